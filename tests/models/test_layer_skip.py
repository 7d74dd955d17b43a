"""The layer-skip self-draft (issue 18): the target's layers, shared, its own KV; speculation stays exact."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch

from spectoolkit.config import SamplingConfig, run_config_from_dict
from spectoolkit.drafting import ModelDrafter
from spectoolkit.errors import SpecToolkitError
from spectoolkit.eval.stochastic_empirical import two_sample_test
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.models.layer_skip import kept_layers, layer_skip_model, skip_name
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.policy import FixedPolicy
from spectoolkit.runtime.blocks import BlockAllocator
from spectoolkit.runtime.lone import lone_sequence
from spectoolkit.runtime.paged_kv import make_pool
from spectoolkit.runtime.runner import make_runner
from spectoolkit.sampling import GreedyChooser, make_chooser
from spectoolkit.serving.engine import ContinuousEngine
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.serving.scheduler import SchedulerLimits
from spectoolkit.verify import GreedyVerifier

VOCAB = 64
EOS_IDS = frozenset({2})
PROMPT = [1, 5, 7, 3, 9, 4, 11, 6, 8, 10, 0, 3, 5, 7]  # vocab 12: every non-EOS id occurs
PASS_P = 1e-3
BLOCKS, BLOCK, POSITIONS = 64, 8, 256


def _pool_of(model: torch.nn.Module):
    return make_runner(model, make_pool(model, "auto", BLOCKS * BLOCK)), BlockAllocator(BLOCKS, BLOCK)


def _arms(target: torch.nn.Module, draft: torch.nn.Module, gamma: int,
          sampling: SamplingConfig | None = None) -> tuple[OneRequestEngine, OneRequestEngine]:  # fmt: skip
    """The target alone and speculation with ``draft`` (batch-1 arms of the one engine, one target pool);
    greedy unless ``sampling``."""
    runner, allocator = _pool_of(target)
    vocab = target.get_input_embeddings().num_embeddings
    chooser = make_chooser(sampling) if sampling is not None else GreedyChooser()
    verifier = make_verifier(sampling) if sampling is not None else GreedyVerifier()
    draft_runner, draft_allocator = _pool_of(draft)
    drafter = ModelDrafter(draft_runner, chooser, draft_allocator, vocab, vocab, EOS_IDS)

    def engine(name: str, chosen, budget: int) -> OneRequestEngine:
        limits = SchedulerLimits(POSITIONS, 1, None, None)
        return OneRequestEngine(ContinuousEngine(name, runner, allocator, verifier, limits, EOS_IDS, POSITIONS, chosen,
                                                 sampling is not None, False, FixedPolicy(budget)), name)  # fmt: skip

    return engine("baseline", None, 0), engine("spec", drafter, gamma)


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
    """Incremental forwards with a rollback equal a fresh forward (the KV rule), and the draft's pool
    has one layer per kept layer: its KV is its own, not the target's."""
    target = tiny_llama(vocab_size=VOCAB, num_layers=4, scale=3.0)
    target_sequence = lone_sequence(target)
    draft = lone_sequence(layer_skip_model(target, [0, 3]))
    assert len(draft.runner.pool.layers) == 2 and len(target_sequence.runner.pool.layers) == 4
    draft.forward([5, 6, 7])
    draft.forward([9, 9])  # candidates later rejected
    draft.truncate(3)
    incremental = draft.forward([8, 10])
    fresh = lone_sequence(layer_skip_model(target, [0, 3])).forward([5, 6, 7, 8, 10])[-2:]
    torch.testing.assert_close(incremental, fresh)


def test_greedy_speculation_with_a_skip_draft_equals_the_target_alone():
    target_model = tiny_llama(vocab_size=VOCAB, num_layers=4, scale=3.0)
    baseline, spec = _arms(target_model, layer_skip_model(target_model, [0, 1, 3]), 4)
    accepted = rejected = 0
    for prompt in ([1, 5, 9, 12, 5, 9], [3, 4, 3, 4, 3], [7] * 6):
        expected = baseline.generate(prompt, 24, None).output_ids
        out = spec.generate(prompt, 24, None)
        assert out.output_ids == expected
        accepted += out.accepted_tokens
        rejected += out.drafted_tokens - out.accepted_tokens
    assert accepted > 0 and rejected > 0  # the draft agrees in part: the test exercises acceptance and rejection


def test_stochastic_speculation_with_a_skip_draft_has_the_target_distribution(one_thread):
    sampling = SamplingConfig(temperature=1.0)
    target_model = tiny_llama(vocab_size=12, seed=0, num_layers=3, hidden=32, scale=3.0)
    baseline, spec = _arms(target_model, layer_skip_model(target_model, [0]), 2, sampling)
    counts = {"baseline": Counter(), "spec": Counter()}
    drafted = accepted = 0
    for name, engine in (("baseline", baseline), ("spec", spec)):
        for index in range(1200):
            out = engine.generate(PROMPT, 3, torch.Generator().manual_seed(index + (10**6 if name == "spec" else 0)))
            padded = out.output_ids + [-1] * 3
            counts[name][(padded[1], padded[2])] += 1
            if name == "spec":
                drafted, accepted = drafted + out.drafted_tokens, accepted + out.accepted_tokens
    pvalue = two_sample_test(counts["baseline"], counts["spec"]).p_value
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
    assert draft.model.model.layers[0].mlp.up_proj.kind == "int4"  # quantized (packed for our kernel), own bytes
    assert all(p.data_ptr() != q.data_ptr() for p in draft.model.parameters() for q in target.model.parameters())
    baseline, speculating = _arms(target.model, draft.model, 3)
    prompt = [5, 9, 14, 3, 7]
    alone = baseline.generate(prompt, 16, None)
    spec = speculating.generate(prompt, 16, None)
    assert spec.output_ids == alone.output_ids and spec.drafted_tokens > 0
    with pytest.raises(SpecToolkitError, match="draft.skip_precision"):
        run_config_from_dict({"draft": {"kind": "skip", "skip_precision": "nf4"}})
