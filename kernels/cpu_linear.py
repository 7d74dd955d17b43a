"""Weights packed once at load for our CPU linear, the layer that runs it, and its fp64 reference.

A weight W [N, K] (``nn.Linear`` layout) is packed into panels of 16 output columns, K-major within a
panel, so one SIMD lane holds one output column and a panel streams as one run of memory (DESIGN §7):

- fp32 / bf16: ``data`` [P, K, 16] in that dtype (P = ceil(N / 16); padded columns are zero);
- rtn-int8 (symmetric): ``data`` int8 [P, K, 16] codes, ``scales`` fp32 [P, G, 16];
- rtn-int4 (asymmetric, :mod:`spectoolkit.kernels.rtn_format`): ``data`` uint8 [P, K/2, 16], byte (p, i, c)
  holding code u of column k = 2i in its low nibble and of 2i + 1 in its high one; the kernel uses u - 8;
  ``scales``, ``zeros`` fp32 [P, G, 16] (bf16 values widened exactly);
- nf4 (bitsandbytes' 4-bit NormalFloat): ``data`` as int4, code u standing for :data:`NF4` [u]; ``scales`` fp32
  [P, G, 16] the blocks' absmax; ``zeros`` empty (that is how the kernel tells nf4 from int4).

With int8 activations (issue 47, DESIGN §7) int8 and int4 weights take a second layout, for the integer dot
products: ``data`` int8 [P, K/4, 16, 4] (each column's 4 consecutive codes together) or uint8 [P, K/8, 16, 4]
(byte (i, c, j): code of k = 8i + j in the low nibble, of 8i + 4 + j in the high one); scales and zeros as
above. Each row is then quantized per 32-element block (:func:`quantize_activations`) and each sub-block's
integer sum is exact (csrc/int_body.inc says how); :func:`to_int8_activations` re-lays a packed weight.

Output element (m, n) is then, for float weights, ``acc = fma(x[m, k], W[n, k], acc)`` for k ascending;
for quantized weights, per group g, ``block = fma(x[m, k], q[n, k], block)`` over the group from 0, then
``acc = fma(block, scale, acc)`` (int4: then ``acc = fma(sum of x over the group, zero, acc)``). The
dequantized weight is ``q * scale`` (int8), ``(u - 8) * scale + zero`` (int4, as the canonical format) and
``NF4[u] * absmax`` (nf4).

A format held at its own size (:mod:`spectoolkit.kernels.formats`, issue 55: a GGUF block type, rtn-int4/int8 and
GPTQ int4 at groups of 32, 64, 128) is a third layout, for int8 activations only: ``data`` uint8 [P, K/B, REC] records
with the checkpoint's codes and scales, ``fmt`` its name, scales and zeros empty (:func:`pack_records`,
:func:`pack_rtn_records`); :func:`widen` gives the wide layout of the same weight (the same bits through the kernel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from spectoolkit.kernels import cpu_ops, formats
from spectoolkit.kernels.rtn_format import QuantizedWeight, unpack_int4

PANEL = 16
FLOAT_DTYPES = (torch.float32, torch.bfloat16)
# bitsandbytes' NF4 code values (QLoRA), fp32; the kernels' own copy is csrc/ops.cpp's NF4 (a test checks both
# against bitsandbytes' table).
NF4 = torch.tensor(
    [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0],
    dtype=torch.float32,
)  # fmt: skip


@dataclass
class PackedWeight:
    """One linear's weight in the kernel's panels (module docstring); ``group`` = K for float weights."""

    data: torch.Tensor  # [P, K, 16] fp32/bf16/int8, [P, K/2, 16] uint8 (int4, nf4); int8 activations: [P, K/4|8, 16, 4]
    scales: torch.Tensor  # [P, G, 16] fp32, or empty
    zeros: torch.Tensor  # [P, G, 16] fp32 (int4), or empty
    out_features: int  # N
    in_features: int  # K
    group: int
    fmt: str = ""  # a format of :mod:`~spectoolkit.kernels.formats` ("Q4_K"), or "" for the wide layouts

    @property
    def kind(self) -> str:
        if self.fmt:
            return self.fmt
        if self.data.dtype == torch.uint8:
            return "int4" if self.zeros.numel() else "nf4"
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}[self.data.dtype]

    @property
    def activations(self) -> str:
        """ "int8": the integer-activation layout; "float": the panels (x stays fp32)."""
        return "int8" if self.data.dim() == 4 or self.fmt else "float"

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.zeros))


def _panels(columns: torch.Tensor) -> torch.Tensor:
    """[N, R] rows of output columns -> [P, R, 16], the last panel padded with zeros."""
    count, width = columns.shape
    padded = -count % PANEL
    if padded:
        columns = torch.cat([columns, columns.new_zeros(padded, width)])
    return columns.view(-1, PANEL, width).transpose(1, 2).contiguous()


_EMPTY = torch.empty(0)


def pack_float(weight: torch.Tensor) -> PackedWeight:
    """A float weight [N, K] (fp32 or bf16, kept in its dtype) -> panels."""
    if weight.dtype not in FLOAT_DTYPES:
        raise ValueError(f"pack_float takes fp32 or bf16 weights, not {weight.dtype}")
    rows, columns = weight.shape
    return PackedWeight(_panels(weight.detach()), _EMPTY, _EMPTY, rows, columns, columns)


def pack_rtn(quantized: QuantizedWeight) -> PackedWeight:
    """A canonical RTN weight (:class:`~spectoolkit.kernels.rtn_format.QuantizedWeight`) -> panels."""
    group = quantized.group_size
    if quantized.bits == 8:
        return pack_int8_codes(quantized.qweight, quantized.scales.float(), group)
    return pack_int4_codes(unpack_int4(quantized.qweight), quantized.scales.float(), quantized.zeros.float(), group)


def pack_rtn_records(quantized: QuantizedWeight) -> PackedWeight | None:
    """A canonical RTN weight at its own size (bf16 scales and zeros, codes at their width: ``rtn-int4-g64``, ...),
    the same weight as :func:`pack_rtn`'s; None where its group has no format (it stays wide)."""
    name = formats.own_size(f"rtn-int{quantized.bits}", quantized.group_size)
    if name is None:
        return None
    if quantized.bits == 8:
        return pack_records(name, quantized.qweight, {"s": quantized.scales})
    return pack_records(name, unpack_int4(quantized.qweight), {"s": quantized.scales, "z": quantized.zeros})


