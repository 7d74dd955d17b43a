"""ModelDrafter's KV bookkeeping (DESIGN §2): feed what is unseen, roll back to the kept length."""

from __future__ import annotations

import copy

import pytest
import torch

from spectoolkit.config import SamplingConfig
from spectoolkit.drafting import ModelDrafter
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.runtime.lone import LoneSequence, lone_sequence
from spectoolkit.sampling import GreedyChooser, make_chooser

VOCAB = 128
EOS = 2
EOS_IDS = frozenset({EOS})
PROMPT = [1, 17, 93, 50, 7, 41, 100, 12]
PENDING = 33  # the target's first token: verified, no KV anywhere yet
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def draft_model() -> torch.nn.Module:
    return tiny_llama(vocab_size=VOCAB, seed=4, scale=4.0)


def _drafter(model: torch.nn.Module, chooser=None, shared: int = VOCAB) -> tuple[ModelDrafter, list[list[int]]]:
    """A greedy drafter whose runner (a lone sequence) records every list of token ids it is fed."""
    drafter = ModelDrafter(model, chooser or GreedyChooser(), VOCAB, shared, EOS_IDS)
    assert isinstance(drafter.runner, LoneSequence)
    feeds: list[list[int]] = []
    original = drafter.runner.forward

    def forward(token_ids, last_only=False):
        feeds.append(list(token_ids))
        return original(token_ids, last_only=last_only)

    drafter.runner.forward = forward
    return drafter, feeds


def test_first_propose_feeds_the_whole_prompt(draft_model):
    drafter, feeds = _drafter(draft_model)
    drafter.begin(PROMPT)
    tokens = PROMPT + [PENDING]
    proposal = drafter.propose(tokens, budget=3, generator=None)
    assert len(proposal) == 3 and proposal.draft_probs is None
    assert feeds == [tokens, proposal.draft_ids[:1], proposal.draft_ids[1:2]]  # the last draft is not fed
    assert drafter.runner.num_computed == len(tokens) + 2


def test_begin_resets_a_previous_request(draft_model):
    drafter, feeds = _drafter(draft_model)
    drafter.begin(PROMPT)
    first = drafter.propose(PROMPT + [PENDING], budget=4, generator=None)
    drafter.begin(PROMPT)
    feeds.clear()
    again = drafter.propose(PROMPT + [PENDING], budget=4, generator=None)
    assert feeds[0] == PROMPT + [PENDING]
    assert again.draft_ids == first.draft_ids


@pytest.mark.parametrize("num_accepted", [0, 1, 2, 3])
def test_rollback_keeps_no_rejected_draft(draft_model, num_accepted):
    drafter, _ = _drafter(draft_model)
    drafter.begin(PROMPT)
    tokens = PROMPT + [PENDING]
    drafter.propose(tokens, budget=4, generator=None)
    kept = len(tokens) + num_accepted
    drafter.rollback(kept)
    assert drafter.runner.num_computed <= kept
    assert drafter.runner.num_computed == kept  # 4 drafted, at most 3 accepted: all kept ones were fed


def test_after_rejection_feeds_only_the_correction(draft_model):
    drafter, feeds = _drafter(draft_model)
    drafter.begin(PROMPT)
    tokens = PROMPT + [PENDING]
    drafts = drafter.propose(tokens, budget=4, generator=None).draft_ids
    drafter.rollback(len(tokens) + 1)  # d1 accepted, d2 rejected
    correction = (drafts[1] + 1) % VOCAB
    feeds.clear()
    tokens = tokens + drafts[:1] + [correction]
    proposal = drafter.propose(tokens, budget=2, generator=None)
    assert feeds[0] == [correction]
    assert drafter.runner.num_computed == len(tokens) + len(proposal) - 1


def test_after_full_acceptance_feeds_last_draft_and_bonus(draft_model):
    drafter, feeds = _drafter(draft_model)
    drafter.begin(PROMPT)
    tokens = PROMPT + [PENDING]
    drafts = drafter.propose(tokens, budget=3, generator=None).draft_ids
    drafter.rollback(len(tokens) + 3)  # all accepted: the last draft was never fed
    assert drafter.runner.num_computed == len(tokens) + 2
    bonus = 77
    tokens = tokens + drafts + [bonus]
    feeds.clear()
    proposal = drafter.propose(tokens, budget=3, generator=None)
    assert feeds[0] == [drafts[-1], bonus]
    assert drafter.runner.num_computed == len(tokens) + len(proposal) - 1


