"""Model path resolution and loading errors are clear SpecToolkitErrors."""

from __future__ import annotations

import pytest
import torch

from spectoolkit.checkpoints import resolve_path
from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels.cpu_linear import PackedLinear, fully_packed
from spectoolkit.kernels.kernel_choice import BY_NAME, ChunkedLinear, linear_layers
from spectoolkit.models import resolve_device
from spectoolkit.models.tiny import save_tiny_llama
from spectoolkit.wiring.loading import frequent_tokens, load_model, load_tokenizer


def test_resolve_path_errors(tmp_path, monkeypatch):
    with pytest.raises(SpecToolkitError, match="does not exist"):
        resolve_path(str(tmp_path / "missing"))
    with pytest.raises(SpecToolkitError, match="no config.json"):
        resolve_path(str(tmp_path))
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "try_to_load_from_cache", lambda *args, **kwargs: "/cache/config.json")
    assert resolve_path("org/name") == "org/name"  # a cached hub id is passed through


def test_load_tiny_checkpoint_at_each_precision(tmp_path):
    directory = save_tiny_llama(tmp_path / "tiny", vocab_size=96)
    for precision, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16), ("fp16", torch.float16)):
        loaded = load_model(str(directory), precision, torch.device("cpu"))
        assert next(loaded.model.parameters()).dtype == dtype
        assert loaded.vocab_size == 96 and loaded.weight_bytes() > 0
        if precision == "fp16":  # our kernel takes fp32/bf16 weights: fp16 keeps the measured row-invariant variants
            kept = {kind: why for kind, why in loaded.kernels.items() if why.startswith("own path")}
            assert kept and set(kept.values()) == {"own path: torch.float16 weights"}
            assert {why for kind, why in loaded.kernels.items() if kind not in kept} <= set(BY_NAME)
            assert all(isinstance(m, ChunkedLinear) for _, m in linear_layers(loaded.model))
        else:  # every linear (the tied head too) is packed for our kernel, in the checkpoint's dtype
            assert set(loaded.kernels.values()) == {"packed"} and len(loaded.kernels) == 5
            assert fully_packed(loaded.model) and not linear_layers(loaded.model)
            assert {m.data.dtype for m in loaded.model.modules() if isinstance(m, PackedLinear)} == {dtype}
    reference = load_model(str(directory), "fp32", torch.device("cpu"), kernels="reference")
    assert not fully_packed(reference.model) and set(reference.kernels.values()) == {"rows1"}
    plain = load_model(str(directory), "fp32", torch.device("cpu"), kernels=None)
    assert not plain.kernels and not any(isinstance(m, ChunkedLinear) for m in plain.model.modules())


def test_int8_activations_are_part_of_the_precision(tmp_path):
    directory = save_tiny_llama(tmp_path / "tiny", vocab_size=96)
    cpu = torch.device("cpu")
    plain = load_model(str(directory), "rtn-int4", cpu, group_size=32)
    a8 = load_model(str(directory), "rtn-int4", cpu, group_size=32, activations="int8")
    assert (plain.activations, plain.label) == ("float", "rtn-int4") and set(plain.kernels.values()) == {"packed"}
    assert (a8.activations, a8.label) == ("int8", "rtn-int4+a8")
    runs = {kind.split()[0]: why for kind, why in a8.kernels.items()}
    assert runs["rtn-int4"] == "packed, int8 activations"  # the head stays fp32: float activations, and why
    assert runs["float32"] == "packed, float activations: fp32 weights are not integer codes"
    ids = torch.tensor([[1, 5, 9, 3]])
    with torch.inference_mode():
        near, far = plain.model(ids).logits, a8.model(ids).logits
    assert not torch.equal(near, far) and torch.allclose(near, far, atol=0.05 * near.abs().max().item())
    reference = load_model(str(directory), "rtn-int4", cpu, group_size=32, kernels="reference", activations="int8")
    assert reference.label == "rtn-int4+a8"  # only our kernel computes integer dot products: packed regardless


def test_bad_precision_and_device():
    with pytest.raises(SpecToolkitError, match="precision"):
        load_model(None, "int3", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(SpecToolkitError, match="no CUDA device"):
            resolve_device("cuda")
    assert resolve_device("cpu").type == "cpu"


def test_int8_activation_logits_are_the_same_bits_on_every_path(tmp_path, monkeypatch):
    """A whole model, loaded once per kernel path this CPU runs (SPECTOOLKIT_ISA pins it), one row or five."""
    from spectoolkit.kernels import cpu_ops

    directory = save_tiny_llama(tmp_path / "tiny", vocab_size=96)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    logits = {}
    for path in cpu_ops.available_isas():
        monkeypatch.setenv("SPECTOOLKIT_ISA", path)
        loaded = load_model(str(directory), "rtn-int4", torch.device("cpu"), group_size=32, activations="int8")
        assert {m.isa for m in loaded.model.modules() if isinstance(m, PackedLinear)} == {cpu_ops.ISAS.index(path)}
        with torch.inference_mode():
            logits[path] = (loaded.model(ids).logits, loaded.model(ids[:, :1]).logits)
    first = logits["scalar"]
    for path, (five, one) in logits.items():
        assert torch.equal(five, first[0]) and torch.equal(one, first[1]), path
        assert torch.equal(one[0, 0], five[0, 0]), path  # a row alone is the row in company


@pytest.mark.parametrize("precision", ["fp32", "rtn-int4"])
def test_a_draft_head_cut_to_some_tokens_computes_their_logits(tmp_path, precision):
    """draft.head_vocab: the head keeps the given rows, cut before it is quantized (rtn-* with its head quantized
    too), and the logits are the whole head's at those ids (fp32: the same bits); gguf refuses."""
    directory = save_tiny_llama(tmp_path / "tiny", vocab_size=96)
    rows = torch.tensor([2, 5, 7, 40, 95])
    whole = load_model(str(directory), precision, torch.device("cpu"), quantize_head=precision != "fp32")
    cut = load_model(str(directory), precision, torch.device("cpu"), quantize_head=precision != "fp32", head_rows=rows)
    assert cut.vocab_size == len(rows) and torch.equal(cut.vocab_ids, rows) and whole.vocab_ids is None
    assert cut.weight_bytes() < whole.weight_bytes()
    ids = torch.tensor([[1, 9, 33, 4, 60]])
    full, kept = whole.model(input_ids=ids).logits[0, -1], cut.model(input_ids=ids).logits[0, -1]
    assert kept.shape == (len(rows),)
    assert torch.equal(kept, full[rows]) if precision == "fp32" else torch.allclose(kept, full[rows], atol=0.05)
    with pytest.raises(SpecToolkitError, match="float or rtn"):
        load_model(str(directory), "gguf", torch.device("cpu"), head_rows=rows)


def test_frequent_tokens_rank_the_calibration_text():
    """The head's rows: ascending ids, the end ids kept, the most frequent calibration tokens in (a space-led word
    and newlines in ShareGPT and code are), ids never seen in a small vocabulary only to fill up."""
    tokenizer = load_tokenizer(None)
    eos = frozenset({tokenizer.eos_token_id})
    ids = frequent_tokens(tokenizer, 512, len(tokenizer), eos)
    assert ids.tolist() == sorted(set(ids.tolist())) and tokenizer.eos_token_id in ids.tolist()
    assert len(ids) in (512, 513)
    common = tokenizer(" the\n")["input_ids"]
    assert set(common) <= set(ids.tolist())
