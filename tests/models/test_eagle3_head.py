"""The EAGLE-3 head (spectoolkit/models/eagle3_head.py): its shape from a target, the draft vocabulary, the
export vLLM's loader reads and its reload to the same logits, causality."""

from __future__ import annotations

import json

import pytest
import torch

from spectoolkit.models.eagle3_head import Eagle3Head, HeadShape, capture_states, draft_vocabulary
from spectoolkit.models.tiny import tiny_llama

VOCAB, DRAFT_VOCAB = 96, 40


@pytest.fixture(scope="module")
def target():
    return tiny_llama(vocab_size=VOCAB, seed=2, num_layers=6)


def _head(target, seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    ids = torch.sort(torch.randperm(VOCAB)[:DRAFT_VOCAB]).values
    return Eagle3Head(HeadShape.of_target(target.config, DRAFT_VOCAB), ids).eval()


def _inputs(target, length: int = 9, seed: int = 1):
    ids = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        states = capture_states(target, ids, (2, 3, 3))  # [2, T, 3H]
    return target.get_input_embeddings()(ids).detach(), states, torch.arange(length).expand(2, -1)


def test_the_shape_follows_the_target(target):
    shape = HeadShape.of_target(target.config, DRAFT_VOCAB)
    assert (shape.hidden_size, shape.num_attention_heads, shape.num_key_value_heads, shape.head_dim) == (64, 4, 2, 16)
    assert shape.aux_layers == (2, 3, 3) and shape.vocab_size == VOCAB  # vLLM's (2, L // 2, L - 3)


def test_the_draft_vocabulary_is_the_most_frequent_ids_ascending():
    ids = draft_vocabulary([[5, 5, 5, 9, 9, 1], [9, 7, 7, 3]], 3, 12)
    assert ids.tolist() == [5, 7, 9]  # 9 x3, 5 x3, 7 x2; then 1 and 3 (x1) are left out
    assert draft_vocabulary([[4]], 3, 12).tolist() == [0, 1, 4]  # unseen ids fill up by id order


def test_a_saved_head_reloads_to_the_same_logits_in_vllms_layout(target, tmp_path):
    head = _head(target)
    embeds, states, positions = _inputs(target)
    with torch.no_grad():
        want = head.target_logits(head(embeds, head.fc(states), positions)[0])
        head.save(tmp_path)
        got = Eagle3Head.load(tmp_path)
        assert torch.equal(got.target_logits(got(embeds, got.fc(states), positions)[0]), want)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == DRAFT_VOCAB
    from safetensors import safe_open

    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d", "midlayer.hidden_norm.weight",
            "midlayer.self_attn.q_proj.weight", "midlayer.mlp.down_proj.weight"} <= names  # fmt: skip
    assert not any("embed_tokens" in name for name in names)  # the target's embeddings are shared


def test_draft_logits_land_on_their_target_ids(target):
    head = _head(target)
    embeds, states, positions = _inputs(target)
    with torch.no_grad():
        normed, _ = head(embeds, head.fc(states), positions)
        draft, full = head.draft_logits(normed), head.target_logits(normed)
    mapped = head.draft_to_target
    assert torch.equal(full[..., mapped], draft)
    assert bool(torch.isinf(full).sum(-1).eq(VOCAB - DRAFT_VOCAB).all())
    assert torch.equal(full.argmax(-1), mapped[draft.argmax(-1)])
    assert head.t2d.sum() == DRAFT_VOCAB and bool(head.t2d[mapped].all())


def test_a_position_never_sees_later_ones(target):
    head = _head(target)
    embeds, states, positions = _inputs(target)
    with torch.no_grad():
        whole, _ = head(embeds, head.fc(states), positions)
        prefix, _ = head(embeds[:, :5], head.fc(states[:, :5]), positions[:, :5])
    torch.testing.assert_close(prefix, whole[:, :5], rtol=1e-5, atol=1e-5)


def test_a_bad_map_is_refused(target):
    shape = HeadShape.of_target(target.config, 3)
    with pytest.raises(ValueError, match="ascending"):
        Eagle3Head(shape, torch.tensor([4, 2, 9]))
    with pytest.raises(ValueError, match="lie in"):
        Eagle3Head(shape, torch.tensor([1, 2, VOCAB]))
