"""Bounded waits for peers, and what a call does when one of them gives up.

A multi-rank kernel waits for its peers' flags (``wait``). Four rules make a late or dead
peer end every rank's call with a clear error, never a hang:

1. **A bound the whole program agrees on.** A wait gives up after ``timeout_us`` of the
   GPU's clock (``kernels.comm.clock``). Every thread reads that clock itself, at slightly
   different times, and a poll is an atomic whose result reaches the other threads through
   shared memory behind a CTA barrier: had each thread compared its own clock, some warps
   would leave the spin while others polled once more, at a barrier the first never reach
   (on two H200s: a hang, or "an illegal instruction was encountered"). So the spin reads
   ``uniform_ns``, the largest of the threads' clocks, one value for all.
2. **One give-up ends the call.** Every wait knows its call by a *tag*: a number that the
   same call has on every rank and no earlier call had (the family's epoch + 1, or its
   running total). The first wait of a call to give up writes the tag into the status word
   ``ST_CALL``; every other wait of that call, on that rank, reads that word in its spin and
   gives up at its next poll. A call therefore ends within one bound, whatever the number
   of its waits (tiles, chunks, peers); the next call has a new tag and waits afresh.
3. **Counters stay in step.** A rank that gave up still sets every flag it owes (ready,
   done, arrivals), and flags only grow, so when the late rank makes the call its counters
   meet its peers' again: the next call works on every rank with no collective reset.
4. **Every rank learns of a give-up, the late one too.** The first wait of a call to give up
   also tells every peer: slot ``ST_ABANDON + rank`` of the peer's status words := the call's
   tag (an atomic max, release, system scope; the status words live in the symmetric heap,
   at the same offset on every rank). A rank that arrives after its peers gave up on it finds
   its waits satisfied, but its host sees the peer's give-up in its status words and raises
   instead of returning as if all were well. Nothing of this runs on a call that went well.

Status words (int32, ``status_words(world)`` of them, one array per family and heap, in the
heap's flag area): ``ST_COUNT`` waits that gave up (cumulative), then what the first give-up
of the latest failing call saw: ``ST_FLAG`` (its flag id), ``ST_SEEN``, ``ST_EXPECTED``,
``ST_WAITED_US`` (microseconds it waited), ``ST_CALL`` (that call's tag); then, from
``ST_ABANDON``, one slot per rank: the latest call tag that rank gave up on. On the host,
``StatusWatch`` copies them without synchronizing and reports each failing call once
(``WaitTimeout``), at the next call or at ``check()``.
"""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.comm.clock import TIMEOUT_ENV, device_ns
from kernels.comm.remote import signal, translate

ST_COUNT, ST_FLAG, ST_SEEN, ST_EXPECTED, ST_WAITED_US, ST_CALL, ST_ABANDON = range(7)
BARRIER = -(1 << 29)     # flag id BARRIER - p: rank p never reached the barrier (barrier_kernel)


def status_words(world: int) -> int:
    """Status words of a family for a world of ``world`` ranks (the peers' slots included)."""
    return ST_ABANDON + world


_ST_COUNT = tl.constexpr(ST_COUNT)
_ST_FLAG = tl.constexpr(ST_FLAG)
_ST_SEEN = tl.constexpr(ST_SEEN)
_ST_EXPECTED = tl.constexpr(ST_EXPECTED)
_ST_WAITED_US = tl.constexpr(ST_WAITED_US)
_ST_CALL = tl.constexpr(ST_CALL)
_ST_ABANDON = tl.constexpr(ST_ABANDON)
_BARRIER = tl.constexpr(BARRIER)
# clock lanes reduced by uniform_ns: at least one per thread of a program of up to 32 warps, so
# that the maximum crosses every warp (a smaller tensor is replicated over warps and reduced in each)
_CLOCK_LANES = tl.constexpr(1024)
_POLLS = tl.constexpr(4)   # polls of a flag between two reads of the clock and the status word


# ---------------------------------------------------------------------------
# Device side
# ---------------------------------------------------------------------------
@triton.jit
def uniform_ns():
    """``device_ns()`` as one value every thread of the program agrees on: the largest of the
    threads' own reads (a reduction through shared memory). Rule 1 of the module docstring."""
    lanes = tl.full([_CLOCK_LANES], 0, tl.int64) + device_ns()
    return tl.max(lanes, axis=0)


