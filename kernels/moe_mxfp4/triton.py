"""Triton kernels of the MXFP4 MoE down-projection ("gemm2").

    out[t, :] (+)= sum over slots k of  w_tk * (a[t * top_k + k, :] @ W[e_tk].T)

``a`` holds one row per (token, slot) pair: bf16 [pairs, I] (w4a16) or MXFP4
(packed uint8 [pairs, I / 2] + e8m0 scales [pairs, I / 32]: a4w4). ``W`` is
MXFP4 [E, H, I / 2] with scales [E, H, I / 32], packed along I (the reduction).
Rows arrive sorted by expert and padded to the row tile BM (``routing.py``);
program (m, n) computes row block m (one expert) x columns [n*BN, (n+1)*BN).

Expansion (Hopper has no FP4 tensor cores). Each byte holds two E2M1 codes
``s e1 e0 m``. Placing ``e1 e0 m`` at bits 8..6 of a bf16 and the sign at bit
15 gives a bf16 whose value is the E2M1 value times 2**-126 (for e = 0 too:
the pattern is then a bf16 subnormal), so one multiply by 2**126 and one by the
block scale 2**(s - 127) (itself built from bits; byte 0 is the subnormal
2**-127, byte 255 NaN) give the exact value. Both multiplies are packed bf16x2
(HMUL2.BF16_V2 in SASS) and exact: every E2M1 value has two significant bits.
The patterns are built by a few lines of inline PTX (``EXPAND="ptx"``: prmt
spreads two bytes into the halves of a 32-bit register, then shifts and masks
place both halves' bits at once; 19% fewer instructions in the kernel than
Triton's own integer ops, ``EXPAND="bits"``, which handle one 16-bit value per op).

``tl.dot_scaled(w, w_scale, "e2m1", a.T, None, "bf16")`` also compiles for
sm_90 with Triton 3.6 (it upcasts to bf16 and uses wgmma with the weights in
registers too), but the same tile took 4,008 SASS instructions against 3,120
here (cross-compiled 2026-11-24), and the interpreter cannot run it.

A K step is two dots: the sum over K does not care about order, so the low
nibbles (even K) and the high nibbles (odd K) of the weights are two tiles that
need no interleaving, against the even and odd columns of the activations.

Orientation. wgmma's M is 64 rows per warpgroup; a 16- or 32-row token tile
would fall back to mma.sync (HMMA). With ``SWAP_AB`` the kernel computes the
transposed tile, acc[BN, BM] = W_tile @ A_tile.T: the expanded weights are the
register-held A operand of wgmma (HGMMA.64xBMx16) and the token rows the N side
(8..256 allowed). Reaching that register layout costs a shared-memory pass of
the packed bytes (STS, then LDS.U16 per byte pair): one reason the expansion,
not HBM, may bound the small-M latency on Hopper.

Epilogue. Each row is scaled by its routing weight (fp32), rounded to bf16 and
either added to ``out[token]`` with atomics (``ATOMIC``; a token's top_k rows
race, so the order of the additions, and the low bits, vary run to run) or
stored to a workspace row per pair, which ``_reduce_topk_kernel`` sums in slot
order (identical bits every run).

Cross-compiled for sm_90 (Triton 3.6, BM16 x BN128 x BK128, 4 warps, 1 stage;
tests/test_moe_mxfp4.py checks these): the main loop has HGMMA.64x16x16.F32.BF16
with the weights from registers, weight loads are LDG.E.EF.128 with NT
(``evict_first``) and LDG.E.128 without, the expansion is LOP3/PRMT plus
HMUL2.BF16_V2, and the atomic epilogue is REDG.E.ADD.BF16x8.RN.STRONG.GPU:
a fire-and-forget 128-bit reduction of eight bf16 per instruction (Triton emits
PTX atom.global.gpu.relaxed.add.noftz.v8.bf16 with the old values unused, which
ptxas turns into the REDG reduction), not a compare-and-swap loop.

Latency switches (seed 004's two changes, measurable on and off):

* ``EARLY_LOADS``: the block's sorted ids, expert id and the first K step of
  A and W are loaded before the early-exit test on ``num_rows``, so their
  latency overlaps the load of ``num_rows`` and the test (the expert id is
  clamped to 0 for blocks past the end, which then load and exit).
* ``PREFETCH_EPILOGUE``: the routing weights are loaded at kernel entry, so
  the epilogue does not wait for them; off, they are loaded after the main loop.

Both survive compilation (tests check the sm_90 SASS): with EARLY_LOADS the
four LDG.E.EF.128 of the first weight step (and the ids, expert id, scales
and activations) come before the first EXIT, without it only the row count
does; with PREFETCH_EPILOGUE the routing weights' LDG.E.64 come before the
first HGMMA, without it after.

Cost model (BM16 x BN128, 4 warps, w4a16, I = 512): about 3,100 SASS
instructions per thread for 4 K steps, i.e. ~6 per expanded weight (the
expansion, the scale broadcast and the shared-memory pass to wgmma's register
layout), against 0.56 bytes of HBM traffic per weight; at small M the issue
rate, not HBM, may set the latency. experiments/run_moe_mxfp4.py measures it.

Where the time goes at small M (issue 17; cross-compiled for sm_90, the heuristic's BM16 x
BN64 x BK128 tile, which M = 4, 32 and 256 all run): 1,744 SASS instructions per thread for
256 weights (6.8 per weight): PRMT 352, IMAD 322 and LOP3 289 (bit placement, byte gathers and
address math), HMUL2 256 (two per bf16 pair: 2**126 and the scale), ISETP 69 + SEL 64 (scale
bytes to bf16 per element), and the shared-memory pass to wgmma's register layout and the scale
broadcast: STS 36, LDS 81 (LDS.U16 byte pairs), 21 BAR.SYNC; 80 registers, 6 programs per SM.
The K steps ran one at a time: each step's two LDG.E.EF.128 of weights (4 KB per program) were
issued only after the previous step's wgmma had retired, so a program had at most 4 KB of
weights in flight and paid four memory round trips in series; 6 programs x 4 KB = 24 KB per SM
at best, against the ~30 KB per SM (4.2 TB/s x ~1 us over 132 SMs) that HBM needs, and far
less on average since the programs spend most of their time expanding. ``LOAD_AHEAD`` (config)
issues the loads of the next 1-3 K steps before the current step's expansion: at LOAD_AHEAD=3
all 16 KB of a BN64 program are requested before its first HGMMA (118 registers and 4 programs
per SM at LOAD_AHEAD=1, 151 and 3 at 3: 32-48 KB per SM requested at once), same instructions.

Prepacked weights (``PREPACK``, config; ``quant.prepack_mxfp4`` stores them, rows and K padded to whole tiles): each
64-row x 128-K tile of packed bytes is stored thread-major in the order of wgmma's register
operand (warp = rows 16w.., lane = 3 row bits + 2 byte-column bits, 32 bytes per thread), so a
thread's two LDG.E.128 land in the registers the expansion and HGMMA use: the reshapes and
permutes in ``_load_w_prepacked`` only rename registers (TTGIR: the convert_layouts left differ
in register order only; SASS: no LDS for the weights, 16 STS = the activations' tiles). The
tile's scales are stored 8 bytes per thread (one LDG.E.64; the four lanes of a row group share
an address) and converted two per 32-bit op by ``_SCALE_PATTERNS_PTX`` (no ISETP/SEL).
PREPACK=2 also rearranges the 32 code bits of each 4-byte register group (``_E2M1_ROT_PTX``:
one rotation and one mask per bf16x2 pattern). Same values as the plain path, bit for bit
(tests: interpreter, and a model of both PTX sequences). Cross-compiled for sm_90 at BM16 x
BN64 x BK128 (2026-11-25; experiments/probes/sass_moe_mxfp4_variants.py), SASS instructions per weight
6.81 (plain) -> 5.19 (PREPACK=1, 74 registers) -> 4.06 (PREPACK=2, 66 registers, 7 programs
per SM). What stays: two HMUL2 per pair (1.0 per weight; one multiply is not exact for scale
bytes above 128 with these patterns, see results/moe_mxfp4/README.md) and the activations'
even/odd split (PRMT) and shared-memory tile.

PREPACK=3 drops two kinds of byte moves (``quant._pair_halves``, ``quant._W_TILE_L3``): each
thread's 4-byte register groups (rows r, r + 8 x columns c, c + 1) are stored together, so no PRMT
assembles them from its two 16-byte loads, and each 128-K tile's codes are paired (K = j,
K = 64 + j), so the low nibbles are the tile's first 64 K in order and the high nibbles the last
64: the bf16 activations meet them as two contiguous [BM, 64] loads, not split into even and
odd columns. The two nibbles of a byte then lie in different scale blocks, so the expansion's
asm takes a scale word for each (``_E2M1_ROT_MUL_HI_PTX``). Cross-compiled (BM16 x BN64 x
BK128, one multiply): 3.31 -> 3.06 SASS instructions per weight, PRMT 88 -> 28, same registers;
at BM128 x BN128 5.16 -> 4.16 and no spill stores. Each step adds its products in another order
than levels 0-2, so its bits differ from theirs within a rounding step.

K tail (issue 42). Where BLOCK_K does not divide I (gpt-oss: I = 2880, 22.5 tiles of 128), the
last K step of each program loads the activations, and plain weights and scales, masked past I
(code 0, scale byte 127: exact zeros); prepacked weights are stored padded to 128 (prepack_mxfp4),
so their loads need no per-element mask (one predicate for the step, which only a ragged split's
steps past I turn off). Every other step keeps its unmasked loads, and a kernel without a tail
compiles to the same SASS as before the tail existed.

Ragged SPLIT_K (issue 42). gpt-oss' 23 K steps divide by nothing, and at small M its launch is a
few programs of 23 steps each (M = 1: four experts x 45 column tiles, each a chain of 23 dependent
steps: 26 us against a 4.2 us HBM bound). With SPLIT_K = S each program takes cdiv(steps, S) of
them; the last part's steps past I read zeros (the tail's masks, and a predicate on the prepacked
weights' loads), so S need not divide the steps. Splits of 2 and 4 give 12- and 6-step programs;
unsplit, the 23 steps now run unrolled too (plan.MAX_UNROLLED_STEPS), with their loads ahead
(results/moe_mxfp4/README.md, "Ragged SPLIT_K": M = 1 26.4 -> 15.6 us, M = 48 166 -> 140 us).

Column tiles per program (``N_TILES``, issue 42; config, default 1). At small M a program is short
(4 K steps at KIMI-K2.5) and starts with two dependent round trips (the block's ids and expert id,
then its weights) and ends with an expansion, a wgmma and the atomics that none of its own loads
overlap. With N_TILES > 1 a program runs N_TILES column tiles of its row block as one sequence of
steps (``_load_flat``): the routing's loads are made once, the loads ahead run on into the next
tile while the finished tile's epilogue (``_tile_out``) runs, and the launch has N_TILES times
fewer programs. Each output element gets the same products in the same order (the deterministic
mode gives N_TILES=1's bits). Cross-compiled (BM16 BN64 PREPACK=2): 3.25 SASS instructions per
weight at one tile, 3.03 at two (LOAD_AHEAD 0, 76 registers), 2.88 at four; N_TILES=1 compiles to
the same SASS as before the change.

The K steps are unrolled (I is a constexpr; 4 steps at I = 512), loads stay
plain 128-bit LDGs into registers (Triton's cp.async pipeliner, num_stages > 1,
narrowed the packed-weight copies to 4 bytes and read the scales back byte by
byte), and a loop-carried, rotated version staged the expanded weights through
shared memory instead of keeping them in registers.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .triton_routing import _route_part

__all__ = ["TWO_POW_126"]

TWO_POW_126 = 8.507059173023462e37   # 2**126: undoes the 2**-126 of the bit-placed E2M1 pattern

# Four packed bytes ($4) -> the bf16 patterns of their low nibbles ($0: bytes 0, 1; $1: bytes 2, 3)
# and of their high nibbles ($2, $3), with 32-bit integer ops that handle two bf16 at a time:
# prmt spreads bytes (b0, b1) into the two 16-bit halves, then each half's nibble bits
# e1 e0 m go to bits 8..6 and its sign to bit 15.
_E2M1_PATTERNS_PTX = tl.constexpr("""
{
.reg .b32 t0, t1, u, v;
prmt.b32 t0, $4, 0, 0x4140;
prmt.b32 t1, $4, 0, 0x4342;
shl.b32 u, t0, 6;
shl.b32 v, t0, 12;
and.b32 u, u, 0x01C001C0;
and.b32 v, v, 0x80008000;
or.b32 $0, u, v;
shl.b32 u, t1, 6;
shl.b32 v, t1, 12;
and.b32 u, u, 0x01C001C0;
and.b32 v, v, 0x80008000;
or.b32 $1, u, v;
shl.b32 u, t0, 2;
shl.b32 v, t0, 8;
and.b32 u, u, 0x01C001C0;
and.b32 v, v, 0x80008000;
or.b32 $2, u, v;
shl.b32 u, t1, 2;
shl.b32 v, t1, 8;
and.b32 u, u, 0x01C001C0;
and.b32 v, v, 0x80008000;
or.b32 $3, u, v;
}
""")


# PREPACK=2 (quant.prepack_mxfp4(level=2)): the 32 code bits of the four bytes are stored so
# that each bf16x2 pattern of _E2M1_PATTERNS_PTX is one rotation and one mask of the word
# (quant.ROT_SHIFTS): R0 = w & M, R1 = rotl(w, 4) & M, R2 = rotl(w, 10) & M, R3 from two
# rotations; shf.l.wrap is one SHF in SASS, so 9 instructions instead of 18 per 8 weights.
# Where the mask keeps no bit that wraps around (R1, and R3's rotation by 6) the rotation is a
# plain left shift, which ptxas issues as IMAD.SHL on the FMA pipe: the expansion's busiest pipe
# is the integer ALU (Nsight Compute at M = 64: 67% of its peak), and this moves a quarter of the
# SHFs off it (cross-compiled: 447 -> 383 ALU instructions per thread at BM16 BN64).
_E2M1_ROT_PTX = tl.constexpr("""
{
.reg .b32 x, y;
and.b32 $0, $4, 0x81C081C0;
shl.b32 x, $4, 4;
and.b32 $1, x, 0x81C081C0;
shf.l.wrap.b32 x, $4, $4, 10;
and.b32 $2, x, 0x81C081C0;
shl.b32 x, $4, 6;
shf.l.wrap.b32 y, $4, $4, 14;
and.b32 x, x, 0x80C080C0;
and.b32 y, y, 0x01000100;
or.b32 $3, x, y;
}
""")


# Four e8m0 bytes ($2) -> the bf16 patterns of 2**(s - 127) ($0: bytes 0, 1; $1: bytes 2, 3),
# two per 32-bit op and without compares: s << 7, with bit 6 set for the bytes 0 (the subnormal
# 0x0040 = 2**-127) and 255 (0x7FC0, NaN), the bytes whose s + 1 has no bit in 0xFE.
_SCALE_PATTERNS_PTX = tl.constexpr("""
{
.reg .b32 h, g;
prmt.b32 h, $2, 0, 0x4140;
add.u32 g, h, 0x00010001;
and.b32 g, g, 0x00FE00FE;
add.u32 g, g, 0x00FF00FF;
shr.b32 g, g, 2;
not.b32 g, g;
and.b32 g, g, 0x00400040;
shl.b32 h, h, 7;
or.b32 $0, h, g;
prmt.b32 h, $2, 0, 0x4342;
add.u32 g, h, 0x00010001;
and.b32 g, g, 0x00FE00FE;
add.u32 g, g, 0x00FF00FF;
shr.b32 g, g, 2;
not.b32 g, g;
and.b32 g, g, 0x00400040;
shl.b32 h, h, 7;
or.b32 $1, h, g;
}
""")


# ONE_MUL: four e8m0 bytes ($2), each at most 128 -> the bf16 patterns of 2**(s - 1) ($0: bytes
# 0, 1; $1: bytes 2, 3): (s + 126) << 7 in each 16-bit half, no special bytes (s + 126 <= 254 is
# a normal exponent, and 2**-1 for byte 0), so one multiply of the 2**-126-scaled E2M1 pattern by
# it gives the value the two multiplies give, bit for bit (every product is exact in bf16).
# Written as s * 128 + (126 << 7), one IMAD per two bytes instead of an add and a shift (no carry
# crosses the halves: each is at most 254 << 7 = 0x7F00).
_SCALE_ONE_MUL_PTX = tl.constexpr("""
{
.reg .b32 h;
prmt.b32 h, $2, 0, 0x4140;
mad.lo.u32 $0, h, 128, 0x3F003F00;
prmt.b32 h, $2, 0, 0x4342;
mad.lo.u32 $1, h, 128, 0x3F003F00;
}
""")


def _with_scale_multiply(pattern_ptx: str, hi_scales: bool = False) -> str:
    """ONE_MUL: a pattern PTX ($0..$3 out, $4 in) followed by one bf16x2 multiply of each pattern
    word by its bytes' scale patterns ($5: bytes 0, 1; $6: bytes 2, 3; the low-nibble words $0, $1
    and the high-nibble words $2, $3 hold bytes (0, 1) and (2, 3)). In the same asm block the
    scale words meet the pattern words they belong to as they are; multiplied in Triton, the
    broadcast scales were regrouped into pairs with PRMTs and half the products ran one per op.
    hi_scales (PREPACK=3, whose two nibbles of a byte lie in different scale blocks): the
    high-nibble words take their own scale words, $7 and $8."""
    inner = pattern_ptx.strip()[1:-1]
    for i in range(4):
        inner = inner.replace(f"${i}", f"q{i}")
    hi = ("$7", "$8") if hi_scales else ("$5", "$6")
    return ("{\n.reg .b32 q0, q1, q2, q3;\n" + inner.strip("\n") + "\n"
            "mul.rn.bf16x2 $0, q0, $5;\nmul.rn.bf16x2 $1, q1, $6;\n"
            f"mul.rn.bf16x2 $2, q2, {hi[0]};\nmul.rn.bf16x2 $3, q3, {hi[1]};\n}}\n")


_E2M1_MUL_PTX = tl.constexpr(_with_scale_multiply(_E2M1_PATTERNS_PTX.value))
_E2M1_ROT_MUL_PTX = tl.constexpr(_with_scale_multiply(_E2M1_ROT_PTX.value))
_E2M1_ROT_MUL_HI_PTX = tl.constexpr(_with_scale_multiply(_E2M1_ROT_PTX.value, hi_scales=True))


@triton.jit
def _rotl32(x, k: tl.constexpr):
    return ((x << k) | (x >> (32 - k))) & 0xFFFFFFFF


@triton.jit
def _rot_code(r, h: tl.constexpr):
    """The E2M1 code held by half h of a bf16x2 pattern (e1 e0 m at bits 8..6, sign at 15)."""
    return ((r >> (6 + 16 * h)) & 7) | (((r >> (15 + 16 * h)) & 1) << 3)


@triton.jit
def _unrot_tile(w, R: tl.constexpr, C: tl.constexpr):
    """Interpreter path of PREPACK >= 2: a tile uint8 [R, C] in row and byte-column order whose
    register groups (rows r, r + 8 x columns c, c + 1) carry rearranged bits -> the plain bytes,
    through the same rotations and masks as _E2M1_ROT_PTX."""
    x = tl.permute(tl.reshape(w, (R // 16, 2, 8, C // 2, 2)).to(tl.int64), (0, 2, 3, 4, 1))
    lo_row, hi_row = tl.split(x)               # r3 = 0, 1: [R / 16, r210, C / 2, 2 (c0)]
    b0, b1 = tl.split(lo_row)
    b2, b3 = tl.split(hi_row)
    word = b0 | (b1 << 8) | (b2 << 16) | (b3 << 24)
    r0 = word & 0x81C081C0
    r1 = _rotl32(word, 4) & 0x81C081C0
    r2 = _rotl32(word, 10) & 0x81C081C0
    r3 = (_rotl32(word, 6) & 0x80C080C0) | (_rotl32(word, 14) & 0x01000100)
    c0 = _rot_code(r0, 0) | (_rot_code(r2, 0) << 4)
    c1 = _rot_code(r0, 1) | (_rot_code(r2, 1) << 4)
    c2 = _rot_code(r1, 0) | (_rot_code(r3, 0) << 4)
    c3 = _rot_code(r1, 1) | (_rot_code(r3, 1) << 4)
    x = tl.join(tl.join(c0, c1), tl.join(c2, c3))          # [R / 16, r210, C / 2, c0, r3]
    x = tl.permute(x, (0, 4, 1, 2, 3))
    return tl.reshape(x, (R, C)).to(tl.uint8)


@triton.jit
def _e2m1_halves(packed, scale, R: tl.constexpr, C: tl.constexpr, EXPAND: tl.constexpr):
    """packed uint8 [R, C] (two E2M1 per byte, low nibble first) and e8m0 scales uint8
    [R, C // 16] -> (even, odd): bf16 [R, C] each, the low and the high nibbles, exact
    (NaN where the scale is 0xFF).

    EXPAND picks how the bf16 patterns are built: "ptx" (inline PTX, two values per 32-bit
    op, the default on GPUs), "bits" (Triton int16 ops; the compiler handles one value per
    op), "fp32" (fp32 patterns and fp32 multiplies, same values: Triton's interpreter has
    neither inline assembly nor bf16 arithmetic, so it runs this).
    """
    if EXPAND == "fp32":
        p = packed.to(tl.int32)
        lo = ((p & 0x7) << 22) | ((p & 0x8) << 28)
        hi = ((p & 0x70) << 18) | ((p & 0x80) << 24)
        s = scale.to(tl.int32)
        sbits = tl.where(s == 0, 0x400000, tl.where(s == 255, 0x7FC00000, s << 23))
        f = tl.reshape(tl.broadcast_to(sbits[:, :, None], (R, C // 16, 16)), (R, C)).to(tl.float32, bitcast=True)
        lo = (lo.to(tl.float32, bitcast=True) * 8.507059173023462e37 * f).to(tl.bfloat16)
        hi = (hi.to(tl.float32, bitcast=True) * 8.507059173023462e37 * f).to(tl.bfloat16)
    else:
        if EXPAND == "ptx":
            lo, hi = tl.inline_asm_elementwise(
                asm=_E2M1_PATTERNS_PTX, constraints="=r,=r,=r,=r,r", args=[packed],
                dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            p = packed.to(tl.int16)
            lo = (((p & 0x7) << 6) | ((p & 0x8) << 12)).to(tl.bfloat16, bitcast=True)
            hi = (((p & 0x70) << 2) | ((p & 0x80) << 8)).to(tl.bfloat16, bitcast=True)
        s = scale.to(tl.int16)
        sbits = tl.where(s == 0, 0x40, tl.where(s == 255, 0x7FC0, s << 7)).to(tl.int16)
        f = tl.reshape(tl.broadcast_to(sbits[:, :, None], (R, C // 16, 16)), (R, C)).to(tl.bfloat16, bitcast=True)
        lo = lo * 8.507059173023462e37 * f
        hi = hi * 8.507059173023462e37 * f
    return lo, hi


@triton.jit
def _e2m1_halves_bits(packed, f, EXPAND: tl.constexpr, ROT: tl.constexpr, ONE_MUL: tl.constexpr, f_hi,
                      HI_SCALES: tl.constexpr = False):
    """As _e2m1_halves, with the scales already as bit patterns broadcast to packed's shape
    (``_scale_bits``: int32 fp32 patterns for EXPAND="fp32", int16 bf16 patterns otherwise):
    f for the low nibbles, f_hi for the high ones (the same tensor unless PREPACK=3, which says
    so with HI_SCALES). ROT: the bytes carry PREPACK=2's rearranged bits (EXPAND="ptx" only).
    ONE_MUL: f holds 2**(s - 1) (every scale byte <= 128), so one multiply replaces x 2**126
    then x 2**(s - 127)."""
    if EXPAND == "fp32":
        p = packed.to(tl.int32)
        lo = ((p & 0x7) << 22) | ((p & 0x8) << 28)
        hi = ((p & 0x70) << 18) | ((p & 0x80) << 24)
        f = f.to(tl.float32, bitcast=True)
        f_hi = f_hi.to(tl.float32, bitcast=True)
        if ONE_MUL:
            lo = (lo.to(tl.float32, bitcast=True) * f).to(tl.bfloat16)
            hi = (hi.to(tl.float32, bitcast=True) * f_hi).to(tl.bfloat16)
        else:
            lo = (lo.to(tl.float32, bitcast=True) * 8.507059173023462e37 * f).to(tl.bfloat16)
            hi = (hi.to(tl.float32, bitcast=True) * 8.507059173023462e37 * f_hi).to(tl.bfloat16)
    elif EXPAND == "ptx" and ONE_MUL and HI_SCALES:
        lo, hi = tl.inline_asm_elementwise(
            asm=_E2M1_ROT_MUL_HI_PTX, constraints="=r,=r,=r,=r,r,r,r,r,r",
            args=[packed, f, f_hi], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    elif EXPAND == "ptx" and ONE_MUL:
        lo, hi = tl.inline_asm_elementwise(
            asm=_E2M1_ROT_MUL_PTX if ROT else _E2M1_MUL_PTX, constraints="=r,=r,=r,=r,r,r,r",
            args=[packed, f], dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
    else:
        if EXPAND == "ptx":
            if ROT:
                lo, hi = tl.inline_asm_elementwise(
                    asm=_E2M1_ROT_PTX, constraints="=r,=r,=r,=r,r", args=[packed],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
            else:
                lo, hi = tl.inline_asm_elementwise(
                    asm=_E2M1_PATTERNS_PTX, constraints="=r,=r,=r,=r,r", args=[packed],
                    dtype=(tl.bfloat16, tl.bfloat16), is_pure=True, pack=4)
        else:
            p = packed.to(tl.int16)
            lo = (((p & 0x7) << 6) | ((p & 0x8) << 12)).to(tl.bfloat16, bitcast=True)
            hi = (((p & 0x70) << 2) | ((p & 0x80) << 8)).to(tl.bfloat16, bitcast=True)
        f = f.to(tl.bfloat16, bitcast=True)
        f_hi = f_hi.to(tl.bfloat16, bitcast=True)
        if ONE_MUL:
            lo = lo * f
            hi = hi * f_hi
        else:
            lo = lo * 8.507059173023462e37 * f
            hi = hi * 8.507059173023462e37 * f_hi
    return lo, hi


@triton.jit
def _scale_bits(s, EXPAND: tl.constexpr, ONE_MUL: tl.constexpr = False):
    """e8m0 bytes -> the bit patterns of 2**(s - 127): fp32 (int32) for EXPAND="fp32", else bf16
    (int16); byte 0 is the subnormal 2**-127, byte 255 NaN (as in _e2m1_halves). ONE_MUL: of
    2**(s - 1) instead, for bytes up to 128 only (_SCALE_ONE_MUL_PTX)."""
    if EXPAND == "fp32":
        s = s.to(tl.int32)
        if ONE_MUL:
            bits = (s + 126) << 23
        else:
            bits = tl.where(s == 0, 0x400000, tl.where(s == 255, 0x7FC00000, s << 23))
    else:
        s = s.to(tl.int16)
        if ONE_MUL:
            bits = ((s + 126) << 7).to(tl.int16)
        else:
            bits = tl.where(s == 0, 0x40, tl.where(s == 255, 0x7FC0, s << 7)).to(tl.int16)
    return bits


@triton.jit
def _load_w_prepacked(w_ptr, w_scale_ptr, e, pid_n, k0, stride_we, stride_wn, stride_wse, stride_wsn,
                      NT: tl.constexpr, EXPAND: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      PREPACK: tl.constexpr = 1, ONE_MUL: tl.constexpr = False, KLIM: tl.constexpr = 0,
                      ROW_MASK: tl.constexpr = False, H=0):
    """Step k0 of expert e's weights in the PREPACK layout (quant.prepack_mxfp4): packed [BN, BK/2]
    and the scales' bit patterns broadcast to [BN, BK/2] (PREPACK=3: those of the low and of the
    high nibbles, joined). Each thread loads its bytes of a 64 x 64-byte tile as two 16-byte
    vectors and its 8 scale bytes as one 8-byte vector; the reshapes and permutes below only
    rename registers (the loaded layout is wgmma's; at levels 1 and 2 a PRMT per 4-byte register
    group moves the bytes of row r + 8 next to those of row r, at level 3 they are stored so).
    KLIM: a step that may start at or past I (a ragged SPLIT_K's last part) reads code 0 under scale
    byte 127 there, one predicate for the whole step; a step that holds I's tail reads the padding
    prepack_mxfp4 stored. ROW_MASK (BN does not divide H: gpt-oss' 2880 at BN128): the tile's 64-row
    blocks that start at or past H, past the stored rows (H rounded up to 64), read as zeros, one
    predicate per block."""
    NB: tl.constexpr = BN // 64
    KB: tl.constexpr = BK // 128
    # Dimension order: Triton's load layout gives lanes and warps to the dimensions after the
    # contiguous (last) one in increasing order, so the thread dimension comes first and the
    # tile counts (registers) after it.
    i_t = tl.arange(0, 128)[:, None, None, None, None]
    i_h = tl.arange(0, 2)[None, :, None, None, None]
    i_nb = tl.arange(0, NB)[None, None, :, None, None]
    i_kb = tl.arange(0, KB)[None, None, None, :, None]
    i_j = tl.arange(0, 16)[None, None, None, None, :]
    base = w_ptr + e * stride_we + (pid_n * BN) * stride_wn + (k0 // 128) * 4096
    w_ptrs = base + i_nb * (64 * stride_wn) + i_kb * 4096 + i_h * 2048 + i_t * 16 + i_j
    s_d = tl.arange(0, 4)[:, None, None, None, None, None]      # the lanes c2 c1 share a row's scales
    s_l = tl.arange(0, 8)[None, :, None, None, None, None]
    s_w = tl.arange(0, 4)[None, None, :, None, None, None]
    s_nb = tl.arange(0, NB)[None, None, None, :, None, None]
    s_kb = tl.arange(0, KB)[None, None, None, None, :, None]
    s_j = tl.arange(0, 8)[None, None, None, None, None, :]
    s_base = w_scale_ptr + e * stride_wse + (pid_n * BN) * stride_wsn + (k0 // 128) * 256
    s_ptrs = s_base + s_nb * (64 * stride_wsn) + s_kb * 256 + s_w * 64 + s_l * 8 + s_d * 0 + s_j
    if KLIM or ROW_MASK:
        w_m = (k0 < KLIM) if KLIM else True
        s_m = w_m
        if ROW_MASK:
            w_m = w_m & (pid_n * BN + i_nb * 64 < H)
            s_m = s_m & (pid_n * BN + s_nb * 64 < H)
        w = _ld(w_ptrs, w_m, 0, NT)
        w_s = _ld(s_ptrs, s_m, 127, NT)
    elif NT:
        w = tl.load(w_ptrs, eviction_policy="evict_first")
        w_s = tl.load(s_ptrs, eviction_policy="evict_first")
    else:
        w = tl.load(w_ptrs)
        w_s = tl.load(s_ptrs)
    if PREPACK == 3:
        # [(r54, r210, c21), c5, nb, kb, (c43, r3, c0)] -> [nb, r54, r3, r210, kb, c5, c43, c21, c0]
        w = tl.reshape(w, (4, 8, 4, 2, NB, KB, 4, 2, 2))
        w = tl.reshape(tl.permute(w, (4, 0, 7, 1, 5, 3, 6, 2, 8)), (BN, BK // 2))
    else:
        # [(r54, r210, c21), r3, nb, kb, (c543, c0)] -> [nb, r54, r3, r210, kb, c543, c21, c0]
        w = tl.reshape(w, (4, 8, 4, 2, NB, KB, 8, 2))
        w = tl.reshape(tl.permute(w, (4, 0, 3, 1, 5, 6, 2, 7)), (BN, BK // 2))
    if PREPACK >= 2 and EXPAND != "ptx":
        w = _unrot_tile(w, BN, BK // 2)
    if EXPAND == "ptx":
        f = tl.inline_asm_elementwise(asm=_SCALE_ONE_MUL_PTX if ONE_MUL else _SCALE_PATTERNS_PTX,
                                      constraints="=r,=r,r", args=[w_s], dtype=tl.int16, is_pure=True, pack=4)
    else:
        f = _scale_bits(w_s, EXPAND, ONE_MUL)
    if PREPACK == 3:
        # block g = 2 gh + gl: the low nibbles of column (c5, ...) are in block c5, the high in 2 + c5
        f_lo, f_hi = tl.split(tl.permute(tl.reshape(f, (4, 8, 4, NB, KB, 2, 2, 2)), (0, 1, 2, 3, 4, 5, 7, 6)))
        f = tl.join(_broadcast_scales(f_lo, 2, NB, BN, BK), _broadcast_scales(f_hi, 2, NB, BN, BK))
    else:
        f = _broadcast_scales(f, 4, NB, BN, BK)
    return w, f


@triton.jit
def _broadcast_scales(f, G: tl.constexpr, NB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """A thread's scale patterns [c21, r210, r54, nb, kb, r3, G blocks] -> [BN, BK/2], each
    pattern repeated over the byte columns of its block (G = 4: the blocks of c5 c4; G = 2, for
    PREPACK=3's halves: of c5)."""
    # [c21, r210, r54, nb, kb, r3, g] + (c43 or c3, c0) -> [nb, r54, r3, r210, kb, g, c.., c21, c0]
    f = tl.reshape(f, (4, 8, 4, NB, BK // 128, 2, G, 1, 1))
    f = tl.broadcast_to(f, (4, 8, 4, NB, BK // 128, 2, G, 8 // G, 2))
    return tl.reshape(tl.permute(f, (3, 2, 5, 1, 4, 6, 7, 0, 8)), (BN, BK // 2))


@triton.jit
def _e2m1_to_bf16(packed, scale, R: tl.constexpr, C: tl.constexpr, EXPAND: tl.constexpr):
    """As _e2m1_halves, interleaved back into K order: bf16 [R, 2C]."""
    lo, hi = _e2m1_halves(packed, scale, R, C, EXPAND)
    return tl.reshape(tl.join(lo, hi), (R, 2 * C))


@triton.jit
def _ld(ptrs, mask, other, NT: tl.constexpr):
    """A masked load, evict-first with NT."""
    if NT:
        return tl.load(ptrs, mask=mask, other=other, eviction_policy="evict_first")
    else:
        return tl.load(ptrs, mask=mask, other=other)


@triton.jit
def _load_a(a_ptr, a_scale_ptr, rows, ok, k0, stride_am, stride_asm,
            A_FP4: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, HALVES: tl.constexpr = False,
            KLIM: tl.constexpr = 0):
    """Step k0 of the gathered activation rows: bf16 [BM, BK], or packed [BM, BK/2] + scales.
    HALVES (PREPACK=3): the first and the second 64 columns of each 128-column tile apart, the K
    order of the weights' low and high nibbles: bf16 as two [BM, BK/2] tiles; MXFP4 as the two
    halves' packed bytes [BM, BK/4, 2] and scales [BM, BK/64, 2], each joined (_mma expands them).
    KLIM (the step that holds I's tail, I % BK != 0): columns at or past KLIM = I read as zeros
    (packed code 0, scale byte 127), so the tail adds exact zeros."""
    if HALVES and not A_FP4:
        i = tl.arange(0, BK // 2)
        rk = k0 + (i // 64) * 128 + i % 64
        a_ptrs = a_ptr + rows[:, None] * stride_am + rk[None, :]
        if KLIM:
            a = tl.load(a_ptrs, mask=ok[:, None] & (rk < KLIM)[None, :], other=0.0)
            a_s = tl.load(a_ptrs + 64, mask=ok[:, None] & (rk + 64 < KLIM)[None, :], other=0.0)
        else:
            a = tl.load(a_ptrs, mask=ok[:, None], other=0.0)
            a_s = tl.load(a_ptrs + 64, mask=ok[:, None], other=0.0)
    elif HALVES:
        # gathered apart, each half expands in K order with no split of the expanded tile (which
        # Triton staged through shared memory: 4.94 SASS instructions per weight against 4.16)
        i = tl.arange(0, BK // 4)
        rkp = k0 // 2 + (i // 32) * 64 + i % 32
        j = tl.arange(0, BK // 64)
        rks = k0 // 32 + (j // 2) * 4 + j % 2
        p_ptrs = a_ptr + rows[:, None] * stride_am + rkp[None, :]
        s_ptrs = a_scale_ptr + rows[:, None] * stride_asm + rks[None, :]
        if KLIM:
            a = tl.join(tl.load(p_ptrs, mask=ok[:, None] & (rkp < KLIM // 2)[None, :], other=0),
                        tl.load(p_ptrs + 32, mask=ok[:, None] & (rkp + 32 < KLIM // 2)[None, :], other=0))
            a_s = tl.join(tl.load(s_ptrs, mask=ok[:, None] & (rks < KLIM // 32)[None, :], other=127),
                          tl.load(s_ptrs + 2, mask=ok[:, None] & (rks + 2 < KLIM // 32)[None, :], other=127))
        else:
            a = tl.join(tl.load(p_ptrs, mask=ok[:, None], other=0), tl.load(p_ptrs + 32, mask=ok[:, None], other=0))
            a_s = tl.join(tl.load(s_ptrs, mask=ok[:, None], other=127),
                          tl.load(s_ptrs + 2, mask=ok[:, None], other=127))
    elif A_FP4:
        rkp = k0 // 2 + tl.arange(0, BK // 2)
        rks = k0 // 32 + tl.arange(0, BK // 32)
        pm = ok[:, None]
        sm = ok[:, None]
        if KLIM:
            pm = pm & (rkp < KLIM // 2)[None, :]
            sm = sm & (rks < KLIM // 32)[None, :]
        a = tl.load(a_ptr + rows[:, None] * stride_am + rkp[None, :], mask=pm, other=0)
        a_s = tl.load(a_scale_ptr + rows[:, None] * stride_asm + rks[None, :], mask=sm, other=127)
    else:
        rk = k0 + tl.arange(0, BK)
        am = ok[:, None]
        if KLIM:
            am = am & (rk < KLIM)[None, :]
        a = tl.load(a_ptr + rows[:, None] * stride_am + rk[None, :], mask=am, other=0.0)
        a_s = a
    return a, a_s


@triton.jit
def _load_w(w_ptr, w_scale_ptr, e, tile, rn, n_ok, H, k0, stride_we, stride_wn, stride_wse, stride_wsn,
            NT: tl.constexpr, EVEN_N: tl.constexpr, BK: tl.constexpr, PREPACK: tl.constexpr = 0,
            EXPAND: tl.constexpr = "ptx", BN: tl.constexpr = 64, ONE_MUL: tl.constexpr = False,
            KLIM: tl.constexpr = 0):
    """Step k0 of expert e's packed weights [BN, BK/2] and scales [BN, BK/32] of column tile
    ``tile`` (rn: its columns; PREPACK: the scales' bit patterns, broadcast to [BN, BK/2]). KLIM (a
    step that may hold I's tail or lie past I): codes past I read as 0 under scale byte 127 (prepacked
    weights hold the tail's padding in memory and mask only steps wholly past it). Prepacked and not
    EVEN_N, the tile's 64-row blocks that start at or past H (past the stored rows) read as zeros."""
    if PREPACK:
        w, w_s = _load_w_prepacked(w_ptr, w_scale_ptr, e, tile, k0, stride_we, stride_wn,
                                   stride_wse, stride_wsn, NT, EXPAND, BN, BK, PREPACK, ONE_MUL, KLIM,
                                   not EVEN_N, H)
    else:
        rkp = k0 // 2 + tl.arange(0, BK // 2)
        rks = k0 // 32 + tl.arange(0, BK // 32)
        w_ptrs = w_ptr + e * stride_we + rn[:, None] * stride_wn + rkp[None, :]
        s_ptrs = w_scale_ptr + e * stride_wse + rn[:, None] * stride_wsn + rks[None, :]
        # NT: the weights are read once per token block; evict_first keeps them from pushing
        # the activations and the output rows out of L2.
        if EVEN_N and not KLIM:
            if NT:
                w = tl.load(w_ptrs, eviction_policy="evict_first")
                w_s = tl.load(s_ptrs, eviction_policy="evict_first")
            else:
                w = tl.load(w_ptrs)
                w_s = tl.load(s_ptrs)
        elif EVEN_N:
            w = _ld(w_ptrs, (rkp < KLIM // 2)[None, :], 0, NT)
            w_s = _ld(s_ptrs, (rks < KLIM // 32)[None, :], 127, NT)
        elif KLIM:
            w = _ld(w_ptrs, n_ok[:, None] & (rkp < KLIM // 2)[None, :], 0, NT)
            w_s = _ld(s_ptrs, n_ok[:, None] & (rks < KLIM // 32)[None, :], 127, NT)
        else:
            w = _ld(w_ptrs, n_ok[:, None], 0, NT)
            w_s = _ld(s_ptrs, n_ok[:, None], 127, NT)
    return w, w_s


@triton.jit
def _mma(acc, a, a_s, w, w_s, A_FP4: tl.constexpr, SWAP_AB: tl.constexpr, EXPAND: tl.constexpr,
         BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREPACK: tl.constexpr = 0,
         ONE_MUL: tl.constexpr = False):
    """acc += one K step. The sum over K does not care about order, so the step is two dots
    over its even and its odd K indices: the weights' low and high nibbles expand into two
    tiles that need no interleaving, and bf16 activations split into their even and odd
    columns (a register-only split of adjacent pairs). PREPACK: w_s holds the scales' bit
    patterns already broadcast to w's shape (_load_w_prepacked); PREPACK=3: the low and high
    nibbles hold the first and second halves of each 128-K tile, so the activations' halves
    meet them as loaded, and w_s is the two halves' scale patterns joined."""
    if PREPACK == 3:
        f_lo, f_hi = tl.split(w_s)
        w_even, w_odd = _e2m1_halves_bits(w, f_lo, EXPAND, True, ONE_MUL, f_hi, True)
    elif PREPACK:
        w_even, w_odd = _e2m1_halves_bits(w, w_s, EXPAND, PREPACK == 2, ONE_MUL, w_s)
    else:
        w_even, w_odd = _e2m1_halves(w, w_s, BN, BK // 2, EXPAND)
    if PREPACK == 3:
        # the weights' "even" and "odd" tiles are the first and second halves of each 128-K tile
        if A_FP4:
            p_lo, p_hi = tl.split(a)
            s_lo, s_hi = tl.split(a_s)
            a_even = _e2m1_to_bf16(p_lo, s_lo, BM, BK // 4, EXPAND)
            a_odd = _e2m1_to_bf16(p_hi, s_hi, BM, BK // 4, EXPAND)
        else:
            a_even, a_odd = a, a_s                         # _load_a(HALVES) loaded them apart
    elif A_FP4:
        a_even, a_odd = _e2m1_halves(a, a_s, BM, BK // 2, EXPAND)
    else:
        a_even, a_odd = tl.split(tl.reshape(a, (BM, BK // 2, 2)))
    if SWAP_AB:
        acc = tl.dot(w_even, tl.trans(a_even), acc)       # [BN, BM]
        acc = tl.dot(w_odd, tl.trans(a_odd), acc)
    else:
        acc = tl.dot(a_even, tl.trans(w_even), acc)       # [BM, BN]
        acc = tl.dot(a_odd, tl.trans(w_odd), acc)
    return acc


@triton.jit
def _load_step(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, ok, e, tile, rn, n_ok, H, k0,
               stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
               A_FP4: tl.constexpr, NT: tl.constexpr, EVEN_N: tl.constexpr, EXPAND: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREPACK: tl.constexpr,
               ONE_MUL: tl.constexpr, KLIM: tl.constexpr):
    """The loads of one K step (activations, weights, scales); KLIM: I, on the step holding its tail."""
    a, a_s = _load_a(a_ptr, a_scale_ptr, rows, ok, k0, stride_am, stride_asm, A_FP4, BM, BK, PREPACK == 3, KLIM)
    w, w_s = _load_w(w_ptr, w_scale_ptr, e, tile, rn, n_ok, H, k0, stride_we, stride_wn, stride_wse, stride_wsn,
                     NT, EVEN_N, BK, PREPACK, EXPAND, BN, ONE_MUL, KLIM)
    return a, a_s, w, w_s


@triton.jit
def _moe_mxfp4_down_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr,
    sorted_ids_ptr, sorted_weights_ptr, expert_ids_ptr, num_rows_ptr,
    num_pairs, H,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    TOP_K: tl.constexpr, A_FP4: tl.constexpr, ATOMIC: tl.constexpr, NT: tl.constexpr,
    EARLY_LOADS: tl.constexpr, PREFETCH_EPILOGUE: tl.constexpr, SWAP_AB: tl.constexpr,
    EVEN_N: tl.constexpr, EXPAND: tl.constexpr, K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LOAD_AHEAD: tl.constexpr = 0,
    PREPACK: tl.constexpr = 0, ONE_MUL: tl.constexpr = False, SPLIT_K: tl.constexpr = 1,
    MAX_UNROLL: tl.constexpr = 16, N_TILES: tl.constexpr = 1,
):
    """Program (m, n, k) of the grid (row blocks, column tiles / N_TILES, SPLIT_K): ``_down_tile``."""
    pid_k = 0
    if SPLIT_K > 1:
        pid_k = tl.program_id(2)
    _down_tile(tl.program_id(0), tl.program_id(1), pid_k,
               a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr,
               sorted_ids_ptr, sorted_weights_ptr, expert_ids_ptr, num_rows_ptr, num_pairs, H,
               stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
               TOP_K, A_FP4, ATOMIC, NT, EARLY_LOADS, PREFETCH_EPILOGUE, SWAP_AB, EVEN_N, EXPAND, K, BM, BN, BK,
               LOAD_AHEAD, PREPACK, ONE_MUL, SPLIT_K, MAX_UNROLL, N_TILES)


@triton.jit
def _moe_mxfp4_down_routed_kernel(
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr,
    ids_ptr, wts_ptr, sorted_ids_ptr, sorted_weights_ptr, expert_ids_ptr, num_rows_ptr, sync_ptr,
    num_pairs, H,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    out_words, max_rows, max_blocks, programs, part_stride,
    TOP_K: tl.constexpr, A_FP4: tl.constexpr, ATOMIC: tl.constexpr, NT: tl.constexpr,
    EARLY_LOADS: tl.constexpr, PREFETCH_EPILOGUE: tl.constexpr, SWAP_AB: tl.constexpr,
    EVEN_N: tl.constexpr, EXPAND: tl.constexpr, K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LOAD_AHEAD: tl.constexpr = 0,
    PREPACK: tl.constexpr = 0, ONE_MUL: tl.constexpr = False, SPLIT_K: tl.constexpr = 1,
    MAX_UNROLL: tl.constexpr = 16, N_TILES: tl.constexpr = 1,
    NE: tl.constexpr = 1, NB: tl.constexpr = 16, CH: tl.constexpr = 16, G: tl.constexpr = 1,
    FILL: tl.constexpr = 1024,
):
    """The down-projection from the router's ids in one launch: routing, zeroing and tiles.

    ids_ptr / wts_ptr: the router's contiguous topk_ids / topk_weights [M, top_k]; the routing's
    four buffers (``routing.py``'s layout, max_rows and max_blocks long) are written by the
    routing parts, then read by the tiles; sync_ptr: int64 [2], zero when made and never reset (a ticket counter and a count of
    finished routing parts, both counting on across calls). The grid is the plain kernel's
    (row blocks, column tiles / N_TILES, SPLIT_K), ``programs`` of them; R = cdiv(NE, G) + 1
    routing parts.

    Each program takes a ticket (an atomic add) as it starts. Ticket t < part_stride makes
    routing parts t, t + part_stride, ... (``triton_routing._route_part``, what the routing
    kernel's programs do) and zeroes their share of out, then counts them finished (release).
    part_stride is the number of programs on a GPU, 1 in Triton's interpreter (it runs programs
    one after the other: the first makes every part). Then every program waits
    (acquire) until the call's R parts are finished and runs its own tile (``_down_tile``, by
    its program ids, as the plain kernel). Waiting is safe: tickets are handed out in the order
    programs start, and a program finishes its own parts before it waits, so every part is held
    by a program that is running or done. The call's number is ticket // programs (calls on one
    stream run one after the other), so the counters never need resetting, in a CUDA graph
    either. Costs two round trips to L2 per program before its loads (the ticket, then the count:
    reading both in one 2-lane atomic raised the tiles' registers from 79 to 100, cross-compiled)
    and the routing's own work once per call."""
    t = tl.atomic_add(sync_ptr, 1).to(tl.int64)
    call = t // programs
    t = t - call * programs
    R: tl.constexpr = (NE + G - 1) // G + 1
    if t < tl.minimum(R, part_stride):
        chunk = (out_words + R - 1) // R                   # out's int32 words each part zeroes
        zero_ptr = out_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
        for part in range(t.to(tl.int32), R, part_stride):
            z0 = part * chunk
            z1 = tl.minimum(z0 + chunk, out_words)
            for w0 in range(z0, z1, FILL):
                wi = w0 + tl.arange(0, FILL)
                tl.store(zero_ptr + wi, tl.zeros([FILL], dtype=tl.int32), mask=wi < z1)
            _route_part(part, ids_ptr, wts_ptr, sorted_ids_ptr, sorted_weights_ptr, expert_ids_ptr,
                        num_rows_ptr, ids_ptr, num_pairs, NE, max_rows, max_blocks, TOP_K, 1, TOP_K, 1,
                        TOP_K, BM, NB, CH, G, FILL, False)
        tl.debug_barrier()                                  # every thread's stores before the release
        tl.atomic_add(sync_ptr + 1, (R - 1 - t) // part_stride + 1, sem="release")
    # this call's parts all finished: done counts on across calls and a later call cannot start
    # before this one ends, so done >= target means this call's (an acquire: the routing's stores
    # are seen by this program's loads that follow)
    target = (call + 1) * R
    done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
    while done < target:
        done = tl.atomic_add(sync_ptr + 1, 0, sem="acquire")
    pid_k = 0
    if SPLIT_K > 1:
        pid_k = tl.program_id(2)
    _down_tile(tl.program_id(0), tl.program_id(1), pid_k,
               a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr,
               sorted_ids_ptr, sorted_weights_ptr, expert_ids_ptr, num_rows_ptr, num_pairs, H,
               stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
               TOP_K, A_FP4, ATOMIC, NT, EARLY_LOADS, PREFETCH_EPILOGUE, SWAP_AB, EVEN_N, EXPAND, K, BM, BN, BK,
               LOAD_AHEAD, PREPACK, ONE_MUL, SPLIT_K, MAX_UNROLL, N_TILES)


@triton.jit
def _down_tile(
    pid_m, pid_n, pid_k,
    a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr,
    sorted_ids_ptr, sorted_weights_ptr, expert_ids_ptr, num_rows_ptr,
    num_pairs, H,
    stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn, stride_om,
    TOP_K: tl.constexpr, A_FP4: tl.constexpr, ATOMIC: tl.constexpr, NT: tl.constexpr,
    EARLY_LOADS: tl.constexpr, PREFETCH_EPILOGUE: tl.constexpr, SWAP_AB: tl.constexpr,
    EVEN_N: tl.constexpr, EXPAND: tl.constexpr, K: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, LOAD_AHEAD: tl.constexpr,
    PREPACK: tl.constexpr, ONE_MUL: tl.constexpr, SPLIT_K: tl.constexpr,
    MAX_UNROLL: tl.constexpr, N_TILES: tl.constexpr,
):
    """One BM x BN tile of the down-projection, or N_TILES of them side by side, one after the other
    (with SPLIT_K > 1, its part program_id(2) of the cdiv(K, BK) steps, cdiv(steps, SPLIT_K) each);
    out is [M, H] (ATOMIC) or the per-pair workspace [pairs, H]. Where BK does not divide K = I,
    the step holding I's tail reads the columns past I as zeros (KT = I: the masks of _load_a /
    _load_w; prepacked weights hold zero codes there, prepack_mxfp4's padding), so the tail adds
    exact zeros and the other steps keep their unmasked loads. A ragged split (SPLIT_K does not
    divide the steps: gpt-oss' 23) gives the last part steps past I, read the same way (zeros,
    the prepacked weights' loads predicated off): masked are the steps from J_MASK on, those that
    lie at or past I's last step in the last part (the launcher checks that every part has one
    step before I's end)."""
    TOTAL_STEPS: tl.constexpr = (K + BK - 1) // BK
    NSTEPS: tl.constexpr = (TOTAL_STEPS + SPLIT_K - 1) // SPLIT_K
    RAGGED: tl.constexpr = NSTEPS * SPLIT_K != TOTAL_STEPS
    KT: tl.constexpr = K if (K % BK or RAGGED) else 0     # the mask limit of the masked steps, 0: none
    J_MASK: tl.constexpr = TOTAL_STEPS - 1 - (SPLIT_K - 1) * NSTEPS if KT else NSTEPS
    K_FIRST: tl.constexpr = KT if J_MASK == 0 else 0
    J_PEEL: tl.constexpr = J_MASK if J_MASK > 0 else 1    # the loop form's first peeled (masked) step
    k_lo = 0                    # a constant without SPLIT_K: the step offsets fold
    if SPLIT_K > 1:
        k_lo = pid_k * (NSTEPS * BK)
    rm = pid_m * BM + tl.arange(0, BM)
    tile0 = pid_n * N_TILES          # N_TILES column tiles per program, one after the other
    rn = tile0 * BN + tl.arange(0, BN)
    n_ok = rn < H
    if EARLY_LOADS:
        ids = tl.load(sorted_ids_ptr + rm)
        ok = ids < num_pairs
        rows = ids.to(tl.int64)
        e = tl.maximum(tl.load(expert_ids_ptr + pid_m), 0).to(tl.int64)
        a0, as0, w0, ws0 = _load_step(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, ok, e, tile0, rn, n_ok, H, k_lo,
                                      stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
                                      A_FP4, NT, EVEN_N, EXPAND, BM, BN, BK, PREPACK, ONE_MUL, K_FIRST)
    if PREFETCH_EPILOGUE:
        wts = tl.load(sorted_weights_ptr + rm)
    else:
        wts = tl.zeros((BM,), dtype=tl.float32)     # loaded where first needed (_tile_done, the epilogue)
    if pid_m * BM >= tl.load(num_rows_ptr):
        return
    if not EARLY_LOADS:
        ids = tl.load(sorted_ids_ptr + rm)
        ok = ids < num_pairs
        rows = ids.to(tl.int64)
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        a0, as0, w0, ws0 = _load_step(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, ok, e, tile0, rn, n_ok, H, k_lo,
                                      stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
                                      A_FP4, NT, EVEN_N, EXPAND, BM, BN, BK, PREPACK, ONE_MUL, K_FIRST)

    if SWAP_AB:
        acc = tl.zeros((BN, BM), dtype=tl.float32)
    else:
        acc = tl.zeros((BM, BN), dtype=tl.float32)
    # K is a constexpr: the K steps are unrolled (4 at I = 512), so each step's loads,
    # expansion and dot are straight-line code the scheduler can overlap, and the expanded
    # weights go from registers straight into wgmma (a loop-carried tile was staged
    # through shared memory instead). Up to MAX_UNROLL steps: a long reduction (Mixtral's
    # I = 14336, 112 steps of 128) unrolled took minutes to compile, so it runs as a loop. Each
    # iteration consumes what it loads: the inline PTX expansion takes its operands four
    # elements per 32-bit register as they were loaded, and a tile carried across iterations
    # may come back in another register order (on the GPU the prepacked layout's bytes did).
    # The masked steps (I's tail, a ragged split's steps past I) are peeled off the loop, so the
    # loop's loads stay unmasked.
    if NSTEPS > MAX_UNROLL:
        acc = _mma(acc, a0, as0, w0, ws0, A_FP4, SWAP_AB, EXPAND, BM, BN, BK, PREPACK, ONE_MUL)
        for s in range(1, J_MASK):
            a, a_s, w, w_s = _load_step(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, ok, e, tile0, rn, n_ok, H,
                                        k_lo + s * BK, stride_am, stride_asm, stride_we, stride_wn, stride_wse,
                                        stride_wsn, A_FP4, NT, EVEN_N, EXPAND, BM, BN, BK, PREPACK, ONE_MUL, 0)
            acc = _mma(acc, a, a_s, w, w_s, A_FP4, SWAP_AB, EXPAND, BM, BN, BK, PREPACK, ONE_MUL)
        for s in tl.static_range(J_PEEL, NSTEPS):
            a, a_s, w, w_s = _load_step(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, ok, e, tile0, rn, n_ok, H,
                                        k_lo + s * BK, stride_am, stride_asm, stride_we, stride_wn,
                                        stride_wse, stride_wsn, A_FP4, NT, EVEN_N, EXPAND, BM, BN, BK, PREPACK,
                                        ONE_MUL, KT)
            acc = _mma(acc, a, a_s, w, w_s, A_FP4, SWAP_AB, EXPAND, BM, BN, BK, PREPACK, ONE_MUL)
    elif LOAD_AHEAD == 0:
        acc = _mma(acc, a0, as0, w0, ws0, A_FP4, SWAP_AB, EXPAND, BM, BN, BK, PREPACK, ONE_MUL)
        for j in tl.static_range(1, NSTEPS * N_TILES):
            a, a_s, w, w_s = _load_flat(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, ok, e, pid_n, k_lo, H,
                                        stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
                                        A_FP4, NT, EVEN_N, EXPAND, BM, BN, BK, PREPACK, ONE_MUL, j, NSTEPS, N_TILES, KT,
                                        J_MASK)
            if j % NSTEPS == 0:        # the previous tile is done: its epilogue runs under this tile's loads
                acc, wts = _tile_done(acc, wts, sorted_weights_ptr, rm, ids, rows, ok, tile0 + j // NSTEPS - 1, H,
                                      out_ptr, stride_om, TOP_K, ATOMIC, SWAP_AB, BN, not PREFETCH_EPILOGUE)
            acc = _mma(acc, a, a_s, w, w_s, A_FP4, SWAP_AB, EXPAND, BM, BN, BK, PREPACK, ONE_MUL)
    else:
        # LOAD_AHEAD = L: the loads of steps j + 1 .. j + L are in flight while step j expands
        # and multiplies (slots 0..3 hold steps j..j+3; the unrolled code rotates them), so a
        # program keeps up to (L + 1) steps of weight bytes in flight instead of one. With
        # N_TILES > 1 the steps run on into the next column tile (_load_flat), so its first
        # loads are in flight while the finished tile's epilogue runs.
        TOTAL: tl.constexpr = NSTEPS * N_TILES
        a1, as1, w1, ws1 = a0, as0, w0, ws0
        a2, as2, w2, ws2 = a0, as0, w0, ws0
        a3, as3, w3, ws3 = a0, as0, w0, ws0
        if LOAD_AHEAD >= 1 and TOTAL > 1:
            a1, as1, w1, ws1 = _load_flat(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, ok, e, pid_n, k_lo, H,
                                          stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
                                          A_FP4, NT, EVEN_N, EXPAND, BM, BN, BK, PREPACK, ONE_MUL, 1, NSTEPS, N_TILES, KT,
                                          J_MASK)
        if LOAD_AHEAD >= 2 and TOTAL > 2:
            a2, as2, w2, ws2 = _load_flat(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, ok, e, pid_n, k_lo, H,
                                          stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
                                          A_FP4, NT, EVEN_N, EXPAND, BM, BN, BK, PREPACK, ONE_MUL, 2, NSTEPS, N_TILES, KT,
                                          J_MASK)
        if LOAD_AHEAD >= 3 and TOTAL > 3:
            a3, as3, w3, ws3 = _load_flat(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, ok, e, pid_n, k_lo, H,
                                          stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
                                          A_FP4, NT, EVEN_N, EXPAND, BM, BN, BK, PREPACK, ONE_MUL, 3, NSTEPS, N_TILES, KT,
                                          J_MASK)
        for j in tl.static_range(TOTAL):
            acc = _mma(acc, a0, as0, w0, ws0, A_FP4, SWAP_AB, EXPAND, BM, BN, BK, PREPACK, ONE_MUL)
            a0, as0, w0, ws0 = a1, as1, w1, ws1
            a1, as1, w1, ws1 = a2, as2, w2, ws2
            a2, as2, w2, ws2 = a3, as3, w3, ws3
            if j + LOAD_AHEAD + 1 < TOTAL:        # the step that now enters the last slot
                an, asn, wn, wsn = _load_flat(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, ok, e, pid_n, k_lo, H,
                                              stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
                                              A_FP4, NT, EVEN_N, EXPAND, BM, BN, BK, PREPACK, ONE_MUL,
                                              j + LOAD_AHEAD + 1, NSTEPS, N_TILES, KT, J_MASK)
                if LOAD_AHEAD == 1:
                    a1, as1, w1, ws1 = an, asn, wn, wsn
                elif LOAD_AHEAD == 2:
                    a2, as2, w2, ws2 = an, asn, wn, wsn
                else:
                    a3, as3, w3, ws3 = an, asn, wn, wsn
            if j % NSTEPS == NSTEPS - 1 and j + 1 < TOTAL:     # a tile done, not the program's last
                acc, wts = _tile_done(acc, wts, sorted_weights_ptr, rm, ids, rows, ok, tile0 + j // NSTEPS, H,
                                      out_ptr, stride_om, TOP_K, ATOMIC, SWAP_AB, BN, not PREFETCH_EPILOGUE)
    if not PREFETCH_EPILOGUE:
        wts = tl.load(sorted_weights_ptr + rm)
    if N_TILES > 1:
        rn = (tile0 + N_TILES - 1) * BN + tl.arange(0, BN)
        n_ok = rn < H
    _tile_out(acc, wts, ids, rows, ok, rn, n_ok, out_ptr, stride_om, TOP_K, ATOMIC, SWAP_AB)


@triton.jit
def _tile_done(acc, wts, sorted_weights_ptr, rm, ids, rows, ok, tile, H, out_ptr, stride_om, TOP_K: tl.constexpr,
               ATOMIC: tl.constexpr, SWAP_AB: tl.constexpr, BN: tl.constexpr, LOAD_WTS: tl.constexpr):
    """N_TILES > 1: the epilogue of a finished column tile inside the program's steps; returns the
    accumulator zeroed for the next tile and the routing weights (loaded here with LOAD_WTS)."""
    if LOAD_WTS:
        wts = tl.load(sorted_weights_ptr + rm)
    rn = tile * BN + tl.arange(0, BN)
    _tile_out(acc, wts, ids, rows, ok, rn, rn < H, out_ptr, stride_om, TOP_K, ATOMIC, SWAP_AB)
    return tl.zeros_like(acc), wts


@triton.jit
def _tile_out(acc, wts, ids, rows, ok, rn, n_ok, out_ptr, stride_om, TOP_K: tl.constexpr, ATOMIC: tl.constexpr,
              SWAP_AB: tl.constexpr):
    """The epilogue of the column tile of columns rn (n_ok: rn < H): each row times its routing
    weight (fp32), rounded to bf16, added to out[token] with atomics (ATOMIC) or stored to the
    pair's workspace row."""
    if SWAP_AB:
        acc = tl.trans(acc)
    val = (acc * wts[:, None]).to(out_ptr.dtype.element_ty)
    mask = ok[:, None] & n_ok[None, :]
    if ATOMIC:
        tok = (ids // TOP_K).to(tl.int64)
        tl.atomic_add(out_ptr + tok[:, None] * stride_om + rn[None, :], val, mask=mask, sem="relaxed")
    else:
        tl.store(out_ptr + rows[:, None] * stride_om + rn[None, :], val, mask=mask)


@triton.jit
def _load_flat(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, ok, e, pid_n, k_lo, H,
               stride_am, stride_asm, stride_we, stride_wn, stride_wse, stride_wsn,
               A_FP4: tl.constexpr, NT: tl.constexpr, EVEN_N: tl.constexpr, EXPAND: tl.constexpr,
               BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PREPACK: tl.constexpr,
               ONE_MUL: tl.constexpr, J: tl.constexpr, NSTEPS: tl.constexpr, N_TILES: tl.constexpr,
               KT: tl.constexpr, J_MASK: tl.constexpr):
    """The loads of a program's step J, counted over its N_TILES column tiles in turn: K step
    J % NSTEPS of tile pid_n * N_TILES + J // NSTEPS (masked by KT from K step J_MASK on)."""
    tile = pid_n * N_TILES + J // NSTEPS
    rn = tile * BN + tl.arange(0, BN)
    return _load_step(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, rows, ok, e, tile, rn, rn < H, H,
                      k_lo + (J % NSTEPS) * BK, stride_am, stride_asm, stride_we, stride_wn, stride_wse,
                      stride_wsn, A_FP4, NT, EVEN_N, EXPAND, BM, BN, BK, PREPACK, ONE_MUL,
                      KT if J % NSTEPS >= J_MASK else 0)


@triton.jit
def _reduce_topk_kernel(ws_ptr, out_ptr, M, H, stride_wsm, stride_om,
                        TOP_K: tl.constexpr, ACCUMULATE: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """out[t] (+)= sum_k ws[t * TOP_K + k], in slot order, in fp32: the deterministic mode's reduction."""
    rt = tl.program_id(0) * BT + tl.arange(0, BT)
    rh = tl.program_id(1) * BH + tl.arange(0, BH)
    mask = (rt < M)[:, None] & (rh < H)[None, :]
    rows = rt.to(tl.int64) * TOP_K
    acc = tl.zeros((BT, BH), dtype=tl.float32)
    o_ptrs = out_ptr + rt.to(tl.int64)[:, None] * stride_om + rh[None, :]
    if ACCUMULATE:
        acc += tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(TOP_K):
        acc += tl.load(ws_ptr + (rows + k)[:, None] * stride_wsm + rh[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(w_ptr, w_scale_ptr, out_ptr, R, C, EXPAND: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """MXFP4 rows (packed [R, C], scales [R, C / 16]) -> bf16 [R, 2C], with the main kernel's expansion."""
    rr = tl.program_id(0) * BR + tl.arange(0, BR)
    rc = tl.program_id(1) * BC + tl.arange(0, BC)
    rs = tl.program_id(1) * (BC // 16) + tl.arange(0, BC // 16)
    r_ok = (rr < R)[:, None]
    rows = rr.to(tl.int64)[:, None]
    w = tl.load(w_ptr + rows * C + rc[None, :], mask=r_ok, other=0)
    s = tl.load(w_scale_ptr + rows * (C // 16) + rs[None, :], mask=r_ok, other=127)
    v = _e2m1_to_bf16(w, s, BR, BC, EXPAND)
    ro = tl.program_id(1) * 2 * BC + tl.arange(0, 2 * BC)
    tl.store(out_ptr + rows * (2 * C) + ro[None, :], v, mask=r_ok)


@triton.jit
def _gather_sorted_kernel(a_ptr, sorted_ids_ptr, num_rows_ptr, x_ptr, n_pairs, I, stride_am, stride_xm,
                          BR: tl.constexpr, BC: tl.constexpr):
    """x[r] = a[sorted_ids[r]] for each row r the routing used whose pair exists (padding rows are
    left as they are: the warp-specialised down-projection drops their products), each run of 8
    columns in its K order (the second and third of every 4 swapped: ``gluon.K_ORDER``)."""
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.program_id(1) * BC + tl.arange(0, BC)
    used = rows < tl.load(num_rows_ptr)
    ids = tl.load(sorted_ids_ptr + rows, mask=used, other=n_pairs)
    mask = (used & (ids < n_pairs))[:, None] & (cols < I)[None, :]
    v = tl.load(a_ptr + ids.to(tl.int64)[:, None] * stride_am + cols[None, :], mask=mask, other=0.0)
    v = tl.reshape(tl.permute(tl.reshape(v, (BR, BC // 4, 2, 2)), (0, 1, 3, 2)), (BR, BC))
    tl.store(x_ptr + rows.to(tl.int64)[:, None] * stride_xm + cols[None, :], v, mask=mask)
