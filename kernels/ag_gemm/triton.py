"""Fused all-gather + GEMM: fetcher programs fill a staging buffer, GEMM programs
consume it tile by tile as ready flags arrive (one persistent launch).

Layout of the data (W ranks, every rank holds a shard of S_M x S_K elements,
row-major):

* gather along K (``GATHER_K``): A = [shard_0 | shard_1 | ...] (M = S_M, K = W*S_K);
* gather along M: A = [shard_0; shard_1; ...] (M = W*S_M, K = S_K).

The staging buffer holds W blocks of S_M x S_K, block p = rank p's shard,
either k-contiguous (row-major, ``M_CONTIG=False``) or m-contiguous (each block
transposed). Block p is split into ``MT`` row tiles of ``BLOCK_M`` and ``KG``
k-groups of ``K_PER_FLAG * BLOCK_K`` columns; flag ``(p * MT + mt) * KG + g``
says that piece is staged (value ``epoch + 1`` in call number ``epoch``), and
one more flag after them says everything is (GEMM programs then stop polling).
Tiles never straddle two shards, so any S_M, S_K work (edges are masked).

Programs ``0 .. FETCHERS-1`` fetch, the rest compute (with ``CLAIM`` they take
tiles from a shared counter; with ``JOIN`` the fetchers too, once their copies
are done: on a GPU, where every program runs at once; not in a simulated world of
several ranks, whose interpreter runs the programs one after another):

1. publish (``PUBLISH``, programs ``0 .. PUBLISHERS-1``: the fetchers, or every
   program): wait until every peer finished reading our previous shard
   (``done`` flags), copy the local shard once into ``pub`` (the heap
   buffer peers read; nothing to copy in a world of one) and, with
   ``PUBLISH_GATHERED``, into its columns of the gathered A that the chunked
   variant's row-chunk GEMMs read (the staging buffer); the last publisher
   then tells every peer our shard is readable (``ready`` flag, release at
   system scope). With ``RESIDENT`` the caller's shard already lies in the
   heap at the same offset on every rank (``pub`` is the shard): no copy; one
   program tells each peer where it is (checked against the peer's own) and
   that it is readable.
2. fetch (``FETCH``): blocks ``rank+1, rank+2, ...`` (staggered, so ranks do
   not all read rank 0 first): wait for the peer's ``ready``, copy its tiles
   from its ``pub`` over NVLink into the staging buffer, set their flags; row
   tile by row tile, or (``FETCH_BY_K``) k-group by k-group across the row tiles.
3. compute (``COMPUTE``): output tiles in an L2-swizzled order (sequence
   parallel: our own rows first). The local shard is read where the caller
   keeps it (``a_ptr``), with no flag to wait for, so the GEMM starts at once;
   then the K loop walks the peers' blocks in the same staggered order and
   spins (acquire, bounded) on each k-group's flag. The staging block ``rank``
   and its flags are never used.
4. the last program to finish bumps the epoch and tells every peer it is done
   reading its shard; with ``END_WAIT`` (a resident shard, on a GPU) it then
   waits until every peer is done reading ours, so that the caller may
   overwrite it once the call is over.

Flag protocol (``kernels.comm.remote``): data stores -> ``tl.debug_barrier()`` ->
one release atomic. Staging flags have producer and consumer on this GPU:
scope "gpu"; ready/done cross GPUs: scope "sys". Every spin is bounded; a
timeout leaves the flag id in the status words (see launch.py for decoding).

In a simulated world (interpreter, ranks take turns) the publish step is a
launch of its own followed by a barrier; on a GPU all three run in one launch.

Tracing (``TRACE``, a constexpr: compiled out when off): each program writes
``[kind, item, start, end, sm]`` events to ``trace_ptr``; the clock is
``%globaltimer`` (ns) on NVIDIA, ``s_memtime`` on AMD, a shared counter in the
interpreter (an order, not a time).
"""
import triton
import triton.language as tl

from kernels.comm.remote import peer_delta, remote_store, signal
from kernels.comm.waits import record_give_up, wait

# trace event kinds
EV_PUBLISH = tl.constexpr(1)
EV_FETCH = tl.constexpr(2)
EV_WAIT = tl.constexpr(3)
EV_COMPUTE = tl.constexpr(4)
TRACE_COLS = 5  # kind, item, start, end, sm


@triton.jit
def _now(tick_ptr, CLOCK: tl.constexpr):
    if CLOCK == "globaltimer":
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False,
                                      pack=1)
    elif CLOCK == "memtime":
        t = tl.inline_asm_elementwise("s_memtime $0\ns_waitcnt lgkmcnt(0)", "=s", [], dtype=tl.int64,
                                      is_pure=False, pack=1)
    else:
        t = tl.atomic_add(tick_ptr, 1).to(tl.int64)
    return t


