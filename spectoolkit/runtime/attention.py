"""Attention of one step's rows over the paged pool, read as :class:`~spectoolkit.runtime.step.StepBatch` says.

On the CPU, for the KV precisions it reads, attention is our kernel (:func:`kernel_attention`,
``spectoolkit::paged_attention``, DESIGN §7): every (row, head) attends exactly the slots its sequence
lists for it (:func:`row_key_lists`), in position order, with fixed-order sums, read from the pool in
place — so no row depends on the step's other rows, whatever the row mode.

Elsewhere (CUDA, int4 KV) the torch path below runs: each layer writes the step's new keys/values to
their slots first, then every sequence attends its keys [0, context) within its own rows only:

- a lone sequence in ``plain`` mode, or a prefill (more than ``MAX_ROWWISE_ROWS`` rows) in ``chosen``
  mode: one SDPA call over its keys, a pool slice when its slots are consecutive; causal, or the tree's
  visibility mask;
- a batched ``plain`` step: all sequences padded to one [B, H, q_max, C_max] SDPA call per layer;
- ``invariant``, and a verify window of a lone sequence in ``chosen`` mode: every row is one decode-step
  call — one query against exactly the keys it sees — so its result cannot depend on which other rows
  share the step, and a verify row equals the decode step at its position (batch-1 exactness).

GQA heads are packed as rows ([Hkv, rep*q, D] queries against [Hkv, C, D] keys): no ``repeat_kv`` copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spectoolkit.kernels import cpu_ops
from spectoolkit.kernels.kernel_choice import MAX_CHUNKED_ROWS as MAX_ROWWISE_ROWS
from spectoolkit.runtime.paged_kv import PagedKVPool
from spectoolkit.runtime.step import StepBatch

KERNEL_KV = ("auto", "fp32", "bf16", "fp16", "int8", "fp8")  # KV precisions our attention kernel reads


def kernel_attends(pool: PagedKVPool, head_dim: int) -> bool:
    """Whether our attention kernel runs over ``pool`` (CPU, a KV precision and head size it reads)."""
    device = pool.layers[0]["key"][pool.fields[0]].device
    if device.type != "cpu" or pool.precision not in KERNEL_KV or head_dim not in cpu_ops.HEAD_DIMS:
        return False
    cpu_ops.load()
    return True


def row_key_lists(batch: StepBatch) -> list[torch.Tensor]:
    """The slots each of the batch's T rows attends, in position order: [0, own] of a chain, a tree row's
    prefix, ancestors and itself."""
    keys = []
    for b in range(batch.num_seqs):
        first, count = batch.rows_of(b)
        start, context = batch.start_of(b), batch.context_lens[b]
        span = batch.spans[b]
        slots = batch.key_slots[b] if span is None else torch.arange(span, span + context, device=batch.slots.device)
        tree = batch.visible[b]
        keys.extend(slots[: start + r + 1] if tree is None else slots[tree[r]] for r in range(count))
    return keys


def flat_key_slots(keys: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' slot lists -> (key_slots [sum of lengths], starts [T+1]); row i's are key_slots[starts[i]:starts[i+1]]."""
    lengths = torch.tensor([0] + [len(k) for k in keys], dtype=torch.long, device=keys[0].device)
    return torch.cat(keys), lengths.cumsum(0)


def pool_stores(pool: PagedKVPool, layer: int) -> tuple[torch.Tensor, ...]:
    """A pool layer's (keys, values, key scales, value scales) as the kernel reads them (no scales: empty)."""
    key, value = pool.layers[layer]["key"], pool.layers[layer]["value"]
    none = torch.empty(0, dtype=torch.float32, device=key["data"].device)
    return key["data"], value["data"], key.get("scale", none), value.get("scale", none)


def kernel_attention(
    stores: tuple[torch.Tensor, ...], query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    write: torch.Tensor, key_slots: torch.Tensor, starts: torch.Tensor, scaling: float, isa: int = -1,
) -> torch.Tensor:  # fmt: skip
    """query [W, Hq, D], key/value [W, Hkv, D] (this step's rows) -> [W, Hq, D] fp32: the new rows are encoded to
    the pool's format (``spectoolkit::kv_encode``, as ``layer_tail`` does) and stored at ``write`` [W] (-1: not
    stored), then each row attends its slots (``isa``: the kernel path, :func:`~spectoolkit.kernels.cpu_ops.best_isa`).
    """
    scaled = stores[2].numel() > 0
    k_new, k_scale = torch.ops.spectoolkit.kv_encode(key.float(), stores[0], scaled)
    v_new, v_scale = torch.ops.spectoolkit.kv_encode(value.float(), stores[1], scaled)
    scales = (k_scale, v_scale) if scaled else stores[2:]
    return torch.ops.spectoolkit.paged_attention(
        query.float(), k_new, v_new, *scales, *stores, write, key_slots, starts, scaling, isa
    )


