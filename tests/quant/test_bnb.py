"""bitsandbytes LLM.int8 / NF4 on a tiny random Llama: loading, size, accuracy, lone-sequence forwards, batch
invariance."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from spectoolkit.checkpoints import resolve_checkpoint
from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels.kernel_choice import choose_kernels
from spectoolkit.quant.bnb import BnbConfig, RowwiseLinear8bitLt, load_bnb, load_quantized
from spectoolkit.quant.bnb_scales import scale_bytes
from spectoolkit.runtime.lone import lone_sequence

bnb = pytest.importorskip("bitsandbytes")

CPU = torch.device("cpu")
VOCAB = 256
HIDDEN = 64  # every projection is a multiple of 32 rows: the nf4 CPU kernel's packing block
NUM_LINEARS = 2 * 7  # 2 layers × (q, k, v, o, gate, up, down); lm_head stays float
BNB_LINEAR = {"int8": bnb.nn.Linear8bitLt, "nf4": bnb.nn.Linear4bit}
# Loose, measured-then-doubled bounds on random tiny weights (int8 ≈ 1% of the logit range, nf4 ≈ 10%).
MAX_REL_LOGIT_ERROR = {"int8": 0.05, "nf4": 0.3}
MIN_TOP1_AGREEMENT = {"int8": 0.85, "nf4": 0.6}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from spectoolkit.models.tiny import save_tiny_llama

    return save_tiny_llama(tmp_path_factory.mktemp("bnb") / "tiny", vocab_size=VOCAB, hidden=HIDDEN, scale=4.0)


@pytest.fixture(scope="module")
def fp32_model(checkpoint: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


@pytest.fixture(scope="module", params=["int8", "nf4"])
def quantized(request: pytest.FixtureRequest, checkpoint: Path) -> tuple[str, torch.nn.Module]:
    return request.param, load_quantized(resolve_checkpoint(str(checkpoint)), request.param, CPU, 64)


@pytest.fixture(scope="module")
def token_ids() -> torch.Tensor:
    return torch.randint(3, VOCAB, (1, 64), generator=torch.Generator().manual_seed(0))  # [1, T]


def _weight_bytes(model: torch.nn.Module) -> int:
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}  # tied weights once
    return sum(t.numel() * t.element_size() for t in tensors.values())


def test_linears_are_replaced_by_bnb_modules(quantized: tuple[str, torch.nn.Module]) -> None:
    kind, model = quantized
    assert sum(isinstance(m, BNB_LINEAR[kind]) for m in model.modules()) == NUM_LINEARS
    assert not model.training
    assert model.lm_head.weight.dtype == torch.float32  # transformers keeps the output head in float


def test_weights_are_smaller_than_fp32(quantized: tuple[str, torch.nn.Module], fp32_model: torch.nn.Module) -> None:
    kind, model = quantized
    linears = [m for n, m in fp32_model.named_modules() if isinstance(m, torch.nn.Linear) and "layers" in n]
    num_weights = sum(m.weight.numel() for m in linears)
    saved = _weight_bytes(fp32_model) - _weight_bytes(model)
    assert saved == num_weights * (3 if kind == "int8" else 3.5)  # 4 → 1 byte, 4 → ½ byte
    scales = scale_bytes(model)  # the absmax scales are attributes, not parameters or buffers
    if kind == "int8":
        assert scales == 4 * sum(m.out_features for m in linears)  # one fp32 per weight row
    else:
        assert scales * 64 / num_weights in (2, 4)  # one per block of 64: fp32, bf16 once repacked for CPU


def test_logits_close_to_fp32(
    quantized: tuple[str, torch.nn.Module], fp32_model: torch.nn.Module, token_ids: torch.Tensor
) -> None:
    kind, model = quantized
    with torch.inference_mode():
        reference = fp32_model(token_ids).logits[0]  # [T, V]
        logits = model(token_ids).logits[0]  # [T, V]
    assert logits.dtype == torch.float32 and logits.shape == reference.shape
    rel_error = (logits - reference).abs().max() / reference.abs().max()
    assert rel_error < MAX_REL_LOGIT_ERROR[kind]
    assert rel_error > 0  # the weights really are quantized
    agreement = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agreement >= MIN_TOP1_AGREEMENT[kind]


def test_lone_sequence_forwards_of_1_and_5_tokens(
    quantized: tuple[str, torch.nn.Module], token_ids: torch.Tensor
) -> None:
    _, model = quantized
    ids = token_ids[0].tolist()
    runner = lone_sequence(model)
    prompt_last = runner.forward(ids[:20], last_only=True)  # [V]
    assert prompt_last.shape == (VOCAB,) and runner.num_computed == 20
    verify = runner.forward(ids[20:25])  # [5, V]
    assert verify.shape == (5, VOCAB) and runner.num_computed == 25
    runner.truncate(20)
    assert runner.num_computed == 20
    assert torch.equal(runner.forward(ids[20:25]), verify)  # rollback + same tokens: same numbers
    runner.truncate(20)
    steps = torch.stack([runner.forward([token], last_only=True) for token in ids[20:25]])  # [5, V]
    assert runner.num_computed == 25
    # One-token and five-token forwards agree up to the float kernels' summation order (GEMMs of the
    # float head: no row-invariant kernels installed here); attention and int8 outliers are row-wise (see
    # the tests below).
    torch.testing.assert_close(steps, verify, rtol=1e-4, atol=1e-4)
    assert torch.equal(steps.argmax(-1), verify.argmax(-1))


def _first_int8_linear(model: torch.nn.Module) -> torch.nn.Module:
    return next(m for m in model.modules() if isinstance(m, (RowwiseLinear8bitLt, bnb.nn.Linear8bitLt)))


@pytest.fixture(scope="module")
def int8_model(checkpoint: Path) -> torch.nn.Module:
    return load_quantized(resolve_checkpoint(str(checkpoint)), "int8", CPU, 64)


def test_int8_rows_are_independent_without_outliers(int8_model: torch.nn.Module) -> None:
    layer = _first_int8_linear(int8_model)
    inputs = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(1)).clamp(-3, 3)  # [1, 5, K]
    with torch.inference_mode():
        batch = layer(inputs)  # [1, 5, N]
        rows = torch.cat([layer(inputs[:, i : i + 1]) for i in range(5)], dim=1)  # [1, 5, N]
    assert torch.equal(batch, rows)  # per-row int8 scales, exact int32 products


def test_int8_outlier_in_one_row_leaves_the_others_alone(
    int8_model: torch.nn.Module, fp32_model: torch.nn.Module
) -> None:
    """Per-row outlier columns: a k-token verify forward gives exactly what k decode steps give."""
    layer = _first_int8_linear(int8_model)
    assert isinstance(layer, RowwiseLinear8bitLt) and type(layer.layer) is bnb.nn.Linear8bitLt
    reference = fp32_model.model.layers[0].self_attn.q_proj  # the same projection in fp32
    inputs = torch.randn(1, 5, HIDDEN, generator=torch.Generator().manual_seed(2)).clamp(-3, 3)  # [1, 5, K]
    inputs[0, 0, 7] = 20.0  # above the 6.0 threshold: an outlier column of row 0 only
    with torch.inference_mode():
        batch = layer(inputs)  # [1, 5, N]
        rows = torch.cat([layer(inputs[:, i : i + 1]) for i in range(5)], dim=1)  # [1, 5, N]
        stock = layer.layer(inputs)  # bitsandbytes' own: outlier columns over all rows
        exact = reference(inputs)  # [1, 5, N]
    assert torch.equal(batch, rows)
    scale = exact.abs().max()
    # The outlier's own row: the same decomposition either way. Stock computes it inside a 5-row product,
    # so it may differ in the last bits only (the CPU's kernel for M = 5 is not the one for M = 1: seen
    # here, 5 fp32 ulps); every other row differs far more (column 7 left its int8 product too).
    own_row = (stock[:, 0] - rows[:, 0]).abs().max()
    other_rows = (stock[:, 1:] - rows[:, 1:]).abs().max()
    assert own_row <= 1e-6 * scale
    assert other_rows > 100 * max(own_row, 1e-7 * scale)
    assert (batch - exact).abs().max() < 0.05 * scale and (stock - exact).abs().max() < 0.05 * scale


def test_bnb_models_keep_the_stock_attention(quantized: tuple[str, torch.nn.Module]) -> None:
    """Nothing is swapped in at load: the stock forward stays the reference; the runners bring their attention."""
    model = quantized[1]
    assert model.config._attn_implementation == "sdpa"
    assert all("forward" not in layer.self_attn.__dict__ for layer in model.model.layers)


@pytest.mark.parametrize("kind", ["int8", "nf4"])
def test_a_verify_window_equals_decode_steps_on_a_lone_sequence(checkpoint: Path, token_ids: torch.Tensor,
                                                                 kind: str) -> None:  # fmt: skip
    """What the swapped-in row-wise attention used to guarantee, now the runner's: a lone sequence (eager runner,
    ``chosen`` rows) computes each verify row as the decode step at its position, so rounding activations to
    int8 / bf16 cannot amplify a difference between the two (float linears on the reference kernels)."""
    model = load_quantized(resolve_checkpoint(str(checkpoint)), kind, CPU, 64)
    choose_kernels(model, "reference")  # the float head (bitsandbytes int8 layers keep their row-wise forward)
    ids = token_ids[0].tolist()
    runner = lone_sequence(model)
    with torch.inference_mode():
        runner.forward(ids[:20], last_only=True)
        window = runner.forward(ids[20:25])  # [5, V]
        runner.truncate(20)
        steps = torch.cat([runner.forward([token]) for token in ids[20:25]])  # [5, V]
    assert torch.equal(window, steps), (window - steps).abs().max()


def test_int8_without_outliers_keeps_stock_linears(checkpoint: Path) -> None:
    model = load_bnb(resolve_checkpoint(str(checkpoint)), BnbConfig("int8", llm_int8_threshold=0.0), CPU)
    assert type(_first_int8_linear(model)) is bnb.nn.Linear8bitLt  # rows are independent already


def test_config_validation() -> None:
    assert BnbConfig("int8").compute_dtype == "fp32"
    with pytest.raises(SpecToolkitError, match="kind"):
        BnbConfig("int4")
    with pytest.raises(SpecToolkitError, match="compute_dtype"):
        BnbConfig("nf4", compute_dtype="fp16")
    with pytest.raises(SpecToolkitError, match="threshold"):
        BnbConfig("int8", llm_int8_threshold=-1.0)


def test_config_maps_to_transformers() -> None:
    int8 = BnbConfig("int8", llm_int8_threshold=4.0).to_transformers()
    assert int8.load_in_8bit and int8.llm_int8_threshold == 4.0
    nf4 = BnbConfig("nf4", compute_dtype="bf16").to_transformers()
    assert nf4.load_in_4bit and nf4.bnb_4bit_quant_type == "nf4" and nf4.bnb_4bit_compute_dtype == torch.bfloat16


def test_bad_precision_is_a_user_error(checkpoint: Path) -> None:
    with pytest.raises(SpecToolkitError, match="not one of int8, nf4"):
        load_quantized(resolve_checkpoint(str(checkpoint)), "fp8", CPU, 64)


def test_missing_bitsandbytes_is_a_user_error(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` raise ImportError
    with pytest.raises(SpecToolkitError, match="needs bitsandbytes"):
        load_quantized(resolve_checkpoint(str(checkpoint)), "nf4", CPU, 64)


@pytest.mark.parametrize("nested", [False, True])
def test_nf4_layers_are_repacked_for_our_kernel_with_exactly_their_weights(nested: bool) -> None:
    """A ``Linear4bit``'s codes and absmax become our nf4 panels: the packed weight is bitsandbytes' own
    dequantized weight bit for bit (its NF4 table is ours), nested absmax included, and the layer computes it."""
    import bitsandbytes.functional as bnb_functional

    from spectoolkit.kernels.cpu_linear import NF4, dequantized
    from spectoolkit.quant.packing import pack_layer, packable

    assert torch.equal(bnb_functional.get_4bit_type("nf4", device="cpu").float(), NF4)
    generator = torch.Generator().manual_seed(0)
    layer = bnb.nn.Linear4bit(128, 48, bias=True, compress_statistics=nested, quant_type="nf4",
                              compute_dtype=torch.float32)  # fmt: skip
    layer.weight = bnb.nn.Params4bit(torch.randn(48, 128, generator=generator), requires_grad=False,
                                     compress_statistics=nested, quant_type="nf4")  # fmt: skip
    layer.bias.data = torch.randn(48, generator=generator)
    layer = layer.to("cpu")  # quantizes
    assert packable(layer) is None and layer.weight.quant_state.nested == nested
    packed = pack_layer(layer)
    theirs = bnb_functional.dequantize_4bit(layer.weight.data, layer.weight.quant_state)  # [48, 128] fp32
    assert packed.kind == "nf4" and torch.equal(dequantized(packed.packed).float(), theirs)
    x = torch.randn(5, 128, generator=generator)
    torch.testing.assert_close(packed(x), x @ theirs.t() + layer.bias, rtol=1e-5, atol=1e-5)


def test_nf4_models_run_our_kernel_and_int8_keeps_bitsandbytes(checkpoint: Path, token_ids: torch.Tensor) -> None:
    import bitsandbytes.functional as bnb_functional

    from spectoolkit.kernels.cpu_linear import fully_packed
    from spectoolkit.quant.packing import pack_model

    nf4, dense = (
        load_quantized(resolve_checkpoint(str(checkpoint)), "nf4", CPU, 64),
        load_quantized(resolve_checkpoint(str(checkpoint)), "nf4", CPU, 64),
    )
    for name, module in list(dense.named_modules()):  # the reference: bitsandbytes' weights, in fp32 nn.Linear
        if isinstance(module, bnb.nn.Linear4bit):
            linear = torch.nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            linear.weight.data = bnb_functional.dequantize_4bit(module.weight.data, module.weight.quant_state)
            parent, _, leaf = name.rpartition(".")
            setattr(dense.get_submodule(parent), leaf, linear)
    report = pack_model(nf4)
    assert fully_packed(nf4) and report[f"bnb-nf4 b64 {HIDDEN}x{HIDDEN}"] == "packed", report
    with torch.inference_mode():  # same weights, fp32 both (bitsandbytes' own kernel here would compute in bf16)
        torch.testing.assert_close(nf4(token_ids).logits, dense(token_ids).logits, rtol=1e-4, atol=1e-4)
    int8 = load_quantized(resolve_checkpoint(str(checkpoint)), "int8", CPU, 64)
    assert set(pack_model(int8).values()) >= {"own path: RowwiseLinear8bitLt (its own kernel)"}
