"""No import cycle between spectoolkit modules, nor between its packages, and packages import only downward.

Modules: function-level imports and package ``__init__``s included. Packages: ``spectoolkit.X`` (a
top-level package or module), with ``spectoolkit.bench.Y`` per bench sub-package; their imports point
down :data:`LAYERS` (DESIGN §4, "Imports point down this list, between folders too").
"""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import (
    attribute_probes,
    cycles,
    edges_between,
    import_graph,
    layer_violations,
    package_graph,
)

REPO = Path(__file__).resolve().parent.parent
ROOTS = {"spectoolkit": REPO / "spectoolkit", "spectoolkit.kernels": REPO / "kernels"}
NESTED = ("spectoolkit.bench",)  # bench's sub-packages (protocol, load, report, sweep) are layers of their own

# The package layers, lowest first: a package imports only packages of its own layer or lower ones.
# DESIGN §4's list, adapted where the code differs today:
# - verify (the chain and tree rules) sits below kernels: the fused kernel's torch reference is
#   those rules; the verifier that runs the kernel, and the chooser, live in kernels.verifier.
# - kvcache is the KV formats only (the paged pool that stores them is runtime's).
# - models sits above kernels: loading, the stock reference forward, heads. Our kernels, their choice, the
#   packing and the static decoder body all live in kernels/ (issue 47). quant sits above models (its backends
#   load checkpoints through models) and so above kernels; the RTN weight format the Triton matmul reads lives
#   beside that kernel (kernels.rtn_format).
# - policy (draft lengths and the step-cost curve) sits below drafting: a hybrid drafter prices its choices by
#   that curve (issue 48).
# - serving/ (the one engine's scheduler, drafters and loop, until it folds into runtime/) sits above
#   drafting, policy and runtime, which it uses.
# - wiring (loading models with quantization, building a run's arms) sits below eval, bench and server.
# - training (a draft head's data, objective and loop) sits above wiring: it loads its target through it.
# - checkpoints (a model spec resolved once) sits low, beside compat, which checks the pair it resolves.
# - backends sit below bench: the load benchmark measures them; server and the entry points top it off.
LAYERS: list[tuple[str, ...]] = [
    ("spectoolkit", "spectoolkit.errors", "spectoolkit.precisions", "spectoolkit.embedded", "spectoolkit.pair"),
    (
        "spectoolkit.config",
        "spectoolkit.sampling",
        "spectoolkit.config_checks",
        "spectoolkit.path_checks",
        "spectoolkit.checkpoints",
        "spectoolkit.compat",
    ),
    ("spectoolkit.workloads",),
    ("spectoolkit.verify",),
    ("spectoolkit.kvcache",),
    ("spectoolkit.kernels",),
    ("spectoolkit.models",),
    ("spectoolkit.quant",),
    ("spectoolkit.runtime",),
    ("spectoolkit.policy",),
    ("spectoolkit.drafting",),
    ("spectoolkit.serving",),
    ("spectoolkit.metrics",),
    ("spectoolkit.wiring",),
    ("spectoolkit.training",),
    ("spectoolkit.eval",),
    ("spectoolkit.backends",),
    ("spectoolkit.bench", "spectoolkit.bench.report"),
    ("spectoolkit.bench.sweep",),
    ("spectoolkit.bench.protocol",),
    ("spectoolkit.bench.load",),
    ("spectoolkit.server",),
    ("spectoolkit.report", "spectoolkit.__main__"),
    ("spectoolkit.serve", "spectoolkit.train_draft"),
]


def test_spectoolkit_has_no_import_cycle():
    found = cycles(import_graph(ROOTS))
    assert not found, "import cycles (break each with a leaf module both sides import): " + "; ".join(
        " <-> ".join(component) for component in found
    )