@triton.jit
def _sm_id(CLOCK: tl.constexpr):
    if CLOCK == "globaltimer":
        s = tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=True, pack=1)
    else:
        s = tl.program_id(0)
    return s


@triton.jit
def _record(trace_ptr, n, kind, item, t0, t1, sm, MAX_EVENTS: tl.constexpr):
    """Write event `n` of this program (dropped past MAX_EVENTS)."""
    if n < MAX_EVENTS:
        row = trace_ptr + (tl.program_id(0).to(tl.int64) * MAX_EVENTS + n) * 5
        tl.store(row, kind)
        tl.store(row + 1, item)
        tl.store(row + 2, t0)
        tl.store(row + 3, t1)
        tl.store(row + 4, sm.to(tl.int64))
    return n + 1


@triton.jit
def _wait_flag(flag_ptr, expected, timeout_us, status_ptr, flag_id, call, heap_bases, rank, WORLD: tl.constexpr,
               SCOPE: tl.constexpr):
    """`kernels.comm.waits.wait` behind a fast path: one acquire read and a CTA barrier
    when the flag is already set (the common case once the gather is ahead). Once any
    wait of this call (tag `call`: epoch + 1) has given up, the others give up at their
    first poll (one lost peer must not cost timeout_us for every tile)."""
    seen = tl.atomic_add(flag_ptr, 0, sem="acquire", scope=SCOPE)
    if seen < expected:
        wait(flag_ptr, expected, timeout_us, status_ptr, flag_id, call, heap_bases, rank, WORLD, SCOPE)
    tl.debug_barrier()  # the acquire (one thread's) ordered before every thread's loads


@triton.jit
def _stage_offsets(rows, cols, S_M, S_K, M_CONTIG: tl.constexpr):
    """Offsets of (rows, cols) inside one staging block."""
    if M_CONTIG:
        return cols[None, :].to(tl.int64) * S_M + rows[:, None]
    else:
        return rows[:, None].to(tl.int64) * S_K + cols[None, :]


@triton.jit
def _copy_item(src_ptr, stg_ptr, pub_ptr, flags_ptr, block, mt, g, epoch, S_M, S_K, MT, KG,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, K_PER_FLAG: tl.constexpr, FETCH_K: tl.constexpr,
               M_CONTIG: tl.constexpr, PUBLISH: tl.constexpr, GATHERED: tl.constexpr = False,
               WORLD: tl.constexpr = 1):
    """Copy piece (mt, g) of a shard (row-major at src_ptr), FETCH_K columns at a time
    (wider than BLOCK_K: more bytes in flight over NVLink): into pub when publishing our
    own (the caller signals once every piece is there; with GATHERED also into our columns
    `block` of the gathered A that the staging buffer holds), else into staging block `block`,
    then set its flag: stores, CTA barrier, release."""
    rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < S_M
    stg_block = stg_ptr + block.to(tl.int64) * S_M * S_K
    k_end = tl.minimum((g + 1) * K_PER_FLAG * BLOCK_K, S_K)
    for k0 in range(g * K_PER_FLAG * BLOCK_K, k_end, FETCH_K):
        cols = k0 + tl.arange(0, FETCH_K)
        mask = row_ok[:, None] & (cols[None, :] < k_end)
        offs = rows[:, None].to(tl.int64) * S_K + cols[None, :]
        vals = tl.load(src_ptr + offs, mask=mask)
        if PUBLISH:
            tl.store(pub_ptr + offs, vals, mask=mask)
            if GATHERED:   # the chunked variant's rows schedule: the GEMMs read A (M, WORLD * S_K) whole
                tl.store(stg_ptr + rows[:, None].to(tl.int64) * (S_K * WORLD) + block * S_K + cols[None, :], vals,
                         mask=mask)
        else:
            tl.store(stg_block + _stage_offsets(rows, cols, S_M, S_K, M_CONTIG), vals, mask=mask)
    if not PUBLISH:
        tl.debug_barrier()  # every thread's stores precede the flag
        tl.atomic_xchg(flags_ptr + (block * MT + mt) * KG + g, epoch + 1, sem="release", scope="gpu")


