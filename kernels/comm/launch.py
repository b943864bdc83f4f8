"""The public launcher of the all-gather: ``all_gather`` (see ``kernels.comm``).

Planned once per call signature and heap (variant, shape, dtype, knobs, out);
a repeated call is a lookup, one launch and, on a GPU, an asynchronous copy of
the status word to pinned host memory: a peer that never arrives surfaces as
`WaitTimeout` naming the rank at the next call (``StatusWatch``), or at once
with ``check=True`` or ``check_all_gather(heap)``. Nothing synchronizes the
host in the default path.
"""
from __future__ import annotations

import torch

from kernels.comm.barrier import Within, barrier, check_barrier, poll_barrier, within_last_barrier
from kernels.comm.baselines import nccl_all_gather
from kernels.comm.clock import timeout_us as _timeout_us
from kernels.comm.config import VARIANTS, _validate, auto_choice, pick_config
from kernels.comm.decide import shared_choice
from kernels.comm.gluon import GLUON_AVAILABLE
from kernels.comm.waits import StatusWatch, wait_all_kernel
from kernels.comm.streams import SideStream
from kernels.comm.triton import _all_gather_kernel
from kernels.common.launcher import PlannedLaunch
from workbench.dtypes import element_size, triton_type

if GLUON_AVAILABLE:
    from kernels.comm.gluon import _all_gather_gluon_kernel

__all__ = ["all_gather", "check_all_gather", "out_buffer", "VARIANTS"]

PLAN_CACHE_SIZE = 256  # plans kept per heap


def _device_sms(heap) -> int | None:
    if heap.device.type == "cuda":
        return torch.cuda.get_device_properties(heap.device).multi_processor_count
    return None


def all_gather(x: torch.Tensor, heap, *, variant: str = "triton", num_sms: int | None = None, block=None,
               hints: bool = True, num_warps: int | None = None, out: torch.Tensor | None = None, check: bool = False,
               timeout_s: float | None = None, scope: str = "sys") -> torch.Tensor:
    """Gather every rank's ``x`` into ``out`` (rank-major along dim 0) on every rank.

    ``heap``: a `workbench.dist.SymmetricHeap` (GPU) or a `SimHeap` of a
    `SimulatedWorld` (CPU, interpreter). ``num_sms``: persistent programs
    (default: all SMs; 4 in a simulated world). ``block``: ``(BLOCK_M,
    BLOCK_N)`` powers of two (default ~8192 elements, as wide as N allows).
    ``hints``: re-state alignment on translated pointers (16-byte stores).
    ``num_warps``: warps per program (default: 8, fewer for small tiles).
    ``out``: a heap tensor to fill (default: a heap buffer reused per shape).
    A peer that never signals makes the bounded device-side wait give up and
    record it in the rank's status word; that surfaces as `WaitTimeout`
    (naming the rank and the peer, and how long the wait lasted) at this rank's next ``all_gather`` call,
    without synchronizing the host on any call. ``check=True`` synchronizes
    after this call and raises at once; ``check_all_gather(heap)`` does the same
    after a batch of calls. The flag totals live on the device, so a captured
    graph of calls replays correctly (check it with ``check_all_gather``).
    ``timeout_s``: how long the wait for the peers may last, in seconds of the
    GPU's clock (default ``$WORKBENCH_WAIT_TIMEOUT_S``, else 60; ``kernels.comm.clock``).
    """
    _validate(x, heap, variant)
    wait_us = _timeout_us(timeout_s)
    watch = _watch(heap)
    watch.poll()   # an earlier call's timeout, if the device has reported one by now
    poll_barrier(heap)   # the copy-engine variant's barrier
    W = heap.world_size
    if variant == "auto":
        nbytes = x.numel() * x.element_size()
        # rank 0's choice, shared once per message size: every rank runs the same variant
        variant, auto_sms = ("triton", None) if heap.simulated else shared_choice(
            heap, "all_gather", (W, nbytes), lambda: auto_choice(W, nbytes))
        num_sms = num_sms if num_sms is not None else auto_sms
    cache = heap.cache("all_gather")
    cache["last variant"] = variant   # within_last_call: whether a kernel of ours left this call's tag
    if variant == "nccl":
        return nccl_all_gather(x, heap, out, (W * x.shape[0], *x.shape[1:]))
    blk = tuple(block) if isinstance(block, (list, tuple)) else block
    # x's 16-byte alignment is part of the key: the compiled kernel assumes what it saw.
    key = (variant, tuple(x.shape), x.dtype, x.data_ptr() % 16 == 0, num_sms, blk, bool(hints), num_warps, scope,
           None if out is None else (out.data_ptr(), tuple(out.shape), out.dtype))
    plan = cache.get(key)
    if plan is None:   # (the status words, in the heap's flag area, are already there: _watch above)
        if len(cache) > PLAN_CACHE_SIZE:   # bounded: drop the oldest plan (dicts keep insertion order)
            del cache[next(k for k in cache if k != "last variant")]
        plan = cache[key] = _plan(x, heap, variant, num_sms, block, hints, num_warps, out, scope)
    if variant == "copy_engine":
        return _copy_engine(x, heap, plan, wait_us)
    kernel, grid, out, flags, total, kw, launch = plan
    args = (x, out, heap.heap_bases, flags, watch.status, total, x.shape[0], x.numel() // x.shape[0], heap.rank,
            wait_us)
    if launch is None:   # a simulated world: the heap runs it in the interpreter, one rank at a time
        heap.launch(kernel, (grid,), *args, **kw)
    else:
        launch(*args)
    if heap.simulated:  # ranks take turns in the interpreter: wait in a launch of its own
        heap.barrier()
        heap.launch(wait_all_kernel, (1,), flags, total, grid, wait_us, watch.status, heap.heap_bases, heap.rank,
                    WORLD=W, SCOPE=scope)
    watch.arm()
    if check:
        watch.check()
    return out


