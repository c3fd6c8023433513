"""No two modules of the package depend on each other, directly or round a longer circle.

Every import counts, wherever it is written (at the top, inside a function, or for the type
checker only): each still ties the two modules together, so neither can be read, tested or
moved without the other. Read from the source alone (``ast``), nothing is imported.
"""

from __future__ import annotations

import ast
from pathlib import Path

from cdc_platform.lib.config import REPO_ROOT

PACKAGE = REPO_ROOT / "cdc_platform"


def _modules() -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its ``__init__``)."""
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules ``module`` imports: ``from a import b`` imports ``a``, and ``a.b``
    too when that is a module."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up a level per dot past the first
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            found |= {base, *(f"{base}.{a.name}" for a in node.names)}
    return {m for m in found if m in known and m != module}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def import_circles() -> list[list[str]]:
    """Each group of modules that import one another round a circle, sorted."""
    modules = _modules()
    graph = {m: _imports_of(m, p, set(modules)) for m, p in modules.items()}
    reach = {m: _reachable(graph, m) for m in graph}
    groups = {frozenset(o for o in reach[m] if m in reach[o]) for m in graph if m in reach[m]}
    return sorted(sorted(g) for g in groups)


def test_no_modules_import_each_other() -> None:
    assert import_circles() == [], "modules that import each other (directly or round a circle)"


def test_a_circle_is_found_however_it_is_imported(tmp_path: Path) -> None:
    """A circle closed by a function's import or a type checker's only is one too."""
    (tmp_path / "a.py").write_text("def f():\n    from pkg import b\n")
    (tmp_path / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import pkg.a\n"
    )
    known = {"pkg.a", "pkg.b"}
    assert _imports_of("pkg.a", tmp_path / "a.py", known) == {"pkg.b"}
    assert _imports_of("pkg.b", tmp_path / "b.py", known) == {"pkg.a"}
