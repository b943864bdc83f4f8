"""No import cycles among the kernels modules.

Each module under kernels/ is imported alone, as the first kernels module of a
fresh interpreter: one subprocess imports the third-party libraries (torch,
triton, numpy: they cannot be part of a cycle of ours), then forks a child per
module, so every child starts with no kernels or workbench module loaded. A
cycle that breaks an import (``from kernels.x import y`` while kernels.x is
half-initialised) fails there. The static check reads every module's imports
and finds any cycle among the kernels modules, including ones that happen to
import without error today, and the direction between families (nothing in
kernels.gemm or kernels.common imports kernels.moe).
"""
from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> list[str]:
    names = []
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        names.append(".".join(parts))
    return names


MODULES = _modules()

_FORKER = textwrap.dedent(r'''
    import importlib, json, os, sys, traceback
    sys.path.insert(0, sys.argv[1])
    import numpy, torch, triton, triton.language  # noqa: F401  (third-party: shared by every child)
    assert not any(m == "kernels" or m.startswith(("kernels.", "workbench")) for m in sys.modules)
    results = {}
    for name in json.loads(sys.argv[2]):
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(r)
            try:
                importlib.import_module(name)
                msg = "ok"
            except BaseException:
                msg = traceback.format_exc()[-2000:]
            os.write(w, msg.encode())
            os._exit(0)
        os.close(w)
        with os.fdopen(r) as f:
            results[name] = f.read()
        os.waitpid(pid, 0)
    print("RESULTS" + json.dumps(results))
''')


@pytest.fixture(scope="module")
def import_results():
    if not hasattr(os, "fork"):
        pytest.skip("needs os.fork")
    proc = subprocess.run([sys.executable, "-c", _FORKER, str(ROOT), json.dumps(MODULES)], capture_output=True,
                          text=True, timeout=300, cwd=ROOT)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS")), None)
    assert line is not None, f"rc={proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(line[len("RESULTS"):])


@pytest.mark.parametrize("module", MODULES)
def test_each_module_imports_alone(import_results, module):
    assert import_results[module] == "ok", import_results[module]


def _imports(path: Path, module: str) -> set[str]:
    """The kernels modules this file imports (at any depth), as module names."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = {f"{base}.{a.name}" for a in node.names}
            if not subs <= set(MODULES):   # `from pkg import module` depends on the module alone
                found.add(base)
            found.update(subs)
    return {m for m in found if m in MODULES and m != module}


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted((ROOT / "kernels").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        module = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        graph[module] = _imports(path, module)
    return graph


def test_no_import_cycle_among_kernels_modules():
    graph = _graph()
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                pytest.fail("import cycle: " + " -> ".join(path[path.index(n):] + [n]))
            if n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_family_direction():
    graph = _graph()
    for m, deps in graph.items():
        if m.startswith(("kernels.gemm", "kernels.common")):
            assert not any(d.startswith("kernels.moe") for d in deps), (m, deps)
        if m.startswith("kernels.common"):
            assert all(d.startswith("kernels.common") for d in deps), (m, deps)
