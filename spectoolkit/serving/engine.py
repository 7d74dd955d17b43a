"""Continuous batching with speculation: one engine for batch 1 and batch B (issue 15).

A step: the scheduler plans who runs (:mod:`~spectoolkit.serving.scheduler`), the blocks for every
sequence's tokens and candidates are reserved, the drafter proposes k_i <= the planned drafts for each
decoding sequence, and one target forward (:class:`~spectoolkit.runtime.eager.EagerRunner` over a
:class:`~spectoolkit.runtime.step.StepBatch`) scores every
sequence's pending token + drafts and every prefill chunk. Then, per sequence (DESIGN §2): the verifier
accepts K_i drafts and emits one correction/bonus token; the target keeps KV for prefix + pending +
accepted (``num_computed = len(tokens) + K_i``) and frees the blocks past it; the drafter is told the
same length. A sequence whose logits are not finite fails alone; finished sequences leave at once and
queued ones join at the next step. With no drafter (or under load control) the same loop is plain
continuous-batching decode, which is the baseline.

Per request (a :class:`~spectoolkit.serving.api.ServeRequest` with its own ``sampling``, ``draft_cap``, ``after``):
its rule is chosen once at submit and each of its rows is verified by it (:mod:`~spectoolkit.serving.rounds`);
its drafts per round stay within its cap (0: plain decode for it alone); a sample of n > 1 starts once its leader
computed their prompt and shares those blocks. Finished requests' full blocks stay in the prefix cache when the
allocator keeps one (``serve.prefix_caching``): a later request with the same prefix starts after it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from spectoolkit.drafting.base import Budget, Drafter, Upkeep
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.policy.base import DraftLengthPolicy, FixedPolicy, Prediction
from spectoolkit.runtime.blocks import BlockAllocator, BlockTable
from spectoolkit.runtime.runner import Runner, synchronize
from spectoolkit.runtime.step import Segment, build_step, tree_layout
from spectoolkit.sampling import SamplingError, SamplingParams
from spectoolkit.serving.api import FinishedRequest, ServeRequest, StepStats, cut
from spectoolkit.serving.counters import EngineCounters
from spectoolkit.serving.rounds import (
    VerifierFor,
    default_rule,
    emitted_logprobs,
    request_rule,
    unsupported,
    verify_round,
)
from spectoolkit.serving.scheduler import Plan, Scheduler, SchedulerLimits, Work
from spectoolkit.serving.sequence import Rule, Sequence, new_sequence
from spectoolkit.verify.base import Verifier
from spectoolkit.verify.tree import TreeVerifier

_NO_DRAFTS = TokenTree([], [])


def finite_rows(logits: torch.Tensor) -> list[bool]:
    """Whether each row of ``logits`` [R, V] is finite throughout. A row's sum is NaN or ±inf wherever the row holds a
    NaN or an inf, so a finite sum proves the row finite: one vectorised reduction (0.03 ms for 4 rows of a 152k
    vocabulary, against 0.6 ms for ``isfinite(logits).all``, a step's 1-2% at concurrency 1-4). A row whose sum is not
    finite, which finite values can also give past fp32's range, is checked element by element."""
    sums = logits.sum(dim=-1).isfinite().tolist()
    return [ok or bool(torch.isfinite(logits[row]).all()) for row, ok in enumerate(sums)]


def _at_width(predicted: Prediction | None, tokens: int) -> float | None:
    """The policy's T_B at the ``tokens`` a step ran (its drafters may propose fewer than it planned)."""
    if predicted is None or not predicted.curve:
        return None
    return predicted.curve[max(0, min(tokens - predicted.fixed_tokens, len(predicted.curve) - 1))]


@dataclass
class Rounds:
    """What a step's verified rounds gave: output tokens emitted, and per round drafts proposed and kept."""

    emitted: int = 0
    drafted: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)


NON_FINITE = "the target produced non-finite logits for this request (NaN/inf)"


