"""The ``quant_quality`` section of a run: the quantized target against its float reference, and with int8
activations (issue 47) what they cost: the target against itself at float activations."""

from __future__ import annotations

from typing import Any

from spectoolkit.config import RunConfig
from spectoolkit.eval.held_text import held_texts
from spectoolkit.eval.quant_quality import measure
from spectoolkit.precisions import QUANT_PRECISIONS
from spectoolkit.wiring.loading import load_model
from spectoolkit.wiring.setup import LoadedModels


def quant_quality(cfg: RunConfig, models: LoadedModels) -> dict[str, Any] | None:
    """Measured when enabled, or by default when the target is quantized; None otherwise."""
    qq = cfg.quant_quality
    enabled = qq.enabled if qq.enabled is not None else cfg.target.precision in QUANT_PRECISIONS
    if not enabled:
        return None
    texts = held_texts(models.tokenizer, cfg.workload, qq.num_texts, qq.max_tokens)
    source = models.target.checkpoint  # resolved once, by the run (wiring.resolve)
    reference = load_model(source, qq.reference, models.device).model
    result = measure(models.target.model, reference, texts)
    del reference
    target = models.target
    section = {"reference": qq.reference, "quantized": target.label, "activations": target.activations, **result}
    if target.activations == "int8":  # what the integer dot products cost, apart from the weights' quantization
        group = cfg.target.group_size
        float_rows = load_model(source, target.precision, models.device, group, activations="float")
        section["int8_activations_vs_float"] = measure(target.model, float_rows.model, texts)
        del float_rows
    return section
