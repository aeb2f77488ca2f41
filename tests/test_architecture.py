"""The package's shape: no import cycles (lazy imports counted), the layering contract of ``pyproject.toml``, a
short package root, and the public API visible to ``dir()``.

The import graph comes from grimp, the library import-linter is built on (the ``dev`` extra): it reads every
``import`` statement of every module, the ones inside functions included.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import ppokit

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = Path(ppokit.__file__).resolve().parent


def _graph():
    grimp = pytest.importorskip("grimp", reason="the import graph needs the dev extra: pip install -e '.[dev]'")
    return grimp.build_graph("ppokit")


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_cycle_finder_finds_a_lazy_cycle():
    # What the next test relies on: a two-module loop and a three-module loop are found, a chain is not.
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": set()}) == [["a", "b"]]
    assert _cycles({"x": {"y"}, "y": {"z"}, "z": {"x"}}) == [["x", "y", "z"]]


def test_no_module_imports_itself_back_through_others():
    graph = _graph()
    # The package root only re-exports (lazily) and registers the envs; every module implicitly imports it as
    # its parent, so edges to the root are not dependencies.
    edges = {m: {d for d in graph.find_modules_directly_imported_by(m) if d.startswith("ppokit.")}
             for m in graph.modules if m.startswith("ppokit.")}
    assert _cycles(edges) == []


def test_the_layering_contract_holds():
    if shutil.which("lint-imports") is None:
        pytest.skip("lint-imports needs the dev extra: pip install -e '.[dev]'")
    proc = subprocess.run(["lint-imports"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_the_package_root_has_a_few_modules_and_the_rest_live_in_subpackages():
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert top == ["__init__.py", "__main__.py", "_version.py"]
    packages = sorted(p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file())
    assert packages == ["analysis", "cli", "config", "core", "diagnostics", "envs", "export", "kernels", "lm",
                        "policies", "rollout", "runtime", "sb3", "training", "update"]


def test_dir_of_the_package_lists_the_public_api():
    names = dir(ppokit)
    for name in ("train", "resume", "load", "evaluate", "PPOConfig", "ConfigError", "Agent", "Run", "__version__"):
        assert name in names, name


def test_importing_the_package_root_loads_no_torch():
    code = "import sys, ppokit; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
