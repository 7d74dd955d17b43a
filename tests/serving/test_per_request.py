"""Per-request settings in one batch (issue 56): each row verified by its own request's rule, its own draft cap,
its own logprobs; n > 1 sharing a prompt's KV; the prefix cache across requests.

The engine's default here is greedy (the server's ``sampling=greedy``); requests bring other settings. Greedy rows
must equal the target alone token for token; a sampled request must equal its own replay (its seed alone), whatever
ran beside it; penalties reach the draft model's rows as the target's, so a penalized greedy request is the same with
speculation on or off. With the prefix cache, a repeated prompt starts after its cached blocks and emits the same
tokens as with the cache off.
"""

from __future__ import annotations

import pytest
import torch

from spectoolkit.config import TreeConfig
from spectoolkit.drafting import NgramDrafter
from spectoolkit.sampling import GreedyChooser, SamplingParams
from spectoolkit.serving.api import ServeRequest
from tests.serving import helpers

pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NEW = 12
GAMMA = 3
TARGET = helpers.tiny()
DRAFT = helpers.noisy_target(0.2, seed=5)  # accepts some drafts, rejects others
PROMPTS = helpers.prompts((4, 7, 10))
SAMPLED = SamplingParams(temperature=0.8, top_k=50)
HOT = SamplingParams(temperature=1.5, top_p=0.9, min_p=0.05)
PENALIZED = SamplingParams(repetition_penalty=1.6, frequency_penalty=0.6, presence_penalty=0.3)


def _spec(drafter=None, **kwargs):
    drafter = drafter or helpers.model_drafter(DRAFT, GreedyChooser(), num_blocks=300)
    return helpers.engine(TARGET, gamma=GAMMA, drafter=drafter, num_blocks=300, max_num_seqs=16, max_num_tokens=256,
                          **kwargs)  # fmt: skip


def _mixed() -> list[ServeRequest]:
    """Per prompt: the engine's default (greedy), explicit greedy, T=0.8 and T=1.5 with top-p and min-p."""
    out = []
    for i, p in enumerate(PROMPTS):
        out += [ServeRequest(f"default/{i}", p, MAX_NEW),
                ServeRequest(f"greedy/{i}", p, MAX_NEW, sampling=SamplingParams()),
                ServeRequest(f"t08/{i}", p, MAX_NEW, seed=10 + i, sampling=SAMPLED),
                ServeRequest(f"t15/{i}", p, MAX_NEW, seed=20 + i, sampling=HOT)]  # fmt: skip
    return out


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_mixed_batch_greedy_rows_are_the_target_alone_and_sampled_rows_their_own_replay(drafter):
    eng = _spec(NgramDrafter(3, 1, helpers.VOCAB, one_hot_probs=False) if drafter == "ngram" else None)
    requests = _mixed()
    done = helpers.run(eng, requests)
    out = helpers.outputs(done)
    baseline = helpers.baseline_outputs(TARGET, PROMPTS, MAX_NEW)
    for i in range(len(PROMPTS)):
        assert out[f"default/{i}"] == out[f"greedy/{i}"] == baseline[str(i)], f"prompt {i}: greedy rows differ"
    sampled = [r for r in requests if r.sampling is not None and not r.sampling.greedy]
    assert {r.request_id: out[r.request_id] for r in sampled} == helpers.alone(eng, sampled)
    assert any(out[f"t15/{i}"] != baseline[str(i)] for i in range(len(PROMPTS))), "T=1.5 never left the argmax"
    assert max(max(r.batch_sizes) for r in done.values()) >= 8, "the requests were not batched"
    assert sum(done[r.request_id].drafted_tokens for r in sampled) > 0, "no sampled row was verified against drafts"
    assert done["t08/0"].sampling == SAMPLED and done["default/0"].sampling.greedy
    assert helpers.all_free(eng)


