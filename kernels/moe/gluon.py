"""Gluon kernel of the warp-specialised, persistent Hopper grouped GEMM (MoE
forward and dgrad; see ``kernels.moe`` for the tile schedule, the operands and
what Gluon took and refused).

The producer / consumer design of ``kernels.gemm.gluon`` (read its docstring
for the synchronisation): every CTA runs a 1-warp TMA producer that fills a
``NUM_STAGES``-deep ring of (x box, w box) stages guarded by ready/empty
mbarriers, and either two 4-warp consumer warpgroups on alternate 128x128
tiles ("ping-pong") or one 8-warp consumer on 128x256 tiles ("cooperative").
Every partition that needs the schedule loads the ``G`` group sizes and builds
their prefix sums in registers (``gl.associative_scan``), laid out over the 32
lanes of a warp and replicated across warps, so every reduction stays inside
a warp. ``descriptors`` builds the three host-side descriptors it takes: x
[M, K] in [BM, BK] boxes, w in [1, BK, BN] ([1, BN, BK] for dgrad) boxes, and
the row-window descriptor of out (``kernels.moe.triton.row_window``).

Narrow last column strip (N = 2880 in 128-wide tiles: 22.5 tiles): not
special-cased. The last strip's tiles are computed 128 wide, the TMA engine
zero-fills the missing w columns and drops the out columns past N: 1/23 of the
tiles do half useless work, about 2% of the MMA work at N = 2880.

``_grouped_gemm_ws_dev_kernel`` is the same kernel with device descriptors
(see ``kernels.gemm.gluon``): pointers and strides in, the producer encodes x's
and w's descriptors and each consumer out's row window, once per program.
"""
from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from kernels.gemm import gluon as dense_gluon
from kernels.moe.triton import row_window

# The dense kernel's descriptor type, layouts and shared state hold here too.
TensorDescriptor = dense_gluon.TensorDescriptor
_layout, _desc_type = dense_gluon.layout, dense_gluon.desc_type
_acc_layout = dense_gluon._acc_layout  # warps stacked along M, the whole BLOCK_N in one wgmma


