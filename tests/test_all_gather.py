"""All-gather: both kernels in a simulated world (CPU, interpreter) and, on a
multi-GPU node, against NCCL bit for bit.

The simulated world runs every rank in this process on host heaps; the
interpreter dereferences the peer addresses in `heap_bases`, so the kernels'
pointer translation and flag protocol run for real, only slower: shapes stay
tiny. No TRITON_INTERPRET is needed (`workbench.dist.interpreted`).
"""
from pathlib import Path

import pytest
import torch

from kernels import comm
from kernels.comm import launch as aglaunch, sweep as agsweep
from kernels.comm.waits import WaitTimeout
from workbench import dist

REPO = Path(__file__).resolve().parents[1]
VARIANTS = ["triton", "gluon"]
CASES = [((6, 40), torch.float16), ((3, 24), torch.float32)]


def _inputs(W, shape, dtype, gen):
    if dtype.is_floating_point:
        return [torch.randn(shape, generator=gen).to(dtype) for _ in range(W)]
    return [torch.randint(-1000, 1000, shape, generator=gen).to(dtype) for _ in range(W)]


def _gather(world, xs, poison=True, **kw):
    """Every rank's output (copied), each written into a buffer poisoned with NaN bytes."""
    out_shape = (world.world_size * xs[0].shape[0], *xs[0].shape[1:])
    outs = world.alloc(out_shape, xs[0].dtype)
    for o in outs:
        o.view(torch.uint8).fill_(0xFF if poison else 0)

    def body(h):
        return comm.all_gather(xs[h.rank], h, out=outs[h.rank], **kw).clone()

    return world.run(body)


def _assert_gathered(outs, xs):
    ref = torch.cat(xs)
    for r, o in enumerate(outs):
        assert o.shape == ref.shape, (r, o.shape)
        same = o.view(torch.uint8) == ref.contiguous().view(torch.uint8)
        assert bool(same.all()), f"rank {r}: {int((~same).sum())} bytes differ"


