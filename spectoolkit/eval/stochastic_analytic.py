"""Analytic exactness of stochastic verification on real logits (DESIGN §1).

At one draft position with target distribution p and draft distribution q, exact speculative
sampling emits x with probability

    out(x) = r(x)·a(x) + (1 − Σ_y r(y)·a(y)) · residual(x) / Σ residual

where r is the distribution the draft token was really drawn from (q when the drafter is honest),
a(x) = min(1, p(x)/q(x)) (0 where p(x) = 0: the verifier's guard) and residual = max(0, p − q).
For an exact verifier out == p. Here p and q are the rows the real code builds at real positions:
the target runs alone over each prompt (seeded sampling), the real drafter proposes at every
position, ``processed_probs`` builds p, and the residual comes from the verifier's own rule
(:func:`spectoolkit.verify.rules.residual`, bound here as ``_residual``). The acceptance probability is
cross-checked against the verifier's :func:`~spectoolkit.verify.rules.accept_mask` (``_accept_mask``
here) by probing it with uniforms just inside and outside the threshold, so a wrong rule there shows
up too.

fp32 limit: the verifier tests p(x)/q(x) on fp32 rows whose sums are off 1 by up to ~1e-5 (fp32
softmax over a 49k vocabulary), so its output differs from p/Σp by up to |Σp/Σq − 1| in TV
(:func:`normalization_gap`). ``max_tv`` is the raw TV; ``passed`` asks the TV beyond that gap
(``max_excess_tv``) to stay under 1e-6, with no disagreement of ``_accept_mask``.

Negative controls use the same sums with a known bug and must give a clearly non-zero TV:
``draft_argmax`` (model draft: the argmax is proposed while the softmax is reported),
``uniform_q`` (n-gram draft: a uniform q is reported for a deterministic proposal) and
``top_p_draft_only`` (top-k/top-p applied to the draft only; forced to top_k=20, top_p=0.9 when
the run's sampling has neither, so that it matters).
"""

from __future__ import annotations

import dataclasses

import torch

from spectoolkit.config import SamplingConfig
from spectoolkit.drafting import Budget, Lone, NgramDrafter, lone_drafter
from spectoolkit.errors import SpecToolkitError
from spectoolkit.runtime.lone import LoneSequence, lone_sequence
from spectoolkit.sampling import RandomChooser, processed_probs
from spectoolkit.verify.rules import accept_mask as _accept_mask  # module-level names: the seams tests patch
from spectoolkit.verify.rules import pad_vocab
from spectoolkit.verify.rules import residual as _residual

THRESHOLD = 1e-6
CONTROL_TOP_K, CONTROL_TOP_P = 20, 0.9
_PROBE = 1e-3  # relative distance of the probing uniforms from the acceptance threshold


class _RecordingChooser(RandomChooser):
    """The real chooser, keeping the draft logits [V] it was last given (for the controls)."""

    last_logits: torch.Tensor | None = None

    def choose(self, logits: torch.Tensor, generator: torch.Generator | None) -> tuple[int, torch.Tensor]:
        self.last_logits = logits.float()
        return super().choose(logits, generator)


def verifier_output_probs(
    proposal_probs: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor
) -> tuple[torch.Tensor, int]:
    """The distribution [V] float64 the verifier emits at one draft position, and rule mismatches.

    proposal_probs: [V] what the draft token is really drawn from; draft_probs: [V_draft] the q
    handed to the verifier; target_probs: [V] the p handed to the verifier (fp32, as the verifier
    sees them). The mismatch count is the number of probes where ``_accept_mask`` disagrees with
    a(x) = min(1, p(x)/q(x))·[p(x) > 0].
    """
    target_probs = target_probs.float()  # [V]
    draft_probs = pad_vocab(draft_probs.float().unsqueeze(0), target_probs.shape[-1])[0]  # [V]
    proposal = proposal_probs.double() / proposal_probs.double().sum()  # [V] sample_from normalizes
    accept = _accept_probability(draft_probs.double(), target_probs.double())  # [V]
    mismatches = _probe_accept_mask(proposal > 0, accept, draft_probs, target_probs)
    accepted = proposal * accept  # [V]
    residual = _residual(target_probs, draft_probs).double()  # [V] the verifier's own residual
    return accepted + (1 - accepted.sum()).clamp_min(0) * residual / residual.sum(), mismatches


