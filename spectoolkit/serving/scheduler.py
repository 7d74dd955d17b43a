"""Which sequences run in the next step, with how many tokens, drafts and KV blocks.

Every step (vLLM v1's unified token budget):

1. **Admission**, first come first served: a queued request joins while fewer than ``max_num_seqs``
   run and the free blocks hold its whole uncomputed history plus the pending token (leading blocks
   of an identical prefix — a live sequence's, or a finished one's still in the prefix cache — are
   shared instead, :mod:`~spectoolkit.runtime.blocks`). A sample of n > 1 waits while its leader
   computes their prompt, then shares its full blocks (the others behind it go ahead meanwhile).
2. **Load control**: speculate only while at most ``spec_max_batch`` sequences run; above that the
   step is plain decode (the fallback under load).
3. **Tokens**, within ``max_num_tokens``: each decoding sequence its pending token first; then its
   drafts k_i <= min(γ, room − 1) as the draft-length policy chooses them jointly for the step
   (:mod:`spectoolkit.policy`; fixed: γ each while the budget lasts), within ``max_draft_tokens``;
   then prefill chunks of the others (a long prompt spreads over steps). A drafter that proposes ahead (a
   lookup, :attr:`~spectoolkit.drafting.base.Drafter.ahead`) is asked first, at each sequence's cap: the policy
   then chooses within what it proposed, and the sequence's work holds that proposal's first k_i nodes.
4. **KV**: the blocks for a sequence's tokens *and its candidates* are reserved before anything is
   drafted. When blocks run out, the latest admitted running sequence is preempted: its blocks are
   freed and it goes back to the front of the queue, to be recomputed from its tokens later — no other
   sequence's state is touched, and nothing already emitted changes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from spectoolkit.drafting.tree import TokenTree
from spectoolkit.policy.base import DraftLengthPolicy, Prediction
from spectoolkit.serving.sequence import Sequence


@dataclass(frozen=True)
class SchedulerLimits:
    """How much one step may hold (the draft length is the policy's: :class:`DraftLengthPolicy`)."""

    max_num_tokens: int
    max_num_seqs: int
    spec_max_batch: int | None
    max_draft_tokens: int | None


@dataclass
class Work:
    """A sequence's share of the step: ``feed`` of its uncomputed tokens, then up to ``drafts`` candidates
    (``proposal``: those candidates already proposed, by a drafter that proposes ahead; else None)."""

    seq: Sequence
    feed: int
    drafts: int = 0
    proposal: TokenTree | None = None


@dataclass
class Plan:
    work: list[Work] = field(default_factory=list)  # in running order
    preempted: list[Sequence] = field(default_factory=list)
    speculating: bool = False
    prediction: Prediction | None = None  # what the policy expected of its drafts (None: it predicts nothing)

    @property
    def num_tokens(self) -> int:
        return sum(w.feed + w.drafts for w in self.work)


class Scheduler:
    """Holds the queue and the running sequences; :meth:`schedule` plans one step."""

    def __init__(
        self, limits: SchedulerLimits, allocator, policy: DraftLengthPolicy, tree: bool = False,
        backlog: Callable[[Sequence], int] | None = None,
        ahead: Callable[[list[Sequence], list[int]], list[TokenTree]] | None = None,
    ) -> None:  # fmt: skip
        """``policy.max_gamma``: the drafts (``tree``: token-tree nodes, which a sequence's room bounds in depth, not
        in number) a sequence may have per round, 0 without a drafter; ``backlog(seq)``: rows the drafter feeds
        before it drafts for ``seq`` (the policy prices them); ``ahead(seqs, caps)``: one proposal per sequence, at most
        ``caps`` nodes each (an empty tree at 0), of a drafter that proposes before the policy chooses (None: it
        proposes after)."""
        self.limits = limits
        self.allocator = allocator
        self.policy, self.tree = policy, tree
        self.backlog, self.ahead = backlog, ahead
        self.queue: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.on_admit: Callable[[Sequence], None] | None = None  # told of each admission (its shared prefix counted)

    def schedule(self, on_preempt) -> Plan:
        """Plan the next step; ``on_preempt(seq)`` is told about every sequence sent back to the queue."""
        self._admit()
        plan = Plan(speculating=self._may_speculate())
        budget = self.limits.max_num_tokens
        decoding = [seq for seq in self.running if seq.decoding]
        by_seq: dict[int, Work] = {}
        for seq in decoding:  # 1. every pending token
            if (
                budget < 1
                or seq not in self.running
                or not self._reserve(seq, seq.num_computed + 1, plan, by_seq, on_preempt)
            ):
                continue
            by_seq[id(seq)] = Work(seq, 1)
            budget -= 1
        if plan.speculating:  # 2. their candidates
            budget -= self._drafts(decoding, budget, plan, by_seq, on_preempt)
        for seq in [s for s in self.running if not s.decoding]:  # 3. prefill chunks
            chunk = min(seq.uncomputed, budget)
            if chunk < 1 or seq not in self.running:
                continue
            if self._reserve(seq, seq.num_computed + chunk, plan, by_seq, on_preempt):
                by_seq[id(seq)] = Work(seq, chunk)
                budget -= chunk
        plan.work = [by_seq[id(seq)] for seq in self.running if id(seq) in by_seq]
        return plan

    def _drafts(self, decoding: list[Sequence], budget: int, plan: Plan, by_seq, on_preempt) -> int:
        """Ask the policy for each decoding sequence's k_i, reserve their KV; returns the candidates planned."""
        works = [by_seq[id(seq)] for seq in decoding if id(seq) in by_seq and seq in self.running]
        cap = self.limits.max_draft_tokens
        draft_budget = budget if cap is None else min(cap, budget)
        prefill = sum(seq.uncomputed for seq in self.running if not seq.decoding)
        fixed = len(by_seq) + min(prefill, budget)  # the step's other tokens: pending ones, prefill chunks
        gamma = self.policy.max_gamma
        caps = [work.seq.draft_cap(min(gamma, work.seq.room - 1) if not self.tree or work.seq.room <= 1 else gamma)
                for work in works]  # fmt: skip
        seqs = [work.seq for work in works]
        proposals = self.ahead(seqs, caps) if self.ahead is not None else None
        if proposals is not None:
            caps = [len(proposal) for proposal in proposals]
        backlogs = [self.backlog(seq) for seq in seqs] if self.backlog is not None else None
        settled = min(len(self.running) + len(self.queue), self.limits.max_num_seqs)  # once prompts are computed
        lengths = self.policy.choose(seqs, caps, fixed, draft_budget, backlogs, [seq.room for seq in seqs], settled)
        plan.prediction = self.policy.prediction()
        planned = 0
        for index, (work, drafts) in enumerate(zip(works, lengths, strict=True)):
            seq = work.seq
            if drafts > 0 and seq in self.running:
                if self._reserve(seq, seq.num_computed + 1 + drafts, plan, by_seq, on_preempt, wait=False):
                    work.drafts = drafts
                    if proposals is not None:
                        work.proposal = proposals[index].truncated(drafts)
                    planned += drafts
        return planned

    def _admit(self) -> None:
        for seq in list(self.queue):
            if len(self.running) >= self.limits.max_num_seqs:
                return
            if seq.waiting:  # a sample of n > 1 whose prompt its leader is computing: shared once it is done
                continue
            if not seq.table.blocks:  # share an identical prefix, live or cached (never the last prompt token)
                seq.num_computed = seq.table.share_prefix(seq.tokens, len(seq.tokens) - 1)
            if seq.table.missing(len(seq.tokens) + 1) > self.allocator.num_free:
                seq.table.release()  # a waiting sequence holds no blocks: they may be what others need
                seq.num_computed = 0
                return  # wait for blocks to be freed (a lone sequence always fits: checked at submit)
            self.queue.remove(seq)
            if self.on_admit is not None:
                self.on_admit(seq)
            seq.order = max((s.order for s in self.running), default=-1) + 1
            self.running.append(seq)

    def _may_speculate(self) -> bool:
        limit = self.limits.spec_max_batch
        return self.policy.max_gamma > 0 and (limit is None or len(self.running) <= limit)

    def _reserve(self, seq: Sequence, positions: int, plan: Plan, by_seq, on_preempt, wait: bool = True) -> bool:
        """Blocks for positions [0, positions) of ``seq``, preempting the latest running sequences if needed.

        ``wait=False`` (candidates): give up instead of preempting. False when ``seq`` itself was preempted.
        """
        while seq.table.missing(positions) > self.allocator.num_free:
            if not wait:
                return False
            victim = max(self.running, key=lambda s: s.order)
            self.preempt(victim, plan, by_seq, on_preempt)
            if victim is seq:
                return False
        seq.table.ensure(positions)
        return True

    def preempt(self, seq: Sequence, plan: Plan, by_seq, on_preempt) -> None:
        """Free ``seq``'s KV and send it back to the front of the queue (recompute later)."""
        self.running.remove(seq)
        by_seq.pop(id(seq), None)
        seq.table.release()
        seq.num_computed = 0
        seq.result.preemptions += 1
        self.queue.appendleft(seq)
        plan.preempted.append(seq)
        on_preempt(seq)

    def finish(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.table.release()