def pack_records(name: str, codes: torch.Tensor, fields: dict[str, torch.Tensor]) -> PackedWeight:
    """Codes [N, K] and header fields [N, K/B, count] of format ``name`` (:func:`~spectoolkit.kernels.formats.records`)
    -> its records."""
    rows, columns = codes.shape
    data = formats.records(name, codes, fields)
    return PackedWeight(data, _EMPTY, _EMPTY, rows, columns, formats.FORMATS[name].group, name)


def pack_int8_codes(codes: torch.Tensor, scales: torch.Tensor, group: int) -> PackedWeight:
    """int8 codes q [N, K] and fp32 ``scales`` [N, K / group] -> panels; the weight is ``q * scale`` (the canonical
    formula; other int8 formats map onto it exactly, e.g. GGUF's Q8_0)."""
    rows, columns = codes.shape
    return PackedWeight(_panels(codes.to(torch.int8)), _panels(scales.float()), _EMPTY, rows, columns, group)


def pack_int4_codes(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> PackedWeight:
    """int4 codes u [N, K] in [0, 15] and fp32 ``scales``/``zeros`` [N, K / group] -> panels; the weight is
    ``(u - 8) * scale + zero`` (the canonical formula; other int4 formats map onto it exactly, e.g. GPTQ)."""
    rows, columns = codes.shape
    return PackedWeight(_nibbles(codes), _panels(scales.float()), _panels(zeros.float()), rows, columns, group)


def pack_nf4(codes: torch.Tensor, absmax: torch.Tensor, group: int) -> PackedWeight:
    """nf4 codes u [N, K] in [0, 15] and fp32 ``absmax`` [N, K / group] -> panels; the weight is ``NF4[u] * absmax``."""
    rows, columns = codes.shape
    return PackedWeight(_nibbles(codes), _panels(absmax.float()), _EMPTY, rows, columns, group)


def _nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] -> [P, K/2, 16] bytes: k even in the low nibble, k + 1 in the high one."""
    panels = _panels(codes.to(torch.uint8))  # [P, K, 16]
    return (panels[:, 0::2] | (panels[:, 1::2] << 4)).contiguous()


def linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None, isa: int = -1) -> torch.Tensor:
    """x [..., K] (any float dtype) -> [..., N] in x's dtype, through the kernel (``isa``: a path of
    :data:`~spectoolkit.kernels.cpu_ops.ISAS`, -1 the best this CPU has)."""
    cpu_ops.load()
    rows = x.reshape(-1, x.shape[-1]).float()  # [M, K]
    out = torch.ops.spectoolkit.linear(
        rows, packed.data, packed.scales, packed.zeros, bias, packed.out_features, packed.group, isa, format_id(packed)
    )  # [M, N] fp32
    return out.to(x.dtype).reshape(*x.shape[:-1], packed.out_features)


def format_id(packed: PackedWeight) -> int:
    """The kernel's ``fmt`` argument for ``packed`` (0: the wide layouts)."""
    return formats.FORMAT_IDS[packed.fmt] if packed.fmt else 0


