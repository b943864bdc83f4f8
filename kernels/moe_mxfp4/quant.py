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

import torch

__all__ = ["BLOCK", "E2M1_VALUES", "dequantize_mxfp4", "quantize_mxfp4"]

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
