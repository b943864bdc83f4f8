"""Triton kernels of the persistent GEMM (see ``kernels.gemm`` for the design).

``_gemm_tma_kernel`` (Hopper: TMA descriptors, wgmma, optional stream-K tail)
and ``_gemm_ptr_kernel`` (masked pointer loads: interpreter, older GPUs,
unaligned or strided operands) share one tile schedule (``_tile_coords``).

TMA descriptors come from either side. Host descriptors (``_gemm_tma_kernel``,
``_gemm_splitk_kernel``): the launcher encodes a ``CUtensorMap`` per descriptor
argument on every call (Triton 3.6: about 2 us of host time each). Device
descriptors (``_gemm_tma_dev_kernel``, ``_gemm_splitk_kernel`` with
``DEVICE_DESC``): each program encodes them with ``tl.make_tensor_descriptor``
into a global scratch buffer (``kernels.common.launcher`` supplies it), so the
launch passes pointers and integers only. Both run the same main loop.

``_gemm_fma_kernel``: fp32 at small M on the FMA units (no tensor cores), split
along K like ``_gemm_splitk_kernel`` and meeting in the same workspace
(``_store_split``).
"""
import triton
import triton.language as tl

from kernels.common import interpreter

if interpreter.active():
    interpreter.patch()


# --------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------
@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, group_m):
    """Tile index -> (row block, column block), walking bands of group_m rows: an
    L2 swizzle (programs that run together share A rows and B columns)."""
    band_id = tile_id // (group_m * num_pid_n)
    first_m = band_id * group_m
    rows_in_band = tl.minimum(num_pid_m - first_m, group_m)
    inside = tile_id - band_id * (group_m * num_pid_n)
    return first_m + inside % rows_in_band, inside // rows_in_band


@triton.jit
def _load_b(b_desc, k, off_n, B_KMAJOR: tl.constexpr):
    """B's (BLOCK_K, BLOCK_N) tile at (k, off_n). B_KMAJOR: the descriptor is over
    B^T (N, K) with K contiguous (a transposed view, e.g. an nn.Linear weight),
    so the tile is read as (BLOCK_N, BLOCK_K) and transposed in shared memory,
    which wgmma takes as it is (tf32 needs it: it reads B only K-major)."""
    if B_KMAJOR:
        return tl.trans(b_desc.load([off_n, k]))
    else:
        return b_desc.load([k, off_n])


