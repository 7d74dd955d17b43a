"""Per-request sampling settings: validation naming the field, min-p as transformers applies it, penalties as vLLM
defines them (against a plain loop)."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import MinPLogitsWarper

from spectoolkit.config import SamplingConfig
from spectoolkit.sampling import SamplingError, SamplingParams, make_chooser, penalize, processed_probs

VOCAB = 12


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("temperature", 1e-9),  # > 0 but below the epsilon: the scaled logits would overflow
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -3),
        ("top_k", 2.5),
        ("min_p", 1.2),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
        ("repetition_penalty", 0.0),
        ("logprobs", 21),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_p", True),
    ],
)
def test_a_bad_value_names_its_field(field, value):
    with pytest.raises(SamplingError) as raised:
        SamplingParams(**{field: value})
    assert raised.value.field == field
    assert field in str(raised.value)


def test_vllm_spelling_of_top_k_off_and_defaults_from_a_run_config():
    assert SamplingParams(top_k=-1).top_k == 0
    params = SamplingParams.of(SamplingConfig(temperature=0.7, top_k=5, top_p=0.9, min_p=0.1))
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (0.7, 5, 0.9, 0.1)
    assert params.mode == "T=0.7" and SamplingParams().mode == "greedy"
    assert make_chooser(params).greedy is False and make_chooser(SamplingParams()).greedy is True


@pytest.mark.parametrize("min_p", [0.05, 0.3, 0.9])
def test_min_p_matches_transformers_warper(min_p):
    logits = 2.0 * torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0))  # [B, V]
    ours = processed_probs(logits, SamplingParams(temperature=0.8, min_p=min_p))
    reference = torch.softmax(MinPLogitsWarper(min_p)(torch.zeros(8, 1, dtype=torch.long), logits / 0.8), dim=-1)
    assert torch.equal(ours > 0, reference > 0)
    torch.testing.assert_close(ours, reference, atol=1e-6, rtol=1e-5)


def _penalized_loop(logits: torch.Tensor, params: SamplingParams, prompt, output, appended) -> torch.Tensor:
    """vLLM's penalties one token at a time (the reference for :func:`penalize`)."""
    out = logits.clone().float()
    for row, extra in enumerate(appended):
        history = list(output) + list(extra)
        for token in range(logits.shape[-1]):
            count = history.count(token)
            value = out[row, token].item()
            if token in prompt or count:
                rp = params.repetition_penalty
                value = value / rp if value > 0 else value * rp
            value -= params.frequency_penalty * count + params.presence_penalty * (count > 0)
            out[row, token] = value
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(repetition_penalty=1.3),
        SamplingParams(temperature=0.7, presence_penalty=0.8, frequency_penalty=-0.4),
        SamplingParams(repetition_penalty=0.8, presence_penalty=-1.0, frequency_penalty=1.5),
    ],
)
def test_penalize_matches_a_plain_loop(params):
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))  # [R, V]
    prompt, output, appended = [1, 4, 4], [2, 2, 7], [[], [5], [5, 2]]
    ours = penalize(logits, params, prompt, output, appended)
    torch.testing.assert_close(ours, _penalized_loop(logits, params, prompt, output, appended))


def test_penalize_is_the_identity_without_penalties():
    logits = torch.randn(2, VOCAB)
    assert penalize(logits, SamplingParams(temperature=0.5), [1], [2], [[], [3]]) is logits
