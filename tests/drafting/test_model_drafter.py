"""ModelDrafter's KV bookkeeping (DESIGN §2): feed what is unseen, commit back to the kept length."""

from __future__ import annotations

import copy

import pytest
import torch

from spectoolkit.config import SamplingConfig, TreeConfig
from spectoolkit.drafting import Budget, Lone, ModelDrafter, TokenTree, base, lone_drafter
from spectoolkit.drafting.base import BACKLOG_ROWS, Upkeep
from spectoolkit.models.float_model import keep_output_rows
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.runtime.lone import lone_sequence
from spectoolkit.sampling import GreedyChooser, make_chooser

VOCAB = 128
EOS = 2
EOS_IDS = frozenset({EOS})
PROMPT = [1, 17, 93, 50, 7, 41, 100, 12]
PENDING = 33  # the target's first token: verified, no KV anywhere yet
POSITIONS = 128  # the drafter's pool: every test's tokens and drafts fit
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def draft_model() -> torch.nn.Module:
    return tiny_llama(vocab_size=VOCAB, seed=4, scale=4.0)


def _drafter(
    model: torch.nn.Module, chooser=None, shared: int = VOCAB, tree: TreeConfig | None = None
) -> tuple[ModelDrafter, list[list[int]]]:
    """A greedy drafter for lone sequences whose runner records the token ids of every forward it runs."""
    drafter = lone_drafter(model, chooser or GreedyChooser(), VOCAB, shared, EOS_IDS, POSITIONS, tree=tree)
    assert drafter.runners() == {"draft": drafter.runner}  # guard: the runner recorded is the one it drives
    feeds: list[list[int]] = []
    original = drafter.runner.forward

    def forward(batch):
        assert batch.num_seqs == 1  # one lone sequence: a forward's tokens are that sequence's feed
        feeds.append(batch.token_ids.tolist())
        return original(batch)

    drafter.runner.forward = forward
    return drafter, feeds


def _propose(drafter: ModelDrafter, seq: Lone, budget: int) -> TokenTree:
    """A chain of at most ``budget`` drafts for ``seq``."""
    (chain,) = drafter.propose([seq], [Budget(budget, budget)])
    assert chain.is_chain()
    return chain


def _num_computed(drafter: ModelDrafter, seq: Lone) -> int:
    """Positions of ``seq`` with draft KV."""
    return drafter._states[id(seq)].num_computed


def _keep(drafter: ModelDrafter, seq: Lone, num_prefix: int, num_accepted: int) -> None:
    """Commit the first ``num_prefix`` tokens and the first ``num_accepted`` drafts of the last chain."""
    drafter.commit(seq, num_prefix, list(range(num_accepted)))


def test_first_propose_feeds_the_whole_prompt(draft_model):
    drafter, feeds = _drafter(draft_model)
    tokens = PROMPT + [PENDING]
    seq = Lone(tokens)
    proposal = _propose(drafter, seq, 3)
    assert len(proposal) == 3 and proposal.draft_probs is None
    assert feeds == [tokens, proposal.token_ids[:1], proposal.token_ids[1:2]]  # the last draft is not fed
    assert _num_computed(drafter, seq) == len(tokens) + 2


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_a_backlog_is_fed_apart_and_booked_as_upkeep(draft_model, tree, monkeypatch):
    """A prompt longer than BACKLOG_ROWS is fed, but its pending token, in a forward of its own before the first
    draft forward (which then feeds one token, as every later one does); the rows and seconds are the drafter's
    upkeep, its backlog says how many, and the drafts equal those of a drafter that feeds the prompt along."""
    config = TreeConfig(kind="static", branching=(2, 1, 1), max_nodes=4) if tree else None
    drafter, feeds = _drafter(draft_model, tree=config)
    long = Lone([(5 * i + 3) % VOCAB for i in range(3 * BACKLOG_ROWS)] + [PENDING])
    assert drafter.backlog(long) == len(long.tokens) - 1 and drafter.backlog(Lone(PROMPT + [PENDING])) == 0
    assert drafter.upkeep() == Upkeep()
    (proposal,) = drafter.propose([long], [Budget(3, 3)])
    assert feeds[0] == long.tokens[:-1] and feeds[1] == long.tokens[-1:]
    assert drafter.upkeep().rows == len(long.tokens) - 1 and drafter.upkeep().seconds > 0
    assert drafter.backlog(long) == 0
    monkeypatch.setattr(base, "BACKLOG_ROWS", len(long.tokens))
    along, feeds = _drafter(draft_model, tree=config)
    (expected,) = along.propose([Lone(list(long.tokens))], [Budget(3, 3)])
    assert feeds[0] == long.tokens and along.upkeep() == Upkeep()  # control: the prompt went along
    assert proposal.token_ids == expected.token_ids and proposal.parents == expected.parents


