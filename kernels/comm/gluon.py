"""Gluon kernel of the all-gather: a flat 1-D tile walk with an explicit
``BlockedLayout`` of 16 bytes per thread, the local heap base hoisted, and
destinations staggered ``(rank + i) % world`` (see ``kernels.comm``)."""
from __future__ import annotations

from kernels.comm.clock import device_ns
from kernels.comm.triton import _RUNTIME_INTS

try:  # Gluon ships with Triton >= 3.4
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    GLUON_AVAILABLE = True
except ImportError:  # pragma: no cover
    GLUON_AVAILABLE = False

if GLUON_AVAILABLE:

    @gluon.jit(do_not_specialize=_RUNTIME_INTS)
    def _all_gather_gluon_kernel(x_ptr, out_ptr, heap_bases, flags_ptr, status_ptr, total_ptr, M, N, rank,
                                 timeout_us, WORLD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                 VEC: gl.constexpr, ESIZE: gl.constexpr, HINTS: gl.constexpr, EVEN_N: gl.constexpr,
                                 NUM_WARPS: gl.constexpr, WAIT: gl.constexpr, SCOPE: gl.constexpr):
        # VEC contiguous elements per thread: 16 bytes -> one 128-bit load/store each.
        layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NUM_WARPS], [0])
        pid = gl.program_id(0)
        grid = gl.num_programs(0)
        local_base = gl.load(heap_bases + rank)  # hoisted: one load for the whole kernel
        tiles_n = (N + BLOCK_N - 1) // BLOCK_N
        num_tiles = ((M + BLOCK_M - 1) // BLOCK_M) * tiles_n
        flat = gl.arange(0, BLOCK_M * BLOCK_N, layout=layout)
        fr = flat // BLOCK_N
        fc = flat % BLOCK_N
        for tile in range(pid, num_tiles, grid):
            rows = ((tile // tiles_n) * BLOCK_M + fr).to(gl.int64)
            cols = (tile % tiles_n) * BLOCK_N + fc
            mask = rows < M
            if not EVEN_N:
                mask = mask & (cols < N)
            vals = gl.load(x_ptr + rows * N + cols, mask=mask)
            dst = out_ptr + (rank * M + rows) * N + cols
            offset = dst.to(gl.int64, bitcast=True) - local_base
            for i in gl.static_range(WORLD):
                peer = (rank + i) % WORLD  # staggered: rank r writes r, r+1, ... first
                ptr = (gl.load(heap_bases + peer) + offset).to(out_ptr.dtype, bitcast=True)
                if HINTS:  # the integer round trip forgot alignment (bytes) and contiguity (elements)
                    ptr = gl.max_contiguous(gl.multiple_of(ptr, VEC * ESIZE), VEC)
                gl.store(ptr, vals, mask=mask)
        # completion: every thread's stores, a CTA barrier, then one release per rank
        gl.thread_barrier()
        for i in gl.static_range(WORLD):
            peer = (rank + i) % WORLD
            flag = (gl.load(heap_bases + peer) + ((flags_ptr + rank).to(gl.int64, bitcast=True) - local_base)
                    ).to(flags_ptr.dtype, bitcast=True)
            gl.atomic_add(flag, 1, sem="release", scope=SCOPE)
        if WAIT:
            if pid == 0:
                expected = gl.load(total_ptr) + grid  # running total, kept on the device
                limit = timeout_us.to(gl.int64) * 1000  # bounded in time (kernels.comm.clock)
                for src in gl.static_range(WORLD):
                    t0 = device_ns()
                    waited = t0 - t0
                    seen = gl.atomic_add(flags_ptr + src, 0, sem="acquire", scope=SCOPE)
                    while (seen < expected) & (waited < limit):
                        seen = gl.atomic_add(flags_ptr + src, 0, sem="acquire", scope=SCOPE)
                        waited = device_ns() - t0
                    if seen < expected:
                        if gl.atomic_add(status_ptr, 1) == 0:   # the first to give up says what it waited for
                            gl.atomic_xchg(status_ptr + 1, src)
                            gl.atomic_xchg(status_ptr + 2, seen)
                            gl.atomic_xchg(status_ptr + 3, expected)
                            gl.atomic_xchg(status_ptr + 4, gl.minimum(waited // 1000, 2 ** 31 - 1).to(gl.int32))
                gl.store(total_ptr, expected)
                gl.thread_barrier()


