"""Exact speculative sampling: emitted tokens must follow the target's processed distribution.

The distribution check simulates decoding against a context-free "model" whose next-token logits
depend only on the position j (target row j, draft row j). Exact verification then emits tokens
independently distributed as p_j, so the first emitted token must follow p_0 and the first two
together p_0 ⊗ p_1. The same check must reject two classic bugs (negative controls).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from scipy import stats

from spectoolkit.config import SamplingConfig
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.sampling import processed_probs, sample_from
from spectoolkit.verify import StochasticVerifier, VerifyResult, verify_with_uniforms
from spectoolkit.verify.rules import accept_mask as _accept_mask

VOCAB = 8
TRIALS = 12_000
PASS_P, FAIL_P = 1e-3, 1e-6
T1 = SamplingConfig(temperature=1.0)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: intra-op threads only add overhead to the ~10^5 verify calls here."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ---- the distribution check ------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    sampling: SamplingConfig
    gamma: int
    draft: str = "random"  # "random" (target + noise), "equal" to the target, or "disjoint" support


@dataclass(frozen=True)
class Rule:
    """A verifier under test: its accept/resample rule and the sampling it applies to the target."""

    verify: Callable[..., VerifyResult] = verify_with_uniforms
    target_sampling: SamplingConfig | None = None  # None: the case's sampling (the correct choice)


def _case_logits(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Target and draft logits, each [γ+2, V]: row j is the next-token logits at position j."""
    gen = torch.Generator().manual_seed(1234)
    target = 1.5 * torch.randn(case.gamma + 2, VOCAB, generator=gen)
    if case.draft == "equal":
        return target, target.clone()
    draft = target + torch.randn(case.gamma + 2, VOCAB, generator=gen)  # a draft that often agrees
    if case.draft == "disjoint":
        target[:, VOCAB // 2 :] = float("-inf")
        draft[:, : VOCAB // 2] = float("-inf")
    return target, draft


@dataclass
class Emissions:
    first: np.ndarray  # [V] counts of the first emitted token
    pair: np.ndarray  # [V, V] counts of the first two emitted tokens
    accepted: int  # drafts accepted in the first round, over all trials
    drafted: int
    first_draft_accepted: int  # trials whose first draft was accepted


def _simulate(case: Case, rule: Rule) -> Emissions:
    """Run TRIALS decodes until two tokens are out (one or two rounds) and count what they emit."""
    gamma = case.gamma
    target_logits, draft_logits = _case_logits(case)
    draft_probs = processed_probs(draft_logits, case.sampling)  # [γ+2, V] what drafts are drawn from
    target_probs = processed_probs(target_logits, rule.target_sampling or case.sampling)  # [γ+2, V]
    gen = torch.Generator().manual_seed(99)
    drafts = torch.stack(  # [2·TRIALS, γ+1], column j drawn from draft row j
        [torch.multinomial(draft_probs[j], 2 * TRIALS, True, generator=gen) for j in range(gamma + 1)], -1
    )
    uniforms = torch.rand(2, TRIALS, gamma + 1, generator=gen)  # [round, trial, γ+1]
    em = Emissions(np.zeros(VOCAB, np.int64), np.zeros((VOCAB, VOCAB), np.int64), 0, gamma * TRIALS, 0)
    for t in range(TRIALS):
        draft_ids = drafts[t, :gamma]  # round 1 drafts positions 0..γ-1
        result = rule.verify(draft_ids, draft_probs[:gamma], target_probs[: gamma + 1], uniforms[0, t])
        tokens = draft_ids[: result.num_accepted].tolist() + [result.next_token]
        em.accepted += result.num_accepted
        em.first_draft_accepted += result.num_accepted > 0
        if len(tokens) == 1:  # round 2 starts at position 1
            draft_ids = drafts[TRIALS + t, 1 : gamma + 1]
            result = rule.verify(draft_ids, draft_probs[1 : gamma + 1], target_probs[1:], uniforms[1, t])
            tokens += draft_ids[: result.num_accepted].tolist() + [result.next_token]
        em.first[tokens[0]] += 1
        em.pair[tokens[0], tokens[1]] += 1
    return em


def _chisquare_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of ``counts`` to ``probs`` (same shape), pooling cells expected below 5.

    Any count in a zero-probability cell is an outright failure (p-value 0).
    """
    counts, probs = counts.ravel(), probs.ravel().astype(np.float64)
    if counts[probs == 0].any():
        return 0.0
    order = np.argsort(probs[probs > 0])
    counts, expected = counts[probs > 0][order], probs[probs > 0][order] * counts.sum() / probs.sum()
    small = int((expected < 5).sum())
    enough = int(np.searchsorted(np.cumsum(expected), 5.0)) + 1  # shortest prefix with mass >= 5
    cut = max(small, enough) if small else 1  # pool the small cells (a pool of one cell: no change)
    counts = np.concatenate([[counts[:cut].sum()], counts[cut:]])
    expected = np.concatenate([[expected[:cut].sum()], expected[cut:]])
    if len(counts) < 2:
        return 1.0  # a single possible outcome: nothing to test beyond the support check above
    return float(stats.chisquare(counts, expected).pvalue)


def _emission_pvalues(case: Case, rule: Rule) -> tuple[float, float, Emissions]:
    """p-values of the first emitted token vs p_0 and the first two vs p_0 ⊗ p_1 (correct target)."""
    em = _simulate(case, rule)
    target_logits, _ = _case_logits(case)
    reference = processed_probs(target_logits, case.sampling).double().numpy()  # [γ+2, V]
    pair = np.outer(reference[0], reference[1])  # [V, V]
    return _chisquare_pvalue(em.first, reference[0]), _chisquare_pvalue(em.pair, pair), em


EXACT = Rule()
POSITIVE_CASES = {
    "T1-gamma1": Case(T1, 1),
    "T1-gamma3": Case(T1, 3),
    "T0.7-topk3-gamma2": Case(SamplingConfig(temperature=0.7, top_k=3), 2),
    "topp0.8-gamma2": Case(SamplingConfig(temperature=1.0, top_p=0.8), 2),
    "draft-equals-target": Case(T1, 3, draft="equal"),
    "disjoint-support": Case(T1, 1, draft="disjoint"),
}


@pytest.mark.parametrize("case", POSITIVE_CASES.values(), ids=POSITIVE_CASES.keys())
def test_emitted_tokens_follow_target_distribution(case: Case):
    p_first, p_pair, em = _emission_pvalues(case, EXACT)
    assert p_first > PASS_P, f"first token: p={p_first:.2e}"
    assert p_pair > PASS_P, f"first two tokens: p={p_pair:.2e}"
    # Acceptance of one draft is Σ_v min(p, q) = 1 − TV(p, q) (DESIGN §1).
    target_logits, draft_logits = _case_logits(case)
    first_rows = processed_probs(torch.stack([target_logits[0], draft_logits[0]]), case.sampling)  # [2, V]
    alpha = min(float(first_rows.min(dim=0).values.sum()), 1.0)
    if case.draft == "equal":
        assert em.accepted == em.drafted  # p == q: every draft accepted, exactly
    elif case.draft == "disjoint":
        assert em.accepted == 0
    else:
        assert stats.binomtest(em.first_draft_accepted, TRIALS, alpha).pvalue > PASS_P


def _verify_residual_omitted(draft_ids, draft_probs, target_probs, uniforms) -> VerifyResult:
    """BUG on purpose: the correction is sampled from p instead of normalize(max(0, p − q))."""
    gamma = draft_ids.shape[0]
    accepted = _accept_mask(draft_ids, draft_probs, target_probs[:gamma], uniforms[:gamma])  # [γ]
    num_accepted = int(accepted.long().cumprod(0).sum())
    return VerifyResult(num_accepted, sample_from(target_probs[num_accepted], uniforms[gamma]))


TOP_P = SamplingConfig(temperature=1.0, top_p=0.8)
NEGATIVE_CASES = {
    "residual-omitted": (Case(T1, 2), Rule(verify=_verify_residual_omitted)),
    # BUG on purpose: top-p applied to the draft only; the target side skips it.
    "top-p-on-draft-only": (Case(TOP_P, 2), Rule(target_sampling=replace(TOP_P, top_p=1.0))),
}


@pytest.mark.parametrize(("case", "rule"), NEGATIVE_CASES.values(), ids=NEGATIVE_CASES.keys())
def test_distribution_check_rejects_wrong_verifier(case: Case, rule: Rule):
    p_first, p_pair, _ = _emission_pvalues(case, rule)
    assert min(p_first, p_pair) < FAIL_P, f"bug not detected: p={p_first:.2e}, {p_pair:.2e}"


# ---- the pure rule: determinism, precision, edge cases ---------------------------------------


def _random_round(gen: torch.Generator, gamma: int, draft_vocab: int = VOCAB, sampling=T1):
    """draft_ids [γ], draft_probs [γ, draft_vocab], target_logits [γ+1, V] for one round."""
    draft_probs = processed_probs(torch.randn(gamma, draft_vocab, generator=gen), sampling)
    draft_ids = torch.multinomial(draft_probs, 1, generator=gen).reshape(gamma) if gamma else torch.zeros(0)
    return draft_ids.long(), draft_probs, torch.randn(gamma + 1, VOCAB, generator=gen)


def _reference_loop(draft_ids, draft_probs, target_probs, uniforms) -> VerifyResult:
    """Leviathan et al. Alg. 1 written as a loop over drafts (fp32, padded draft vocabulary)."""
    gamma, vocab = draft_ids.shape[0], target_probs.shape[-1]
    draft_probs = torch.cat([draft_probs, torch.zeros(gamma, vocab - draft_probs.shape[-1])], -1)
    for i, token in enumerate(draft_ids.tolist()):
        target_p, draft_p = target_probs[i, token], draft_probs[i, token]
        if not (uniforms[i] * draft_p <= target_p and target_p > 0):
            residual = (target_probs[i] - draft_probs[i]).clamp_min(0)
            return VerifyResult(i, sample_from(residual if residual.sum() > 0 else target_probs[i], uniforms[-1]))
    return VerifyResult(gamma, sample_from(target_probs[gamma], uniforms[-1]))


def test_matches_loop_reference_on_random_rounds():
    gen = torch.Generator().manual_seed(5)
    for trial in range(300):
        gamma, draft_vocab = trial % 5, VOCAB - trial % 3  # includes γ=0 and smaller draft vocabularies
        draft_ids, draft_probs, target_logits = _random_round(gen, gamma, draft_vocab)
        target_probs = processed_probs(target_logits, T1)  # [γ+1, V]
        uniforms = torch.rand(gamma + 1, generator=gen)
        expected = _reference_loop(draft_ids, draft_probs, target_probs, uniforms)
        assert verify_with_uniforms(draft_ids, draft_probs, target_probs, uniforms) == expected


def test_verify_with_uniforms_is_deterministic_and_leaves_inputs_alone():
    draft_ids, draft_probs, target_logits = _random_round(torch.Generator().manual_seed(6), 4)
    target_probs = processed_probs(target_logits, T1)
    inputs = [draft_ids, draft_probs, target_probs, torch.rand(5, generator=torch.Generator().manual_seed(7))]
    copies = [x.clone() for x in inputs]
    results = {verify_with_uniforms(*inputs) for _ in range(20)}
    assert len(results) == 1
    assert all(torch.equal(x, c) for x, c in zip(inputs, copies, strict=True))


def test_verify_draws_uniforms_once_from_generator():
    sampling = SamplingConfig(temperature=0.8, top_k=5, top_p=0.9)
    verifier, gen = StochasticVerifier(sampling), torch.Generator().manual_seed(8)
    for gamma in range(4):
        draft_ids, draft_probs, target_logits = _random_round(gen, gamma, sampling=sampling)
        result = verifier.verify(draft_ids, target_logits, draft_probs, torch.Generator().manual_seed(gamma))
        uniforms = torch.rand(gamma + 1, generator=torch.Generator().manual_seed(gamma))
        expected = verify_with_uniforms(draft_ids, draft_probs, processed_probs(target_logits, sampling), uniforms)
        assert result == expected


def test_select_matches_verify_without_drafts():
    sampling = SamplingConfig(temperature=0.9, top_p=0.7)
    verifier = make_verifier(sampling)
    assert isinstance(verifier, StochasticVerifier)
    logits = torch.randn(VOCAB, generator=torch.Generator().manual_seed(9))  # [V]
    for seed in range(20):
        selected = verifier.select(logits, torch.Generator().manual_seed(seed))
        empty = torch.zeros(0, dtype=torch.long)
        for no_drafts in (torch.zeros(0, VOCAB), None):  # None is allowed when nothing was drafted
            verified = verifier.verify(empty, logits[None], no_drafts, torch.Generator().manual_seed(seed))
            assert verified == VerifyResult(0, selected)


def test_acceptance_is_fp32_for_bf16_inputs():
    # q(x) = 1, p(x) = 0.5, u = 0.5 + 2^-10: fp32 rejects; in bf16 u rounds to 0.5 and would accept.
    draft_probs = torch.zeros(1, VOCAB, dtype=torch.bfloat16)
    draft_probs[0, 0] = 1.0
    target_probs = torch.full((2, VOCAB), 0.5 / (VOCAB - 1), dtype=torch.bfloat16)
    target_probs[0, 0] = 0.5
    assert torch.tensor(0.5 + 2**-10).bfloat16().item() == 0.5  # the case is meaningful
    rejected = verify_with_uniforms(torch.tensor([0]), draft_probs, target_probs, torch.tensor([0.5 + 2**-10, 0.3]))
    assert rejected.num_accepted == 0 and rejected.next_token != 0
    # The boundary u·q == p accepts (the rule is u·q <= p; a fused kernel must agree).
    on_boundary = verify_with_uniforms(torch.tensor([0]), draft_probs, target_probs, torch.tensor([0.5, 0.3]))
    assert on_boundary.num_accepted == 1


def test_bf16_logits_give_the_fp32_result():
    gen = torch.Generator().manual_seed(10)
    draft_ids, draft_probs, target_logits = _random_round(gen, 3)
    target_logits = target_logits.bfloat16()
    verifier = StochasticVerifier(T1)
    for seed in range(20):
        low = verifier.verify(draft_ids, target_logits, draft_probs, torch.Generator().manual_seed(seed))
        full = verifier.verify(draft_ids, target_logits.float(), draft_probs, torch.Generator().manual_seed(seed))
        assert low == full


def test_target_excluded_token_is_never_accepted():
    # Inconsistent input on purpose (u = 0, or q(x) = 0): a token the target excludes stays rejected.
    draft_probs = torch.full((1, VOCAB), 1.0 / VOCAB)
    target_probs = torch.full((2, VOCAB), 1.0 / (VOCAB - 1))
    target_probs[:, 0] = 0.0
    result = verify_with_uniforms(torch.tensor([0]), draft_probs, target_probs, torch.tensor([0.0, 0.5]))
    assert result.num_accepted == 0 and result.next_token != 0


def test_zero_residual_falls_back_to_target():
    # p == q but the draft is a token both exclude: rejected, residual is all zero -> sample from p.
    probs = torch.tensor([[0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25]])  # [γ+1=2, V=4]
    for u in (0.0, 0.4, 0.6, 0.999):
        result = verify_with_uniforms(torch.tensor([3]), probs[:1], probs, torch.tensor([0.5, u]))
        assert result.num_accepted == 0 and result.next_token in (1, 2)


def test_smaller_draft_vocab_is_zero_padded():
    gen = torch.Generator().manual_seed(11)
    draft_ids, draft_probs, target_logits = _random_round(gen, 3, draft_vocab=VOCAB - 3)
    target_probs = processed_probs(target_logits, T1)
    padded = torch.cat([draft_probs, torch.zeros(3, 3)], dim=-1)  # [γ, V]
    for _ in range(50):
        uniforms = torch.rand(4, generator=gen)
        expected = verify_with_uniforms(draft_ids, padded, target_probs, uniforms)
        assert verify_with_uniforms(draft_ids, draft_probs, target_probs, uniforms) == expected


def test_bad_inputs_raise():
    verifier = StochasticVerifier(T1)
    with pytest.raises(ValueError, match="draft_probs"):
        verifier.verify(torch.tensor([1]), torch.zeros(2, VOCAB), None, None)
    with pytest.raises(ValueError, match="draft_probs"):  # rows do not match γ
        verifier.verify(torch.tensor([1]), torch.zeros(2, VOCAB), torch.zeros(2, VOCAB), None)
    with pytest.raises(ValueError, match="more than"):
        verify_with_uniforms(torch.tensor([1]), torch.rand(1, VOCAB + 1), torch.rand(2, VOCAB), torch.rand(2))
    with pytest.raises(ValueError, match="temperature"):
        StochasticVerifier(SamplingConfig(temperature=0.0))
