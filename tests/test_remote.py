"""Peer-memory helpers (kernels/comm/remote.py) in a simulated world, and their PTX."""
import re
import time

import pytest
import torch

from kernels.comm import remote
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
        status = torch.zeros(remote.STATUS_WORDS, dtype=torch.int32)
        world.on_rank(r, remote.wait_kernel, (1,), flags[r], 2, 5, status, WORLD=W, SCOPE="sys")
        remote.check_status(status, r)  # no timeout


def test_rank_that_never_arrives_fails_the_bounded_wait():
    W = 3
    world = dist.SimulatedWorld(W, heap_bytes=1 << 14)
    flags = [h.flags("barrier", W) for h in world.heaps]
    for r in (0, 2):  # rank 1 never arrives
        world.on_rank(r, remote.arrive_kernel, (1,), flags[r], world.heap_bases, r, WORLD=W, SCOPE="sys")
    status = torch.zeros(remote.STATUS_WORDS, dtype=torch.int32)
    world.on_rank(0, remote.wait_kernel, (1,), flags[0], 1, 30, status, WORLD=W, SCOPE="sys")
    with pytest.raises(remote.WaitTimeout) as info:
        remote.check_status(status, 0, "barrier", names=lambda i: f"rank {i}'s arrival")
    msg = str(info.value)
    assert msg.startswith("rank 0:") and "barrier[1]" in msg and "rank 1's arrival" in msg
    assert "saw 0, expected >= 1" in msg


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
    ptx = _compile(remote.wait_kernel, {"flags_ptr": "*i32", "expected": "i32", "timeout_us": "i32",
                                        "status_ptr": "*i32"}, {"WORLD": 2, "SCOPE": "sys"}, tmp_path)
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


def test_status_watch_copies_at_most_once_per_interval(monkeypatch):
    """On a GPU the watch queues a status copy at most once per ARM_EVERY_S of host time (a copy
    and an event record cost as much host time as a launch), reports a timeout once a copy made
    after it has landed, keeps reporting it, and forgets it after a reset. The clock, the event
    and the copy are faked on the CPU."""
    import torch

    from kernels.comm import remote

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
    status = torch.zeros(remote.STATUS_WORDS, dtype=torch.int32)
    watch = remote.StatusWatch(status, 0, "flags", names=lambda i: f"rank {i}")
    watch.cuda, watch._host = True, torch.zeros_like(status)
    watch.arm()
    watch.arm()                                   # within the interval: no second copy
    assert len(events) == 1 and events[0].recorded == 1
    status[:4] = torch.tensor([1, 1, 0, 5])       # a wait times out after that copy was queued
    events[0].done = True
    watch.poll()                                  # the landed copy predates it: nothing to report
    clock[0] += remote.ARM_EVERY_S
    watch.arm()
    assert events[0].recorded == 2
    watch.poll()                                  # not landed yet: returns at once
    events[0].done = True
    with pytest.raises(remote.WaitTimeout, match="rank 1"):
        watch.poll()                              # landed: reported
    watch.poll()                                  # each copy once
    clock[0] += remote.ARM_EVERY_S
    watch.arm()
    events[0].done = True
    with pytest.raises(remote.WaitTimeout, match="rank 1"):
        watch.poll()                              # the words accumulate: a later copy reports it again
    with pytest.raises(remote.WaitTimeout, match="rank 1"):
        watch.check()                             # synchronizes (faked away) and reads the words
    status.zero_()                                # recovery zeroes the words
    clock[0] += remote.ARM_EVERY_S
    watch.arm()
    events[0].done = True
    watch.poll()                                  # a copy made after it is clean
    watch.arm()                                   # within the interval: nothing queued
    watch.forget()
    watch.poll()
