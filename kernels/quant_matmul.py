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

Two paths, picked by the config's BLOCK_M: M = 1 (decode) is a GEMV — an FMA tile reduced over K,
no tensor cores; M > 1 uses ``tl.dot`` (BLOCK_M = 16 up to M = 16, wider for prefill). Both split K
over SPLIT_K programs when N alone gives too few tiles to fill the GPU; the partial sums are then
added in a fixed order by the last program of each tile to arrive (a per-tile arrival counter,
reset by that program), so results are deterministic and the call is one launch. The counters are
shared per device: calls on two concurrent streams of one device could collide. The M = 1 and
M > 1 paths sum in different orders, so a row's output may differ in the last bit between a decode
and a verify call (not batch-invariant). Reference: :func:`reference_quant_matmul`.
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
BLOCK_K_CHOICES = (256, 128, 64, 32)  # every group size the kernel takes is a multiple of 32
_MAX_SPLIT_K = 8
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
def _tile_product(x, codes, BLOCK_M: tl.constexpr, DOT_IEEE: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] @ codes [BLOCK_K, BLOCK_N] -> fp32 [BLOCK_M, BLOCK_N]."""
    if BLOCK_M == 1:  # GEMV: FMAs reduced over K, no tensor-core padding of M
        return tl.sum(tl.trans(x.to(tl.float32)) * codes, axis=0, keep_dims=True)
    elif DOT_IEEE:  # fp32 operands, no TF32 rounding (see quant_matmul)
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
    partial_ptr,  # fp32 [SPLIT_K, M, N] scratch (SPLIT_K > 1)
    counter_ptr,  # int32 [>= tiles], zero between calls (SPLIT_K > 1)
    M,
    N,
    K,
    group_size,
    m_bucket,  # autotune key only: M rounded up to a power of two, capped (prefill lengths share a tuning)
    stride_xm,
    stride_ym,
    BITS: tl.constexpr,
    PER_CHANNEL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    DOT_IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_n = tl.max_contiguous(tl.multiple_of(offs_n, BLOCK_N), BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    # This program's share of K: whole BLOCK_K tiles, so a tile never straddles a group (BLOCK_K | g).
    k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K) * BLOCK_K
    k_begin = pid_k * k_per_split
    k_end = tl.minimum(k_begin + k_per_split, K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # Σ x·w (per channel: Σ x·code)
    x_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)  # per channel int4: Σ x, for the zero term
    for k0 in range(k_begin, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0
        )
        codes = _load_codes(w_ptr, offs_k, offs_n, mask_k[:, None] & mask_n[None, :], N, BITS)
        part = _tile_product(x, codes, BLOCK_M, DOT_IEEE)  # [BLOCK_M, BLOCK_N]
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
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :] * (pid_k == 0)
    if SPLIT_K == 1:
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        _reduce_splits(acc, partial_ptr, counter_ptr, y_ptr, offs_m, offs_n, mask, M, N, stride_ym, SPLIT_K)


@triton.jit
def _reduce_splits(acc, partial_ptr, counter_ptr, y_ptr, offs_m, offs_n, mask, M, N, stride_ym, SPLIT_K: tl.constexpr):
    """Park this split's sum; the last split of the tile to arrive adds all of them in split order."""
    tl.store(partial_ptr + (tl.program_id(2) * M + offs_m[:, None]) * N + offs_n[None, :], acc, mask=mask)
    tl.debug_barrier()  # every thread's partial is written before the (release) arrival below
    tile = tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
    arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
    if arrived == SPLIT_K - 1:
        total = tl.zeros(acc.shape, dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):  # fixed order: the sum does not depend on arrival order
            offs = (split * M + offs_m[:, None]) * N + offs_n[None, :]
            total += tl.load(partial_ptr + offs, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :], total.to(y_ptr.dtype.element_ty), mask=mask)
        tl.atomic_xchg(counter_ptr + tile, 0)  # ready for the next call


def _config(block_m: int, block_n: int, block_k: int, split_k: int, warps: int, stages: int) -> triton.Config:
    meta = {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k}
    return triton.Config(meta, num_warps=warps, num_stages=stages)


