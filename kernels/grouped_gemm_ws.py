"""Warp-specialised, persistent Hopper grouped GEMM in Gluon (MoE forward and dgrad).

The grouped GEMM of ``kernels.grouped_gemm`` (``x`` [sum(sizes), K] split into
``G`` row groups, group ``g`` times its own weight):

* forward ``out[rows_g] = x[rows_g] @ w[g]``     (``w`` [G, K, N])
* dgrad   ``out[rows_g] = dy[rows_g] @ w[g].T``  (``trans_w=True``, ``w`` [G, N, K])

with the producer / consumer design of ``kernels.gemm.gluon`` (read its docstring
for the synchronisation): every CTA runs a 1-warp TMA producer that fills a
``NUM_STAGES``-deep ring of (x box, w box) stages guarded by ready/empty
mbarriers, and either two 4-warp consumer warpgroups on alternate 128x128
tiles ("ping-pong", with the order barrier that makes their mainloops
alternate and keeps the shared ring's parity waits correct) or one 8-warp
consumer on 128x256 tiles ("cooperative"). wgrad is not here.

Grouped tile schedule (as ``kernels.grouped_gemm``). The group sizes stay on
the GPU: every partition that needs the schedule (the producer and each
consumer) loads the ``G`` sizes, builds their prefix sums in registers
(``gl.associative_scan``) and maps a tile index to its group by comparing it
with the cumulative tile counts. Tiles are numbered expert by expert, with a
GROUP_M-row swizzle inside each expert; CTA ``p`` of ``grid`` takes tiles
``p, p + grid, ...`` (ping-pong: consumer ``c`` its CTA's tiles ``c, c + 2,
...``). Producer and consumers run the same integer arithmetic on the same
sizes, so they agree on the tile sequence; the consumers' mainloops need only
the number of K-steps (the same for every tile), the coordinates are needed
for the epilogue. The sizes vectors are laid out over the 32 lanes of a warp
and replicated across warps, so every reduction stays inside a warp (no shared
memory, no barrier in the consumer warpgroups).

Operands, through TMA:

* x: a 2-D descriptor over [M, K], loaded at row ``group start + off_m``;
  rows past the group belong to the next group (their output rows are
  dropped), rows past M and columns past K read as zeros;
* w: a 3-D descriptor over the stored [G, K, N] (boxes [1, BK, BN]) or, for
  dgrad, [G, N, K] (boxes [1, BN, BK], K-major: wgmma reads the permuted
  shared-memory view, ``permute([1, 0])``, as its B operand);
* out: the 4-D "row-window" descriptor of ``kernels.grouped_gemm``
  (``_row_window_desc``): a store at ``(2**30, lo + n, 2**30 - n + i, c)``
  lands on row ``lo + i`` and the hardware drops rows ``i >= n``, so a tile
  never writes past its group. The C staging buffer is allocated with the
  descriptor's rank-4 layout ([1, 1, BM, BN]); the registers are stored into
  its rank-2 view (``reshape``).

Narrow last column strip (N = 2880 in 128-wide tiles: 22.5 tiles): not
special-cased. The last strip's tiles are computed 128 wide, the TMA engine
zero-fills the missing w columns and drops the out columns past N: 1/23 of the
tiles do half useless work, about 2% of the MMA work at N = 2880.

Shared memory: ``NUM_STAGES * (BM*BK + BK*BN) * 2`` bytes for the ring, one
``BM*BN*2``-byte C buffer per consumer, mbarriers and Triton's
warp-specialisation state (``smem_bytes``). Registers: 12 warps (384 threads,
``maxnreg`` 168 at launch), ``setmaxnreg`` moves them to the consumers
(default 232 each, producer 40), as ``kernels.gemm.gluon``.

What Gluon (Triton 3.6) took and refused, found while writing this:

* accepted: a rank-3 NVMMA ring ([NUM_STAGES, 1, BK, BN]) filled by 3-D TMA
  loads, viewed as [BK, BN] with ``.index(s).reshape(...)`` (and
  ``.permute([1, 0])`` for dgrad: Triton infers the transposed NVMMA layout and
  wgmma takes it as B); a rank-4 C buffer [1, 1, BM, BN] written through its
  ``reshape([BM, BN])`` view (stmatrix) and stored with a 4-D TMA store;
  ``gl.associative_scan`` and ``gl.reduce`` on a 1-D BlockedLayout whose warps
  are broadcast (shuffles and redux.sync, no shared memory);
* refused: ``gl.associative_scan`` on a SliceLayout vector ("TODO: unsupported
  scan layout" when lowering to LLVM); ``gl.sum`` / ``gl.max`` / ``gl.min``
  under TRITON_INTERPRET=1 ("Unsupported function referenced:
  InterpretedFunction": they are Triton @jit functions), hence the combine
  functions below.

Refused, with a ValueError pointing to ``kernels.grouped_gemm.grouped_gemm``:
CPU tensors, GPUs other than sm_90, Triton's interpreter (Gluon has none),
fp32, K or N not multiples of 8 (16-byte TMA row strides), more than
``MAX_GROUPS`` groups, strides the TMA engine cannot take.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

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

from kernels.common import cuda_context, interpreter
from kernels.gemm import config as dense, gluon as dense_gluon
from kernels.gemm.launch import _capability, _sm_count, _tma_ok, prepare_output
from kernels.gemm.sweep import tolerance  # noqa: F401  (this module's protocol name)
from workbench.dtypes import triton_type

# The dense kernel's limits and config helpers hold here too (same partitions,
# registers, ring and staging buffers): kernels.gemm.config / kernels.gemm.gluon.
DTYPES, SMEM_LIMIT_SM90, TOTAL_WARPS, MAXNREG, WS_EXTRA_SMEM = (
    dense.WS_DTYPES, dense.SMEM_LIMIT_SM90, dense.TOTAL_WARPS, dense.MAXNREG, dense.WS_EXTRA_SMEM)
num_consumers, num_warps = dense.num_consumers, dense.num_warps
default_partition_regs, consumer_regs_of = dense.default_partition_regs, dense.consumer_regs_of
_gl_dtype, TensorDescriptor = dense_gluon._gl_dtype, dense_gluon.TensorDescriptor
_layout, _desc_type = dense_gluon.layout, dense_gluon.desc_type
_acc_layout = dense_gluon._acc_layout  # warps stacked along M, the whole BLOCK_N in one wgmma
MAX_GROUPS = 512  # G_PAD / 32 registers per sizes vector; the 40-register producer spills at G_PAD = 1024
_WINDOW = 1 << 30  # rows a row-window descriptor can address past its base
_FALLBACK = "use kernels.grouped_gemm.grouped_gemm instead"


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
    groups at M_total, as kernels.grouped_gemm does."""
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
    BLOCK_M: gl.constexpr = out_desc.block_type.shape[2]
    BLOCK_N: gl.constexpr = out_desc.block_type.shape[3]
    BLOCK_K: gl.constexpr = x_desc.block_type.shape[1]
    dtype: gl.constexpr = out_desc.dtype
    acc_layout: gl.constexpr = _acc_layout(BLOCK_N, dtype.primitive_bitwidth, gl.num_warps())
    c_smem = c_bufs.index(WHICH)  # [1, 1, BM, BN], the descriptor's layout
    c_view = c_smem.reshape([BLOCK_M, BLOCK_N])
    K = x_desc.shape[1]
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
# Configuration
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GroupedWsConfig(dense.WsConfig):
    """``kernels.gemm.gluon.WsConfig``'s knobs; 5 stages by default (the probe's best
    on the seed layers); group_m: rows of tiles per L2 band inside an expert."""

    num_stages: int = 5
    WHO = "grouped_gemm_ws"  # the name errors about this config start with


