"""Greedy speculative decoding must emit exactly the target-alone tokens (DESIGN §1, §2).

Tiny random Llama targets (scale 4 so greedy is not a string of near-ties); drafters range from a
bf16/fp16 copy of the target (high acceptance) through a noisy copy (partial rounds) to another
random model (almost every draft rejected), plus n-gram lookup. Besides the tokens, every test
checks the round counters and the KV rule: the target keeps KV for everything but the pending token.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch

from spectoolkit.drafting import ModelDrafter, NgramDrafter, Proposal
from spectoolkit.engine import BaselineEngine, GenerationOutput, SpeculativeEngine
from spectoolkit.models.cached import CachedModel
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.sampling import GreedyChooser
from spectoolkit.verify import GreedyVerifier
from tests.noise import noisy_copy

VOCAB = 512
EOS = 2
EOS_IDS = frozenset({EOS})
MAX_NEW = 24
PROMPTS = (
    [1, 17, 93, 250, 7, 41, 300, 12],
    [1, 5, 5, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7],  # repetitive: n-gram lookup finds matches
    [1, 400, 3, 99, 123, 77],
)
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)


@pytest.fixture(scope="module")
def draft_models(target) -> dict[str, torch.nn.Module]:
    return {
        "bf16-copy": copy.deepcopy(target).to(torch.bfloat16),
        "fp16-copy": copy.deepcopy(target).to(torch.float16),
        "noisy-copy": noisy_copy(target, sigma=0.2, seed=5),
        "other-seed": tiny_llama(vocab_size=VOCAB, seed=1, scale=4.0),
    }


@pytest.fixture(scope="module")
def references(target) -> dict[tuple[int, ...], list[int]]:
    """Target-alone greedy output for every prompt."""
    engine = BaselineEngine(CachedModel(target), GreedyVerifier(), EOS_IDS)
    return {tuple(prompt): engine.generate(prompt, MAX_NEW, None).output_ids for prompt in PROMPTS}


def _drafter(name: str, draft_models: dict[str, torch.nn.Module]):
    if name == "ngram":
        return NgramDrafter(max_n=3, min_n=1, target_vocab_size=VOCAB, one_hot_probs=False)
    return ModelDrafter(draft_models[name], GreedyChooser(), VOCAB, VOCAB, EOS_IDS, name=name)


@dataclass
class RollbackLog:
    """(num_kept, draft num_computed after the rollback) per round, recorded by a wrapped rollback."""

    rounds: list[tuple[int, int]] = field(default_factory=list)


def _spy_rollback(drafter: ModelDrafter) -> RollbackLog:
    log, original = RollbackLog(), drafter.rollback

    def rollback(num_kept: int) -> None:
        original(num_kept)
        log.rounds.append((num_kept, drafter.runner.num_computed))

    drafter.rollback = rollback
    return log


def _check_counters(out: GenerationOutput) -> None:
    assert out.accepted_tokens <= out.drafted_tokens
    assert out.verify_rounds == len(out.accept_lengths) == len(out.draft_lengths)
    assert out.accepted_tokens == sum(out.accept_lengths)
    assert out.drafted_tokens == sum(out.draft_lengths)
    assert all(0 <= a <= d for a, d in zip(out.accept_lengths, out.draft_lengths, strict=True))
    assert out.rollback_count == sum(a < d for a, d in zip(out.accept_lengths, out.draft_lengths, strict=True))
    assert out.proposed_rounds == sum(d > 0 for d in out.draft_lengths)


def _check_uncut(out: GenerationOutput, prompt: list[int], target: CachedModel) -> None:
    """A generation that did not stop at EOS: no round was cut (the engine sizes the last budget)."""
    assert len(out.output_ids) == out.accepted_tokens + out.verify_rounds + 1  # +1: the prefill token
    assert target.num_computed == len(prompt) + len(out.output_ids) - 1  # the last token is pending


DRAFTERS = ("bf16-copy", "fp16-copy", "noisy-copy", "other-seed", "ngram")


@pytest.mark.parametrize("gamma", range(1, 9))
@pytest.mark.parametrize("drafter_name", DRAFTERS)
def test_greedy_output_equals_baseline(target, draft_models, references, drafter_name, gamma):
    drafter = _drafter(drafter_name, draft_models)
    log = _spy_rollback(drafter) if isinstance(drafter, ModelDrafter) else None
    runner = CachedModel(target)
    engine = SpeculativeEngine(runner, drafter, GreedyVerifier(), gamma, EOS_IDS)
    for prompt in PROMPTS:
        if log:
            log.rounds.clear()
        out = engine.generate(prompt, MAX_NEW, None)
        reference = references[tuple(prompt)]
        assert out.output_ids == reference, f"prompt {prompt}: diverged from the target alone"
        assert EOS not in reference  # these prompts test the max_new_tokens stop
        assert len(out.output_ids) == MAX_NEW
        _check_counters(out)
        _check_uncut(out, prompt, runner)
        assert all(d <= gamma for d in out.draft_lengths)
        if log:
            assert len(log.rounds) == out.verify_rounds
            for (kept, computed), drafted in zip(log.rounds, out.draft_lengths, strict=True):
                assert computed <= kept  # never holds KV of a rejected draft
                if drafted:  # it fed every draft but the last: at most one token behind
                    assert computed >= kept - 1


def test_drafters_span_high_and_low_acceptance(target, draft_models):
    """Guard: the drafter set really exercises full rounds, partial rounds and near-total rejection."""
    rates = {}
    for name in ("bf16-copy", "noisy-copy", "other-seed"):
        engine = SpeculativeEngine(CachedModel(target), _drafter(name, draft_models), GreedyVerifier(), 4, EOS_IDS)
        outs = [engine.generate(prompt, MAX_NEW, None) for prompt in PROMPTS]
        rates[name] = sum(o.accepted_tokens for o in outs) / sum(o.drafted_tokens for o in outs)
        if name == "noisy-copy":
            lengths = [(a, d) for o in outs for a, d in zip(o.accept_lengths, o.draft_lengths, strict=True)]
            assert any(0 < a < d for a, d in lengths)  # rejections in the middle of a round
    assert rates["bf16-copy"] > 0.8
    assert 0.15 < rates["noisy-copy"] < 0.8
    assert rates["other-seed"] < 0.1


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 7, 10])
def test_max_new_tokens_is_exact(target, draft_models, references, max_new_tokens):
    runner = CachedModel(target)
    engine = SpeculativeEngine(runner, _drafter("bf16-copy", draft_models), GreedyVerifier(), 8, EOS_IDS)
    prompt = PROMPTS[0]
    out = engine.generate(prompt, max_new_tokens, None)
    assert out.output_ids == references[tuple(prompt)][:max_new_tokens]
    assert len(out.output_ids) == max_new_tokens
    _check_counters(out)
    _check_uncut(out, prompt, runner)
    if max_new_tokens == 1:
        assert out.verify_rounds == 0


# ---- EOS inside the draft ----------------------------------------------------------------------


class OracleDrafter:
    """Proposes the reference continuation; with ``overshoot`` it keeps proposing past EOS."""

    name = "oracle"

    def __init__(self, prompt: list[int], reference: list[int], overshoot: bool) -> None:
        self.prompt_len = len(prompt)
        self.reference = reference
        self.overshoot = overshoot
        self.proposals: list[list[int]] = []

    def begin(self, prompt_ids: list[int]) -> None:
        assert len(prompt_ids) == self.prompt_len

    def propose(self, tokens: list[int], budget: int, generator: torch.Generator | None) -> Proposal:
        emitted = len(tokens) - self.prompt_len
        draft_ids = self.reference[emitted : emitted + budget]
        if self.overshoot:
            draft_ids = draft_ids + [7] * (budget - len(draft_ids))  # junk after EOS
        self.proposals.append(draft_ids)
        return Proposal(draft_ids, None)

    def rollback(self, num_kept: int) -> None:
        pass


EOS_PROMPT = PROMPTS[0]


@pytest.fixture(scope="module")
def eos_target(target, references) -> torch.nn.Module:
    """The target with EOS's lm_head row 1% above the row of its 6th greedy token: EOS wins there."""
    biased = copy.deepcopy(target)
    with torch.no_grad():
        biased.lm_head.weight[EOS] = 1.01 * biased.lm_head.weight[references[tuple(EOS_PROMPT)][5]]
    return biased


