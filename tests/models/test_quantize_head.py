"""``draft.quantize_head``: an RTN draft's lm_head quantized like its other linears (issue 18)."""

from __future__ import annotations

import pytest
import torch

from spectoolkit.config import run_config_from_dict
from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels.kernel_choice import library_layer
from spectoolkit.quant.rtn import RtnLinear
from spectoolkit.wiring.loading import load_model

pytestmark = pytest.mark.integration


def test_rtn_draft_head_is_quantized_only_when_asked():
    cpu = torch.device("cpu")
    plain = load_model(None, "rtn-int4", cpu, 64, "reference")
    quantized = load_model(None, "rtn-int4", cpu, 64, "reference", quantize_head=True)
    assert not isinstance(library_layer(plain.model.lm_head), RtnLinear)  # the layer a measured variant wraps
    assert isinstance(library_layer(quantized.model.lm_head), RtnLinear)
    assert quantized.weight_bytes() < plain.weight_bytes() + plain.model.lm_head.weight.numel()  # a packed head
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        a, b = plain.model(input_ids=ids).logits, quantized.model(input_ids=ids).logits
    correlation = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
    assert not torch.equal(a, b) and correlation > 0.95  # the head's 4-bit error: close logits, not the same


def test_quantize_head_is_refused_where_it_cannot_apply():
    with pytest.raises(SpecToolkitError, match="quantize_head applies to rtn-int8, rtn-int4"):
        load_model(None, "bf16", torch.device("cpu"), 64, "reference", quantize_head=True)
    cfg = run_config_from_dict({"draft": {"kind": "model", "precision": "rtn-int4", "quantize_head": True}})
    assert cfg.draft.model_name == "model-rtn-int4+qhead"