def smem_bytes(config: GroupedWsConfig | Mapping[str, Any] | None = None, elem_bytes: int = 2) -> int:
    """Shared memory per CTA (an upper bound), as ``kernels.gemm.gluon.smem_bytes``."""
    return dense.ws_smem_bytes(config, elem_bytes, GroupedWsConfig)


def validate(config: GroupedWsConfig | Mapping[str, Any] | None) -> GroupedWsConfig:
    """The config, or a ValueError naming the knob that cannot work."""
    return dense.validate_ws(config, GroupedWsConfig)


def g_pad(G: int) -> int:
    """Entries of the in-register sizes vectors (a power of two >= 32, the lanes of a warp)."""
    check_groups(G)
    return max(32, 1 << (G - 1).bit_length())


def check_groups(G: int) -> None:
    if not isinstance(G, int) or G < 1 or G > MAX_GROUPS:
        raise ValueError(f"grouped_gemm_ws: G={G!r} groups; this kernel takes 1 to {MAX_GROUPS} (the sizes live "
                         f"in registers of every partition); {_FALLBACK}, which takes up to 4096")


def check_alignment(N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """ValueError unless the TMA engine can address x [M, K], w and out [M, N]
    packed row-major: 16-byte row strides, so K and N multiples of 8 (16-bit)."""
    per16 = 16 // dtype.itemsize
    if K % per16 or N % per16:
        raise ValueError(f"grouped_gemm_ws: K={K} and N={N} must be multiples of {per16} for {dtype} (TMA needs "
                         f"16-byte aligned row strides); {_FALLBACK}, which handles any shape")


# --------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------
def row_window(t: torch.Tensor, who: str = "grouped_gemm_ws") -> tuple[list[int], list[int]]:
    """(shape, strides) of the 4-D row-window view of a 2-D row-major tensor (see
    kernels.grouped_gemm._row_window_desc): dims (a, b, r, c), strides
    (2**34 - s, s, s, 1); (2**30, lo + n, 2**30 - n + i, c) is element (lo + i, c)
    and rows i >= n are out of bounds (zero-filled on loads, dropped on stores)."""
    rows, cols = t.shape
    if rows > _WINDOW:
        raise ValueError(f"{who}: at most {_WINDOW} rows, got {rows}")
    s = t.stride(0)
    return [0x7FFF0000, 0x7FFF0000, _WINDOW, cols], [2**34 - s, s, s, 1]


def _row_window_desc(t: torch.Tensor, block_rows: int, block_cols: int):
    """The row-window descriptor as a Gluon one (it carries the shared-memory layout
    of its [1, 1, block_rows, block_cols] box)."""
    block = [1, 1, block_rows, block_cols]
    return TensorDescriptor(t, *row_window(t), block, _layout(t.dtype, block))


def _check_device(device: torch.device) -> None:
    """ValueError unless device is a CUDA device of compute capability 9.x."""
    if device.type != "cuda":
        raise ValueError(f"grouped_gemm_ws: tensors on {device}: this kernel needs an sm_90 (Hopper) CUDA GPU; "
                         f"{_FALLBACK}")
    cap = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if cap[0] != 9:
        raise ValueError(f"grouped_gemm_ws: this kernel needs an sm_90 (Hopper) GPU, found sm_{cap[0]}{cap[1]} "
                         f"(wgmma and setmaxnreg as used here are Hopper's); {_FALLBACK}")


def _check_operands(x, w, group_sizes, trans_w: bool) -> tuple[int, int, int, int]:
    """(M, N, K, G) of valid operands, else a ValueError naming the fallback."""
    if interpreter.active():
        raise ValueError("grouped_gemm_ws: Gluon kernels do not run in Triton's interpreter (TRITON_INTERPRET=1 "
                         f"is set); {_FALLBACK}")
    for name, t in (("x", x), ("w", w), ("group_sizes", group_sizes)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"grouped_gemm_ws: {name} must be a torch.Tensor, got {type(t).__name__}")
    layout = "[G, N, K]" if trans_w else "[G, K, N]"
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_gemm_ws: need x [M, K] and w {layout}, got x{tuple(x.shape)} and w{tuple(w.shape)}")
    if group_sizes.dim() != 1 or group_sizes.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_gemm_ws: group_sizes must be a 1-D int32 or int64 tensor, got "
                         f"{group_sizes.dtype} of shape {tuple(group_sizes.shape)}")
    if x.dtype != w.dtype or x.dtype not in DTYPES:
        raise ValueError(f"grouped_gemm_ws: x and w must both be bfloat16 or both float16, got {x.dtype} and "
                         f"{w.dtype}; {_FALLBACK}")
    if not (x.device == w.device == group_sizes.device):
        raise ValueError(f"grouped_gemm_ws: x ({x.device}), w ({w.device}) and group_sizes ({group_sizes.device}) "
                         "must be on one device; the group sizes stay on the GPU")
    _check_device(x.device)
    M, K = x.shape
    G = w.shape[0]
    N, Kw = (w.shape[1], w.shape[2]) if trans_w else (w.shape[2], w.shape[1])
    if Kw != K:
        raise ValueError(f"grouped_gemm_ws: x is [M={M}, K={K}] but w {layout} is {tuple(w.shape)} (K={Kw}); "
                         f"did you mean trans_w={not trans_w}?")
    if group_sizes.shape[0] != G:
        raise ValueError(f"grouped_gemm_ws: group_sizes has {group_sizes.shape[0]} entries but w has G={G}")
    check_groups(G)
    check_alignment(N, K, x.dtype)
    return M, N, K, G


