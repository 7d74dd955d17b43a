"""KV-cache precision: exact rollback of cast and quantized storage, format error bounds, bytes (DESIGN §2)."""

from __future__ import annotations

import pytest
import torch

from spectoolkit.errors import SpecToolkitError
from spectoolkit.kvcache import PositionalKVCache, PositionalKVLayer
from spectoolkit.kvcache.cache import _INITIAL_CAPACITY
from spectoolkit.kvcache.formats import (
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from spectoolkit.models.cached import CachedModel
from spectoolkit.models.kv_cache import make_kv_cache
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.precisions import KV_PRECISIONS

BATCH, HEADS, DIM = 1, 2, 64  # DIM = 64: two int4 groups of 32 per row
STORED = ("fp32", "bf16", "fp16", "fp8", "int8", "int4")  # every precision that converts on write
pytestmark = pytest.mark.usefixtures("one_thread")


def _kv(n: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random key/value states [B, H_kv, n, D], rows of very different magnitudes (per-token scales matter)."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 10 ** torch.empty(BATCH, HEADS, n, 1).uniform_(-2, 2, generator=gen)
    return tuple((torch.randn(BATCH, HEADS, n, DIM, generator=gen) * magnitude).to(dtype) for _ in range(2))


def _cat(*chunks: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.cat(states, dim=-2) for states in zip(*chunks, strict=True))


def _layer(precision: str) -> PositionalKVLayer:
    return make_kv_cache(1, precision).layers[0]


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    # Bitwise, and the only way for float8: torch.equal has no CPU kernel for Float8_e4m3fn in torch 2.13.
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def _assert_same_storage(rolled: PositionalKVLayer, clean: PositionalKVLayer) -> None:
    rolled_storage, clean_storage = rolled.storage(), clean.storage()
    assert rolled_storage.keys() == clean_storage.keys() and rolled_storage
    for name, stored in rolled_storage.items():
        assert _same_bits(stored, clean_storage[name]), name


def _assert_same_reads(reads: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    for got, want in zip(reads, expected, strict=True):
        assert _same_bits(got, want)


# ---- rollback is bit-exact for every stored precision ------------------------------------------


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision", STORED)
def test_rollback_equals_never_having_written_the_rejected_slots(precision, compute_dtype):
    prefix, accepted, rejected, nxt = (_kv(n, seed, compute_dtype) for seed, n in enumerate((7, 2, 3, 4)))
    rolled = _layer(precision)
    rolled.update(*prefix)
    rolled.update(*_cat(accepted, rejected))  # accepted + rejected drafts
    rolled.truncate(7 + 2)
    assert rolled.get_seq_length() == 9
    rolled_reads = rolled.update(*nxt)  # overwrites the rejected slots by position

    clean = _layer(precision)
    for states in (prefix, accepted):
        clean.update(*states)
    clean_reads = clean.update(*nxt)
    one_write = _layer(precision)  # per-token conversion: chunking cannot change a stored bit
    one_write.update(*_cat(prefix, accepted, nxt))

    assert rolled.get_seq_length() == clean.get_seq_length() == 13
    _assert_same_storage(rolled, clean)
    _assert_same_storage(rolled, one_write)
    _assert_same_reads(rolled_reads, clean_reads)  # what attention reads
    _assert_same_reads(rolled.valid(), clean_reads)
    assert rolled_reads[0].dtype == compute_dtype and rolled_reads[0].shape == (BATCH, HEADS, 13, DIM)
    assert rolled.keys is None and rolled.values is None  # no full-precision copy kept between steps


@pytest.mark.parametrize("precision", STORED)
def test_rollback_across_growth_keeps_contents_exactly(precision):
    prefix = _kv(_INITIAL_CAPACITY - 6, 0)
    accepted, rejected, nxt = _kv(3, 1), _kv(7, 2), _kv(4 * _INITIAL_CAPACITY, 3)
    rolled = _layer(precision)
    rolled.update(*prefix)
    allocated = rolled.allocated_bytes()
    rolled.update(*_cat(accepted, rejected))  # crosses the initial capacity: every buffer is reallocated
    assert rolled.allocated_bytes() > allocated and rolled.capacity == 2 * _INITIAL_CAPACITY
    rolled.truncate(_INITIAL_CAPACITY - 3)
    rolled_reads = rolled.update(*nxt)  # larger than twice the capacity in one write
    assert rolled.capacity == 5 * _INITIAL_CAPACITY - 3

    clean = _layer(precision)
    for states in (prefix, accepted, nxt):
        clean_reads = clean.update(*states)
    one_write = _layer(precision)
    one_write.update(*_cat(prefix, accepted, nxt))
    _assert_same_storage(rolled, clean)
    _assert_same_storage(rolled, one_write)
    _assert_same_reads(rolled_reads, clean_reads)


def test_cast_storage_is_the_cast_and_reads_come_back_in_the_compute_dtype():
    keys, values = _kv(5, 0)
    layer = _layer("bf16")
    read_keys, _ = layer.update(keys, values)
    assert layer.storage()["_key_buf"].dtype == torch.bfloat16
    assert torch.equal(read_keys, keys.to(torch.bfloat16).float())
    assert torch.equal(_layer("auto").update(keys, values)[0], keys)  # auto: the model's own dtype
    assert type(make_kv_cache(2, "auto").layers[0]) is PositionalKVLayer


def test_unknown_precision_and_odd_head_dim_raise_our_error():
    with pytest.raises(SpecToolkitError, match="int4"):
        make_kv_cache(2, "int3")
    layer = _layer("int4")
    with pytest.raises(SpecToolkitError, match="even head_dim"):
        layer.update(torch.zeros(1, 1, 2, 5), torch.zeros(1, 1, 2, 5))


# ---- quantization error bounds ------------------------------------------------------------------

_ROUNDING_SLACK = 1e-6  # fp32 rounding of the divide / multiply-add, relative to the row magnitude


def test_int8_error_is_at_most_half_a_step():
    states = _kv(300, 5)[0]
    data, scale = quantize_int8(states)  # int8 [..., D], fp32 [..., 1]
    error = (dequantize_int8(data, scale, torch.float32) - states).abs()
    assert data.dtype == torch.int8 and scale.shape == (*states.shape[:-1], 1)
    assert torch.all(error <= scale / 2 + _ROUNDING_SLACK * states.abs().amax(-1, keepdim=True))
    assert error.amax() > 0.4 * scale.amin()  # the bound is tight: this really is 8-bit
    assert torch.equal(data.abs().amax(-1), torch.full(states.shape[:-1], 127, dtype=torch.int8))


def test_int4_error_is_at_most_half_a_step_per_group():
    states = _kv(300, 6)[0]
    data, scale, zero = quantize_int4(states)  # uint8 [..., D/2], fp32 [..., D/32] twice
    assert data.shape[-1] == DIM // 2 and scale.shape[-1] == zero.shape[-1] == DIM // 32
    error = (dequantize_int4(data, scale, zero, torch.float32) - states).abs().unflatten(-1, (DIM // 32, 32))
    magnitude = states.abs().amax(-1)[..., None, None]
    assert torch.all(error <= scale[..., None] / 2 + _ROUNDING_SLACK * magnitude)
    assert error.amax() > 0.4 * scale.amin()
    codes = torch.stack([data & 0x0F, data >> 4], -1).flatten(-2).unflatten(-1, (DIM // 32, 32))
    assert torch.all(codes.amin(-1) == 0) and torch.all(codes.amax(-1) == 15)  # each group spans 0..15


def test_int4_packing_layout_low_nibble_first():
    codes = torch.arange(64).remainder(16).float().view(1, 1, 1, 64)  # each group: 0..15 twice, min 0, max 15
    data, scale, zero = quantize_int4(codes)
    assert torch.equal(scale, torch.ones(1, 1, 1, 2)) and torch.equal(zero, torch.zeros(1, 1, 1, 2))
    expected = (codes[..., 0::2] + 16 * codes[..., 1::2]).to(torch.uint8)  # element 2j low, 2j+1 high
    assert torch.equal(data, expected)


def test_fp8_relative_error_within_e4m3():
    states = _kv(300, 7)[0]
    data, scale = quantize_fp8(states)
    assert data.dtype == torch.float8_e4m3fn and scale.shape == (*states.shape[:-1], 1)
    error = (dequantize_fp8(data, scale, torch.float32) - states).abs()
    # e4m3: 3 mantissa bits -> half an ulp is 2^-4 relative for normals; subnormals (|x/scale| < 2^-6)
    # are spaced 2^-9, so at most 2^-10 absolute in scaled units.
    bound = 2**-4 * states.abs() + 2**-10 * scale + _ROUNDING_SLACK * states.abs().amax(-1, keepdim=True)
    assert torch.all(error <= bound)
    assert (error / states.abs()).amax() > 2**-5  # coarser than fp16/bf16 would be
    assert torch.equal(data.float().abs().amax(-1), torch.full(states.shape[:-1], 448.0))


@pytest.mark.parametrize("precision", ["fp8", "int8", "int4"])
def test_zero_rows_and_constant_groups_decode_exactly(precision):
    keys = torch.zeros(1, 1, 3, DIM)
    keys[:, :, 1] = 2.5  # a constant row: every int4 group is constant, fp8/int8 exact at absmax
    keys[:, :, 2, :32] = -1.0
    read_keys, _ = _layer(precision).update(keys, keys)
    assert torch.equal(read_keys, keys)


# ---- bytes: the quantized storage, scales and zeros included ------------------------------------

_PER_TOKEN_BYTES = {  # per layer, keys + values, for [B, H_kv, ·, D]
    "fp32": 2 * BATCH * HEADS * DIM * 4,
    "bf16": 2 * BATCH * HEADS * DIM * 2,
    "fp16": 2 * BATCH * HEADS * DIM * 2,
    "fp8": 2 * BATCH * HEADS * (DIM + 4),  # 1-byte codes + one fp32 scale per (token, head)
    "int8": 2 * BATCH * HEADS * (DIM + 4),
    "int4": 2 * BATCH * HEADS * (DIM // 2 + 2 * 4 * DIM // 32),  # packed codes + fp32 scale, zero per group
}


@pytest.mark.parametrize("precision", STORED)
def test_used_and_allocated_bytes_count_the_stored_format(precision):
    cache = make_kv_cache(2, precision)
    assert cache.used_bytes() == cache.allocated_bytes() == 0
    for layer_idx in range(2):
        cache.update(*_kv(10, layer_idx), layer_idx)
    per_token = _PER_TOKEN_BYTES[precision]
    assert cache.used_bytes() == 2 * 10 * per_token
    assert cache.allocated_bytes() == 2 * _INITIAL_CAPACITY * per_token
    cache.truncate(4)
    assert cache.used_bytes() == 2 * 4 * per_token


def test_int8_is_a_quarter_and_int4_an_eighth_of_fp32_plus_scales():
    fp32 = _PER_TOKEN_BYTES["fp32"]
    assert _PER_TOKEN_BYTES["int8"] / fp32 == pytest.approx(1 / 4 + 1 / DIM)  # + 4 scale bytes per D codes
    assert _PER_TOKEN_BYTES["int4"] / fp32 == pytest.approx(1 / 8 + 1 / 16)  # + 8 bytes per 32 codes
    assert _PER_TOKEN_BYTES["int4"] < _PER_TOKEN_BYTES["int8"] < _PER_TOKEN_BYTES["bf16"]


# ---- through a real model ------------------------------------------------------------------------

# Max |logit - fp32-cache logit| on the tiny model below (logits up to ~3); 2-4x what each format shows.
_LOGIT_ATOL = {"auto": 0.0, "fp32": 0.0, "fp16": 1e-3, "bf16": 5e-3, "fp8": 6e-2, "int8": 2.5e-2, "int4": 0.25}
PROMPT = [1, 17, 93, 250, 7, 41, 8, 9, 100, 200, 33, 64, 128, 5, 6, 7]


def _spec_round(runner: CachedModel, drafts: list[int], num_accepted: int) -> list[torch.Tensor]:
    """Prefill, one decode step, verify ``drafts``, keep ``num_accepted`` of them, decode two more steps."""
    logits = [runner.forward(PROMPT, last_only=True)[None], runner.forward([21])]
    logits.append(runner.forward(drafts))  # [len(drafts), V]
    runner.truncate(len(PROMPT) + 1 + num_accepted)
    logits += [runner.forward([77]), runner.forward([78])]
    return logits


def _runner(model: torch.nn.Module, precision: str) -> CachedModel:
    runner = CachedModel(model)
    runner.cache = make_kv_cache(runner.num_layers, precision)
    return runner


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(seed=3, scale=4.0)


@pytest.mark.parametrize("precision", KV_PRECISIONS)
def test_decode_verify_rollback_decode_close_to_fp32_cache(model, precision):
    reference = _spec_round(_runner(model, "fp32"), [300, 12, 5, 88, 401], 2)
    runner = _runner(model, precision)
    logits = _spec_round(runner, [300, 12, 5, 88, 401], 2)
    assert runner.num_computed == len(PROMPT) + 1 + 2 + 2
    for got, want in zip(logits, reference, strict=True):
        torch.testing.assert_close(got, want, atol=_LOGIT_ATOL[precision], rtol=0)


@pytest.mark.parametrize("precision", STORED)
def test_rejected_tokens_leave_no_trace_bit_exact(model, precision):
    """Same chunk shapes, different rejected drafts: kept KV and every later logit are bit-identical."""
    first, second = _runner(model, precision), _runner(model, precision)
    first_logits = _spec_round(first, [300, 12, 5, 88, 401], 2)
    second_logits = _spec_round(second, [300, 12, 499, 3, 250], 2)
    assert not torch.equal(first_logits[2], second_logits[2])  # the rejected drafts did differ
    for after_rollback in (3, 4):
        assert _same_bits(first_logits[after_rollback], second_logits[after_rollback])
    for first_layer, second_layer in zip(first.cache.layers, second.cache.layers, strict=True):
        _assert_same_storage(first_layer, second_layer)


def test_int8_rollback_matches_a_run_that_never_saw_the_rejected_drafts(model):
    rolled = _runner(model, "int8")
    rolled_logits = _spec_round(rolled, [300, 12, 5, 88, 401], 2)
    fresh = _runner(model, "int8")
    fresh_logits = _spec_round(fresh, [300, 12], 2)
    # A 5-token forward computes the kept drafts' K/V with other GEMM/SDPA blocking than a 2-token one,
    # so fp32 K/V (and hence int8 scales) may differ in the last ulp; the codes almost never do.
    for after_rollback in (3, 4):
        torch.testing.assert_close(rolled_logits[after_rollback], fresh_logits[after_rollback], atol=1e-4, rtol=0)
    assert isinstance(rolled.cache, PositionalKVCache)
