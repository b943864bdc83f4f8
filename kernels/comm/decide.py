"""The same variant on every rank: rank 0 decides once per new problem, every rank uses that.

A multi-rank kernel's variants make different calls (a different publish kernel, other
flags, NCCL or not), so two ranks that chose differently would wait on each other until
their bounds ran out. A rank's own choice can differ from its peers' (each reads its own
tuning table from its own disk, a user's cache on one node only, a table being rewritten),
so no rank uses its own: the first time a problem is seen, rank 0 calls the family's one
decision function (``kernels.ag_gemm.config.auto_config``, ``kernels.gemm_scatter.config.
auto_config``, ``kernels.comm.config.auto_choice``) and its result is broadcast over the
heap's process group (``torch.distributed.broadcast_object_list``); every rank caches it
under the problem's key. Later calls of that problem are a dictionary lookup.

The key must name the problem only (shapes, world size, dtype, ...), never anything that
differs between ranks (a pointer's alignment, a device index): every rank then misses the
cache at the same call and meets the others in the broadcast, since every rank makes the
same calls in the same order. For the same reason the cache forgets in first-in, first-out
order, which is the same on every rank.

In a simulated world (ranks are threads of one process) the broadcast is a dictionary of
the world's: rank 0 puts the decision there, the others wait for it (bounded by the
world's barrier timeout).

A first call of a new problem broadcasts (a host synchronization): make it, or
``prepare``, before capturing a CUDA graph.
"""
from __future__ import annotations

from typing import Any, Callable, Hashable

MAX_DECISIONS = 4096   # problems remembered per heap and family


def shared_choice(heap, family: str, problem: Hashable, decide: Callable[[], Any]) -> Any:
    """``decide()`` as rank 0 ran it for ``problem`` (the cached result on later calls)."""
    cache = heap.cache(f"{family}.decisions")
    hit = cache.get(problem)
    if hit is not None:
        return hit
    if not heap.simulated and _capturing():
        raise RuntimeError(f"{family}: the first call of problem {problem} is being captured into a CUDA graph, "
                           "where rank 0's choice cannot be shared (a broadcast); make one call of it before "
                           "capturing (a warm-up on a side stream, as CUDA graphs need anyway)")
    if heap.simulated:
        choice = heap.world.decide((family, problem), heap.rank, decide)
    else:
        choice = _broadcast_from_rank0(heap, decide)
    if len(cache) >= MAX_DECISIONS:
        del cache[next(iter(cache))]
    cache[problem] = choice
    return choice


def _capturing() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _broadcast_from_rank0(heap, decide):
    import torch.distributed as tdist

    group = getattr(heap, "group", None)
    if not tdist.is_initialized() or heap.world_size == 1:
        return decide()
    mine = [decide() if heap.rank == 0 else None]
    src = tdist.get_global_rank(group, 0) if group is not None else 0
    device = heap.device if getattr(heap.device, "type", None) == "cuda" else None
    tdist.broadcast_object_list(mine, src=src, group=group, device=device)
    return mine[0]
