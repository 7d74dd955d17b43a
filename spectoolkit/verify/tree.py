"""Exact verification of a token tree: greedy, and multi-candidate speculative sampling (SpecInfer).

The target scores the root (the pending token) and every node in one forward: row 0 is the target's
distribution after the root, row ``i + 1`` the one after node ``i``'s path. From the root down:

- **Greedy:** move to the child whose token is the target's argmax at the current node; stop where no
  child is, and emit the argmax there (the correction, or the bonus token at a leaf). The emitted
  tokens are the target-alone tokens, for any tree.
- **Stochastic** (SpecInfer's multi-round rule, Miao et al. 2024, Thm 4.2 — generalised to a proposal
  per sibling): with p the processed target distribution at the node, try the children in the order
  they were drawn; accept child x_j with probability min(1, p(x_j)/q_j(x_j)); on rejection set
  p ← normalise(max(0, p − q_j)) and try the next sibling; if every child is rejected, sample from p.
  Each try is one exact speculative-sampling step for target p and proposal q_j, so what is emitted is
  distributed as the p the try started from, whatever came before. It is exact when q_j is the
  distribution x_j was really drawn from given the siblings before it: q for siblings drawn i.i.d. from
  q, one-hot for deterministic (n-gram) candidates. Ranking siblings (top-k) while reporting q is not.

All arithmetic is fp32; uniforms come from the request's generator, one per tried child and one per
emitted correction/bonus token. :func:`residual_after` is the residual step the analytic check
(:mod:`spectoolkit.eval.tree_analytic`) reuses.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectoolkit.sampling import Processing, processed_probs, sample_from
from spectoolkit.verify.rules import accept_mask, draw_uniforms, pad_vocab, residual


@dataclass(frozen=True)
class TreeVerifyResult:
    """The round emits ``[token_ids[i] for i in path] + [next_token]``."""

    path: list[int]  # accepted node indices, root's child first; [] when the first depth was rejected
    next_token: int  # correction (at the first node whose children all failed) or bonus (at a leaf)

    @property
    def num_accepted(self) -> int:
        return len(self.path)


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """{node: its children in order}; the root is -1."""
    children: dict[int, list[int]] = {}
    for index, parent in enumerate(parents):
        children.setdefault(parent, []).append(index)
    return children


def residual_after(target_probs: torch.Tensor, draft_row: torch.Tensor) -> torch.Tensor:
    """normalise(max(0, p − q_j)) [V]: the distribution the next sibling is tested against."""
    leftover = residual(target_probs, draft_row)
    return leftover / leftover.sum()


class TreeVerifier:
    """Verifies a :class:`~spectoolkit.drafting.tree.TokenTree`'s ids/parents against the target's rows."""

    def __init__(self, sampling: Processing) -> None:
        self.sampling = sampling

    def verify_tree(
        self,
        token_ids: list[int],
        parents: list[int],
        target_logits: torch.Tensor,
        draft_probs: torch.Tensor | None,
        generator: torch.Generator | None,
    ) -> TreeVerifyResult:
        """token_ids/parents [n]; target_logits [n+1, V] (row 0: the root); draft_probs [n, V_draft] or None."""
        if target_logits.dim() != 2 or target_logits.shape[0] != len(token_ids) + 1:
            raise ValueError(
                f"target_logits must be [n+1, V] = [{len(token_ids) + 1}, V], got {list(target_logits.shape)}"
            )
        children = children_of(parents)
        if self.sampling.greedy:
            return _greedy(token_ids, children, target_logits)
        if draft_probs is None and token_ids:
            raise ValueError("stochastic tree verification needs draft_probs: the distribution each node came from")
        draft_probs = pad_vocab(draft_probs.float(), target_logits.shape[-1]) if token_ids else None  # [n, V]
        return _stochastic(token_ids, children, target_logits, draft_probs, self.sampling, generator)


def _greedy(token_ids: list[int], children: dict[int, list[int]], target_logits: torch.Tensor) -> TreeVerifyResult:
    argmax = target_logits.float().argmax(dim=-1).tolist()  # [n+1]: one pass over all rows
    path, node = [], -1
    while True:
        best = argmax[node + 1]
        nxt = next((c for c in children.get(node, ()) if token_ids[c] == best), None)
        if nxt is None:
            return TreeVerifyResult(path, best)
        path.append(nxt)
        node = nxt


def _stochastic(
    token_ids: list[int],
    children: dict[int, list[int]],
    target_logits: torch.Tensor,
    draft_probs: torch.Tensor | None,
    sampling: Processing,
    generator: torch.Generator | None,
) -> TreeVerifyResult:
    path, node = [], -1
    device = target_logits.device
    while True:
        probs = processed_probs(target_logits[node + 1], sampling)  # [V] fp32, p at this node
        accepted = None
        for child in children.get(node, ()):
            index = torch.tensor([token_ids[child]], device=device)
            uniform = draw_uniforms(1, generator, device)
            row = draft_probs[child].to(device)
            if bool(accept_mask(index, row[None], probs[None], uniform)[0]):
                accepted = child
                break
            probs = residual_after(probs, row)
        if accepted is None:
            return TreeVerifyResult(path, sample_from(probs, draw_uniforms(1, generator, device)))
        path.append(accepted)
        node = accepted