def test_spectoolkit_has_no_package_cycle():
    graph = import_graph(ROOTS)
    found = cycles(package_graph(graph, "spectoolkit", NESTED))
    edges = [
        f"  {a} -> {b}: " + ", ".join(edges_between(graph, a, b, "spectoolkit", NESTED))
        for component in found
        for a in component
        for b in component
        if a != b and edges_between(graph, a, b, "spectoolkit", NESTED)
    ]
    named = "; ".join(" <-> ".join(component) for component in found)
    assert not found, f"package cycles (move code to the layer it belongs to): {named}\n" + "\n".join(edges)


def test_packages_import_only_down_the_layers():
    graph = import_graph(ROOTS)
    problems = layer_violations(package_graph(graph, "spectoolkit", NESTED), LAYERS)
    assert not problems, "\n".join(problems)


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


def test_a_planted_package_cycle_is_found(tmp_path):
    _write(tmp_path, {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/x.py": "from pkg.b.y import g\n",
        "a/w.py": "",
        "b/__init__.py": "",
        "b/y.py": "def g():\n    pass\n",
        "b/z.py": "def h():\n    from pkg.a import w  # a function-level import still counts\n",
    })  # fmt: skip
    graph = import_graph({"pkg": tmp_path})
    assert cycles(graph) == []  # no module imports itself back: only the packages form a cycle
    assert cycles(package_graph(graph, "pkg")) == [["pkg.a", "pkg.b"]]
    assert layer_violations(package_graph(graph, "pkg"), [("pkg",), ("pkg.a",), ("pkg.b",)]) == [
        "pkg.a (layer 1) imports pkg.b (layer 2)"
    ]


def test_nested_packages_and_unlisted_packages(tmp_path):
    _write(tmp_path, {
        "__init__.py": "",
        "top.py": "import pkg.group.low\n",
        "group/__init__.py": "",
        "group/low/__init__.py": "",
        "group/high/mod.py": "from pkg.group.low import x\n",
    })  # fmt: skip
    packages = package_graph(import_graph({"pkg": tmp_path}), "pkg", ("pkg.group",))
    assert packages == {"pkg": set(), "pkg.top": {"pkg.group", "pkg.group.low"}, "pkg.group": set(),
                        "pkg.group.low": set(), "pkg.group.high": {"pkg.group.low"}}  # fmt: skip
    layers = [("pkg", "pkg.group"), ("pkg.group.low",), ("pkg.group.high", "pkg.top")]
    assert layer_violations(packages, layers) == []
    assert layer_violations(packages, layers[:2]) == [
        "pkg.group.high is in no layer: add it to the layer list",
        "pkg.top is in no layer: add it to the layer list",
    ]


# The engine, its scheduler and builder, the batch-1 arms and the drafters talk through declared protocols
# (Drafter, Runner, Verifier, DraftLengthPolicy): none asks another whether it has an attribute (issue 48).
PROTOCOL_ONLY = [*sorted((REPO / "spectoolkit" / "serving").glob("*.py")), *sorted((REPO / "spectoolkit" /
                 "drafting").glob("*.py")), REPO / "spectoolkit" / "wiring" / "one_engine.py"]  # fmt: skip


def test_the_engine_reaches_its_parts_only_through_their_protocols():
    found = attribute_probes(PROTOCOL_ONLY)
    assert not found, "declare it in the protocol (with a default) instead of probing:\n" + "\n".join(found)


def test_a_planted_probe_in_the_engine_is_found(tmp_path):
    engine = (REPO / "spectoolkit" / "serving" / "engine.py").read_text(encoding="utf-8")
    planted = engine.replace("self.capture: tuple[int, ...] = drafter.capture if drafter is not None else ()",
                             'self.capture = tuple(getattr(drafter, "capture", ()))')  # fmt: skip
    assert planted != engine  # guard: the line it replaces is still there
    (tmp_path / "engine.py").write_text(planted, encoding="utf-8")
    (found,) = attribute_probes([tmp_path / "engine.py"])
    assert 'getattr(drafter, "capture", ())' in found
