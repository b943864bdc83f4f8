"""Triton kernel of the all-gather (see ``kernels.comm`` for the design)."""
from __future__ import annotations

import triton
import triton.language as tl

from kernels.comm.remote import peer_delta, signal
from kernels.comm.waits import wait_all

# Integers that vary between calls of one configuration stay unspecialized (no recompiles).
_RUNTIME_INTS = ["rank", "timeout_us"]


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _all_gather_kernel(x_ptr, out_ptr, heap_bases, flags_ptr, status_ptr, total_ptr, M, N, rank, timeout_us,
                       WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VEC: tl.constexpr,
                       ESIZE: tl.constexpr, HINTS: tl.constexpr, EVEN_N: tl.constexpr, WAIT: tl.constexpr,
                       SCOPE: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    num_tiles = ((M + BLOCK_M - 1) // BLOCK_M) * tiles_n
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    for tile in range(pid, num_tiles, grid):
        rows = (tile // tiles_n) * BLOCK_M + rm
        cols = (tile % tiles_n) * BLOCK_N + rn
        mask = rows[:, None] < M
        if not EVEN_N:
            mask = mask & (cols[None, :] < N)
        r64 = rows.to(tl.int64)
        tile_vals = tl.load(x_ptr + r64[:, None] * N + cols[None, :], mask=mask)
        dst = out_ptr + (rank * M + r64)[:, None] * N + cols[None, :]
        for i in tl.static_range(WORLD):
            peer = (rank + i) % WORLD
            # dst on `peer`: with HINTS the distance is known 16-byte aligned, so the
            # stores keep the load's 128-bit width; without, they fall to scalars.
            delta = peer_delta(rank, peer, heap_bases, ESIZE, VEC if HINTS else 0)
            tl.store(dst + delta, tile_vals, mask=mask)
    for i in tl.static_range(WORLD):
        signal(flags_ptr + rank, 1, rank, (rank + i) % WORLD, heap_bases, "add", SCOPE)
    if WAIT:
        if pid == 0:
            wait_all(flags_ptr, total_ptr, grid, timeout_us, status_ptr, heap_bases, rank, WORLD, SCOPE)


