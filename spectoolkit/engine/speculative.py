"""Speculative decoding at batch size 1 (Leviathan et al. 2023; Chen et al. 2023).

Each round: the draft-length policy (:mod:`spectoolkit.policy`) picks k <= γ, the drafter proposes
at most k tokens after the pending token (k = 0: a plain decode round); the target scores
[pending, d1..dk] in one forward (k+1 logits rows); the verifier accepts a prefix and emits one
correction or bonus token. KV rule (DESIGN §2): the target keeps KV for prefix + pending + accepted
drafts; the emitted correction/bonus token has no KV yet and is the first input of the next round.
The drafter is told the same kept length and truncates its own cache.
"""

from __future__ import annotations

import time

import torch

from spectoolkit.config import SamplingConfig, TreeConfig
from spectoolkit.drafting.base import Drafter, Proposal
from spectoolkit.engine.output import GenerationOutput, cut, finished, prefill
from spectoolkit.engine.tree_round import tree_round
from spectoolkit.models.cached import CachedModel, synchronize
from spectoolkit.policy.base import DraftLengthPolicy, FixedPolicy
from spectoolkit.verify.base import Verifier
from spectoolkit.verify.tree import TreeVerifier


class SpeculativeEngine:
    """Draft → verify → commit, one sequence at a time."""

    name = "spec"

    def __init__(
        self,
        target: CachedModel,
        drafter: Drafter,
        verifier: Verifier,
        gamma: int,
        eos_ids: frozenset[int],
        policy: DraftLengthPolicy | None = None,
        tree: TreeConfig | None = None,
    ) -> None:
        """``gamma`` caps every round (a tree's depth); ``policy`` picks each round's k (default: always ``gamma``).

        ``tree`` (enabled): every round drafts a token tree (:mod:`spectoolkit.engine.tree_round`); the
        verifier then needs ``verify_tree`` and the drafter ``propose_tree``/``commit_path``.
        """
        self.target = target
        self.drafter = drafter
        self.verifier = verifier
        self.gamma = gamma
        self.eos_ids = eos_ids
        self.policy = policy or FixedPolicy(gamma)
        self.tree = tree if tree is not None and tree.enabled else None
        # The tree rule is one module for every device; the chain's verifier keeps selecting the target-alone token.
        self.tree_verifier = TreeVerifier(getattr(verifier, "sampling", None) or _GREEDY)

    def generate(
        self, prompt_ids: list[int], max_new_tokens: int, generator: torch.Generator | None, on_token=None
    ) -> GenerationOutput:
        """Decode up to ``max_new_tokens`` tokens after ``prompt_ids``; ``on_token(id)`` streams them."""
        out = GenerationOutput()
        start = time.perf_counter()
        self.drafter.begin(prompt_ids)
        first = prefill(self.target, self.verifier, prompt_ids, generator, out, start, on_token)
        tokens = list(prompt_ids) + [first]  # verified tokens; the last one is pending (no KV)
        key = object()  # this request, to the policy
        try:
            while not finished(out.output_ids, max_new_tokens, self.eos_ids):
                room = max_new_tokens - len(out.output_ids)
                if self.tree is not None:
                    emitted = tree_round(self, tokens, room, generator, out)
                else:
                    emitted = self._round(key, tokens, room, generator, out)
                tokens.extend(emitted)
                out.output_ids.extend(emitted)
                if on_token:
                    for token in emitted:
                        on_token(token)
        finally:
            self.policy.release(key)
        synchronize(self.target.device)
        out.total_time = time.perf_counter() - start
        out.overhead_time = out.total_time - out.prefill_time - out.draft_time - out.verify_time
        return out

    def kv_bytes(self) -> dict[str, int]:
        return {"target_kv_bytes": self.target.cache.allocated_bytes(), "draft_kv_bytes": self.drafter.kv_bytes()}

    def _round(
        self, key: object, tokens: list[int], room: int, generator: torch.Generator | None, out: GenerationOutput
    ) -> list[int]:
        """One draft/verify round; returns the tokens to emit (already cut at EOS and ``room``)."""
        t0 = time.perf_counter()
        cap = min(self.gamma, room - 1)  # the round always emits one target token on top
        budget = self.policy.choose([key], [cap], 1, cap)[0] if cap > 0 else 0
        proposal = self.drafter.propose(tokens, budget, generator) if budget > 0 else _EMPTY
        synchronize(self.target.device)
        t1 = time.perf_counter()
        logits = self.target.forward([tokens[-1], *proposal.draft_ids])  # [k+1, V]
        synchronize(self.target.device)
        t2 = time.perf_counter()
        draft_ids = torch.tensor(proposal.draft_ids, dtype=torch.long, device=logits.device)  # [k]
        result = self.verifier.verify(draft_ids, logits, proposal.draft_probs, generator)
        kept = len(tokens) + result.num_accepted  # prefix + pending + accepted drafts have KV
        self.target.truncate(kept)
        t3 = time.perf_counter()  # acceptance test + KV commit: overhead (C), the rest of the round
        self.drafter.rollback(kept)
        t4 = time.perf_counter()
        out.draft_time += t1 - t0 + (t4 - t3)
        out.verify_time += t2 - t1
        _count(out, len(proposal), result.num_accepted)
        out.chosen_lengths.append(budget)
        self.policy.observe(key, budget, len(proposal), result.num_accepted)
        self.policy.observe_step(1 + len(proposal), len(proposal), t3 - t1, t1 - t0 + (t4 - t3))
        return cut(proposal.draft_ids[: result.num_accepted] + [result.next_token], room, self.eos_ids)


def _count(out: GenerationOutput, drafted: int, accepted: int) -> None:
    out.verify_rounds += 1
    out.drafted_tokens += drafted
    out.accepted_tokens += accepted
    out.proposed_rounds += drafted > 0
    out.rollback_count += accepted < drafted
    out.accept_lengths.append(accepted)
    out.draft_lengths.append(drafted)


_EMPTY = Proposal([], None)
_GREEDY = SamplingConfig(temperature=0.0)
