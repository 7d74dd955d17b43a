"""The verification kernel emits exactly the torch verifier's tokens for the same uniforms.

Batches mix draft lengths (0 included) and request kinds: independent p and q, top-k zeros in p,
p == q rows (all accepted, bonus token), and p == q with the first draft excluded (rejected, residual
mass 0). References are the torch verifiers run per request on the CPU (torch's CPU cumsum is the
rule the kernel reproduces; see ``spectoolkit.kernels.verify``).
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.config import SamplingConfig
from spectoolkit.kernels.verifier import FusedVerifier, make_verifier
from spectoolkit.kernels.verify import (
    BatchVerifyResult,
    bench_cases,
    verify_greedy,
    verify_greedy_reference,
    verify_stochastic,
    verify_stochastic_reference,
)
from spectoolkit.sampling import processed_probs
from spectoolkit.verify import GreedyVerifier, StochasticVerifier

KINDS = ("random", "top_k", "equal", "equal_excluded")
GAMMAS = (3, 0, 5, 1, 4, 0, 2, 6)
ALMOST_ONE = 1.0 - 2.0**-24  # the largest fp32 below 1: u·total can round up to the total


def _cu(gammas: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(gammas).cumsum(0).tolist()], dtype=torch.long)  # [B+1]


def _request(kind: str, gamma: int, vocab: int, draft_vocab: int, gen: torch.Generator):
    """(draft_ids [γ], draft_probs [γ, V_draft], target_probs [γ+1, V]) for one request of ``kind``."""
    logits = torch.randn(gamma + 1, vocab, generator=gen) * 3  # [γ+1, V]
    top_k = max(2, vocab // 3) if kind != "random" else 0
    if kind.startswith("equal"):
        logits[:, draft_vocab:] = float("-inf")  # p == q needs p = 0 where the draft has no column
    target = processed_probs(logits, SamplingConfig(temperature=1.0, top_k=top_k))  # [γ+1, V]
    if kind.startswith("equal"):
        draft = target[:gamma, :draft_vocab].clone()  # [γ, V_draft]
    else:
        draft = torch.softmax(torch.randn(gamma, draft_vocab, generator=gen) * 3, dim=-1)
    ids = torch.multinomial(draft, 1, generator=gen).squeeze(-1) if gamma else torch.zeros(0, dtype=torch.long)
    if kind == "equal_excluded" and gamma:
        ids[0] = int(torch.nonzero(target[0, :draft_vocab] == 0)[0].item())  # p = q = 0: rejected
    return ids, draft, target


def _stochastic_batch(batch: int, vocab: int, draft_vocab: int, seed: int):
    """A flattened batch cycling through GAMMAS and KINDS, shifted by ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    gammas = [GAMMAS[(b + seed) % len(GAMMAS)] for b in range(batch)]
    parts = [_request(KINDS[(b + seed) % len(KINDS)], g, vocab, draft_vocab, gen) for b, g in enumerate(gammas)]
    ids, draft, target = (torch.cat(column) for column in zip(*parts, strict=True))
    return ids, _cu(gammas), draft, target


def _uniforms(total: int, seed: int) -> torch.Tensor:
    """[total] uniforms with the extremes 0 and ALMOST_ONE at some slots."""
    uniforms = torch.rand(total, generator=torch.Generator().manual_seed(seed + 1000))
    uniforms[::5] = 0.0
    uniforms[2::7] = ALMOST_ONE
    return uniforms


def _assert_same(result: BatchVerifyResult, reference: BatchVerifyResult) -> None:
    assert result.num_accepted.cpu().tolist() == reference.num_accepted.tolist()
    assert result.next_token.cpu().tolist() == reference.next_token.tolist()
    assert result.output_ids.cpu().tolist() == reference.output_ids.tolist()


def _on(device: torch.device, *tensors: torch.Tensor) -> list[torch.Tensor]:
    return [tensor.to(device) for tensor in tensors]