def _watch(heap) -> StatusWatch:
    return StatusWatch.of(heap, "all_gather", names=lambda i: f"signals from rank {i}")


def within_last_call(heap) -> Within | None:
    """The all-gather call just queued, for a barrier that ends it (``kernels.comm.barrier``):
    its tag is the running total its kernel's wait left, or, for the copy engines, the tag of
    the barrier it ended with. None after NCCL's (whose wait is NCCL's): the barrier is then a
    call of its own."""
    last = heap.cache("all_gather").get("last variant")
    if heap.simulated or last not in ("triton", "gluon", "copy_engine"):
        return None
    if last == "copy_engine":
        return within_last_barrier(heap)
    return Within(_watch(heap), heap.flags("all_gather.total", 1))


def check_all_gather(heap) -> None:
    """Raise `WaitTimeout` (naming the rank and the silent peer) if any earlier
    ``all_gather`` on this heap timed out. Synchronizes with the device."""
    _watch(heap).check()
    check_barrier(heap)   # the copy-engine variant ends in a barrier of its own


def _plan(x, heap, variant, num_sms, block, hints, num_warps, out, scope):
    """Everything a call needs that depends only on its configuration (cached per heap)."""
    W = heap.world_size
    M = x.shape[0]
    N = x.numel() // M
    out_shape = (W * M, *x.shape[1:])
    if variant == "gluon" and not GLUON_AVAILABLE:
        raise ValueError("all_gather: variant 'gluon' needs triton.experimental.gluon (Triton >= 3.4)")
    if scope not in ("sys", "gpu"):
        raise ValueError(f"all_gather: scope must be 'sys' (peers on other GPUs) or 'gpu', got {scope!r}")
    if out is None:
        out = out_buffer(heap, out_shape, x.dtype)
    elif tuple(out.shape) != out_shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"all_gather: out must be a contiguous {out_shape} {x.dtype} heap tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    else:
        heap.offset_of(out)  # raises unless out lives in the heap
    if variant == "copy_engine":
        rows = slice(heap.rank * M, (heap.rank + 1) * M)
        targets = [heap.peer_view(out, (heap.rank + i) % W)[rows] for i in range(1, W)]
        side = SideStream(heap.device) if heap.device.type == "cuda" else None
        return out, out[rows], targets, side
    cfg = pick_config(M, N, x.element_size(), variant, block, num_sms, W, _device_sms(heap) or 4, num_warps)
    kw = dict(WORLD=W, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], VEC=cfg["VEC"], ESIZE=x.element_size(),
              HINTS=bool(hints) and cfg["VEC"] > 1, EVEN_N=cfg["EVEN_N"], WAIT=not heap.simulated, SCOPE=scope,
              num_warps=cfg["num_warps"])
    if variant == "gluon":
        kw["NUM_WARPS"] = cfg["num_warps"]
    kernel = _all_gather_gluon_kernel if variant == "gluon" else _all_gather_kernel
    launch = None if heap.simulated else PlannedLaunch.of(kernel, (cfg["grid"],), kw)
    return kernel, cfg["grid"], out, heap.flags("all_gather", W), heap.flags("all_gather.total", 1), kw, launch


