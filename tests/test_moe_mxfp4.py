"""MXFP4 MoE down-projection (kernels.moe_mxfp4): quantizer, routing preparation, kernel, assembly.

CPU: the kernel runs in Triton's interpreter at 6 experts, H = 96, I = 64, top-3
(expert 2 gets no tokens); the assembly checks cross-compile the kernel for sm_90.
GPU (`gpu`): the same checks at KIMI-K2.5's shapes (385 experts, H = 7168, I = 512, top-9).

Tolerance of the kernel against the fp32 reference. Weights (and a4w4 activations)
are exact in bf16 after expansion and the products accumulate in fp32, so the error
comes from bf16 roundings in the epilogue: each weighted row is rounded to bf16
(relative 2**-9), and the top_k rows of a token are summed either by bf16 atomics
(one rounding per addition, relative 2**-9 of the partial sum) or in fp32 with one
final rounding (deterministic). Per element, with S = sum_k |w_k y_k| (the reference
sum of magnitudes), |out - ref| <= (top_k + 1) * 2**-9 * S covers both modes;
the check uses 2**-8 * (top_k + 1) * S + 1e-6 (twice that: fp32 accumulation order
and the interpreter's fp32 dot differ from the reference's by far less).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from collections import Counter

import pytest
import torch

from kernels.moe_mxfp4 import (MoeMxfp4Config, Mxfp4Weights, config_for_block_m, default_config, dequantize_mxfp4,
                               dequantize_weights_bf16, moe_mxfp4_down, prepare_routing, prepare_weights,
                               quantize_mxfp4, reference_rows)
from kernels.moe_mxfp4 import launch as mx_launch
from kernels.moe_mxfp4 import metrics
from kernels.moe_mxfp4 import plan as mx_plan
from kernels.moe_mxfp4 import routing as mx_routing
from kernels.moe_mxfp4.quant import E2M1_VALUES
from kernels.moe_mxfp4.routing import max_rows, reference_routing
from ptx_model import run_ptx as _run_ptx

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"

# ---------------------------------------------------------------------------
# quantizer
# ---------------------------------------------------------------------------


def _block(values, fill=0.0):
    return torch.tensor(list(values) + [fill] * (32 - len(values)), dtype=torch.float32)


def test_quant_hand_examples_ties_and_saturation():
    # amax 7.9 -> floor(log2) = 2 -> X = 0 (scale byte 127): values are their own E2M1 inputs.
    x = _block([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9, -0.1, -3.0, 0.5, 6.0])
    packed, scales = quantize_mxfp4(x)
    assert scales.tolist() == [127]
    got = dequantize_mxfp4(packed, scales)[:12].tolist()
    # ties to even: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4; 7.9 saturates to 6
    assert got == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -3.0, 0.5, 6.0]
    assert math.copysign(1.0, got[8]) == -1.0          # -0.1 -> -0 (sign kept: code 0x8)
    # codes: 0.25 -> 0x0 (low nibble), 0.75 -> 0x2 (high): first byte 0x20; -3.0 is code 0xD
    assert packed[0].item() == 0x20
    assert (packed[4].item() & 0xF) == 0x8 and (packed[4].item() >> 4) == 0xD


def test_quant_scale_choice_and_zero_block():
    # amax 1000 -> floor(log2 1000) = 9 -> X = 7 -> byte 134; over 128: 7.8 -> 6 (saturates),
    # 0.78 -> 1, -0.31 -> -0.5; times 128: 768, 128, -64
    packed, scales = quantize_mxfp4(_block([1000.0, 100.0, -40.0]))
    assert scales.tolist() == [134]
    assert dequantize_mxfp4(packed, scales)[:3].tolist() == [768.0, 128.0, -64.0]
    # a block of zeros: scale byte 0 (X clamped to -127), all codes 0
    packed, scales = quantize_mxfp4(torch.zeros(64))
    assert scales.tolist() == [0, 0] and packed.eq(0).all()
    assert dequantize_mxfp4(packed, scales).eq(0).all()


def test_quant_subnormal_range_blocks():
    tiny = 2.0 ** -126                                 # smallest fp32 normal
    # floor(log2) = -126 -> X = -128 -> clamped to -127 (byte 0): values / 2**-127 = 2, 1, 0.5
    x = _block([tiny, tiny / 2, -tiny / 4, tiny / 16])
    packed, scales = quantize_mxfp4(x)
    assert scales.tolist() == [0]
    d = dequantize_mxfp4(packed, scales)
    assert d[:4].tolist() == [tiny, tiny / 2, -tiny / 4, 0.0]     # tiny/16 = 0.125 * 2**-127 -> 0
    # fp32 subnormals: amax 2**-140 -> X = -127 still; 2**-140 / 2**-127 = 2**-13 rounds to 0
    packed, scales = quantize_mxfp4(_block([2.0 ** -140]))
    assert scales.tolist() == [0] and dequantize_mxfp4(packed, scales).eq(0).all()


def test_quant_nan_inf_blocks_decode_as_nan():
    x = torch.randn(3, 32)
    x[0, 5] = float("nan")
    x[1, 0] = float("inf")
    packed, scales = quantize_mxfp4(x)
    assert scales[:2, 0].tolist() == [255, 255] and scales[2, 0].item() != 255
    d = dequantize_mxfp4(packed, scales)
    assert d[:2].isnan().all() and d[2].isfinite().all()
    # a NaN scale decodes as NaN whatever the codes
    assert dequantize_mxfp4(torch.full((1, 16), 0x22, dtype=torch.uint8),
                            torch.tensor([[255]], dtype=torch.uint8)).isnan().all()


def _rne_codes(y: torch.Tensor) -> torch.Tensor:
    """Brute force: nearest E2M1 magnitude, ties to the even code, saturating at 6."""
    grid = torch.tensor(E2M1_VALUES)
    a = y.abs().clamp(max=6.0).unsqueeze(-1)
    dist = (a - grid).abs()
    best = dist.min(-1, keepdim=True).values
    cand = dist == best
    # among tied codes prefer the even one
    even = cand & (torch.arange(8) % 2 == 0)
    code = torch.where(even.any(-1), even.float().argmax(-1), cand.float().argmax(-1))
    return code | (torch.signbit(y).long() << 3)


def test_quant_matches_brute_force_rne():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 128, generator=g) * torch.logspace(-3, 3, 64).unsqueeze(1)
    x[3, :32] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5] * 4) * 2.0   # ties at X = 2 ... scaled
    packed, scales = quantize_mxfp4(x)
    X = scales.to(torch.int32) - 127
    y = torch.ldexp(x.reshape(64, 4, 32), -X.unsqueeze(-1).float()).reshape(64, 128)
    codes = torch.stack((packed & 0xF, packed >> 4), -1).reshape(64, 128).long()
    assert torch.equal(codes, _rne_codes(y))


def test_quant_round_trip_is_exact():
    g = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (8, 64), generator=g)
    codes[:, ::32] = torch.tensor([7, 15, 6, 14])[torch.randint(0, 4, (8, 2), generator=g)]  # max |value| 4 or 6
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    scales = torch.randint(2, 250, (8, 2), generator=g, dtype=torch.uint8)
    x = dequantize_mxfp4(packed, scales)
    p2, s2 = quantize_mxfp4(x)
    assert torch.equal(s2, scales)
    assert torch.equal(dequantize_mxfp4(p2, s2), x)      # -0 and +0 both decode to zero
    assert torch.equal(quantize_mxfp4(x.bfloat16())[0], p2)


def test_quant_rejects_bad_input():
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(4, 48))
    with pytest.raises(ValueError, match="floating-point"):
        quantize_mxfp4(torch.ones(4, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match="scales must be"):
        dequantize_mxfp4(torch.zeros(4, 16, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))


# ---------------------------------------------------------------------------
# routing preparation
# ---------------------------------------------------------------------------

E, H, I, TOP_K = 6, 96, 64, 3
EMPTY_EXPERT = 2


def _topk(M, E_=E, top_k=TOP_K, empty=EMPTY_EXPERT, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    experts = [e for e in range(E_) if e != empty]
    if M == 0:
        return torch.zeros(0, top_k, dtype=torch.int32, device=device), torch.zeros(0, top_k, device=device)
    ids = torch.stack([torch.tensor(experts)[torch.randperm(len(experts), generator=g)[:top_k]]
                       for _ in range(M)])
    weights = torch.rand(M, top_k, generator=g) + 0.1
    return ids.to(torch.int32).to(device), weights.to(device)


@pytest.mark.parametrize("M,block_m", [(1, 16), (5, 16), (33, 16), (33, 32), (0, 16)])
def test_routing_matches_host_reference(M, block_m):
    ids, wts = _topk(M)
    got = prepare_routing(ids, wts, E, block_m)
    ref = reference_routing(ids, wts, E, block_m)
    for f in ("sorted_ids", "sorted_weights", "expert_ids", "num_rows", "counts"):
        assert torch.equal(getattr(got, f).cpu(), getattr(ref, f)), f
    assert got.sorted_ids.shape[0] == max_rows(M * TOP_K, E, block_m)
    assert got.counts[EMPTY_EXPERT] == 0 and EMPTY_EXPERT not in got.expert_ids.tolist()


def test_routing_rejects_bad_input():
    ids, wts = _topk(4)
    with pytest.raises(ValueError, match="block_m"):
        prepare_routing(ids, wts, E, 24)
    with pytest.raises(ValueError, match="shaped like"):
        prepare_routing(ids, wts[:, :2], E, 16)
    with pytest.raises(ValueError, match=r"lie in \[0, 6\)"):
        prepare_routing(ids + 6, wts, E, 16, check=True)


# ---------------------------------------------------------------------------
# the kernel (interpreter on CPU)
# ---------------------------------------------------------------------------


def _problem(M, *, E_=E, H_=H, I_=I, top_k=TOP_K, a_fp4=False, seed=0, device=DEV, empty=EMPTY_EXPERT):
    g = torch.Generator().manual_seed(100 + seed)
    w, w_scale = quantize_mxfp4(torch.randn(E_, H_, I_, generator=g) * 0.05)
    a = torch.randn(M * top_k, I_, generator=g).bfloat16()
    ids, wts = _topk(M, E_, top_k, empty, seed)
    a_scale = None
    if a_fp4:
        a, a_scale = quantize_mxfp4(a.float())
        a_scale = a_scale.to(device)
    return dict(a=a.to(device), a_scale=a_scale, w=w.to(device), w_scale=w_scale.to(device),
                ids=ids.to(device), wts=wts.to(device))


def _reference(p):
    rows = reference_rows(p["a"], p["w"], p["w_scale"], p["ids"], p["wts"], a_scale=p["a_scale"])
    return rows.sum(1), rows.abs().sum(1)


def _check(out, p, *, slack=1.0, ref=None):
    ref, mag = ref if ref is not None else _reference(p)
    top_k = p["ids"].shape[1]
    bound = slack * (top_k + 1) * 2.0 ** -8 * mag + 1e-6
    err = (out.float() - ref).abs()
    assert out.isfinite().all(), "unwritten (poisoned) or non-finite outputs"
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, worst ratio {(err / bound).max().item():.3g}"
    assert ref.abs().max() > 0


def _split_reference(p, n):
    """(sum, magnitude bound) for SPLIT_K = n (w4a16): each program's partial row is rounded and
    added on its own, so the bound's magnitudes are the partial rows' (cancelling parts can exceed
    the whole row's)."""
    step = p["a"].shape[1] // n
    parts = [reference_rows(p["a"][:, j * step:(j + 1) * step], p["w"][..., j * step // 2:(j + 1) * step // 2],
                            p["w_scale"][..., j * step // 32:(j + 1) * step // 32], p["ids"], p["wts"])
             for j in range(n)]
    return sum(x.sum(1) for x in parts), sum(x.abs().sum(1) for x in parts)


def _run(p, cfg, **kw):
    """p["w"]: plain weights (with p["w_scale"]) or Mxfp4Weights (p["w_scale"] None)."""
    w = p["w"]
    E_ = w.num_experts if isinstance(w, Mxfp4Weights) else w.shape[0]
    r = prepare_routing(p["ids"], p["wts"], E_, cfg.BLOCK_M)
    return moe_mxfp4_down(p["a"], w, p["w_scale"], r, a_scale=p["a_scale"], config=cfg, **kw)


def _poison_workspaces():
    for plan in mx_launch._PLANS.values():
        if plan.workspace is not None:
            plan.workspace.fill_(float("nan"))


@pytest.mark.parametrize("M", [1, 5, 33])
@pytest.mark.parametrize("a_fp4", [False, True], ids=["w4a16", "a4w4"])
@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "det"])
def test_kernel_matches_reference(M, a_fp4, deterministic):
    p = _problem(M, a_fp4=a_fp4, seed=M)
    cfg = default_config(M, TOP_K, E, I, interpreter=not ON_GPU, deterministic=deterministic)
    _run(p, cfg)                                     # builds the plan (and its workspace)
    _poison_workspaces()
    out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device=DEV)
    _check(_run(p, cfg, out=out), p)


@pytest.mark.parametrize("cfg", [
    MoeMxfp4Config(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, num_warps=1, NT=False, EARLY_LOADS=False,
                   PREFETCH_EPILOGUE=False),                                   # H = 96: a ragged column tile
    MoeMxfp4Config(BLOCK_M=16, BLOCK_N=32, BLOCK_K=64, num_warps=1, SWAP_AB=False),
], ids=lambda c: c.label())
def test_kernel_switches_and_tiles(cfg):
    p = _problem(5, seed=7)
    out = torch.full((5, H), float("nan"), dtype=torch.bfloat16, device=DEV)
    _check(_run(p, cfg, out=out), p)


@pytest.mark.parametrize("I_", [128, 256], ids=["4steps", "8steps"])
@pytest.mark.parametrize("la", [1, 2, 3])
def test_kernel_load_ahead_is_exact(la, I_):
    """LOAD_AHEAD rotates register slots over the unrolled K steps: with 4 and 8 steps of 32
    (every slot refilled, at I = 256 the last slot too) the result stays within the bound
    of the plain loop, on poisoned outputs; a4w4 and the deterministic mode included."""
    for a_fp4, det in ((False, False), (True, True)):
        p = _problem(5, I_=I_, a_fp4=a_fp4, seed=11 + la)
        cfg = MoeMxfp4Config(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=1, LOAD_AHEAD=la, DETERMINISTIC=det)
        _run(p, cfg)
        _poison_workspaces()
        out = torch.full((5, H), float("nan"), dtype=torch.bfloat16, device=DEV)
        _check(_run(p, cfg, out=out), p)


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "det"])
def test_kernel_k_loop_is_exact(det):
    """UNROLL=False runs the K steps as a loop (pipelined over num_stages on a GPU): within
    the bound of the reference on poisoned outputs, 4 steps of 32."""
    p = _problem(5, I_=128, seed=23)
    cfg = MoeMxfp4Config(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=1, num_stages=3, UNROLL=False,
                         DETERMINISTIC=det)
    _run(p, cfg)
    _poison_workspaces()
    out = torch.full((5, H), float("nan"), dtype=torch.bfloat16, device=DEV)
    _check(_run(p, cfg, out=out), p)


