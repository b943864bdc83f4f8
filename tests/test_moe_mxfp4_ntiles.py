"""MXFP4 down-projection, several column tiles per program (``MoeMxfp4Config.N_TILES``, issue 42).

A program computes N_TILES column tiles of its row block one after the other: the routing's ids,
expert id and routing weights are loaded once, and the loads ahead run on into the next tile, so
its first weights are in flight while the finished tile's epilogue (its atomics) runs.

CPU (Triton's interpreter): each output element gets the same products summed in the same order
as with N_TILES=1, so the deterministic mode gives N_TILES=1's bits, on NaN-poisoned outputs and
workspaces, fresh random inputs per case (plain and prepacked layouts, every LOAD_AHEAD, loads
that cross a tile boundary, a K tail, a4w4); the atomic mode stays within the reference bound
(tests/test_moe_mxfp4.py's: (top_k + 1) * 2**-8 * S + 1e-6, S the sum of the rows' magnitudes).
sm_90 (cross-compiled): fewer SASS instructions per weight, and the next tile's first weight loads
issued before the first tile's atomics. GPU (`gpu`): the same at KIMI-K2.5's shapes, prepared weights.
"""
from __future__ import annotations

import re

import pytest
import torch

from kernels.moe_mxfp4 import (MoeMxfp4Config, moe_mxfp4_down, prepare_routing, prepare_weights, quantize_mxfp4,
                               reference_rows)
from kernels.moe_mxfp4 import launch as mx_launch

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
E, TOP_K = 5, 3


def _problem(M, H, I, *, seed, a_fp4=False):
    g = torch.Generator().manual_seed(4200 + seed)
    w, w_scale = quantize_mxfp4(torch.randn(E, H, I, generator=g) * 0.05)
    a = torch.randn(M * TOP_K, I, generator=g).bfloat16()
    # distinct experts per token, expert 0 gets none (its row blocks exit early)
    ids = torch.stack([torch.randperm(E - 1, generator=g)[:TOP_K] + 1 for _ in range(M)])
    wts = torch.softmax(torch.randn(M, TOP_K, generator=g), -1)
    a_scale = None
    if a_fp4:
        a, a_scale = quantize_mxfp4(a.float())
    return {k: (v.to(DEV) if v is not None else None) for k, v in
            dict(a=a, a_scale=a_scale, w=w, w_scale=w_scale, ids=ids.to(torch.int32), wts=wts).items()}


def _run(p, cfg, weights=None):
    """The kernel into a NaN-poisoned output (and workspace: the deterministic mode's rows)."""
    r = prepare_routing(p["ids"], p["wts"], E, cfg.BLOCK_M)
    args = (weights, r) if weights is not None else (p["w"], p["w_scale"], r)
    moe_mxfp4_down(p["a"], *args, a_scale=p["a_scale"], config=cfg)          # builds the plan
    for plan in mx_launch._PLANS.values():
        if plan.workspace is not None:
            plan.workspace.fill_(float("nan"))
    M, H = p["ids"].shape[0], p["w"].shape[1]
    out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device=DEV)
    return moe_mxfp4_down(p["a"], *args, a_scale=p["a_scale"], config=cfg, out=out)


def _check(out, p):
    rows = reference_rows(p["a"], p["w"], p["w_scale"], p["ids"], p["wts"], a_scale=p["a_scale"])
    ref, mag = rows.sum(1), rows.abs().sum(1)
    bound = (p["ids"].shape[1] + 1) * 2.0 ** -8 * mag + 1e-6
    err = (out.float() - ref).abs()
    assert out.isfinite().all(), "unwritten (poisoned) or non-finite outputs"
    assert (err <= bound).all(), f"max error {err.max().item():.3g}, worst ratio {(err / bound).max().item():.3g}"
    assert ref.abs().max() > 0


_PLAIN = MoeMxfp4Config(BLOCK_M=16, BLOCK_N=32, BLOCK_K=32, num_warps=1)


@pytest.mark.parametrize("nt,la,I_,bk,a_fp4", [
    (2, 0, 96, 32, False),    # 3 steps per tile, the next tile's loads before the epilogue
    (4, 1, 64, 32, False),    # 2 steps per tile: every tile boundary crossed by a load ahead
    (2, 3, 96, 32, True),     # loads 3 steps ahead (into the next tile), a4w4
    (3, 2, 96, 64, False),    # I = 96 in steps of 64: a K tail (the last step masked) in every tile
], ids=["nt2_la0", "nt4_la1", "nt2_la3_a4w4", "nt3_la2_tail"])
def test_n_tiles_gives_one_tiles_bits(nt, la, I_, bk, a_fp4):
    H = 32 * nt * 2 if nt != 3 else 96                 # 2 programs per row block (1 at nt = 3)
    p = _problem(7, H, I_, seed=10 * nt + la, a_fp4=a_fp4)
    one = _PLAIN.replace(LOAD_AHEAD=la, BLOCK_K=bk, DETERMINISTIC=True)
    many = one.replace(N_TILES=nt)
    ref = _run(p, one)
    got = _run(p, many)
    _check(got, p)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    plan = next(v for v in mx_launch._PLANS.values() if v.config == many)
    assert plan.grid[1] == H // 32 // nt
    _check(_run(p, many.replace(DETERMINISTIC=False)), p)           # atomic: within the bound


