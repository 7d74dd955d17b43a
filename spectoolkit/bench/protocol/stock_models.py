"""The stock counterpart of a target at every precision a run can have (``bench.baseline_check``).

Each is loaded the way a user of the stock libraries would, from the same checkpoint, with none of
our loader's kernel swaps:

- float (fp32/bf16/fp16): ``AutoModelForCausalLM.from_pretrained(path, dtype=...)``.
- bitsandbytes (int8/nf4): the same, with the ``BitsAndBytesConfig`` our loader uses.
- GPTQ (int4): the GPTQ checkpoint our run quantized (cached), loaded through transformers' own GPTQ
  integration (``from_pretrained`` reads its ``quantization_config``; optimum + GPTQModel underneath,
  with GPTQModel's default kernel choice).
- gguf: the float checkpoint the GGUF file converts to, fp32 — what transformers' GGUF loading gives
  (``from_pretrained(..., gguf_file=...)`` dequantizes every tensor; it has no GGUF kernels). The weights
  are the very values our gguf precision holds in its packed codes.
- rtn-int8 / rtn-int4: the float checkpoint at our rtn base precision (fp32), its linears quantized by
  torchao weight-only at the same bits and group size (``lm_head`` kept float, as ours): int4 through
  torchao's CPU int4 layout (``PrototypeInt4WeightOnlyConfig``: the tinygemm kernel), int8 through
  ``Int8WeightOnlyConfig(PerGroup(g))``.

A missing library is :class:`StockUnavailable`: the check records it as skipped, with the reason.
"""

from __future__ import annotations

import torch

from spectoolkit.checkpoints import Checkpoint

BNB = ("int8", "nf4")  # stock transformers loads these through BitsAndBytesConfig
RTN = ("rtn-int8", "rtn-int4")
GGUF = "gguf"


class StockUnavailable(Exception):
    """No stock counterpart can be loaded here (a library is absent); the message says which and why."""


def load_stock(
    source: Checkpoint, precision: str, group_size: int, device: torch.device
) -> tuple[torch.nn.Module, str]:
    """A fresh stock copy of checkpoint ``source`` (the run's resolved checkpoint) at
    ``precision`` on ``device`` (eval), and how it was loaded."""
    import transformers

    from spectoolkit.models.float_model import DTYPES

    path = source.location
    if precision in DTYPES:
        model, how = _float(path, DTYPES[precision], device), precision
    elif precision in BNB:
        model, how = _bitsandbytes(path, precision, device)
    elif precision == "int4":
        model, how = _gptq(source, group_size, device)
    elif precision in RTN:
        model, how = _torchao(path, precision, group_size, device)
    elif precision == GGUF:
        model, how = _float(path, torch.float32, device), "GGUF dequantized to fp32 (transformers' GGUF loading)"
    else:
        raise ValueError(f"no stock counterpart for precision '{precision}'")
    model.eval()
    attention = getattr(model.config, "_attn_implementation", None) or "default"
    return model, f"transformers {transformers.__version__} generate, {attention} attention, {how}"


def _float(path: str, dtype: torch.dtype, device: torch.device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)


def _bitsandbytes(path: str, precision: str, device: torch.device) -> tuple[torch.nn.Module, str]:
    from transformers import AutoModelForCausalLM

    from spectoolkit.quant.bnb import BnbConfig

    bnb = BnbConfig(kind=precision)  # the scheme our backend loads, as a plain BitsAndBytesConfig
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=bnb.dtype, quantization_config=bnb.to_transformers(), device_map={"": device}
    )
    return model, f"bitsandbytes {precision}, {bnb.compute_dtype} compute"


def _gptq(path: Checkpoint, group_size: int, device: torch.device) -> tuple[torch.nn.Module, str]:
    """Our cached GPTQ checkpoint of ``path`` through transformers' GPTQ loading (optimum + GPTQModel)."""
    from importlib.metadata import PackageNotFoundError, version

    from transformers import AutoModelForCausalLM

    from spectoolkit.quant.gptq import PRECISION_BITS, GptqConfig, activation_dtype, gptqmodel_quietly
    from spectoolkit.quant.gptq import quantized_checkpoint as gptq_checkpoint

    try:
        versions = {name: version(name) for name in ("optimum", "gptqmodel")}
    except PackageNotFoundError as exc:
        raise StockUnavailable(
            f"transformers loads GPTQ checkpoints through optimum and gptqmodel; {exc.name} is not installed "
            "(`make install` installs both)"
        ) from None
    checkpoint = gptq_checkpoint(path, GptqConfig(bits=PRECISION_BITS["int4"], group_size=group_size))
    dtype = activation_dtype(device)  # the dtype our own GPTQ loader runs in
    with gptqmodel_quietly():  # as our loader: GPTQMODEL_CPU_WORKERS on 2 cores, its banner dropped
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype, device_map={"": device})
    kernels = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "qweight")})
    stack = ", ".join(f"{name} {v}" for name, v in versions.items())
    how = f"GPTQ int4 g{group_size} ({checkpoint.name}) via {stack}, {str(dtype).removeprefix('torch.')}"
    return model, f"{how}, {'/'.join(kernels)}"


def _torchao(path: str, precision: str, group_size: int, device: torch.device) -> tuple[torch.nn.Module, str]:
    """The float checkpoint, its linears (not ``lm_head``) quantized by torchao weight-only at our bits and g."""
    try:  # (its "Failed to load" warnings for CUDA-only extensions are silenced in spectoolkit/__init__.py)
        import torchao
        from torchao.quantization import Int8WeightOnlyConfig, quantize_
        from torchao.quantization.granularity import PerGroup
    except ImportError as exc:
        raise StockUnavailable(f"{precision}: the stock PyTorch path is torchao weight-only; {exc}") from None
    from spectoolkit.models.float_model import DTYPES
    from spectoolkit.quant.rtn import BASE_PRECISION

    model = _float(path, DTYPES[BASE_PRECISION], device)
    if precision == "rtn-int4":
        from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

        config, kind = PrototypeInt4WeightOnlyConfig(group_size=group_size, set_inductor_config=False), "int4"
    else:
        config, kind = Int8WeightOnlyConfig(granularity=PerGroup(group_size)), "int8"
    quantize_(model, config, filter_fn=lambda module, name: isinstance(module, torch.nn.Linear) and name != "lm_head")
    return model, f"torchao {torchao.__version__} {kind} weight-only g{group_size} ({type(config).__name__}), fp32"
