"""Waits bounded in time (kernels.comm.clock), in simulated worlds of 2, 3 and 4 ranks.

One rank is late: the others run their calls, and a host thread plays the late
rank's part after a delay, writing what its kernel would have written (its
rows or columns of the result, its shard, its flag) into the others' heaps.
Its kernel cannot run then, since the interpreter runs one kernel at a time and
the waiting rank's kernel is the one running. The interpreter reads the host's
clock where a GPU reads %globaltimer, so the waits count real seconds here.

- late by LATE_S (longer than the 0.9 s after which the old poll bound, 1 << 24
  polls, gave up on an H200, and than the 1 << 10 polls the simulated configs
  used to allow) but inside the bound: every waiting rank gets the right result;
- later than the bound: the wait gives up, and the error names the rank, the
  peer and what it waited for, and says how long it waited.
"""
import json
import re
import threading
import time

import pytest
import torch

from kernels import comm
from kernels import gemm_scatter as gs
from kernels.ag_gemm import AgGemmConfig, AgGemmTimeout, all_gather_matmul
from kernels.ag_gemm.launch import get_plan
from kernels.ag_gemm.reference import reference, tolerance
from kernels.comm import clock
from kernels.comm.waits import WaitTimeout
from workbench import dist

LATE_S = 1.0     # the late rank's delay
BOUND_S = 8.0    # a bound it arrives within
SHORT_S = 0.25   # a bound it misses
LATE = 1         # the late rank
WORLDS = [2, 3, 4]
AG = AgGemmConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_stages=1, num_warps=1, fetchers=2,
                  k_per_flag=1, num_sms=5)


def _on_time(W):
    return [r for r in range(W) if r != LATE]


def _later(delay, effect, heaps, *names):
    """`effect` (what the late rank writes into its peers' heaps) after `delay` seconds, and not
    before every waiting heap has made the flags it writes: in one process, an early write
    would make them at another offset than the peers' (ranks make them in the same order)."""
    def run():
        time.sleep(delay)
        deadline = time.monotonic() + 120
        while not all(h.has_flags(n) for h in heaps for n in names):
            assert time.monotonic() < deadline, f"the waiting ranks never made {names}"
            time.sleep(0.01)
        effect()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _waited(err) -> float:
    m = re.search(r"after waiting ([0-9.]+) s", str(err))
    assert m, str(err)
    return float(m.group(1))


# --------------------------------------------------------------------------
# all_gather
# --------------------------------------------------------------------------
def _all_gather_world(W, timeout_s, arrive_after):
    g = torch.Generator().manual_seed(W)
    xs = [torch.randn(5, 24, generator=g).to(torch.float16) for _ in range(W)]
    world = dist.SimulatedWorld(W, heap_bytes=1 << 16)
    outs = world.alloc((5 * W, 24), torch.float16)
    for o in outs:
        o.view(torch.uint8).fill_(0xFF)   # NaN poison
    grid = comm.pick_config(5, 24, 2, "triton", None, 2, W, 4)["grid"]

    def arrive():   # what the late rank's kernel writes into each waiting rank's heap
        for r in _on_time(W):
            outs[r][LATE * 5:(LATE + 1) * 5] = xs[LATE]
            world.heaps[r].flags("all_gather", W)[LATE] += grid

    late = _later(arrive_after, arrive, [world.heaps[r] for r in _on_time(W)], "all_gather")
    try:
        got = world.run(lambda h: comm.all_gather(xs[h.rank], h, out=outs[h.rank], num_sms=2, timeout_s=timeout_s,
                                                  check=True).clone(), ranks=_on_time(W))
    finally:
        late.join()
    return got, torch.cat(xs)


