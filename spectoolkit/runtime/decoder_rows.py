"""One step of a decoder over the paged pool on our kernels: the body the eager runner runs op by op and the
compiled runner hands to ``torch.compile`` — the same code, so the two give the same bits (DESIGN §7)."""

from __future__ import annotations

import torch

from spectoolkit.models.static_decoder import StaticDecoder
from spectoolkit.runtime.attention import kernel_attention
from spectoolkit.runtime.paged_kv import PagedKVPool


def decoder_rows(
    dec: StaticDecoder, pool: PagedKVPool, stores: list[tuple[torch.Tensor, ...]], ids: torch.Tensor,
    cos: torch.Tensor, sin: torch.Tensor, write: torch.Tensor, key_slots: torch.Tensor, starts: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """ids/write [W], cos/sin [W, D] (the rows' rotary rows), key_slots [N] with row i's slots at
    [starts[i], starts[i+1]) -> final hidden states [W, E]; row i's keys/values are stored at write[i] (-1: not)."""
    hidden = dec.embed(ids)  # [W, E]
    for layer, layer_stores in zip(dec.layers, stores, strict=True):
        attn = layer.self_attn
        q, k, v = dec.qkv(attn, dec.rms_norm(layer.input_layernorm, hidden), cos, sin)  # [W, Hq|Hkv, D] fp32
        out = kernel_attention(pool, layer_stores, q, k, v, write, key_slots, starts, dec.scale, dec.isa)
        hidden = hidden + attn.o_proj(out.to(hidden.dtype).reshape(out.shape[0], -1))
        hidden = hidden + dec.mlp(layer.mlp, dec.rms_norm(layer.post_attention_layernorm, hidden))
    return dec.rms_norm(dec.norm, hidden)
