"""GGUF at its own precision (spectoolkit/quant/gguf_native.py): ``+target=gguf`` on the embedded SmolLM2 GGUF.

Every linear, the tied head included, runs our kernel on the file's own quantized tensor: its weight is
``gguf_codes.dequantized_fp32`` of that tensor (q/k in HF row order) and, independently of our name map and row
permutation, the float weight transformers' conversion wrote. Greedy speculation at two verify widths gives the
target-alone output token for token (the exact reference is the target at this precision); a checkpoint that no
GGUF file backs is one error; a tensor type we do not take keeps its float path and says so in the kernel report.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spectoolkit.embedded import embedded_dir, gguf_path, gguf_source
from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels.cpu_linear import PackedLinear, dequantized, fully_packed
from spectoolkit.pair import PAIR, not_assembled
from spectoolkit.quant import gguf_codes, gguf_native
from spectoolkit.quant.gguf_native import TensorReader, hf_rows, linear_tensors
from spectoolkit.wiring.loading import load_model
from tests.integration import embedded
from tests.test_config import _run_config

pytestmark = pytest.mark.integration
CPU = torch.device("cpu")
PROMPTS = ("Write a Python function that reverses a string.", "List three tips for writing clear emails.")
MAX_NEW = 16


@pytest.fixture(scope="module")
def reader() -> TensorReader:
    return TensorReader(gguf_path())


@pytest.fixture(scope="module")
def converted() -> nn.Module:
    """The embedded model as transformers converted it (fp32 ``nn.Linear`` weights, nothing packed)."""
    return load_model(None, "fp32", CPU, kernels=None).model


def _linears(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if hasattr(m, "in_features") and not any(m.children())}


def test_the_conf_files_select_the_gguf_precision() -> None:
    assert _run_config("+target=gguf").target.precision == "gguf"
    draft = _run_config("+draft=gguf").draft
    assert (draft.kind, draft.precision) == ("model", "gguf")


def test_every_linear_runs_its_gguf_tensor_exactly(reader, converted) -> None:
    loaded = embedded.model("gguf")
    model = loaded.model
    assert fully_packed(model) and loaded.precision == "gguf"
    assert model.get_input_embeddings().weight.dtype == torch.float32  # the tied embedding stays the float table
    tensors = linear_tensors(converted, reader)
    floats = _linears(converted)
    layers = _linears(model)
    assert layers.keys() == floats.keys() == tensors.keys()
    for name, layer in layers.items():
        tensor, rows = tensors[name]
        assert isinstance(layer, PackedLinear) and layer.source == f"gguf {gguf_codes.gguf_type_name(tensor)}", name
        weight = dequantized(layer.packed).float()  # [N, K]
        assert torch.equal(weight, gguf_codes.dequantized_fp32(tensor, rows)), name
        assert torch.equal(weight, floats[name].weight), name  # transformers' conversion: an independent oracle
    assert tensors["lm_head"][0].name == "token_embd.weight"  # tied: the head from the embedding's Q8_0 codes
    assert layers["lm_head"].source == "gguf Q8_0"
    assert set(loaded.kernels.values()) == {"packed, int8 activations"}  # nothing kept in float; gguf's default
    assert loaded.label == "gguf+a8" and all(layer.activations == "int8" for layer in layers.values())


def test_llamas_q_and_k_rows_are_permuted_back(reader, converted) -> None:
    config = converted.config
    tensors = {t.name: t for t in reader.tensors}
    for part, heads in (("attn_q", config.num_attention_heads), ("attn_k", config.num_key_value_heads)):
        tensor = tensors[f"blk.0.{part}.weight"]
        rows = hf_rows("llama", tensor.name, config, int(tensor.shape[1]))
        assert sorted(rows.tolist()) == list(range(int(tensor.shape[1]))) and rows.numel() == heads * 64
        projection = converted.model.layers[0].self_attn.get_submodule(f"{part[-1]}_proj")
        assert torch.equal(gguf_codes.dequantized_fp32(tensor, rows), projection.weight)
        assert not torch.equal(gguf_codes.dequantized_fp32(tensor), projection.weight)  # the order matters
    assert hf_rows("qwen2", "blk.0.attn_q.weight", config, 576) is None  # transformers permutes llama only


@pytest.mark.parametrize("gamma", [1, 4])
def test_greedy_speculation_equals_the_gguf_target_alone(gamma: int) -> None:
    _, baseline, spec = embedded.greedy_engines("gguf", "gguf", "auto", "auto", gamma)
    embedded.assert_greedy_identical(baseline, spec, PROMPTS, MAX_NEW, f"γ={gamma}")


def test_a_checkpoint_no_gguf_backs_is_one_error(tiny_checkpoint) -> None:
    assert gguf_source(tiny_checkpoint) is None and gguf_source(embedded_dir()) == gguf_path()
    with pytest.raises(SpecToolkitError, match="not GGUF-backed.*model.target_path"):
        load_model(str(tiny_checkpoint), "gguf", CPU)


def test_a_tensor_we_do_not_take_keeps_its_float_path_and_says_so(monkeypatch) -> None:
    real = TensorReader(gguf_path())
    head = next(t for t in real.tensors if t.name == "token_embd.weight")
    as_f32 = gguf_codes.dequantized_fp32(head).numpy()  # the head's weights as an F32 tensor: not a quantized one
    real.tensors[real.tensors.index(head)] = head._replace(tensor_type=gguf_codes.Type.F32, data=as_f32)
    monkeypatch.setattr(gguf_native, "TensorReader", lambda path: real)
    loaded = load_model(None, "gguf", CPU)
    kept = [key for key in loaded.kernels if "kept float" in key]  # what conditions.kernels records
    assert kept == [f"{loaded.model.lm_head.source} 49152x576"], loaded.kernels  # the converted float head, packed
    assert kept[0].startswith("gguf F32 kept float (gguf F32 is a float tensor") and loaded.model.lm_head.kind == "fp32"
    assert loaded.model.model.layers[0].mlp.up_proj.source == "gguf Q4_1"
    assert torch.equal(dequantized(loaded.model.lm_head.packed).float(), torch.from_numpy(as_f32))


@pytest.mark.slow
@pytest.mark.parametrize("name", [model.name for model in PAIR])
def test_the_pairs_linears_run_their_gguf_tensors_exactly(name: str) -> None:
    if not_assembled(name):
        pytest.skip(f"{name} is not assembled (make pair)")
    floats = _linears(load_model(name, "fp32", CPU, kernels=None).model)
    loaded = load_model(name, "gguf", CPU, kernels=None)
    layers = _linears(loaded.model)
    assert layers.keys() == floats.keys() and fully_packed(loaded.model)
    for layer_name, layer in layers.items():
        assert layer.source.startswith("gguf "), layer_name
        assert torch.equal(dequantized(layer.packed).float(), floats[layer_name].weight), layer_name