@triton.jit
def _store_tile(acc, off_m, off_n, c_desc, c_ptr, stride_cm, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                TMA_STORE: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr):
    """C[off_m:, off_n:] = acc: through C's descriptor (whole, or in two column
    halves to halve the staging buffer), or with plain masked stores (the form
    Triton 3.6's Hopper warp specialisation accepts)."""
    if TMA_STORE:
        if EPILOGUE_SPLIT == 2:
            pair = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(pair)
            c_desc.store([off_m, off_n], left.to(c_desc.dtype))
            c_desc.store([off_m, off_n + BLOCK_N // 2], right.to(c_desc.dtype))
        else:
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
    else:
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _sk_program_of(step, sk_iters_per, sk_extra):
    """The stream-K program whose range holds global tail K-step `step` (the first
    sk_extra programs take sk_iters_per + 1 steps, the rest sk_iters_per)."""
    big = sk_extra * (sk_iters_per + 1)
    return tl.where(step < big, step // (sk_iters_per + 1), sk_extra + (step - big) // sk_iters_per)


@triton.jit(do_not_specialize=["num_sms", "group_m", "dp_tiles", "sk_programs", "sk_iters_per", "sk_extra"])
def _gemm_tma_kernel(a_desc, b_desc, c_desc, c_ptr, stride_cm, M, N, K, num_sms, group_m,
                     dp_tiles, sk_programs, sk_iters_per, sk_extra, ws_ptr, cnt_ptr, b2_desc,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     TMA_STORE: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr, FLATTEN: tl.constexpr,
                     WARP_SPECIALIZE: tl.constexpr, STREAM_K: tl.constexpr, B_KMAJOR: tl.constexpr = False,
                     TAIL_SPLIT: tl.constexpr = 1, TAIL_STAGES: tl.constexpr = 3, EXTRA_N: tl.constexpr = 0):
    """Host descriptors: A, B (and C with TMA_STORE) arrive as TMA descriptors
    encoded by the launcher on every call; with TAIL_SPLIT > 1 or EXTRA_N > 0 also
    ``b2_desc``, a second descriptor of B with a narrower box (the tail slices' or
    the extra columns'; else None)."""
    _tma_gemm(a_desc, b_desc, c_desc, c_ptr, stride_cm, M, N, K, num_sms, group_m, dp_tiles, sk_programs,
              sk_iters_per, sk_extra, ws_ptr, cnt_ptr, BLOCK_M, BLOCK_N, BLOCK_K, TMA_STORE, EPILOGUE_SPLIT,
              FLATTEN, WARP_SPECIALIZE, STREAM_K, B_KMAJOR, b2_desc, TAIL_SPLIT, TAIL_STAGES, EXTRA_N)


@triton.jit(do_not_specialize=["num_sms", "group_m", "dp_tiles", "sk_programs", "sk_iters_per", "sk_extra"])
def _gemm_tma_dev_kernel(a_ptr, b_ptr, c_ptr, stride_am, stride_bk, stride_cm, M, N, K, num_sms, group_m,
                         dp_tiles, sk_programs, sk_iters_per, sk_extra, ws_ptr, cnt_ptr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         TMA_STORE: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr, FLATTEN: tl.constexpr,
                         WARP_SPECIALIZE: tl.constexpr, STREAM_K: tl.constexpr, B_KMAJOR: tl.constexpr = False,
                         TAIL_SPLIT: tl.constexpr = 1, TAIL_STAGES: tl.constexpr = 3, EXTRA_N: tl.constexpr = 0):
    """Device descriptors: the same kernel, but each program encodes the TMA
    descriptors of A, B (and C) itself from plain pointers and strides, into its
    slot of the global scratch buffer the launcher passes (128 bytes each), so
    the host launches with pointers and integers only. Needs 16-byte aligned
    bases, unit inner strides and 16-byte aligned row strides (the plan checks).
    B_KMAJOR: b_ptr holds B^T (N, K) with row stride ``stride_bk``."""
    a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
    if B_KMAJOR:
        b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_bk, 1], [BLOCK_N, BLOCK_K])
    else:
        b_desc = tl.make_tensor_descriptor(b_ptr, [K, N], [stride_bk, 1], [BLOCK_K, BLOCK_N])
    if TMA_STORE:
        c_desc = tl.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BLOCK_M, BLOCK_N // EPILOGUE_SPLIT])
    else:
        c_desc = None
    b2_desc = None
    if TAIL_SPLIT > 1 or EXTRA_N > 0:
        B2_N: tl.constexpr = EXTRA_N if EXTRA_N > 0 else BLOCK_N // TAIL_SPLIT
        if B_KMAJOR:
            b2_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_bk, 1], [B2_N, BLOCK_K])
        else:
            b2_desc = tl.make_tensor_descriptor(b_ptr, [K, N], [stride_bk, 1], [BLOCK_K, B2_N])
    _tma_gemm(a_desc, b_desc, c_desc, c_ptr, stride_cm, M, N, K, num_sms, group_m, dp_tiles, sk_programs,
              sk_iters_per, sk_extra, ws_ptr, cnt_ptr, BLOCK_M, BLOCK_N, BLOCK_K, TMA_STORE, EPILOGUE_SPLIT,
              FLATTEN, WARP_SPECIALIZE, STREAM_K, B_KMAJOR, b2_desc, TAIL_SPLIT, TAIL_STAGES, EXTRA_N)


