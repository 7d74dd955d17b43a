"""Decode loops: the target-alone baseline and speculative decoding (batch size 1)."""

from spectoolkit.engine.base import Engine
from spectoolkit.engine.baseline import BaselineEngine
from spectoolkit.engine.output import GenerationOutput
from spectoolkit.engine.speculative import SpeculativeEngine
from spectoolkit.models.cached import CachedModel  # noqa: F401  re-exported

__all__ = ["BaselineEngine", "CachedModel", "Engine", "GenerationOutput", "SpeculativeEngine"]
