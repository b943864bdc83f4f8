"""Gluon kernel of the all-gather: a flat 1-D tile walk with an explicit
``BlockedLayout`` of 16 bytes per thread, the local heap base hoisted, and
destinations staggered ``(rank + i) % world`` (see ``kernels.comm``)."""
from __future__ import annotations

from kernels.comm.clock import device_ns
from kernels.comm.triton import _RUNTIME_INTS
from kernels.comm.waits import _POLLS, _ST_ABANDON, _ST_CALL, _ST_COUNT, _ST_EXPECTED, _ST_FLAG, _ST_SEEN, _ST_WAITED_US

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
                _wait_all(flags_ptr, total_ptr, grid, timeout_us, status_ptr, heap_bases, local_base, rank, WORLD,
                          SCOPE, NUM_WARPS)

    # kernels.comm.waits' wait_all, written again in Gluon (a Gluon kernel cannot call
    # @triton.jit functions): the same rules, the same status words.
    @gluon.jit
    def _larger(a, b):
        return gl.maximum(a, b)

    @gluon.jit
    def _uniform_ns(NUM_WARPS: gl.constexpr):
        """The largest of the program's threads' clocks: one value all agree on (waits.uniform_ns).
        (gl.reduce with a combine of our own: gl.max's is a @triton.jit function, which the
        interpreter, when on, replaces by one the Gluon compiler cannot lower.)"""
        lanes: gl.constexpr = gl.BlockedLayout([1], [32], [NUM_WARPS], [0])
        return gl.reduce(gl.full([32 * NUM_WARPS], 0, gl.int64, lanes) + device_ns(), 0, _larger)

    @gluon.jit
    def _give_up(status_ptr, call, flag_id, seen, expected, waited_ns, heap_bases, local_base, rank,
                 WORLD: gl.constexpr):
        gl.atomic_add(status_ptr + _ST_COUNT, 1)
        if gl.atomic_xchg(status_ptr + _ST_CALL, call) != call:   # the first of its call says what it waited for
            gl.atomic_xchg(status_ptr + _ST_FLAG, flag_id)
            gl.atomic_xchg(status_ptr + _ST_SEEN, seen)
            gl.atomic_xchg(status_ptr + _ST_EXPECTED, expected)
            gl.atomic_xchg(status_ptr + _ST_WAITED_US, gl.minimum(waited_ns // 1000, 2 ** 31 - 1).to(gl.int32))
            for i in gl.static_range(1, WORLD):   # and tells every peer (waits.record_give_up)
                peer = (rank + i) % WORLD
                mine = (gl.load(heap_bases + peer) + ((status_ptr + _ST_ABANDON + rank).to(gl.int64, bitcast=True)
                                                     - local_base)).to(status_ptr.dtype, bitcast=True)
                gl.atomic_max(mine, call, sem="release", scope="sys")

    @gluon.jit
    def _wait_all(flags_ptr, total_ptr, count, timeout_us, status_ptr, heap_bases, local_base, rank,
                  WORLD: gl.constexpr, SCOPE: gl.constexpr, NUM_WARPS: gl.constexpr):
        call = gl.load(total_ptr) + count  # running total, kept on the device: also the call's tag
        limit = timeout_us.to(gl.int64) * 1000  # bounded in time (kernels.comm.clock)
        for src in gl.static_range(WORLD):
            seen = gl.atomic_add(flags_ptr + src, 0, sem="acquire", scope=SCOPE)
            for _ in gl.static_range(_POLLS):   # a flag about to arrive needs no clock
                if seen < call:
                    seen = gl.atomic_add(flags_ptr + src, 0, sem="acquire", scope=SCOPE)
            if seen < call:
                t0 = _uniform_ns(NUM_WARPS)
                waited = t0 - t0
                ended = gl.atomic_add(status_ptr + _ST_CALL, 0, sem="relaxed", scope="gpu") == call
                while (seen < call) & (waited < limit) & (ended == 0):
                    for _ in gl.static_range(_POLLS):
                        if seen < call:
                            seen = gl.atomic_add(flags_ptr + src, 0, sem="acquire", scope=SCOPE)
                    ended = gl.atomic_add(status_ptr + _ST_CALL, 0, sem="relaxed", scope="gpu") == call
                    waited = _uniform_ns(NUM_WARPS) - t0
                if seen < call:
                    _give_up(status_ptr, call, src, seen, call, waited, heap_bases, local_base, rank, WORLD)
        gl.store(total_ptr, call)
        gl.thread_barrier()
        return call
