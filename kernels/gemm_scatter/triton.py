"""Triton kernel of the fused GEMM + all-scatter (see ``kernels.gemm_scatter``).

One persistent program per SM walks the output tiles of ``A @ B_local`` (the
tile schedule of ``kernels.gemm``) and stores each finished tile into every
rank's C at this rank's column block, then signals completion by flags.

Small M (``_gemm_scatter_split_kernel``): few output tiles cannot keep the SMs
streaming B, so each tile's K range is cut into pieces (grid: tiles x pieces,
the split-K pieces and swapped operands of ``kernels.gemm``); the piece that
completes a tile in the fp32 workspace scatters it. Every program signals.

Senders (``_gemm_scatter_send_kernel``, variant "senders"): the sends leave the
GEMM's programs. The first ``num_gemm`` programs compute tiles in row-band order
(the L2 swizzle's bands of ``group_m`` row tiles, so row bands finish one after
another), store each into this rank's own C only (HBM, not NVLink) and count it
in the band's counter (release); the last SENDERS programs take the bands in
order, wait (acquire, bounded) until a band's tiles are all counted, and push the
band's rows of this rank's column block to every peer with 16-byte stores, while
the GEMM programs go on with later bands. A remote store that back-pressures
(NVLink is 10x slower than HBM) then stalls a sender, not an SM of the GEMM.
"""
import triton
import triton.language as tl

from kernels.common import interpreter
from kernels.comm.remote import signal
from kernels.comm.waits import wait, wait_all
from kernels.gemm.triton import _meet_split, _split_piece, _tile_coords, ptr_mainloop

if interpreter.active():
    interpreter.patch()

# Integers that vary between calls of one configuration stay unspecialized (no
# recompiles): the rank, the wait bound, the grid, the swizzle, and M (the
# seed's M sweep runs 1..1024 through one compiled kernel).
_RUNTIME_INTS = ["M", "rank", "timeout_us", "num_sms", "group_m"]


@triton.jit
def _peer_tile_ptrs(ptrs, rank, peer, heap_bases, HINTS: tl.constexpr, BLOCK_N: tl.constexpr):
    """``ptrs`` (a tile of addresses in this rank's heap) on ``peer``: the heap
    offset moved onto the peer's base (iris' ``translate``).

    The integer round trip erases what the compiler knew about the addresses;
    with HINTS the tile's rows are re-stated as runs of BLOCK_N contiguous
    elements starting 16-byte aligned (the seed's ``hint=(1, BLOCK_N)``), on the
    op that makes the pointer (a hint on a helper's result would be dropped
    with the call). The launcher sets HINTS only when that is true: C's row
    length and column offsets are multiples of 16 bytes.
    """
    here = tl.load(heap_bases + rank).to(tl.uint64)
    there = tl.load(heap_bases + peer).to(tl.uint64)
    out = (ptrs.to(tl.uint64, bitcast=True) - here + there).to(ptrs.dtype, bitcast=True)
    if HINTS:
        out = tl.max_contiguous(tl.multiple_of(out, (1, 16)), (1, BLOCK_N))
    return out


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _gemm_scatter_kernel(a_ptr, b_ptr, a_desc, b_desc, c_ptr, heap_bases, flags_ptr, status_ptr, total_ptr,
                         M, N_LOCAL, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                         rank, timeout_us, num_sms, group_m,
                         WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, TMA_LOADS: tl.constexpr, FROM_REGISTERS: tl.constexpr,
                         HINTS: tl.constexpr, WAIT: tl.constexpr, FLATTEN: tl.constexpr, SCOPE: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N_LOCAL + BLOCK_N - 1) // BLOCK_N
    num_tiles = num_pid_m * num_pid_n
    k_steps = (K + BLOCK_K - 1) // BLOCK_K
    col0 = rank * N_LOCAL  # this rank's column block in every rank's C
    for tile_id in tl.range(pid, num_tiles, num_sms, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, group_m)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if TMA_LOADS:
            # Hopper: the copy engine zero-fills reads past the edges.
            for kk in range(k_steps):
                a = a_desc.load([off_m, kk * BLOCK_K])
                b = b_desc.load([kk * BLOCK_K, off_n])
                acc = tl.dot(a, b, acc)
        else:
            acc = ptr_mainloop(a_ptr, b_ptr, rows, cols, M, N_LOCAL, K, stride_am, stride_ak, stride_bk, stride_bn,
                               acc, k_steps, BLOCK_K)
        tile = acc.to(c_ptr.dtype.element_ty)
        mask = (rows[:, None] < M) & (cols[None, :] < N_LOCAL)
        dst = c_ptr + rows[:, None].to(tl.int64) * stride_cm + (col0 + cols)[None, :]
        if not FROM_REGISTERS:
            # The seed's first version (iris ctx.put): C lands in local memory first,
            # then every peer gets a copy read back from it.
            tl.store(dst, tile, mask=mask)
            tl.debug_barrier()  # every thread's part of the tile is written before anyone reads it back
            tile = tl.load(dst, mask=mask)
            _scatter(tile, dst, mask, rank, heap_bases, 1, WORLD, HINTS, BLOCK_N)
        else:
            _scatter(tile, dst, mask, rank, heap_bases, 0, WORLD, HINTS, BLOCK_N)
    _finish(flags_ptr, total_ptr, status_ptr, heap_bases, rank, timeout_us, pid == 0, num_sms, WORLD, WAIT, SCOPE)