def test_load_ahead_config_validates_and_labels():
    with pytest.raises(ValueError, match="LOAD_AHEAD must be 0, 1, 2 or 3"):
        MoeMxfp4Config(LOAD_AHEAD=4).validate(512)
    with pytest.raises(ValueError, match="LOAD_AHEAD .* needs UNROLL=True"):
        MoeMxfp4Config(LOAD_AHEAD=1, UNROLL=False).validate(512)
    assert MoeMxfp4Config(UNROLL=False).label().endswith("_loop")
    assert MoeMxfp4Config(LOAD_AHEAD=2).label().endswith("_la2")
    assert "_la" not in MoeMxfp4Config().label()
    assert default_config(4, 9, 385, 512).LOAD_AHEAD == 0          # the default is unchanged until measured


def test_prepack_round_trip_and_validation():
    from kernels.moe_mxfp4 import prepack_mxfp4, unprepack_mxfp4

    g = torch.Generator().manual_seed(21)
    w = torch.randint(0, 256, (3, 128, 128), generator=g, dtype=torch.uint8)
    s = torch.randint(0, 256, (3, 128, 8), generator=g, dtype=torch.uint8)
    for level in (1, 2, 3):
        wp, sp = prepack_mxfp4(w, s, level)
        assert wp.shape == w.shape and sp.shape == s.shape and not torch.equal(wp, w)
        assert all(torch.equal(x, y) for x, y in zip(unprepack_mxfp4(wp, sp, level), (w, s)))
    # thread t = 32 * warp + lane of the warpgroup reads bytes [16 t, 16 t + 16) of each tile half:
    # lane 5 of warp 1 holds rows 16 + 1 (+ 8) and the byte columns 2 * (5 % 4) + {0, 1} (+ 8, 16, ...)
    tile = torch.arange(64 * 64, dtype=torch.int32).reshape(64, 64)
    idx = tile.reshape(1, 64, 64)
    flat = prepack_mxfp4((idx % 256).to(torch.uint8), torch.zeros(1, 64, 4, dtype=torch.uint8))[0].reshape(-1)
    t = 32 + 5
    got = flat[16 * t:16 * t + 16].tolist()
    want = [int(tile[17, c]) % 256 for c in (2, 3, 10, 11, 18, 19, 26, 27, 34, 35, 42, 43, 50, 51, 58, 59)]
    assert got == want
    # level 3: the halves are byte columns 0-31 and 32-63, each 4-byte word one register group
    # (rows 17, 25 x columns c, c + 1), of bytes whose codes are paired (K = j, K = 64 + j) and
    # whose bits are regrouped as at level 2
    from kernels.moe_mxfp4.quant import _pair_halves, _regroup_bits

    vals = torch.randint(0, 256, (1, 64, 64), generator=g, dtype=torch.uint8)
    flat = prepack_mxfp4(vals, torch.zeros(1, 64, 4, dtype=torch.uint8), 3)[0].reshape(-1)
    stored = _regroup_bits(_pair_halves(vals, inverse=False), inverse=False)[0]
    paired = _pair_halves(vals, inverse=False)[0, 3]            # byte j: codes K = j, 64 + j of row 3
    assert int(paired[4]) == (int(vals[0, 3, 2]) & 15) | (int(vals[0, 3, 34]) & 15) << 4       # K 4, 68: low nibbles
    assert int(paired[5]) == int(vals[0, 3, 2]) >> 4 | (int(vals[0, 3, 34]) >> 4) << 4         # K 5, 69: high
    for half in (0, 1):
        got = flat[2048 * half + 16 * t:2048 * half + 16 * t + 16].tolist()
        want = [int(stored[r, 32 * half + c8 + c]) for c8 in (0, 8, 16, 24) for r in (17, 25) for c in (2, 3)]
        assert got == want
    with pytest.raises(ValueError, match=r"H % 8 == 0 and I % 32 == 0, got H=100"):
        prepack_mxfp4(w[:, :100], s[:, :100])
    # shapes that are not whole tiles are padded (rows to 64, I to 128: code 0 under scale byte 127)
    for level in (1, 2, 3):
        wp, sp = prepack_mxfp4(w[:, :72, :48], s[:, :72, :3], level)
        assert wp.shape == (3, 128, 64) and sp.shape == (3, 128, 4)
        back = unprepack_mxfp4(wp, sp, level, shape=(72, 96))
        assert torch.equal(back[0], w[:, :72, :48]) and torch.equal(back[1], s[:, :72, :3])
        full = unprepack_mxfp4(wp, sp, level)
        assert (full[0][:, 72:] == 0).all() and (full[0][:, :, 48:] == 0).all() and (full[1][:, :, 3:] == 127).all()
    with pytest.raises(ValueError, match="PREPACK=2 needs EXPAND='ptx'"):
        MoeMxfp4Config(BLOCK_N=64, PREPACK=2, EXPAND="bits").validate(512)
    with pytest.raises(ValueError, match="PREPACK needs SWAP_AB"):
        MoeMxfp4Config(BLOCK_N=64, BLOCK_K=64, PREPACK=True).validate(512)
    assert MoeMxfp4Config(BLOCK_N=64, PREPACK=2).label().endswith("_prepack2")
    assert not default_config(4, 9, 385, 512).PREPACK              # the default is unchanged until measured


@pytest.mark.parametrize("level", [1, 2, 3])
@pytest.mark.parametrize("a_fp4,det,bn,I_", [(False, False, 64, 256), (True, True, 128, 256), (False, False, 64, 512)],
                         ids=["w4a16_bn64", "a4w4_det_bn128", "w4a16_la1_4steps"])
