"""Kernel choice by measurement (kernels/kernel_choice.py) and verify numerics equal to decode numerics.

The chooser is tested with stubbed timers (which variant is "fast" is the test's to say); the
row-invariance tests run the real kernels of every backend: a k-token verify forward of the target
must give, bit for bit, the logits of k one-token decode steps, whatever the KV precision.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from spectoolkit.kernels import kernel_choice as kc
from spectoolkit.models.tiny import save_tiny_llama, tiny_llama
from spectoolkit.runtime.lone import lone_sequence, model_step
from spectoolkit.wiring.loading import load_model

PROMPT = list(range(3, 20))
WINDOW = [21, 22, 23, 24, 25]  # a verify window of γ = 4 drafts after the pending token


def _layer() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(64, 48)


def _prefer(name: str, others: float = 2.0):
    """A timer under which the variant ``name`` costs 1 and every other ``others``."""
    return lambda variant, rows, function: 1.0 if variant.name == name else others


def test_reference_wins_when_the_fast_path_is_slower():
    assert kc.choose_variant([_layer()], torch.float32, (1, 5), _prefer("rows1")) == kc.REFERENCE


def test_reference_wins_ties_and_near_ties():
    assert kc.choose_variant([_layer()], torch.float32, (1, 5), lambda v, r, f: 1.0) == kc.REFERENCE
    near = lambda variant, rows, function: 0.99 if variant.name == "rows2" else 1.0  # noqa: E731  within margin
    assert kc.choose_variant([_layer()], torch.float32, (1, 5), near) == kc.REFERENCE


def test_a_faster_invariant_variant_is_chosen():
    assert kc.choose_variant([_layer()], torch.float32, (1, 5), _prefer("rows2")).name == "rows2"


class _BatchDependent(nn.Linear):
    """BUG on purpose: a kernel whose per-row result depends on the other rows of the call (a fixed
    chunk size alone makes a row-count dependence harmless; a dependence on the neighbours is not)."""

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        rows = inputs.reshape(-1, inputs.shape[-1])
        return super().forward(inputs) + 1e-3 * rows.sum()


def test_a_variant_that_is_not_row_invariant_is_never_chosen():
    torch.manual_seed(0)
    layer = _BatchDependent(64, 48)
    assert kc.row_invariant(layer, kc.REFERENCE, torch.float32)  # one row per call: invariant by construction
    assert not kc.row_invariant(layer, kc.BY_NAME["rows8"], torch.float32)
    assert kc.choose_variant([layer], torch.float32, (1, 5), _prefer("rows8", others=100.0)) == kc.REFERENCE


def test_choices_are_cached_per_machine_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    device = torch.device("cpu")
    path = tmp_path / f"{kc.fingerprint(device)}.json"
    model = nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 64))
    first = kc.choose_kernels(model, "auto", cache=kc.ChoiceCache(path), timer=_prefer("rows2"))
    assert set(first.values()) == {"rows2"} and path.is_file()

    def no_timing(variant, rows, function):
        raise AssertionError("a cached choice must not be measured again")

    again = kc.choose_kernels(nn.Sequential(nn.Linear(64, 48), nn.Linear(48, 64)), "auto",
                              cache=kc.ChoiceCache(path), timer=no_timing)  # fmt: skip
    assert again == first
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    assert kc.fingerprint(device) != path.stem  # another thread count is another machine
    monkeypatch.setattr(kc, "cpu_model", lambda: "another CPU")
    assert kc.fingerprint(device) != path.stem


def test_reference_mode_measures_nothing():
    model = nn.Sequential(nn.Linear(64, 48))
    chosen = kc.choose_kernels(model, "reference", timer=lambda v, r, f: pytest.fail("reference mode timed"))
    assert set(chosen.values()) == {"rows1"}
    assert isinstance(model[0], kc.ChunkedLinear) and type(model[0].layer) is nn.Linear


def test_an_unreadable_cache_is_measured_again(tmp_path: Path):
    path = tmp_path / "bad.json"
    path.write_text("{not json", encoding="utf-8")
    assert kc.ChoiceCache(path).choices == {}
    path.write_text('{"k": "no-such-variant"}', encoding="utf-8")
    assert kc.ChoiceCache(path).get("k") is None


def test_prefills_keep_the_plain_forward():
    layer = kc.install(_layer(), kc.BY_NAME["rows2"])
    inputs = torch.randn(kc.MAX_CHUNKED_ROWS + 1, 64)
    assert torch.equal(layer(inputs), nn.functional.linear(inputs, layer.weight, layer.bias))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("invariance") / "tiny", vocab_size=128, scale=4.0)


def verify_and_steps(model: nn.Module, kv: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [k, V] of one k-token forward after the prompt, and of k one-token forwards (a lone sequence)."""
    runner = lone_sequence(model, kv)
    with torch.inference_mode():
        runner.reset()
        runner.forward(PROMPT, last_only=True)
        window = runner.forward(WINDOW)
        runner.reset()
        runner.forward(PROMPT, last_only=True)
        steps = torch.cat([runner.forward([token]) for token in WINDOW])
    return window, steps


@pytest.mark.parametrize("kv", ["auto", "int8", "int4", "fp8"])
@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16", "rtn-int8", "rtn-int4", "int8", "nf4"])
@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_a_verify_forward_equals_decode_steps_bit_for_bit(checkpoint: Path, precision: str, kv: str, kernels: str):
    loaded = load_model(str(checkpoint), precision, torch.device("cpu"), group_size=32, kernels=kernels)
    window, steps = verify_and_steps(loaded.model, kv)
    assert torch.equal(window, steps), (loaded.kernels, (window.float() - steps.float()).abs().max())


def test_whole_model_steps_decide_when_a_step_is_given():
    model = tiny_llama(vocab_size=64).eval()
    real_step = model_step(model)
    widths_seen: list[int] = []

    def step(width: int) -> object:
        widths_seen.append(width)
        return real_step(width)

    prefer = _prefer("rows2")

    def timer(variant, rows, function):  # runs the call, reports the preferred cost
        function()
        return prefer(variant, rows, function)

    chosen = kc.choose_kernels(model, "auto", cache=kc.ChoiceCache(None), timer=timer, step=step)
    assert set(chosen.values()) == {"rows2"}
    assert set(widths_seen) == {1, 5}  # a decode step and the verify width, as whole model forwards
    assert all(layer.variant.name == "rows2" for _, layer in kc.linear_layers(model))
