"""The EAGLE-3 drafter (spectoolkit/drafting/eagle.py) in the one engine: what it drafts is what the head computes
when unrolled whole over the target's states (its paged KV, rows and positions are right), and speculation with it
is greedy-exact at batch 1 and under batching, chains and dynamic trees."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spectoolkit.config import TreeConfig
from spectoolkit.drafting import eagle
from spectoolkit.drafting.base import BACKLOG_ROWS, Lone
from spectoolkit.models.eagle3_head import capture_states
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.sampling import GreedyChooser
from tests.serving import helpers

pytestmark = pytest.mark.usefixtures("one_thread")
GAMMA = 3


VOCAB = 96  # a small vocabulary: a head trained for seconds agrees with the target often


@pytest.fixture(scope="module")
def target():
    return helpers.switched(tiny_llama(vocab_size=VOCAB, seed=2, num_layers=6, scale=6.0))


@pytest.fixture(scope="module")
def trained(target):
    return helpers.eagle_head(target, steps=240)


def _prompts(lengths: tuple[int, ...]) -> list[list[int]]:
    gen = torch.Generator().manual_seed(11)  # not the training prompts' seed
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in lengths]


class Recording:
    """Wraps a drafter: keeps (the sequence's tokens, the proposal) of every round."""

    def __init__(self, drafter) -> None:
        self.drafter, self.rounds, self.backlogs = drafter, [], []

    def __getattr__(self, name):
        return getattr(self.drafter, name)

    def propose(self, seqs, budgets):
        made = self.drafter.propose(seqs, budgets)
        self.rounds.extend((list(seq.tokens), tree) for seq, tree in zip(seqs, made, strict=True))
        return made


@torch.no_grad()
def _unrolled_chain(head, target, tokens: list[int], length: int) -> list[int]:
    """The greedy chain the head drafts after ``tokens`` (the last one pending), computed whole: rows (x_{t+1},
    fc(states_t)) for every verified t, then each draft fed with the previous row's aux, causal attention."""
    states = capture_states(target, torch.tensor([tokens[:-1]]), head.shape.aux_layers)  # [1, c, 3H]
    embed = target.get_input_embeddings()
    ids, hidden = list(tokens[1:]), head.fc(states)
    draft = []
    for _ in range(length):
        positions = torch.arange(len(ids))[None]
        normed, aux = head(embed(torch.tensor([ids])), hidden, positions)
        token = int(head.draft_to_target[head.draft_logits(normed[0, -1]).argmax()])
        draft.append(token)
        ids, hidden = ids + [token], torch.cat([hidden, aux[:, -1:]], dim=1)
    return draft


@pytest.mark.parametrize("lengths", [(5, 9), (5, 3 * BACKLOG_ROWS)], ids=["short", "backlog"])
def test_drafts_are_the_head_unrolled_over_the_targets_states(target, trained, lengths):
    """A long prompt's rows are held until its first drafting round, which feeds them in a forward of its own (the
    upkeep the engine keeps out of draft costs, and tells the policy of by rows, as the scheduler told it the
    backlog) before it drafts."""
    drafter = Recording(helpers.eagle_drafter(target, trained, GreedyChooser(), weights=torch.float32))
    eng = helpers.engine(target, gamma=GAMMA, drafter=drafter)
    caught_up, choose = [], eng.policy.choose
    eng.policy.observe_catch_up = lambda rows, seconds: caught_up.append(rows)
    eng.policy.choose = lambda keys, caps, fixed, budget, backlogs, rooms, settled=None: (
        drafter.backlogs.extend(backlogs) or choose(keys, caps, fixed, budget, backlogs, rooms)
    )
    helpers.outputs(helpers.run(eng, helpers.requests(_prompts(lengths), 16)))
    chains = [(tokens, tree.token_ids) for tokens, tree in drafter.rounds if len(tree)]
    assert len(chains) >= 6
    for tokens, drafted in chains:
        assert drafted == _unrolled_chain(trained, target, tokens, len(drafted)), len(tokens)
    assert (drafter.upkeep().seconds > 0) == (max(lengths) > BACKLOG_ROWS)
    assert sum(caught_up) == drafter.upkeep().rows == sum(drafter.backlogs)
    assert (drafter.upkeep().rows >= max(lengths) - 1) == (max(lengths) > BACKLOG_ROWS)


def test_head_rows_match_the_heads_own_forward(target, trained):
    """One catch-up feed through the paged pool gives the logits of the head's own (SDPA) forward."""
    drafter = helpers.eagle_drafter(target, trained, GreedyChooser(), weights=torch.float32)
    tokens = _prompts((7,))[0]
    seq = Lone(tokens)
    states = capture_states(target, torch.tensor([tokens[:-1]]), trained.shape.aux_layers)[0]
    drafter.keep_states(seq, 0, states)
    chosen, logits, _ = drafter._catch_up([seq], [1])
    embed = target.get_input_embeddings()
    with torch.no_grad():
        positions = torch.arange(len(tokens) - 1)[None]
        normed, _ = trained(embed(torch.tensor([tokens[1:]])), trained.fc(states[None]), positions)
        want = trained.draft_logits(normed[0, -1])
    assert chosen == [0]
    torch.testing.assert_close(logits[0], want, rtol=1e-4, atol=1e-4)
    assert F.cosine_similarity(logits[0], want, dim=0) > 0.9999


@pytest.mark.parametrize("eager", [32, 2], ids=["held", "fed-when-handed"])
def test_states_handed_over_in_pieces_feed_as_one(target, trained, eager, monkeypatch):
    """Rows the engine hands over round by round (one position recomputed) give the head the KV and logits of the
    rows handed over at once: held until a round feeds them, or fed as they come (but the last)."""
    monkeypatch.setattr(eagle, "MAX_HELD", eager)
    tokens = _prompts((9,))[0]
    states = capture_states(target, torch.tensor([tokens[:-1]]), trained.shape.aux_layers)[0]  # [8, 3H]
    whole, pieces = (helpers.eagle_drafter(target, trained, GreedyChooser(), weights=torch.float32) for _ in "ab")
    seq_whole, seq_pieces = Lone(tokens), Lone(tokens)
    stale = states[3:6].clone()
    stale[2] += 100.0  # position 5 as first handed over; the target recomputes it next round
    for start, rows in ((0, states[:3]), (3, stale), (5, states[5:])):
        pieces.keep_states(seq_pieces, start, rows)
    assert pieces._state(seq_pieces).pending == (8 if eager == 32 else 1)
    monkeypatch.setattr(eagle, "MAX_HELD", 32)
    whole.keep_states(seq_whole, 0, states)
    _, want, _ = whole._catch_up([seq_whole], [1])
    _, got, _ = pieces._catch_up([seq_pieces], [1])
    torch.testing.assert_close(got, want)
    assert pieces._state(seq_pieces).pending == 0 and pieces._state(seq_pieces).num_computed == 8


def test_prompts_sharing_a_prefix_both_draft(target, trained):
    """Two live prompts with a common prefix: the second takes the first's target blocks and the head's blocks of
    that prefix, and its drafts are still the head unrolled whole over its own tokens."""
    drafter = Recording(helpers.eagle_drafter(target, trained, GreedyChooser(), weights=torch.float32))
    eng = helpers.engine(target, gamma=GAMMA, drafter=drafter)
    shared = _prompts((4 * helpers.BLOCK + 3,))[0]  # they part inside a block (at a block's end, see _adopt)
    prompts = [shared + [5, 6, 7], shared + [8, 9]]
    first, second = helpers.requests(prompts, 12)
    adopt, adopted = drafter.drafter._adopt, []
    drafter.drafter._adopt = lambda *args: adopted.append(adopt(*args)) or adopted[-1]
    eng.submit(first)
    done = {result.request_id: result for _ in range(2) for result in eng.step()}  # the first's prompt is computed
    done |= helpers.run(eng, [second])
    assert helpers.outputs(done) == helpers.outputs(helpers.run(helpers.engine(target), helpers.requests(prompts, 12)))
    for prompt in prompts:
        rounds = [(tokens, tree) for tokens, tree in drafter.rounds if tokens[: len(prompt)] == prompt]
        assert rounds and sum(1 for _, tree in rounds if len(tree)) >= len(rounds) - 1, prompt
        for tokens, tree in rounds:
            assert tree.token_ids == _unrolled_chain(trained, target, tokens, len(tree)), len(tokens)
    assert adopted == [True], "the second prompt did not start from the first's shared prefix"


@pytest.mark.parametrize("tail", [[5, 6, 7], []], ids=["part-inside-a-block", "part-at-a-block-end"])
def test_a_prompt_sharing_a_prefix_whose_rows_are_held_unfed_still_drafts(target, trained, tail):
    """The first prompt's rows are held, not fed (its requests sat out rounds under load): the second, started from
    its shared target blocks, copies the target's states of the prefix from it and drafts what the head drafts fed
    whole; also where the prompts part right after the prefix (the head's blocks could not be shared there)."""
    shared = _prompts((4 * helpers.BLOCK,))[0]
    first, second = Lone(shared + tail + [9, 10]), Lone(shared + [11, 12, 13])
    start = len(shared)
    states = [capture_states(target, torch.tensor([seq.tokens[:-1]]), trained.shape.aux_layers)[0]
              for seq in (first, second)]  # fmt: skip
    drafter = helpers.eagle_drafter(target, trained, GreedyChooser(), weights=torch.float32)
    drafter.keep_states(first, 0, states[0])
    drafter.keep_states(second, start, states[1][start:])
    assert drafter._state(second).pending == len(second.tokens) - 1, "the second prompt held nothing to feed"
    whole = helpers.eagle_drafter(target, trained, GreedyChooser(), weights=torch.float32)
    alone = Lone(list(second.tokens))
    whole.keep_states(alone, 0, states[1])
    _, want, _ = whole._catch_up([alone], [1])
    _, got, _ = drafter._catch_up([second], [1])
    torch.testing.assert_close(got, want)
    _, first_logits, _ = drafter._catch_up([first], [1])  # the donor still feeds its own rows
    assert first_logits.shape[0] == 1


TREE = TreeConfig(kind="dynamic", max_nodes=8, top_k=3)


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "dynamic-tree"])
@pytest.mark.parametrize("concurrency", [1, 4])
def test_speculation_with_the_head_is_greedy_exact(target, trained, tree, concurrency):
    prompt_ids = _prompts((4, 7, 11, 6))
    drafter = helpers.eagle_drafter(target, trained, GreedyChooser(), tree)
    eng = helpers.engine(target, gamma=TREE.max_nodes if tree else GAMMA, drafter=drafter, invariant=True, depth=GAMMA)
    reqs = helpers.requests(prompt_ids, 20)
    if concurrency > 1:
        done = helpers.run(eng, reqs)
    else:
        done = {r.request_id: helpers.run(eng, [r])[r.request_id] for r in reqs}
    assert helpers.outputs(done) == helpers.baseline_outputs(target, prompt_ids, 20)
    drafted, accepted = (sum(getattr(r, key) for r in done.values()) for key in ("drafted_tokens", "accepted_tokens"))
    assert 0 < accepted < drafted, (accepted, drafted)
    assert helpers.all_free(eng) and drafter.allocator.num_free == drafter.allocator.num_blocks


