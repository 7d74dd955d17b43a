"""The import graph of a package tree, read from source (imports inside functions included).

An edge ``a -> b`` means module ``a`` imports module ``b`` somewhere in its source: at module level,
inside a function or class, or as the parent package ``b`` of a module it imports (importing
``p.q.r`` runs ``p/__init__.py`` and ``p/q/__init__.py`` too, unless the importer is inside them).
Imports under ``if TYPE_CHECKING:`` are not edges: they never run.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from pathlib import Path


def module_files(roots: dict[str, Path]) -> dict[str, Path]:
    """Module name -> source file, for every ``*.py`` under each root (root dir -> its package name)."""
    modules: dict[str, Path] = {}
    for package, root in roots.items():
        for path in sorted(Path(root).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join([package, *parts])] = path
    return modules


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterable[str]:
    """Every dotted name an import statement in ``tree`` may load (``from a import b`` gives a.b and a)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join([*parts, *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)
        stack.extend(ast.iter_child_nodes(node))


def import_graph(roots: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports (see the module docstring)."""
    modules = module_files(roots)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        ancestors = {".".join(module.split(".")[:i]) for i in range(1, module.count(".") + 1 + is_package)}
        targets: set[str] = set()
        for name in _imported_names(ast.parse(path.read_text(encoding="utf-8")), module, is_package):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # the module itself and every package above it
                candidate = ".".join(parts[:i])
                if candidate in modules and candidate != module and candidate not in ancestors:
                    targets.add(candidate)
        graph[module] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (each one import cycle or more), sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:  # iterative Tarjan: deep graphs never hit the recursion limit
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return sorted(found)


def package_of(module: str, root: str, nested: tuple[str, ...] = ()) -> str:
    """The package ``module`` counts toward: ``root.X`` for a module under ``root`` (``root`` for its
    ``__init__``), one level deeper, ``root.X.Y``, inside each package named in ``nested``."""
    parts = module.split(".")
    depth = len(root.split(".")) + 1
    for package in nested:
        if module.startswith(package + "."):
            depth = len(package.split(".")) + 1
    return ".".join(parts[:depth])


def package_graph(graph: dict[str, set[str]], root: str, nested: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """Package -> the other packages its modules import: :func:`import_graph` collapsed by :func:`package_of`."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        package = package_of(module, root, nested)
        imported = {package_of(target, root, nested) for target in targets}
        packages.setdefault(package, set()).update(imported - {package})
    return packages


def edges_between(graph: dict[str, set[str]], importer: str, imported: str, root: str, nested=()) -> list[str]:
    """The module edges ``a -> b`` behind the package edge ``importer -> imported`` (for error messages)."""
    return sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        if package_of(module, root, nested) == importer
        for target in targets
        if package_of(target, root, nested) == imported
    )


def layer_violations(packages: dict[str, set[str]], layers: list[tuple[str, ...]]) -> list[str]:
    """Package edges that point up ``layers`` (lowest first; a package may import its own layer or lower),
    and packages no layer lists, as readable lines."""
    level = {package: index for index, layer in enumerate(layers) for package in layer}
    unlisted = sorted(packages.keys() - level.keys())
    problems = [f"{package} is in no layer: add it to the layer list" for package in unlisted]
    for package, imported in sorted(packages.items()):
        for target in sorted(imported):
            if package in level and target in level and level[target] > level[package]:
                problems.append(f"{package} (layer {level[package]}) imports {target} (layer {level[target]})")
    return problems


PROBES = ("getattr", "hasattr")


def attribute_probes(paths: Iterable[Path]) -> list[str]:
    """Every ``getattr``/``hasattr`` call in ``paths`` (``file:line: source``): a part asking another whether it has
    something, where the two should talk through a declared protocol."""
    found = []
    for path in paths:
        source = Path(path).read_text(encoding="utf-8")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES:
                found.append(f"{Path(path).name}:{node.lineno}: {ast.get_source_segment(source, node)}")
    return found
