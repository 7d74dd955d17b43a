"""KV storage written by position, with a committed length that rollback simply lowers (DESIGN §2).

Only the leaves are re-exported: the positional cache and the storage formats. The precision chooser
:func:`~spectoolkit.kvcache.quantized.make_kv_cache` and its layers stay in
:mod:`spectoolkit.kvcache.quantized`: they run the Triton attention kernel, which imports the formats
(hence this package), so the package must not import them.
"""

from spectoolkit.kvcache.cache import PositionalKVCache, PositionalKVLayer
from spectoolkit.kvcache.formats import KV_FORMATS, KVFormat

__all__ = [
    "KV_FORMATS",
    "KVFormat",
    "PositionalKVCache",
    "PositionalKVLayer",
]
