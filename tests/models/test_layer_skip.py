"""The layer-skip self-draft (issue 18): the target's layers, shared, its own KV; speculation stays exact."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from spectoolkit.config import SamplingConfig, run_config_from_dict
from spectoolkit.drafting import ModelDrafter
from spectoolkit.engine import BaselineEngine, SpeculativeEngine
from spectoolkit.errors import SpecToolkitError
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.models.cached import CachedModel
from spectoolkit.models.layer_skip import kept_layers, layer_skip_model, skip_name
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.sampling import GreedyChooser, make_chooser
from spectoolkit.verify import GreedyVerifier
from tests.engine.test_stochastic_engine import PASS_P, PROMPT, _two_sample_pvalue

VOCAB = 64
EOS_IDS = frozenset({2})


def test_kept_layers_rules():
    assert kept_layers(8, (), 2) == [0, 2, 4, 6, 7]  # every 2nd left out, the last kept
    assert kept_layers(9, (), 3) == [0, 1, 3, 4, 6, 7, 8]
    assert kept_layers(30, (), 2) == [0, *range(2, 30, 2), 29]
    assert kept_layers(6, (5, 0, 3, 3), 2) == [0, 3, 5]
    with pytest.raises(SpecToolkitError, match="outside the target's layers"):
        kept_layers(6, (0, 6), 2)
    with pytest.raises(SpecToolkitError, match="keeps all 2 layers"):
        kept_layers(2, (), 2)  # first and last: nothing left out


def _reference(model: torch.nn.Module, keep: list[int]) -> torch.nn.Module:
    """The same computation from scratch: a deep copy with the other layers deleted."""
    ref = copy.deepcopy(model)
    ref.model.layers = torch.nn.ModuleList([ref.model.layers[i] for i in keep])
    ref.config.num_hidden_layers = len(keep)
    for index, layer in enumerate(ref.model.layers):
        layer.self_attn.layer_idx = index
    return ref


@torch.inference_mode()
def test_skip_model_shares_weights_and_runs_only_the_kept_layers():
    target = tiny_llama(vocab_size=VOCAB, num_layers=5, scale=3.0)
    keep = kept_layers(5, (), 2)  # [0, 2, 4]
    before = target(input_ids=torch.tensor([[5, 6, 7, 8]])).logits
    draft = layer_skip_model(target, keep)
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(draft(input_ids=ids).logits, _reference(target, keep)(input_ids=ids).logits)
    assert not torch.allclose(draft(input_ids=ids).logits, before)  # it is not the target
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    assert {p.data_ptr() for p in draft.parameters()} <= target_ptrs  # no weight copied
    assert [layer.self_attn.layer_idx for layer in target.model.layers] == [0, 1, 2, 3, 4]  # target untouched
    assert target.config.num_hidden_layers == 5 and draft.config.num_hidden_layers == 3
    torch.testing.assert_close(target(input_ids=ids).logits, before)
    assert skip_name(draft, target) == "skip-3of5"


@torch.inference_mode()
def test_skip_draft_kv_cache_is_its_own_and_rolls_back():
    """Incremental forwards with a rollback equal a fresh forward (the KV rule), and the draft's cache
    has one slot per kept layer while the target's cache is not written by the draft."""
    target = tiny_llama(vocab_size=VOCAB, num_layers=4, scale=3.0)
    draft = CachedModel(layer_skip_model(target, [0, 3]))
    assert draft.num_layers == 2
    draft.forward([5, 6, 7])
    draft.forward([9, 9])  # candidates later rejected
    draft.truncate(3)
    incremental = draft.forward([8, 10])
    fresh = CachedModel(layer_skip_model(target, [0, 3])).forward([5, 6, 7, 8, 10])[-2:]
    torch.testing.assert_close(incremental, fresh)


