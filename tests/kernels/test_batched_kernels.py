"""The many-row kernel of a serving step: chosen per shape by measurement, cached, close to F.linear."""

from __future__ import annotations

import json

import torch

from spectoolkit.kernels import batched_kernels
from spectoolkit.kernels.batched_kernels import ROWS, batched_key, choose_batched_kernels, measure_gemm_from
from spectoolkit.kernels.kernel_choice import choose_kernels
from spectoolkit.models.tiny import tiny_llama


def _model():
    model = tiny_llama()
    choose_kernels(model, "reference")
    return model


def test_cached_choices_are_installed_without_measuring(tmp_path, monkeypatch) -> None:
    model = _model()
    key = batched_key(model.model.layers[0].self_attn.q_proj)
    path = tmp_path / "choices.json"
    path.write_text(json.dumps({key: 4}))
    measured = []
    monkeypatch.setattr(batched_kernels, "measure_gemm_from", lambda layers: measured.append(layers) or None)
    chosen = choose_batched_kernels(model, path)
    assert chosen[key] == 4 and model.model.layers[1].self_attn.q_proj.gemm_from == 4
    assert measured and all(batched_key(layers[0]) != key for layers in measured)  # only the other shapes
    assert set(json.loads(path.read_text())) == set(chosen)  # the new measurements were written back


def test_an_unreadable_cache_is_measured_again(tmp_path, monkeypatch) -> None:
    path = tmp_path / "choices.json"
    path.write_text("{not json")
    monkeypatch.setattr(batched_kernels, "measure_gemm_from", lambda layers: 16)
    chosen = choose_batched_kernels(_model(), path)
    assert chosen and set(chosen.values()) == {16}


def test_the_measured_threshold_is_a_measured_row_count_or_none() -> None:
    layers = [torch.nn.Linear(64, 96, bias=False) for _ in range(2)]
    for layer in layers:
        choose_kernels(torch.nn.Sequential(layer), "reference")
    assert measure_gemm_from(layers, rows=(2, 8), repeats=1) in (None, 2, 8)
    assert ROWS == tuple(sorted(ROWS))


@torch.inference_mode()
def test_plain_rows_through_w_xt_match_f_linear_and_are_contiguous() -> None:
    model = _model()
    layer = model.model.layers[0].mlp.up_proj
    layer.gemm_from = 2
    rows = torch.randn(1, 5, layer.in_features)
    out = layer.run(rows, "plain")
    assert out.is_contiguous() and out.shape == (1, 5, layer.out_features)
    torch.testing.assert_close(out, torch.nn.functional.linear(rows, layer.weight), rtol=1e-5, atol=1e-5)
