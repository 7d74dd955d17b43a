"""The compiled runner driven as the engine and the replays drive it: a lone sequence, the one engine, other families.

What tests/runtime/test_compiled.py leaves to this file (the deleted CompiledModel's tests, moved onto the
CompiledRunner over the paged pool):

- a :class:`~spectoolkit.runtime.lone.LoneSequence` on a compiled runner gives the stock forward's greedy tokens
  and logits (prompts shorter and longer than the widest graph), every row of a call, and rows that are the
  decode steps' bits across truncations; its reset/truncate semantics;
- graphs: narrowed by ``warm``, none compiled after warm-up, the same bits on a second pass;
- greedy speculation on the one engine with a compiled target (n-gram, an eager and a compiled bf16 draft)
  equals the compiled target alone;
- the Qwen2 (q/k/v biases) and Qwen3 (q/k norms, head_dim != hidden/heads) families.

Compiling costs seconds per width, so the tests share one module-scoped runner per model, at widths (1, 8).
"""

from __future__ import annotations

import copy

import pytest
import torch

from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.policy import FixedPolicy
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.compiled import CompiledRunner, compiled_runners
from spectoolkit.runtime.eager import EagerRunner
from spectoolkit.runtime.lone import LoneSequence
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.sampling import GreedyChooser
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.serving.scheduler import SchedulerLimits
from spectoolkit.verify import GreedyVerifier
from tests.reference import stock_greedy

VOCAB = 512
EOS_IDS = frozenset({2})
WIDTHS = (1, 8)  # a decode step and a verify window; a prompt chunks by 8
BLOCK, BLOCKS, POSITIONS = 8, 128, 1024
TOLERANCE = 1e-4  # compiled fp32 rows vs the stock forward: other kernels, same math
SHORT_PROMPT = [1, 17, 93, 250, 7, 41, 300, 12, 5, 9]  # 10 tokens: chunks of 8 and 2 rows (padded to 8)
LONG_PROMPT = [1, *range(3, 43)]  # 41 tokens: five chunks of 8 and one row
REPETITIVE_PROMPT = [1, 5, 5, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]  # n-gram lookup finds matches
STEPS = 20
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)


def _compiled(model: torch.nn.Module) -> tuple[CompiledRunner, BlockAllocator]:
    """A compiled runner of ``model`` over its own pool, narrowed to :data:`WIDTHS` and warmed; its allocator."""
    runner = CompiledRunner(model, make_pool(model, "auto", BLOCKS * BLOCK))  # every width, on demand
    runner.warm(WIDTHS)
    runner.compile_stats.mark_warm()
    return runner, BlockAllocator(BLOCKS, BLOCK)


@pytest.fixture(scope="module")
def compiled(target) -> tuple[CompiledRunner, BlockAllocator]:
    return _compiled(target)


@pytest.fixture
def sequence(compiled) -> LoneSequence:
    """A lone sequence on the shared compiled runner; its blocks go back after the test."""
    lone = LoneSequence(*compiled)
    yield lone
    lone.reset()