def can_run(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, out: torch.Tensor | None,
            trans_w: bool) -> bool:
    """Whether ``grouped_gemm_ws`` takes these operands (``kernels.grouped_gemm``
    asks before it hands its default fwd/dgrad path over; ``out=None``: a new one)."""
    try:
        _check_operands(x, w, group_sizes, trans_w)
    except ValueError:
        return False
    return all(_tma_ok(t) for t in (x, w) + ((out,) if out is not None else ()))


# Stages per (op, N, K) of kernels.grouped_gemm's default path, from the probe of
# results/grouped_gemm (run 12, H200): ping-pong with 5 stages beat our Triton kernel
# on every layer (geomean 1.009-1.054 per model, layer and op), except gpt-oss-20B's
# Down (2880 x 2880), where 4 stages did better (1.025 vs 1.009-1.011).
DEFAULT_CONFIG = GroupedWsConfig()
TABLE: dict[tuple[str, int, int], GroupedWsConfig] = {
    ("fwd", 2880, 2880): GroupedWsConfig(num_stages=4),
    ("dgrad", 2880, 2880): GroupedWsConfig(num_stages=4),
}


def pick_config(op: str, N: int, K: int) -> GroupedWsConfig:
    """The config of the default path for one (op, N, K): output width N, reduction K."""
    return TABLE.get((op, N, K), DEFAULT_CONFIG)


