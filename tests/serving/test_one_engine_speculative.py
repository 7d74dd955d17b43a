"""Greedy speculation at batch 1 on the one engine emits exactly the target-alone tokens (DESIGN §1, §2).

:class:`~spectoolkit.serving.one.OneRequestEngine` (a ContinuousEngine with one request in flight) over a tiny
random Llama target (scale 4 so greedy is not a string of near-ties); drafters range from a bf16/fp16 copy of the
target (high acceptance) through a noisy copy (partial rounds) to another random model (almost every draft
rejected), plus n-gram lookup. Besides the tokens, every test checks the round counters and, after every commit,
the KV rule: the target keeps KV for everything but the pending token (and no block past it); the draft model
never holds KV of a rejected draft and, in a round it drafted, is at most one token behind.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import pytest
import torch

from spectoolkit.drafting import NgramDrafter
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.runtime.lone import lone_sequence
from spectoolkit.sampling import GreedyChooser
from spectoolkit.serving.api import GenerationOutput
from spectoolkit.serving.one import OneRequestEngine
from tests.noise import noisy_copy
from tests.reference import alone_greedy
from tests.serving import helpers
from tests.serving.helpers import EOS, EOS_IDS, VOCAB

MAX_NEW = 24
PROMPTS = (
    [1, 17, 93, 250, 7, 41, 300, 12],
    [1, 5, 5, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7],  # repetitive: n-gram lookup finds matches
    [1, 400, 3, 99, 123, 77],
)
DRAFTERS = ("bf16-copy", "fp16-copy", "noisy-copy", "other-seed", "ngram")
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return helpers.switched(tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0))


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
    return {tuple(prompt): alone_greedy(target, prompt, MAX_NEW, EOS_IDS) for prompt in PROMPTS}


def _drafter(name: str, draft_models: dict[str, torch.nn.Module]):
    if name == "ngram":
        return NgramDrafter(3, 1, VOCAB, one_hot_probs=False)
    return helpers.model_drafter(draft_models[name], GreedyChooser())


def _one(target: torch.nn.Module, drafter, gamma: int) -> OneRequestEngine:
    return OneRequestEngine(helpers.engine(target, gamma=gamma, drafter=drafter), "spec")


@dataclass
class Commit:
    """The KV state after one commit, read when the engine tells the drafter what the target kept."""

    kept: int  # the kept length handed to the drafter (prefix + accepted path)
    tokens: int  # len(seq.tokens) after the round's tokens were emitted
    target_computed: int
    target_blocks: int  # blocks the target's table holds
    needed_blocks: int  # blocks for [0, target_computed) (or its published ones)
    draft_computed: int | None  # the draft model's KV length after the commit; None: no draft KV (yet)


def _spy_commits(one: OneRequestEngine) -> list[Commit]:
    """Record a :class:`Commit` at every ``drafter.commit`` (once per commit: the prefill's token, then per round)."""
    drafter, log = one.drafter, []
    original = drafter.commit

    def commit(seq, num_prefix: int, path: list[int]) -> None:
        original(seq, num_prefix, path)
        state = getattr(drafter, "_states", {}).get(id(seq))
        table = seq.table
        needed = max(table.blocks_for(seq.num_computed), table.published)
        log.append(Commit(num_prefix + len(path), len(seq.tokens), seq.num_computed, len(table.blocks), needed,
                          None if state is None else state.num_computed))  # fmt: skip

    drafter.commit = commit
    return log


def _check_counters(out: GenerationOutput) -> None:
    assert out.accepted_tokens <= out.drafted_tokens
    assert out.verify_rounds == len(out.accept_lengths) == len(out.draft_lengths) == len(out.chosen_lengths)
    assert out.accepted_tokens == sum(out.accept_lengths)
    assert out.drafted_tokens == sum(out.draft_lengths)
    assert all(0 <= a <= d for a, d in zip(out.accept_lengths, out.draft_lengths, strict=True))
    assert out.rollback_count == sum(a < d for a, d in zip(out.accept_lengths, out.draft_lengths, strict=True))
    assert out.proposed_rounds == sum(d > 0 for d in out.draft_lengths)
    assert out.tree_depths == []  # chains
    times = (out.ttft, out.prefill_time, out.draft_time, out.verify_time, out.overhead_time, out.total_time)
    assert all(t >= 0 for t in times), times


def _check_uncut(out: GenerationOutput, log: list[Commit]) -> None:
    """A generation that did not stop at EOS: no round was cut (the engine sizes the last budget), and after every
    commit the target kept KV for all but the pending token, the draft model none of a rejected draft."""
    assert len(out.output_ids) == out.accepted_tokens + out.verify_rounds + 1  # +1: the prefill token
    assert len(log) == out.verify_rounds + 1  # the prefill's token, then one per round
    for commit in log:
        assert commit.target_computed == commit.kept == commit.tokens - 1  # the last token is pending
        assert commit.target_blocks == commit.needed_blocks, "blocks past num_computed were kept"
    for commit, drafted in zip(log[1:], out.draft_lengths, strict=True):
        if commit.draft_computed is not None:
            assert commit.draft_computed <= commit.kept  # never holds KV of a rejected draft
            if drafted:  # it fed every draft but the last: at most one token behind
                assert commit.draft_computed >= commit.kept - 1


def _caps(out: GenerationOutput, gamma: int, max_new: int) -> list[int]:
    """Each round's fixed-policy draft length min(γ, room − 1), from what the rounds before it emitted."""
    caps, emitted = [], 1  # the prefill's token
    for accepted in out.accept_lengths:
        caps.append(min(gamma, max_new - emitted - 1))
        emitted += accepted + 1
    return caps


@pytest.mark.parametrize("gamma", range(1, 9))
@pytest.mark.parametrize("drafter_name", DRAFTERS)
def test_greedy_output_equals_the_target_alone(target, draft_models, references, drafter_name, gamma):
    one = _one(target, _drafter(drafter_name, draft_models), gamma)
    log = _spy_commits(one)
    for prompt in PROMPTS:
        log.clear()
        out = one.generate(prompt, MAX_NEW, None)
        reference = references[tuple(prompt)]
        assert out.output_ids == reference, f"prompt {prompt}: diverged from the target alone"
        assert EOS not in reference  # these prompts test the max_new_tokens stop
        assert len(out.output_ids) == MAX_NEW
        _check_counters(out)
        _check_uncut(out, log)
        if drafter_name != "ngram":  # guard: the draft model's KV rule was really checked every round
            assert all(commit.draft_computed is not None for commit in log[1:])
        caps = _caps(out, gamma, MAX_NEW)
        if one.engine.drafter.ahead:  # a lookup proposes at the cap first: the policy takes what it proposed
            assert out.chosen_lengths == out.draft_lengths
            assert all(d <= cap for d, cap in zip(out.draft_lengths, caps, strict=True))
        else:
            assert out.chosen_lengths == caps
        assert all(d <= gamma for d in out.draft_lengths)
    assert not one.engine.has_work() and helpers.all_free(one.engine)


def test_drafters_span_high_and_low_acceptance(target, draft_models):
    """Guard: the drafter set really exercises full rounds, partial rounds and near-total rejection."""
    rates = {}
    for name in ("bf16-copy", "noisy-copy", "other-seed"):
        one = _one(target, _drafter(name, draft_models), 4)
        outs = [one.generate(prompt, MAX_NEW, None) for prompt in PROMPTS]
        rates[name] = sum(o.accepted_tokens for o in outs) / sum(o.drafted_tokens for o in outs)
        if name == "noisy-copy":
            lengths = [(a, d) for o in outs for a, d in zip(o.accept_lengths, o.draft_lengths, strict=True)]
            assert any(0 < a < d for a, d in lengths)  # rejections in the middle of a round
    assert rates["bf16-copy"] > 0.8, rates
    assert 0.15 < rates["noisy-copy"] < 0.8, rates
    assert rates["other-seed"] < 0.1, rates


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 5, 7, 10])
def test_max_new_tokens_is_exact(target, draft_models, references, max_new_tokens):
    one = _one(target, _drafter("bf16-copy", draft_models), 8)
    log = _spy_commits(one)
    prompt = PROMPTS[0]
    out = one.generate(prompt, max_new_tokens, None)
    assert out.output_ids == references[tuple(prompt)][:max_new_tokens]
    assert len(out.output_ids) == max_new_tokens
    _check_counters(out)
    _check_uncut(out, log)
    assert out.chosen_lengths == _caps(out, 8, max_new_tokens)
    if max_new_tokens == 1:
        assert out.verify_rounds == 0