# GEMV (M = 1): narrow N tiles and split K so that even N = 1024 spreads over every SM; GEMM (M > 1):
# BLOCK_M = 16 (the smallest tensor-core M). Pruned per call to BLOCK_K | g (see _prune_configs).
AUTOTUNE_CONFIGS = (
    [
        _config(1, block_n, block_k, split_k, warps, stages)
        for block_n, block_k, warps in (
            (32, 256, 4),
            (64, 128, 4),
            (64, 256, 4),
            (128, 128, 4),
            (128, 64, 4),
            (256, 32, 4),
        )
        for split_k in (1, 2, 4, 8)
        for stages in (2, 4)
    ]
    + [
        _config(16, block_n, block_k, split_k, warps, stages)
        for block_n, block_k, warps in ((32, 128, 4), (64, 64, 4), (64, 128, 4), (128, 64, 4), (128, 32, 4))
        for split_k in (1, 2, 4)
        for stages in (3, 4)
    ]
    + [  # prefill-sized M: wider M tiles, no split
        _config(block_m, block_n, block_k, 1, warps, 3)
        for block_m, block_n, block_k, warps in ((32, 64, 64, 4), (64, 64, 32, 4), (64, 128, 32, 8), (64, 64, 64, 4))
    ]
)


def _prune_configs(configs: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Keep the configs for this M (GEMV or GEMM) whose BLOCK_K tiles fit inside one group."""
    m = named_args["M"]
    block_ms = (1,) if m == 1 else (16,) if m <= 16 else (16, 32, 64)
    group_size, per_channel = named_args["group_size"], kwargs.get("PER_CHANNEL", named_args.get("PER_CHANNEL"))
    return [
        c for c in configs if c.kwargs["BLOCK_M"] in block_ms and (per_channel or group_size % c.kwargs["BLOCK_K"] == 0)
    ]


_autotuned_kernel = triton.autotune(
    AUTOTUNE_CONFIGS,
    key=["m_bucket", "N", "K", "group_size", "BITS", "PER_CHANNEL", "DOT_IEEE"],
    prune_configs_by={"early_config_prune": _prune_configs},
)(_quant_matmul_kernel)


def interpreter_config(m: int, group_size: int, num_cols: int) -> dict:
    """The one config launched under the interpreter: big tiles (fewer interpreted steps), no split."""
    block_k = next(b for b in BLOCK_K_CHOICES if group_size % b == 0 or group_size == num_cols)
    return {"BLOCK_M": 1 if m == 1 else 16, "BLOCK_N": 64, "BLOCK_K": min(block_k, 128), "SPLIT_K": 1}


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _arrival_counters(device: torch.device, size: int) -> torch.Tensor:
    """int32 [>= size] zeros, kept per device: the kernel resets each counter it uses."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < size:
        counters = _COUNTERS[device] = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
    return counters


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


def quant_matmul(
    x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None, *, config: dict | None = None
) -> torch.Tensor:
    """x [..., K] fp16/bf16/fp32 @ dequantized weightᵀ (+ bias [N]) -> [..., N] in x's dtype.

    ``config`` (meta-parameters, e.g. ``{"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2}``)
    pins one launch instead of the autotuned choice (CUDA) or :func:`interpreter_config` (interpreter).
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
        torch.empty(_MAX_SPLIT_K, m, num_rows, dtype=torch.float32, device=x.device),  # [SPLIT_K, M, N]
        _arrival_counters(x.device, m * triton.cdiv(num_rows, 16)),
        m,
        num_rows,
        num_cols,
        weight.group_size,
        min(triton.next_power_of_2(m), 256),
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
    if config is None and not interpreting():
        grid = lambda meta: (triton.cdiv(num_rows, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]), meta["SPLIT_K"])  # noqa: E731
        _autotuned_kernel[grid](*args, **flags)
    else:
        meta = config or interpreter_config(m, weight.group_size, num_cols)
        if meta["SPLIT_K"] > _MAX_SPLIT_K:
            raise ValueError(f"quant_matmul: SPLIT_K must be <= {_MAX_SPLIT_K}, got {meta['SPLIT_K']}")
        grid = (triton.cdiv(num_rows, meta["BLOCK_N"]), triton.cdiv(m, meta["BLOCK_M"]), meta["SPLIT_K"])
        _quant_matmul_kernel[grid](*args, **flags, **meta)
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
