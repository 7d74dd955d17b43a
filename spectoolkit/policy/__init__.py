"""Draft-length policies (``speculate.policy``): fixed γ, the draft model's confidence, or adaptive."""

from __future__ import annotations

from spectoolkit.config import DRAFT_POLICIES, SpeculateConfig
from spectoolkit.policy.adaptive import AdaptivePolicy
from spectoolkit.policy.base import ConfidencePolicy, DraftLengthPolicy, FixedPolicy


def make_policy(
    speculate: SpeculateConfig, kind: str | None = None, max_gamma: int | None = None, tree: bool | None = None
) -> DraftLengthPolicy:
    """The policy ``kind`` (default ``speculate.policy``), drafting at most ``max_gamma`` (default γ; token-tree
    nodes when ``tree``, default ``speculate.tree`` enabled: then ``max_nodes``)."""
    kind = kind or speculate.policy
    tree = speculate.tree.enabled if tree is None else tree
    gamma = max_gamma or (speculate.tree.max_nodes if tree else speculate.gamma)
    if kind == "adaptive":
        return AdaptivePolicy(gamma, speculate.decay, speculate.probe_every, tree)
    if kind == "confidence":
        return ConfidencePolicy(gamma, speculate.confidence)
    if kind == "fixed":
        return FixedPolicy(gamma)
    raise ValueError(f"unknown draft-length policy {kind!r}; use one of {', '.join(DRAFT_POLICIES)}")


__all__ = ["DRAFT_POLICIES", "AdaptivePolicy", "ConfidencePolicy", "DraftLengthPolicy", "FixedPolicy", "make_policy"]