# ---- EOS inside the draft ----------------------------------------------------------------------


class OracleDrafter(helpers.ContinuationDrafter):
    """Proposes the reference continuation; with ``overshoot`` it keeps proposing past EOS."""

    name = "oracle"

    def __init__(self, reference: list[int], overshoot: bool) -> None:
        super().__init__(reference)
        self.overshoot = overshoot
        self.proposals: list[list[int]] = []

    def adjust(self, draft_ids: list[int], length: int) -> list[int]:
        if self.overshoot:
            draft_ids = draft_ids + [7] * (length - len(draft_ids))  # junk after EOS
        self.proposals.append(draft_ids)
        return draft_ids


EOS_PROMPT = PROMPTS[0]


@pytest.fixture(scope="module")
def eos_target(references) -> torch.nn.Module:
    """The target with EOS's lm_head row 1% above the row of its 6th greedy token: EOS wins there."""
    biased = tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)
    with torch.no_grad():
        biased.lm_head.weight[EOS] = 1.01 * biased.lm_head.weight[references[tuple(EOS_PROMPT)][5]]
    return helpers.switched(biased)


@pytest.fixture(scope="module")
def eos_reference(eos_target) -> list[int]:
    ids = alone_greedy(eos_target, EOS_PROMPT, MAX_NEW, EOS_IDS)
    assert 3 <= len(ids) < MAX_NEW and ids[-1] == EOS and EOS not in ids[:-1]  # guard: EOS is argmax mid-output
    return ids


