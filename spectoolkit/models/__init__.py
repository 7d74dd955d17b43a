"""Load target and draft models (HF transformers) by hub id or local directory.

Only the leaves are re-exported: float dtypes and checkpoint/device resolution. The loader that
chooses between float and quantized checkpoints is :mod:`spectoolkit.models.loading`
(``load_model``, ``load_tokenizer``, ``LoadedModel``): the quantization backends it chooses import
the model modules (attention, linears, paths), hence this package, so the package must not import it.
"""

from spectoolkit.models.float_model import DTYPES
from spectoolkit.models.paths import resolve_device, resolve_path

__all__ = ["DTYPES", "resolve_device", "resolve_path"]
