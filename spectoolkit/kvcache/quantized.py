"""KV-cache precision: keys/values stored in a cast dtype or a per-token quantized format (DESIGN §2).

:func:`make_kv_cache` picks one layer class per precision, once. Every layer keeps the positional
contract of :class:`~spectoolkit.kvcache.cache.PositionalKVLayer`: position ``i`` lives in slot ``i``,
a token is converted (cast or quantized, :mod:`spectoolkit.kvcache.formats`) exactly once when it is
written, and rollback only lowers ``length`` — kept slots are never touched again, so a rolled-back
cache is bit-identical to one that never saw the rejected tokens.

Reads return slots [0, end) converted back to the compute dtype of the incoming states. For the
quantized formats this dequantizes the whole valid prefix on every call: the plain-torch reference
path; a fused kernel attends over the stored codes directly (layouts in :mod:`.formats`).
"""

from __future__ import annotations

from functools import partial

import torch

from spectoolkit.errors import SpecToolkitError
from spectoolkit.kvcache.cache import PositionalKVCache, PositionalKVLayer
from spectoolkit.kvcache.formats import KV_FORMATS, KVFormat

KV_PRECISIONS = ("auto", "fp32", "bf16", "fp16", "fp8", "int8", "int4")
_CAST_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


class _ConvertingKVLayer(PositionalKVLayer):
    """A layer whose reads are fresh tensors: they are not kept after ``update`` returns.

    Holding them in ``self.keys``/``self.values`` would keep a full-precision copy of every layer's
    history alive at once and hide the memory saving of the compact storage.
    """

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, *args, **kwargs)  # [B, H_kv, end, D]
        self.keys = self.values = None
        return keys, values


class CastKVLayer(_ConvertingKVLayer):
    """Buffers [B, H_kv, capacity, D] in ``storage_dtype`` (cast on write); reads are in the compute dtype."""

    def __init__(self, storage_dtype: torch.dtype) -> None:
        super().__init__()
        self.storage_dtype = storage_dtype

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        batch, heads, _, dim = key_states.shape
        self._key_buf = key_states.new_empty((batch, heads, capacity, dim), dtype=self.storage_dtype)
        self._value_buf = value_states.new_empty((batch, heads, capacity, dim), dtype=self.storage_dtype)

    def _read(self, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self._key_buf[:, :, :end].to(dtype), self._value_buf[:, :, :end].to(dtype)


class QuantizedKVLayer(_ConvertingKVLayer):
    """Keys and values quantized per (token, kv-head) on write, in the fields of ``fmt``.

    Buffers are ``_{key,value}_{field}`` with the layouts of :mod:`spectoolkit.kvcache.formats`, e.g.
    int4: ``_key_data`` uint8 [B, H_kv, capacity, D/2], ``_key_scale``/``_key_zero`` fp32
    [B, H_kv, capacity, D/32]. :meth:`storage` returns them for the valid slots.
    """

    def __init__(self, fmt: KVFormat) -> None:
        super().__init__()
        self.format = fmt
        self._fields: tuple[str, ...] = ()
        self._buffer_names = ()

    def _allocate(self, key_states: torch.Tensor, value_states: torch.Tensor, capacity: int) -> None:
        fields = self.format.fields(key_states.shape[-1])
        for kind, states in (("key", key_states), ("value", value_states)):
            batch, heads = states.shape[:2]
            for field, (width, dtype) in fields.items():
                buf = torch.empty(batch, heads, capacity, width, dtype=dtype, device=states.device)
                setattr(self, f"_{kind}_{field}", buf)
        self._fields = tuple(fields)
        self._buffer_names = tuple(f"_{kind}_{field}" for kind in ("key", "value") for field in fields)

    def _write(self, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        end = start + key_states.shape[-2]
        for kind, states in (("key", key_states), ("value", value_states)):
            for field, stored in self.format.quantize(states).items():  # [B, H_kv, n, width]
                getattr(self, f"_{kind}_{field}")[:, :, start:end] = stored

    def _read(self, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        keys = self.format.dequantize(self._stored("key", end), dtype)  # [B, H_kv, end, D]
        values = self.format.dequantize(self._stored("value", end), dtype)
        return keys, values

    def _stored(self, kind: str, end: int) -> dict[str, torch.Tensor]:
        return {field: getattr(self, f"_{kind}_{field}")[:, :, :end] for field in self._fields}


def make_kv_cache(num_layers: int, precision: str) -> PositionalKVCache:
    """A positional KV cache for ``num_layers`` attention layers storing KV at ``precision``.

    ``auto``: the model's own dtype, no conversion; ``fp32``/``bf16``/``fp16``: stored in that dtype;
    ``fp8``/``int8``/``int4``: quantized per token (:mod:`spectoolkit.kvcache.formats`). Reads always
    come back in the dtype of the states the model writes.
    """
    if precision == "auto":
        return PositionalKVCache(num_layers)
    if precision in _CAST_DTYPES:
        return PositionalKVCache(num_layers, partial(CastKVLayer, _CAST_DTYPES[precision]))
    if precision in KV_FORMATS:
        return PositionalKVCache(num_layers, partial(QuantizedKVLayer, KV_FORMATS[precision]))
    raise SpecToolkitError(f"unknown KV precision {precision!r}; choose one of {', '.join(KV_PRECISIONS)}")
