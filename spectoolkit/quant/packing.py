"""Pack a loaded model's linears once, at load, into our CPU kernel's panels (DESIGN §7).

Every CPU linear our kernel runs becomes a :class:`~spectoolkit.kernels.cpu_linear.PackedLinear`: float
``nn.Linear`` (fp32 or bf16 weights, kept in their dtype) and RTN layers (int8/int4, any group size
that divides K, or per channel) from their canonical codes, and GPTQModel's 4-bit GPTQ layers from
their codes (:mod:`spectoolkit.quant.gptq_codes`), bitsandbytes NF4 layers likewise
(:mod:`spectoolkit.quant.bnb_codes`): the same weights exactly. The original weight is dropped, except a
tied output embedding, which stays as the input embedding. Layers the kernel cannot take keep their own
path, and :func:`pack_model` says which and why: bitsandbytes LLM.int8 (it quantizes activations too),
GPTQ with act-order or other bit widths, fp16 weights, and anything off the CPU.
The model's own forward then runs our kernels too, so every user of the model (runners, drafters,
lm-eval) computes one numerics.
"""

from __future__ import annotations

import torch
from torch import nn

from spectoolkit.kernels.cpu_linear import (
    FLOAT_DTYPES,
    PANEL,
    PackedLinear,
    PackedWeight,
    pack_float,
    pack_int4_codes,
    pack_nf4,
    pack_rtn,
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
    if isinstance(layer, RtnLinear):
        return PackedLinear(pack_rtn(layer.quantized()), bias, f"rtn-int{layer.bits} g{layer.group_size}")
    if gptq_codes.is_gptq_layer(layer):
        codes, scales, zeros, group = gptq_codes.int4_codes(layer)
        return PackedLinear(pack_int4_codes(codes, scales, zeros, group), bias, f"gptq-int4 g{group}")
    if bnb_codes.is_nf4_layer(layer):
        codes, absmax, block = bnb_codes.nf4_codes(layer)
        return PackedLinear(pack_nf4(codes, absmax, block), bias, f"bnb-nf4 b{block}")
    return PackedLinear(pack_float(layer.weight), bias, str(layer.weight.dtype).removeprefix("torch."))


def pack_model(model: nn.Module) -> dict[str, str]:
    """Replace every linear of ``model`` our kernel takes by its packed twin (idempotent); returns what each
    kind of layer runs: ``{"<source> <N>x<K>": "packed" | "own path: <why>"}``."""
    report: dict[str, str] = {}
    for name, module in list(model.named_modules()):
        if not hasattr(module, "in_features") or any(module.children()):
            continue
        shape = f"{module.out_features}x{module.in_features}"
        if isinstance(module, PackedLinear):
            report[f"{module.source} {shape}"] = "packed"
            continue
        why = packable(module)
        if why is not None:
            report[f"{type(module).__name__} {shape}"] = f"own path: {why}"
            continue
        packed = pack_layer(module)
        report[f"{packed.source} {shape}"] = "packed"
        parent, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, leaf, packed)
    for layer in getattr(getattr(model, "model", None), "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is not None and not hasattr(attn, "qkv_fused"):
            _fuse(attn, "qkv_fused", ("q_proj", "k_proj", "v_proj"))
        if mlp is not None and not hasattr(mlp, "gate_up_fused"):
            _fuse(mlp, "gate_up_fused", ("gate_proj", "up_proj"))
    return report


def _fuse(parent: nn.Module, name: str, parts: tuple[str, ...]) -> None:
    """One packed linear over ``parts`` (their panels end to end, one call), the parts becoming views of it.

    A column's result does not depend on the other columns of the call, so the fused call gives each part's
    bits; the parts keep working alone (the model's own forward), with no second copy of the weights."""
    layers = [getattr(parent, part, None) for part in parts]
    if not all(isinstance(layer, PackedLinear) for layer in layers):
        return
    first = layers[0]
    same = all(
        (layer.kind, layer.group, layer.in_features) == (first.kind, first.group, first.in_features) for layer in layers
    )
    if not same or any(layer.out_features % PANEL for layer in layers[:-1]):
        return
    if len({layer.bias is None for layer in layers}) > 1:
        return
    fields = [torch.cat([getattr(layer, field) for layer in layers]) for field in ("data", "scales", "zeros")]
    out_features = sum(layer.out_features for layer in layers)
    bias = None if first.bias is None else torch.cat([layer.bias for layer in layers])
    packed = PackedWeight(*fields, out_features, first.in_features, first.group)
    fused = PackedLinear(packed, bias, f"{first.source} fused {'+'.join(parts)}")
    fused.splits = [layer.out_features for layer in layers]
    panel = 0
    for layer in layers:
        panels = -(-layer.out_features // PANEL)
        for field in ("data", "scales", "zeros"):
            if getattr(layer, field).numel():
                setattr(layer, field, getattr(fused, field)[panel : panel + panels])
        panel += panels
    object.__setattr__(parent, name, fused)  # not a submodule: its buffers are the parts' (no double count)


def packed_bytes(model: nn.Module) -> int:
    """Bytes the packed weights take (the stream a decode step reads)."""
    return sum(m.packed.nbytes() for m in model.modules() if isinstance(m, PackedLinear))
