"""The priced hybrid (spectoolkit/drafting/hybrid.py): suffix decoding beside a draft model is greedy-exact on the
serving engine at any concurrency; per request it takes the model only when the model's expected emitted tokens per
second of step beat the lookup's (the step curve's rows, the model's own seconds, shared among the requests that
take it); it hands the engine's calls through to its parts; and draft.hybrid_with builds and validates it."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from spectoolkit.config import DraftConfig, RunConfig, TreeConfig, drafter_kinds
from spectoolkit.drafting import ModelDrafter, SuffixDrafter, SuffixSettings, TokenTree
from spectoolkit.drafting.base import Budget, Lone, Upkeep
from spectoolkit.drafting.hybrid import MODEL_CARRY, PROBE_EVERY, HybridDrafter
from spectoolkit.errors import SpecToolkitError
from spectoolkit.policy.costs import WINDOW
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import make_runner
from spectoolkit.sampling import GreedyChooser
from spectoolkit.serving.factory import batched_drafter
from tests.serving import helpers
from tests.serving.helpers import BLOCK, EOS_IDS, VOCAB

pytestmark = pytest.mark.usefixtures("one_thread")
GAMMA = 4
MAX_NEW = 24
LOOKUP_TOKEN, MODEL_TOKEN = 5, 7
BUDGET = Budget(GAMMA, GAMMA)


# ---- greedy identity on the serving engine -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def target():
    return helpers.tiny()


@pytest.fixture(scope="module")
def prompt_ids():
    """Prompts that repeat themselves (the suffix tries find long matches) and plain ones (the model drafts)."""
    repeated = helpers.prompts((6, 9, 5), seed=3)
    return [prompt * 2 for prompt in repeated] + helpers.prompts((13, 21, 7, 3))


@pytest.fixture(scope="module")
def references(target, prompt_ids):
    return helpers.baseline_outputs(target, prompt_ids, MAX_NEW)


def _model_drafter(tree: TreeConfig | None) -> ModelDrafter:
    """A draft model that agrees with the target in part (its weights plus noise)."""
    draft = helpers.noisy_target(0.2, seed=5)
    runner = make_runner(draft, make_pool(draft, "auto", 200 * BLOCK))
    return ModelDrafter(runner, GreedyChooser(), BlockAllocator(200, BLOCK), VOCAB, VOCAB, EOS_IDS, "model", None, tree)


@pytest.mark.parametrize(
    ("concurrency", "tree"),
    [(1, None), (4, None), (7, None), (4, TreeConfig(kind="dynamic", max_nodes=8, top_k=3))],
    ids=["c1", "c4", "c7", "c4-tree"],
)
def test_suffix_with_a_draft_model_is_greedy_exact(target, prompt_ids, references, concurrency, tree):
    model = _model_drafter(tree)
    drafter = HybridDrafter(SuffixDrafter(SuffixSettings(), VOCAB, one_hot_probs=False, tree=tree), model,
                            "hybrid-model")  # fmt: skip
    assert drafter.runners() == model.runners() and drafter.capture == ()
    nodes = tree.max_nodes if tree is not None else GAMMA
    eng = helpers.engine(target, gamma=nodes, depth=GAMMA, drafter=drafter, max_num_seqs=concurrency)
    done = helpers.run(eng, helpers.requests(prompt_ids, MAX_NEW))
    assert helpers.outputs(done) == references
    if concurrency == len(prompt_ids):
        assert max(max(r.batch_sizes) for r in done.values()) == concurrency, "the requests never ran together"
    assert drafter.rounds["model"] > 0, drafter.rounds
    assert sum(r.accepted_tokens for r in done.values()) > 0
    widths = max(curve.widths() for curve in drafter.costs.curves.values())
    assert widths >= 2, "the engine's decode steps never reached the hybrid's step curve"
    assert helpers.all_free(eng) and drafter.kv_bytes() == 0, "KV left behind (target or draft)"


def test_the_lookup_drafts_where_it_matches(target, prompt_ids, references):
    """Over every concurrency the lookup takes rounds too (a draft model as large as the target is dear)."""
    rounds = {"lookup": 0, "model": 0}
    for concurrency in (1, 7):
        drafter = HybridDrafter(SuffixDrafter(SuffixSettings(), VOCAB, one_hot_probs=False), _model_drafter(None))
        eng = helpers.engine(target, gamma=GAMMA, drafter=drafter, max_num_seqs=concurrency)
        assert helpers.outputs(helpers.run(eng, helpers.requests(prompt_ids, MAX_NEW))) == references
        rounds = {part: rounds[part] + drafter.rounds[part] for part in rounds}
    assert rounds["lookup"] > 0 and rounds["model"] > 0, rounds


# ---- the decision rule -------------------------------------------------------------------------------------------


class ScoredLookup(helpers.StatelessDrafter):
    """A lookup proposing ``length`` tokens scored ``score`` (the test sets both, and may change them)."""

    name, tree = "scored", None

    def __init__(self, length: int, score: float) -> None:
        self.length, self.score = length, score

    def scored(self, seq, budget: Budget) -> tuple[TokenTree, float]:
        length = min(self.length, budget.nodes, budget.depth)
        return TokenTree.chain([LOOKUP_TOKEN] * length), self.score if length else 0.0

    def propose(self, seqs, budgets):
        return [self.scored(seq, budget)[0] for seq, budget in zip(seqs, budgets, strict=True)]


class TimedModel(ScoredLookup):
    """A model-backed drafter of whole chains taking ``seconds`` per draft forward (asleep); ``calls``: how many
    sequences each of its calls drafted for."""

    name = "timed"

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds, self.calls = seconds, []

    def propose(self, seqs, budgets):
        self.calls.append(len(seqs))
        lengths = [min(budget.nodes, budget.depth) for budget in budgets]
        time.sleep(self.seconds * max(lengths, default=0))  # one batched forward per depth
        return [TokenTree.chain([MODEL_TOKEN] * length) for length in lengths]


def _trained(lookup: ScoredLookup, model: TimedModel, kept: int = GAMMA, rounds: int = 12) -> HybridDrafter:
    """A hybrid whose model kept ``kept`` tokens of each of ``rounds`` rounds (before any step was measured, when the
    model is taken wherever it expects more than the lookup)."""
    hybrid = HybridDrafter(lookup, model)
    seq = Lone([1, 2, 3])
    for _ in range(rounds):
        (proposal,) = hybrid.propose([seq], [BUDGET])
        assert proposal.token_ids[:1] == [MODEL_TOKEN]
        hybrid.commit(seq, len(seq.tokens), list(range(min(kept, len(proposal)))))
    hybrid.release(seq)
    return hybrid


def _steps(hybrid: HybridDrafter, seconds_by_tokens: dict[int, float]) -> None:
    """The engine's decode steps took these times (a whole window each: earlier ones are forgotten)."""
    for _ in range(WINDOW):
        for tokens, seconds in seconds_by_tokens.items():
            hybrid.observe_step(tokens, seconds, 1)


