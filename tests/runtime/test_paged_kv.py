"""Paged KV storage (spectoolkit.runtime.paged_kv): per-token conversion on write, exact read-back (DESIGN §2)."""

from __future__ import annotations

import pytest
import torch

from spectoolkit.kvcache import formats
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.precisions import KV_PRECISIONS
from spectoolkit.runtime.paged_kv import KINDS, PagedKVPool, make_pool
from tests.serving.helpers import assert_same_bits, bits

LAYERS, HEADS, DIM, SLOTS = 2, 2, 16, 48
CAST = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
QUANT = {
    "fp8": (formats.quantize_fp8, formats.dequantize_fp8),
    "int8": (formats.quantize_int8, formats.dequantize_int8),
    "int4": (formats.quantize_int4, formats.dequantize_int4),
}
TOLERANCE = {"int4": 0.5, "fp8": 0.3, "int8": 0.05, "bf16": 0.05, "fp16": 0.01}  # share of max |x|


def _pool(precision: str, compute: torch.dtype = torch.float32) -> PagedKVPool:
    return PagedKVPool(LAYERS, HEADS, DIM, SLOTS, precision, compute, torch.device("cpu"))


def _states(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(HEADS, n, DIM, generator=gen) * 3  # [H_kv, n, D]
    values = torch.randn(HEADS, n, DIM, generator=gen)
    keys[:, 0] = 0.0  # an all-zero row: scale 0 must decode exactly
    return keys, values


def _expected(precision: str, states: torch.Tensor, compute: torch.dtype) -> torch.Tensor:
    """What the format stores and reads back for ``states``: the reference functions of kvcache.formats."""
    if precision in QUANT:
        quantize, dequantize = QUANT[precision]
        return dequantize(*quantize(states), compute)
    if precision in CAST:
        return states.to(CAST[precision]).to(compute)
    return states.to(compute)


@pytest.mark.parametrize("precision", KV_PRECISIONS)
def test_chunking_and_order_of_writes_do_not_change_stored_bits(precision):
    n = 20
    slots = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(3))[:n]  # scattered, like paged blocks
    keys, values = _states(n, seed=0)
    whole = _pool(precision)
    for layer in range(LAYERS):
        whole.write(layer, slots, keys, values)
    for chunks in ([1] * n, [3, 7, 10], [n - 1, 1]):
        pool = _pool(precision)
        start = 0
        for size in chunks:
            for layer in range(LAYERS):
                pool.write(layer, slots[start : start + size], keys[:, start : start + size],
                           values[:, start : start + size])  # fmt: skip
            start += size
        for layer in range(LAYERS):
            for kind in KINDS:
                assert_same_bits(pool.stored(layer, kind, slots), whole.stored(layer, kind, slots))
    reversed_pool = _pool(precision)  # the same tokens written in the opposite order
    for layer in range(LAYERS):
        reversed_pool.write(layer, slots.flip(0), keys.flip(1), values.flip(1))
        for kind in KINDS:
            assert_same_bits(reversed_pool.stored(layer, kind, slots), whole.stored(layer, kind, slots))


@pytest.mark.parametrize("precision", KV_PRECISIONS)
def test_overwritten_slot_equals_a_slot_that_only_saw_the_new_token(precision):
    """A rejected candidate's slot is written over by the next token: nothing of the old one remains."""
    keys, values = _states(6, seed=1)
    slots = torch.tensor([5, 9, 13])
    rewritten, fresh = _pool(precision), _pool(precision)
    rewritten.write(0, slots, keys[:, :3] * 100, values[:, :3] * 100)
    rewritten.write(0, slots, keys[:, 3:], values[:, 3:])
    fresh.write(0, slots, keys[:, 3:], values[:, 3:])
    for kind in KINDS:
        assert_same_bits(rewritten.stored(0, kind, slots), fresh.stored(0, kind, slots))


