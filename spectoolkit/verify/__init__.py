"""Verification of drafted tokens against the target: greedy and exact stochastic (DESIGN §1).

The torch rules only: the fused kernel's reference is these rules, so this package sits below the
kernels, and the verifier that runs the kernel, with the chooser (choose once with
:func:`spectoolkit.kernels.verifier.make_verifier`), lives beside that kernel.
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
