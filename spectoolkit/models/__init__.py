"""Causal LMs (HF transformers): device resolution, float loading, attention, runners.

Only the leaves are re-exported: float dtypes and device resolution (checkpoints are resolved by
:mod:`spectoolkit.checkpoints`). The loader that chooses between float and quantized checkpoints is
:func:`spectoolkit.wiring.loading.load_model`: it sits above the quantization backends, which import the model
modules (attention, paths).
"""

from spectoolkit.models.float_model import DTYPES
from spectoolkit.models.paths import resolve_device

__all__ = ["DTYPES", "resolve_device"]