def test_a_request_turns_speculation_off_or_caps_its_drafts():
    eng = _spec()
    requests = [ServeRequest("off", PROMPTS[1], MAX_NEW, draft_cap=0), ServeRequest("one", PROMPTS[1], MAX_NEW,
                draft_cap=1), ServeRequest("policy", PROMPTS[1], MAX_NEW)]  # fmt: skip
    done = helpers.run(eng, requests)
    baseline = helpers.baseline_outputs(TARGET, [PROMPTS[1]], MAX_NEW)["0"]
    assert all(ids == baseline for ids in helpers.outputs(done).values())
    assert done["off"].drafted_tokens == 0 and done["off"].verify_rounds == MAX_NEW - 1
    assert done["one"].drafted_tokens > 0 and max(done["one"].draft_lengths) == 1
    assert max(done["policy"].draft_lengths) == GAMMA
    kinds = eng.counters.requests_by_kind
    assert kinds[("greedy", "off")] == kinds[("greedy", "capped")] == kinds[("greedy", "on")] == 1
    bad = helpers.run(eng, [ServeRequest("bad", PROMPTS[0], 4, draft_cap=-1)])["bad"]
    assert bad.error is not None and "draft_cap" in bad.error


def _reference_logprobs(ids: list[int], prompt_len: int) -> torch.Tensor:
    """log-softmax of the target's logits predicting each output token of ``ids`` [len(ids) - prompt_len, V]."""
    with torch.no_grad():
        logits = TARGET(torch.tensor([ids])).logits[0]  # [L, V]
    return torch.log_softmax(logits.float(), dim=-1)[prompt_len - 1 : len(ids) - 1]


