"""The compiled runner over the paged pool: the stock forward's numbers, every row row-invariant, bounded graphs."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels.rtn_format import RtnConfig
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.quant.packing import pack_model
from spectoolkit.quant.rtn import quantize_model_rtn
from spectoolkit.runtime.blocks import BlockAllocator, BlockTable
from spectoolkit.runtime.compiled import CompiledRunner, bucket, compiled_runners
from spectoolkit.runtime.eager import EagerRunner
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import make_runner, run_segments
from spectoolkit.runtime.step import Segment, tree_layout

BLOCK, BLOCKS = 4, 64
WIDTHS = (1, 8)  # two graphs for the whole module (~25 s on 2 cores); a 9-row call chunks as 8 + 1


@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab_size=128, seed=3)


@pytest.fixture(scope="module", params=["auto", "int8"])
def runner(model, request):
    return CompiledRunner(model, make_pool(model, request.param, BLOCKS * BLOCK), WIDTHS), BlockAllocator(BLOCKS, BLOCK)


def _ids(count: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 128, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def _feed(runner, table: BlockTable, ids: list[int], start: int, tree=None) -> torch.Tensor:
    table.ensure(start + len(ids))
    return run_segments(runner, [Segment(table, ids, start, list(range(len(ids))), tree)], "chosen")


@torch.inference_mode()
def test_a_prompt_and_decode_steps_match_the_stock_forward(model, runner):
    compiled, allocator = runner
    ids, table = _ids(13), BlockTable(allocator)
    logits = torch.cat([_feed(compiled, table, ids[:10], 0), *(_feed(compiled, table, [t], 10 + i)
                                                               for i, t in enumerate(ids[10:]))])  # fmt: skip
    stock = model(torch.tensor([ids])).logits[0]
    tolerance = 1e-4 if compiled.pool.precision == "auto" else 5e-2  # int8 KV: the quantization error
    torch.testing.assert_close(logits, stock, rtol=tolerance, atol=tolerance)
    table.release()


@torch.inference_mode()
def test_every_row_equals_its_decode_step_bit_for_bit(runner):
    compiled, allocator = runner
    ids = _ids(12, seed=1)
    steps, window = BlockTable(allocator), BlockTable(allocator)
    one_by_one = torch.cat([_feed(compiled, steps, [t], i) for i, t in enumerate(ids)])
    at_once = torch.cat([_feed(compiled, window, ids[:3], 0), _feed(compiled, window, ids[3:], 3)])  # 3, then 9 rows
    assert torch.equal(at_once, one_by_one)
    steps.release()
    window.release()


@torch.inference_mode()
def test_a_batched_step_equals_each_sequence_alone(runner):
    """Two sequences and a tree in one call: every row's bits as if its sequence ran alone, in any company."""
    compiled, allocator = runner
    prompts, nodes, parents = [_ids(6, seed=2), _ids(5, seed=3)], [10, 11, 12], [-1, 0, 0]
    alone = []
    for prompt in prompts:
        table = BlockTable(allocator)
        _feed(compiled, table, prompt, 0)
        alone.append(_feed(compiled, table, nodes, len(prompt), tree_layout(parents, len(prompt))))
        table.release()
    tables = [BlockTable(allocator) for _ in prompts]
    for table, prompt in zip(tables, prompts, strict=True):
        table.ensure(len(prompt) + len(nodes))
    run_segments(compiled, [Segment(t, p, 0, []) for t, p in zip(tables, prompts, strict=True)], "plain")
    together = run_segments(compiled, [Segment(t, nodes, len(p), [0, 1, 2], tree_layout(parents, len(p)))
                                       for t, p in zip(tables, prompts, strict=True)], "plain")  # fmt: skip
    assert torch.equal(together, torch.cat(alone))
    for table in tables:
        table.release()


@torch.inference_mode()
def test_graphs_stay_bounded_by_the_widths(runner):
    compiled, allocator = runner
    for count in (1, 2, 5, 8, 9, 17):  # contexts and widths vary; the key list is the only dynamic input
        table = BlockTable(allocator)
        _feed(compiled, table, _ids(count, seed=count), 0)
        _feed(compiled, table, [5], count)
        table.release()
    assert compiled.compile_stats.graphs <= len(WIDTHS)
    assert compiled.compile_stats.as_dict()["widths"] == list(WIDTHS)