@triton.jit
def record_give_up(status_ptr, call, flag_id, seen, expected, waited_ns, heap_bases, rank, WORLD: tl.constexpr):
    """Count a wait that gave up; the first of its call (``ST_CALL`` was not ``call`` yet) also
    leaves what it waited for, and tells every peer (rule 4 of the module docstring). Other
    waits of the call read ``ST_CALL`` and give up too."""
    tl.atomic_add(status_ptr + _ST_COUNT, 1)
    if tl.atomic_xchg(status_ptr + _ST_CALL, call) != call:
        tl.atomic_xchg(status_ptr + _ST_FLAG, flag_id)
        tl.atomic_xchg(status_ptr + _ST_SEEN, seen)
        tl.atomic_xchg(status_ptr + _ST_EXPECTED, expected)
        tl.atomic_xchg(status_ptr + _ST_WAITED_US, tl.minimum(waited_ns // 1000, 2 ** 31 - 1).to(tl.int32))
        for i in tl.static_range(1, WORLD):
            peer = (rank + i) % WORLD
            mine = translate(status_ptr + _ST_ABANDON + rank, rank, peer, heap_bases)
            tl.atomic_max(mine, call, sem="release", scope="sys")


@triton.jit
def call_given_up(status_ptr, call):
    """Whether a wait of call ``call`` on this rank has given up already (one relaxed read)."""
    return (tl.atomic_add(status_ptr + _ST_CALL, 0, sem="relaxed", scope="gpu") == call).to(tl.int32)


@triton.jit
def wait(flag_ptr, expected, timeout_us, status_ptr, flag_id, call, heap_bases, rank, WORLD: tl.constexpr,
         SCOPE: tl.constexpr = "sys"):
    """Spin with acquire reads until the local int32 flag reaches `expected` (flags only grow,
    so ">=" also accepts a later round), for at most `timeout_us` microseconds of the device's
    clock, or until another wait of the same call (tag `call`) gave up. Returns True when the
    flag arrived; otherwise the give-up is recorded in the status words (``record_give_up``).

    After the spin a CTA barrier hands the acquired view to every thread of the program. A flag
    already there costs one read, and one about to arrive a few more; after ``_POLLS`` polls the
    clock (a reduction over the program's threads) and the status word are read once per
    ``_POLLS`` polls of the flag, so they add little to the time a flag takes to be seen (the
    all-gather's fixed cost per call is mostly this wait).
    """
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
    for _ in tl.static_range(_POLLS):   # a flag about to arrive needs no clock
        if seen < expected:
            seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
    if seen < expected:   # not there yet: only now the clock and the status word
        t0 = uniform_ns()
        limit = timeout_us.to(tl.int64) * 1000
        waited = t0 - t0
        ended = call_given_up(status_ptr, call)
        while (seen < expected) & (waited < limit) & (ended == 0):
            for _ in tl.static_range(_POLLS):   # a few polls of the flag alone between two clock reads
                if seen < expected:
                    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
            ended = call_given_up(status_ptr, call)
            waited = uniform_ns() - t0
        if seen < expected:
            record_give_up(status_ptr, call, flag_id, seen, expected, waited, heap_bases, rank, WORLD)
    tl.debug_barrier()
    return seen >= expected


@triton.jit
def wait_all(flags_ptr, total_ptr, count, timeout_us, status_ptr, heap_bases, rank, WORLD: tl.constexpr,
             SCOPE: tl.constexpr):
    """Wait until every slot of the local flag array reached the running total
    ``*total_ptr + count``, then record that total (one program, device-side); returns it,
    which is also the call's tag (every rank's totals agree, and they only grow).

    Keeping the total on the device (not a launch argument) makes a round
    replayable: a CUDA graph of launches stays right as flags keep growing.
    """
    expected = tl.load(total_ptr) + count
    for src in tl.static_range(WORLD):
        wait(flags_ptr + src, expected, timeout_us, status_ptr, src, expected, heap_bases, rank, WORLD, SCOPE)
    tl.store(total_ptr, expected)
    return expected


@triton.jit(do_not_specialize=["count", "timeout_us", "rank"])
def wait_all_kernel(flags_ptr, total_ptr, count, timeout_us, status_ptr, heap_bases, rank,
                    WORLD: tl.constexpr, SCOPE: tl.constexpr):
    """`wait_all` as a launch of its own (one program): the wait of a simulated world, whose
    ranks take turns in the interpreter."""
    wait_all(flags_ptr, total_ptr, count, timeout_us, status_ptr, heap_bases, rank, WORLD, SCOPE)


@triton.jit(do_not_specialize=["rank"])
def wait_kernel(flags_ptr, expected, timeout_us, status_ptr, heap_bases, rank, WORLD: tl.constexpr,
                SCOPE: tl.constexpr):
    """Wait until every slot of the local flag array reaches `expected` (the call's tag)."""
    for src in tl.static_range(WORLD):
        wait(flags_ptr + src, expected, timeout_us, status_ptr, src, expected, heap_bases, rank, WORLD, SCOPE)


@triton.jit(do_not_specialize=["rank", "timeout_us"])
def barrier_kernel(flags_ptr, total_ptr, heap_bases, status_ptr, call_ptr, rank, timeout_us,
                   WORLD: tl.constexpr, SCOPE: tl.constexpr, LINKED: tl.constexpr):
    """A bounded barrier of every rank (one program): add 1 to slot `rank` of the flag array on
    every rank (self included, the next rank first), then wait until every slot reached the
    running total + 1. LINKED: the barrier ends a call whose tag ``*call_ptr`` holds (its waits
    give up at once where that call already gave up, and its own give-up is that call's);
    else it is a call of its own."""
    for i in tl.static_range(WORLD):
        signal(flags_ptr + rank, 1, rank, (rank + i) % WORLD, heap_bases, "add", SCOPE)
    expected = tl.load(total_ptr) + 1
    if LINKED:
        call = tl.load(call_ptr)
    else:
        call = expected
    for src in tl.static_range(WORLD):
        wait(flags_ptr + src, expected, timeout_us, status_ptr, _BARRIER - src, call, heap_bases, rank, WORLD, SCOPE)
    tl.store(total_ptr, expected)


# ---------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------
class WaitTimeout(RuntimeError):
    """A bounded device-side wait gave up: a peer never signalled, or gave up on this call."""


def waited_s(words) -> float:
    """Seconds the first give-up of the latest failing call waited (status word ST_WAITED_US)."""
    return int(words[ST_WAITED_US]) / 1e6 if len(words) > ST_WAITED_US else float("nan")


def missed_barrier(flag_id: int) -> int | None:
    """The rank that never reached a barrier, for a barrier's flag id, else None."""
    peer = BARRIER - int(flag_id)
    return peer if 0 <= peer < 1 << 16 else None


AFTER = ("The flags stay in step: once every rank has made this call, the next call works on every rank. "
         "Every rank must make the same calls in the same order; a rank held back longer than the bound on "
         f"purpose needs a larger timeout_s= or ${TIMEOUT_ENV}; a rank that died means the world must be "
         "rebuilt (destroy the process group and start every rank again).")


def abandoned_text(rank: int, who: str, peer: int, call: int) -> str:
    """The error of a rank whose peer gave up on a call (rule 4: the late rank's, above all)."""
    return (f"rank {rank}: {who}: rank {peer} gave up on the call with tag {call} (it waited out the bound for "
            f"a rank that had not arrived: this one, if it is the late one), so that call's result is not "
            f"valid here either. {AFTER}")


def failure(words, reported_call: int) -> tuple[int, int | None] | None:
    """The newest failing call the status words show that ``reported_call`` does not cover:
    (call tag, None) for a give-up of this rank's own, (call tag, peer) for a peer's; else None."""
    own = int(words[ST_CALL]) if int(words[ST_COUNT]) else 0
    peers = [int(v) for v in words[ST_ABANDON:]]
    newest = max([own] + peers)
    if newest <= reported_call:
        return None
    return (newest, None) if own == newest else (newest, peers.index(newest))


def describe(words, rank: int, what: str = "flag", names=None, peer: int | None = None) -> str:
    """The error text for status words (``names(flag_id)`` says whose flag a slot is); ``peer``:
    the failure to describe is that peer's give-up (``failure``)."""
    if peer is not None:
        return abandoned_text(rank, what, peer, int(words[ST_ABANDON + peer]))
    count, flag_id, seen, expected = (int(v) for v in words[:4])
    call = int(words[ST_CALL])
    late = missed_barrier(flag_id)
    whose = (f"rank {late} never reached the barrier" if late is not None
             else names(flag_id) if names else f"slot {flag_id}")
    return (f"rank {rank}: {count} bounded wait(s) on {what} timed out (call tag {call}) after waiting "
            f"{waited_s(words):.3f} s: {whose} (flag {flag_id}: saw {seen}, expected >= {expected}). The peer "
            f"never signalled within the bound: it died, is stuck, is slower than the bound, or launched a "
            f"different grid or call sequence (every rank must make the same calls with the same num_sms). "
            f"{AFTER}")


def check_status(status, rank: int, what: str = "flag", names=None) -> None:
    """Raise `WaitTimeout` if ``status`` shows a failing call (synchronizes: call it after a
    batch of launches, not inside a timed loop)."""
    words = status.detach().to("cpu").tolist()
    found = failure(words, 0)
    if found:
        raise WaitTimeout(describe(words, rank, what, names, found[1]))


ARM_EVERY_S = 1e-3  # StatusWatch: at most one status copy per millisecond of host time


class StatusWatch:
    """Reads a family's status words without synchronizing the host on every call.

    After a launch ``arm()`` queues a copy of the status words into pinned host memory and
    records an event, on the caller's stream, at most once per ``ARM_EVERY_S`` of host time:
    the copy and the event record cost about 17 us of host time on an H200 node (as much as
    a launch), so calls in a tight loop share one. ``poll()`` (at the start of the next
    call) reports a failure that a copy landed since the last poll shows, and otherwise
    returns at once: an error surfaces within about a millisecond of calls after the device
    reached it. ``check()`` synchronizes and reads the words themselves: call it after a
    batch. Each failing call is reported once (by its tag: ``failure``), so the call after
    the one that raised runs normally. Under CUDA graph capture nothing is armed (check a
    captured graph with ``check()`` after replays). ``report(words, peer)`` raises (default:
    ``WaitTimeout`` with ``describe``).
    """

    def __init__(self, status, rank: int, what: str, names=None, report=None):
        self.status = status
        self._raise = report or (lambda words, peer: _raise(words, rank, what, names, peer))
        self.cuda = status.device.type == "cuda"
        self._host = status.new_zeros(status.shape, device="cpu", pin_memory=self.cuda) if self.cuda else status
        self._event = None
        self._armed_at = float("-inf")
        self._unread = False   # a copy was queued that no poll has read yet
        self._reported = 0     # the newest failing call (tag) already reported

    @classmethod
    def of(cls, heap, family: str, names=None, report=None) -> "StatusWatch":
        """The watch of ``family``'s calls on ``heap``: its status words in the heap's flag area
        (peers write their give-ups there), the watch kept as long as they are (``heap.keep``)."""
        kept = heap.keep(family)
        w = kept.get("status_watch")
        if w is None:
            status = heap.flags(f"{family}.status", status_words(heap.world_size))
            w = kept["status_watch"] = cls(status, heap.rank, f"{family} flags", names, report)
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
        """Report a failure a landed copy shows; never waits. Skipped while a CUDA graph
        is being captured (an event query would break the capture)."""
        if not self._unread:
            return
        if self.cuda:
            import torch

            if torch.cuda.is_current_stream_capturing() or not self._event.query():
                return
        self._unread = False
        self._report(self._host)

    def check(self) -> None:
        """Synchronize with the device and report a failure the status words show."""
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.status.device)
        self._report(self.status)

    def _report(self, words) -> None:
        words = words.tolist() if hasattr(words, "tolist") else list(words)
        found = failure(words, self._reported)
        if found:
            self._reported = found[0]
            self._raise(words, found[1])

    def reset(self) -> None:
        """Zero the status words (a collective resynchronization) and drop a queued copy."""
        self.status.zero_()
        self._unread, self._reported = False, 0



def _raise(words, rank, what, names, peer):
    raise WaitTimeout(describe(words, rank, what, names, peer))
