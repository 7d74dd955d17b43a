"""Analytic exactness of token trees (spectoolkit.eval.tree_analytic): TV ≈ 0 at every node, not for bugs.

Target: a tiny random Llama (vocab 512, sharpened head). Draft: a noisy copy (p ≠ q substantially), or
the n-gram trie on a prompt where the last token recurs with several continuations. Every check runs
the real drafter, the real tree verify forward and the verifier's own residual / acceptance rule.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import spectoolkit.eval.tree_analytic as tree_analytic
from spectoolkit.config import (
    DraftConfig,
    EvalConfig,
    ModelConfig,
    RunConfig,
    SamplingConfig,
    SpeculateConfig,
    TreeConfig,
    WorkloadConfig,
)
from spectoolkit.errors import SpecToolkitError
from spectoolkit.eval.exactness_job import RESULT_FILE, run_exactness_job
from spectoolkit.eval.stochastic_analytic import total_variation
from spectoolkit.eval.tree_analytic import CONTROLS, tree_analytic_exactness, tree_output_probs, with_earlier_siblings
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.models.tree_mask import verify_rows
from spectoolkit.sampling import processed_probs
from tests.noise import noisy_copy

VOCAB = 512
PROMPTS = [[1, 17, 305, 40, 77, 90], [1, 64, 12, 64, 12, 33]]
POSITIONS = 3
T1 = SamplingConfig(temperature=1.0)
TOP_K = SamplingConfig(temperature=1.0, top_k=20)
TOP_P = SamplingConfig(temperature=1.0, top_p=0.9)
SAMPLINGS = pytest.mark.parametrize("sampling", [T1, TOP_K, TOP_P], ids=["T1", "top_k20", "top_p0.9"])
TREES = {
    "static-2x2": TreeConfig(kind="static", branching=(2, 2), max_nodes=8),
    "static-3x1": TreeConfig(kind="static", branching=(3, 1), max_nodes=8),
    "dynamic-top3": TreeConfig(kind="dynamic", top_k=3, max_nodes=8),
}
CLEARLY_NONZERO = 1e-3
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(vocab_size=VOCAB, seed=0, scale=8.0)


@pytest.fixture(scope="module")
def draft(target) -> torch.nn.Module:
    return noisy_copy(target, sigma=0.3, seed=1)


@pytest.fixture(scope="module")
def ngram_prompt(target) -> list[int]:
    """ "5 6 7 c 9" for three tokens c, then "5 6 7": the trie has three children at the root.

    The c are the target's own top-3 next tokens after the prompt (found by iterating), so that the
    children are likely under p (also with top-k): a bug in how they are tested then carries mass.
    """
    suffix, children = [5, 6, 7], [1, 3, 8]
    for _ in range(3):
        prompt = [token for child in children for token in (*suffix, child, 9)] + suffix
        with torch.no_grad():
            children = torch.topk(target(torch.tensor([prompt])).logits[0, -1], 3).indices.tolist()
    return prompt


def _assert_exact_and_controls_caught(result: dict) -> None:
    assert result["passed"] and result["accept_rule_mismatches"] == 0, result
    assert result["max_excess_tv"] < tree_analytic.THRESHOLD and result["max_excess_tv"] <= result["max_tv"], result
    assert set(result["controls"]) == set(CONTROLS)
    for name, control in result["controls"].items():
        assert control["max_tv"] > CLEARLY_NONZERO, (name, control)


@SAMPLINGS
@pytest.mark.parametrize("tree_name", list(TREES))
def test_model_trees_are_exact_and_controls_are_not(target, draft, sampling, tree_name):
    result = tree_analytic_exactness(target, draft, PROMPTS, sampling, TREES[tree_name], POSITIONS, seed=3, gamma=3)
    assert result["positions"] == len(PROMPTS) * POSITIONS and result["positions_skipped"] == 0
    assert result["expanded_nodes"] > result["positions"]  # nodes below the root were expanded and checked
    assert result["nodes"] > result["expanded_nodes"]  # leaves (the bonus token) too
    assert result["max_tv"] < 1e-6  # vocab 512: even the raw TV, normalization gap included
    _assert_exact_and_controls_caught(result)


@pytest.mark.parametrize("sampling", [T1, TOP_K], ids=["T1", "top_k20"])
def test_ngram_trie_is_exact_and_controls_are_not(target, ngram_prompt, sampling):
    tree = TreeConfig(kind="static", branching=(2, 2), max_nodes=8)
    result = tree_analytic_exactness(target, None, [ngram_prompt], sampling, tree, POSITIONS, seed=0, gamma=3)
    assert result["positions"] >= 1 and result["positions"] + result["positions_skipped"] == POSITIONS
    _assert_exact_and_controls_caught(result)


def test_draft_differs_from_target(target, draft):
    """The check is only meaningful if p ≠ q: rejections (the residuals) carry real mass."""
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        target_probs = processed_probs(target(ids).logits[0, -1], T1)
        draft_probs = processed_probs(draft(ids).logits[0, -1], T1)
    assert total_variation(target_probs, draft_probs) > 0.1


def test_output_probs_hand_example():
    """p = [.5, .3, .2], two i.i.d. siblings from q = [.2, .5, .3]: out = p; the bugs by hand."""
    target_probs, draft_probs = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    siblings = [draft_probs, draft_probs]
    out, gap, mismatches = tree_output_probs(siblings, siblings, target_probs)
    assert torch.allclose(out, target_probs.double(), atol=1e-7) and mismatches == 0 and gap < 1e-6
    # ranked: token 1 (top of q) accepted w.p. .6, else p2 = [1, 0, 0]; token 2 (second) then never: [.4, .6, 0]
    ranked = [torch.tensor([0.0, 1.0, 0.0]), torch.tensor([0.0, 0.0, 1.0])]
    out, _, _ = tree_output_probs(ranked, siblings, target_probs)
    assert torch.allclose(out, torch.tensor([0.4, 0.6, 0.0], dtype=torch.float64), atol=1e-7)
    # p kept: each try accepts min(p, q) = [.2, .3, .2] (ρ = .3), then p: m + .3·m + .09·p
    out, _, _ = tree_output_probs(siblings, siblings, target_probs, lambda probs, _: probs)
    assert torch.allclose(out, torch.tensor([0.305, 0.417, 0.278], dtype=torch.float64), atol=1e-7)


def test_one_hot_siblings_hand_example():
    """n-gram children 0 then 1 (one-hot q): x0 w.p. .5, then x1 w.p. .3/.5 of the rest, then token 2."""
    target_probs = torch.tensor([0.5, 0.3, 0.2])
    one_hots = [torch.tensor([1.0, 0.0, 0.0]), torch.tensor([0.0, 1.0, 0.0])]
    out, gap, mismatches = tree_output_probs(one_hots, one_hots, target_probs)
    assert torch.allclose(out, target_probs.double(), atol=1e-7) and mismatches == 0


def test_sibling_visible_mask_adds_exactly_the_earlier_siblings():
    parents = [-1, -1, -1, 0, 0]  # root children 0, 1, 2; node 0's children 3, 4
    start = 10
    _, visible = verify_rows(parents, start)
    wrong = with_earlier_siblings(visible, parents, start)
    added = {(int(row), int(col)) for row, col in torch.nonzero(wrong & ~visible)}
    slot = {node: start + 1 + node for node in range(len(parents))}
    assert added == {(2, slot[0]), (3, slot[0]), (3, slot[1]), (5, slot[3])}  # row = node + 1


def test_a_wrong_residual_shows_up(target, draft, monkeypatch):
    """The check uses the verifier's own residual_after: resampling from p itself is caught."""
    monkeypatch.setattr(tree_analytic, "residual_after", lambda target_probs, draft_row: target_probs)
    result = tree_analytic_exactness(target, draft, PROMPTS[:1], T1, TREES["static-2x2"], 2, seed=3, gamma=3)
    assert not result["passed"] and result["max_tv"] > CLEARLY_NONZERO


