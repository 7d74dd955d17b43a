"""KV storage written by position, with a committed length that rollback simply lowers (DESIGN §2)."""

from spectoolkit.kvcache.cache import PositionalKVCache, PositionalKVLayer

__all__ = ["PositionalKVCache", "PositionalKVLayer"]