@triton.jit(do_not_specialize=["rank", "timeout_us", "pub_off16"])
def _ag_gemm_kernel(a_ptr, pub_ptr, stg_ptr, b_ptr, bias_ptr, c_ptr,
                    heap_bases, sig_ptr, flags_ptr, state_ptr, status_ptr, trace_ptr,
                    S_M, S_K, N, stride_bk, stride_bn, stride_cm,
                    rank, timeout_us, pub_off16,
                    WORLD: tl.constexpr, GATHER_K: tl.constexpr, M_CONTIG: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    K_PER_FLAG: tl.constexpr, FETCH_K: tl.constexpr, FETCHERS: tl.constexpr, HAS_BIAS: tl.constexpr,
                    PUBLISH: tl.constexpr, FETCH: tl.constexpr, COMPUTE: tl.constexpr, WAIT_READY: tl.constexpr,
                    SKIP_RANK: tl.constexpr, ESIZE: tl.constexpr, EVEN_K: tl.constexpr,
                    ALIGNED_M: tl.constexpr, ALIGNED_N: tl.constexpr, STAGED_FLAG: tl.constexpr,
                    TRACE: tl.constexpr, CLOCK: tl.constexpr, MAX_EVENTS: tl.constexpr,
                    TMA: tl.constexpr = False, PROXY_FENCE: tl.constexpr = False, CLAIM: tl.constexpr = False,
                    JOIN: tl.constexpr = False, FETCH_BY_K: tl.constexpr = False,
                    WAIT_GROWTH: tl.constexpr = 1, RESIDENT: tl.constexpr = False,
                    END_WAIT: tl.constexpr = False, PUBLISHERS: tl.constexpr = 1, CHUNK_TILES: tl.constexpr = 0,
                    SET_NEXT: tl.constexpr = False, PUBLISH_GATHERED: tl.constexpr = False):
    pid = tl.program_id(0)
    MT = (S_M + BLOCK_M - 1) // BLOCK_M
    KT = (S_K + BLOCK_K - 1) // BLOCK_K
    KG = (KT + K_PER_FLAG - 1) // K_PER_FLAG
    epoch = tl.load(state_ptr)  # calls completed; bumped by the last program of the previous call
    ready_ptr = sig_ptr          # ready[p]: rank p published its shard (counts calls)
    done_ptr = sig_ptr + WORLD   # done[p]: rank p finished reading our shard (counts calls)
    where_ptr = sig_ptr + 2 * WORLD  # where[p]: rank p's resident shard's heap offset / 16, as it told us
    tick_ptr = state_ptr + 3
    n_ev = 0
    sm = 0
    if TRACE:
        sm = _sm_id(CLOCK)
    if PUBLISH and RESIDENT:
        # The caller's shard is in the heap (pub_ptr is a_ptr): nothing to copy, and the
        # previous call ended only once every peer had read it (END_WAIT). Tell every
        # peer where it is (checked against theirs), then that it is readable.
        if pid == 0:
            for i in tl.static_range(1, WORLD):
                peer = (rank + i) % WORLD
                remote_store(where_ptr + rank, pub_off16, rank, peer, heap_bases)
                signal(ready_ptr + rank, 1, rank, peer, heap_bases, "add", "sys")
    if PUBLISH and not RESIDENT and pid < PUBLISHERS:
        # Programs 0 .. PUBLISHERS-1 copy our shard into pub (the fetchers, or every program:
        # a local copy is quick on many SMs, and the peers' fetch waits for all of it).
        # Peers must be done with our previous shard before pub is overwritten.
        for i in tl.static_range(1, WORLD):
            peer = (rank + i) % WORLD
            _wait_flag(done_ptr + peer, epoch, timeout_us, status_ptr, -1 - WORLD - peer, epoch + 1, heap_bases,
                       rank, WORLD, "sys")
        # (a world of one has no reader, and needs no gathered A but with PUBLISH_GATHERED)
        for item in range(pid, MT * KG * (WORLD > 1 or PUBLISH_GATHERED), PUBLISHERS):
            if TRACE:
                t0 = _now(tick_ptr, CLOCK)
            _copy_item(a_ptr, stg_ptr, pub_ptr, flags_ptr, rank, item // KG, item % KG, epoch, S_M, S_K, MT,
                       KG, BLOCK_M, BLOCK_K, K_PER_FLAG, FETCH_K, M_CONTIG, True, PUBLISH_GATHERED, WORLD)
            if TRACE:
                n_ev = _record(trace_ptr, n_ev, EV_PUBLISH, rank * MT * KG + item, t0, _now(tick_ptr, CLOCK),
                               sm, MAX_EVENTS)
        # the last publisher (in arrival order) tells every peer that pub is complete
        tl.debug_barrier()
        arrived = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if arrived == PUBLISHERS - 1:
            tl.store(state_ptr + 1, 0)
            for i in tl.static_range(1, WORLD):
                signal(ready_ptr + rank, 1, rank, (rank + i) % WORLD, heap_bases, "add", "sys")
    if PUBLISH and SET_NEXT:
        # pipelined: the value its chunk signals take this call (epoch + 1), which the side
        # stream copies after each chunk (no kernel of its own to make it)
        if pid == 0:
            tl.store(state_ptr + 6, epoch + 1)
    if TRACE and FETCH and not PUBLISH:  # simulated world: the publish launch wrote these programs' first events
        if pid < PUBLISHERS:
            n_ev = (MT * KG * (WORLD > 1 or PUBLISH_GATHERED) - pid + PUBLISHERS - 1) // PUBLISHERS
    if pid < FETCHERS:
        if PUBLISH and WAIT_READY:  # copy-engine variant: the copies start after this kernel, once all published
            if pid == 0:
                for i in tl.static_range(1, WORLD):
                    peer = (rank + i) % WORLD
                    _wait_flag(ready_ptr + peer, epoch + 1, timeout_us, status_ptr, -1 - peer, epoch + 1, heap_bases,
                               rank, WORLD, "sys")
                    _same_place(where_ptr, peer, pub_off16, status_ptr, epoch + 1, heap_bases, rank, WORLD,
                                RESIDENT)
        if FETCH:
            for i in tl.static_range(1, WORLD):
                peer = (rank + i) % WORLD
                if peer != SKIP_RANK:  # SKIP_RANK: fault injection for tests (-1: none)
                    if TRACE:
                        t0 = _now(tick_ptr, CLOCK)
                    _wait_flag(ready_ptr + peer, epoch + 1, timeout_us, status_ptr, -1 - peer, epoch + 1, heap_bases,
                               rank, WORLD, "sys")
                    if TRACE:
                        n_ev = _record(trace_ptr, n_ev, EV_WAIT, -1 - peer, t0, _now(tick_ptr, CLOCK), sm,
                                       MAX_EVENTS)
                    # the peer's pub, addressed through our own pub pointer (same heap offset)
                    src = pub_ptr + peer_delta(rank, peer, heap_bases, ESIZE, 16 // ESIZE)
                    n_items = MT * KG * _same_place(where_ptr, peer, pub_off16, status_ptr, epoch + 1, heap_bases,
                                                    rank, WORLD, RESIDENT)
                    for item in range(pid, n_items, FETCHERS):
                        if TRACE:
                            t0 = _now(tick_ptr, CLOCK)
                        # row tile by row tile (each tile complete early: many tiles per GEMM program), or
                        # k-group by k-group across the row tiles (every tile starts early: about one each)
                        if FETCH_BY_K:
                            mt, kg = item % MT, item // MT
                        else:
                            mt, kg = item // KG, item % KG
                        _copy_item(src, stg_ptr, pub_ptr, flags_ptr, peer, mt, kg, epoch, S_M, S_K,
                                   MT, KG, BLOCK_M, BLOCK_K, K_PER_FLAG, FETCH_K, M_CONTIG, False)
                        if TRACE:
                            n_ev = _record(trace_ptr, n_ev, EV_FETCH, peer * MT * KG + item, t0,
                                           _now(tick_ptr, CLOCK), sm, MAX_EVENTS)
            if STAGED_FLAG and SKIP_RANK < 0:
                # the last fetcher to finish raises the "everything is staged" flag (after
                # acquiring the others' releases): GEMM programs then stop polling per tile
                tl.debug_barrier()
                finished = tl.atomic_add(state_ptr + 4, 1, sem="acq_rel", scope="gpu")
                if finished == FETCHERS - 1:
                    tl.atomic_xchg(state_ptr + 4, 0, sem="relaxed", scope="gpu")  # counter only: no data
                    tl.atomic_xchg(flags_ptr + WORLD * MT * KG, epoch + 1, sem="release", scope="gpu")
    if COMPUTE:
        # GEMM programs (and, with JOIN, the fetchers too once their copies are done)
        _compute(a_ptr, stg_ptr, b_ptr, bias_ptr, c_ptr, flags_ptr, status_ptr, trace_ptr, tick_ptr, state_ptr + 5,
                 S_M, S_K, N, stride_bk, stride_bn, stride_cm, heap_bases, rank, timeout_us, epoch, MT, KT, KG,
                 pid - FETCHERS, tl.num_programs(0) - FETCHERS, n_ev, sm, WORLD, GATHER_K, M_CONTIG, BLOCK_M,
                 BLOCK_N, BLOCK_K, GROUP_M, K_PER_FLAG, HAS_BIAS, EVEN_K, ALIGNED_M, ALIGNED_N, STAGED_FLAG, TRACE,
                 CLOCK, MAX_EVENTS, TMA, PROXY_FENCE, CLAIM, JOIN, WAIT_GROWTH, CHUNK_TILES)
        # the last program of the call: next epoch, and tell peers we are done with their shards
        tl.debug_barrier()
        arrived = tl.atomic_add(state_ptr + 2, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            tl.store(state_ptr + 2, 0)
            tl.store(state_ptr + 5, 0)  # the tile counter: every program has made its last claim
            _end_call(state_ptr, sig_ptr, epoch, heap_bases, status_ptr, rank, timeout_us, WORLD, END_WAIT)


@triton.jit
def _end_call(state_ptr, sig_ptr, epoch, heap_bases, status_ptr, rank, timeout_us,
              WORLD: tl.constexpr, END_WAIT: tl.constexpr):
    """Next epoch, and tell every peer we are done reading its shard. With END_WAIT (a resident
    shard) wait until every peer is done reading ours: the shard is the caller's again once the
    call is over (they may overwrite it next), so the call ends only when every peer has read it.
    Done flags are set whatever happened, so every rank's counters stay in step for the next
    call (``kernels.comm.waits``, rule 3)."""
    done_ptr = sig_ptr + WORLD
    tl.store(state_ptr, epoch + 1)
    for i in tl.static_range(1, WORLD):
        signal(done_ptr + rank, 1, rank, (rank + i) % WORLD, heap_bases, "add", "sys")
    if END_WAIT:
        for i in tl.static_range(1, WORLD):
            peer = (rank + i) % WORLD
            _wait_flag(done_ptr + peer, epoch + 1, timeout_us, status_ptr, -1 - WORLD - peer, epoch + 1, heap_bases,
                       rank, WORLD, "sys")


@triton.jit
def _same_place(where_ptr, peer, pub_off16, status_ptr, call, heap_bases, rank, WORLD: tl.constexpr,
                RESIDENT: tl.constexpr):
    """1 when the peer's shard sits at our shard's heap offset (always, unless RESIDENT:
    then each rank said where its own is), else 0 after recording the mismatch in the
    status words: the heap addresses a peer's data by our offset, so shards allocated
    out of step between ranks would be read from the wrong place."""
    ok = 1
    if RESIDENT:
        theirs = tl.atomic_add(where_ptr + peer, 0, sem="relaxed", scope="gpu")  # ordered by the ready acquire
        if theirs != pub_off16:
            record_give_up(status_ptr, call, -1 - 2 * WORLD - peer, theirs, pub_off16, 0, heap_bases, rank, WORLD)
            ok = 0
    return ok


@triton.jit
def _k_step(acc, a_blk, b_ptr, k_base, k, cols_in, S_K, stride_sk, stride_bk, stride_bn, EVEN_K: tl.constexpr):
    """acc += the staged A rows at columns k (a_blk: their row pointers) @ B's rows k_base + k."""
    a_ptrs = a_blk + k[None, :] * stride_sk
    b_ptrs = b_ptr + (k_base + k)[:, None].to(tl.int64) * stride_bk + cols_in[None, :] * stride_bn
    if EVEN_K:  # no shard edge inside a tile: unmasked (vector) loads
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
    else:
        a = tl.load(a_ptrs, mask=(k < S_K)[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=(k < S_K)[:, None], other=0.0)
    return tl.dot(a, b, acc)


@triton.jit
def _k_step_tma(acc, a_desc, b_desc, a_row, a_col, b_row, b_col, TRANS_A: tl.constexpr):
    """The same step through TMA descriptors (Hopper): A's tile at (a_row, a_col) of its
    descriptor (TRANS_A: stored transposed, K by M), B's at (b_row, b_col). Reads past a
    descriptor's edges are zeros."""
    if TRANS_A:
        a = tl.trans(a_desc.load([a_row, a_col]))
    else:
        a = a_desc.load([a_row, a_col])
    b = b_desc.load([b_row, b_col])
    return tl.dot(a, b, acc)


@triton.jit
def _staged_step(acc, a_stg, b_desc, a_blk, b_ptr, block, mt, pn, k_base, k0, lane_k, cols_in, S_M, S_K,
                 stride_sk, stride_bk, stride_bn, M_CONTIG: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr):
    """One K step over staging block `block` (a_blk: its row pointers, for pointer loads)."""
    if TMA:
        if M_CONTIG:  # each staging block is stored transposed: S_K rows of S_M
            acc = _k_step_tma(acc, a_stg, b_desc, block * S_K + k0, mt * BLOCK_M, k_base + k0, pn * BLOCK_N, True)
        else:
            acc = _k_step_tma(acc, a_stg, b_desc, block * S_M + mt * BLOCK_M, k0, k_base + k0, pn * BLOCK_N, False)
    else:
        acc = _k_step(acc, a_blk, b_ptr, k_base, k0 + lane_k, cols_in, S_K, stride_sk, stride_bk, stride_bn, EVEN_K)
    return acc


@triton.jit
def _fence_async_proxy(ON: tl.constexpr):
    """Order what this thread acquired (a flag, through the generic proxy) before its TMA
    reads (the async proxy) of the tiles the flag covers: other programs wrote them with
    plain stores. A no-op where it is off (the interpreter, pointer loads)."""
    if ON:
        tl.inline_asm_elementwise("fence.proxy.async.global;\n\tmov.u32 $0, 0;", "=r", [], dtype=tl.int32,
                                  is_pure=False, pack=1)


@triton.jit
def _compute(a_ptr, stg_ptr, b_ptr, bias_ptr, c_ptr, flags_ptr, status_ptr, trace_ptr, tick_ptr, claim_ptr,
             S_M, S_K, N, stride_bk, stride_bn, stride_cm, heap_bases, rank, timeout_us, epoch, MT, KT, KG, gid,
             num_gemm, n_ev, sm, WORLD: tl.constexpr, GATHER_K: tl.constexpr, M_CONTIG: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
             K_PER_FLAG: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, ALIGNED_M: tl.constexpr,
             ALIGNED_N: tl.constexpr, STAGED_FLAG: tl.constexpr, TRACE: tl.constexpr,
             CLOCK: tl.constexpr, MAX_EVENTS: tl.constexpr, TMA: tl.constexpr, PROXY_FENCE: tl.constexpr,
             CLAIM: tl.constexpr, JOIN: tl.constexpr, WAIT_GROWTH: tl.constexpr, CHUNK_TILES: tl.constexpr = 0):
    """GEMM programs: output tiles gid, gid + num_gemm, ... in GROUP_M bands; with CLAIM,
    the next tile from a shared counter until none is left, so a program held up by a late
    tile takes fewer. Fetchers (gid < 0) take tiles only with JOIN (and CLAIM), once their
    copies are done, so no SM idles after fetching.

    TMA: A tiles (of the local shard and of the staging buffer) and B tiles through
    descriptors made here (the launcher allows it where every row is 16-byte aligned and no
    K tile straddles two shards, or, gathered along M, where zero-filled columns of A meet
    zero-filled rows of B); the pipelined loops then run on TMA and wgmma. Otherwise masked
    pointer loads.

    CHUNK_TILES > 0 (variant pipelined): peers' shards arrive in chunks of CHUNK_TILES row
    tiles, one signal per (shard, chunk); tiles go in the chunks' arrival order
    (``_chunk_tile``), and a tile waits once per peer shard, on its chunk's signal, then runs
    that shard's whole K range as one pipelined loop."""
    if GATHER_K:
        ROW_BLOCKS: tl.constexpr = 1
        K_BLOCKS: tl.constexpr = WORLD
    else:
        ROW_BLOCKS: tl.constexpr = WORLD
        K_BLOCKS: tl.constexpr = 1
    num_m = ROW_BLOCKS * MT
    num_n = (N + BLOCK_N - 1) // BLOCK_N
    lane_k = tl.arange(0, BLOCK_K)
    if M_CONTIG:
        stride_sm = 1
        stride_sk = S_M
    else:
        stride_sm = S_K
        stride_sk = 1
    a_loc = None
    a_stg = None
    b_desc = None
    if TMA:
        a_loc = tl.make_tensor_descriptor(a_ptr, [S_M, S_K], [S_K, 1], [BLOCK_M, BLOCK_K])
        if M_CONTIG:
            a_stg = tl.make_tensor_descriptor(stg_ptr, [WORLD * S_K, S_M], [S_M, 1], [BLOCK_K, BLOCK_M])
        else:
            a_stg = tl.make_tensor_descriptor(stg_ptr, [WORLD * S_M, S_K], [S_K, 1], [BLOCK_M, BLOCK_K])
        b_desc = tl.make_tensor_descriptor(b_ptr, [K_BLOCKS * S_K, N], [stride_bk, 1], [BLOCK_K, BLOCK_N])
    num_tiles = num_m * num_n
    if CHUNK_TILES > 0:
        NCH = (MT + CHUNK_TILES - 1) // CHUNK_TILES   # chunks per shard
        staged_at = WORLD * NCH   # the "all staged" signal follows the chunks' signals
    else:
        NCH = MT
        staged_at = WORLD * MT * KG
    if CLAIM and JOIN:
        tile = tl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu")  # a work counter: orders no data
    elif CLAIM:
        tile = num_tiles    # a fetcher that does not join takes no tile (and claims none)
        if gid >= 0:
            tile = tl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu")
    else:
        tile = tl.where(gid < 0, num_tiles, gid)
    while tile < num_tiles:
        if TRACE:
            t_tile = _now(tick_ptr, CLOCK)
        if CHUNK_TILES > 0:
            lm, pn = _chunk_tile(tile, MT, num_n, GROUP_M, CHUNK_TILES)
        else:
            # L2 swizzle over (logical row tile, column tile)
            band = tile // (GROUP_M * num_n)
            first_m = band * GROUP_M
            rows_in_band = tl.minimum(num_m - first_m, GROUP_M)
            inside = tile - band * (GROUP_M * num_n)
            lm = first_m + inside % rows_in_band
            pn = inside // rows_in_band
        # sequence parallel: our own rows first, then rank+1's, ... (they arrive in that order)
        row_block = ((lm // MT) + rank) % ROW_BLOCKS
        mt = lm % MT
        rows = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < S_M
        rows_in = tl.where(row_ok, rows, 0)
        cols = pn * BLOCK_N + tl.arange(0, BLOCK_N)
        cols_in = tl.where(cols < N, cols, 0)
        # Clamping erased contiguity; where rows of B (and, m-contiguous, of staged A) hold
        # whole 16-byte vectors, every vector is either all in range or all clamped (never
        # stored), so it is safe to say so: 16-byte loads instead of 2-byte ones.
        if ALIGNED_N:
            cols_in = tl.max_contiguous(tl.multiple_of(cols_in, BLOCK_N), BLOCK_N)
        if ALIGNED_M:
            rows_in = tl.max_contiguous(tl.multiple_of(rows_in, BLOCK_M), BLOCK_M)
        # tl.full, not tl.zeros: a builtin, so the kernel also runs through workbench.dist.interpreted
        acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
        if GATHER_K:
            first_q = 1                   # block q = 0 is our own shard, read below
            k_local = rank * S_K
            local = True
            remote = WORLD > 1
        else:
            first_q = 0
            k_local = 0
            local = row_block == rank     # a tile's rows are all ours or all one peer's
            remote = row_block != rank
        if local:
            # Our own shard, where the caller keeps it: no flag to wait for, so every GEMM
            # program starts at once instead of behind the publish copy.
            a_blk = a_ptr + rows_in[:, None].to(tl.int64) * S_K
            for t in range(KT):
                if TMA:
                    acc = _k_step_tma(acc, a_loc, b_desc, mt * BLOCK_M, t * BLOCK_K, k_local + t * BLOCK_K,
                                      pn * BLOCK_N, False)
                else:
                    acc = _k_step(acc, a_blk, b_ptr, k_local, t * BLOCK_K + lane_k, cols_in, S_K, 1, stride_bk,
                                  stride_bn, EVEN_K)
        if remote:
            # everything staged already (the usual case after the first wave): no per-group polls
            staged = False
            if STAGED_FLAG:
                staged = tl.atomic_add(flags_ptr + staged_at, 0, sem="acquire", scope="gpu") >= epoch + 1
                tl.debug_barrier()
                _fence_async_proxy(PROXY_FENCE)
            if staged:
                # Every piece is staged: one loop over all K steps, which the compiler pipelines
                # (num_stages) from start to end. The nested loops below restart the pipeline at
                # every flag group of K_PER_FLAG steps (measured at world size 1 on an H200, where
                # every tile sees this flag: the fused GEMM at 0.46x cuBLAS's speed).
                for kk in range((K_BLOCKS - first_q) * KT):
                    q = first_q + kk // KT
                    t = kk % KT
                    if GATHER_K:
                        block = (rank + q) % WORLD
                        k_base = block * S_K
                    else:
                        block = row_block
                        k_base = 0
                    a_blk = stg_ptr + block.to(tl.int64) * S_M * S_K + rows_in[:, None] * stride_sm
                    acc = _staged_step(acc, a_stg, b_desc, a_blk, b_ptr, block, mt, pn, k_base, t * BLOCK_K, lane_k,
                                       cols_in, S_M, S_K, stride_sk, stride_bk, stride_bn, M_CONTIG, BLOCK_M, BLOCK_N,
                                       EVEN_K, TMA)
            else:   # not all staged yet: wait span by span of k-groups
                for q in range(first_q, K_BLOCKS):
                    if GATHER_K:
                        block = (rank + q) % WORLD
                        k_base = block * S_K  # rows of B for this shard
                    else:
                        block = row_block
                        k_base = 0
                    a_blk = stg_ptr + block.to(tl.int64) * S_M * S_K + rows_in[:, None] * stride_sm
                    if CHUNK_TILES > 0:
                        # one signal covers this tile's rows of the shard, all of K: one wait, one loop
                        if TRACE:
                            t0 = _now(tick_ptr, CLOCK)
                        flag = block * NCH + mt // CHUNK_TILES
                        _wait_flag(flags_ptr + flag, epoch + 1, timeout_us, status_ptr, flag, epoch + 1, heap_bases,
                                   rank, WORLD, "gpu")
                        if TRACE:
                            n_ev = _record(trace_ptr, n_ev, EV_WAIT, flag, t0, _now(tick_ptr, CLOCK), sm, MAX_EVENTS)
                        _fence_async_proxy(PROXY_FENCE)
                        for t in range(KT):
                            acc = _staged_step(acc, a_stg, b_desc, a_blk, b_ptr, block, mt, pn, k_base, t * BLOCK_K,
                                               lane_k, cols_in, S_M, S_K, stride_sk, stride_bk, stride_bn, M_CONTIG,
                                               BLOCK_M, BLOCK_N, EVEN_K, TMA)
                    else:
                        # Each span's K steps are one pipelined loop, which starts empty: a wait per
                        # k-group restarted the pipeline KG times per tile (traced on two H200s: a
                        # remote tile's K loop 1.3x slower than a local one). Spans growing by
                        # WAIT_GROWTH keep the first wait as early and restart it about log2(KG)
                        # times; fetchers stage k-groups faster than a program consumes them.
                        g0 = 0
                        span = 1
                        while g0 < KG:
                            g1 = tl.minimum(g0 + span, KG)
                            for g in range(g0, g1):
                                if TRACE:
                                    t0 = _now(tick_ptr, CLOCK)
                                flag = (block * MT + mt) * KG + g
                                _wait_flag(flags_ptr + flag, epoch + 1, timeout_us, status_ptr, flag, epoch + 1,
                                           heap_bases, rank, WORLD, "gpu")
                                if TRACE:
                                    n_ev = _record(trace_ptr, n_ev, EV_WAIT, flag, t0, _now(tick_ptr, CLOCK), sm,
                                                   MAX_EVENTS)
                            _fence_async_proxy(PROXY_FENCE)
                            for t in range(g0 * K_PER_FLAG, tl.minimum(g1 * K_PER_FLAG, KT)):
                                acc = _staged_step(acc, a_stg, b_desc, a_blk, b_ptr, block, mt, pn, k_base,
                                                   t * BLOCK_K, lane_k, cols_in, S_M, S_K, stride_sk, stride_bk,
                                                   stride_bn, M_CONTIG, BLOCK_M, BLOCK_N, EVEN_K, TMA)
                            g0 = g1
                            span = span * WAIT_GROWTH
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols_in).to(tl.float32)[None, :]
        c_rows = (row_block * S_M + rows).to(tl.int64)
        tl.store(c_ptr + c_rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & (cols[None, :] < N))
        if TRACE:
            n_ev = _record(trace_ptr, n_ev, EV_COMPUTE, lm * num_n + pn, t_tile, _now(tick_ptr, CLOCK), sm,
                           MAX_EVENTS)
        if CLAIM:
            tile = tl.atomic_add(claim_ptr, 1, sem="relaxed", scope="gpu")
        else:
            tile += num_gemm


@triton.jit
def _chunk_tile(tile, MT, num_n, GROUP_M: tl.constexpr, CHUNK_TILES: tl.constexpr):
    """(logical row tile, column tile) of tile number ``tile`` in the chunks' arrival order:
    row block by row block (logical, ``lm // MT``: our own rows first when gathered along M),
    inside a block chunk by chunk of CHUNK_TILES row tiles (the last chunk may be shorter),
    inside a chunk GROUP_M-row bands, column tiles in each band (the L2 swizzle), so that
    no band straddles two chunks: a tile never waits on a later chunk than its band's."""
    per_block = MT * num_n
    blk = tile // per_block
    t = tile - blk * per_block
    chunk = t // (CHUNK_TILES * num_n)
    t = t - chunk * (CHUNK_TILES * num_n)
    first = chunk * CHUNK_TILES
    rows = tl.minimum(MT - first, CHUNK_TILES)
    band = t // (GROUP_M * num_n)
    band_rows = tl.minimum(rows - band * GROUP_M, GROUP_M)
    inside = t - band * (GROUP_M * num_n)
    lm = blk * MT + first + band * GROUP_M + inside % band_rows
    pn = inside // band_rows
    return lm, pn


@triton.jit
def _next_epoch_kernel(state_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """Fill out[:n] with epoch + 1: the copy-engine variant sets a staged chunk's flags by
    copying from it on the copy stream, right after the chunk (no kernel, no SM needed)."""
    offs = tl.arange(0, BLOCK)
    for s in range(0, n, BLOCK):
        tl.store(out_ptr + s + offs, tl.full([BLOCK], 1, tl.int32) + tl.load(state_ptr),
                 mask=s + offs < n)


@triton.jit(do_not_specialize=["rank", "timeout_us"])
def _finish_kernel(state_ptr, sig_ptr, heap_bases, status_ptr, rank, timeout_us,
                   WORLD: tl.constexpr, END_WAIT: tl.constexpr):
    """The end of a ``chunked`` call (one program, stream-ordered after its copies from the
    peers): what the last GEMM program does in the other variants."""
    _end_call(state_ptr, sig_ptr, tl.load(state_ptr), heap_bases, status_ptr, rank, timeout_us, WORLD, END_WAIT)
