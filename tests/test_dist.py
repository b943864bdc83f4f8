"""workbench.dist: torchrun launches (gloo on CPU), failure naming, simulated world."""
import os
import textwrap
import time

import pytest
import torch

from workbench import dist

SCRIPT = textwrap.dedent('''
    import os, sys, time
    import torch.distributed as tdist
    from workbench import dist

    mode = sys.argv[1]
    with dist.worker() as w:
        got = [None] * w.world_size
        tdist.all_gather_object(got, w.rank * 10)
        w.emit({"gathered": got, "env": {k: os.environ.get(k) for k in dist.MULTICAST_OFF}})
        if mode == "exit" and w.rank == 1:
            os._exit(3)  # dies without a word
        if mode == "hang" and w.rank == 1:
            w.stage("stuck on purpose")
            time.sleep(600)
        if mode != "ok":
            w.stage("waiting for the others")
            tdist.barrier()
''')


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    p = tmp_path_factory.mktemp("dist") / "worker.py"
    p.write_text(SCRIPT)
    return p


def test_launch_gathers_rows_from_every_rank(script, tmp_path):
    res = dist.launch(script, 2, ["ok"], timeout_s=120, run_dir=tmp_path, backend="gloo",
                      env={"NCCL_NVLS_ENABLE": "1"})  # must not win over MULTICAST_OFF
    assert [r["rank"] for r in res.rows] == [0, 1]
    assert all(r["gathered"] == [0, 10] for r in res.rows)
    assert all(r["env"] == dist.MULTICAST_OFF for r in res.rows)
    assert (tmp_path / "rank0.done").exists() and (tmp_path / "rank1.done").exists()


def test_launch_names_the_rank_that_died(script, tmp_path):
    with pytest.raises(dist.LaunchError) as info:
        dist.launch(script, 2, ["exit"], timeout_s=120, run_dir=tmp_path, backend="gloo")
    assert not isinstance(info.value, dist.LaunchTimeout)
    assert info.value.ranks == [1]
    assert "rank 1 exited with code 3" in str(info.value)


def test_launch_rows_keeps_a_failed_worlds_error_as_text(script, tmp_path):
    rows, err = dist.launch_rows(script, 2, ["ok"], timeout_s=120, run_dir=tmp_path / "ok", backend="gloo")
    assert [r["rank"] for r in rows] == [0, 1] and err == ""
    rows, err = dist.launch_rows(script, 2, ["exit"], timeout_s=120, run_dir=tmp_path / "exit", backend="gloo")
    assert "rank 1 exited with code 3" in err


