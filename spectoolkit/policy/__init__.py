"""Draft-length policies (``speculate.policy``): fixed γ, the draft model's confidence, or adaptive."""

from __future__ import annotations

from spectoolkit.config import DRAFT_POLICIES, SpeculateConfig
from spectoolkit.policy.adaptive import AdaptivePolicy
from spectoolkit.policy.base import ConfidencePolicy, DraftLengthPolicy, FixedPolicy


def make_policy(
    speculate: SpeculateConfig, kind: str | None = None, max_gamma: int | None = None, tree: bool | None = None
) -> DraftLengthPolicy:
    """The policy ``kind`` (default ``speculate.policy``), drafting at most ``max_gamma`` (default γ; token-tree
    nodes when ``tree``, default ``speculate.tree`` enabled: then ``max_nodes``), as deep as
    :func:`draft_depth` says. The policy is the one holder of both: drafters take them from each round's budget."""
    kind = kind or speculate.policy
    tree = speculate.tree.enabled if tree is None else tree
    gamma = max_gamma or (speculate.tree.max_nodes if tree else speculate.gamma)
    depth = draft_depth(speculate) if tree else gamma
    if kind == "adaptive":
        return AdaptivePolicy(gamma, speculate.decay, speculate.probe_every, tree, depth)
    if kind == "confidence":
        return ConfidencePolicy(gamma, speculate.confidence, depth)
    if kind == "fixed":
        return FixedPolicy(gamma, depth)
    raise ValueError(f"unknown draft-length policy {kind!r}; use one of {', '.join(DRAFT_POLICIES)}")


def draft_depth(speculate: SpeculateConfig) -> int:
    """How deep a round's tree may grow, whoever grows it (a draft model, a head, a lookup's trie): a static tree's
    ``len(branching)``, else ``tree.max_depth`` or γ."""
    tree = speculate.tree
    return len(tree.branching) if tree.kind == "static" else tree.max_depth or speculate.gamma


__all__ = [
    "DRAFT_POLICIES",
    "AdaptivePolicy",
    "ConfidencePolicy",
    "DraftLengthPolicy",
    "FixedPolicy",
    "draft_depth",
    "make_policy",
]
