"""Tolerant reading of JSON into typed dataclasses: a wrong-typed or missing field becomes its default.

Results files outlive the code that wrote them (older schema versions, a run killed mid-write, a
hand-edited summary), so reading one never raises: :func:`from_mapping` fills a dataclass field by
field from its annotation, and a value of the wrong type is replaced by the field's default (None
for a field without one). Unknown keys are ignored.

Annotations understood: ``int``, ``float`` (finite; an int is accepted), ``str``, ``bool``, ``Any``,
``X | None``, ``list[X]`` (wrong-typed items dropped), ``dict[str, X]`` and ``dict[int, X]`` (JSON
str keys of digits accepted), and nested dataclasses (a dataclass inside a dict is kept, empty,
when its value is not an object; inside a list it is dropped), read through the class's own
``from_dict`` where it has one (to accept legacy shapes).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, TypeVar

T = TypeVar("T")
_MISSING = object()  # a value that could not be read as the annotated type


def num(value: Any) -> float | None:
    """``value`` as a finite float, else None (bools, strings and NaN are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value) if math.isfinite(value) else None


def as_int(value: Any) -> int | None:
    """``value`` as an int (an integral float included), else None; bools are not ints here."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    return int(value) if isinstance(value, float) and value.is_integer() else None


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _read(kind: Any, value: Any) -> Any:
    """``value`` read as annotation ``kind``, or _MISSING."""
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if kind is Any:
        return value
    if origin in (types.UnionType, typing.Union):  # X | None
        return None if value is None else _read(next(a for a in args if a is not type(None)), value)
    if dataclasses.is_dataclass(kind):
        return _nested(kind, value) if isinstance(value, dict) else _MISSING
    if origin is list:
        if not isinstance(value, list):
            return _MISSING
        items = (_read(args[0], item) for item in value)
        return [item for item in items if item is not _MISSING]
    if origin is dict:
        return _read_dict(args[0], args[1], value)
    return _read_scalar(kind, value)


def _read_dict(key_kind: Any, value_kind: Any, value: Any) -> Any:
    if not isinstance(value, dict):
        return _MISSING
    out = {}
    for key, item in value.items():
        if key_kind is int:
            key = as_int(key) if not isinstance(key, str) else (int(key) if key.isdigit() else None)
            if key is None:
                continue
        if dataclasses.is_dataclass(value_kind):  # keep the key: the entry exists, its content is unreadable
            out[key] = _nested(value_kind, item)
            continue
        read = _read(value_kind, item)
        if read is _MISSING and key_kind is int:
            continue
        out[key] = None if read is _MISSING else read
    return out


def _nested(kind: type, value: Any) -> Any:
    """A nested dataclass through its own ``from_dict`` when it has one (legacy shapes), else field by field."""
    reader = getattr(kind, "from_dict", None)
    return reader(value) if reader else from_mapping(kind, value)


def _read_scalar(kind: Any, value: Any) -> Any:
    if kind is float:
        read = num(value)
    elif kind is int:
        read = as_int(value)
    elif kind is bool:
        read = value if isinstance(value, bool) else None
    elif kind is str:
        read = value if isinstance(value, str) else None
    else:
        read = value if isinstance(value, kind) else None
    return _MISSING if read is None else read


def from_mapping(cls: type[T], raw: Any) -> T:
    """An instance of dataclass ``cls`` from the JSON object ``raw``, field by field (never raises)."""
    raw = raw if isinstance(raw, dict) else {}
    hints = _field_types(cls)
    values = {}
    for field in dataclasses.fields(cls):
        read = _read(hints[field.name], raw[field.name]) if field.name in raw else _MISSING
        values[field.name] = _default(field) if read is _MISSING else read
    return cls(**values)
