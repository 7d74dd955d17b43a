"""Compiled static-KV steps (runtime.compile=true): CachedModel's contract, eager's tokens, exact speculation.

Every new (width, KV capacity) graph costs several seconds of inductor compiling, so the tests share
one module-scoped CompiledModel at the default capacity; a fresh CompiledModel of the same shapes
reuses dynamo's graphs (they are entries of one code object, StaticDecoder.rows) and compiles nothing.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch._dynamo.utils import counters

from spectoolkit.drafting import ModelDrafter, NgramDrafter
from spectoolkit.engine import BaselineEngine, SpeculativeEngine
from spectoolkit.errors import SpecToolkitError
from spectoolkit.models.cached import CachedModel
from spectoolkit.models.compiled import (
    LOGIT_TOLERANCE,
    WIDTHS,
    CompiledModel,
    StaticKV,
    compiled_runners,
    make_runner,
    widths_for,
)
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.sampling import GreedyChooser
from spectoolkit.verify import GreedyVerifier

VOCAB = 512
EOS_IDS = frozenset({2})
SHORT_PROMPT = [1, 17, 93, 250, 7, 41, 300, 12, 5, 9]  # 10 tokens: a padded 16-row step
LONG_PROMPT = [1, *range(3, 43)]  # 41 tokens (> 32): the BLAS/SDPA prefill
REPETITIVE_PROMPT = [1, 5, 5, 5, 6, 7, 8, 9, 10, 11, 5, 6, 7]  # n-gram lookup finds matches
STEPS = 20
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return tiny_llama(vocab_size=VOCAB, seed=0, scale=4.0)


@pytest.fixture(scope="module")
def compiled(target) -> CompiledModel:
    return CompiledModel(target)


def _greedy(runner, prompt: list[int], steps: int) -> tuple[list[int], list[torch.Tensor]]:
    """Prefill ``prompt``, then ``steps`` one-token greedy steps: (tokens, last-row logits per call)."""
    runner.reset()
    logits = [runner.forward(prompt)[-1]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps):
        logits.append(runner.forward([tokens[-1]], last_only=True))
        tokens.append(int(logits[-1].argmax()))
    return tokens, logits


# ---- against eager transformers -----------------------------------------------------------------


@pytest.mark.slow  # compiles the tiny model's steps (60 s on AMD Zen 3) or decodes long
@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["rows-prompt", "prefill-prompt"])
def test_greedy_tokens_and_logits_match_eager(target, compiled, prompt):
    eager = CachedModel(target)
    got_tokens, got_logits = _greedy(compiled, prompt, STEPS)
    want_tokens, want_logits = _greedy(eager, prompt, STEPS)
    assert got_tokens == want_tokens
    for step, (got, want) in enumerate(zip(got_logits, want_logits, strict=True)):
        assert got.shape == want.shape == (VOCAB,) and got.dtype == torch.float32
        error = (got - want).abs().max().item()
        assert error <= LOGIT_TOLERANCE, f"step {step}: |compiled - eager| = {error:.2e}"
    assert compiled.num_computed == eager.num_computed == len(prompt) + STEPS


@pytest.mark.slow  # compiles the tiny model's steps (60 s on AMD Zen 3) or decodes long
def test_all_rows_of_a_call_match_eager(target, compiled):
    """Not only the last row: every row of a padded rows call and of a prefill."""
    eager = CachedModel(target)
    for prompt in (SHORT_PROMPT, LONG_PROMPT):
        compiled.reset()
        eager.reset()
        torch.testing.assert_close(compiled.forward(prompt), eager.forward(prompt), rtol=0, atol=LOGIT_TOLERANCE)
        window = [4, 8, 15, 16, 23]  # a 5-token verify window: 8 rows, 3 of them padding
        torch.testing.assert_close(compiled.forward(window), eager.forward(window), rtol=0, atol=LOGIT_TOLERANCE)
        last = compiled.forward([42, 43, 44], last_only=True)
        assert last.shape == (VOCAB,)
        torch.testing.assert_close(last, eager.forward([42, 43, 44], last_only=True), rtol=0, atol=LOGIT_TOLERANCE)
        later = compiled.forward(LONG_PROMPT)  # a prefill that starts mid-sequence (its causal mask is offset)
        torch.testing.assert_close(later, eager.forward(LONG_PROMPT), rtol=0, atol=LOGIT_TOLERANCE)


# ---- row invariance: a verify window's rows are the decode steps' bits -------------------------------


@pytest.mark.slow  # compiles the tiny model's steps (60 s on AMD Zen 3) or decodes long
@pytest.mark.parametrize("prompt", [SHORT_PROMPT, LONG_PROMPT], ids=["rows-prompt", "prefill-prompt"])
def test_a_verify_window_equals_single_decode_steps_bitwise(compiled, prompt):
    compiled.reset()
    compiled.forward(prompt)
    candidates = [int(t) for t in torch.randint(3, VOCAB, (6,), generator=torch.Generator().manual_seed(3))]
    for k in range(2, 7):  # widths 2, 4 (1 padding row), 4, 8 (3 padding rows), 8 (2)
        start = compiled.num_computed
        window = compiled.forward(candidates[:k])  # [k, V]
        assert window.shape == (k, VOCAB) and compiled.num_computed == start + k
        compiled.truncate(start)
        steps = torch.stack([compiled.forward([token], last_only=True) for token in candidates[:k]])
        for row in range(k):
            assert torch.equal(window[row], steps[row]), f"k={k}: row {row} differs from the decode step"
        compiled.truncate(start + 1)  # keep one token, as an engine keeps the accepted prefix


@pytest.mark.slow  # compiles the tiny model's steps (20-78 s on AMD Zen 3)
def test_warm_narrows_the_widths_and_padding_keeps_rows_exact(target):
    assert widths_for(1) == (1,) and widths_for(2) == (1, 2) and widths_for(5) == (1, 8)
    assert widths_for(32) == (1, 32) and widths_for(33) == widths_for(1000) == (1, WIDTHS[-1])
    model = CompiledModel(target)
    model.warm(5)  # (1, 8): a verify window of 2..8 tokens pads to 8 rows
    assert model.widths == (1, 8) and model.num_computed == 0
    assert model.compile_stats.graphs == 2 and model.compile_stats.widths == (1, 8)
    model.compile_stats.mark_warm()
    model.forward(SHORT_PROMPT[:7])
    for k in (2, 3, 5):
        start = model.num_computed
        window = model.forward(SHORT_PROMPT[:k])  # 6, 5 and 3 padding rows
        model.truncate(start)
        steps = torch.stack([model.forward([token], last_only=True) for token in SHORT_PROMPT[:k]])
        assert torch.equal(window, steps), f"k={k}"
    assert model.compile_stats.as_dict()["compiled_after_warm_up"] == 0
    assert model.compile_stats.widths == (1, 8)


# ---- speculation stays exact --------------------------------------------------------------------


def _drafters(target: torch.nn.Module) -> dict[str, object]:
    return {
        "ngram": NgramDrafter(max_n=3, min_n=1, target_vocab_size=VOCAB, one_hot_probs=False),
        "bf16-copy": ModelDrafter(copy.deepcopy(target).to(torch.bfloat16), GreedyChooser(), VOCAB, VOCAB, EOS_IDS),
    }


@pytest.mark.slow  # compiles the tiny model's steps (60 s on AMD Zen 3) or decodes long
@pytest.mark.parametrize("gamma", [1, 3, 5])
def test_speculative_output_equals_the_compiled_baseline(target, compiled, gamma):
    baseline = BaselineEngine(compiled, GreedyVerifier(), EOS_IDS)
    prompts = (SHORT_PROMPT, REPETITIVE_PROMPT, LONG_PROMPT)
    expected = {tuple(p): baseline.generate(p, 24, None).output_ids for p in prompts}
    rejected = 0
    for name, drafter in _drafters(target).items():
        engine = SpeculativeEngine(compiled, drafter, GreedyVerifier(), gamma, EOS_IDS)
        accepted = 0
        for prompt in prompts:
            out = engine.generate(prompt, 24, None)
            assert out.output_ids == expected[tuple(prompt)], f"{name}, gamma={gamma}: diverged from the baseline"
            assert compiled.num_computed == len(prompt) + len(out.output_ids) - 1  # the last token is pending
            accepted += out.accepted_tokens
            rejected += out.drafted_tokens - out.accepted_tokens
        assert accepted > 0, f"{name}: no draft token accepted, the test exercises nothing"
    assert rejected > 0  # and some rejected: verify windows are cut and the KV truncated


@pytest.mark.slow
def test_speculation_with_a_compiled_draft_equals_the_baseline(target, compiled):
    """A compiled bf16 draft (ModelDrafter(compiled=True)): its own graphs (bf16 weights and KV)."""
    draft = ModelDrafter(copy.deepcopy(target).to(torch.bfloat16), GreedyChooser(), VOCAB, VOCAB, EOS_IDS,
                         compiled=True)  # fmt: skip
    assert isinstance(draft.runner, CompiledModel) and draft.runner.cache.keys[0].dtype == torch.bfloat16
    baseline = BaselineEngine(compiled, GreedyVerifier(), EOS_IDS)
    engine = SpeculativeEngine(compiled, draft, GreedyVerifier(), 4, EOS_IDS)
    accepted = 0
    for prompt in (SHORT_PROMPT, REPETITIVE_PROMPT):
        out = engine.generate(prompt, 24, None)
        assert out.output_ids == baseline.generate(prompt, 24, None).output_ids
        accepted += out.accepted_tokens
    assert accepted > 0
    assert compiled_runners([engine]) == {"target": compiled, "draft": draft.runner}


# ---- bounded recompiles -------------------------------------------------------------------------


def _workload(model: CompiledModel) -> list[torch.Tensor]:
    """Calls of 1..12 tokens with verify-like truncations; the logits of every call."""
    gen = torch.Generator().manual_seed(11)
    model.reset()
    outputs = [model.forward(SHORT_PROMPT[:3])]
    for length in [*range(1, 13), *range(12, 0, -1)]:
        start = model.num_computed
        tokens = torch.randint(3, VOCAB, (length,), generator=gen).tolist()
        outputs.append(model.forward(tokens))
        model.truncate(start + int(torch.randint(0, length + 1, (1,), generator=gen)))
    return outputs


@pytest.mark.slow  # compiles the tiny model's steps (20-78 s on AMD Zen 3)
def test_recompiles_are_bounded_by_the_widths(target):
    model = CompiledModel(target)
    first = _workload(model)
    used = {next(w for w in WIDTHS if w >= n) for n in [3, *range(1, 13)]}  # {1, 2, 4, 8, 16}
    stats = model.compile_stats
    assert set(stats.widths) == used and stats.graphs == len(used)
    graphs, unique = stats.graphs, counters["stats"]["unique_graphs"]
    with torch._dynamo.config.patch(error_on_recompile=True):  # a recompile on the 2nd pass raises
        second = _workload(model)
    assert stats.graphs == graphs and counters["stats"]["unique_graphs"] == unique
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))  # deterministic, too


# ---- KV capacity --------------------------------------------------------------------------------


def test_static_kv_grow_keeps_the_valid_slots():
    kv = StaticKV(num_layers=2, kv_heads=2, head_dim=4, dtype=torch.bfloat16, device="cpu", capacity=4)
    for buffer in kv.keys + kv.values:
        buffer.copy_(torch.randn(buffer.shape))
    kv.length = 3
    before = [b.clone() for b in kv.keys + kv.values]
    kv.grow(9)  # 4 -> 8 -> 16
    assert kv.capacity == 16 and all(b.shape == (2, 16, 4) and b.dtype == torch.bfloat16 for b in kv.keys + kv.values)
    for old, new in zip(before, kv.keys + kv.values, strict=True):
        assert torch.equal(new[:, :3], old[:, :3]) and not new[:, 3:].any()
    assert kv.allocated_bytes() == 2 * 2 * (2 * 16 * 4) * 2
    kv.grow(10)  # fits already: same capacity
    assert kv.capacity == 16


@pytest.mark.slow  # compiles the tiny model's steps (60 s on AMD Zen 3) or decodes long
def test_decoding_past_a_small_capacity_matches_eager(target):
    """Capacity 16: the 10-token prompt's padded step fills it; the 7th decode step doubles it to 32."""
    model = CompiledModel(target, capacity=16)
    assert model.cache.capacity == 16
    small = model.cache.allocated_bytes()
    got_tokens, got_logits = _greedy(model, SHORT_PROMPT, 12)
    want_tokens, want_logits = _greedy(CachedModel(target), SHORT_PROMPT, 12)
    assert got_tokens == want_tokens
    assert max((g - w).abs().max().item() for g, w in zip(got_logits, want_logits, strict=True)) <= LOGIT_TOLERANCE
    assert model.cache.capacity == 32 and model.cache.allocated_bytes() == 2 * small
    assert model.num_computed == len(SHORT_PROMPT) + 12
    assert model.compile_stats.graphs == 3  # (width 16, 16 slots), (1, 16), (1, 32)


