"""Each row of a step verified by its own request's rule (DESIGN §1): the part of a commit that reads logits.

A request's :class:`~spectoolkit.serving.sequence.Rule` was chosen when it was submitted; here a round's rows
[k+1, V] get that request's penalties (each row after the drafts before it: a chain's row i follows the first i
drafts, a tree's row follows its node's path), then its verifier — the argmax for a greedy request, the exact
rejection rule with the drafts' q under the request's own temperature/top-k/top-p/min-p for a sampled one — and,
when the request asked, the log-probabilities of the tokens it emits (raw target logits, as vLLM reports them).
Every step of this is per row, so a request's result never depends on its batch companions.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spectoolkit.drafting.base import Drafter
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.sampling import SamplingError, SamplingParams, make_chooser, penalize
from spectoolkit.serving.api import TokenLogprob
from spectoolkit.serving.sequence import Rule, Sequence
from spectoolkit.verify.base import Verifier
from spectoolkit.verify.tree import TreeVerifier

VerifierFor = Callable[[SamplingParams], Verifier]


def request_rule(sampling: SamplingParams, verifier_for: VerifierFor) -> Rule:
    """The rule of a request that brought its own ``sampling`` (chosen once, at submit)."""
    return Rule(sampling, verifier_for(sampling), TreeVerifier(sampling), make_chooser(sampling), not sampling.greedy)


def default_rule(verifier: Verifier, tree_verifier: TreeVerifier, stochastic: bool) -> Rule:
    """The rule of a request without settings of its own: the engine's verifier, the drafter's own chooser."""
    return Rule(SamplingParams.of(verifier.sampling), verifier, tree_verifier, None, stochastic)


def unsupported(sampling: SamplingParams, tree_drafter: Drafter | None) -> SamplingError | None:
    """Why ``sampling`` cannot be honoured as asked by an engine drafting token trees with ``tree_drafter`` (None:
    chains), or None. Penalties reach a draft model's chains (its rows get them as the target's do), not the children
    of its token trees: with those they are refused rather than applied to the target alone."""
    if not sampling.penalized or tree_drafter is None or not tree_drafter.runners():
        return None
    field, off = sampling.active_penalties()[0]
    return SamplingError(f"{field} is not applied to the token trees this server drafts with a draft model "
                         f"(speculate.tree.kind={tree_drafter.tree.kind}): send {field}={off:g}", field)  # fmt: skip


def row_histories(proposal: TokenTree) -> list[list[int]]:
    """[k+1] the drafts each row follows past the pending token: row 0 none, row i + 1 node i's path."""
    return [[]] + [[proposal.token_ids[node] for node in proposal.path_to(index)] for index in range(len(proposal))]


def verify_round(seq: Sequence, proposal: TokenTree, rows: torch.Tensor) -> tuple[list[int], int]:
    """``seq``'s rows [k+1, V] (row 0: after the pending token, row i + 1: after node i) checked against its
    ``proposal`` by its rule: (accepted node indices root first, the correction or bonus token)."""
    rule = seq.rule
    if rule.sampling.penalized:
        prompt = seq.tokens[: seq.prompt_len]
        rows = penalize(rows, rule.sampling, prompt, seq.tokens[seq.prompt_len :], row_histories(proposal))
    if not len(proposal):
        return [], rule.verifier.select(rows[0], seq.generator)
    if proposal.is_chain():  # the fast path: the chain rule (the fused kernel where it runs), no KV moves
        draft_ids = torch.tensor(proposal.token_ids, dtype=torch.long, device=rows.device)
        result = rule.verifier.verify(draft_ids, rows, proposal.draft_probs, seq.generator)
        return list(range(result.num_accepted)), result.next_token
    result = rule.tree_verifier.verify_tree(proposal.token_ids, proposal.parents, rows, proposal.draft_probs,
                                            seq.generator)  # fmt: skip
    return result.path, result.next_token


def emitted_logprobs(rows: torch.Tensor, path: list[int], emitted: list[int], top: int) -> list[TokenLogprob]:
    """The log-probabilities of the ``emitted`` tokens (the accepted ``path``'s, then the correction or bonus, cut at
    the room or EOS) from the raw rows [k+1, V] that predicted them, with the ``top`` most likely at each."""
    predicting = [0] + [node + 1 for node in path]  # the row before each emitted token
    logprobs = torch.log_softmax(rows[predicting[: len(emitted)]].float(), dim=-1)  # [n, V]
    chosen = logprobs.gather(1, torch.tensor(emitted, device=rows.device)[:, None])[:, 0].tolist()  # [n]
    if top <= 0:
        return [TokenLogprob(value, []) for value in chosen]
    values, indices = logprobs.topk(min(top, logprobs.shape[-1]), dim=-1)  # [n, top]
    return [
        TokenLogprob(value, list(zip(ids, lps, strict=True)))
        for value, ids, lps in zip(chosen, indices.tolist(), values.tolist(), strict=True)
    ]