def paged_attention(
    pool: PagedKVPool, layer: int, batch: StepBatch, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    scaling: float,
) -> torch.Tensor:  # fmt: skip
    """query [Hq, T, D], key/value [Hkv, T, D] (this step's tokens) -> [T, Hq, D]; writes key/value to the pool."""
    pool.write(layer, batch.slots, key, value)
    if batch.padded is not None:
        return _padded_attention(pool, layer, batch, query, scaling)
    if batch.num_seqs == 1:
        return _sequence_attention(pool, layer, batch, 0, query, scaling)
    return torch.cat([_sequence_attention(pool, layer, batch, b, query, scaling) for b in range(batch.num_seqs)])


def _keys_values(pool: PagedKVPool, layer: int, batch: StepBatch, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence b's keys and values [Hkv, context_b, D]: a pool slice when its slots are consecutive."""
    span = batch.spans[b]
    if span is not None:
        end = span + batch.context_lens[b]
        return pool.span(layer, "key", span, end), pool.span(layer, "value", span, end)
    slots = batch.key_slots[b]
    return pool.gather(layer, "key", slots), pool.gather(layer, "value", slots)


def _sequence_attention(
    pool: PagedKVPool, layer: int, batch: StepBatch, b: int, query: torch.Tensor, scaling: float
) -> torch.Tensor:
    """Attention of sequence b's rows of query [Hq, T, D] -> [q_b, Hq, D]."""
    keys, values = _keys_values(pool, layer, batch, b)  # [Hkv, C, D]
    first, q = batch.rows_of(b)
    start = batch.start_of(b)
    rows = query[:, first : first + q]  # [Hq, q, D]
    tree = batch.visible[b]  # [q, C] or None
    rowwise = batch.mode == "invariant" or (batch.mode == "chosen" and 1 < q <= MAX_ROWWISE_ROWS)
    if rowwise and tree is not None:  # each tree row as a decode step over prefix + its path
        picks = [torch.nonzero(tree[r]).flatten() for r in range(q)]
        seen = [(keys.index_select(1, pick), values.index_select(1, pick)) for pick in picks]
        return torch.cat([packed_attention(rows[:, r : r + 1], *seen[r], None, scaling) for r in range(q)])
    if rowwise:  # each row exactly as a decode step computes it
        return torch.cat([packed_attention(rows[:, r : r + 1], keys[:, : start + r + 1], values[:, : start + r + 1],
                                           None, scaling) for r in range(q)])  # fmt: skip
    mask = tree
    if q > 1 and mask is None:
        mask = torch.ones(q, start + q, dtype=torch.bool, device=query.device).tril(start)  # [q, C]
    return packed_attention(rows, keys, values, mask, scaling)


def packed_attention(rows: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask, scaling) -> torch.Tensor:
    """rows [Hq, q, D], keys/values [Hkv, C, D], mask [q, C] or None -> [q, Hq, D]; GQA heads packed as rows."""
    heads, q, dim = rows.shape
    kv_heads = keys.shape[0]
    rep = heads // kv_heads
    packed = rows.reshape(1, kv_heads, rep * q, dim)  # rows ordered (head-in-group, position)
    if mask is not None:
        mask = mask.repeat(rep, 1)  # [rep*q, C]
    out = F.scaled_dot_product_attention(packed, keys.unsqueeze(0), values.unsqueeze(0), attn_mask=mask, scale=scaling)
    return out.reshape(heads, q, dim).transpose(0, 1)  # [q, Hq, D]


def _padded_attention(pool: PagedKVPool, layer: int, batch: StepBatch, query: torch.Tensor, scaling) -> torch.Tensor:
    """All sequences in one padded SDPA call: query [Hq, T, D] -> [T, Hq, D]."""
    call = batch.padded
    num_seqs, _, q_max, c_max = call.mask.shape
    heads, _, dim = query.shape
    keys = pool.gather(layer, "key", call.key_slots)  # [Hkv, B*C_max, D]
    values = pool.gather(layer, "value", call.key_slots)
    kv_heads = keys.shape[0]
    rep = heads // kv_heads
    keys = keys.view(kv_heads, num_seqs, c_max, dim).transpose(0, 1)  # [B, Hkv, C_max, D]
    values = values.view(kv_heads, num_seqs, c_max, dim).transpose(0, 1)
    rows = query.index_select(1, call.query_rows).view(heads, num_seqs, q_max, dim).transpose(0, 1)  # [B, Hq, q_max, D]
    packed = rows.reshape(num_seqs, kv_heads, rep * q_max, dim)
    mask = call.mask.repeat(1, 1, rep, 1)
    out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask, scale=scaling)
    out = out.reshape(num_seqs, heads, q_max, dim).transpose(1, 2).reshape(num_seqs * q_max, heads, dim)
    return out.index_select(0, call.out_rows)  # [T, Hq, D]
