"""Shared pytest setup.

- Without a CUDA GPU, kernels run in Triton's interpreter: TRITON_INTERPRET=1
  must be set before any @triton.jit decorator runs, so it is set here, before
  test modules are imported. (Cross-compilation still works: workbench.asm
  rebuilds interpreted functions as compilable ones.)
- Tests marked `gpu` / `multigpu` skip cleanly, with a reason, without GPUs.
- Tests marked `slow` (GPU runs of several minutes) skip unless asked for: `--run-slow`.
- Tuning tables: a fresh, empty user directory (WORKBENCH_TUNING_DIR); no tune-on-miss.
"""
import importlib.util
import os
import tempfile
from pathlib import Path

import pytest

FIXTURES = Path(__file__).parent / "fixtures"


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


CUDA_COUNT = _cuda_count()
if CUDA_COUNT == 0:
    os.environ.setdefault("TRITON_INTERPRET", "1")
# The tests' tuning tables are their own (the shipped ones still load): a developer's tables in
# ~/.cache, or $WORKBENCH_TUNING_DIR, must not change which config a test's call runs.
os.environ["WORKBENCH_TUNING_DIR"] = tempfile.mkdtemp(prefix="workbench-tuning-tests-")
os.environ.pop("WORKBENCH_TUNE", None)


def pytest_addoption(parser):
    parser.addoption("--run-slow", action="store_true",
                     help="also run the tests marked slow (GPU runs of several minutes each)")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (sm_90: H100 or H200)")
    skip_multi = pytest.mark.skip(reason=f"needs 2 or more CUDA GPUs on one node (sm_90: H100 or H200), found {CUDA_COUNT}")
    skip_slow = pytest.mark.skip(reason="slow (several minutes on GPUs): pass --run-slow")
    for item in items:
        if "slow" in item.keywords and not config.getoption("--run-slow"):
            item.add_marker(skip_slow)
        elif "multigpu" in item.keywords and CUDA_COUNT < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and CUDA_COUNT < 1:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def isa_fixture_kernels():
    """tests/fixtures/isa/make_isa_fixtures.py, imported with the interpreter off so its kernels compile."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "0")
        spec = importlib.util.spec_from_file_location("_isa_fixture_kernels", FIXTURES / "isa" / "make_isa_fixtures.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def slurm_cluster():
    """A real one-node Slurm cluster (tests/slurm_cluster.py) for the session; SLURM_CONF points at it.

    Installs Debian's Slurm and munge when they are missing and this is root (as `make browser`
    does for chromium), else skips with the reason. Every daemon it starts is stopped by pid at
    the end, after the cluster's jobs are cancelled."""
    import slurm_cluster as sc

    why = sc.install()
    if why:
        pytest.skip(why)
    before = os.environ.get("SLURM_CONF")
    with sc.LocalSlurm() as cluster:
        os.environ.update(cluster.env())
        try:
            yield cluster
        finally:
            if before is None:
                os.environ.pop("SLURM_CONF", None)
            else:
                os.environ["SLURM_CONF"] = before


@pytest.fixture
def isolated_tables(monkeypatch, tmp_path):
    """The selection layer's tables for one test: its own user and shipped roots (empty), warnings
    said anew, no tune-on-miss asked by the environment, the default tuning budget."""
    from kernels.common import select, tables

    monkeypatch.setattr(tables, "_said", set())
    monkeypatch.setenv("WORKBENCH_TUNING_DIR", str(tmp_path / "user"))
    monkeypatch.setattr(tables, "SHIPPED_ROOT", tmp_path / "shipped")
    monkeypatch.setattr(select, "TABLES", tables.Tables())
    monkeypatch.delenv("WORKBENCH_TUNE", raising=False)
    monkeypatch.delenv("WORKBENCH_TUNE_BUDGET_S", raising=False)
    return tmp_path