def _accept_probability(draft_probs: torch.Tensor, target_probs: torch.Tensor) -> torch.Tensor:
    """P_u[u·q(x) <= p(x) and p(x) > 0] for u ~ U[0, 1): min(1, p/q), 1 where q = 0, 0 where p = 0."""
    ratio = torch.where(draft_probs > 0, target_probs / draft_probs, torch.ones_like(target_probs))
    return torch.where(target_probs > 0, ratio.clamp(max=1), torch.zeros_like(ratio))


def _probe_accept_mask(
    proposed: torch.Tensor, accept: torch.Tensor, draft_probs: torch.Tensor, target_probs: torch.Tensor, rule=None
) -> int:
    """How often ``rule`` (default ``_accept_mask``) disagrees with ``accept`` [V] at uniforms 0, just below
    and above it.

    Only tokens that can be proposed and whose probabilities are normal fp32 numbers (or p == 0) are
    probed: the rounding of u·q near denormals says nothing about the rule.
    """
    rule = rule or _accept_mask
    normal = ((target_probs > 1e-30) | (target_probs == 0)) & (draft_probs > 1e-30)
    token_ids = torch.nonzero(proposed & normal).flatten()  # [n]
    if token_ids.numel() == 0:
        return 0
    rows = token_ids.numel()
    draft_rows, target_rows = draft_probs.expand(rows, -1), target_probs.expand(rows, -1)  # [n, V] views
    threshold = accept[token_ids].float()  # [n]
    below_one = threshold * (1 + _PROBE) < 1 - 1e-6  # room above the threshold for a rejecting probe
    probes = (
        (torch.zeros_like(threshold), threshold > 0, torch.ones_like(below_one)),  # the p > 0 guard
        (threshold * (1 - _PROBE), threshold > 0, torch.ones_like(below_one)),
        (threshold * (1 + _PROBE), torch.zeros_like(below_one), below_one),
    )
    mismatches = 0
    for uniform, expected, probed in probes:
        got = rule(token_ids, draft_rows, target_rows, uniform)  # [n] bool
        mismatches += int(((got != expected) & probed).sum())
    return mismatches


def total_variation(first: torch.Tensor, second: torch.Tensor) -> float:
    """½ Σ |first − second| over [V] rows (float64; each normalized to sum 1)."""
    first, second = first.double() / first.double().sum(), second.double() / second.double().sum()
    return 0.5 * float((first - second).abs().sum())


def _control_sampling(sampling: SamplingConfig) -> SamplingConfig:
    if sampling.top_k or sampling.top_p < 1.0:
        return sampling
    return dataclasses.replace(sampling, top_k=CONTROL_TOP_K, top_p=CONTROL_TOP_P)


def _target_positions(
    runner: LoneSequence, prompt: list[int], sampling: SamplingConfig, count: int, generator, split_last: bool = False
):
    """Yield (tokens so far, target logits [V]) at ``count`` positions of a target-alone continuation.

    ``split_last``: the prompt's last token is fed as a decode step after a prefill of the rest."""
    runner.reset()
    tokens = list(prompt)
    if split_last and len(prompt) > 1:
        runner.forward(prompt[:-1])
    logits = runner.forward(tokens[-1:] if split_last else tokens, last_only=True)  # [V]
    chooser = RandomChooser(sampling)
    for index in range(count):
        yield tokens, logits.float()
        token, _ = chooser.choose(logits, generator)
        tokens = tokens + [token]
        if index + 1 < count:
            logits = runner.forward([token], last_only=True)


def _position_rows(target_logits, proposal, recorder, sampling, control_sampling, model_draft):
    """(real row, {control: row}) of (proposal_probs, draft_probs, target_probs, reference) tuples."""
    target_probs = processed_probs(target_logits, sampling)  # [V]
    draft_probs = proposal.draft_probs[0]  # [V] what the real drafter reported
    real = (draft_probs, draft_probs, target_probs, target_probs)
    control_target = processed_probs(target_logits, control_sampling)
    temperature_only = SamplingConfig(temperature=sampling.temperature)
    unprocessed = processed_probs(target_logits, temperature_only)
    if model_draft:
        argmax = torch.zeros_like(draft_probs)
        argmax[int(torch.argmax(draft_probs))] = 1.0
        draft_control = processed_probs(recorder.last_logits, control_sampling)
        controls = {
            "draft_argmax": (argmax, draft_probs, target_probs, target_probs),
            "top_p_draft_only": (draft_control, draft_control, unprocessed, control_target),
        }
    else:
        uniform = torch.full_like(draft_probs, 1.0 / draft_probs.shape[-1])
        controls = {
            "uniform_q": (draft_probs, uniform, target_probs, target_probs),
            "top_p_draft_only": (draft_probs, draft_probs, unprocessed, control_target),
        }
    return real, controls


