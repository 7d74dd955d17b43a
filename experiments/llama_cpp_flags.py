"""CMake flags that build llama.cpp (``make llama-cpp``) for the CPU at hand: what this CPU *runs*, not what it lists.

``-DGGML_NATIVE=ON`` compiles with ``-march=native``, which enables every feature ``/proc/cpuinfo`` lists.
Some guests list features they cannot run (AMX on these Intel VMs: the kernel refuses the tile-data
permission, and the native build dies with "Illegal instruction"), while an AVX2-only CPU (AMD Zen 3)
must never get AVX-512 flags. So each x86 feature llama.cpp can use is probed: a tiny C program using
one of its instructions is compiled with gcc at -O0 (nothing folded away) and run; a feature is usable
when that program exits 0.

Prints the flags for ``CMAKE_ARGS``: ``-DGGML_NATIVE=ON`` when every listed feature runs, otherwise
``-DGGML_NATIVE=OFF`` and one ``-DGGML_<FEATURE>=ON|OFF`` per probed feature. ``--explain`` prints one
line per feature to stderr. Without gcc or off x86-64 it prints the native build (llama.cpp's default).
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Feature:
    ggml: str  # GGML_<ggml> CMake option
    cpuinfo: str  # the flag /proc/cpuinfo lists for it
    gcc: str  # gcc flags that enable the intrinsic
    body: str  # C statements using it; the program returns 0 when they ran


_VEC256 = "volatile float a[8] = {1}; __m256 x = _mm256_loadu_ps((float *)a);"
_VEC512 = "volatile float a[16] = {1}; __m512 x = _mm512_loadu_ps((float *)a);"
_AMX_PERM = "if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) return 2;"
_AMX_TILE = "unsigned char cfg[64] = {1}; cfg[16] = 64; cfg[48] = 16; _tile_loadconfig(cfg); _tile_zero(0);"

FEATURES = (
    Feature("AVX", "avx", "-mavx", f"{_VEC256} x = _mm256_add_ps(x, x); _mm256_storeu_ps((float *)a, x);"),
    Feature("AVX2", "avx2", "-mavx2", "volatile int a[8] = {1}; __m256i x = _mm256_loadu_si256((void *)a);"
            " x = _mm256_add_epi32(x, x); _mm256_storeu_si256((void *)a, x);"),
    Feature("FMA", "fma", "-mfma", f"{_VEC256} x = _mm256_fmadd_ps(x, x, x); _mm256_storeu_ps((float *)a, x);"),
    Feature("F16C", "f16c", "-mf16c", "volatile float a[4] = {1};"
            " __m128i h = _mm_cvtps_ph(_mm_loadu_ps((float *)a), 0); _mm_storeu_ps((float *)a, _mm_cvtph_ps(h));"),
    Feature("BMI2", "bmi2", "-mbmi2", "volatile unsigned a = 7; a = _pdep_u32(a, 0xff);"),
    Feature("AVX_VNNI", "avx_vnni", "-mavxvnni", "volatile int a[8] = {1}; __m256i x = _mm256_loadu_si256((void *)a);"
            " x = _mm256_dpbusd_avx_epi32(x, x, x); _mm256_storeu_si256((void *)a, x);"),
    Feature("AVX512", "avx512f", "-mavx512f", f"{_VEC512} x = _mm512_fmadd_ps(x, x, x);"
            " _mm512_storeu_ps((float *)a, x);"),
    Feature("AVX512_VBMI", "avx512vbmi", "-mavx512f -mavx512vbmi", "volatile char a[64] = {1};"
            " __m512i x = _mm512_loadu_si512((void *)a); x = _mm512_permutexvar_epi8(x, x);"
            " _mm512_storeu_si512((void *)a, x);"),
    Feature("AVX512_VNNI", "avx512_vnni", "-mavx512f -mavx512vnni", "volatile int a[16] = {1};"
            " __m512i x = _mm512_loadu_si512((void *)a); x = _mm512_dpbusd_epi32(x, x, x);"
            " _mm512_storeu_si512((void *)a, x);"),
    Feature("AVX512_BF16", "avx512_bf16", "-mavx512f -mavx512bf16", f"{_VEC512}"
            " __m256bh b = _mm512_cvtneps_pbh(x); volatile short s = ((short *)&b)[0]; (void)s;"),
    Feature("AMX_TILE", "amx_tile", "-mamx-tile", f"{_AMX_PERM} {_AMX_TILE} _tile_release();"),
    Feature("AMX_INT8", "amx_int8", "-mamx-tile -mamx-int8", f"{_AMX_PERM} {_AMX_TILE} _tile_zero(1);"
            " _tile_zero(2); _tile_dpbssd(0, 1, 2); _tile_release();"),
    Feature("AMX_BF16", "amx_bf16", "-mamx-tile -mamx-bf16", f"{_AMX_PERM} {_AMX_TILE} _tile_zero(1);"
            " _tile_zero(2); _tile_dpbf16ps(0, 1, 2); _tile_release();"),
)  # fmt: skip

_PROGRAM = """#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
int main(void) {{ {body} return 0; }}
"""


def listed_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> set[str]:
    """The feature flags the CPU (or the guest's view of it) lists."""
    for line in cpuinfo.read_text().splitlines() if cpuinfo.exists() else ():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def runs(feature: Feature, gcc: str, workdir: Path) -> bool:
    """Whether a program using ``feature``'s instructions compiles and exits 0 here (SIGILL: no)."""
    source, binary = workdir / f"{feature.ggml}.c", workdir / feature.ggml
    source.write_text(_PROGRAM.format(body=feature.body))
    built = subprocess.run([gcc, "-O0", *feature.gcc.split(), str(source), "-o", str(binary)], capture_output=True)
    return built.returncode == 0 and subprocess.run([str(binary)], capture_output=True, timeout=30).returncode == 0


def cmake_args(explain: bool = False) -> list[str]:
    """``-DGGML_NATIVE=ON`` when every listed feature runs; else NATIVE=OFF and one flag per probed feature."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None or platform.machine() not in ("x86_64", "AMD64"):
        return ["-DGGML_NATIVE=ON"]
    listed = listed_flags()
    with tempfile.TemporaryDirectory() as tmp:
        usable = {f.ggml: runs(f, gcc, Path(tmp)) for f in FEATURES}
    if explain:
        for f in FEATURES:
            state = "runs" if usable[f.ggml] else "does not run"
            print(f"{f.ggml:12s} listed={f.cpuinfo in listed!s:5s} {state}", file=sys.stderr)
    if all(usable[f.ggml] for f in FEATURES if f.cpuinfo in listed):
        return ["-DGGML_NATIVE=ON"]
    return ["-DGGML_NATIVE=OFF"] + [f"-DGGML_{f.ggml}={'ON' if usable[f.ggml] else 'OFF'}" for f in FEATURES]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--explain", action="store_true", help="one line per probed feature on stderr")
    print(" ".join(cmake_args(parser.parse_args().explain)))


if __name__ == "__main__":
    main()