@triton.jit
def _tma_gemm(a_desc, b_desc, c_desc, c_ptr, stride_cm, M, N, K, num_sms, group_m,
              dp_tiles, sk_programs, sk_iters_per, sk_extra, ws_ptr, cnt_ptr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              TMA_STORE: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr, FLATTEN: tl.constexpr,
              WARP_SPECIALIZE: tl.constexpr, STREAM_K: tl.constexpr, B_KMAJOR: tl.constexpr,
              b2_desc, TAIL_SPLIT: tl.constexpr, TAIL_STAGES: tl.constexpr, EXTRA_N: tl.constexpr = 0):
    """The persistent TMA GEMM, whichever side made its descriptors.

    EXTRA_N > 0: tiles BLOCK_N + EXTRA_N wide, the extra columns a second MMA per K-step
    on the same A tile (B's through ``b2_desc``), stored with plain stores (C's box is
    BLOCK_N wide): tile widths between powers of two, for problems of 1-3 rounds."""
    TILE_N: tl.constexpr = BLOCK_N + EXTRA_N
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + TILE_N - 1) // TILE_N
    k_steps = (K + BLOCK_K - 1) // BLOCK_K
    pid = tl.program_id(0)
    # Data-parallel part: whole tiles 0 .. dp_tiles-1 (every tile without stream-K).
    for tile_id in tl.range(pid, dp_tiles, num_sms, flatten=FLATTEN,
                            warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, group_m)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * TILE_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if EXTRA_N > 0:
            acc2 = tl.zeros((BLOCK_M, EXTRA_N), dtype=tl.float32)
        for kk in range(k_steps):
            a = a_desc.load([off_m, kk * BLOCK_K])
            b = _load_b(b_desc, kk * BLOCK_K, off_n, B_KMAJOR)
            acc = tl.dot(a, b, acc)
            if EXTRA_N > 0:
                b2 = _load_b(b2_desc, kk * BLOCK_K, off_n + BLOCK_N, B_KMAJOR)
                acc2 = tl.dot(a, b2, acc2)
        _store_tile(acc, off_m, off_n, c_desc, c_ptr, stride_cm, M, N, BLOCK_M, BLOCK_N, TMA_STORE,
                    EPILOGUE_SPLIT)
        if EXTRA_N > 0:
            _store_tile(acc2, off_m, off_n + BLOCK_N, c_desc, c_ptr, stride_cm, M, N, BLOCK_M, EXTRA_N, False, 1)
    if TAIL_SPLIT > 1:
        # The last, partial round's tiles (dp_tiles ..) in TAIL_SPLIT column slices each, one
        # slice per program, so the round takes 1/TAIL_SPLIT of a tile's time on more SMs. A
        # slice is a whole block of C: nothing to add up. Plain stores (C's box is a whole tile).
        # A slice's K-steps move fewer bytes, so the same shared memory holds TAIL_STAGES of
        # them in flight (its loop is latency-bound at the whole tile's depth).
        SLICE_N: tl.constexpr = BLOCK_N // TAIL_SPLIT
        tiles = num_pid_m * num_pid_n
        for unit in range(pid, (tiles - dp_tiles) * TAIL_SPLIT, num_sms):
            t = dp_tiles + unit // TAIL_SPLIT
            pid_m, pid_n = _tile_coords(t, num_pid_m, num_pid_n, group_m)
            off_m = pid_m * BLOCK_M
            off_n = pid_n * BLOCK_N + (unit % TAIL_SPLIT) * SLICE_N
            acc = tl.zeros((BLOCK_M, SLICE_N), dtype=tl.float32)
            for kk in tl.range(k_steps, num_stages=TAIL_STAGES):
                a = a_desc.load([off_m, kk * BLOCK_K])
                b = _load_b(b2_desc, kk * BLOCK_K, off_n, B_KMAJOR)
                acc = tl.dot(a, b, acc)
            _store_tile(acc, off_m, off_n, c_desc, c_ptr, stride_cm, M, N, BLOCK_M, SLICE_N, False, 1)
    if STREAM_K:
        # Stream-K tail: the last (tiles - dp_tiles) tiles' K-steps, split evenly
        # over programs 0 .. sk_programs-1 (contiguous ranges, the first sk_extra
        # programs one step more), so the last wave leaves no SM idle. A tile
        # split between programs is summed by whichever arrives last: each writes
        # its fp32 partial to its own workspace slot (0: the first tile of its
        # range, 1: the last), then counts itself in the tile's counter; the one
        # that completes the count sums the tile's slots, stores C and resets the
        # counter for the next call. Nobody waits, so it also runs in the interpreter.
        # Split tiles leave through plain stores (C's descriptor box is a whole tile).
        if pid < sk_programs:
            start = pid * sk_iters_per + tl.minimum(pid, sk_extra)
            end = start + sk_iters_per + (pid < sk_extra).to(tl.int32)
            rows_t = tl.arange(0, BLOCK_M)
            cols_t = tl.arange(0, BLOCK_N)
            tile_offs = rows_t[:, None] * BLOCK_N + cols_t[None, :]
            half_cols = tl.arange(0, BLOCK_N // 2)
            it = start
            while it < end:
                t = it // k_steps
                k_lo = it - t * k_steps
                k_hi = tl.minimum(k_steps, k_lo + end - it)
                pid_m, pid_n = _tile_coords(dp_tiles + t, num_pid_m, num_pid_n, group_m)
                off_m = pid_m * BLOCK_M
                off_n = pid_n * BLOCK_N
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for kk in range(k_lo, k_hi):
                    a = a_desc.load([off_m, kk * BLOCK_K])
                    b = _load_b(b_desc, kk * BLOCK_K, off_n, B_KMAJOR)
                    acc = tl.dot(a, b, acc)
                # Programs holding the tile's first and last K-step.
                s_first = t * k_steps
                s_last = s_first + k_steps - 1
                q_first = _sk_program_of(s_first, sk_iters_per, sk_extra)
                q_last = _sk_program_of(s_last, sk_iters_per, sk_extra)
                if q_first == q_last:  # the whole tile is ours
                    _store_tile(acc, off_m, off_n, c_desc, c_ptr, stride_cm, M, N, BLOCK_M, BLOCK_N, TMA_STORE,
                                EPILOGUE_SPLIT)
                else:
                    slot = (t != start // k_steps).to(tl.int32)
                    tl.store(ws_ptr + (pid * 2 + slot).to(tl.int64) * (BLOCK_M * BLOCK_N) + tile_offs, acc)
                    tl.debug_barrier()  # every thread's partial is written before the count
                    arrived = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
                    if arrived == q_last - q_first:
                        # Sum the slots half a tile at a time (the accumulator is dead by
                        # now): a whole second tile in registers would spill.
                        for h in tl.static_range(2):
                            half_offs = rows_t[:, None] * BLOCK_N + (h * (BLOCK_N // 2) + half_cols)[None, :]
                            part = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.float32)
                            for q in range(q_first, q_last + 1):
                                q_start = q * sk_iters_per + tl.minimum(q, sk_extra)
                                q_slot = (t != q_start // k_steps).to(tl.int32)
                                part += tl.load(ws_ptr + (q * 2 + q_slot).to(tl.int64) * (BLOCK_M * BLOCK_N)
                                                + half_offs, cache_modifier=".cg")
                            rows = off_m + rows_t
                            cols = off_n + h * (BLOCK_N // 2) + half_cols
                            tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :],
                                     part.to(c_ptr.dtype.element_ty),
                                     mask=(rows[:, None] < M) & (cols[None, :] < N))
                        tl.store(cnt_ptr + t, 0)
                it += k_hi - k_lo


@triton.jit
def ptr_mainloop(a_ptr, b_ptr, rows, cols, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, acc, k_steps,
                 BLOCK_K: tl.constexpr):
    """``acc`` plus A[rows, :] @ B[:, cols] over ``k_steps`` steps of BLOCK_K, with masked
    pointer loads. Rows/columns past the edge read row/column 0 (always valid) and are
    never stored by the callers, so the loads need a mask on K only."""
    lane_k = tl.arange(0, BLOCK_K)
    rows_in = tl.where(rows < M, rows, 0)
    cols_in = tl.where(cols < N, cols, 0)
    a_ptrs = a_ptr + rows_in[:, None] * stride_am + lane_k[None, :] * stride_ak
    b_ptrs = b_ptr + lane_k[:, None] * stride_bk + cols_in[None, :] * stride_bn
    for kk in range(k_steps):
        k_left = K - kk * BLOCK_K
        a = tl.load(a_ptrs, mask=lane_k[None, :] < k_left, other=0.0)
        b = tl.load(b_ptrs, mask=lane_k[:, None] < k_left, other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit(do_not_specialize=["num_sms", "group_m"])
def _gemm_ptr_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                     stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                     num_sms, group_m,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     FLATTEN: tl.constexpr):
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    num_tiles = num_pid_m * num_pid_n
    k_steps = (K + BLOCK_K - 1) // BLOCK_K
    for tile_id in tl.range(tl.program_id(0), num_tiles, num_sms, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, group_m)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc = ptr_mainloop(a_ptr, b_ptr, rows, cols, M, N, K, stride_am, stride_ak, stride_bk, stride_bn, acc,
                           k_steps, BLOCK_K)
        c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


# --------------------------------------------------------------------------
@triton.jit
def _meet_split(acc, pid, pid_k, split_k, ws_ptr, cnt_ptr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                ATOMIC: tl.constexpr = False, THREADS: tl.constexpr = 128):
    """(tile ``pid``'s sum of its ``split_k`` pieces, True) in the piece that completes the
    tile, (``acc``, False) in the others; ``acc`` is piece ``pid_k``'s partial. Split tiles
    meet in an fp32 workspace: every piece stores its partial in its own slot and counts
    itself in the tile's counter; the piece that completes the count adds the others' slots
    to its own and resets the counter (nobody waits, so it also runs in the interpreter).

    ATOMIC: every piece adds its partial into the tile's one sum (fp32 atomics, in whatever
    order the pieces arrive), and the piece that completes the count reads the sum and sets
    it back to zero (the workspace is ``plan.workspace(..., zeroed=True)``). The serial form
    has that piece read split_k - 1 slots one after another, which at 16-32 pieces of a long
    K is most of the kernel's time; here the adds are spread over the pieces as they end.
    Each of the program's THREADS threads counts itself (a tensor of THREADS ones, one per
    thread), with release semantics, so that its own adds are performed before its count
    whatever a barrier orders; the count to reach is then split_k * THREADS, and the program
    holding its last increment is the tile's last piece."""
    last = split_k == 1
    if split_k > 1:
        tile_offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        if ATOMIC:
            tile_ws = ws_ptr + pid.to(tl.int64) * (BLOCK_M * BLOCK_N)
            tl.atomic_add(tile_ws + tile_offs, acc, sem="relaxed", scope="gpu")
            counts = tl.atomic_add(cnt_ptr + pid + tl.zeros([THREADS], tl.int32), tl.full([THREADS], 1, tl.int32),
                                   sem="acq_rel", scope="gpu")
            last = tl.max(counts, axis=0) == split_k * THREADS - 1
        else:
            tile_ws = ws_ptr + (pid * split_k).to(tl.int64) * (BLOCK_M * BLOCK_N)
            tl.store(tile_ws + pid_k * (BLOCK_M * BLOCK_N) + tile_offs, acc)
            tl.debug_barrier()  # every thread's partial is written before the count
            arrived = tl.atomic_add(cnt_ptr + pid, 1, sem="acq_rel", scope="gpu")
            last = arrived == split_k - 1
        if last:
            if ATOMIC:
                acc = tl.load(tile_ws + tile_offs, cache_modifier=".cg")
                # The zeros go out in the atomics' layout, not the load's (Triton picks both): a
                # thread would zero an element another thread has yet to read. Every read first.
                tl.debug_barrier()
                tl.store(tile_ws + tile_offs, tl.zeros_like(acc))
            else:
                for q in range(split_k):
                    if q != pid_k:
                        acc += tl.load(tile_ws + q * (BLOCK_M * BLOCK_N) + tile_offs, cache_modifier=".cg")
            tl.store(cnt_ptr + pid, 0)
    return acc, last


@triton.jit
def _store_split(acc, pid, pid_k, split_k, rows, cols, c_ptr, stride_cm, stride_cn, M, N, ws_ptr, cnt_ptr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ATOMIC: tl.constexpr = False,
                 THREADS: tl.constexpr = 128):
    """C[rows, cols] = the sum of tile ``pid``'s ``split_k`` pieces (``_meet_split``),
    stored by the piece that completes it."""
    acc, last = _meet_split(acc, pid, pid_k, split_k, ws_ptr, cnt_ptr, BLOCK_M, BLOCK_N, ATOMIC, THREADS)
    if last:
        c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit(do_not_specialize=["M", "N", "K", "split_k", "steps_per_split"])
def _gemm_splitk_kernel(a_desc, b_desc, a_ptr, b_ptr, c_ptr, ws_ptr, cnt_ptr, M, N, K,
                        stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                        split_k, steps_per_split,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, DEVICE_DESC: tl.constexpr = False,
                        B_KMAJOR: tl.constexpr = False, GROUP_M: tl.constexpr = 8,
                        ATOMIC_SPLIT: tl.constexpr = False, THREADS: tl.constexpr = 128):
    """One output tile per program column, its K range cut into ``split_k`` pieces
    (grid: tiles x split_k). For few tiles (small M, or a short wide problem): the
    split puts every SM to work on B, which small-M products only read once.

    SWAP_AB computes the tile transposed, C^T = B^T A^T: the wide side (BLOCK_N)
    becomes the MMA's M, which must be 64 per warpgroup, and the short side
    (BLOCK_M, as small as 16) its N, so a 16-row A costs a 16-wide MMA instead of
    a 64-row one padded with zeros.

    Split tiles meet in an fp32 workspace (``_store_split``; ATOMIC_SPLIT: added into one
    sum per tile with atomics, see ``_meet_split``; THREADS: num_warps * 32).

    DEVICE_DESC (with USE_TMA): a_desc and b_desc come as None and every program
    encodes them itself from a_ptr, b_ptr and the row strides (unit inner
    strides), in its slot of the launcher's global scratch buffer.

    B_KMAJOR (with USE_TMA): B's descriptor is over B^T (N, K), row stride
    ``stride_bn`` (see ``_load_b``); the pointer path needs nothing, its
    strides say it."""
    if USE_TMA and DEVICE_DESC:
        a_desc = tl.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K])
        if B_KMAJOR:
            b_desc = tl.make_tensor_descriptor(b_ptr, [N, K], [stride_bn, 1], [BLOCK_N, BLOCK_K])
        else:
            b_desc = tl.make_tensor_descriptor(b_ptr, [K, N], [stride_bk, 1], [BLOCK_K, BLOCK_N])
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    acc, rows, cols = _split_piece(a_desc, b_desc, a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                                   pid, pid_k, steps_per_split, BLOCK_M, BLOCK_N, BLOCK_K, USE_TMA, SWAP_AB, B_KMAJOR,
                                   GROUP_M)
    _store_split(acc, pid, pid_k, split_k, rows, cols, c_ptr, stride_cm, stride_cn, M, N, ws_ptr, cnt_ptr,
                 BLOCK_M, BLOCK_N, ATOMIC_SPLIT, THREADS)


@triton.jit
def _split_piece(a_desc, b_desc, a_ptr, b_ptr, M, N, K, stride_am, stride_ak, stride_bk, stride_bn,
                 pid, pid_k, steps_per_split, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 USE_TMA: tl.constexpr, SWAP_AB: tl.constexpr, B_KMAJOR: tl.constexpr, GROUP_M: tl.constexpr):
    """(piece ``pid_k`` of output tile ``pid``'s product, its rows, its columns): K steps
    ``pid_k * steps_per_split`` onwards, tiles numbered in GROUP_M-row bands (``_tile_coords``).

    The bands matter once the programs fill the GPU: numbered row-major, the tiles that
    share a block of B were a row of tiles apart and read it from HBM each (an H200,
    256x14336x4096 in 112 tiles of 128x256: 73.7 us row-major against 50.7 for the
    persistent kernel's bands, results/gemm_zoo/gaps/mid_m.csv)."""
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = _tile_coords(pid, num_pid_m, num_pid_n, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    k_steps = (K + BLOCK_K - 1) // BLOCK_K
    k_lo = pid_k * steps_per_split
    k_hi = tl.minimum(k_steps, k_lo + steps_per_split)
    rows = off_m + tl.arange(0, BLOCK_M)
    cols = off_n + tl.arange(0, BLOCK_N)
    lane_k = tl.arange(0, BLOCK_K)
    # Pointer path: rows/columns past the edge read row/column 0 (never stored).
    rows_in = tl.where(rows < M, rows, 0)
    cols_in = tl.where(cols < N, cols, 0)
    a_ptrs = a_ptr + rows_in[:, None] * stride_am + (k_lo * BLOCK_K + lane_k)[None, :] * stride_ak
    b_ptrs = b_ptr + (k_lo * BLOCK_K + lane_k)[:, None] * stride_bk + cols_in[None, :] * stride_bn
    if SWAP_AB:
        acc_t = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kk in range(k_lo, k_hi):
        if USE_TMA:
            a = a_desc.load([off_m, kk * BLOCK_K])
            b = _load_b(b_desc, kk * BLOCK_K, off_n, B_KMAJOR)
        else:
            k_left = K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=lane_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=lane_k[:, None] < k_left, other=0.0)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        if SWAP_AB:
            acc_t = tl.dot(tl.trans(b), tl.trans(a), acc_t)
        else:
            acc = tl.dot(a, b, acc)
    if SWAP_AB:
        acc = tl.trans(acc_t)
    return acc, rows, cols



# --------------------------------------------------------------------------
@triton.jit(do_not_specialize=["split_k", "steps_per_split"])
def _gemm_fma_kernel(a_ptr, b_ptr, c_ptr, ws_ptr, cnt_ptr, M, N, K,
                     stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                     split_k, steps_per_split,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """fp32 C = A @ B for a short A (small M) on the FMA units, no tensor cores:
    true fp32 products (tf32 rounds the inputs to 10 mantissa bits), and B is
    read as it lies, with no re-layout for an MMA. Bound by reading B once.

    Grid: (M blocks x N blocks, split_k); program (tile, pid_k) takes K-steps
    ``[pid_k * steps_per_split, ...)`` of its tile, and the pieces meet in the
    split-K workspace (``_store_split``). M blocks are the fastest index, so the
    programs sharing a slab of B run side by side (the later ones read it from L2).

    BLOCK_M < 16 (GEMV-like, M of 1-8): per row k of B, one outer product
    ``acc += A[:, k] * B[k, :]``. With row-major B each thread loads 4 adjacent
    columns (128-bit loads, a warp covers 512 contiguous bytes) and keeps all
    BLOCK_M rows of its columns, so warps should lie along N (BLOCK_N = 128 *
    num_warps). The K-step is unrolled (static_range) so its BLOCK_K loads of B
    are in flight together; no shared memory.
    BLOCK_M >= 16: ``tl.dot`` in ieee precision, which Triton builds from FMAs on
    tiles staged in shared memory by asynchronous copies (num_stages deep): more
    FMAs per load where the rows of A make FMA throughput, not B, the limit. It
    also reads a K-major B (a transposed view) along K, where the outer product
    would read 4-byte pieces of separate rows.

    Masked for any M, N, K: rows/columns past the edge are neither loaded nor stored."""
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    pid_n = pid // num_pid_m
    pid_m = pid - pid_n * num_pid_m
    k_steps = (K + BLOCK_K - 1) // BLOCK_K
    k_lo = pid_k * steps_per_split
    k_hi = tl.minimum(k_steps, k_lo + steps_per_split)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_in = rows[:, None] < M
    col_in = cols[None, :] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if BLOCK_M < 16:
        a_ptrs = a_ptr + rows[:, None] * stride_am   # (BLOCK_M, 1): one column of A
        b_ptrs = b_ptr + cols[None, :] * stride_bn   # (1, BLOCK_N): one row of B
        for kk in range(k_lo, k_hi):
            for j in tl.static_range(BLOCK_K):
                k = kk * BLOCK_K + j
                a_k = tl.load(a_ptrs + k * stride_ak, mask=row_in & (k < K), other=0.0)
                b_k = tl.load(b_ptrs + k * stride_bk, mask=col_in & (k < K), other=0.0)
                acc += a_k * b_k
    else:
        ks = k_lo * BLOCK_K + tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ak
        b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :] * stride_bn
        for kk in range(k_lo, k_hi):
            k_in = ks < K
            a = tl.load(a_ptrs, mask=row_in & k_in[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_in[:, None] & col_in, other=0.0)
            acc = tl.dot(a, b, acc, input_precision="ieee")
            ks += BLOCK_K
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    _store_split(acc, pid, pid_k, split_k, rows, cols, c_ptr, stride_cm, stride_cn, M, N, ws_ptr, cnt_ptr,
                 BLOCK_M, BLOCK_N)
