"""The KV cache a :class:`~spectoolkit.models.cached.CachedModel` runs on, per precision (DESIGN §2).

Keys/values stored in a cast dtype or a per-token quantized format. Here, above the kernels, and not
in :mod:`spectoolkit.kvcache` (the formats, which the attention kernel reads): the quantized layers run
that kernel. :func:`make_kv_cache` picks one layer class per precision, once. Every layer keeps the positional
contract of :class:`~spectoolkit.kvcache.cache.PositionalKVLayer`: position ``i`` lives in slot ``i``,
a token is converted (cast or quantized, :mod:`spectoolkit.kvcache.formats`) exactly once when it is
written, and rollback only lowers ``length`` — kept slots are never touched again, so a rolled-back
cache is bit-identical to one that never saw the rejected tokens.

Reads return slots [0, end) converted back to the compute dtype of the incoming states. For the
quantized formats this dequantizes the whole valid prefix on every call: the plain-torch reference
path. On CUDA with Triton (:func:`~spectoolkit.kernels.runtime.kernels_usable`), chosen once when a
layer first allocates, a quantized layer instead returns :class:`~.stored_kv.StoredKV` stand-ins and
the attention functions of :mod:`spectoolkit.models.attention` run :meth:`QuantizedKVLayer.attend`,
the Triton kernel of :mod:`spectoolkit.kernels.kv_attention`, on the stored codes.
"""

from __future__ import annotations

from functools import partial

import torch

from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels.runtime import kernels_usable
from spectoolkit.kvcache.cache import PositionalKVCache, PositionalKVLayer
from spectoolkit.kvcache.formats import CAST_DTYPES, KV_FORMATS, KVFormat
from spectoolkit.models.stored_kv import StoredKV
from spectoolkit.precisions import KV_PRECISIONS


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

    ``attend_from_codes``: reads return :class:`StoredKV` stand-ins and attention runs :meth:`attend` on
    the codes. ``None`` (the default) decides once, at the first write: on CUDA where the kernel runs
    (Triton present, head_dim supported); dequantize + SDPA elsewhere.
    """

    def __init__(self, fmt: KVFormat, attend_from_codes: bool | None = None) -> None:
        super().__init__()
        self.format = fmt
        self.attend_from_codes = attend_from_codes
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
        self._head_dim = key_states.shape[-1]
        if self.attend_from_codes is None:
            self.attend_from_codes = _kernel_runs(key_states.device, self._head_dim, self.format.name)

    def _write(self, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        end = start + key_states.shape[-2]
        for kind, states in (("key", key_states), ("value", value_states)):
            for field, stored in self.format.quantize(states).items():  # [B, H_kv, n, width]
                getattr(self, f"_{kind}_{field}")[:, :, start:end] = stored

    def _read(self, end: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        if self.attend_from_codes:
            shape = (*self._key_data.shape[:2], end, self._head_dim)  # [B, H_kv, end, D]
            return StoredKV(self, "key", shape, dtype), StoredKV(self, "value", shape, dtype)
        return self.dequantized("key", end, dtype), self.dequantized("value", end, dtype)

    def dequantized(self, kind: str, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Slots [0, end) of ``kind`` ("key"/"value") dequantized: [B, H_kv, end, D] in ``dtype``."""
        return self.format.dequantize(self._stored(kind, end), dtype)

    def valid(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The committed keys and values [B, H_kv, length, D], dequantized (on either path)."""
        keys = self.dequantized("key", self.length, self._compute_dtype)  # [B, H_kv, length, D]
        return keys, self.dequantized("value", self.length, self._compute_dtype)

    def attend(
        self,
        query: torch.Tensor,
        scaling: float | None = None,
        key_mask: torch.Tensor | None = None,
        end: int | None = None,
    ) -> torch.Tensor:
        """Attention of the window query [B, H, Q, D] at slots [end-Q, end) over slots [0, end), causally.

        Runs the Triton kernel on the stored codes (never dequantizing the history); ``end`` defaults
        to ``length``; ``key_mask`` bool [B|1, Q, >= end] may further restrict keys (padding).
        Returns [B, H, Q, D] in the query's dtype. Needs CUDA, or the CPU interpreter in tests.
        """
        from spectoolkit.kernels.kv_attention import kv_attention  # lazy: decorating kernels needs CUDA

        end = self.length if end is None else end
        keys, values = self._stored("key", end), self._stored("value", end)
        prefix = end - query.shape[2]
        return kv_attention(query, keys, values, self.format.name, prefix, scaling, key_mask=key_mask)

    def _stored(self, kind: str, end: int) -> dict[str, torch.Tensor]:
        return {field: getattr(self, f"_{kind}_{field}")[:, :, :end] for field in self._fields}


def _kernel_runs(device: torch.device, head_dim: int, fmt: str) -> bool:
    """Whether attention over this layer runs the Triton kernel: CUDA, Triton, a head_dim and format it takes."""
    if not kernels_usable(device):
        return False
    from spectoolkit.kernels.kv_attention import kernel_supports  # only on CUDA: importing decorates kernels

    return kernel_supports(head_dim, fmt, device)


def make_kv_cache(num_layers: int, precision: str) -> PositionalKVCache:
    """A positional KV cache for ``num_layers`` attention layers storing KV at ``precision``.

    ``auto``: the model's own dtype, no conversion; ``fp32``/``bf16``/``fp16``: stored in that dtype;
    ``fp8``/``int8``/``int4``: quantized per token (:mod:`spectoolkit.kvcache.formats`). Reads always
    come back in the dtype of the states the model writes.
    """
    if precision == "auto":
        return PositionalKVCache(num_layers)
    if precision in CAST_DTYPES:
        return PositionalKVCache(num_layers, partial(CastKVLayer, CAST_DTYPES[precision]))
    if precision in KV_FORMATS:
        return PositionalKVCache(num_layers, partial(QuantizedKVLayer, KV_FORMATS[precision]))
    raise SpecToolkitError(f"unknown KV precision {precision!r}; choose one of {', '.join(KV_PRECISIONS)}")
