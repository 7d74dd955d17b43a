"""The precision names a run can ask for, in one leaf module that config, quant and kvcache all import.

- model weights: a float dtype, or a quantization backend (``spectoolkit.quant`` maps each to its
  module: bitsandbytes int8/nf4, GPTQ int4, native round-to-nearest rtn-int8/rtn-int4, and gguf: a GGUF
  checkpoint's own quantization);
- KV cache storage: ``auto`` (the model's compute dtype), a float dtype, or a quantized format
  (``spectoolkit.kvcache.formats``: fp8, int8, int4 per-token scaled).
"""

FLOAT_PRECISIONS = ("fp32", "bf16", "fp16")
QUANT_PRECISIONS = ("int8", "nf4", "int4", "rtn-int8", "rtn-int4", "gguf")
MODEL_PRECISIONS = FLOAT_PRECISIONS + QUANT_PRECISIONS
KV_PRECISIONS = ("auto", "fp32", "bf16", "fp16", "fp8", "int8", "int4")
