"""Peer-memory helpers (kernels/comm/remote.py) and bounded waits (kernels/comm/waits.py) in a
simulated world, and their PTX."""
import re
import time

import pytest
import torch
import triton
import triton.language as tl

from kernels.comm import remote, waits
from kernels.comm.clock import device_ns
from workbench import dist


def _poisoned(world, n, dtype):
    bufs = world.alloc((n,), dtype)
    for b in bufs:
        b.view(torch.uint8).fill_(0xFF)
    return bufs


@pytest.mark.parametrize("hint", [False, True])
@pytest.mark.parametrize("n,dtype", [(100, torch.float16), (37, torch.float32)])
def test_put_and_get_move_exact_bits(n, dtype, hint):
    world = dist.SimulatedWorld(3, heap_bytes=1 << 14)
    src = torch.randn(n).to(dtype)
    dst = _poisoned(world, n, dtype)
    world.on_rank(0, remote.put_kernel, (2,), src, dst[0], n, world.heap_bases, 0, 2, BLOCK=32, HINT=hint)
    assert torch.equal(dst[2], src)
    assert bool(torch.isnan(dst[1].float()).all()), "rank 1 must be untouched"
    # rank 1 reads rank 2's copy back into local memory
    back = torch.full((n,), float("nan"), dtype=dtype)
    world.on_rank(1, remote.get_kernel, (3,), dst[1], back, n, world.heap_bases, 1, 2, BLOCK=16, HINT=hint)
    assert torch.equal(back, src)