@pytest.mark.parametrize("level", [2, 3])
def test_n_tiles_prepacked(level):
    """The prepacked default's tile (BM16 BN64 BK128, LOAD_AHEAD=1) with 2 and 4 tiles per program:
    N_TILES=1's bits (deterministic), each tile reading its own prepacked 64-row tiles."""
    H, I_ = 256, 256
    p = _problem(6, H, I_, seed=50 + level)
    weights = prepare_weights(p["w"], p["w_scale"], level)
    one = MoeMxfp4Config(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, PREPACK=level, LOAD_AHEAD=1, DETERMINISTIC=True)
    ref = _run(p, one, weights)
    _check(ref, p)
    for nt in (2, 4):
        got = _run(p, one.replace(N_TILES=nt), weights)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), nt
    _check(_run(p, one.replace(N_TILES=2, DETERMINISTIC=False), weights), p)


def test_n_tiles_validates_and_labels():
    p = _problem(3, 96, 64, seed=1)
    with pytest.raises(ValueError, match=r"N_TILES=2 must divide the 3 column tiles"):
        _run(p, _PLAIN.replace(N_TILES=2))
    with pytest.raises(ValueError, match="N_TILES must be an int in"):
        MoeMxfp4Config(N_TILES=9).validate(512)
    with pytest.raises(ValueError, match="needs UNROLL=True"):
        MoeMxfp4Config(N_TILES=2, UNROLL=False).validate(512)
    with pytest.raises(ValueError, match="N_TILES must be an int in"):
        MoeMxfp4Config(N_TILES=True).validate(512)
    q = _problem(3, 64, 32 * 13, seed=2)                 # 13 steps of 32 per tile: 26 > 24 unrolled
    with pytest.raises(ValueError, match="unrolls 13 K steps per tile, 26 in all"):
        _run(q, _PLAIN.replace(N_TILES=2))
    assert _PLAIN.replace(N_TILES=4).label().endswith("_tiles4")
    assert "_tiles" not in _PLAIN.label()


# ---------------------------------------------------------------------------------------------
# sm_90, cross-compiled: the prepacked default's tile, 1 and 2 column tiles per program
# ---------------------------------------------------------------------------------------------
_CHILD = r"""
import json, sys
from kernels.moe_mxfp4 import MoeMxfp4Config
from kernels.moe_mxfp4.launch import compile_for_target
out = {}
for nt in (1, 2):
    cfg = MoeMxfp4Config(BLOCK_M=16, BLOCK_N=64, PREPACK=2, LOAD_AHEAD=1, N_TILES=nt)
    e = compile_for_target(cfg, cache_dir=sys.argv[1])[0]
    out[nt] = {"sass": e.text("sass"), "registers": e.resources()["registers"]}
print(json.dumps(out))
"""
_OP = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


@pytest.fixture(scope="module")
def sm90(tmp_path_factory):
    import json
    import os
    import subprocess
    import sys

    cache = tmp_path_factory.mktemp("moe_mxfp4_ntiles_sm90")
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(cache)], capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {int(k): dict(v, ops=[m.group(1) for m in map(_OP.search, v["sass"].splitlines()) if m])
            for k, v in json.loads(proc.stdout).items()}


def test_sm90_n_tiles_amortizes_and_overlaps(sm90):
    """Per weight (64 columns x 512 K per tile, 128 threads: 256 weights per thread and tile), two
    tiles per program cost fewer SASS instructions than one (the prologue and routing loads once;
    3.31 -> 3.19 cross-compiled with Triton 3.6), the same expansion and wgmma per tile, and the
    second tile's first weight loads (its step 0, 2 x LDG.E.EF.128 after the first tile's 4 steps)
    are issued before the first tile's bf16x8 reduction."""
    one, two = sm90[1]["ops"], sm90[2]["ops"]
    assert len(two) / 512 < 0.97 * len(one) / 256
    count = lambda ops, p: sum(1 for op in ops if op.startswith(p))
    for p in ("HGMMA", "HMUL2", "LDG.E.EF.128"):
        assert count(two, p) == 2 * count(one, p), p
    assert count(one, "LDG.E.EF.128") == 8 and count(one, "REDG") == 1 and count(two, "REDG") == 2
    first_red = next(i for i, op in enumerate(two) if op.startswith("REDG"))
    assert count(two[:first_red], "LDG.E.EF.128") >= 10


