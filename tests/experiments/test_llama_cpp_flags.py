"""``make llama-cpp`` builds for the CPU it runs on: each x86 feature is probed by running it, never assumed."""

from __future__ import annotations

import importlib.util
import platform
import shutil
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "experiments" / "llama_cpp_flags.py"
_SPEC = importlib.util.spec_from_file_location("llama_cpp_flags", _PATH)
flags = importlib.util.module_from_spec(_SPEC)
sys.modules["llama_cpp_flags"] = flags  # dataclasses resolve their module by name
_SPEC.loader.exec_module(flags)

x86_with_gcc = pytest.mark.skipif(
    platform.machine() != "x86_64" or shutil.which("gcc") is None, reason="probes x86 features with gcc"
)


@x86_with_gcc
def test_probes_agree_with_what_this_cpu_lists(tmp_path: Path):
    """Every baseline x86-64-v3 feature this CPU lists runs; AVX-512 runs only where the CPU lists it."""
    listed = flags.listed_flags()
    by_name = {f.ggml: f for f in flags.FEATURES}
    for name in ("AVX", "AVX2", "FMA", "F16C"):
        if by_name[name].cpuinfo in listed:
            assert flags.runs(by_name[name], "gcc", tmp_path), f"{name} is listed but its probe failed"
    if "avx512f" not in listed:  # e.g. AMD Zen 3: the probe must die (SIGILL), not pass
        assert not flags.runs(by_name["AVX512"], "gcc", tmp_path)


@x86_with_gcc
def test_native_only_when_every_listed_feature_runs(monkeypatch: pytest.MonkeyPatch):
    listed = {"avx", "avx2", "fma", "f16c", "amx_tile"}
    monkeypatch.setattr(flags, "listed_flags", lambda: listed)
    monkeypatch.setattr(flags, "runs", lambda f, gcc, workdir: f.cpuinfo in listed - {"amx_tile"})
    args = flags.cmake_args()
    assert args[0] == "-DGGML_NATIVE=OFF", "a listed feature that cannot run must turn the native build off"
    assert "-DGGML_AVX2=ON" in args and "-DGGML_AMX_TILE=OFF" in args and "-DGGML_AVX512=OFF" in args
    monkeypatch.setattr(flags, "runs", lambda f, gcc, workdir: f.cpuinfo in listed)
    assert flags.cmake_args() == ["-DGGML_NATIVE=ON"]
