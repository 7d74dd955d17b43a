"""What quantization costs on the embedded SmolLM2: GPTQ int4 beats round-to-nearest int4."""

from __future__ import annotations

import pytest
import torch

from spectoolkit.config import WorkloadConfig
from spectoolkit.eval.held_text import held_texts
from spectoolkit.eval.quant_quality import measure
from spectoolkit.wiring.loading import load_model, load_tokenizer

pytestmark = [pytest.mark.integration, pytest.mark.slow]  # a quality claim, not a regression gate (36 s)
CPU = torch.device("cpu")


def test_gptq_int4_has_lower_kl_than_rtn_int4():
    texts = held_texts(load_tokenizer(None), WorkloadConfig(kind="sharegpt"), num_texts=3, max_tokens=96)
    assert len(texts) == 3
    reference = load_model(None, "bf16", CPU).model
    gptq = measure(load_model(None, "int4", CPU, group_size=64).model, reference, texts)
    rtn = measure(load_model(None, "rtn-int4", CPU, group_size=64).model, reference, texts)
    assert 0 < gptq["kl_mean"] < rtn["kl_mean"], (gptq, rtn)
    assert gptq["top1_agreement"] >= rtn["top1_agreement"] - 0.02
