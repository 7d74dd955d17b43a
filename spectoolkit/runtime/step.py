"""What one forward computes, as one argument: :class:`StepBatch` (the step metadata of vLLM's attention
metadata and nano-vllm's per-forward ``Context``, passed explicitly instead of through global state).

Each sequence in a step contributes a :class:`Segment`: the tokens it feeds at positions
[start, start+q) (a pending token and its drafts, a token tree, or a prefill chunk) and the rows whose
next-token logits are wanted. :func:`build_step` flattens B segments over a paged pool into one
:class:`StepBatch` of T tokens: their ids, rotary positions, the pool slot each token's KV is written
to, per-sequence query starts and context lengths, the key slots each sequence attends, and, for tree
rows, which of those slots each row sees. A runner's ``forward(batch)`` reads nothing else.

Row modes (how linears and attention run the rows; :mod:`spectoolkit.kernels.kernel_choice`):

- ``"chosen"``: a lone sequence; linears run their measured row-invariant variant for up to
  ``MAX_CHUNKED_ROWS`` rows, so a verify row equals the decode step at its position (batch-1 exactness).
- ``"plain"``: a batched step; every linear gets all T rows in one call and the sequences share one
  padded attention call (a row may depend on its companions by a last bit).
- ``"invariant"`` (``serve.batch_invariant``): every row computed as a lone decode step would be, so
  no row's result depends on which others share the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectoolkit.runtime.blocks import BlockTable

ROW_MODES = ("chosen", "plain", "invariant")


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
class PaddedCall:
    """Gather indices of one padded attention call over B sequences (``plain`` mode, B > 1)."""

    query_rows: torch.Tensor  # [B*q_max] long: the flattened token row of each padded query row
    key_slots: torch.Tensor  # [B*C_max] long: the pool slot of each padded key
    mask: torch.Tensor  # [B, 1, q_max, C_max] bool: causal (or tree) visibility within each sequence
    out_rows: torch.Tensor  # [T] long: the padded row of each real token


@dataclass
class StepBatch:
    """One forward's tokens and their place in the paged pool (B sequences, T tokens, R logit rows)."""

    token_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long: rotary position of each token
    slots: torch.Tensor  # [T] long: the pool slot each token's KV is written to
    query_starts: list[int]  # [B+1]: sequence b's tokens are rows [query_starts[b], query_starts[b+1])
    context_lens: list[int]  # [B]: keys sequence b attends after the write (its start + q_b)
    key_slots: list[torch.Tensor | None]  # [B] of [context_b] long: the slots of positions [0, context_b); None: span
    spans: list[int | None]  # [B]: first slot of a sequence whose keys are consecutive slots (read as a slice)
    visible: list[torch.Tensor | None]  # [B] of [q_b, context_b] bool: a tree's visible slots; None: causal
    logit_rows: torch.Tensor  # [R] long: the token rows whose next-token logits the forward returns
    mode: str  # one of ROW_MODES
    padded: PaddedCall | None = None  # the one padded attention call of a batched plain step

    @property
    def num_seqs(self) -> int:
        return len(self.context_lens)

    def rows_of(self, b: int) -> tuple[int, int]:
        """(first row, row count q_b) of sequence b."""
        return self.query_starts[b], self.query_starts[b + 1] - self.query_starts[b]

    def start_of(self, b: int) -> int:
        """First new position of sequence b (its tokens below have KV already)."""
        first, count = self.rows_of(b)
        return self.context_lens[b] - count


def build_step(segments: list[Segment], mode: str, device: torch.device) -> StepBatch:
    """The :class:`StepBatch` of ``segments`` (their tables already cover every position they feed)."""
    if mode not in ROW_MODES:
        raise ValueError(f"row mode {mode!r} is not one of {ROW_MODES}")
    ids, positions, write, starts, context, key_slots, spans, rows = [], [], [], [0], [], [], [], []
    lone = len(segments) == 1 and mode != "invariant"
    for segment in segments:
        q = len(segment.token_ids)
        end = segment.start + q
        rows.extend(starts[-1] + r for r in segment.logit_rows)
        ids.extend(segment.token_ids)
        positions.extend(segment.positions())
        write.extend(segment.table.slots(segment.start, end))
        starts.append(starts[-1] + q)
        context.append(end)
        span = segment.table.contiguous(end) if lone else None
        spans.append(span)
        keys = None if span is not None else torch.tensor(segment.table.slots(0, end), dtype=torch.long, device=device)
        key_slots.append(keys)
    visible = [segment.visible() for segment in segments]
    batch = StepBatch(
        token_ids=_longs(ids, device), positions=_longs(positions, device), slots=_longs(write, device),
        query_starts=starts, context_lens=context, key_slots=key_slots, spans=spans,
        visible=[None if mask is None else mask.to(device) for mask in visible], logit_rows=_longs(rows, device),
        mode=mode,
    )  # fmt: skip
    if mode == "plain" and len(segments) > 1:
        batch.padded = _pad(batch, device)
    return batch


def _longs(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def _pad(batch: StepBatch, device: torch.device) -> PaddedCall:
    """The padded call of ``batch``: every sequence's rows and keys padded to the longest."""
    num_seqs = batch.num_seqs
    q_max = max(batch.rows_of(b)[1] for b in range(num_seqs))
    c_max = max(batch.context_lens)
    query_rows = torch.zeros(num_seqs, q_max, dtype=torch.long)
    key_slots = torch.zeros(num_seqs, c_max, dtype=torch.long)
    mask = torch.zeros(num_seqs, 1, q_max, c_max, dtype=torch.bool)
    out_rows = []
    for b in range(num_seqs):
        first, q = batch.rows_of(b)
        ctx, start = batch.context_lens[b], batch.start_of(b)
        query_rows[b, :q] = torch.arange(first, first + q)
        key_slots[b, :ctx] = batch.key_slots[b].cpu()
        tree = batch.visible[b]
        mask[b, 0, :q, :ctx] = torch.arange(ctx)[None, :] <= torch.arange(start, start + q)[:, None] if tree is None \
            else tree.cpu()  # fmt: skip
        mask[b, 0, q:, 0] = True  # padded query rows see one key (their output is dropped): no NaN
        out_rows.extend(range(b * q_max, b * q_max + q))
    return PaddedCall(query_rows.flatten().to(device), key_slots.flatten().to(device), mask.to(device),
                      _longs(out_rows, device))  # fmt: skip
