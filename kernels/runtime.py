"""When the Triton kernels run, and what a kernel exposes to the benchmark.

The pipeline uses a kernel on CUDA tensors when Triton imports, and the plain-torch path elsewhere;
the choice is made once, when a module or verifier is built (:func:`kernels_usable`). Tests run the
same kernels on the CPU under ``TRITON_INTERPRET=1`` (set before Triton is imported), by calling
the launch wrappers directly.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch


def triton_installed() -> bool:
    """Whether the ``triton`` package is importable here (it ships for Linux only)."""
    return importlib.util.find_spec("triton") is not None


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_usable(device: torch.device | str) -> bool:
    """Whether the product path should launch Triton kernels for tensors on ``device``.

    Only on CUDA: the interpreter is exact but far slower than the torch path, so it is for tests.
    ``SPECTOOLKIT_KERNELS=0`` keeps the torch path on CUDA too (to compare the two, or to rule the
    kernels out when a result looks wrong).
    """
    if os.environ.get("SPECTOOLKIT_KERNELS", "1") == "0":
        return False
    return torch.device(device).type == "cuda" and triton_installed() and torch.cuda.is_available()


def launchable(device: torch.device | str) -> bool:
    """Whether a launch wrapper can run for tensors on ``device``: CUDA, or the CPU interpreter."""
    kind = torch.device(device).type
    return triton_installed() and (kind == "cuda" or (kind == "cpu" and interpreting()))


def require_launchable(*tensors: torch.Tensor) -> None:
    """Raise one clear error when a launch wrapper is called where its kernel cannot run."""
    for tensor in tensors:
        if not launchable(tensor.device):
            raise RuntimeError(
                f"Triton kernels need CUDA tensors (got {tensor.device}); on the CPU they run only under "
                "TRITON_INTERPRET=1, set before triton is imported"
            )


@dataclass(frozen=True)
class BenchCase:
    """One kernel at one shape, for ``python -m spectoolkit.kernels.bench``.

    ``bytes_moved`` is the minimum HBM traffic of one call (inputs read once, outputs written once),
    so ``bytes_moved / time`` is the achieved bandwidth the roofline compares with the device's peak.
    """

    kernel: str  # e.g. "int4 gemm"
    shape: str  # e.g. "M=1 N=14336 K=4096 g=128"
    bytes_moved: int
    run_triton: Callable[[], object]
    run_torch: Callable[[], object]
