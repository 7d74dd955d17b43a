"""Shared builders for the serving tests: a tiny target switched as load_model does, engines over it."""

from __future__ import annotations

import dataclasses

import torch

from spectoolkit.drafting import ModelDrafter, NgramDrafter, TokenTree
from spectoolkit.drafting.base import Drafter
from spectoolkit.kernels.kernel_choice import choose_kernels
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.policy import FixedPolicy
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.eager import EagerRunner
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import make_runner, run_segments
from spectoolkit.serving.api import FinishedRequest, ServeRequest, StepStats
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.scheduler import SchedulerLimits
from spectoolkit.verify import GreedyVerifier
from tests.noise import noisy_copy
from tests.reference import alone_greedy

VOCAB = 512
EOS = 2
EOS_IDS = frozenset({EOS})
BLOCK = 8
MAX_POSITIONS = 1024


def switched(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` decoding row-invariantly with the reference kernels (what load_model does)."""
    choose_kernels(model, "reference")
    return model


def paged_forward(model: torch.nn.Module, pool, segments: list, invariant: bool) -> torch.Tensor:
    """One eager-runner forward of ``segments`` over ``pool``: logits [R, V] of their ``logit_rows``."""
    return run_segments(EagerRunner(model, pool), segments, "invariant" if invariant else "plain")


def tiny(seed: int = 0, scale: float = 3.0) -> torch.nn.Module:
    return switched(tiny_llama(vocab_size=VOCAB, seed=seed, scale=scale))


def noisy_target(sigma: float, seed: int) -> torch.nn.Module:
    """The target's weights (:func:`tiny`) plus Gaussian noise: a draft that agrees in part."""
    return switched(noisy_copy(tiny_llama(vocab_size=VOCAB, seed=0, scale=3.0), sigma, seed))


def prompts(lengths: tuple[int, ...], seed: int = 1) -> list[list[int]]:
    """Random prompts of ``lengths`` with a repeated stretch, so n-gram lookup finds drafts."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for length in lengths:
        base = torch.randint(3, VOCAB, (length,), generator=gen).tolist()
        out.append(base + base[:5] + base)
    return out


def engine(
    model: torch.nn.Module,
    *,
    gamma: int = 0,
    drafter=None,
    num_blocks: int = 200,
    max_num_tokens: int = 64,
    max_num_seqs: int = 8,
    spec_max_batch: int | None = None,
    max_draft_tokens: int | None = None,
    kv: str = "auto",
    invariant: bool = False,
    verifier=None,
    stochastic: bool = False,
    policy=None,
    depth: int | None = None,
    prefix_cache: bool = False,
    verifier_for=None,
) -> ContinuousEngine:
    """``policy`` (default: fixed ``gamma`` drafts or tree nodes, ``depth`` deep) holds the draft length when there
    is a ``drafter``; ``prefix_cache``: finished requests' full blocks stay cached; ``verifier_for``: the verifier of a
    request with sampling of its own (default: the engine's choice)."""
    limits = SchedulerLimits(max_num_tokens, max_num_seqs, spec_max_batch, max_draft_tokens)
    if drafter is not None and policy is None:
        policy = FixedPolicy(gamma, depth)
    return ContinuousEngine(
        "test", make_runner(model, make_pool(model, kv, num_blocks * BLOCK)),
        BlockAllocator(num_blocks, BLOCK, prefix_cache), verifier or GreedyVerifier(), limits, EOS_IDS, MAX_POSITIONS,
        drafter, stochastic, invariant, policy, verifier_for,
    )  # fmt: skip


def default_rule(stochastic: bool = False):
    """The rule of a request without sampling of its own on a greedy engine (``stochastic``: it draws anyway, from
    its request's generator)."""
    from spectoolkit.serving.rounds import default_rule as rule
    from spectoolkit.verify.tree import TreeVerifier

    verifier = GreedyVerifier()
    return rule(verifier, TreeVerifier(verifier.sampling), stochastic)


def model_drafter(draft: torch.nn.Module, chooser, num_blocks: int = 200, kv: str = "auto") -> ModelDrafter:
    pool = make_pool(draft, kv, num_blocks * BLOCK)
    return ModelDrafter(make_runner(draft, pool), chooser, BlockAllocator(num_blocks, BLOCK), VOCAB, VOCAB, EOS_IDS)


def run(eng: ContinuousEngine, requests: list[ServeRequest], max_steps: int = 10_000) -> dict[str, FinishedRequest]:
    """Submit ``requests`` at once and step until idle; request id -> its result."""
    for request in requests:
        eng.submit(request)
    done: dict[str, FinishedRequest] = {}
    for _ in range(max_steps):
        if not eng.has_work():
            break
        for result in eng.step():
            assert result.request_id not in done, f"{result.request_id} finished twice"
            done[result.request_id] = result
    assert not eng.has_work(), "the engine did not drain"
    return done


def requests(prompt_ids: list[list[int]], max_new: int, seed: int = 0) -> list[ServeRequest]:
    return [ServeRequest(str(i), list(p), max_new, seed=seed + i) for i, p in enumerate(prompt_ids)]


def outputs(done: dict[str, FinishedRequest]) -> dict[str, list[int]]:
    for result in done.values():
        assert result.error is None, f"{result.request_id}: {result.error}"
    return {rid: result.output_ids for rid, result in done.items()}


def alone(eng: ContinuousEngine, reqs: list[ServeRequest]) -> dict[str, list[int]]:
    """Each request run by itself on ``eng`` (concurrency 1)."""
    out = {}
    for request in reqs:  # its own settings kept; a fresh generator from its seed; no leader to wait for
        copy = dataclasses.replace(request, prompt_ids=list(request.prompt_ids), generator=None, after=None)
        out.update(outputs(run(eng, [copy])))
    return out


def baseline_outputs(model: torch.nn.Module, prompt_ids: list[list[int]], max_new: int,
                     kv: str = "auto") -> dict[str, list[int]]:  # fmt: skip
    """The batch-1 reference: the target alone on the one runner (a lone sequence), greedy."""
    return {str(i): alone_greedy(model, list(p), max_new, EOS_IDS, kv) for i, p in enumerate(prompt_ids)}


class StepLog:
    """An ``on_step`` callback keeping every StepStats."""

    def __init__(self) -> None:
        self.steps: list[StepStats] = []

    def __call__(self, stats: StepStats) -> None:
        self.steps.append(stats)


def all_free(eng: ContinuousEngine) -> bool:
    return eng.allocator.num_free == eng.allocator.num_blocks


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The raw bits of ``tensor`` as integers (so -0.0 != 0.0, NaN == NaN, and float8 compares at all)."""
    return tensor.contiguous().view(_INT_VIEW[tensor.element_size()])


def assert_same_bits(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor], what: str = "") -> None:
    """Two dicts of stored KV fields are bit-identical (same names, dtypes, shapes and bits)."""
    assert first.keys() == second.keys(), what
    for name in first:
        assert first[name].dtype == second[name].dtype, f"{what}: field {name} dtype"
        assert torch.equal(bits(first[name]), bits(second[name])), f"{what}: field {name} differs"


class StatelessDrafter(Drafter):
    """A test drafter of chains holding no per-sequence state: its bookkeeping calls do nothing."""

    tree = None

    def commit(self, seq, num_prefix: int, path: list[int]) -> None:
        pass

    def release(self, seq) -> None:
        pass

    def reset(self) -> None:
        pass

    def runners(self) -> dict:
        return {}

    def kv_bytes(self) -> int:
        return 0

    def describe_tree(self) -> None:
        return None

    def variant(self, stop_below, tree):
        return self


class ContinuationDrafter(StatelessDrafter):
    """Chains read off a known ``reference`` continuation of the prompt, as far as each budget allows, passed
    through :meth:`adjust` (a subclass's change: wrong ids, junk past EOS)."""

    def __init__(self, reference: list[int]) -> None:
        self.reference = reference

    def propose(self, seqs, budgets) -> list[TokenTree]:
        out = []
        for seq, budget in zip(seqs, budgets, strict=True):
            emitted, length = len(seq.tokens) - seq.prompt_len, min(budget.nodes, budget.depth)
            out.append(TokenTree.chain(self.adjust(self.reference[emitted : emitted + length], length)))
        return out

    def adjust(self, draft_ids: list[int], length: int) -> list[int]:
        return draft_ids


def record_proposed(drafter) -> list[int]:
    """Every token ``drafter`` proposes from now on (its ``propose`` wrapped), in order."""
    proposed: list[int] = []
    original = drafter.propose

    def propose(seqs, budgets):
        trees = original(seqs, budgets)
        proposed.extend(token for tree in trees for token in tree.token_ids)
        return trees

    drafter.propose = propose
    return proposed


def eagle_head(target: torch.nn.Module, draft_vocab: int = 64, steps: int = 0, seed: int = 0):
    """An EAGLE-3 head for ``target`` (untrained, or trained ``steps`` steps on its greedy answers to random
    prompts: a head that agrees with the target often)."""
    from spectoolkit.models.eagle3_head import Eagle3Head, HeadShape, draft_vocabulary
    from spectoolkit.training.data import greedy_answer, target_sequence
    from spectoolkit.training.loop import TrainSettings, train

    vocab = target.get_input_embeddings().num_embeddings
    gen = torch.Generator().manual_seed(seed)
    texts = [torch.randint(3, vocab, (int(n),), generator=gen).tolist() for n in torch.randint(6, 14, (48,))]
    pairs = [(p, greedy_answer(target, p, 24, (EOS,))) for p in texts] if steps else [(p, []) for p in texts]
    draft_ids = draft_vocabulary([p + a for p, a in pairs], draft_vocab, vocab)
    shape = HeadShape.of_target(target.config, draft_vocab)
    torch.manual_seed(seed)
    head = Eagle3Head(shape, draft_ids)
    if steps:
        seqs = [target_sequence(target, p, a, shape.aux_layers, draft_ids) for p, a in pairs if a]
        embeddings = target.get_input_embeddings().weight.detach()
        train(head, embeddings, seqs, TrainSettings(steps=steps, lr=3e-3, save_every=0))
    return head.eval()


def eagle_drafter(target: torch.nn.Module, head, chooser, tree=None, num_blocks: int = 200,
                  weights: torch.dtype = torch.bfloat16):  # fmt: skip
    """A batched EAGLE drafter of a copy of ``head`` (the drafter packs its linears in ``weights``) over ``target``'s
    embeddings."""
    import copy

    from spectoolkit.drafting.eagle import EagleDrafter, EagleHead

    ready = EagleHead(copy.deepcopy(head), target.get_input_embeddings(), num_blocks * BLOCK, weights)
    return EagleDrafter(ready, BlockAllocator(num_blocks, BLOCK), chooser, EOS_IDS, None, tree)


class NgramAfterPlan(NgramDrafter):
    """The n-gram lookup asked after the plan, as a draft model is (a lookup proposes ahead by default)."""

    ahead = False
