"""The ``quant_quality`` section of a run: the quantized target against its float reference."""

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
    reference = load_model(cfg.model.target_path, qq.reference, models.device).model
    result = measure(models.target.model, reference, texts)
    del reference
    return {"reference": qq.reference, "quantized": cfg.target.precision, **result}