@pytest.mark.parametrize("overshoot", [False, True], ids=["stops-at-eos", "drafts-past-eos"])
@pytest.mark.parametrize("gamma", [1, 2, 3, 4, 5, 8])
def test_eos_inside_draft_ends_output(eos_target, eos_reference, gamma, overshoot):
    drafter = OracleDrafter(eos_reference, overshoot)
    one = _one(eos_target, drafter, gamma)
    out = one.generate(EOS_PROMPT, MAX_NEW, None)
    assert out.output_ids == eos_reference
    _check_counters(out)
    assert helpers.all_free(one.engine)
    if gamma == len(eos_reference) - 2:
        # One full round drafts everything between the prefill token and EOS: EOS is the bonus token.
        assert out.accept_lengths == out.draft_lengths == [gamma]
        return
    assert len(drafter.proposals) == out.verify_rounds  # a proposal every round: room never ran short
    assert any(EOS in proposal for proposal in drafter.proposals)
    eos_round = max(i for i, p in enumerate(drafter.proposals) if EOS in p)
    eos_index = drafter.proposals[eos_round].index(EOS)
    assert out.accept_lengths[eos_round] > eos_index  # the EOS draft itself was accepted
    assert eos_round == out.verify_rounds - 1  # no round after the EOS round


@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_eos_from_model_drafter(eos_target, eos_reference, gamma):
    draft = copy.deepcopy(eos_target).to(torch.bfloat16)
    one = _one(eos_target, helpers.model_drafter(draft, GreedyChooser()), gamma)
    out = one.generate(EOS_PROMPT, MAX_NEW, None)
    assert out.output_ids == eos_reference
    _check_counters(out)
    assert helpers.all_free(one.engine) and one.drafter.kv_bytes() == 0


# ---- draft vocabulary larger than the target's -------------------------------------------------


EXTRA = 64


@pytest.fixture(scope="module")
def wide_draft() -> torch.nn.Module:
    """The target's weights in a model with EXTRA more ids whose lm_head rows outscore the shared ones."""
    plain = tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)  # the target's weights
    wide = tiny_llama(vocab_size=VOCAB + EXTRA, seed=0, scale=4.0)
    with torch.no_grad():
        for source, dest in zip(plain.parameters(), wide.parameters(), strict=True):
            dest[: source.shape[0]] = source  # embeddings and lm_head: the first VOCAB rows
        wide.lm_head.weight[VOCAB:] = 3.0 * plain.lm_head.weight[:EXTRA]
    raw = lone_sequence(wide).forward(PROMPTS[0], last_only=True)  # [V + EXTRA]
    assert int(torch.argmax(raw)) >= VOCAB  # guard: unmasked, the draft would propose a foreign id
    return wide


def test_larger_draft_vocab_never_proposes_foreign_ids(target, wide_draft, references):
    drafter = helpers.model_drafter(wide_draft, GreedyChooser())  # target vocab = shared vocab = VOCAB
    proposed = helpers.record_proposed(drafter)
    one = _one(target, drafter, 4)
    accepted = drafted = 0
    for prompt in PROMPTS:
        out = one.generate(prompt, MAX_NEW, None)
        assert out.output_ids == references[tuple(prompt)]
        _check_counters(out)
        accepted, drafted = accepted + out.accepted_tokens, drafted + out.drafted_tokens
    assert proposed and max(proposed) < VOCAB
    assert accepted / drafted > 0.9  # on the shared ids the draft is the target: ids line up one to one
