"""One forward over the flattened tokens of many sequences: explicit positions, paged KV, per-sequence masks.

Each sequence contributes a *segment*: the tokens it feeds this step (a pending token and its drafts,
or a prefill chunk) at positions [start, start+q). The HF model runs once on all T tokens as a
[1, T] batch with explicit ``position_ids`` (rotary embeddings per token); its linears see T rows at
once, which is where batching pays. Attention is ours, registered with transformers'
``AttentionInterface``: inside :func:`ragged_forward` each layer writes its new keys/values to the
sequences' slots of a :class:`~spectoolkit.serving.paged_kv.PagedKVPool`, gathers every sequence's
keys [0, start+q) and attends causally within its own sequence only.

Two attention modes:

- **padded** (default): the B sequences padded to one [B, H, q_max, C_max] SDPA call per layer with a
  boolean mask (query r of a sequence sees its keys at positions <= start + r). One call per layer;
  a row's result may depend on the padding (the batch composition) by a last bit.
- **invariant** (``serve.batch_invariant``): every query row is one decode-step call — one query
  against its sequence's keys [0, pos] in a contiguous tensor — so its result cannot depend on which
  other rows share the step; linears run their fixed-chunk kernel for every row count
  (:data:`~spectoolkit.models.kernel_choice.ROW_MODE`).

Outside :func:`ragged_forward` the registered function delegates to the attention the model had, so
the same model object keeps working with :class:`~spectoolkit.models.cached.CachedModel`.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from spectoolkit.models.kernel_choice import ROW_MODE
from spectoolkit.serving.blocks import BlockTable
from spectoolkit.serving.paged_kv import PagedKVPool

RAGGED_ATTN_NAME = "spectoolkit_ragged"


@dataclass
class Segment:
    """What one sequence feeds in a step."""

    table: BlockTable  # its blocks (already covering [0, start + len(token_ids)))
    token_ids: list[int]  # [q] tokens at positions [start, start + q)
    start: int  # positions below this have KV
    logit_rows: list[int]  # indices into token_ids whose next-token logits are wanted
    tree: tuple[list[int], torch.Tensor] | None = None  # a token tree's (positions [q], visible [q, start+q])

    def positions(self) -> list[int]:
        """Rotary position of each row: start + index (a chain) or as the tree gives them (start + depth)."""
        return list(range(self.start, self.start + len(self.token_ids))) if self.tree is None else self.tree[0]

    def visible(self) -> torch.Tensor | None:
        """[q, start+q] bool for a tree (the prefix, the row's ancestors and itself), None for a chain."""
        return None if self.tree is None else self.tree[1]


def tree_layout(row_parents: list[int], start: int) -> tuple[list[int], torch.Tensor]:
    """(positions, visible) of rows fed at positions [start, start+q) that form a tree: ``row_parents[r]`` is the
    row row r hangs from (-1: directly after the prefix [0, start))."""
    q = len(row_parents)
    visible = torch.zeros(q, start + q, dtype=torch.bool)
    visible[:, :start] = True
    depths: list[int] = []
    for row, parent in enumerate(row_parents):
        if parent >= 0:
            visible[row] |= visible[parent]
        visible[row, start + row] = True
        depths.append(0 if parent < 0 else depths[parent] + 1)
    return [start + depth for depth in depths], visible


@dataclass
class _Layout:
    """The tensors every layer of one ragged forward shares (B sequences, T tokens)."""

    pool: PagedKVPool
    invariant: bool
    write_slots: torch.Tensor  # [T] long: pool slot of each new token
    starts: list[int]  # [B] first new position of each sequence
    lengths: list[int]  # [B] new tokens of each sequence (q_b)
    offsets: list[int]  # [B] row of each sequence's first token in the flattened T
    context: list[int]  # [B] keys after the write: start + q
    key_slots: list[torch.Tensor]  # [B] of [context_b] long: the slots of positions [0, context_b)
    spans: list[int | None]  # [B] first slot of a lone sequence whose keys are consecutive slots, else None
    visible: list[torch.Tensor | None]  # [B] a tree segment's [q_b, context_b] mask, None for a chain
    padded: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None  # see _pad


_STEP: ContextVar[_Layout | None] = ContextVar("spectoolkit_ragged_step", default=None)


def build_layout(pool: PagedKVPool, segments: list[Segment], invariant: bool, device: torch.device) -> _Layout:
    """The layout of ``segments`` over ``pool``."""
    write, starts, lengths, offsets, context, key_slots, spans = [], [], [], [], [], [], []
    offset = 0
    for segment in segments:
        q = len(segment.token_ids)
        end = segment.start + q
        write.extend(segment.table.slots(segment.start, end))
        starts.append(segment.start)
        lengths.append(q)
        offsets.append(offset)
        context.append(end)
        span = segment.table.contiguous(end) if not invariant and len(segments) == 1 else None
        spans.append(span)
        slots = segment.table.slots(0, end) if span is None else []  # a slice needs no slot list
        key_slots.append(torch.tensor(slots, dtype=torch.long, device=device))
        offset += q
    write_slots = torch.tensor(write, dtype=torch.long, device=device)
    visible = [segment.visible() for segment in segments]
    visible = [None if mask is None else mask.to(device) for mask in visible]
    layout = _Layout(pool, invariant, write_slots, starts, lengths, offsets, context, key_slots, spans, visible, None)
    if not invariant and len(segments) > 1:
        layout.padded = _pad(layout, device)
    return layout


def _pad(layout: _Layout, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(query rows [B*q_max], key slots [B*C_max], mask [B, 1, q_max, C_max], output rows [T]) of the padded call."""
    batch, q_max, c_max = len(layout.lengths), max(layout.lengths), max(layout.context)
    query_rows = torch.zeros(batch, q_max, dtype=torch.long)
    key_slots = torch.zeros(batch, c_max, dtype=torch.long)
    mask = torch.zeros(batch, 1, q_max, c_max, dtype=torch.bool)
    out_rows = []
    for b, (start, q, offset, ctx) in enumerate(
        zip(layout.starts, layout.lengths, layout.offsets, layout.context, strict=True)
    ):
        query_rows[b, :q] = torch.arange(offset, offset + q)
        key_slots[b, :ctx] = layout.key_slots[b].cpu()
        positions = torch.arange(start, start + q)[:, None]  # [q, 1]
        tree = layout.visible[b]
        mask[b, 0, :q, :ctx] = torch.arange(ctx)[None, :] <= positions if tree is None else tree.cpu()
        mask[b, 0, q:, 0] = True  # padded query rows see one key (their output is dropped): no NaN
        out_rows.extend(range(b * q_max, b * q_max + q))
    out = torch.tensor(out_rows, dtype=torch.long)
    return query_rows.flatten().to(device), key_slots.flatten().to(device), mask.to(device), out.to(device)


@torch.inference_mode()
def ragged_forward(model: torch.nn.Module, pool: PagedKVPool, segments: list[Segment], invariant: bool) -> torch.Tensor:
    """Run ``segments`` through ``model`` (switched with :func:`use_ragged_attention`); writes their KV to
    ``pool`` and returns the logits [R, V] of every segment's ``logit_rows``, in segment order."""
    device = pool.layers[0]["key"][pool.fields[0]].device
    layout = build_layout(pool, segments, invariant, device)
    ids = [token for segment in segments for token in segment.token_ids]
    positions = [position for segment in segments for position in segment.positions()]
    rows = [offset + r for segment, offset in zip(segments, layout.offsets, strict=True) for r in segment.logit_rows]
    input_ids = torch.tensor([ids], dtype=torch.long, device=device)  # [1, T]
    position_ids = torch.tensor([positions], dtype=torch.long, device=device)  # [1, T]
    keep = torch.tensor(rows, dtype=torch.long, device=device)  # [R]
    step_token, mode_token = _STEP.set(layout), ROW_MODE.set("invariant" if invariant else "plain")
    try:
        out = model(input_ids=input_ids, position_ids=position_ids, use_cache=False, logits_to_keep=keep)
    finally:
        _STEP.reset(step_token)
        ROW_MODE.reset(mode_token)
    return out.logits[0]  # [R, V]


def _ragged_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """query [1, Hq, T, D], key/value [1, Hkv, T, D] (this step's tokens) -> ([1, T, Hq, D], None)."""
    layout = _STEP.get()
    if layout is None:
        return _fallback(module)(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    layer = module.layer_idx
    layout.pool.write(layer, layout.write_slots, key[0], value[0])
    if layout.padded is not None:
        out = _padded_attention(layout, layer, query[0], scaling)  # [T, Hq, D]
    elif len(layout.lengths) == 1:
        out = _sequence_attention(layout, layer, 0, query[0], scaling)
    else:
        out = torch.cat([_sequence_attention(layout, layer, b, query[0], scaling) for b in range(len(layout.lengths))])
    return out.unsqueeze(0), None


def _keys_values(layout: _Layout, layer: int, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's keys and values [H_kv, context_b, D]: a pool slice when consecutive (not in invariant mode)."""
    span = layout.spans[b]
    if span is not None:
        end = span + layout.context[b]
        return layout.pool.span(layer, "key", span, end), layout.pool.span(layer, "value", span, end)
    slots = layout.key_slots[b]
    return layout.pool.gather(layer, "key", slots), layout.pool.gather(layer, "value", slots)


def _sequence_attention(layout: _Layout, layer: int, b: int, query: torch.Tensor, scaling) -> torch.Tensor:
    """Attention of sequence b's rows of query [Hq, T, D] -> [q_b, Hq, D]."""
    keys, values = _keys_values(layout, layer, b)  # [Hkv, C, D]
    offset, q, start = layout.offsets[b], layout.lengths[b], layout.starts[b]
    rows = query[:, offset : offset + q]  # [Hq, q, D]
    tree = layout.visible[b]  # [q, C] or None
    if layout.invariant and tree is not None:  # each tree row as a decode step over prefix + its path computes it
        picks = [torch.nonzero(tree[r]).flatten() for r in range(q)]
        return torch.cat([_packed(rows[:, r : r + 1], keys.index_select(1, picks[r]), values.index_select(1, picks[r]),
                                  None, scaling) for r in range(q)])  # fmt: skip
    if layout.invariant:  # each row exactly as a decode step computes it
        return torch.cat([_packed(rows[:, r : r + 1], keys[:, : start + r + 1], values[:, : start + r + 1], None,
                                  scaling) for r in range(q)])  # fmt: skip
    mask = tree
    if q > 1 and mask is None:
        mask = torch.ones(q, start + q, dtype=torch.bool, device=query.device).tril(start)  # [q, C]
    return _packed(rows, keys, values, mask, scaling)


def _packed(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, scaling) -> torch.Tensor:
    """rows [Hq, q, D], keys/values [Hkv, C, D], mask [q, C] or None -> [q, Hq, D]; GQA heads packed as rows."""
    heads, q, dim = rows.shape
    kv_heads = keys.shape[0]
    rep = heads // kv_heads
    packed = rows.reshape(1, kv_heads, rep * q, dim)  # rows ordered (head-in-group, position)
    if mask is not None:
        mask = mask.repeat(rep, 1)  # [rep*q, C]
    out = F.scaled_dot_product_attention(packed, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scaling)
    return out.reshape(heads, q, dim).transpose(0, 1)  # [q, Hq, D]


def _padded_attention(layout: _Layout, layer: int, query: torch.Tensor, scaling) -> torch.Tensor:
    """All sequences in one padded SDPA call: query [Hq, T, D] -> [T, Hq, D]."""
    query_rows, key_slots, mask, out_rows = layout.padded
    batch, _, q_max, c_max = mask.shape
    heads, _, dim = query.shape
    keys = layout.pool.gather(layer, "key", key_slots)  # [Hkv, B*C_max, D]
    values = layout.pool.gather(layer, "value", key_slots)
    kv_heads = keys.shape[0]
    rep = heads // kv_heads
    keys = keys.view(kv_heads, batch, c_max, dim).transpose(0, 1)  # [B, Hkv, C_max, D]
    values = values.view(kv_heads, batch, c_max, dim).transpose(0, 1)
    rows = query.index_select(1, query_rows).view(heads, batch, q_max, dim).transpose(0, 1)  # [B, Hq, q_max, D]
    packed = rows.reshape(batch, kv_heads, rep * q_max, dim)
    out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask.repeat(1, 1, rep, 1), scale=scaling)
    out = out.reshape(batch, heads, q_max, dim).transpose(1, 2).reshape(batch * q_max, heads, dim)
    return out.index_select(0, out_rows)  # [T, Hq, D]


def _ragged_mask(*args, config=None, **kwargs):
    """No mask inside a ragged forward (the attention builds its own); the model's own mask outside."""
    if _STEP.get() is not None:
        return None
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    mask = ALL_MASK_ATTENTION_FUNCTIONS.get(_fallback_name(config), sdpa_mask)
    return mask(*args, config=config, **kwargs)


def _fallback(module):
    """The attention function the module's model had before the switch."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS.get(_fallback_name(module.config), sdpa_attention_forward)


def _fallback_name(config) -> str:
    return getattr(config, "_spectoolkit_attn_fallback", "sdpa")


def use_ragged_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to the ragged attention (a no-op if it is already on it); its attention until
    then stays what it computes outside :func:`ragged_forward`."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    current = model.config._attn_implementation
    if current == RAGGED_ATTN_NAME:
        return
    AttentionInterface.register(RAGGED_ATTN_NAME, _ragged_attention)
    AttentionMaskInterface.register(RAGGED_ATTN_NAME, _ragged_mask)
    model.set_attn_implementation(RAGGED_ATTN_NAME)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config._spectoolkit_attn_fallback = current
