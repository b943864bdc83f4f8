"""No import cycles among the kernels modules, nor anywhere in the house (workbench, kernels, experiments).

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


# --------------------------------------------------------------------------
# The whole house: workbench, kernels, experiments
# --------------------------------------------------------------------------
HOUSE = ("workbench", "kernels", "experiments")


def _house_modules() -> dict[str, Path]:
    out = {}
    for top in HOUSE:
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _house_imports(path: Path, module: str, known) -> dict[str, set[str]]:
    """{module of ours this file imports: the names it takes from it} (at any depth). A script
    of experiments/ imports its neighbours by their bare names (``import overlap``)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, set[str]] = {}

    def ours(name: str) -> str | None:
        if name in known:
            return name
        if module.startswith("experiments") and f"{package}.{name}" in known:
            return f"{package}.{name}"
        return None

    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for a in node.names:
                m = ours(a.name)
                if m:
                    found.setdefault(m, set())
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            subs = {a.name: ours(f"{base}.{a.name}") for a in node.names}
            for name, sub in subs.items():
                if sub:   # `from pkg import module` depends on the module alone
                    found.setdefault(sub, set())
                elif ours(base):
                    found.setdefault(ours(base), set()).add(name)
    found.pop(module, None)
    return found


def _house_graph() -> dict[str, dict[str, set[str]]]:
    mods = _house_modules()
    return {m: _house_imports(p, m, mods) for m, p in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_cycle_finder_finds_a_planted_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert _cycles(graph) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_anywhere_in_the_house():
    graph = _house_graph()
    assert len(graph) > 100 and {"workbench.sweep", "kernels.gemm", "experiments.run_ag_gemm"} <= set(graph)
    assert "experiments.overlap" in graph["experiments.run_ag_gemm"]   # bare-name imports are followed
    cycles = _cycles({m: set(deps) for m, deps in graph.items()})
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


RUNNERS = ("workbench.sweep", "workbench.sweep_point", "workbench.sweep_rows", "workbench.sweep_rank",
           "workbench.report", "workbench.report_html", "workbench.report_index", "workbench.tune")
HANDING_OVER = ("workbench.sweep_command", "workbench.sweep_jobs", "workbench.report_command",
                "workbench.report_jobs", "workbench.tune_command", "workbench.jobs")


def test_runners_know_no_executor_and_executors_take_public_names_only():
    graph = _house_graph()
    for runner in RUNNERS:
        assert not any(d.startswith(("workbench.executors", "workbench.jobs")) or d in HANDING_OVER
                       for d in graph[runner]), (runner, sorted(graph[runner]))
    users = [m for m in graph if m in HANDING_OVER or m.startswith("workbench.executors")]
    assert len(users) >= len(HANDING_OVER) + 3
    for m in users:
        private = {d: sorted(n for n in names if n.startswith("_")) for d, names in graph[m].items()}
        assert not any(private.values()), (m, {d: n for d, n in private.items() if n})
        # nor through an imported module's attribute (sweep._RowStore)
        mods = {a.asname or a.name.rpartition(".")[2] for node in ast.walk(ast.parse(_house_modules()[m].read_text()))
                if isinstance(node, ast.ImportFrom) for a in node.names if a.name in {d.rpartition(".")[2]
                                                                                       for d in graph[m]}}
        reached = [f"{n.value.id}.{n.attr}" for n in ast.walk(ast.parse(_house_modules()[m].read_text()))
                   if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in mods
                   and n.attr.startswith("_") and not n.attr.startswith("__")]
        assert not reached, (m, reached)