def test_kernel_prepack_is_exact(a_fp4, det, bn, I_, level):
    """quantize -> prepack -> kernel (PREPACK): on poisoned outputs, within the reference bound and
    bit-identical to the plain layout's kernel on the same weights, scale bytes 0, 1, 254 and 255
    (NaN) included in a second pass (NaN where the plain kernel has NaN, the same bits elsewhere).
    Level 3 adds each step's products in another order (halves of K, not even and odd K), so it
    is held to the plain kernel's NaN and infinities and within a bf16 step of its values."""
    from kernels.moe_mxfp4 import prepack_mxfp4

    H_ = 256
    p = _problem(5, H_=H_, I_=I_, a_fp4=a_fp4, seed=31 + bn)
    la = 1 if I_ == 512 else 0
    plain = MoeMxfp4Config(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128, num_warps=4, DETERMINISTIC=det, LOAD_AHEAD=la)
    pre = plain.replace(PREPACK=level)
    q = dict(p, w=Mxfp4Weights(*prepack_mxfp4(p["w"], p["w_scale"], level), level), w_scale=None)
    _run(q, pre)
    _poison_workspaces()
    out = torch.full((5, H_), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = _run(q, pre, out=out)
    _check(got, p)
    _same_as_plain(got, _run(p, plain), level)
    ws = p["w_scale"].clone()
    ws[0, 0, 0], ws[1, 3, 1], ws[3, 70, 2], ws[4, 200, 3], ws[5, 129, 0] = 0, 1, 254, 255, 200
    p2 = dict(p, w_scale=ws)
    q2 = dict(q, w=Mxfp4Weights(*prepack_mxfp4(p2["w"], ws, level), level))
    a, b = _run(q2, pre).float(), _run(p2, plain).float()
    assert a.isnan().any()
    _same_as_plain(a, b, level)


def test_kernel_prepack3_a4w4_two_tiles_per_step():
    """Level 3 with MXFP4 activations and K steps of two 128-K tiles (BLOCK_K 256): the packed
    bytes and scales of each tile's two halves are gathered apart, within the reference bound and a
    rounding step of the plain layout's kernel, on poisoned outputs."""
    from kernels.moe_mxfp4 import prepack_mxfp4

    H_, I_ = 128, 512
    p = _problem(5, H_=H_, I_=I_, a_fp4=True, seed=77)
    plain = MoeMxfp4Config(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, num_warps=4)
    q = dict(p, w=Mxfp4Weights(*prepack_mxfp4(p["w"], p["w_scale"], 3), 3), w_scale=None)
    out = torch.full((5, H_), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = _run(q, plain.replace(PREPACK=3), out=out)
    _check(got, p)
    _same_as_plain(got, _run(p, plain), 3)


def _same_as_plain(got, plain, level):
    """The prepacked kernel's output against the plain layout's: the same bits at levels 1 and 2;
    at level 3 (another order of the fp32 additions) the same NaN and infinities and the finite
    values within one bf16 rounding step of the row's largest, the orders' whole difference."""
    got, plain = got.float(), plain.float()
    if level < 3:
        assert torch.equal(got.isnan(), plain.isnan())
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(plain))
        return
    assert torch.equal(got.isnan(), plain.isnan()) and torch.equal(got.isinf(), plain.isinf())
    assert torch.equal(got[got.isinf()], plain[plain.isinf()])
    fin = got.isfinite()
    scale = torch.where(fin, plain, 0).abs().amax(dim=-1, keepdim=True).expand_as(got)[fin]
    assert ((got[fin] - plain[fin]).abs() <= 2.0 ** -7 * scale).all()


@pytest.mark.parametrize("level,a_fp4,det", [(1, False, False), (2, False, False), (2, True, True), (3, False, False),
                                             (3, True, True)],
                         ids=["level1", "level2", "level2_a4w4_det", "level3", "level3_a4w4_det"])
def test_prepared_weights_default_path_equals_plain(level, a_fp4, det):
    """A model loader's path: prepare_weights once, then moe_mxfp4_down(a, weights, routing) with no
    config runs the prepacked default (BM16 BN64 BK128 PREPACK=level LOAD_AHEAD=1 at small M): on
    poisoned outputs, within the reference bound and bit-identical to the plain layout's kernel with
    the same tile (the deterministic mode through default_config(..., prepacked=level))."""
    H_, I_, M = 128, 256, 5
    p = _problem(M, H_=H_, I_=I_, a_fp4=a_fp4, seed=40 + level + 2 * a_fp4)
    weights = prepare_weights(p["w"], p["w_scale"], level)
    assert weights.level == level and not torch.equal(weights.w, p["w"])
    assert all(torch.equal(x, y) for x, y in zip(weights.plain(), (p["w"], p["w_scale"])))
    cfg = default_config(M, TOP_K, E, I_, prepacked=level, deterministic=det)
    assert (cfg.PREPACK, cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.LOAD_AHEAD) == (level, 16, 64, 128, 1)
    r = prepare_routing(p["ids"], p["wts"], E, cfg.BLOCK_M)
    kw = dict(a_scale=p["a_scale"], config=cfg if det else None)
    out = torch.empty((M, H_), dtype=torch.bfloat16, device=DEV)
    moe_mxfp4_down(p["a"], weights, r, out=out, **kw)           # builds the plan (and its workspace)
    _poison_workspaces()
    out.fill_(float("nan"))
    got = moe_mxfp4_down(p["a"], weights, r, out=out, **kw).clone()
    _check(got, p)
    want = moe_mxfp4_down(p["a"], p["w"], p["w_scale"], r, a_scale=p["a_scale"], config=cfg.replace(PREPACK=0))
    _same_as_plain(got, want, level)
    assert torch.equal(moe_mxfp4_down(p["a"], weights, routing=r, **kw), got)       # keyword form


@pytest.mark.parametrize("block_m", [64, 128])
def test_prepared_weights_large_m(block_m):
    """Every M runs on the one prepacked layout: at large M the prepacked defaults for BLOCK_M 64 and
    128 (SWAP_AB forced, BN64 / BN128; the plain defaults do not swap there), several row blocks per expert
    and a partial last one, on poisoned outputs: within the reference bound and the plain layout's
    bits with the same tile; at BLOCK_M 64 (the heuristic's pick here) the deterministic mode too."""
    H_, I_, M = 128, 256, 300                      # 900 pairs over 5 experts: ~180 rows each
    p = _problem(M, H_=H_, I_=I_, seed=60 + block_m)
    weights = prepare_weights(p["w"], p["w_scale"], 2)
    assert default_config(M, TOP_K, E, I_, prepacked=2).BLOCK_M == 64
    cfg = config_for_block_m(block_m, I_, prepacked=2)
    assert cfg.swap_ab and cfg.PREPACK == 2 and cfg.BLOCK_M == block_m
    if block_m == 128:   # 128 columns where H allows, else 64
        assert (config_for_block_m(128, I_, prepacked=2, H=256).BLOCK_N,
                config_for_block_m(128, I_, prepacked=2, H=192).BLOCK_N) == (128, 64)
    r = prepare_routing(p["ids"], p["wts"], E, block_m)
    ref = _reference(p)
    out = torch.full((M, H_), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = moe_mxfp4_down(p["a"], weights, r, out=out)                     # no config: the prepacked default
    _check(got, p, ref=ref)
    assert torch.equal(got, moe_mxfp4_down(p["a"], p["w"], p["w_scale"], r, config=cfg.replace(PREPACK=0)))
    if block_m == 64:
        det = cfg.replace(DETERMINISTIC=True)
        moe_mxfp4_down(p["a"], weights, r, config=det)
        _poison_workspaces()
        got = moe_mxfp4_down(p["a"], weights, r, config=det)
        _check(got, p, ref=ref)
        assert torch.equal(got, moe_mxfp4_down(p["a"], p["w"], p["w_scale"], r, config=det.replace(PREPACK=0)))


def test_prepared_weights_refuse_a_wrong_layout():
    """A config must read the layout the weights are in: every mismatch is a ValueError that says
    what to do (no kernel runs), and prepare_weights / Mxfp4Weights check their inputs."""
    p = _problem(5, H_=128, I_=128, seed=50)
    w2 = prepare_weights(p["w"], p["w_scale"], 2)
    cfg = default_config(5, TOP_K, E, 128, prepacked=2)
    r = prepare_routing(p["ids"], p["wts"], E, cfg.BLOCK_M)
    with pytest.raises(ValueError, match=r"prepacked at level 2 \(Mxfp4Weights\) but config.PREPACK=0: "
                                         r"pass config=None"):
        moe_mxfp4_down(p["a"], w2, r, config=cfg.replace(PREPACK=0))
    with pytest.raises(ValueError, match="prepacked at level 2 .* config.PREPACK=1"):
        moe_mxfp4_down(p["a"], w2, r, config=cfg.replace(PREPACK=1))
    with pytest.raises(ValueError, match=r"config.PREPACK=2 reads prepacked weights, but w and w_scale are plain "
                                         r"tensors .* prepare_weights\(w, w_scale, level=2\)"):
        moe_mxfp4_down(p["a"], w2.w, w2.w_scale, r, config=cfg)              # prepacked bytes passed bare
    with pytest.raises(ValueError, match="without w_scale"):
        moe_mxfp4_down(p["a"], w2, p["w_scale"], r)
    with pytest.raises(ValueError, match="H % 8 == 0 and I % 32 == 0, got H=100, I=128; level=0 keeps"):
        prepare_weights(p["w"][:, :100], p["w_scale"][:, :100])
    with pytest.raises(ValueError, match="level must be 0"):
        Mxfp4Weights(p["w"], p["w_scale"], 4)
    with pytest.raises(ValueError, match="w_scale must be"):
        Mxfp4Weights(p["w"], p["w_scale"][:, :, :2], 0)
    wide = torch.zeros(E, 128, 128, dtype=torch.uint8)[:, :, :64]           # rows 128 bytes apart, 64 used
    with pytest.raises(ValueError, match="contiguous rows"):
        Mxfp4Weights(wide, p["w_scale"], 2)
    with pytest.raises(ValueError, match="I % 32 == 0"):
        config_for_block_m(16, 48, prepacked=2)
    assert prepare_weights(p["w"], p["w_scale"], 0).w is p["w"]               # level 0: no copy
    assert default_config(4, 9, 385, 512).PREPACK == 0                        # plain weights: plain defaults
    assert default_config(16384, 9, 385, 512) == config_for_block_m(128, 512)


def test_prepared_weights_plan_key_has_the_layout():
    """Plain and prepacked weights have the same shapes, strides and dtypes: the level is part of
    the plan's key, so each gets its own plan (and config); bare tensors are level 0."""
    p = _problem(1, H_=128, I_=128, seed=52)
    r = prepare_routing(p["ids"], p["wts"], E, 16)
    key = lambda w, s, level, one_mul=False: mx_launch._plan_key(p["a"], None, w, s, level, one_mul, r, None,
                                                                 False, None)
    same = [key(p["w"], p["w_scale"], lvl) for lvl in (0, 1, 2)]
    assert len(set(same)) == 3
    w2 = prepare_weights(p["w"], p["w_scale"], 2)
    assert w2.max_scale == int(p["w_scale"].max()) <= 128 and w2.one_mul
    assert mx_plan.unwrap_weights(p["w"], p["w_scale"], r)[3:] == (0, False, None)
    assert mx_plan.unwrap_weights(w2, r, None)[1:] == (w2.w_scale, r, 2, True, None)    # (a, weights, routing)
    moe_mxfp4_down(p["a"], p["w"], p["w_scale"], r)
    moe_mxfp4_down(p["a"], w2, r)
    # the weights' and the routing's parts of the key, made once (host time), are the ones made per call
    assert w2.signature == mx_launch.weights_signature(w2.w, w2.w_scale, 2, True, None)
    r_again = prepare_routing(p["ids"], p["wts"], E, 16)
    assert r_again.sig is not None
    assert mx_routing.routing_signature(r_again) == mx_routing.routing_signature(dataclasses.replace(r_again, sig=None))
    assert key(w2.w, w2.w_scale, 2, True) == mx_launch._plan_key(p["a"], None, w2.w, w2.w_scale, 2, True, r_again,
                                                                  None, False, None, wsig=w2.signature)
    assert mx_launch._PLANS.get(key(p["w"], p["w_scale"], 0)).config.PREPACK == 0
    plan = mx_launch._PLANS.get(key(w2.w, w2.w_scale, 2, True))
    assert plan.config.PREPACK == 2 and plan.constexprs["ONE_MUL"]
    # the same tensors with the scale range unknown: a plan of their own, two multiplies
    moe_mxfp4_down(p["a"], Mxfp4Weights(w2.w, w2.w_scale, 2), r)
    assert not mx_launch._PLANS.get(key(w2.w, w2.w_scale, 2, False)).constexprs["ONE_MUL"]


def test_rot_ptx_expansion_matches_plain_patterns():
    """PREPACK=2's inline PTX (modelled instruction by instruction) on every prepacked register
    word gives the same four bf16x2 patterns as the plain layout's PTX on the plain bytes: the
    GPU path is exact wherever the plain one is (the interpreter runs neither)."""
    import numpy as np

    from kernels.moe_mxfp4.quant import _regroup_bits
    from kernels.moe_mxfp4.triton import _E2M1_PATTERNS_PTX, _E2M1_ROT_PTX

    g = torch.Generator().manual_seed(5)
    w = torch.randint(0, 256, (1, 16, 2 * 4096), generator=g, dtype=torch.uint8)
    w[0, 0, 0], w[0, 0, 1], w[0, 8, 0], w[0, 8, 1] = 0xFF, 0x88, 0x00, 0x7F
    wr = _regroup_bits(w, inverse=False)

    def words(t):        # the register groups: bytes (r, c), (r, c + 1), (r + 8, c), (r + 8, c + 1)
        t = t.reshape(2, 8, -1, 2).to(torch.int64)
        b = [t[q // 2, :, :, q % 2] for q in range(4)]
        return (b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24).reshape(-1).numpy().astype(np.uint32)

    plain = _run_ptx(_E2M1_PATTERNS_PTX.value, {"$4": words(w)})
    rot = _run_ptx(_E2M1_ROT_PTX.value, {"$4": words(wr)})
    x = words(w).astype(np.int64)          # the model itself, against the patterns' definition
    pat = lambda b, sh: (((b >> sh) & 7) << 6) | (((b >> sh) & 8) << 12)
    assert np.array_equal(plain["$0"], (pat(x & 0xFF, 0) | pat((x >> 8) & 0xFF, 0) << 16).astype(np.uint32))
    assert np.array_equal(plain["$3"], (pat(x >> 16 & 0xFF, 4) | pat((x >> 24) & 0xFF, 4) << 16).astype(np.uint32))
    for r in ("$0", "$1", "$2", "$3"):
        assert np.array_equal(plain[r], rot[r]), r


def test_scale_ptx_matches_scale_bits():
    """The prepacked path's scale PTX (two bytes per 32-bit op, no compares), modelled, gives
    the bf16 pattern of 2**(s - 127) for all 256 bytes: 0 -> 0x0040 (2**-127), 255 -> 0x7FC0."""
    import numpy as np

    from kernels.moe_mxfp4.triton import _SCALE_PATTERNS_PTX

    b = np.arange(256, dtype=np.uint32)
    words = b | np.roll(b, 1) << 8 | np.roll(b, 2) << 16 | np.roll(b, 3) << 24
    out = _run_ptx(_SCALE_PATTERNS_PTX.value, {"$2": words.astype(np.uint32)})
    want = lambda s: np.where(s == 0, 0x40, np.where(s == 255, 0x7FC0, s << 7)).astype(np.uint32)
    assert np.array_equal(out["$0"], want(b) | want(np.roll(b, 1)) << 16)
    assert np.array_equal(out["$1"], want(np.roll(b, 2)) | want(np.roll(b, 3)) << 16)
    # the same patterns as the plain path's conversion (and the fp32 decode used by the interpreter)
    assert torch.equal(torch.from_numpy(want(b).astype(np.int64)).view(torch.int64).to(torch.int16).view(torch.bfloat16)
                       .float().nan_to_num(7.0),
                       torch.ldexp(torch.ones(256), torch.arange(256) - 127.0).where(torch.arange(256) < 255,
                                                                                     torch.tensor(7.0)))


def test_scale_one_mul_ptx_and_products_match_two_multiplies():
    """ONE_MUL's scale PTX (modelled) gives 2**(s - 1) as a bf16 pattern for every byte up to 128,
    and one bf16 multiply of each of the 16 bit-placed E2M1 patterns (value * 2**-126, the codes 0
    and 0.5 in bf16's zero and subnormal encodings) by it gives the bits of the two multiplies
    (x 2**126, then x 2**(s - 127)) for every such byte: bf16 products round once either way and
    each is exact. (torch's CPU bf16 multiply rounds the exact product once, as HMUL2 does.)"""
    import numpy as np

    from kernels.moe_mxfp4.triton import _SCALE_ONE_MUL_PTX

    b = np.arange(129, dtype=np.uint32)
    words = b | np.roll(b, 1) << 8 | np.roll(b, 2) << 16 | np.roll(b, 3) << 24
    out = _run_ptx(_SCALE_ONE_MUL_PTX.value, {"$2": words.astype(np.uint32)})
    want = lambda s: ((s + 126) << 7).astype(np.uint32)
    assert np.array_equal(out["$0"], want(b) | want(np.roll(b, 1)) << 16)
    assert np.array_equal(out["$1"], want(np.roll(b, 2)) | want(np.roll(b, 3)) << 16)

    as_bf16 = lambda bits: torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    codes = torch.arange(16)
    pattern = as_bf16((((codes & 7) << 6) | ((codes & 8) << 12)).tolist())         # value * 2**-126
    values = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))             # codes 0-7, then 8-15
    assert torch.equal(pattern.float() * 2.0 ** 126, values)
    s = torch.arange(129)
    one = as_bf16(want(s.numpy()).astype(np.int64).tolist())                        # 2**(s - 1)
    two = as_bf16(np.where(s.numpy() == 0, 0x40, s.numpy() << 7).tolist())            # 2**(s - 127)
    assert torch.equal(one.float(), torch.ldexp(torch.ones(129), s - 1.0))
    got = pattern[:, None] * one[None, :]
    ref = (pattern * torch.tensor(2.0 ** 126, dtype=torch.bfloat16))[:, None] * two[None, :]
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    assert torch.equal(got.float(), values[:, None] * torch.ldexp(torch.ones(129), s - 127.0))


def test_one_mul_expansion_ptx_matches_pattern_times_scale():
    """ONE_MUL's expansion (the pattern PTX and one bf16x2 multiply per word in one asm block),
    modelled instruction by instruction, for the plain and the PREPACK=2 bit orders: each output
    half is its byte's pattern times that byte's scale pattern 2**(s - 1), i.e. the E2M1 value
    times 2**(s - 127), for random words and every scale byte up to 128."""
    import numpy as np

    from kernels.moe_mxfp4.triton import (_E2M1_MUL_PTX, _E2M1_PATTERNS_PTX, _E2M1_ROT_MUL_HI_PTX, _E2M1_ROT_MUL_PTX,
                                          _E2M1_ROT_PTX)

    g = np.random.default_rng(7)
    n = 4096
    words = g.integers(0, 2 ** 32, n, dtype=np.uint64).astype(np.uint32)
    s = g.integers(0, 129, (n, 4))
    s[:129, 0] = np.arange(129)
    f = ((s + 126) << 7).astype(np.uint32)
    f01, f23 = f[:, 0] | f[:, 1] << 16, f[:, 2] | f[:, 3] << 16
    bf = lambda x, i: torch.from_numpy(((x >> (16 * i)) & 0xFFFF).astype(np.int32)).to(torch.int16).view(torch.bfloat16)
    for mul_ptx, pat_ptx in ((_E2M1_MUL_PTX, _E2M1_PATTERNS_PTX), (_E2M1_ROT_MUL_PTX, _E2M1_ROT_PTX)):
        pat = _run_ptx(pat_ptx.value, {"$4": words})
        got = _run_ptx(mul_ptx.value, {"$4": words, "$5": f01, "$6": f23})
        for out, scales in (("$0", f01), ("$1", f23), ("$2", f01), ("$3", f23)):
            for i in (0, 1):
                want = bf(pat[out], i).float() * bf(scales, i).float()       # exact: E2M1 value x 2**(s - 127)
                assert torch.equal(bf(got[out], i).float(), want), (out, i)
    # PREPACK=3: the high-nibble words take their own scale words ($7, $8)
    h = ((g.integers(0, 129, (n, 4)) + 126) << 7).astype(np.uint32)
    h01, h23 = h[:, 0] | h[:, 1] << 16, h[:, 2] | h[:, 3] << 16
    pat = _run_ptx(_E2M1_ROT_PTX.value, {"$4": words})
    got = _run_ptx(_E2M1_ROT_MUL_HI_PTX.value, {"$4": words, "$5": f01, "$6": f23, "$7": h01, "$8": h23})
    for out, scales in (("$0", f01), ("$1", f23), ("$2", h01), ("$3", h23)):
        for i in (0, 1):
            assert torch.equal(bf(got[out], i).float(), bf(pat[out], i).float() * bf(scales, i).float()), (out, i)


def test_weights_scale_range_and_split_k_validate():
    p = _problem(1, H_=128, I_=128, seed=53)
    with pytest.raises(ValueError, match="max_scale must be None or the largest scale byte"):
        Mxfp4Weights(p["w"], p["w_scale"], 0, 300)
    big = p["w_scale"].clone()
    big[0, 0, 0] = 129
    assert not prepare_weights(p["w"], big, 2).one_mul and prepare_weights(p["w"], p["w_scale"], 1).one_mul
    with pytest.raises(ValueError, match=r"SPLIT_K must be one of \(1, 2, 3, 4, 6, 8\)"):
        MoeMxfp4Config(SPLIT_K=5).validate(512)
    with pytest.raises(ValueError, match="deterministic mode needs SPLIT_K=1"):
        MoeMxfp4Config(SPLIT_K=2, DETERMINISTIC=True).validate(512)
    with pytest.raises(ValueError, match=r"cdiv\(I=640, BLOCK_K=128\) = 5 K steps, 2 each, leave the last part none"):
        MoeMxfp4Config(SPLIT_K=4).validate(640)
    MoeMxfp4Config(SPLIT_K=2).validate(480)             # 4 steps, the last I's 96-wide tail
    MoeMxfp4Config(SPLIT_K=2).validate(384)             # 3 steps: 2 + 1, the last part's second past I
    MoeMxfp4Config(SPLIT_K=8).validate(2880)            # gpt-oss' 23 steps: 3 each, the last part 2
    assert MoeMxfp4Config(BLOCK_N=64, PREPACK=2, ONE_MUL=False, SPLIT_K=2).label().endswith("_prepack2_2mul_sk2")
    with pytest.raises(ValueError, match="maxnreg must be None or an int in"):
        MoeMxfp4Config(maxnreg=16).validate(512)
    assert MoeMxfp4Config(BLOCK_N=64, PREPACK=2, maxnreg=64).label().endswith("_prepack2_r64")
    assert MoeMxfp4Config(BLOCK_N=64, PREPACK=2).label().endswith("_prepack2")


@pytest.mark.parametrize("split,level,la", [(2, 0, 0), (2, 2, 1), (4, 2, 0), (2, 3, 1)],
                         ids=["plain_sk2", "prepack2_sk2_la1", "prepack2_sk4", "prepack3_sk2_la1"])
def test_kernel_split_k_within_bound(split, level, la):
    """SPLIT_K programs each reduce I / SPLIT_K and add their partial sums with the atomic epilogue:
    on poisoned outputs within the reference bound, plain and prepacked layouts, with and without
    loads ahead. The bound follows the additions: each partial row is rounded and added on its own,
    so its terms are the magnitudes of the partial rows (which can exceed the whole row's where
    the halves cancel), and SPLIT_K times as many of them."""
    I_, H_ = 512, 128
    p = _problem(5, H_=H_, I_=I_, seed=60 + split + level)
    cfg = MoeMxfp4Config(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128 if level else 64, num_warps=4 if level else 1,
                         PREPACK=level, LOAD_AHEAD=la, SPLIT_K=split)
    q = dict(p, w=prepare_weights(p["w"], p["w_scale"], level), w_scale=None) if level else p
    out = torch.full((5, H_), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = _run(q, cfg, out=out)
    _check(got, p, slack=split, ref=_split_reference(p, split))
    assert any(v.config == cfg and v.grid[2] == split for v in mx_launch._PLANS.values())


def test_split_k_rule_and_the_launcher_uses_it(monkeypatch):
    """Without a config (atomic mode) the launcher splits K by config.split_k_for: while each part
    keeps 8 or more K steps, and the output tiles (the routing's row blocks times the column
    tiles, an upper bound) do not give 8 programs per SM or a program would run 32 steps or more.
    In the interpreter (the minimum lowered to 1 step): 64 SMs, 14 tiles -> SPLIT_K 4 at I = 512,
    within the bound of the partial rows, and default_config(..., H, sms) names that config."""
    from kernels.moe_mxfp4 import config as mx_config
    from kernels.moe_mxfp4.config import split_k_for

    assert split_k_for(4032, 512, 128, 132) == 1                     # KIMI-K2.5 (4 steps): never
    assert split_k_for(128, 14336, 128, 132) == 4                    # Mixtral at M = 1 (112 steps)
    assert split_k_for(5120, 8192, 128, 132) == 4                    # long programs split in a full launch
    assert split_k_for(600, 2048, 128, 132) == 2 and split_k_for(1056, 2048, 128, 132) == 1
    assert split_k_for(512, 1536, 128, 132) == 1                     # 12 steps: parts of 6 are too short
    # ragged parts (issue 42): gpt-oss' 23 steps in 12 + 11 at M = 1 (4 experts x 45 column tiles), not
    # in a full launch; Phi-3.5's 50 in 13 + 13 + 13 + 11 at M = 1 (was 2: 4 did not divide 50)
    assert split_k_for(180, 2880, 128, 132) == 2 and split_k_for(4500, 2880, 128, 132) == 1
    assert split_k_for(128, 6400, 128, 132) == 4
    monkeypatch.setattr(mx_config, "SPLIT_MIN_STEPS", 1)
    monkeypatch.setattr(mx_plan, "sms", lambda device: 64)
    mx_launch._PLANS.clear()
    I_, H_ = 512, 128
    p = _problem(5, H_=H_, I_=I_, seed=71)
    weights = prepare_weights(p["w"], p["w_scale"], 2)
    r = prepare_routing(p["ids"], p["wts"], E, 16)
    out = torch.full((5, H_), float("nan"), dtype=torch.bfloat16, device=DEV)
    got = moe_mxfp4_down(p["a"], weights, r, out=out)
    plan = next(v for v in mx_launch._PLANS.values() if v.config.PREPACK == 2 and v.H == H_ and v.M == 5
                and v.config.SPLIT_K == 4)
    assert plan.grid == (r.max_blocks, 2, 4) and r.max_blocks * 2 < 64 * 8
    assert default_config(5, TOP_K, E, I_, prepacked=2, H=H_, sms=64) == plan.config      # what it runs
    _check(got, p, slack=4.0, ref=_split_reference(p, 4))
    det = moe_mxfp4_down(p["a"], weights, r, config=default_config(5, TOP_K, E, I_, prepacked=2, deterministic=True))
    _check(det, p)


@pytest.mark.parametrize("level,bk,split", [(0, 32, 1), (2, 128, 1), (2, 128, 2), (3, 256, 1)],
                         ids=["plain_8steps", "prepack2_4steps", "prepack2_sk2", "prepack3_bk256_2steps"])
def test_kernel_long_reduction_loop_equals_unrolled(monkeypatch, level, bk, split):
    """More K steps than the kernel unrolls (MAX_UNROLLED_STEPS, lowered here to 1) run as a
    loop: on poisoned outputs the same bits as the unrolled steps, plain and prepacked layouts,
    with SPLIT_K. (The interpreter runs the fp32 expansion, which does not depend on register
    order; test_gpu_long_reduction_prepacked checks the inline PTX in the loop.)"""
    I_, H_ = (256, 96) if level == 0 else (512, 128)
    p = _problem(5, H_=H_, I_=I_, seed=80 + level + split)
    cfg = MoeMxfp4Config(BLOCK_M=16, BLOCK_N=32 if level == 0 else 64, BLOCK_K=bk, num_warps=1 if level == 0 else 4,
                         PREPACK=level, SPLIT_K=split, DETERMINISTIC=split == 1)
    q = dict(p, w=prepare_weights(p["w"], p["w_scale"], level), w_scale=None) if level else p
    unrolled = _run(q, cfg).clone()
    mx_launch._PLANS.clear()
    monkeypatch.setattr(mx_plan, "MAX_UNROLLED_STEPS", 1)
    _run(q, cfg)
    _poison_workspaces()
    out = torch.full((5, H_), float("nan"), dtype=torch.bfloat16, device=DEV)
    looped = _run(q, cfg, out=out)
    assert next(iter(mx_launch._PLANS.values())).constexprs["MAX_UNROLL"] == 1
    mx_launch._PLANS.clear()
    assert torch.equal(looped, unrolled)
    if split == 1:
        _check(looped, p)


def test_kernel_accumulates_into_out():
    p = _problem(5, seed=3)
    cfg = default_config(5, TOP_K, E, I, interpreter=not ON_GPU)
    base = torch.randn(5, H, generator=torch.Generator().manual_seed(4)).bfloat16().to(DEV)
    out = _run(p, cfg, out=base.clone(), accumulate=True)
    rows = reference_rows(p["a"], p["w"], p["w_scale"], p["ids"], p["wts"])
    ref = rows.sum(1) + base.float()
    bound = (TOP_K + 2) * 2.0 ** -8 * (rows.abs().sum(1) + base.float().abs()) + 1e-6
    assert ((out.float() - ref).abs() <= bound).all()


def test_deterministic_mode_is_bit_identical():
    p = _problem(33, seed=5)
    cfg = default_config(33, TOP_K, E, I, interpreter=not ON_GPU, deterministic=True)
    first = _run(p, cfg).clone()
    _poison_workspaces()
    assert torch.equal(_run(p, cfg), first)


def test_expansion_is_exact():
    """The kernel's E2M1 -> bf16 expansion (through the dequantize kernel that shares it) equals
    the torch dequantizer bit for bit, scale bytes 0 (subnormal), 1, 254 and 255 (NaN) included."""
    g = torch.Generator().manual_seed(6)
    packed = torch.randint(0, 256, (40, 32), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (40, 2), generator=g, dtype=torch.uint8)
    scales[0, 0], scales[1, 0], scales[2, 1], scales[3, 0] = 0, 1, 254, 255
    got = dequantize_weights_bf16(packed.to(DEV), scales.to(DEV)).float().cpu()
    ref = dequantize_mxfp4(packed, scales, torch.bfloat16).float()
    assert torch.equal(got.isnan(), ref.isnan())
    got, ref = torch.nan_to_num(got), torch.nan_to_num(ref)
    if not ON_GPU:
        # The interpreter's fp32 -> bf16 conversion rounds bf16 subnormals (scale byte 0: values
        # below 2**-126) wrongly (1.5 * 2**-127 -> 2**-127, 2**-128 -> 0); the GPU's cvt does not.
        # Everywhere else the bits must match in the interpreter too.
        sub = (got != ref) & (ref.abs() < 2.0 ** -126) & (got.abs() < 2.0 ** -126)
        got = torch.where(sub, ref, got)
        assert sub.sum() < 64
    assert torch.equal(got, ref)


def test_launcher_validates_and_caches():
    p = _problem(5)
    cfg = default_config(5, TOP_K, E, I, interpreter=not ON_GPU)
    r = prepare_routing(p["ids"], p["wts"], E, cfg.BLOCK_M)
    with pytest.raises(ValueError, match="BLOCK_M=32 but the routing was padded to 16"):
        moe_mxfp4_down(p["a"], p["w"], p["w_scale"], r, config=cfg.replace(BLOCK_M=32))
    with pytest.raises(ValueError, match="a must be bf16"):
        moe_mxfp4_down(p["a"].float(), p["w"], p["w_scale"], r, config=cfg)
    with pytest.raises(ValueError, match="w_scale must be uint8"):
        moe_mxfp4_down(p["a"], p["w"], p["w_scale"][:, :, :1], r, config=cfg)
    with pytest.raises(ValueError, match="leave the last part none"):
        moe_mxfp4_down(p["a"], p["w"], p["w_scale"], r, config=cfg.replace(SPLIT_K=8))
    with pytest.raises(ValueError, match="routing must come from prepare_routing"):
        moe_mxfp4_down(p["a"], p["w"], p["w_scale"], (1, 2), config=cfg)
    with pytest.raises(ValueError, match="accumulate=True needs an out"):
        moe_mxfp4_down(p["a"], p["w"], p["w_scale"], r, config=cfg, accumulate=True)
    p0 = _problem(0)
    r0 = prepare_routing(p0["ids"], p0["wts"], E, cfg.BLOCK_M)
    assert moe_mxfp4_down(p0["a"], p0["w"], p0["w_scale"], r0, config=cfg).shape == (0, H)
    before = mx_launch.plan_cache_info()["plans"]
    moe_mxfp4_down(p["a"], p["w"], p["w_scale"], r, config=cfg)
    moe_mxfp4_down(p["a"], p["w"], p["w_scale"], r, config=cfg)
    assert mx_launch.plan_cache_info()["plans"] <= before + 1


def test_baseline_dequant_grouped_gemm_matches_reference():
    from kernels.moe_mxfp4 import baselines

    p = _problem(5, seed=9)
    rows = baselines.sorted_rows(p["ids"], E)
    assert rows.counts.tolist() == torch.bincount(p["ids"].reshape(-1).long().cpu(), minlength=E).tolist()
    _check(baselines.dequant_grouped_gemm(p["a"], p["w"], p["w_scale"], rows, p["wts"]), p, slack=2.0)


def test_metrics():
    assert metrics.flops(4, 9, 7168, 512) == 2 * 36 * 7168 * 512
    # 36 experts' weights (packed + scales), bf16 activations, bf16 output
    assert metrics.hbm_bytes(4, 9, 7168, 512, 36) == 36 * 7168 * (256 + 16) + 36 * 512 * 2 + 4 * 7168 * 2
    assert metrics.hbm_bytes(4, 9, 7168, 512, 36, a_fp4=True) == 36 * 7168 * 272 + 36 * 272 + 4 * 7168 * 2


def test_default_config_follows_rows_per_expert():
    from kernels.moe_mxfp4.config import config_for_block_m

    assert config_for_block_m(32, 512).BLOCK_M == 32 and config_for_block_m(128, 512).num_warps == 8
    with pytest.raises(ValueError, match="BLOCK_M must be one of"):
        config_for_block_m(8, 512)
    assert default_config(4, 9, 385, 512).BLOCK_M == 16
    assert default_config(256, 9, 385, 512).BLOCK_M == 16
    assert default_config(16384, 9, 385, 512).BLOCK_M == 128
    assert default_config(16384, 9, 385, 512, deterministic=True).DETERMINISTIC


# ---------------------------------------------------------------------------
# assembly: the kernel cross-compiled for sm_90
# ---------------------------------------------------------------------------

_OP = re.compile(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Za-z0-9_.]+)")


_SM90_CONFIGS = {
    "bm16_nt_atomic": ({}, False),
    "bm32_det": (dict(BLOCK_M=32, NT=False, DETERMINISTIC=True), False),
    "bm16_a4w4": ({}, True),
    "bm16_bits": (dict(EXPAND="bits"), False),
    "bm16_early_off": (dict(EARLY_LOADS=False), False),
    "bm16_prefetch_off": (dict(PREFETCH_EPILOGUE=False), False),
    "bm16_la3": (dict(NT=True, LOAD_AHEAD=3), False),
    "bm16_bn64": (dict(BLOCK_N=64), False),
    "bm16_bn64_prepack1": (dict(BLOCK_N=64, PREPACK=1), False),
    "bm16_bn64_prepack2": (dict(BLOCK_N=64, PREPACK=2), False),
    "bm16_bn64_prepack2_2mul": (dict(BLOCK_N=64, PREPACK=2, ONE_MUL=False), False),
    "bm16_bn64_prepack2_la1_sk2": (dict(BLOCK_N=64, PREPACK=2, LOAD_AHEAD=1, SPLIT_K=2), False),
    "bm16_bn64_prepack3": (dict(BLOCK_N=64, PREPACK=3), False),
    # the prepacked large-M tile where H % 128 != 0 (config_for_block_m(128, 512, prepacked=2, H=...)): swapped
    "bm128_bn64_prepack2_swap": (dict(BLOCK_M=128, BLOCK_N=64, SWAP_AB=True, NT=False, PREPACK=2), False),
}

# One child process (the interpreter off) compiles every config: one import instead of six.
_SM90_CHILD = r"""
import json, sys
from kernels.moe_mxfp4 import MoeMxfp4Config
from kernels.moe_mxfp4.launch import compile_for_target
configs, cache = json.loads(sys.argv[1]), sys.argv[2]
out = {}
for name, (kw, a_fp4) in configs.items():
    e = compile_for_target(MoeMxfp4Config(**kw), a_fp4=a_fp4, cache_dir=cache)[0]
    out[name] = {"sass": e.text("sass"), "ptx": e.text("ptx"), "ttgir": e.text("ttgir")}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def sm90(tmp_path_factory):
    import json
    import os
    import subprocess
    import sys

    cache = tmp_path_factory.mktemp("moe_mxfp4_sm90")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", _SM90_CHILD, json.dumps(_SM90_CONFIGS), str(cache)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    texts = json.loads(proc.stdout)
    ops = {name: Counter(m.group(1) for m in map(_OP.search, t["sass"].splitlines()) if m)
           for name, t in texts.items()}
    ops["ptx"] = texts["bm16_nt_atomic"]["ptx"]
    ops["ttgir"] = {name: t["ttgir"] for name, t in texts.items() if "prepack" in name}
    for name in ("bm16_nt_atomic", "bm16_early_off", "bm16_prefetch_off", "bm16_la3"):
        ops[name + "_seq"] = [m.group(1) for m in map(_OP.search, texts[name]["sass"].splitlines()) if m]
    return ops


def _count(ops: Counter, prefix: str) -> int:
    return sum(v for k, v in ops.items() if k.startswith(prefix))


def test_sm90_main_loop_uses_wgmma_with_expansion_in_registers(sm90):
    for name, ops in sm90.items():
        if name in ("ptx", "ttgir") or name.endswith("_seq"):
            continue
        bm = int(re.match(r"bm(\d+)", name).group(1))
        steps = 2 if "_sk2" in name else 4                        # K steps per program
        assert _count(ops, f"HGMMA.64x{bm}x16.F32.BF16") >= 8 * steps, name
        assert _count(ops, "HMMA") == 0, name                     # no mma.sync fallback
        bn = 64 if "bn64" in name else 128
        one_mul = "prepack" in name and "2mul" not in name       # one multiply per pair, not two
        assert _count(ops, "HMUL2.BF16_V2") >= steps * bn // (2 if one_mul else 1), name   # bf16x2 expansion


def test_sm90_inline_ptx_expansion_is_used_and_cheaper(sm90):
    assert "prmt.b32 t0" in sm90["ptx"] and "0x01C001C0" in sm90["ptx"]
    total = lambda ops: sum(ops.values())
    assert total(sm90["bm16_nt_atomic"]) < 0.9 * total(sm90["bm16_bits"])


def test_sm90_latency_switches_move_the_loads(sm90):
    """EARLY_LOADS: the first K step's 128-bit weight loads are issued before the early exit
    (EXIT); off, nothing but the row count is loaded before it. PREFETCH_EPILOGUE: the
    routing weights (the block's 16 fp32, two LDG.E.64) are loaded before the first wgmma;
    off, after it (in the epilogue)."""
    def before(seq, what, marker):
        stop = next(i for i, op in enumerate(seq) if op.startswith(marker))
        return sum(1 for op in seq[:stop] if op == what)

    assert before(sm90["bm16_nt_atomic_seq"], "LDG.E.EF.128", "EXIT") >= 4
    assert before(sm90["bm16_early_off_seq"], "LDG.E.EF.128", "EXIT") == 0
    assert before(sm90["bm16_nt_atomic_seq"], "LDG.E.64", "HGMMA") == 2
    assert before(sm90["bm16_prefetch_off_seq"], "LDG.E.64", "HGMMA") == 0


def test_sm90_load_ahead_issues_every_weight_load_before_the_first_wgmma(sm90):
    """LOAD_AHEAD=3 at I = 512 (4 K steps): all 4 x 4 evict-first 128-bit weight loads come
    before the first HGMMA; without it only the first step's (and at most the second's)."""
    def before(seq, what, marker):
        stop = next(i for i, op in enumerate(seq) if op.startswith(marker))
        return sum(1 for op in seq[:stop] if op == what)

    assert before(sm90["bm16_la3_seq"], "LDG.E.EF.128", "HGMMA") >= 16
    assert before(sm90["bm16_nt_atomic_seq"], "LDG.E.EF.128", "HGMMA") <= 8


def test_sm90_prepack_needs_fewer_instructions_per_weight(sm90):
    """At the heuristic's small-M tile (BM16 x BN64 x BK128, 4 warps; 64 x 512 weights over 128
    threads = 256 per thread): PREPACK=1 drops the shared-memory pass of the weights (no LDS of
    byte pairs, no byte-gathering PRMTs) and the per-scale compares; PREPACK=2 also halves the
    bit placement; ONE_MUL (the weights' scale bytes all <= 128) scales each pair with one multiply
    instead of two, in the expansion's asm block. Cross-compiled 2026-11-25: 6.81 -> 4.47 -> 3.34
    SASS instructions per weight (4.06 for PREPACK=2 with two multiplies)."""
    names = ("bm16_bn64", "bm16_bn64_prepack1", "bm16_bn64_prepack2", "bm16_bn64_prepack2_2mul")
    per_w = {n: sum(sm90[n].values()) / 256 for n in names}
    assert per_w["bm16_bn64_prepack1"] < per_w["bm16_bn64"] - 1.0, per_w
    assert per_w["bm16_bn64_prepack2_2mul"] < 4.5, per_w
    assert per_w["bm16_bn64_prepack2"] < per_w["bm16_bn64_prepack1"] - 0.8, per_w
    assert per_w["bm16_bn64_prepack2"] < min(3.6, per_w["bm16_bn64_prepack2_2mul"] - 0.5), per_w
    for n in names[1:]:
        ops = sm90[n]
        assert _count(ops, "LDS") <= 2 and _count(ops, "ISETP") <= 8 and _count(ops, "SEL") == 0, n
        assert _count(ops, "HGMMA.64x16x16.F32.BF16") == 32, n
        assert _count(ops, "HMUL2.BF16_V2") == (256 if n.endswith("2mul") else 128), n
        assert _count(ops, "LDG.E.EF.128") == 8 and _count(ops, "LDG.E.EF.64") == 4, n  # 2 + 1 per K step
    assert _count(sm90["bm16_bn64"], "LDS") >= 64
    # per word: two rotations (SHF) and two plain left shifts (IMAD.SHL, on the FMA pipe)
    assert _count(sm90["bm16_bn64_prepack2"], "SHF") >= 2 * 8 * 4 and _count(sm90["bm16_bn64_prepack2"], "IMAD.SHL") >= 2 * 8 * 4


def test_sm90_prepack3_drops_the_byte_moves(sm90):
    """PREPACK=3 stores each register group's 4 bytes together and pairs the codes (K = j, 64 + j):
    the weights' PRMT per word (rows r + 8 moved next to rows r) and the bf16 activations' even /
    odd split are gone (cross-compiled 2026-11-27: 3.34 -> 3.00 SASS instructions per weight at
    LOAD_AHEAD 0, 3.31 -> 3.06 at 1; 88 -> 28 PRMT), the same HGMMA and HMUL2. The expansion's asm reads its 4 bytes in
    the layout level 2's does (wgmma's register operand; level 2 checked bit for bit on the GPU),
    so the rotations see the same register groups."""
    p2, p3 = sm90["bm16_bn64_prepack2"], sm90["bm16_bn64_prepack3"]
    assert sum(p3.values()) <= sum(p2.values()) - 32, (sum(p2.values()), sum(p3.values()))
    assert _count(p3, "PRMT") <= _count(p2, "PRMT") - 32
    assert _count(p3, "HGMMA.64x16x16.F32.BF16") == 32 and _count(p3, "HMUL2.BF16_V2") == 128
    assert _count(p3, "LDS") <= 2 and _count(p3, "LDG.E.EF.128") == 8

    def rot_operands(ttgir):
        lines = [ln for ln in ttgir.splitlines() if "elementwise_inline_asm" in ln and "shf.l.wrap" in ln]
        return {re.search(r": (tensor<64x64xi8, [^>]*>>)", ln).group(1) for ln in lines}

    layouts = {lvl: rot_operands(sm90["ttgir"][f"bm16_bn64_prepack{lvl}"]) for lvl in (2, 3)}
    assert layouts[2] == layouts[3] and len(layouts[3]) == 1 and "dot_op<{opIdx = 0" in next(iter(layouts[3]))


def test_sm90_prepacked_large_m_default_compiles_without_spills(sm90):
    """The prepacked BLOCK_M 128 tile where H % 128 != 0 (BN64; elsewhere BN128, which ran 1.4x as
    fast at M = 16384 with a few spill stores) is the swapped kernel: wgmma 64 x 128 x 16 with the weights from registers (2 dots x 4 per K step, 4 steps),
    the scales in one 64-bit load per step (the weights' two 128-bit loads per step are among the
    activations' LDG.E.128), no evict-first (NT off), one HMUL2 per weight pair (ONE_MUL), and no
    register spills (cross-compiled with Triton 3.6: 220 registers with two multiplies)."""
    from kernels.moe_mxfp4 import config_for_block_m

    kw = _SM90_CONFIGS["bm128_bn64_prepack2_swap"][0]
    assert config_for_block_m(128, 512, prepacked=2, H=7168 + 64) == MoeMxfp4Config(**kw)
    assert config_for_block_m(128, 512, prepacked=2, H=7168).BLOCK_N == 128
    ops = sm90["bm128_bn64_prepack2_swap"]
    assert _count(ops, "HGMMA.64x128x16.F32.BF16") == 32
    assert _count(ops, "LDG.E.128") >= 8 and _count(ops, "LDG.E.64") == 4 and _count(ops, "LDG.E.EF") == 0
    assert _count(ops, "HMUL2.BF16_V2") == 128
    assert _count(ops, "STL") == 0 and _count(ops, "LDL") == 0


def test_sm90_split_k_halves_each_program(sm90):
    """SPLIT_K=2: each program runs two of the four K steps (half the wgmma and weight loads; the
    K offset is the program's third grid index), the epilogue still the bf16 atomic reduction."""
    ops = sm90["bm16_bn64_prepack2_la1_sk2"]
    assert _count(ops, "HGMMA.64x16x16.F32.BF16") == 16 and _count(ops, "HMUL2.BF16_V2") == 64
    assert _count(ops, "LDG.E.EF.128") == 4 and _count(ops, "REDG.E.ADD.BF16x8.RN") >= 1
    assert _count(ops, "S2R") > _count(sm90["bm16_bn64_prepack2"], "S2R")       # reads the third grid index


def test_sm90_weight_loads_are_128_bit(sm90):
    # NT: evict-first 128-bit loads of the packed weights, 4 per K step x 4 steps
    assert _count(sm90["bm16_nt_atomic"], "LDG.E.EF.128") >= 16
    assert _count(sm90["bm32_det"], "LDG.E.EF") == 0
    assert _count(sm90["bm32_det"], "LDG.E.128") >= 16


def test_sm90_atomic_epilogue_is_bf16x8_reduction(sm90):
    atomic = sm90["bm16_nt_atomic"]
    assert _count(atomic, "REDG.E.ADD.BF16x8.RN") >= 2            # 128-bit: eight bf16 per instruction
    assert _count(atomic, "ATOMG") == 0 and _count(atomic, "ATOMS.CAS") == 0
    det = sm90["bm32_det"]
    assert _count(det, "REDG") == 0 and _count(det, "STG.E.128") >= 1


# ---------------------------------------------------------------------------
# GPU: KIMI-K2.5 shapes
# ---------------------------------------------------------------------------

KIMI = dict(E_=385, H_=7168, I_=512, top_k=9)


@functools.lru_cache(maxsize=1)
def _kimi_weights():
    g = torch.Generator(device="cuda").manual_seed(0)
    w = torch.empty(385, 7168, 256, dtype=torch.uint8, device="cuda")
    w_scale = torch.empty(385, 7168, 16, dtype=torch.uint8, device="cuda")
    for e0 in range(0, 385, 64):       # bounded temporaries
        n = min(64, 385 - e0)
        w[e0:e0 + n], w_scale[e0:e0 + n] = quantize_mxfp4(torch.randn(n, 7168, 512, device="cuda", generator=g) * 0.02)
    return w, w_scale


def _kimi_problem(M, a_fp4=False):
    g = torch.Generator(device="cuda").manual_seed(M)
    w, w_scale = _kimi_weights()
    a = torch.randn(M * 9, 512, device="cuda", generator=g).bfloat16()
    ids = torch.rand(M, 385, device="cuda", generator=g).topk(9, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(M, 9, device="cuda", generator=g), -1)
    a_scale = None
    if a_fp4:
        a, a_scale = quantize_mxfp4(a.float())
    return dict(a=a, a_scale=a_scale, w=w, w_scale=w_scale, ids=ids, wts=wts)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4, 32, 256, 16384])
@pytest.mark.parametrize("a_fp4", [False, True], ids=["w4a16", "a4w4"])
def test_gpu_kimi_matches_reference(M, a_fp4):
    p = _kimi_problem(M, a_fp4)
    ref = _reference(p)
    for bm in (16, 32) if M <= 256 else (128,):
        for det in (False, True):
            cfg = default_config(M, 9, 385, 512, deterministic=det).replace(BLOCK_M=bm)
            if bm < 64:
                cfg = cfg.replace(num_warps=4, BLOCK_N=128)
            _run(p, cfg)
            _poison_workspaces()
            out = torch.full((M, 7168), float("nan"), dtype=torch.bfloat16, device="cuda")
            _check(_run(p, cfg, out=out), p, ref=ref)


@pytest.mark.gpu
def test_gpu_deterministic_bit_identical_and_graph_capturable():
    p = _kimi_problem(128)
    cfg = default_config(128, 9, 385, 512, deterministic=True)
    r = prepare_routing(p["ids"], p["wts"], 385, cfg.BLOCK_M)
    first = moe_mxfp4_down(p["a"], p["w"], p["w_scale"], r, config=cfg).clone()
    for _ in range(3):
        assert torch.equal(moe_mxfp4_down(p["a"], p["w"], p["w_scale"], r, config=cfg), first)
    # routing preparation and launch, captured together: no host synchronization anywhere
    out = torch.empty(128, 7168, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe_mxfp4_down(p["a"], p["w"], p["w_scale"], prepare_routing(p["ids"], p["wts"], 385, cfg.BLOCK_M),
                       config=cfg, out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        rg = prepare_routing(p["ids"], p["wts"], 385, cfg.BLOCK_M)
        moe_mxfp4_down(p["a"], p["w"], p["w_scale"], rg, config=cfg, out=out)
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, first)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4, 256])
def test_gpu_prepack_bit_identical_to_plain(M):
    """PREPACK 1 and 2 (the inline PTX the CPU tests only model) at KIMI-K2.5's shapes give the
    plain layout's bits, deterministic mode, on NaN-poisoned outputs; scale bytes 0, 1, 254,
    255 in a few blocks (NaN where the plain kernel has NaN). PREPACK 3 (another order of the
    additions): the same NaN and infinities, within a bf16 step elsewhere (_same_as_plain)."""
    p = _kimi_problem(M)
    ws = p["w_scale"].clone()
    ws[:, 0, 0], ws[:, 1, 1], ws[:, 70, 2], ws[:, 129, 3] = 0, 1, 254, 255
    plain = default_config(M, 9, 385, 512, deterministic=True)
    assert plain.BLOCK_N == 64 and plain.BLOCK_K == 128 and plain.num_warps == 4
    r = prepare_routing(p["ids"], p["wts"], 385, plain.BLOCK_M)
    want = moe_mxfp4_down(p["a"], p["w"], ws, r, config=plain).float()
    for level in (1, 2, 3):
        weights = prepare_weights(p["w"], ws, level)
        out = torch.full_like(want, float("nan")).bfloat16()
        got = moe_mxfp4_down(p["a"], weights, r, config=plain.replace(PREPACK=level), out=out).float()
        _same_as_plain(got, want, level)