def test_proposals_after_rollback_equal_a_fresh_drafter(draft_model):
    """Rolled-back KV must be indistinguishable from KV that never saw the rejected drafts."""
    drafter, _ = _drafter(draft_model)
    drafter.begin(PROMPT)
    tokens = PROMPT + [PENDING]
    for round_index in range(7):
        fresh, _ = _drafter(draft_model)
        fresh.begin(PROMPT)
        expected = fresh.propose(tokens, budget=4, generator=None).draft_ids  # one prefill of all tokens
        drafts = drafter.propose(tokens, budget=4, generator=None).draft_ids
        assert drafts == expected, f"round {round_index}"
        num_accepted = min(round_index % 5, len(drafts))  # 0..4: rejections at every slot, then all
        next_token = (drafts[num_accepted] + 5) % VOCAB if num_accepted < len(drafts) else 9
        drafter.rollback(len(tokens) + num_accepted)
        tokens = tokens + drafts[:num_accepted] + [next_token]


def test_stops_after_proposing_eos(draft_model):
    plain, _ = _drafter(draft_model)
    plain.begin(PROMPT)
    tokens = PROMPT + [PENDING]
    unbiased = plain.propose(tokens, budget=5, generator=None).draft_ids
    eos_model = copy.deepcopy(draft_model)
    with torch.no_grad():  # EOS outscores the third draft token where that one was the argmax
        eos_model.lm_head.weight[EOS] = 1.05 * eos_model.lm_head.weight[unbiased[2]]
    drafter, feeds = _drafter(eos_model)
    drafter.begin(PROMPT)
    proposal = drafter.propose(tokens, budget=5, generator=None)
    assert EOS in proposal.draft_ids, "guard: the biased draft must propose EOS within the budget"
    assert proposal.draft_ids[-1] == EOS and proposal.draft_ids.count(EOS) == 1 and len(proposal) <= 3
    assert len(feeds) == len(proposal)  # EOS itself is never fed
    assert drafter.runner.num_computed == len(tokens) + len(proposal) - 1


def test_sampled_proposal_reports_its_distributions(draft_model):
    sampling = SamplingConfig(temperature=0.8, top_k=20)
    drafter, _ = _drafter(draft_model, make_chooser(sampling))
    drafter.begin(PROMPT)
    tokens = PROMPT + [PENDING]
    proposal = drafter.propose(tokens, budget=4, generator=torch.Generator().manual_seed(0))
    probs = proposal.draft_probs  # [k, V]
    assert probs.shape == (len(proposal), VOCAB) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(len(proposal)))
    assert ((probs > 0).sum(dim=-1) <= 20).all()  # top-k applied to what it samples from
    assert (probs[torch.arange(len(proposal)), proposal.draft_ids] > 0).all()
    drafter.begin(PROMPT)
    again = drafter.propose(tokens, budget=4, generator=torch.Generator().manual_seed(0))
    assert again.draft_ids == proposal.draft_ids and torch.equal(again.draft_probs, probs)


def test_ids_past_the_shared_vocab_are_never_proposed(draft_model):
    shared = VOCAB - 16
    boosted = copy.deepcopy(draft_model)
    with torch.no_grad():
        boosted.lm_head.weight[shared:] = 5.0 * boosted.lm_head.weight[:16]  # they would win unmasked
    sampling = SamplingConfig(temperature=1.0)
    for chooser in (GreedyChooser(), make_chooser(sampling)):
        drafter, _ = _drafter(boosted, chooser, shared=shared)
        drafter.begin(PROMPT)
        proposal = drafter.propose(PROMPT + [PENDING], budget=6, generator=torch.Generator().manual_seed(1))
        assert max(proposal.draft_ids) < shared
        if proposal.draft_probs is not None:
            assert proposal.draft_probs.shape == (len(proposal), VOCAB)
            assert (proposal.draft_probs[:, shared:] == 0).all()
    raw = lone_sequence(boosted).forward(PROMPT + [PENDING], last_only=True)  # [V]
    assert int(torch.argmax(raw)) >= shared  # guard: the mask is what keeps them out
