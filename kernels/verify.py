"""Batched speculative verification in one launch: greedy and exact stochastic (DESIGN §1).

One program per request. Requests have different draft lengths γ_b (0 allowed) and are flattened:
request b's drafts are rows ``cu_draft_lens[b]:cu_draft_lens[b+1]`` of ``draft_ids``/``draft_probs``
and its γ_b+1 target rows (and uniforms) start at ``cu_draft_lens[b] + b``. The rule is exactly
:func:`spectoolkit.verify.rules.verify_with_uniforms` (Leviathan et al. 2023, Alg. 1) and
:class:`spectoolkit.verify.greedy.GreedyVerifier`, so for the same uniforms the tokens are identical:

- stochastic: accept draft x_i while u_i·q_i(x_i) <= p_i(x_i) and p_i(x_i) > 0; at the first rejection
  K sample the correction from max(0, p_K − q_K) (p_K when that mass is 0), else the bonus from p_γ;
- greedy: accept while x_i == argmax p_i (first maximum on ties, as ``torch.argmax``), then argmax.

Inverse CDF, as ``sample_from``: the first index whose CDF exceeds u·total, where CDF and total are fp32
roundings of the running sum and u·total is an fp32 product; past the end, the last positive token.
torch's CPU ``cumsum`` of fp32 runs sequentially in an fp64 accumulator, so the kernel accumulates in
fp64 as well (blockwise scan + carry). Both fp64 sums are within ~V·2⁻⁵³ of the exact sum, so their fp32
roundings can only differ when the exact prefix lies that close to an fp32 rounding midpoint *and* the
threshold equals that very fp32 value: about 1e-8 per sampled token for a 128k vocabulary. Ties on the
threshold itself (CDF == u·total, which right-sided search skips) are exact and tested. torch on CUDA
accumulates cumsum in fp32, so the reference for identical tokens is the torch verifier on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from spectoolkit.kernels.runtime import BenchCase, interpreting, require_launchable
from spectoolkit.verify.greedy import GreedyVerifier
from spectoolkit.verify.rules import verify_with_uniforms

_BLOCK_G = 16  # drafts handled per step of the acceptance loop (γ is small)
_CONFIGS = [triton.Config({"BLOCK_V": bv}, num_warps=w) for bv in (1024, 2048, 4096) for w in (4, 8)]
_INTERPRETER_CONFIG = {"BLOCK_V": 256, "num_warps": 1}  # several blocks at test vocabularies


@triton.jit
def _uniforms_at(uniforms_ptr, seed, row_start, slots, live, SEEDED: tl.constexpr):
    """[BLOCK] uniforms of slots ``slots`` of one request: drawn from (seed, slot) and recorded, or read."""
    if SEEDED:
        uniforms = tl.rand(seed, slots)
        tl.store(uniforms_ptr + row_start + slots, uniforms, mask=live)
    else:
        uniforms = tl.load(uniforms_ptr + row_start + slots, mask=live, other=1.0)
    return uniforms


@triton.jit
def _first_rejection(
    draft_ids_ptr, target_ptr, draft_probs_ptr, uniforms_ptr, seed, draft_start, row_start, gamma,
    stride_target, stride_draft, vocab, draft_vocab, SEEDED: tl.constexpr, BLOCK_G: tl.constexpr,
):  # fmt: skip
    """K: the index of the first rejected draft, γ when all are accepted (as ``accept_mask``)."""
    first = gamma
    for start in range(0, gamma, BLOCK_G):
        slots = start + tl.arange(0, BLOCK_G)  # [BLOCK_G]
        live = slots < gamma
        ids = tl.load(draft_ids_ptr + draft_start + slots, mask=live, other=0).to(tl.int64)
        known = live & (ids >= 0) & (ids < vocab)  # an id outside the vocabulary is rejected
        target_at = tl.load(target_ptr + (row_start + slots) * stride_target + ids, mask=known, other=0.0)
        draft_mask = known & (ids < draft_vocab)  # columns the draft vocabulary lacks have q = 0
        draft_at = tl.load(draft_probs_ptr + (draft_start + slots) * stride_draft + ids, mask=draft_mask, other=0.0)
        uniforms = _uniforms_at(uniforms_ptr, seed, row_start, slots, live, SEEDED)
        accepted = (uniforms * draft_at <= target_at) & (target_at > 0)
        first = tl.minimum(first, tl.min(tl.where(live & ~accepted, slots, gamma), axis=0))
    return first


@triton.jit
def _rows_at(target_row_ptr, draft_row_ptr, cols, vocab, draft_vocab):
    """[BLOCK_V] p and max(0, p − q) at ``cols`` (q = 0 beyond ``draft_vocab``)."""
    target = tl.load(target_row_ptr + cols, mask=cols < vocab, other=0.0)
    draft = tl.load(draft_row_ptr + cols, mask=cols < draft_vocab, other=0.0)
    return target, tl.maximum(target - draft, 0.0)


@triton.jit
def _sample_residual(target_row_ptr, draft_row_ptr, uniform, vocab, draft_vocab, BLOCK_V: tl.constexpr):
    """Inverse-CDF sample from max(0, p − q), or p when its mass is 0, with ``sample_from``'s rule."""
    residual_mass = tl.zeros([], tl.float64)
    target_mass = tl.zeros([], tl.float64)
    residual_last = tl.full([], -1, tl.int32)
    target_last = tl.full([], -1, tl.int32)
    for start in range(0, vocab, BLOCK_V):  # pass 1: masses and last positive tokens of both rows
        cols = start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        target, residual = _rows_at(target_row_ptr, draft_row_ptr, cols, vocab, draft_vocab)
        residual_mass += tl.sum(residual.to(tl.float64), axis=0)
        target_mass += tl.sum(target.to(tl.float64), axis=0)
        residual_last = tl.maximum(residual_last, tl.max(tl.where(residual > 0, cols, -1), axis=0))
        target_last = tl.maximum(target_last, tl.max(tl.where(target > 0, cols, -1), axis=0))
    use_target = residual_mass == 0  # torch: ``residual if residual.sum() > 0 else target``
    threshold = uniform * tl.where(use_target, target_mass, residual_mass).to(tl.float32)  # fp32, as torch
    carry = tl.zeros([], tl.float64)
    index = tl.zeros([], tl.int32) + vocab  # a tensor even where Triton specializes vocab == 1
    start = tl.zeros([], tl.int32)
    while (start < vocab) & (index == vocab):  # pass 2: first fp32 CDF value above the threshold
        cols = start + tl.arange(0, BLOCK_V)
        target, residual = _rows_at(target_row_ptr, draft_row_ptr, cols, vocab, draft_vocab)
        row = tl.where(use_target, target, residual).to(tl.float64)  # [BLOCK_V]
        cdf = (carry + tl.cumsum(row, axis=0)).to(tl.float32)  # [BLOCK_V]
        hit = (cdf > threshold) & (cols < vocab)
        index = tl.minimum(index, tl.min(tl.where(hit, cols, vocab), axis=0))
        carry += tl.sum(row, axis=0)
        start += BLOCK_V
    return tl.where(index < vocab, index, tl.where(use_target, target_last, residual_last))