@functools.lru_cache(maxsize=2)
def _kimi_prepacked(level):
    return prepare_weights(*_kimi_weights(), level)


@pytest.mark.gpu
@pytest.mark.parametrize("level", [2, 3])
@pytest.mark.parametrize("M", [4, 32, 256, 16384])
def test_gpu_prepacked_default_every_m(M, level):
    """A loader's single layout at every M (KIMI-K2.5): moe_mxfp4_down(a, prepare_weights(w, w_scale),
    routing) with no config (BM16 at M <= 256, BM128 with SWAP_AB at 16384) within the reference
    bound on poisoned outputs, and its deterministic mode bit-identical to the plain layout's
    kernel with the same tile (level 3: within a bf16 step of it, _same_as_plain)."""
    p = _kimi_problem(M)
    weights = _kimi_prepacked(level)
    cfg = default_config(M, 9, 385, 512, prepacked=level)
    assert cfg.BLOCK_M == (16 if M <= 256 else 128)
    r = prepare_routing(p["ids"], p["wts"], 385, cfg.BLOCK_M)
    out = torch.full((M, 7168), float("nan"), dtype=torch.bfloat16, device="cuda")
    _check(moe_mxfp4_down(p["a"], weights, r, out=out), p)
    det = cfg.replace(DETERMINISTIC=True)
    moe_mxfp4_down(p["a"], weights, r, config=det)
    _poison_workspaces()
    got = moe_mxfp4_down(p["a"], weights, r, config=det)
    _same_as_plain(got, moe_mxfp4_down(p["a"], p["w"], p["w_scale"], r, config=det.replace(PREPACK=0)), level)


