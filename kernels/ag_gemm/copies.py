"""The variants of ``all_gather_matmul`` whose transfers the copy engine makes, not SMs:
their plans (which copies, in which order, with which signals) and their launches.

All three start with the same publish kernel (``_ag_gemm_kernel`` with PUBLISH: our shard
into the heap, then, on a GPU, a wait in the kernel until every peer has published), then
queue ``cudaMemcpyAsync`` pulls from the peers' heaps on a side stream (``SideStream``:
forked from and joined to the caller's stream with two events made once per plan):

``copy_engine``  each peer's shard in ``ce_chunks`` copies of whole row tiles, each followed
                 by a copy that sets its (row tile, k-group) flags; every SM but a few
                 (``CE_SPARE_SMS``) runs our GEMM kernel, polling flag group by flag group.
``chunked``      each peer's shard in one copy, an event after it; cuBLAS on our shard at once
                 and on each peer's as its event fires (gathered along K with
                 ``k_schedule="sum"``: the products summed in fp32). Gathered along K with
                 ``"rows"`` (the default): ``ce_chunks`` row chunks, each peer's rows of a chunk
                 copied into their columns of the gathered A (a 2-D copy,
                 ``kernels.common.memcpy2d``), an event after each chunk, and cuBLAS on each
                 chunk's rows over the whole K as its event fires (one rounding, as one GEMM's).
                 A finish kernel after the copies.
``pipelined``    each peer's shard in ``ce_chunks`` row chunks, ONE signal per chunk (a 4-byte
                 copy of the call's value, which the publish kernel leaves in the state
                 words: no kernel of its own), copied in arrival order: gathered along M,
                 peer by peer (rank + 1 first), so our rows' tiles and then each peer's
                 chunks in turn are ready in the order the GEMM takes them; gathered along K,
                 chunk by chunk across the peers, so the first row chunk of C has every
                 shard's columns first. One GEMM launch on every SM but ``CE_SPARE_SMS``
                 takes tiles in that order (``triton._chunk_tile``: our own rows' tiles
                 first), waits once per (tile, peer shard) on the chunk's signal and runs
                 that shard's K range as one pipelined loop. The Flux / PyTorch async-TP
                 decomposition, at chunk grain.

In a simulated world the copies are host copies made after the publish kernel, between
barriers (ranks take turns in the interpreter), in the same order, signals included.
"""
from __future__ import annotations

import torch
import triton

from kernels.ag_gemm.triton import _ag_gemm_kernel, _finish_kernel, _next_epoch_kernel
from kernels.comm.streams import SideStream
from kernels.common.launcher import launch_planned
from kernels.common.memcpy2d import Copy2D

CE_PUBLISHERS = 16       # programs of the publish kernel where not every program publishes (publish_all=False)
CE_VARIANTS = ("copy_engine", "chunked", "pipelined")
# SMs our polling GEMM leaves free (copy_engine, pipelined). Its programs spin until the copies'
# signals arrive; where the driver runs one of those copies as a kernel (on H200s at 2 and 4 ranks,
# back-to-back eager calls and graph replays of copy_engine timed out on some shapes, never with 100
# of 132 SMs polling: results/overlap/README.md), a GEMM on every SM starves it until its waits
# give up. Any spare SM guarantees progress (with 8, eager calls and graph replays passed at 2
# ranks, tests/test_ag_gemm.py; 4 ranks not yet run); how many the copies run fastest with is not
# measured.
CE_SPARE_SMS = 8


# --------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------
def n_flags(plan) -> int:
    """Signals a plan's flag array holds, the "all staged" one last."""
    if plan.cfg.variant == "pipelined":
        return plan.world * plan.NCH + 1
    return plan.world * plan.MT * plan.KG + 1


def plan_copies(plan, heap, shared: dict) -> None:
    """The side stream and the copies of a copy-engine variant's plan."""
    plan.side = SideStream(heap.device) if heap.device.type == "cuda" else None
    if plan.cfg.variant == "chunked":
        _chunked_plan(plan, heap, shared)
    elif plan.cfg.variant == "pipelined":
        _pipelined_plan(plan, heap, shared)
    else:
        _copy_engine_plan(plan, heap)


