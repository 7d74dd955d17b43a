"""Empirical exactness of stochastic speculative decoding: same tokens, same distribution (DESIGN §1).

One prompt is continued ``samples`` times by the target alone and by the real speculative sampler
(batch-1 arms of the one engine), each run with its own seed. At every output
position the two samples of tokens are compared with a two-sample Pearson chi-square test of
homogeneity; tokens too rare for the chi-square approximation (expected count < 5 in an arm) are
pooled into one "other" category. With ``length`` positions each p-value is compared with
``significance / length`` (Bonferroni), so the whole test rejects a correct sampler with probability
<= ``significance``. Position 0 comes from the prefill in both arms; the later ones are what
speculation produces.

A negative control shows the test has power at the chosen sample size: the same comparison with a
drafter that proposes one token but reports another distribution (:func:`negative_control`: a model
drafter proposing the argmax while reporting the softmax; an n-gram drafter reporting a uniform q
for its deterministic proposal). It must be rejected.

With ``tree=`` (``speculate.tree`` enabled) the speculative arm drafts token trees; its negative
control is then
:func:`~spectoolkit.eval.tree_empirical.tree_negative_control` (siblings taken by rank, reported as
i.i.d. draws), since the chain controls above lie only in ``propose``.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import torch
from scipy import stats

from spectoolkit.config import SamplingConfig, TreeConfig
from spectoolkit.drafting import Budget, Drafter, ModelDrafter, NgramDrafter, TokenTree
from spectoolkit.sampling import SamplingParams, processed_probs
from spectoolkit.serving.one import Engine

MIN_EXPECTED = 5.0  # the usual validity condition of the chi-square approximation
ENDED = -1  # the output stopped (EOS) before this position
_ARM_SEED_STRIDE = 1_000_003  # arms draw from disjoint seed ranges: independent samples


@dataclasses.dataclass(frozen=True)
class ChiSquare:
    """A two-sample test at one position."""

    statistic: float
    dof: int
    p_value: float
    categories: int  # after pooling rare tokens


def pooled_table(first: Counter, second: Counter, min_expected: float = MIN_EXPECTED) -> list[list[int]]:
    """[categories, 2] counts: outcomes whose expected count is < ``min_expected`` in either arm pooled.

    The pooled "other" row is kept when it is itself large enough, else folded into the smallest row.
    """
    totals = first + second
    size_first, size_second = sum(first.values()), sum(second.values())
    smaller_share = min(size_first, size_second) / max(size_first + size_second, 1)
    common = sorted((key for key in totals if totals[key] * smaller_share >= min_expected), key=repr)
    rare = [key for key in totals if totals[key] * smaller_share < min_expected]
    rows = [[first[key], second[key]] for key in common]
    if rare:
        other = [sum(first[key] for key in rare), sum(second[key] for key in rare)]
        if sum(other) * smaller_share >= min_expected or not rows:
            rows.append(other)
        else:
            smallest = min(range(len(rows)), key=lambda index: sum(rows[index]))
            rows[smallest] = [rows[smallest][0] + other[0], rows[smallest][1] + other[1]]
    return rows


def chi_square_homogeneity(rows: list[list[int]]) -> ChiSquare:
    """Pearson chi-square of a [categories, 2] table (no continuity correction); 1 category: p = 1."""
    if len(rows) < 2:
        return ChiSquare(0.0, 0, 1.0, len(rows))
    column_totals = [sum(row[arm] for row in rows) for arm in range(2)]
    total = sum(column_totals)
    statistic = 0.0
    for row in rows:
        row_total = sum(row)
        for arm in range(2):
            expected = row_total * column_totals[arm] / total
            statistic += (row[arm] - expected) ** 2 / expected
    dof = len(rows) - 1
    return ChiSquare(statistic, dof, float(stats.chi2.sf(statistic, dof)), len(rows))


def two_sample_test(first: Counter, second: Counter) -> ChiSquare:
    """Chi-square homogeneity test of two samples of outcomes, rare outcomes pooled."""
    return chi_square_homogeneity(pooled_table(first, second))


class ArgmaxReportingSoftmax:
    """BUG on purpose (negative control): proposes the argmax but reports the softmax it did not sample."""

    greedy = False

    def __init__(self, sampling: SamplingConfig) -> None:
        self.sampling = SamplingParams.of(sampling)

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
        """logits [V] -> (argmax token, processed probs [V])."""
        return int(torch.argmax(logits.float())), processed_probs(logits, self.sampling)


class UniformReportingNgram(NgramDrafter):
    """BUG on purpose (negative control): n-gram proposals reported with a uniform q."""

    def propose(self, seqs, budgets: list[Budget]) -> list[TokenTree]:
        vocab = self.target_vocab_size
        return [TokenTree(t.token_ids, t.parents, torch.full((len(t), vocab), 1.0 / vocab))
                for t in super().propose(seqs, budgets)]  # fmt: skip


def _argmax_control(drafter: ModelDrafter, sampling: SamplingConfig) -> ModelDrafter:
    return ModelDrafter(drafter.runner, ArgmaxReportingSoftmax(sampling), drafter.allocator, drafter.target_vocab_size,
                        drafter.shared_vocab_size, drafter.eos_ids, f"{drafter.name}-argmax-control", None,
                        drafter.tree)  # fmt: skip


def _uniform_control(drafter: NgramDrafter, sampling: SamplingConfig) -> NgramDrafter:
    return UniformReportingNgram(drafter.max_n, drafter.min_n, drafter.target_vocab_size, True, drafter.tree)


# The negative control of each drafter kind: same proposals, a reported distribution they were not drawn from.
NEGATIVE_CONTROLS: dict[type, Callable[[Drafter, SamplingConfig], Drafter]] = {
    ModelDrafter: _argmax_control,
    NgramDrafter: _uniform_control,
}


def negative_control(drafter: Drafter, sampling: SamplingConfig) -> Drafter:
    """A drafter like ``drafter`` (same model / lookup) that lies about its proposal distribution."""
    return control_from(NEGATIVE_CONTROLS, "NEGATIVE_CONTROLS", drafter, sampling)


def control_from(registry: dict, registry_name: str, drafter: Drafter, sampling: SamplingConfig) -> Drafter:
    """The control ``registry`` holds for ``drafter``'s class (or its nearest base), built for ``sampling``."""
    control = next((registry[kind] for kind in type(drafter).__mro__ if kind in registry), None)
    if control is None:
        raise TypeError(f"no negative control for drafter {type(drafter).__name__}: add one to {registry_name}")
    return control(drafter, sampling)