@pytest.mark.gpu
@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_gpu_long_reduction_prepacked(level):
    """A reduction longer than the kernel unrolls (I = 4096: 32 steps of 128, a loop) on every
    layout, through the default path (SPLIT_K by rule) and the deterministic mode: within the
    reference bound on poisoned outputs (a first loop carried the loaded bytes across
    iterations and the prepacked layouts came out wrong on the GPU only)."""
    I_, H_ = 4096, 256
    p = _problem(3, E_=4, H_=H_, I_=I_, top_k=2, seed=90 + level, empty=None)
    weights = prepare_weights(p["w"], p["w_scale"], level)
    r = prepare_routing(p["ids"], p["wts"], 4, 16)
    assert r.max_blocks * (H_ // 64) < 132 * 4                        # few tiles: the rule splits K
    out = torch.full((3, H_), float("nan"), dtype=torch.bfloat16, device="cuda")
    got = moe_mxfp4_down(p["a"], weights, r, out=out)
    _check(got, p, slack=4.0, ref=_split_reference(p, 4))
    assert any(v.config.SPLIT_K == 4 and v.H == H_ for v in mx_launch._PLANS.values())   # 8 steps each
    det = config_for_block_m(16, I_, prepacked=level, H=H_, deterministic=True)
    for cfg in (det, det.replace(DETERMINISTIC=False)):                 # 32 steps: the loop
        out = torch.full((3, H_), float("nan"), dtype=torch.bfloat16, device="cuda")
        _check(moe_mxfp4_down(p["a"], weights, r, config=cfg, out=out), p)


@pytest.mark.gpu
@pytest.mark.parametrize("expand", ["ptx", "bits"])
def test_gpu_expansion_exact_at_kimi_size(expand):
    p = _kimi_problem(4)
    got = dequantize_weights_bf16(p["w"][:8], p["w_scale"][:8], expand=expand)
    assert torch.equal(got, dequantize_mxfp4(p["w"][:8], p["w_scale"][:8], torch.bfloat16))
    # every byte and scale value, NaN scale and the subnormal scale 0 included
    packed = torch.arange(256, dtype=torch.uint8, device="cuda").repeat(256, 1)
    scales = torch.arange(256, dtype=torch.uint8, device="cuda").unsqueeze(1).repeat(1, 16)
    got = dequantize_weights_bf16(packed, scales, expand=expand)
    ref = dequantize_mxfp4(packed, scales, torch.bfloat16)
    assert torch.equal(got.isnan(), ref.isnan())
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(ref))