def _drafted_by(hybrid: HybridDrafter, count: int = 1) -> list[str]:
    """Who drafts this round for each of ``count`` new requests."""
    seqs = [Lone([1, 2, 3]) for _ in range(count)]
    made = hybrid.propose(seqs, [BUDGET] * count)
    for seq in seqs:
        hybrid.release(seq)
    return ["model" if proposal.token_ids[:1] == [MODEL_TOKEN] else "lookup" for proposal in made]


def test_the_model_is_taken_only_where_its_rows_pay():
    """A lookup of one token expected kept (0.2) against a model that keeps ~4 of its 4: where extra rows are nearly
    free the model's wins; where each row past the second costs twice a plain step, its four rows do not pay."""
    hybrid = _trained(ScoredLookup(1, 0.2), TimedModel())
    assert hybrid.overall > 3.5
    _steps(hybrid, {n: 1.0 + 0.001 * n for n in range(1, 6)})
    assert _drafted_by(hybrid) == ["model"]
    _steps(hybrid, {1: 1.0, 2: 1.2, 3: 3.0, 4: 5.0, 5: 7.0})  # (0.2 + 1) / 1.2 = 1.0 against (~4 + 1) / 7
    assert _drafted_by(hybrid) == ["lookup"]
    _steps(hybrid, {n: 1.0 + 0.001 * n for n in range(1, 6)})
    assert _drafted_by(hybrid) == ["model"]


def test_the_lookup_is_taken_where_the_models_own_seconds_do_not_pay():
    """A lookup expected to keep 3 of 4 against a model keeping ~4 of 4 at 5 ms a draft forward: on slow steps (1 s)
    the model's drafting is nothing and its extra token wins; on fast ones (1 ms) its 20 ms cost more than it gains."""
    lookup = ScoredLookup(GAMMA, 0.2)
    hybrid = _trained(lookup, TimedModel(0.005))
    lookup.score = 3.0
    _steps(hybrid, {n: 1.0 + 0.01 * n for n in range(1, 6)})
    assert _drafted_by(hybrid) == ["model"]
    _steps(hybrid, {n: 0.001 + 0.00001 * n for n in range(1, 6)})
    assert _drafted_by(hybrid) == ["lookup"]