def widen(packed: PackedWeight) -> PackedWeight:
    """A format's records -> the wide int8-activation layout of the same weight (what it was packed as before
    issue 55); the wide layouts as they are."""
    if not packed.fmt:
        return packed
    kind = formats.WIDE_KIND.get(packed.fmt)
    if kind is None:
        raise ValueError(f"{packed.fmt} has no wide layout (its codes do not fit the wide int8/int4 kinds)")
    fmt = formats.FORMATS[packed.fmt]
    codes, scales, zeros = formats.decode(packed.data, packed.fmt)  # [P, K or G, 16]

    def rows(panels: torch.Tensor) -> torch.Tensor:  # [P, X, 16] -> [N, X]
        return panels.transpose(1, 2).reshape(-1, panels.shape[1])[: packed.out_features]

    if kind == "int8":
        wide = pack_int8_codes(rows(codes - fmt.offset), rows(scales), fmt.group)
    else:
        wide = pack_int4_codes(rows(codes), rows(scales), rows(zeros), fmt.group)
    return to_int8_activations(wide)


def float_layout(packed: PackedWeight) -> PackedWeight:
    """``packed`` for float activations: the wide panels (a format without a wide kind: its fp32 weight)."""
    if packed.fmt and packed.fmt not in formats.WIDE_KIND:
        return pack_float(dequantized(packed).float())
    return _float_layout(widen(packed))


def dequantized(packed: PackedWeight) -> torch.Tensor:
    """The weight [N, K] as fp64, from the panels (what the kernel multiplies by)."""
    if packed.fmt:  # the scales and zeros the kernel computes from the records (formats.decode)
        fmt = formats.FORMATS[packed.fmt]
        codes, scales, zeros = formats.decode(packed.data, packed.fmt)
        return _scaled(codes.double() - fmt.offset, scales, zeros, fmt.group, packed.out_features)
    data = _float_layout(packed).data
    if packed.kind in ("int4", "nf4"):
        codes = torch.stack([data & 15, data >> 4], dim=2).flatten(1, 2)  # [P, K, 16] u
        codes = codes.double() - 8 if packed.kind == "int4" else NF4.double()[codes.long()]
    else:
        codes = data.double()
    return _scaled(codes, packed.scales, packed.zeros, packed.group, packed.out_features)


def _scaled(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group: int, out_features: int):
    """Codes [P, K, 16] fp64 times their group's scale, plus its zero (empty or None: none) -> the weight [N, K]."""
    if scales.numel():
        codes = codes * scales.double().repeat_interleave(group, dim=1)
    if zeros is not None and zeros.numel():
        codes = codes + zeros.double().repeat_interleave(group, dim=1)
    return codes.transpose(1, 2).reshape(-1, codes.shape[1])[:out_features]


QBLOCK = 32  # activation elements per int8 scale (csrc QBLOCK)


def int8_activations_why(packed: PackedWeight) -> str | None:
    """Why ``packed`` cannot run with int8 activations (None: it can)."""
    if packed.fmt:
        return None
    if packed.kind not in ("int8", "int4"):
        return f"{packed.kind} weights are not integer codes"
    if packed.in_features % QBLOCK:
        return f"K={packed.in_features} is not a multiple of {QBLOCK}"
    if packed.group % QBLOCK and packed.group != 16:
        return f"group {packed.group} is neither 16 nor a multiple of {QBLOCK}"
    return None


def to_int8_activations(packed: PackedWeight) -> PackedWeight:
    """``packed`` (int8 or int4 panels) in the integer-activation layout (module docstring); the same weights."""
    why = int8_activations_why(packed)
    if why is not None:
        raise ValueError(f"cannot run with int8 activations: {why}")
    if packed.activations == "int8":
        return packed
    data = packed.data
    count = data.shape[0]
    if packed.kind == "int8":  # [P, K, 16] -> [P, K/4, 16, 4]
        quads = data.view(count, -1, 4, PANEL).transpose(2, 3).contiguous()
    else:  # nibbles [P, K/2, 16] -> codes [P, K/8, 2, 4, 16] (k = 8i + 4h + j) -> [P, K/8, 16, 4]
        codes = torch.stack([data & 15, data >> 4], dim=2).view(count, -1, 2, 4, PANEL)
        quads = (codes[:, :, 0] | (codes[:, :, 1] << 4)).transpose(2, 3).contiguous()
    return PackedWeight(quads, packed.scales, packed.zeros, packed.out_features, packed.in_features, packed.group)


