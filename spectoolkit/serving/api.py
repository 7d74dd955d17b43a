"""What a serving engine takes and gives back: requests in, finished requests and step stats out.

A load generator (:mod:`spectoolkit.bench.load`) submits :class:`ServeRequest` objects and calls
``step()`` until the engine has no work; each finished request comes back once as a
:class:`FinishedRequest` with its token times, from which TTFT, TPOT and inter-token latencies are
computed. Times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from spectoolkit.sampling import SamplingParams

if TYPE_CHECKING:
    import torch


@dataclass
class ServeRequest:
    """One request as a client sends it."""

    request_id: str  # unique among the requests in the engine at once
    prompt_ids: list[int]  # [L] token ids (may be empty or overlong: the engine fails it alone)
    max_new_tokens: int
    seed: int = 0  # per-request sampling generator seed (a sampled rule)
    arrival: float | None = None  # perf_counter when sent; None: stamped by submit()
    generator: torch.Generator | None = None  # a sampled rule: this generator instead of one seeded with ``seed``
    sampling: SamplingParams | None = None  # its own token rule; None: the engine's (the run's sampling config)
    draft_cap: int | None = None  # at most this many drafts per round (0: no speculation); None: as the policy says
    after: str | None = None  # another sample of the same prompt (n > 1): start once that request computed it


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of an emitted token under the target (raw logits: before penalties and temperature, as
    vLLM reports them), and the ``k`` most likely tokens there."""

    logprob: float
    top: list[tuple[int, float]]  # [(token id, logprob)], most likely first


@dataclass
class FinishedRequest:
    """A request that left the engine: done, or failed alone with ``error``."""

    request_id: str
    output_ids: list[int] = field(default_factory=list)
    error: str | None = None
    arrival: float = 0.0
    scheduled: float | None = None  # first admitted into the running batch (queue time = scheduled - arrival)
    token_times: list[float] = field(default_factory=list)  # [output_len] when each token was emitted
    finish: float = 0.0
    batch_sizes: list[int] = field(default_factory=list)  # running batch size of each step it took part in
    verify_rounds: int = 0  # target forwards after its prefill that emitted tokens for it
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    accept_lengths: list[int] = field(default_factory=list)  # accepted drafts per round with drafts
    draft_lengths: list[int] = field(default_factory=list)  # proposed drafts per round with drafts
    chosen_lengths: list[int] = field(default_factory=list)  # k the draft-length policy planned, per round
    tree_depths: list[int] = field(default_factory=list)  # token trees: each round's tree depth (nodes: draft_lengths)
    proposed_rounds: int = 0  # rounds in which the drafter proposed >= 1 token
    rollback_count: int = 0  # rounds with >= 1 rejected candidate (a tree: the accepted path shorter than its depth)
    preemptions: int = 0  # times its KV was freed and its tokens recomputed
    prompt_len: int = 0
    cached_tokens: int = 0  # prompt positions whose KV it took from the prefix cache at its (first) admission
    sampling: SamplingParams | None = None  # the rule it ran under
    draft_cap: int | None = None  # the drafts per round it asked for at most (None: the policy's)
    logprobs: list[TokenLogprob] = field(default_factory=list)  # [output_len] when its rule asked for logprobs


@dataclass(frozen=True)
class StepStats:
    """One engine step (one target forward over the ragged batch)."""

    index: int
    batch_size: int  # sequences in the forward
    num_tokens: int  # tokens in the forward (pending + drafts + prefill chunks)
    prefill_tokens: int
    draft_tokens: int  # candidate tokens verified this step (their KV is temporary until accepted)
    reserved_kv_tokens: int  # KV slots held for candidates before the forward
    used_kv_tokens: int  # committed KV slots after the step, all sequences
    queued: int  # requests waiting after the step
    speculating: bool  # False: load control fell back to plain decode
    step_time: float  # seconds, drafting included
    draft_time: float
    finished: int
    forward_time: float = 0.0  # seconds of the target forward (the rest of step_time - draft_time: verify, commit)
    emitted_tokens: int = 0  # output tokens the step emitted (a prefill's first token included)
    drafted: list[int] = field(default_factory=list)  # per decoding sequence in step order: drafts proposed
    accepted: list[int] = field(default_factory=list)  # ... and kept
    # The draft-length policy's expectation (issue 57; None: a policy that predicts nothing, e.g. fixed γ), to set
    # beside the measured emitted_tokens, step_time - draft_time and draft_time:
    predicted_tokens: float | None = None  # Σ_i E_i(k_i) of the decoding sequences
    predicted_target_seconds: float | None = None  # T_B(n) on the policy's curve for this batch, n as planned
    predicted_actual_seconds: float | None = None  # ... at the n the step ran (drafters may propose fewer)
    predicted_draft_seconds: float | None = None
    acceptance_estimates: list[list[float]] | None = None  # per decoding sequence: S_1..S_k it used
    prior_strength: float | None = None  # m, the workload prior's pseudo-rounds in each request's estimate


class ServingEngine(Protocol):
    """Continuous batching: submit requests at any time, step until idle."""

    name: str

    def submit(self, request: ServeRequest) -> None:
        """Queue ``request``; it joins the running batch at a later step."""

    def step(self) -> list[FinishedRequest]:
        """Run one scheduler step (one target forward); returns the requests that finished in it."""

    def has_work(self) -> bool:
        """Whether any request is queued or running."""

    def reset(self) -> None:
        """Drop every request and free all KV (between load levels)."""

    def runners(self) -> dict:
        """The model runners it drives, by role (a run's conditions read a compiled runner's graphs)."""

    def peak_kv_bytes(self) -> dict[str, int]:
        """The most KV bytes its requests held at once: ``{"target_kv_bytes": …, "draft_kv_bytes": …}``."""


@dataclass
class GenerationOutput:
    """Counters follow DESIGN §3; times are wall-clock seconds measured inside the loop."""

    output_ids: list[int] = field(default_factory=list)
    ttft: float = 0.0  # request start -> first output token available
    total_time: float = 0.0
    draft_time: float = 0.0  # proposer work (draft forwards, n-gram lookup, draft KV rollback)
    verify_time: float = 0.0  # target forwards after the prefill (baseline: decode steps incl. selection)
    overhead_time: float = 0.0  # the rest: acceptance test, KV commit, loop (total - prefill - draft - verify)
    prefill_time: float = 0.0
    verify_rounds: int = 0  # target forwards after the prefill (baseline: decode steps)
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    rollback_count: int = 0  # rounds with >= 1 rejected draft token
    proposed_rounds: int = 0  # rounds in which the drafter proposed >= 1 token
    accept_lengths: list[int] = field(default_factory=list)  # accepted drafts per round
    draft_lengths: list[int] = field(default_factory=list)  # proposed drafts per round
    chosen_lengths: list[int] = field(default_factory=list)  # k the draft-length policy asked for, per round
    tree_depths: list[int] = field(default_factory=list)  # token trees: each round's tree depth (nodes: draft_lengths)


def cut(new_ids: list[int], room: int, eos_ids: frozenset[int]) -> list[int]:
    """The part of a round's tokens that is emitted: at most ``room`` tokens, up to the first EOS."""
    kept = new_ids[:room]
    for index, token in enumerate(kept):
        if token in eos_ids:
            return kept[: index + 1]
    return kept