@pytest.mark.gpu
def test_gpu_bits_expansion_matches_reference():
    p = _kimi_problem(32)
    cfg = MoeMxfp4Config(EXPAND="bits")
    out = torch.full((32, 7168), float("nan"), dtype=torch.bfloat16, device="cuda")
    _check(_run(p, cfg, out=out), p)



def test_quick_run_measures_committed_token_counts():
    """`run_moe_mxfp4.py --quick` (the notebook's quick run) measures M 4 and 32, both in the
    committed full run, so the notebook compares them case by case."""
    import importlib.util
    import subprocess
    import sys
    from pathlib import Path

    import pandas as pd

    root = Path(__file__).resolve().parents[1]
    script = root / "experiments" / "run_moe_mxfp4.py"
    res = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--quick" in res.stdout, res.stderr
    spec = importlib.util.spec_from_file_location("run_moe_mxfp4", script)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    assert run.measured_ms(True) == (4, 32) and run.measured_ms(False) == run.M_LIST
    committed = set(pd.read_csv(root / "results" / "moe_mxfp4" / "rows.csv").M)
    assert set(run.measured_ms(True)) <= committed and set(run.M_LIST) == committed
    # issue 42's models: gpt-oss at M 1-256 and gpt-oss-120b's long context, both prepacked (the rule)
    for name in ("gpt-oss-120b", "gpt-oss-20b"):
        ms, model = run.measured_ms(False, name), run.MODELS[name]
        assert min(ms) == 1 and 256 in ms and set(run.measured_ms(True, name)) <= set(ms)
        assert (model.E, model.H, model.I, model.TOP_K) == ((128 if name.endswith("120b") else 32), 2880, 2880, 4)
        run.use_model(name)
        assert run.prepackable() and {"default", "prepacked default", "prepacked L3"} <= set(run.variants(1))
    assert 8192 in run.measured_ms(False, "gpt-oss-120b") and 16384 in run.measured_ms(False, "kimi-k2.5")
    run.use_model("kimi-k2.5")


