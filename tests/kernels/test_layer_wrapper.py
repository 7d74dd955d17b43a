"""No patched library modules (kernels/layer_wrapper.py): a layer run our way is held by a wrapper module.

A loaded model of every precision is walked: no module instance may carry a ``forward`` of its own (the
class's is the one that runs) or a class built at run time (the mark of a ``__class__`` swap), and no class of
ours may subclass a library's layer. The wrapper keeps the layer's tensors and ``state_dict`` keys.
"""

from __future__ import annotations

import functools
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch
from torch import nn

from spectoolkit.kernels.kernel_choice import BY_NAME, ChunkedLinear, choose_kernels
from spectoolkit.models.tiny import save_tiny_llama, tiny_llama
from spectoolkit.wiring.loading import load_model
from tests.quant.test_gptq import gptq_cache, tiny_float, tiny_quantized  # noqa: F401  (the tiny GPTQ checkpoint)

CPU = torch.device("cpu")
LIBRARIES = ("transformers", "bitsandbytes", "gptqmodel")  # whose layers we hold, never subclass or patch


def patched_modules(model: nn.Module) -> list[str]:
    """Every module of ``model`` that is patched, and how (empty: none)."""
    found = []
    for name, module in model.named_modules():
        cls = type(module)
        if "forward" in vars(module):
            found.append(f"{name}: forward assigned on the instance")
        home = sys.modules.get(cls.__module__)
        try:
            defined = functools.reduce(getattr, cls.__qualname__.split("."), home)
        except AttributeError:
            defined = None
        if defined is not cls:
            found.append(f"{name}: class {cls.__qualname__} built at run time (a swapped __class__?)")
        if cls.__module__.startswith("spectoolkit") and any(
            base.__module__.split(".")[0] in LIBRARIES for base in cls.__mro__[1:]
        ):
            found.append(f"{name}: {cls.__qualname__} subclasses a library layer")
    return found


def test_the_walk_finds_a_patched_forward_and_a_swapped_class() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    assert patched_modules(model) == []
    model[0].forward = lambda x: x  # what kernel_choice.install did
    swapped = type("Swapped", (nn.Linear,), {})  # what quant.bnb.use_rowwise_int8 did
    model[1].__class__ = swapped
    assert len(patched_modules(model)) == 2


def test_a_wrapper_keeps_the_layers_tensors_and_state_dict_keys() -> None:
    model = tiny_llama(vocab_size=64)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied
    state = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    choose_kernels(model, "reference")
    assert isinstance(model.lm_head, ChunkedLinear) and model.lm_head.weight is model.model.embed_tokens.weight
    assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == state
    plain = tiny_llama(vocab_size=64, seed=5)
    plain.load_state_dict(model.state_dict())  # a wrapped model's checkpoint loads into a plain one ...
    model.load_state_dict(plain.state_dict())  # ... and back
    assert all(torch.equal(tensor, plain.state_dict()[name]) for name, tensor in model.state_dict().items())
    ids = torch.arange(3, 20)[None]
    with torch.inference_mode():  # the reference variant runs one row per call: equal up to the BLAS path
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=1e-5, atol=1e-6)


def test_install_never_changes_the_layer() -> None:
    layer = nn.Linear(8, 4)
    wrapper = ChunkedLinear(layer, BY_NAME["rows4"])
    assert "forward" not in vars(layer) and type(layer) is nn.Linear and wrapper.in_features == 8
    inputs = torch.randn(3, 8)
    assert torch.allclose(wrapper(inputs), layer(inputs), rtol=1e-5, atol=1e-6)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("walk") / "tiny", vocab_size=96, hidden=64, scale=4.0)


@pytest.mark.parametrize(
    ("precision", "kernels"),
    [("fp32", "auto"), ("fp32", "reference"), ("fp16", "auto"), ("rtn-int4", "auto"), ("rtn-int4", "reference"),
     ("nf4", "auto"), ("nf4", "reference"), ("int8", "auto")],
)  # fmt: skip
def test_no_loaded_model_has_a_patched_module(checkpoint: Path, precision: str, kernels: str) -> None:
    loaded = load_model(str(checkpoint), precision, CPU, group_size=32, kernels=kernels)
    assert patched_modules(loaded.model) == []


@pytest.mark.integration
def test_the_gguf_model_has_no_patched_module() -> None:
    assert patched_modules(load_model(None, "gguf", CPU).model) == []


@pytest.mark.skipif(find_spec("gptqmodel") is None, reason="GPTQModel is not installed")
@pytest.mark.parametrize("kernels", ["auto", "reference"])
def test_the_gptq_int4_model_has_no_patched_module(tiny_quantized: Path, kernels: str) -> None:  # noqa: F811
    assert patched_modules(load_model(str(tiny_quantized), "int4", CPU, kernels=kernels).model) == []