def test_the_hybrid_takes_suffix_drafts_or_the_heads_and_stays_greedy_exact(target, trained):
    """Repetitive prompts give the suffix tries long matches (they draft those rounds); elsewhere the head drafts.
    The hybrid hands the head's capture, states and backlog through, and the engine's step times to its curve."""
    from spectoolkit.drafting import SuffixDrafter, SuffixSettings
    from spectoolkit.drafting.hybrid import HybridDrafter

    gen = torch.Generator().manual_seed(3)
    bases = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (6, 9, 5, 8)]
    prompt_ids = [base * 3 for base in bases] + _prompts((7, 10))
    suffix = SuffixDrafter(SuffixSettings(), VOCAB, one_hot_probs=False)
    head = helpers.eagle_drafter(target, trained, GreedyChooser(), None)
    drafter = HybridDrafter(suffix, head)
    assert drafter.capture == head.capture and drafter.name == "hybrid"
    eng = helpers.engine(target, gamma=GAMMA, drafter=drafter, invariant=True)
    done = helpers.run(eng, helpers.requests(prompt_ids, 24))
    assert helpers.outputs(done) == helpers.baseline_outputs(target, prompt_ids, 24)
    assert drafter.rounds["lookup"] > 0 and drafter.rounds["model"] > 0, drafter.rounds
    assert sum(r.accepted_tokens for r in done.values()) > 0
    widths = max(curve.widths() for curve in drafter.costs.curves.values())
    assert widths >= 2, "the engine's decode steps never reached the hybrid's step curve"
    assert drafter.upkeep() == head.upkeep()
    assert helpers.all_free(eng) and drafter.kv_bytes() == 0