@torch.inference_mode()
def test_the_compiled_and_eager_runners_agree(model):
    pool = make_pool(model, "auto", BLOCKS * BLOCK)
    eager, allocator = EagerRunner(model, pool), BlockAllocator(BLOCKS, BLOCK)
    ids = _ids(9, seed=4)
    reference = _feed(eager, BlockTable(allocator), ids, 0)
    compiled = CompiledRunner(model, make_pool(model, "auto", BLOCKS * BLOCK), WIDTHS)
    got = _feed(compiled, BlockTable(BlockAllocator(BLOCKS, BLOCK)), ids, 0)
    torch.testing.assert_close(got, reference, rtol=1e-4, atol=1e-4)


def test_make_runner_and_compiled_runners(model):
    pool = make_pool(model, "auto", BLOCKS * BLOCK)
    eager, fast = make_runner(model, pool), make_runner(model, pool, compiled=True)
    assert type(eager) is EagerRunner and type(fast) is CompiledRunner
    engines = [SimpleNamespace(runners=lambda: {"target": fast, "draft": eager}),
               SimpleNamespace(runners=lambda: {"target": fast})]  # fmt: skip
    assert compiled_runners(engines) == {"target": fast}  # eager runners and repeats left out
    assert [bucket(rows) for rows in (1, 3, 5, 9, 40)] == [1, 4, 8, 16, 32]


def test_int4_kv_is_refused(model):
    with pytest.raises(SpecToolkitError, match="runtime.compile.*int4"):
        CompiledRunner(model, make_pool(model, "int4", BLOCKS * BLOCK))


def test_a_non_llama_model_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2)).eval()
    pool = SimpleNamespace(precision="auto", layers=[])
    with pytest.raises(SpecToolkitError, match="runtime.compile.*gpt2"):
        CompiledRunner(gpt2, pool)


def test_llm_int8_layers_are_refused_and_nf4_and_rtn_layers_accepted(tmp_path):
    from spectoolkit.models.tiny import save_tiny_llama
    from spectoolkit.wiring.loading import load_model

    directory = save_tiny_llama(tmp_path / "tiny")
    int8 = load_model(str(directory), "int8", torch.device("cpu"), kernels=None)
    with pytest.raises(SpecToolkitError, match="runtime.compile.*Linear8bitLt"):
        CompiledRunner(int8.model, make_pool(int8.model, "auto", BLOCK))
    nf4 = load_model(str(directory), "nf4", torch.device("cpu"), kernels=None)
    CompiledRunner(nf4.model, make_pool(nf4.model, "auto", BLOCK))  # accepted: packed as our nf4 kind
    rtn = load_model(str(directory), "rtn-int4", torch.device("cpu"), group_size=32, kernels=None)
    CompiledRunner(rtn.model, make_pool(rtn.model, "auto", BLOCK))  # accepted: RTN layers trace into the graph


