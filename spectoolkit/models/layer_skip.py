"""A layer-skip self-draft: the target's own weights with decoder layers left out (issue 18).

Draft & Verify (Zhang et al., 2023), SWIFT (Xia et al., 2024) and LayerSkip (Elhoushi et al., 2024)
draft with a subset of the target's layers. The draft here is a second model object that **shares every
parameter** with the target (no weight copy) and runs the decoder layers in ``keep`` only; its attention
modules are its own shallow copies renumbered 0..len(keep)-1, so it has its own KV cache
(a paged pool) and the target's is never touched.
Exactness does not depend on the draft: verification is the target's (DESIGN §1).
"""

from __future__ import annotations

import copy

import torch

from spectoolkit.errors import SpecToolkitError


def kept_layers(num_layers: int, layers: tuple[int, ...] | None, skip_every: int | None) -> list[int]:
    """The decoder layers the draft runs: ``layers`` as given, else every layer but each ``skip_every``-th
    (indices skip_every-1, 2·skip_every-1, …); the first and last layer are always kept."""
    if layers:
        bad = [i for i in layers if not 0 <= i < num_layers]
        if bad:
            raise SpecToolkitError(f"draft.layers has {bad} outside the target's layers 0..{num_layers - 1}")
        keep = sorted(set(layers))
    else:
        every = skip_every or 2
        keep = [i for i in range(num_layers) if (i + 1) % every != 0 or i in (0, num_layers - 1)]
    if len(keep) == num_layers:
        raise SpecToolkitError(
            f"the layer-skip draft keeps all {num_layers} layers: it would be the target itself; "
            "set draft.skip_every >= 2 or list fewer draft.layers"
        )
    return keep


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    inner = getattr(model, "model", None)
    if inner is None or not isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
        raise SpecToolkitError(
            f"{type(model).__name__} has no model.layers: the layer-skip draft supports decoder-only HF models "
            "(Llama, Qwen, Mistral, SmolLM, ...)"
        )
    return inner


def _shallow(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``module`` sharing its parameters and buffers, with its own child table."""
    clone = copy.copy(module)
    clone._modules = dict(module._modules)
    return clone


def layer_skip_model(model: torch.nn.Module, keep: list[int]) -> torch.nn.Module:
    """A model object that shares ``model``'s weights and runs only its decoder layers ``keep``."""
    inner = _decoder(model)
    config = copy.deepcopy(model.config)
    text_config = config.get_text_config()
    layer_types = getattr(text_config, "layer_types", None)
    text_config.num_hidden_layers = len(keep)
    if isinstance(layer_types, list) and len(layer_types) == len(inner.layers):
        text_config.layer_types = [layer_types[i] for i in keep]
    layers = []
    for new_index, old_index in enumerate(keep):
        layer = _shallow(inner.layers[old_index])
        attention = _shallow(layer.self_attn)
        attention.layer_idx = new_index  # its slot in the draft's own KV cache
        layer._modules["self_attn"] = attention
        layers.append(layer)
    draft_inner = _shallow(inner)
    draft_inner._modules["layers"] = torch.nn.ModuleList(layers)
    draft_inner.config = text_config
    draft = _shallow(model)
    draft._modules["model"] = draft_inner
    draft.config = config
    return draft


def skip_name(draft: torch.nn.Module, target: torch.nn.Module, precision: str | None = None) -> str:
    """``skip-16of30``: the decoder layers a layer-skip draft runs, of the target's (``-rtn-int4``: of a
    quantized copy, ``draft.skip_precision``)."""
    name = f"skip-{len(_decoder(draft).layers)}of{len(_decoder(target).layers)}"
    return f"{name}-{precision}" if precision else name


def draft_model_name(draft_cfg, draft: torch.nn.Module, target: torch.nn.Module) -> str:
    """The drafter's name for a draft model or layer-skip draft (``draft_cfg``: a ``DraftConfig``, kind
    ``model`` or ``skip``), the same in batch-1 runs and serving."""
    if draft_cfg.kind == "skip":
        return skip_name(draft, target, draft_cfg.skip_precision)
    return draft_cfg.model_name
