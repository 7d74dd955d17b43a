"""Kernel tests run on CUDA when there is one, else under Triton's CPU interpreter.

Triton reads ``TRITON_INTERPRET`` when a kernel is decorated, i.e. when its module is imported; this
conftest is imported before the kernel test modules, and the product code imports kernel modules only
on CUDA, so every kernel decorated in a CPU test session is an interpreted one.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton", reason="Triton ships for Linux only")


@pytest.fixture
def device() -> torch.device:
    """Where kernel tests put their tensors: CUDA when present, else the CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