def _float_layout(packed: PackedWeight) -> PackedWeight:
    """``packed`` in the panels of float activations (the inverse of :func:`to_int8_activations`)."""
    if packed.activations == "float":
        return packed
    data = packed.data
    count = data.shape[0]
    if data.dtype == torch.int8:
        panels = data.transpose(2, 3).reshape(count, -1, PANEL)
    else:
        codes = torch.stack([data & 15, data >> 4], dim=2).transpose(3, 4)  # [P, K/8, 2, 4, 16]
        codes = codes.reshape(count, -1, PANEL)  # [P, K, 16]
        panels = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return PackedWeight(panels.contiguous(), packed.scales, packed.zeros, packed.out_features, packed.in_features,
                        packed.group)  # fmt: skip


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> int8 codes [M, K] and fp32 scales [M, K/32], in torch (the kernel's rule, written again): per
    block d = max |x| / 127, q = x / d rounded half to even (a zero block: codes 0)."""
    blocks = x.float().reshape(x.shape[0], -1, QBLOCK)  # [M, K/32, 32]
    scales = blocks.abs().amax(dim=-1) / 127  # [M, K/32]
    safe = torch.where(scales == 0, torch.ones_like(scales), scales)
    codes = torch.round(blocks / safe[..., None]).clamp(-127, 127).to(torch.int8)
    return codes.reshape(x.shape), scales


def reference_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in fp64 (what the kernel approximates in fp32): x [M, K] -> [M, N] fp64."""
    if packed.activations == "int8":  # the product of the quantized rows
        codes, scales = quantize_activations(x.reshape(-1, packed.in_features))
        x = (codes.double().view(codes.shape[0], -1, QBLOCK) * scales.double()[..., None]).reshape(codes.shape)
    out = x.double() @ dequantized(packed).t()
    return out + bias.double() if bias is not None else out


class PackedLinear(nn.Module):
    """A linear layer whose weight lives in the kernel's panels; ``forward`` runs our kernel.

    Built from a float ``nn.Linear`` or an RTN layer (:func:`pack_float`, :func:`pack_rtn`); the original
    weight is not kept (a tied output embedding stays, as the input embedding's).
    """

    def __init__(self, packed: PackedWeight, bias: torch.Tensor | None, source: str) -> None:
        super().__init__()
        cpu_ops.load()
        self.in_features, self.out_features = packed.in_features, packed.out_features
        self.group, self.kind, self.source = packed.group, packed.kind, source
        self.fmt, self.fmt_id = packed.fmt, format_id(packed)
        self.register_buffer("data", packed.data)
        self.register_buffer("scales", packed.scales)
        self.register_buffer("zeros", packed.zeros)
        self.register_buffer("bias", None if bias is None else bias.detach().float())
        self.isa = cpu_ops.best_isa()
        self.placed = False  # whether the buffers live in huge-page memory (kernels/placement.py)

    @property
    def packed(self) -> PackedWeight:
        return PackedWeight(
            self.data, self.scales, self.zeros, self.out_features, self.in_features, self.group, self.fmt
        )

    @property
    def activations(self) -> str:
        """ "int8" when the layer runs integer dot products (:attr:`PackedWeight.activations`), else "float"."""
        return self.packed.activations

    def set_packed(self, packed: PackedWeight) -> None:
        """Hold ``packed`` (the same weight in another layout, e.g. :func:`to_int8_activations`) from now on."""
        if (packed.out_features, packed.in_features) != (self.out_features, self.in_features):
            raise ValueError("set_packed takes the same weight in another layout")
        self.data, self.scales, self.zeros = packed.data, packed.scales, packed.zeros
        self.placed = False
        self.group, self.kind, self.fmt, self.fmt_id = packed.group, packed.kind, packed.fmt, format_id(packed)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs [..., K] -> [..., N] in the input dtype."""
        rows = inputs.reshape(-1, self.in_features).float()  # [M, K]
        out = torch.ops.spectoolkit.linear(
            rows, self.data, self.scales, self.zeros, self.bias, self.out_features, self.group, self.isa, self.fmt_id
        )  # [M, N] fp32
        return out.to(inputs.dtype).view(*inputs.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, kind={self.kind}, "
                f"activations={self.activations}, from={self.source}")  # fmt: skip


def fully_packed(model: nn.Module) -> bool:
    """Whether every linear of ``model`` runs our kernel (then no row of a step depends on its company)."""
    return all(
        isinstance(module, PackedLinear)
        for module in model.modules()
        if hasattr(module, "in_features") and not any(module.children())
    )
