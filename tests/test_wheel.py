"""What ships is what is tested: the wheel built from a clean copy of the tree holds every module and data file.

``make install`` is editable, so every other test imports the source tree and would pass with a package
left out of the wheel. Here the wheel is built from a copy of the tracked files, installed non-editable
into a throwaway directory, and, with the source tree off ``sys.path``, every module is imported and the
CLI composes its config. Fails on a package missing from discovery (setup.py), a yaml, a task file, or a
kernel source.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# source tree directory -> where it lives inside the installed package
SHIPPED = {"spectoolkit": "spectoolkit", "conf": "spectoolkit/conf", "kernels": "spectoolkit/kernels"}
DATA_SUFFIXES = (".py", ".yaml", ".jsonl", ".cpp", ".h", ".c")


def _git_files(*paths: str) -> list[str]:
    """The checkout's files (committed or new, not ignored) under ``paths``."""
    listing = ["git", "ls-files", "--cached", "--others", "--exclude-standard", *paths]
    return subprocess.run(listing, cwd=ROOT, capture_output=True, text=True, check=True).stdout.splitlines()


def _tracked_files() -> list[str]:
    return [name for name in _git_files(*SHIPPED) if name.endswith(DATA_SUFFIXES)]


def _installed_name(tracked: str) -> str:
    top, _, rest = tracked.partition("/")
    return f"{SHIPPED[top]}/{rest}"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of the tracked tree and installed (no deps) into a fresh directory."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout (the wheel is built from its tracked files)")
    base = tmp_path_factory.mktemp("wheel")
    copy, dist, target = base / "src", base / "dist", base / "site"
    for name in _git_files():
        if (ROOT / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, copy / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", str(dist), str(copy)], check=True)
    (wheel,) = dist.glob("spectoolkit-*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-compile", "--target", str(target), str(wheel)], check=True)
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    missing = [name for name in map(_installed_name, _tracked_files()) if name not in names]
    assert not missing, f"the wheel lacks {len(missing)} shipped file(s): {missing[:10]}"
    return target


def _run_installed(target: Path, *args: str) -> subprocess.CompletedProcess:
    """``python *args`` with the installed copy first on the path and the source tree nowhere on it."""
    env = {**os.environ, "PYTHONPATH": str(target), "PYTHONSAFEPATH": "1"}
    return subprocess.run([sys.executable, *args], cwd=target.parent, env=env, capture_output=True, text=True)


IMPORT_ALL = """
import importlib, sys
import spectoolkit
assert spectoolkit.__path__[0].startswith(sys.argv[1]), f"imported {spectoolkit.__path__[0]}, not the installed copy"
for name in sys.argv[2:]:
    importlib.import_module(name)
"""


def _module_names() -> list[str]:
    """Every tracked module as the installed package names it (``conf/…`` is ``spectoolkit.conf.…``)."""
    names = []
    for tracked in _tracked_files():
        if tracked.endswith(".py"):
            name = _installed_name(tracked).removesuffix(".py").removesuffix("/__init__").replace("/", ".")
            names.append(name)
    return sorted(set(names) - {"spectoolkit.__main__", "spectoolkit.serve"})  # entry points: run, not imported


def test_wheel_imports_every_module_off_the_source_tree(installed: Path):
    names = _module_names()
    assert "spectoolkit.policy.base" in names and "spectoolkit.kernels.verify" in names
    done = _run_installed(installed, "-c", IMPORT_ALL, str(installed), *names)
    assert done.returncode == 0, done.stderr[-3000:]


def test_wheel_cli_composes_the_config(installed: Path):
    done = _run_installed(installed, "-m", "spectoolkit", "+target=int4", "+draft=bf16", "--cfg", "job")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "precision: int4" in done.stdout and "kind: model" in done.stdout, done.stdout[:2000]
