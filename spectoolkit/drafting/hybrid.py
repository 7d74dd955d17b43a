"""Hybrid drafting (ArcticInference's suffix + model speculator), priced: per round and request, the lookup's draft
(suffix decoding) or a model-backed drafter's (a draft model, or an EAGLE head), whichever buys more emitted tokens
per second of step.

The lookup's proposal is computed first (far below a millisecond) with its score: the sum of its nodes' path
probabilities in the trie, the tokens it expects accepted. The model's expectation is what its own drafts kept for
this request: an exponential mean of its accepted lengths (a new request starts from the mean over every request).
An option is worth its expected emitted tokens (accepted + 1, the target's own token) over the seconds it costs:

- the request's share of the step's plain rows, T(W) / W, with W the pending rows of the requests asked to draft
  (the drafter sees no others of the step: prefill chunks, requests the policy kept from drafting);
- what its rows add to the step, T(W + rows) - T(W): the lookup's nodes, or what the model may draft (its budget:
  a chain min(nodes, depth), a tree ``nodes``), each priced alone on the pending rows (the others' drafts are not
  chosen yet; on a convex T they would only make every option dearer);
- the model's drafting: its measured seconds per draft forward for as many requests as share it (an exponential
  mean over its calls of that size, less their backlog upkeep, which the draft-length policy prices) times the
  forwards it takes for the request (its depth).
  The model drafts every request in one batched forward per depth (chains and trees alike), so that cost is shared
  equally among the requests that take the model this round: the largest set each member of which still prefers
  the model at its share (start from every request, drop those that do not, repeat: each share only grows);
- the model's catch-up for the request: what it has not seen of it (its prompt, the tokens the lookup's rounds
  emitted), fed apart before it drafts, at its measured seconds per row, charged to the round that pays it. So the
  model takes over a request the lookup drafts well only where one round's gain covers the catch-up: on unseen
  code at c4, pricing instead each lookup token as a row the model feeds later (the backlog already owed as sunk)
  sent new requests to the model and cost fixed γ 6 a tenth of its speed (1.09× the target alone against 1.20×).
  A draft model carries along only what a round of its own leaves unfed (:data:`MODEL_CARRY`): taken along in its
  first forward, up to 16 such rows priced that forward, and so every draft forward, at twice its cost (issue 57:
  the 0.5B's 9 ms forward at 18.3 ms).

T is the target's step-time curve for steps of W sequences, and the model's forward cost is by the requests that share
it, from the same :class:`~spectoolkit.policy.costs.StepCosts` the adaptive draft-length policy prices with (issue 57:
one curve pooled over batch sizes priced a step of 16 from steps of 1 and 4), learnt from the engine's decode steps
(:meth:`HybridDrafter.observe_step`). Until anything is measured every price is the
same, and the rule is the unpriced one: the lookup's draft when it expects at least as many tokens as the model. An
empty lookup proposal is a plain decode (one token for the share of the pending row); a request with nothing to
look up that has not had the model for :data:`PROBE_EVERY` rounds gets it once, so a mean that fell can recover,
where the round could pay were every token of it kept (its catch-up and the forward shared by every request priced:
unpriced, probes at c16 fed the 0.5B whole prompts first, 235-294 ms a request, for rounds that could not pay).

The model drafts only for the requests that take it, in one batched call; a round it sits out costs it nothing but
a longer catch-up next time (a draft model's KV, or a head's held rows, follow the verified tokens). The choice
depends on past rounds and the lookup's deterministic proposal only, never on this round's draws, so verification
stays exact (each proposal carries its own q: one-hot for the lookup, the model's for the model).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from spectoolkit.config import TreeConfig
from spectoolkit.drafting.base import Budget, Drafter, Drafting, Upkeep
from spectoolkit.drafting.suffix import SuffixDrafter
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.policy.costs import DraftCost, StepCosts

DECAY = 0.7  # weight of the past in the model's mean accepted length
PRIOR = 1.0  # the model's expected accepted tokens before any round
PROBE_EVERY = 16  # rounds a request with nothing to look up goes without the model before it gets it once
MODEL_CARRY = 2  # unfed rows the draft model's first forward takes along: what a round of its own leaves (its last
# draft and the target's token); the tokens the lookup's rounds emitted are fed apart, as catch-up (module docstring)


class HybridDrafter(Drafter):
    """Suffix decoding or a model-backed drafter, per round and request, by emitted tokens per second (module
    docstring). ``rounds`` counts the rounds each part proposed."""

    def __init__(self, lookup: SuffixDrafter, model: Drafter, name: str = "hybrid") -> None:
        """``lookup``: suffix decoding (its proposals come scored); ``model``: a draft model or an EAGLE head, growing
        the same tree kind; ``name``: the records' name (``hybrid``: with a head, ``hybrid-model``: a draft model)."""
        self.lookup, self.model, self.name = lookup, model, name
        self.tree, self.capture = model.tree, model.capture
        self.costs = StepCosts()  # T_B(n) of the target's decode steps per batch, the model's forward per count
        self.catch_up = DraftCost()  # seconds per row the model fed apart before drafting (its upkeep)
        self.overall = PRIOR  # the model's mean accepted length over every request
        self._mean: dict[int, float] = {}  # per request
        self._idle: dict[int, int] = {}  # rounds since the model last drafted for the request
        self._drafted_by: dict[int, str] = {}  # who proposed the request's last round
        self.rounds = {"lookup": 0, "model": 0}

    def variant(self, stop_below: float | None, tree: TreeConfig | None) -> HybridDrafter:
        return type(self)(self.lookup.variant(stop_below, tree), self.model.variant(stop_below, tree), self.name)

    # ---- proposing ----------------------------------------------------------------------------

    def propose(self, seqs: list[Drafting], budgets: list[Budget]) -> list[TokenTree]:
        out, scores = [], []
        for seq, budget in zip(seqs, budgets, strict=True):
            proposal, score = self.lookup.scored(seq, budget)
            out.append(proposal)
            scores.append(score)
        taking = self.choose(seqs, budgets, out, scores)
        for i, seq in enumerate(seqs):
            if i not in taking and len(out[i]):
                self._drafted_by[id(seq)] = "lookup"
                self.rounds["lookup"] += 1
        if taking:
            made = self._drafted([seqs[i] for i in taking], [budgets[i] for i in taking])
            for i, proposal in zip(taking, made, strict=True):
                out[i] = proposal
                if len(proposal):  # an empty round (no room) says nothing of what the model keeps
                    self._drafted_by[id(seqs[i])] = "model"
                    self.rounds["model"] += 1
        return out

    def choose(self, seqs: list[Drafting], budgets: list[Budget], proposals: list[TokenTree],
               scores: list[float]) -> list[int]:  # fmt: skip
        """The indices of the requests the model drafts for this round, given the lookup's ``proposals`` and their
        ``scores`` (module docstring); every other request takes its lookup proposal (empty: a plain decode)."""
        width = len(seqs)
        depths = [min(budget.nodes, budget.depth) for budget in budgets]  # the model's forwards for each request
        rows = [budget.nodes if self.tree is not None else depth for budget, depth in zip(budgets, depths, strict=True)]
        widths = [width] + [width + len(proposal) for proposal in proposals] + [width + r for r in rows]
        curve = self.costs.target(width)  # steps of this many sequences (issue 57: not pooled over batch sizes)
        plain, *added = curve(np.array(widths)).tolist()  # T of the pending rows, then with each option's rows
        share = plain / width
        lookup_rate = [(score + 1) / (share + cost - plain) for score, cost in zip(scores, added[:width], strict=True)]
        step_cost = [share + cost - plain for cost in added[width:]]  # the model option's, before its drafting
        means = [self._mean.get(id(seq), self.overall) for seq in seqs]
        owed = [self.model.backlog(seq) * self.catch_up.per_forward for seq in seqs]  # its catch-up, if it drafts

        def pays(i: int, shared: int, kept: float) -> bool:
            forwards = self.costs.draft(shared) * depths[i] / shared  # one batched forward for ``shared`` rows
            return (kept + 1) / (step_cost[i] + forwards + owed[i]) > lookup_rate[i]

        candidates = [i for i in range(width) if depths[i] > 0]
        probes = {  # a probe where the model's round could pay at all: every token kept, its catch-up included
            i for i in candidates
            if not len(proposals[i]) and self._idle.get(id(seqs[i]), 0) >= PROBE_EVERY and pays(i, width, depths[i])
        }  # fmt: skip
        taking, before = candidates, None
        while taking != before:  # each pass only raises the share of those left: it ends
            shared = max(1, len(taking))
            before, taking = taking, [i for i in taking if i in probes or pays(i, shared, means[i])]
        for i in candidates:
            self._idle[id(seqs[i])] = 0 if i in taking else self._idle.get(id(seqs[i]), 0) + 1
        return taking

    def _drafted(self, seqs: list[Drafting], budgets: list[Budget]) -> list[TokenTree]:
        """The model's proposals for ``seqs``, its seconds per draft forward (one batched forward per depth of the
        deepest proposal) and per catch-up row (its upkeep) learnt from the call."""
        began, before = time.perf_counter(), self.model.upkeep()
        made = self.model.propose(seqs, budgets)
        after = self.model.upkeep()
        upkeep = after.seconds - before.seconds
        self.catch_up.observe(after.rows - before.rows, upkeep)
        depths = [max(proposal.depths(), default=0) for proposal in made]
        self.costs.observe_draft(len(seqs), max(depths, default=0), time.perf_counter() - began - upkeep)
        return made

    # ---- what the engine tells it -------------------------------------------------------------

    def observe_step(self, tokens: int, seconds: float, sequences: int) -> None:
        self.costs.observe_target(sequences, tokens, seconds)

    def keep_states(self, seq: Drafting, start: int, states: torch.Tensor) -> None:
        self.model.keep_states(seq, start, states)

    def backlog(self, seq: Drafting) -> int:
        """The model's backlog (a round it drafts pays it; the policy's acceptance covers both parts), but none where
        the lookup has a proposal for ``seq``: the lookup drafts without it, and the model takes the request only where
        it beats the lookup with that catch-up priced (:meth:`choose`). Reported whole, a code request the lookup
        drafted for throughout owed the model its prompt and every token since (270 rows at c1), and the draft-length
        policy kept it plain for its last 20 tokens, which the lookup would have drafted for nothing (issue 57)."""
        proposal, _ = self.lookup.scored(seq, Budget(1, 1))
        return 0 if len(proposal) else self.model.backlog(seq)

    def upkeep(self) -> Upkeep:
        lookup, model = self.lookup.upkeep(), self.model.upkeep()
        return Upkeep(lookup.seconds + model.seconds, lookup.rows + model.rows)

    def commit(self, seq: Drafting, num_prefix: int, path: list[int]) -> None:
        self.model.commit(seq, num_prefix, path)
        self.lookup.commit(seq, num_prefix, path)
        if self._drafted_by.pop(id(seq), None) == "model":
            key = id(seq)
            self._mean[key] = DECAY * self._mean.get(key, self.overall) + (1 - DECAY) * len(path)
            self.overall = DECAY * self.overall + (1 - DECAY) * len(path)

    def release(self, seq: Drafting) -> None:
        self.model.release(seq)
        self.lookup.release(seq)
        for held in (self._mean, self._idle, self._drafted_by):
            held.pop(id(seq), None)

    def reset(self) -> None:
        """Every request's state goes; what steps, draft forwards and catch-up cost, and the model's mean over every
        request, stay learnt (as the draft-length policy keeps its workload acceptance: reset to :data:`PRIOR` on every
        pass, the model had to win its way back by probes each time)."""
        self.model.reset()
        self.lookup.reset()
        for held in (self._mean, self._idle, self._drafted_by):
            held.clear()

    def runners(self) -> dict:
        return self.model.runners()

    def kv_bytes(self) -> int:
        return self.model.kv_bytes() + self.lookup.kv_bytes()

    def describe_tree(self) -> str | None:
        return self.model.describe_tree()
