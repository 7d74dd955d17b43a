"""Decode / verify attention straight from a quantized KV cache (flash-decoding, GQA-packed).

Queries q [B, H, Q, D] with Q = 1 (a decode step) or Q = γ+1 (a verify window). Request b has
``L_b`` positions before the window (committed prefix plus the window's causal predecessors), so the
window occupies slots [L_b, L_b + Q) of its cache and query i sees KV positions [0, L_b + i].

One program handles one (request, KV head, KV split, row block): the ``n_rep = H / H_kv`` query heads
of a KV head and the Q positions are packed as ``n_rep * Q`` rows, so each KV block is read once per
KV head. K and V are dequantized in registers from the stored codes and per-token scales of
:mod:`spectoolkit.kvcache.formats` (fp8 / int8 per row; int4 per group of G = gcd(32, D) with a zero,
two codes a byte, low nibble first); fp16/bf16/fp32 KV go through the same kernel unscaled. Scores
and the online softmax are fp32; P·V accumulates in fp32; the output is in q's dtype.

Exact by construction (DESIGN §7): every output row is one fixed-order computation over its own
visible slots. The KV sequence is cut at fixed positions — split s holds slots
[s·SPLIT_LEN, (s+1)·SPLIT_LEN) — and each split walks its slots in blocks of BLOCK_N from its start, so
the number of splits of a request depends on its own length only, never on the batch, the other
requests' lengths or the device's SM count. A request of one split is normalized in place; longer
ones are merged by a second kernel that combines that request's splits one after another, in split
order. The tile shapes (BLOCK_M rows, BLOCK_N slots), num_warps and num_stages are constants (no
autotuning: a tile shape can select another MMA instruction or reduction layout). Hence a row's bits
do not depend on its batch companions, on its place in the row block, on the window length (a decode
step at position p equals row p of a verify window over the same prefix: blocks and splits past a
row's last visible slot add exact zeros) or on the GPU it runs on (given one Triton build). The
``split_len`` argument overrides SPLIT_LEN for a whole call (tests: the merge on short contexts).

The reference (:func:`kv_attention_reference`) dequantizes with formats.py and runs fp32 SDPA with the
causal-window mask: the path the pipeline runs without a GPU.
"""

