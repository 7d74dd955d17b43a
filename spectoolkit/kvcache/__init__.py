"""KV storage written by position, with a committed length that rollback simply lowers (DESIGN §2)."""

from spectoolkit.kvcache.cache import PositionalKVCache, PositionalKVLayer
from spectoolkit.kvcache.formats import KV_FORMATS, KVFormat
from spectoolkit.kvcache.quantized import KV_PRECISIONS, CastKVLayer, QuantizedKVLayer, make_kv_cache

__all__ = [
    "KV_FORMATS",
    "KV_PRECISIONS",
    "CastKVLayer",
    "KVFormat",
    "PositionalKVCache",
    "PositionalKVLayer",
    "QuantizedKVLayer",
    "make_kv_cache",
]
