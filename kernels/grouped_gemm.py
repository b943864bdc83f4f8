"""Grouped GEMM for mixture-of-experts layers: forward, dgrad and wgrad.

A token batch ``x`` of shape ``[sum(group_sizes), K]`` is split along its rows
into ``G`` consecutive groups (one per expert); group ``g`` is multiplied by
its own weight ``w[g]``:

* forward  ``out[rows_g] = x[rows_g] @ w[g]``           (``w`` is ``[G, K, N]``)
* dgrad    ``dx[rows_g]  = dy[rows_g] @ w[g].T``         (``trans_w=True``)
* wgrad    ``dw[g]       = x[rows_g].T @ dy[rows_g]``    (variable-K GEMM)

The group sizes never leave the GPU. Each persistent program loads the (at
most a few hundred) sizes once, builds their prefix sums in registers with
``tl.cumsum`` and finds the group of every tile it owns by comparing the tile
index with the cumulative tile counts: no ``.item()``, ``.tolist()`` or
``.cpu()`` anywhere in the launch path, so a launch never waits for the GPU and
can be captured in a CUDA graph.

Tile order. Tiles are numbered expert by expert; within an expert they are
grouped ``GROUP_M`` row blocks at a time (the usual L2 swizzle). Programs take
tiles round-robin, so the wave of tiles in flight at any moment covers one
expert (two at a boundary) and every SM streams the same ``w[g]`` through L2.
An output width that leaves a narrow last column strip (N = 2880 in 256-wide
tiles: 11.25 tiles) gets that strip in tiles of its own width (``tail_width``),
numbered after the full tiles, instead of mostly-padding 256-wide ones.

On Hopper (sm_90) the operands arrive through TMA: host-side tensor
descriptors, with "row-window" descriptors for the row-split operands so that a
tile never reads or writes past its group's last row (the hardware clips and
zero-fills; see ``_row_window_desc``). Elsewhere (older GPUs, strides that
are not 16-byte aligned, the interpreter by default) masked pointer loads do
the same job; the interpreter also emulates the descriptor path when a config
asks for it (``USE_TMA=True``), which is how the CPU tests cover it.

wgrad numbers its tiles over the experts that have rows only, in one flat loop
over (tile, row step) pairs per program, so the next tile's loads are in
flight while a tile is stored; experts with no rows get their dw tiles stored
as zeros without loading anything.

Backends for comparison (``torch._grouped_mm``, a per-expert cuBLAS loop) and
the autotuner that picks among them live in ``kernels.grouped_gemm_autotune``.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels import cuda_context
from kernels import grouped_gemm_ws as ws
from kernels import interpreter

__all__ = [
    "GemmConfig",
    "GroupedGemmFunction",
    "flops",
    "bytes_moved",
    "compile_for_target",
    "default_label",
    "grouped_gemm",
    "grouped_gemm_wgrad",
    "grouped_linear",
    "pick_config",
    "reference",
    "reference_wgrad",
]

_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_MAX_GROUPS = 4096


def _interpreting() -> bool:
    return interpreter.active()


def _patch_interpreter() -> None:
    if _interpreting():
        interpreter.patch()


# ---------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------




def _row_window_desc(t: torch.Tensor, block_rows: int, block_cols: int) -> TensorDescriptor:
    """A TMA descriptor over a 2-D row-major tensor that can be bounded to any row window.

    It has four dimensions, (a, b, r, c) with strides (2**34 - s, s, s, 1) in
    elements, s being the row stride. Addressing it at (2**30, lo + n,
    2**30 - n + i, c) lands on element (lo + i, c): the 2**30 * 2**34 term wraps
    to zero in 64-bit address arithmetic. Because dimension r has extent 2**30,
    the hardware treats i >= n as out of bounds, so rows outside [lo, lo + n)
    are zero-filled on loads and dropped on stores.
    """
    return TensorDescriptor(t, *ws.row_window(t, "grouped_gemm"), [1, 1, block_rows, block_cols])


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
    DOT_PRECISION: tl.constexpr,
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
    DOT_PRECISION: tl.constexpr,
):
    """dw[g] = x[rows of g].T @ dy[rows of g]; BLOCK_M tiles K, BLOCK_N tiles N,
    BLOCK_K steps through the group's rows (the reduction). Empty group -> zeros.

    The reduction length differs from group to group, which Triton's automatic
    loop flattening does not handle; FLATTEN runs one flat loop over all
    (tile, row step) pairs of this program instead, so the loads of the next
    tile are already in flight while the current one is stored.
    """
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


# ---------------------------------------------------------------------------
# Configurations
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GemmConfig:
    """One launch configuration. For wgrad, BLOCK_M tiles K, BLOCK_N tiles N and
    BLOCK_K steps through the rows of a group."""

    BLOCK_M: int = 128
    BLOCK_N: int = 256
    BLOCK_K: int = 64
    GROUP_M: int = 8
    num_warps: int = 8
    num_stages: int = 3
    EPI_SUBTILE: bool = True
    FLATTEN: bool = True
    USE_TMA: bool | None = None   # None: TMA whenever the device and strides allow it
    CTAS_PER_SM: int = 1
    NARROW_TAIL: bool = True      # fwd/dgrad: a last column strip <= BLOCK_N/2 wide gets narrow tiles

    def as_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        tma = {None: "auto", True: "tma", False: "ptr"}[self.USE_TMA]
        return (f"{self.BLOCK_M}x{self.BLOCK_N}x{self.BLOCK_K}_g{self.GROUP_M}_w{self.num_warps}"
                f"_s{self.num_stages}_{'sub' if self.EPI_SUBTILE else 'full'}"
                f"_{'flat' if self.FLATTEN else 'nest'}_{tma}_o{self.CTAS_PER_SM}"
                f"{'' if self.NARROW_TAIL else '_wide'}")


# Config table, derived from the H200 sweep recorded under results/grouped_gemm/
# (experiments/run_grouped_gemm_h200.py --sweep). Keys: (op, N, K) of the
# *call* (fwd/dgrad: N the output width, K the reduction; wgrad: the layer's N
# and K); a missing key falls back to the op's default.
_DEFAULT = {
    "fwd": GemmConfig(),
    "dgrad": GemmConfig(),
    "wgrad": GemmConfig(),
}
_S4 = GemmConfig(num_stages=4)
_TABLE: dict[tuple[str, int, int], GemmConfig] = {
    # measured 2026-11-21 on an H200 (results/grouped_gemm/sweep.csv, run 7): 128x256x64 tiles,
    # 8 warps, one CTA per SM, 4 stages won everywhere but two wgrad keys (3 stages, within
    # 0.2%); the narrow tail strip (N = 2880, 5760) gained 0.5-1.3% over whole 256-wide tiles.
    # Earlier sweeps (run 2, and run 6 on the gpt-oss shapes): 128x128 tiles (8 warps, or 4 warps
    # with 2 CTAs per SM), 256x128, BLOCK_K=128, pointer loads instead of TMA and unflattened
    # loops were all slower.
    ("fwd", 4096, 7168): _S4, ("fwd", 7168, 2048): _S4,
    ("fwd", 5760, 2880): _S4, ("fwd", 2880, 2880): _S4,
    ("dgrad", 7168, 4096): _S4, ("dgrad", 2048, 7168): _S4,
    ("dgrad", 2880, 5760): _S4, ("dgrad", 2880, 2880): _S4,
    ("wgrad", 4096, 7168): _S4, ("wgrad", 7168, 2048): GemmConfig(),
    ("wgrad", 5760, 2880): _S4, ("wgrad", 2880, 2880): GemmConfig(),
}

# Tiny tiles for the interpreter: correctness only.
_INTERPRET_CONFIG = GemmConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1,
                               num_stages=1, EPI_SUBTILE=False, FLATTEN=False, USE_TMA=False)


def tail_width(N: int, block_n: int) -> int:
    """Width of the narrow tiles for the last column strip of an N-wide output in
    block_n-wide tiles, or 0 when that strip is full or too wide to be worth it
    (more than half a tile). A power of two >= 16 (tl.dot's smallest)."""
    rem = N % block_n
    if rem == 0:
        return 0
    width = max(16, triton.next_power_of_2(rem))
    return width if width <= block_n // 2 else 0


def pick_config(op: str, N: int, K: int, device: torch.device | None = None) -> GemmConfig:
    """The launch configuration for one call (host-side shapes only)."""
    if op not in _DEFAULT:
        raise ValueError(f"op must be one of {sorted(_DEFAULT)}, got {op!r}")
    if _interpreting() or (device is not None and device.type == "cpu"):
        return _INTERPRET_CONFIG
    return _TABLE.get((op, N, K), _DEFAULT[op])


_SM_COUNT: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4   # interpreter: a few programs, so the persistent loop really loops
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _tma_ok(device: torch.device, *tensors: torch.Tensor, forced: bool = False) -> bool:
    """TMA needs sm_90+, 16-byte aligned bases and 16-byte aligned leading strides.

    In the interpreter the descriptor path runs (emulated) only when a config
    asks for it explicitly (``forced``), so tests can cover it on a CPU.
    """
    if _interpreting():
        if not forced:
            return False
    elif device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 9:
        return False
    for t in tensors:
        if t.data_ptr() % 16:
            return False
        if t.stride(-1) != 1:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands: exact fp32 products (the matrix units' tf32 mode is opt-in elsewhere).
    return "ieee" if dtype == torch.float32 else "tf32"


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------


def _check_common(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor,
                  group_sizes: torch.Tensor, dim_b: int) -> None:
    for n, t in ((name_a, a), (name_b, b), ("group_sizes", group_sizes)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"grouped_gemm: {n} must be a torch.Tensor, got {type(t).__name__}")
    if a.dim() != 2:
        raise ValueError(f"grouped_gemm: {name_a} must be 2-D [tokens, features], got shape {tuple(a.shape)}")
    if b.dim() != dim_b:
        raise ValueError(f"grouped_gemm: {name_b} must be {dim_b}-D, got shape {tuple(b.shape)}")
    if group_sizes.dim() != 1:
        raise ValueError(f"grouped_gemm: group_sizes must be 1-D [G], got shape {tuple(group_sizes.shape)}")
    if group_sizes.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_gemm: group_sizes must be int32 or int64, got {group_sizes.dtype}")
    if a.dtype not in _DTYPES:
        raise ValueError(f"grouped_gemm: {name_a}.dtype must be one of bf16/fp16/fp32, got {a.dtype}")
    if b.dtype != a.dtype:
        raise ValueError(f"grouped_gemm: {name_a} and {name_b} dtypes differ ({a.dtype} vs {b.dtype})")
    if not (a.device == b.device == group_sizes.device):
        raise ValueError(f"grouped_gemm: {name_a} ({a.device}), {name_b} ({b.device}) and group_sizes "
                         f"({group_sizes.device}) must be on one device; group sizes stay on the GPU")
    if a.device.type == "cpu" and not _interpreting():
        raise ValueError("grouped_gemm: CPU tensors run only in Triton's interpreter "
                         "(set TRITON_INTERPRET=1 before importing triton); use reference() otherwise")
    if a.device.type not in ("cpu", "cuda"):
        raise ValueError(f"grouped_gemm: unsupported device {a.device}")
    if a.stride(-1) != 1 or (a.shape[0] > 1 and a.stride(0) < a.shape[1]):
        raise ValueError(f"grouped_gemm: {name_a} must be row-major with unit inner stride "
                         f"(got strides {a.stride()}); call .contiguous()")


def _check_g(G: int, group_sizes: torch.Tensor, what: str) -> None:
    if group_sizes.shape[0] != G:
        raise ValueError(f"grouped_gemm: group_sizes has {group_sizes.shape[0]} entries but {what} has G={G}")
    if G < 1 or G > _MAX_GROUPS:
        raise ValueError(f"grouped_gemm: G must be in [1, {_MAX_GROUPS}], got {G}")
    # Sizes on the host cost nothing to look at (no device sync): a negative one would write out of bounds.
    if group_sizes.device.type == "cpu" and bool((group_sizes < 0).any()):
        raise ValueError(f"grouped_gemm: group_sizes must be >= 0, got {group_sizes.tolist()[:16]}")


# ---------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *,
                 trans_w: bool = False, config: GemmConfig | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped x @ w[g] (or x @ w[g].T with ``trans_w``) over row groups of x.

    x: [M, K]; w: [G, K, N] ([G, N, K] with trans_w); group_sizes: int tensor
    [G] on x's device, summing to M (not checked: that would need a host sync;
    rows past the sum are left unwritten, groups are clipped at M).
    Returns out [M, N] in x's dtype (fp32 accumulation). Without a ``config``,
    operands the warp-specialised Gluon kernel takes (sm_90, bf16/fp16, K and N
    multiples of 8) go to ``kernels.grouped_gemm_ws``; a ``config`` (or any other
    case) runs this module's Triton kernel.
    """
    _check_common("x", x, "w", w, group_sizes, 3)
    G = w.shape[0]
    _check_g(G, group_sizes, "w")
    M, K = x.shape
    if trans_w:
        N, Kw = w.shape[1], w.shape[2]
    else:
        Kw, N = w.shape[1], w.shape[2]
    if Kw != K:
        layout = "[G, N, K]" if trans_w else "[G, K, N]"
        raise ValueError(f"grouped_gemm: x is [M={M}, K={K}] but w {layout} is {tuple(w.shape)} "
                         f"(K={Kw}); did you mean trans_w={not trans_w}?")
    if w.stride(-1) != 1:
        raise ValueError(f"grouped_gemm: w must have unit inner stride (got {w.stride()}); "
                         f"pass the stored layout with trans_w instead of a transposed view")
    if out is None:
        out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    elif out.shape != (M, N) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"grouped_gemm: out must be a contiguous {x.dtype} [{M}, {N}] tensor on {x.device}")
    if M == 0 or N == 0:
        return out
    if K == 0:
        return out.zero_()

    op = "dgrad" if trans_w else "fwd"
    gluon = _gluon_config(x, w, group_sizes, out, trans_w) if config is None else None
    if gluon is not None:
        return ws.grouped_gemm_ws(x, w, group_sizes, trans_w=trans_w, config=gluon, out=out)
    _patch_interpreter()
    cfg = config or pick_config(op, N, K, x.device)
    use_tma = cfg.USE_TMA is not False and _tma_ok(x.device, x, w, out, forced=bool(cfg.USE_TMA))
    BM, BN, BK = cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K
    tail = tail_width(N, BN) if cfg.NARROW_TAIL else 0
    x_desc = w_desc = out_desc = w_tail_desc = out_tail_desc = None
    if use_tma:
        cuda_context.ensure_current(x.device)
        x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), [BM, BK])
        w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), [1, BN, BK] if trans_w else [1, BK, BN])
        out_desc = _row_window_desc(out, BM, BN // 2 if cfg.EPI_SUBTILE else BN)
        if tail:
            w_tail_desc = TensorDescriptor(w, list(w.shape), list(w.stride()),
                                           [1, tail, BK] if trans_w else [1, BK, tail])
            out_tail_desc = _row_window_desc(out, BM, tail)
    # Logical [G, K, N] strides of w for the pointer path.
    s_g, s_a, s_b = w.stride()
    stride_wk, stride_wn = (s_b, s_a) if trans_w else (s_a, s_b)

    n_tiles = triton.cdiv(N, BN)
    max_tiles = (triton.cdiv(M, BM) + G) * n_tiles     # an upper bound, known on the host
    programs = max(1, min(_num_sms(x.device) * cfg.CTAS_PER_SM, max_tiles))
    _grouped_mm_kernel[(programs,)](
        x, w, out, group_sizes,
        x_desc, w_desc, out_desc, w_tail_desc, out_tail_desc,
        M, N, K, G,
        x.stride(0), s_g, stride_wk, stride_wn, out.stride(0),
        TRANS_W=trans_w, USE_TMA=use_tma,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, TAIL_N=tail, GROUP_M=cfg.GROUP_M,
        G_PAD=max(64, triton.next_power_of_2(G)), NUM_PROGRAMS=programs,
        EPI_SUBTILE=cfg.EPI_SUBTILE and use_tma, FLATTEN=cfg.FLATTEN, EVEN_K=(K % BK == 0),
        DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


def _gluon_config(x, w, group_sizes, out, trans_w: bool):
    """The Gluon kernel's config when ``grouped_gemm``'s default path goes to it
    (sm_90, bf16/fp16, TMA-aligned: the warp-specialised kernel of
    kernels.grouped_gemm_ws, 1-5% ahead of this module's on every seed layer in
    results/grouped_gemm run 12), else None."""
    if x.device.type != "cuda" or not ws.can_run(x, w, group_sizes, out, trans_w):
        return None
    N, K = (w.shape[1], w.shape[2]) if trans_w else (w.shape[2], w.shape[1])
    return ws.pick_config("dgrad" if trans_w else "fwd", N, K)


def default_label(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *, trans_w: bool = False) -> str:
    """Which kernel and config ``grouped_gemm`` runs for these operands without a config."""
    gluon = _gluon_config(x, w, group_sizes, None, trans_w)
    if gluon is not None:
        return "gluon " + gluon.label()
    N, K = (w.shape[1], w.shape[2]) if trans_w else (w.shape[2], w.shape[1])
    return pick_config("dgrad" if trans_w else "fwd", N, K, x.device).label()


def grouped_gemm_wgrad(x: torch.Tensor, dy: torch.Tensor, group_sizes: torch.Tensor, *,
                       config: GemmConfig | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """dw[g] = x[rows of g].T @ dy[rows of g] -> [G, K, N]; an empty group gives zeros.

    x: [M, K], dy: [M, N], group_sizes: int tensor [G] on their device.
    """
    _check_common("x", x, "dy", dy, group_sizes, 2)
    if dy.stride(-1) != 1 or (dy.shape[0] > 1 and dy.stride(0) < dy.shape[1]):
        raise ValueError(f"grouped_gemm_wgrad: dy must be row-major (got strides {dy.stride()}); "
                         f"call .contiguous()")
    M, K = x.shape
    if dy.shape[0] != M:
        raise ValueError(f"grouped_gemm_wgrad: x has {M} rows but dy has {dy.shape[0]}")
    N = dy.shape[1]
    G = group_sizes.shape[0]
    _check_g(G, group_sizes, "group_sizes")
    if out is None:
        out = torch.empty((G, K, N), device=x.device, dtype=x.dtype)
    elif out.shape != (G, K, N) or out.dtype != x.dtype or out.device != x.device or not out.is_contiguous():
        raise ValueError(f"grouped_gemm_wgrad: out must be a contiguous {x.dtype} [{G}, {K}, {N}] tensor")
    if K == 0 or N == 0:
        return out
    if M == 0:
        return out.zero_()

    _patch_interpreter()
    cfg = config or pick_config("wgrad", N, K, x.device)
    use_tma = cfg.USE_TMA is not False and _tma_ok(x.device, x, dy, out, forced=bool(cfg.USE_TMA))
    BM, BN, BK = cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K
    if use_tma:
        cuda_context.ensure_current(x.device)
        x_desc = _row_window_desc(x, BK, BM)
        dy_desc = _row_window_desc(dy, BK, BN)
        dw_desc = TensorDescriptor(out, list(out.shape), list(out.stride()),
                                   [1, BM, BN // 2 if cfg.EPI_SUBTILE else BN])
    else:
        x_desc = dy_desc = dw_desc = None
    total = G * triton.cdiv(K, BM) * triton.cdiv(N, BN)
    programs = max(1, min(_num_sms(x.device) * cfg.CTAS_PER_SM, total))
    _grouped_mm_wgrad_kernel[(programs,)](
        x, dy, out, group_sizes,
        x_desc, dy_desc, dw_desc,
        M, K, N, G,
        x.stride(0), dy.stride(0), out.stride(0), out.stride(1),
        USE_TMA=use_tma,
        BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.GROUP_M,
        G_PAD=max(64, triton.next_power_of_2(G)), NUM_PROGRAMS=programs,
        EPI_SUBTILE=cfg.EPI_SUBTILE and use_tma, FLATTEN=cfg.FLATTEN,
        DOT_PRECISION=_dot_precision(x.dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


# ---------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------


class GroupedGemmFunction(torch.autograd.Function):
    """out = grouped_gemm(x, w, group_sizes, trans_w); dx through dgrad, dw through wgrad."""

    @staticmethod
    def forward(ctx, x, w, group_sizes, trans_w=False):
        ctx.save_for_backward(x, w, group_sizes)
        ctx.trans_w = trans_w
        return grouped_gemm(x, w, group_sizes, trans_w=trans_w)

    @staticmethod
    def backward(ctx, dy):
        x, w, group_sizes = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # d/dx of x @ W_g is dy @ W_g.T: flip the weight's orientation.
            dx = grouped_gemm(dy, w, group_sizes, trans_w=not ctx.trans_w)
        if ctx.needs_input_grad[1]:
            if ctx.trans_w:   # w[g] is [N, K]: dw[g] = dy_g.T @ x_g
                dw = grouped_gemm_wgrad(dy, x, group_sizes)
            else:             # w[g] is [K, N]: dw[g] = x_g.T @ dy_g
                dw = grouped_gemm_wgrad(x, dy, group_sizes)
        return dx, dw, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *,
                   trans_w: bool = False) -> torch.Tensor:
    """Differentiable grouped GEMM: rows of group g of x times w[g] ([G, K, N])."""
    return GroupedGemmFunction.apply(x, w, group_sizes, trans_w)


# ---------------------------------------------------------------------------
# References, FLOPs and bytes
# ---------------------------------------------------------------------------


def _host_sizes(group_sizes: torch.Tensor) -> list[int]:
    return [int(s) for s in group_sizes.detach().cpu().tolist()]


def reference(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *, trans_w: bool = False,
              dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Per-group torch matmuls in `dtype` (fp64 by default; fp32 on CUDA is fine too)."""
    M = x.shape[0]
    N = w.shape[1] if trans_w else w.shape[2]
    out = torch.zeros((M, N), dtype=dtype, device=x.device)
    start = 0
    for g, m in enumerate(_host_sizes(group_sizes)):
        if m:
            wg = w[g].to(dtype)
            out[start:start + m] = x[start:start + m].to(dtype) @ (wg.T if trans_w else wg)
        start += m
    return out


def reference_wgrad(x: torch.Tensor, dy: torch.Tensor, group_sizes: torch.Tensor, *,
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """dw[g] = x_g.T @ dy_g per group in `dtype`; zeros for empty groups."""
    sizes = _host_sizes(group_sizes)
    out = torch.zeros((len(sizes), x.shape[1], dy.shape[1]), dtype=dtype, device=x.device)
    start = 0
    for g, m in enumerate(sizes):
        if m:
            out[g] = x[start:start + m].to(dtype).T @ dy[start:start + m].to(dtype)
        start += m
    return out


def flops(total_tokens: int, N: int, K: int) -> int:
    """FLOPs of one grouped GEMM (fwd, dgrad or wgrad alike): 2 * M * N * K."""
    return 2 * int(total_tokens) * int(N) * int(K)


def bytes_moved(op: str, total_tokens: int, G: int, N: int, K: int, elem_bytes: int = 2,
                active_groups: int | None = None) -> int:
    """The fewest bytes an op must move: each operand read once, the result written once.

    (N, K) are the layer's: forward reads x [M, K] and w [G, K, N] and writes
    [M, N]; dgrad reads dy [M, N] and w and writes dx [M, K]; wgrad reads x and
    dy and writes dw [G, K, N]. Experts with no tokens need not read their
    weight in fwd/dgrad (pass active_groups to count that).
    """
    M = int(total_tokens)
    gw = G if active_groups is None else active_groups
    if op in ("fwd", "dgrad"):
        return elem_bytes * (M * K + gw * K * N + M * N)
    if op == "wgrad":
        return elem_bytes * (M * K + M * N + G * K * N)
    raise ValueError(f"op must be fwd, dgrad or wgrad, got {op!r}")


# ---------------------------------------------------------------------------
# Cross-compilation (no GPU needed): read the assembly the compiler produces
# ---------------------------------------------------------------------------

def compile_for_target(op: str = "fwd", *, dtype: torch.dtype = torch.bfloat16,
                       config: GemmConfig | None = None, arch: int = 90, G: int = 32, N: int | None = None):
    """Compile one kernel variant with Triton for `sm_{arch}` without a GPU.

    op: 'fwd', 'dgrad' (the trans_w variant) or 'wgrad'. N (fwd/dgrad: the output
    width), when given, decides the narrow tail strip (`tail_width`). Returns Triton's
    CompiledKernel; its ``asm`` dict holds 'ttgir', 'ptx' (and 'cubin').
    Integer arguments are marked 16-divisible as they are at the seed's shapes.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    cfg = config or _DEFAULT[op]
    use_tma = cfg.USE_TMA is not False and arch >= 90
    from workbench.dtypes import triton_type

    t = triton_type(dtype)
    BM, BN, BK = cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K
    sub = cfg.EPI_SUBTILE and use_tma
    common = dict(USE_TMA=use_tma, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.GROUP_M,
                  G_PAD=max(64, triton.next_power_of_2(G)),
                  EPI_SUBTILE=sub, FLATTEN=cfg.FLATTEN, DOT_PRECISION=_dot_precision(dtype))
    if op in ("fwd", "dgrad"):
        fn = _grouped_mm_kernel
        trans = op == "dgrad"
        sig = {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "out_ptr": f"*{t}", "sizes_ptr": "*i32",
               "M_total": "i32", "N": "i32", "K": "i32", "G": "i32",
               "stride_xm": "i32", "stride_wg": "i32", "stride_wk": "i32", "stride_wn": "i32",
               "stride_om": "i32", "NUM_PROGRAMS": "i32"}
        tail = tail_width(N, BN) if N and cfg.NARROW_TAIL else 0
        constexprs = dict(common, TRANS_W=trans, EVEN_K=True, TAIL_N=tail)
        if use_tma:
            sig["x_desc"] = f"tensordesc<{t}[{BM}, {BK}]>"
            sig["w_desc"] = f"tensordesc<{t}[1, {BN}, {BK}]>" if trans else f"tensordesc<{t}[1, {BK}, {BN}]>"
            sig["out_desc"] = f"tensordesc<{t}[1, 1, {BM}, {BN // 2 if sub else BN}]>"
        else:
            constexprs.update(x_desc=None, w_desc=None, out_desc=None)
        if use_tma and tail:
            sig["w_tail_desc"] = (f"tensordesc<{t}[1, {tail}, {BK}]>" if trans
                                  else f"tensordesc<{t}[1, {BK}, {tail}]>")
            sig["out_tail_desc"] = f"tensordesc<{t}[1, 1, {BM}, {tail}]>"
        else:
            constexprs.update(w_tail_desc=None, out_tail_desc=None)
        # trans: w is [G, N, K] so its K stride is 1
        if trans:
            constexprs["stride_wk"] = 1
            del sig["stride_wk"]
        else:
            constexprs["stride_wn"] = 1
            del sig["stride_wn"]
        divisible = ["x_ptr", "w_ptr", "out_ptr", "sizes_ptr", "N", "K", "stride_xm", "stride_wg",
                     "stride_om", "stride_wn" if trans else "stride_wk"]
    elif op == "wgrad":
        fn = _grouped_mm_wgrad_kernel
        sig = {"x_ptr": f"*{t}", "dy_ptr": f"*{t}", "dw_ptr": f"*{t}", "sizes_ptr": "*i32",
               "M_total": "i32", "K": "i32", "N": "i32", "G": "i32",
               "stride_xm": "i32", "stride_dym": "i32", "stride_dwg": "i32", "stride_dwk": "i32",
               "NUM_PROGRAMS": "i32"}
        constexprs = dict(common)
        if use_tma:
            sig["x_desc"] = f"tensordesc<{t}[1, 1, {BK}, {BM}]>"
            sig["dy_desc"] = f"tensordesc<{t}[1, 1, {BK}, {BN}]>"
            sig["dw_desc"] = f"tensordesc<{t}[1, {BM}, {BN // 2 if sub else BN}]>"
        else:
            constexprs.update(x_desc=None, dy_desc=None, dw_desc=None)
        divisible = ["x_ptr", "dy_ptr", "dw_ptr", "sizes_ptr", "K", "N", "stride_xm", "stride_dym",
                     "stride_dwg", "stride_dwk"]
    else:
        raise ValueError(f"op must be fwd, dgrad or wgrad, got {op!r}")
    from triton.runtime.jit import JITFunction

    if not isinstance(fn, JITFunction):
        raise RuntimeError("compile_for_target: this process imported triton with TRITON_INTERPRET=1, "
                           "so the kernels are interpreted functions; cross-compile in a process without it")
    for name, value in constexprs.items():
        sig[name] = "constexpr"
    ordered = {name: sig[name] for name in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=ordered, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})