@pytest.mark.parametrize("W", WORLDS)
def test_all_gather_waits_out_a_late_peer(W):
    t0 = time.monotonic()
    got, want = _all_gather_world(W, BOUND_S, LATE_S)
    assert time.monotonic() - t0 >= LATE_S
    for o in got:
        assert torch.equal(o.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("W", WORLDS)
def test_all_gather_gives_up_after_the_bound_and_says_how_long(W):
    with pytest.raises(dist.RankError) as info:
        _all_gather_world(W, SHORT_S, 3 * LATE_S)
    err = info.value.__cause__
    assert isinstance(err, WaitTimeout) and f"signals from rank {LATE}" in str(err), err
    assert re.match(r"rank \d:", str(err)) and SHORT_S <= _waited(err) < 3 * LATE_S


# --------------------------------------------------------------------------
# gemm_all_scatter
# --------------------------------------------------------------------------
def _scatter_world(W, timeout_s, arrive_after):
    g = torch.Generator().manual_seed(10 + W)
    M, K, n = 13, 32, 24
    a = torch.randn(M, K, generator=g).to(torch.float16)
    bs = [torch.randn(K, n, generator=g).to(torch.float16) for _ in range(W)]
    cfg = gs.ScatterConfig(block_m=16, block_n=16, block_k=16, num_warps=2, num_stages=2, num_sms=2)
    world = dist.SimulatedWorld(W, heap_bytes=1 << 16)
    outs = world.alloc((M, W * n), torch.float16)
    for o in outs:
        o.view(torch.uint8).fill_(0xFF)
    grid = gs.launch.plan_for(a, bs[0], world.heaps[0], cfg).grid

    def arrive():
        block = (a.float() @ bs[LATE].float()).to(torch.float16)
        for r in _on_time(W):
            outs[r][:, LATE * n:(LATE + 1) * n] = block
            world.heaps[r].flags("gemm_scatter", W)[LATE] += grid

    late = _later(arrive_after, arrive, [world.heaps[r] for r in _on_time(W)], "gemm_scatter")
    try:
        got = world.run(lambda h: gs.gemm_all_scatter(a, bs[h.rank], h, config=cfg, out=outs[h.rank],
                                                      timeout_s=timeout_s, check=True).clone(), ranks=_on_time(W))
    finally:
        late.join()
    return got, gs.reference(a, bs)


@pytest.mark.parametrize("W", WORLDS)
def test_gemm_all_scatter_waits_out_a_late_peer(W):
    t0 = time.monotonic()
    got, ref = _scatter_world(W, BOUND_S, LATE_S)
    assert time.monotonic() - t0 >= LATE_S
    for c in got:
        assert not torch.isnan(c).any()
        torch.testing.assert_close(c.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("W", WORLDS)
def test_gemm_all_scatter_gives_up_after_the_bound_and_says_how_long(W):
    with pytest.raises(dist.RankError) as info:
        _scatter_world(W, SHORT_S, 3 * LATE_S)
    err = info.value.__cause__
    assert isinstance(err, WaitTimeout) and f"tiles from rank {LATE}" in str(err), err
    assert SHORT_S <= _waited(err) < 3 * LATE_S


# --------------------------------------------------------------------------
# all_gather_matmul (the fused kernel: fetchers wait for the late rank's shard)
# --------------------------------------------------------------------------
def _ag_world(W, gather_dim, timeout_s, arrive_after):
    g = torch.Generator().manual_seed(20 + W + gather_dim)
    S_M, S_K = (19, 13) if gather_dim == 1 else (7, 37)
    K = S_K * W if gather_dim == 1 else S_K
    shards = [torch.randn(S_M, S_K, generator=g).to(torch.bfloat16) for _ in range(W)]
    b = torch.randn(K, 21, generator=g).to(torch.bfloat16)
    world = dist.SimulatedWorld(W, heap_bytes=1 << 18)
    # the late rank's plan: its heap buffers at the offsets the others' plans use (same calls)
    late_plan = get_plan(shards[LATE], b, world.heaps[LATE], gather_dim=gather_dim, config=AG)

    def arrive():   # its shard published, then its ready flag on every waiting rank
        late_plan.pub.copy_(shards[LATE])
        for r in _on_time(W):
            world.heaps[r].flags("ag_gemm.sig", 3 * W)[LATE] += 1

    def body(h):
        out = torch.full((S_M * (W if gather_dim == 0 else 1), 21), float("nan"), dtype=torch.bfloat16)
        get_plan(shards[h.rank], b, h, gather_dim=gather_dim, config=AG).stg.fill_(float("nan"))
        return all_gather_matmul(shards[h.rank], b, h, gather_dim=gather_dim, config=AG, out=out,
                                 timeout_s=timeout_s).clone()

    late = _later(arrive_after, arrive, [world.heaps[r] for r in _on_time(W)], "ag_gemm.sig")
    try:
        got = world.run(body, ranks=_on_time(W))
    finally:
        late.join()
    return got, shards, b


@pytest.mark.parametrize("W,gather_dim", [(2, 1), (3, 0), (4, 1)])
def test_all_gather_matmul_waits_out_a_late_peer(W, gather_dim):
    t0 = time.monotonic()
    got, shards, b = _ag_world(W, gather_dim, BOUND_S, LATE_S)
    assert time.monotonic() - t0 >= LATE_S
    ref = reference(shards, b, gather_dim)
    atol, rtol = tolerance(torch.bfloat16, b.shape[0])
    for c in got:
        assert not torch.isnan(c).any()
        torch.testing.assert_close(c.double(), ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("W,gather_dim", [(2, 0), (3, 1), (4, 0)])
def test_all_gather_matmul_gives_up_after_the_bound_and_says_how_long(W, gather_dim):
    with pytest.raises(dist.RankError) as info:
        _ag_world(W, gather_dim, SHORT_S, 3 * LATE_S)
    err = info.value.__cause__
    assert isinstance(err, AgGemmTimeout), err
    msg = str(err)
    assert re.match(r"rank \d: all_gather_matmul", msg) and f"rank {LATE} never published its shard" in msg, msg
    assert SHORT_S <= _waited(err) < 3 * LATE_S


# --------------------------------------------------------------------------
# The bound itself: per call, from the environment, refused when meaningless
# --------------------------------------------------------------------------
def test_bound_from_call_environment_or_default(monkeypatch):
    monkeypatch.delenv(clock.TIMEOUT_ENV, raising=False)
    assert clock.timeout_us() == int(clock.DEFAULT_TIMEOUT_S * 1e6)
    assert 10 <= clock.DEFAULT_TIMEOUT_S <= 120   # tens of seconds (kernels/comm/clock.py says why)
    monkeypatch.setenv(clock.TIMEOUT_ENV, "2.5")
    assert clock.timeout_us() == 2_500_000
    assert clock.timeout_us(0.5) == 500_000       # the call's own wins
    for bad in ("soon", "0", "-1", "1e9"):
        monkeypatch.setenv(clock.TIMEOUT_ENV, bad)
        with pytest.raises(ValueError, match=clock.TIMEOUT_ENV):
            clock.timeout_us()
    for bad in (0, -3, float("nan"), True, "x", 3000.0):
        with pytest.raises(ValueError, match="timeout_s must be a number of seconds"):
            clock.timeout_us(bad)


def test_bad_bound_is_refused_before_anything_runs():
    world = dist.SimulatedWorld(2, heap_bytes=1 << 16)
    h = world.heaps[0]
    with pytest.raises(ValueError, match="timeout_s"):
        comm.all_gather(torch.randn(4, 8), h, timeout_s=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        gs.gemm_all_scatter(torch.randn(4, 16), torch.randn(16, 8), h, timeout_s=0)
    with pytest.raises(ValueError, match="timeout_s"):
        all_gather_matmul(torch.randn(4, 8), torch.randn(16, 8), h, config=AG, timeout_s="soon")


def test_max_spins_is_gone_from_the_launchers():
    """Poll counts no longer bound anything: the launchers take timeout_s, and the config's
    old field only warns (it is ignored)."""
    import inspect

    for fn in (comm.all_gather, gs.gemm_all_scatter, all_gather_matmul):
        params = inspect.signature(fn).parameters
        assert "timeout_s" in params and "max_spins" not in params
    with pytest.warns(FutureWarning, match="timeout_s"):
        from kernels.ag_gemm.config import validate

        validate(AG.replace(max_spins=1 << 12), 2)


# --------------------------------------------------------------------------
# A rank later than the bound: every rank's call fails once, naming it, and the next call works
# --------------------------------------------------------------------------
def _family_call(family, W):
    """(call(heap, timeout_s) -> result, reference) for one family in a world of W ranks."""
    g = torch.Generator().manual_seed(40 + W)
    if family == "all_gather":
        xs = [torch.randn(5, 24, generator=g).to(torch.float16) for _ in range(W)]
        return (lambda h, t: comm.all_gather(xs[h.rank], h, num_sms=2, timeout_s=t, check=True).clone(),
                torch.cat(xs).float())
    if family == "gemm_all_scatter":
        a = torch.randn(13, 32, generator=g).to(torch.float16)
        bs = [torch.randn(32, 24, generator=g).to(torch.float16) for _ in range(W)]
        cfg = gs.ScatterConfig(block_m=16, block_n=16, block_k=16, num_warps=2, num_stages=2, num_sms=2)
        return (lambda h, t: gs.gemm_all_scatter(a, bs[h.rank], h, config=cfg, timeout_s=t, check=True).clone(),
                gs.reference(a, bs))
    shards = [torch.randn(7, 37, generator=g).to(torch.bfloat16) for _ in range(W)]
    b = torch.randn(37, 21, generator=g).to(torch.bfloat16)
    return (lambda h, t: all_gather_matmul(shards[h.rank], b, h, gather_dim=0, config=AG, timeout_s=t).clone(),
            reference(shards, b, 0))


@pytest.mark.parametrize("family,W", [("all_gather", 2), ("gemm_all_scatter", 3), ("all_gather_matmul", 3)])
def test_late_rank_fails_every_rank_once_and_the_next_call_works(family, W):
    """The on-time ranks give up after the bound and raise naming the late rank; the late rank,
    arriving after they gave up, finds the call abandoned and raises too; then every rank's next
    call is right, with no recovery step (the flags stayed in step)."""
    call, ref = _family_call(family, W)
    world = dist.SimulatedWorld(W, heap_bytes=1 << 18)
    timed = {}

    def on_time(h):
        t0 = time.monotonic()
        try:
            return call(h, SHORT_S)
        finally:
            timed[h.rank] = time.monotonic() - t0

    with pytest.raises(dist.RankError) as info:
        world.run(on_time, ranks=_on_time(W))
    err = info.value.__cause__
    assert isinstance(err, WaitTimeout), err
    assert re.match(r"rank \d", str(err)) and f"rank {LATE}" in str(err) and "once every rank has made" in str(err)
    assert SHORT_S <= _waited(err) < 3 * SHORT_S
    with pytest.raises(dist.RankError) as info:          # the late rank arrives, alone
        world.run(lambda h: call(h, SHORT_S), ranks=[LATE])
    late = info.value.__cause__
    assert isinstance(late, WaitTimeout) and str(late).startswith(f"rank {LATE}: "), late
    assert re.search(r"rank \d gave up on the call with tag \d+", str(late)), late
    got = world.run(lambda h: call(h, BOUND_S))          # every rank's next call: right, nothing raised
    for c in got:
        assert not torch.isnan(c.float()).any()
        torch.testing.assert_close(c.double(), ref.double(), atol=3e-2, rtol=3e-2)


# --------------------------------------------------------------------------
# On two GPUs: tests/late_peer_world.py
# --------------------------------------------------------------------------
GPU_BOUND_S = 2.0


def _check_late_world(scenarios):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (sm_90: H100 or H200) on one node")
    from pathlib import Path

    script = Path(__file__).with_name("late_peer_world.py")
    res = dist.launch(script, 2, ["--bound", str(GPU_BOUND_S), "--scenarios", ",".join(scenarios)],
                      timeout_s=60 + 40 * len(scenarios), stage_timeout_s=60)
    rows = {(r["scenario"], r["phase"], r["rank"]): r for r in res.rows}
    bad = []
    for s in scenarios:
        early, late = rows[(s, "late", 0)], rows[(s, "late", 1)]
        if early["library_wait"]:   # NCCL waited for the late rank (its own bound): right on both
            expect = {"early": early["ok"] and not early["raised"], "late": late["ok"] and not late["raised"]}
        else:   # both ranks raise within 5 s of the bound: rank 0 after waiting it out, naming rank 1;
            # rank 1 (2 x the bound late) at once, its peer having given up on the call
            expect = {"early": early["raised"] and "rank 1" in early["error"]
                      and GPU_BOUND_S <= early["seconds"] < GPU_BOUND_S + 5,
                      "late": late["raised"] and "rank 0 gave up on the call" in late["error"]
                      and late["seconds"] < GPU_BOUND_S + 5}
        for phase in ("next", "half"):   # the next call right on both; half the bound late: right
            expect.update({f"{phase} {r}": rows[(s, phase, r)]["ok"] and not rows[(s, phase, r)]["raised"]
                           for r in (0, 1)})
        bad += [f"{s} {what}" for what, good in expect.items() if not good]
    assert not bad, "\n".join(bad + [json.dumps(r) for r in res.rows])


@pytest.mark.multigpu
def test_late_rank_on_two_gpus():
    from late_peer_world import FAST

    _check_late_world(FAST)


@pytest.mark.multigpu
@pytest.mark.slow
def test_late_rank_on_two_gpus_every_variant():
    from late_peer_world import SLOW

    _check_late_world(SLOW)