def _tv_of(row) -> tuple[float, int]:
    proposal_probs, draft_probs, verifier_target, reference = row
    out, mismatches = verifier_output_probs(proposal_probs, draft_probs, verifier_target)
    return total_variation(out, reference), mismatches


def normalization_gap(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> float:
    """|Σp / Σq − 1| of the fp32 rows [V] the verifier is given (sums taken exactly, in float64).

    The verifier tests p(x)/q(x) on rows that fp32 softmax leaves off 1 by up to ~1e-5 over a 49k
    vocabulary; with proposal q/Σq and reference p/Σp its output is then off the reference by at
    most this gap in TV (the accept mass moves by ≤ |κ−1|, κ = Σp/Σq, and the residual absorbs it).
    """
    return abs(float(target_probs.double().sum() / draft_probs.double().sum()) - 1)


def _summary(values: list[float]) -> dict:
    return {"max_tv": max(values, default=0.0), "mean_tv": sum(values) / len(values) if values else 0.0}


def _vocab_size(model: torch.nn.Module) -> int:
    return model.get_output_embeddings().out_features


def analytic_exactness(
    target: torch.nn.Module,
    draft: torch.nn.Module | None,
    prompts: list[list[int]],
    sampling: SamplingConfig,
    positions_per_prompt: int,
    seed: int,
    draft_vocab_shared: int | None = None,
    ngram_max: int = 3,
    ngram_min: int = 2,
) -> dict:
    """TV between the verifier's output distribution and the target's processed p at real positions.

    ``draft`` None means the n-gram proposer (``ngram_max``/``ngram_min``): its one-hot q is checked at
    the positions where it proposes (the others count in ``positions_skipped``).
    ``draft_vocab_shared``: ids the draft shares with the target (default: the smaller vocabulary).
    Returns max_tv, mean_tv (raw), max_excess_tv (beyond the fp32 normalization gap), positions,
    controls {name: {max_tv, mean_tv}}, passed (max_excess_tv < threshold, no rule mismatch), ….
    """
    if sampling.greedy:
        raise SpecToolkitError("analytic exactness needs sampling.temperature > 0 (greedy is checked token for token)")
    runner = lone_sequence(target)
    vocab = _vocab_size(target)
    recorder = _RecordingChooser(sampling)
    if draft is not None:
        shared = draft_vocab_shared or min(vocab, _vocab_size(draft))
        positions = max(map(len, prompts), default=0) + positions_per_prompt + 2
        drafter = lone_drafter(draft, recorder, vocab, shared, frozenset(), positions)
    else:
        drafter = NgramDrafter(ngram_max, ngram_min, vocab, one_hot_probs=True)
    control_sampling = _control_sampling(sampling)
    real_tvs, excess_tvs, gaps, control_tvs, mismatches, skipped = [], [], [], {}, 0, 0
    target_gen, draft_gen = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed + 1)
    for prompt in prompts:
        drafter.reset()  # one prompt at a time
        seq = Lone([], draft_gen)
        for tokens, target_logits in _target_positions(runner, prompt, sampling, positions_per_prompt, target_gen):
            seq.tokens = tokens
            (proposal,) = drafter.propose([seq], [Budget(1, 1)])
            drafter.commit(seq, len(tokens), [])  # the draft token is never kept: the next position feeds the target's
            if len(proposal) == 0:
                skipped += 1
                continue
            real, controls = _position_rows(
                target_logits, proposal, recorder, sampling, control_sampling, draft is not None
            )
            tv, bad = _tv_of(real)
            gap = normalization_gap(real[2], real[1])
            real_tvs.append(tv)
            gaps.append(gap)
            excess_tvs.append(max(0.0, tv - gap))
            mismatches += bad
            for name, row in controls.items():
                control_tvs.setdefault(name, []).append(_tv_of(row)[0])
    result = _summary(real_tvs)
    max_excess = max(excess_tvs, default=0.0)
    return {
        **result,
        "positions": len(real_tvs),
        "positions_skipped": skipped,
        "max_excess_tv": max_excess,
        "max_normalization_gap": max(gaps, default=0.0),
        "accept_rule_mismatches": mismatches,
        "sampling": dataclasses.asdict(sampling),
        "control_sampling": dataclasses.asdict(control_sampling),
        "controls": {name: _summary(values) for name, values in control_tvs.items()},
        "passed": bool(real_tvs) and max_excess < THRESHOLD and mismatches == 0,
        "threshold": THRESHOLD,
    }
