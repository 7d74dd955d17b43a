"""Pack a model's linears once, at load, into our CPU kernel's panels (DESIGN §7), and fuse sibling calls.

:func:`pack_model` walks the model's leaf linears (a wrapper, :mod:`spectoolkit.kernels.layer_wrapper`, counts as
one); ``convert`` (the weight formats' own code, e.g.
:func:`spectoolkit.quant.packing.convert`) turns each into a :class:`~spectoolkit.kernels.cpu_linear.PackedLinear`
or says why it keeps its own path. With int8 activations (issue 47) every packed int8/int4 layer is re-laid for
the integer dot products (:func:`~spectoolkit.kernels.cpu_linear.to_int8_activations`); a layer that cannot take
them (nf4, float, a K not a multiple of 32) keeps float activations, and the report says so. Then q/k/v and
gate/up become one call each (:func:`_fuse`), the parts views of it, and every packed buffer moves to huge-page
memory (:func:`~spectoolkit.kernels.placement.place_packed`). A model whose weights stream from memory has the
distance its linears prefetch at measured (:func:`~spectoolkit.kernels.prefetch.tune_for`, once per process). A new
weight kind or ISA path is added in this folder alone: the formats only hand over codes.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from spectoolkit.kernels.cpu_linear import (
    PANEL,
    PackedLinear,
    PackedWeight,
    float_layout,
    int8_activations_why,
    to_int8_activations,
    widen,
)
from spectoolkit.kernels.kernel_choice import library_layer
from spectoolkit.kernels.layer_wrapper import leaf_linears, replace_module
from spectoolkit.kernels.placement import place_packed
from spectoolkit.kernels.prefetch import tune_for

Converter = Callable[[nn.Module], "PackedLinear | str"]  # a leaf linear -> its packed twin, or why it keeps its path


def pack_model(model: nn.Module, convert: Converter, activations: str | None = None) -> dict[str, str]:
    """Replace every linear of ``model`` that ``convert`` packs by its packed twin (idempotent); with ``activations=
    "int8"`` its integer layers run integer dot products; None: as the layers packed already run (int8 if one does,
    so packing a model again keeps its records and integer layouts). Returns what each kind of layer runs:
    ``{"<source> <N>x<K>": "packed" | "packed, int8 activations" | "packed, float activations: <why>" |
    "own path: <why>"}``."""
    if activations is None:
        layers = [library_layer(module) for _, module in leaf_linears(model)]
        integer = any(isinstance(layer, PackedLinear) and layer.activations == "int8" for layer in layers)
        activations = "int8" if integer else "float"
    report: dict[str, str] = {}
    for name, module in leaf_linears(model):
        module = library_layer(module)  # a layer run as a measured variant is packed itself, its wrapper dropped
        shape = f"{module.out_features}x{module.in_features}"
        if not isinstance(module, PackedLinear):
            packed = convert(module)
            if isinstance(packed, str):
                report[f"{type(module).__name__} {shape}"] = f"own path: {packed}"
                continue
            replace_module(model, name, packed)
            module = packed
        report[f"{module.source} {shape}"] = _with_activations(module, activations)
    for layer in getattr(getattr(model, "model", None), "layers", []):
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is not None and not hasattr(attn, "qkv_fused"):
            _fuse(attn, "qkv_fused", ("q_proj", "k_proj", "v_proj"))
        if mlp is not None and not hasattr(mlp, "gate_up_fused"):
            _fuse(mlp, "gate_up_fused", ("gate_proj", "up_proj"))
    place_packed(packed_layers(model))
    tune_for(packed_bytes(model))
    return report


def packed_layers(model: nn.Module) -> list[PackedLinear]:
    """Every packed linear of ``model``: its modules, then the fused calls (not submodules: their parts are views)."""
    layers = [module for module in model.modules() if isinstance(module, PackedLinear)]
    for module in model.modules():
        for name in ("qkv_fused", "gate_up_fused"):
            if isinstance(module.__dict__.get(name), PackedLinear):
                layers.append(module.__dict__[name])
    return layers


def _with_activations(layer: PackedLinear, activations: str) -> str:
    """Re-lay ``layer`` for int8 activations when asked and it can; what it then runs (pack_model's report)."""
    if activations != "int8":
        if layer.packed.fmt:  # a format at its own size runs int8 activations only: the wide panels of its weight
            layer.set_packed(float_layout(layer.packed))
        return "packed"
    why = int8_activations_why(layer.packed)
    if why is not None:
        return f"packed, float activations: {why}"
    layer.set_packed(to_int8_activations(layer.packed))
    return "packed, int8 activations"


def _fuse(parent: nn.Module, name: str, parts: tuple[str, ...]) -> None:
    """One packed linear over ``parts`` (their panels end to end, one call), the parts becoming views of it.

    A column's result does not depend on the other columns of the call, so the fused call gives each part's
    bits; the parts keep working alone (the model's own forward), with no second copy of the weights."""
    layers = [getattr(parent, part, None) for part in parts]
    if not all(isinstance(layer, PackedLinear) for layer in layers):
        return
    first = layers[0]
    same = all(
        (layer.kind, layer.group, layer.in_features, layer.data.dim(), layer.fmt)
        == (first.kind, first.group, first.in_features, first.data.dim(), first.fmt)
        for layer in layers
    )
    if not same or any(layer.out_features % PANEL for layer in layers[:-1]):
        return
    if len({layer.bias is None for layer in layers}) > 1:
        return
    fields = [torch.cat([getattr(layer, field) for layer in layers]) for field in ("data", "scales", "zeros")]
    out_features = sum(layer.out_features for layer in layers)
    bias = None if first.bias is None else torch.cat([layer.bias for layer in layers])
    packed = PackedWeight(*fields, out_features, first.in_features, first.group, first.fmt)
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


def widen_formats(model: nn.Module) -> None:
    """Every format at its own size in ``model`` back to the wide int8-activation layout of before issue 55 (the fused
    calls too): the same weights and bits in more bytes, for measurements against the layout of before."""
    for layer in packed_layers(model):
        if layer.fmt:
            layer.set_packed(to_int8_activations(widen(layer.packed)))
    place_packed(packed_layers(model))


def packed_bytes(model: nn.Module) -> int:
    """Bytes the packed weights take (the stream a decode step reads)."""
    return sum(m.packed.nbytes() for m in model.modules() if isinstance(m, PackedLinear))