def test_greedy_speculation_with_a_skip_draft_equals_the_target_alone():
    target_model = tiny_llama(vocab_size=VOCAB, num_layers=4, scale=3.0)
    runner = CachedModel(target_model)
    draft = layer_skip_model(target_model, [0, 1, 3])
    drafter = ModelDrafter(draft, GreedyChooser(), VOCAB, VOCAB, EOS_IDS)
    baseline = BaselineEngine(runner, GreedyVerifier(), EOS_IDS)
    spec = SpeculativeEngine(runner, drafter, GreedyVerifier(), 4, EOS_IDS)
    accepted = 0
    for prompt in ([1, 5, 9, 12, 5, 9], [3, 4, 3, 4, 3], [7] * 6):
        expected = baseline.generate(prompt, 24, None).output_ids
        out = spec.generate(prompt, 24, None)
        assert out.output_ids == expected
        accepted += out.accepted_tokens
    assert accepted > 0  # the draft agrees in part: the test exercises acceptance and rejection


def test_stochastic_speculation_with_a_skip_draft_has_the_target_distribution(one_thread):
    sampling = SamplingConfig(temperature=1.0)
    target_model = tiny_llama(vocab_size=12, seed=0, num_layers=3, hidden=32, scale=3.0)
    runner = CachedModel(target_model)
    drafter = ModelDrafter(layer_skip_model(target_model, [0]), make_chooser(sampling), 12, 12, EOS_IDS)
    engines = {
        "baseline": BaselineEngine(runner, make_verifier(sampling), EOS_IDS),
        "spec": SpeculativeEngine(runner, drafter, make_verifier(sampling), 2, EOS_IDS),
    }
    counts = {name: Counter() for name in engines}
    drafted = accepted = 0
    for name, engine in engines.items():
        for index in range(1200):
            out = engine.generate(PROMPT, 3, torch.Generator().manual_seed(index + (10**6 if name == "spec" else 0)))
            padded = out.output_ids + [-1] * 3
            counts[name][(padded[1], padded[2])] += 1
            if name == "spec":
                drafted, accepted = drafted + out.drafted_tokens, accepted + out.accepted_tokens
    pvalue = _two_sample_pvalue(counts["baseline"], counts["spec"])
    assert pvalue > PASS_P, f"spec vs baseline: p={pvalue:.2e}"
    assert 0.1 < accepted / drafted < 0.98  # acceptances and residual samples both happen


def test_draft_skip_config():
    cfg = run_config_from_dict({"draft": {"kind": "skip", "skip_every": 3, "layers": [0, 4]}})
    assert cfg.draft.layers == (0, 4) and cfg.draft.skip_every == 3
    with pytest.raises(SpecToolkitError, match="draft.skip_every=1"):
        run_config_from_dict({"draft": {"kind": "skip", "skip_every": 1}})


def test_skip_precision_runs_the_kept_layers_of_a_quantized_copy(tiny_checkpoint):
    from spectoolkit.wiring.loading import load_model
    from spectoolkit.wiring.setup import skip_draft

    cfg = run_config_from_dict(
        {"draft": {"kind": "skip", "layers": [0], "skip_precision": "rtn-int4", "group_size": 32}}
    )
    target = load_model(str(tiny_checkpoint), "fp32", torch.device("cpu"), kernels=None)
    draft = skip_draft(cfg, target)
    assert draft.precision == "rtn-int4" and not draft.shared and draft.weight_bytes() > 0
    assert type(draft.model.model.layers[0].mlp.up_proj).__name__.startswith("_Int4")  # quantized, own bytes
    assert all(p.data_ptr() != q.data_ptr() for p in draft.model.parameters() for q in target.model.parameters())
    drafter = ModelDrafter(draft.model, GreedyChooser(), target.vocab_size, target.vocab_size, EOS_IDS)
    runner = CachedModel(target.model)
    prompt = [5, 9, 14, 3, 7]
    alone = BaselineEngine(runner, GreedyVerifier(), EOS_IDS).generate(prompt, 16, None)
    spec = SpeculativeEngine(runner, drafter, GreedyVerifier(), 3, EOS_IDS).generate(prompt, 16, None)
    assert spec.output_ids == alone.output_ids
    with pytest.raises(SpecToolkitError, match="draft.skip_precision"):
        run_config_from_dict({"draft": {"kind": "skip", "skip_precision": "nf4"}})
