"""workbench.sweep with world sizes above 1: each world size is one torchrun world
(gloo on the CPU here) running tests/fake_dist_kernel.py, a module whose `run`
all-gathers with torch.distributed; skipped worlds, resume, a rank that raises,
hangs or dies. Few launches: torchrun takes seconds to start."""
from __future__ import annotations

import json
import math
import tempfile
from pathlib import Path

import pytest
import yaml

from workbench import dist, sweep, sweep_point
from workbench.sweep import SpecError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def world_folders_in_tmp(tmp_path, monkeypatch):
    """A failed world keeps its folder (heartbeats, log) for a look: here, not in /tmp."""
    (tmp_path / "worlds").mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "worlds"))


@pytest.fixture
def fake_dist(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "tests"))  # `fake_dist_kernel`; the ranks get this path from the plan
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    return "fake_dist_kernel"


def write_spec(tmp_path, d, name="fakedist.yaml"):
    p = tmp_path / "experiments" / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(yaml.safe_dump(d, sort_keys=False))
    return p


def base_spec(kernel, **over):
    d = {"name": "fakedist", "kernel": kernel, "dtypes": ["float32"], "world_size": [1, 2],
         "bench": {"warmup_ms": 0, "rep_ms": 0}, "shapes": [{"n": [5, 8]}],
         "grid": {"mode": ["ok", "raise"], "tag": [0, 1]}, "baselines": ["gloo"],
         "launch_timeout_s": 120, "point_timeout_s": 60}
    d.update(over)
    return d


@pytest.fixture
def launches(monkeypatch):
    """Every dist.launch call the sweep makes (the real one runs)."""
    calls = []
    real = dist.launch

    def counting(*args, **kw):
        calls.append(args[1])
        return real(*args, **kw)

    monkeypatch.setattr(dist, "launch", counting)
    return calls


def test_world_points_skip_run_in_a_world_and_resume(fake_dist, tmp_path, launches, monkeypatch, capsys):
    p = write_spec(tmp_path, base_spec(fake_dist))
    out = tmp_path / "results"
    n_points = len(sweep.expand(sweep.load_spec(p)))
    assert n_points == 2 * (2 * 4 + 2)  # 2 world sizes x (2 shapes x 4 configs + 2 baselines)

    # Fewer GPUs than ranks: the world's points are recorded as skipped, nothing launched.
    with monkeypatch.context() as m:
        m.setattr(sweep, "_world_capacity", lambda device: 1)
        df = sweep.run_spec(p, results_dir=out, progress=False)
    assert launches == [] and len(df) == n_points
    w2 = df[df.world_size == 2]
    assert (w2.status == "skipped").all() and (df[df.world_size == 1].status == "ok").all()
    assert "world size 2 needs 2 GPUs and this machine has 1" in w2.error.iloc[0]

    # A machine that can: one world of 2 ranks runs every skipped point, and replaces its row.
    df = sweep.run_spec(p, results_dir=out, progress=True)
    err = capsys.readouterr().err
    assert launches == [2]
    assert "world size 2: 10 rows on 2 ranks (torchrun, gloo)" in err and "sweep fakedist" in err
    assert len(df) == n_points and "skipped" not in set(df.status)
    w2 = df[df.world_size == 2]
    boom = w2[w2.p_mode == "raise"]
    assert len(boom) == 4 and (boom.status == "runtime_error").all()
    assert boom.error.str.contains("rank 1: RuntimeError: rank 1 exploded on purpose").all()
    ok = w2[w2.p_mode != "raise"]
    assert len(ok) == 6 and (ok.status == "ok").all(), ok[["config", "status", "error"]]
    assert (ok.rel_err == 0).all() and ok.median_ms.gt(0).all() and not ok.is_performance.any()
    assert set(ok.timing_method) == {"collective-host-timer"}
    assert all(len(json.loads(v)) == 2 for v in ok.ms_per_rank)  # the slowest of both ranks' medians
    assert (ok.bytes == ok.n * 4).all()  # bytes_moved ran inside the 2-rank world: (W - 1) * n * 4
    assert set(ok.variant) == {"triton", "gloo"}
    assert json.loads(ok.knobs.iloc[0])["dist_backend"] == "gloo"
    for col in ("git_sha", "torch_version", "device_name", "hostname", "timestamp", "run_id"):
        assert ok[col].notna().all(), col
    w1 = df[df.world_size == 1]
    assert (w1.status == "ok").all() and (w1.bytes == 0).all() and w1.ms_per_rank.isna().all()
    assert set(w1.device_name) == set(w2.device_name)

    # Resume: everything is recorded, so no world is launched.
    df2 = sweep.run_spec(p, results_dir=out, progress=False)
    assert launches == [2] and len(df2) == n_points
    assert "0 rows run" in capsys.readouterr().err


