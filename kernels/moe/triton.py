"""Triton kernels of the grouped GEMM (see ``kernels.moe`` for the design).

``_grouped_mm_kernel`` runs forward (``out[rows_g] = x[rows_g] @ w[g]``) and,
with ``TRANS_W``, dgrad (``x @ w[g].T``); ``_grouped_mm_wgrad_kernel`` the
weight gradient (``dw[g] = x[rows_g].T @ dy[rows_g]``, a variable-K GEMM).
Both read the group sizes on the GPU and find the group of every tile from
in-register prefix sums; both take either TMA descriptors (``USE_TMA``) or
masked pointer loads. ``row_window`` gives the 4-D "row-window" view that keeps
a tile inside its group; ``build`` makes the host descriptors of a launch plan.
With ``DEVICE_DESC`` (and ``USE_TMA``) the descriptors arrive as None and every
program encodes the same ones itself (``tl.make_tensor_descriptor``, into the
launcher's global scratch buffer), so the launch passes no host descriptor.
"""
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.common import interpreter

if interpreter.active():
    interpreter.patch()

_WINDOW = 1 << 30  # rows a row-window descriptor can address past its base


# --------------------------------------------------------------------------
# Row-window descriptors (host side)
# --------------------------------------------------------------------------
def row_window(rows: int, cols: int, row_stride: int, who: str = "grouped_gemm") -> tuple[list[int], list[int]]:
    """(shape, strides) of the 4-D row-window view of a 2-D row-major tensor of
    ``rows`` x ``cols`` elements, ``row_stride`` apart.

    It has four dimensions, (a, b, r, c) with strides (2**34 - s, s, s, 1) in
    elements, s being the row stride. Addressing it at (2**30, lo + n,
    2**30 - n + i, c) lands on element (lo + i, c): the 2**30 * 2**34 term wraps
    to zero in 64-bit address arithmetic. Because dimension r has extent 2**30,
    the hardware treats i >= n as out of bounds, so rows outside [lo, lo + n)
    are zero-filled on loads and dropped on stores.
    """
    if rows > _WINDOW:
        raise ValueError(f"{who}: at most {_WINDOW} rows, got {rows}")
    s = row_stride
    return [0x7FFF0000, 0x7FFF0000, _WINDOW, cols], [2**34 - s, s, s, 1]


def build(recipes: tuple, operands: tuple) -> list:
    """Host TMA descriptors from recipes, each (operand index, shape, strides, block)
    or None (the kernel takes None there): everything but the base pointer is
    decided once per launch plan; this is the per-call part."""
    return [None if r is None else TensorDescriptor(operands[r[0]], *r[1:]) for r in recipes]


# --------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------
@triton.jit
def _device_window(ptr, cols, row_stride, BR: tl.constexpr, BC: tl.constexpr):
    """The row-window descriptor of ``row_window`` (a box of BR rows, BC columns),
    encoded on the device."""
    s = row_stride.to(tl.int64)
    return tl.make_tensor_descriptor(ptr, [0x7FFF0000, 0x7FFF0000, 1 << 30, cols], [(1 << 34) - s, s, s, 1],
                                     [1, 1, BR, BC])


@triton.jit
def _window_load(desc, lo, n, row, col, BR: tl.constexpr, BC: tl.constexpr):
    """Rows [row, row + BR) of the window [lo, lo + n); rows past n read as zeros."""
    block = desc.load([1 << 30, lo + n, (1 << 30) - n + row, col])
    return block.reshape(BR, BC)


@triton.jit
def _window_store(desc, lo, n, row, col, val, BR: tl.constexpr, BC: tl.constexpr):
    """Store val ([BR, BC]) at rows [row, row + BR) of the window; rows past n are dropped."""
    desc.store([1 << 30, lo + n, (1 << 30) - n + row, col], val.reshape(1, 1, BR, BC))


