"""The typed ``summary.json`` of a run: what :func:`spectoolkit.metrics.summary.summarize` writes and the
report and the sweep table read, by attribute.

``Summary.from_dict`` is tolerant (a wrong-typed or missing field is None or empty, never an
exception) and reads the older shapes too: schema version 1 (no ``schema_version`` key), arms kept at
the top of a group (issue 2), one ``speedup`` for the arm "spec", no ``primary_arm`` ("spec" when it
was measured); before version 3 a cost model's ``recommended_gamma`` was searched over every predicted
γ, and is read as today's (the best of 1..the arm's γ; the best above it as ``extrapolated_gamma``).
Metric definitions: DESIGN §3 and the docstring of :mod:`spectoolkit.metrics.summary`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spectoolkit.metrics.cost_model import recommendation
from spectoolkit.metrics.summary_sections import (
    ArmKDistribution,
    BaselineCheck,
    Conditions,
    CostModel,
    Exactness,
    GammaCheck,
    QuantQuality,
    TokenCost,
    TreeArm,
)
from spectoolkit.metrics.tolerant import from_mapping, num

# 1: no schema_version key (the fields of 2); 3: + k_distribution, gamma_validation, recommended_gamma
# within the measured γ range and extrapolated_gamma beyond it, the arms' draft-length policy.
# An added optional section that older summaries simply lack (baseline_check, mode: serving, token_cost)
# does not bump the version: the tolerant reader gives its default; a changed meaning does.
SUMMARY_SCHEMA_VERSION = 3
BASELINE = "baseline"  # the target-alone arm every speedup is measured against
TIME_PARTS = ("prefill", "draft", "verify", "overhead")  # ArmStats.time_split: parts of total_time


@dataclass
class Quantiles:
    """Request-level quantiles (numpy linear interpolation over all records), seconds."""

    p50: float | None = None
    p95: float | None = None
    p99: float | None = None


@dataclass
class ArmStats:
    """Statistics of one arm's successful records (field order = the JSON key order)."""

    requests: int | None = None
    target_precision: str | None = None
    draft: str | None = None  # the drafter's name, "none" for a target-alone arm
    gamma: int | None = None  # largest draft_len of the arm (0: target alone)
    output_tokens: int | None = None
    drafted_tokens: int | None = None
    accepted_tokens: int | None = None
    acceptance_rate: float | None = None  # α = accepted / drafted
    tokens_per_verify: float | None = None  # E = output tokens / target forwards (prefill included)
    mean_accept_length: float | None = None  # 1 + accepted / rounds
    rollback_rate: float | None = None
    proposal_coverage: float | None = None
    net_throughput: float | None = None  # output tokens / total wall time
    total_time: float | None = None
    time_split: dict[str, float | None] | None = None  # TIME_PARTS -> seconds; None: not recorded
    acceptance_histogram: list[int] = field(default_factory=list)  # [γ+1] rounds that accepted K = 0..γ
    prob_accept_at_least: list[float] = field(default_factory=list)  # [γ] Pr(K >= i), i = 1..γ
    ttft: Quantiles = field(default_factory=Quantiles)
    ttft_nonstreaming: Quantiles = field(default_factory=Quantiles)
    latency: Quantiles = field(default_factory=Quantiles)
    latencies: list[float] = field(default_factory=list)  # every request's total_time, sorted
    reference_arm: str | None = None  # the target-alone arm with the same target (drafting arms)

    @classmethod
    def from_dict(cls, raw: Any) -> ArmStats:
        """Tolerant read; older summaries named the drafter ``drafter``."""
        stats = from_mapping(cls, raw)
        drafter = raw.get("drafter") if isinstance(raw, dict) and "draft" not in raw else None
        if isinstance(drafter, str):
            stats.draft = drafter
        return stats