@triton.jit
def _row_argmax(row_ptr, vocab, BLOCK_V: tl.constexpr):
    """First index of the maximum of a row of ``vocab`` logits (any float dtype, compared in fp32)."""
    best = tl.full([], float("-inf"), tl.float32)
    best_index = tl.zeros([], tl.int32)
    for start in range(0, vocab, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)  # [BLOCK_V]
        logits = tl.load(row_ptr + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
        block_best = tl.max(logits, axis=0)
        block_index = tl.argmax(logits, axis=0, tie_break_left=True).to(tl.int32) + start
        better = block_best > best  # strict: an equal maximum in a later block keeps the first
        best_index = tl.where(better, block_index, best_index)
        best = tl.where(better, block_best, best)
    return best_index


@triton.jit
def _greedy(draft_ids_ptr, target_ptr, draft_start, row_start, gamma, stride_target, vocab, BLOCK_V: tl.constexpr):
    """(K, next token): accept while the draft equals the row's argmax; rows after a mismatch are not read."""
    num_accepted = tl.zeros([], tl.int32)
    token = _row_argmax(target_ptr + row_start * stride_target, vocab, BLOCK_V)
    draft = tl.load(draft_ids_ptr + draft_start, mask=gamma > 0, other=-1)
    while (num_accepted < gamma) & (token == draft):
        num_accepted += 1
        token = _row_argmax(target_ptr + (row_start + num_accepted) * stride_target, vocab, BLOCK_V)
        draft = tl.load(draft_ids_ptr + draft_start + num_accepted, mask=num_accepted < gamma, other=-1)
    return num_accepted, token


@triton.jit
def _verify_kernel(
    draft_ids_ptr,  # [N] int, N = Σγ_b
    cu_draft_lens_ptr,  # [B+1] int
    target_ptr,  # [N+B, V]: fp32 probs (stochastic) or logits (greedy)
    draft_probs_ptr,  # [N, V_draft] fp32 (stochastic only)
    uniforms_ptr,  # [N+B] fp32: read, or written when SEEDED
    seeds_ptr,  # [B] int64 (SEEDED only)
    num_accepted_ptr,  # [B] int64 out
    next_token_ptr,  # [B] int64 out
    output_ids_ptr,  # [N+B] int64 out: accepted drafts, next token, then -1
    stride_target, stride_draft, vocab, draft_vocab,
    GREEDY: tl.constexpr, SEEDED: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_V: tl.constexpr,
):  # fmt: skip
    request = tl.program_id(0)
    draft_start = tl.load(cu_draft_lens_ptr + request).to(tl.int64)
    gamma = (tl.load(cu_draft_lens_ptr + request + 1) - draft_start).to(tl.int32)
    row_start = draft_start + request  # first target row / uniform of this request
    if GREEDY:
        num_accepted, next_token = _greedy(draft_ids_ptr, target_ptr, draft_start, row_start, gamma, stride_target,
                                           vocab, BLOCK_V)  # fmt: skip
    else:
        seed = 0
        if SEEDED:
            seed = tl.load(seeds_ptr + request)
        num_accepted = _first_rejection(
            draft_ids_ptr, target_ptr, draft_probs_ptr, uniforms_ptr, seed, draft_start, row_start, gamma,
            stride_target, stride_draft, vocab, draft_vocab, SEEDED, BLOCK_G,
        )  # fmt: skip
        last = gamma + tl.arange(0, 1)  # [1]: the correction/bonus slot
        uniform = tl.max(_uniforms_at(uniforms_ptr, seed, row_start, last, last >= 0, SEEDED), axis=0)
        target_row_ptr = target_ptr + (row_start + num_accepted) * stride_target
        draft_row_ptr = draft_probs_ptr + (draft_start + num_accepted) * stride_draft
        residual_vocab = tl.where(num_accepted < gamma, draft_vocab, 0)  # the bonus row has no q
        next_token = _sample_residual(target_row_ptr, draft_row_ptr, uniform, vocab, residual_vocab, BLOCK_V)
    tl.store(num_accepted_ptr + request, num_accepted.to(tl.int64))
    tl.store(next_token_ptr + request, next_token.to(tl.int64))
    for start in range(0, gamma + 1, BLOCK_G):
        slots = start + tl.arange(0, BLOCK_G)  # [BLOCK_G]
        drafts = tl.load(draft_ids_ptr + draft_start + slots, mask=slots < num_accepted, other=-1).to(tl.int64)
        emitted = tl.where(slots == num_accepted, next_token.to(tl.int64), drafts)
        tl.store(output_ids_ptr + row_start + slots, emitted, mask=slots <= gamma)


_verify_kernel_tuned = triton.autotune(configs=_CONFIGS, key=["vocab", "GREEDY"])(_verify_kernel)


@dataclass(frozen=True)
class BatchVerifyResult:
    """One round for B requests; request b emits ``output_ids[cu_draft_lens[b] + b :][: num_accepted[b] + 1]``."""

    num_accepted: torch.Tensor  # [B] int64, K_b
    next_token: torch.Tensor  # [B] int64, correction or bonus token
    output_ids: torch.Tensor  # [N+B] int64, per request: K_b accepted drafts, next token, -1 for the rest
    uniforms: torch.Tensor | None  # [N+B] fp32, the uniforms used (stochastic), same layout as the target rows


def verify_stochastic(
    draft_ids: torch.Tensor,
    cu_draft_lens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor | None = None,
    seeds: torch.Tensor | None = None,
) -> BatchVerifyResult:
    """Exact speculative sampling for B requests in one launch.

    draft_ids: [N] int, N = Σγ_b. cu_draft_lens: [B+1] int, 0 = c_0 <= ... <= c_B = N (trusted: checking
    the values would cost a device sync). draft_probs: [N, V_draft] fp32, V_draft <= V. target_probs:
    [N+B, V] fp32, already processed (``processed_probs``). Exactly one of uniforms [N+B] fp32 (slot
    c_b + b + i decides draft i of request b, slot c_b + b + γ_b samples its correction/bonus) or seeds
    [B] int64 (slot j of request b draws ``tl.rand(seeds[b], j)``; the result carries the uniforms used).
    """
    if (uniforms is None) == (seeds is None):
        raise ValueError("pass exactly one of uniforms (given random numbers) or seeds (drawn in the kernel)")
    batch, total = _check_layout(draft_ids, cu_draft_lens, target_probs)
    _check(target_probs.dtype == torch.float32, f"target_probs must be fp32, got {target_probs.dtype}")
    _check(draft_probs.dtype == torch.float32, f"draft_probs must be fp32, got {draft_probs.dtype}")
    _check(
        draft_probs.dim() == 2 and draft_probs.shape[0] == draft_ids.shape[0],
        f"draft_probs must be [N, V_draft] = [{draft_ids.shape[0]}, V_draft], got {list(draft_probs.shape)}",
    )
    _check(
        draft_probs.shape[1] <= target_probs.shape[1],
        f"draft_probs has {draft_probs.shape[1]} columns, more than the target's {target_probs.shape[1]}",
    )
    if seeds is not None:
        _check(seeds.shape == (batch,) and seeds.dtype == torch.int64, f"seeds must be [B] = [{batch}] int64")
        uniforms = torch.empty(total, dtype=torch.float32, device=target_probs.device)
    _check(
        uniforms.shape == (total,) and uniforms.dtype == torch.float32,
        f"uniforms must be [N+B] = [{total}] fp32, got {list(uniforms.shape)} {uniforms.dtype}",
    )
    _check_devices(
        draft_ids, cu_draft_lens, draft_probs, target_probs, uniforms, *([seeds] if seeds is not None else [])
    )
    draft_probs = draft_probs.contiguous()
    return _launch(draft_ids, cu_draft_lens, target_probs, draft_probs, uniforms, seeds, greedy=False)


def verify_greedy(
    draft_ids: torch.Tensor, cu_draft_lens: torch.Tensor, target_logits: torch.Tensor
) -> BatchVerifyResult:
    """Greedy verification for B requests in one launch (argmax in fp32, first maximum on ties).

    draft_ids: [N] int. cu_draft_lens: [B+1] int (trusted, as in :func:`verify_stochastic`).
    target_logits: [N+B, V] fp32/bf16/fp16. The result's ``uniforms`` is None.
    """
    _check_layout(draft_ids, cu_draft_lens, target_logits)
    floats = (torch.float32, torch.bfloat16, torch.float16)
    _check(target_logits.dtype in floats, f"target_logits must be fp32, bf16 or fp16, got {target_logits.dtype}")
    _check_devices(draft_ids, cu_draft_lens, target_logits)
    return _launch(draft_ids, cu_draft_lens, target_logits, target_logits, None, None, greedy=True)


def _launch(
    draft_ids: torch.Tensor,
    cu_draft_lens: torch.Tensor,
    target: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor | None,
    seeds: torch.Tensor | None,
    greedy: bool,
) -> BatchVerifyResult:
    require_launchable(target)
    batch = cu_draft_lens.shape[0] - 1
    target = target.contiguous()  # [N+B, V]
    longs = {"dtype": torch.int64, "device": target.device}
    num_accepted, next_token = torch.empty(batch, **longs), torch.empty(batch, **longs)
    output_ids = torch.empty(target.shape[0], **longs)  # [N+B]
    args = (
        draft_ids.contiguous(), cu_draft_lens.contiguous(), target, draft_probs,
        uniforms if uniforms is not None else target, seeds if seeds is not None else cu_draft_lens,
        num_accepted, next_token, output_ids, target.stride(0), draft_probs.stride(0), target.shape[1],
        draft_probs.shape[1],
    )  # fmt: skip
    meta = {"GREEDY": greedy, "SEEDED": seeds is not None, "BLOCK_G": _BLOCK_G}
    if batch > 0:
        if interpreting():
            _verify_kernel[(batch,)](*args, **meta, **_INTERPRETER_CONFIG)
        else:
            _verify_kernel_tuned[(batch,)](*args, **meta)
    return BatchVerifyResult(num_accepted, next_token, output_ids, uniforms)


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def _check_layout(draft_ids: torch.Tensor, cu_draft_lens: torch.Tensor, target: torch.Tensor) -> tuple[int, int]:
    """(B, N+B) after checking the flattened layout's shapes and index dtypes."""
    ints = (torch.int32, torch.int64)
    _check(draft_ids.dim() == 1 and draft_ids.dtype in ints, f"draft_ids must be [N] int32/int64, got "
           f"{list(draft_ids.shape)} {draft_ids.dtype}")  # fmt: skip
    cu_ok = cu_draft_lens.dim() == 1 and cu_draft_lens.shape[0] >= 1 and cu_draft_lens.dtype in ints
    _check(cu_ok, f"cu_draft_lens must be [B+1] int32/int64, got {list(cu_draft_lens.shape)} {cu_draft_lens.dtype}")
    batch = cu_draft_lens.shape[0] - 1
    total = draft_ids.shape[0] + batch
    rows_ok = target.dim() == 2 and target.shape[0] == total and target.shape[1] > 0
    _check(rows_ok, f"target must be [N+B, V] = [{total}, V] (γ_b+1 rows per request), got {list(target.shape)}")
    return batch, total


def _check_devices(*tensors: torch.Tensor) -> None:
    devices = {tensor.device for tensor in tensors}
    _check(len(devices) == 1, f"all inputs must be on one device, got {sorted(map(str, devices))}")


def verify_stochastic_reference(
    draft_ids: torch.Tensor,
    cu_draft_lens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
) -> BatchVerifyResult:
    """Plain torch: :func:`verify_with_uniforms` per request, same layout as :func:`verify_stochastic`."""
    results = [
        verify_with_uniforms(draft_ids[d0:d1], draft_probs[d0:d1], target_probs[t0:t1], uniforms[t0:t1])
        for d0, d1, t0, t1 in _request_rows(cu_draft_lens)
    ]
    return _gather(results, draft_ids, cu_draft_lens, uniforms)


def verify_greedy_reference(
    draft_ids: torch.Tensor, cu_draft_lens: torch.Tensor, target_logits: torch.Tensor
) -> BatchVerifyResult:
    """Plain torch: ``GreedyVerifier.verify`` per request, same layout as :func:`verify_greedy`."""
    verifier = GreedyVerifier()
    results = [
        verifier.verify(draft_ids[d0:d1], target_logits[t0:t1]) for d0, d1, t0, t1 in _request_rows(cu_draft_lens)
    ]
    return _gather(results, draft_ids, cu_draft_lens, None)


def _request_rows(cu_draft_lens: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Per request: (first draft, end of drafts, first target row, end of target rows)."""
    cu = cu_draft_lens.tolist()
    return [(cu[b], cu[b + 1], cu[b] + b, cu[b + 1] + b + 1) for b in range(len(cu) - 1)]


def _gather(results: list, draft_ids: torch.Tensor, cu_draft_lens: torch.Tensor, uniforms) -> BatchVerifyResult:
    device = draft_ids.device
    output_ids = torch.full((draft_ids.shape[0] + len(results),), -1, dtype=torch.int64)  # [N+B]
    for (d0, _, t0, _), result in zip(_request_rows(cu_draft_lens), results, strict=True):
        output_ids[t0 : t0 + result.num_accepted] = draft_ids[d0 : d0 + result.num_accepted].cpu()
        output_ids[t0 + result.num_accepted] = result.next_token
    longs = {"dtype": torch.int64, "device": device}
    num_accepted = torch.tensor([r.num_accepted for r in results], **longs)
    next_token = torch.tensor([r.next_token for r in results], **longs)
    return BatchVerifyResult(num_accepted, next_token, output_ids.to(device), uniforms)


def bench_cases(device: torch.device) -> list[BenchCase]:
    """A 1B-model decode batch (Llama-3.2-1B vocabulary 128256), γ = 4, B in {1, 8, 32}.

    ``bytes_moved`` counts the whole target probs/logits and draft probs once, plus ids, uniforms and
    outputs: what the torch reference reads. The kernel reads less when it can (greedy stops at the
    first mismatch, stochastic reads only the rows it samples from), so it is an *effective* bandwidth;
    the drafts here mostly match so greedy reads every row.
    """
    cases = []
    for batch in (1, 8, 32):
        cases += [_stochastic_case(device, batch, 4, 128256), _greedy_case(device, batch, 4, 128256)]
    return cases


def _stochastic_case(device: torch.device, batch: int, gamma: int, vocab: int) -> BenchCase:
    gen = torch.Generator(device=device).manual_seed(batch)
    logits = torch.randn(batch * (gamma + 1), vocab, device=device, generator=gen) * 4  # [N+B, V]
    target_probs = torch.softmax(logits, dim=-1)
    drafted = logits.view(batch, gamma + 1, vocab)[:, :gamma].reshape(-1, vocab)  # [N, V]: the rows drafts answer
    noise = torch.randn(drafted.shape, device=device, generator=gen)
    draft_probs = torch.softmax(drafted + noise, dim=-1)  # [N, V], close to p: realistic acceptance
    draft_ids = torch.multinomial(draft_probs, 1, generator=gen).squeeze(-1)  # [N]
    cu_draft_lens = torch.arange(batch + 1, device=device) * gamma  # [B+1]
    uniforms = torch.rand(target_probs.shape[0], device=device, generator=gen)  # [N+B]
    args = (draft_ids, cu_draft_lens, draft_probs, target_probs)
    moved = _bytes(target_probs, draft_probs, draft_ids, cu_draft_lens, uniforms) + 8 * (2 * batch + uniforms.numel())
    return BenchCase(
        "verify stochastic", f"B={batch} γ={gamma} V={vocab}", moved,
        lambda: verify_stochastic(*args, uniforms=uniforms), lambda: verify_stochastic_reference(*args, uniforms),
    )  # fmt: skip


def _greedy_case(device: torch.device, batch: int, gamma: int, vocab: int) -> BenchCase:
    gen = torch.Generator(device=device).manual_seed(batch)
    target_logits = torch.randn(batch * (gamma + 1), vocab, device=device, generator=gen)  # [N+B, V]
    draft_ids = target_logits.view(batch, gamma + 1, vocab)[:, :gamma].argmax(-1).reshape(-1)  # [N]: all match
    cu_draft_lens = torch.arange(batch + 1, device=device) * gamma  # [B+1]
    args = (draft_ids, cu_draft_lens, target_logits)
    moved = _bytes(target_logits, draft_ids, cu_draft_lens) + 8 * (2 * batch + target_logits.shape[0])
    return BenchCase(
        "verify greedy", f"B={batch} γ={gamma} V={vocab}", moved,
        lambda: verify_greedy(*args), lambda: verify_greedy_reference(*args),
    )  # fmt: skip


def _bytes(*tensors: torch.Tensor) -> int:
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)
