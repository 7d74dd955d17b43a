"""Attention over a strided KV cache without ``repeat_kv``: GQA query heads packed as extra rows.

transformers' SDPA path copies every key/value head ``n_rep`` times (``repeat_kv``) whenever a
mask is present — i.e. for every multi-token verify forward over a cache — which costs O(context)
per layer per round. Here each KV group's ``n_rep`` query heads become ``n_rep × q`` query rows of
one SDPA call, and the mask rows are repeated instead: identical math, no KV copy.

Registered with transformers' ``AttentionInterface`` under :data:`ATTN_NAME`; the reference is
transformers' own ``sdpa`` implementation, and a test compares logits of the two.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ATTN_NAME = "spectoolkit_sdpa"


def packed_gqa_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [B, Hq, q, D], key/value [B, Hkv, L, D], mask [B|1, 1, q, L] or None -> ([B, q, Hq, D], None)."""
    batch, num_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    rep = num_heads // kv_heads
    packed = query.reshape(batch, kv_heads, rep * q_len, head_dim)  # rows ordered (head-in-group, position)
    mask = attention_mask
    if mask is not None:
        mask = mask[..., -kv_len:].repeat(1, 1, rep, 1)  # [B|1, 1, rep*q, L]
    elif q_len > 1:
        # Query i sits at absolute position kv_len - q_len + i and sees keys up to it.
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        mask = causal.repeat(rep, 1)  # [rep*q, L]
    out = F.scaled_dot_product_attention(
        packed, key, value, attn_mask=mask, dropout_p=dropout if module.training else 0.0, scale=scaling
    )  # [B, Hkv, rep*q, D]
    return out.reshape(batch, num_heads, q_len, head_dim).transpose(1, 2).contiguous(), None


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch an SDPA transformers model to :func:`packed_gqa_attention`; False if not applicable."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) != "sdpa":
        return False
    AttentionInterface.register(ATTN_NAME, packed_gqa_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)
    model.set_attn_implementation(ATTN_NAME)
    return model.config._attn_implementation == ATTN_NAME