def test_a_wrong_acceptance_rule_shows_up(monkeypatch):
    """``accept_mask`` is probed: a rule without the p > 0 guard, or with q/p, is reported."""

    def no_guard(draft_ids, draft_probs, target_probs, uniforms):
        index = draft_ids.unsqueeze(-1)
        return uniforms * draft_probs.gather(-1, index).squeeze(-1) <= target_probs.gather(-1, index).squeeze(-1)

    def inverted(draft_ids, draft_probs, target_probs, uniforms):
        index = draft_ids.unsqueeze(-1)
        return uniforms * target_probs.gather(-1, index).squeeze(-1) <= draft_probs.gather(-1, index).squeeze(-1)

    target_probs, draft_probs = torch.tensor([0.5, 0.5, 0.0]), torch.tensor([0.2, 0.6, 0.2])
    for wrong in (no_guard, inverted):
        monkeypatch.setattr(tree_analytic, "accept_mask", wrong)
        assert tree_output_probs([draft_probs], [draft_probs], target_probs)[2] > 0, wrong.__name__


def test_greedy_and_chains_are_refused(target):
    with pytest.raises(SpecToolkitError, match="temperature"):
        tree_analytic_exactness(target, None, PROMPTS, SamplingConfig(temperature=0.0), TREES["static-2x2"], 2, 0)
    with pytest.raises(SpecToolkitError, match="speculate.tree.kind"):
        tree_analytic_exactness(target, None, PROMPTS, T1, TreeConfig(), 2, 0)