def test_a_drafter_carrying_two_rows_feeds_a_short_backlog_apart(draft_model):
    """With ``carry`` 2 (a hybrid's draft model: the tokens its lookup's rounds emitted are catch-up), a sequence
    holding more than two unfed rows has them fed apart and booked as upkeep; the drafts are the same."""
    drafter, feeds = _drafter(draft_model)
    drafter.carry = 2
    seq = Lone(PROMPT + [PENDING])
    assert len(seq.tokens) <= BACKLOG_ROWS and drafter.backlog(seq) == len(seq.tokens) - 1
    (proposal,) = drafter.propose([seq], [Budget(3, 3)])
    assert feeds[0] == seq.tokens[:-1] and feeds[1] == [PENDING]
    assert drafter.upkeep().rows == len(seq.tokens) - 1 and drafter.backlog(seq) == 0
    along, feeds = _drafter(draft_model)
    assert along.backlog(Lone(list(seq.tokens))) == 0  # control: the default carries them along
    (expected,) = along.propose([Lone(list(seq.tokens))], [Budget(3, 3)])
    assert feeds[0] == seq.tokens and proposal.token_ids == expected.token_ids


@pytest.mark.parametrize("forget", ["release", "reset"])
def test_release_and_reset_forget_a_previous_request(draft_model, forget):
    drafter, feeds = _drafter(draft_model)
    seq = Lone(PROMPT + [PENDING])
    first = _propose(drafter, seq, 4)
    if forget == "release":
        drafter.release(seq)
    else:
        drafter.reset()
    feeds.clear()
    again = _propose(drafter, seq, 4)
    assert feeds[0] == PROMPT + [PENDING]
    assert again.token_ids == first.token_ids


@pytest.mark.parametrize("num_accepted", [0, 1, 2, 3])
def test_commit_keeps_no_rejected_draft(draft_model, num_accepted):
    drafter, _ = _drafter(draft_model)
    tokens = PROMPT + [PENDING]
    seq = Lone(tokens)
    _propose(drafter, seq, 4)
    kept = len(tokens) + num_accepted
    _keep(drafter, seq, len(tokens), num_accepted)
    assert _num_computed(drafter, seq) <= kept
    assert _num_computed(drafter, seq) == kept  # 4 drafted, at most 3 accepted: all kept ones were fed


def test_after_rejection_feeds_only_the_correction(draft_model):
    drafter, feeds = _drafter(draft_model)
    tokens = PROMPT + [PENDING]
    seq = Lone(tokens)
    drafts = _propose(drafter, seq, 4).token_ids
    _keep(drafter, seq, len(tokens), 1)  # d1 accepted, d2 rejected
    correction = (drafts[1] + 1) % VOCAB
    feeds.clear()
    seq.tokens = tokens = tokens + drafts[:1] + [correction]
    proposal = _propose(drafter, seq, 2)
    assert feeds[0] == [correction]
    assert _num_computed(drafter, seq) == len(tokens) + len(proposal) - 1


def test_after_full_acceptance_feeds_last_draft_and_bonus(draft_model):
    drafter, feeds = _drafter(draft_model)
    tokens = PROMPT + [PENDING]
    seq = Lone(tokens)
    drafts = _propose(drafter, seq, 3).token_ids
    _keep(drafter, seq, len(tokens), 3)  # all accepted: the last draft was never fed
    assert _num_computed(drafter, seq) == len(tokens) + 2
    bonus = 77
    seq.tokens = tokens = tokens + drafts + [bonus]
    feeds.clear()
    proposal = _propose(drafter, seq, 3)
    assert feeds[0] == [drafts[-1], bonus]
    assert _num_computed(drafter, seq) == len(tokens) + len(proposal) - 1


def test_proposals_after_commit_equal_a_fresh_drafter(draft_model):
    """Committed-away KV must be indistinguishable from KV that never saw the rejected drafts."""
    drafter, _ = _drafter(draft_model)
    seq = Lone(PROMPT + [PENDING])
    for round_index in range(7):
        fresh, _ = _drafter(draft_model)
        expected = _propose(fresh, Lone(seq.tokens), 4).token_ids  # one prefill of all tokens
        drafts = _propose(drafter, seq, 4).token_ids
        assert drafts == expected, f"round {round_index}"
        num_accepted = min(round_index % 5, len(drafts))  # 0..4: rejections at every slot, then all
        next_token = (drafts[num_accepted] + 5) % VOCAB if num_accepted < len(drafts) else 9
        _keep(drafter, seq, len(seq.tokens), num_accepted)
        seq.tokens = seq.tokens + drafts[:num_accepted] + [next_token]


