"""The Triton kernel of the routing preparation (``routing.prepare_routing``): one launch.

From the router's ``topk_ids`` / ``topk_weights`` ([M, top_k], any strides) to the layout the
down-projection reads (``routing.py``): the (token, slot) pairs p = token * top_k + slot sorted
by expert, ascending within an expert, each expert's run padded to a multiple of BM.

Program g < cdiv(E, G) owns the experts g * G .. g * G + G - 1. It

1. counts the pairs of every expert (``tl.histogram`` over all pairs, CH at a time), so it knows
   where its experts' rows start (the padded counts of the experts before them) without waiting
   for any other program: no workspace, no counter, nothing to reset, nothing for a CUDA graph
   to carry between replays;
2. walks the pairs again in order and writes each of its experts' pairs to the next row of that
   expert (a running count plus a cumulative sum within the chunk: the order of the pairs is
   kept, so the result is the same every run), with its routing weight in fp32;
3. pads its experts' last blocks (row id M * top_k, weight 0) and names its experts' blocks.

With ZERO, every program first zeroes its share (``zero_chunk`` int32 words) of the down-projection's
output, which the caller allocated with these buffers: the call then needs no zeroing launch of its own
(``routing.prepare_routing_and_output``).

The last program (g = cdiv(E, G)) writes the rows used (``num_rows``), and pads every row past
them and names every block past them -1. Each program reads the ids twice: M * top_k * E / G
reads in all, from L2; fine for decode and prefill sizes (KIMI-K2.5 at M = 16384: 147,456 pairs,
97 programs), and one launch whatever the size.

Pairs whose expert id lies outside [0, E) are left out of every expert (no row; like torch
indexing, ids are not checked on the device: ``prepare_routing(..., check=True)`` does, on the host).
"""
from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["_prepare_routing_kernel", "_route_chunk_counts_kernel", "_route_chunk_offsets_kernel",
           "_route_chunk_scatter_kernel", "_route_part", "chunked_constexprs", "routing_constexprs"]


