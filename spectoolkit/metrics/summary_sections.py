"""Typed sections of ``summary.json`` that the runner adds beside the statistics: the cost model of each
drafting arm and its check against a gamma sweep, the distribution of the draft length k per round, the
greedy exactness verdict, the quantization quality, the stock-baseline check, the cost per output token and
the run conditions.

Read with :func:`spectoolkit.metrics.tolerant.from_mapping` through ``Summary.from_dict``: a missing or
wrong-typed field is None (or empty), never an exception. Times are seconds, memory is bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class CostModel:
    """One drafting arm's cost model (DESIGN §1, :func:`spectoolkit.metrics.cost_model.cost_model_for_arm`).

    ``recommended_gamma`` is the best γ of the measured range 1..``measured_gamma_max`` (the arm's own γ;
    a gamma sweep's largest), ``extrapolated_gamma`` the best γ above it: predicted, not measured. An arm
    whose ``policy`` is not "fixed" varies k per round: its fixed-γ what-ifs (``predicted_by_gamma``,
    ``recommended_gamma``, ``extrapolated_gamma``, ``break_even_alpha``) are None / empty.
    """

    policy: str | None = None  # the draft-length policy; None: a summary from before policies (fixed)
    t1: float | None = None  # one target-alone decode step
    draft_step: float | None = None  # D, per drafted token
    verify: dict[int, float] = field(default_factory=dict)  # V: verify width -> seconds (JSON: str keys)
    overhead: float | None = None  # C, per round
    prefill: float | None = None  # P, mean per request
    mean_output_len: float | None = None
    expected_tokens: float | None = None  # E[N] per round
    round_cost: float | None = None
    predicted_decode_speedup: float | None = None
    predicted_speedup: float | None = None  # whole request, prefill included
    measured_speedup: float | None = None
    prediction_error: float | None = None  # predicted / measured - 1
    break_even_alpha: float | None = None
    measured_gamma_max: int | None = None  # recommended_gamma is searched over 1..this
    recommended_gamma: int | None = None
    recommended_speedup: float | None = None  # predicted at recommended_gamma
    recommended_source: str | None = None  # the arm whose measured rounds, truncated, predict it
    extrapolated_gamma: int | None = None  # the best γ above measured_gamma_max: predicted, not measured
    extrapolated_speedup: float | None = None
    predicted_by_gamma: dict[int, float] = field(default_factory=dict)  # γ -> predicted_speedup
    verify_measured_mean: float | None = None


@dataclass
class GammaCheck:
    """One cost-model prediction of a gamma sweep beside its measurement (``metrics.gamma_validation``): the
    rounds of ``source_arm`` (run at ``source_gamma``) predict the speedup at ``gamma``, which ``arm`` ran."""

    source_arm: str | None = None
    source_gamma: int | None = None
    arm: str | None = None
    gamma: int | None = None
    kind: str | None = None  # "truncation" (gamma <= source_gamma: exact) or "extrapolation"
    predicted_speedup: float | None = None
    measured_speedup: float | None = None  # arm's net throughput / its reference's
    error: float | None = None  # predicted / measured - 1


@dataclass
class KDistribution:
    """Verify rounds by the draft length k their policy chose (:mod:`spectoolkit.metrics.draft_lengths`)."""

    rounds: int | None = None
    counts: list[int] = field(default_factory=list)  # [γ+1] rounds at k = 0..γ
    mean_k: float | None = None
    zero_share: float | None = None  # rounds at k = 0 / rounds
    mean_proposed: float | None = None  # drafted tokens per round (at most k: the drafter may stop early)


@dataclass
class ArmKDistribution:
    """One drafting arm's distribution of k: overall, per task type, per load level (serving runs)."""

    gamma: int | None = None  # the most a round could draft
    source: str | None = None  # "chosen_lengths", or "draft_lengths" (records before schema 4), or "mixed"
    overall: KDistribution = field(default_factory=KDistribution)  # every round of the arm
    by_task_type: dict[str, KDistribution] = field(default_factory=dict)
    by_load_level: dict[str, KDistribution] = field(default_factory=dict)  # level key -> (serving runs)


@dataclass
class TreeArm:
    """One drafting arm's rounds in a token-tree run (:mod:`spectoolkit.metrics.trees`)."""

    tree: str | None = None  # "static[3,2,1,1]/8", "dynamic(top_k=4)/8"; None for a chain
    rounds: int | None = None
    verify_width: int | None = None  # most rows one verify forward scored (nodes + 1)
    mean_nodes: float | None = None
    mean_depth: float | None = None
    mean_accepted: float | None = None  # K: accepted drafts per round
    mean_accept_length: float | None = None  # K + 1
    accepted_counts: list[int] = field(default_factory=list)  # rounds with K = 0, 1, …


@dataclass
class ExactnessArm:
    """The greedy exactness counts of one drafting arm against its reference arm."""

    verdict: str | None = None
    pairs: int | None = None
    identical: int | None = None
    divergent_pairs: int | None = None
    divergent_share: float | None = None  # divergent_pairs / pairs
    near_ties: int | None = None  # divergences the target alone reproduced
    unexplained: int | None = None
    threshold: float | None = None  # dtype-aware top-2 logit margin of a rounding flip (information only)


@dataclass
class DivergenceEntry:
    """One diverging (case, repeat) as written by :class:`spectoolkit.eval.exactness.Divergence`."""

    arm: str | None = None
    case_id: str | None = None
    repeat_idx: int | None = None
    position: int | None = None  # output token index of the first difference
    reference_token: int | None = None
    spec_token: int | None = None
    margin: float | None = None  # None: not examined
    threshold: float | None = None
    classification: str | None = None  # near_tie only when reproduced
    flip_width: int | None = None  # records without rounds: the k-token forward that emits the spec token
    replayed_token: int | None = None  # the target alone's token in the replayed spec round
    replay_round: int | None = None  # 0: prefill, r >= 1: verify round r; None: not replayed
    replay_window_start: int | None = None  # absolute position of the round's pending token
    replay_width: int | None = None  # k_r + 1 (prefill: the prompt length)
    reproduced: bool | None = None  # the target alone emitted the spec token there


@dataclass
class Exactness:
    """The ``exactness`` section of a greedy run: verdict over every drafting arm, per-arm counts."""

    verdict: str | None = None
    passed: bool | None = None
    pairs: int | None = None
    identical: int | None = None
    divergent_pairs: int | None = None
    divergent_share: float | None = None  # above max_tie_share, reproduced divergences fail as "by rounding"
    max_tie_share: float | None = None
    near_ties: int | None = None
    unexplained: int | None = None
    divergences: list[DivergenceEntry] = field(default_factory=list)
    arms: dict[str, ExactnessArm] = field(default_factory=dict)


@dataclass
class QuantQuality:
    """The quantized target against its float reference (``eval.quality_section``), or the error."""

    reference: str | None = None
    quantized: str | None = None
    kl_mean: float | None = None
    top1_agreement: float | None = None
    ppl_ref: float | None = None
    ppl_quant: float | None = None
    ppl_delta: float | None = None
    positions: int | None = None
    texts: int | None = None
    error: str | None = None  # the measurement failed; the run was kept


@dataclass
class BaselineCheck:
    """Our baseline arm against stock transformers ``generate`` (``bench.protocol.baseline_check``).

    Tokens/s = output tokens / wall time of the call, prefill included; ``ratio`` = ours / stock.
    """

    stock_tokens_per_s: float | None = None
    baseline_tokens_per_s: float | None = None
    ratio: float | None = None
    prompts: int | None = None  # run prompts timed
    max_new_tokens: int | None = None
    stock: str | None = None  # how the stock side ran: transformers version, attention, precision
    skipped: str | None = None  # why no stock counterpart was timed (e.g. our own rtn-* format)
    error: str | None = None  # the stock side failed; the run was kept
    seconds: float | None = None  # wall time of the whole check (bounded: bench.protocol.baseline_check)
    # A run with a draft model: stock assisted generation (``generate(assistant_model=<stock draft>)``) beside our
    # primary speculative arm, on the same prompts, interleaved with the two above.
    spec_arm: str | None = None
    spec_tokens_per_s: float | None = None  # ours: the primary speculative arm
    assisted_tokens_per_s: float | None = None  # stock transformers assisted generation
    assisted: str | None = None  # how the stock draft ran
    assisted_skipped: str | None = None  # why assisted generation was not timed


@dataclass
class TokenCostEntry:
    """One arm (at one load level) priced: :func:`spectoolkit.metrics.token_cost.cost_entry`."""

    output_throughput: float | None = None  # output tokens/s the cost rests on
    cost_per_million_output_tokens: float | None = None  # in the currency of bench.cost_per_hour
    reference: str | None = None  # the arm the change is against; None: target alone
    change: float | None = None  # cost / the reference's cost - 1 (negative: cheaper)


@dataclass
class TokenCost:
    """``token_cost``: the cost per 1M output tokens at ``bench.cost_per_hour`` (``metrics.token_cost``)."""

    cost_per_hour: float | None = None  # price of one hour of this machine; None: the run was not priced
    arms: dict[str, TokenCostEntry] = field(default_factory=dict)  # batch-1 runs
    by_level: dict[str, dict[str, TokenCostEntry]] = field(default_factory=dict)  # serving: arm -> level key ->


@dataclass
class ConfiguredArm:
    """One arm as configured for the run (conditions.arms), measured or not."""

    name: str | None = None
    target_precision: str | None = None
    drafter: str | None = None
    gamma: int | None = None
    policy: str | None = None  # the draft-length policy ("fixed", "adaptive", ...); None: before policies
    reference: str | None = None


@dataclass
class ArmMemory:
    """Weights + KV footprint of one arm, and its difference from the baseline's."""

    target_weight_bytes: int | None = None
    draft_weight_bytes: int | None = None
    target_kv_bytes: int | None = None
    draft_kv_bytes: int | None = None
    total_bytes: int | None = None
    delta_bytes: int | None = None
    target_streamed_bytes: int | None = None  # weights a decode step reads (linears and head)
    draft_streamed_bytes: int | None = None


@dataclass
class Memory:
    """conditions.memory: the primary arm's parts, its delta vs the baseline, and every arm's footprint."""

    target_weight_bytes: int | None = None
    draft_weight_bytes: int | None = None
    target_kv_bytes: int | None = None
    draft_kv_bytes: int | None = None
    memory_delta_bytes: int | None = None
    target_streamed_bytes: int | None = None  # weights a target decode step reads (linears and head)
    draft_streamed_bytes: int | None = None
    stream_bandwidth_gbs: float | None = None  # read bandwidth measured in the run's process (CPU)
    target_step_floor_ms: float | None = None  # target_streamed_bytes / stream_bandwidth_gbs
    arms: dict[str, ArmMemory] = field(default_factory=dict)


@dataclass
class Conditions:
    """What every number of the run holds under. The recorded environment and configuration groups
    (hardware, software, target, ...) stay free-form ``key -> value`` objects: the report lists them as
    written; the parts the report computes with are typed."""

    hardware: dict[str, Any] = field(default_factory=dict)
    software: dict[str, Any] = field(default_factory=dict)
    target: dict[str, Any] = field(default_factory=dict)
    draft: dict[str, Any] = field(default_factory=dict)
    kv: dict[str, Any] = field(default_factory=dict)
    compat: dict[str, Any] | None = None
    arms: list[ConfiguredArm] = field(default_factory=list)
    primary_arm: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    gamma: int | None = None
    policy: str | None = None  # speculate.policy
    batch_size: int | None = None
    concurrency: int | None = None
    workload: dict[str, Any] = field(default_factory=dict)
    bench: dict[str, Any] = field(default_factory=dict)
    serve: dict[str, Any] = field(default_factory=dict)  # ServeConfig (SLOs); empty before it was recorded
    memory: Memory = field(default_factory=Memory)
    compat_warnings: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)  # what the run does less than its settings say (config_checks)
    backend: dict[str, Any] = field(default_factory=dict)  # serving on servers: kind, URLs, how they were started
    servers: dict[str, Any] = field(default_factory=dict)  # arm -> what its server reports about itself
