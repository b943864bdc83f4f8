"""Gluon kernel of the MXFP4 down-projection at large M: the expansion beside the MMA, not before it.

At large M every weight tile feeds whole 128-row blocks of pairs, so the work is the MMA's, and the
Triton kernel (``triton.py``) loses it by running the expansion of the FP4 codes to bf16 and the
wgmma one after the other in the same warps (gpt-oss-120b at M = 8192: about 200 TFLOP/s of bf16
work, 0.55x the bf16-weight grouped GEMM). Here the expansion has warps of its own. The kernel is
persistent: CTA p takes the tiles p, p + grid, ... of the row blocks the routing used, each tile
[128 pairs, BN columns] of one expert, in bands of ``group_b`` row blocks (their activations and
weights stay in L2). Three warp-specialised partitions share a ring of ``NUM_STAGES`` shared-memory
stages, across the tiles' boundaries:

- the loader (1 warp): TMA copies of the activations' [BM, BK] boxes, from the activations gathered
  into the routing's sorted, padded order (``gather_sorted``, one Triton launch before this one);
- the expander (``EXPAND_WARPS`` warps): the expert's code words and scale bytes, loaded two steps
  ahead, expanded to bf16 pairs by inline PTX (the Triton kernel's bit patterns and multiplies: the
  same values, bit for bit) and stored into the stage's [BN, BK] K-major buffer;
- the default partition (4 warps, one warpgroup): wgmma from the two buffers, one step in flight;
  then the tile's epilogue: each row times its routing weight, rounded to bf16, added to its
  token's output row with atomics (as the Triton kernel's atomic epilogue).

A stage is ready when both producers have arrived: its ``ready`` barrier counts 2 (the loader's
expect-tx arrival, completed by the TMA's bytes, and the expander's after its stores and a fence).
The consumer releases a stage once the wgmma after it is issued.

The expander reads two layouts (``LEVELS``): the plain one (``quantize_mxfp4``'s [E, H, I / 2]
codes, [E, H, I / 32] scales) and level 2 (``prepare_weights``' default: 64 x 128 tiles in wgmma's
register order, each 4-byte register group's bits rearranged, ``quant.prepack_mxfp4``), so a model
keeps one copy of its weights for every M. Both give the values in one K order: the pattern PTX pairs
values (2c, 2c + 2) and (2c + 1, 2c + 3) in a word, so each run of 4 is stored as (0, 2, 1, 3)
(``K_ORDER``), and the gather puts the activations' columns in that order too: each product meets
its own activation. A K tail (I % BK) reads zero codes past I, and the TMA box zero-fills the
activations there.
"""
from __future__ import annotations

import functools

import torch
import triton
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
from kernels.moe_mxfp4.triton import _E2M1_PATTERNS_PTX, _E2M1_ROT_PTX, _gather_sorted_kernel

__all__ = ["K_ORDER", "LEVELS", "compile_args", "gather_sorted", "launch", "reduce_pairs"]

LEVELS = (0, 2)                          # the weight layouts the expander reads: plain, and prepacked level 2
GATHER_ROWS, GATHER_COLS = 16, 256       # the gather's tile



def _patterns_times_scale(pattern_ptx: str, one_mul: bool) -> str:
    """The pattern PTX ($0..$3 out, $4 in: one word of four code bytes) followed by the plain path's
    bf16x2 multiplies: by 2**126, then by the scale pattern $5 (both halves the word's scale, which
    its eight values share); with one_mul, $5 holds 2**(s - 1) and one multiply does (exact for
    scale bytes up to 128, ``triton._SCALE_ONE_MUL_PTX``)."""
    inner = pattern_ptx.strip()[1:-1]
    for i in range(4):
        inner = inner.replace(f"${i}", f"q{i}")
    if one_mul:
        muls = "".join(f"mul.rn.bf16x2 ${i}, q{i}, $5;\n" for i in range(4))
    else:
        muls = "".join(f"mul.rn.bf16x2 q{i}, q{i}, c;\nmul.rn.bf16x2 ${i}, q{i}, $5;\n" for i in range(4))
    return ("{\n.reg .b32 q0, q1, q2, q3, c;\nmov.b32 c, 0x7E807E80;\n" + inner.strip("\n") + "\n" + muls + "}\n")


