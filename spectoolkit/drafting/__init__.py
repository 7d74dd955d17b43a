"""Proposers: a draft model (any precision, incl. a self-draft), n-gram prompt lookup."""

from spectoolkit.drafting.base import Drafter, Proposal
from spectoolkit.drafting.model_drafter import ModelDrafter
from spectoolkit.drafting.ngram import NgramDrafter, lookup

__all__ = ["Drafter", "ModelDrafter", "NgramDrafter", "Proposal", "lookup"]
