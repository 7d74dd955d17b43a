"""KV storage: the per-token formats (fp8/int8/int4, and the float casts) and the positional cache base.

Rollback simply lowers a committed length (DESIGN §2). The formats are what the attention kernel
(:mod:`spectoolkit.kernels.kv_attention`) reads, so this package sits below the kernels; the layers
that store those formats and run that kernel, with the precision chooser
:func:`~spectoolkit.models.kv_cache.make_kv_cache`, live in :mod:`spectoolkit.models.kv_cache`.
"""

from spectoolkit.kvcache.cache import PositionalKVCache, PositionalKVLayer
from spectoolkit.kvcache.formats import CAST_DTYPES, KV_FORMATS, KVFormat

__all__ = [
    "CAST_DTYPES",
    "KV_FORMATS",
    "KVFormat",
    "PositionalKVCache",
    "PositionalKVLayer",
]
