"""GPTQ through GPTQModel: config checks, calibration text, checkpoint cache, loading, decoding.

The quantization tests run GPTQ for real, once, on a tiny 2-layer Llama (hidden 128) with a small
calibration set (seconds, after GPTQModel's import); the embedded SmolLM2 run is slow.
"""

from __future__ import annotations

import json
import shutil
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

from spectoolkit.checkpoints import resolve_checkpoint
from spectoolkit.errors import SpecToolkitError
from spectoolkit.quant import gptq
from spectoolkit.quant.gptq import GptqConfig, calibration_texts, is_gptq_checkpoint, load_quantized

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TINY_CFG = GptqConfig(bits=4, group_size=32, num_samples=16, max_length=64)  # a small calibration set

# find_spec, not importorskip: importing GPTQModel at collection would cost every test run seconds.
pytestmark = pytest.mark.skipif(find_spec("gptqmodel") is None, reason="GPTQModel is not installed")


@pytest.fixture(scope="module")
def tiny_float(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float tiny Llama (hidden 128: four groups of 32 per row) with the embedded tokenizer."""
    from spectoolkit.embedded import embedded_dir
    from spectoolkit.models.tiny import save_tiny_llama

    tokenizer_dir = embedded_dir()
    out = save_tiny_llama(tmp_path_factory.mktemp("gptq") / "tiny", vocab_size=49152, hidden=128, scale=4.0)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, out / name)
    return out


@pytest.fixture(scope="module")
def gptq_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gptq_cache")


@pytest.fixture
def cache_env(gptq_cache: Path, tiny_float: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Quantized checkpoints go to a per-module cache (tiny_float has already used the real one)."""
    monkeypatch.setenv("SPECTOOLKIT_CACHE", str(gptq_cache))
    return gptq_cache


@pytest.fixture(scope="module")
def tiny_quantized(tiny_float: Path, gptq_cache: Path) -> Path:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECTOOLKIT_CACHE", str(gptq_cache))
        return gptq.quantized_checkpoint(resolve_checkpoint(str(tiny_float)), TINY_CFG)


# --- config and calibration ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [{"bits": 3}, {"bits": 8}, {"group_size": 48}, {"group_size": 8}]
    + [{"num_samples": 0}, {"num_samples": 5000}, {"max_length": 4}],
)
def test_bad_config_raises(kwargs: dict) -> None:
    with pytest.raises(SpecToolkitError, match="gptq"):
        GptqConfig(**kwargs)


def test_calibration_texts_are_real_deterministic_and_mixed() -> None:
    texts = calibration_texts(6)
    assert texts == calibration_texts(6)
    assert len(texts) == 6 and all(len(text) > 50 for text in texts)
    assert all("def " in text for text in texts[1::2])  # HumanEval prompt + canonical solution
    assert not any(text.lstrip().startswith("def ") for text in texts[0::2])  # ShareGPT chats
    assert calibration_texts(7) == texts + calibration_texts(8)[6:7]  # an odd count ends on a chat


def test_calibration_is_disjoint_from_benchmark_prompts() -> None:
    from spectoolkit.config import WorkloadConfig
    from spectoolkit.workloads.prompts import load_workload

    bench = load_workload(WorkloadConfig(kind="sharegpt", num_prompts=64))
    texts = calibration_texts(64)
    assert not any(request.prompt in text for request in bench for text in texts[0::2])


def test_group_size_must_divide_layer_widths(tiny_float: Path, cache_env: Path) -> None:
    cfg = GptqConfig(group_size=256)  # hidden 128
    with pytest.raises(SpecToolkitError, match="group_size=128"):
        gptq.quantized_checkpoint(resolve_checkpoint(str(tiny_float)), cfg)


def test_bad_precision_raises(tiny_float: Path) -> None:
    with pytest.raises(SpecToolkitError, match="not a GPTQ precision"):
        load_quantized(resolve_checkpoint(str(tiny_float)), "rtn-int4", "cpu", 32)


def test_missing_hub_model_is_a_clear_error(cache_env: Path) -> None:
    # Offline: "not cached here and the hub cannot be reached"; online: "not a model on the hub".
    with pytest.raises(SpecToolkitError, match="'nobody-here/no-such-model' is not"):
        gptq.quantized_checkpoint(resolve_checkpoint("nobody-here/no-such-model"), TINY_CFG)


