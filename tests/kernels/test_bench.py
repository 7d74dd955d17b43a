"""The kernel benchmark's CPU-checkable parts: peak-bandwidth lookup and the no-GPU message."""

from __future__ import annotations

import pytest
import torch

from spectoolkit.kernels import bench


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H200", 4800), ("NVIDIA H100 80GB HBM3", 3350), ("NVIDIA H100 PCIe", 2000),
     ("NVIDIA A100-SXM4-80GB", 2039), ("NVIDIA A100-SXM4-40GB", 1555), ("NVIDIA L40S", 864), ("Some GPU", None)],
)  # fmt: skip
def test_peak_bandwidth_is_looked_up_by_device_name(name: str, peak: float | None) -> None:
    assert bench.peak_gbps(name) == peak


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message printed without a GPU")
def test_without_a_gpu_the_benchmark_says_so(capsys) -> None:
    assert bench.main([]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: the kernel benchmark needs a CUDA GPU") and "TRITON_INTERPRET=1" in err


def test_kernels_run_only_on_cuda_and_can_be_switched_off(monkeypatch) -> None:
    from spectoolkit.kernels.runtime import kernels_usable

    assert not kernels_usable("cpu")  # the interpreter is for tests, never the product path
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert kernels_usable("cuda")
    monkeypatch.setenv("SPECTOOLKIT_KERNELS", "0")
    assert not kernels_usable("cuda")