def test_profile_cases_run_the_prepared_layer():
    """experiments/profile_cases.py's MXFP4 cases at M = 4, 12, 64, 256 (and N_TILES=2 at 4 and 64)
    exist, name the down kernel, and their function runs the prepared layer through the launcher
    (here a small layer in the interpreter: the N_TILES=2 config fits the routing it prepares)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "experiments" / "profile_cases.py"
    spec = importlib.util.spec_from_file_location("profile_cases", path)
    cases = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cases)
    names = [f"mxfp4_m{m}" for m in (4, 12, 64, 256)] + ["mxfp4_tiles2_m4", "mxfp4_tiles2_m64"]
    for name in names:
        assert cases.CASES[name][0] == "_moe_mxfp4_down_kernel" and callable(getattr(cases, name))
        assert cases.command(name, "OUT")[-2:] == ["--name", name]
    layer = dict(E=5, H=128, I=128, top_k=3)
    out = {nt: cases._mxfp4_prepared(3, nt, layer=layer, device=DEV) for nt in (1, 2)}
    assert out[1].shape == (3, 128) and out[1].isfinite().all() and out[1].abs().max() > 0
    torch.testing.assert_close(out[2].float(), out[1].float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [4, 64, 256])
def test_gpu_n_tiles_kimi(M):
    """KIMI-K2.5 (385 experts, H 7168, I 512, top-9), weights prepared at level 2, the prepacked default
    config with 2 and 4 column tiles per program (112 tiles of 64): the deterministic mode gives
    N_TILES=1's bits, the atomic mode stays within the bound, on poisoned outputs."""
    g = torch.Generator(device="cuda").manual_seed(420 + M)
    w, w_scale = quantize_mxfp4(torch.randn(385, 7168, 512, device="cuda", generator=g) * 0.02)
    a = torch.randn(M * 9, 512, device="cuda", generator=g).bfloat16()
    ids = torch.rand(M, 385, device="cuda", generator=g).topk(9, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(M, 9, device="cuda", generator=g), -1)
    p = dict(a=a, a_scale=None, w=w, w_scale=w_scale, ids=ids, wts=wts)
    weights = prepare_weights(w, w_scale)
    from kernels.moe_mxfp4 import default_config

    one = default_config(M, 9, 385, 512, prepacked=weights.level).replace(DETERMINISTIC=True)
    r = prepare_routing(ids, wts, 385, one.BLOCK_M)
    ref = moe_mxfp4_down(a, weights, r, config=one)
    for nt in (2, 4):
        cfg = one.replace(N_TILES=nt)
        moe_mxfp4_down(a, weights, r, config=cfg)
        for plan in mx_launch._PLANS.values():
            if plan.workspace is not None:
                plan.workspace.fill_(float("nan"))
        out = torch.full((M, 7168), float("nan"), dtype=torch.bfloat16, device="cuda")
        got = moe_mxfp4_down(a, weights, r, config=cfg, out=out)
        assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), nt
        out = torch.full((M, 7168), float("nan"), dtype=torch.bfloat16, device="cuda")
        _check(moe_mxfp4_down(a, weights, r, config=cfg.replace(DETERMINISTIC=False), out=out), p)


def test_n_tiles_with_split_k():
    """N_TILES=2 with SPLIT_K=2 (atomic: each program adds its half of I for two column tiles): within
    the bound of the split's partial rows (each rounded and added on its own) on poisoned outputs."""
    p = _problem(5, 128, 128, seed=77)
    cfg = _PLAIN.replace(N_TILES=2, SPLIT_K=2, LOAD_AHEAD=1)
    got = _run(p, cfg)
    half = 64
    parts = [reference_rows(p["a"][:, j * half:(j + 1) * half], p["w"][..., j * half // 2:(j + 1) * half // 2],
                            p["w_scale"][..., j * half // 32:(j + 1) * half // 32], p["ids"], p["wts"]) for j in (0, 1)]
    ref, mag = sum(x.sum(1) for x in parts), sum(x.abs().sum(1) for x in parts)
    bound = 2 * (TOP_K + 1) * 2.0 ** -8 * mag + 1e-6
    assert got.isfinite().all() and ((got.float() - ref).abs() <= bound).all()
    plan = next(v for v in mx_launch._PLANS.values() if v.config == cfg)
    assert plan.grid[1:] == (2, 2)
