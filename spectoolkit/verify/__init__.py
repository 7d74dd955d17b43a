"""Verification of drafted tokens against the target: greedy and exact stochastic (DESIGN §1).

Choose once with :func:`make_verifier`; the baseline loop uses ``Verifier.select`` so baseline and
speculative decoding pick tokens the same way.
"""

from spectoolkit.verify.base import Verifier, VerifyResult, make_verifier
from spectoolkit.verify.greedy import GreedyVerifier
from spectoolkit.verify.stochastic import StochasticVerifier, verify_with_uniforms

__all__ = [
    "GreedyVerifier",
    "StochasticVerifier",
    "Verifier",
    "VerifyResult",
    "make_verifier",
    "verify_with_uniforms",
]