@triton.jit
def _tile_product(a_ptr, b_ptr, a_desc, b_desc, off_m, off_n, rows, cols, M, N_LOCAL, K, stride_am, stride_ak,
                  stride_bk, stride_bn, k_steps, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr, TMA_LOADS: tl.constexpr):
    """One output tile of A @ B_local in fp32 (TMA loads on Hopper, else masked pointer loads)."""
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)   # tl.full, a builtin: runs in an interpreted helper
    if TMA_LOADS:
        for kk in range(k_steps):
            a = a_desc.load([off_m, kk * BLOCK_K])
            b = b_desc.load([kk * BLOCK_K, off_n])
            acc = tl.dot(a, b, acc)
    else:
        acc = ptr_mainloop(a_ptr, b_ptr, rows, cols, M, N_LOCAL, K, stride_am, stride_ak, stride_bk, stride_bn,
                           acc, k_steps, BLOCK_K)
    return acc


BAND_FLAG = tl.constexpr(1 << 20)  # status flag ids from here on name a row band of our own GEMM (senders' waits)


@triton.jit(do_not_specialize=_RUNTIME_INTS + ["num_gemm"])
def _gemm_scatter_send_kernel(a_ptr, b_ptr, a_desc, b_desc, c_ptr, heap_bases, flags_ptr, status_ptr, total_ptr,
                              band_ptr, M, N_LOCAL, K, stride_am, stride_ak, stride_bk, stride_bn, stride_cm,
                              rank, timeout_us, num_gemm, group_m,
                              WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                              BLOCK_K: tl.constexpr, TMA_LOADS: tl.constexpr, HINTS: tl.constexpr,
                              WAIT: tl.constexpr, SCOPE: tl.constexpr, SENDERS: tl.constexpr):
    pid = tl.program_id(0)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N_LOCAL + BLOCK_N - 1) // BLOCK_N
    num_bands = (num_pid_m + group_m - 1) // group_m
    col0 = rank * N_LOCAL
    if pid < num_gemm:
        k_steps = (K + BLOCK_K - 1) // BLOCK_K
        for tile_id in range(pid, num_pid_m * num_pid_n, num_gemm):
            pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, group_m)
            rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = _tile_product(a_ptr, b_ptr, a_desc, b_desc, pid_m * BLOCK_M, pid_n * BLOCK_N, rows, cols, M,
                                N_LOCAL, K, stride_am, stride_ak, stride_bk, stride_bn, k_steps, BLOCK_M, BLOCK_N,
                                BLOCK_K, TMA_LOADS)
            mask = (rows[:, None] < M) & (cols[None, :] < N_LOCAL)
            dst = c_ptr + rows[:, None].to(tl.int64) * stride_cm + (col0 + cols)[None, :]
            tl.store(dst, acc.to(c_ptr.dtype.element_ty), mask=mask)   # our own C only
            tl.debug_barrier()   # every thread's part of the tile precedes the count
            tl.atomic_add(band_ptr + pid_m // group_m, 1, sem="release", scope="gpu")
    else:
        call = tl.load(total_ptr) + tl.num_programs(0)   # this call's tag (what the waiter's wait_all will expect)
        for band in range(pid - num_gemm, num_bands, SENDERS):
            first = band * group_m
            band_tiles = tl.minimum(num_pid_m - first, group_m) * num_pid_n
            if wait(band_ptr + band, band_tiles, timeout_us, status_ptr, BAND_FLAG + band, call, heap_bases, rank,
                    WORLD, "gpu"):
                for sub in range(0, band_tiles):
                    rows = (first + sub // num_pid_n) * BLOCK_M + tl.arange(0, BLOCK_M)
                    cols = (sub % num_pid_n) * BLOCK_N + tl.arange(0, BLOCK_N)
                    mask = (rows[:, None] < M) & (cols[None, :] < N_LOCAL)
                    dst = c_ptr + rows[:, None].to(tl.int64) * stride_cm + (col0 + cols)[None, :]
                    _scatter(tl.load(dst, mask=mask), dst, mask, rank, heap_bases, 1, WORLD, HINTS, BLOCK_N)
                tl.atomic_xchg(band_ptr + band, 0, sem="relaxed", scope="gpu")   # counted from 0 again next call
    _finish(flags_ptr, total_ptr, status_ptr, heap_bases, rank, timeout_us, pid == 0, tl.num_programs(0), WORLD,
            WAIT, SCOPE)


@triton.jit
def _scatter(tile, dst, mask, rank, heap_bases, FIRST: tl.constexpr, WORLD: tl.constexpr, HINTS: tl.constexpr,
             BLOCK_N: tl.constexpr):
    """The tile (at ``dst`` in this rank's heap) into ranks rank + FIRST, rank + FIRST + 1,
    ... of the world: straight from the accumulator (or a read-back), starting with the
    next rank so that ranks do not all write rank 0 first."""
    for i in tl.static_range(FIRST, WORLD):
        peer = (rank + i) % WORLD
        tl.store(_peer_tile_ptrs(dst, rank, peer, heap_bases, HINTS, BLOCK_N), tile, mask=mask)


@triton.jit
def _finish(flags_ptr, total_ptr, status_ptr, heap_bases, rank, timeout_us, waiter, programs,
            WORLD: tl.constexpr, WAIT: tl.constexpr, SCOPE: tl.constexpr):
    """Completion: this program's stores, a CTA barrier, then a release add of 1 to slot
    `rank` of every rank's flag array (kernels.comm.remote.signal). With WAIT one program
    per rank (``waiter``) waits, bounded, acquire, until every rank's ``programs``
    programs have signalled: C is complete here when the kernel ends. The running total
    lives on the device, so CUDA-graph replays stay right."""
    for i in tl.static_range(WORLD):
        signal(flags_ptr + rank, 1, rank, (rank + i) % WORLD, heap_bases, "add", SCOPE)
    if WAIT:
        if waiter:
            wait_all(flags_ptr, total_ptr, programs, timeout_us, status_ptr, heap_bases, rank, WORLD, SCOPE)


@triton.jit(do_not_specialize=_RUNTIME_INTS[:3] + ["split_k", "steps_per_split"])
def _gemm_scatter_split_kernel(a_ptr, b_ptr, a_desc, b_desc, c_ptr, ws_ptr, cnt_ptr, heap_bases, flags_ptr,
                               status_ptr, total_ptr, M, N_LOCAL, K, stride_am, stride_ak, stride_bk, stride_bn,
                               stride_cm, rank, timeout_us, split_k, steps_per_split,
                               WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr, TMA_LOADS: tl.constexpr, SWAP_AB: tl.constexpr,
                               HINTS: tl.constexpr, WAIT: tl.constexpr, SCOPE: tl.constexpr,
                               GROUP_M: tl.constexpr = 8):
    """Small M: piece ``program_id(1)`` of tile ``program_id(0)`` (``kernels.gemm``'s
    split-K piece, SWAP_AB computing it as C^T = B^T A^T with a narrow MMA side); the
    piece that completes the tile in the fp32 workspace scatters it from registers."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    acc, rows, cols = _split_piece(a_desc, b_desc, a_ptr, b_ptr, M, N_LOCAL, K, stride_am, stride_ak, stride_bk,
                                   stride_bn, pid, pid_k, steps_per_split, BLOCK_M, BLOCK_N, BLOCK_K, TMA_LOADS,
                                   SWAP_AB, False, GROUP_M)
    acc, last = _meet_split(acc, pid, pid_k, split_k, ws_ptr, cnt_ptr, BLOCK_M, BLOCK_N)
    if last:
        mask = (rows[:, None] < M) & (cols[None, :] < N_LOCAL)
        dst = c_ptr + rows[:, None].to(tl.int64) * stride_cm + (rank * N_LOCAL + cols)[None, :]
        _scatter(acc.to(c_ptr.dtype.element_ty), dst, mask, rank, heap_bases, 0, WORLD, HINTS, BLOCK_N)
    _finish(flags_ptr, total_ptr, status_ptr, heap_bases, rank, timeout_us, (pid == 0) & (pid_k == 0),
            tl.num_programs(0) * tl.num_programs(1), WORLD, WAIT, SCOPE)