def test_the_models_seconds_are_shared_by_the_requests_that_take_it():
    """Rows cost 10 ms each, and the model at least 10 ms a forward (40 ms a round of 4). Alone, a request's lookup
    (1.2 tokens for 20 ms) beats the model (~5 for 90 ms); eight requests share the model's 40 ms (~5 for 55 ms
    each), and all eight take it in one batched call."""
    model = TimedModel(0.01)
    hybrid = _trained(ScoredLookup(1, 0.2), model)
    _steps(hybrid, {n: 0.01 * n for n in range(1, 14)})
    assert _drafted_by(hybrid) == ["lookup"]
    calls = len(model.calls)
    assert _drafted_by(hybrid, 8) == ["model"] * 8
    assert model.calls[calls:] == [8]


def test_a_request_with_nothing_to_look_up_probes_the_model_now_and_then():
    """The model kept nothing lately and its rows cost more than its mean is worth ((0 + 1) / 1.5 s against a plain
    1 / 1.1 s), though a round of it all kept would pay (5 / 1.5 s): a request with no lookup proposal decodes
    plainly, and every PROBE_EVERY plain rounds the model drafts once (so its mean can recover)."""
    hybrid = _trained(ScoredLookup(0, 0.0), TimedModel(), kept=0)
    _steps(hybrid, {n: 1.0 + 0.1 * n for n in range(1, 6)})
    seq = Lone([1, 2, 3])
    made = []
    for _ in range(2 * PROBE_EVERY + 2):
        (proposal,) = hybrid.propose([seq], [BUDGET])
        made.append(len(proposal))
        hybrid.commit(seq, len(seq.tokens), [])
    assert made == ([0] * PROBE_EVERY + [GAMMA]) * 2, made
    assert hybrid.rounds == {"lookup": 0, "model": 12 + 2}


class OwingModel(TimedModel):
    """A model that first feeds each request's ``owed`` rows apart, ``per_row`` seconds each (asleep), booked as its
    upkeep."""

    def __init__(self, owed: int, per_row: float) -> None:
        super().__init__()
        self.owed, self.per_row, self.spent = owed, per_row, Upkeep()

    def backlog(self, seq) -> int:
        return self.owed

    def upkeep(self) -> Upkeep:
        return self.spent

    def propose(self, seqs, budgets):
        rows = self.owed * len(seqs)
        time.sleep(rows * self.per_row)
        self.spent = Upkeep(self.spent.seconds + rows * self.per_row, self.spent.rows + rows)
        return super().propose(seqs, budgets)


def test_no_probe_where_even_a_round_all_kept_would_not_pay():
    """A probe pays the model's catch-up too: with 1000 rows owed at 10 ms, even a round of four tokens all kept
    ((4 + 1) / 11.5 s) loses to a plain decode (1 / 1.1 s), so the model is never asked (issue 57: unpriced probes at
    c16 fed the 0.5B the prompts of the requests it had not drafted for, 1.4 s in one step)."""
    model = OwingModel(1, 0.01)
    hybrid = _trained(ScoredLookup(0, 0.0), model, kept=0)
    _steps(hybrid, {n: 1.0 + 0.1 * n for n in range(1, 6)})
    model.owed, calls = 1000, len(model.calls)
    seq = Lone([1, 2, 3])
    for _ in range(2 * PROBE_EVERY + 2):
        (proposal,) = hybrid.propose([seq], [BUDGET])
        assert len(proposal) == 0
        hybrid.commit(seq, len(seq.tokens), [])
    assert len(model.calls) == calls


def test_the_models_catch_up_is_priced():
    """A request the model last drafted for many tokens ago (the lookup's rounds) owes it those rows, fed apart at the
    seconds per row it measured: 40 rows at 10 ms cost more than the model's extra tokens are worth on 100 ms steps,
    1 row does not. The catch-up is not booked as draft forwards."""
    model = OwingModel(1, 0.01)
    hybrid = _trained(ScoredLookup(1, 0.2), model)
    assert hybrid.catch_up.per_forward == pytest.approx(0.01, rel=0.5)
    _steps(hybrid, {n: 0.1 + 0.0001 * n for n in range(1, 6)})  # (4 + 1) / 0.11 s against (0.2 + 1) / 0.1 s
    assert _drafted_by(hybrid) == ["model"]
    model.owed = 40  # (4 + 1) / 0.5 s
    assert _drafted_by(hybrid) == ["lookup"]
    assert hybrid.costs.draft(1) < 0.005  # its draft forwards took no time: the catch-up was not booked as them