@pytest.fixture(scope="module")
def eos_reference(eos_target) -> list[int]:
    reference = BaselineEngine(CachedModel(eos_target), GreedyVerifier(), EOS_IDS).generate(EOS_PROMPT, MAX_NEW, None)
    ids = reference.output_ids
    assert 3 <= len(ids) < MAX_NEW and ids[-1] == EOS and EOS not in ids[:-1]  # guard: EOS is argmax mid-output
    return ids


@pytest.mark.parametrize("overshoot", [False, True], ids=["stops-at-eos", "drafts-past-eos"])
@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5, 8])
def test_eos_inside_draft_ends_output(eos_target, eos_reference, gamma, overshoot):
    drafter = OracleDrafter(EOS_PROMPT, eos_reference, overshoot)
    engine = SpeculativeEngine(CachedModel(eos_target), drafter, GreedyVerifier(), gamma, EOS_IDS)
    out = engine.generate(EOS_PROMPT, MAX_NEW, None)
    assert out.output_ids == eos_reference
    _check_counters(out)
    if gamma == len(eos_reference) - 2:
        # One full round drafts everything between the prefill token and EOS: EOS is the bonus token.
        assert out.accept_lengths == out.draft_lengths == [gamma]
        return
    assert any(EOS in proposal for proposal in drafter.proposals)
    eos_round = max(i for i, p in enumerate(drafter.proposals) if EOS in p)
    eos_index = drafter.proposals[eos_round].index(EOS)
    assert out.accept_lengths[eos_round] > eos_index  # the EOS draft itself was accepted
    assert eos_round == out.verify_rounds - 1  # no round after the EOS round


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_eos_from_model_drafter(eos_target, eos_reference, gamma):
    draft = copy.deepcopy(eos_target).to(torch.bfloat16)
    drafter = ModelDrafter(draft, GreedyChooser(), VOCAB, VOCAB, EOS_IDS)
    out = SpeculativeEngine(CachedModel(eos_target), drafter, GreedyVerifier(), gamma, EOS_IDS).generate(
        EOS_PROMPT, MAX_NEW, None
    )
    assert out.output_ids == eos_reference
    _check_counters(out)


