"""The negative control of token-tree sampling: siblings taken by rank, reported as i.i.d. draws (DESIGN §1).

The multi-candidate rule (:mod:`spectoolkit.verify.tree`) is exact when each node's reported q is the
distribution it was really drawn from given the siblings before it. The classic tree bug breaks that:
a node's children are the draft's top-c tokens (distinct, most probable first: a deterministic
choice) while every child still reports the processed q, as if the c children were i.i.d. draws from
q. :func:`rank_siblings` applies that bug to a real tree; :func:`tree_negative_control` wraps a real
drafter so that every tree it proposes carries it. For an n-gram trie (children deterministic already,
one-hot q each) the same bug reads: its distinct continuations are reported as i.i.d. draws from their
mean, the uniform distribution over them, and the tokens stay as they are.

:func:`~spectoolkit.eval.stochastic_empirical.engine_exactness` with ``tree=`` must reject the
control at the sample size it accepts the real sampler at; :mod:`spectoolkit.eval.tree_analytic`
uses :func:`rank_siblings` as its ``rank_siblings`` control.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from spectoolkit.config import SamplingConfig
from spectoolkit.drafting import Budget, Drafter, ModelDrafter, NgramDrafter
from spectoolkit.drafting.tree import TokenTree
from spectoolkit.eval.stochastic_empirical import control_from
from spectoolkit.sampling import RandomChooser
from spectoolkit.verify.tree import children_of


def rank_siblings(tree: TokenTree) -> TokenTree:
    """BUG on purpose: every sibling group becomes the top-c tokens of Q, each reporting Q.

    Q [V] is the mean of the group's reported rows: the parent's q for i.i.d. siblings (model drafts),
    uniform over the distinct continuations for one-hot rows (n-gram). Ties in Q keep the drawn
    tokens in their order, so an n-gram trie keeps its tokens (and its subtrees) and only its rows change.
    """
    token_ids = list(tree.token_ids)
    draft_probs = tree.draft_probs.clone()  # [n, V]
    for kids in children_of(tree.parents).values():
        reported = draft_probs[kids].double().mean(dim=0).float()  # [V] Q
        for kid, token in zip(kids, _top_tokens(reported, [token_ids[k] for k in kids], len(kids)), strict=True):
            token_ids[kid] = token
            draft_probs[kid] = reported
    return TokenTree(token_ids, list(tree.parents), draft_probs)


def _top_tokens(reported: torch.Tensor, drawn: list[int], count: int) -> list[int]:
    """The ``count`` most probable tokens of ``reported`` [V]; ties go to the ``drawn`` tokens, in order."""
    candidates = list(dict.fromkeys(drawn + torch.topk(reported, count).indices.tolist()))
    return sorted(candidates, key=lambda token: -float(reported[token]))[:count]  # stable: drawn first


class RankSiblingsModelDrafter(ModelDrafter):
    """BUG on purpose (negative control): a draft model's trees with :func:`rank_siblings` applied."""

    def propose(self, seqs, budgets: list[Budget]) -> list[TokenTree]:
        return [rank_siblings(grown) if len(grown) else grown for grown in super().propose(seqs, budgets)]

    def commit(self, seq, num_prefix: int, path: list[int]) -> None:
        super().commit(seq, num_prefix, [])  # the tree's slots hold the drawn tokens, not the ranked ones


class RankSiblingsNgramDrafter(NgramDrafter):
    """BUG on purpose (negative control): n-gram tries whose continuations report their uniform mean."""

    def propose(self, seqs, budgets: list[Budget]) -> list[TokenTree]:
        return [rank_siblings(grown) if len(grown) else grown for grown in super().propose(seqs, budgets)]


def _model_control(drafter: ModelDrafter, sampling: SamplingConfig) -> ModelDrafter:
    name = f"{drafter.name}-rank-siblings-control"
    return RankSiblingsModelDrafter(drafter.runner, RandomChooser(sampling), drafter.allocator,
                                    drafter.target_vocab_size, drafter.shared_vocab_size, drafter.eos_ids, name, None,
                                    drafter.tree)  # fmt: skip


def _ngram_control(drafter: NgramDrafter, sampling: SamplingConfig) -> NgramDrafter:
    return RankSiblingsNgramDrafter(drafter.max_n, drafter.min_n, drafter.target_vocab_size, True, drafter.tree)


# The tree negative control of each drafter kind: the same trees' candidates, reported as i.i.d. draws they are not.
TREE_NEGATIVE_CONTROLS: dict[type, Callable[[Drafter, SamplingConfig], Drafter]] = {
    ModelDrafter: _model_control,
    NgramDrafter: _ngram_control,
}


def tree_negative_control(drafter: Drafter, sampling: SamplingConfig) -> Drafter:
    """A drafter like ``drafter`` (same model / lookup) whose trees carry the rank-siblings bug."""
    return control_from(TREE_NEGATIVE_CONTROLS, "TREE_NEGATIVE_CONTROLS", drafter, sampling)
