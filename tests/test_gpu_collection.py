"""`pytest -m gpu tests/` and `-m multigpu` on a GPU node that has torch and triton but not the
notebook stack: every GPU-marked test is collected, and the modules that need the stack skip
with a reason instead of stopping the collection.

One subprocess collects the suite (no test runs) with nbformat, papermill and nbconvert made
unimportable: a stub folder first on PYTHONPATH whose packages raise ImportError.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
STACK = ("nbformat", "papermill", "nbconvert")
NEEDS_STACK = {"test_report.py", "test_datasource.py", "test_browser.py"}
GPU_MARK = re.compile(r"pytest\.mark\.(?:multi)?gpu\b")


def test_gpu_tests_collect_without_the_notebook_stack(tmp_path):
    stub = tmp_path / "no_notebook_stack"
    for name in STACK:
        (stub / name).mkdir(parents=True)
        (stub / name / "__init__.py").write_text(f"raise ImportError('{name}: not installed on this node (stub)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(stub), str(REPO), os.environ.get("PYTHONPATH")]))}
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-rs", "-p", "no:cacheprovider",
                          "-m", "gpu or multigpu", "tests/"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-4000:]
    assert not re.search(r"\berrors?\b", out.splitlines()[-1]), out[-4000:]
    # the stub is what the modules saw
    probe = subprocess.run([sys.executable, "-c", "import nbformat"], env=env, capture_output=True, text=True)
    assert probe.returncode != 0 and "stub" in probe.stderr
    collected = {line.split("::")[0].split("/")[-1] for line in res.stdout.splitlines() if "::" in line}
    with_gpu_tests = {p.name for p in (REPO / "tests").glob("test_*.py")
                      if GPU_MARK.search(p.read_text(encoding="utf-8"))} - NEEDS_STACK
    assert with_gpu_tests and with_gpu_tests <= collected, sorted(with_gpu_tests - collected)
    assert not collected & NEEDS_STACK
    skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
    for name in NEEDS_STACK:
        assert any(name in line and "notebook stack" in line for line in skipped), (name, skipped)
