"""Weight quantization backends behind one interface, chosen once by precision name.

| precision  | backend                                   | module              |
|------------|-------------------------------------------|---------------------|
| `int8`     | bitsandbytes LLM.int8                     | ``quant/bnb.py``    |
| `nf4`      | bitsandbytes 4-bit NormalFloat            | ``quant/bnb.py``    |
| `int4`     | GPTQ 4-bit via GPTQModel (calibrated)     | ``quant/gptq.py``   |
| `rtn-int8` | native round-to-nearest, group-wise int8  | ``quant/rtn.py``    |
| `rtn-int4` | native round-to-nearest, group-wise int4  | ``quant/rtn.py``    |

Every backend exposes ``load_quantized(path, precision, device, group_size) -> nn.Module`` (a causal
LM in eval mode whose forward runs the quantized weights). The float precisions (fp32/bf16/fp16)
are loaded by :mod:`spectoolkit.models.loading` directly.
"""

from __future__ import annotations

QUANT_PRECISIONS = ("int8", "nf4", "int4", "rtn-int8", "rtn-int4")


def load_quantized(path: str, precision: str, device, group_size: int):
    """Load ``path`` quantized to ``precision`` with its backend (imported only when used)."""
    from importlib import import_module

    module = import_module(f"spectoolkit.quant.{_BACKEND_MODULES[precision]}")
    return module.load_quantized(path, precision, device, group_size)


_BACKEND_MODULES = {"int8": "bnb", "nf4": "bnb", "int4": "gptq", "rtn-int8": "rtn", "rtn-int4": "rtn"}