@dataclass
class GroupStats:
    """Per-arm statistics of a group of records (all, a task type, a length bucket) and each arm's
    speedup against the baseline arm of the same group."""

    arms: dict[str, ArmStats] = field(default_factory=dict)
    speedups: dict[str, float | None] = field(default_factory=dict)

    @classmethod
    def from_dict(cls, raw: Any) -> GroupStats:
        """Tolerant read; older summaries kept the arms at the top of a group and one ``speedup`` for "spec"."""
        raw = raw if isinstance(raw, dict) else {}
        arms = raw.get("arms")
        if not isinstance(arms, dict):  # legacy: an arm is a top-level object with a request count
            arms = {name: stats for name, stats in raw.items() if isinstance(stats, dict) and "requests" in stats}
        speedups = raw.get("speedups")
        if isinstance(speedups, dict):
            speedups = {str(name): num(value) for name, value in speedups.items()}
        else:
            legacy = num(raw.get("speedup"))
            speedups = {"spec": legacy} if legacy is not None else {}
        return cls(
            arms={str(name): ArmStats.from_dict(stats) for name, stats in arms.items() if isinstance(stats, dict)},
            speedups=speedups,
        )


@dataclass
class Summary:
    """``summary.json``: the statistics of :func:`~spectoolkit.metrics.summary.summarize` plus the
    sections the runner adds (cost model, gamma validation, exactness, quantization quality, baseline
    check, token cost, conditions)."""

    schema_version: int = SUMMARY_SCHEMA_VERSION
    complete: bool | None = None  # False: interrupted, the numbers are partial
    requests: int | None = None  # records, errors included
    errors: int | None = None
    error_reasons: list[str] = field(default_factory=list)
    primary_arm: str | None = None  # the arm the headline is about
    speedup: float | None = None  # the primary arm's
    speedups: dict[str, float | None] = field(default_factory=dict)
    greedy_exact_match: float | None = None  # the primary arm's
    exact_match: dict[str, float | None] = field(default_factory=dict)
    arms: dict[str, ArmStats] = field(default_factory=dict)
    by_task_type: dict[str, GroupStats] = field(default_factory=dict)
    task_share: dict[str, float | None] = field(default_factory=dict)
    by_input_len: dict[str, GroupStats] = field(default_factory=dict)
    by_output_len: dict[str, GroupStats] = field(default_factory=dict)
    baseline_repeat_throughput: list[float] = field(default_factory=list)
    baseline_spread: float | None = None  # (max - min) / median over repeats
    cost_model: dict[str, CostModel] = field(default_factory=dict)
    gamma_validation: list[GammaCheck] = field(default_factory=list)  # a gamma sweep's predictions vs measurements
    k_distribution: dict[str, ArmKDistribution] = field(default_factory=dict)  # drafting arm -> k per round
    trees: dict[str, TreeArm] = field(default_factory=dict)  # drafting arm -> nodes/depth/accepted (tree runs only)
    exactness: Exactness | None = None
    quant_quality: QuantQuality | None = None
    baseline_check: BaselineCheck | None = None  # None: bench.baseline_check=false, or an older run
    token_cost: TokenCost | None = None  # cost per 1M output tokens at bench.cost_per_hour; None: an older run
    conditions: Conditions = field(default_factory=Conditions)

    @classmethod
    def from_dict(cls, raw: Any) -> Summary:
        """The summary of a parsed summary.json, any schema version; never raises."""
        raw = raw if isinstance(raw, dict) else {}
        summary = from_mapping(cls, raw)
        overall = GroupStats.from_dict(raw)
        summary.arms, summary.speedups = overall.arms, overall.speedups
        if "schema_version" not in raw:
            summary.schema_version = 1
        if "primary_arm" not in raw:
            summary.primary_arm = "spec" if "spec" in summary.arms else None
        if summary.schema_version < 3:
            _recommend_within_measured(summary)
        return summary


def _recommend_within_measured(summary: Summary) -> None:
    """Cost models written before version 3 (one fixed γ per arm, recommended_gamma over every predicted γ):
    recommended_gamma becomes the best of 1..the arm's γ, the best above it extrapolated_gamma."""
    for name, model in summary.cost_model.items():
        stats = summary.arms.get(name)
        if model.measured_gamma_max is None and stats is not None and stats.gamma and model.predicted_by_gamma:
            for key, value in recommendation(model.predicted_by_gamma, stats.gamma).items():
                setattr(model, key, value)
            model.recommended_source = name if model.recommended_gamma is not None else None