def descriptors(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, config: GroupedWsConfig, trans_w: bool):
    """The kernel's three host-side descriptors: x [M, K] in [BM, BK] boxes, w in
    [1, BK, BN] boxes ([1, BN, BK] for trans_w) and the row-window descriptor of out."""
    bm, bn, bk = config.block_m, config.block_n, config.block_k
    x_block = [bm, bk]
    w_block = [1, bn, bk] if trans_w else [1, bk, bn]
    x_desc = TensorDescriptor(x, list(x.shape), list(x.stride()), x_block, _layout(x.dtype, x_block))
    w_desc = TensorDescriptor(w, list(w.shape), list(w.stride()), w_block, _layout(w.dtype, w_block))
    return x_desc, w_desc, _row_window_desc(out, bm, bn)


def grid_size(M: int, N: int, G: int, config: GroupedWsConfig, num_sms: int) -> int:
    """CTAs launched: one per SM (or ``config.num_sms``), never more than the tiles
    could be (an upper bound known on the host: cdiv(M, BM) + G row blocks)."""
    max_tiles = (-(-M // config.block_m) + G) * -(-N // config.block_n)
    return max(1, min(config.num_sms or num_sms, max_tiles))


def grouped_gemm_ws(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *, trans_w: bool = False,
                    config: GroupedWsConfig | Mapping[str, Any] | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped ``x @ w[g]`` (or ``x @ w[g].T`` with ``trans_w``) over row groups of x,
    with the warp-specialised kernel (sm_90 only).

    x: [M, K]; w: [G, K, N] ([G, N, K] with trans_w), both bf16 or both fp16,
    K and N multiples of 8; group_sizes: int32/int64 [G] on x's device, summing
    to M (not checked: that would need a host sync; rows past the sum are left
    unwritten, groups are clipped at M). Returns out [M, N] (fp32 accumulation).
    Raises ValueError, naming ``kernels.grouped_gemm.grouped_gemm`` as the
    fallback, for anything this kernel cannot take.
    """
    cfg = validate(config)
    M, N, K, G = _check_operands(x, w, group_sizes, trans_w)
    out, done = prepare_output(out, M, N, K, x, who="grouped_gemm_ws")
    if done:
        return out
    if not all(_tma_ok(t) for t in (x, w, out)):
        raise ValueError("grouped_gemm_ws: x, w and out need unit inner stride and 16-byte aligned base pointers "
                         f"and strides (TMA); {_FALLBACK}, which takes any row-major strides")
    if group_sizes.stride(0) != 1:
        group_sizes = group_sizes.contiguous()  # the kernel reads sizes_ptr + g (a device copy, no sync)
    cuda_context.ensure_current(x.device)   # autograd's backward thread may have no current context
    x_desc, w_desc, out_desc = descriptors(x, w, out, cfg, trans_w)
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    grid = grid_size(M, N, G, cfg, _sm_count(dev))
    _grouped_gemm_ws_kernel[(grid,)](
        x_desc, w_desc, out_desc, group_sizes, M, G, cfg.group_m,
        NUM_STAGES=cfg.num_stages, COOPERATIVE=cfg.cooperative, TRANS_W=bool(trans_w), G_PAD=g_pad(G),
        CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs,
        num_warps=num_warps(cfg), maxnreg=MAXNREG)
    return out


def reference(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *, trans_w: bool = False) -> torch.Tensor:
    """fp32 per-group torch matmuls (kernels.grouped_gemm.reference), tf32 off on CUDA."""
    from kernels import grouped_gemm as gg

    if x.device.type == "cuda":
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return gg.reference(x, w, group_sizes, trans_w=trans_w, dtype=torch.float32)
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    return gg.reference(x, w, group_sizes, trans_w=trans_w, dtype=torch.float32)


def flops(total_tokens: int, N: int, K: int) -> int:
    return 2 * int(total_tokens) * int(N) * int(K)


# --------------------------------------------------------------------------
# Cross-compilation (no GPU needed): arguments for workbench.asm.compile
# --------------------------------------------------------------------------
def compile_args(config: GroupedWsConfig | Mapping[str, Any] | None = None, dtype: torch.dtype = torch.bfloat16,
                 trans_w: bool = False, G: int = 32, shape: Mapping[str, int] | tuple[int, int] | None = None,
                 sizes_dtype: torch.dtype = torch.int32) -> dict:
    """Keyword arguments for ``workbench.asm.compile.cross_compile`` that build the
    kernel ``grouped_gemm_ws`` launches for ``config`` (``fn`` included)::

        cross_compile(targets="sm90", cache_dir=d, **compile_args(cfg, torch.float16, trans_w=True))

    G sets the in-register sizes vectors' length (``g_pad``); the descriptors carry
    the problem size at run time, so ``shape`` (N, K of the call: output width,
    reduction) only checks the alignment rule.
    """
    cfg = validate(config)
    if dtype not in DTYPES:
        raise ValueError(f"grouped_gemm_ws: dtype {dtype} is not supported; use torch.bfloat16 or torch.float16 "
                         f"({_FALLBACK} for others)")
    if shape is not None:
        N, K = (shape["N"], shape["K"]) if isinstance(shape, Mapping) else shape
        check_alignment(N, K, dtype)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    sig = {"x_desc": _desc_type(dtype, [bm, bk]),
           "w_desc": _desc_type(dtype, [1, bn, bk] if trans_w else [1, bk, bn]),
           "out_desc": _desc_type(dtype, [1, 1, bm, bn]),
           "sizes_ptr": "*" + triton_type(sizes_dtype), "M_total": "i32", "G": "i32", "group_m": "i32"}
    constexprs = {"NUM_STAGES": cfg.num_stages, "COOPERATIVE": cfg.cooperative, "TRANS_W": bool(trans_w),
                  "G_PAD": g_pad(G), "CONSUMER_REGS": cfg.consumer_regs, "PRODUCER_REGS": cfg.producer_regs}
    return {"fn": _grouped_gemm_ws_kernel, "signature": sig, "constexprs": constexprs, "divisible": ["sizes_ptr"],
            "num_warps": num_warps(cfg), "options": {"maxnreg": MAXNREG}}