def test_launch_timeout_names_the_stuck_rank(script, tmp_path):
    t0 = time.monotonic()
    with pytest.raises(dist.LaunchTimeout) as info:
        dist.launch(script, 2, ["hang"], timeout_s=12, run_dir=tmp_path, backend="gloo", heartbeat_s=0.5)
    assert time.monotonic() - t0 < 40, "the world must be killed promptly"
    msg = str(info.value)
    assert "timed out after 12 s" in msg and 1 in info.value.ranks
    assert "rank 1: running, in stage 'stuck on purpose'" in msg
    assert "rank 0: running, in stage 'waiting for the others'" in msg
    pid = dist._read_json(tmp_path / "rank1.heartbeat")["pid"]
    time.sleep(0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the stuck rank is gone


def test_a_world_takes_the_first_gpus_the_user_made_visible(monkeypatch):
    """CUDA_VISIBLE_DEVICES=2,3 puts a 2-rank world on GPUs 2 and 3 (two worlds side by side on one
    node stay apart); with nothing set, GPUs 0 .. W-1."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2, 3,5")
    assert dist.first_gpus(2) == "2,3" and dist.first_gpus(1) == "2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert dist.first_gpus(2) == ""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert dist.first_gpus(4) == "0,1,2,3"


def test_launch_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="world_size"):
        dist.launch("x.py", 0)
    with pytest.raises(FileNotFoundError):
        dist.launch(tmp_path / "missing.py", 2)
    with pytest.raises(ValueError, match="neither"):
        dist.launch("not a module!", 2)


def test_child_env_keeps_multicast_off_and_repo_on_path(monkeypatch):
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    env = dist.child_env({"NVSHMEM_DISABLE_NVLS": "0"})
    assert all(env[k] == v for k, v in dist.MULTICAST_OFF.items())
    assert str(dist.REPO_ROOT) in env["PYTHONPATH"].split(os.pathsep)
    assert "TRITON_INTERPRET" not in env
    assert all(os.environ[k] == v for k, v in dist.MULTICAST_OFF.items() if k != "TORCH_SYMM_MEM_DISABLE_MULTICAST")


def test_time_collective_single_process():
    calls = []
    t = dist.time_collective(lambda: calls.append(1), warmup=2, iters=5)
    assert len(calls) == 7 and t["iters"] == 5 and t["slowest_rank"] == 0 and len(t["ms_per_rank"]) == 1


def test_time_collective_quartiles_are_bench_s(monkeypatch):
    """q25/q75 interpolate as workbench.bench's do, not pick s[n // 4] and s[3n // 4]."""
    from workbench import bench

    clock = [0.0]
    durations_ms = iter([0.5, 0.5, 1.0, 2.0, 10.0, 3.0])  # 2 warm-up calls, then 4 timed ones
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the host-timer path, on any machine
    monkeypatch.setattr(dist.time, "perf_counter", lambda: clock[0])

    def fn():
        clock[0] += next(durations_ms) / 1e3

    t = dist.time_collective(fn, warmup=2, iters=4)
    s = [1.0, 2.0, 3.0, 10.0]
    assert t["ms"] == pytest.approx(2.5)
    assert bench._quantile(s, 0.25) == 1.75 and bench._quantile(s, 0.75) == 4.75
    assert t["q25_ms"] == pytest.approx(1.75) and t["q75_ms"] == pytest.approx(4.75)


def test_simulated_world_run_returns_in_rank_order_and_barriers():
    world = dist.SimulatedWorld(4, heap_bytes=1 << 14)
    seen = []

    def body(h):
        seen.append(("before", h.rank))
        h.barrier()
        seen.append(("after", h.rank))
        return h.rank * 2

    assert world.run(body) == [0, 2, 4, 6]
    assert all(s[0] == "before" for s in seen[:4]) and all(s[0] == "after" for s in seen[4:])


def test_heap_named_flags_advance_and_reset():
    h = dist.SimulatedWorld(2, heap_bytes=1 << 14).heaps[0]
    a = h.named("a", (4, 4), torch.float32)
    assert h.named("a", (4, 4), torch.float32).data_ptr() == a.data_ptr()
    f = h.flags("f", 3)
    assert f.tolist() == [0, 0, 0] and h.flags("f", 3).data_ptr() == f.data_ptr()
    with pytest.raises(ValueError, match="already exist"):
        h.flags("f", 4)
    assert h.advance("f", 5) == 5 and h.advance("f", 3) == 8
    used = h.used
    h.reset()
    assert h.used < used and h.flags("f", 3).data_ptr() == f.data_ptr() and h.advance("f", 1) == 9


def test_interpreted_runs_a_jit_kernel_without_the_env_variable():
    from kernels.comm.remote import put_kernel

    fn = dist.interpreted(put_kernel)
    assert dist.interpreted(put_kernel) is fn
    world = dist.SimulatedWorld(2, heap_bytes=1 << 14)
    src = torch.arange(40, dtype=torch.int32)
    dst = world.alloc((40,), torch.int32)
    world.on_rank(1, put_kernel, (1,), src, dst[1], 40, world.heap_bases, 1, 0, BLOCK=16, HINT=False)
    assert torch.equal(dst[0], src)