# --- checkpoints --------------------------------------------------------------------------------


def test_existing_checkpoint_detection(tmp_path: Path, tiny_float: Path) -> None:
    assert not is_gptq_checkpoint(tiny_float)
    by_quantize_config = tmp_path / "a"
    by_quantize_config.mkdir()
    (by_quantize_config / "quantize_config.json").write_text('{"bits": 4}')
    assert is_gptq_checkpoint(by_quantize_config)
    by_config = tmp_path / "b"
    by_config.mkdir()
    (by_config / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "gptq", "bits": 4}}))
    assert is_gptq_checkpoint(by_config)
    other = tmp_path / "c"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "bitsandbytes"}}))
    assert not is_gptq_checkpoint(other)


def test_quantized_checkpoint_is_gptq_and_cached(tiny_quantized: Path, gptq_cache: Path) -> None:
    assert tiny_quantized.parent == gptq_cache / "gptq"
    assert tiny_quantized.name.startswith("tiny-4b-g32-")
    settings = json.loads((tiny_quantized / "quantize_config.json").read_text())
    assert (settings["bits"], settings["group_size"], settings["sym"]) == (4, 32, False)
    assert (tiny_quantized / "quantize.log").is_file()  # GPTQModel's console output, not the user's terminal
    leftovers = [p.name for p in tiny_quantized.parent.iterdir() if p.name.startswith(".") and p.suffix != ".lock"]
    assert leftovers == []  # no temp dir left (the build's lock file stays: removing one is racy)