def _copy_engine_plan(plan, heap) -> None:
    """copy_engine: each peer's shard in ce_chunks copies of whole row tiles, each with its flags
    (the flags' values: a slice of ``nextval``, made once here)."""
    cfg, W = plan.cfg, heap.world_size
    tiles_per_chunk = triton.cdiv(plan.MT, cfg.ce_chunks)  # whole row tiles: a chunk owns its flags
    n_chunk = triton.cdiv(plan.MT, tiles_per_chunk)
    plan.nextval = torch.zeros(tiles_per_chunk * plan.KG, dtype=torch.int32, device=heap.device)
    rows = tiles_per_chunk * cfg.block_m
    for q in range(1, W):
        p = (heap.rank + q) % W
        if p == cfg.skip_rank:
            continue
        src = heap.peer_view(plan.pub, p)
        for c in range(n_chunk):
            r0, r1 = c * rows, min(plan.S_M, (c + 1) * rows)
            f0 = (p * plan.MT + c * tiles_per_chunk) * plan.KG
            f1 = (p * plan.MT + min(plan.MT, (c + 1) * tiles_per_chunk)) * plan.KG
            plan.chunks.append((plan.stg[p, r0:r1], src[r0:r1], plan.flags[f0:f1], plan.nextval[:f1 - f0]))
    if cfg.skip_rank < 0 and cfg.staged_flag:  # after the last chunk: the "all staged" flag
        plan.chunks.append((None, None, plan.flags[-1:], plan.nextval[:1]))


def _chunked_plan(plan, heap, shared: dict) -> None:
    """chunked: one whole-shard copy per peer (staggered, as the fetchers go) and an event after
    each, with (along K, ``k_schedule="sum"``) the fp32 buffer that sums the shards' products; or
    along K with ``"rows"``, ``chunk_rows`` row chunks, each chunk's rows of our published
    shard and of every peer's copied into their columns of the gathered A (``gathered_k``) and
    an event after each chunk."""
    W, dev = heap.world_size, heap.device
    peers = [(heap.rank + q) % W for q in range(1, W)]
    srcs = {p: heap.peer_view(plan.pub, p) for p in peers}
    if _by_rows(plan):
        A, S_K = gathered_k(plan), plan.S_K
        plan.rows = chunk_rows(plan)
        # our own columns: written by the publish kernel, but for a shard already in the heap
        # (nothing to publish), where the copy engine copies them with the peers'
        own = [] if publish_gathered(plan) else [heap.rank]
        srcs[heap.rank] = plan.pub
        plan.chunks = [[Copy2D(A[r0:r1, p * S_K:(p + 1) * S_K], srcs[p][r0:r1]) for p in own + peers]
                       for r0, r1 in plan.rows]
    else:
        plan.chunks = [(p, plan.stg[p], srcs[p]) for p in peers]
    plan.events = [torch.cuda.Event() for _ in plan.chunks] if dev.type == "cuda" else []
    if plan.gather_dim == 1 and not _by_rows(plan):  # one per output shape, shared like the staging buffer
        key = ("acc",) + plan.out_shape
        if key not in shared:
            shared[key] = torch.empty(plan.out_shape, dtype=torch.float32, device=dev)
        plan.acc = shared[key]


def _by_rows(plan) -> bool:
    return plan.cfg.variant == "chunked" and plan.gather_dim == 1 and plan.cfg.k_schedule == "rows"


def publish_gathered(plan) -> bool:
    """Whether the publish kernel also writes our shard into its columns of the gathered A (the
    chunked variant's rows schedule, a shard it copies into the heap): one pass over the shard,
    on every SM, where a separate strided copy took 43 us (SM kernel) or 166 us (copy engine) at
    4096 x 4096 bf16 on an H200 (experiments/probes/probe_ag_chunked.py)."""
    return _by_rows(plan) and not plan.resident


def gathered_k(plan) -> torch.Tensor:
    """chunked along K: the staging buffer seen as the gathered A (M, K), peer p's shard in
    columns p*S_K...(p+1)*S_K (the same elements as the (W, M, S_K) layout the other variants use)."""
    return plan.stg.view(plan.S_M, plan.world * plan.S_K)


# chunked along K, rows: row tiles a chunk holds at least. cuBLAS on fewer rows runs a GEMM too short
# to pay for its launch and its ramp: on 2 H200s, 128-row chunks took M = 256 to 1.3x one chunk's time,
# and chunks under 1024 rows gained at most 1% over one chunk (experiments/probes/probe_ag_chunked.py).
MIN_CHUNK_TILES = 8


