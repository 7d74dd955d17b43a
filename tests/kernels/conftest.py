"""Kernel tests run on CUDA when there is one, else under Triton's CPU interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when its module is imported; this
conftest is imported before the kernel test modules, and the product code imports kernel modules only
on CUDA, so every kernel decorated in a CPU test session is an interpreted one.

What the interpreter cannot show: under it ``tl.dot`` is numpy's ``matmul``, so the summation order of one
row of a tile is whatever kernel numpy's BLAS picks for that row's place in the tile (OpenBLAS's choice, which
``OPENBLAS_CORETYPE`` changes: with ``Haswell`` on an AMD EPYC, rows 6–15 of a 16-row tile sum in another
order than row 0). A test that moves a row to another place in a tile and asserts the same bits would check
OpenBLAS, not our kernel: it asks for :func:`gpu_tile_order` and runs on CUDA only (and in
``experiments/cuda_check.py`` on a GPU). Under the interpreter the same calls are checked against the
kernels' references; tests whose rows keep their place in the tile (a request alone and batched) stay.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="Triton ships for Linux only")

INTERPRETER_ORDER = (
    "a row's bits at another place in a tile: under Triton's interpreter tl.dot is numpy's matmul, whose "
    "per-row summation order is the BLAS's choice (OPENBLAS_CORETYPE), not the kernel's; checked on CUDA "
    "(here and in experiments/cuda_check.py)"
)


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests put their tensors: CUDA when present, else the CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@pytest.fixture
def gpu_tile_order() -> None:
    """Skips the test off CUDA: it asserts a GPU tile's summation order (module docstring)."""
    if not torch.cuda.is_available():
        pytest.skip(INTERPRETER_ORDER)
