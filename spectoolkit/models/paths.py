"""Where a model runs: the device, checked up front (``auto`` picks CUDA when there is one).

Where it comes from is :mod:`spectoolkit.checkpoints` (a spec resolved once to a
:class:`~spectoolkit.checkpoints.Checkpoint`).
"""

from __future__ import annotations

import torch

from spectoolkit.errors import SpecToolkitError


def resolve_device(device: str) -> torch.device:
    """``auto`` picks CUDA when available; ``cuda`` without a GPU is a user error."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise SpecToolkitError("device=cuda but no CUDA device is available: use device=cpu or device=auto")
    return torch.device(device)
