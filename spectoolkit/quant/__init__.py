"""Weight quantization backends behind one interface, chosen once by precision name.

| precision  | backend                                   | module              |
|------------|-------------------------------------------|---------------------|
| `int8`     | bitsandbytes LLM.int8                     | ``quant/bnb.py``    |
| `nf4`      | bitsandbytes 4-bit NormalFloat            | ``quant/bnb.py``    |
| `int4`     | GPTQ 4-bit via GPTQModel (calibrated)     | ``quant/gptq.py``   |
| `rtn-int8` | native round-to-nearest, group-wise int8  | ``quant/rtn.py``    |
| `rtn-int4` | native round-to-nearest, group-wise int4  | ``quant/rtn.py``    |
| `gguf`     | a GGUF checkpoint's own quantized tensors | ``quant/gguf_native.py`` |

Every backend exposes ``load_quantized(path, precision, device, group_size) -> nn.Module`` (a causal
LM in eval mode whose forward runs the quantized weights); :func:`spectoolkit.quant.registry.load_quantized`
picks it by precision (not imported here: see :mod:`spectoolkit.quant.registry`). The float precisions
(fp32/bf16/fp16) are loaded by :mod:`spectoolkit.wiring.loading` directly.
"""

from spectoolkit.precisions import QUANT_PRECISIONS

__all__ = ["QUANT_PRECISIONS"]