@pytest.mark.slow  # compiles the tiny model's steps (60 s on AMD Zen 3) or decodes long
def test_a_verify_window_across_the_capacity_stays_exact(target, compiled):
    """A 4-token window from slot 14 of 16 slots grows the cache mid-sequence; its rows are still the
    decode steps' bits (which run in the default-capacity model, compiled separately)."""
    model = CompiledModel(target, capacity=16)
    prefix = SHORT_PROMPT + [11, 12, 13, 14]  # 14 tokens: a 16-row step, slots 14 and 15 padding
    model.forward(prefix)
    window = model.forward([20, 21, 22, 23])  # 4 rows from slot 14: 18 > 16 slots, grows to 32
    assert model.cache.capacity == 32
    after = model.forward([24], last_only=True)  # slot 18: reads the 14 copied and 4 new slots
    compiled.reset()
    compiled.forward(prefix)
    steps = torch.stack([compiled.forward([token], last_only=True) for token in [20, 21, 22, 23]])
    assert torch.equal(window, steps)
    assert torch.equal(after, compiled.forward([24], last_only=True))


# ---- what it refuses ----------------------------------------------------------------------------


@pytest.mark.parametrize("kv", ["int8", "fp8", "bf16"])
def test_a_kv_precision_other_than_auto_is_refused(target, kv):
    with pytest.raises(SpecToolkitError, match="runtime.compile"):
        CompiledModel(target, kv_precision=kv)
    with pytest.raises(SpecToolkitError, match="runtime.compile"):
        make_runner(target, kv, compiled=True)