@pytest.mark.parametrize("variant", VARIANTS + ["copy_engine"])
@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("shape,dtype", CASES, ids=["6x40-fp16", "3x24-fp32"])
def test_equals_concatenation(variant, world_size, shape, dtype):
    gen = torch.Generator().manual_seed(hash((variant, world_size, shape)) % 2**31)
    xs = _inputs(world_size, shape, dtype, gen)
    world = dist.SimulatedWorld(world_size, heap_bytes=1 << 16)
    outs = _gather(world, xs, variant=variant, num_sms=3)
    _assert_gathered(outs, xs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_knobs_and_repeated_calls(variant):
    """Small tiles (many per program), hints off, odd rows, ints, and the flag totals
    carried across calls with different grids."""
    gen = torch.Generator().manual_seed(7)
    world = dist.SimulatedWorld(3, heap_bytes=1 << 16)
    for shape, dtype, kw in [((5, 3, 7), torch.bfloat16, dict(num_sms=1, block=(2, 8))),
                             ((7, 33), torch.int32, dict(num_sms=5, hints=False)),
                             ((4, 16), torch.float16, dict(num_sms=2, block=(1, 16), num_warps=1))]:
        xs = _inputs(3, shape, dtype, gen)
        _assert_gathered(_gather(world, xs, variant=variant, **kw), xs)
    # default output buffer (in the heap), called twice with fresh inputs
    for _ in range(2):
        xs = _inputs(3, (6, 40), torch.float16, gen)
        _assert_gathered(world.run(lambda h: comm.all_gather(xs[h.rank], h, variant=variant).clone()), xs)


def test_heap_reset_drops_cached_launch_plans():
    world = dist.SimulatedWorld(2, heap_bytes=1 << 16)
    gen = torch.Generator().manual_seed(9)
    for _ in range(2):
        xs = _inputs(2, (4, 24), torch.float16, gen)
        _assert_gathered(world.run(lambda h: comm.all_gather(xs[h.rank], h).clone()), xs)
        assert world.heaps[0].cache("all_gather")
        for h in world.heaps:
            h.reset()
        assert not world.heaps[0].cache("all_gather")
        world.heaps[0].alloc((64,), torch.float32).fill_(1.0)  # reuses the old output's bytes
        world.heaps[1].alloc((64,), torch.float32).fill_(1.0)


def test_rank_that_never_arrives_surfaces_at_the_next_call_once():
    """Only rank 0 runs: its bounded wait gives up. The call itself returns (no host
    synchronization per call); the next call names the silent rank, before it launches; each
    failure is reported once, so the call after that runs (and fails again, rank 1 being still
    absent: reported by check_all_gather, once)."""
    world = dist.SimulatedWorld(2, heap_bytes=1 << 16)
    xs = _inputs(2, (6, 40), torch.float16, torch.Generator().manual_seed(3))
    call = lambda h: comm.all_gather(xs[h.rank], h, timeout_s=0.05)  # noqa: E731
    world.run(call, ranks=[0])
    with pytest.raises(dist.RankError) as info:
        world.run(call, ranks=[0])
    err = info.value.__cause__
    assert isinstance(err, WaitTimeout)
    assert "rank 0" in str(err) and "signals from rank 1" in str(err) and "timed out" in str(err)
    world.run(call, ranks=[0])
    with pytest.raises(WaitTimeout, match="signals from rank 1"):
        comm.check_all_gather(world.heaps[0])
    comm.check_all_gather(world.heaps[0])


def test_check_true_raises_at_once():
    world = dist.SimulatedWorld(2, heap_bytes=1 << 16)
    xs = _inputs(2, (4, 16), torch.float16, torch.Generator().manual_seed(4))
    with pytest.raises(dist.RankError) as info:
        world.run(lambda h: comm.all_gather(xs[h.rank], h, timeout_s=0.05, check=True), ranks=[0])
    assert isinstance(info.value.__cause__, WaitTimeout)
    # rank 1 never called, but rank 0 told it that it gave up on the call (every rank learns)
    with pytest.raises(WaitTimeout, match="rank 1: all_gather flags: rank 0 gave up on the call with tag"):
        comm.check_all_gather(world.heaps[1])
    comm.check_all_gather(world.heaps[1])   # once


def test_sim_barrier_names_missing_rank():
    world = dist.SimulatedWorld(3, heap_bytes=1 << 14, barrier_timeout_s=30)

    def body(h):
        if h.rank == 2:
            raise RuntimeError("rank 2 gives up before the barrier")
        h.barrier()

    with pytest.raises(dist.RankError, match="rank 2 failed") as info:
        world.run(body)
    assert info.value.rank == 2


@pytest.mark.parametrize("bad,match", [
    (dict(variant="mpi"), "unknown variant"),
    (dict(x=torch.tensor(1.0)), "at least one dimension"),
    (dict(x=torch.empty(0, 4)), "at least one dimension"),
    (dict(x=torch.zeros(4, 6).t()), "must be contiguous"),
    (dict(x=torch.zeros(4, 4, dtype=torch.bool)), "not supported"),
    (dict(x=torch.zeros(4, 4, dtype=torch.complex64)), "not supported"),
    (dict(block=(3, 8)), "power of two"),
    (dict(block=8), r"\(BLOCK_M, BLOCK_N\)"),
    (dict(num_sms=0), "num_sms"),
    (dict(variant="nccl"), "needs an initialized torch.distributed"),
    (dict(out=torch.zeros(3, 3)), "out must be"),
    (dict(scope="cta"), "scope"),
])
def test_clear_errors(bad, match):
    world = dist.SimulatedWorld(2, heap_bytes=1 << 14)
    kw = dict(x=torch.randn(4, 4), variant="triton")
    kw.update(bad)
    x = kw.pop("x")
    with pytest.raises(ValueError, match=match):
        comm.all_gather(x, world.heaps[0], **kw)


def test_out_must_live_in_the_heap():
    world = dist.SimulatedWorld(2, heap_bytes=1 << 14)
    with pytest.raises(ValueError, match="not in rank 0's heap"):
        comm.all_gather(torch.randn(4, 4), world.heaps[0], out=torch.empty(8, 4))


def test_auto_dispatch_table_and_sim_fallback():
    for ws, limit, variant, sms in comm.AUTO_TABLE:
        assert variant in ("triton", "gluon", "copy_engine", "nccl") and limit > 0
        assert sms is None or 1 <= sms <= 1024
    for W in (2, 4, 8):
        for nbytes in (1 << 20, 8 << 20, 512 << 20):
            assert comm.auto_choice(W, nbytes)[0] in ("triton", "gluon", "copy_engine", "nccl")
    world = dist.SimulatedWorld(2, heap_bytes=1 << 14)
    xs = _inputs(2, (2, 16), torch.float16, torch.Generator().manual_seed(1))
    _assert_gathered(_gather(world, xs, variant="auto"), xs)


def test_bus_bandwidth_is_nccl_tests_definition():
    alg, bus = comm.bus_bandwidth_gbps(1_000_000_000, 4, 1000.0)  # 4 GB gathered in 1 s
    assert alg == pytest.approx(4.0) and bus == pytest.approx(3.0)


def test_sweep_protocol_on_cpu():
    shape = {"M": 3, "N": 24, "world": 3}
    inp = agsweep.make_inputs(shape, torch.float32, "cpu", seed=5)
    agsweep.poison(inp)
    out = agsweep.run(inp, variant="gluon", num_sms=2)
    ok, err, msg = agsweep.check(out, agsweep.reference(inp), torch.float32)
    assert ok, msg
    agsweep.poison(inp)
    bad = inp.heaps[0]._named[next(iter(k for k in inp.heaps[0]._named if k.startswith("all_gather.out")))]
    assert not agsweep.check(torch.stack([bad] * 3), agsweep.reference(inp), torch.float32)[0]
    assert agsweep.bytes_moved(shape, torch.float32) == 2 * 3 * 24 * 4 and agsweep.flops(shape) == 0
    assert set(agsweep.PARAMS) >= {"variant", "num_sms", "block_m", "block_n", "hints"}


def test_hints_give_128_bit_remote_stores_on_sm90(tmp_path):
    """Cross-compiled (no GPU): both kernels store 16 bytes with hints, 2 without."""
    from workbench.asm.diff import diff_entries

    for variant in VARIANTS:
        off = aglaunch.compile_kernel(variant, False, world_size=2, N=1024, cache_dir=tmp_path)
        on = aglaunch.compile_kernel(variant, True, world_size=2, N=1024, cache_dir=tmp_path)
        mix = diff_entries(off, on, "ptx").mix
        stores = mix[(mix["space"] == "global") & (mix["kind"] == "store")]
        by_width = {int(w): (int(a), int(b)) for w, a, b in stores[["width_bits", "count_a", "count_b"]].values}
        assert by_width[128][0] == 0 and by_width[128][1] > 0, (variant, by_width)
        assert by_width[16][0] > 0 and by_width[16][1] == 0, (variant, by_width)


# --------------------------------------------------------------------------
# GPU: every variant equals NCCL, bit for bit (on a node with 2 or more H200s)
# --------------------------------------------------------------------------
@pytest.mark.multigpu
@pytest.mark.parametrize("world_size", [2, 4])
def test_equals_nccl_on_gpus(world_size):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")
    res = dist.launch(REPO / "experiments" / "run_all_gather.py", world_size, ["--worker", "--check-only"],
                      timeout_s=180)
    checks = [r for r in res.rows if r.get("kind") == "check"]
    assert checks, "no check rows came back"
    bad = [r for r in checks if not r["ok"]]
    assert not bad, bad
    assert {r["variant"] for r in checks} >= {"triton", "gluon", "copy_engine"}
    assert {r["rank"] for r in checks} == set(range(world_size))


# --------------------------------------------------------------------------
# The latency bound in experiments/run_all_gather.py's summary
# --------------------------------------------------------------------------
def _run_all_gather_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_all_gather", REPO / "experiments" / "run_all_gather.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_busbw_bound_from_fixed_cost():
    r = _run_all_gather_module()
    # 8 MiB per rank, 2 ranks, 5 us fixed, 400 GB/s: 8.39 MB take 20.97 us on the link.
    n = 8 << 20
    assert r.busbw_bound(n, 2, 5.0, 400.0) == pytest.approx(n / (5e3 + n / 400.0))
    assert r.busbw_bound(n, 2, 0.0, 400.0) == pytest.approx(400.0)
    assert r.busbw_bound(n, 4, 5.0, 400.0) > r.busbw_bound(n, 2, 5.0, 400.0)  # 3x the bytes per fixed cost
    # fixed cost: a 16 KiB call of 4.1 us at 400 GB/s spends 0.041 us on the link
    assert r.fixed_cost_us(4.1e-3, 16384, 2, 400.0) == pytest.approx(4.1 - 16384 / 400e3)


def test_summary_states_the_bound_for_graph_rows_only():
    import pandas as pd

    r = _run_all_gather_module()
    rows = []
    for timing in ("eager", "graph"):
        for nbytes, ms in ((16384, 0.005), (8 << 20, 0.027)):
            for v, f in (("nccl", 2.0), ("triton", 1.0)):
                rows.append(dict(kind="bw", rank=0, status="ok", timing=timing, world_size=2, bytes_per_rank=nbytes,
                                 variant=v, hints=True, ms=ms * f, busbw_gbps=nbytes / (ms * f) / 1e6,
                                 loop_busbw_gbps=nbytes / (ms * f) / 1e6, num_sms=132, block_m=1, block_n=8192,
                                 num_warps=8))
    peer = pd.DataFrame([dict(kind="peer", world_size=2, method="copy_engine", gbps=400.0)])
    s = r.summarize(pd.DataFrame(rows), peer).set_index(["timing", "bytes_per_rank"])
    fixed = 5.0 - 16384 / 400e3
    assert s.loc[("graph", 8 << 20), "fixed_us"] == pytest.approx(fixed)
    assert s.loc[("graph", 8 << 20), "bound_busbw"] == pytest.approx(r.busbw_bound(8 << 20, 2, fixed, 400.0))
    assert s.loc[("graph", 8 << 20), "bound_frac_of_peer_copy"] < 1.0
    assert s.loc[("eager", 8 << 20), "bound_busbw"] != s.loc[("eager", 8 << 20), "bound_busbw"]  # NaN


# --------------------------------------------------------------------------
# The script as the notebook starts it (no torchrun), and the notebook's measuring cell
# --------------------------------------------------------------------------
def _check_row(ok=True):
    return dict(kind="check", rank=0, variant="triton", hints=True, M=6, N=40, dtype="float16", ok=ok,
                bytes_differ=0 if ok else 3, error="")


def test_script_started_plainly_launches_each_world_and_fails_with_it(tmp_path, monkeypatch):
    """`python experiments/run_all_gather.py --world-sizes 2 ...` (what notebooks/03 runs): one world per
    size through dist.launch_rows, the flags passed on; a world that fails or hangs past --timeout, or a
    check that differs from NCCL, exits 1 with the rows written so far in the tables."""
    r = _run_all_gather_module()
    calls = []

    def fake_launch_rows(script, W, args, timeout_s, run_dir=None):
        calls.append((W, list(args), timeout_s))
        err = f"dist.launch(run_all_gather.py, world_size={W}): timed out after {timeout_s:g} s" if W == 4 else ""
        return [dict(_check_row(), world_size=W)], err

    monkeypatch.setattr(dist, "launch_rows", fake_launch_rows)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert r.main(["--world-sizes", "2", "--out", str(tmp_path / "a"), "--quick", "--timeout", "120"]) == 0
    assert calls == [(2, calls[0][1], 120)] and {"--worker", "--quick"} <= set(calls[0][1])
    assert r.main(["--world-sizes", "2,4", "--out", str(tmp_path / "b")]) == 1
    assert len((tmp_path / "b" / "checks.csv").read_text().splitlines()) == 3  # both worlds' rows kept

    monkeypatch.setattr(dist, "launch_rows", lambda *a, **k: ([_check_row(ok=False)], ""))
    assert r.main(["--world-sizes", "2", "--out", str(tmp_path / "c")]) == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert r.main(["--world-sizes", "2", "--out", str(tmp_path / "d")]) == 1  # nothing ran: no rows


def test_quick_grid_is_within_the_committed_run():
    """The notebook compares a fresh quick run with the committed one: every quick point has a committed twin."""
    import pandas as pd

    r = _run_all_gather_module()
    bw = pd.read_csv(REPO / "results" / "all_gather" / "bw.csv")
    committed = {(s, int(m), int(n)) for s, m, n in zip(bw["study"], bw["M"], bw["N"])}
    quick = r.load_plan(r.SPEC, quick=True)["points"]
    assert {(p["study"], p["M"], p["N"]) for p in quick} <= committed
    assert {p["M"] for p in quick} == {128, 512, 2048}  # 2, 8 and 32 MiB per rank

