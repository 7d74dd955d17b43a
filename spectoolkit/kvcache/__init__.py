"""KV formats only: the per-token quantized formats (fp8/int8/int4) and the float casts.

The one KV store is the paged pool (:mod:`spectoolkit.runtime.paged_kv`), which stores tokens in these
formats; the attention kernels (:mod:`spectoolkit.kernels.kv_attention`, the compiled runner's
``paged_attention``) read them, so this package sits below the kernels.
"""

from spectoolkit.kvcache.formats import CAST_DTYPES, KV_FORMATS, KVFormat

__all__ = ["CAST_DTYPES", "KV_FORMATS", "KVFormat"]