def test_lead_remote_store_kernel_unchanged():
    world = dist.SimulatedWorld(2, heap_bytes=1 << 14)
    n, block = 256, 64
    xs = world.alloc((n,), torch.float16)
    xs[0].copy_(torch.randn(n).half())
    xs[1].fill_(float("nan"))
    world.on_rank(0, remote.remote_store_kernel, (n // block,), world.heap_bases, xs[0], n, rank=0, peer=1,
                  BLOCK=block, HINT=True)
    assert torch.equal(xs[0], xs[1])


def test_signal_then_wait_passes_and_counts():
    W = 3
    world = dist.SimulatedWorld(W, heap_bytes=1 << 14)
    flags = [h.flags("t", W) for h in world.heaps]
    for r in range(W):  # every rank arrives twice
        for _ in range(2):
            world.on_rank(r, remote.arrive_kernel, (1,), flags[r], world.heap_bases, r, WORLD=W, SCOPE="sys")
    for r in range(W):
        assert flags[r].tolist() == [2] * W
        status = world.heaps[r].flags("t.status", waits.status_words(W))
        world.on_rank(r, waits.wait_kernel, (1,), flags[r], 2, 5, status, world.heap_bases, r, WORLD=W, SCOPE="sys")
        waits.check_status(status, r)  # no timeout


def test_rank_that_never_arrives_fails_the_bounded_wait():
    W = 3
    world = dist.SimulatedWorld(W, heap_bytes=1 << 14)
    flags = [h.flags("barrier", W) for h in world.heaps]
    for r in (0, 2):  # rank 1 never arrives
        world.on_rank(r, remote.arrive_kernel, (1,), flags[r], world.heap_bases, r, WORLD=W, SCOPE="sys")
    statuses = [h.flags("barrier.status", waits.status_words(W)) for h in world.heaps]
    world.on_rank(0, waits.wait_kernel, (1,), flags[0], 1, 30, statuses[0], world.heap_bases, 0, WORLD=W,
                  SCOPE="sys")
    with pytest.raises(waits.WaitTimeout) as info:
        waits.check_status(statuses[0], 0, "barrier", names=lambda i: f"rank {i}'s arrival")
    msg = str(info.value)
    assert msg.startswith("rank 0:") and "on barrier" in msg and "rank 1's arrival" in msg
    assert "flag 1: saw 0, expected >= 1" in msg and "call tag 1" in msg
    # the give-up told every peer (rule 4): ranks 1 and 2 learn that rank 0 gave up on call 1
    for r in (1, 2):
        assert statuses[r][waits.ST_ABANDON + 0] == 1 and statuses[r][waits.ST_COUNT] == 0
        with pytest.raises(waits.WaitTimeout, match=f"rank {r}: barrier: rank 0 gave up on the call with tag 1"):
            waits.check_status(statuses[r], r, "barrier")


def test_heap_bases_are_the_host_buffers_and_allocations_are_symmetric():
    world = dist.SimulatedWorld(4, heap_bytes=1 << 14)
    assert world.heap_bases.tolist() == [h.buffer.data_ptr() for h in world.heaps]
    assert all(b % 256 == 0 for b in world.heap_bases.tolist())
    a = world.alloc((3, 5), torch.float16)
    b = world.alloc((7,), torch.int64)
    offs = {(world.heaps[r].offset_of(a[r]), world.heaps[r].offset_of(b[r])) for r in range(4)}
    assert len(offs) == 1, "same offsets on every rank"
    b[2].copy_(torch.arange(7))
    assert torch.equal(world.heaps[0].peer_view(b[0], 2), torch.arange(7))
    with pytest.raises(MemoryError, match="heap is full|is full"):
        world.heaps[0].alloc((1 << 20,), torch.float32)


def _compile(kernel, signature, constexprs, tmp_path):
    from workbench.asm.compile import cross_compile

    (e,) = cross_compile(kernel, ["sm90"], signature=signature, constexprs=constexprs,
                         divisible=[k for k, v in signature.items() if v.startswith("*") or k == "n"], num_warps=4,
                         cache_dir=tmp_path)
    return e.text("ptx")


def test_flags_use_release_after_barrier_and_acquire_spins(tmp_path):
    """Memory model on sm90: stores, bar.sync, then a system-scope release; acquire polls."""
    ptx = _compile(remote.arrive_kernel, {"flags_ptr": "*i32", "heap_bases": "*i64", "rank": "i32"},
                   {"WORLD": 2, "SCOPE": "sys"}, tmp_path)
    body = ptx[ptx.index("{"):]
    release = [m.start() for m in re.finditer(r"\.sys\.release\.|\.release\.sys\.", body)]
    assert len(release) == 2, "one release atomic per peer"
    assert body.rfind("bar.sync", 0, release[0]) >= 0, "a CTA barrier precedes the release"
    ptx = _compile(waits.wait_kernel, {"flags_ptr": "*i32", "expected": "i32", "timeout_us": "i32",
                                        "status_ptr": "*i32", "heap_bases": "*i64", "rank": "i32"},
                   {"WORLD": 2, "SCOPE": "sys"}, tmp_path)
    assert re.search(r"\.sys\.acquire\.|\.acquire\.sys\.", ptx), "waits poll with system-scope acquire"
    # bounded in time: the poll loop reads the GPU's nanosecond clock, and counts no polls
    assert "%globaltimer" in ptx


def test_put_hint_gives_vector_stores(tmp_path):
    sig = {"src_ptr": "*fp16", "dst_ptr": "*fp16", "n": "i32", "heap_bases": "*i64", "rank": "i32",
           "peer": "i32"}
    plain = _compile(remote.put_kernel, sig, {"BLOCK": 1024, "HINT": False}, tmp_path)
    hinted = _compile(remote.put_kernel, sig, {"BLOCK": 1024, "HINT": True}, tmp_path)
    assert "st.global.v4.b32" not in plain and "st.global.b16" in plain
    assert "st.global.v4.b32" in hinted


def test_status_watch_copies_at_most_once_per_interval_and_reports_each_failure_once(monkeypatch):
    """On a GPU the watch queues a status copy at most once per ARM_EVERY_S of host time (a copy
    and an event record cost as much host time as a launch), reports a failure once a copy made
    after it has landed, and only once (the call after it must run), a new failure again, and
    starts afresh after a reset. The clock, the event and the copy are faked on the CPU."""
    events = []

    class FakeEvent:
        def __init__(self):
            self.recorded, self.done = 0, False
            events.append(self)

        def record(self):
            self.recorded, self.done = self.recorded + 1, False

        def query(self):
            return self.done

    clock = [100.0]
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    status = torch.zeros(waits.status_words(2), dtype=torch.int32)
    watch = waits.StatusWatch(status, 0, "flags", names=lambda i: f"rank {i}")
    watch.cuda, watch._host = True, torch.zeros_like(status)

    def land():
        clock[0] += waits.ARM_EVERY_S
        watch.arm()
        events[0].done = True

    watch.arm()
    watch.arm()                                   # within the interval: no second copy
    assert len(events) == 1 and events[0].recorded == 1
    status[:6] = torch.tensor([1, 1, 0, 5, 2000, 5])   # a wait gives up after that copy was queued
    events[0].done = True
    watch.poll()                                  # the landed copy predates it: nothing to report
    clock[0] += waits.ARM_EVERY_S
    watch.arm()
    assert events[0].recorded == 2
    watch.poll()                                  # not landed yet: returns at once
    events[0].done = True
    with pytest.raises(waits.WaitTimeout, match="rank 1"):
        watch.poll()                              # landed: reported
    land()
    watch.poll()                                  # the same failure, a later copy: not again
    watch.check()                                 # nor at a check
    status[0] += 3                                # a later call fails (three waits of it)
    status[5] = 9
    land()
    with pytest.raises(waits.WaitTimeout, match="call tag 9"):
        watch.poll()
    status[waits.ST_ABANDON + 1] = 9              # the peer gave up on that call too: the same failure
    land()
    watch.poll()
    status[waits.ST_ABANDON + 1] = 10             # the peer gave up on a call this rank's waits passed
    land()
    with pytest.raises(waits.WaitTimeout, match="rank 1 gave up on the call with tag 10"):
        watch.poll()
    with pytest.raises(waits.WaitTimeout, match="call tag 11"):
        status[0] += 1
        status[5] = 11
        watch.check()                             # synchronizes (faked away) and reads the words
    watch.reset()                                 # a collective resynchronization zeroes the words
    assert not status.any()
    watch.poll()                                  # the copy queued before it is dropped
    status[:6] = torch.tensor([1, 0, 0, 1, 10, 1])
    with pytest.raises(waits.WaitTimeout):
        watch.check()                             # tags counted from zero again


def test_spin_exit_depends_only_on_values_every_thread_agrees_on(tmp_path):
    """Each thread reads %globaltimer itself; a poll is an atomic whose result reaches the other
    threads through shared memory behind a CTA barrier. Had the spin compared each thread's own
    clock, warps would leave it at different polls, at barriers the others never reach (a hang,
    or an illegal instruction, on two H200s). In the PTX of every kernel that waits, each
    predicate of a loop's back edge must come from shared memory (the broadcast), kernel
    parameters and constants only: never straight from a clock or a thread index."""
    from kernels.comm.gluon import _all_gather_gluon_kernel
    from kernels.comm.triton import _all_gather_kernel

    wait = _compile(waits.wait_kernel, {"flags_ptr": "*i32", "expected": "i32", "timeout_us": "i32",
                                        "status_ptr": "*i32", "heap_bases": "*i64", "rank": "i32"},
                    {"WORLD": 3, "SCOPE": "sys"}, tmp_path)
    sig = {"x_ptr": "*fp16", "out_ptr": "*fp16", "heap_bases": "*i64", "flags_ptr": "*i32", "status_ptr": "*i32",
           "total_ptr": "*i32", "M": "i32", "N": "i32", "rank": "i32", "timeout_us": "i32"}
    ce = {"WORLD": 2, "BLOCK_M": 8, "BLOCK_N": 1024, "VEC": 8, "ESIZE": 2, "HINTS": True, "EVEN_N": True,
          "WAIT": True, "SCOPE": "sys"}
    triton_ag = _compile(_all_gather_kernel, sig, ce, tmp_path)
    gluon_ag = _compile(_all_gather_gluon_kernel, sig, {**ce, "NUM_WARPS": 4}, tmp_path)
    for name, ptx in (("wait_kernel", wait), ("all-gather", triton_ag), ("gluon all-gather", gluon_ag)):
        spins = _spin_predicates(ptx)
        assert spins, f"{name}: no spin loop found"
        for label, bad in spins.items():
            assert not bad, f"{name}: the back edge to {label} depends on per-thread values: {sorted(bad)}"


@triton.jit
def _old_wait(flag_ptr, expected, timeout_us, status_ptr):
    """The spin as it was before: each thread's own clock decides when it leaves."""
    t0 = device_ns()
    limit = timeout_us.to(tl.int64) * 1000
    waited = t0 - t0
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    while (seen < expected) & (waited < limit):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        waited = device_ns() - t0
    if seen < expected:
        tl.atomic_add(status_ptr, 1)


def test_old_spin_fails_the_uniformity_check(tmp_path):
    """The check above catches the spin as it was: each thread's own clock in its exit."""
    ptx = _compile(_old_wait, {"flag_ptr": "*i32", "expected": "i32", "timeout_us": "i32", "status_ptr": "*i32"},
                   {}, tmp_path)
    spins = _spin_predicates(ptx)
    assert spins and any(spins.values())


_PER_THREAD = re.compile(r"%globaltimer|%tid|%laneid|%clock")


def _spin_predicates(ptx: str) -> dict[str, set[str]]:
    """{loop label: the per-thread registers its back edge's predicate depends on}, for every
    backward conditional branch of the PTX. A register is per-thread when an instruction that
    defines it reads a per-thread special register or a per-thread register; loads from shared
    memory and parameters, and constants, are taken as uniform (Triton broadcasts a scalar
    atomic's result through shared memory)."""
    lines = [ln.split("//")[0].strip() for ln in ptx.splitlines()]
    defs: dict[str, list[str]] = {}
    labels = {}
    for i, ln in enumerate(lines):
        m = re.match(r"(\$\w+):", ln)
        if m:
            labels[m.group(1)] = i
        m = re.match(r"(@!?%p\d+\s+)?[\w.]+\s+(%\w+)\s*,(.*);", ln)
        if m and not ln.startswith(("st.", "bra", "@")) or (m and m.group(1) and "ld." in ln):
            defs.setdefault(m.group(2), []).append(ln)
    memo: dict[str, bool] = {}

    def per_thread(reg: str, depth: int = 0) -> bool:
        if reg in memo:
            return memo[reg]
        memo[reg] = False   # loop-carried: assume uniform until shown otherwise
        bad = False
        for d in defs.get(reg, []):
            op = d.split()[0] if not d.startswith("@") else d.split()[1]
            if _PER_THREAD.search(d):
                bad = True
            elif op.startswith(("ld.shared", "ld.param", "mov.u32 %r", "mov.b32", "mov.u64", "mov.b64")) and \
                    not re.search(r",\s*%(r|rd|p)\w*\s*;", d):
                continue
            else:
                srcs = re.findall(r"%\w+", d.split(",", 1)[1]) if "," in d else []
                if any(per_thread(s, depth + 1) for s in srcs if s != reg):
                    bad = True
        memo[reg] = bad
        return bad

    out = {}
    for i, ln in enumerate(lines):
        m = re.match(r"@(%p\d+)\s+bra(?:\.uni)?\s+(\$\w+);", ln)
        if m and labels.get(m.group(2), i + 1) <= i:
            memo.clear()
            out[m.group(2)] = {m.group(1)} if per_thread(m.group(1)) else set()
    return out


def test_waits_of_one_call_end_within_one_bound():
    """Four waits on flags that never arrive (one program, one after another): the first gives up
    after the bound, the others at their first poll, so the call takes about one bound, not four;
    the status names the first flag and counts all four."""
    W, bound_s = 4, 0.3
    world = dist.SimulatedWorld(W, heap_bytes=1 << 14)
    flags = world.heaps[0].flags("t", W)
    status = world.heaps[0].flags("t.status", waits.status_words(W))
    t0 = time.monotonic()
    world.on_rank(0, waits.wait_kernel, (1,), flags, 1, int(bound_s * 1e6), status, world.heap_bases, 0, WORLD=W,
                  SCOPE="sys")
    took = time.monotonic() - t0
    assert bound_s <= took < 2 * bound_s, took
    words = status.tolist()
    assert words[waits.ST_COUNT] == W and words[waits.ST_FLAG] == 0 and words[waits.ST_CALL] == 1
    assert bound_s <= waits.waited_s(words) < 2 * bound_s
    # the next call (a new tag) waits afresh, and its flags arrived: no new give-up
    flags += 2
    world.on_rank(0, waits.wait_kernel, (1,), flags, 2, int(bound_s * 1e6), status, world.heap_bases, 0, WORLD=W,
                  SCOPE="sys")
    assert status.tolist()[waits.ST_COUNT] == W