def _check_stochastic(device: torch.device, batch: int, vocab: int, draft_vocab: int, seed: int) -> None:
    ids, cu, draft, target = _stochastic_batch(batch, vocab, draft_vocab, seed)
    uniforms = _uniforms(ids.shape[0] + batch, seed)
    given = verify_stochastic(*_on(device, ids, cu, draft, target), uniforms=uniforms.to(device))
    _assert_same(given, verify_stochastic_reference(ids, cu, draft, target, uniforms))
    seeds = torch.arange(batch, dtype=torch.long) * 7919 + seed
    drawn = verify_stochastic(*_on(device, ids, cu, draft, target), seeds=seeds.to(device))
    _assert_same(drawn, verify_stochastic_reference(ids, cu, draft, target, drawn.uniforms.cpu()))


STOCHASTIC_GRID = [(1, 7, 7), (3, 7, 5), (8, 7, 6), (1, 1000, 1000), (3, 1000, 900), (8, 1000, 777), (2, 32000, 31000)]


@pytest.mark.parametrize(("batch", "vocab", "draft_vocab"), STOCHASTIC_GRID)
def test_stochastic_matches_torch_verifier(device, batch, vocab, draft_vocab):
    _check_stochastic(device, batch, vocab, draft_vocab, seed=batch + vocab)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize(("batch", "vocab", "draft_vocab"), [(8, 1000, 1000), (8, 32000, 32000), (8, 32768, 30000)])
def test_stochastic_matches_torch_verifier_large(device, batch, vocab, draft_vocab, seed):
    _check_stochastic(device, batch, vocab, draft_vocab, seed)


def test_seeded_uniforms_are_reproducible_and_per_slot(device):
    ids, cu, draft, target = _on(device, *_stochastic_batch(3, 7, 7, seed=0))
    seeds = torch.tensor([1, 2, 1], device=device)
    first = verify_stochastic(ids, cu, draft, target, seeds=seeds).uniforms
    second = verify_stochastic(ids, cu, draft, target, seeds=seeds).uniforms
    assert torch.equal(first, second)
    assert ((first >= 0) & (first < 1)).all()
    rows = [first[c + b : c + b + 3] for b, c in enumerate(cu[:-1].tolist())]  # every request has γ >= 2 here
    assert torch.equal(rows[0], rows[2]) and not torch.equal(rows[0], rows[1])  # depends on seed and slot only
    assert len(set(rows[0].tolist())) == 3


def test_inverse_cdf_ties_and_the_end_follow_sample_from(device):
    """Thresholds landing exactly on a CDF value skip it (right-sided search); u·total == total takes the
    last positive token. Dyadic probabilities make every sum exact."""
    target = torch.tensor([[0.25, 0.0, 0.25, 0.25, 0.25, 0.0, 0.0]] * 6)  # 6 requests with γ = 0
    uniforms = torch.tensor([0.0, 0.25, 0.5, 0.75, ALMOST_ONE, 1.0])  # 1.0 stands in for u·total rounding up
    cu = torch.zeros(7, dtype=torch.long)
    ids, draft = torch.zeros(0, dtype=torch.long), torch.zeros(0, 7)
    result = verify_stochastic(*_on(device, ids, cu, draft, target), uniforms=uniforms.to(device))
    reference = verify_stochastic_reference(ids, cu, draft, target, uniforms)
    _assert_same(result, reference)
    assert reference.next_token.tolist() == [0, 2, 3, 4, 4, 4]


def test_acceptance_boundary_is_inclusive(device):
    """u·q(x) == p(x) accepts (exact in fp32 here); p(x) == 0 rejects even with u = 0."""
    target = torch.tensor([[0.25, 0.75, 0.0], [0.5, 0.0, 0.5], [0.0, 0.5, 0.5]])  # [γ+1, V], γ = 2
    draft = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5]])  # [γ, V]
    ids, cu = torch.tensor([0, 1]), torch.tensor([0, 2])
    for uniforms, accepted in [([0.5, 0.0, 0.3], 1), ([0.5 + 2**-20, 0.0, 0.3], 0)]:
        uniforms = torch.tensor(uniforms)
        result = verify_stochastic(*_on(device, ids, cu, draft, target), uniforms=uniforms.to(device))
        _assert_same(result, verify_stochastic_reference(ids, cu, draft, target, uniforms))
        assert result.num_accepted.tolist() == [accepted]