class ContinuousEngine:
    """Serves many requests at once on ``runner`` (a target model over its paged pool)."""

    def __init__(
        self,
        name: str,
        runner: Runner,
        allocator: BlockAllocator,
        verifier: Verifier,
        limits: SchedulerLimits,
        eos_ids: frozenset[int],
        max_positions: int,
        drafter: Drafter | None = None,
        stochastic: bool = False,
        invariant: bool = False,
        policy: DraftLengthPolicy | None = None,
        verifier_for: VerifierFor | None = None,
    ) -> None:
        """Decoding sequences draft up to the planned drafts nodes (a tree drafter: within its depth and the
        sequence's room), verified in the same ragged forward as everything else of the step. ``verifier`` is the
        rule of requests without sampling of their own; ``verifier_for(sampling)`` gives the others theirs (default:
        :func:`~spectoolkit.kernels.verifier.make_verifier` on the runner's device)."""
        self.runner, self.model, self.pool = runner, runner.model, runner.pool
        self.name, self.allocator = name, allocator
        self.verifier, self.drafter, self.eos_ids = verifier, drafter, eos_ids
        # Our kernels compute every row by itself (runner.row_exact): batch invariance then holds whatever was asked.
        self.max_positions, self.stochastic = max_positions, stochastic
        self.invariant = invariant or runner.row_exact
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.trees = drafter is not None and drafter.tree is not None  # drafts are tree nodes, not a chain
        # A drafter that reads the target's states (an EAGLE head): the layers whose input states each forward returns.
        self.capture: tuple[int, ...] = drafter.capture if drafter is not None else ()
        # The one holder of how many nodes, and how deep, a round drafts (none without a drafter).
        self.policy = policy if drafter is not None and policy is not None else FixedPolicy(0)
        if drafter is not None and policy is None:
            raise ValueError("an engine with a drafter needs its draft-length policy (spectoolkit.policy.make_policy)")
        backlog = drafter.backlog if drafter is not None else None
        ahead = self._propose if drafter is not None and drafter.ahead else None  # a lookup: proposed before the plan
        self.scheduler = Scheduler(limits, allocator, self.policy, self.trees, backlog, ahead)
        self.on_step: Callable[[StepStats], None] | None = None
        # (request id, new output ids, their TokenLogprobs when the request asked) per step
        self.on_emit: Callable[[str, list[int], list | None], None] | None = None
        self.counters = EngineCounters()
        self.scheduler.on_admit = self._admitted
        self._failed: list[FinishedRequest] = []
        self._steps = 0
        self.peak_kv_tokens = 0  # the most KV slots the running sequences held at once (a shared prefix per holder)
        self.peak_draft_kv_bytes = 0  # the most bytes the drafter's KV held at a target forward
        self.tree_verifier = TreeVerifier(verifier.sampling)
        self.default_rule = default_rule(verifier, self.tree_verifier, stochastic)
        self.verifier_for = verifier_for or (lambda sampling: make_verifier(sampling, runner.device))

    # ---- the ServingEngine protocol ------------------------------------------------------------

    def submit(self, request: ServeRequest) -> None:
        if request.arrival is None:
            request.arrival = time.perf_counter()
        reason = self._reject_reason(request)
        if reason:
            failed = FinishedRequest(request.request_id, error=reason, arrival=request.arrival)
            failed.finish, failed.prompt_len = time.perf_counter(), len(request.prompt_ids or [])
            self._failed.append(failed)
            self.counters.failed_requests += 1
            return
        seq = new_sequence(request, BlockTable(self.allocator), -1, self._rule(request))
        if request.after is not None:
            seq.leader = self._find(request.after)
        self.scheduler.queue.append(seq)

    def _admitted(self, seq: Sequence) -> None:
        """``seq`` joined the running batch with ``num_computed`` positions shared from the prefix index."""
        self.counters.count_admission(len(seq.tokens), seq.num_computed)
        if not seq.result.batch_sizes:  # its first admission (a preempted one's recompute is not its prompt's)
            seq.result.cached_tokens = seq.num_computed

    def _rule(self, request: ServeRequest) -> Rule:
        """The request's rule, chosen once: its own sampling's, or the engine's."""
        if request.sampling is None:
            return self.default_rule
        return request_rule(request.sampling, self.verifier_for)

    def _find(self, request_id: str) -> Sequence | None:
        scheduler = self.scheduler
        return next((s for s in [*scheduler.queue, *scheduler.running] if s.request.request_id == request_id), None)

    def has_work(self) -> bool:
        return bool(self.scheduler.queue or self.scheduler.running or self._failed)

    def reset(self) -> None:
        """Drop every request and free all KV, the prefix cache's too (no later run inherits this one's KV)."""
        for seq in list(self.scheduler.running) + list(self.scheduler.queue):
            seq.done = True
            seq.table.release()
            self.policy.release(seq)
            if self.drafter is not None:
                self.drafter.release(seq)
        self.scheduler.running.clear()
        self.scheduler.queue.clear()
        self._failed.clear()
        self.allocator.drop_cached()
        if self.drafter is not None:
            self.drafter.reset()

    def abort(self, request_id: str) -> bool:
        """Drop ``request_id`` (queued or running) and free its KV now; False when it is not here."""
        scheduler = self.scheduler
        seq = self._find(request_id)
        if seq is None:
            return False
        seq.done = True
        if seq in scheduler.running:
            scheduler.finish(seq)
        else:
            scheduler.queue.remove(seq)
            seq.table.release()
        self._forget(seq)
        self.policy.release(seq)
        self.counters.aborted_requests += 1
        return True

    def step(self) -> list[FinishedRequest]:
        """One scheduler step: plan, draft, one target forward, verify and commit per sequence."""
        finished, self._failed = self._failed, []
        started = time.perf_counter()
        plan = self.scheduler.schedule(self._forget)
        if not plan.work:
            return finished
        reserved = sum(work.drafts for work in plan.work)
        prefill = sum(work.feed for work in plan.work if not work.seq.decoding)  # before anything commits
        before = self.drafter.upkeep() if self.drafter is not None else Upkeep()
        proposals = self._draft(plan)
        after = self.drafter.upkeep() if self.drafter is not None else Upkeep()
        upkeep_seconds, upkeep_rows = after.seconds - before.seconds, after.rows - before.rows
        forward_start = time.perf_counter()
        draft_time = forward_start - started
        logits, states, firsts = self._forward(plan.work, proposals)  # [R, V], [T, n*E] or None, rows of each work
        forward_time = time.perf_counter() - forward_start
        held = sum(len(work.seq.table.blocks) for work in plan.work)  # candidates' blocks included, before commit
        self.peak_kv_tokens = max(self.peak_kv_tokens, held * self.allocator.block_size)
        if self.drafter is not None:
            self.peak_draft_kv_bytes = max(self.peak_draft_kv_bytes, self.drafter.kv_bytes())
        finite = finite_rows(logits)  # [R]: one check for the whole step
        now = time.perf_counter()
        row, emitted_before, rounds = 0, self.counters.generation_tokens, Rounds()
        for index, (work, proposal) in enumerate(zip(plan.work, proposals, strict=True)):
            seq = work.seq
            seq.result.batch_sizes.append(len(plan.work))
            if seq.result.scheduled is None:
                seq.result.scheduled = started
            reaches_end = seq.num_computed + work.feed == len(seq.tokens)
            fed = None if states is None else states[firsts[index] : firsts[index + 1]]  # [feed + nodes, n*E]
            if not reaches_end:  # a prefill chunk: nothing to emit yet
                if fed is not None:
                    self.drafter.keep_states(seq, seq.num_computed, fed)
                seq.num_computed += work.feed
                seq.table.publish_committed(seq.tokens, seq.num_computed)
                continue
            rows = logits[row : row + 1 + len(proposal)]  # [k+1, V]
            ok = all(finite[row : row + 1 + len(proposal)])
            row += 1 + len(proposal)
            known = len(seq.result.accept_lengths)
            done = self._commit(seq, work, proposal, rows, now, fed) if ok else self._fail(seq, NON_FINITE, now)
            if len(seq.result.accept_lengths) > known:  # a verified round (not a prefill's first token)
                rounds.drafted.append(len(proposal))
                rounds.accepted.append(seq.result.accept_lengths[-1])
            if done is not None:
                finished.append(done)
        if not prefill:  # a step with prefill chunks says little about the cost of drafts
            self._learn(plan.work, proposals, started, draft_time, upkeep_seconds)
        if upkeep_rows:
            self.policy.observe_catch_up(upkeep_rows, upkeep_seconds)
        rounds.emitted = self.counters.generation_tokens - emitted_before
        self._report(plan, reserved, prefill, started, draft_time, forward_time, len(finished), rounds)
        return finished

    def _learn(
        self, works: list[Work], proposals: list[TokenTree], started: float, draft_time: float, upkeep: float
    ) -> None:
        """Tell the draft-length policy, and the drafter, what this step cost: its tokens, draft forwards (one per
        depth; none for a drafter that proposes ahead, whose proposals were made before the plan whatever it chose:
        priced per depth, the step's whole scheduling and lookup time made each drafted position look 0.3-0.9 ms dear
        at c4) and times (``upkeep``: the part of ``draft_time`` a drafter spent feeding backlogs, priced apart per
        row)."""
        tokens = sum(work.feed + len(proposal) for work, proposal in zip(works, proposals, strict=True))
        forwards = 0
        if self.scheduler.ahead is None:
            forwards = max((max(proposal.depths(), default=0) for proposal in proposals), default=0)
        drafting = sum(1 for proposal in proposals if len(proposal))  # a batched draft forward's rows
        target = time.perf_counter() - started - draft_time  # the forward, and verifying and committing its rows
        self.policy.observe_step(tokens, forwards, target, draft_time - upkeep, len(works), drafting)
        if self.drafter is not None:  # the same seconds: a hybrid priced its rows by the forward alone (issue 57)
            self.drafter.observe_step(tokens, target, len(works))

    # ---- the parts of a step ------------------------------------------------------------------

    def _draft(self, plan: Plan) -> list[TokenTree]:
        """Each work's proposal: the one the scheduler holds (a drafter that proposes ahead), else proposed now
        within its planned drafts."""
        later = [work for work in plan.work if work.proposal is None]
        made = iter(self._propose([work.seq for work in later], [work.drafts for work in later]))
        return [next(made) if work.proposal is None else work.proposal for work in plan.work]

    def _propose(self, seqs: list[Sequence], nodes: list[int]) -> list[TokenTree]:
        """One proposal per sequence of ``seqs``, ``nodes`` each at most (0: an empty tree, the drafter not asked), as
        deep as the policy and each one's room and cap allow."""
        proposals = [_NO_DRAFTS] * len(seqs)
        asked = [i for i, n in enumerate(nodes) if n > 0]
        if asked and self.drafter is not None:
            depth = self.policy.max_depth
            budgets = [Budget(nodes[i], seqs[i].draft_cap(min(depth, seqs[i].room - 1))) for i in asked]
            for i, proposal in zip(asked, self.drafter.propose([seqs[i] for i in asked], budgets), strict=True):
                proposals[i] = proposal
        return proposals

    def _forward(self, works: list[Work], proposals: list[TokenTree]):
        """One target forward over every work's rows: (logits [R, V], the captured states [T, n*E] or None (no
        ``capture``), the first row of each work and the total [len(works) + 1])."""
        segments = []
        for work, proposal in zip(works, proposals, strict=True):
            seq = work.seq
            feed = seq.tokens[seq.num_computed : seq.num_computed + work.feed]
            rows, tree = [], None
            if seq.num_computed + work.feed == len(seq.tokens):  # its last token is fed: logits wanted
                if not proposal.is_chain():  # rows: a chain, then the tree
                    parents = list(range(-1, work.feed - 1)) + [work.feed + p for p in proposal.parents]
                    tree = tree_layout(parents, seq.num_computed)
                feed = feed + proposal.token_ids
                rows = list(range(work.feed - 1, len(feed)))
            segments.append(Segment(seq.table, feed, seq.num_computed, rows, tree))
        batch = build_step(segments, self._row_mode(len(segments)), self.runner.device)
        if self.capture:
            logits, states = self.runner.forward_states(batch, self.capture)
        else:
            logits, states = self.runner.forward(batch), None
        synchronize(logits.device)
        return logits, states, batch.query_starts

    def _row_mode(self, num_seqs: int) -> str:
        """``invariant`` (``serve.batch_invariant``, or a runner whose rows are exact by construction, where every
        mode computes the same); else a lone sequence runs ``chosen`` (its verify rows compute
        as its decode steps: batch 1 exact) and a batched step ``plain`` (one call for all rows)."""
        if self.invariant:
            return "invariant"
        return "chosen" if num_seqs == 1 else "plain"

    def _commit(self, seq: Sequence, work: Work, proposal: TokenTree, rows: torch.Tensor, now: float,
                states: torch.Tensor | None = None):  # fmt: skip
        """Verify ``seq``'s rows [k+1, V], emit and keep its accepted path; its result when it is done. ``states``:
        the captured states of every row it fed (its feed, then its nodes), for a drafter that reads them."""
        first = len(seq.tokens) == seq.prompt_len
        prefix = len(seq.tokens)
        path, next_token = verify_round(seq, proposal, rows)  # by the request's own rule
        if len(proposal) and not proposal.is_chain():
            # The path's KV moves next to the pending token (node i was written at position prefix + i).
            sources = seq.table.slots_at([prefix + node for node in path])
            self.pool.move(sources, seq.table.slots(prefix, prefix + len(path)))
        accepted, accepted_ids = len(path), [proposal.token_ids[node] for node in path]
        kept = prefix + accepted  # prefix + pending + accepted drafts have KV
        emitted = cut(accepted_ids + [next_token], seq.room, self.eos_ids)
        if seq.rule.sampling.logprobs is not None:
            seq.result.logprobs += emitted_logprobs(rows, path, emitted, seq.rule.sampling.logprobs)
        seq.tokens.extend(emitted)
        if states is not None:  # the kept rows' states: the feed, then the accepted path's nodes
            kept_rows = list(range(work.feed)) + [work.feed + node for node in path]
            self.drafter.keep_states(seq, seq.num_computed, states[kept_rows])
        seq.num_computed = kept
        seq.table.truncate(kept)
        seq.table.publish_committed(seq.tokens, min(kept, len(seq.tokens)))
        if self.drafter is not None:
            self.drafter.commit(seq, prefix, path)
        self._count(seq, first, work, proposal, path, emitted, now)
        if seq.room <= 0 or emitted[-1] in self.eos_ids:
            return self._finish(seq, now)
        return None

    def _count(self, seq: Sequence, first: bool, work: Work, proposal: TokenTree, path, emitted, now) -> None:
        result = seq.result
        result.token_times.extend([now] * len(emitted))
        self.counters.generation_tokens += len(emitted)
        if self.on_emit is not None:
            logprobs = result.logprobs[-len(emitted) :] if seq.rule.sampling.logprobs is not None else None
            self.on_emit(seq.request.request_id, emitted, logprobs)
        if first:
            self.counters.prompt_tokens += seq.prompt_len
            return  # the prefill's token: not a verify round
        result.verify_rounds += 1
        accepted = len(path)
        self.counters.count_round(len(proposal), accepted)
        if self.drafter is not None:
            depth = max(proposal.depths(), default=0)
            result.drafted_tokens += len(proposal)
            result.accepted_tokens += accepted
            result.proposed_rounds += len(proposal) > 0
            result.rollback_count += accepted < depth
            result.draft_lengths.append(len(proposal))
            result.accept_lengths.append(accepted)
            result.chosen_lengths.append(work.drafts)
            if self.trees:  # every round of a tree arm, an empty one included (depth 0)
                result.tree_depths.append(depth)
            self.policy.observe(seq, work.drafts, len(proposal), accepted, path, depth)

    def _finish(self, seq: Sequence, now: float) -> FinishedRequest:
        seq.done = True
        self.counters.finished_requests += seq.result.error is None
        self.counters.count_request(seq.result)
        self.counters.preemptions += seq.result.preemptions
        self.scheduler.finish(seq)
        self._forget(seq)
        self.policy.release(seq)
        seq.result.output_ids = seq.output_ids
        seq.result.finish = now
        return seq.result

    def _fail(self, seq: Sequence, reason: str, now: float) -> FinishedRequest:
        self.counters.failed_requests += 1
        seq.result.error = reason
        return self._finish(seq, now)

    def _forget(self, seq: Sequence) -> None:
        if self.drafter is not None:
            self.drafter.release(seq)

    def _report(
        self, plan: Plan, reserved: int, prefill: int, started: float, draft_time: float, forward_time: float,
        finished: int, rounds: Rounds,
    ) -> None:  # fmt: skip
        self._steps += 1
        self.counters.steps += 1
        self.counters.step_seconds += time.perf_counter() - started
        self.counters.draft_seconds += draft_time
        if self.on_step is None:
            return
        used = (self.allocator.num_blocks - self.allocator.num_free) * self.allocator.block_size
        predicted = plan.prediction
        self.on_step(StepStats(
            index=self._steps, batch_size=len(plan.work), num_tokens=plan.num_tokens, prefill_tokens=prefill,
            draft_tokens=sum(w.drafts for w in plan.work), reserved_kv_tokens=reserved, used_kv_tokens=used,
            queued=len(self.scheduler.queue), speculating=plan.speculating,
            step_time=time.perf_counter() - started, draft_time=draft_time, finished=finished,
            forward_time=forward_time, emitted_tokens=rounds.emitted, drafted=rounds.drafted, accepted=rounds.accepted,
            predicted_tokens=predicted.tokens if predicted else None,
            predicted_target_seconds=predicted.target_seconds if predicted else None,
            predicted_actual_seconds=_at_width(predicted, plan.num_tokens - reserved + sum(rounds.drafted)),
            predicted_draft_seconds=predicted.draft_seconds if predicted else None,
            acceptance_estimates=predicted.survival if predicted else None,
            prior_strength=predicted.prior_strength if predicted else None,
        ))  # fmt: skip

    def _reject_reason(self, request: ServeRequest) -> str | None:
        """Why ``request`` cannot run at all (it then fails alone), or None."""
        ids = request.prompt_ids
        if not isinstance(ids, list) or not ids:
            return "empty prompt"
        if not all(isinstance(t, int) and 0 <= t < self.vocab_size for t in ids):
            return f"prompt has token ids outside the vocabulary [0, {self.vocab_size})"
        if request.max_new_tokens < 1:
            return f"max_new_tokens={request.max_new_tokens} must be >= 1"
        if request.draft_cap is not None and request.draft_cap < 0:
            return f"draft_cap={request.draft_cap} must be >= 0 (0: no speculation)"
        refused = self.unsupported(request.sampling) if request.sampling is not None else None
        if refused is not None:
            return str(refused)
        needed = len(ids) + request.max_new_tokens - 1  # the last token emitted never needs KV
        if len(ids) + request.max_new_tokens > self.max_positions:
            return (f"prompt of {len(ids)} tokens + max_new_tokens {request.max_new_tokens} exceeds the "
                    f"model's context of {self.max_positions} positions")  # fmt: skip
        capacity = self.allocator.num_blocks * self.allocator.block_size
        if needed > capacity:
            return f"needs {needed} KV slots but the pool holds {capacity}: raise serve.max_kv_tokens"
        return None

    def unsupported(self, sampling: SamplingParams) -> SamplingError | None:
        """Why this engine cannot honour ``sampling`` as asked (its ``field`` named), or None."""
        return unsupported(sampling, self.drafter if self.trees else None)

    def runners(self) -> dict[str, Runner]:
        """The runners this engine drives: the target's, and the draft model's when it drafts with one."""
        return {"target": self.runner} | (self.drafter.runners() if self.drafter is not None else {})

    def peak_kv_bytes(self) -> dict[str, int]:
        """The most KV bytes the running requests held at once (the target's pool, candidates included; a shared
        prefix once per holder) and the most the drafter's KV held at a target forward."""
        return {"target_kv_bytes": self.peak_kv_tokens * self.pool.slot_bytes(),
                "draft_kv_bytes": self.peak_draft_kv_bytes}  # fmt: skip

    def kv_bytes(self) -> dict[str, int]:
        used = (self.allocator.num_blocks - self.allocator.num_free) * self.allocator.block_size
        draft = self.drafter.kv_bytes() if self.drafter is not None else 0
        return {"target_kv_bytes": used * self.pool.slot_bytes(), "draft_kv_bytes": draft}
