"""Which of a loaded model's linears our CPU kernel takes, and their codes handed over (DESIGN §7); the packing
itself, int8 activations and fused calls are :mod:`spectoolkit.kernels.packing`'s.

Every CPU linear our kernel runs becomes a :class:`~spectoolkit.kernels.cpu_linear.PackedLinear`: float
``nn.Linear`` (fp32 or bf16 weights, kept in their dtype) and RTN layers (int8/int4, any group size
that divides K, or per channel) from their canonical codes, and GPTQModel's 4-bit GPTQ layers from
their codes (:mod:`spectoolkit.quant.gptq_codes`), bitsandbytes NF4 layers likewise
(:mod:`spectoolkit.quant.bnb_codes`): the same weights exactly. RTN and GPTQ layers whose group has a format
(32, 64, 128) keep their own size (:mod:`spectoolkit.kernels.formats`, issue 55), records that run int8 activations
and become the wide panels of before at float activations. The original weight is dropped, except a
tied output embedding, which stays as the input embedding. Layers the kernel cannot take keep their own
path, and :func:`pack_model` says which and why: bitsandbytes LLM.int8 (it quantizes activations too),
GPTQ with act-order or other bit widths, fp16 weights, and anything off the CPU.
The model's own forward then runs our kernels too, so every user of the model (runners, drafters,
lm-eval) computes one numerics.
"""

from __future__ import annotations

from torch import nn

from spectoolkit.kernels import packing
from spectoolkit.kernels.cpu_linear import (
    FLOAT_DTYPES,
    PackedLinear,
    pack_float,
    pack_int4_codes,
    pack_nf4,
    pack_rtn,
    pack_rtn_records,
)
from spectoolkit.quant import bnb_codes, gptq_codes
from spectoolkit.quant.rtn import RtnLinear


def packable(layer: nn.Module) -> str | None:
    """Why ``layer`` keeps its own path (None: our kernel takes it)."""
    weight = getattr(layer, "weight", None)
    if isinstance(layer, RtnLinear):
        if layer.group_size != layer.in_features and (layer.group_size % 2 or layer.in_features % layer.group_size):
            return f"rtn group size {layer.group_size} does not split K={layer.in_features} evenly"
        return None if layer.bias is None or layer.bias.is_cpu else "not on the CPU"
    if gptq_codes.is_gptq_layer(layer):
        return gptq_codes.unpackable(layer)
    if bnb_codes.is_nf4_layer(layer):
        return bnb_codes.unpackable(layer) or (None if layer.bias is None or layer.bias.is_cpu else "not on the CPU")
    if type(layer) is not nn.Linear:
        return f"{type(layer).__name__} (its own kernel)"
    if not weight.is_cpu:
        return "not on the CPU"
    if weight.dtype not in FLOAT_DTYPES:
        return f"{weight.dtype} weights"
    return None


def pack_layer(layer: nn.Module) -> PackedLinear:
    """The packed twin of a layer :func:`packable` accepts."""
    bias = layer.bias.detach() if layer.bias is not None else None
    if isinstance(layer, RtnLinear):  # at their own size where a format has their group (issue 55), else wide
        quantized = layer.quantized()
        packed = pack_rtn_records(quantized) or pack_rtn(quantized)
        return PackedLinear(packed, bias, f"rtn-int{layer.bits} g{layer.group_size}")
    if gptq_codes.is_gptq_layer(layer):
        packed = gptq_codes.to_records(layer)
        if packed is None:
            codes, scales, zeros, group = gptq_codes.int4_codes(layer)
            packed = pack_int4_codes(codes, scales, zeros, group)
        return PackedLinear(packed, bias, f"gptq-int4 g{packed.group}")
    if bnb_codes.is_nf4_layer(layer):
        codes, absmax, block = bnb_codes.nf4_codes(layer)
        return PackedLinear(pack_nf4(codes, absmax, block), bias, f"bnb-nf4 b{block}")
    return PackedLinear(pack_float(layer.weight), bias, str(layer.weight.dtype).removeprefix("torch."))


def convert(layer: nn.Module) -> PackedLinear | str:
    """``layer``'s packed twin, or why it keeps its own path (:data:`spectoolkit.kernels.packing.Converter`)."""
    why = packable(layer)
    return why if why is not None else pack_layer(layer)


def pack_model(model: nn.Module, activations: str | None = None) -> dict[str, str]:
    """:func:`spectoolkit.kernels.packing.pack_model` with the formats of this package."""
    return packing.pack_model(model, convert, activations)
