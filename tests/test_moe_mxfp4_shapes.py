"""MXFP4 down-projection at any shape a checkpoint has (issue 42): prepacked layouts for any H % 8 == 0
and I % 32 == 0 (rows padded to 64 and I to 128 at prepack, the kernel's last K step reading I's
tail), checked against an OCP MX decode written here from the spec (sign, exponent and mantissa bits
of each E2M1 code, 2**(byte - 127) per block; not the package's dequantizer nor its expansion).

CPU (Triton's interpreter): gpt-oss-like tiny shapes (H = 72, I = 96: neither a multiple of the
tile) at every level, bit-identical to the plain layout's kernel with the same tile (level 3: within
a bf16 step of it, its additions run in another order), multi-step tails (unrolled, loads ahead,
looped, SPLIT_K, a4w4, deterministic), the refusal of shapes outside the rule, and the bounds:
all-zero blocks, scale bytes 0 / 127 / 254, an expert with no tokens, a token routed to the same
expert twice. GPU (`gpu`): KIMI-K2.5, gpt-oss-120b and gpt-oss-20b at two M each, the same bounds.

Tolerance (tests/test_moe_mxfp4.py's): per element |out - ref| <= (top_k + 1) * 2**-8 * S + 1e-6,
S = sum_k |w_k y_k| from the reference: the weights are exact after expansion, so the error is the
epilogue's bf16 roundings (each weighted row, each atomic addition).
"""
from __future__ import annotations

import functools

import pytest
import torch

from kernels.moe_mxfp4 import (MoeMxfp4Config, Mxfp4Weights, default_config, moe_mxfp4_down, prepack_mxfp4,
                               prepare_routing, prepare_weights, quantize_mxfp4)
from kernels.moe_mxfp4 import launch as mx_launch
from kernels.moe_mxfp4 import plan as mx_plan

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"


