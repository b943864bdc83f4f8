"""Device-side peer-memory helpers (the role iris' `translate` plays on AMD).

Every rank allocates its symmetric heap at a different base address; a kernel
holds the table of all ranks' bases (`heap_bases`, int64 per rank). A local
heap pointer becomes a peer's by swapping the base. That arithmetic goes
through integers, which erases what the compiler knew about alignment and
contiguity: re-state it with `tl.multiple_of`/`tl.max_contiguous` (HINT) or
the stores fall back to 16-bit scalars instead of 128-bit vectors.
"""
import triton
import triton.language as tl


@triton.jit
def translate(ptr, from_rank, to_rank, heap_bases, HINT: tl.constexpr = 0):
    """`ptr` (local to `from_rank`) as a pointer into `to_rank`'s heap.

    HINT > 0 re-asserts that runs of HINT elements are contiguous and
    HINT-aligned, so vector loads/stores survive the integer round trip.
    """
    from_base = tl.load(heap_bases + from_rank).to(tl.uint64)
    to_base = tl.load(heap_bases + to_rank).to(tl.uint64)
    offset = ptr.to(tl.uint64, bitcast=True) - from_base
    out = (to_base + offset).to(ptr.dtype, bitcast=True)
    if HINT > 0:
        out = tl.max_contiguous(tl.multiple_of(out, HINT), HINT)
    return out


