"""The package's edges (docs/design.md#layout): which modules may import which, no cycles, one top-level name.

The import graph is read from the source with :mod:`ast` (every ``import``,
at module level or inside a function: a lazy import still ties two modules
together), so the test needs nothing installed and runs in milliseconds.
"""

from __future__ import annotations

import ast
import os
import tomllib

import networkx as nx
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SUBPACKAGES = ("graphpipe.frontend", "graphpipe.search", "graphpipe.sched", "graphpipe.runtime", "graphpipe.cli", "graphpipe.evals")


def _modules() -> dict[str, str]:
    """Module name -> file, for graphpipe/ and evals/ (installed as graphpipe.evals)."""
    found = {}
    for folder, package in (("graphpipe", "graphpipe"), ("evals", "graphpipe.evals")):
        base = os.path.join(ROOT, folder)
        for dirpath, _, files in os.walk(base):
            rel = os.path.relpath(dirpath, base)
            prefix = package if rel == "." else package + "." + rel.replace(os.sep, ".")
            for f in files:
                if f.endswith(".py"):
                    name = prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}"
                    found[name] = os.path.join(dirpath, f)
    return found


def _resolve(name: str, known: set[str]) -> str | None:
    """The module ``name`` names, or its longest known prefix (``pkg.attr`` -> ``pkg``)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> nx.DiGraph:
    modules = _modules()
    known = set(modules)
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for name, path in modules.items():
        package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
        tree = ast.parse(open(path, encoding="utf-8").read(), path)
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    mod = f"{base}.{node.module}" if node.module else base
                else:
                    mod = node.module or ""
                if mod == "evals" or mod.startswith("evals."):
                    mod = "graphpipe." + mod
                targets = [f"{mod}.{a.name}" for a in node.names]  # a submodule, or an attribute of mod
            for target in targets:
                resolved = _resolve(target, known)
                if resolved and resolved != name:
                    graph.add_edge(name, resolved)
    return graph


def _in(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_import_graph_has_no_cycle():
    graph = import_graph()
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


def test_library_code_never_imports_the_cli():
    graph = import_graph()
    bad = [(a, b) for a, b in graph.edges if _in(b, "graphpipe.cli") and not _in(a, "graphpipe.cli")
           and a != "graphpipe.__main__"]
    assert not bad, bad


def test_the_layers_point_down():
    """The core imports no subpackage; sched never imports search; only the CLI and evals import runtime (and the
    package's ``__getattr__``, which re-exports ``graphpipe.Pipeline`` on first use)."""
    graph = import_graph()
    core = [m for m in graph if not any(_in(m, p) for p in SUBPACKAGES)]
    for a, b in graph.edges:
        if a in core and a not in ("graphpipe", "graphpipe.__main__"):
            if a in FRONTEND_DOORS and _in(b, "graphpipe.frontend"):
                continue
            assert not any(_in(b, p) for p in SUBPACKAGES), f"core module {a} imports {b}"
        if _in(a, "graphpipe.sched"):
            assert not _in(b, "graphpipe.search"), f"{a} imports {b}"
        if _in(b, "graphpipe.runtime") and not _in(a, "graphpipe.runtime"):
            assert _in(a, "graphpipe.cli") or _in(a, "graphpipe.evals") or (a, b) == ("graphpipe", "graphpipe.runtime.api"), \
                f"{a} imports {b}"


FRONTEND_DOORS = ("graphpipe.models", "graphpipe.planning")
"""Core modules that may reach the torch front end, lazily: the MODEL-spec resolver and the planning API (a spec
given to either may be a module to capture)."""


def _imports_torch(path: str) -> list[int]:
    """Lines of ``path`` that import torch (at module level or inside a function)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), path)
    return [n.lineno for n in ast.walk(tree)
            if isinstance(n, ast.Import) and any(a.name.split(".")[0] == "torch" for a in n.names)
            or isinstance(n, ast.ImportFrom) and not n.level and (n.module or "").split(".")[0] == "torch"]


def test_the_core_is_torch_free():
    """Every top-level ``graphpipe/*.py`` module plans without torch: torch lives in the front end (capture,
    export, zoo, profile) and the runtime, never in the core beside them."""
    core = {m: p for m, p in _modules().items() if m.count(".") == 1 and m.startswith("graphpipe.")
            and not p.endswith("__init__.py")}
    assert "graphpipe.graph" in core and "graphpipe.plan" in core
    bad = {m: _imports_torch(p) for m, p in core.items() if _imports_torch(p)}
    assert not bad, f"core modules importing torch (module: lines): {bad}"


def test_the_torch_check_sees_a_planted_import(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n    import torch.nn as nn\n    from torch import fx\n")
    assert _imports_torch(str(path)) == [2, 3]


def test_the_check_sees_a_planted_cycle(tmp_path, monkeypatch):
    """The cycle check can fail: two modules that import each other are found."""
    pkg = tmp_path / "graphpipe"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from graphpipe.b import g\n")
    (pkg / "b.py").write_text("from graphpipe import a\n")
    (tmp_path / "evals").mkdir()
    monkeypatch.setattr(__import__(__name__), "ROOT", str(tmp_path))
    assert ["graphpipe.a", "graphpipe.b"] in [sorted(c) for c in nx.simple_cycles(import_graph())]


def test_the_wheel_lists_every_package_folder_and_one_top_level_name():
    config = tomllib.load(open(os.path.join(ROOT, "pyproject.toml"), "rb"))["tool"]["setuptools"]
    listed = set(config["packages"])
    assert {p.split(".")[0] for p in listed} == {"graphpipe"}
    assert config["package-dir"] == {"graphpipe.evals": "evals"}
    on_disk = {m for m, path in _modules().items() if path.endswith("__init__.py")}
    assert listed == on_disk, f"pyproject packages {sorted(listed ^ on_disk)} out of step with the folders"


@pytest.mark.parametrize("module", ["graphpipe.runtime.worker", "graphpipe.runtime.baseline"])
def test_the_executor_and_the_torch_baseline_share_the_job_helpers(module):
    """Both build the model, check it and assemble their result with the same code, so they compare."""
    graph = import_graph()
    for shared in ("graphpipe.runtime.runnable", "graphpipe.runtime.reference", "graphpipe.runtime.results"):
        assert graph.has_edge(module, shared), (module, shared)
