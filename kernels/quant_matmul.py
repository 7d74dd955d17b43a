"""Weight-only int4/int8 matmul on the RTN group-wise format, dequantized in registers (Triton).

Computes ``y [M, N] = x [M, K] @ Wᵀ (+ bias)`` for the canonical weights of
:mod:`spectoolkit.kernels.rtn_format` (int4 asymmetric / int8 symmetric, group size g or per channel), for
decode (M = 1) and verify widths (M = γ + 1): fp32 accumulation, output in x's dtype.

Kernel layout (:class:`PackedWeight`, from :func:`pack_for_kernel`, inverted exactly by
:func:`unpack_from_kernel`) — K-major, so a tile of BLOCK_N output channels is one contiguous run
of memory per K step (coalesced, 16-byte vector loads along N) and the [BLOCK_K, BLOCK_N] tile
is the ``b`` operand of ``tl.dot`` as loaded:

- int4: ``qweight`` int32 [K8/8, N] (K8 = K rounded up to a multiple of 8): word (r, n) holds the
  code of column 8r + s in bits 4s..4s+3 (GPTQ's order); padding codes are never read into a sum.
- int8: ``qweight`` int8 [K, N] (the canonical codes, transposed).
- ``scales`` / ``zeros`` bf16 [G, N] (transposed, so a tile's scales are one coalesced row).

The scale is applied to a partial sum, not to each weight: a K tile never crosses a group
(BLOCK_K divides g), so ``Σ_k x_k ((u_k - 8)·s + z) = s·Σ_k x_k (u_k - 8) + z·Σ_k x_k``. The codes
(u - 8 in [-8, 7], q in [-127, 127]) are exact in bf16/fp16, so the tensor-core path sees the
canonical weights bit for bit (no rounding of the dequantized weight to the activation dtype),
and a weight element costs a shift, a mask and a convert. Per channel the scale is applied once,
after the K loop.

Exact by construction (DESIGN §7): every output element is one fixed-order reduction over K that
depends only on its own row of x and the weight. One path for every M: rows run in tiles of
:data:`BLOCK_M` = 16 (the smallest tensor-core M; a decode row is one masked tile), each program
walks the whole of K in tiles of BLOCK_K ascending — no split-K — and every tile is one ``tl.dot``
(fp16/bf16 operands on tensor cores; fp32 activations as exact fp32 ``ieee`` dots, no TF32). BLOCK_K
is a fixed function of (g, K) (:func:`block_k`), and BLOCK_N and num_warps are constants: a tile
shape can select another MMA instruction or reduction layout, so none is tuned. Only num_stages
(software pipelining of the loads; the arithmetic is unchanged) is autotuned on CUDA. A row's bits are
therefore the same whether it is computed alone (decode), in a verify window, or beside any other
rows (batching), and whatever the GPU's SM count; they differ from the reference by fp32 summation
order only. Reference: :func:`reference_quant_matmul`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from spectoolkit.kernels.rtn_format import (
    QuantizedWeight,
    RtnConfig,
    dequantize_weight,
    pack_int4,
    quantize_weight,
    unpack_int4,
)
from spectoolkit.kernels.runtime import BenchCase, interpreting, require_launchable

ACTIVATION_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_M = 16  # rows per tile, for every M: a row's arithmetic never depends on how many rows came with it
BLOCK_N = 32  # output channels per tile: narrow, since without split-K the N tiles alone fill the GPU
NUM_WARPS = 4
BLOCK_K_CHOICES = (128, 64, 32)  # every group size the kernel takes is a multiple of 32
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int64)  # nibble s of a word sits at bits 4s..4s+3


@dataclass
class PackedWeight:
    """The kernel layout of a :class:`QuantizedWeight` (module docstring); N, K as in the canonical one."""

    qweight: torch.Tensor  # int4: int32 [ceil(K/8), N], 8 codes per word along K; int8: int8 [K, N]
    scales: torch.Tensor  # bf16 [G, N]
    zeros: torch.Tensor | None  # int4: bf16 [G, N]; int8: None
    group_size: int  # g (K for per-channel)
    bits: int  # 4 or 8
    in_features: int  # K (int4 words may pad it up to a multiple of 8)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of the float weight."""
        return self.qweight.shape[1], self.in_features

    @property
    def nbytes(self) -> int:
        """Bytes of the packed codes, scales and zeros (what one call streams from memory)."""
        tensors = [self.qweight, self.scales] + ([] if self.zeros is None else [self.zeros])
        return sum(t.numel() * t.element_size() for t in tensors)


