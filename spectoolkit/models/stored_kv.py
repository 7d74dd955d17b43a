"""Keys/values that stay in their quantized buffers: the stand-in a cache layer returns on the kernel path.

On CUDA, :class:`~spectoolkit.models.kv_cache.QuantizedKVLayer` returns :class:`StoredKV` from
``update`` instead of dequantizing its whole history every step. An attention function that knows it
(:mod:`spectoolkit.models.attention`) calls the layer's Triton kernel on the stored codes; any other
torch op sees the dequantized tensor, built on demand by the reference path of
:mod:`spectoolkit.kvcache.formats`. Code unaware of the stand-in stays correct, only slower.

A stand-in reads the layer when it is used: it is valid within the forward that produced it (the
layer may be rolled back and overwritten afterwards), which is all transformers asks of ``update``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch.utils._pytree import tree_map_only

if TYPE_CHECKING:
    from spectoolkit.models.kv_cache import QuantizedKVLayer

# Ops answered from the stand-in's own (expanded, storage-free) metadata: no dequantization.
_METADATA = {
    torch.Tensor.shape.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__,
    torch.Tensor.ndim.__get__,
    torch.Tensor.is_cuda.__get__,
    torch.Tensor.requires_grad.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
}


class StoredKV(torch.Tensor):
    """Stand-in for keys or values [B, H_kv, end, D] (in the compute dtype) of slots [0, end) of ``layer``."""

    layer: QuantizedKVLayer
    kind: str  # "key" or "value"
    end: int

    @staticmethod
    def __new__(cls, layer: QuantizedKVLayer, kind: str, shape: tuple[int, int, int, int], dtype: torch.dtype):
        base = torch.empty((), dtype=dtype, device=layer.device).expand(shape)  # no storage behind the shape
        stand_in = torch.Tensor._make_subclass(cls, base)
        stand_in.layer, stand_in.kind, stand_in.end = layer, kind, shape[2]
        return stand_in

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = tree_map_only(StoredKV, StoredKV.materialize, (args, kwargs))
        return func(*args, **kwargs)

    def materialize(self) -> torch.Tensor:
        """The dequantized keys or values [B, H_kv, end, D] (the reference path)."""
        with torch._C.DisableTorchFunctionSubclass():
            dtype = self.dtype
        return self.layer.dequantized(self.kind, self.end, dtype)

    def truncated(self, end: int) -> StoredKV:
        """The stand-in for slots [0, end) of the same layer (slicing would dequantize)."""
        with torch._C.DisableTorchFunctionSubclass():
            batch, heads, _, dim = self.shape
            dtype = self.dtype
        return StoredKV(self.layer, self.kind, (batch, heads, end, dim), dtype)
