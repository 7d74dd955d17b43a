"""The one place a verifier is chosen: greedy or exact stochastic, in torch or on the fused kernel.

Not re-exported by :mod:`spectoolkit.verify`: the fused verifier imports the kernel module, whose
torch reference imports the verification rules (``spectoolkit.verify.rules``, hence the package), so
the package itself must not import the chooser.
"""

from __future__ import annotations

import torch

from spectoolkit.config import SamplingConfig
from spectoolkit.kernels.runtime import kernels_usable
from spectoolkit.verify.base import Verifier
from spectoolkit.verify.fused import FusedVerifier
from spectoolkit.verify.greedy import GreedyVerifier
from spectoolkit.verify.stochastic import StochasticVerifier


def make_verifier(sampling: SamplingConfig, device: torch.device | str | None = None) -> Verifier:
    """The verifier for ``sampling``: greedy when ``temperature == 0``, exact stochastic otherwise.

    On a ``device`` where the Triton kernels run (CUDA, ``kernels_usable``) both rules run as one
    kernel launch (:class:`~spectoolkit.verify.fused.FusedVerifier`, same tokens); elsewhere in torch.
    """
    if device is not None and kernels_usable(device):
        return FusedVerifier(sampling)
    return GreedyVerifier() if sampling.greedy else StochasticVerifier(sampling)