def test_a_non_llama_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)).eval()
    with pytest.raises(SpecToolkitError, match="runtime.compile.*gpt2"):
        CompiledModel(gpt2)


def test_bitsandbytes_layers_are_refused_and_rtn_layers_accepted(tmp_path):
    from spectoolkit.models.tiny import save_tiny_llama
    from spectoolkit.wiring.loading import load_model

    directory = save_tiny_llama(tmp_path / "tiny")
    nf4 = load_model(str(directory), "nf4", torch.device("cpu"), kernels=None)
    with pytest.raises(SpecToolkitError, match="runtime.compile.*Linear4bit"):
        CompiledModel(nf4.model)
    rtn = load_model(str(directory), "rtn-int4", torch.device("cpu"), group_size=32, kernels=None)
    CompiledModel(rtn.model)  # accepted: RTN layers trace into the graph


def test_sliding_window_attention_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    config = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    with pytest.raises(SpecToolkitError, match="sliding-window"):
        CompiledModel(MistralForCausalLM(MistralConfig(sliding_window=16, **config)).eval())
    CompiledModel(MistralForCausalLM(MistralConfig(sliding_window=None, **config)).eval())  # accepted


def test_make_runner_and_compiled_runners(target):
    eager = make_runner(target, "auto", compiled=False)
    fast = make_runner(target, "auto", compiled=True)
    assert type(eager) is CachedModel and type(fast) is CompiledModel
    engines = [SimpleNamespace(target=fast, drafter=SimpleNamespace(runner=eager)), SimpleNamespace(target=fast)]
    assert compiled_runners(engines) == {"target": fast}  # eager runners and repeats left out


