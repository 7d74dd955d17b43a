"""Load target and draft models (HF transformers) by hub id or local directory."""

from spectoolkit.models.loading import (
    DTYPES,
    LoadedModel,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_path,
)

__all__ = ["DTYPES", "LoadedModel", "load_model", "load_tokenizer", "resolve_device", "resolve_path"]