def _greedy_batch(batch: int, vocab: int, seed: int, dtype: torch.dtype):
    """Logits with many exact ties (small integers) in half the requests; drafts match a random prefix."""
    gen = torch.Generator().manual_seed(seed)
    gammas = [GAMMAS[(b + seed) % len(GAMMAS)] for b in range(batch)]
    rows, ids = [], []
    for b, gamma in enumerate(gammas):
        tied = torch.randint(0, 3, (gamma + 1, vocab), generator=gen).float()
        logits = (tied if b % 2 else torch.randn(gamma + 1, vocab, generator=gen)).to(dtype)  # [γ+1, V]
        argmax = logits.float().argmax(-1)[:gamma]  # [γ]
        matched = int(torch.randint(0, gamma + 1, (1,), generator=gen))
        ids.append(torch.where(torch.arange(gamma) < matched, argmax, (argmax + 1) % vocab))
        rows.append(logits)
    return torch.cat(ids), _cu(gammas), torch.cat(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("batch", "vocab"), [(1, 7), (3, 7), (8, 7), (1, 1000), (3, 1000), (8, 1000), (3, 32000)])
def test_greedy_matches_torch_verifier(device, batch, vocab, dtype):
    if dtype != torch.float32 and vocab == 32000:
        pytest.skip("one dtype is enough at the largest vocabulary")
    ids, cu, logits = _greedy_batch(batch, vocab, seed=batch * vocab, dtype=dtype)
    result = verify_greedy(*_on(device, ids, cu, logits))
    _assert_same(result, verify_greedy_reference(ids, cu, logits))
    assert result.uniforms is None


def test_greedy_first_maximum_across_blocks(device):
    """An equal maximum in a later block (the interpreter's blocks are 256 wide) must not win."""
    logits = torch.zeros(2, 1000)
    logits[:, [700, 300, 999]] = 5.0
    ids, cu = torch.tensor([300]), torch.tensor([0, 1])
    result = verify_greedy(*_on(device, ids, cu, logits))
    assert result.num_accepted.tolist() == [1] and result.next_token.tolist() == [300]


def _valid_stochastic(device):
    ids, cu, draft, target = _on(device, *_stochastic_batch(2, 7, 6, seed=1))
    return {"draft_ids": ids, "cu_draft_lens": cu, "draft_probs": draft, "target_probs": target}


BAD_STOCHASTIC = {
    "neither uniforms nor seeds": lambda a: {},
    "both uniforms and seeds": lambda a: {"uniforms": _uniforms_for(a), "seeds": torch.zeros(2, dtype=torch.long)},
    "fp16 target": lambda a: {"target_probs": a["target_probs"].half(), "uniforms": _uniforms_for(a)},
    "fp64 draft": lambda a: {"draft_probs": a["draft_probs"].double(), "uniforms": _uniforms_for(a)},
    "missing target row": lambda a: {"target_probs": a["target_probs"][1:], "uniforms": _uniforms_for(a)},
    "draft wider than target": lambda a: {
        "draft_probs": torch.zeros(a["draft_probs"].shape[0], 8),
        "uniforms": _uniforms_for(a),
    },  # fmt: skip
    "draft rows": lambda a: {"draft_probs": a["draft_probs"][1:], "uniforms": _uniforms_for(a)},
    "float draft ids": lambda a: {"draft_ids": a["draft_ids"].float(), "uniforms": _uniforms_for(a)},
    "2-d offsets": lambda a: {"cu_draft_lens": a["cu_draft_lens"][None], "uniforms": _uniforms_for(a)},
    "short uniforms": lambda a: {"uniforms": _uniforms_for(a)[1:]},
    "fp64 uniforms": lambda a: {"uniforms": _uniforms_for(a).double()},
    "int32 seeds": lambda a: {"seeds": torch.zeros(2, dtype=torch.int32)},
    "seeds per slot": lambda a: {"seeds": torch.zeros(3, dtype=torch.long)},
    "another device": lambda a: {"uniforms": _uniforms_for(a).to("meta")},
}