@pytest.mark.parametrize(
    "sampling", [SamplingParams(logprobs=3), SamplingParams(temperature=0.9, top_k=20, logprobs=0)]
)
def test_logprobs_are_the_targets_at_each_emitted_token(sampling):
    eng = _spec()
    done = helpers.run(eng, [ServeRequest("0", PROMPTS[2], MAX_NEW, seed=3, sampling=sampling)])["0"]
    assert done.drafted_tokens > 0 and len(done.logprobs) == len(done.output_ids)
    reference = _reference_logprobs(PROMPTS[2] + done.output_ids, len(PROMPTS[2]))  # [n, V]
    chosen = reference.gather(1, torch.tensor(done.output_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor([lp.logprob for lp in done.logprobs]), chosen, atol=1e-4, rtol=1e-4)
    for position, entry in enumerate(done.logprobs):
        assert len(entry.top) == sampling.logprobs
        assert [token for token, _ in entry.top] == reference[position].topk(sampling.logprobs).indices.tolist()
        if sampling.greedy:
            assert entry.top[0][0] == done.output_ids[position]


def test_penalties_reach_the_drafts_so_speculation_keeps_the_penalized_output():
    requests = [ServeRequest(str(i), p, MAX_NEW, sampling=PENALIZED) for i, p in enumerate(PROMPTS)]
    plain = helpers.outputs(helpers.run(helpers.engine(TARGET, num_blocks=300), requests))
    done = helpers.run(_spec(), requests)
    assert helpers.outputs(done) == plain
    assert sum(r.drafted_tokens for r in done.values()) > 0
    assert plain != helpers.baseline_outputs(TARGET, PROMPTS, MAX_NEW), "the penalties changed nothing"


def test_penalties_are_refused_naming_the_field_where_draft_model_trees_cannot_apply_them():
    tree = TreeConfig(kind="dynamic", max_nodes=6, top_k=2)
    drafter = helpers.model_drafter(DRAFT, GreedyChooser(), num_blocks=300).variant(None, tree)
    eng = helpers.engine(TARGET, gamma=6, depth=GAMMA, drafter=drafter, num_blocks=300)
    done = helpers.run(eng, [ServeRequest("0", PROMPTS[0], 4, sampling=SamplingParams(frequency_penalty=0.5)),
                             ServeRequest("1", PROMPTS[0], 4, sampling=SAMPLED)])  # fmt: skip
    assert "frequency_penalty" in done["0"].error
    assert eng.unsupported(PENALIZED).field == "presence_penalty" and eng.unsupported(SAMPLED) is None
    assert done["1"].error is None and len(done["1"].output_ids) == 4


def test_samples_of_one_prompt_share_its_kv():
    """n = 3: the second and third wait for the first to compute the prompt, then share its full blocks."""
    prompt = helpers.prompts((20,))[0]  # 45 tokens: 5 full blocks of 8
    eng = _spec()
    requests = [ServeRequest("s0", prompt, MAX_NEW, seed=0, sampling=SAMPLED)] + [
        ServeRequest(f"s{j}", prompt, MAX_NEW, seed=j, sampling=SAMPLED, after="s0") for j in (1, 2)
    ]
    done = helpers.run(eng, requests)
    assert [done[f"s{j}"].cached_tokens for j in range(3)] == [0, 40, 40]
    assert helpers.outputs(done) == helpers.alone(eng, requests)
    assert len({tuple(r.output_ids) for r in done.values()}) > 1, "three seeds, one output"
    assert helpers.all_free(eng)


def test_prefix_cache_across_requests_keeps_the_output_and_is_bounded_by_the_pool():
    prompt = helpers.prompts((20,))[0]  # 45 tokens
    other = helpers.prompts((20,), seed=9)[0]
    reference = helpers.run(_spec(), [ServeRequest("ref", prompt, MAX_NEW)])["ref"].output_ids
    eng = _spec(prefix_cache=True)
    first = helpers.run(eng, [ServeRequest("a", prompt, MAX_NEW)])["a"]
    again = helpers.run(eng, [ServeRequest("b", prompt, MAX_NEW)])["b"]
    assert (first.cached_tokens, again.cached_tokens) == (0, 40)
    assert first.output_ids == again.output_ids == reference
    assert eng.allocator.num_cached > 0 and helpers.all_free(eng)  # cached blocks count as free
    counters = eng.counters
    assert (counters.prefix_cache_queries, counters.prefix_cache_hits) == (90, 40)
    # A pool just large enough for one request: the next prompt evicts the cache, least recent first.
    small = helpers.engine(TARGET, num_blocks=8, prefix_cache=True)
    helpers.run(small, [ServeRequest("a", prompt, MAX_NEW)])
    helpers.run(small, [ServeRequest("x", other, MAX_NEW)])
    evicted = helpers.run(small, [ServeRequest("b", prompt, MAX_NEW)])["b"]
    assert evicted.cached_tokens < 40 and evicted.output_ids == reference
    eng.reset()  # a reset forgets the cache: no later run inherits this one's KV
    assert eng.allocator.num_cached == 0
    assert helpers.run(eng, [ServeRequest("c", prompt, MAX_NEW)])["c"].cached_tokens == 0


@pytest.mark.parametrize("tree", [None, TreeConfig(kind="dynamic", max_nodes=6, top_k=2)], ids=["chain", "tree"])
def test_penalized_rows_follow_each_drafts_path_with_ngram_lookup(tree):
    """Row i of a round is penalized as if the drafts on its path were output (a tree's rows: their node's path)."""
    mild = SamplingParams(repetition_penalty=1.05, presence_penalty=0.05)
    requests = [ServeRequest(str(i), p, MAX_NEW, sampling=mild) for i, p in enumerate(PROMPTS)]
    plain = helpers.outputs(helpers.run(helpers.engine(TARGET, num_blocks=300), requests))
    drafter = NgramDrafter(3, 1, helpers.VOCAB, one_hot_probs=False, tree=tree)
    done = helpers.run(_spec(drafter, depth=GAMMA if tree else None), requests)
    assert helpers.outputs(done) == plain
    assert sum(r.accepted_tokens for r in done.values()) > 0