def test_cache_hit_does_not_requantize(
    tiny_quantized: Path, tiny_float: Path, cache_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def fail(*args, **kwargs):
        raise AssertionError("quantized again")

    monkeypatch.setattr(gptq, "_quantize", fail)
    assert gptq.quantized_checkpoint(resolve_checkpoint(str(tiny_float)), TINY_CFG) == tiny_quantized
    assert (
        gptq.quantized_checkpoint(resolve_checkpoint(str(tiny_quantized)), TINY_CFG) == tiny_quantized
    )  # already GPTQ: as is
    with pytest.raises(AssertionError, match="quantized again"):  # another config is another checkpoint
        gptq.quantized_checkpoint(resolve_checkpoint(str(tiny_float)), GptqConfig(group_size=64))


def test_failed_quantization_leaves_no_checkpoint(
    tiny_float: Path, cache_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_then_fail(source: Path, cfg: GptqConfig, out_dir: Path) -> None:
        (out_dir / "quantize_config.json").write_text("{}")
        raise RuntimeError("killed mid-way")

    monkeypatch.setattr(gptq, "_quantize", half_then_fail)
    cfg = GptqConfig(group_size=16, num_samples=4)
    with pytest.raises(RuntimeError, match="mid-way"):
        gptq.quantized_checkpoint(resolve_checkpoint(str(tiny_float)), cfg)
    assert not [p for p in (cache_env / "gptq").iterdir() if "-g16-" in p.name and p.suffix != ".lock"]


# --- loading and decoding -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model(tiny_quantized: Path) -> torch.nn.Module:
    return load_quantized(
        resolve_checkpoint(str(tiny_quantized)), "int4", torch.device("cpu"), 64
    )  # the checkpoint's 32 applies


def test_loaded_model_is_a_transformers_lm_with_gptq_linears(tiny_model: torch.nn.Module) -> None:
    from transformers import PreTrainedModel

    assert isinstance(tiny_model, PreTrainedModel) and not tiny_model.training
    q_proj = tiny_model.model.layers[0].self_attn.q_proj
    assert type(q_proj).__name__ == "TorchAtenLinear"  # torch's int4 matmul: nothing to JIT-compile
    assert tiny_model.dtype == torch.bfloat16


def test_stock_transformers_loads_our_checkpoint_with_the_same_weights(
    tiny_quantized: Path, tiny_model: torch.nn.Module
) -> None:
    """The stock baseline check's int4 side: our cached checkpoint through transformers' own GPTQ loading
    (optimum + GPTQModel, as a transformers user would load it) holds the very weights we load."""
    from spectoolkit.bench.protocol.stock_models import load_stock

    stock, description = load_stock(resolve_checkpoint(str(tiny_quantized)), "int4", 32, torch.device("cpu"))
    assert "optimum" in description and "gptqmodel" in description and "g32" in description, description
    ours_q, stock_q = tiny_model.model.layers[0].self_attn.q_proj, stock.model.layers[0].self_attn.q_proj
    assert stock_q.__class__.__module__.startswith("gptqmodel") and stock.dtype == torch.bfloat16
    prompt = torch.tensor([list(range(100, 116))])
    with torch.inference_mode():
        ours, theirs = tiny_model(input_ids=prompt).logits.float(), stock(input_ids=prompt).logits.float()
    torch.testing.assert_close(theirs, ours, atol=0.15, rtol=0.05)  # same weights; kernels may differ (bf16)
    assert ours_q.bits == stock_q.bits == 4


def _write_checkpoint(directory: Path, hidden: int, intermediate: int, settings: dict) -> Path:
    directory.mkdir()
    config = {"hidden_size": hidden, "intermediate_size": intermediate, "num_attention_heads": 4}
    (directory / "config.json").write_text(json.dumps(config))
    (directory / "quantize_config.json").write_text(json.dumps(settings))
    return directory


def test_cpu_backend_falls_back_to_plain_torch_where_aten_cannot(tmp_path: Path) -> None:
    """ATen's int4 matmul needs 4 bits and whole groups of 32..256; anything else dequantizes per call."""
    whole = _write_checkpoint(tmp_path / "whole", 576, 1536, {"bits": 4, "group_size": 64})
    partial = _write_checkpoint(tmp_path / "partial", 576, 1536, {"bits": 4, "group_size": 128})
    small = _write_checkpoint(tmp_path / "small", 576, 1536, {"bits": 4, "group_size": 16})
    eight = _write_checkpoint(tmp_path / "eight", 576, 1536, {"bits": 8, "group_size": 64})
    assert gptq._cpu_backend(whole) == "gptq_torch_aten"
    assert [gptq._cpu_backend(d) for d in (partial, small, eight)] == ["gptq_torch"] * 3


def test_cached_model_decodes_and_truncates(tiny_model: torch.nn.Module) -> None:
    from spectoolkit.runtime.lone import lone_sequence

    prompt = list(range(100, 120))
    cached = lone_sequence(tiny_model)
    cached.forward(prompt, last_only=True)
    one = cached.forward([7])  # [1, V]
    five = cached.forward([8, 9, 10, 11, 12])  # [5, V]
    assert one.shape == (1, 49152) and five.shape == (5, 49152) and cached.num_computed == 26
    cached.truncate(21)  # reject the five: the next forward overwrites their slots
    again = cached.forward([8, 9, 10, 11, 12])
    torch.testing.assert_close(again, five)
    # Incremental logits equal one full forward over the same tokens (bf16: loose tolerance).
    with torch.inference_mode():
        full = tiny_model(input_ids=torch.tensor([prompt + [7, 8, 9, 10, 11, 12]])).logits[0, -5:]
    torch.testing.assert_close(five.float(), full.float(), atol=0.15, rtol=0.05)


def test_gptq_layers_are_repacked_for_our_kernel_with_exactly_their_weights(tiny_quantized: Path) -> None:
    """Every GPTQ layer becomes our int4 panels holding GPTQModel's own dequantized weights bit for bit, and the
    packed model computes what GPTQModel's kernel does (up to its bf16 rounding)."""
    from spectoolkit.kernels.cpu_linear import PackedLinear, dequantized, fully_packed
    from spectoolkit.quant.gptq_codes import is_gptq_layer
    from spectoolkit.quant.packing import pack_layer, pack_model, packable

    model = load_quantized(resolve_checkpoint(str(tiny_quantized)), "int4", torch.device("cpu"), 64)
    own = load_quantized(
        resolve_checkpoint(str(tiny_quantized)), "int4", torch.device("cpu"), 64
    )  # GPTQModel's kernel, unpacked
    layers = [module for module in model.modules() if is_gptq_layer(module)]
    assert len(layers) == 2 * 7
    for layer in layers:
        assert packable(layer) is None
        ours = dequantized(pack_layer(layer).packed)  # [N, K] fp64: (u - 8)·scale + zero
        assert torch.equal(ours.to(layer.scales.dtype), layer.dequantize_weight().t()), layer.name
        assert torch.equal(ours, ours.float().double())  # exact in fp32: (q - z)·scale needs no rounding
    report = pack_model(model)
    assert fully_packed(model) and report["gptq-int4 g32 128x128"] == "packed", report
    assert isinstance(model.model.layers[0].mlp.gate_up_fused, PackedLinear)
    prompt = torch.tensor([list(range(100, 116))])
    with torch.inference_mode():
        ours, theirs = model(input_ids=prompt).logits.float(), own(input_ids=prompt).logits.float()
    torch.testing.assert_close(ours, theirs, atol=0.15, rtol=0.05)  # same weights; their kernel rounds x to bf16


def test_gptq_layers_keep_their_own_size_with_exactly_the_wide_layouts_weights_and_bits(tiny_quantized: Path) -> None:
    """Issue 55: GPTQModel's own layers (bf16 scales on the CPU) become gptq-int4-g32 records at the checkpoint's bytes,
    which widen to exactly the wide int4 layout of the same codes and give its bits through the kernel."""
    from spectoolkit.kernels.cpu_linear import linear, pack_int4_codes, to_int8_activations, widen
    from spectoolkit.quant.gptq_codes import int4_codes, is_gptq_layer, to_records

    model = load_quantized(resolve_checkpoint(str(tiny_quantized)), "int4", torch.device("cpu"), 64)
    generator = torch.Generator().manual_seed(0)
    for layer in (module for module in model.modules() if is_gptq_layer(module)):
        x = torch.randn(5, layer.in_features, generator=generator)
        packed, wide = to_records(layer), to_int8_activations(pack_int4_codes(*int4_codes(layer)))
        stored = sum(t.numel() * t.element_size() for t in (layer.qweight, layer.qzeros, layer.scales))
        assert packed.fmt == "gptq-int4-g32"
        assert packed.nbytes() * layer.out_features == stored * packed.data.shape[0] * 16  # panels of 16 columns
        for field in ("data", "scales", "zeros"):
            assert torch.equal(getattr(widen(packed), field), getattr(wide, field)), field
        assert torch.equal(linear(x, packed), linear(x, wide)), layer.name


def test_gptq_layers_the_bits_do_not_allow_keep_their_path_and_say_why(tiny_quantized: Path) -> None:
    from spectoolkit.quant.gptq_codes import unpackable

    model = load_quantized(resolve_checkpoint(str(tiny_quantized)), "int4", torch.device("cpu"), 64)
    attn = model.model.layers[0].self_attn
    attn.q_proj.g_idx = attn.q_proj.g_idx.flip(0)  # act-order: groups are no longer runs of columns
    assert "act-order" in unpackable(attn.q_proj)
    with torch.inference_mode():
        attn.k_proj(torch.zeros(1, attn.k_proj.in_features, dtype=torch.bfloat16))  # converts to torch's layout
    assert "layout" in unpackable(attn.k_proj)


def _rtn_int4(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """Round-to-nearest asymmetric int4 with a scale and zero per group: GPTQ without error feedback."""
    rows, cols = weight.shape
    groups = weight.reshape(rows, cols // group_size, group_size)
    low, high = groups.amin(-1, keepdim=True).clamp(max=0), groups.amax(-1, keepdim=True).clamp(min=0)
    scale = (high - low).clamp(min=1e-8) / 15
    zero = torch.round(-low / scale)
    return ((torch.clamp(torch.round(groups / scale) + zero, 0, 15) - zero) * scale).reshape(rows, cols)


def test_gptq_beats_round_to_nearest_on_held_text(tiny_model: torch.nn.Module, tiny_float: Path) -> None:
    """GPTQ's error feedback: lower logit error than RTN with the same bits/groups, on text it never saw."""
    from spectoolkit.config import WorkloadConfig
    from spectoolkit.wiring.loading import load_model, load_tokenizer
    from spectoolkit.workloads.prompts import load_workload

    tokenizer = load_tokenizer(str(tiny_float))
    chats = load_workload(WorkloadConfig(kind="sharegpt", num_prompts=3))  # the start: not calibration text
    reference = load_model(str(tiny_float), "fp32", torch.device("cpu"), kernels=None).model
    rtn = load_model(str(tiny_float), "fp32", torch.device("cpu"), kernels=None).model
    with torch.no_grad():
        for name, module in rtn.named_modules():
            if isinstance(module, torch.nn.Linear) and name != "lm_head":
                module.weight.copy_(_rtn_int4(module.weight, TINY_CFG.group_size))
    errors = {"gptq": [], "rtn": []}
    with torch.inference_mode():
        for chat in chats:
            ids = torch.tensor([tokenizer(chat.prompt + (chat.reference or "")).input_ids[:96]])
            ref_logits = reference(input_ids=ids).logits[0].float()  # [96, V]
            for label, model in (("gptq", tiny_model), ("rtn", rtn)):
                errors[label].append(model(input_ids=ids).logits[0].float() - ref_logits)
            errors.setdefault("ref", []).append(ref_logits)
    relative = {k: torch.cat(errors[k]).norm().item() / torch.cat(errors["ref"]).norm().item() for k in ("gptq", "rtn")}
    assert relative["gptq"] < 0.95 * relative["rtn"], relative
    assert relative["gptq"] < 0.15, relative  # a working 4-bit model, not a broken one (random logits: ~1.4)


def test_float_path_is_quantized_then_loaded(
    tiny_quantized: Path, tiny_float: Path, cache_env: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Path] = []
    real = gptq.quantized_checkpoint
    monkeypatch.setattr(gptq, "quantized_checkpoint", lambda path, cfg: seen.append(real(path, cfg)) or seen[-1])
    monkeypatch.setattr(gptq, "_quantize", lambda *args: pytest.fail("quantized again"))
    # load_quantized's calibration defaults are TINY_CFG's here, so its checkpoint is the cached one.
    small = {"num_samples": TINY_CFG.num_samples, "max_length": TINY_CFG.max_length}
    monkeypatch.setattr(gptq, "GptqConfig", lambda **kwargs: GptqConfig(**small, **kwargs))
    model = load_quantized(resolve_checkpoint(str(tiny_float)), "int4", "cpu", 32)
    assert seen == [tiny_quantized]
    assert model.config.num_hidden_layers == 2


@pytest.mark.slow
@pytest.mark.integration
def test_embedded_model_int4_agrees_with_fp32() -> None:
    """Real GPTQ of SmolLM2-135M (minutes on 2 cores the first time, then cached)."""
    from spectoolkit.config import WorkloadConfig
    from spectoolkit.runtime.lone import lone_sequence
    from spectoolkit.wiring.loading import load_model, load_tokenizer
    from spectoolkit.workloads.prompts import load_workload

    tokenizer = load_tokenizer(None)
    chats = load_workload(WorkloadConfig(kind="sharegpt", num_prompts=10))  # the start: not calibration text
    held = [r.prompt + "\n" + (r.reference or "") for r in chats]
    ids = [row for row in (tokenizer(text).input_ids[:100] for text in held) if len(row) == 100][:3]
    reference = lone_sequence(load_model(None, "fp32", torch.device("cpu")).model)
    quantized = lone_sequence(load_quantized(resolve_checkpoint(None), "int4", torch.device("cpu"), 64))
    agree = []
    for row in ids:
        reference.reset()
        quantized.reset()
        agree.append(reference.forward(row).argmax(-1) == quantized.forward(row).argmax(-1))
    assert torch.cat(agree).float().mean() >= 0.75


@pytest.mark.parametrize("kv", ["auto", "int8", "int4"])
def test_gptq_verify_forward_equals_decode_steps_bit_for_bit(tiny_quantized: Path, kv: str) -> None:
    """GPTQModel's int4 kernel under the chosen row-invariant variant: k-row verify = k decode steps."""
    from spectoolkit.wiring.loading import load_model
    from tests.kernels.test_kernel_choice import verify_and_steps

    loaded = load_model(str(tiny_quantized), "int4", torch.device("cpu"), kernels="auto")
    window, steps = verify_and_steps(loaded.model, kv)
    assert torch.equal(window, steps), (loaded.kernels, (window.float() - steps.float()).abs().max())