def unsupported_reason(q: QuantizedWeight | PackedWeight) -> str | None:
    """Why the kernel cannot run this weight, or None: grouped g must be a multiple of 32 dividing K."""
    num_cols = q.shape[1]
    if q.bits not in (4, 8):
        return f"bits must be 4 or 8, got {q.bits}"
    if q.group_size == num_cols:
        return None
    if q.group_size % 32 or num_cols % q.group_size:
        return f"group_size must be K ({num_cols}, per channel) or a multiple of 32 dividing K, got {q.group_size}"
    return None


def pack_for_kernel(q: QuantizedWeight) -> PackedWeight:
    """Canonical weight -> kernel layout (module docstring). Raises ValueError if the kernel cannot take it."""
    reason = unsupported_reason(q)
    if reason is not None:
        raise ValueError(f"quant_matmul: {reason}")
    zeros = None if q.zeros is None else q.zeros.t().contiguous()  # [G, N]
    scales = q.scales.t().contiguous()  # [G, N]
    num_cols = q.shape[1]
    if q.bits == 8:
        return PackedWeight(q.qweight.t().contiguous(), scales, None, q.group_size, 8, num_cols)
    codes = unpack_int4(q.qweight).to(torch.int64)  # [N, K]
    codes = F.pad(codes, (0, -num_cols % 8), value=8)  # [N, K8]
    words = (codes.view(codes.shape[0], -1, 8) << _SHIFTS.to(codes.device)).sum(-1)  # [N, K8/8] in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # same bits, as int32
    return PackedWeight(words.t().contiguous(), scales, zeros, q.group_size, 4, num_cols)


def unpack_from_kernel(p: PackedWeight) -> QuantizedWeight:
    """Exact inverse of :func:`pack_for_kernel`: kernel layout -> canonical weight."""
    zeros = None if p.zeros is None else p.zeros.t().contiguous()  # [N, G]
    scales = p.scales.t().contiguous()  # [N, G]
    if p.bits == 8:
        return QuantizedWeight(p.qweight.t().contiguous(), scales, None, p.group_size, 8)
    words = p.qweight.t().to(torch.int64) & 0xFFFFFFFF  # [N, K8/8]
    codes = (words[..., None] >> _SHIFTS.to(words.device)) & 15  # [N, K8/8, 8]
    codes = codes.reshape(words.shape[0], -1)[:, : p.in_features]  # [N, K]
    return QuantizedWeight(pack_int4(codes), scales, zeros, p.group_size, 4)


