"""Follow one run's config through the code (issue 59): the walk from ``run_serving`` a newcomer reads.

Traces a small serving run on the embedded model (``bench/load/runner.py:run_serving``) up to its first load level
(the run assembled: models loaded, arms built; ``--phase all`` goes on through the levels) and records every call
into a ``spectoolkit`` function that receives the run's config or a group of it (a class of :mod:`spectoolkit.config`)
or what it resolves to (a ``Checkpoint``, a ``ResolvedRun``, where the checkout has them); those classes' own
methods and properties, field reads to a reader, are left out. Consecutive such calls in one file are one *stay*.
It prints:

- stays, and the distinct files they are in;
- climbs: stays in a file of a higher import layer than the stay before (the layers of
  tests/test_import_graph.py, read from this checkout);
- returns: stays in a file the walk already left;
- the files entered most often, and how often a model spec was resolved (``resolve_path``, compat's own
  ``_resolve``, ``pair.gguf_checkpoint``).

Run it on another checkout by putting that checkout first on the path (the layers stay this checkout's)::

    python experiments/config_walk.py                      # this checkout
    PYTHONPATH=/tmp/before python experiments/config_walk.py  # an older one (its kernels build on first use)
"""

from __future__ import annotations

import argparse
import ast
import collections
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESOLVERS = ("resolve_path", "_resolve", "gguf_checkpoint")
OVERRIDES = ("experiment=concurrency_sweep", "workload.num_prompts=2", "workload.max_new_tokens=8",
             "serve.concurrency=[1]", "bench.repeat=1", "+draft=ngram")  # fmt: skip


def layers() -> list[tuple[str, ...]]:
    """The package layers, lowest first, as tests/test_import_graph.py lists them (read, not imported)."""
    tree = ast.parse((REPO / "tests" / "test_import_graph.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == "LAYERS":
            return ast.literal_eval(node.value)
    raise SystemExit("tests/test_import_graph.py has no LAYERS")


def layer_of(module: str, table: list[tuple[str, ...]]) -> int:
    """The layer of ``module``: its longest package prefix in ``table``."""
    best, level = -1, 0
    for index, names in enumerate(table):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, level = len(name), index
    return level


class Assembled(Exception):
    """The run reached its first load level: the walk ends there."""


def carried() -> tuple[type, ...]:
    """The classes a walk follows: the config's, and the resolved checkpoints and run where the checkout has them."""
    from importlib import import_module

    from spectoolkit import config as config_module

    classes = [value for value in vars(config_module).values()
               if isinstance(value, type) and value.__module__ == config_module.__name__]  # fmt: skip
    for module, name in (("spectoolkit.checkpoints", "Checkpoint"), ("spectoolkit.models.paths", "Checkpoint"),
                         ("spectoolkit.wiring.resolve", "ResolvedRun")):  # fmt: skip
        try:
            classes.append(getattr(import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return tuple(classes)


def trace(overrides: list[str], phase: str) -> tuple[list[str], collections.Counter]:
    """The files of every call that carries the run's config (or what it resolved), in order, and the resolver
    calls, for one small serving run."""
    from hydra import compose, initialize_config_module

    import spectoolkit
    from spectoolkit.__main__ import config_from_hydra
    from spectoolkit.bench.load import runner

    root = str(Path(spectoolkit.__file__).parent)
    classes = carried()
    methods = {cls.__name__ for cls in classes}  # a carried class's own methods: reading a field, not a stay
    with tempfile.TemporaryDirectory() as out:
        with initialize_config_module(config_module="spectoolkit.conf", version_base=None):
            cfg = config_from_hydra(compose(config_name="config", overrides=[f"output_dir={out}", *overrides]))
        calls: list[str] = []
        resolved: collections.Counter = collections.Counter()

        def profile(frame, event, _arg) -> None:
            if event != "call":
                return
            code = frame.f_code
            if not code.co_filename.startswith(root) or code.co_qualname.split(".")[0] in methods:
                return
            if phase == "setup" and code.co_name == "_run_levels":
                raise Assembled
            if code.co_name in RESOLVERS:
                resolved[code.co_name] += 1
            arguments = [frame.f_locals.get(name) for name in code.co_varnames[: code.co_argcount]]
            if any(isinstance(value, classes) for value in arguments):
                calls.append(str(Path(code.co_filename).relative_to(Path(root).parent)))

        sys.setprofile(profile)
        try:
            runner.run_serving(cfg, progress=False)
        except Assembled:
            pass
        finally:
            sys.setprofile(None)
    return calls, resolved


def walk(calls: list[str]) -> dict:
    """Stays, files, climbs and returns of the call sequence ``calls``."""
    table = layers()
    stays = [file for index, file in enumerate(calls) if index == 0 or calls[index - 1] != file]
    modules = [file.removesuffix(".py").removesuffix("/__init__").replace("/", ".") for file in stays]
    seen: set[str] = set()
    climbs = returns = 0
    for index, file in enumerate(stays):
        if index and layer_of(modules[index], table) > layer_of(modules[index - 1], table):
            climbs += 1
        returns += file in seen
        seen.add(file)
    entered = collections.Counter(stays)
    return {"stays": len(stays), "files": len(seen), "climbs": climbs, "returns": returns,
            "entered": entered.most_common(8)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("overrides", nargs="*", default=list(OVERRIDES), help="Hydra overrides of the run")
    parser.add_argument("--phase", choices=("setup", "all"), default="setup", help="up to the first level, or all")
    args = parser.parse_args()
    calls, resolved = trace(args.overrides, args.phase)
    found = walk(calls)
    import spectoolkit

    print(f"checkout: {Path(spectoolkit.__file__).parents[1]}")
    print(f"calls carrying the config: {len(calls)}")
    print(f"stays {found['stays']} in {found['files']} files, climbs {found['climbs']}, returns {found['returns']}")
    print("entered most: " + ", ".join(f"{file} {count}" for file, count in found["entered"]))
    print("spec resolutions: " + (", ".join(f"{name} {count}" for name, count in resolved.items()) or "none"))


if __name__ == "__main__":
    main()