def _uniforms_for(args: dict) -> torch.Tensor:
    return torch.rand(args["target_probs"].shape[0], device=args["target_probs"].device)


@pytest.mark.parametrize("case", list(BAD_STOCHASTIC))
def test_stochastic_wrapper_rejects_bad_input(device, case):
    args = _valid_stochastic(device)
    with pytest.raises(ValueError):
        verify_stochastic(**{**args, **BAD_STOCHASTIC[case](args)})


@pytest.mark.parametrize("case", ["fp64 logits", "int logits", "rows", "int8 ids"])
def test_greedy_wrapper_rejects_bad_input(device, case):
    ids, cu, logits = _on(device, *_greedy_batch(2, 7, seed=0, dtype=torch.float32))
    bad = {
        "fp64 logits": (ids, cu, logits.double()),
        "int logits": (ids, cu, logits.long()),
        "rows": (ids, cu, logits[:-1]),
        "int8 ids": (ids.to(torch.int8), cu, logits),
    }[case]
    with pytest.raises(ValueError):
        verify_greedy(*bad)


# ---- the pipeline verifier -------------------------------------------------------------------


SAMPLINGS = [SamplingConfig(temperature=0.0), SamplingConfig(temperature=0.8, top_k=50, top_p=0.9)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "stochastic"])
def test_fused_verifier_equals_torch_verifier_over_rounds(device, sampling):
    """Same generator seed -> same tokens and the same generator state after every round."""
    fused = FusedVerifier(sampling)
    torch_verifier = GreedyVerifier() if sampling.greedy else StochasticVerifier(sampling)
    data = torch.Generator().manual_seed(3)
    streams = [torch.Generator().manual_seed(11), torch.Generator().manual_seed(11)]
    vocab, draft_vocab = 300, 280
    for gamma in (4, 0, 2, 4, 1, 3):
        logits = torch.randn(gamma + 1, vocab, generator=data) * 2  # [γ+1, V]
        draft_probs = processed_probs(logits[:gamma, :draft_vocab] + torch.randn(gamma, draft_vocab, generator=data),
                                      SamplingConfig(temperature=0.8, top_k=50))  # fmt: skip
        draft_ids = torch.multinomial(draft_probs, 1, generator=data).squeeze(-1) if gamma else torch.zeros(0).long()
        probs = None if sampling.greedy else draft_probs
        expected = torch_verifier.verify(draft_ids, logits, probs, streams[0])
        assert fused.verify(draft_ids.to(device), logits.to(device), probs, streams[1]) == expected
        assert fused.select(logits[0].to(device), streams[1]) == torch_verifier.select(logits[0], streams[0])
        assert torch.equal(streams[0].get_state(), streams[1].get_state())


def test_fused_verifier_rejects_what_the_torch_verifier_rejects():
    fused = FusedVerifier(SamplingConfig(temperature=1.0))
    with pytest.raises(ValueError):
        fused.verify(torch.tensor([1, 2]), torch.randn(2, 9), torch.rand(2, 9))  # needs γ+1 = 3 rows
    with pytest.raises(ValueError):
        fused.verify(torch.tensor([1]), torch.randn(2, 9), None)  # no draft distributions


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["greedy", "stochastic"])
def test_make_verifier_keeps_torch_off_cuda(sampling):
    expected = GreedyVerifier if sampling.greedy else StochasticVerifier
    assert isinstance(make_verifier(sampling, torch.device("cpu")), expected)
    assert isinstance(make_verifier(sampling), expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused verifier is chosen on CUDA only")
def test_make_verifier_fuses_on_cuda():
    assert isinstance(make_verifier(SAMPLINGS[1], torch.device("cuda")), FusedVerifier)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bench shapes are sized for a GPU")
def test_bench_cases_run():
    for case in bench_cases(torch.device("cuda")):
        triton_out, torch_out = case.run_triton(), case.run_torch()
        assert torch.equal(triton_out.num_accepted.cpu(), torch_out.num_accepted.cpu()), case.shape
        assert case.bytes_moved > 0