@triton.jit
def _experts_of(ids_ptr, p, n, E, stride_im, stride_ik, TOP_K: tl.constexpr):
    """The experts of pairs p (int32) and which of them count (p < n, expert in [0, E))."""
    valid = p < n
    e = tl.load(ids_ptr + (p // TOP_K) * stride_im + (p % TOP_K) * stride_ik, mask=valid, other=0)
    ok = valid & (e >= 0) & (e < E)
    return tl.where(ok, e, 0).to(tl.int32), ok


@triton.jit
def _prepare_routing_kernel(ids_ptr, wts_ptr, sorted_ids_ptr, sorted_w_ptr, expert_ids_ptr, num_rows_ptr, counts_ptr,
                            n, E, max_rows, max_blocks, stride_im, stride_ik, stride_wm, stride_wk,
                            zero_ptr, zero_words, zero_chunk,
                            TOP_K: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr, CH: tl.constexpr,
                            G: tl.constexpr, FILL: tl.constexpr, ZERO: tl.constexpr = False):
    pid = tl.program_id(0)
    if ZERO:   # 0. the down-projection's output (int32 words), zeroed for its atomics: no launch of its own
        z0 = pid * zero_chunk
        z1 = tl.minimum(z0 + zero_chunk, zero_words)
        for w0 in range(z0, z1, FILL):
            wi = w0 + tl.arange(0, FILL)
            tl.store(zero_ptr + wi, tl.zeros([FILL], dtype=tl.int32), mask=wi < z1)
    _route_part(pid, ids_ptr, wts_ptr, sorted_ids_ptr, sorted_w_ptr, expert_ids_ptr, num_rows_ptr, counts_ptr,
                n, E, max_rows, max_blocks, stride_im, stride_ik, stride_wm, stride_wk, TOP_K, BM, NB, CH, G, FILL,
                True)


@triton.jit(noinline=True)     # a call: inlined into the one-launch kernel it raised the tiles' registers
def _route_part(pid, ids_ptr, wts_ptr, sorted_ids_ptr, sorted_w_ptr, expert_ids_ptr, num_rows_ptr, counts_ptr,
                n, E, max_rows, max_blocks, stride_im, stride_ik, stride_wm, stride_wk,
                TOP_K: tl.constexpr, BM: tl.constexpr, NB: tl.constexpr, CH: tl.constexpr, G: tl.constexpr,
                FILL: tl.constexpr, COUNTS: tl.constexpr):
    """Part pid of the routing (steps 1-3 of the module doc; the last part, pid = cdiv(E, G), the
    rows used and the padding past them): what one program of the routing kernel does, also run
    by the first programs of the down-projection's one-launch form. COUNTS: write counts."""
    bins = tl.arange(0, NB)
    hist = tl.zeros([NB], dtype=tl.int32)
    for c0 in range(0, n, CH):                                   # 1. pairs per expert
        e, ok = _experts_of(ids_ptr, c0 + tl.arange(0, CH), n, E, stride_im, stride_ik, TOP_K)
        hist += tl.histogram(e, NB, mask=ok)
    padded = (hist + BM - 1) // BM * BM
    num_rows = tl.sum(padded, 0)
    if pid < tl.cdiv(E, G):
        eg = pid * G + tl.arange(0, G)
        g_ok = eg < E
        start = tl.sum(tl.where(bins[None, :] < eg[:, None], padded[None, :], 0), 1)     # first row of each
        count = tl.sum(tl.where(bins[None, :] == eg[:, None], hist[None, :], 0), 1)
        if COUNTS:
            tl.store(counts_ptr + eg, count, mask=g_ok)
        if tl.sum(count, 0) > 0:                                 # 2. the group's pairs, in order
            run = start
            for c0 in range(0, n, CH):
                p = c0 + tl.arange(0, CH)
                e, ok = _experts_of(ids_ptr, p, n, E, stride_im, stride_ik, TOP_K)
                hit = ((e[:, None] == eg[None, :]) & ok[:, None]).to(tl.int32)          # [CH, G]
                dest = tl.sum(hit * (tl.cumsum(hit, 0) - 1 + run[None, :]), 1)
                mine = tl.sum(hit, 1) > 0
                wt = tl.load(wts_ptr + (p // TOP_K) * stride_wm + (p % TOP_K) * stride_wk, mask=mine, other=0.0)
                tl.store(sorted_ids_ptr + dest, p, mask=mine)
                tl.store(sorted_w_ptr + dest, wt.to(tl.float32), mask=mine)
                run += tl.sum(hit, 0)
        _pad_and_name_blocks(eg, g_ok, start, count, sorted_ids_ptr, sorted_w_ptr, expert_ids_ptr, n, BM,   # 3.
                             FILL)
    else:
        _past_the_rows(num_rows, sorted_ids_ptr, sorted_w_ptr, expert_ids_ptr, num_rows_ptr, n, max_rows, max_blocks,
                       BM, FILL)


@triton.jit
def _pad_and_name_blocks(eg, g_ok, start, count, sorted_ids_ptr, sorted_w_ptr, expert_ids_ptr, n,
                         BM: tl.constexpr, FILL: tl.constexpr):
    """Experts eg (g_ok: real ones), their runs starting at row start with count pairs: each last
    block's padding rows (pair n, weight 0), and the expert of each of their blocks."""
    blocks = (count + BM - 1) // BM
    rows = start[:, None] + count[:, None] + tl.arange(0, BM)[None, :]
    pad = (rows < (start + blocks * BM)[:, None]) & g_ok[:, None]
    tl.store(sorted_ids_ptr + rows, tl.zeros_like(rows) + n, mask=pad)
    tl.store(sorted_w_ptr + rows, tl.zeros(rows.shape, dtype=tl.float32), mask=pad)
    for b0 in range(0, tl.max(blocks, 0), FILL):
        b = b0 + tl.arange(0, FILL)
        mb = (b[None, :] < blocks[:, None]) & g_ok[:, None]
        tl.store(expert_ids_ptr + start[:, None] // BM + b[None, :], eg[:, None] + tl.zeros_like(b)[None, :],
                 mask=mb)


@triton.jit
def _past_the_rows(num_rows, sorted_ids_ptr, sorted_w_ptr, expert_ids_ptr, num_rows_ptr, n, max_rows, max_blocks,
                   BM: tl.constexpr, FILL: tl.constexpr):
    """The rows used (num_rows), and every row and block past them: pair n, weight 0, expert -1."""
    tl.store(num_rows_ptr, num_rows)
    for r0 in range(num_rows, max_rows, FILL):
        r = r0 + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + r, tl.zeros_like(r) + n, mask=r < max_rows)
        tl.store(sorted_w_ptr + r, tl.zeros([FILL], dtype=tl.float32), mask=r < max_rows)
    for b0 in range(num_rows // BM, max_blocks, FILL):
        b = b0 + tl.arange(0, FILL)
        tl.store(expert_ids_ptr + b, tl.zeros_like(b) - 1, mask=b < max_blocks)


def routing_constexprs(num_pairs: int, num_experts: int, top_k: int, block_m: int, *,
                       sms: int = 132) -> tuple[tuple[int], dict]:
    """(grid, constexprs and launch options) of ``_prepare_routing_kernel`` for a call signature.

    G experts per program: about one program per SM (G = 1 up to 132 experts, 4 for KIMI-K2.5's
    385), so the pairs are read E / G times; CH pairs per step with CH x G <= 8192 (the [CH, G]
    tile of step 2)."""
    NB = max(16, triton.next_power_of_2(num_experts))
    G = min(8, triton.next_power_of_2(max(1, -(-num_experts // max(sms, 1)))))
    CH = max(16, min(triton.next_power_of_2(max(num_pairs, 1)), 8192 // G, 2048))
    grid = (-(-num_experts // G) + 1,)
    return grid, dict(TOP_K=top_k, BM=block_m, NB=NB, CH=CH, G=G, FILL=1024, num_warps=4)


# --------------------------------------------------------------------------------------------------
# Many pairs: the same layout in three launches, each pair read twice in all (the one-launch kernel
# reads every pair twice in each of its cdiv(E, G) programs, one after the other: at KIMI-K2.5's
# M = 16384, 147,456 pairs, that was most of a millisecond). Chunks of CH pairs:
#   1. _route_chunk_counts_kernel, a program per chunk: its pairs per expert, and where each expert's
#      run starts inside the chunk once the chunk is sorted (the exclusive sum over lower experts);
#   2. _route_chunk_offsets_kernel, one program: each expert's first row (the padded counts before
#      it), then, chunk by chunk, base[c, e] = that row + expert e's pairs in chunks before c - where
#      e's run starts inside chunk c; the counts, the last blocks' padding, the blocks' experts and
#      everything past the rows used (as _route_part does);
#   3. _route_chunk_scatter_kernel, a program per chunk: the chunk's pairs sorted by (expert, index)
#      (tl.sort of one key), the pair at sorted position q of expert e goes to row base[c, e] + q:
#      ascending within an expert, chunk after chunk, so the rows are the one-launch kernel's.
# --------------------------------------------------------------------------------------------------
@triton.jit
def _route_chunk_counts_kernel(ids_ptr, counts_ptr, local_ptr, n, E, stride_im, stride_ik,
                               TOP_K: tl.constexpr, NB: tl.constexpr, CH: tl.constexpr):
    c = tl.program_id(0)
    e, ok = _experts_of(ids_ptr, c * CH + tl.arange(0, CH), n, E, stride_im, stride_ik, TOP_K)
    hist = tl.histogram(e, NB, mask=ok)
    bins = tl.arange(0, NB)
    tl.store(counts_ptr + c * NB + bins, hist)
    tl.store(local_ptr + c * NB + bins, tl.cumsum(hist, 0) - hist)


@triton.jit
def _route_chunk_offsets_kernel(counts_ptr, local_ptr, sorted_ids_ptr, sorted_w_ptr, expert_ids_ptr, num_rows_ptr,
                                out_counts_ptr, n, E, max_rows, max_blocks, chunks,
                                BM: tl.constexpr, NB: tl.constexpr, G: tl.constexpr, FILL: tl.constexpr):
    bins = tl.arange(0, NB)
    hist = tl.zeros([NB], dtype=tl.int32)
    for c in range(0, chunks):
        hist += tl.load(counts_ptr + c * NB + bins)
    padded = (hist + BM - 1) // BM * BM
    start = tl.cumsum(padded, 0) - padded
    run = start
    for c in range(0, chunks):                     # counts become bases, row by row
        h = tl.load(counts_ptr + c * NB + bins)
        tl.store(counts_ptr + c * NB + bins, run - tl.load(local_ptr + c * NB + bins))
        run += h
    tl.store(out_counts_ptr + bins, hist, mask=bins < E)
    for g0 in range(0, E, G):                      # each expert's last block padded, its blocks named
        eg = g0 + tl.arange(0, G)
        g_ok = eg < E
        sel = bins[None, :] == eg[:, None]
        count = tl.sum(tl.where(sel, hist[None, :], 0), 1)
        first = tl.sum(tl.where(sel, start[None, :], 0), 1)
        _pad_and_name_blocks(eg, g_ok, first, count, sorted_ids_ptr, sorted_w_ptr, expert_ids_ptr, n, BM, FILL)
    _past_the_rows(tl.sum(padded, 0), sorted_ids_ptr, sorted_w_ptr, expert_ids_ptr, num_rows_ptr, n, max_rows,
                   max_blocks, BM, FILL)


@triton.jit
def _route_chunk_scatter_kernel(ids_ptr, wts_ptr, base_ptr, sorted_ids_ptr, sorted_w_ptr, n, E,
                                stride_im, stride_ik, stride_wm, stride_wk, zero_ptr, zero_words, zero_chunk,
                                TOP_K: tl.constexpr, NB: tl.constexpr, CH: tl.constexpr, FILL: tl.constexpr,
                                ZERO: tl.constexpr = False):
    c = tl.program_id(0)
    if ZERO:   # the down-projection's output (int32 words), zeroed for its atomics, a share per program
        z0 = c * zero_chunk
        z1 = tl.minimum(z0 + zero_chunk, zero_words)
        for w0 in range(z0, z1, FILL):
            wi = w0 + tl.arange(0, FILL)
            tl.store(zero_ptr + wi, tl.zeros([FILL], dtype=tl.int32), mask=wi < z1)
    q = tl.arange(0, CH)
    e, ok = _experts_of(ids_ptr, c * CH + q, n, E, stride_im, stride_ik, TOP_K)
    key = tl.sort(tl.where(ok, e, NB) * CH + q)    # by expert (pairs left out: NB, last), then index
    se = key // CH
    mine = se < NB
    p = c * CH + key % CH
    dest = tl.load(base_ptr + c * NB + se, mask=mine, other=0) + q
    wt = tl.load(wts_ptr + (p // TOP_K) * stride_wm + (p % TOP_K) * stride_wk, mask=mine, other=0.0)
    tl.store(sorted_ids_ptr + dest, p, mask=mine)
    tl.store(sorted_w_ptr + dest, wt.to(tl.float32), mask=mine)


def chunked_constexprs(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(CH, NB, chunks) of the three-launch routing: CH = 2048 pairs a chunk (fewer for fewer pairs)."""
    NB = max(16, triton.next_power_of_2(num_experts))
    CH = max(16, min(2048, triton.next_power_of_2(max(num_pairs, 1))))
    return CH, NB, -(-num_pairs // CH)
