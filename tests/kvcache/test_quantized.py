"""KV precision in the paged pool: exact rollback of cast and quantized storage, format error bounds, bytes
(DESIGN §2)."""

from __future__ import annotations

import pytest
import torch

from spectoolkit.errors import SpecToolkitError
from spectoolkit.kvcache.formats import (
    KV_FORMATS,
    dequantize_fp8,
    dequantize_int4,
    dequantize_int8,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
)
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.precisions import KV_PRECISIONS
from spectoolkit.runtime.lone import LONE_BLOCK, LoneSequence, lone_sequence
from spectoolkit.runtime.paged_kv import KINDS, PagedKVPool
from tests.serving.helpers import assert_same_bits, bits

LAYERS, HEADS, DIM, SLOTS = 2, 2, 64, 32  # DIM = 64: two int4 groups of 32 per row
STORED = ("fp32", "bf16", "fp16", "fp8", "int8", "int4")  # every precision that converts on write
pytestmark = pytest.mark.usefixtures("one_thread")


def _kv(n: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Random key/value states [H_kv, n, D], rows of very different magnitudes (per-token scales matter)."""
    gen = torch.Generator().manual_seed(seed)
    magnitude = 10 ** torch.empty(HEADS, n, 1).uniform_(-2, 2, generator=gen)
    return tuple((torch.randn(HEADS, n, DIM, generator=gen) * magnitude).to(dtype) for _ in range(2))


def _cat(*chunks: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.cat(states, dim=1) for states in zip(*chunks, strict=True))


def _pool(precision: str, compute: torch.dtype = torch.float32, head_dim: int = DIM) -> PagedKVPool:
    return PagedKVPool(LAYERS, HEADS, head_dim, SLOTS, precision, compute, torch.device("cpu"))


def _assert_same_storage(rolled: PagedKVPool, clean: PagedKVPool, slots: torch.Tensor) -> None:
    for layer in range(LAYERS):
        for kind in KINDS:
            assert_same_bits(rolled.stored(layer, kind, slots), clean.stored(layer, kind, slots), f"{layer} {kind}")


# ---- rollback is bit-exact for every stored precision ------------------------------------------


@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("precision", STORED)
def test_rollback_equals_never_having_written_the_rejected_slots(precision, compute_dtype):
    slot_of = torch.randperm(SLOTS, generator=torch.Generator().manual_seed(1))  # position -> slot
    prefix, accepted, rejected, nxt = (_kv(n, seed, compute_dtype) for seed, n in enumerate((7, 2, 3, 4)))
    rolled, clean, one_write = _pool(precision, compute_dtype), _pool(precision, compute_dtype), \
        _pool(precision, compute_dtype)  # fmt: skip
    for layer in range(LAYERS):
        rolled.write(layer, slot_of[:7], *prefix)
        rolled.write(layer, slot_of[7:12], *_cat(accepted, rejected))  # accepted + rejected drafts
        rolled.write(layer, slot_of[9:13], *nxt)  # rolled back to 9: the next tokens overwrite the rejected slots
        for start, states in zip((0, 7, 9), (prefix, accepted, nxt), strict=True):
            clean.write(layer, slot_of[start : start + states[0].shape[1]], *states)
        one_write.write(layer, slot_of[:13], *_cat(prefix, accepted, nxt))  # per-token: chunking changes no bit
    _assert_same_storage(rolled, clean, slot_of[:13])
    _assert_same_storage(rolled, one_write, slot_of[:13])
    reads = rolled.gather(0, "key", slot_of[:13])  # what attention reads
    assert torch.equal(bits(reads), bits(clean.gather(0, "key", slot_of[:13])))
    assert reads.dtype == compute_dtype and reads.shape == (HEADS, 13, DIM)
    fields = KV_FORMATS[precision].fields(DIM) if precision in KV_FORMATS else {"data": None}
    assert rolled.fields == tuple(fields)  # no full-precision copy kept next to the stored format


def test_cast_storage_is_the_cast_and_reads_come_back_in_the_compute_dtype():
    keys, values = _kv(5, 0)
    slots = torch.arange(5)
    pool = _pool("bf16")
    pool.write(0, slots, keys, values)
    assert pool.layers[0]["key"]["data"].dtype == torch.bfloat16 and not pool.as_computed
    assert torch.equal(pool.gather(0, "key", slots), keys.to(torch.bfloat16).float())
    auto = _pool("auto")  # auto: the model's own dtype, read back as a view
    auto.write(0, slots, keys, values)
    assert auto.as_computed and torch.equal(auto.gather(0, "key", slots), keys)
    assert auto.span(0, "key", 0, 5).data_ptr() == auto.layers[0]["key"]["data"].data_ptr()


def test_unknown_precision_and_odd_head_dim_raise_our_error():
    with pytest.raises(SpecToolkitError, match="int4"):  # the message lists the precisions there are
        _pool("int3")
    with pytest.raises(SpecToolkitError, match="even head_dim"):
        _pool("int4", head_dim=5)


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
    codes = torch.arange(64).remainder(16).float().view(1, 1, 64)  # each group: 0..15 twice, min 0, max 15
    data, scale, zero = quantize_int4(codes)
    assert torch.equal(scale, torch.ones(1, 1, 2)) and torch.equal(zero, torch.zeros(1, 1, 2))
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
    keys = torch.zeros(1, 3, DIM)  # [H_kv = 1, 3 tokens, D]
    keys[:, 1] = 2.5  # a constant row: every int4 group is constant, fp8/int8 exact at absmax
    keys[:, 2, :32] = -1.0
    pool = PagedKVPool(1, 1, DIM, 4, precision, torch.float32, torch.device("cpu"))
    pool.write(0, torch.tensor([3, 0, 2]), keys, keys)
    assert torch.equal(pool.gather(0, "key", torch.tensor([3, 0, 2])), keys)


# ---- bytes: the quantized storage, scales and zeros included ------------------------------------

_PER_TOKEN_BYTES = {  # per layer, keys + values, for H_kv heads of D
    "fp32": 2 * HEADS * DIM * 4,
    "bf16": 2 * HEADS * DIM * 2,
    "fp16": 2 * HEADS * DIM * 2,
    "fp8": 2 * HEADS * (DIM + 4),  # 1-byte codes + one fp32 scale per (token, head)
    "int8": 2 * HEADS * (DIM + 4),
    "int4": 2 * HEADS * (DIM // 2 + 2 * 4 * DIM // 32),  # packed codes + fp32 scale, zero per group
}


@pytest.mark.parametrize("precision", STORED)
def test_slot_bytes_count_the_stored_format(precision):
    assert _pool(precision).slot_bytes() == LAYERS * _PER_TOKEN_BYTES[precision]


def test_int8_is_a_quarter_and_int4_an_eighth_of_fp32_plus_scales():
    fp32 = _PER_TOKEN_BYTES["fp32"]
    assert _PER_TOKEN_BYTES["int8"] / fp32 == pytest.approx(1 / 4 + 1 / DIM)  # + 4 scale bytes per D codes
    assert _PER_TOKEN_BYTES["int4"] / fp32 == pytest.approx(1 / 8 + 1 / 16)  # + 8 bytes per 32 codes
    assert _PER_TOKEN_BYTES["int4"] < _PER_TOKEN_BYTES["int8"] < _PER_TOKEN_BYTES["bf16"]


# ---- through a real model ------------------------------------------------------------------------

# Max |logit - fp32-KV logit| on the tiny model below (logits up to ~3); 2-4x what each format shows.
_LOGIT_ATOL = {"auto": 0.0, "fp32": 0.0, "fp16": 1e-3, "bf16": 5e-3, "fp8": 6e-2, "int8": 2.5e-2, "int4": 0.25}
PROMPT = [1, 17, 93, 250, 7, 41, 8, 9, 100, 200, 33, 64, 128, 5, 6, 7]  # one whole block: drafts go to the next


def _spec_round(sequence: LoneSequence, drafts: list[int], num_accepted: int) -> list[torch.Tensor]:
    """Prefill, one decode step, verify ``drafts``, keep ``num_accepted`` of them, decode two more steps."""
    logits = [sequence.forward(PROMPT, last_only=True)[None], sequence.forward([21])]
    logits.append(sequence.forward(drafts))  # [len(drafts), V]
    sequence.truncate(len(PROMPT) + 1 + num_accepted)
    logits += [sequence.forward([77]), sequence.forward([78])]
    return logits


def _kept(sequence: LoneSequence) -> torch.Tensor:
    return torch.tensor(sequence.table.slots(0, sequence.num_computed))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_llama(seed=3, scale=4.0)


@pytest.mark.parametrize("precision", KV_PRECISIONS)
def test_decode_verify_rollback_decode_close_to_fp32_kv(model, precision):
    reference = _spec_round(lone_sequence(model, "fp32"), [300, 12, 5, 88, 401], 2)
    sequence = lone_sequence(model, precision)
    logits = _spec_round(sequence, [300, 12, 5, 88, 401], 2)
    assert sequence.num_computed == len(PROMPT) + 1 + 2 + 2 and len(PROMPT) == LONE_BLOCK
    for got, want in zip(logits, reference, strict=True):
        torch.testing.assert_close(got, want, atol=_LOGIT_ATOL[precision], rtol=0)


@pytest.mark.parametrize("precision", STORED)
def test_rejected_tokens_leave_no_trace_bit_exact(model, precision):
    """Same chunk shapes, different rejected drafts: kept KV and every later logit are bit-identical."""
    first, second = lone_sequence(model, precision), lone_sequence(model, precision)
    first_logits = _spec_round(first, [300, 12, 5, 88, 401], 2)
    second_logits = _spec_round(second, [300, 12, 499, 3, 250], 2)
    assert not torch.equal(first_logits[2], second_logits[2])  # the rejected drafts did differ
    for after_rollback in (3, 4):
        assert torch.equal(bits(first_logits[after_rollback]), bits(second_logits[after_rollback]))
    assert torch.equal(_kept(first), _kept(second))
    for layer in range(model.config.num_hidden_layers):
        for kind in KINDS:
            assert_same_bits(first.runner.pool.stored(layer, kind, _kept(first)),
                             second.runner.pool.stored(layer, kind, _kept(second)), f"{layer} {kind}")  # fmt: skip


def test_int8_rollback_matches_a_run_that_never_saw_the_rejected_drafts(model):
    rolled = lone_sequence(model, "int8")
    rolled_logits = _spec_round(rolled, [300, 12, 5, 88, 401], 2)
    fresh = lone_sequence(model, "int8")
    fresh_logits = _spec_round(fresh, [300, 12], 2)
    # A 5-token forward computes the kept drafts' K/V through other linear calls (plain nn.Linear here,
    # no row-invariant kernels installed) than a 2-token one, so fp32 K/V (and hence int8 scales) may
    # differ in the last ulp; the codes almost never do.
    for after_rollback in (3, 4):
        torch.testing.assert_close(rolled_logits[after_rollback], fresh_logits[after_rollback], atol=1e-4, rtol=0)
    assert rolled.runner.pool.precision == "int8" and rolled.runner.pool.fields == ("data", "scale")
