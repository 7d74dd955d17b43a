"""Training an EAGLE-3 head on a tiny target's own greedy answers (spectoolkit/training): the loss falls, the head
agrees with the target more often than an untrained one on held text, and an interrupted run resumes to the
very weights of an uninterrupted one."""

from __future__ import annotations

import pytest
import torch

from spectoolkit.models.eagle3_head import Eagle3Head, HeadShape, draft_vocabulary
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.training.data import greedy_answer, output_rows, target_sequence
from spectoolkit.training.loop import TrainSettings, agreement, train
from spectoolkit.training.ttt import ttt_attention

pytestmark = pytest.mark.usefixtures("one_thread")
VOCAB, DRAFT_VOCAB = 96, 64


@pytest.fixture(scope="module")
def data():
    target = tiny_llama(vocab_size=VOCAB, seed=2, num_layers=6, scale=6.0)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=gen).tolist() for n in torch.randint(6, 14, (48,))]
    answers = [greedy_answer(target, prompt, 24) for prompt in prompts]
    draft_ids = draft_vocabulary([p + a for p, a in zip(prompts, answers, strict=True)], DRAFT_VOCAB, VOCAB)
    shape = HeadShape.of_target(target.config, DRAFT_VOCAB)
    seqs = [target_sequence(target, p, a, shape.aux_layers, draft_ids) for p, a in zip(prompts, answers, strict=True)]
    return target.get_input_embeddings().weight.detach(), shape, draft_ids, seqs[:40], seqs[40:]


def _head(shape, draft_ids) -> Eagle3Head:
    torch.manual_seed(5)
    return Eagle3Head(shape, draft_ids)


def test_training_lowers_the_loss_and_raises_agreement_on_held_text(data):
    embeddings, shape, draft_ids, training, held = data
    head = _head(shape, draft_ids)
    before = agreement(head, embeddings, held, 2)
    losses = train(head, embeddings, training, TrainSettings(steps=240, lr=3e-3, save_every=0))
    after = agreement(head, embeddings, held, 2)
    assert sum(losses[-24:]) < 0.6 * sum(losses[:24]), (losses[:3], losses[-3:])
    assert after[0] > before[0] + 0.2 and after[1] > before[1], (before, after)


def test_an_interrupted_run_resumes_to_the_same_weights(data, tmp_path):
    embeddings, shape, draft_ids, training, _ = data
    settings = TrainSettings(steps=30, lr=3e-3, save_every=7)
    whole = _head(shape, draft_ids)
    train(whole, embeddings, training, settings)
    resumed = _head(shape, draft_ids)
    train(resumed, embeddings, training, settings, checkpoint_dir=tmp_path, stop_after=17)
    again = _head(shape, draft_ids)  # a fresh process: only the checkpoint carries over
    train(again, embeddings, training, settings, checkpoint_dir=tmp_path)
    for (name, a), b in zip(whole.state_dict().items(), again.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_the_unrolled_attention_sees_the_prefix_and_its_own_steps_only():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 4, 5, 8, generator=gen)
    keys = [torch.randn(1, 2, 6, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen)]
    values = [torch.randn(1, 2, 6, 8, generator=gen), torch.randn(1, 2, 5, 8, generator=gen)]
    out = ttt_attention(q, keys, values)
    t, head = 3, 2  # anchor 3, query head 2 (kv head 1): keys 0..3 of step 0, then its own key of step 1
    k = torch.cat([keys[0][0, 1, : t + 1], keys[1][0, 1, t : t + 1]])
    v = torch.cat([values[0][0, 1, : t + 1], values[1][0, 1, t : t + 1]])
    want = torch.softmax(q[0, head, t] @ k.t() / 8**0.5, -1) @ v
    torch.testing.assert_close(out[0, head, t], want)


def test_labels_are_the_targets_logits_at_the_draft_ids():
    """A sequence keeps the target's final state, not its logits; with the output rows they give the logits back,
    and a head the final state does not explain (a bias) is refused."""
    from spectoolkit.errors import SpecToolkitError

    target = tiny_llama(vocab_size=VOCAB, seed=3, num_layers=4)
    draft_ids = torch.arange(0, VOCAB, 3)
    rows = output_rows(target, draft_ids)
    torch.testing.assert_close(rows, target.lm_head.weight.detach()[draft_ids])
    ids = list(range(5, 17))
    seq = target_sequence(target, ids[:4], ids[4:], (0, 1, 2), draft_ids, prompt_loss=True)
    with torch.no_grad():
        logits = target(input_ids=torch.tensor([ids])).logits[0][:, draft_ids]
    torch.testing.assert_close(seq.target_logits(), logits, rtol=0.02, atol=0.02)  # states kept in bf16
    target.lm_head.bias = torch.nn.Parameter(torch.ones(VOCAB))
    with pytest.raises(SpecToolkitError, match="no bias"):
        output_rows(target, draft_ids)
