"""Verification of drafted tokens against the target: greedy and exact stochastic (DESIGN §1).

Choose once with :func:`spectoolkit.verify.factory.make_verifier` (not re-exported here: it imports
the fused verifier, whose kernel module imports :mod:`spectoolkit.verify.rules` and so this package).
The baseline loop uses ``Verifier.select`` so baseline and speculative decoding pick tokens the same way.
"""

from spectoolkit.verify.base import Verifier, VerifyResult
from spectoolkit.verify.greedy import GreedyVerifier
from spectoolkit.verify.rules import verify_with_uniforms
from spectoolkit.verify.stochastic import StochasticVerifier

__all__ = [
    "GreedyVerifier",
    "StochasticVerifier",
    "Verifier",
    "VerifyResult",
    "verify_with_uniforms",
]