def test_sliding_window_attention_is_refused():
    from transformers import MistralConfig, MistralForCausalLM

    config = dict(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip  (head dim 16: our attention takes it)
    windowed = MistralForCausalLM(MistralConfig(sliding_window=16, **config)).eval()
    with pytest.raises(SpecToolkitError, match="sliding-window"):
        CompiledRunner(windowed, make_pool(windowed, "auto", BLOCK))
    plain = MistralForCausalLM(MistralConfig(sliding_window=None, **config)).eval()
    CompiledRunner(plain, make_pool(plain, "auto", BLOCK))  # accepted


@torch.inference_mode()
@pytest.mark.parametrize("mode", ["chosen", "plain", "invariant"])
def test_a_lone_prompt_past_the_widest_width_is_the_graphs_chunks_in_every_mode(runner, mode):
    """A prompt chunk of 12 rows (> 8) wanting its last row's logits runs as the graphs' chunks (8 + 4 rows) in every
    row mode: the same logits and the same KV bits as the prompt fed in those two pieces."""
    compiled, allocator = runner
    ids, tables = _ids(12, seed=7), [BlockTable(allocator) for _ in range(2)]
    for table in tables:
        table.ensure(len(ids))
    got = run_segments(compiled, [Segment(tables[0], ids, 0, [len(ids) - 1])], mode)
    pieces = torch.cat([run_segments(compiled, [Segment(tables[1], ids[:8], 0, [])], mode),
                        run_segments(compiled, [Segment(tables[1], ids[8:], 8, [3])], mode)])  # fmt: skip
    assert torch.equal(got, pieces)
    pool = compiled.pool
    keys = [pool.gather(1, "key", torch.tensor(table.slots(0, len(ids)))) for table in tables]  # [H_kv, 12, D] each
    assert torch.equal(keys[0], keys[1])
    for table in tables:
        table.release()


@torch.inference_mode()
@pytest.mark.parametrize("case", ["fp32", "bf16", "rtn-int4+a8"])
def test_the_eager_runner_gives_the_compiled_bits(case):
    """Both runners run one body on our kernels (runtime/decoder_rows.py): a prompt, decode steps, a verify window
    and a tree give the same logits and store the same KV bits, whichever runner and however the rows are batched
    (int8 activations too: integer dot products in every quantized linear)."""
    dtype = torch.bfloat16 if case == "bf16" else torch.float32
    model = tiny_llama(vocab_size=128, seed=5).to(dtype)
    if case == "rtn-int4+a8":
        quantize_model_rtn(model, RtnConfig(4, 32))
    report = pack_model(model, "int8" if case.endswith("+a8") else "float")
    assert case != "rtn-int4+a8" or "packed, int8 activations" in report.values()
    ids, nodes, parents = _ids(11, seed=9), [10, 11, 12, 13], [-1, 0, 0, 1]
    outputs, pools = [], []
    for make in (lambda pool: EagerRunner(model, pool), lambda pool: CompiledRunner(model, pool, (1, 4))):
        runner, allocator = make(make_pool(model, "auto", BLOCKS * BLOCK)), BlockAllocator(BLOCKS, BLOCK)
        assert runner.row_exact
        table = BlockTable(allocator)
        tree = tree_layout(parents, 11)
        logits = [_feed(runner, table, ids[:7], 0), _feed(runner, table, [ids[7]], 7),
                  _feed(runner, table, ids[8:], 8), _feed(runner, table, nodes, 11, tree)]  # fmt: skip
        outputs.append(torch.cat(logits))
        pools.append(runner.pool.gather(0, "value", torch.tensor(table.slots(0, 15))))
    assert outputs[0].dtype == dtype and torch.equal(outputs[0], outputs[1])
    assert torch.equal(pools[0], pools[1])


@torch.inference_mode()
def test_both_runners_return_the_states_entering_the_captured_layers():
    """``forward_states`` (what an EAGLE head reads): the residual stream entering each captured layer, as the
    stock forward's ``hidden_states`` give it, the same bits from both runners, logits unchanged."""
    from spectoolkit.models.eagle3_head import capture_states
    from spectoolkit.runtime.step import build_step

    model = tiny_llama(vocab_size=128, seed=6, num_layers=4)
    pack_model(model)
    ids, layers = _ids(7, seed=2), (3, 1, 3)  # any order, repeats allowed: side by side as asked
    got = []
    for make in (lambda pool: EagerRunner(model, pool), lambda pool: CompiledRunner(model, pool, (8,))):
        runner, table = make(make_pool(model, "auto", BLOCKS * BLOCK)), BlockTable(BlockAllocator(BLOCKS, BLOCK))
        table.ensure(len(ids))
        batch = build_step([Segment(table, ids, 0, list(range(len(ids))))], "chosen", runner.device)
        got.append(runner.forward_states(batch, layers))
    (eager_logits, eager_states), (compiled_logits, compiled_states) = got
    assert eager_states.shape == (7, 3 * 64)
    assert torch.equal(eager_states, compiled_states) and torch.equal(eager_logits, compiled_logits)
    stock = capture_states(model, torch.tensor([ids]), layers)[0]
    torch.testing.assert_close(eager_states, stock, rtol=1e-4, atol=1e-4)