# ---- draft vocabulary larger than the target's -------------------------------------------------


EXTRA = 64


@pytest.fixture(scope="module")
def wide_draft(target) -> torch.nn.Module:
    """The target's weights in a model with EXTRA more ids whose lm_head rows outscore the shared ones."""
    wide = tiny_llama(vocab_size=VOCAB + EXTRA, seed=0, scale=4.0)
    with torch.no_grad():
        for source, dest in zip(target.parameters(), wide.parameters(), strict=True):
            dest[: source.shape[0]] = source  # embeddings and lm_head: the first VOCAB rows
        wide.lm_head.weight[VOCAB:] = 3.0 * target.lm_head.weight[:EXTRA]
    raw = CachedModel(wide).forward(PROMPTS[0], last_only=True)  # [V + EXTRA]
    assert int(torch.argmax(raw)) >= VOCAB  # guard: unmasked, the draft would propose a foreign id
    return wide


def test_larger_draft_vocab_never_proposes_foreign_ids(target, wide_draft, references):
    drafter = ModelDrafter(wide_draft, GreedyChooser(), VOCAB, VOCAB, EOS_IDS)
    proposed: list[int] = []
    original = drafter.propose

    def propose(tokens, budget, generator):
        proposal = original(tokens, budget, generator)
        proposed.extend(proposal.draft_ids)
        return proposal

    drafter.propose = propose
    engine = SpeculativeEngine(CachedModel(target), drafter, GreedyVerifier(), 4, EOS_IDS)
    accepted = drafted = 0
    for prompt in PROMPTS:
        out = engine.generate(prompt, MAX_NEW, None)
        assert out.output_ids == references[tuple(prompt)]
        _check_counters(out)
        accepted, drafted = accepted + out.accepted_tokens, drafted + out.drafted_tokens
    assert proposed and max(proposed) < VOCAB
    assert accepted / drafted > 0.9  # on the shared ids the draft is the target: ids line up one to one
