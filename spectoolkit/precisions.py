"""The precision names a run can ask for, in one leaf module that config, quant and kvcache all import.

- model weights: a float dtype, or a quantization backend (``spectoolkit.quant`` maps each to its
  module: bitsandbytes int8/nf4, GPTQ int4, native round-to-nearest rtn-int8/rtn-int4, and gguf: a GGUF
  checkpoint's own quantization);
- activations (issue 47): ``float`` (fp32 rows times the weights) or ``int8`` (each row quantized per 32-element
  block, integer dot products with the weights' integer codes: llama.cpp's own numerics for its formats); part
  of a precision's name (``gguf+a8``), so the exact reference is the target at that setting;
- KV cache storage: ``auto`` (the model's compute dtype), a float dtype, or a quantized format
  (``spectoolkit.kvcache.formats``: fp8, int8, int4 per-token scaled).
"""

FLOAT_PRECISIONS = ("fp32", "bf16", "fp16")
QUANT_PRECISIONS = ("int8", "nf4", "int4", "rtn-int8", "rtn-int4", "gguf")
MODEL_PRECISIONS = FLOAT_PRECISIONS + QUANT_PRECISIONS
KV_PRECISIONS = ("auto", "fp32", "bf16", "fp16", "fp8", "int8", "int4")
ACTIVATIONS = ("float", "int8")
INT_CODE_PRECISIONS = ("int4", "rtn-int8", "rtn-int4", "gguf")  # weights held as integer codes: int8 activations apply
# A precision's activations when none are asked for: gguf runs as llama.cpp runs its files (int8 activations, as
# measured: README "int8 activations"); the others keep float activations, their numerics of earlier runs.
DEFAULT_ACTIVATIONS = {"gguf": "int8"}


def resolve_activations(precision: str, activations: str | None) -> str:
    """The activations a model at ``precision`` runs: ``activations``, or the precision's default."""
    return activations or DEFAULT_ACTIVATIONS.get(precision, "float")


def precision_label(precision: str, activations: str) -> str:
    """A precision's name with its activations: ``gguf+a8`` for int8 activations, else the precision itself."""
    return f"{precision}+a8" if activations == "int8" else precision