def chunk_rows(plan) -> list[tuple[int, int]]:
    """chunked along K: the row ranges of C computed one cuBLAS call each, as their rows of every
    shard land: ``ce_chunks`` chunks of whole ``block_m`` row tiles, at least ``MIN_CHUNK_TILES``
    tiles each (fewer chunks where M is short), each ``chunk_growth`` times the one before (a small
    first chunk: little copy before the first GEMM; larger ones after: fewer, fuller GEMMs, their
    copies hidden behind the GEMM before)."""
    cfg, unit = plan.cfg, plan.cfg.block_m
    tiles = triton.cdiv(plan.S_M, unit)
    weights = [cfg.chunk_growth ** i for i in range(max(1, min(cfg.ce_chunks, tiles // MIN_CHUNK_TILES)))]
    bounds, acc = [0], 0
    for w in weights:
        acc += w
        bounds.append(max(bounds[-1] + 1, round(tiles * acc / sum(weights))))
    return [(b0 * unit, min(plan.S_M, b1 * unit)) for b0, b1 in zip(bounds, bounds[1:]) if b0 * unit < plan.S_M]


def chunk_tiles(plan) -> int:
    """pipelined: row tiles per chunk (``ce_chunks`` chunks per shard, whole row tiles)."""
    return triton.cdiv(plan.MT, plan.cfg.ce_chunks)


def copy_order(plan, rank: int, world: int) -> list[tuple[int, int]]:
    """pipelined: (peer, chunk) in the order the copies are queued (see the module docstring)."""
    peers = [(rank + q) % world for q in range(1, world)]
    chunks = range(plan.NCH)
    if plan.gather_dim == 0:
        return [(p, c) for p in peers for c in chunks]
    return [(p, c) for c in chunks for p in peers]


def _pipelined_plan(plan, heap, shared: dict) -> None:
    """pipelined: (staging rows, the peer's rows, the chunk's signal) per copy, in arrival order;
    the "all staged" signal after the last one; every signal takes the value the publish
    kernel leaves in state word 6 (epoch + 1)."""
    cfg = plan.cfg
    rows = chunk_tiles(plan) * cfg.block_m
    plan.nextval = shared["state"][6:7]
    srcs = {}
    for p, c in copy_order(plan, heap.rank, heap.world_size):
        if p == cfg.skip_rank:
            continue
        if p not in srcs:
            srcs[p] = heap.peer_view(plan.pub, p)
        r0, r1 = c * rows, min(plan.S_M, (c + 1) * rows)
        sig = p * plan.NCH + c
        plan.chunks.append((plan.stg[p, r0:r1], srcs[p][r0:r1], plan.flags[sig:sig + 1], plan.nextval))
    if cfg.skip_rank < 0 and cfg.staged_flag:
        plan.chunks.append((None, None, plan.flags[-1:], plan.nextval))


def describe_chunk(plan, fid: int) -> str | None:
    """pipelined: what signal ``fid`` stands for, for a timeout's message."""
    if plan.cfg.variant != "pipelined" or not plan.NCH:
        return None
    if fid == plan.world * plan.NCH:
        return "the \"all staged\" signal never came (the last copy of the call never ran)"
    src, c = divmod(fid, plan.NCH)
    rows = chunk_tiles(plan) * plan.cfg.block_m
    r0, r1 = c * rows, min(plan.S_M, (c + 1) * rows) - 1
    return (f"chunk {c} of rank {src}'s shard never arrived: rows {r0}...{r1} of its {plan.S_M}x{plan.S_K} shard "
            f"(chunk signal {fid}); rank {src} never published it, or our copy of it never ran")


# --------------------------------------------------------------------------
# Launches
# --------------------------------------------------------------------------
def publish(heap, plan, args, cs) -> None:
    """The publish kernel (its FETCHERS programs): copy our shard into the heap and, on a GPU,
    wait in-kernel until every peer has published, so that copies issued after it read the
    peers' shards at once. In a simulated world, between two barriers instead."""
    if heap.simulated:
        heap.barrier()
    launch_planned(heap, plan.launches, ("ce_publish", cs), _ag_gemm_kernel, (plan.kw["FETCHERS"],), *args,
                   PUBLISH=True, FETCH=False, COMPUTE=False, WAIT_READY=not heap.simulated, **plan.kw)
    if heap.simulated:
        heap.barrier()


def _gemm(heap, plan, args, cs) -> None:
    """The GEMM kernel that polls the copies' signals, on every SM but ``CE_SPARE_SMS`` (the
    kernel reads its grid's size: any grid works). A simulated world's copies are made before it."""
    grid = plan.grid if heap.simulated else max(1, plan.grid - CE_SPARE_SMS)
    launch_planned(heap, plan.launches, ("ce_gemm", cs), _ag_gemm_kernel, (grid,), *args, PUBLISH=False,
                   FETCH=False, COMPUTE=True, WAIT_READY=False, **plan.gemm_kw)


def _signalled_copies(plan) -> None:
    """Every (data, signal) copy of the plan, in order, on the current stream."""
    for dst, src, flags, value in plan.chunks:
        if dst is not None:
            dst.copy_(src, non_blocking=True)  # cudaMemcpyAsync from the peer (copy engine)
        flags.copy_(value, non_blocking=True)  # then its signal, in stream order


def run_flagged(heap, plan, c, s, args) -> None:
    """copy_engine and pipelined: publish, the signalled copies on the side stream, and our
    GEMM kernel on the caller's stream, polling the signals."""
    cs = (c.data_ptr() % 16, c.stride(0))
    if plan.cfg.variant == "copy_engine":
        launch_planned(heap, plan.launches, "next_epoch", _next_epoch_kernel, (1,), s["state"], plan.nextval,
                       plan.nextval.numel(), BLOCK=128)
    publish(heap, plan, args, cs)
    if heap.simulated:
        _signalled_copies(plan)
        _gemm(heap, plan, args, cs)
        if plan.resident:  # the GPU's END_WAIT: the peers have read our shard before the call returns
            heap.barrier()
        return
    cur = torch.cuda.current_stream(heap.device)
    plan.side.fork(cur)
    try:
        _signalled_copies(plan)
    finally:
        plan.side.leave(cur)
    _gemm(heap, plan, args, cs)
    plan.side.join(cur)


def run_chunked(a, b, heap, plan, bias, c, s, args) -> None:
    """Publish, then on a side stream copy the peers' shards into the staging buffer (copy
    engine): gathered along M each peer's shard whole, along K row chunk by row chunk into the
    gathered A; an event after each. On the caller's stream cuBLAS computes C's rows as they
    are ready: our shard's rows at once and each peer's as its copy lands (M), or each row
    chunk over the whole K once its columns from every peer have landed (K: one GEMM's
    rounding, no partial sums). PyTorch async-TP's schedule, on our heap and flags; a finish
    kernel after the copies ends the call for the peers."""
    wait_us = args[-2]
    publish(heap, plan, args, (c.data_ptr() % 16, c.stride(0)))
    if heap.simulated:
        _copy_chunks(plan, None)
        finish(heap, plan, s, wait_us)
        _chunk_products(a, b, plan, bias, c, heap.rank, None)
        if plan.resident:  # the GPU's END_WAIT: the peers have read our shard before the call returns
            heap.barrier()
        return
    cur = torch.cuda.current_stream(heap.device)
    plan.side.fork(cur)  # the copies start once every peer has published
    try:
        _copy_chunks(plan, plan.side.stream)
        finish(heap, plan, s, wait_us)
    finally:
        plan.side.leave(cur)
    # (gathered along M, the peers' GEMMs on the copies' stream beside ours gained nothing on 2 H200s,
    # M 256-16384: cuBLAS's kernels do not share the SMs; results/overlap/README.md, tenth session)
    _chunk_products(a, b, plan, bias, c, heap.rank, (cur, plan.events))
    plan.side.join(cur)


def _copy_chunks(plan, stream) -> None:
    """chunked: every copy of the plan in order on ``stream`` (None: at once, on the host's
    turn in a simulated world), an event after each chunk on a GPU."""
    by_rows = _by_rows(plan)
    for i, chunk in enumerate(plan.chunks):
        if not by_rows:
            chunk[1].copy_(chunk[2], non_blocking=stream is not None)  # cudaMemcpyAsync from the peer
        else:
            for copy in chunk:
                copy(stream)    # cuMemcpy2DAsync: a shard's rows into their columns of the gathered A
        if stream is not None:
            plan.events[i].record(stream)


def finish(heap, plan, s, wait_us) -> None:
    launch_planned(heap, plan.launches, "finish", _finish_kernel, (1,), s["state"], s["sig"], heap.heap_bases,
                   s["status"], heap.rank, wait_us, WORLD=heap.world_size, END_WAIT=plan.kw["END_WAIT"])


def _chunk_products(a, b, plan, bias, c, rank, waits) -> None:
    """C from the copies, each product once ``waits`` (the stream and the copies' events; None:
    nothing to wait for) has ordered the copy it reads. Gathered along M, our shard's rows,
    then each staged peer shard's. Along K with ``k_schedule="rows"``, each row chunk of the
    gathered A over the whole K (rounded once, as one GEMM rounds); with ``"sum"``, one product
    per shard summed in fp32 (``plan.acc``) and rounded once. (Summing them in C itself, as PyTorch's fused op does, rounds once per shard: at 4
    ranks that missed our bf16 tolerance on every shape.)"""
    S_M, S_K = plan.S_M, plan.S_K
    if plan.gather_dim == 1 and not _by_rows(plan):
        _sum_products(a, b, plan, bias, c, rank, waits)
        return
    if bias is not None and bias.dtype != a.dtype:
        bias = bias.to(a.dtype)
    if plan.gather_dim == 0:
        _rows_product(a, b, bias, c[rank * S_M:(rank + 1) * S_M])
        for i, (p, dst, _) in enumerate(plan.chunks):
            if waits is not None:
                waits[0].wait_event(waits[1][i])
            _rows_product(dst, b, bias, c[p * S_M:(p + 1) * S_M])
        return
    A = gathered_k(plan)
    for i, (r0, r1) in enumerate(plan.rows):
        if waits is not None:
            waits[0].wait_event(waits[1][i])
        _rows_product(A[r0:r1], b, bias, c[r0:r1])


def _sum_products(a, b, plan, bias, c, rank, waits) -> None:
    """Along K, ``k_schedule="sum"``: our shard's product at once, each peer's added as it lands."""
    S_K = plan.S_K
    _mm_fp32(a, b[rank * S_K:(rank + 1) * S_K], plan.acc, False)
    for i, (p, dst, _) in enumerate(plan.chunks):
        if waits is not None:
            waits[0].wait_event(waits[1][i])
        _mm_fp32(dst, b[p * S_K:(p + 1) * S_K], plan.acc, True)
    torch.add(plan.acc, bias, out=c) if bias is not None else c.copy_(plan.acc)


def _rows_product(x, b, bias, rows) -> None:
    torch.mm(x, b, out=rows) if bias is None else torch.addmm(bias, x, b, out=rows)


def _mm_fp32(x, y, acc, add) -> None:
    """acc (+)= x @ y, products and sums in fp32 (cuBLAS's out_dtype on a GPU)."""
    if acc.device.type == "cuda":
        if add:
            torch.addmm(acc, x, y, out_dtype=torch.float32, out=acc)
        else:
            torch.mm(x, y, out_dtype=torch.float32, out=acc)
    elif add:
        acc.addmm_(x.float(), y.float())
    else:
        torch.mm(x.float(), y.float(), out=acc)


def warmup(heap, plan, s, args, wait_us) -> None:
    """Compile a copy-engine variant's kernels without launching them (``launch.prepare``)."""
    _ag_gemm_kernel.warmup(*args, grid=(plan.kw["FETCHERS"],), PUBLISH=True, FETCH=False, COMPUTE=False,
                           WAIT_READY=True, **plan.kw)
    if plan.cfg.variant == "chunked":
        _finish_kernel.warmup(s["state"], s["sig"], heap.heap_bases, s["status"], heap.rank, wait_us,
                              WORLD=heap.world_size, END_WAIT=plan.kw["END_WAIT"], grid=(1,))
        return
    if plan.cfg.variant == "copy_engine":
        _next_epoch_kernel.warmup(s["state"], plan.nextval, plan.nextval.numel(), BLOCK=128, grid=(1,))
    _ag_gemm_kernel.warmup(*args, grid=(plan.grid,), PUBLISH=False, FETCH=False, COMPUTE=True, WAIT_READY=False,
                           **dict(plan.kw, FETCHERS=0))
