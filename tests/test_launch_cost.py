"""experiments/launch_cost.py: what runs without a GPU (--help, and the CPU part of
--descriptors: both descriptor variants in Triton's interpreter)."""
from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "experiments" / "launch_cost.py"


def _run(*args, timeout=300):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=ROOT)


def test_help_names_the_descriptor_run():
    r = _run("--help")
    assert r.returncode == 0, r.stderr
    assert "--descriptors" in r.stdout and "--dry-run" in r.stdout and "--budget-s" in r.stdout


def test_descriptors_dry_run_checks_both_variants(tmp_path):
    r = _run("--out", str(tmp_path), "--descriptors", "--dry-run")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "descriptors_dry.csv").open()))
    assert {row["impl"] for row in rows} == {"host", "device"}
    assert all(row["ok"] == "True" for row in rows), rows
    assert {row["device_desc"] for row in rows if row["impl"] == "device"} == {"True"}
    assert {row["kind"] for row in rows if row["case"].startswith("matmul")} == {"tma", "splitk"}
    assert any(row["case"].startswith("grouped_gemm_wgrad") for row in rows)


def test_dry_run_needs_descriptors(tmp_path):
    r = _run("--out", str(tmp_path), "--dry-run")
    assert r.returncode != 0 and "--descriptors" in r.stderr


def test_descriptor_shapes_cover_the_goal_table_and_small_m():
    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import launch_cost
        import run_gemm_tiling
    finally:
        sys.path.pop(0)
    shapes = launch_cost._desc_shapes()
    assert len(shapes) == len(set(shapes))
    assert set(run_gemm_tiling.GOAL_SHAPES) <= set(shapes) and set(launch_cost.GEMM_SHAPES) <= set(shapes)
    assert {M for M, _, _ in shapes} >= {1, 16, 128}


def test_only_filter_for_the_gluon_rows(tmp_path):
    r = _run("--help")
    assert "--only" in r.stdout and "gluon" in r.stdout
    r = _run("--out", str(tmp_path), "--only", "gluon")
    assert r.returncode != 0 and "--only goes with --descriptors" in r.stderr
    r = _run("--out", str(tmp_path), "--descriptors", "--dry-run", "--only", "gluon")
    assert r.returncode != 0 and "Gluon" in r.stderr and not (tmp_path / "descriptors_dry.csv").exists()


def test_gluon_rows_are_the_shapes_the_plan_sends_to_gluon():
    """GLUON_SHAPES: goal-table shapes that the heuristic gives the Gluon kernel on an H200
    (132 SMs, bf16, aligned); the grouped cases' fwd and dgrad take it on sm_90 by default."""
    import torch

    from kernels.gemm.cold import heuristic
    from kernels.moe import config as mconfig

    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import launch_cost
    finally:
        sys.path.pop(0)
    assert set(launch_cost.GLUON_SHAPES) <= set(launch_cost._desc_shapes())
    for M, N, K in launch_cost.GLUON_SHAPES:
        cfg = heuristic(M, N, K, torch.bfloat16, 132, hopper=True, gluon=True, tma=True, c_aligned=True)
        assert cfg.gluon in ("pingpong", "coop"), (M, N, K, cfg)
    for G, T, N, K in launch_cost.GROUPED:   # K, N multiples of 8, G within the Gluon kernel's limit
        mconfig.check_alignment(N, K)
        mconfig.check_alignment(K, N)
        mconfig.check_groups(G)