def test_the_models_mean_outlives_a_reset():
    """A pass's reset forgets the requests, not what the model keeps over them (the policy keeps its workload
    acceptance too): reset to 1 token, the model had to win its way back by probes every pass."""
    hybrid = _trained(ScoredLookup(1, 0.2), TimedModel())
    before = hybrid.overall
    hybrid.reset()
    assert before > 3.5 and hybrid.overall == before


def test_a_request_without_a_budget_asks_neither_part():
    model = TimedModel()
    hybrid = HybridDrafter(ScoredLookup(2, 1.0), model)
    assert hybrid.propose([Lone([1, 2])], [Budget(0, GAMMA)]) == [TokenTree([], [])]
    assert model.calls == [] and hybrid.rounds == {"lookup": 0, "model": 0}


# ---- what the engine asks of it ----------------------------------------------------------------------------------


class HeadLike(TimedModel):
    """A model part reading the target's states, with a backlog and upkeep of its own; ``variants``: what it was
    asked for."""

    capture = (1, 3, 5)

    def __init__(self) -> None:
        super().__init__()
        self.kept, self.variants = [], []

    def keep_states(self, seq, start: int, states) -> None:
        self.kept.append((start, states))

    def backlog(self, seq) -> int:
        return 7

    def upkeep(self) -> Upkeep:
        return Upkeep(0.5, 3)

    def variant(self, stop_below, tree):
        self.variants.append((stop_below, tree))
        return HeadLike()


def test_the_engines_calls_reach_the_model_part():
    head = HeadLike()
    lookup = ScoredLookup(0, 1.0)
    hybrid = HybridDrafter(lookup, head, "hybrid")
    seq = Lone([1, 2, 3])
    assert hybrid.capture == (1, 3, 5) and hybrid.backlog(seq) == 7
    lookup.length = 1  # the lookup has a proposal: it drafts without the head's catch-up
    assert hybrid.backlog(seq) == 0
    hybrid.keep_states(seq, 2, "states")
    assert head.kept == [(2, "states")]
    assert hybrid.upkeep() == Upkeep(0.5, 3)  # the lookup spends none
    tree = TreeConfig(kind="dynamic")
    sibling = hybrid.variant(0.4, tree)
    assert isinstance(sibling, HybridDrafter) and sibling.name == "hybrid" and head.variants == [(0.4, tree)]
    assert isinstance(sibling.model, HeadLike) and sibling.model is not head


# ---- configuration -----------------------------------------------------------------------------------------------


def test_hybrid_with_is_validated_and_names_the_parts():
    with pytest.raises(SpecToolkitError, match=r"draft.hybrid_with='medusa'.*eagle.*model"):
        DraftConfig(kind="hybrid", hybrid_with="medusa")
    with pytest.raises(SpecToolkitError, match="draft.precision"):
        DraftConfig(kind="hybrid", hybrid_with="model", precision="fp7")
    assert drafter_kinds(RunConfig(draft=DraftConfig(kind="hybrid"))) == {"hybrid", "suffix", "eagle"}
    assert drafter_kinds(RunConfig(draft=DraftConfig(kind="hybrid", hybrid_with="model"))) == {"hybrid", "suffix",
                                                                                                "model"}  # fmt: skip
    assert "model" not in drafter_kinds(RunConfig(draft=DraftConfig(kind="suffix", hybrid_with="model")))


def test_the_factory_pairs_suffix_decoding_with_the_loaded_draft_model(target):
    cfg = RunConfig(draft=DraftConfig(kind="hybrid", hybrid_with="model"))
    draft = helpers.noisy_target(0.2, seed=5)
    models = SimpleNamespace(
        target=SimpleNamespace(model=target, vocab_size=VOCAB),
        draft=SimpleNamespace(model=draft, vocab_size=VOCAB, vocab_ids=None),
        eos_ids=EOS_IDS,
    )  # fmt: skip
    drafter = batched_drafter(cfg, models, 64 * cfg.serve.block_size)
    assert isinstance(drafter, HybridDrafter) and drafter.name == "hybrid-model"
    assert isinstance(drafter.lookup, SuffixDrafter) and isinstance(drafter.model, ModelDrafter)
    assert drafter.model.carry == MODEL_CARRY and drafter.variant(None, None).model.carry == MODEL_CARRY
    assert drafter.model.name == cfg.draft.model_name and drafter.runners()["draft"].model is draft