# One word of four code bytes (values v0..v7, two per byte, low nibble first) -> four bf16x2 words,
# exact: (v0, v2), (v4, v6), (v1, v3), (v5, v7) (the pattern PTX pairs the low nibbles of two bytes).
_EXPAND_PTX = gl.constexpr(_patterns_times_scale(_E2M1_PATTERNS_PTX.value, one_mul=False))
_EXPAND_ONE_MUL_PTX = gl.constexpr(_patterns_times_scale(_E2M1_PATTERNS_PTX.value, one_mul=True))

# The order of the values in each run of 8 along K as the expander stores them (words (v0, v2),
# (v1, v3), (v4, v6), (v5, v7)): the gathered activations' columns are put in the same order, so
# each product meets its own activation and the sum over K is the same sum.
K_ORDER = (0, 2, 1, 3, 4, 6, 5, 7)


def _level2_ptx(one_mul: bool) -> str:
    """Level-2 prepacked codes (``quant.prepack_mxfp4(..., 2)``): two 16-byte halves of a thread's
    tile bytes, rows r ($8) and r + 8 ($9), one word of each; bytes (0, 1) and (2, 3) of the pair
    are two register groups (rows r, r + 8 x byte columns c, c + 1), each four bf16x2 patterns by
    one rotation and one mask (``triton._E2M1_ROT_PTX``), times the rows' scales ($10: row r,
    $11: row r + 8; one_mul: 2**(s - 1), else 2**126 then 2**(s - 127)). Out: row r's words
    (values (2c, 2c + 2), (2c + 1, 2c + 3)) of the first group, then of the second ($0..$3), then
    row r + 8's ($4..$7)."""
    rot = _E2M1_ROT_PTX.value.strip()[1:-1].replace(".reg .b32 x, y;", "")
    body = ["{", ".reg .b32 g, x, y, c, r0, r1, r2, r3;", "mov.b32 c, 0x7E807E80;"]
    outs = {0: ("$0", "$4", "$1", "$5"), 1: ("$2", "$6", "$3", "$7")}   # R0 (r), R1 (r+8), R2 (r), R3 (r+8)
    for grp, sel in ((0, "0x5410"), (1, "0x7632")):
        body.append(f"prmt.b32 g, $8, $9, {sel};")
        part = rot
        for i in range(4):
            part = part.replace(f"${i}", f"r{i}")
        body.append(part.replace("$4", "g").strip())
        for i, out in enumerate(outs[grp]):
            f = "$10" if i in (0, 2) else "$11"
            if not one_mul:
                body.append(f"mul.rn.bf16x2 r{i}, r{i}, c;")
            body.append(f"mul.rn.bf16x2 {out}, r{i}, {f};")
    return "\n".join(body + ["}"])


_LEVEL2_PTX = gl.constexpr(_level2_ptx(one_mul=False))
_LEVEL2_ONE_MUL_PTX = gl.constexpr(_level2_ptx(one_mul=True))


