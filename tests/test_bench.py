"""workbench.bench (timing) and workbench.provenance."""
from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch

from workbench import bench, provenance
from workbench.bench import Timing

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------- host timer
def test_host_timer_is_labelled_not_performance(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    calls = []
    t = bench.measure(lambda: calls.append(time.sleep(0.001)), warmup_ms=2, rep_ms=10)
    assert isinstance(t, Timing)
    assert t.is_performance is False
    assert t.method == "host-timer"
    assert "not performance" in str(t)
    assert t.n >= 1 and len(calls) >= t.n + 1
    assert 0 < t.q25_ms <= t.median_ms <= t.q75_ms
    assert t.min_ms <= t.median_ms
    assert t.median_ms >= 0.9  # slept 1 ms


def test_input_sets_rotate(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = []
    sets = ["a", "b", "c"]
    t = bench.measure(lambda s: seen.append(s), input_sets=sets, warmup_ms=0, rep_ms=0, min_reps=7)
    assert t.input_sets == 3
    assert set(seen) == set(sets)
    # consecutive calls cycle a, b, c, a, ...
    timed = seen[-7:]
    for x, y in zip(timed, timed[1:]):
        assert sets.index(y) == (sets.index(x) + 1) % 3


def test_empty_input_sets():
    with pytest.raises(ValueError, match="empty"):
        bench.measure(lambda s: None, input_sets=[])


# ------------------------------------------------------------ metrics
def test_metrics():
    t = Timing(median_ms=2.0, q25_ms=1.5, q75_ms=2.5, n=10, is_performance=True)
    assert t.tflops(4e12) == pytest.approx(2000.0)
    assert t.gbps(2e9) == pytest.approx(1000.0)
    assert t.iqr_ms == pytest.approx(1.0)
    assert t.rel_spread == pytest.approx(0.5)
    # floor = max(4e12 / 1000e12, 2e9 / 2000e9) = 4 ms... over 2 ms measured -> 2.0 (impossible, but the formula)
    assert t.fraction_of_ceiling(flops=4e12, peak_tflops=4000) == pytest.approx(0.5)
    assert t.fraction_of_ceiling(nbytes=2e9, peak_gbps=2000) == pytest.approx(0.5)
    assert t.fraction_of_ceiling(flops=4e12, nbytes=2e9, peak_tflops=4000, peak_gbps=4000) == pytest.approx(0.5)
    assert math.isnan(t.fraction_of_ceiling())
    row = t.as_row("x_")
    assert row["x_median_ms"] == 2.0 and row["x_n_runs"] == 10 and row["x_is_performance"] is True


def test_quantiles_match_torch():
    vals = [5.0, 1.0, 3.0, 2.0, 4.0, 10.0]
    t = bench._summarize(vals, is_performance=False)
    q = torch.tensor(sorted(vals)).quantile(torch.tensor([0.25, 0.5, 0.75])).tolist()
    assert (t.q25_ms, t.median_ms, t.q75_ms) == pytest.approx(tuple(q))


def test_sets_for_l2():
    l2 = 60 << 20
    assert bench.sets_for_l2(1 << 30, l2) == 1  # far bigger than L2
    assert bench.sets_for_l2(120 << 20, l2) == 1  # twice L2
    assert bench.sets_for_l2(30 << 20, l2) == 6  # 3 x 60 / 30
    assert bench.sets_for_l2(1, l2, max_sets=16) == 16
    assert bench.sets_for_l2(1 << 20, 0) == 1  # no GPU: nothing to rotate for


# ------------------------------------------------------------- provenance
FIELDS = {"git_sha", "git_dirty", "git_source", "python_version", "torch_version", "triton_version",
          "cuda_version", "device_name", "device_count", "world_size", "knobs", "timestamp", "hostname",
          "interpreter"}


def test_provenance_fields(monkeypatch):
    monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/x")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")
    monkeypatch.setenv("UNRELATED_VAR", "1")
    info = provenance.collect(world_size=4, knobs={"block_m": 128})
    assert FIELDS <= set(info)
    assert info["world_size"] == 4
    assert info["knobs"]["TRITON_CACHE_DIR"] == "/tmp/x"
    assert info["knobs"]["NCCL_NVLS_ENABLE"] == "0"
    assert info["knobs"]["block_m"] == 128
    assert "UNRELATED_VAR" not in info["knobs"]
    assert info["timestamp"].endswith("+00:00")
    assert info["torch_version"] == torch.__version__
    flat = provenance.flat(info)
    assert isinstance(flat["knobs"], str) and "TRITON_CACHE_DIR" in flat["knobs"]


def test_provenance_env_sha_wins_over_a_checkout(monkeypatch):
    # A copied tree may carry a stale .git; the sha passed in is the code that runs.
    monkeypatch.setenv("WORKBENCH_GIT_SHA", "feedbeef")
    monkeypatch.setenv("WORKBENCH_GIT_DIRTY", "0")
    info = provenance.git_info()
    assert (info["git_sha"], info["git_dirty"], info["git_source"]) == ("feedbeef", False, "env")


def test_provenance_in_this_checkout(monkeypatch):
    monkeypatch.delenv("WORKBENCH_GIT_SHA", raising=False)
    info = provenance.git_info()
    if info["git_source"] == "git":
        assert len(info["git_sha"]) == 40 and isinstance(info["git_dirty"], bool)


def test_provenance_outside_git(tmp_path, monkeypatch):
    monkeypatch.setattr(provenance, "REPO_ROOT", tmp_path)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path.parent))
    monkeypatch.delenv("WORKBENCH_GIT_SHA", raising=False)
    info = provenance.collect()
    assert info["git_sha"] == "unknown" and info["git_source"] == "unknown" and info["git_dirty"] is None
    monkeypatch.setenv("WORKBENCH_GIT_SHA", "abc123")
    monkeypatch.setenv("WORKBENCH_GIT_DIRTY", "1")
    info = provenance.collect()
    assert (info["git_sha"], info["git_dirty"], info["git_source"]) == ("abc123", True, "env")


