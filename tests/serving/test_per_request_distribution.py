"""A sampled request keeps the target's distribution when it shares the batch with greedy and differently tempered
neighbours (issue 56, DESIGN §1).

The engine's default rule is greedy (a greedy verifier; the draft model proposes argmax drafts); the tested requests
bring T=0.8 with top-k, so their drafts are sampled from the draft model under their own settings and their rows
verified by the rejection rule under them, while greedy requests (argmax rows) and T=1.5 requests run in the same
steps. At each of the first ``LENGTH`` positions, each prompt's tokens are compared with the target alone at T=0.8
(a batch-1 arm, its own seeds) by the two-sample chi-square of :mod:`spectoolkit.eval.stochastic_empirical`. The
negative control verifies the sampled requests by a rule that accepts every draft (their tokens then follow q): the
same test at the same sample size must reject it.
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.config import SamplingConfig
from spectoolkit.kernels.verifier import make_verifier
from spectoolkit.models.tiny import tiny_llama
from spectoolkit.sampling import GreedyChooser, SamplingParams
from spectoolkit.serving.api import ServeRequest
from spectoolkit.serving.one import OneRequestEngine
from spectoolkit.verify.stochastic import StochasticVerifier
from tests.serving import helpers
from tests.serving.test_batch_stochastic import LENGTH, SIGNIFICANCE, AcceptEveryDraft, _counts_of, _min_p, _noisy

pytestmark = pytest.mark.usefixtures("one_thread")
TESTED = SamplingParams(temperature=0.8, top_k=64)
NEIGHBOURS = (None, SamplingParams(), SamplingParams(temperature=1.5, top_p=0.9))  # default greedy, greedy, hot
SAMPLES = 200
GAMMA = 3
VOCAB, SCALE = 512, 15.0  # sharp enough that a few hundred samples resolve the top tokens


def _models():
    target = helpers.switched(tiny_llama(vocab_size=VOCAB, seed=0, scale=SCALE))
    return target, _noisy(0, VOCAB, SCALE, sigma=0.3)


def _target_alone(target, prompts: list[list[int]]) -> list[list]:
    sampling = SamplingConfig(temperature=TESTED.temperature, top_k=TESTED.top_k)
    engine = OneRequestEngine(helpers.engine(target, verifier=StochasticVerifier(sampling), stochastic=True), "alone")
    return [_counts_of([engine.generate(p, LENGTH, torch.Generator().manual_seed(s)).output_ids
                        for s in range(SAMPLES)]) for p in prompts]  # fmt: skip


def _among_neighbours(target, draft, prompts, verifier_for) -> tuple[list[list], dict]:
    drafter = helpers.model_drafter(draft, GreedyChooser(), num_blocks=800)
    eng = helpers.engine(target, gamma=GAMMA, drafter=drafter, num_blocks=800, max_num_seqs=48, max_num_tokens=4096,
                         verifier_for=verifier_for)  # fmt: skip
    requests = []
    for s in range(SAMPLES):
        for i, p in enumerate(prompts):
            requests.append(ServeRequest(f"t/{i}/{s}", p, LENGTH, seed=1_000_003 + s, sampling=TESTED))
            if s % 4 == 0:  # a neighbour of each kind now and then, on the same prompts
                neighbour = NEIGHBOURS[(s // 4) % len(NEIGHBOURS)]
                requests.append(ServeRequest(f"n/{i}/{s}", p, LENGTH + 2, seed=s, sampling=neighbour))
    done = helpers.run(eng, requests)
    outputs = helpers.outputs(done)
    assert helpers.all_free(eng)
    counts = [
        _counts_of([ids for rid, ids in outputs.items() if rid.startswith(f"t/{i}/")]) for i in range(len(prompts))
    ]
    return counts, done


def test_sampled_request_keeps_its_distribution_among_greedy_and_hot_neighbours():
    target, draft = _models()
    prompts = helpers.prompts((4, 9))
    threshold = SIGNIFICANCE / (len(prompts) * LENGTH)
    reference = _target_alone(target, prompts)
    served, done = _among_neighbours(target, draft, prompts, None)
    p_value = _min_p(reference, served)
    assert p_value >= threshold, f"served among neighbours, the distribution changed: p={p_value:.2e}"
    tested = [r for rid, r in done.items() if rid.startswith("t/")]
    assert 0 < sum(r.accepted_tokens for r in tested) < sum(r.drafted_tokens for r in tested)
    assert max(max(r.batch_sizes) for r in done.values()) >= 32, "the requests were not batched"
    assert {r.sampling.mode for rid, r in done.items() if rid.startswith("n/")} == {"greedy", "T=1.5"}

    def accept_every_draft(sampling: SamplingParams):  # BUG on purpose for the sampled rows
        return make_verifier(sampling, "cpu") if sampling.greedy else AcceptEveryDraft(sampling)

    control, _ = _among_neighbours(target, draft, prompts, accept_every_draft)
    control_p = _min_p(reference, control)
    assert control_p < threshold, f"no power: the negative control passed (p={control_p:.2e})"