def _position_counts(engine, prompt_ids: list[int], samples: int, length: int, seed: int) -> tuple[list, float | None]:
    """Per output position, token counts over ``samples`` seeded generations (ENDED after EOS); acceptance rate."""
    counts = [Counter() for _ in range(length)]
    drafted = accepted = 0
    for index in range(samples):
        out = engine.generate(prompt_ids, length, torch.Generator().manual_seed(seed + index))
        padded = out.output_ids + [ENDED] * (length - len(out.output_ids))
        for position, token in enumerate(padded[:length]):
            counts[position][token] += 1
        drafted += out.drafted_tokens
        accepted += out.accepted_tokens
    return counts, accepted / drafted if drafted else None


def _compare(baseline: list[Counter], other: list[Counter], threshold: float) -> dict:
    tests = [two_sample_test(first, second) for first, second in zip(baseline, other, strict=True)]
    min_p = min(test.p_value for test in tests)
    positions = [{"position": index, **dataclasses.asdict(test)} for index, test in enumerate(tests)]
    return {"positions": positions, "min_p_value": min_p, "rejected": min_p < threshold}


def engine_exactness(
    engine_for: Callable[[str], Engine],
    prompt_ids: list[int],
    samples: int = 400,
    length: int = 3,
    seed: int = 0,
    significance: float = 1e-3,
    tree: TreeConfig | None = None,
) -> dict:
    """Chi-square tests of baseline vs speculative tokens at each of ``length`` output positions.

    ``engine_for("baseline")`` is the target alone, ``engine_for("spec")`` the sampler under test and
    ``engine_for("control")`` its negative control (batch-1 arms of the one engine:
    :class:`~spectoolkit.serving.one.OneRequestEngine`). Each arm runs ``samples`` generations of
    ``length`` tokens; ``passed`` means no position is rejected at ``significance`` (Bonferroni over
    positions); ``power_shown`` that the control is rejected. ``tree`` (enabled): the speculative arms
    draft token trees."""
    threshold = significance / length
    baseline, _ = _position_counts(engine_for("baseline"), prompt_ids, samples, length, seed)
    arms = {}
    for arm, control in (("spec", False), ("control", True)):
        arm_seed = seed + _ARM_SEED_STRIDE * (2 if control else 1)
        counts, acceptance_rate = _position_counts(engine_for(arm), prompt_ids, samples, length, arm_seed)
        arms[arm] = {**_compare(baseline, counts, threshold), "acceptance_rate": acceptance_rate}
    spec, control = arms["spec"], arms["control"]
    return {
        "positions": spec["positions"],
        "min_p_value": spec["min_p_value"],
        "rejected": spec["rejected"],
        "passed": not spec["rejected"],
        "acceptance_rate": spec["acceptance_rate"],
        "threshold": threshold,
        "significance": significance,
        "samples": samples,
        "length": length,
        "control": control,
        "power_shown": control["rejected"],
        "tree": dataclasses.asdict(tree) if tree is not None and tree.enabled else None,
    }
