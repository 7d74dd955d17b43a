"""Attention over a strided KV cache without ``repeat_kv``: GQA query heads packed as extra rows.

transformers' SDPA path copies every key/value head ``n_rep`` times (``repeat_kv``) whenever a
mask is present — i.e. for every multi-token verify forward over a cache — which costs O(context)
per layer per round. Here each KV group's ``n_rep`` query heads become ``n_rep × q`` query rows of
one SDPA call, and the mask rows are repeated instead: identical math, no KV copy.

Registered with transformers' ``AttentionInterface`` under :data:`ATTN_NAME`; the reference is
transformers' own ``sdpa`` implementation, and a test compares logits of the two.

:func:`rowwise_gqa_attention` (:data:`ROWWISE_ATTN_NAME`) is the batch-invariant variant: a q-token
call computes each query row with exactly the kernel call of a decode step at that position (one
packed query against the keys up to it), so a k-token verify forward gives the same attention
output as k decode steps, bit for bit. fp32 SDPA for 1 and k queries differ by ~1e-7, which is
harmless in float models but becomes whole quantization steps once a quantized linear rounds the
activations (see :mod:`spectoolkit.quant.bnb`); it costs k small SDPA calls instead of one.

Keys/values that are :class:`~spectoolkit.models.stored_kv.StoredKV` stand-ins (a quantized KV layer on
CUDA) are attended by the layer's Triton kernel on the stored codes for decode steps and verify
windows; prefills, training and masks the kernel does not take dequantize them and run SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spectoolkit.models.stored_kv import StoredKV

ATTN_NAME = "spectoolkit_sdpa"
# Calls with at most this many query rows (verify windows up to γ = 32) run row by row; longer
# calls are prefills, which the baseline and speculative arms make identically, so they keep the
# fast path. (Chat-templated prompts are longer than this; a γ > 32 verify on a bitsandbytes
# target is exact only up to kernel rounding.)
MAX_ROWWISE_ROWS = 33
ROWWISE_ATTN_NAME = "spectoolkit_rowwise"


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
    if isinstance(key, StoredKV):
        out = _attend_stored(module, query, key, value, attention_mask, scaling)
        if out is not None:
            return out, None
        key, value = key.materialize(), value.materialize()  # [B, Hkv, L, D]
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


def _attend_stored(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: StoredKV,
    value: StoredKV,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
) -> torch.Tensor | None:
    """[B, q, Hq, D] from the layer's kernel on its stored codes, or None where the kernel does not apply."""
    q_len, kv_len = query.shape[2], key.shape[2]
    if module.training or q_len > MAX_ROWWISE_ROWS or value.layer is not key.layer or value.end != key.end:
        return None  # a prefill would compile a kernel per prompt length; dequantizing once is as cheap
    key_mask = None
    if attention_mask is not None:
        shape_ok = attention_mask.dim() == 4 and attention_mask.shape[1] == 1 and attention_mask.shape[2] == q_len
        if attention_mask.dtype != torch.bool or not shape_ok or attention_mask.shape[-1] < kv_len:
            return None
        key_mask = attention_mask[:, 0, :, -kv_len:]  # [B|1, q, L]
    out = key.layer.attend(query, scaling, key_mask, end=kv_len)  # [B, Hq, q, D]
    return out.transpose(1, 2).contiguous()


def rowwise_gqa_attention(
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
    """:func:`packed_gqa_attention` one query row at a time; shapes as there.

    Query i (absolute position ``kv_len - q_len + i``) gets the decode-step call: keys/values
    ``[:, :, :pos+1]`` and no mask when the mask only encodes causality (what a decode step gets).
    """
    q_len, kv_len = query.shape[2], key.shape[2]
    if q_len == 1 or q_len > MAX_ROWWISE_ROWS:  # decode step, or a prefill (both arms make the same call)
        return packed_gqa_attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    row_masks = _row_masks(attention_mask, q_len, kv_len)
    rows = []
    for i in range(q_len):
        end = kv_len - q_len + i + 1
        row_mask, index = row_masks[i], _visible_slots(row_masks[i])
        if index is None:
            row_keys, row_values = _prefix(key, end), _prefix(value, end)  # [B, Hkv, end, D]
        else:  # a tree row: exactly the slots it sees, in order, as a decode step over prefix + path has them
            row_keys, row_values, row_mask = _gather(key, index), _gather(value, index), None
        row, _ = packed_gqa_attention(
            module, query[:, :, i : i + 1], row_keys, row_values, row_mask, dropout, scaling, **kwargs
        )  # [B, 1, Hq, D]
        rows.append(row)
    return torch.cat(rows, dim=1), None  # [B, q, Hq, D]


def _visible_slots(row_mask: torch.Tensor | None) -> torch.Tensor | None:
    """The slot indices a batch-1 boolean row mask [1, 1, 1, n] lets through when they are not all n; else None."""
    if row_mask is None or row_mask.shape[0] != 1 or row_mask.dtype != torch.bool or bool(row_mask.all()):
        return None
    return torch.nonzero(row_mask.reshape(-1)).flatten()  # [m] ascending


def _gather(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """states [B, Hkv, L, D] -> slots ``index`` [m] in order, contiguous (a stand-in is dequantized first)."""
    if isinstance(states, StoredKV):
        states = states.materialize()
    return states.index_select(2, index.to(states.device))


def _prefix(states: torch.Tensor, end: int) -> torch.Tensor:
    """states [B, Hkv, L, D] -> slots [0, end) (a stand-in stays one: slicing it would dequantize)."""
    return states.truncated(end) if isinstance(states, StoredKV) else states[:, :, :end]


def _row_masks(attention_mask: torch.Tensor | None, q_len: int, kv_len: int) -> list[torch.Tensor | None]:
    """Per-row masks [B|1, 1, 1, pos+1] for a [B|1, 1, q, L] mask; all None if it is purely causal."""
    if attention_mask is None:
        return [None] * q_len
    mask = attention_mask[..., -kv_len:]
    causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=mask.device).tril(kv_len - q_len)
    if mask.dtype == torch.bool and bool((mask == causal).all()):
        return [None] * q_len  # batch 1 without padding (CachedModel): exactly the decode-step call
    return [mask[..., i : i + 1, : kv_len - q_len + i + 1] for i in range(q_len)]


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch an SDPA transformers model to :func:`packed_gqa_attention`; False if not applicable.

    Only a model on transformers' plain ``sdpa`` is switched, so a model already on
    :func:`rowwise_gqa_attention` keeps it.
    """
    return _switch_attention(model, ATTN_NAME, packed_gqa_attention, replaces=("sdpa",))


def use_rowwise_attention(model: torch.nn.Module) -> bool:
    """Switch an SDPA (or packed) transformers model to :func:`rowwise_gqa_attention`; False if not applicable."""
    return _switch_attention(model, ROWWISE_ATTN_NAME, rowwise_gqa_attention, replaces=("sdpa", ATTN_NAME))


def _switch_attention(model: torch.nn.Module, name: str, function, replaces: tuple[str, ...]) -> bool:
    """Register ``function`` as ``name`` and switch ``model`` to it if it is on one of ``replaces``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if getattr(model.config, "_attn_implementation", None) not in replaces:
        return False
    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(name)
    return model.config._attn_implementation == name