def test_study_tables_from_synthetic_rows():
    """run_moe_mxfp4.py's per-model summary and models.csv table: the prepacked default against the HBM
    bound and the peers, the user's loop eager over graph and its host time (synthetic timings)."""
    import importlib.util
    from pathlib import Path

    import pandas as pd

    script = Path(__file__).resolve().parents[1] / "experiments" / "run_moe_mxfp4.py"
    spec = importlib.util.spec_from_file_location("run_moe_mxfp4", script)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    times = {"default": 100.0, "prepacked default": 40.0, "prepacked L3": 32.0, "bf16 grouped_mm": 120.0,
             "dequant+grouped_mm": 800.0, "dequant+grouped_gemm": 900.0}
    rows = [dict(model="gpt-oss-20b", M=16, name=n, method=m, median_us=t * (1.1 if m == "eager" else 1.0),
                 hbm_bound_us=30.0, active_experts=20, host_us=float("nan"), kind="ours")
            for n, t in times.items() for m in ("graph", "eager")]
    rows += [dict(model="gpt-oss-20b", M=16, name="user loop", method=m, median_us=t, hbm_bound_us=30.0,
                  active_experts=20, host_us=h, kind="loop") for m, t, h in (("eager", 52.0, 31.0), ("graph", 40.0, None))]
    df = pd.DataFrame(rows)
    table = run.models_table({"gpt-oss-20b": df}).set_index("method")
    g = table.loc["graph"]
    assert g.frac_hbm_bound == pytest.approx(30 / 40) and g.frac_hbm_bound_l3 == pytest.approx(30 / 32)
    assert g.vs_bf16_grouped_mm == pytest.approx(120 / 32) and g.vs_dequant_grouped_mm == pytest.approx(800 / 32)
    assert g.user_loop_eager_over_graph == pytest.approx(52 / 40) and g.user_loop_host_us == pytest.approx(31.0)
    text = run.summary(df)
    assert "prepacked/bound" in text and "L3/bound" in text and "user loop eager/graph" in text


