"""``barrier(heap)``: every rank of the heap meets, on the device, bounded in time.

The launchers' paths that must not run ahead of their peers (our all-gather's buffer is
refilled by the peers only once every rank has read it; the copy-engine all-gather ends
when every peer's copies landed) meet here instead of in PyTorch's symmetric-memory
barrier, whose wait has no bound of ours: a peer later than the bound there left its
partner spinning, and a wait that later gave up in the same call could not end the call.

One program per rank (``kernels.comm.waits.barrier_kernel``): it adds 1 to its slot on
every rank, then waits, bounded, until every slot reached the running total. A barrier is
a call of its own (its own status words and tags, reported at the next barrier or at
``check_barrier``), or, with ``within=``, the end of a family's call: its waits then give
up at once where that call gave up already, and its give-up is reported with that
family's (one bound per call, rule 2 of ``kernels.comm.waits``). In a simulated world the
heap's own barrier (host threads, bounded by the world's timeout) stands in.
"""
from __future__ import annotations

from kernels.comm.clock import timeout_us as _timeout_us
from kernels.comm.waits import StatusWatch, barrier_kernel
from kernels.common.launcher import launch_planned

__all__ = ["barrier", "check_barrier", "poll_barrier", "within_last_barrier", "Within"]


class Within:
    """The family call a barrier ends: the family's status watch, and a one-element device
    tensor holding the call's tag (e.g. the family's running total)."""

    def __init__(self, watch: StatusWatch, tag):
        self.watch, self.tag = watch, tag


def _own(heap) -> dict:
    kept = heap.keep("barrier")
    if "flags" not in kept:
        kept.update(watch=StatusWatch.of(heap, "barrier", names=lambda i: f"rank {i}'s arrival"),
                    flags=heap.flags("barrier", heap.world_size), total=heap.flags("barrier.total", 1),
                    launches={})
    return kept


def barrier(heap, *, timeout_s: float | None = None, within: Within | None = None, scope: str = "sys") -> None:
    """Every rank of ``heap`` meets (on the current stream; no host synchronization).

    Every rank must make the same barrier calls. A rank that does not arrive within
    ``timeout_s`` (default ``$WORKBENCH_WAIT_TIMEOUT_S``, else 60) makes the others give up;
    the failure surfaces as ``WaitTimeout`` at the next barrier (or the family's next call,
    with ``within``) or at ``check_barrier(heap)``.
    """
    wait_us = _timeout_us(timeout_s)
    if heap.simulated:
        heap.barrier()
        return
    own = _own(heap)
    watch = within.watch if within is not None else own["watch"]
    if within is None:
        watch.poll()
    tag = within.tag if within is not None else own["total"]
    launch_planned(heap, own["launches"], (within is not None, scope), barrier_kernel, (1,), own["flags"],
                   own["total"], heap.heap_bases, watch.status, tag, heap.rank, wait_us,
                   WORLD=heap.world_size, SCOPE=scope, LINKED=within is not None, num_warps=4)
    watch.arm()


def within_last_barrier(heap) -> Within:
    """The barrier call just queued, for a barrier that ends the same call (its waits then give
    up at once where the first one gave up)."""
    own = _own(heap)
    return Within(own["watch"], own["total"])


def poll_barrier(heap) -> None:
    """Report an earlier barrier's failure if the device has shown one by now (never waits)."""
    w = heap.keep("barrier").get("watch")
    if w is not None:
        w.poll()


def check_barrier(heap) -> None:
    """Synchronize and raise ``WaitTimeout`` if an earlier barrier of its own timed out."""
    w = heap.keep("barrier").get("watch")
    if w is not None:
        w.check()