# --------------------------------------------------------------------------
# Gluon kernel
# --------------------------------------------------------------------------
@gluon.constexpr_function
def _vec_layout(g_pad, num_warps):
    # 1-D vectors of G_PAD (>= 32) entries: G_PAD / 32 per lane, the 32 lanes of a
    # warp covering them all, so every warp holds a whole copy (the warps'
    # share of the layout is broadcast) and scans and reductions stay in a warp.
    return gl.BlockedLayout([g_pad // 32], [32], [num_warps], [0])


# Combine functions of our own for the scans and reductions: gl.sum / gl.max / gl.min
# are Triton's @triton.jit functions, which TRITON_INTERPRET=1 (set for the CPU test
# suite) turns into interpreter objects that a Gluon compile then refuses
# ("Unsupported function referenced: InterpretedFunction").
@gluon.jit
def _add(a, b):
    return a + b


@gluon.jit
def _max(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _min(a, b):
    return gl.minimum(a, b)


@gluon.jit
def _schedule(sizes_ptr, G, M_total, num_n_tiles, BLOCK_M: gl.constexpr, G_PAD: gl.constexpr):
    """(row_ends, tile_ends, total tiles): cumulative rows and tiles of groups
    0..g (padding entries repeat the totals). Sizes are clipped at 0 and the
    groups at M_total, as the Triton kernels (kernels.moe.triton) do."""
    layout: gl.constexpr = _vec_layout(G_PAD, gl.num_warps())
    gi = gl.arange(0, G_PAD, layout=layout)
    sizes = gl.load(sizes_ptr + gi, mask=gi < G, other=0).to(gl.int32)
    sizes = gl.maximum(sizes, 0)
    cum = gl.associative_scan(sizes, 0, _add)
    row_ends = gl.minimum(cum, M_total)
    rows = row_ends - gl.minimum(cum - sizes, M_total)
    tile_ends = gl.associative_scan((rows + BLOCK_M - 1) // BLOCK_M * num_n_tiles, 0, _add)
    return row_ends, tile_ends, gl.reduce(tile_ends, 0, _max)


@gluon.jit
def _locate(t, row_ends, tile_ends, num_n_tiles, group_m, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """Tile t -> (group, its first row, its rows, row offset in the group, column offset).

    Groups 0..g-1 are those whose tiles end at or before t (empty groups too);
    cumulative counts never decrease, so the group's first row is the largest
    row end among them and its last row the smallest among the others."""
    before = tile_ends <= t
    g = gl.reduce(before.to(gl.int32), 0, _add)
    tile0 = gl.reduce(gl.where(before, tile_ends, 0), 0, _max)
    row0 = gl.reduce(gl.where(before, row_ends, 0), 0, _max)
    m_g = gl.reduce(gl.where(before, 2147483647, row_ends), 0, _min) - row0
    # GROUP_M-row bands inside the group (kernels.gemm.gluon._tile_coords).
    local = t - tile0
    num_pid_m = (m_g + BLOCK_M - 1) // BLOCK_M
    band = local // (group_m * num_n_tiles)
    first_m = band * group_m
    rows_in_band = gl.minimum(num_pid_m - first_m, group_m)
    inside = local - band * (group_m * num_n_tiles)
    return g, row0, m_g, (first_m + inside % rows_in_band) * BLOCK_M, (inside // rows_in_band) * BLOCK_N


@gluon.jit
def _b_view(b_bufs, s, TRANS_W: gl.constexpr):
    """Stage s of the w ring as wgmma's [BK, BN] B operand: the box is [1, BK, BN],
    or [1, BN, BK] (K-major) for trans_w, read through the transposed view."""
    if TRANS_W:
        BLOCK_N: gl.constexpr = b_bufs.shape[2]
        BLOCK_K: gl.constexpr = b_bufs.shape[3]
        return b_bufs.index(s).reshape([BLOCK_N, BLOCK_K]).permute([1, 0])
    else:
        BLOCK_K: gl.constexpr = b_bufs.shape[2]
        BLOCK_N: gl.constexpr = b_bufs.shape[3]
        return b_bufs.index(s).reshape([BLOCK_K, BLOCK_N])


@gluon.jit
def _producer(x_desc, w_desc, sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, ready, empty,
              NUM_STAGES: gl.constexpr, TRANS_W: gl.constexpr, G_PAD: gl.constexpr):
    """Every K-step of every tile of this CTA, in order, into the ring."""
    BLOCK_M: gl.constexpr = x_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = w_desc.block_type.shape[1] if TRANS_W else w_desc.block_type.shape[2]
    STAGE_BYTES: gl.constexpr = x_desc.block_type.nbytes + w_desc.block_type.nbytes
    K = x_desc.shape[1]
    N = w_desc.shape[1] if TRANS_W else w_desc.shape[2]
    num_n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    k_steps = (K + BLOCK_K - 1) // BLOCK_K
    row_ends, tile_ends, total = _schedule(sizes_ptr, G, M_total, num_n_tiles, BLOCK_M, G_PAD)
    counter = 0  # ring position: stage counter % NUM_STAGES, fill counter // NUM_STAGES
    for t in range(gl.program_id(0), total, gl.num_programs(0)):
        g, row0, m_g, off_m, off_n = _locate(t, row_ends, tile_ends, num_n_tiles, group_m, BLOCK_M, BLOCK_N)
        for kk in range(k_steps):
            s = counter % NUM_STAGES
            # A fresh mbarrier counts as having completed the phase before phase 0.
            mbarrier.wait(empty.index(s), ((counter // NUM_STAGES) & 1) ^ 1)
            mbarrier.expect(ready.index(s), STAGE_BYTES)  # whole boxes, zero-filled past the edges
            tma.async_copy_global_to_shared(x_desc, [row0 + off_m, kk * BLOCK_K], ready.index(s), a_bufs.index(s))
            if TRANS_W:
                tma.async_copy_global_to_shared(w_desc, [g, off_n, kk * BLOCK_K], ready.index(s), b_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(w_desc, [g, kk * BLOCK_K, off_n], ready.index(s), b_bufs.index(s))
            counter += 1


@gluon.jit
def _mainloop(a_bufs, b_bufs, ready, empty, counter, k_steps, acc_layout: gl.constexpr,
              NUM_STAGES: gl.constexpr, TRANS_W: gl.constexpr):
    """One tile's wgmma loop from ring position `counter` (kernels.gemm.gluon._mainloop,
    with the B view of _b_view); the last wgmma is left pending."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.shape[2] if TRANS_W else b_bufs.shape[3]
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    for kk in range(k_steps):
        s = counter % NUM_STAGES
        mbarrier.wait(ready.index(s), (counter // NUM_STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(s), _b_view(b_bufs, s, TRANS_W), acc, is_async=True)
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((counter + NUM_STAGES - 1) % NUM_STAGES), pred=kk > 0)
        counter += 1
    return acc


@gluon.jit
def _consumer(x_desc, w_desc, out_desc, sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, c_bufs,
              ready, empty, order, WHICH: gl.constexpr, NUM_CONSUMERS: gl.constexpr,
              NUM_STAGES: gl.constexpr, TRANS_W: gl.constexpr, G_PAD: gl.constexpr):
    """The CTA's tiles WHICH, WHICH + NUM_CONSUMERS, ...: mainloop, then the epilogue
    through the row-window descriptor (rows past the group are dropped)."""
    _consumer_tiles(out_desc, x_desc.shape[1], sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, c_bufs, ready, empty,
                    order, WHICH, NUM_CONSUMERS, NUM_STAGES, TRANS_W, G_PAD)


@gluon.jit
def _consumer_tiles(out_desc, K, sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, c_bufs, ready, empty, order,
                    WHICH: gl.constexpr, NUM_CONSUMERS: gl.constexpr, NUM_STAGES: gl.constexpr,
                    TRANS_W: gl.constexpr, G_PAD: gl.constexpr):
    """``_consumer``'s work, given the reduction length K (x's columns)."""
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[3]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]   # the x ring: [NUM_STAGES, BM, BK]
    dtype: gl.constexpr = out_desc.dtype
    acc_layout: gl.constexpr = _acc_layout(BLOCK_N, dtype.primitive_bitwidth, gl.num_warps())
    c_smem = c_bufs.index(WHICH)  # [1, 1, BM, BN], the descriptor's layout
    c_view = c_smem.reshape([BLOCK_M, BLOCK_N])
    N = out_desc.shape[3]
    num_n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    k_steps = (K + BLOCK_K - 1) // BLOCK_K
    row_ends, tile_ends, total = _schedule(sizes_ptr, G, M_total, num_n_tiles, BLOCK_M, G_PAD)
    grid = gl.num_programs(0)
    j = 0  # tiles this consumer has done
    for t in range(gl.program_id(0) + WHICH * grid, total, NUM_CONSUMERS * grid):
        g, row0, m_g, off_m, off_n = _locate(t, row_ends, tile_ends, num_n_tiles, group_m, BLOCK_M, BLOCK_N)
        start = (NUM_CONSUMERS * j + WHICH) * k_steps  # stages the producer filled before this tile
        if NUM_CONSUMERS == 2:
            mbarrier.wait(order.index(WHICH), (j & 1) ^ (1 - WHICH))
        acc = _mainloop(a_bufs, b_bufs, ready, empty, start, k_steps, acc_layout, NUM_STAGES, TRANS_W)
        if NUM_CONSUMERS == 2:
            mbarrier.arrive(order.index(1 - WHICH))  # all our wgmma issued: the other may start
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((start + k_steps - 1) % NUM_STAGES))
        tma.store_wait(0)  # our previous store has read c_smem
        c_view.store(acc.to(dtype))
        fence_async_shared()
        tma.async_copy_shared_to_global(out_desc, [1 << 30, row0 + m_g, (1 << 30) - m_g + off_m, off_n], c_smem)
        j += 1
    tma.store_wait(0)


@gluon.jit(do_not_specialize=["M_total", "G"])
def _grouped_gemm_ws_kernel(x_desc, w_desc, out_desc, sizes_ptr, M_total, G, group_m,
                            NUM_STAGES: gl.constexpr, COOPERATIVE: gl.constexpr, TRANS_W: gl.constexpr,
                            G_PAD: gl.constexpr, CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    NUM_CONSUMERS: gl.constexpr = 1 if COOPERATIVE else 2
    a_bufs, b_bufs, c_bufs, ready, empty, order = dense_gluon._shared_state(x_desc, w_desc, out_desc, NUM_STAGES,
                                                                      NUM_CONSUMERS)

    if COOPERATIVE:
        gl.warp_specialize([
            (_consumer, (x_desc, w_desc, out_desc, sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, c_bufs,
                         ready, empty, order, 0, NUM_CONSUMERS, NUM_STAGES, TRANS_W, G_PAD)),
            (_producer, (x_desc, w_desc, sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, ready, empty,
                         NUM_STAGES, TRANS_W, G_PAD)),
        ], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (x_desc, w_desc, out_desc, sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, c_bufs,
                         ready, empty, order, 0, NUM_CONSUMERS, NUM_STAGES, TRANS_W, G_PAD)),
            (_consumer, (x_desc, w_desc, out_desc, sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, c_bufs,
                         ready, empty, order, 1, NUM_CONSUMERS, NUM_STAGES, TRANS_W, G_PAD)),
            (_producer, (x_desc, w_desc, sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, ready, empty,
                         NUM_STAGES, TRANS_W, G_PAD)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])



# --------------------------------------------------------------------------
# The same kernel with device descriptors
# --------------------------------------------------------------------------
@gluon.jit
def _producer_dev(x_ptr, w_ptr, M_total, N, K, G, stride_xm, stride_wg, stride_w1, sizes_ptr, group_m, a_bufs, b_bufs,
                  ready, empty, NUM_STAGES: gl.constexpr, TRANS_W: gl.constexpr, G_PAD: gl.constexpr):
    """``_producer``, with the descriptors of x and w encoded by this partition (the
    warp that issues the TMA loads wrote and acquired them)."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    W_BOX_1: gl.constexpr = b_bufs.shape[2]   # BK ([1, BK, BN] boxes), or BN for trans_w ([1, BN, BK])
    W_BOX_2: gl.constexpr = b_bufs.shape[3]
    x_desc = tma.make_tensor_descriptor(x_ptr, [M_total, K], [stride_xm, 1], [BLOCK_M, BLOCK_K], a_bufs.layout)
    if TRANS_W:   # w: [G, N, K]
        w_desc = tma.make_tensor_descriptor(w_ptr, [G, N, K], [stride_wg, stride_w1, 1], [1, W_BOX_1, W_BOX_2],
                                            b_bufs.layout)
    else:         # w: [G, K, N]
        w_desc = tma.make_tensor_descriptor(w_ptr, [G, K, N], [stride_wg, stride_w1, 1], [1, W_BOX_1, W_BOX_2],
                                            b_bufs.layout)
    _producer(x_desc, w_desc, sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, ready, empty, NUM_STAGES, TRANS_W,
              G_PAD)


@gluon.jit
def _consumer_dev(out_ptr, N, K, stride_om, sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, c_bufs, ready, empty,
                  order, WHICH: gl.constexpr, NUM_CONSUMERS: gl.constexpr, NUM_STAGES: gl.constexpr,
                  TRANS_W: gl.constexpr, G_PAD: gl.constexpr):
    """``_consumer``, with out's row-window descriptor (``kernels.moe.triton.row_window``:
    shape [0x7FFF0000, 0x7FFF0000, 2**30, N], strides [2**34 - s, s, s, 1]) encoded by
    this consumer itself."""
    BLOCK_M: gl.constexpr = c_bufs.shape[3]
    BLOCK_N: gl.constexpr = c_bufs.shape[4]
    s = stride_om.to(gl.int64)
    out_desc = tma.make_tensor_descriptor(out_ptr, [0x7FFF0000, 0x7FFF0000, 1 << 30, N], [(1 << 34) - s, s, s, 1],
                                          [1, 1, BLOCK_M, BLOCK_N], c_bufs.layout)
    _consumer_tiles(out_desc, K, sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, c_bufs, ready, empty, order,
                    WHICH, NUM_CONSUMERS, NUM_STAGES, TRANS_W, G_PAD)


@gluon.jit(do_not_specialize=["M_total", "G"])
def _grouped_gemm_ws_dev_kernel(x_ptr, w_ptr, out_ptr, sizes_ptr, M_total, N, K, G, stride_xm, stride_wg, stride_w1,
                                stride_om, group_m, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                BLOCK_K: gl.constexpr, NUM_STAGES: gl.constexpr, COOPERATIVE: gl.constexpr,
                                TRANS_W: gl.constexpr, G_PAD: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                                PRODUCER_REGS: gl.constexpr):
    """``_grouped_gemm_ws_kernel`` with device descriptors: x [M_total, K], w [G, K, N]
    ([G, N, K] with TRANS_W; ``stride_w1`` is its middle stride) and out (row stride
    ``stride_om``) arrive as pointers, and every partition encodes the descriptors it
    issues TMA copies with (once per program, 128 bytes of the launcher's global
    scratch each: x and w in the producer, out's row window in each consumer). Same
    boxes, layouts, ring and schedule as the host-descriptor kernel."""
    NUM_CONSUMERS: gl.constexpr = 1 if COOPERATIVE else 2
    dtype: gl.constexpr = x_ptr.dtype.element_ty
    W_BOX: gl.constexpr = [1, BLOCK_N, BLOCK_K] if TRANS_W else [1, BLOCK_K, BLOCK_N]
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K],
                                       dense_gluon._smem_layout([BLOCK_M, BLOCK_K], dtype))
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + W_BOX, dense_gluon._smem_layout(W_BOX, dtype))
    c_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, 1, 1, BLOCK_M, BLOCK_N],
                                       dense_gluon._smem_layout([1, 1, BLOCK_M, BLOCK_N], dtype))
    ready, empty, order = dense_gluon._barriers(NUM_STAGES)

    if COOPERATIVE:
        gl.warp_specialize([
            (_consumer_dev, (out_ptr, N, K, stride_om, sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, c_bufs,
                             ready, empty, order, 0, NUM_CONSUMERS, NUM_STAGES, TRANS_W, G_PAD)),
            (_producer_dev, (x_ptr, w_ptr, M_total, N, K, G, stride_xm, stride_wg, stride_w1, sizes_ptr, group_m,
                             a_bufs, b_bufs, ready, empty, NUM_STAGES, TRANS_W, G_PAD)),
        ], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer_dev, (out_ptr, N, K, stride_om, sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, c_bufs,
                             ready, empty, order, 0, NUM_CONSUMERS, NUM_STAGES, TRANS_W, G_PAD)),
            (_consumer_dev, (out_ptr, N, K, stride_om, sizes_ptr, M_total, G, group_m, a_bufs, b_bufs, c_bufs,
                             ready, empty, order, 1, NUM_CONSUMERS, NUM_STAGES, TRANS_W, G_PAD)),
            (_producer_dev, (x_ptr, w_ptr, M_total, N, K, G, stride_xm, stride_wg, stride_w1, sizes_ptr, group_m,
                             a_bufs, b_bufs, ready, empty, NUM_STAGES, TRANS_W, G_PAD)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------
# Host-side descriptors
# --------------------------------------------------------------------------
def descriptor_recipes(x_shape, x_strides, w_shape, w_strides, out_rows: int, out_cols: int, out_stride: int,
                       dtype: torch.dtype, config, trans_w: bool) -> tuple:
    """(operand, shape, strides, block, layout) of the kernel's three descriptors for a
    ``GroupedWsConfig``: x [M, K] (operand 0) in [BM, BK] boxes, w (operand 1) in
    [1, BK, BN] boxes ([1, BN, BK] for trans_w) and the row-window view of out
    (operand 2). Everything but the base pointers, so a launch plan can keep it."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    x_block = [bm, bk]
    w_block = [1, bn, bk] if trans_w else [1, bk, bn]
    out_block = [1, 1, bm, bn]
    return ((0, list(x_shape), list(x_strides), x_block, _layout(dtype, x_block)),
            (1, list(w_shape), list(w_strides), w_block, _layout(dtype, w_block)),
            (2, *row_window(out_rows, out_cols, out_stride, "grouped_gemm_ws"), out_block, _layout(dtype, out_block)))


def build(recipes: tuple, operands: tuple) -> list:
    """The descriptors of ``recipes`` over these operands (the only per-call part)."""
    return [TensorDescriptor(operands[r[0]], *r[1:]) for r in recipes]


def descriptors(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config, trans_w: bool) -> list:
    """The kernel's three host-side descriptors (``descriptor_recipes``) over x, w, out."""
    recipes = descriptor_recipes(x.shape, x.stride(), w.shape, w.stride(), out.shape[0], out.shape[1],
                                 out.stride(0), x.dtype, config, trans_w)
    return build(recipes, (x, w, out))