from __future__ import annotations

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
BLOCK_M = 32  # packed query rows (heads of a KV head × window positions) per program, for every shape
BLOCK_N = 64  # KV slots per online-softmax block
SPLIT_LEN = 512  # KV slots per split (a multiple of BLOCK_N): split s holds slots [s·SPLIT_LEN, (s+1)·SPLIT_LEN)
NUM_WARPS, NUM_STAGES = 4, 2  # fixed, like the tiles: one compiled kernel per shape, the same on every GPU
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
    qk_scale, H_KV, split_len, max_splits,
    Q: tl.constexpr, N_REP: tl.constexpr, D: tl.constexpr, G: tl.constexpr, FORMAT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, FP32_DOT: tl.constexpr, HAS_MASK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Program (b * H_KV + kv_head, split, row block): online softmax over the split's slots, in fp32.

    Rows r = head_in_group * Q + i. Request b has cdiv(L_b + Q, split_len) splits of its own (``max_splits``,
    the grid's count, only lays out the partials; a program past the request's splits does nothing). With one
    split it writes the normalized output [B, H, Q, D]; otherwise the unnormalized accumulator and (running
    max, denominator) of its split for the merge.
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
    num_splits = tl.cdiv(prefix + Q, split_len)  # this request's own: its length decides, nothing else
    lo = split * split_len  # fixed positions: empty (no iteration) past the request's end
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

    # Masked stores, not branches: one split -> the output; several -> this split's partials (if it has slots).
    # (Row bounds as `rows < limit`: the interpreter cannot mask with a vector & scalar of booleans.)
    alone = rows < tl.where((num_splits == 1) & (split == 0), N_REP * Q, 0)  # [BLOCK_M]
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    out_off = b * s_ob + head[:, None] * s_oh + pos[:, None] * s_oq + offs_d[None, :]
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=alone[:, None])
    merged = rows < tl.where((num_splits > 1) & (split < num_splits), N_REP * Q, 0)  # [BLOCK_M]
    part = (pid_bh * max_splits + split) * (N_REP * Q) + rows  # [BLOCK_M] row index into partials
    tl.store(part_acc_ptr + part[:, None] * D + offs_d[None, :], acc, mask=merged[:, None])
    tl.store(part_ml_ptr + part * 2, m_i, mask=merged)
    tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=merged)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, prefix_lens_ptr, out_ptr, s_ob, s_oh, s_oq, H_KV, split_len, max_splits,
    Q: tl.constexpr, N_REP: tl.constexpr, D: tl.constexpr,
):  # fmt: skip
    """Program (b * H_KV + kv_head, row): request b's splits' (acc, max, denominator) combined into one output row,
    one split after another in split order (a request of one split was normalized by the first kernel)."""
    pid_bh, row = tl.program_id(0), tl.program_id(1)
    b, kv_head = pid_bh // H_KV, pid_bh % H_KV
    num_splits = tl.cdiv(tl.load(prefix_lens_ptr + b) + Q, split_len)
    count = tl.where(num_splits > 1, num_splits, 0)  # splits to merge: none for a one-split request
    first = pid_bh * max_splits * (N_REP * Q) + row  # split 0's partial row; split s is s * N_REP * Q further
    m_max = tl.load(part_ml_ptr + first * 2, mask=count > 0, other=0.0)
    for split in range(1, count):  # the max is exact in any order; the sums below run in split order
        m_max = tl.maximum(m_max, tl.load(part_ml_ptr + (first + split * N_REP * Q) * 2))
    offs_d = tl.arange(0, D)
    denom = tl.zeros_like(m_max)
    acc = tl.zeros([D], tl.float32)
    for split in range(0, count):
        part = first + split * N_REP * Q
        weight = tl.exp2(tl.load(part_ml_ptr + part * 2) - m_max)  # 0 for a split this row sees nothing of
        denom += tl.load(part_ml_ptr + part * 2 + 1) * weight
        acc += tl.load(part_acc_ptr + part * D + offs_d) * weight
    out = acc / tl.where(denom > 0, denom, 1.0)  # [D]; a fully masked row gives 0
    head, pos = kv_head * N_REP + row // Q, row % Q
    out_off = b * s_ob + head * s_oh + pos * s_oq + offs_d
    tl.store(out_ptr + out_off, out.to(out_ptr.dtype.element_ty), mask=offs_d < tl.where(count > 0, D, 0))


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
    split_len: int = SPLIT_LEN,
    key_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of query [B, H, Q, D] over stored KV fields [B, H_kv, cap, width] -> [B, H, Q, D] in q's dtype.

    ``key_fields``/``value_fields``: the stored fields of ``fmt`` (``data``, ``scale``[, ``zero``] as laid out
    in :mod:`spectoolkit.kvcache.formats`; ``{"data": ...}`` for bf16/fp16/fp32). ``prefix_lens``: L_b, the
    positions before the window per request (an int for all); query i of request b sees slots
    [0, L_b + i]. ``softmax_scale`` defaults to D**-0.5; ``split_len`` overrides :data:`SPLIT_LEN` (a positive
    multiple of :data:`BLOCK_N`; every request of the call is cut at the same fixed positions).
    ``key_mask``: optional bool [B|1, Q, N] (N ≥ max L_b + Q, slot n at index n) further restricting what
    query i sees, e.g. left padding; a row that sees nothing gets zeros.
    """
    head_dim = _check_inputs(query, key_fields, value_fields, fmt)
    batch, num_heads, q_len, _ = query.shape
    kv_heads, capacity = key_fields["data"].shape[1], key_fields["data"].shape[2]
    prefix, max_prefix = _prefix_tensor(prefix_lens, batch, query.device)
    if max_prefix + q_len > capacity:
        raise ValueError(f"prefix length {max_prefix} + {q_len} queries exceeds the KV capacity {capacity}")
    if split_len <= 0 or split_len % BLOCK_N:
        raise ValueError(f"split_len must be a positive multiple of {BLOCK_N}, got {split_len}")
    n_rep = num_heads // kv_heads
    m_blocks = triton.cdiv(n_rep * q_len, BLOCK_M)
    splits = triton.cdiv(max_prefix + q_len, split_len)  # the grid's count: the longest request's own
    out = torch.empty_like(query, memory_format=torch.contiguous_format)  # [B, H, Q, D]
    rows = batch * kv_heads * splits * n_rep * q_len
    part_acc = query.new_empty((rows if splits > 1 else 1, head_dim), dtype=torch.float32)
    part_ml = query.new_empty((rows if splits > 1 else 1, 2), dtype=torch.float32)
    keys, values = _with_defaults(key_fields), _with_defaults(value_fields)
    scale = head_dim**-0.5 if softmax_scale is None else softmax_scale
    group = int4_group_size(head_dim) if fmt == "int4" else 1
    mask = _check_mask(key_mask, batch, q_len, max_prefix + q_len, query.device)  # [B|1, Q, N] uint8
    _kv_attention_kernel[(batch * kv_heads, splits, m_blocks)](
        query, out, part_acc, part_ml, prefix, mask, mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(1),
        keys["data"], keys["scale"], keys["zero"], values["data"], values["scale"], values["zero"],
        *query.stride()[:3], *out.stride()[:3],
        *_strides(keys), *_strides(values),
        scale * _LOG2E, kv_heads, split_len, splits,
        Q=q_len, N_REP=n_rep, D=head_dim, G=group, FORMAT=_FORMAT_CODES[fmt],
        DOT_DTYPE=_DOT_DTYPES[query.dtype], FP32_DOT=_fp32_dot(query.dtype),
        HAS_MASK=key_mask is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
    )  # fmt: skip
    if splits > 1:
        _merge_splits_kernel[(batch * kv_heads, n_rep * q_len)](
            part_acc, part_ml, prefix, out, out.stride(0), out.stride(1), out.stride(2), kv_heads, split_len, splits,
            Q=q_len, N_REP=n_rep, D=head_dim, num_warps=NUM_WARPS, num_stages=NUM_STAGES,
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