def test_stops_after_proposing_eos(draft_model):
    plain, _ = _drafter(draft_model)
    tokens = PROMPT + [PENDING]
    unbiased = _propose(plain, Lone(tokens), 5).token_ids
    eos_model = copy.deepcopy(draft_model)
    with torch.no_grad():  # EOS outscores the third draft token where that one was the argmax
        eos_model.lm_head.weight[EOS] = 1.05 * eos_model.lm_head.weight[unbiased[2]]
    drafter, feeds = _drafter(eos_model)
    seq = Lone(tokens)
    proposal = _propose(drafter, seq, 5)
    assert EOS in proposal.token_ids, "guard: the biased draft must propose EOS within the budget"
    assert proposal.token_ids[-1] == EOS and proposal.token_ids.count(EOS) == 1 and len(proposal) <= 3
    assert len(feeds) == len(proposal)  # EOS itself is never fed
    assert _num_computed(drafter, seq) == len(tokens) + len(proposal) - 1


def test_sampled_proposal_reports_its_distributions(draft_model):
    sampling = SamplingConfig(temperature=0.8, top_k=20)
    drafter, _ = _drafter(draft_model, make_chooser(sampling))
    tokens = PROMPT + [PENDING]
    seq = Lone(tokens, torch.Generator().manual_seed(0))
    proposal = _propose(drafter, seq, 4)
    probs = proposal.draft_probs  # [k, V]
    assert probs.shape == (len(proposal), VOCAB) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(dim=-1), torch.ones(len(proposal)))
    assert ((probs > 0).sum(dim=-1) <= 20).all()  # top-k applied to what it samples from
    assert (probs[torch.arange(len(proposal)), proposal.token_ids] > 0).all()
    drafter.release(seq)
    again = _propose(drafter, Lone(tokens, torch.Generator().manual_seed(0)), 4)
    assert again.token_ids == proposal.token_ids and torch.equal(again.draft_probs, probs)


def test_ids_past_the_shared_vocab_are_never_proposed(draft_model):
    shared = VOCAB - 16
    boosted = copy.deepcopy(draft_model)
    with torch.no_grad():
        boosted.lm_head.weight[shared:] = 5.0 * boosted.lm_head.weight[:16]  # they would win unmasked
    sampling = SamplingConfig(temperature=1.0)
    for chooser in (GreedyChooser(), make_chooser(sampling)):
        drafter, _ = _drafter(boosted, chooser, shared=shared)
        proposal = _propose(drafter, Lone(PROMPT + [PENDING], torch.Generator().manual_seed(1)), 6)
        assert max(proposal.token_ids) < shared
        if proposal.draft_probs is not None:
            assert proposal.draft_probs.shape == (len(proposal), VOCAB)
            assert (proposal.draft_probs[:, shared:] == 0).all()
    raw = lone_sequence(boosted).forward(PROMPT + [PENDING], last_only=True)  # [V]
    assert int(torch.argmax(raw)) >= shared  # guard: the mask is what keeps them out


def test_a_head_cut_to_frequent_tokens_drafts_the_best_of_them(draft_model):
    """draft.head_vocab: the cut head's logits are the kept rows' logits; the drafter proposes only kept ids, greedy
    the best of them, and when sampling q is the kept tokens' distribution scattered into the target vocabulary."""
    kept = torch.tensor(sorted({*range(1, VOCAB, 3), EOS}))
    cut = copy.deepcopy(draft_model)
    keep_output_rows(cut, kept)
    tokens = PROMPT + [PENDING]
    raw = lone_sequence(draft_model).forward(tokens, last_only=True)  # [V]
    assert int(torch.argmax(raw)) not in kept.tolist()  # guard: the whole head would propose another token
    assert torch.equal(lone_sequence(cut).forward(tokens, last_only=True), raw[kept])
    for chooser in (GreedyChooser(), make_chooser(SamplingConfig(temperature=1.0))):
        drafter = lone_drafter(cut, chooser, VOCAB, VOCAB, EOS_IDS, POSITIONS, vocab_ids=kept)
        proposal = _propose(drafter, Lone(list(tokens), torch.Generator().manual_seed(2)), 5)
        assert set(proposal.token_ids) <= set(kept.tolist())
        if proposal.draft_probs is None:
            assert proposal.token_ids[0] == int(kept[torch.argmax(raw[kept])])
        else:
            outside = torch.ones(VOCAB, dtype=torch.bool)
            outside[kept] = False
            assert proposal.draft_probs.shape == (len(proposal), VOCAB)
            assert (proposal.draft_probs[:, outside] == 0).all()
            assert torch.allclose(proposal.draft_probs[0, kept], torch.softmax(raw[kept], dim=-1), atol=1e-6)