@triton.jit
def _swizzle(local, num_m_tiles, num_n_tiles, GROUP_M: tl.constexpr):
    """Tile `local` of a (num_m_tiles x num_n_tiles) grid, GROUP_M rows at a time."""
    width = GROUP_M * num_n_tiles
    first_m = (local // width) * GROUP_M
    rows = tl.minimum(num_m_tiles - first_m, GROUP_M)
    pid_m = first_m + (local % width) % rows
    pid_n = (local % width) // rows
    return pid_m, pid_n


@triton.jit
def _owner(idx, ends, begins, gi, starts, sizes):
    """The group owning tile `idx` when group g's tiles are [begins[g], ends[g]): the
    number of groups that end at or before it. Returns (g, its first row, its rows,
    idx's place among its tiles)."""
    g = tl.sum((ends <= idx).to(tl.int32), 0)
    sel = gi == g
    return (g, tl.sum(tl.where(sel, starts, 0), 0), tl.sum(tl.where(sel, sizes, 0), 0),
            idx - tl.sum(tl.where(sel, begins, 0), 0))


@triton.jit
def _mm_tile(x_ptr, w_ptr, out_ptr, x_desc, w_desc, out_desc, g, row0, m_g, off_m, off_n, N, K,
             stride_xm, stride_wg, stride_wk, stride_wn, stride_om, k_tiles,
             TRANS_W: tl.constexpr, USE_TMA: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             EPI_SUBTILE: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """out[row0 + off_m :, off_n :] (rows inside group g only) = x_g @ W_g for one
    BLOCK_M x BLOCK_N tile; the descriptors' boxes match BLOCK_N."""
    out_dtype = out_ptr.dtype.element_ty
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if USE_TMA:
        for kt in range(k_tiles):
            off_k = kt * BLOCK_K
            a = x_desc.load([row0 + off_m, off_k])
            if TRANS_W:
                b = w_desc.load([g, off_n, off_k]).reshape(BLOCK_N, BLOCK_K).T
            else:
                b = w_desc.load([g, off_k, off_n]).reshape(BLOCK_K, BLOCK_N)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    else:
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        row_ok = rm < m_g
        col_ok = rn < N
        a_ptrs = x_ptr + (row0 + rm).to(tl.int64)[:, None] * stride_xm + rk[None, :]
        b_ptrs = (w_ptr + g.to(tl.int64) * stride_wg
                  + rk[:, None].to(tl.int64) * stride_wk + rn[None, :].to(tl.int64) * stride_wn)
        for kt in range(k_tiles):
            if EVEN_K:
                a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
            else:
                k_ok = rk < K - kt * BLOCK_K
                a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K * stride_wk

    if USE_TMA:
        if EPI_SUBTILE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            c0, c1 = tl.split(halves)
            _window_store(out_desc, row0, m_g, off_m, off_n, c0.to(out_dtype), BLOCK_M, BLOCK_N // 2)
            _window_store(out_desc, row0, m_g, off_m, off_n + BLOCK_N // 2, c1.to(out_dtype),
                          BLOCK_M, BLOCK_N // 2)
        else:
            _window_store(out_desc, row0, m_g, off_m, off_n, acc.to(out_dtype), BLOCK_M, BLOCK_N)
    else:
        rm = off_m + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        c_ptrs = out_ptr + (row0 + rm).to(tl.int64)[:, None] * stride_om + rn[None, :]
        tl.store(c_ptrs, acc.to(out_dtype), mask=(rm < m_g)[:, None] & (rn < N)[None, :])


@triton.jit(do_not_specialize=["M_total", "G", "NUM_PROGRAMS"])
def _grouped_mm_kernel(
    x_ptr, w_ptr, out_ptr, sizes_ptr,
    x_desc, w_desc, out_desc, w_tail_desc, out_tail_desc,
    M_total, N, K, G,
    stride_xm, stride_wg, stride_wk, stride_wn, stride_om,
    TRANS_W: tl.constexpr,
    USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TAIL_N: tl.constexpr,
    GROUP_M: tl.constexpr, G_PAD: tl.constexpr, NUM_PROGRAMS,
    EPI_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr, EVEN_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DEVICE_DESC: tl.constexpr = False,
):
    """out[rows of g] = x[rows of g] @ W_g, W_g = w[g] ([K, N]) or w[g].T (TRANS_W).

    Pointer path: w is addressed through the logical [G, K, N] strides.
    TMA path: w_desc is 3-D over the stored layout ([G, K, N], or [G, N, K]
    when TRANS_W), x_desc 2-D over [M_total, K], out_desc a row-window descriptor over out.

    TAIL_N > 0 (N % BLOCK_N <= TAIL_N <= BLOCK_N / 2): the last, narrow column strip
    is not computed in BLOCK_N-wide tiles, mostly padding (N = 2880 in 256-wide
    tiles: 11.25 tiles of work cost 12), but in BLOCK_M x TAIL_N tiles of its own
    (w_tail_desc, out_tail_desc), handed out after the full tiles in the same
    round-robin order, so the programs that finish first take them.
    """
    if USE_TMA and DEVICE_DESC:   # the descriptors the host would have built, from pointers and strides
        x_desc = tl.make_tensor_descriptor(x_ptr, [M_total, K], [stride_xm, 1], [BLOCK_M, BLOCK_K])
        out_w: tl.constexpr = BLOCK_N // 2 if EPI_SUBTILE else BLOCK_N
        out_desc = _device_window(out_ptr, N, stride_om, BLOCK_M, out_w)
        if TRANS_W:   # stored [G, N, K]
            w_desc = tl.make_tensor_descriptor(w_ptr, [G, N, K], [stride_wg, stride_wn, 1], [1, BLOCK_N, BLOCK_K])
        else:
            w_desc = tl.make_tensor_descriptor(w_ptr, [G, K, N], [stride_wg, stride_wk, 1], [1, BLOCK_K, BLOCK_N])
        if TAIL_N > 0:
            out_tail_desc = _device_window(out_ptr, N, stride_om, BLOCK_M, TAIL_N)
            if TRANS_W:
                w_tail_desc = tl.make_tensor_descriptor(w_ptr, [G, N, K], [stride_wg, stride_wn, 1],
                                                        [1, TAIL_N, BLOCK_K])
            else:
                w_tail_desc = tl.make_tensor_descriptor(w_ptr, [G, K, N], [stride_wg, stride_wk, 1],
                                                        [1, BLOCK_K, TAIL_N])
    pid = tl.program_id(0)

    # Prefix sums of the group sizes, in registers (G <= G_PAD).
    gi = tl.arange(0, G_PAD)
    sizes = tl.load(sizes_ptr + gi, mask=gi < G, other=0).to(tl.int32)
    sizes = tl.maximum(sizes, 0)
    ends = tl.minimum(tl.cumsum(sizes, 0), M_total)   # rows past x are never touched
    starts = ends - sizes
    starts = tl.minimum(starts, M_total)
    sizes = ends - starts
    if TAIL_N > 0:
        num_n_tiles = N // BLOCK_N
    else:
        num_n_tiles = tl.cdiv(N, BLOCK_N)
    m_tiles = (sizes + BLOCK_M - 1) // BLOCK_M
    tile_ends = tl.cumsum(m_tiles * num_n_tiles, 0)
    total_tiles = tl.sum(m_tiles * num_n_tiles, 0)
    tile_starts = tile_ends - m_tiles * num_n_tiles
    k_tiles = tl.cdiv(K, BLOCK_K)

    for tile in tl.range(pid, total_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        g, row0, m_g, local = _owner(tile, tile_ends, tile_starts, gi, starts, sizes)
        pid_m, pid_n = _swizzle(local, tl.cdiv(m_g, BLOCK_M), num_n_tiles, GROUP_M)
        _mm_tile(x_ptr, w_ptr, out_ptr, x_desc, w_desc, out_desc, g, row0, m_g, pid_m * BLOCK_M,
                 pid_n * BLOCK_N, N, K, stride_xm, stride_wg, stride_wk, stride_wn, stride_om, k_tiles,
                 TRANS_W, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_K, EPI_SUBTILE, EVEN_K, DOT_PRECISION)

    if TAIL_N > 0:
        # Narrow strip: one tile per BLOCK_M rows of each group, numbered after the full
        # tiles (global index total_tiles + t goes to program (total_tiles + t) % NUM_PROGRAMS).
        # Measured (H200, results/grouped_gemm run 8): giving them first to the programs with
        # one full tile fewer, four each, was 8% slower on gpt-oss GateUP dgrad: a 128x64 tile
        # loads half a 128x256 tile's bytes per K-step, so it costs about half, not a quarter.
        m_tile_ends = tl.cumsum(m_tiles, 0)
        m_tile_starts = m_tile_ends - m_tiles
        first = (pid - total_tiles % NUM_PROGRAMS + NUM_PROGRAMS) % NUM_PROGRAMS
        for t in tl.range(first, tl.sum(m_tiles, 0), NUM_PROGRAMS, flatten=FLATTEN):
            g, row0, m_g, m_idx = _owner(t, m_tile_ends, m_tile_starts, gi, starts, sizes)
            _mm_tile(x_ptr, w_ptr, out_ptr, x_desc, w_tail_desc, out_tail_desc, g, row0, m_g, m_idx * BLOCK_M,
                     num_n_tiles * BLOCK_N, N, K, stride_xm, stride_wg, stride_wk, stride_wn, stride_om, k_tiles,
                     TRANS_W, USE_TMA, BLOCK_M, TAIL_N, BLOCK_K, False, EVEN_K, DOT_PRECISION)


@triton.jit
def _wgrad_tile(tile, gi, rank, starts, sizes, per_group, num_k_tiles, num_n_tiles,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """(group, first row, rows, K offset, N offset, row steps) of wgrad tile `tile`.

    Tiles are numbered over the groups that have rows only: tile // per_group is
    a rank among them (`rank` holds each group's, -1 for empty ones)."""
    r = tile // per_group
    pid_k, pid_n = _swizzle(tile % per_group, num_k_tiles, num_n_tiles, GROUP_M)
    sel = rank == r
    g = tl.sum(tl.where(sel, gi, 0), 0)
    row0 = tl.sum(tl.where(sel, starts, 0), 0)
    m_g = tl.sum(tl.where(sel, sizes, 0), 0)
    steps = tl.cdiv(m_g, BLOCK_K)
    return g, row0, m_g, pid_k * BLOCK_M, pid_n * BLOCK_N, steps


@triton.jit
def _wgrad_store(dw_ptr, dw_desc, acc, g, off_k, off_n, K, N, stride_dwg, stride_dwk,
                 USE_TMA: tl.constexpr, EPI_SUBTILE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    out_dtype = dw_ptr.dtype.element_ty
    if USE_TMA:
        if EPI_SUBTILE:
            halves = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            c0, c1 = tl.split(halves)
            dw_desc.store([g, off_k, off_n], c0.to(out_dtype).reshape(1, BLOCK_M, BLOCK_N // 2))
            dw_desc.store([g, off_k, off_n + BLOCK_N // 2], c1.to(out_dtype).reshape(1, BLOCK_M, BLOCK_N // 2))
        else:
            dw_desc.store([g, off_k, off_n], acc.to(out_dtype).reshape(1, BLOCK_M, BLOCK_N))
    else:
        rk = off_k + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        c_ptrs = dw_ptr + g.to(tl.int64) * stride_dwg + rk.to(tl.int64)[:, None] * stride_dwk + rn[None, :]
        tl.store(c_ptrs, acc.to(out_dtype), mask=(rk < K)[:, None] & (rn < N)[None, :])


@triton.jit
def _wgrad_operands(x_ptr, dy_ptr, x_desc, dy_desc, row0, m_g, off_r, off_k, off_n, K, N,
                    stride_xm, stride_dym, USE_TMA: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x rows [off_r, off_r + BLOCK_K) of the group as [BLOCK_M, BLOCK_K] (transposed) and
    the same rows of dy as [BLOCK_K, BLOCK_N]; rows past the group read as zeros."""
    if USE_TMA:
        a = _window_load(x_desc, row0, m_g, off_r, off_k, BLOCK_K, BLOCK_M).T
        b = _window_load(dy_desc, row0, m_g, off_r, off_n, BLOCK_K, BLOCK_N)
    else:
        rr = off_r + tl.arange(0, BLOCK_K)
        rk = off_k + tl.arange(0, BLOCK_M)
        rn = off_n + tl.arange(0, BLOCK_N)
        r_ok = rr < m_g
        rows = (row0 + rr).to(tl.int64)
        a = tl.load(x_ptr + rows[None, :] * stride_xm + rk[:, None],
                    mask=(rk < K)[:, None] & r_ok[None, :], other=0.0)
        b = tl.load(dy_ptr + rows[:, None] * stride_dym + rn[None, :],
                    mask=r_ok[:, None] & (rn < N)[None, :], other=0.0)
    return a, b


@triton.jit(do_not_specialize=["M_total", "G", "NUM_PROGRAMS"])
def _grouped_mm_wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, sizes_ptr,
    x_desc, dy_desc, dw_desc,
    M_total, K, N, G,
    stride_xm, stride_dym, stride_dwg, stride_dwk,
    USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, G_PAD: tl.constexpr, NUM_PROGRAMS,
    EPI_SUBTILE: tl.constexpr, FLATTEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DEVICE_DESC: tl.constexpr = False,
):
    """dw[g] = x[rows of g].T @ dy[rows of g]; BLOCK_M tiles K, BLOCK_N tiles N,
    BLOCK_K steps through the group's rows (the reduction). Empty group -> zeros.

    The reduction length differs from group to group, which Triton's automatic
    loop flattening does not handle; FLATTEN runs one flat loop over all
    (tile, row step) pairs of this program instead, so the loads of the next
    tile are already in flight while the current one is stored.
    """
    if USE_TMA and DEVICE_DESC:   # the descriptors the host would have built, from pointers and strides
        x_desc = _device_window(x_ptr, K, stride_xm, BLOCK_K, BLOCK_M)
        dy_desc = _device_window(dy_ptr, N, stride_dym, BLOCK_K, BLOCK_N)
        dw_w: tl.constexpr = BLOCK_N // 2 if EPI_SUBTILE else BLOCK_N
        dw_desc = tl.make_tensor_descriptor(dw_ptr, [G, K, N], [stride_dwg, stride_dwk, 1], [1, BLOCK_M, dw_w])
    pid = tl.program_id(0)

    gi = tl.arange(0, G_PAD)
    sizes = tl.load(sizes_ptr + gi, mask=gi < G, other=0).to(tl.int32)
    sizes = tl.maximum(sizes, 0)
    ends = tl.minimum(tl.cumsum(sizes, 0), M_total)
    starts = tl.minimum(ends - sizes, M_total)
    sizes = ends - starts

    num_k_tiles = tl.cdiv(K, BLOCK_M)
    num_n_tiles = tl.cdiv(N, BLOCK_N)
    per_group = num_k_tiles * num_n_tiles
    busy = sizes > 0
    empty = (sizes == 0) & (gi < G)
    rank = tl.where(busy, tl.cumsum(busy.to(tl.int32), 0) - 1, -1)
    empty_rank = tl.where(empty, tl.cumsum(empty.to(tl.int32), 0) - 1, -1)
    n_busy = tl.sum(busy.to(tl.int32), 0)

    # Experts with no rows: their dw tiles are zeros; store them without loading anything.
    zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for tile in range(pid, (G - n_busy) * per_group, NUM_PROGRAMS):
        pid_k, pid_n = _swizzle(tile % per_group, num_k_tiles, num_n_tiles, GROUP_M)
        g = tl.sum(tl.where(empty_rank == tile // per_group, gi, 0), 0)
        _wgrad_store(dw_ptr, dw_desc, zeros, g, pid_k * BLOCK_M, pid_n * BLOCK_N, K, N, stride_dwg, stride_dwk,
                     USE_TMA, EPI_SUBTILE, BLOCK_M, BLOCK_N)

    if FLATTEN:
        # Tiles pid, pid + P, ... (numbered over busy groups) belong to this program.
        # Of those, the ones of the busy group of rank r: count(hi_r) - count(lo_r),
        # count(x) = #{t < x : t = pid mod P}.
        lo = rank * per_group
        hi = lo + per_group
        mine = (hi - pid + NUM_PROGRAMS - 1) // NUM_PROGRAMS - (lo - pid + NUM_PROGRAMS - 1) // NUM_PROGRAMS
        mine = tl.where(busy, mine, 0)
        total_steps = tl.sum(mine * ((sizes + BLOCK_K - 1) // BLOCK_K), 0)

        # Tile coordinates are updated at the top of a step and the result stored at
        # the bottom, so the pipeliner can issue the next steps' loads early.
        tile = pid - NUM_PROGRAMS
        g = 0
        row0 = 0
        m_g = 0
        off_k = 0
        off_n = 0
        steps = 0
        ki = -1
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(total_steps):
            ki = tl.where(ki == steps - 1, 0, ki + 1)
            if ki == 0:
                tile += NUM_PROGRAMS
                g, row0, m_g, off_k, off_n, steps = _wgrad_tile(tile, gi, rank, starts, sizes, per_group,
                                                                num_k_tiles, num_n_tiles,
                                                                BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
            a, b = _wgrad_operands(x_ptr, dy_ptr, x_desc, dy_desc, row0, m_g, ki * BLOCK_K, off_k, off_n,
                                   K, N, stride_xm, stride_dym, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_K)
            acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            if ki == steps - 1:
                _wgrad_store(dw_ptr, dw_desc, acc, g, off_k, off_n, K, N, stride_dwg, stride_dwk,
                             USE_TMA, EPI_SUBTILE, BLOCK_M, BLOCK_N)
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    else:
        for tile in range(pid, n_busy * per_group, NUM_PROGRAMS):
            g, row0, m_g, off_k, off_n, steps = _wgrad_tile(tile, gi, rank, starts, sizes, per_group,
                                                            num_k_tiles, num_n_tiles,
                                                            BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for ki in range(0, steps):
                a, b = _wgrad_operands(x_ptr, dy_ptr, x_desc, dy_desc, row0, m_g, ki * BLOCK_K, off_k, off_n,
                                       K, N, stride_xm, stride_dym, USE_TMA, BLOCK_M, BLOCK_N, BLOCK_K)
                acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
            _wgrad_store(dw_ptr, dw_desc, acc, g, off_k, off_n, K, N, stride_dwg, stride_dwk,
                         USE_TMA, EPI_SUBTILE, BLOCK_M, BLOCK_N)