def test_exactness_job_checks_the_tree_rule(one_thread, tiny_checkpoint: Path, tmp_path: Path) -> None:
    """``+eval=exactness`` with ``speculate.tree`` runs the tree checks (analytic and empirical)."""
    tree = TreeConfig(kind="static", branching=(2, 1), max_nodes=4)
    cfg = RunConfig(
        draft=DraftConfig(kind="model", precision="rtn-int8"),
        model=ModelConfig(target_path=str(tiny_checkpoint)),
        speculate=SpeculateConfig(gamma=2, tree=tree),
        workload=WorkloadConfig(kind="builtin", max_new_tokens=6, num_prompts=1),
        eval=EvalConfig(kind="exactness", stochastic_temperature=0.05, analytic_positions=2, samples=30, length=3),
        device="cpu",
        output_dir=str(tmp_path),
    )
    run_exactness_job(cfg)
    result = json.loads((tmp_path / RESULT_FILE).read_text(encoding="utf-8"))
    analytic, empirical = result["analytic"], result["empirical"]
    assert analytic["tree"]["branching"] == [2, 1] and set(analytic["controls"]) == set(CONTROLS)
    assert analytic["passed"] and analytic["positions"] == 2 and analytic["expanded_nodes"] >= 2
    assert empirical["tree"]["branching"] == [2, 1] and not empirical["rejected"]
    assert result["greedy"]["passed"]


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("sampling", [T1, SamplingConfig(temperature=0.8, top_k=50, top_p=0.95)], ids=["T1", "topk-p"])
def test_embedded_trees_are_exact_on_real_logits(sampling):
    """SmolLM2-135M fp32 target, its bf16 self-draft: real logits over 49k tokens, every node."""
    from tests.integration import embedded

    target, draft = embedded.model("fp32"), embedded.model("bf16")
    prompts = [
        list(ids) for ids in embedded.encoded(("Write a Python function that returns the n-th Fibonacci number.",))
    ]
    for tree in (TREES["static-2x2"], TREES["dynamic-top3"]):
        result = tree_analytic_exactness(target.model, draft.model, prompts, sampling, tree, 2, seed=0, gamma=3)
        assert result["positions"] == 2
        assert result["max_forward_tv"] < 1e-6  # batch-invariant rows: the tree forward is the causal one
        _assert_exact_and_controls_caught(result)