@torch.inference_mode()
def _stock(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The stock transformers forward of ``ids`` from scratch: logits [n, V]."""
    return model(torch.tensor([ids])).logits[0]


def _greedy(sequence: LoneSequence, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ``prompt``, then ``steps`` one-token greedy steps: (tokens, last-row logits per call)."""
    sequence.reset()
    logits = [sequence.forward(prompt)[-1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps):
        logits.append(sequence.forward([tokens[-1]], last_only=True))
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


# ---- a lone sequence on the compiled runner against the stock forward ---------------------------------


@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short-prompt", "chunked-prompt"])
def test_greedy_tokens_and_logits_match_the_stock_forward(target, sequence, prompt):
    tokens, logits = _greedy(sequence, prompt, STEPS)
    assert tokens == stock_greedy(target, prompt, STEPS + 1)
    stock = _stock(target, prompt + tokens[:-1])[len(prompt) - 1 :]  # [STEPS + 1, V]: the rows that chose them
    got = torch.stack(logits)
    assert got.shape == stock.shape == (STEPS + 1, VOCAB) and got.dtype == torch.float32
    torch.testing.assert_close(got, stock, rtol=0, atol=TOLERANCE)
    assert sequence.num_computed == len(prompt) + STEPS


@torch.inference_mode()
def test_all_rows_of_a_call_match_the_stock_forward(target, sequence):
    """Not only the last row: every row of a prompt, of a padded verify window, of a prefill that starts
    mid-sequence (chunked), and a ``last_only`` call."""
    for prompt in (SHORT_PROMPT, LONG_PROMPT):
        sequence.reset()
        window, last = [4, 8, 15, 16, 23], [42, 43, 44]  # a 5-token window: 8 rows, 3 of them padding
        calls = [sequence.forward(prompt), sequence.forward(window), sequence.forward(last, last_only=True)[None],
                 sequence.forward(LONG_PROMPT)]  # fmt: skip
        assert calls[2].shape == (1, VOCAB)
        stock = _stock(target, prompt + window + last + LONG_PROMPT)
        wanted = torch.cat([stock[: len(prompt) + len(window)], stock[len(prompt) + len(window) + 2][None],
                            stock[len(prompt) + len(window) + len(last) :]])  # fmt: skip
        torch.testing.assert_close(torch.cat(calls), wanted, rtol=0, atol=TOLERANCE)


@torch.inference_mode()
@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["short-prompt", "chunked-prompt"])
def test_a_verify_window_equals_single_decode_steps_bitwise(sequence, prompt):
    sequence.reset()
    sequence.forward(prompt)
    candidates = torch.randint(3, VOCAB, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    for k in (2, 3, 5, 8, 9):  # widths 8 (padded), 8, 8 and 8 + 1 (chunked)
        start = sequence.num_computed
        window = sequence.forward(candidates[:k])  # [k, V]
        assert window.shape == (k, VOCAB) and sequence.num_computed == start + k
        sequence.truncate(start)
        steps = torch.stack([sequence.forward([token], last_only=True) for token in candidates[:k]])
        for row in range(k):
            assert torch.equal(window[row], steps[row]), f"k={k}: row {row} differs from the decode step"
        sequence.truncate(start + 1)  # keep one token, as an engine keeps the accepted prefix


@torch.inference_mode()
def test_reset_and_truncate_semantics(compiled, sequence):
    runner, allocator = compiled
    free = allocator.num_free
    sequence.reset()
    assert sequence.num_computed == 0 and sequence.kv_bytes() == 0
    first = sequence.forward(SHORT_PROMPT[:5])
    assert first.shape == (5, VOCAB) and sequence.num_computed == 5
    more = sequence.forward([30, 31])
    assert sequence.num_computed == 7
    sequence.truncate(100)  # only lowers
    assert sequence.num_computed == 7
    sequence.truncate(5)
    assert sequence.num_computed == 5
    assert torch.equal(sequence.forward([30, 31]), more)  # slots 5, 6 recomputed from the same prefix
    sequence.truncate(0)
    assert sequence.num_computed == 0
    sequence.forward([99])
    sequence.reset()
    assert sequence.num_computed == 0 and allocator.num_free == free  # every block back
    assert torch.equal(sequence.forward(SHORT_PROMPT[:5]), first)  # stale slots are never read
    assert sequence.forward([30], last_only=True).shape == (VOCAB,) and sequence.num_computed == 6
    assert allocator.num_free == free - 1  # 6 positions: one block of 8
    slot_bytes = 2 * 2 * 2 * 16 * 4  # 2 layers, K and V, [2 heads, 16] fp32 per slot
    assert runner.pool.slot_bytes() == slot_bytes and sequence.kv_bytes() == BLOCK * slot_bytes


# ---- graphs -------------------------------------------------------------------------------------------


@torch.inference_mode()
def _workload(sequence: LoneSequence) -> list[torch.Tensor]:
    """Calls of 1..12 tokens with verify-like truncations; the logits of every call."""
    gen = torch.Generator().manual_seed(11)
    sequence.reset()
    outputs = [sequence.forward(SHORT_PROMPT[:3])]
    for length in [*range(1, 13), *range(12, 0, -1)]:
        start = sequence.num_computed
        outputs.append(sequence.forward(torch.randint(3, VOCAB, (length,), generator=gen).tolist()))
        sequence.truncate(start + int(torch.randint(0, length + 1, (1,), generator=gen)))
    return outputs


def test_warm_narrows_the_widths_and_nothing_compiles_after(compiled, sequence):
    runner, _ = compiled
    assert runner.widths == WIDTHS and runner.compile_stats.widths == WIDTHS  # warm((1, 8)) of all WIDTHS
    first = _workload(sequence)
    with torch._dynamo.config.patch(error_on_recompile=True):  # a recompile on the 2nd pass raises
        second = _workload(sequence)
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))  # deterministic, too
    assert runner.compile_stats.as_dict()["compiled_after_warm_up"] == 0 and runner.compile_stats.widths == WIDTHS


# ---- speculation on the one engine stays exact --------------------------------------------------------


