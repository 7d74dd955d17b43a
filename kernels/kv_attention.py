"""Decode / verify attention straight from a quantized KV cache (flash-decoding, GQA-packed).

Queries q [B, H, Q, D] with Q = 1 (a decode step) or Q = γ+1 (a verify window). Request b has
``L_b`` positions before the window (committed prefix plus the window's causal predecessors), so the
window occupies slots [L_b, L_b + Q) of its cache and query i sees KV positions [0, L_b + i].

One program handles one (request, KV head, KV split, row block): the ``n_rep = H / H_kv`` query heads
of a KV head and the Q positions are packed as ``n_rep * Q`` rows, so each KV block is read once per
KV head. K and V are dequantized in registers from the stored codes and per-token scales of
:mod:`spectoolkit.kvcache.formats` (fp8 / int8 per row; int4 per group of G = gcd(32, D) with a zero,
two codes a byte, low nibble first); fp16/bf16/fp32 KV go through the same kernel unscaled. Scores
and the online softmax are fp32; P·V accumulates in fp32; the output is in q's dtype. Long contexts
are split over several programs (flash-decoding) and merged by a second small kernel.

The reference (:func:`kv_attention_reference`) dequantizes with formats.py and runs fp32 SDPA with the
causal-window mask: the path the pipeline runs without a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from spectoolkit.kvcache.formats import KV_FORMATS, int4_group_size

from .runtime import BenchCase, interpreting, require_launchable

_FLOAT, _INT8, _FP8, _INT4 = 0, 1, 2, 3
_FORMAT_CODES = {"bf16": _FLOAT, "fp16": _FLOAT, "fp32": _FLOAT, "int8": _INT8, "fp8": _FP8, "int4": _INT4}
_FLOAT_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_QUERY_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}
_SPLIT_ALIGN = 256  # KV split lengths are multiples of every BLOCK_N in the configs
_MAX_BLOCK_M = 64
_LOG2E = 1.4426950408889634


# ---- kernels --------------------------------------------------------------------------------------------


@triton.jit
def _load_kv_block(
    data_ptr, scale_ptr, zero_ptr, s_n, s_sc, offs_n, offs_d, n_ok,
    FORMAT: tl.constexpr, G: tl.constexpr, DOT_DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """Codes of one KV block -> ([BLOCK_N, D] in DOT_DTYPE, per-token scale [BLOCK_N] to apply after).

    int8 / fp8 keep their codes (exact in fp16/bf16) and return the row scale for the caller to apply
    after the dot; int4 and float formats return the dequantized values and a unit scale.
    """
    ok = n_ok[:, None]
    row_scale = tl.full(offs_n.shape, 1.0, tl.float32)
    if FORMAT == 3:  # each byte and each group's scale/zero is loaded once, then expanded in registers
        packed = tl.load(data_ptr + offs_n[:, None] * s_n + tl.arange(0, D // 2)[None, :], mask=ok, other=0)
        codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (BLOCK_N, D)).to(tl.float32)  # low nibble first
        group = offs_n[:, None] * s_sc + tl.arange(0, D // G)[None, :]  # [BLOCK_N, D/G]
        scale = _per_element(tl.load(scale_ptr + group, mask=ok, other=0.0), BLOCK_N, D, G)
        zero = _per_element(tl.load(zero_ptr + group, mask=ok, other=0.0), BLOCK_N, D, G)
        values = (codes * scale + zero).to(DOT_DTYPE)
    else:
        values = tl.load(data_ptr + offs_n[:, None] * s_n + offs_d[None, :], mask=ok, other=0.0)
        values = values.to(tl.float32).to(DOT_DTYPE)  # int8 / fp8 codes are exact in fp16 and bf16
        if FORMAT != 0:
            row_scale = tl.load(scale_ptr + offs_n * s_sc, mask=n_ok, other=0.0)
    return values, row_scale  # one return: the compiler traces every return of a jit function


@triton.jit
def _per_element(per_group, BLOCK_N: tl.constexpr, D: tl.constexpr, G: tl.constexpr):
    """[BLOCK_N, D/G] -> [BLOCK_N, D]: each group's value repeated over its G elements."""
    return tl.reshape(tl.broadcast_to(per_group[:, :, None], (BLOCK_N, D // G, G)), (BLOCK_N, D))


@triton.jit
def _dot(a, b, DOT_DTYPE: tl.constexpr, FP32_DOT: tl.constexpr):
    """a @ b with fp32 accumulation, operands rounded to DOT_DTYPE.

    FP32_DOT: operands rounded to DOT_DTYPE, then an exact fp32 dot: for fp32 queries (no tf32), and for
    bf16 under the interpreter, whose numpy dot has no bf16 (a bf16 product is exact in fp32, so this is
    the tensor-core result up to summation order).
    """
    if FP32_DOT:
        return tl.dot(a.to(DOT_DTYPE).to(tl.float32), b.to(DOT_DTYPE).to(tl.float32), input_precision="ieee")
    return tl.dot(a.to(DOT_DTYPE), b.to(DOT_DTYPE))


@triton.jit
def _kv_attention_kernel(
    q_ptr, out_ptr, part_acc_ptr, part_ml_ptr, prefix_lens_ptr, mask_ptr, s_mb, s_mq,
    kd_ptr, ks_ptr, kz_ptr, vd_ptr, vs_ptr, vz_ptr,
    s_qb, s_qh, s_qq, s_ob, s_oh, s_oq,
    s_kb, s_kh, s_kn, s_ksb, s_ksh, s_ksn,
    s_vb, s_vh, s_vn, s_vsb, s_vsh, s_vsn,
    qk_scale, H_KV, split_len,
    Q: tl.constexpr, N_REP: tl.constexpr, D: tl.constexpr, G: tl.constexpr, FORMAT: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT_DTYPE: tl.constexpr, FP32_DOT: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program (b * H_KV + kv_head, split, row block): online softmax over its KV slots, in fp32.

    Rows r = head_in_group * Q + i. With NUM_SPLITS == 1 it writes the normalized output [B, H, Q, D];
    otherwise the unnormalized accumulator and (running max, denominator) of its split for the merge.
    """
    pid_bh, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, kv_head = pid_bh // H_KV, pid_bh % H_KV
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    row_ok = rows < N_REP * Q
    head, pos = kv_head * N_REP + rows // Q, rows % Q
    offs_d = tl.arange(0, D)
    q_off = b * s_qb + head[:, None] * s_qh + pos[:, None] * s_qq + offs_d[None, :]
    q = tl.load(q_ptr + q_off, mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]

    prefix = tl.load(prefix_lens_ptr + b)
    last_visible = prefix + pos  # [BLOCK_M]: row sees slots [0, prefix + i]
    lo = split * split_len
    hi = tl.minimum(lo + split_len, prefix + Q)
    k_base, v_base = kd_ptr + b * s_kb + kv_head * s_kh, vd_ptr + b * s_vb + kv_head * s_vh
    ks_off, vs_off = b * s_ksb + kv_head * s_ksh, b * s_vsb + kv_head * s_vsh

    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)  # finite: a fully masked block leaves exp2(0) = 1
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        n_ok = offs_n < hi
        k, k_scale = _load_kv_block(
            k_base,
            ks_ptr + ks_off,
            kz_ptr + ks_off,
            s_kn,
            s_ksn,
            offs_n,
            offs_d,
            n_ok,
            FORMAT,
            G,
            DOT_DTYPE,
            BLOCK_N,
            D,
        )
        scores = _dot(q, tl.trans(k), DOT_DTYPE, FP32_DOT)  # [BLOCK_M, BLOCK_N] fp32
        scores = scores * (k_scale * qk_scale)[None, :]
        visible = offs_n[None, :] <= last_visible[:, None]
        if HAS_MASK:  # an extra key mask (e.g. padding), slot-aligned: [B|1, Q, slots] bytes
            mask_off = b * s_mb + pos[:, None] * s_mq + offs_n[None, :]
            visible &= tl.load(mask_ptr + mask_off, mask=row_ok[:, None] & n_ok[None, :], other=0) != 0
        scores = tl.where(visible & n_ok[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v, v_scale = _load_kv_block(
            v_base,
            vs_ptr + vs_off,
            vz_ptr + vs_off,
            s_vn,
            s_vsn,
            offs_n,
            offs_d,
            n_ok,
            FORMAT,
            G,
            DOT_DTYPE,
            BLOCK_N,
            D,
        )
        v = (v.to(tl.float32) * v_scale[:, None]).to(DOT_DTYPE)  # V is dequantized before the dot
        acc = acc * alpha[:, None] + _dot(p, v, DOT_DTYPE, FP32_DOT)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        out_off = b * s_ob + head[:, None] * s_oh + pos[:, None] * s_oq + offs_d[None, :]
        tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (pid_bh * NUM_SPLITS + split) * (N_REP * Q) + rows  # [BLOCK_M] row index into partials
        tl.store(part_acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr, s_ob, s_oh, s_oq, H_KV,
    Q: tl.constexpr, N_REP: tl.constexpr, D: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr,
):  # fmt: skip
    """Program (b * H_KV + kv_head, row): combine the splits' (acc, max, denominator) into one output row."""
    pid_bh, row = tl.program_id(0), tl.program_id(1)
    b, kv_head = pid_bh // H_KV, pid_bh % H_KV
    splits = tl.arange(0, SPLITS_P2)
    split_ok = splits < NUM_SPLITS
    part = (pid_bh * NUM_SPLITS + splits) * (N_REP * Q) + row  # [SPLITS_P2]
    m_s = tl.load(part_ml_ptr + part * 2, mask=split_ok, other=-1.0e30)
    l_s = tl.load(part_ml_ptr + part * 2 + 1, mask=split_ok, other=0.0)
    offs_d = tl.arange(0, D)
    acc_s = tl.load(part_acc_ptr + part[:, None] * D + offs_d[None, :], mask=split_ok[:, None], other=0.0)
    weight = tl.exp2(m_s - tl.max(m_s, 0))  # [SPLITS_P2]
    denom = tl.sum(l_s * weight, 0)
    out = tl.sum(acc_s * weight[:, None], 0) / tl.where(denom > 0, denom, 1.0)  # [D]; a fully masked row gives 0
    head, pos = kv_head * N_REP + row // Q, row % Q
    tl.store(out_ptr + b * s_ob + head * s_oh + pos * s_oq + offs_d, out.to(out_ptr.dtype.element_ty))


def _autotune_configs() -> list[triton.Config]:
    """BLOCK_N × warps × stages tried on CUDA (BLOCK_N divides _SPLIT_ALIGN)."""
    return [
        triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages)
        for block_n in (32, 64, 128)
        for warps in (4, 8)
        for stages in (2, 3)
    ]


_kv_attention_autotuned = triton.autotune(
    configs=_autotune_configs(), key=["Q", "N_REP", "D", "FORMAT", "DOT_DTYPE", "BLOCK_M"]
)(_kv_attention_kernel)
_INTERPRETER_CONFIG = {"BLOCK_N": 64, "num_warps": 4}  # one fixed config keeps interpreted tests fast


# ---- launch wrapper ----------------------------------------------------------------------------------


def kernel_supports(head_dim: int, fmt: str, device: torch.device | None = None) -> bool:
    """Whether :func:`kv_attention` takes this head_dim (a power of two in [16, 256]) and format on ``device``.

    fp8 (e4m3) needs a CUDA device of compute capability 8.9 or newer (Triton has no e4m3 before Ada).
    """
    shape_ok = fmt in _FORMAT_CODES and 16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0
    if fmt == "fp8" and device is not None and torch.device(device).type == "cuda":
        return shape_ok and torch.cuda.get_device_capability(device) >= (8, 9)
    return shape_ok


def expected_fields(fmt: str, head_dim: int) -> dict[str, tuple[int, torch.dtype]]:
    """Field name -> (last-dim width, dtype) that ``fmt`` stores per (token, kv-head) row."""
    if fmt in _FLOAT_DTYPES:
        return {"data": (head_dim, _FLOAT_DTYPES[fmt])}
    return KV_FORMATS[fmt].fields(head_dim)


def kv_attention(
    query: torch.Tensor,
    key_fields: dict[str, torch.Tensor],
    value_fields: dict[str, torch.Tensor],
    fmt: str,
    prefix_lens: int | Sequence[int] | torch.Tensor,
    softmax_scale: float | None = None,
    *,
    num_splits: int | None = None,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query [B, H, Q, D] over stored KV fields [B, H_kv, cap, width] -> [B, H, Q, D] in q's dtype.

    ``key_fields``/``value_fields``: the stored fields of ``fmt`` (``data``, ``scale``[, ``zero``] as laid out
    in :mod:`spectoolkit.kvcache.formats`; ``{"data": ...}`` for bf16/fp16/fp32). ``prefix_lens``: L_b, the
    positions before the window per request (an int for all); query i of request b sees slots
    [0, L_b + i]. ``softmax_scale`` defaults to D**-0.5; ``num_splits`` overrides the KV split count.
    ``key_mask``: optional bool [B|1, Q, N] (N ≥ max L_b + Q, slot n at index n) further restricting what
    query i sees, e.g. left padding; a row that sees nothing gets zeros.
    """
    head_dim = _check_inputs(query, key_fields, value_fields, fmt)
    batch, num_heads, q_len, _ = query.shape
    kv_heads, capacity = key_fields["data"].shape[1], key_fields["data"].shape[2]
    prefix, max_prefix = _prefix_tensor(prefix_lens, batch, query.device)
    if max_prefix + q_len > capacity:
        raise ValueError(f"prefix length {max_prefix} + {q_len} queries exceeds the KV capacity {capacity}")
    n_rep = num_heads // kv_heads
    block_m = min(max(16, triton.next_power_of_2(n_rep * q_len)), _MAX_BLOCK_M)
    m_blocks = triton.cdiv(n_rep * q_len, block_m)
    splits, split_len = _plan_splits(max_prefix + q_len, batch * kv_heads * m_blocks, query.device, num_splits)
    out = torch.empty_like(query, memory_format=torch.contiguous_format)  # [B, H, Q, D]
    rows = batch * kv_heads * splits * n_rep * q_len
    part_acc = query.new_empty((rows if splits > 1 else 1, head_dim), dtype=torch.float32)
    part_ml = query.new_empty((rows if splits > 1 else 1, 2), dtype=torch.float32)
    keys, values = _with_defaults(key_fields), _with_defaults(value_fields)
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = int4_group_size(head_dim) if fmt == "int4" else 1
    launch = _kv_attention_kernel if interpreting() else _kv_attention_autotuned
    extra = _INTERPRETER_CONFIG if interpreting() else {}
    mask = _check_mask(key_mask, batch, q_len, max_prefix + q_len, query.device)  # [B|1, Q, N] uint8
    launch[(batch * kv_heads, splits, m_blocks)](
        query, out, part_acc, part_ml, prefix, mask, mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(1),
        keys["data"], keys["scale"], keys["zero"], values["data"], values["scale"], values["zero"],
        *query.stride()[:3], *out.stride()[:3],
        *_strides(keys), *_strides(values),
        scale * _LOG2E, kv_heads, split_len,
        Q=q_len, N_REP=n_rep, D=head_dim, G=group, FORMAT=_FORMAT_CODES[fmt],
        NUM_SPLITS=splits, DOT_DTYPE=_DOT_DTYPES[query.dtype], FP32_DOT=_fp32_dot(query.dtype),
        HAS_MASK=key_mask is not None, BLOCK_M=block_m, **extra,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(batch * kv_heads, n_rep * q_len)](
            part_acc, part_ml, out, out.stride(0), out.stride(1), out.stride(2), kv_heads,
            Q=q_len, N_REP=n_rep, D=head_dim, NUM_SPLITS=splits, SPLITS_P2=triton.next_power_of_2(splits),
        )  # fmt: skip
    return out


def _fp32_dot(dtype: torch.dtype) -> bool:
    """Exact fp32 dots for fp32 queries, and for bf16 ones under the interpreter (see :func:`_dot`)."""
    return dtype == torch.float32 or (dtype == torch.bfloat16 and interpreting())


def _check_inputs(query, key_fields, value_fields, fmt: str) -> int:
    """Validate shapes, dtypes, devices and layouts; return D."""
    if fmt not in _FORMAT_CODES:
        raise ValueError(f"unknown KV format {fmt!r}; choose one of {', '.join(_FORMAT_CODES)}")
    if query.dim() != 4 or query.dtype not in _QUERY_DTYPES:
        raise ValueError(f"query must be [B, H, Q, D] fp16/bf16/fp32, got {tuple(query.shape)} {query.dtype}")
    batch, num_heads, _, head_dim = query.shape
    if not kernel_supports(head_dim, fmt):
        raise ValueError(f"head_dim must be a power of two in [16, 256], got {head_dim}")
    if not kernel_supports(head_dim, fmt, query.device):
        raise ValueError(f"{fmt} KV needs a GPU of compute capability 8.9 or newer ({query.device} is older)")
    if query.stride(-1) != 1:
        raise ValueError("query must be contiguous in its last dimension")
    require_launchable(query)
    kv_heads = None
    for kind, fields in (("key", key_fields), ("value", value_fields)):
        expected = expected_fields(fmt, head_dim)
        if set(fields) != set(expected):
            raise ValueError(f"{kind} fields for {fmt} must be {sorted(expected)}, got {sorted(fields)}")
        capacity = fields["data"].shape[2] if fields["data"].dim() == 4 else -1
        for name, (width, dtype) in expected.items():
            tensor = fields[name]
            kv_heads = tensor.shape[1] if kv_heads is None and tensor.dim() == 4 else kv_heads
            want = (batch, kv_heads, capacity, width)
            if tuple(tensor.shape) != want or tensor.dtype != dtype:
                raise ValueError(
                    f"{kind} {name} must be {dtype} {want}, got {tensor.dtype} {tuple(tensor.shape)} (query {batch=})"
                )
            if tensor.device != query.device:
                raise ValueError(f"{kind} {name} is on {tensor.device}, query on {query.device}")
            if tensor.stride(-1) != 1:
                raise ValueError(f"{kind} {name} must be contiguous in its last dimension")
        if "zero" in fields and fields["zero"].stride() != fields["scale"].stride():
            raise ValueError(f"{kind} zero and scale must share one layout (strides)")
    if kv_heads == 0 or num_heads % kv_heads:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of KV heads ({kv_heads})")
    return head_dim


def _check_mask(key_mask, batch: int, q_len: int, kv_len: int, device: torch.device) -> torch.Tensor:
    """key_mask bool [B|1, Q, N] -> the same as uint8 with unit last stride (a 1-element dummy when None)."""
    if key_mask is None:
        return torch.ones((1, 1, 1), dtype=torch.uint8, device=device)
    if key_mask.dtype != torch.bool or key_mask.dim() != 3 or key_mask.shape[0] not in (1, batch):
        raise ValueError(f"key_mask must be bool [B|1, Q, N], got {key_mask.dtype} {tuple(key_mask.shape)}")
    if key_mask.shape[1] != q_len or key_mask.shape[2] < kv_len or key_mask.device != device:
        raise ValueError(f"key_mask must be [B|1, {q_len}, >= {kv_len}] on {device}, got {tuple(key_mask.shape)}")
    return key_mask.contiguous().view(torch.uint8)


def _prefix_tensor(prefix_lens, batch: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """L_b as int32 [B] on ``device`` and its maximum (a tensor argument costs one host sync)."""
    if isinstance(prefix_lens, int):
        if prefix_lens < 0:
            raise ValueError(f"prefix_lens must be non-negative, got {prefix_lens}")
        return torch.full((batch,), prefix_lens, dtype=torch.int32, device=device), prefix_lens  # no host sync
    elif isinstance(prefix_lens, torch.Tensor):
        values = prefix_lens.tolist()
    else:
        values = list(prefix_lens)
    if len(values) != batch or any(length < 0 for length in values):
        raise ValueError(f"prefix_lens must be {batch} non-negative lengths, got {values}")
    return torch.tensor(values, dtype=torch.int32, device=device), max(values)


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def _plan_splits(max_kv_len: int, programs: int, device: torch.device, num_splits: int | None) -> tuple[int, int]:
    """(splits, split length): by default enough programs to fill the device twice over, each split a
    multiple of _SPLIT_ALIGN slots; ``num_splits`` forces a count (tests exercise the merge on short contexts).
    """
    align = 1
    if num_splits is None:
        by_device = triton.cdiv(2 * _num_sms(device), programs)
        num_splits, align = max(1, min(by_device, triton.cdiv(max_kv_len, _SPLIT_ALIGN))), _SPLIT_ALIGN
    split_len = triton.cdiv(triton.cdiv(max_kv_len, num_splits), align) * align
    return triton.cdiv(max_kv_len, split_len), split_len


def _with_defaults(fields: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Fill absent scale/zero with the data tensor (never read: the format switch skips them)."""
    return {
        "data": fields["data"],
        "scale": fields.get("scale", fields["data"]),
        "zero": fields.get("zero", fields["data"]),
    }


def _strides(fields: dict[str, torch.Tensor]) -> tuple[int, ...]:
    """(data b, h, n strides, scale b, h, n strides) in elements (zero shares scale's layout)."""
    data, scale = fields["data"], fields["scale"]
    return (*data.stride()[:3], *scale.stride()[:3])


# ---- plain-torch reference ---------------------------------------------------------------------------


def dequantize_fields(fields: dict[str, torch.Tensor], fmt: str) -> torch.Tensor:
    """Stored fields [B, H_kv, n, width] -> fp32 states [B, H_kv, n, D] (formats.py; a plain cast for floats)."""
    if fmt in _FLOAT_DTYPES:
        return fields["data"].float()
    return KV_FORMATS[fmt].dequantize(fields, torch.float32)


def kv_attention_reference(
    query: torch.Tensor,
    key_fields: dict[str, torch.Tensor],
    value_fields: dict[str, torch.Tensor],
    fmt: str,
    prefix_lens: int | Sequence[int] | torch.Tensor,
    softmax_scale: float | None = None,
    *,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`kv_attention` as dequantize + fp32 SDPA with the causal-window mask, one request at a time."""
    batch, num_heads, q_len, _ = query.shape
    lengths = _prefix_tensor(prefix_lens, batch, torch.device("cpu"))[0].tolist()
    rows = []
    for b, prefix in enumerate(lengths):
        end = prefix + q_len
        keys = dequantize_fields({k: t[b : b + 1, :, :end] for k, t in key_fields.items()}, fmt)  # [1, H_kv, end, D]
        values = dequantize_fields({k: t[b : b + 1, :, :end] for k, t in value_fields.items()}, fmt)
        n_rep = num_heads // keys.shape[1]
        keys, values = keys.repeat_interleave(n_rep, dim=1), values.repeat_interleave(n_rep, dim=1)  # [1, H, end, D]
        mask = torch.ones(q_len, end, dtype=torch.bool, device=query.device).tril(prefix)  # query i sees [0, prefix+i]
        if key_mask is not None:
            mask = mask & key_mask[b if key_mask.shape[0] > 1 else 0, :, :end]
        out = F.scaled_dot_product_attention(
            query[b : b + 1].float(), keys, values, attn_mask=mask, scale=softmax_scale
        )
        rows.append(out)  # [1, H, Q, D]
    return torch.cat(rows).to(query.dtype)


# ---- benchmark cases ---------------------------------------------------------------------------------

_LLAMA_8B = {"num_heads": 32, "kv_heads": 8, "head_dim": 128}  # Llama-3.1-8B attention


def bench_cases(device: torch.device) -> list[BenchCase]:
    """Llama-3.1-8B decode (Q=1) and γ=4 verify (Q=5) attention over int8 / fp8 / int4 KV, bf16 queries.

    Contexts 1024 / 4096 / 16384 (total KV length, window included) × B in {1, 8}; cases whose stored KV
    would take more than a quarter of free memory are skipped, and off CUDA only the smallest is kept.
    ``run_torch`` is today's path: dequantize the history to bf16, then packed-GQA SDPA.
    """
    contexts, batches = ((1024, 4096, 16384), (1, 8)) if device.type == "cuda" else ((1024,), (1,))
    cases = []
    for fmt in ("int8", "fp8", "int4"):
        for batch in batches:
            for context in contexts:
                if not _fits(device, batch * context * 2 * _LLAMA_8B["kv_heads"] * _LLAMA_8B["head_dim"] * 2):
                    continue
                key_fields, value_fields = _bench_kv(fmt, batch, context, device)
                cases += [_bench_case(fmt, key_fields, value_fields, q_len, device) for q_len in (1, 5)]
    return cases


def _fits(device: torch.device, nbytes: int) -> bool:
    """Whether ``nbytes`` (here: the bf16 history run_torch materializes) is under a quarter of free memory."""
    return device.type != "cuda" or nbytes < torch.cuda.mem_get_info(device)[0] // 4


def _bench_kv(fmt: str, batch: int, context: int, device: torch.device) -> tuple[dict, dict]:
    """Stored key and value fields [B, H_kv, context, width] of random states, quantized by formats.py."""
    shape = (batch, _LLAMA_8B["kv_heads"], context, _LLAMA_8B["head_dim"])
    return tuple(KV_FORMATS[fmt].quantize(torch.randn(shape, device=device, dtype=torch.bfloat16)) for _ in range(2))


def _packed_gqa_sdpa(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """query [B, H, Q, D], keys/values [B, H_kv, L, D] -> [B, H, Q, D]: the model's torch path, timed by ``run_torch``.

    Packed-GQA SDPA (each KV head's query heads as extra rows, one SDPA call, the causal window as a mask),
    the torch path the deleted ``models/attention.py`` ran; kept as this benchmark's torch baseline.
    """
    batch, num_heads, q_len, head_dim = query.shape
    kv_heads, kv_len = keys.shape[1], keys.shape[2]
    rep = num_heads // kv_heads
    packed = query.reshape(batch, kv_heads, rep * q_len, head_dim)  # rows ordered (head-in-group, position)
    mask = None
    if q_len > 1:  # query i sits at position kv_len - q_len + i and sees keys up to it
        causal = torch.ones(q_len, kv_len, dtype=torch.bool, device=query.device).tril(kv_len - q_len)
        mask = causal.repeat(rep, 1)  # [rep*Q, L]
    out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=mask)  # [B, H_kv, rep*Q, D]
    return out.reshape(batch, num_heads, q_len, head_dim)


def _bench_case(fmt: str, key_fields: dict, value_fields: dict, q_len: int, device: torch.device) -> BenchCase:
    batch, _, context, _ = key_fields["data"].shape
    head_dim = _LLAMA_8B["head_dim"]
    query = torch.randn(batch, _LLAMA_8B["num_heads"], q_len, head_dim, device=device, dtype=torch.bfloat16)

    def run_torch() -> torch.Tensor:
        keys = KV_FORMATS[fmt].dequantize(key_fields, torch.bfloat16)  # [B, H_kv, context, D]
        values = KV_FORMATS[fmt].dequantize(value_fields, torch.bfloat16)
        return _packed_gqa_sdpa(query, keys, values)  # [B, H, Q, D]

    def run_triton() -> torch.Tensor:
        return kv_attention(query, key_fields, value_fields, fmt, context - q_len)

    stored = sum(t.numel() * t.element_size() for t in (*key_fields.values(), *value_fields.values()))
    return BenchCase(
        kernel=f"kv attention {fmt}",
        shape=f"B={batch} H=32 H_kv=8 D=128 ctx={context} Q={q_len}",
        bytes_moved=stored + 2 * query.numel() * query.element_size(),  # codes + scales, q in, out
        run_triton=run_triton,
        run_torch=run_torch,
    )