@triton.jit
def remote_store_kernel(heap_bases, x_ptr, n, rank: tl.constexpr, peer: tl.constexpr,
                        BLOCK: tl.constexpr, HINT: tl.constexpr):
    """Copy a block of the local heap buffer `x_ptr` to the same place on `peer`."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    dst = translate(x_ptr + offs, rank, peer, heap_bases, BLOCK if HINT else 0)
    tl.store(dst, x, mask=mask)


# ---------------------------------------------------------------------------
# Everything below extends the two helpers above (kept at their lines: cache
# fixtures record `remote_store_kernel`'s source location).
#
# Conventions: `rank` is the calling rank, `peer` the other side; a "heap
# address" is a pointer into the caller's own symmetric heap (the same offset
# names the same buffer on every rank). HINT as in `translate` (1-D pointers).
# ---------------------------------------------------------------------------

from kernels.comm.clock import TIMEOUT_ENV, device_ns  # noqa: E402 (below the kept lines)

# Host-side error codes and sizes.
STATUS_WORDS = 5  # [timeouts, flag id, value seen, value expected, microseconds waited] (int32)


@triton.jit
def peer_delta(rank, peer, heap_bases, ESIZE: tl.constexpr, HINT: tl.constexpr = 0):
    """Elements from an address in `rank`'s heap to the same offset in `peer`'s.

    ``ptr + peer_delta(...)`` is `ptr` on `peer`. Unlike `translate` this stays
    pointer arithmetic, so what the compiler knows about `ptr` (contiguity,
    alignment, any tile shape) survives; it only needs to know the distance's
    alignment: HINT > 0 asserts it is a multiple of HINT elements (heaps are
    at least 256-byte aligned, so HINT = 16 // ESIZE always holds). Returned
    hints survive inlining because they are set here, on the op that makes
    the value (a hint on a helper's *result* is dropped with the call).
    """
    d = (tl.load(heap_bases + peer) - tl.load(heap_bases + rank)) // ESIZE
    if HINT > 0:
        d = tl.multiple_of(d, HINT)
    return d


@triton.jit
def remote_load(ptr, rank, peer, heap_bases, mask=None, other=None, HINT: tl.constexpr = 0):
    """Load the heap address `ptr` from `peer`'s heap (a read over NVLink)."""
    return tl.load(translate(ptr, rank, peer, heap_bases, HINT), mask=mask, other=other)


@triton.jit
def remote_store(ptr, value, rank, peer, heap_bases, mask=None, HINT: tl.constexpr = 0):
    """Store `value` at the heap address `ptr` in `peer`'s heap (a posted write)."""
    tl.store(translate(ptr, rank, peer, heap_bases, HINT), value, mask=mask)


@triton.jit
def put(src_ptr, dst_ptr, rank, peer, heap_bases, mask=None, HINT: tl.constexpr = 0):
    """Copy local `src_ptr` (any local memory) to heap address `dst_ptr` on `peer`."""
    value = tl.load(src_ptr, mask=mask)
    remote_store(dst_ptr, value, rank, peer, heap_bases, mask, HINT)


@triton.jit
def get(src_ptr, dst_ptr, rank, peer, heap_bases, mask=None, HINT: tl.constexpr = 0):
    """Copy heap address `src_ptr` on `peer` into local `dst_ptr` (any local memory)."""
    value = remote_load(src_ptr, rank, peer, heap_bases, mask, None, HINT)
    tl.store(dst_ptr, value, mask=mask)


@triton.jit
def signal(flag_ptr, value, rank, peer, heap_bases, OP: tl.constexpr = "set", SCOPE: tl.constexpr = "sys"):
    """Publish this program's earlier stores, then set (OP="set") or add to
    (OP="add") the int32 heap flag `flag_ptr` on `peer`; returns the old value.

    Order matters: the data stores of every thread come first, then a CTA
    barrier (so all of them precede the flag in the memory model), then one
    release atomic. SCOPE="sys" when `peer` is another GPU (stores cross
    NVLink); "gpu" only when producer and consumer share a GPU.
    """
    tl.debug_barrier()
    target = translate(flag_ptr, rank, peer, heap_bases)
    if OP == "add":
        old = tl.atomic_add(target, value, sem="release", scope=SCOPE)
    else:
        old = tl.atomic_xchg(target, value, sem="release", scope=SCOPE)
    return old


@triton.jit
def wait(flag_ptr, expected, timeout_us, status_ptr, flag_id, SCOPE: tl.constexpr = "sys"):
    """Spin with acquire reads until the local int32 flag reaches `expected`
    (flags only grow, so ">=" also accepts a later round), for at most
    `timeout_us` microseconds of the device's clock (``kernels.comm.clock``).
    Returns True when it arrived.

    A timeout never hangs: it counts itself in `status_ptr[0]` and, if it is the
    first, leaves the flag id, the value seen, the value expected and the
    microseconds waited in `status_ptr[1:5]`, which the host turns into an
    error (`check_status`).
    After the spin a CTA barrier hands the acquired view to every thread of
    the program. The clock is read once per poll: a poll is a round trip to
    L2 or over NVLink, which costs more than the timer read.
    """
    t0 = device_ns()
    limit = timeout_us.to(tl.int64) * 1000
    waited = t0 - t0
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
    while (seen < expected) & (waited < limit):
        seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
        waited = device_ns() - t0
    arrived = seen >= expected
    if not arrived:
        # the first wait to give up says what it waited for (a later one may have cut its own wait short)
        if tl.atomic_add(status_ptr, 1) == 0:
            tl.atomic_xchg(status_ptr + 1, flag_id)
            tl.atomic_xchg(status_ptr + 2, seen)
            tl.atomic_xchg(status_ptr + 3, expected)
            tl.atomic_xchg(status_ptr + 4, tl.minimum(waited // 1000, 2 ** 31 - 1).to(tl.int32))
    tl.debug_barrier()
    return arrived


@triton.jit
def wait_all(flags_ptr, total_ptr, count, timeout_us, status_ptr, WORLD: tl.constexpr, SCOPE: tl.constexpr):
    """Wait until every slot of the local flag array reached the running total
    ``*total_ptr + count``, then record that total (one program, device-side).

    Keeping the total on the device (not a launch argument) makes a round
    replayable: a CUDA graph of launches stays right as flags keep growing.
    """
    expected = tl.load(total_ptr) + count
    for src in tl.static_range(WORLD):
        wait(flags_ptr + src, expected, timeout_us, status_ptr, src, SCOPE)
    tl.store(total_ptr, expected)


@triton.jit
def put_kernel(src_ptr, dst_ptr, n, heap_bases, rank, peer, BLOCK: tl.constexpr, HINT: tl.constexpr):
    """Grid-stride copy of `n` local elements to heap address `dst_ptr` on `peer`
    (the SM-driven peer copy used to measure NVLink write bandwidth)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        put(src_ptr + offs, dst_ptr + offs, rank, peer, heap_bases, offs < n, BLOCK if HINT else 0)


@triton.jit
def get_kernel(src_ptr, dst_ptr, n, heap_bases, rank, peer, BLOCK: tl.constexpr, HINT: tl.constexpr):
    """Grid-stride copy of `n` elements from heap address `src_ptr` on `peer` to local `dst_ptr`."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        get(src_ptr + offs, dst_ptr + offs, rank, peer, heap_bases, offs < n, BLOCK if HINT else 0)


@triton.jit
def arrive_kernel(flags_ptr, heap_bases, rank, WORLD: tl.constexpr, SCOPE: tl.constexpr):
    """Add 1 to slot `rank` of the flag array on every rank (self included),
    starting with the next rank so that ranks do not all hit rank 0 first."""
    for i in tl.static_range(WORLD):
        signal(flags_ptr + rank, 1, rank, (rank + i) % WORLD, heap_bases, "add", SCOPE)


@triton.jit
def wait_kernel(flags_ptr, expected, timeout_us, status_ptr, WORLD: tl.constexpr, SCOPE: tl.constexpr):
    """Wait until every slot of the local flag array reaches `expected`."""
    for src in tl.static_range(WORLD):
        wait(flags_ptr + src, expected, timeout_us, status_ptr, src, SCOPE)


@triton.jit(do_not_specialize=["count", "timeout_us"])
def wait_all_kernel(flags_ptr, total_ptr, count, timeout_us, status_ptr, WORLD: tl.constexpr, SCOPE: tl.constexpr):
    """`wait_all` as a launch of its own (one program)."""
    wait_all(flags_ptr, total_ptr, count, timeout_us, status_ptr, WORLD, SCOPE)


class WaitTimeout(RuntimeError):
    """A bounded device-side wait gave up: a peer never signalled."""


def waited_s(words) -> float:
    """Seconds the last timed-out wait waited (status word 4, microseconds)."""
    return int(words[4]) / 1e6 if len(words) > 4 else float("nan")


def check_status(status, rank: int, what: str = "flag", names=None) -> None:
    """Raise `WaitTimeout` if a `wait` on this rank recorded a timeout.

    `status` is the int32 tensor the kernels wrote (STATUS_WORDS long); `what`
    names the flag array and `names(flag_id)` (optional) says whose flag that
    slot is, e.g. ``lambda i: f"rank {i}"``. Reading it synchronizes with the
    device; call it once after a batch of launches, not inside a timed loop.
    """
    words = status.detach().to("cpu").tolist()[:STATUS_WORDS]
    count, flag_id, seen, expected = (int(v) for v in words[:4])
    if count == 0:
        return
    whose = names(flag_id) if names else f"slot {flag_id}"
    raise WaitTimeout(
        f"rank {rank}: {count} bounded wait(s) on {what}[{flag_id}] ({whose}) timed out after waiting "
        f"{waited_s(words):.3f} s: saw {seen}, expected >= {expected}. The peer never signalled within the "
        f"bound: it died, is stuck, is slower than the bound (raise timeout_s= or ${TIMEOUT_ENV}), or launched "
        f"a different grid or call sequence (every rank must make the same calls with the same num_sms)."
    )


ARM_EVERY_S = 1e-3  # StatusWatch: at most one status copy per millisecond of host time


class StatusWatch:
    """Reads a rank's status word without synchronizing the host on every call.

    After a launch ``arm()`` queues a copy of the status words into pinned host
    memory and records an event, on the caller's stream, at most once per
    ``ARM_EVERY_S`` of host time: the copy and the event record cost about 17 us
    of host time on an H200 node (as much as a launch), so calls in a tight loop
    share one. ``poll()`` (at the start of the next call) reports a timeout if a
    copy that landed since the last poll shows one (each copy once), and
    otherwise returns at once: an error surfaces within about a millisecond of
    calls after the device reached it. ``check()`` synchronizes and reads the
    words themselves: call it after a batch. The words accumulate until
    ``heap.resync_flags()``, so later copies keep reporting a timeout until the
    world is resynchronized (a copy queued before that reports it once more). Under
    CUDA graph capture nothing is armed (check a captured graph with ``check()``
    after replays). ``report(words)`` raises for a timeout (default:
    `check_status` with ``what`` and ``names``).
    """

    def __init__(self, status, rank: int, what: str, names=None, report=None):
        self.status = status
        self.report = report or (lambda words: check_status(words, rank, what, names))
        self.cuda = status.device.type == "cuda"
        self._host = status.new_zeros(status.shape, device="cpu", pin_memory=self.cuda) if self.cuda else status
        self._event = None
        self._armed_at = float("-inf")
        self._unread = False   # a copy was queued that no poll has read yet

    @classmethod
    def of(cls, heap, family: str, names=None) -> "StatusWatch":
        """The watch of ``family``'s calls on ``heap`` (one per heap and family, kept in
        ``heap.cache(family)``, so ``heap.reset()`` starts a new one)."""
        cache = heap.cache(family)
        w = cache.get("status_watch")
        if w is None:
            w = cache["status_watch"] = cls(heap.status(), heap.rank, f"{family} flags", names)
        return w

    def arm(self) -> None:
        if not self.cuda:
            self._unread = True   # a simulated world's status words are host memory already
            return
        import time

        import torch

        now = time.perf_counter()
        if now - self._armed_at < ARM_EVERY_S or torch.cuda.is_current_stream_capturing():
            return
        self._host.copy_(self.status, non_blocking=True)
        if self._event is None:
            self._event = torch.cuda.Event()
        self._event.record()
        self._armed_at, self._unread = now, True

    def poll(self) -> None:
        """Report a timeout a landed copy shows; never waits. Skipped while a CUDA graph
        is being captured (an event query would break the capture)."""
        if not self._unread:
            return
        if self.cuda:
            import torch

            if torch.cuda.is_current_stream_capturing() or not self._event.query():
                return
        self._unread = False
        self.report(self._host)

    def check(self) -> None:
        """Synchronize with the device and report a timeout the status words show."""
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.status.device)
        self.report(self.status)

    def forget(self) -> None:
        """Drop a queued copy (after the words were reset: it would show the old ones)."""
        self._unread = False