# ---------------------------------------------------------------------------------------------
# the independent decode and the check
# ---------------------------------------------------------------------------------------------
def ocp_decode(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """OCP MX v1.0, from the spec: each byte holds two E2M1 elements (element 2i in the low nibble),
    bits s e1 e0 m: e = 0 is subnormal, (-1)^s * 2^0 * (m / 2); else (-1)^s * 2^(e - 1) * (1 + m / 2).
    The block's E8M0 scale byte X is 2^(X - 127), 0xFF NaN. Float64 [..., 2 * packed.shape[-1]]."""
    p = packed.to(torch.int64)
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(*p.shape[:-1], 2 * p.shape[-1])
    sign = 1.0 - 2.0 * ((codes >> 3) & 1).double()
    e = (codes >> 1) & 3
    m = (codes & 1).double()
    mag = torch.where(e == 0, m / 2, torch.ldexp(1.0 + m / 2, (e - 1).double()))
    x = scales.to(torch.int64).repeat_interleave(32, dim=-1)
    block = torch.where(x == 255, float("nan"), torch.ldexp(torch.ones_like(mag), (x - 127).double()))
    return sign * mag * block


def reference(a, a_scale, w, w_scale, ids, wts, *, parts: int = 1):
    """(sum over slots, sum of magnitudes) in float64 from the independent decode, one routed
    expert at a time. parts (SPLIT_K): the magnitudes of that many K slices summed (each program's
    partial row is rounded and added on its own; cancelling halves can exceed the whole row)."""
    x = ocp_decode(a, a_scale) if a_scale is not None else a.double()
    M, top_k = ids.shape
    flat = ids.reshape(-1).long()
    K = x.shape[1]
    per = -(-(-(-K // 128)) // parts) * 128                 # each program's K steps of 128 (cdiv)
    cut = [min(K, j * per) for j in range(parts + 1)]
    y = torch.zeros(parts, M * top_k, w.shape[1], dtype=torch.float64, device=a.device)
    for e in torch.unique(flat).tolist():
        sel = (flat == e).nonzero().squeeze(1)
        We = ocp_decode(w[e], w_scale[e])
        for j in range(parts):
            y[j, sel] = x[sel, cut[j]:cut[j + 1]] @ We[:, cut[j]:cut[j + 1]].T
    y = (y * wts.reshape(1, -1, 1).double()).view(parts, M, top_k, -1)
    return y.sum((0, 2)), y.abs().sum((0, 2))


def check(out, ref, top_k, *, slack: float = 1.0):
    """Within the bound, nothing unwritten (outputs are poisoned with NaN before a run)."""
    total, mag = ref
    err = (out.double() - total).abs()
    bound = slack * (top_k + 1) * 2.0 ** -8 * mag + 1e-6
    assert out.isfinite().all(), "unwritten (poisoned) or non-finite outputs"
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, worst ratio {(err / bound).max().item():.3g}"
    assert total.abs().max() > 0


def same_as_plain(got, plain, level):
    """Levels 1-2: the plain layout's bits; level 3 (K halves, another order of the fp32 additions):
    the same NaN and infinities, finite values within one bf16 step of the row's largest."""
    got, plain = got.float(), plain.float()
    assert torch.equal(got.isnan(), plain.isnan()) and torch.equal(got.isinf(), plain.isinf())
    if level < 3:
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(plain))
        return
    fin = got.isfinite()
    scale = torch.where(fin, plain, 0).abs().amax(dim=-1, keepdim=True).expand_as(got)[fin]
    assert ((got[fin] - plain[fin]).abs() <= 2.0 ** -7 * scale).all()


def _poison_workspaces():
    for plan in mx_launch._PLANS.values():
        if plan.workspace is not None:
            plan.workspace.fill_(float("nan"))


# ---------------------------------------------------------------------------------------------
# CPU problems (interpreter)
# ---------------------------------------------------------------------------------------------
TOP_K = 3


def problem(M, E, H, I, *, seed=0, a_fp4=False, device=DEV, empty=None):
    """Random weights (quantized), activations and distinct top-3 routing; expert ``empty`` gets none."""
    g = torch.Generator().manual_seed(1000 + seed)
    w, ws = quantize_mxfp4(torch.randn(E, H, I, generator=g) * 0.05)
    a = torch.randn(M * TOP_K, I, generator=g).bfloat16()
    experts = torch.tensor([e for e in range(E) if e != empty])
    ids = torch.stack([experts[torch.randperm(len(experts), generator=g)[:TOP_K]] for _ in range(M)]).int()
    wts = torch.rand(M, TOP_K, generator=g) + 0.1
    a_scale = None
    if a_fp4:
        a, a_scale = quantize_mxfp4(a.float())
        a_scale = a_scale.to(device)
    return dict(a=a.to(device), a_scale=a_scale, w=w.to(device), ws=ws.to(device), ids=ids.to(device),
                wts=wts.to(device))


def run(p, weights, cfg, **kw):
    r = prepare_routing(p["ids"], p["wts"], weights.num_experts, cfg.BLOCK_M if cfg else 16)
    out = torch.full((p["ids"].shape[0], weights.H), float("nan"), dtype=torch.bfloat16, device=DEV)
    return moe_mxfp4_down(p["a"], weights, r, a_scale=p["a_scale"], config=cfg, out=out, **kw)


def run_plain(p, cfg):
    r = prepare_routing(p["ids"], p["wts"], p["w"].shape[0], cfg.BLOCK_M)
    return moe_mxfp4_down(p["a"], p["w"], p["ws"], r, a_scale=p["a_scale"], config=cfg.replace(PREPACK=0))


@pytest.mark.parametrize("level", [1, 2, 3])
def test_gpt_oss_like_shape_every_level_equals_plain(level):
    """H = 72, I = 96 (gpt-oss' H = I = 2880 are not multiples of 64 and 128 either): prepared
    weights padded to 128 x 128, the default path (no config: the prepacked default tile, BM16 BN64
    BK128 LOAD_AHEAD 1, its one K step I's tail) within the bound of the independent decode and
    the plain layout's bits with the same tile; the deterministic mode too; the padding is gone
    from weights.plain()."""
    p = problem(5, 6, 72, 96, seed=level, empty=2)
    weights = prepare_weights(p["w"], p["ws"], level)
    assert weights.shape == (72, 96) and tuple(weights.w.shape) == (6, 128, 64) and weights.padded
    assert all(torch.equal(x, y) for x, y in zip(weights.plain(), (p["w"], p["ws"])))
    ref = reference(p["a"], None, p["w"], p["ws"], p["ids"], p["wts"])
    got = run(p, weights, None)
    check(got, ref, TOP_K)
    cfg = default_config(5, TOP_K, 6, 96, prepacked=level)
    assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K, cfg.PREPACK) == (16, 64, 128, level)
    same_as_plain(got, run_plain(p, cfg), level)
    det = cfg.replace(DETERMINISTIC=True)
    run(p, weights, det)
    _poison_workspaces()
    got = run(p, weights, det)
    check(got, ref, TOP_K)
    same_as_plain(got, run_plain(p, det), level)


@pytest.mark.parametrize("case", [
    dict(H=136, I=288, level=2, cfg=dict(LOAD_AHEAD=1)),          # 3 steps, the tail loaded ahead
    dict(H=136, I=288, level=3, cfg=dict(LOAD_AHEAD=2)),
    dict(H=64, I=160, level=1, cfg=dict()),                       # 2 steps, a 32-wide tail
    dict(H=80, I=480, level=2, cfg=dict(SPLIT_K=2)),              # 4 steps in two programs
    dict(H=72, I=224, level=2, cfg=dict(), a_fp4=True, det=True),
    dict(H=72, I=224, level=3, cfg=dict(), a_fp4=True),
    dict(H=72, I=224, level=1, cfg=dict(BLOCK_N=128)),
    # ragged SPLIT_K (the parts' cdiv(steps, SPLIT_K) steps overrun I in the last part)
    dict(H=80, I=288, level=2, cfg=dict(SPLIT_K=2)),              # 3 steps: 2 + (tail, past I)
    dict(H=80, I=288, level=3, cfg=dict(SPLIT_K=2, LOAD_AHEAD=1)),
    dict(H=72, I=640, level=2, cfg=dict(SPLIT_K=3, LOAD_AHEAD=2)),  # 5 whole steps: 2 + 2 + (1, past I)
    dict(H=72, I=864, level=0, cfg=dict(SPLIT_K=4, LOAD_AHEAD=1)),  # 7 steps, plain: 2+2+2+(tail, past I)
    dict(H=72, I=352, level=2, cfg=dict(SPLIT_K=2), a_fp4=True),   # a4w4: 2 + (tail, past I)
    dict(H=72, I=2880, level=2, cfg=dict(SPLIT_K=8, LOAD_AHEAD=1)),  # gpt-oss' I: 23 steps, 3 per part
], ids=["l2_3steps_la1", "l3_3steps_la2", "l1_tail32", "l2_splitk2", "l2_a4w4_det", "l3_a4w4", "l1_bn128",
        "l2_ragged_sk2", "l3_ragged_sk2_la1", "l2_ragged_sk3_la2_notail", "l0_ragged_sk4_la1", "l2_ragged_a4w4",
        "l2_gpt_oss_i_sk8"])
def test_k_tails_equal_plain(case):
    """I's tail in the last step, every way the kernel reaches it, and a ragged SPLIT_K's steps past
    I: within the bound of the independent decode and the plain layout's kernel with the same tile
    (the plain layout masks the same tail, the prepacked one reads the zeros prepack_mxfp4 stored
    and predicates off its loads past them)."""
    level, a_fp4, det = case["level"], case.get("a_fp4", False), case.get("det", False)
    p = problem(5, 6, case["H"], case["I"], seed=case["I"] + level, a_fp4=a_fp4)
    weights = prepare_weights(p["w"], p["ws"], level)
    cfg = MoeMxfp4Config(**{**dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, PREPACK=level, DETERMINISTIC=det),
                            **case["cfg"]})
    got = run(p, weights, cfg)
    split = cfg.SPLIT_K
    check(got, reference(p["a"], p["a_scale"], p["w"], p["ws"], p["ids"], p["wts"], parts=split), TOP_K,
          slack=float(split))
    same_as_plain(got, run_plain(p, cfg), level)


@pytest.mark.parametrize("level,I,split", [(0, 288, 1), (2, 288, 1), (3, 288, 1), (0, 864, 2), (2, 864, 2)],
                         ids=["l0_tail", "l2_tail", "l3_tail", "l0_ragged_sk2", "l2_ragged_sk2"])
def test_k_tail_in_the_looped_reduction(monkeypatch, level, I, split):
    """More steps than the kernel unrolls (MAX_UNROLLED_STEPS lowered to 1: as Mixtral's 112 steps run
    as a loop): the tail step is peeled off the loop, the same bits as the unrolled steps. With a
    ragged SPLIT_K (7 steps, I's tail in the last, in parts of 4) the second part's third step holds
    the tail and its fourth lies past I, both peeled off (two parts: their atomic sum does not depend
    on the order), within the bound of the two parts."""
    p = problem(5, 6, 72, I, seed=40 + level + 10 * split)
    cfg = MoeMxfp4Config(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, PREPACK=level, SPLIT_K=split,
                         DETERMINISTIC=split == 1)
    weights = prepare_weights(p["w"], p["ws"], level)
    unrolled = run(p, weights, cfg).clone()
    mx_launch.clear_plans()
    monkeypatch.setattr(mx_plan, "MAX_UNROLLED_STEPS", 1)
    looped = run(p, weights, cfg)
    assert next(iter(mx_launch._PLANS.values())).constexprs["MAX_UNROLL"] == 1
    mx_launch.clear_plans()
    assert torch.equal(looped, unrolled)
    check(looped, reference(p["a"], None, p["w"], p["ws"], p["ids"], p["wts"], parts=split), TOP_K,
          slack=float(split))


@pytest.mark.parametrize("level,H,bn", [(1, 136, 128), (2, 136, 128), (3, 136, 128), (2, 72, 256), (2, 2880, 128)],
                         ids=["l1_h136_bn128", "l2_h136_bn128", "l3_h136_bn128", "l2_h72_bn256", "l2_h2880_bn128"])
def test_column_tiles_wider_than_the_stored_rows(level, H, bn):
    """A BLOCK_N that does not divide the prepacked rows (H rounded up to 64: 136 -> 192, 72 -> 128,
    gpt-oss' 2880) runs: the plain layout's bits with the same tile, within the bound of the
    independent decode. (The kernel masks off the last column tile's 64-row blocks past the stored
    rows so that it reads nothing past the expert; values cannot show that mask, since those rows
    only feed output columns past H, which are not stored.)"""
    p = problem(5, 6, H, 160, seed=H + level + bn)
    weights = prepare_weights(p["w"], p["ws"], level)
    assert weights.w.shape[1] % bn
    cfg = MoeMxfp4Config(BLOCK_M=16, BLOCK_N=bn, BLOCK_K=128, PREPACK=level, DETERMINISTIC=True)
    got = run(p, weights, cfg)
    check(got, reference(p["a"], None, p["w"], p["ws"], p["ids"], p["wts"]), TOP_K)
    same_as_plain(got, run_plain(p, cfg), level)


def test_shapes_outside_the_rule_are_refused():
    """H % 8 != 0 (I % 32 != 0 cannot even be quantized): a ValueError naming the rule, and what
    else would silently read the wrong bytes is refused too: padded tensors wrapped without their
    logical shape, a BLOCK_K that does not divide the padded I, a SPLIT_K that leaves a part no
    step."""
    g = torch.Generator().manual_seed(5)
    w, ws = quantize_mxfp4(torch.randn(2, 100, 96, generator=g))
    for level in (1, 2, 3):
        with pytest.raises(ValueError, match=r"need H % 8 == 0 and I % 32 == 0, got H=100, I=96; level=0 keeps"):
            prepare_weights(w, ws, level)
    with pytest.raises(ValueError, match=r"H % 8 == 0 and I % 32 == 0, got H=100"):
        prepack_mxfp4(w, ws, 2)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.randn(2, 8, 100))
    assert prepare_weights(w, ws, 0).level == 0                      # the plain layout takes any shape

    p = problem(3, 4, 72, 96, seed=7)
    weights = prepare_weights(p["w"], p["ws"], 2)
    with pytest.raises(ValueError, match=r"are prepacked as \[E, 192, 64\].*pass shape=\(H, I\)"):
        Mxfp4Weights(weights.w, weights.w_scale, 2, shape=(136, 96))
    bare = Mxfp4Weights(weights.w, weights.w_scale, 2)               # read as H = 128, I = 128: says so
    r = prepare_routing(p["ids"], p["wts"], 4, 16)
    with pytest.raises(ValueError, match=r"a must be bf16 \[M \* top_k, I\] = \(9, 128\).*shape=\(H, I\)"):
        moe_mxfp4_down(p["a"], bare, r)
    with pytest.raises(ValueError, match="plain weights .* are not padded"):
        Mxfp4Weights(p["w"], p["ws"], 0, shape=(64, 96))
    big = problem(3, 4, 72, 288, seed=8)
    wb = prepare_weights(big["w"], big["ws"], 2)
    rb = prepare_routing(big["ids"], big["wts"], 4, 16)
    with pytest.raises(ValueError, match="BLOCK_K=256 does not divide them: use BLOCK_K=128"):
        moe_mxfp4_down(big["a"], wb, rb, config=MoeMxfp4Config(BLOCK_N=64, BLOCK_K=256, PREPACK=2))
    with pytest.raises(ValueError, match=r"cdiv\(I=288, BLOCK_K=128\) = 3 K steps, 1 each, leave the last part none"):
        moe_mxfp4_down(big["a"], wb, rb, config=MoeMxfp4Config(BLOCK_N=64, PREPACK=2, SPLIT_K=4))
    w3, ws3 = quantize_mxfp4(torch.randn(4, 200, 96, generator=g) * 0.05)       # 200 rows -> 256: BN128 fits
    assert tuple(prepare_weights(w3, ws3, 2).w.shape) == (4, 256, 64)



