"""No import cycle between spectoolkit modules, function-level imports and package __init__s included."""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import cycles, import_graph

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"spectoolkit": REPO / "spectoolkit", "spectoolkit.kernels": REPO / "kernels"}


def test_spectoolkit_has_no_import_cycle():
    found = cycles(import_graph(ROOTS))
    assert not found, "import cycles (break each with a leaf module both sides import): " + "; ".join(
        " <-> ".join(component) for component in found
    )


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_a_planted_cycle_is_found(tmp_path):
    _write(tmp_path, {
        "__init__.py": "",
        "low.py": "def f():\n    from pkg.high import g  # a function-level import still counts\n",
        "high.py": "from pkg.low import f\n",
        "leaf.py": "import os\n",
    })  # fmt: skip
    assert cycles(import_graph({"pkg": tmp_path})) == [["pkg.high", "pkg.low"]]


def test_a_cycle_through_a_package_init_is_found(tmp_path):
    _write(tmp_path, {
        "__init__.py": "",
        "sub/__init__.py": "from pkg.sub.chooser import choose\n",
        "sub/chooser.py": "def choose():\n    from pkg.backend import run\n",
        "sub/rules.py": "",
        "backend.py": "from pkg.sub.rules import *\n",  # runs pkg/sub/__init__.py, which imports the chooser
    })  # fmt: skip
    assert cycles(import_graph({"pkg": tmp_path})) == [["pkg.backend", "pkg.sub", "pkg.sub.chooser"]]


def test_type_checking_imports_and_relative_imports(tmp_path):
    _write(tmp_path, {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "b.py": "from . import a\n",
    })  # fmt: skip
    graph = import_graph({"pkg": tmp_path})
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.a"] == set()
    assert cycles(graph) == []
