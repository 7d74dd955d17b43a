"""End-to-end exactness of stochastic speculative decoding (DESIGN §1).

With temperature > 0, SpeculativeEngine must emit tokens distributed exactly as BaselineEngine's.
A tiny target with a 12-token vocabulary and spread-out distributions is decoded from one prompt
under many seeds by both engines; a two-sample chi-square test compares the joint distribution of
output tokens 2 and 3 (the ones speculation produces). A drafter that lies about the distribution
its tokens came from must be caught by the same test at the same sample size (negative control).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy import stats

from spectoolkit.config import SamplingConfig
from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.engine import BaselineEngine, SpeculativeEngine
from spectoolkit.eval.stochastic_empirical import ArgmaxReportingSoftmax
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.models.cached import CachedModel
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.sampling import make_chooser

VOCAB = 12
EOS_IDS = frozenset({2})
GAMMA = 2
SAMPLES = 1200
SPEC_SEED_OFFSET = 1_000_000  # the arms use disjoint seeds: two independent samples
PASS_P, FAIL_P = 1e-3, 1e-4
PROMPT = [1, 5, 7, 3, 9, 4, 11, 6, 8, 10, 0, 3, 5, 7]  # every non-EOS id occurs: n-gram lookup proposes
T1 = SamplingConfig(temperature=1.0)
TOP_K_P = SamplingConfig(temperature=1.0, top_k=5, top_p=0.9)
MISSING = -1  # the output ended (EOS) before this position
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> CachedModel:
    return CachedModel(tiny_llama(vocab_size=VOCAB, seed=0, num_layers=1, hidden=32, scale=3.0))


@pytest.fixture(scope="module")
def draft_model() -> torch.nn.Module:
    return tiny_llama(vocab_size=VOCAB, seed=1, num_layers=1, hidden=32, scale=3.0)


def _tokens_2_and_3(output_ids: list[int]) -> tuple[int, int]:
    padded = output_ids + [MISSING] * 3
    return padded[1], padded[2]


def _sample(engine, max_new_tokens: int, seed_offset: int) -> Counter:
    """Counts of (token 2, token 3) over SAMPLES seeded generations."""
    counts: Counter = Counter()
    for index in range(SAMPLES):
        generator = torch.Generator().manual_seed(seed_offset + index)
        out = engine.generate(PROMPT, max_new_tokens, generator)
        assert len(out.output_ids) <= max_new_tokens
        counts[_tokens_2_and_3(out.output_ids)] += 1
    return counts


def _two_sample_pvalue(first: Counter, second: Counter, min_count: int = 10) -> float:
    """Chi-square homogeneity test of two count tables; outcomes seen < ``min_count`` times in all are pooled."""
    totals = first + second
    common = sorted(key for key in totals if totals[key] >= min_count)
    rare = [key for key in totals if totals[key] < min_count]
    columns = [[first[key], second[key]] for key in common]  # [outcomes, 2]
    if rare:
        pooled = [sum(first[key] for key in rare), sum(second[key] for key in rare)]
        if sum(pooled) < min_count and columns:  # still too sparse: fold into the rarest common outcome
            smallest = min(range(len(columns)), key=lambda i: sum(columns[i]))
            columns[smallest] = [columns[smallest][0] + pooled[0], columns[smallest][1] + pooled[1]]
        else:
            columns.append(pooled)
    assert len(columns) >= 5, "too few outcomes left to compare"
    return float(stats.chi2_contingency(np.array(columns).T).pvalue)


_baselines: dict[SamplingConfig, Counter] = {}


def _baseline_counts(target: CachedModel, sampling: SamplingConfig) -> Counter:
    """Baseline samples, shared by every case with the same sampling (they are the costly half)."""
    if sampling not in _baselines:
        engine = BaselineEngine(target, make_verifier(sampling), EOS_IDS)
        _baselines[sampling] = _sample(engine, 3, seed_offset=0)
    return _baselines[sampling]


def _spec_counts(target, drafter, sampling: SamplingConfig, max_new_tokens: int) -> tuple[Counter, list]:
    outputs = []
    engine = SpeculativeEngine(target, drafter, make_verifier(sampling), GAMMA, EOS_IDS)
    original = engine.generate

    def generate(*args, **kwargs):
        outputs.append(original(*args, **kwargs))
        return outputs[-1]

    engine.generate = generate
    return _sample(engine, max_new_tokens, SPEC_SEED_OFFSET), outputs


def _model_drafter(draft_model, chooser) -> ModelDrafter:
    return ModelDrafter(draft_model, chooser, VOCAB, VOCAB, EOS_IDS)


@pytest.mark.parametrize(
    ("sampling", "max_new_tokens"),
    [(T1, 3), (TOP_K_P, 4)],
    ids=["T1-budget-cut", "top_k5-top_p0.9-full-gamma"],
)
def test_model_drafter_matches_baseline_distribution(target, draft_model, sampling, max_new_tokens):
    """max_new_tokens=3 leaves room for 1 draft in round one (plus the target's token); 4 drafts γ=2.

    Tokens 2 and 3 do not depend on max_new_tokens, so both compare with the same baseline sample.
    """
    drafter = _model_drafter(draft_model, make_chooser(sampling))
    spec, outputs = _spec_counts(target, drafter, sampling, max_new_tokens)
    pvalue = _two_sample_pvalue(_baseline_counts(target, sampling), spec)
    assert pvalue > PASS_P, f"spec vs baseline: p={pvalue:.2e}"
    accepted = sum(o.accepted_tokens for o in outputs)
    drafted = sum(o.drafted_tokens for o in outputs)
    assert 0.2 < accepted / drafted < 0.9  # both acceptances and rejections (residual samples) happen
    first_round = [o.draft_lengths[0] for o in outputs if o.verify_rounds]
    assert max(first_round) == min(GAMMA, max_new_tokens - 2)  # fewer only when a draft is EOS
    if max_new_tokens == 3:  # after a rejection the last round has no room to draft: γ = 0, bonus only
        assert any(o.draft_lengths[1:] == [0] for o in outputs)


def test_ngram_drafter_one_hot_matches_baseline_distribution(target):
    drafter = NgramDrafter(max_n=3, min_n=1, target_vocab_size=VOCAB, one_hot_probs=True)
    spec, outputs = _spec_counts(target, drafter, T1, 4)
    pvalue = _two_sample_pvalue(_baseline_counts(target, T1), spec)
    assert pvalue > PASS_P, f"spec vs baseline: p={pvalue:.2e}"
    rounds = sum(o.verify_rounds for o in outputs)
    assert sum(o.proposed_rounds for o in outputs) > 0.5 * rounds  # the lookup really proposes
    assert 0 < sum(o.accepted_tokens for o in outputs) < sum(o.drafted_tokens for o in outputs)


def test_negative_control_draft_probs_not_sampled_from_is_rejected(target, draft_model):
    drafter = _model_drafter(draft_model, ArgmaxReportingSoftmax(T1))
    spec, _ = _spec_counts(target, drafter, T1, 3)
    pvalue = _two_sample_pvalue(_baseline_counts(target, T1), spec)
    assert pvalue < FAIL_P, f"lying drafter not detected: p={pvalue:.2e}"


def test_two_sample_pvalue_pools_rare_outcomes():
    common = Counter({(i, i): 100 for i in range(6)})
    rare_a, rare_b = Counter({(9, 9): 1, (8, 8): 2}), Counter({(7, 7): 3})
    assert _two_sample_pvalue(common + rare_a, common + rare_b) > 0.5  # rare cells do not blow it up
    shifted = Counter({(i, i): 100 + 100 * (i % 2) for i in range(6)})
    assert _two_sample_pvalue(common, shifted) < 1e-3