@triton.jit
def _load_codes(w_ptr, offs_k, offs_n, mask, N, BITS: tl.constexpr):
    """[BLOCK_K, BLOCK_N] centered codes as fp32: u - 8 (int4) or q (int8)."""
    if BITS == 4:
        # Eight rows of the tile read the same word (an L1 hit after the first); each keeps its nibble.
        words = tl.load(w_ptr + (offs_k[:, None] // 8) * N + offs_n[None, :], mask=mask, other=0)
        codes = (words >> ((offs_k[:, None] % 8) * 4)) & 15
        return codes.to(tl.float32) - 8.0
    else:
        return tl.load(w_ptr + offs_k[:, None] * N + offs_n[None, :], mask=mask, other=0).to(tl.float32)


@triton.jit
def _tile_product(x, codes, DOT_IEEE: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] @ codes [BLOCK_K, BLOCK_N] -> fp32 [BLOCK_M, BLOCK_N]."""
    if DOT_IEEE:  # fp32 operands, no TF32 rounding (see quant_matmul)
        return tl.dot(x.to(tl.float32), codes, input_precision="ieee")
    else:  # the codes are exact in fp16/bf16
        return tl.dot(x, codes.to(x.dtype))


@triton.jit
def _quant_matmul_kernel(
    x_ptr,  # [M, K] fp16/bf16/fp32, unit stride along K
    w_ptr,  # int4: int32 [K8/8, N]; int8: int8 [K, N]
    scales_ptr,  # bf16 [G, N]
    zeros_ptr,  # bf16 [G, N] (int4; unused for int8)
    bias_ptr,  # [N] (unused without bias)
    y_ptr,  # [M, N] in x's dtype
    M,
    N,
    K,
    group_size,
    stride_xm,
    stride_ym,
    BITS: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Program (N tile, M tile): the whole of K for BLOCK_M rows × BLOCK_N channels, K tiles in ascending order."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # Σ x·w (per channel: Σ x·code)
    x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)  # per channel int4: Σ x, for the zero term
    for k0 in range(0, K, BLOCK_K):  # a tile never straddles a group (BLOCK_K | g)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        codes = _load_codes(w_ptr, offs_k, offs_n, mask_k[:, None] & mask_n[None, :], N, BITS)
        part = _tile_product(x, codes, DOT_IEEE)  # [BLOCK_M, BLOCK_N]
        if PER_CHANNEL:
            acc += part
            if BITS == 4:
                x_sum += tl.sum(x.to(tl.float32), axis=1)
        else:
            group = k0 // group_size
            scale = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
            acc += part * scale[None, :]
            if BITS == 4:
                zero = tl.load(zeros_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
                acc += tl.sum(x.to(tl.float32), axis=1)[:, None] * zero[None, :]
    if PER_CHANNEL:
        acc *= tl.load(scales_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        if BITS == 4:
            acc += x_sum[:, None] * tl.load(zeros_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)


def block_k(group_size: int, num_cols: int) -> int:
    """The K tile of a weight: the largest of :data:`BLOCK_K_CHOICES` dividing g (128 per channel) — fixed by the
    weight alone, so the order of the K reduction is too."""
    if group_size == num_cols:
        return BLOCK_K_CHOICES[0]
    return next(b for b in BLOCK_K_CHOICES if group_size % b == 0)


def tile_config(group_size: int, num_cols: int) -> dict[str, int]:
    """The one tiling of a weight's calls, whatever M: ``{"BLOCK_M", "BLOCK_N", "BLOCK_K"}``."""
    return {"BLOCK_M": BLOCK_M, "BLOCK_N": BLOCK_N, "BLOCK_K": block_k(group_size, num_cols)}


# num_stages only: it pipelines the loads and leaves every sum as it is (tiles and warps are fixed above).
AUTOTUNE_CONFIGS = [triton.Config({}, num_warps=NUM_WARPS, num_stages=stages) for stages in (2, 3, 4)]
_autotuned_kernel = triton.autotune(
    AUTOTUNE_CONFIGS, key=["N", "K", "group_size", "BITS", "PER_CHANNEL", "HAS_BIAS", "DOT_IEEE"]
)(_quant_matmul_kernel)


def _check(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> None:
    """Raise ValueError for inputs the kernel cannot take (shape, dtype, device, layout)."""
    num_rows, num_cols = weight.shape
    reason = unsupported_reason(weight)
    if reason is not None:
        raise ValueError(f"quant_matmul: {reason}")
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"quant_matmul: activations must be fp16, bf16 or fp32, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] != num_cols:
        raise ValueError(f"quant_matmul: x must be [..., K={num_cols}], got {tuple(x.shape)}")
    word_rows, word_dtype = (-(-num_cols // 8), torch.int32) if weight.bits == 4 else (num_cols, torch.int8)
    if weight.qweight.dtype != word_dtype or weight.qweight.shape[0] != word_rows or not weight.qweight.is_contiguous():
        raise ValueError(f"quant_matmul: int{weight.bits} qweight must be contiguous {word_dtype} [{word_rows}, N]")
    groups = num_cols // weight.group_size
    for name, table in (("scales", weight.scales), ("zeros", weight.zeros)):
        if table is None and (name == "scales" or weight.bits == 4):
            raise ValueError(f"quant_matmul: int{weight.bits} needs {name}")
        if table is not None and (table.shape != (groups, num_rows) or not table.is_contiguous()):
            raise ValueError(f"quant_matmul: {name} must be contiguous [G={groups}, N={num_rows}]")
    if bias is not None and bias.shape != (num_rows,):
        raise ValueError(f"quant_matmul: bias must be [N={num_rows}], got {tuple(bias.shape)}")
    tensors = [x, weight.qweight, weight.scales] + [t for t in (weight.zeros, bias) if t is not None]
    if any(t.device != x.device for t in tensors):
        raise ValueError(f"quant_matmul: all tensors must be on one device, got {[str(t.device) for t in tensors]}")
    require_launchable(x)


def quant_matmul(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] fp16/bf16/fp32 @ dequantized weightᵀ (+ bias [N]) -> [..., N] in x's dtype.

    Row-invariant: each output row's bits depend on that row of x and the weight only (module docstring).
    """
    _check(x, weight, bias)
    num_rows, num_cols = weight.shape
    rows = x.reshape(-1, num_cols)  # [M, K]
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, num_rows, dtype=x.dtype, device=x.device)  # [M, N]
    if m == 0:
        return out.view(*x.shape[:-1], num_rows)
    args = (
        rows,
        weight.qweight,
        weight.scales,
        weight.scales if weight.zeros is None else weight.zeros,
        out if bias is None else bias,
        out,
        m,
        num_rows,
        num_cols,
        weight.group_size,
        rows.stride(0),
        out.stride(0),
    )
    flags = {
        "BITS": weight.bits,
        "PER_CHANNEL": weight.group_size == num_cols,
        "HAS_BIAS": bias is not None,
        # fp32: no TF32 rounding of x. Under the interpreter bf16 too: its bf16 tl.dot returns garbage
        # (triton 3.9); an fp32 dot of the same exact operands gives the same sums.
        "DOT_IEEE": x.dtype == torch.float32 or (interpreting() and x.dtype == torch.bfloat16),
    }
    tiles = tile_config(weight.group_size, num_cols)
    grid = (triton.cdiv(num_rows, BLOCK_N), triton.cdiv(m, BLOCK_M))
    if interpreting():  # pipelining means nothing to the interpreter: no tuning runs
        _quant_matmul_kernel[grid](*args, **flags, **tiles, num_warps=NUM_WARPS)
    else:
        _autotuned_kernel[grid](*args, **flags, **tiles)
    return out.view(*x.shape[:-1], num_rows)


def reference_quant_matmul(x: torch.Tensor, q: QuantizedWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] -> [..., N] in x's dtype: dequantize to fp32, ``F.linear`` in fp32, round once."""
    return F.linear(x.float(), dequantize_weight(q), None if bias is None else bias.float()).to(x.dtype)


LLAMA_8B_SHAPES = ((4096, 4096, "q/o"), (1024, 4096, "k/v"), (14336, 4096, "gate/up"), (4096, 14336, "down"))  # (N, K)


def bench_cases(device: torch.device) -> list[BenchCase]:
    """Llama-3.1-8B linears, int4 g=128 and int8 per channel, M = 1 (decode) and 5 (γ = 4 verify), bf16.

    ``run_torch`` is what a user runs without the kernel: a bf16 copy of the dequantized weight, kept
    in memory, and ``F.linear``. ``bytes_moved``: packed codes + scales/zeros + x + y.
    """
    gen = torch.Generator(device=device).manual_seed(0)
    cases = []
    for num_rows, num_cols, name in LLAMA_8B_SHAPES:
        weight = torch.randn(num_rows, num_cols, generator=gen, device=device) * 0.02  # [N, K]
        for cfg, label in ((RtnConfig(4, 128), "int4 g=128"), (RtnConfig(8, -1), "int8 per-channel")):
            q = quantize_weight(weight, cfg)
            packed = pack_for_kernel(q)
            dense = dequantize_weight(q).to(torch.bfloat16)  # [N, K], the torch path's resident weight
            for m in (1, 5):
                x = torch.randn(m, num_cols, generator=gen, device=device).to(torch.bfloat16)  # [M, K]
                cases.append(
                    BenchCase(
                        kernel=f"{label} {'gemv' if m == 1 else 'gemm'}",
                        shape=f"{name} M={m} N={num_rows} K={num_cols}",
                        bytes_moved=packed.nbytes + x.numel() * 2 + m * num_rows * 2,
                        run_triton=lambda x=x, packed=packed: quant_matmul(x, packed),
                        run_torch=lambda x=x, dense=dense: F.linear(x, dense),
                    )
                )
        del weight
    return cases