def test_variants_script_scores_the_prepacked_defaults(tmp_path):
    """run_moe_mxfp4_variants.py: every variant's config is valid at KIMI-K2.5's shapes (the prepacked
    default and, at large M, the BM64/BM128 prepacked tiles among them), and its summary scores the
    prepacked default at held-out M against the best variant, the best prepacked one and the plain
    default (synthetic timings)."""
    import importlib.util
    from pathlib import Path

    import pandas as pd

    script = Path(__file__).resolve().parents[1] / "experiments" / "run_moe_mxfp4_variants.py"
    spec = importlib.util.spec_from_file_location("run_moe_mxfp4_variants", script)
    run = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run)
    for M in (8, 16384):
        v = run.variants(M, 9, 385, 512)
        assert v["prepacked default"] == default_config(M, 9, 385, 512, prepacked=2)
        for cfg in v.values():
            cfg.validate(512)
            assert 7168 % cfg.BLOCK_N == 0 or not cfg.PREPACK
    big = run.variants(16384, 9, 385, 512)
    assert {"BM128 BN128 prepack2", "BM64 BN64 prepack2"} <= set(big) and big["prepacked default"].BLOCK_M == 128
    assert big["prepacked default tile, plain"] == big["prepacked default"].replace(PREPACK=0)
    # few experts with 16+ rows each below large M (gpt-oss-20b at M = 128): the 64- and 128-row tiles
    # and the small tiles without evict-first join; not where experts hold fewer rows (KIMI-K2.5 at 256)
    oss = run.variants(128, 4, 32, 2880)
    assert {"BM64 BN64 prepack2", "BM128 BN128 prepack2", "BM16 BN64 prepack2 la1 noNT"} <= set(oss)
    assert not oss["BM32 BN64 prepack2 noNT"].NT and oss["BM64 BN64 prepack2"].SWAP_AB
    assert {"BM32 BN64 prepack3 la1", "BM64 BN64 prepack3 la2", "BM32 BN128 prepack3"} <= set(oss)
    for name, cfg in oss.items():
        if name.startswith(("BM64", "BM128")) or "noNT" in name or "prepack3" in name:
            cfg.validate(2880)
    assert "BM64 BN64 prepack2" not in run.variants(256, 9, 385, 512)

    pre, plain = "_prepack2", ""
    times = {8: {"default": (90.0, plain), "prepacked default": (60.0, pre), "BM16 BN64 prepack2": (58.0, pre),
                 "dequant+grouped_gemm": (1200.0, None), "bf16 grouped_gemm": (220.0, None)},
             16384: {"default": (5300.0, plain), "prepacked default": (6000.0, pre),
                     "BM128 BN128 prepack2": (5000.0, pre), "dequant+grouped_gemm": (5800.0, None),
                     "bf16 grouped_gemm": (4800.0, None)}}
    rows = [dict(M=M, name=n, method="graph", kind="baseline" if lab is None else "ours",
                 config="" if lab is None else f"cfg{lab}", median_us=t, hbm_bound_us=30.0 if M == 8 else 270.0)
            for M, d in times.items() for n, (t, lab) in d.items()]
    checks = pd.DataFrame([dict(M=8, name="default", ok=True)])
    text = run.summarize(pd.DataFrame(rows), checks, tmp_path)
    got = pd.read_csv(tmp_path / "prepacked_defaults.csv").set_index("M")
    assert list(got.role) == ["held-out", "held-out, large M"]
    assert got.loc[8, "best_prepacked"] == "BM16 BN64 prepack2" and got.loc[8, "regret"] == pytest.approx(60 / 58)
    assert got.loc[16384, "regret"] == pytest.approx(6000 / 5000)
    assert got.loc[16384, "vs_plain_default"] == pytest.approx(5300 / 6000)
    assert got.loc[16384, "vs_bf16_grouped_gemm"] == pytest.approx(4800 / 6000)
    assert "PREPACKED DEFAULTS" in text and "No fitting M" in text
    picks = pd.read_csv(tmp_path / "picks.csv")
    assert picks[(picks.layout == "prepacked") & (picks.M == 16384)].pick.item() == "BM128 BN128 prepack2"