# ---------------------------------------------------------------------------------------------
# the bounds: all-zero blocks, scale bytes 0 / 127 / 254, an empty expert, a duplicate expert
# ---------------------------------------------------------------------------------------------
def bounds_problem(M, E, H, I, top_k, *, device, seed=0, subnormal_codes=True):
    """Weights built from codes and scale bytes (not quantized), I = 96 or more, by K block:
    block 0 scale byte 0 (2**-127: values down to 2**-128, bf16 subnormals); block 1 scale byte
    254 (2**127) with magnitudes up to 1.5 (finite in bf16); their activation columns scaled so the
    products matter (_scale_bound_columns); the other blocks scale byte 127, and every (expert, row)
    with h % 5 == 0 all-zero codes in block 2 (some with the sign bit: -0). The last expert gets no
    token; token 0 goes to expert 1 twice. subnormal_codes=False leaves the scale-0 block without
    the codes whose value is a bf16 subnormal there (0.5, 1, 1.5: the interpreter's fp32 -> bf16
    cast flushes them; the GPU's does not)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (E, H, I), generator=g)
    if not subnormal_codes:
        big = torch.tensor([0, 4, 5, 6, 7, 8, 12, 13, 14, 15])              # 0, 2, 3, 4, 6 and their negatives
        codes[:, :, :32] = big[torch.randint(0, len(big), (E, H, 32), generator=g)]
    small = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11])                         # |value| <= 1.5
    codes[:, :, 32:64] = small[torch.randint(0, 8, (E, H, 32), generator=g)]
    codes[:, ::5, 64:96] = torch.randint(0, 2, (E, len(range(0, H, 5)), 32), generator=g) * 8   # +0 / -0
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    scales = torch.full((E, H, I // 32), 127, dtype=torch.uint8)
    scales[:, :, 0], scales[:, :, 1] = 0, 254
    a = _scale_bound_columns(torch.randn(M * top_k, I, generator=g), torch.ones(M * top_k, dtype=torch.bool))
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:top_k] for _ in range(M)])
    ids[0] = torch.tensor([1, 1, 2, 3][:top_k])
    wts = torch.rand(M, top_k, generator=g) + 0.1
    return dict(a=a.bfloat16().to(device), a_scale=None, w=packed.to(device), ws=scales.to(device),
                ids=ids.int().to(device), wts=wts.to(device))


def _scale_bound_columns(a: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """The activation columns that meet the bound blocks, in the given rows: block 0's (scale byte 0)
    times 2**120, block 1's (scale byte 254) at least 0.5 in magnitude, times 2**-124 (bf16 normals:
    the weights' subnormals are what is tested, not the activations')."""
    a = a.clone()
    a[rows, :32] *= 2.0 ** 120
    b1 = a[rows, 32:64]
    a[rows, 32:64] = b1.abs().clamp(min=0.5).copysign(b1) * 2.0 ** -124
    return a


def _bounds_problem_is_what_it_says(p, E):
    d = ocp_decode(p["w"].cpu(), p["ws"].cpu())
    assert d.isfinite().all() and (d[:, :, 64:96][:, ::5] == 0).all()
    assert d[:, :, 32:64].abs().max() == 1.5 * 2.0 ** 127
    assert (p["ids"] == E - 1).sum() == 0 and int((p["ids"][0] == 1).sum()) == 2


@pytest.mark.parametrize("level", [0, 1, 2, 3])
def test_bounds_against_the_independent_decode(level):
    """The bounds at H = 72, I = 96 (the gpt-oss-like shape), every layout, atomic and
    deterministic, on poisoned outputs: within the bound of the independent decode; prepacked
    levels 1-2 the plain layout's bits, level 3 within a step."""
    E = 5
    p = bounds_problem(6, E, 72, 96, TOP_K, device=DEV, seed=level, subnormal_codes=ON_GPU)
    _bounds_problem_is_what_it_says(p, E)
    ref = reference(p["a"], None, p["w"], p["ws"], p["ids"], p["wts"])
    weights = prepare_weights(p["w"], p["ws"], level)
    assert weights.max_scale == 254 and not weights.one_mul               # two multiplies (byte 254)
    for det in (False, True):
        cfg = default_config(6, TOP_K, E, 96, prepacked=level, interpreter=not ON_GPU, deterministic=det)
        run(p, weights, cfg)
        _poison_workspaces()
        got = run(p, weights, cfg)
        check(got, ref, TOP_K)
        if level:
            same_as_plain(got, run_plain(p, cfg), level)


