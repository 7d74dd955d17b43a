"""Packing a model for our kernel at load (spectoolkit/quant/packing.py): what is packed, what keeps its path, and
the fused q/k/v and gate/up calls that give each part's bits without a second copy of the weights."""

from __future__ import annotations

import pytest
import torch

from spectoolkit.kernels.cpu_linear import PackedLinear, fully_packed
from spectoolkit.kernels.rtn_format import RtnConfig
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.quant.packing import pack_model
from spectoolkit.quant.rtn import quantize_model_rtn


def _bytes(model: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.buffers())


@pytest.mark.parametrize("precision", ["fp32", "bf16", "rtn-int4", "rtn-int8"])
def test_every_linear_is_packed_and_the_fused_calls_give_each_parts_bits(precision):
    model = tiny_llama(vocab_size=96, seed=1)
    if precision == "bf16":
        model = model.to(torch.bfloat16)
    if precision.startswith("rtn"):
        quantize_model_rtn(model, RtnConfig(int(precision[-1]), 32))
    report = pack_model(model)
    assert set(report.values()) == {"packed"} and fully_packed(model)
    before = _bytes(model)
    assert pack_model(model) == report and _bytes(model) == before  # idempotent, no new bytes
    x = torch.randn(5, model.config.hidden_size).to(model.dtype)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        for fused, parts in ((attn.qkv_fused, (attn.q_proj, attn.k_proj, attn.v_proj)),
                             (mlp.gate_up_fused, (mlp.gate_proj, mlp.up_proj))):  # fmt: skip
            assert fused.splits == [part.out_features for part in parts]
            for got, part in zip(fused(x).split(fused.splits, dim=-1), parts, strict=True):
                assert torch.equal(got, part(x))
                assert part.data.untyped_storage().data_ptr() == fused.data.untyped_storage().data_ptr()
    assert not any(isinstance(m, PackedLinear) and "fused" in m.source for m in model.modules())  # not submodules


def test_layers_our_kernel_does_not_take_keep_their_path_and_are_reported():
    model = tiny_llama(vocab_size=96, seed=1).to(torch.float16)
    report = pack_model(model)
    assert report and set(report.values()) == {"own path: torch.float16 weights"}
    assert not fully_packed(model) and not hasattr(model.model.layers[0].self_attn, "qkv_fused")