def _engine(runner, allocator, drafter=None, gamma: int = 0) -> OneRequestEngine:
    """A greedy batch-1 arm of the one engine on ``runner`` (with ``drafter``, ``gamma`` tokens per round)."""
    limits = SchedulerLimits(POSITIONS, 1, None, None)
    engine = ContinuousEngine("spec" if drafter else "baseline", runner, allocator, GreedyVerifier(), limits, EOS_IDS,
                              POSITIONS, drafter, policy=FixedPolicy(gamma))  # fmt: skip
    return OneRequestEngine(engine, engine.name)


def _draft_model(target: torch.nn.Module, runner_type) -> ModelDrafter:
    """A bf16 copy of ``target`` drafting greedily on a ``runner_type`` runner over its own pool."""
    draft = copy.deepcopy(target).to(torch.bfloat16)
    pool = make_pool(draft, "auto", BLOCKS * BLOCK)
    runner = CompiledRunner(draft, pool, WIDTHS) if runner_type is CompiledRunner else EagerRunner(draft, pool)
    return ModelDrafter(runner, GreedyChooser(), BlockAllocator(BLOCKS, BLOCK), VOCAB, VOCAB, EOS_IDS)


def _assert_equal_to_the_target_alone(compiled, drafter, gamma: int, prompts) -> tuple[int, int]:
    """Every output of speculation with ``drafter`` is the compiled target alone's; (accepted, rejected)."""
    runner, allocator = compiled
    baseline, spec = _engine(runner, allocator), _engine(runner, allocator, drafter, gamma)
    accepted = rejected = 0
    for prompt in prompts:
        out = spec.generate(prompt, 24, None)
        assert out.output_ids == baseline.generate(prompt, 24, None).output_ids, f"gamma={gamma}: diverged"
        assert allocator.num_free == allocator.num_blocks  # the finished request's blocks are back
        accepted += out.accepted_tokens
        rejected += out.drafted_tokens - out.accepted_tokens
    return accepted, rejected


@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_speculative_output_equals_the_compiled_target_alone(target, compiled, gamma):
    drafters = {"ngram": NgramDrafter(3, 1, VOCAB, one_hot_probs=False),
                "bf16-copy": _draft_model(target, EagerRunner)}  # fmt: skip
    rejected = 0
    for name, drafter in drafters.items():
        accepted, rejected_here = _assert_equal_to_the_target_alone(
            compiled, drafter, gamma, (SHORT_PROMPT, REPETITIVE_PROMPT, LONG_PROMPT)
        )
        assert accepted > 0, f"{name}: no draft token accepted, the test exercises nothing"
        rejected += rejected_here
    assert rejected > 0  # and some rejected: verify windows are cut and the KV truncated


@pytest.mark.slow  # the bf16 draft's own two graphs
def test_speculation_with_a_compiled_draft_equals_the_compiled_target_alone(target, compiled):
    drafter = _draft_model(target, CompiledRunner)
    draft_runner = drafter.runner
    assert draft_runner.pool.layers[0]["key"]["data"].dtype == torch.bfloat16  # bf16 weights and KV
    accepted, _ = _assert_equal_to_the_target_alone(compiled, drafter, 4, (SHORT_PROMPT, REPETITIVE_PROMPT))
    assert accepted > 0
    assert draft_runner.compile_stats.widths == WIDTHS
    spec = _engine(*compiled, drafter, 4)
    assert compiled_runners([spec]) == {"target": compiled[0], "draft": draft_runner}


# ---- the other supported families ---------------------------------------------------------------------


def _qwen(kind: str) -> torch.nn.Module:
    """A tiny random Qwen2 (q/k/v biases) or Qwen3 (q/k norms, head_dim != hidden/heads), tied head."""
    from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    if kind == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(**common)).eval()
    else:
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=24, **common)).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:  # biases and norm weights away from their 0/1 init
                param.add_(torch.randn_like(param) * 0.1)
    return model


@pytest.mark.slow  # two graphs per family
@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
@torch.inference_mode()
def test_qwen_families_match_the_stock_forward_and_stay_row_invariant(kind):
    model = _qwen(kind)
    sequence = LoneSequence(*_compiled(model))
    prompt = list(range(3, 40))  # chunked by 8
    stock = _stock(model, prompt + [5, 6])
    torch.testing.assert_close(sequence.forward(prompt), stock[: len(prompt)], rtol=0, atol=TOLERANCE)
    window = sequence.forward([5, 6])
    torch.testing.assert_close(window, stock[len(prompt) :], rtol=0, atol=TOLERANCE)
    sequence.truncate(len(prompt))
    steps = torch.stack([sequence.forward([token], last_only=True) for token in (5, 6)])
    assert torch.equal(window, steps)