def _copy_engine(x, heap, plan, wait_us):
    """Copy engines instead of SMs: one cudaMemcpyAsync into each peer's heap, one after
    another on a side stream (measured on H200s: copies to several peers issued on
    streams of their own share the engines badly, 230 GB/s against 390 in turn), the
    local copy meanwhile on the caller's stream, then a device barrier."""
    out, local, targets, side = plan
    if side is not None:
        cur = torch.cuda.current_stream(heap.device)
        side.fork(cur)
        try:
            for t in targets:
                t.copy_(x)
        finally:
            side.leave(cur)
        local.copy_(x)
        side.join(cur)
        if not torch.cuda.is_current_stream_capturing():
            x.record_stream(side.stream)  # x may be freed by the caller before the copies ran
    else:
        for t in targets:
            t.copy_(x)
        local.copy_(x)
    # every peer's copies into our `out` are complete after this: a barrier call of its own (no kernel of
    # ours left a tag), whose failure all_gather and check_all_gather report too
    barrier(heap, timeout_s=wait_us / 1e6)
    return out


def out_buffer(heap, out_shape, dtype) -> torch.Tensor:
    """The heap buffer `all_gather` fills when no `out` is given (one per shape and dtype)."""
    return heap.named(f"all_gather.out.{tuple(out_shape)}.{dtype}", tuple(out_shape), dtype)


# ==========================================================================
# Assembly: the kernels cross-compiled without a GPU
# ==========================================================================
def compile_kernel(variant: str, hints: bool, *, target: str = "sm90", dtype: torch.dtype = torch.float16,
                   world_size: int = 4, N: int = 8192, block=None, cache_dir, wait: bool = True):
    """Cross-compile the `variant` kernel ("triton"/"gluon") for `target` into `cache_dir`.

    Returns the `workbench.asm.cache.Entry`; diff two of them (hints off/on)
    with `workbench.asm.diff.diff_entries`. N (row length) fixes the vector
    width and whether a column mask is needed, as at run time.
    """
    from workbench.asm.compile import cross_compile

    if variant not in ("triton", "gluon"):
        raise ValueError(f"compile_kernel: variant must be 'triton' or 'gluon', got {variant!r}")
    esize = element_size(dtype)
    cfg = pick_config(1 << 20, N, esize, variant, block, 132, world_size, 132)
    kernel = _all_gather_gluon_kernel if variant == "gluon" else _all_gather_kernel
    ty = triton_type(dtype)
    signature = {"x_ptr": f"*{ty}", "out_ptr": f"*{ty}", "heap_bases": "*i64", "flags_ptr": "*i32",
                 "status_ptr": "*i32", "total_ptr": "*i32", "M": "i32", "N": "i32", "rank": "i32",
                 "timeout_us": "i32"}
    constexprs = {"WORLD": world_size, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "VEC": cfg["VEC"],
                  "ESIZE": esize,
                  "HINTS": bool(hints) and cfg["VEC"] > 1, "EVEN_N": cfg["EVEN_N"], "WAIT": wait, "SCOPE": "sys"}
    if variant == "gluon":
        constexprs["NUM_WARPS"] = cfg["num_warps"]
    divisible = ["x_ptr", "out_ptr", "heap_bases", "flags_ptr", "status_ptr", "total_ptr"] + (
        ["N"] if N % 16 == 0 else [])
    (entry,) = cross_compile(kernel, [target], signature=signature, constexprs=constexprs, divisible=divisible,
                             num_warps=cfg["num_warps"], cache_dir=cache_dir)
    return entry


