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


def test_comm_cases_wire_every_variant_in_a_simulated_world():
    """experiments/launch_cost_comm.py's cases, built on simulated heaps (2 ranks, tiny problems):
    every variant of the three multi-rank launchers is there by name and runs on every rank
    (the library calls need a process group: they are timed on GPUs only)."""
    import torch

    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import launch_cost_comm as lcc
    finally:
        sys.path.pop(0)
    from kernels.ag_gemm import AgGemmConfig
    from workbench import dist

    world = dist.SimulatedWorld(2, heap_bytes=1 << 20)
    sim = AgGemmConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_stages=1, num_warps=1, fetchers=2,
                       k_per_flag=1, num_sms=5, ce_chunks=2)
    sizes = {"gather_rows": (3,), "ag": ((24, 32, 48),), "scatter": ((5, 32, 16),)}

    def body(h):
        ran = {}
        for case, (lib, impls) in lcc.comm_cases(h, sizes=sizes, simulated_config=sim).items():
            for name, fn in impls.items():
                out = fn()
                h.barrier()   # (what the GPU run's barriers do between impls)
                ran.setdefault(case.split()[0], set()).add(name)
                assert out is None or torch.isfinite(out.float()).all(), (case, name)
        return ran

    ran = world.run(body)[0]
    assert ran["all_gather_matmul"] == set(lcc.AG_VARIANTS)
    assert ran["gemm_all_scatter"] == set(lcc.SCATTER_VARIANTS)
    assert ran["all_gather"] == {"triton", "copy_engine"}
