"""The import graph of the two packages: arrows point down and never close a circle.

Every import is read from the source with ``ast`` at any depth (a lazy import inside a
function and a ``TYPE_CHECKING`` import count too: a reader follows them all), so
nothing is imported here and the test runs without torch. Two rules:

- no circle between modules of ``jaxrope`` and ``torch_bridge``;
- the core imports nothing of the torch layer or the benchmarks: no ``jaxrope`` module
  imports ``torch_bridge`` or ``bench``.
"""

from __future__ import annotations

import ast
import pathlib
from typing import Dict, Iterator, List, Set, Tuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("jaxrope", "torch_bridge")


def modules(root: pathlib.Path, packages=PACKAGES) -> Dict[str, pathlib.Path]:
    """``{dotted name: path}`` of every module file under ``root``'s ``packages``."""
    found = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imported(name: str, path: pathlib.Path) -> Iterator[Tuple[str, Tuple[str, ...]]]:
    """``(module, names)`` for every import of ``path`` (module ``name``): ``import X`` and
    ``importlib.import_module("X")`` are ``(X, ())``, ``from X import Y, Z`` is
    ``(X, (Y, Z))``, relative imports resolved."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from ((alias.name, ()) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                anchor = parts[:len(parts) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            yield base, tuple(alias.name for alias in node.names)
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__")):
            yield node.args[0].value, ()   # importlib.import_module("pkg.mod")


def graph(found: Dict[str, pathlib.Path]) -> Dict[str, Set[str]]:
    """``{module: modules it imports}`` within ``found``: ``from X import Y`` is an arrow
    to ``X.Y`` when that is a module, else to ``X``; an import of a name outside ``found``
    is an arrow to its nearest enclosing module in ``found``, if any."""
    def nearest(target: str) -> str:
        while target and target not in found:
            target = target.rpartition(".")[0]
        return target

    arrows: Dict[str, Set[str]] = {}
    for name, path in found.items():
        targets = set()
        for base, names in imported(name, path):
            submodules = [f"{base}.{n}" for n in names if f"{base}.{n}" in found]
            targets.update(submodules)
            if len(submodules) < len(names) or not names:
                targets.add(nearest(base))
        arrows[name] = targets - {"", name}
    return arrows


def circles(arrows: Dict[str, Set[str]]) -> List[List[str]]:
    """The strongly connected components of more than one module (Tarjan), sorted."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    on_stack: Set[str] = set()
    found: List[List[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(arrows.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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

    for node in sorted(arrows):
        if node not in index:
            visit(node)
    return sorted(found)


def test_no_import_circle_between_modules():
    arrows = graph(modules(ROOT))
    found = circles(arrows)
    assert not found, "\n".join(
        " <-> ".join(circle) + ": " + "; ".join(
            f"{a} -> {b}" for a in circle for b in sorted(arrows[a]) if b in circle)
        for circle in found)


def test_the_core_imports_neither_the_torch_layer_nor_the_benchmarks():
    offenders = [f"{name} imports {target}"
                 for name, path in modules(ROOT, ("jaxrope",)).items()
                 for target, _ in imported(name, path)
                 if target.split(".")[0] in ("torch_bridge", "bench")]
    assert not offenders, offenders


def test_the_walk_sees_a_circle_closed_by_a_lazy_relative_import(tmp_path):
    # The check above must be able to fail: a package whose two modules import each
    # other, one of them lazily inside a function through a relative import.
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from . import a\n    return a\n")
    (package / "c.py").write_text("import pkg.a\n")
    arrows = graph(modules(tmp_path, ("pkg",)))
    assert arrows["pkg.c"] == {"pkg.a"}
    assert circles(arrows) == [["pkg.a", "pkg.b"]]


def test_the_walk_sees_the_core_importing_the_torch_layer_lazily(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("import importlib\n"
                    "def f():\n    from torch_bridge.launch import runtime\n    return runtime\n"
                    "def g():\n    return importlib.import_module('torch_bridge.demo.cli')\n")
    assert {("torch_bridge.launch", ("runtime",)), ("torch_bridge.demo.cli", ())} <= set(
        imported("jaxrope.m", path))
