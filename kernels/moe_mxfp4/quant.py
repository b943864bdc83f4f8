"""MXFP4 quantization as the OCP Microscaling (MX) v1.0 spec defines it, in torch.

One block is 32 consecutive values along the last dimension (K). A block
stores one shared scale, an E8M0 byte (a power of two, 2**(byte - 127); byte
0xFF is NaN), and 32 FP4 E2M1 elements (1 sign, 2 exponent, 1 mantissa bit:
magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6), packed two per byte along K: element
2i in the low nibble, 2i + 1 in the high nibble.

Quantizing a block (spec section 6.3):

* shared exponent X = floor(log2(amax)) - 2 (2 is E2M1's largest exponent),
  clamped to E8M0's range [-127, 127]; a block of zeros gets X = -127 (byte 0);
* each element is V / 2**X rounded to the E2M1 grid, round-to-nearest, ties to
  even (the even neighbour has mantissa bit 0: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1,
  2.5 -> 2, 5 -> 4), and saturating: V / 2**X lies in [0, 8), and anything
  above 6 becomes 6 (so 7.9 -> 6, never overflow to a code that does not exist);
* the sign is kept, so small negative values give -0 (0x8).

NaN and infinity: E2M1 has no encoding for either. A block holding a NaN or a
+-inf gets the NaN scale (0xFF) and zero elements, so all 32 of its values
decode as NaN: the non-finite value is not silently turned into a finite one.
Dequantizing with scale 0xFF gives NaN whatever the elements; a finite scale
times 6 may overflow the output dtype to inf (byte 254 in fp32).

``dequantize_mxfp4`` is exact in fp32 and, since every E2M1 value has at most
two significant bits, also in bf16 as long as the result is in bf16's range:
the kernels expand weights to bf16 in registers and lose nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kernels.common.plans import tensor_signature

__all__ = ["BLOCK", "E2M1_VALUES", "PREPACK_ROWS", "PREPACK_K", "Mxfp4Weights", "check_prepackable",
           "dequantize_mxfp4", "prepack_mxfp4", "prepacked_shape", "prepare_weights", "quantize_mxfp4",
           "unprepack_mxfp4"]

BLOCK = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_EMAX_E2M1 = 2
_SCALE_NAN = 255
# Round-to-nearest-even on the E2M1 grid: code = number of thresholds passed. A tie
# goes to the even code (mantissa bit 0): ">" where the lower code is even, ">=" where odd.
_UP_STRICT = (0.25, 1.25, 2.5, 5.0)     # lower neighbour code 0, 2, 4, 6 (even): ties stay
_UP_TIES = (0.75, 1.75, 3.5)            # lower neighbour code 1, 3, 5 (odd): ties go up


def _check_k(x: torch.Tensor, what: str) -> None:
    if x.dim() < 1 or x.shape[-1] % BLOCK:
        raise ValueError(f"{what}: the last dimension must be a multiple of {BLOCK} (one scale per "
                         f"{BLOCK} values), got shape {tuple(x.shape)}; pad K first")


def quantize_mxfp4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] (float, K % 32 == 0) -> (packed uint8 [..., K // 2], scales uint8 [..., K // 32]).

    Runs on x's device with torch ops; bf16/fp16 inputs are exact in fp32, where
    the arithmetic happens.
    """
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise ValueError(f"quantize_mxfp4: x must be a floating-point tensor, got "
                         f"{getattr(x, 'dtype', type(x).__name__)}")
    _check_k(x, "quantize_mxfp4")
    shape = x.shape
    v = x.detach().to(torch.float32).reshape(*shape[:-1], shape[-1] // BLOCK, BLOCK)
    finite = torch.isfinite(v).all(dim=-1)
    amax = torch.where(torch.isfinite(v), v.abs(), 0.0).amax(dim=-1)
    # floor(log2(amax)) exactly (subnormals too): amax = m * 2**e with m in [0.5, 1).
    _, e = torch.frexp(amax)
    X = torch.where(amax > 0, e.to(torch.int32) - 1 - _EMAX_E2M1, -127).clamp(-127, 127)
    y = torch.ldexp(v, (-X).unsqueeze(-1).to(torch.float32))   # exact: a power-of-two scaling
    a = y.abs()
    code = torch.zeros_like(a, dtype=torch.uint8)
    for t in _UP_STRICT:
        code += (a > t).to(torch.uint8)
    for t in _UP_TIES:
        code += (a >= t).to(torch.uint8)
    code |= torch.signbit(y).to(torch.uint8) << 3
    code = torch.where(finite.unsqueeze(-1), code, 0)
    scales = torch.where(finite, X + 127, _SCALE_NAN).to(torch.uint8)
    code = code.reshape(*shape[:-1], shape[-1] // 2, 2)
    packed = code[..., 0] | (code[..., 1] << 4)
    return packed.contiguous(), scales.reshape(*shape[:-1], shape[-1] // BLOCK).contiguous()


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(packed uint8 [..., K // 2], scales uint8 [..., K // 32]) -> values [..., K] in `dtype`."""
    for name, t in (("packed", packed), ("scales", scales)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8:
            raise ValueError(f"dequantize_mxfp4: {name} must be a uint8 tensor, got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")
    K = packed.shape[-1] * 2
    if scales.shape[:-1] != packed.shape[:-1] or scales.shape[-1] * BLOCK != K:
        raise ValueError(f"dequantize_mxfp4: packed {tuple(packed.shape)} holds K={K} values per row, so scales "
                         f"must be {tuple(packed.shape[:-1]) + (K // BLOCK,)}, got {tuple(scales.shape)}")
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], K)
    vals = lut[codes.long()].reshape(*packed.shape[:-1], K // BLOCK, BLOCK)
    s = scales.to(torch.int32)
    out = torch.ldexp(vals, (s - 127).unsqueeze(-1).to(torch.float32))
    out = torch.where((s == _SCALE_NAN).unsqueeze(-1), float("nan"), out)
    return out.reshape(*packed.shape[:-1], K).to(dtype)


# ---------------------------------------------------------------------------
# "prepacked" weight layout: the bytes in the order wgmma's register operand wants
# ---------------------------------------------------------------------------

PREPACK_ROWS = 64    # one warpgroup's 64 rows (wgmma's M)
PREPACK_K = 128      # K values per tile: 64 packed bytes, 4 scale blocks

# A 64-row x 64-byte tile of packed weights (rows r = r5..r0, byte columns c = c5..c0) as the
# 4 warps x 32 lanes of a warpgroup hold it in wgmma's A-operand registers (the expanded tile's
# layout with 2 bf16 per register): warp = r5 r4, lane = r2 r1 r0 c2 c1, and the 32 bytes of
# one thread are r3 (two halves of 16) x c5 c4 c3 c0. Stored thread-major, [r3, r5r4, r2r1r0,
# c2c1, c5c4c3, c0]: every thread reads its 16 + 16 bytes with two 128-bit loads and they
# already sit in the registers the expansion and the dot use (no shared-memory pass). The
# expansion takes one register group (rows r, r + 8 x columns c, c + 1) per 32-bit word, so
# at levels 1 and 2 one PRMT per word brings the bytes of row r + 8 next to row r's. Level 3
# stores them so: the 32 bytes are c5 (two halves) x c4 c3 r3 c0, [c5, r5r4, r2r1r0, c2c1,
# c4c3, r3, c0] (it is a new level, not a change of level 2's, because level 2's measured
# kernel needed 9 registers more with that order, and 5 programs per SM instead of 6).
_W_TILE = (2, 4, 8, 4, 8, 2)
_W_TILE_L3 = (2, 4, 8, 4, 4, 2, 2)
# The tile's 4 x 64 scale bytes (rows r, blocks g = c5 c4): a thread needs rows r, r + 8 of
# its lane group, all 4 blocks: stored [r5r4, r2r1r0, r3, g], 8 bytes per thread (the four
# lanes c2 c1 read the same 8).


# Which shapes the prepacked layouts take (levels 1-3): I a multiple of 32 (one scale per 32
# values, MXFP4 itself) and H a multiple of 8 (output rows stay 16-byte aligned for the epilogue's
# 8-wide bf16 atomics). The stored tiles are 64 rows x 128 K, so the rows are padded to a multiple
# of 64 and I to a multiple of 128 at prepack, with zero codes and the neutral scale byte 127
# (2**0): the padded K adds exact zeros to every sum and the padded rows are never stored.
PREPACK_H_MULTIPLE = 8
PREPACK_I_MULTIPLE = BLOCK
PAD_SCALE = 127


def prepacked_shape(H: int, I: int) -> tuple[int, int]:
    """(rows, K) of the prepacked tensors of an [H, I] expert: H rounded up to 64, I to 128."""
    return -(-H // PREPACK_ROWS) * PREPACK_ROWS, -(-I // PREPACK_K) * PREPACK_K


def check_prepackable(H: int, I: int, what: str) -> None:
    """ValueError naming the rule unless the prepacked layouts take an [H, I] expert."""
    if H < 1 or I < 1 or H % PREPACK_H_MULTIPLE or I % PREPACK_I_MULTIPLE:
        raise ValueError(f"{what}: the prepacked layouts (levels 1-3) need H % {PREPACK_H_MULTIPLE} == 0 and "
                         f"I % {PREPACK_I_MULTIPLE} == 0, got H={H}, I={I}; level=0 keeps the plain layout")


def _uint8_pair(w, w_scale, what):
    for name, t in (("w", w), ("w_scale", w_scale)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() < 2:
            raise ValueError(f"{what}: {name} must be a uint8 tensor [..., H, ...], got "
                             f"{getattr(t, 'dtype', type(t).__name__)}")


def _prepack_check(w, w_scale, what):
    """Plain weights about to be prepacked: (H, K2) after the rule and the scales' shape are checked."""
    _uint8_pair(w, w_scale, what)
    H, K2 = w.shape[-2], w.shape[-1]
    check_prepackable(H, 2 * K2, what)
    if tuple(w_scale.shape) != tuple(w.shape[:-1]) + (K2 // 16,):
        raise ValueError(f"{what}: w_scale must be {tuple(w.shape[:-1]) + (K2 // 16,)}, got {tuple(w_scale.shape)}")
    return H, K2


def _stored_check(w, w_scale, what):
    """Tensors in a prepacked layout: whole 64-row x 128-K tiles, scales to match; (rows, K2)."""
    _uint8_pair(w, w_scale, what)
    H, K2 = w.shape[-2], w.shape[-1]
    if H % PREPACK_ROWS or (2 * K2) % PREPACK_K:
        raise ValueError(f"{what}: prepacked tensors hold whole {PREPACK_ROWS}-row x {PREPACK_K}-K tiles "
                         f"(rows % {PREPACK_ROWS} == 0, I % {PREPACK_K} == 0), got rows={H}, I={2 * K2}")
    if tuple(w_scale.shape) != tuple(w.shape[:-1]) + (K2 // 16,):
        raise ValueError(f"{what}: w_scale must be {tuple(w.shape[:-1]) + (K2 // 16,)}, got {tuple(w_scale.shape)}")
    return H, K2


def _pad_plain(w: torch.Tensor, w_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain weights [..., H, I/2] + scales -> [..., Hp, Ip/2] + [..., Hp, Ip/32] (prepacked_shape):
    the added rows and K hold code 0 under scale byte 127 (exact zeros)."""
    H, K2 = w.shape[-2], w.shape[-1]
    Hp, Ip = prepacked_shape(H, 2 * K2)
    if (Hp, Ip) == (H, 2 * K2):
        return w, w_scale
    lead = tuple(w.shape[:-2])
    wp = torch.zeros(lead + (Hp, Ip // 2), dtype=torch.uint8, device=w.device)
    sp = torch.full(lead + (Hp, Ip // BLOCK), PAD_SCALE, dtype=torch.uint8, device=w.device)
    wp[..., :H, :K2] = w
    sp[..., :H, :K2 // 16] = w_scale
    return wp, sp


# Level 2: the bits of each 4-byte register group are rearranged too. A thread's register holds
# the bytes B0 = W[r, c], B1 = W[r, c + 1], B2 = W[r + 8, c], B3 = W[r + 8, c + 1] (c even) and
# the expansion makes four bf16x2 patterns of them, R0 = the low nibbles of B0, B1, R1 = the low
# nibbles of B2, B3, R2 / R3 = the high nibbles: each half holds its code's e1 e0 m at bits
# 8..6 and its sign at bit 15 (the value times 2**-126). The stored word places the 32 code
# bits so that R0 = w & M, R1 = rotl(w, 4) & M, R2 = rotl(w, 10) & M and
# R3 = (rotl(w, 6) & 0x80C080C0) | (rotl(w, 14) & 0x01000100), M = 0x81C081C0: about 9
# instructions for 8 weights instead of 18 (three rotations tile the 32 bits; no fourth does).
ROT_MASK = 0x81C081C0
ROT_SHIFTS = ((0, ROT_MASK), (4, ROT_MASK), (10, ROT_MASK), (6, 0x80C080C0), (14, 0x01000100))


def _rot_bit_map() -> list[tuple[int, int]]:
    """(source bit in the plain word B0 | B1 << 8 | B2 << 16 | B3 << 24, bit in the stored word)."""
    out = []
    pieces = {0: [ROT_SHIFTS[0]], 1: [ROT_SHIFTS[1]], 2: [ROT_SHIFTS[2]], 3: list(ROT_SHIFTS[3:])}
    for j in range(4):                          # pattern R_j
        for h in range(2):                      # its half h
            q = (2 if j in (1, 3) else 0) + h   # the byte
            nib = 4 if j >= 2 else 0            # the nibble in it
            for i, p in ((0, 6), (1, 7), (2, 8), (3, 15)):     # m, e0, e1 -> bits 6..8, sign -> 15
                p += 16 * h
                shift = next(sh for sh, mask in pieces[j] if mask >> p & 1)
                out.append((8 * q + nib + i, (p - shift) % 32))
    assert sorted(d for _, d in out) == list(range(32)) and sorted(s for s, _ in out) == list(range(32))
    return out


def _pair_halves(w: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Level 3: byte j of each 64-byte (128-K) tile holds the codes of K = j (low nibble) and
    K = 64 + j (high) instead of 2j and 2j + 1, so the kernel's low-nibble tile is the first half
    of the tile's K in order and its high-nibble tile the second: each meets a contiguous half of
    the activations (inverse: back to the plain pairs)."""
    t = w.reshape(*w.shape[:-1], w.shape[-1] // 64, 64)
    if inverse:
        codes = torch.cat([t & 0xF, t >> 4], dim=-1)                  # K = 0..127 of the tile
        pairs = codes.reshape(*t.shape[:-1], 64, 2)
        out = pairs[..., 0] | (pairs[..., 1] << 4)
    else:
        codes = torch.stack([t & 0xF, t >> 4], dim=-1).reshape(*t.shape[:-1], 128)
        out = codes[..., :64] | (codes[..., 64:] << 4)
    return out.reshape(w.shape)


def _regroup_bits(w: torch.Tensor, inverse: bool) -> torch.Tensor:
    """Rearrange the bits of each register group (rows r, r + 8 x byte columns c, c + 1 of every
    16-row block) by _rot_bit_map (inverse: back)."""
    lead, (H, K2) = w.shape[:-2], w.shape[-2:]
    t = w.reshape(*lead, H // 16, 2, 8, K2 // 2, 2).to(torch.int64)      # [..., r3, r210, c/2, c0]
    b = [t[..., q // 2, :, :, q % 2] for q in range(4)]
    word = b[0] | (b[1] << 8) | (b[2] << 16) | (b[3] << 24)
    new = torch.zeros_like(word)
    for src, dst in _rot_bit_map():
        if inverse:
            src, dst = dst, src
        new |= ((word >> src) & 1) << dst
    out = torch.stack([torch.stack([(new >> (8 * (2 * r3 + c0))) & 0xFF for c0 in range(2)], dim=-1)
                       for r3 in range(2)], dim=-4)
    return out.to(torch.uint8).reshape(w.shape)


def prepack_mxfp4(w: torch.Tensor, w_scale: torch.Tensor, level: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 weights (packed uint8 [..., H, I / 2], scales uint8 [..., H, I / 32], as
    ``quantize_mxfp4`` gives them) -> the same values in the kernel's ``PREPACK`` layout. Each
    block of 64 rows keeps its memory range; inside it, each K tile of 128 values (64 x 64
    packed bytes, 64 x 4 scales) is stored contiguously in the order of wgmma's register operand
    (see ``_W_TILE``; level 3: ``_W_TILE_L3``). H % 8 == 0 and I % 32 == 0 (``check_prepackable``);
    the rows are padded to a multiple of 64 and I to a multiple of 128 (``prepacked_shape``: code
    0 under scale byte 127), so the result is [..., Hp, Ip / 2] and [..., Hp, Ip / 32] (the
    input's shapes where H % 64 == 0 and I % 128 == 0). level=2 also rearranges the bits of every
    4-byte register group (``_rot_bit_map``) for the kernel's ``PREPACK=2`` expansion; level=3
    first pairs the codes of each 128-K tile as (K = j, K = 64 + j) (``_pair_halves``), then does
    what level 2 does. ``unprepack_mxfp4`` inverts each (``shape=(H, I)`` drops the padding)."""
    _prepack_check(w, w_scale, "prepack_mxfp4")
    if level not in (1, 2, 3):
        raise ValueError(f"prepack_mxfp4: level must be 1, 2 or 3, got {level!r}")
    w, w_scale = _pad_plain(w, w_scale)
    H, K2 = w.shape[-2], w.shape[-1]
    if level == 3:
        w = _pair_halves(w, inverse=False)
    if level >= 2:
        w = _regroup_bits(w, inverse=False)
    lead = w.shape[:-2]
    nb, kb = H // PREPACK_ROWS, K2 // 64
    n = len(lead)
    d = lambda *i: [n + j for j in i]
    if level == 3:
        # w[..., nb, (r54, r3, r210), kb, (c5, c43, c21, c0)] -> [..., nb, kb, c5, r54, r210, c21, c43, r3, c0]
        t = w.reshape(*lead, nb, 4, 2, 8, kb, 2, 4, 4, 2)
        wp = t.permute(*range(n), *d(0, 4, 5, 1, 3, 7, 6, 2, 8)).reshape(w.shape)
    else:
        # w[..., nb, (r54, r3, r210), kb, (c543, c21, c0)] -> [..., nb, kb, r3, r54, r210, c21, c543, c0]
        t = w.reshape(*lead, nb, 4, 2, 8, kb, 8, 4, 2)
        wp = t.permute(*range(n), *d(0, 4, 2, 1, 3, 6, 5, 7)).reshape(w.shape)
    # scales[..., nb, (r54, r3, r210), kb, g] -> [..., nb, kb, r54, r210, r3, g]
    s = w_scale.reshape(*lead, nb, 4, 2, 8, kb, 4)
    sp = s.permute(*range(n), *d(0, 4, 1, 3, 2, 5)).reshape(w_scale.shape)
    return wp.contiguous(), sp.contiguous()


def unprepack_mxfp4(wp: torch.Tensor, sp: torch.Tensor, level: int = 1,
                    shape: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of ``prepack_mxfp4`` (the same level); ``shape=(H, I)``: the logical rows and
    K of the weights that were prepacked (their padding is dropped; default: all rows and K)."""
    H, K2 = _stored_check(wp, sp, "unprepack_mxfp4")
    if level not in (1, 2, 3):
        raise ValueError(f"unprepack_mxfp4: level must be 1, 2 or 3, got {level!r}")
    lead = wp.shape[:-2]
    nb, kb = H // PREPACK_ROWS, K2 // 64
    n = len(lead)
    d = lambda *i: [n + j for j in i]
    if level == 3:
        t = wp.reshape(*lead, nb, kb, 2, 4, 8, 4, 4, 2, 2)     # nb, kb, c5, r54, r210, c21, c43, r3, c0
        w = t.permute(*range(n), *d(0, 3, 7, 4, 1, 2, 6, 5, 8)).reshape(wp.shape)
    else:
        t = wp.reshape(*lead, nb, kb, 2, 4, 8, 4, 8, 2)        # nb, kb, r3, r54, r210, c21, c543, c0
        w = t.permute(*range(n), *d(0, 3, 2, 4, 1, 6, 5, 7)).reshape(wp.shape)
    s = sp.reshape(*lead, nb, kb, 4, 8, 2, 4)                  # nb, kb, r54, r210, r3, g
    ws = s.permute(*range(n), *d(0, 2, 4, 3, 1, 5)).reshape(sp.shape)
    if level >= 2:
        w = _regroup_bits(w, inverse=True)
    if level == 3:
        w = _pair_halves(w, inverse=True)
    if shape is not None:
        h, i = shape
        if prepacked_shape(h, i) != (H, 2 * K2):
            raise ValueError(f"unprepack_mxfp4: shape={tuple(shape)} is prepacked as {prepacked_shape(h, i)}, "
                             f"not as the tensors' (rows={H}, I={2 * K2})")
        w, ws = w[..., :h, :i // 2], ws[..., :h, :i // BLOCK]
    return w.contiguous(), ws.contiguous()


# ---------------------------------------------------------------------------
# weights with their layout: what a model loader keeps and the launcher reads
# ---------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Mxfp4Weights:
    """MXFP4 expert weights together with the layout their bytes are in.

    w: uint8 [E, H, I / 2], w_scale: uint8 [E, H, I / 32]; level: 0 for the plain layout
    (``quantize_mxfp4``'s), 1 to 3 for ``prepack_mxfp4(..., level)``'s (other byte order; rows
    and K padded to whole 64 x 128 tiles where H % 64 or I % 128: then the tensors are [E, Hp,
    Ip / 2] and ``shape`` says the logical (H, I)). The prepacked layouts and the plain one cannot
    be told apart from the tensors, so the level travels with them: ``moe_mxfp4_down(a, weights,
    routing)`` reads it, picks a config of that layout when none is given, and refuses a config of
    another.

    Make one with ``prepare_weights`` (once, at load time); wrap tensors that were prepacked
    elsewhere (a saved checkpoint) with ``Mxfp4Weights(w, w_scale, level, shape=(H, I))`` and the
    level they were prepacked with: that is the one statement the launcher cannot check.

    max_scale: the largest scale byte, when known (``prepare_weights`` reads it once). Where it
    is at most 128 (every block's largest magnitude under 16, as in trained weights) the kernel
    scales each pair of values with one multiply instead of two (``MoeMxfp4Config.ONE_MUL``);
    None (unknown) keeps the two. Pass it only as ``int(w_scale.max())`` of these scales.

    shape: the experts' logical (H, I), None for the tensors' own (rows, 2 * w.shape[-1]).
    """

    w: torch.Tensor
    w_scale: torch.Tensor
    level: int = 0
    max_scale: int | None = None
    shape: tuple[int, int] | None = None

    def __post_init__(self):
        w, s = self.w, self.w_scale
        if self.level not in (0, 1, 2, 3):
            raise ValueError(f"Mxfp4Weights: level must be 0 (plain), 1, 2 or 3 (prepack_mxfp4), got {self.level!r}")
        for name, t in (("w", w), ("w_scale", s)):
            if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 3:
                raise ValueError(f"Mxfp4Weights: {name} must be a 3-D uint8 tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
        E, H, K2 = w.shape
        if tuple(s.shape) != (E, H, K2 // 16) or K2 % 16:
            raise ValueError(f"Mxfp4Weights: w {tuple(w.shape)} holds I={2 * K2} values per row, so w_scale must be "
                             f"{(E, H, K2 // 16)} and I a multiple of {BLOCK}; got w_scale {tuple(s.shape)}")
        if w.device != s.device:
            raise ValueError(f"Mxfp4Weights: w and w_scale must be on one device, got {w.device} and {s.device}")
        if self.max_scale is not None and (not isinstance(self.max_scale, int) or not 0 <= self.max_scale <= 255):
            raise ValueError(f"Mxfp4Weights: max_scale must be None or the largest scale byte (an int in "
                             f"[0, 255]), got {self.max_scale!r}")
        shape = (H, 2 * K2) if self.shape is None else self.shape
        if not (isinstance(shape, tuple) and len(shape) == 2 and all(type(v) is int for v in shape)):
            raise ValueError(f"Mxfp4Weights: shape must be None or the logical (H, I) as two ints, got {self.shape!r}")
        object.__setattr__(self, "shape", shape)
        if self.level == 0:
            if shape != (H, 2 * K2):
                raise ValueError(f"Mxfp4Weights: plain weights (level 0) are not padded: shape={shape} but the "
                                 f"tensors hold (H, I) = {(H, 2 * K2)}")
            return
        check_prepackable(*shape, "Mxfp4Weights")
        if prepacked_shape(*shape) != (H, 2 * K2):
            raise ValueError(f"Mxfp4Weights: experts of (H, I) = {shape} are prepacked as [E, {prepacked_shape(*shape)[0]}, "
                             f"{prepacked_shape(*shape)[1] // 2}] (rows to 64, I to 128), got w {tuple(w.shape)}; "
                             f"pass shape=(H, I) of the weights that were prepacked")
        # the kernel reads each 64-row block of the prepacked layout as one contiguous range
        if w.stride(2) != 1 or w.stride(1) != K2 or s.stride(2) != 1 or s.stride(1) != K2 // 16:
            raise ValueError(f"Mxfp4Weights: prepacked w and w_scale need contiguous rows (strides (.., {K2}, 1) "
                             f"and (.., {K2 // 16}, 1)), got {tuple(w.stride())} and {tuple(s.stride())}; "
                             f"call .contiguous()")

    @property
    def H(self) -> int:
        """The output columns (hidden size) of each expert."""
        return self.shape[0]

    @property
    def I(self) -> int:  # noqa: E743 (the reduction is called I throughout)
        """The reduction length (intermediate size) of each expert."""
        return self.shape[1]

    @property
    def padded(self) -> bool:
        """Whether the stored tensors carry padding rows or K (prepacked, H % 64 or I % 128)."""
        return self.shape != (self.w.shape[1], 2 * self.w.shape[2])

    @property
    def one_mul(self) -> bool:
        """Whether every scale byte is known to be at most 128 (one multiply per pair is exact)."""
        return self.max_scale is not None and self.max_scale <= 128

    @cached_property
    def signature(self) -> tuple:
        """``weights_signature`` of these weights, made once (the launcher's plan key includes it)."""
        return weights_signature(self.w, self.w_scale, self.level, self.one_mul, self.shape if self.padded else None)

    @property
    def num_experts(self) -> int:
        return self.w.shape[0]

    def plain(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w, w_scale) in the plain layout, [E, H, I / 2] and [E, H, I / 32] (``unprepack_mxfp4``
        when prepacked, the padding dropped; for references)."""
        if self.level == 0:
            return self.w, self.w_scale
        return unprepack_mxfp4(self.w, self.w_scale, self.level, shape=self.shape)


def weights_signature(w: torch.Tensor, w_scale: torch.Tensor, level: int, one_mul: bool, shape) -> tuple:
    """What a down-projection's plan depends on of the weights: both tensors' signatures, the layout
    level, whether one multiply per pair is exact, the logical (H, I) where the tensors are padded."""
    return (tensor_signature(w), tensor_signature(w_scale), level, one_mul, shape)


def prepare_weights(w: torch.Tensor, w_scale: torch.Tensor, level: int = 2, *,
                    experts_per_chunk: int = 32) -> Mxfp4Weights:
    """Plain MXFP4 weights (``quantize_mxfp4``'s uint8 [E, H, I / 2] and [E, H, I / 32]) -> the
    ``Mxfp4Weights`` a model loader keeps and passes to ``moe_mxfp4_down`` at every M.

    level 2 (the default): ``prepack_mxfp4(..., 2)``, the fastest layout measured (issue 17;
    results/moe_mxfp4/README.md); 1: tile order only; 3: level 2 with the codes paired by K
    halves, fewer instructions with bf16 activations when cross-compiled (with MXFP4 activations
    it needs more registers than level 2); 0: the tensors as they are (no copy).
    Prepacking needs H % 8 == 0 and I % 32 == 0 (``check_prepackable``; level 0 otherwise): gpt-oss'
    H = I = 2880 are prepacked as 2880 x 2944 (the last 128-K tile half zeros). It writes a copy,
    ``experts_per_chunk`` experts at a time (its int64 temporaries stay a few times that slice),
    and reads the largest scale byte (``max_scale``; one synchronization, at load time).
    """
    if level not in (0, 1, 2, 3):
        raise ValueError(f"prepare_weights: level must be 0 (plain), 1, 2 or 3, got {level!r}")
    Mxfp4Weights(w, w_scale, 0)                       # checks shapes, dtypes and device
    max_scale = int(w_scale.max()) if w_scale.numel() else 0
    if level == 0:
        return Mxfp4Weights(w, w_scale, 0, max_scale)
    E, H, K2 = w.shape
    check_prepackable(H, 2 * K2, "prepare_weights")
    Hp, Ip = prepacked_shape(H, 2 * K2)
    wp = torch.empty((E, Hp, Ip // 2), dtype=torch.uint8, device=w.device)
    sp = torch.empty((E, Hp, Ip // BLOCK), dtype=torch.uint8, device=w.device)
    step = max(1, experts_per_chunk)
    for e0 in range(0, E, step):
        wp[e0:e0 + step], sp[e0:e0 + step] = prepack_mxfp4(w[e0:e0 + step], w_scale[e0:e0 + step], level)
    return Mxfp4Weights(wp, sp, level, max_scale, shape=(H, 2 * K2))