# ---- CachedModel's contract ---------------------------------------------------------------------


@pytest.mark.slow  # compiles the tiny model's steps (60 s on AMD Zen 3) or decodes long
def test_reset_and_truncate_semantics(compiled):
    compiled.reset()
    assert compiled.num_computed == 0
    first = compiled.forward(SHORT_PROMPT[:5])
    assert first.shape == (5, VOCAB) and compiled.num_computed == 5
    more = compiled.forward([30, 31])
    assert compiled.num_computed == 7
    compiled.truncate(100)  # only lowers
    assert compiled.num_computed == 7
    compiled.truncate(5)
    assert compiled.num_computed == 5
    assert torch.equal(compiled.forward([30, 31]), more)  # slots 5, 6 recomputed from the same prefix
    compiled.truncate(0)
    assert compiled.num_computed == 0
    compiled.forward([99])
    compiled.reset()
    assert compiled.num_computed == 0
    assert torch.equal(compiled.forward(SHORT_PROMPT[:5]), first)  # stale slots are never read
    assert compiled.forward([30], last_only=True).shape == (VOCAB,) and compiled.num_computed == 6
    kv = compiled.cache
    assert kv.get_seq_length() == 6
    assert kv.allocated_bytes() == 2 * 2 * (2 * kv.capacity * 16) * 4  # 2 layers, K and V, [2, cap, 16] fp32


# ---- the other supported families ---------------------------------------------------------------


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


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["qwen2", "qwen3"])
def test_qwen_families_match_eager_and_stay_row_invariant(kind):
    model = _qwen(kind)
    fast, eager = CompiledModel(model), CachedModel(model)
    prompt = list(range(3, 40))  # prefill
    torch.testing.assert_close(fast.forward(prompt), eager.forward(prompt), rtol=0, atol=LOGIT_TOLERANCE)
    window = fast.forward([5, 6])
    torch.testing.assert_close(window, eager.forward([5, 6]), rtol=0, atol=LOGIT_TOLERANCE)
    fast.truncate(len(prompt))
    steps = torch.stack([fast.forward([token], last_only=True) for token in (5, 6)])
    assert torch.equal(window, steps)