def test_a_rank_that_hangs_or_dies_fails_only_its_world(fake_dist, tmp_path, launches):
    d = base_spec(fake_dist, world_size=[2, 3], shapes=[{"n": 4}], grid={"mode": ["ok", "hang2", "die3"]},
                  point_timeout_s=5)
    p = write_spec(tmp_path, d)
    df = sweep.run_spec(p, results_dir=tmp_path / "r", progress=False)
    assert launches == [2, 3]  # the hung world of 2 did not stop the world of 3
    st = {(int(r.world_size), r.config): (r.status, r.error) for r in df.itertuples()}
    assert len(st) == 8

    assert st[(2, "ok t0")][0] == "ok"
    status, error = st[(2, "hang2 t0")]
    assert status == "timeout" and "rank 1 made no progress" in error and "checked run" in error, error
    for config in ("die3 t0", "gloo"):  # after the hang: not run, named, and tried again on resume
        status, error = st[(2, config)]
        assert status == "not_run" and "rank 1 made no progress" in error, (config, error)

    assert st[(3, "ok t0")][0] == "ok" and st[(3, "hang2 t0")][0] == "ok"
    status, error = st[(3, "die3 t0")]
    assert status == "crashed" and "rank 1 exited with code 7" in error, error
    status, error = st[(3, "gloo")]
    assert status == "not_run" and "rank 1 exited with code 7" in error

    # not_run rows do not count as done; crashed / timeout ones do (like a point that kills the process).
    done = sweep.RowStore(tmp_path / "r").done_keys()
    assert len(done) == 8 - 3
    assert len(list((tmp_path / "worlds").iterdir())) == 2  # both failed worlds kept their folders


def test_world_sizes_are_validated_against_the_module(fake_dist, tmp_path):
    with pytest.raises(SpecError, match=r"world_size: 4: fake_dist_kernel supports world sizes 2, 3"):
        sweep.load_spec(write_spec(tmp_path, base_spec(fake_dist, world_size=[2, 4])))
    for bad in (0, [], "2"):
        with pytest.raises(SpecError, match="world_size"):
            sweep.load_spec(write_spec(tmp_path, base_spec(fake_dist, world_size=bad)))
    with pytest.raises(SpecError, match="point_timeout_s: expected a number of seconds"):
        sweep.load_spec(write_spec(tmp_path, base_spec(fake_dist, point_timeout_s=0)))
    spec = sweep.load_spec(write_spec(tmp_path, base_spec(fake_dist, launch_timeout_s=30)))
    assert spec.launch_timeout_s == 30 and spec.point_timeout_s == 60 and spec.world_sizes == [1, 2]


def test_all_gather_spec_declares_worlds_of_2_and_4(capsys):
    from workbench import cli

    spec = sweep.load_spec(ROOT / "experiments" / "all_gather.yaml")
    pts = sweep.expand(spec)
    assert spec.world_sizes == [2, 4] and {p.world_size for p in pts} == {2, 4}
    assert sum(p.world_size == 2 for p in pts) == sum(p.world_size == 4 for p in pts)
    assert {p.baseline for p in pts if p.baseline} == {"nccl"}
    assert cli.main(["sweep", str(ROOT / "experiments" / "all_gather.yaml"), "--quick", "--dry-run"]) == 0
    assert "world sizes 2, 4; spec OK" in capsys.readouterr().out


def test_point_json_round_trip_keeps_the_point_id(fake_dist, tmp_path):
    spec = sweep.load_spec(write_spec(tmp_path, base_spec(fake_dist)))
    for p in sweep.expand(spec):
        q = sweep_point.point_from_json(json.loads(json.dumps(sweep_point.point_to_json(p))))
        assert q == p and q.point_id(spec.kernel) == p.point_id(spec.kernel)


def test_retry_rows_are_replaced_not_duplicated(tmp_path):
    store = sweep.RowStore(tmp_path)
    row = {"point_id": "a", "variant": "triton", "repeat": 0, "device_name": "cpu", "status": "skipped"}
    store.add(dict(row))
    store.add(dict(row, point_id="b", status="ok"))
    store.flush()
    assert store.done_keys("cpu") == {("b", "triton", 0)}
    store.add(dict(row, status="ok", median_ms=1.0))
    store.add(dict(row, device_name="other GPU", status="not_run"))
    df = store.frame()
    assert len(df) == 3 and set(df[df.point_id == "a"].status) == {"ok", "not_run"}
    assert store.done_keys("cpu") == {("a", "triton", 0), ("b", "triton", 0)}
    assert not math.isnan(df[(df.point_id == "a") & (df.status == "ok")].median_ms.iloc[0])


def test_all_gather_module_in_a_cpu_world(tmp_path, monkeypatch):
    """kernels.comm.sweep through a torchrun world of 2 on gloo: each rank gathers in a
    simulated world (interpreter); its nccl baseline needs a GPU world and says so."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    d = {"name": "ag_tiny", "kernel": "kernels.comm.sweep", "dtypes": ["float16"], "world_size": [2],
         "bench": {"warmup_ms": 0, "rep_ms": 0}, "shapes": [{"M": 3, "N": 24}],
         "grid": {"variant": ["triton", "copy_engine"], "num_sms": [2]}, "baselines": ["nccl"],
         "launch_timeout_s": 300}
    df = sweep.run_spec(write_spec(tmp_path, d, "ag_tiny.yaml"), results_dir=tmp_path / "r", progress=False)
    assert len(df) == 3 and (df.world_size == 2).all()
    ok = df[~df.is_baseline]
    assert (ok.status == "ok").all(), ok[["config", "status", "error"]].to_string()
    assert (ok.rel_err == 0).all() and (ok.bytes == 1 * 3 * 24 * 2).all()  # (W - 1) x shard, W from the world
    nccl = df[df.is_baseline].iloc[0]
    assert nccl.status == "runtime_error" and "needs an initialized torch.distributed" in nccl.error