def test_provenance_without_git_binary(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("WORKBENCH_GIT_SHA", raising=False)
    info = provenance.collect()  # must not raise
    assert info["git_sha"] == "unknown"


# ------------------------------------------------------------------- GPU
@pytest.mark.gpu
def test_gpu_events_and_flush():
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    t = bench.measure(lambda: a @ a, warmup_ms=5, rep_ms=20)
    assert t.is_performance and t.method == "cuda-events" and t.l2_flushed
    assert t.n >= 5 and 0 < t.q25_ms <= t.median_ms <= t.q75_ms
    assert 1 < t.tflops(2 * 2048 ** 3) < 2000


@pytest.mark.gpu
@pytest.mark.parametrize("flush", [True, False])
def test_gpu_graph(flush):
    sets = [torch.randn(512, 512, device="cuda", dtype=torch.float16) for _ in range(3)]
    t = bench.measure(lambda x: x @ x, cuda_graph=True, flush_l2=flush, input_sets=sets, warmup_ms=2, rep_ms=10)
    assert t.is_performance and t.input_sets == 3
    assert t.method == ("cuda-graph" if flush else "cuda-graph-unrolled")
    assert t.median_ms > 0
    if not flush:
        assert t.calls_per_sample % 3 == 0


@pytest.mark.gpu
def test_gpu_graph_faster_than_launches_for_tiny_kernels():
    x = torch.randn(16, device="cuda")
    eager = bench.measure(lambda: x.add_(1.0), flush_l2=False, warmup_ms=2, rep_ms=10)
    graph = bench.measure(lambda: x.add_(1.0), flush_l2=False, cuda_graph=True, warmup_ms=2, rep_ms=10)
    assert graph.median_ms <= eager.median_ms * 1.5


def test_interleave_rotates_and_drops_failing_callables():
    from workbench.bench import interleave

    calls = []

    def make(name):
        def fn():
            calls.append(name)
        return fn

    def broken():
        raise RuntimeError("does not launch")

    out = interleave({"a": make("a"), "b": make("b"), "bad": broken}, warmup_ms=0, rep_ms=0, min_reps=4)
    assert set(out) == {"a", "b"}
    assert all(t.n == 4 and not t.is_performance for t in out.values())
    timed = calls[-8:]  # the 4 timed rounds of two callables each
    firsts = timed[0::2]
    assert firsts == ["a", "b", "a", "b"]  # the first of a round rotates
    assert interleave({"bad": broken}) == {}


@pytest.mark.gpu
def test_gpu_interleave_orders_two_sizes():
    small = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    big = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    out = bench.interleave({"small": lambda: small @ small, "big": lambda: big @ big}, warmup_ms=5, rep_ms=20)
    assert all(t.is_performance and t.l2_flushed and t.n >= 15 for t in out.values())
    assert out["small"].median_ms * 10 < out["big"].median_ms  # 64x the work


# ------------------------------------------------ modes and host time (CPU)
def test_mode_is_checked_and_named():
    with pytest.raises(ValueError, match="eager"):
        bench.measure(lambda: None, mode="fast")
    t = bench.measure(lambda: time.sleep(0.0005), warmup_ms=0, rep_ms=2, mode="eager")
    assert t.mode == "eager" and t.host_us >= 400  # the host timer: the call's own wall time
    assert t.as_row()["mode"] == "eager" and "host" in str(t)


def test_host_time_counts_every_call_without_sync():
    calls = []
    h = bench.host_time_us(lambda: calls.append(time.sleep(0.0002)), calls=30, warmup=3)
    assert len(calls) == 33 and h["calls"] == 30
    assert 150 <= h["median_us"] < 50_000 and h["q25_us"] <= h["median_us"] <= h["q75_us"]


def test_interleave_records_host_time_per_callable():
    out = bench.interleave({"slow": lambda: time.sleep(0.001), "fast": lambda: None},
                           warmup_ms=0, rep_ms=0, min_reps=5)
    assert out["slow"].host_us > 500 > out["fast"].host_us
    assert all(t.mode == "eager" for t in out.values())
    with pytest.raises(ValueError, match="mode"):
        bench.interleave({"a": lambda: None}, mode="replay")


@pytest.mark.gpu
def test_interleave_graph_mode_times_replays():
    import torch

    x = torch.randn(4096, 4096, device="cuda")
    out = bench.interleave({"mm": lambda: x @ x, "add": lambda: x.add_(1.0)}, warmup_ms=2, rep_ms=10, mode="graph")
    assert {t.mode for t in out.values()} == {"graph"} and out["mm"].median_ms > out["add"].median_ms
    assert all(math.isnan(t.host_us) for t in out.values())
