"""Wrapper modules: a library's layer held, and run by a forward of ours — never a patched instance.

Where a linear of transformers or bitsandbytes must run rows our way (a measured row-invariant variant,
:mod:`spectoolkit.kernels.kernel_choice`; LLM.int8 per row, :mod:`spectoolkit.quant.bnb`), the model's
attribute is set to a :class:`LayerWrapper` holding the library's layer as its child ``layer``. Nothing of the
library's instance changes (no ``forward`` or ``__class__`` assigned), its parameters are the same tensors (tied
weights stay tied), and the wrapper reads as the layer it holds: ``weight``, ``in_features``, ... come from
``layer``, and ``state_dict`` keys are the layer's own (``q_proj.weight``, not ``q_proj.layer.weight``), so a
checkpoint saved from a wrapped model loads into a plain one and back.
"""

from __future__ import annotations

from torch import nn

INNER = "layer"  # the child that holds the library's layer


class LayerWrapper(nn.Module):
    """Holds a library ``layer`` (child ``layer``); subclasses give the forward."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer
        self.register_state_dict_post_hook(_drop_inner_prefix)
        self.register_load_state_dict_pre_hook(_add_inner_prefix)

    def __getattr__(self, name: str):
        """The layer's attributes (``weight``, ``bias``, ``in_features``, ...) read through the wrapper."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if INNER not in modules:
                raise
            return getattr(modules[INNER], name)


def _drop_inner_prefix(module: LayerWrapper, state: dict, prefix: str, local_metadata: dict) -> None:
    """state_dict hook: ``<prefix>layer.<key>`` saved as ``<prefix><key>`` (the layer's own key)."""
    inner = f"{prefix}{INNER}."
    for key in [key for key in state if key.startswith(inner)]:
        state[prefix + key[len(inner) :]] = state.pop(key)


def _add_inner_prefix(module: LayerWrapper, state: dict, prefix: str, *args) -> None:
    """load_state_dict pre-hook: the layer's own keys (``<prefix><key>``) go to ``<prefix>layer.<key>``."""
    inner = f"{prefix}{INNER}."
    for key in [key for key in state if key.startswith(prefix) and not key.startswith(inner)]:
        state[inner + key[len(prefix) :]] = state.pop(key)  # the wrapper holds nothing but the layer


def replace_module(model: nn.Module, name: str, module: nn.Module) -> None:
    """Set ``model``'s submodule at dotted ``name`` to ``module``."""
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, module)


def leaf_linears(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The linear layers of ``model`` as it runs them: modules with ``in_features`` and no children, and wrappers
    (never the library layer inside one)."""
    found: list[tuple[str, nn.Module]] = []
    inside: tuple[str, ...] = ()
    for name, module in model.named_modules():
        if inside and name.startswith(inside):
            continue
        if isinstance(module, LayerWrapper):
            found.append((name, module))
            inside = (f"{name}.",) if name else ("",)
        elif hasattr(module, "in_features") and not any(True for _ in module.children()):
            found.append((name, module))
    return found
