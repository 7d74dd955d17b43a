"""Native round-to-nearest (RTN) weight-only quantization: group-wise int8 and int4 linears.

Every ``nn.Linear`` (weight W [N, K] = [out_features, in_features]) becomes an :class:`RtnLinear`
holding its weight in the canonical format of :mod:`spectoolkit.kernels.rtn_format`
(:class:`~spectoolkit.kernels.rtn_format.QuantizedWeight`: int4 asymmetric or int8 symmetric, groups of
g columns along K or one per output channel) — the contract the Triton kernels share, in a leaf module
both import. Scales are bf16 because the fast CPU kernels (and the usual GPU activation dtype) take
bf16; the products ``code × scale`` are exact in fp32, so every kernel sees bit-identical weights.

``RtnLinear.forward`` picks the fastest kernel that runs exactly these weights
(:mod:`spectoolkit.quant.rtn_kernels`): on the CPU, torch's int4 tinygemm kernel (int4, and
group-wise int8 split into two int4 halves) or ``_weight_int8pack_mm`` (per-channel int8). Those are
vectorized for bf16 activations only, so fp32 inputs are rounded to bf16 on the way in, accumulated
in fp32 and returned as bf16 → input dtype. Anything else (other devices, fp16, shapes the kernels
reject) runs :meth:`RtnLinear.reference_forward`: dequantize, then ``F.linear``. On CUDA (when
Triton imports) a layer holds the K-major packed weight of ``spectoolkit.kernels.quant_matmul`` and
runs its Triton kernel (codes dequantized in registers, fp32 accumulation, output in the input
dtype) for fp16/bf16/fp32 inputs and the group sizes it takes. Each variant is one subclass with
its own storage, chosen once at construction; the quantized bytes are held once (canonical codes
are recovered from a kernel layout by an exact, checked unpacking).

``quantize_model_rtn`` leaves ``lm_head`` in float by default: in most small LMs (SmolLM2 included)
it is tied to the input embedding, so a quantized copy *adds* memory instead of saving it, and the
logits are where quantization error reaches the output most directly. Pass ``skip=()`` to quantize
it anyway (a self-draft whose step time is dominated by a 49k-row float head wants that).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels.rtn_format import (
    QuantizedWeight,
    RtnConfig,
    dequantize_weight,
    pack_int4,
    quantize_weight,
    unpack_int4,
)
from spectoolkit.kernels.runtime import interpreting, kernels_usable
from spectoolkit.quant import rtn_kernels as kernels

if TYPE_CHECKING:
    from spectoolkit.checkpoints import Checkpoint

PRECISION_BITS = {"rtn-int8": 8, "rtn-int4": 4}
BASE_PRECISION = "fp32"  # float checkpoint the linears are quantized from; see load_quantized


class RtnLinear(nn.Module):
    """A quantized ``nn.Linear``; :meth:`from_linear` picks the subclass (storage + kernel) once."""

    has_kernel = False  # whether forward can run a CPU kernel (else always the reference)

    def __init__(self, in_features: int, out_features: int, bits: int, group_size: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.bits = bits
        self.group_size = group_size
        self.has_bias = bias is not None
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, cfg: RtnConfig) -> RtnLinear:
        """Quantize ``linear`` (RTN) into the fastest variant available for its device and shape."""
        quantized = quantize_weight(linear.weight, cfg)
        bias = None if linear.bias is None else linear.bias.detach().clone()
        if kernels_usable(linear.weight.device):
            layer = _TritonCuda.build(quantized, bias)
            if layer is not None:
                return layer
        if linear.weight.device.type == "cpu":
            for variant in (_Int8ChannelCpu, _Int4Cpu, _Int8SplitCpu):
                if variant.fits(quantized):
                    layer = variant.build(quantized, bias)
                    if layer is not None:
                        return layer
        return _Canonical.build(quantized, bias)

    def quantized(self) -> QuantizedWeight:
        """The canonical format of this layer's weight (recovered exactly from the kernel layout)."""
        raise NotImplementedError

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [N, K]."""
        return dequantize_weight(self.quantized())

    def reference_forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs [..., K] -> [..., N] in the input dtype: dequantize, then ``F.linear``."""
        bias = None if self.bias is None else self.bias.to(inputs.dtype)
        return F.linear(inputs, self.dequantized_weight().to(inputs.dtype), bias)

    def _fast_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        """rows [M, K] fp32/bf16 on the CPU -> [M, N] bf16; subclasses with a kernel override it."""
        raise NotImplementedError

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs [..., K] -> [..., N]: the CPU kernel for fp32/bf16 inputs, else the reference."""
        # ~200 calls per decode step: test plain attributes (a buffer lookup goes through Module.__getattr__).
        if not (self.has_kernel and inputs.is_cpu and inputs.dtype in kernels.FAST_ACTIVATION_DTYPES):
            return self.reference_forward(inputs)
        out = self._fast_matmul(inputs.reshape(-1, self.in_features)).to(inputs.dtype)  # [M, N]
        if self.has_bias:
            out = out + self.bias.to(out.dtype)
        return out.view(*inputs.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"{shape}, bits={self.bits}, group_size={self.group_size}, variant={type(self).__name__}"


class _Canonical(RtnLinear):
    """Canonical buffers, reference forward (off the CPU, or shapes no CPU kernel takes)."""

    @classmethod
    def build(cls, q: QuantizedWeight, bias: torch.Tensor | None) -> RtnLinear:
        layer = cls(q.shape[1], q.shape[0], q.bits, q.group_size, bias)
        layer.register_buffer("qweight", q.qweight)
        layer.register_buffer("scales", q.scales)
        layer.register_buffer("zeros", q.zeros)
        return layer

    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scales, self.zeros, self.group_size, self.bits)


class _Int8ChannelCpu(_Canonical):
    """Per-channel int8 (g == K): canonical buffers, ``_weight_int8pack_mm``."""

    has_kernel = True

    @staticmethod
    def fits(q: QuantizedWeight) -> bool:
        return q.bits == 8 and q.group_size == q.shape[1] and kernels.int8_kernel_fits(q.shape[1])

    def _fast_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return kernels.int8_channel_matmul(rows, self.qweight, self.scales[:, 0])


class _Int4Cpu(RtnLinear):
    """Group-wise int4: codes in the CPU tinygemm layout + scales_and_zeros [G, N, 2] bf16."""

    has_kernel = True

    @staticmethod
    def fits(q: QuantizedWeight) -> bool:
        return q.bits == 4 and kernels.int4_kernel_fits(q.shape[0], q.group_size)

    @classmethod
    def build(cls, q: QuantizedWeight, bias: torch.Tensor | None) -> RtnLinear | None:
        packed = kernels.pack_cpu_int4(unpack_int4(q.qweight))
        if packed is None:
            return None
        layer = cls(q.shape[1], q.shape[0], 4, q.group_size, bias)
        layer.register_buffer("packed", packed)  # [N, K/2] uint8
        layer.register_buffer("scales_and_zeros", torch.stack([q.scales.t(), q.zeros.t()], dim=-1).contiguous())
        return layer

    def quantized(self) -> QuantizedWeight:
        codes = kernels.unpack_cpu_int4(self.packed, self.out_features, self.in_features)
        scales, zeros = self.scales_and_zeros.unbind(-1)  # [G, N] each
        return QuantizedWeight(pack_int4(codes), scales.t().contiguous(), zeros.t().contiguous(), self.group_size, 4)

    def _fast_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return kernels.int4_matmul(rows, self.packed, self.group_size, self.scales_and_zeros)


class _Int8SplitCpu(RtnLinear):
    """Group-wise int8 as two int4 halves on the tinygemm kernel (exact; see rtn_kernels)."""

    has_kernel = True

    @staticmethod
    def fits(q: QuantizedWeight) -> bool:
        return q.bits == 8 and kernels.int4_kernel_fits(q.shape[0], q.group_size)

    @classmethod
    def build(cls, q: QuantizedWeight, bias: torch.Tensor | None) -> RtnLinear | None:
        codes, scales_and_zeros = kernels.split_int8(q.qweight, q.scales)
        packed = kernels.pack_cpu_int4(codes)
        if packed is None:
            return None
        layer = cls(q.shape[1], q.shape[0], 8, q.group_size, bias)
        layer.register_buffer("packed", packed)  # [N, K] uint8 (= int4 [N, 2K])
        layer.register_buffer("scales_and_zeros", scales_and_zeros)  # [2G, N, 2] bf16
        return layer

    def quantized(self) -> QuantizedWeight:
        codes = kernels.unpack_cpu_int4(self.packed, self.out_features, 2 * self.in_features)
        qweight, scales = kernels.join_int8(codes, self.scales_and_zeros)
        return QuantizedWeight(qweight, scales, None, self.group_size, 8)

    def _fast_matmul(self, rows: torch.Tensor) -> torch.Tensor:
        return kernels.int8_split_matmul(rows, self.packed, self.group_size, self.scales_and_zeros)


class _TritonCuda(RtnLinear):
    """CUDA: the Triton weight-only matmul on its K-major packed weight (``spectoolkit.kernels.quant_matmul``).

    The kernel module is imported only here, when a layer is built on a GPU: importing it decorates
    its kernels, which must stay interpreted in a CPU test session.
    """

    _kernels = None  # spectoolkit.kernels.quant_matmul, set by the first build

    @classmethod
    def build(cls, q: QuantizedWeight, bias: torch.Tensor | None) -> RtnLinear | None:
        """The layer, or None when the kernel does not take this group size (then the caller falls back)."""
        from spectoolkit.kernels import quant_matmul

        if quant_matmul.unsupported_reason(q) is not None:
            return None
        packed = quant_matmul.pack_for_kernel(q)
        layer = cls(q.shape[1], q.shape[0], q.bits, q.group_size, bias)
        layer.register_buffer("qweight", packed.qweight)  # int4: int32 [ceil(K/8), N]; int8: int8 [K, N]
        layer.register_buffer("scales", packed.scales)  # bf16 [G, N]
        layer.register_buffer("zeros", packed.zeros)  # bf16 [G, N] or None
        cls._kernels = quant_matmul  # a class attribute: a module object in the instance would not deepcopy
        return layer

    def packed(self):
        """The kernel-layout weight (``quant_matmul.PackedWeight``) over this layer's buffers."""
        return self._kernels.PackedWeight(
            self.qweight, self.scales, self.zeros, self.group_size, self.bits, self.in_features
        )

    def quantized(self) -> QuantizedWeight:
        return self._kernels.unpack_from_kernel(self.packed())

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs [..., K] -> [..., N]: the Triton kernel for fp16/bf16/fp32, else the reference."""
        # Off CUDA (a model moved to the CPU) the kernel runs only in the interpreter (tests).
        if inputs.dtype not in self._kernels.ACTIVATION_DTYPES or not (inputs.is_cuda or interpreting()):
            return self.reference_forward(inputs)
        return self._kernels.quant_matmul(inputs, self.packed(), self.bias)


def quantize_model_rtn(model: nn.Module, cfg: RtnConfig, skip: tuple[str, ...] = ("lm_head",)) -> dict[str, int]:
    """Replace the ``nn.Linear`` layers of ``model`` by :class:`RtnLinear`, in place.

    A layer is left in float when its name (last component or full dotted name) is in ``skip``
    (counted as ``excluded``), or when ``cfg.group_size`` does not divide its in_features
    (``skipped``). Returns ``{"quantized": n, "skipped": m, "excluded": e}``.
    """
    counts = {"quantized": 0, "skipped": 0, "excluded": 0}
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            full_name = f"{parent_name}.{child_name}" if parent_name else child_name
            if child_name in skip or full_name in skip:
                counts["excluded"] += 1
            elif cfg.layer_group_size(child.in_features) is None:
                counts["skipped"] += 1
            else:
                setattr(parent, child_name, RtnLinear.from_linear(child, cfg))
                counts["quantized"] += 1
    return counts


def load_quantized(
    checkpoint: Checkpoint,
    precision: str,
    device,
    group_size: int,
    *,
    quantize_lm_head: bool = False,
    head_rows: torch.Tensor | None = None,
) -> nn.Module:
    """Load ``checkpoint`` (resolved once: :func:`~spectoolkit.checkpoints.resolve_checkpoint`) and RTN-quantize
    its linears (``rtn-int8``/``rtn-int4``).

    The checkpoint is loaded at :data:`BASE_PRECISION` (fp32: a bf16 base measured no faster on the
    CPU and adds error outside the linears) with the fp32 CPU GEMM path for layers left in float;
    quantized layers compute in bf16 on the CPU (module docstring). ``quantize_lm_head`` also
    quantizes the output projection (see :func:`quantize_model_rtn` for why it is off by default); ``head_rows``
    (target ids) cuts it to those rows first (:func:`~spectoolkit.models.float_model.load_float_model`).
    """
    # Here, not at the top: the model modules import transformers, which
    # ``import spectoolkit.quant.rtn`` (the kernels' tests, the CPU linears) does not need.
    from spectoolkit.models.float_model import load_float_model
    from spectoolkit.models.paths import resolve_device

    if precision not in PRECISION_BITS:
        raise SpecToolkitError(f"precision '{precision}' is not an RTN precision ({', '.join(PRECISION_BITS)})")
    cfg = RtnConfig(PRECISION_BITS[precision], group_size)
    device = resolve_device(device) if isinstance(device, str) else device
    model = load_float_model(checkpoint.location, BASE_PRECISION, device, head_rows)
    quantize_model_rtn(model, cfg, skip=() if quantize_lm_head else ("lm_head",))
    return model
