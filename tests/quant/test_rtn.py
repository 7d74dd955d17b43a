"""Native RTN int8/int4: canonical format, CPU kernels against the reference, model swap, memory."""

from __future__ import annotations

import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spectoolkit.checkpoints import resolve_checkpoint
from spectoolkit.errors import SpecToolkitError
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.quant import rtn_kernels
from spectoolkit.quant.rtn import (
    RtnConfig,
    RtnLinear,
    dequantize_weight,
    load_quantized,
    pack_int4,
    quantize_model_rtn,
    quantize_weight,
    unpack_int4,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # small matmuls: a second thread only adds sync stalls

SHAPES = [(rows, cols, out) for rows in (1, 2, 5, 9) for cols in (64, 128, 576) for out in (96, 192)]
# |forward - reference_forward| <= TOL * (|x| @ |W|ᵀ): the fast path rounds fp32 inputs to bf16 and
# returns bf16 (2^-9 each); the bf16 reference rounds the dequantized weights to bf16 instead.
TOL = {torch.float32: 2**-8, torch.bfloat16: 2**-7}


def _weight(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Gaussian weights with the awkward groups: an outlier, an all-zero row, a one-sided group."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(rows, cols, generator=gen) * 0.05
    weight[0, 3] = 1.5  # outlier
    weight[1] = 0.0  # all-zero groups, whatever the group size
    weight[2, :32] = weight[2, :32].abs() + 0.3  # one-sided group far from zero
    return weight


def _linear(cols: int, out: int, seed: int = 0, bias: bool = False) -> nn.Linear:
    layer = nn.Linear(cols, out, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(_weight(out, cols, seed))
    return layer


@pytest.mark.parametrize(
    ("bits", "group_size"), [(3, 64), (16, 64), (4, 0), (8, 1), (8, -2), (4, 33), (8, "64"), (8, 64.0)]
)
def test_bad_config_raises(bits, group_size):
    with pytest.raises(SpecToolkitError):
        RtnConfig(bits, group_size)


def test_int4_nibble_order():
    codes = torch.tensor([[1, 2, 3, 4], [15, 0, 0, 15]])
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x21, 0x43], [0x0F, 0xF0]]
    assert torch.equal(unpack_int4(packed), codes.to(torch.uint8))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
def test_round_trip_error_is_at_most_half_a_step(bits, group_size):
    weight = _weight(96, 256)
    q = quantize_weight(weight, RtnConfig(bits, group_size))
    group = 256 if group_size == -1 else group_size
    assert q.group_size == group and q.bits == bits and q.shape == (96, 256)
    assert q.scales.dtype == torch.bfloat16 and q.scales.shape == (96, 256 // group)
    if bits == 4:
        assert q.qweight.dtype == torch.uint8 and q.qweight.shape == (96, 128)
        assert q.zeros.dtype == torch.bfloat16 and q.zeros.shape == q.scales.shape
    else:
        assert q.qweight.dtype == torch.int8 and q.qweight.shape == (96, 256) and q.zeros is None
        assert q.qweight.abs().max() <= 127
    error = (dequantize_weight(q) - weight).abs().reshape(96, -1, group).amax(-1)  # [N, G]
    assert (error <= q.scales.float() / 2 * (1 + 1e-5) + 1e-12).all()
    assert (error[1] == 0).all()  # all-zero groups are exact


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_matches_reference_over_shapes(bits, group_size, dtype):
    torch.manual_seed(0)
    for rows, cols, out in SHAPES:
        if cols % group_size:
            continue
        cfg = RtnConfig(bits, group_size)
        layer = RtnLinear.from_linear(_linear(cols, out, seed=rows), cfg)
        assert layer.has_kernel, type(layer)  # the fast path is what is under test
        canonical = quantize_weight(_weight(out, cols, seed=rows), cfg)
        recovered = layer.quantized()  # the kernel layout holds the canonical codes exactly
        assert torch.equal(recovered.qweight, canonical.qweight) and torch.equal(recovered.scales, canonical.scales)
        weight = layer.dequantized_weight()  # fp32 [N, K]
        inputs = torch.randn(rows, cols).to(dtype)
        got = layer(inputs)
        assert got.dtype == dtype and got.shape == (rows, out)
        scale = inputs.float().abs() @ weight.abs().t()  # [M, N]: bounds any rounding of the sum
        diff = (got.float() - layer.reference_forward(inputs).float()).abs()
        assert (diff <= TOL[dtype] * scale).all(), (rows, cols, out, (diff / scale).max().item())
        # Same bf16 inputs, fp32 math: only the kernel's bf16 output rounding and summation order remain.
        exact = F.linear(inputs.to(torch.bfloat16).float(), weight)
        diff = (got.float() - exact).abs()
        assert (diff <= 2**-8 * exact.abs() + 1e-6 * scale).all(), (rows, cols, out)


def test_forward_keeps_batch_dims_and_bias():
    layer = RtnLinear.from_linear(_linear(128, 96, bias=True), RtnConfig(4, 64))
    inputs = torch.randn(2, 3, 128)
    got, ref = layer(inputs), layer.reference_forward(inputs)
    assert got.shape == (2, 3, 96)
    scale = inputs.abs() @ layer.dequantized_weight().abs().t()  # [2, 3, N]
    assert ((got - ref).abs() <= TOL[torch.float32] * scale).all()


@pytest.mark.parametrize("bits", [4, 8])
def test_without_a_kernel_forward_is_the_reference(bits):
    odd = RtnLinear.from_linear(_linear(64, 100), RtnConfig(bits, 16))  # N % 16 and g=16: no CPU kernel
    assert not odd.has_kernel
    inputs = torch.randn(3, 64)
    assert torch.equal(odd(inputs), odd.reference_forward(inputs))
    fast = RtnLinear.from_linear(_linear(64, 96), RtnConfig(bits, 32))
    half = inputs.to(torch.float16)  # fp16: no vectorized kernel, the reference runs
    assert torch.equal(fast(half), fast.reference_forward(half))


def test_int8_per_channel_uses_int8pack_only_when_k_is_a_multiple_of_16():
    assert rtn_kernels.int8_kernel_fits(64) and not rtn_kernels.int8_kernel_fits(72)
    per_channel = RtnLinear.from_linear(_linear(64, 96), RtnConfig(8, -1))
    assert type(per_channel).__name__ == "_Int8ChannelCpu"
    awkward = RtnLinear.from_linear(_linear(72, 96), RtnConfig(8, -1))  # int8pack is wrong at K=72
    inputs = torch.randn(5, 72)
    assert torch.equal(awkward(inputs), awkward.reference_forward(inputs))


def test_cpu_int4_layout_round_trips_on_other_isas():
    """The packed layout differs per ISA (block of 64 rows on AVX-512, 32 otherwise): check all three."""
    script = (
        "import torch\nfrom spectoolkit.quant.rtn_kernels import pack_cpu_int4\n"
        "for rows in (16, 48, 96, 192):\n"
        "    codes = torch.randint(0, 16, (rows, 64), dtype=torch.uint8)\n"
        "    assert pack_cpu_int4(codes) is not None, rows\n"
    )
    for capability in ("default", "avx2"):
        env = dict(os.environ, ATEN_CPU_CAPABILITY=capability)
        subprocess.run([sys.executable, "-c", script], env=env, check=True)


def _dequantized_copy(reference: nn.Module, quantized: nn.Module) -> nn.Module:
    """``reference`` with each linear that was quantized replaced by its fp32 dequantized weight."""
    swapped = copy.deepcopy(reference)
    modules = dict(swapped.named_modules())
    for name, module in quantized.named_modules():
        if isinstance(module, RtnLinear):
            modules[name].weight = nn.Parameter(module.dequantized_weight())
    return swapped


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("skip", [("lm_head",), ()])
def test_quantize_model_rtn_on_tiny_llama(bits, skip):
    reference = tiny_llama(vocab_size=256, seed=2, scale=4.0)
    model = copy.deepcopy(reference)
    counts = quantize_model_rtn(model, RtnConfig(bits, 32), skip=skip)
    num_layers = 2 * 7
    assert counts == {"quantized": num_layers + (not skip), "skipped": 0, "excluded": len(skip)}
    assert isinstance(model.lm_head, RtnLinear) == (not skip)
    assert sum(isinstance(m, RtnLinear) and m.has_kernel for m in model.modules()) == counts["quantized"]
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        got = model(ids).logits[0]
        expected = _dequantized_copy(reference, model)(ids).logits[0]
    # Same weights; the kernels round activations and outputs to bf16 (2^-9 relative) at every linear.
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_layers_whose_width_the_group_does_not_divide_are_skipped_and_counted():
    model = nn.Sequential(nn.Linear(96, 32), nn.Linear(32, 64), nn.Sequential(nn.Linear(64, 96)))
    model.add_module("lm_head", nn.Linear(96, 8))
    counts = quantize_model_rtn(model, RtnConfig(4, 48))  # 48 divides 96, not 32 or 64
    assert counts == {"quantized": 1, "skipped": 2, "excluded": 1}
    assert isinstance(model[0], RtnLinear) and type(model[1]) is nn.Linear and type(model[2][0]) is nn.Linear
    assert type(model.lm_head) is nn.Linear
    with pytest.raises(SpecToolkitError):
        quantize_weight(torch.randn(8, 32), RtnConfig(4, 48))


def _bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            total += tensor.numel() * tensor.element_size()
    return total


@pytest.mark.parametrize(("bits", "bytes_per_weight"), [(4, 0.5 + 4 / 64), (8, 1 + 8 / 64)])
def test_quantized_weight_bytes(bits, bytes_per_weight):
    """int4: codes + bf16 (scale, zero) per 64; int8 (two int4 halves): codes + 2 x bf16 pairs per 64."""
    model = tiny_llama(vocab_size=256, hidden=128)
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    fp32_bytes = _bytes(model)
    quantize_model_rtn(model, RtnConfig(bits, 64), skip=())
    expected = fp32_bytes - 4 * linear_params + bytes_per_weight * linear_params
    assert abs(_bytes(model) - expected) <= 0.01 * expected
    linear_bytes = sum(_bytes(m) for m in model.modules() if isinstance(m, RtnLinear))
    assert 4 / bytes_per_weight * 0.99 <= 4 * linear_params / linear_bytes <= 4 / bytes_per_weight * 1.01


def test_load_quantized(tiny_checkpoint):
    with pytest.raises(SpecToolkitError):
        load_quantized(resolve_checkpoint(str(tiny_checkpoint)), "int4", "cpu", 64)
    model = load_quantized(resolve_checkpoint(str(tiny_checkpoint)), "rtn-int4", "cpu", 32)
    assert sum(isinstance(m, RtnLinear) for m in model.modules()) == 2 * 7
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.float32  # left in float
    with torch.no_grad():
        logits = model(input_ids=torch.arange(3, 12)[None]).logits
    assert logits.shape[:2] == (1, 9) and torch.isfinite(logits).all()
    with_head = load_quantized(resolve_checkpoint(str(tiny_checkpoint)), "rtn-int8", "cpu", 32, quantize_lm_head=True)
    assert isinstance(with_head.lm_head, RtnLinear) and with_head.lm_head.has_kernel
