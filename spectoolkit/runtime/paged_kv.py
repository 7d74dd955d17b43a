"""Paged KV storage: every layer's keys and values in one pool of slots, in any KV precision.

Per layer and kind (key/value), each stored field is a tensor [H_kv, num_slots, width]: the model's
dtype (``auto``), a cast dtype (fp32/bf16/fp16), or the per-token quantized fields of
:mod:`spectoolkit.kvcache.formats` (fp8/int8/int4). A token is converted once, when it is written to
its slot (DESIGN §2); slots are addressed by :class:`~spectoolkit.runtime.blocks.BlockTable`. Rolling
a sequence back writes nothing: its rejected slots are simply written over by its next tokens, so a
sequence's KV is bit-identical to one that never saw them. Pages of the pool are touched only when
written (``torch.empty``), so a large pool costs memory only for the slots in use.
"""

from __future__ import annotations

import torch

from spectoolkit.errors import SpecToolkitError
from spectoolkit.kvcache.formats import CAST_DTYPES, KV_FORMATS
from spectoolkit.precisions import KV_PRECISIONS

KINDS = ("key", "value")


class PagedKVPool:
    """Slots [0, num_slots) of ``num_layers`` layers, each [H_kv, num_slots, D] per kind (or its fields)."""

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_slots: int,
        precision: str,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        if precision not in KV_PRECISIONS:
            raise SpecToolkitError(f"unknown KV precision {precision!r}; choose one of {', '.join(KV_PRECISIONS)}")
        self.precision = precision
        self.compute_dtype = compute_dtype
        self.num_slots = num_slots
        self.format = KV_FORMATS.get(precision)
        if self.format is not None:
            fields = self.format.fields(head_dim)
        else:
            fields = {"data": (head_dim, CAST_DTYPES.get(precision, compute_dtype))}
        self.fields = tuple(fields)
        self.layers: list[dict[str, dict[str, torch.Tensor]]] = [
            {
                kind: {
                    name: torch.empty(num_kv_heads, num_slots, width, dtype=dtype, device=device)
                    for name, (width, dtype) in fields.items()
                }
                for kind in KINDS
            }
            for _ in range(num_layers)
        ]  # layer -> kind -> field -> [H_kv, num_slots, width]

        # Stored as computed (auto, or a cast to the compute dtype): reads are views, writes plain copies.
        self.as_computed = self.format is None and fields["data"][1] == compute_dtype
        self._slot_bytes = sum(buf[:, :1].numel() * buf.element_size() for layer in self.layers
                               for kind in layer.values() for buf in kind.values())  # fmt: skip

    def write(self, layer: int, slots: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store keys/values [H_kv, n, D] at ``slots`` [n] (long) of ``layer``."""
        if self.as_computed:  # the decode-step path: no conversion
            self.layers[layer]["key"]["data"].index_copy_(1, slots, keys)
            self.layers[layer]["value"]["data"].index_copy_(1, slots, values)
            return
        for kind, states in zip(KINDS, (keys, values), strict=True):
            for name, stored in self._encode(states).items():  # [H_kv, n, width]
                _bits(self.layers[layer][kind][name]).index_copy_(1, slots, _bits(stored))

    def move(self, sources: list[int], targets: list[int]) -> None:
        """Copy the stored bytes of slots ``sources`` to ``targets`` in every layer (a token tree's accepted
        path moved next to its prefix): nothing is re-encoded, so a moved slot reads back bit for bit."""
        if sources == targets or not sources:
            return
        device = self.layers[0]["key"][self.fields[0]].device
        src = torch.tensor(sources, dtype=torch.long, device=device)
        dst = torch.tensor(targets, dtype=torch.long, device=device)
        for layer in self.layers:
            for kind in layer.values():
                for buf in kind.values():  # [H_kv, num_slots, width]
                    bits = _bits(buf)
                    bits.index_copy_(1, dst, bits.index_select(1, src))

    def gather(self, layer: int, kind: str, slots: torch.Tensor) -> torch.Tensor:
        """States [H_kv, n, D] in the compute dtype of ``slots`` [n] (long): a copy."""
        return self._decode(self.stored(layer, kind, slots))

    def span(self, layer: int, kind: str, start: int, end: int) -> torch.Tensor:
        """States [H_kv, end-start, D] of consecutive slots [start, end): a view when stored as computed."""
        if self.as_computed:
            return self.layers[layer][kind]["data"][:, start:end]
        stored = {name: buf[:, start:end] for name, buf in self.layers[layer][kind].items()}
        return self._decode(stored)

    def _encode(self, states: torch.Tensor) -> dict[str, torch.Tensor]:
        if self.format is not None:
            return self.format.quantize(states)
        return {"data": states.to(self.layers[0]["key"]["data"].dtype)}

    def _decode(self, stored: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.format is not None:
            return self.format.dequantize(stored, self.compute_dtype)
        return stored["data"].to(self.compute_dtype)  # a no-op (the same tensor) when no cast is needed

    def slot_bytes(self) -> int:
        """Bytes one slot takes over all layers, keys and values (the buffers never change shape: counted once)."""
        return self._slot_bytes

    def stored(self, layer: int, kind: str, slots: torch.Tensor) -> dict[str, torch.Tensor]:
        """The raw stored fields [H_kv, n, width] of ``slots`` (for bit-exact comparisons in tests)."""
        return {
            name: _bits(buf).index_select(1, slots).view(buf.dtype) for name, buf in self.layers[layer][kind].items()
        }


def make_pool(model: torch.nn.Module, precision: str, num_slots: int) -> PagedKVPool:
    """A paged pool shaped for ``model``'s attention layers, storing KV at ``precision``."""
    config = model.config.get_text_config()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    parameter = next(model.parameters())
    dtype = model.get_input_embeddings().weight.dtype
    compute = dtype if dtype.is_floating_point else torch.float32
    return PagedKVPool(config.num_hidden_layers, config.num_key_value_heads, head_dim, num_slots, precision,
                       compute, parameter.device)  # fmt: skip


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as raw bytes where torch's CPU index kernels lack its dtype (float8), else itself."""
    return tensor.view(torch.uint8) if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else tensor
