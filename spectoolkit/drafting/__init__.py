"""Proposers behind one batched interface: a draft model (any precision, incl. a self-draft), n-gram lookup,
suffix decoding."""

from spectoolkit.drafting.base import Budget, Drafter, Drafting, Lone
from spectoolkit.drafting.model_drafter import ModelDrafter, lone_drafter
from spectoolkit.drafting.ngram import NgramDrafter, lookup
from spectoolkit.drafting.suffix import SuffixDrafter, SuffixSettings
from spectoolkit.drafting.tree import TokenTree

__all__ = [
    "Budget",
    "Drafter",
    "Drafting",
    "Lone",
    "ModelDrafter",
    "NgramDrafter",
    "SuffixDrafter",
    "SuffixSettings",
    "TokenTree",
    "lone_drafter",
    "lookup",
]