@gluon.constexpr_function
def _codes_layout(block_k, num_warps):
    # [BN, BK / 32, 4] code words: one scale block's 4 words (32 values) per thread, the blocks of
    # a row across BK / 32 lanes, rows across the rest.
    nb = block_k // 32
    return gl.BlockedLayout([1, 1, 4], [32 // nb, nb, 1], [num_warps, 1, 1], [2, 1, 0])


@gluon.constexpr_function
def _w_smem_layout(block_n, block_k):
    return gl.NVMMASharedLayout.get_default_for([block_n, block_k], gl.bfloat16)


@gluon.constexpr_function
def _w_words_layout(block_k):
    # The same bytes as 32-bit words (bf16 pairs): the swizzle is defined on bytes.
    return gl.NVMMASharedLayout(swizzle_byte_width=min(128, block_k * 2), element_bitwidth=32, rank=2)


@gluon.jit
def _tile(t, num_blocks, num_n_tiles, group_b):
    """Tile t -> (its row block, its column tile): bands of group_b row blocks, each band's column
    tiles in turn (``kernels.gemm.gluon._tile_coords``), so the band's activations and experts'
    weights stay in L2 while its tiles run."""
    return dense_gluon._tile_coords(t, num_blocks, num_n_tiles, group_b)


@gluon.jit
def _loader(x_desc, a_bufs, ready, empty, num_tiles, k_steps, num_blocks, num_n_tiles, group_b,
            NUM_STAGES: gl.constexpr):
    """The activations' boxes of every K step of this CTA's tiles, into the ring."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        blk, tile_n = _tile(t, num_blocks, num_n_tiles, group_b)
        for kk in range(k_steps):
            s = it % NUM_STAGES
            mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)   # a fresh barrier passes phase 1
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(x_desc, [blk * BM, kk * BK], ready.index(s), a_bufs.index(s))
            it += 1


@gluon.jit
def _tile_rows(tile_n, e, w_words, ws_ptr, H, stride_we, stride_wn, stride_wse, stride_wsn, BN: gl.constexpr,
               BK: gl.constexpr, layout: gl.constexpr):
    """A tile's code word pointers [BN, BK / 32, 4] (K step 0), scale pointers [BN, 1] and valid rows."""
    NB: gl.constexpr = BK // 32
    rows_l: gl.constexpr = gl.SliceLayout(2, layout)                                 # [BN, NB]
    rn = tile_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, rows_l))
    e64 = e.to(gl.int64)
    rn64 = gl.expand_dims(rn.to(gl.int64), 1)
    s_rows = ws_ptr + e64 * stride_wse + rn64 * stride_wsn
    nb = gl.arange(0, NB, layout=gl.SliceLayout(0, rows_l))
    c = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, layout)))
    w_rows = (w_words + gl.expand_dims(e64 * (stride_we // 4) + rn64 * (stride_wn // 4) + gl.expand_dims(nb * 4, 0), 2)
              + gl.expand_dims(gl.expand_dims(c, 0), 1))
    return w_rows, s_rows, rn < H


@gluon.jit
def _load_codes(w_rows, s_rows, n_ok, kk, KB, NB: gl.constexpr):
    """K step kk's code words [BN, NB, 4] and scale bytes [BN, NB]; blocks past I (KB blocks of 32)
    read as zero codes with a unit scale."""
    kb = kk * NB + gl.arange(0, NB, layout=gl.SliceLayout(0, s_rows.type.layout))
    ok = gl.expand_dims(n_ok, 1) & gl.expand_dims(kb < KB, 0)                    # [BN, NB]
    sc = gl.load(s_rows + gl.expand_dims(kb, 0), mask=ok, other=127)
    codes = gl.load(w_rows + kk * (NB * 4), mask=gl.expand_dims(ok, 2), other=0)
    return codes, sc


@gluon.jit
def _expand(codes, sc, BN: gl.constexpr, BK: gl.constexpr, ONE_MUL: gl.constexpr):
    """[BN, BK / 32, 4] code words and [BN, BK / 32] scale bytes -> [BN, BK / 2] bf16 pairs (int32),
    K in K_ORDER within each run of 8, the values the Triton kernel's EXPAND="ptx" path computes:
    bit-placed patterns (E2M1 x 2**-126), times 2**126, times 2**(s - 127) (byte 0 the subnormal
    2**-127, byte 255 NaN); ONE_MUL (every scale byte <= 128): times 2**(s - 1), one multiply."""
    s = sc.to(gl.int32)
    if ONE_MUL:
        bits = (s + 126) << 7
    else:
        bits = gl.where(s == 0, 0x40, gl.where(s == 255, 0x7FC0, s << 7))
    f = gl.broadcast(gl.expand_dims(bits | (bits << 16), 2), codes)[0]             # one scale per 4 words
    if ONE_MUL:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(_EXPAND_ONE_MUL_PTX, "=r,=r,=r,=r,r,r", [codes, f],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                                                   is_pure=True, pack=1)
    else:
        o0, o1, o2, o3 = gl.inline_asm_elementwise(_EXPAND_PTX, "=r,=r,=r,=r,r,r", [codes, f],
                                                   dtype=(gl.int32, gl.int32, gl.int32, gl.int32),
                                                   is_pure=True, pack=1)
    # per code word, the words (v0, v2), (v1, v3), (v4, v6), (v5, v7) in that order
    return gl.reshape(gl.join(gl.join(o0, o1), gl.join(o2, o3)), [BN, BK // 2])


@gluon.constexpr_function
def _l2_layout(num_warps):
    # [nb, kb, r54, r210, c21, jw]: the thread (r54, r210, c21) of a 64-row block's 64 x 64-byte tile
    # holds words jw = 0..3 of each 16-byte half (quant's _W_TILE order); warps over r54 and the
    # row blocks
    return gl.BlockedLayout([1, 1, 1, 1, 1, 4], [1, 1, 1, 8, 4, 1], [num_warps // 4, 1, 4, 1, 1, 1],
                            [5, 4, 3, 2, 1, 0])


@gluon.jit
def _l2_index(n: gl.constexpr, dim: gl.constexpr, layout: gl.constexpr):
    """arange(n) along dimension dim of a 6-D tensor in layout (size 1 elsewhere)."""
    i = gl.arange(0, n, layout=_slice_all_but(layout, dim))
    for d in gl.static_range(6):
        if d != dim:
            i = gl.expand_dims(i, d)
    return i


@gluon.constexpr_function
def _slice_all_but(layout, dim):
    out = layout
    for d in reversed(range(6)):
        if d != dim:
            out = gl.SliceLayout(d, out)
    return out


@gluon.jit
def _l2_tile_ptrs(tile_n, e, w_words, ws_words, Hp, stride_we, stride_wn, stride_wse, stride_wsn,
                  BN: gl.constexpr, BK: gl.constexpr, layout: gl.constexpr):
    """A tile's word pointers at K step 0: codes [NB, KB, 4, 8, 4, 4] (the half of rows r; + 512
    for rows r + 8), scales [NB, KB, 4, 8, 1, 1] (rows r; + 1 for r + 8), and the row blocks that
    lie inside the stored rows [NB, 1, 1, 1, 1, 1]."""
    NB: gl.constexpr = BN // 64
    KB: gl.constexpr = BK // 128
    row0 = tile_n * BN + _l2_index(NB, 0, layout) * 64
    kb = _l2_index(KB, 1, layout)
    r54 = _l2_index(4, 2, layout)
    r210 = _l2_index(8, 3, layout)
    e64 = e.to(gl.int64)
    w = (w_words + e64 * (stride_we // 4) + row0.to(gl.int64) * (stride_wn // 4) + kb * 1024 + r54 * 128 + r210 * 16
         + _l2_index(4, 4, layout) * 4 + _l2_index(4, 5, layout))
    sp = ws_words + e64 * (stride_wse // 4) + row0.to(gl.int64) * (stride_wsn // 4) + kb * 64 + r54 * 16 + r210 * 2
    return w, sp, row0 < Hp


@gluon.jit
def _l2_load(w, sp, ok, kk, KB: gl.constexpr):
    """K step kk: the two halves' code words and the two rows' scale words."""
    h0 = gl.load(w + kk * (KB * 1024), mask=ok, other=0)
    h1 = gl.load(w + kk * (KB * 1024) + 512, mask=ok, other=0)
    s0 = gl.load(sp + kk * (KB * 64), mask=ok, other=0x7F7F7F7F)
    s1 = gl.load(sp + kk * (KB * 64) + 1, mask=ok, other=0x7F7F7F7F)
    return h0, h1, s0, s1


@gluon.jit
def _l2_scale(sw, jw, ONE_MUL: gl.constexpr):
    """Scale byte jw of each word -> its bf16 pattern in both halves of a word."""
    s = (sw >> (jw * 8)) & 0xFF
    if ONE_MUL:
        bits = (s + 126) << 7
    else:
        bits = gl.where(s == 0, 0x40, gl.where(s == 255, 0x7FC0, s << 7))
    return bits | (bits << 16)


@gluon.jit
def _l2_expand(h0, h1, s0, s1, BN: gl.constexpr, BK: gl.constexpr, ONE_MUL: gl.constexpr):
    """A step's level-2 words -> [BN, BK / 2] bf16 pairs (int32) in K_ORDER."""
    layout: gl.constexpr = h0.type.layout
    jw = _l2_index(4, 5, layout)
    f0 = gl.broadcast(_l2_scale(s0, jw, ONE_MUL), h0)[0]
    f1 = gl.broadcast(_l2_scale(s1, jw, ONE_MUL), h0)[0]
    if ONE_MUL:
        o = gl.inline_asm_elementwise(_LEVEL2_ONE_MUL_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [h0, h1, f0, f1],
                                      dtype=(gl.int32,) * 8, is_pure=True, pack=1)
    else:
        o = gl.inline_asm_elementwise(_LEVEL2_PTX, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [h0, h1, f0, f1],
                                      dtype=(gl.int32,) * 8, is_pure=True, pack=1)
    # [nb, kb, r54, r210, c21, jw] + (q, mm, r3) -> [nb, r54, r3, r210, kb, jw, mm, c21, q]: row
    # nb*64 + r54*16 + r3*8 + r210, word column kb*64 + jw*16 + mm*8 + c21*2 + q
    rows_r = gl.join(gl.join(o[0], o[1]), gl.join(o[2], o[3]))
    rows_r8 = gl.join(gl.join(o[4], o[5]), gl.join(o[6], o[7]))
    v = gl.permute(gl.join(rows_r, rows_r8), [0, 2, 8, 3, 1, 5, 7, 4, 6])
    return gl.reshape(v, [BN, BK // 2])


@gluon.jit
def _expander(w_ptr, ws_ptr, num_tiles, k_steps, num_blocks, num_n_tiles, group_b, expert_ids_ptr, H, I, Hp,
              stride_we, stride_wn, stride_wse, stride_wsn, b_bufs, ready, empty,
              NUM_STAGES: gl.constexpr, ONE_MUL: gl.constexpr, LEVEL: gl.constexpr):
    """The weights of every K step of this CTA's tiles, expanded into the ring; each step's loads
    are issued two steps ahead (a step's expansion is shorter than a load's latency)."""
    BN: gl.constexpr = b_bufs.shape[1]
    BK: gl.constexpr = b_bufs.shape[2]
    w_words = w_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        blk, tile_n = _tile(t, num_blocks, num_n_tiles, group_b)
        e = gl.load(expert_ids_ptr + blk)
        if LEVEL == 2:
            KB: gl.constexpr = BK // 128
            layout2: gl.constexpr = _l2_layout(gl.num_warps())
            wp, sp, ok = _l2_tile_ptrs(tile_n, e, w_words, ws_ptr.to(gl.pointer_type(gl.int32), bitcast=True), Hp,
                                       stride_we, stride_wn, stride_wse, stride_wsn, BN, BK, layout2)
            a0 = _l2_load(wp, sp, ok, 0, KB)
            a1 = _l2_load(wp, sp, ok & (1 < k_steps), 1, KB)
            for kk in range(k_steps):
                a2 = _l2_load(wp, sp, ok & (kk + 2 < k_steps), kk + 2, KB)
                _store_step(_l2_expand(a0[0], a0[1], a0[2], a0[3], BN, BK, ONE_MUL), it, b_bufs, ready, empty,
                            NUM_STAGES)
                a0, a1 = a1, a2
                it += 1
        else:
            NB: gl.constexpr = BK // 32
            layout: gl.constexpr = _codes_layout(BK, gl.num_warps())
            w_rows, s_rows, n_ok = _tile_rows(tile_n, e, w_words, ws_ptr, H, stride_we, stride_wn, stride_wse,
                                              stride_wsn, BN, BK, layout)
            c0, s0 = _load_codes(w_rows, s_rows, n_ok, 0, I // 32, NB)
            c1, s1 = _load_codes(w_rows, s_rows, n_ok, 1, I // 32, NB)
            for kk in range(k_steps):
                c2, s2 = _load_codes(w_rows, s_rows, n_ok, kk + 2, I // 32, NB)
                _store_step(_expand(c0, s0, BN, BK, ONE_MUL), it, b_bufs, ready, empty, NUM_STAGES)
                c0, s0, c1, s1 = c1, s1, c2, s2
                it += 1


@gluon.jit
def _store_step(vals, it, b_bufs, ready, empty, NUM_STAGES: gl.constexpr):
    """A step's expanded weights (bf16 pairs) into ring position it, once the MMA is done with it."""
    BN: gl.constexpr = b_bufs.shape[1]
    BK: gl.constexpr = b_bufs.shape[2]
    s = it % NUM_STAGES
    mbarrier.wait(empty.index(s), ((it // NUM_STAGES) & 1) ^ 1)
    b_bufs.index(s)._reinterpret(gl.int32, [BN, BK // 2], _w_words_layout(BK)).store(vals)
    fence_async_shared()
    mbarrier.arrive(ready.index(s))


@gluon.jit
def _mma_epilogue(a_bufs, b_bufs, ready, empty, num_tiles, k_steps, num_blocks, num_n_tiles, group_b,
                  out_ptr, sorted_ids_ptr, sorted_w_ptr, n_pairs, H, stride_om,
                  TOP_K: gl.constexpr, NUM_STAGES: gl.constexpr, ATOMIC: gl.constexpr):
    """Per tile: wgmma over the ring (one step in flight), then its epilogue."""
    BM: gl.constexpr = a_bufs.shape[1]
    BN: gl.constexpr = b_bufs.shape[1]
    acc_layout: gl.constexpr = dense_gluon._acc_layout(BN, 16, gl.num_warps())
    it = 0
    for t in range(gl.program_id(0), num_tiles, gl.num_programs(0)):
        blk, tile_n = _tile(t, num_blocks, num_n_tiles, group_b)
        acc = gl.zeros((BM, BN), dtype=gl.float32, layout=acc_layout)
        for kk in range(k_steps):
            s = it % NUM_STAGES
            mbarrier.wait(ready.index(s), (it // NUM_STAGES) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute([1, 0]), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=(acc,))
            mbarrier.arrive(empty.index((it + NUM_STAGES - 1) % NUM_STAGES), pred=kk > 0)
            it += 1
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((it + NUM_STAGES - 1) % NUM_STAGES))   # the tile's last stage
        _epilogue(acc, blk * BM, tile_n * BN, out_ptr, sorted_ids_ptr, sorted_w_ptr, n_pairs, H, stride_om,
                  TOP_K, ATOMIC)


@gluon.jit
def _epilogue(acc, row0, off_n, out_ptr, sorted_ids_ptr, sorted_w_ptr, n_pairs, H, stride_om,
              TOP_K: gl.constexpr, ATOMIC: gl.constexpr):
    """Each row times its routing weight, rounded to bf16, added to its token's output row (ATOMIC)
    or stored to the pair's row of a [pairs, H] workspace."""
    BM: gl.constexpr = acc.shape[0]
    BN: gl.constexpr = acc.shape[1]
    rows = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, acc.type.layout))
    cols = off_n + gl.arange(0, BN, layout=gl.SliceLayout(0, acc.type.layout))
    ids = gl.load(sorted_ids_ptr + rows)
    wts = gl.load(sorted_w_ptr + rows)
    val = (acc * gl.expand_dims(wts, 1)).to(out_ptr.dtype.element_ty)
    mask = gl.expand_dims(ids < n_pairs, 1) & gl.expand_dims(cols < H, 0)
    if ATOMIC:
        tok = (ids // TOP_K).to(gl.int64)
        gl.atomic_add(out_ptr + gl.expand_dims(tok * stride_om, 1) + gl.expand_dims(cols, 0), val, mask=mask,
                      sem="relaxed")
    else:
        gl.store(out_ptr + gl.expand_dims(ids.to(gl.int64) * stride_om, 1) + gl.expand_dims(cols, 0), val, mask=mask)


@gluon.jit(do_not_specialize=["n_pairs"])
def _moe_mxfp4_down_ws_kernel(x_desc, w_ptr, ws_ptr, expert_ids_ptr, num_rows_ptr, sorted_ids_ptr, sorted_w_ptr,
                              out_ptr, n_pairs, H, I, Hp, num_n_tiles, group_b,
                              stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
                              TOP_K: gl.constexpr, BN: gl.constexpr, NUM_STAGES: gl.constexpr,
                              EXPAND_WARPS: gl.constexpr, EXPAND_REGS: gl.constexpr, LOADER_REGS: gl.constexpr,
                              ATOMIC: gl.constexpr = True, ONE_MUL: gl.constexpr = False, LEVEL: gl.constexpr = 0):
    """Persistent: CTA p takes the tiles p, p + grid, ... of the row blocks the routing used
    (num_rows / BM of them, read on the device), each [BM pairs, BN columns] of one expert."""
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    num_blocks = gl.load(num_rows_ptr) // BM
    num_tiles = num_blocks * num_n_tiles
    k_steps = (I + BK - 1) // BK

    a_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BM, BK], x_desc.layout)
    b_bufs = gl.allocate_shared_memory(gl.bfloat16, [NUM_STAGES, BN, BK], _w_smem_layout(BN, BK))
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=2)     # the loader's expect-tx and the expander's arrival
        mbarrier.init(empty.index(i), count=1)

    gl.warp_specialize([
        (_mma_epilogue, (a_bufs, b_bufs, ready, empty, num_tiles, k_steps, num_blocks, num_n_tiles, group_b,
                         out_ptr, sorted_ids_ptr, sorted_w_ptr, n_pairs, H, stride_om, TOP_K, NUM_STAGES, ATOMIC)),
        (_loader, (x_desc, a_bufs, ready, empty, num_tiles, k_steps, num_blocks, num_n_tiles, group_b, NUM_STAGES)),
        (_expander, (w_ptr, ws_ptr, num_tiles, k_steps, num_blocks, num_n_tiles, group_b, expert_ids_ptr, H, I, Hp,
                     stride_we, stride_wn, stride_wse, stride_wsn, b_bufs, ready, empty, NUM_STAGES, ONE_MUL, LEVEL)),
    ], [1, EXPAND_WARPS], [LOADER_REGS, EXPAND_REGS])


def x_descriptor(x_sorted: torch.Tensor, block_m: int, block_k: int):
    """The host TMA descriptor of the gathered activations [rows, I] in [BM, BK] boxes."""
    return dense_gluon.descriptor(x_sorted, [block_m, block_k])


def compile_args(*, block_m: int = 128, block_n: int = 128, block_k: int = 128, num_stages: int = 3,
                 top_k: int = 4, expand_warps: int = 8, expand_regs: int = 96, loader_regs: int = 40,
                 consumer_warps: int = 4, one_mul: bool = False, level: int = 2) -> dict:
    """Keyword arguments for ``workbench.asm.compile.cross_compile`` that build this kernel
    (``fn`` included), as the launcher runs it at gpt-oss-like shapes (strides multiples of 16)."""
    sig = {"x_desc": dense_gluon.desc_type(torch.bfloat16, [block_m, block_k]),
           "w_ptr": "*u8", "ws_ptr": "*u8", "expert_ids_ptr": "*i32", "num_rows_ptr": "*i32", "sorted_ids_ptr": "*i32",
           "sorted_w_ptr": "*fp32", "out_ptr": "*bf16", "n_pairs": "i32", "H": "i32", "I": "i32", "Hp": "i32",
           "num_n_tiles": "i32", "group_b": "i32", "stride_we": "i32", "stride_wn": "i32", "stride_wse": "i32",
           "stride_wsn": "i32", "stride_om": "i32"}
    constexprs = {"TOP_K": top_k, "BN": block_n, "NUM_STAGES": num_stages, "EXPAND_WARPS": expand_warps,
                  "EXPAND_REGS": expand_regs, "LOADER_REGS": loader_regs, "ONE_MUL": one_mul,
                  "ATOMIC": True, "LEVEL": level}
    divisible = ["w_ptr", "ws_ptr", "expert_ids_ptr", "num_rows_ptr", "sorted_ids_ptr", "sorted_w_ptr", "out_ptr",
                 "H", "I", "Hp", "stride_we", "stride_wn", "stride_wse", "stride_om"]
    return {"fn": _moe_mxfp4_down_ws_kernel, "signature": sig, "constexprs": constexprs, "divisible": divisible,
            "num_warps": consumer_warps}


@functools.lru_cache(maxsize=8)
def _sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def gather_sorted(a: torch.Tensor, routing) -> torch.Tensor:
    """The activations' rows in the routing's sorted, padded order ([max_rows, I]), each run of 8
    columns in K_ORDER: one launch of ``triton._gather_sorted_kernel``. Rows past the routing's
    used rows, and its padding rows, are not written (their products are dropped)."""
    R, I = routing.sorted_ids.shape[0], a.shape[1]
    x = torch.empty((R, I), dtype=a.dtype, device=a.device)
    _gather_sorted_kernel[(triton.cdiv(R, GATHER_ROWS), triton.cdiv(I, GATHER_COLS))](
        a, routing.sorted_ids, routing.num_rows, x, routing.num_pairs, I, a.stride(0), x.stride(0),
        BR=GATHER_ROWS, BC=GATHER_COLS)
    return x



def launch(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, routing, out: torch.Tensor, *, level: int,
           shape: tuple[int, int], one_mul: bool, block_n: int = 128, block_k: int = 128, num_stages: int = 3,
           consumer_warps: int = 4, expand_warps: int = 8, group_b: int = 4, expand_regs: int = 96,
           loader_regs: int = 40, atomic: bool = True) -> torch.Tensor:
    """out[token] += the down-projection of the pairs of ``routing`` (its block_m the tile's rows)
    with the weights (w, w_scale) of layout ``level`` (in LEVELS) and logical (H, I) ``shape``,
    through the warp-specialised kernel: the activations gathered (one launch), then one persistent
    launch. ``out`` must be zeroed (or hold what the products add to). atomic=False: ``out`` is a
    [pairs, H] workspace that gets each pair's weighted row (``reduce_pairs`` sums them per token).
    one_mul: one multiply per pair, only for weights whose scale bytes are all <= 128."""
    if level not in LEVELS:
        raise ValueError(f"the warp-specialised down-projection reads weights of levels {LEVELS}, got level "
                         f"{level}; prepare_weights(w, w_scale, level=2) makes them")
    H, I = shape
    x = gather_sorted(a, routing)
    n_tiles = -(-H // block_n)
    grid = (min(_sms(a.get_device()), routing.max_blocks * n_tiles),)
    _moe_mxfp4_down_ws_kernel[grid](
        x_descriptor(x, routing.block_m, block_k), w, w_scale, routing.expert_ids, routing.num_rows,
        routing.sorted_ids, routing.sorted_weights, out, routing.num_pairs, H, I, w.shape[1], n_tiles, group_b,
        w.stride(0), w.stride(1), w_scale.stride(0), w_scale.stride(1), out.stride(0), TOP_K=routing.top_k,
        BN=block_n, NUM_STAGES=num_stages, EXPAND_WARPS=expand_warps, EXPAND_REGS=expand_regs,
        LOADER_REGS=loader_regs, ATOMIC=atomic, ONE_MUL=one_mul, LEVEL=level, num_warps=consumer_warps)
    return out


def reduce_pairs(ws: torch.Tensor, out: torch.Tensor, top_k: int) -> torch.Tensor:
    """out[t] = the sum of ws[t * top_k + k] over k, in fp32 (the Triton family's reduction)."""
    from kernels.moe_mxfp4.triton import _reduce_topk_kernel
    M, H = out.shape
    _reduce_topk_kernel[(-(-M // 16), -(-H // 256))](ws, out, M, H, ws.stride(0), out.stride(0), TOP_K=top_k,
                                                     ACCUMULATE=False, BT=16, BH=256)
    return out