@pytest.mark.parametrize("compute", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision", KV_PRECISIONS)
def test_gather_returns_the_formats_dequantization(precision, compute):
    n = 12
    slots = torch.tensor([40, 3, 17, 0, 25, 26, 27, 8, 9, 47, 31, 12])
    keys, values = _states(n, seed=2)
    keys, values = keys.to(compute), values.to(compute)
    pool = _pool(precision, compute)
    pool.write(1, slots, keys, values)
    for kind, states in zip(KINDS, (keys, values), strict=True):
        got = pool.gather(1, kind, slots)
        expected = _expected(precision, states, compute)
        assert got.dtype == compute and got.shape == (HEADS, n, DIM)
        assert torch.equal(bits(got), bits(expected)), f"{precision} {kind}: not the format's dequantization"
        # not vacuous: the round trip is close to the states (coarse for int4, exact for auto/fp32)
        error = (got.float() - states.float()).abs().max()
        assert error <= TOLERANCE.get(precision, 0.0) * states.float().abs().max()
    assert torch.equal(pool.gather(1, "key", slots[:1])[:, 0], _expected(precision, keys, compute)[:, 0])
    assert not pool.gather(1, "key", slots[:1]).any(), "an all-zero row must decode to zeros"


@pytest.mark.parametrize("precision", KV_PRECISIONS)
def test_span_of_consecutive_slots_equals_gather(precision):
    keys, values = _states(10, seed=4)
    pool = _pool(precision)
    slots = torch.arange(20, 30)
    pool.write(0, slots, keys, values)
    for kind in KINDS:
        assert torch.equal(bits(pool.span(0, kind, 20, 30)), bits(pool.gather(0, kind, slots)))


@pytest.mark.parametrize("precision", ["fp8", "int8", "int4"])
def test_stored_fields_are_the_formats_codes(precision):
    """The raw fields are exactly what kvcache.formats computes per token (fp8: float8 through uint8 views)."""
    keys, values = _states(7, seed=5)
    slots = torch.tensor([1, 30, 2, 44, 7, 8, 19])
    pool = _pool(precision)
    pool.write(0, slots, keys, values)
    fmt = formats.KV_FORMATS[precision]
    assert pool.fields == tuple(fmt.fields(DIM))
    for kind, states in zip(KINDS, (keys, values), strict=True):
        stored = pool.stored(0, kind, slots)
        for name, (width, dtype) in fmt.fields(DIM).items():
            assert stored[name].dtype == dtype and stored[name].shape == (HEADS, len(slots), width)
        assert_same_bits(stored, fmt.quantize(states))
    if precision == "fp8":
        assert pool.layers[0]["key"]["data"].dtype == torch.float8_e4m3fn


def test_unknown_precision_is_refused():
    from spectoolkit.errors import SpecToolkitError

    with pytest.raises(SpecToolkitError, match="unknown KV precision"):
        _pool("int3")


def test_slot_bytes_follow_the_format():
    per_row = {"auto": 4 * DIM, "fp32": 4 * DIM, "bf16": 2 * DIM, "fp16": 2 * DIM, "fp8": DIM + 4, "int8": DIM + 4,
               "int4": DIM // 2 + 2 * 4 * (DIM // formats.int4_group_size(DIM))}  # fmt: skip
    for precision, row in per_row.items():
        assert _pool(precision).slot_bytes() == LAYERS * len(KINDS) * HEADS * row, precision


def _snapshot(pool: PagedKVPool) -> dict[tuple[int, str, str], torch.Tensor]:
    """Every stored buffer's bits over all slots (unwritten slots included: they must not change either)."""
    return {(index, kind, name): bits(buf).clone() for index, layer in enumerate(pool.layers)
            for kind, fields in layer.items() for name, buf in fields.items()}  # fmt: skip


@pytest.mark.parametrize("precision", KV_PRECISIONS)
def test_moved_slots_read_back_bit_for_bit(precision):
    """A tree's accepted path moved next to its prefix: targets get the sources' stored bytes, nothing re-encoded;
    the sources keep theirs (a move may overlap: source 3 is also a target) and no other slot changes."""
    slots = torch.tensor([2, 3, 5, 6, 30, 12])
    pool = _pool(precision)
    for layer in range(LAYERS):
        pool.write(layer, slots, *_states(len(slots), seed=6 + layer))
    sources, targets = [3, 5, 6, 30], [2, 3, 4, 40]
    before = _snapshot(pool)
    stored = {(layer, kind): pool.stored(layer, kind, torch.tensor(sources)) for layer in range(LAYERS)
              for kind in KINDS}  # fmt: skip
    pool.move(sources, targets)
    for layer in range(LAYERS):
        for kind in KINDS:
            assert_same_bits(pool.stored(layer, kind, torch.tensor(targets)), stored[layer, kind], f"{layer} {kind}")
    after = _snapshot(pool)
    untouched = [slot for slot in range(SLOTS) if slot not in targets]
    for key, buf in before.items():
        assert torch.equal(after[key][:, untouched], buf[:, untouched]), f"{key}: a slot that was not a target"


def test_a_move_onto_itself_or_of_nothing_changes_nothing():
    pool = _pool("int4")
    pool.write(0, torch.tensor([4, 9]), *_states(2, seed=7))
    before = _snapshot(pool)
    pool.move([4, 9], [4, 9])
    pool.move([], [])
    after = _snapshot(pool)
    assert all(torch.equal(after[key], buf) for key, buf in before.items())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_make_pool_is_shaped_for_the_model(dtype):
    model = tiny_llama(vocab_size=64).to(dtype)
    config = model.config
    pool = make_pool(model, "int8", 24)
    head_dim = config.hidden_size // config.num_attention_heads
    assert len(pool.layers) == config.num_hidden_layers and pool.num_slots == 24 and pool.compute_dtype == dtype
    assert pool.layers[0]["value"]["data"].shape == (config.num_key_value_heads, 24, head_dim)
    assert pool.layers[0]["value"]["scale"].shape == (config.num_key_value_heads, 24, 1)