# ---------------------------------------------------------------------------------------------
# GPU: the three configurations at two M each
# ---------------------------------------------------------------------------------------------
CONFIGS = {"kimi-k2.5": dict(E=385, H=7168, I=512, top_k=9, M=(12, 100)),
           "gpt-oss-120b": dict(E=128, H=2880, I=2880, top_k=4, M=(3, 200)),
           "gpt-oss-20b": dict(E=32, H=2880, I=2880, top_k=4, M=(1, 48))}


@functools.lru_cache(maxsize=1)
def _gpu_layer(name):
    """One layer's weights, quantized from N(0, 0.02) on the GPU, and a copy with the bounds written
    into experts 0-7 (bounds_problem's first three K blocks: scale bytes 0 and 254, all-zero codes in
    every fifth row); the quantized ones prepared at level 2 (the default), the bounded at 2 and 3."""
    c = CONFIGS[name]
    E, H, I = c["E"], c["H"], c["I"]
    g = torch.Generator(device="cuda").manual_seed(42)
    w = torch.empty(E, H, I // 2, dtype=torch.uint8, device="cuda")
    ws = torch.empty(E, H, I // 32, dtype=torch.uint8, device="cuda")
    for e0 in range(0, E, 16):
        e1 = min(E, e0 + 16)
        w[e0:e1], ws[e0:e1] = quantize_mxfp4(torch.randn(e1 - e0, H, I, device="cuda", generator=g) * 0.02)
    b = bounds_problem(1, 8, H, 96, 1, device="cuda", seed=3)
    wb, wsb = w.clone(), ws.clone()
    wb[:8, :, :48], wsb[:8, :, :3] = b["w"], b["ws"]
    return {"quantized": (w, ws, {2: prepare_weights(w, ws, 2)}),
            "bounds": (wb, wsb, {lvl: prepare_weights(wb, wsb, lvl) for lvl in (2, 3)})}


@pytest.mark.gpu
@pytest.mark.parametrize("name,M", [(n, m) for n, c in CONFIGS.items() for m in c["M"]])
def test_gpu_three_configs_against_the_independent_decode(name, M):
    """Each configuration at two M, tokens routed at random to distinct experts, except token 0
    (expert 1 twice and expert 0) and the last expert, which gets none. Two weight sets: quantized
    (every scale byte <= 128: the one-multiply expansion) and with the bounds in experts 0-7 (whose
    pairs' activation columns of blocks 0 and 1 are scaled as in bounds_problem). Scale byte 0
    with codes 0.5-1.5 makes bf16 subnormal weights: this checks that wgmma keeps them. The default path (prepared weights, no config; level 2, and 3 for the bounds),
    and the plain layout's default, on NaN-poisoned outputs, within the bound of the independent
    decode (float64; where the default path splits K, with the parts' magnitudes); level 2's
    deterministic mode bit-identical to the plain layout's kernel with the same tile; on gpt-oss'
    23 K steps, ragged splits of 3, 4 and 8 (the last part's steps past I predicated off) within
    the bound of their parts, and 128-column tiles over its 2880 rows (the last tile's second 64-row
    block, past the stored rows, masked off)."""
    c = CONFIGS[name]
    E, H, I, top_k = c["E"], c["H"], c["I"], c["top_k"]
    split = default_config(M, top_k, E, I, prepacked=2, H=H, sms=mx_plan.sms(torch.device("cuda"))).SPLIT_K
    g = torch.Generator(device="cuda").manual_seed(M)
    ids = torch.rand(M, E - 1, device="cuda", generator=g).topk(top_k, dim=1).indices
    ids[0, :3] = torch.tensor([1, 1, 0], device="cuda")
    ids = ids.int()
    wts = torch.softmax(torch.randn(M, top_k, device="cuda", generator=g), -1)
    a0 = torch.randn(M * top_k, I, device="cuda", generator=g)
    for kind, (w, ws, prepared) in _gpu_layer(name).items():
        a = (_scale_bound_columns(a0, ids.reshape(-1) < 8) if kind == "bounds" else a0).bfloat16()
        refs = {n: reference(a, None, w, ws, ids, wts, parts=n) for n in {1, split}}

        def ok(out, what, parts=1):
            total, mag = refs[parts] if parts in refs else reference(a, None, w, ws, ids, wts, parts=parts)
            bound = parts * (top_k + 1) * 2.0 ** -8 * mag + 1e-6
            err = (out.double() - total).abs()
            assert out.isfinite().all(), f"{name} M={M} {kind} {what}: unwritten or non-finite outputs"
            assert (err <= bound).all(), f"{name} M={M} {kind} {what}: worst ratio {(err / bound).max().item():.3g}"

        for level, weights in prepared.items():
            assert weights.shape == (H, I) and weights.one_mul == (kind == "quantized")
            out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda")
            ok(moe_mxfp4_down(a, weights, (ids, wts), out=out), f"level {level} default", split)
        if I % 128:
            cold = default_config(M, top_k, E, I, prepacked=2, H=H)
            r = prepare_routing(ids, wts, E, cold.BLOCK_M)
            for parts in (3, 4, 8):
                out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda")
                got = moe_mxfp4_down(a, prepared[2], r, config=cold.replace(SPLIT_K=parts), out=out)
                ok(got, f"level 2 SPLIT_K={parts}", parts)
            out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda")     # 2880 rows at BN128
            ok(moe_mxfp4_down(a, prepared[2], r, config=cold.replace(BLOCK_N=128), out=out), "level 2 BLOCK_N=128")
        cfg = default_config(M, top_k, E, I)
        r = prepare_routing(ids, wts, E, cfg.BLOCK_M)
        out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device="cuda")
        ok(moe_mxfp4_down(a, w, ws, r, config=cfg, out=out), "plain default")
        det = default_config(M, top_k, E, I, prepacked=2, deterministic=True)
        r = prepare_routing(ids, wts, E, det.BLOCK_M)
        got = moe_mxfp4_down(a, prepared[2], r, config=det)
        ok(got, "level 2 deterministic")
        assert torch.equal(got, moe_mxfp4_down(a, w, ws, r, config=det.replace(PREPACK=0)))
