"""kernels.gemm: interpreter correctness (CPU), validation, heuristic, sm_90
cross-compilation, and GPU correctness (marked gpu)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kernels import gemm
from kernels.gemm import cold as gcold, config as gconfig, gluon as ggluon, launch as glaunch, sweep as gsweep

ROOT = Path(__file__).resolve().parents[1]

SMALL = dict(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2)
TINY = dict(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1)
SPLIT = dict(block_m=16, block_n=64, block_k=32, num_warps=4, num_stages=2, split_k=1)
FMA = dict(block_m=4, block_n=32, block_k=8, num_warps=1, num_stages=1, fma=True)
# (name, M, N, K, dtype, config)
CASES = [
    ("6x42x123-fp16-tiny", 6, 42, 123, "float16", TINY),
    ("6x42x123-fp32-tiny", 6, 42, 123, "float32", TINY),
    ("6x42x123-bf16-tiny", 6, 42, 123, "bfloat16", TINY),
    ("1x7x64-fp16", 1, 7, 64, "float16", TINY),
    ("1x7x64-fp32", 1, 7, 64, "float32", SMALL),
    ("1x7x64-bf16", 1, 7, 64, "bfloat16", SMALL),
    ("130x257x96-fp16", 130, 257, 96, "float16", SMALL),
    ("130x257x96-fp32", 130, 257, 96, "float32", SMALL),
    ("130x257x96-bf16", 130, 257, 96, "bfloat16", SMALL),
    ("130x257x96-fp16-persistent", 130, 257, 96, "float16", dict(SMALL, num_sms=3, group_m=3)),
    ("130x257x96-fp16-default-config", 130, 257, 96, "float16", None),
    # TMA descriptor path (aligned rows), also runnable in the interpreter.
    ("130x264x96-bf16-tma", 130, 264, 96, "bfloat16", dict(SMALL, tma=True)),
    ("130x264x96-fp16-tma-split", 130, 264, 96, "float16", dict(SMALL, tma=True, epilogue_split=2)),
    ("130x264x96-bf16-tma-ws", 130, 264, 96, "bfloat16",
     dict(SMALL, tma=True, warp_specialize=True, tma_store=False, flatten=False)),
    ("6x48x40-fp32-tma", 6, 48, 40, "float32", dict(TINY, tma=True, num_sms=2)),
    # Stream-K tail (TMA path): 45 tiles on 4 programs leave 1 tile split 4 ways; on 7
    # programs 3 tiles whose K-steps straddle programs (3 contributors); 4 tiles on 8
    # programs, no whole round. The cases share the arrival counters, so a counter
    # left unreset by one case would break the next.
    ("130x264x256-bf16-tma-sk4", 130, 264, 256, "bfloat16",
     dict(SMALL, tma=True, stream_k=True, num_sms=4, tma_store=False)),
    ("130x264x256-fp16-tma-sk7-split", 130, 264, 256, "float16",
     dict(SMALL, tma=True, stream_k=True, num_sms=7, epilogue_split=2)),
    ("64x64x512-fp32-tma-sk8", 64, 64, 512, "float32", dict(SMALL, tma=True, stream_k=True, num_sms=8)),
    ("130x264x256-bf16-tma-sk7-again", 130, 264, 256, "bfloat16",
     dict(SMALL, tma=True, stream_k=True, num_sms=7, group_m=2)),
    # Split-K kernel (pieces of K meeting in the fp32 workspace), swapped (C^T = B^T A^T) or
    # not, pointer loads (unaligned rows) and TMA; the cases share the arrival counters too.
    ("1x7x64-fp16-swap", 1, 7, 64, "float16", dict(SPLIT, swap_ab=True, split_k=2)),
    ("1x7x64-fp32-narrow", 1, 7, 64, "float32", dict(SPLIT, block_n=32, split_k=2)),
    ("1x7x64-bf16-swap-k1", 1, 7, 64, "bfloat16", dict(SPLIT, swap_ab=True)),
    ("3x4097x96-bf16-swap", 3, 4097, 96, "bfloat16", dict(SPLIT, block_n=256, swap_ab=True, split_k=3)),
    ("3x4097x96-fp32-narrow", 3, 4097, 96, "float32", dict(SPLIT, block_n=256, split_k=2)),
    ("130x257x96-fp16-split", 130, 257, 96, "float16", dict(SPLIT, block_m=32, block_n=64, split_k=3)),
    ("130x257x96-fp32-swap", 130, 257, 96, "float32", dict(SPLIT, block_m=32, swap_ab=True, split_k=2)),
    # 13 row blocks in bands of 8 and 5 (the tiles' order, _tile_coords), each tile in 2 pieces
    ("200x70x64-bf16-split-bands", 200, 70, 64, "bfloat16", dict(SPLIT, split_k=2)),
    ("17x33x8200-bf16-swap", 17, 33, 8200, "bfloat16", dict(SPLIT, block_k=128, swap_ab=True, split_k=16)),
    ("17x33x8200-fp16-narrow", 17, 33, 8200, "float16", dict(SPLIT, block_k=128, split_k=7)),
    ("17x40x8200-fp32-swap-tma", 17, 40, 8200, "float32", dict(SPLIT, block_k=128, swap_ab=True, split_k=9,
                                                               tma=True)),
    ("17x40x8200-bf16-split-tma", 17, 40, 8200, "bfloat16", dict(SPLIT, block_k=128, split_k=5, tma=True)),
    # pad=True: unaligned A (K odd) and/or B (N odd) copied into aligned buffers, then TMA
    ("17x33x8200-bf16-swap-pad", 17, 33, 8200, "bfloat16", dict(SPLIT, block_k=128, swap_ab=True, split_k=8,
                                                               tma=True, pad=True)),
    ("130x257x96-fp16-pad", 130, 257, 96, "float16", dict(SMALL, tma=True, tma_store=False, pad=True)),
    ("3x4097x95-fp32-pad", 3, 4097, 95, "float32", dict(SPLIT, block_n=256, split_k=2, tma=True, pad=True)),
    ("70x64x123-bf16-pad-sk", 70, 64, 123, "bfloat16",
     dict(SMALL, tma=True, tma_store=False, stream_k=True, num_sms=3, pad=True)),
    # Tail split (TMA path): the last, partial round's tiles in column slices, one per program
    # (the tail tiles are whole columns of tiles here, so a slice written twice or not at all
    # shows). 40 tiles on 9 programs: 4 in the last round, 2 slices each; 20 tiles on 9
    # programs, B K-major: 2 left, 4 slices; 24 on 7, fp32 (B copied K-major): 3 left, 2
    # slices; 4 tiles on 8 programs, the only round, 2 slices each.
    ("130x256x96-bf16-tma-ts2", 130, 256, 96, "bfloat16", dict(SMALL, tma=True, tail_split=2, num_sms=9)),
    ("130x256x96-fp16-tma-ts4-bT", 130, 256, 96, "float16",
     dict(SMALL, block_n=64, tma=True, tail_split=4, num_sms=9, _b="t")),
    ("70x256x96-fp32-tma-ts2", 70, 256, 96, "float32", dict(SMALL, tma=True, tail_split=2, num_sms=7)),
    ("40x96x64-bf16-tma-ts4-one-round", 40, 96, 64, "bfloat16",
     dict(SMALL, block_n=64, tma=True, tail_split=4, num_sms=8, tma_store=False)),
    # Tiles block_n + extra_n wide (two MMAs per K-step on one A tile, the extra columns
    # through a second descriptor of B): the last column of tiles has its extra part cut by
    # N (136 = 2 x 48 + 32 + 8, 88 = 48 + 32 + 8), or only part of its main part (100 = 64 + 36); row edges
    # too; host and device descriptors; C through plain and descriptor stores; B K-major.
    ("130x136x96-bf16-tma-wide", 130, 136, 96, "bfloat16", dict(SMALL, tma=True, extra_n=16, num_sms=4)),
    ("70x100x80-fp16-tma-wide-bT", 70, 100, 80, "float16",
     dict(SMALL, tma=True, extra_n=32, tma_store=False, num_sms=3, _b="t")),
    ("70x88x64-fp32-tma-wide", 70, 88, 64, "float32", dict(SMALL, tma=True, extra_n=16, num_sms=5)),
    # B as a transposed view (K-major, x @ w.t() with an nn.Linear weight w (N, K)): read
    # through a descriptor over w; fp32 row-major B copied K-major first (transpose_b).
    ("130x264x96-bf16-tma-bT", 130, 264, 96, "bfloat16", dict(SMALL, tma=True, _b="t")),
    ("130x264x256-fp16-tma-sk7-bT", 130, 264, 256, "float16",
     dict(SMALL, tma=True, stream_k=True, num_sms=7, tma_store=False, _b="t")),
    ("17x40x8200-bf16-split-tma-bT", 17, 40, 8200, "bfloat16", dict(SPLIT, block_k=128, split_k=5, tma=True,
                                                                   _b="t")),
    ("17x72x8200-fp16-swap-tma-bT", 17, 72, 8200, "float16", dict(SPLIT, block_k=128, swap_ab=True, split_k=4,
                                                                 tma=True, _b="t")),
    ("130x264x96-fp32-tma-bT", 130, 264, 96, "float32", dict(SMALL, tma=True, _b="t")),
    ("130x264x96-fp32-tma-transpose-b", 130, 264, 96, "float32", dict(SMALL, tma=True)),
    ("70x264x200-fp32-tma-sk-transpose-b", 70, 264, 200, "float32",
     dict(SMALL, tma=True, stream_k=True, num_sms=5, epilogue_split=2)),
    ("130x264x95-bf16-bT-unaligned-pad", 130, 264, 95, "bfloat16", dict(SMALL, tma=True, tma_store=False, pad=True,
                                                                       _b="t")),
    ("130x257x96-fp16-bT-ptr", 130, 257, 96, "float16", dict(SMALL, _b="t")),
    # Padded operands at the edges: one row of C (M = 1), one column (N = 1: B's and C's rows one
    # element), one element; C's rows alone unaligned (B a transposed view with K aligned); tail
    # slices on padded operands (45 tiles on 4 programs leave a partial last round).
    ("1x33x95-bf16-pad-one-row", 1, 33, 95, "bfloat16", dict(SMALL, tma=True, tma_store=False, pad=True)),
    ("70x1x95-fp16-pad-one-column", 70, 1, 95, "float16", dict(SMALL, tma=True, tma_store=False, pad=True)),
    ("1x1x41-bf16-pad-one-element", 1, 1, 41, "bfloat16", dict(SMALL, tma=True, tma_store=False, pad=True)),
    ("70x1x96-fp16-bT-one-column", 70, 1, 96, "float16", dict(SMALL, tma=True, tma_store=False, pad=True,
                                                              _b="t")),
    ("130x257x95-bf16-pad-tail-slices", 130, 257, 95, "bfloat16",
     dict(SMALL, tma=True, tma_store=False, pad=True, num_sms=4, tail_split=2)),
    # fp32 FMA kernel (fma=True): outer products per row of B (block_m < 16) or tl.dot in ieee
    # precision (block_m >= 16); K pieces meet in the split-K workspace; B row-major or K-major.
    ("1x7x64-fp32-fma", 1, 7, 64, "float32", dict(FMA, block_m=1)),
    ("3x4097x96-fp32-fma-split", 3, 4097, 96, "float32", dict(FMA, block_n=512, num_warps=4, split_k=3)),
    ("17x33x8200-fp32-fma-dot-split", 17, 33, 8200, "float32", dict(FMA, block_m=16, block_k=128, split_k=16)),
    ("64x130x257-fp32-fma-dot", 64, 130, 257, "float32", dict(FMA, block_m=32, block_n=64, block_k=16, split_k=2)),
    ("64x130x257-fp32-fma-rows-auto-split", 64, 130, 257, "float32", dict(FMA, block_m=8, block_n=64, num_warps=2)),
    ("5x40x48-fp32-fma-bT", 5, 40, 48, "float32", dict(FMA, split_k=2, _b="t")),
    ("5x40x48-fp32-fma-dot-bT", 5, 40, 48, "float32", dict(FMA, block_m=16, block_k=16, split_k=3, _b="t")),
    # No config: the heuristic's FMA configs (fp32, M <= 32, B row-major), K split for the
    # interpreter's 4 "SMs"; beyond that, or with B K-major, the other kernels.
    ("1x7x64-fp32-default-fma", 1, 7, 64, "float32", None),
    ("3x4097x96-fp32-default-fma", 3, 4097, 96, "float32", None),
    ("17x33x8200-fp32-default-fma", 17, 33, 8200, "float32", None),
    ("30x130x257-fp32-default-fma", 30, 130, 257, "float32", None),
    ("64x130x257-fp32-default", 64, 130, 257, "float32", None),
    ("5x40x48-fp32-default-bT", 5, 40, 48, "float32", dict(_b="t")),
]
FMA_CASES = [c[0] for c in CASES if "fma" in c[0]]
# True fp32 (products and sums rounded to 24-bit mantissas, unit roundoff 6e-8): the norm-wise
# error of a K-long dot product stays near sqrt(K) * 6e-8 (6e-6 at K = 11683) for random signs.
# tf32 rounds every input to 11 significant bits (unit roundoff 4.9e-4), hence its 2e-3.
FMA_TOL = 1e-5
# The zoo's fp32 shapes at M <= 64 (results/gemm_zoo/final.csv: 0.39-0.86x cuBLAS on the tf32 "swap" kernel).
FP32_SMALL_M = [(1, 3584, 3584), (10, 7770, 11683), (19, 6896, 2352), (12, 3744, 2464), (64, 2048, 768),
                (64, 3584, 3584)]

_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path.insert(0, {root!r})
    from kernels import gemm
    from kernels.gemm import launch as glaunch, sweep as gsweep
    cases = json.loads(sys.argv[1])
    glaunch.DEVICE_DESCRIPTORS = len(sys.argv) > 2 and sys.argv[2] == "device"
    out = {{}}
    for i, (name, M, N, K, dt, cfg) in enumerate(cases):
        dtype = getattr(torch, dt)
        g = torch.Generator().manual_seed(1000 + i + 500 * glaunch.DEVICE_DESCRIPTORS)   # fresh inputs per case
        a = torch.randn(M, K, generator=g).to(dtype)
        cfg = dict(cfg) if cfg else cfg
        if cfg and cfg.pop("_b", None) == "t":   # B (K, N) as the transposed view of an (N, K) tensor
            b = torch.randn(N, K, generator=g).to(dtype).t()
        else:
            b = torch.randn(K, N, generator=g).to(dtype)
        cfg = cfg or None   # only _b given: no config (the heuristic)
        c = torch.full((M, N), float("nan"), dtype=dtype)   # poisoned
        try:
            gemm.matmul(a, b, cfg, out=c)
            ref = a.double() @ b.double()
            finite = bool(torch.isfinite(c).all())
            err = float((c.double() - ref).norm() / ref.norm())
            p = glaunch.plan_for(a, b, cfg, c)
            out[name] = {{"finite": finite, "err": err, "tol": gsweep.tolerance(dtype), "kind": p.kind,
                          "device_desc": p.device_desc, "b_kmajor": p.b_kmajor, "trans_b": p.trans_b}}
        except Exception as exc:
            out[name] = {{"error": f"{{type(exc).__name__}}: {{exc}}"}}
    print(json.dumps(out))
""")


def _interpret(cases, *mode):
    """All `cases` in one subprocess (TRITON_INTERPRET=1 before triton is imported); mode "device":
    DEVICE_DESCRIPTORS on, else off."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _SCRIPT.format(root=str(ROOT)), json.dumps(cases), *mode],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def interpreter_results():
    return _interpret(CASES)


@pytest.mark.parametrize("case", [c[0] for c in CASES])
def test_interpreter_correct(interpreter_results, case):
    res = interpreter_results[case]
    assert "error" not in res, res.get("error")
    assert res["finite"], "unwritten (still NaN-poisoned) or non-finite outputs"
    assert res["err"] <= res["tol"], f"relative error {res['err']:.2e} > {res['tol']:.0e}"


@pytest.mark.parametrize("case,b_kmajor,trans_b", [
    ("130x264x96-bf16-tma-bT", True, False), ("17x72x8200-fp16-swap-tma-bT", True, False),
    ("130x264x96-fp32-tma-bT", True, False), ("130x264x96-fp32-tma-transpose-b", True, True),
    ("130x264x96-bf16-tma", False, False), ("17x40x8200-fp32-swap-tma", False, False),
    ("130x264x95-bf16-bT-unaligned-pad", False, False), ("130x257x96-fp16-bT-ptr", False, False),
])
def test_interpreter_b_layout_path(interpreter_results, case, b_kmajor, trans_b):
    """The plan reads a K-major B through a descriptor over B^T (no copy), copies a row-major
    fp32 B K-major for the persistent kernel only, and leaves unaligned or pointer-path B alone."""
    res = interpreter_results[case]
    assert (res["b_kmajor"], res["trans_b"]) == (b_kmajor, trans_b), res


PAD_EDGE_CASES = [c[0] for c in CASES if "one-" in c[0] or "pad-tail" in c[0]]


@pytest.mark.parametrize("case", PAD_EDGE_CASES)
def test_interpreter_padded_edges_take_the_tma_path(interpreter_results, case):
    """One row, one column, one element of C: the padded operands go through TMA (not the pointer
    kernel), right to the last element (the outputs were NaN-poisoned)."""
    res = interpreter_results[case]
    assert "error" not in res and res["kind"] == "tma" and res["finite"] and res["err"] <= res["tol"], res


@pytest.mark.parametrize("case", FMA_CASES)
def test_interpreter_fma_is_true_fp32(interpreter_results, case):
    """The FMA cases (explicit configs and the heuristic's) ran the FMA kernel, and to
    fp32 accuracy, far inside tf32's tolerance."""
    res = interpreter_results[case]
    assert "error" not in res, res.get("error")
    assert res["kind"] == "fma", res
    assert res["err"] <= FMA_TOL, f"relative error {res['err']:.2e} > {FMA_TOL:.0e}"


# The TMA cases again with DEVICE_DESCRIPTORS on: the kernels build their descriptors
# (tl.make_tensor_descriptor) from pointers and strides; the interpreter runs that too.
DD_CASES = [c for c in CASES if c[5] and c[5].get("tma")] + [
    ("40x48x64-bf16-tma-M-below-box", 40, 48, 64, "bfloat16", dict(SMALL, tma=True, block_m=64)),
    ("1x64x200-fp16-splitk-tma", 1, 64, 200, "float16", dict(SPLIT, tma=True, split_k=3)),
]


@pytest.fixture(scope="module")
def interpreter_results_dd():
    return _interpret(DD_CASES, "device")


@pytest.mark.parametrize("case", [c[0] for c in DD_CASES])
def test_interpreter_device_descriptors_correct(interpreter_results_dd, case):
    res = interpreter_results_dd[case]
    assert "error" not in res, res.get("error")
    assert res["kind"] in ("tma", "splitk") and res["device_desc"], res
    assert res["finite"], "unwritten (still NaN-poisoned) or non-finite outputs"
    assert res["err"] <= res["tol"], f"relative error {res['err']:.2e} > {res['tol']:.0e}"


# ---------------------------------------------------------------- validation
def _t(*shape, dtype=torch.float16, device="cpu"):
    return torch.randn(*shape).to(dtype=dtype, device=device)


@pytest.mark.parametrize("a,b,match", [
    (lambda: _t(4, 8), lambda: _t(9, 4), "inner dimensions"),
    (lambda: _t(4, 8, 2), lambda: _t(8, 4), "2-D"),
    (lambda: _t(4, 8), lambda: _t(8, 4, dtype=torch.bfloat16), "share a dtype"),
    (lambda: torch.ones(4, 8, dtype=torch.int32), lambda: torch.ones(8, 4, dtype=torch.int32), "not supported"),
    (lambda: _t(4, 8, dtype=torch.float64), lambda: _t(8, 4, dtype=torch.float64), "not supported"),
    (lambda: _t(4, 8), lambda: torch.empty(8, 4, dtype=torch.float16, device="meta"), "device"),
    (lambda: [[1.0]], lambda: _t(1, 1), "torch tensors"),
])
def test_bad_operands(a, b, match):
    with pytest.raises(ValueError, match=match):
        gemm.matmul(a(), b())


_ATOMIC_SPLIT_SCRIPT = textwrap.dedent("""
    import json, os, sys
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    sys.path.insert(0, {root!r})
    from kernels import gemm
    from kernels.gemm import config as gconfig, launch as glaunch, plan as gplan
    out = {{}}
    g = torch.Generator().manual_seed(77)
    a = torch.randn(40, 1000, generator=g).bfloat16()
    b = torch.randn(1000, 70, generator=g).bfloat16()
    ref = a.double() @ b.double()
    for mode, least in (("atomic", 3), ("serial", 10 ** 9)):
        gconfig.SPLIT_ATOMIC_MIN_PIECES = least
        glaunch.clear_plans()
        cfg = dict(block_m=16, block_n=64, block_k=32, num_warps=4, num_stages=2, split_k=6)
        for call in range(2):                       # the sums and counters reset themselves
            c = torch.full((40, 70), float("nan")).bfloat16()
            gemm.matmul(a, b, cfg, out=c)
            out[f"{{mode}}{{call}}"] = float((c.double() - ref).norm() / ref.norm())
        out[mode + "_flag"] = glaunch.plan_for(a, b, cfg, c).launch.kwargs["ATOMIC_SPLIT"]
    ws, cnt = gplan._SK_ZEROED[(-1, 0)]
    out["zeroed_left"] = float(ws.abs().max()) + float(cnt.abs().max())
    print(json.dumps(out))
""")


def test_interpreter_split_k_atomic_sum_matches_and_resets():
    """Six pieces per tile of a 40 x 70 x 1000 bf16 product (3 x 2 tiles): with the atomic sum
    (SPLIT_ATOMIC_MIN_PIECES = 3) and with the serial one, each called twice on a poisoned output,
    within bf16's tolerance of float64; the atomic workspace and its counters are all zero again
    afterwards (a later call starts from a zero sum)."""
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", _ATOMIC_SPLIT_SCRIPT.format(root=str(ROOT))],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["atomic_flag"] is True and res["serial_flag"] is False
    for k in ("atomic0", "atomic1", "serial0", "serial1"):
        assert res[k] <= gsweep.tolerance(torch.bfloat16), (k, res[k])
    assert res["zeroed_left"] == 0.0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")
def test_cpu_without_interpreter_says_what_to_do():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import torch; from kernels import gemm\n"
            "try:\n    gemm.matmul(torch.randn(4, 8).half(), torch.randn(8, 4).half())\n"
            "except ValueError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert "TRITON_INTERPRET=1" in r.stdout, r.stdout + r.stderr


@pytest.mark.parametrize("cfg,match", [
    (dict(block_m=48), "power of two"),
    (dict(block_k=8), "power of two"),
    (dict(num_warps=3), "num_warps"),
    (dict(num_stages=0), "num_stages"),
    (dict(group_m=0), "group_m"),
    (dict(num_sms=0), "num_sms"),
    (dict(epilogue_split=4), "epilogue_split"),
    (dict(tail_split=3), "tail_split=3 must be 1, 2 or 4"),
    (dict(tail_split=2, stream_k=True), "tail_split runs on the persistent TMA kernel"),
    (dict(tail_split=4, block_n=32), "block_n / tail_split >= 16"),
    (dict(extra_n=24), "extra_n=24 must be 0 or a power of two from 16 to block_n"),
    (dict(extra_n=512), "extra_n=512 must be 0 or a power of two"),
    (dict(extra_n=True), "extra_n=True must be 0"),
    (dict(extra_n=32, tail_split=2), "tail_split runs on the persistent TMA kernel without stream_k, extra_n"),
    (dict(extra_n=32, split_k=2), "extra_n runs on the persistent TMA kernel"),
    (dict(extra_n=32, tma=False), "extra_n runs on the persistent TMA kernel"),
    (dict(extra_n=32), "extra_n needs the TMA path"),   # tma=None in the interpreter: the pointer kernel
    (dict(warp_specialize=True), "warp_specialize"),
    (dict(blok_m=64), "unknown config"),
])
def test_bad_config(cfg, match, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # validation happens before any launch
    with pytest.raises(ValueError, match=match):
        gemm.matmul(_t(4, 8), _t(8, 4), cfg)


@pytest.mark.parametrize("cfg,match", [
    (dict(fma=1), "fma=1 must be True"),
    (dict(fma=True, swap_ab=True), "takes none of swap_ab"),
    (dict(fma=True, stream_k=True), "takes none of stream_k"),
    (dict(fma=True, tma=True, pad=True), "takes none of tma, pad"),
    (dict(fma=True, transpose_b=True), "transpose_b"),
    (dict(fma=True, gluon="coop", block_n=256, block_k=32, num_stages=6), "takes none of gluon"),
    (dict(fma=True, block_m=3), "block_m=3 must be a power of two from 1"),
    (dict(fma=True, block_n=8), "block_n=8 must be a power of two from 16"),
    (dict(fma=True, block_m=8, block_k=64), "needs block_k <= 32"),
    (dict(fma=True, block_m=16, block_k=8), "needs block_k >= 16"),
    (dict(fma=True, split_k=0), "split_k=0"),
    (dict(block_m=8), "from 16"),   # short blocks are the FMA kernel's only
])
def test_bad_fma_config(cfg, match, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a, b = _t(4, 8, dtype=torch.float32), _t(8, 4, dtype=torch.float32)
    with pytest.raises(ValueError, match=match):
        gemm.matmul(a, b, cfg)


def test_fma_refuses_16_bit_operands(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="fma=True is the fp32 kernel"):
        gemm.matmul(_t(4, 8), _t(8, 4), dict(fma=True, block_m=4, block_k=8))


def test_bad_out(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="out must be"):
        gemm.matmul(_t(4, 8), _t(8, 4), out=torch.empty(4, 5, dtype=torch.float16))


def test_tma_needs_alignment(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="16-byte"):
        gemm.matmul(_t(4, 7), _t(7, 4), dict(tma=True))


def test_empty_dims(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gemm.matmul(_t(0, 8), _t(8, 4)).shape == (0, 4)
    c = gemm.matmul(_t(3, 0), _t(0, 4))
    assert c.shape == (3, 4) and bool((c == 0).all())


# ------------------------------------------------------------------ counting
def test_counts():
    s = {"M": 3, "N": 5, "K": 7}
    assert gemm.flops(s) == 2 * 3 * 5 * 7
    assert gemm.bytes_moved(s, torch.bfloat16) == (3 * 7 + 7 * 5 + 3 * 5) * 2
    assert gemm.bytes_moved(s, torch.float32) == (3 * 7 + 7 * 5 + 3 * 5) * 4


# ----------------------------------------------------------------- heuristic
GOAL = [(8192, 8192, 8192), (4096, 4096, 4096), (1024, 4096, 14336), (4096, 14336, 4096),
        (16384, 3584, 8192), (2048, 7168, 2048), (512, 4096, 7168), (8192, 28672, 8192)]


@pytest.mark.parametrize("M,N,K", GOAL + [(1, 7, 64), (6, 42, 123), (100000, 64, 64)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_heuristic_configs_are_valid(M, N, K, dtype):
    cfg = gemm.heuristic(M, N, K, dtype, num_sms=132)
    gconfig.validate_config(cfg)
    es = torch.empty((), dtype=dtype).element_size()
    if cfg.gluon:
        assert dtype != torch.float32
        gconfig.validate_ws(cfg.ws_config())    # smem, registers per consumer thread
    else:
        assert gconfig.smem_bytes(cfg, es) <= gconfig.SMEM_LIMIT_SM90
        assert cfg.block_m * cfg.block_n // (cfg.num_warps * 32) <= 128
    assert gemm.heuristic(M, N, K, dtype, num_sms=132) == cfg  # deterministic


def test_heuristic_pointer_path_is_small():
    cfg = gemm.heuristic(512, 512, 512, torch.float16, 4, hopper=False)
    assert cfg.block_m * cfg.block_n <= 64 * 64


def test_sweep_protocol_surface():
    inp = gsweep.make_inputs({"M": 5, "N": 6, "K": 7}, torch.float32, "cpu", seed=3)
    assert inp.a.shape == (5, 7) and inp.b.shape == (7, 6) and inp.out.shape == (5, 6)
    gsweep.poison(inp)
    assert torch.isnan(inp.out).all()
    ref = gemm.reference(inp)
    assert torch.allclose(ref, inp.a.float() @ inp.b.float())
    d = gsweep.derived({"M": 256, "N": 256, "K": 64}, torch.bfloat16, {"block_m": 128, "block_n": 256})
    assert d["smem_bytes"] == gconfig.smem_bytes(gemm.GemmConfig(block_m=128, block_n=256), 2)
    assert set(gsweep.PARAMS) >= {"block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages", "num_sms"}
    assert "cublas" in gsweep.baselines
    assert "ws" in gsweep.label({"warp_specialize": True, "tma_store": False, "flatten": False})


# -------------------------------------------- Hopper path, cross-compiled (CPU)
# In a subprocess without TRITON_INTERPRET: under the interpreter (which the
# conftest turns on for CPU runs) Triton cannot compile descriptor loads.
_XC_SCRIPT = textwrap.dedent("""
    import json, sys, tempfile
    sys.path.insert(0, {root!r})
    from kernels.gemm import launch as glaunch
    from workbench.asm.compile import cross_compile
    out = {{}}
    for name, cfg in json.loads(sys.argv[1]).items():
        e = cross_compile(targets="sm90", cache_dir=tempfile.mkdtemp(), **glaunch.compile_args(cfg))[0]
        ptx = e.text("ptx")
        out[name] = {{k: ptx.count(v) for k, v in (("wgmma", "wgmma.mma_async"), ("tma", "cp.async.bulk.tensor"),
                                                  ("local", ".local"), ("setmaxnreg", "setmaxnreg"))}}
        out[name]["shared"] = e.resources()["shared_bytes"]
    print(json.dumps(out))
""")
XC_CONFIGS = {
    "tma-store": dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3),
    "warp-specialized": dict(block_m=128, block_n=256, block_k=64, num_warps=4, num_stages=3,
                             warp_specialize=True, tma_store=False, flatten=False),
    # the widest tile of experiments/probes/probe_gemm_gaps.py --wide: 128 x (256 + 32), two MMAs per K-step
    "wide-288": dict(block_m=128, block_n=256, extra_n=32, block_k=64, num_warps=8, num_stages=3,
                     tma_store=False),
}


def _cross_compile_in_child(script: str, payload) -> dict:
    """Run a cross-compiling script (its JSON argument: payload) in a child process with the
    interpreter off; its last stdout line is the JSON result."""
    try:
        import workbench.asm.compile  # noqa: F401
    except Exception as exc:  # the asm package is developed alongside
        pytest.skip(f"workbench.asm.compile not available: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", script.format(root=str(ROOT)), json.dumps(payload)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sm90_ptx_counts():
    return _cross_compile_in_child(_XC_SCRIPT, XC_CONFIGS)


@pytest.mark.parametrize("name", list(XC_CONFIGS))
def test_sm90_cross_compile_uses_wgmma_and_tma(sm90_ptx_counts, name):
    c = sm90_ptx_counts[name]
    assert c["wgmma"] > 0  # Hopper tensor-core instructions (HGMMA in SASS)
    assert c["tma"] > 0  # bulk tensor copies (TMA loads)
    assert c["local"] == 0  # nothing spilled to local memory
    assert c["shared"] <= gconfig.SMEM_LIMIT_SM90  # it can launch
    if XC_CONFIGS[name].get("warp_specialize"):
        assert c["setmaxnreg"] > 0  # producer / consumer warpgroups


# Device descriptors, cross-compiled: each program encodes a 128-byte CUtensorMap per
# descriptor in shared memory, copies it to its slot of the global scratch buffer with the
# tensormap release fence, acquires it, and the TMA loads (UTMALDG) read it from there.
_XC_DD_SCRIPT = textwrap.dedent("""
    import json, sys, tempfile
    sys.path.insert(0, {root!r})
    from kernels.gemm import launch as glaunch
    from workbench.asm.compile import cross_compile
    out = {{}}
    for name, cfg in json.loads(sys.argv[1]).items():
        e = cross_compile(targets="sm90", cache_dir=tempfile.mkdtemp(),
                          **glaunch.compile_args(cfg, device_desc=True))[0]
        ptx, sass = e.text("ptx"), e.text("sass")
        out[name] = dict(scratch=e.metadata.get("global_scratch_size"), fn=e.name,
                         release=ptx.count("tensormap.cp_fenceproxy.global.shared::cta"),
                         acquire=ptx.count("fence.proxy.tensormap::generic.acquire"),
                         replace_address=ptx.count("tensormap.replace.tile.global_address"),
                         wgmma=ptx.count("wgmma.mma_async"), local=ptx.count(".local"),
                         utmaldg=sass.count("UTMALDG"), utmastg=sass.count("UTMASTG"),
                         utmacctl=sass.count("UTMACCTL"))
    print(json.dumps(out))
""")
XC_DD_CONFIGS = {  # name -> (config, descriptors the kernel builds)
    "tma-store": (dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3), 3),
    "tma-sk-no-store": (dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=4, tma_store=False,
                             stream_k=True), 2),
    "splitk-swap": (dict(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4, split_k=4,
                         swap_ab=True), 2),
}


@pytest.fixture(scope="module")
def sm90_device_desc():
    try:
        import workbench.asm.compile  # noqa: F401
    except Exception as exc:  # the asm package is developed alongside
        pytest.skip(f"workbench.asm.compile not available: {exc}")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cfgs = {name: cfg for name, (cfg, _) in XC_DD_CONFIGS.items()}
    r = subprocess.run([sys.executable, "-c", _XC_DD_SCRIPT.format(root=str(ROOT)), json.dumps(cfgs)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(XC_DD_CONFIGS))
def test_sm90_device_descriptors_compile_to_tma_from_global_memory(sm90_device_desc, name):
    c, (cfg, n) = sm90_device_desc[name], XC_DD_CONFIGS[name]
    assert c["fn"] == ("_gemm_splitk_kernel" if "split_k" in cfg else "_gemm_tma_dev_kernel")
    assert c["scratch"] == 128 * n          # one CUtensorMap per descriptor and program
    assert c["release"] == c["acquire"] == c["replace_address"] == n
    assert c["wgmma"] > 0 and c["local"] == 0
    assert c["utmaldg"] > 0 and c["utmacctl"] >= 1      # TMA loads; descriptor-cache invalidation
    assert (c["utmastg"] > 0) == bool(cfg.get("tma_store", True) and "split_k" not in cfg)


# The FMA kernel, cross-compiled for sm_90 as the heuristic configures it: FFMA and no
# tensor-core instruction, nothing spilled; B arrives in 128-bit pieces, by LDG.E.128 into
# registers (outer products, block_m < 16) or by LDGSTS.E.BYPASS.128, the asynchronous copy
# into shared memory that tl.dot's pipeline uses (block_m >= 16; also for a K-major B, along K).
_XC_FMA_SCRIPT = textwrap.dedent("""
    import json, re, sys, tempfile
    sys.path.insert(0, {root!r})
    import torch
    from kernels.gemm import launch as glaunch
    from kernels.gemm.config import GemmConfig
    from workbench.asm.compile import cross_compile
    out = {{}}
    for name, (params, shape, b_kmajor) in json.loads(sys.argv[1]).items():
        e = cross_compile(targets="sm90", cache_dir=tempfile.mkdtemp(),
                          **glaunch.compile_args(GemmConfig(**params), torch.float32, shape, b_kmajor=b_kmajor))[0]
        sass = e.text("sass")
        ops = re.findall(r"^\\s+/\\*[0-9a-f]+\\*/\\s+(?:@!?U?P\\w+\\s+)?([A-Z][A-Z0-9_.]+)", sass, re.M)
        r = e.resources()
        out[name] = dict(fn=e.name, ffma=ops.count("FFMA"), ldg128=ops.count("LDG.E.128"),
                         ldgsts128=ops.count("LDGSTS.E.BYPASS.128"),
                         mma=sum(o.startswith(("HMMA", "HGMMA")) for o in ops),
                         spills=r.get("spill_stores"), local=r.get("local_bytes"), registers=r.get("registers"))
    print(json.dumps(out))
""")


def _fma_xc_cases():
    out = {}
    # the heuristic's tiles (M <= 32, B row-major), the same on a K-major B, and the outer-product form
    for (M, N, K), b_t in [((1, 3584, 3584), False), ((4, 192, 224), False), ((8, 2048, 4096), False),
                           ((12, 3744, 2464), False), ((19, 6896, 2352), False), ((1, 3584, 3584), True)]:
        cfg = gemm.heuristic(M, N, K, torch.float32, 132) if not b_t else gconfig.fma_config(M, N, K, 132)
        out[f"{M}x{N}x{K}{'-bT' if b_t else ''}"] = (dataclasses.asdict(cfg), dict(M=M, N=N, K=K), b_t)
    rows = gconfig.GemmConfig(block_m=8, block_n=512, block_k=4, num_warps=4, num_stages=1, group_m=1,
                              tma_store=False, split_k=4, fma=True)
    out["8x2048x4096-rows"] = (dataclasses.asdict(rows), dict(M=8, N=2048, K=4096), False)
    return out


@pytest.fixture(scope="module")
def sm90_fma():
    return _cross_compile_in_child(_XC_FMA_SCRIPT, _fma_xc_cases())


@pytest.mark.parametrize("name", list(_fma_xc_cases()))
def test_sm90_fma_kernel_uses_ffma_and_128_bit_loads_of_b(sm90_fma, name):
    c, (params, _, _) = sm90_fma[name], _fma_xc_cases()[name]
    assert c["fn"] == "_gemm_fma_kernel"
    assert c["ffma"] > 0 and c["mma"] == 0              # FMA units, no tensor cores
    assert c["spills"] == 0 and not c["local"], c        # nothing spilled to local memory
    if params["block_m"] < 16:
        assert c["ldg128"] >= params["block_k"], c       # a 128-bit load per row of B per K-step
    else:
        assert c["ldgsts128"] > 0, c                     # 128-bit asynchronous copies of A and B


# ----------------------------------------------------------------------- GPU
GPU_CASES = [
    (8192, 8192, 8192, torch.bfloat16, None),
    (512, 4096, 7168, torch.bfloat16, None),
    (1000, 3000, 2000, torch.bfloat16, None),
    (130, 257, 96, torch.float16, None),  # unaligned rows: pointer path
    (6, 42, 123, torch.bfloat16, None),
    (1, 7, 64, torch.float16, None),
    (777, 1024, 520, torch.float32, None),
    (1000, 3000, 2000, torch.bfloat16, dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4,
                                            tma_store=False)),
    (1000, 3000, 2000, torch.float16, dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4,
                                           epilogue_split=2, num_sms=37, group_m=3)),
    (1000, 3000, 2000, torch.bfloat16, dict(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3,
                                            tma=False, flatten=False)),
    # stream-K tails: 2048 tiles on 132 SMs (68 split); 128 tiles < 132 SMs; ragged edges
    (8192, 8192, 2048, torch.bfloat16, dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4,
                                            tma_store=False, stream_k=True)),
    (512, 4096, 7168, torch.bfloat16, dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6,
                                           tma_store=False, stream_k=True)),
    (1000, 3000, 2000, torch.float16, dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3,
                                           epilogue_split=2, stream_k=True)),
    # split-K kernel: odd shapes (pointer loads), aligned ones (TMA), swapped or not
    (1, 7, 64, torch.float16, dict(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4, split_k=1,
                                   swap_ab=True)),
    (3, 4097, 96, torch.bfloat16, dict(block_m=16, block_n=64, block_k=32, num_warps=4, num_stages=3, split_k=3,
                                       swap_ab=True)),
    (130, 257, 96, torch.float32, dict(block_m=64, block_n=128, block_k=32, num_warps=4, num_stages=3, split_k=3)),
    (17, 33, 8200, torch.bfloat16, dict(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=4,
                                        split_k=16, swap_ab=True)),
    (16, 4096, 4096, torch.bfloat16, dict(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=4,
                                          split_k=5, swap_ab=True)),
    (64, 4096, 14336, torch.float16, dict(block_m=64, block_n=128, block_k=128, num_warps=4, num_stages=4,
                                          split_k=4, swap_ab=True)),
    (8, 5120, 2880, torch.float32, dict(block_m=16, block_n=128, block_k=128, num_warps=4, num_stages=2,
                                        split_k=3, swap_ab=True)),
    (32, 6144, 4096, torch.bfloat16, dict(block_m=32, block_n=128, block_k=128, num_warps=4, num_stages=4,
                                          split_k=4)),
    (256, 4096, 4096, torch.bfloat16, dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=4,
                                           split_k=4)),
]


@pytest.mark.gpu
def test_gpu_stream_k_repeated_calls_stay_right():
    """The arrival counters reset themselves: many calls in a row, two shapes
    interleaved, each output checked."""
    cfg = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, tma_store=False, stream_k=True)
    shapes = [(4096, 4096, 4096), (2000, 7168, 1000)]
    ops = [(torch.randn(M, K, device="cuda", dtype=torch.bfloat16), torch.randn(K, N, device="cuda",
                                                                          dtype=torch.bfloat16))
           for M, N, K in shapes]
    refs = [(a.float() @ b.float()) for a, b in ops]
    for _ in range(5):
        for (a, b), ref in zip(ops, refs):
            c = gemm.matmul(a, b, cfg)
            assert ((c.float() - ref).norm() / ref.norm()).item() <= gsweep.tolerance(torch.bfloat16)


# split-K shapes for the atomic sum: at 8 x 28672 x 4096 (16 x 128 x 64 swapped tiles) its completing
# piece once zeroed the sum while other threads still read it (wrong on every call; one check of 102
# when only two calls were checked), so each is called many times, every output checked
ATOMIC_CASES = [
    (8, 28672, 4096, dict(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=6, split_k=4,
                          swap_ab=True, tma_store=False)),
    (90, 256, 23216, dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=6, split_k=26,
                          tma_store=False)),
    (1199, 80, 26040, dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6, split_k=13,
                           tma_store=False)),
]


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,cfg", ATOMIC_CASES)
def test_gpu_split_k_atomic_sum_repeated_calls_stay_right(M, N, K, cfg, monkeypatch):
    """The atomic sum (from 3 pieces) against the serial one's reference: 200 calls into a
    NaN-poisoned output, each checked against float64 (errors gathered on the GPU, one sync)."""
    from kernels.gemm import config as gconfig, launch as glaunch
    monkeypatch.setattr(gconfig, "SPLIT_ATOMIC_MIN_PIECES", 3)
    glaunch.clear_plans()
    g = torch.Generator(device="cuda").manual_seed(M + N + K)
    a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
    b = torch.randn(K, N, device="cuda", generator=g).bfloat16()
    ref = a.double() @ b.double()
    assert glaunch.plan_for(a, b, cfg, torch.empty(M, N, device="cuda", dtype=torch.bfloat16)).launch.kwargs[
        "ATOMIC_SPLIT"]
    c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    errs = []
    try:
        for _ in range(200):
            c.fill_(float("nan"))
            gemm.matmul(a, b, cfg, out=c)
            errs.append(torch.nan_to_num((c.double() - ref).norm() / ref.norm(), nan=float("inf")))
    finally:
        glaunch.clear_plans()   # plans made with the atomic sum from 3 pieces serve no later test
    worst = torch.stack(errs).max().item()
    assert worst <= gsweep.tolerance(torch.bfloat16), worst


def _gpu_check(M, N, K, dtype, cfg, g):
    """One matmul on fresh inputs into a NaN-poisoned output, against float64; returns the operands."""
    a = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    b = torch.randn(K, N, device="cuda", generator=g).to(dtype)
    c = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
    gemm.matmul(a, b, cfg, out=c)
    torch.cuda.synchronize()
    ref = a.double() @ b.double()
    assert torch.isfinite(c).all()
    err = ((c.double() - ref).norm() / ref.norm()).item()
    assert err <= gsweep.tolerance(dtype), err
    return a, b, c


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,dtype,cfg", GPU_CASES)
def test_gpu_correct(M, N, K, dtype, cfg):
    _gpu_check(M, N, K, dtype, cfg, torch.Generator(device="cuda").manual_seed(M * 7 + N * 3 + K))


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,dtype,cfg", GPU_CASES)
def test_gpu_device_descriptors_correct(M, N, K, dtype, cfg, monkeypatch):
    """The same cases with the kernels encoding their descriptors; no allocator is set
    (the launcher supplies the global scratch), and each call sees fresh inputs."""
    import triton

    monkeypatch.setattr(glaunch, "DEVICE_DESCRIPTORS", True)
    monkeypatch.setattr(glaunch, "DEVICE_DESC_MAX_US", float("inf"))   # at every size
    g = torch.Generator(device="cuda").manual_seed(M * 5 + N * 11 + K)
    for _ in range(2):
        a, b, c = _gpu_check(M, N, K, dtype, cfg, g)
    p = glaunch.plan_for(a, b, cfg, c)
    triton_dev = p.kind in ("tma", "splitk") and bool(p.launch.kwargs.get("USE_TMA", True))
    gluon_dev = p.kind == "gluon" and glaunch.GLUON_DEVICE_DESCRIPTORS   # the Gluon kernels encode theirs too
    assert p.device_desc == (triton_dev or gluon_dev)
    assert triton.runtime._allocation._allocator.get() is triton.runtime._allocation._NULL_ALLOCATOR


@pytest.mark.gpu
def test_gpu_device_descriptors_streams_and_graphs(monkeypatch):
    """Two streams get two scratch buffers; a captured CUDA graph replays right after
    the pool has grown (its old buffer is kept) and with new inputs copied in."""
    from kernels.common import launcher

    monkeypatch.setattr(glaunch, "DEVICE_DESCRIPTORS", True)
    monkeypatch.setattr(glaunch, "DEVICE_DESC_MAX_US", float("inf"))
    a = torch.randn(1000, 2000, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2000, 3000, device="cuda", dtype=torch.bfloat16)
    ref = a.double() @ b.double()
    cfg = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, num_sms=8)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    outs = {}
    for s in (s1, s2):
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            outs[s] = gemm.matmul(a, b, cfg)
    torch.cuda.synchronize()
    dev = torch.cuda.current_device()
    assert {(dev, s1.cuda_stream), (dev, s2.cuda_stream)} <= set(launcher._SCRATCH)
    for c in outs.values():
        assert ((c.double() - ref).norm() / ref.norm()).item() <= gsweep.tolerance(torch.bfloat16)
    c = torch.empty(1000, 3000, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    s1.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s1):
        gemm.matmul(a, b, cfg, out=c)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        gemm.matmul(a, b, cfg, out=c)
        captured = glaunch.plan_for(a, b, cfg, c)
    assert not captured.device_desc and glaunch.plan_for(a, b, cfg, c).device_desc   # host descriptors in graphs
    # Grow every buffer (a program count far above the graph's), then replay with new inputs.
    for key in list(launcher._SCRATCH):
        launcher.scratch(*key, 1 << 24)
    a.copy_(torch.randn_like(a))
    c.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = a.double() @ b.double()
    assert ((c.double() - ref).norm() / ref.norm()).item() <= gsweep.tolerance(torch.bfloat16)


@pytest.mark.gpu
def test_gpu_transposed_b_is_read_k_major_and_strided_b_is_copied_or_read_by_pointers():
    a = torch.randn(300, 200, device="cuda").to(torch.bfloat16)
    w = torch.randn(100, 200, device="cuda").to(torch.bfloat16)
    c = gemm.matmul(a, w.t())  # b is K-major: a descriptor over w, no copy
    assert glaunch.plan_for(a, w.t()).b_kmajor
    ref = a.double() @ w.t().double()
    assert ((c.double() - ref).norm() / ref.norm()).item() <= gsweep.tolerance(torch.bfloat16)
    wide = torch.randn(200, 200, device="cuda").to(torch.bfloat16)
    b = wide[:, ::2]   # no unit stride either way: copied (pad) or read by the pointer kernel
    p = glaunch.plan_for(a, b)
    assert not p.b_kmajor and (p.kind == "ptr" or p.pad_b)
    ref = a.double() @ b.double()
    assert ((gemm.matmul(a, b).double() - ref).norm() / ref.norm()).item() <= gsweep.tolerance(torch.bfloat16)


_SK = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, tma_store=False, stream_k=True)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K,dtype,cfg,b_t", [
    (4096, 4096, 4096, torch.bfloat16, None, True), (16, 4096, 14336, torch.bfloat16, None, True),
    (1, 57344, 8192, torch.bfloat16, None, True), (130, 8200, 1032, torch.float16, None, True),
    (1024, 8192, 8192, torch.float32, None, False), (2958, 3120, 2144, torch.float32, None, False),
    (1000, 3000, 2000, torch.float32, None, True), (64, 3584, 3584, torch.float32, None, True),
    (1000, 3000, 2000, torch.bfloat16, dict(gluon="pingpong", block_n=128, num_stages=5, num_warps=4), True),
    (777, 520, 4104, torch.float16, dict(gluon="coop", block_n=256, block_k=32, num_stages=6, num_warps=8), True),
    (1539, 2824, 4224, torch.bfloat16, _SK, True), (2958, 3120, 2144, torch.float32,
                                                    dict(_SK, block_k=32, num_stages=2), False),
])
def test_gpu_b_layouts(M, N, K, dtype, cfg, b_t):
    """B K-major (x @ w.t(); the Gluon kernels too), fp32 B copied K-major, with stream-K
    too: fresh inputs, poisoned outputs, twice in a row (the stream-K counters reset themselves)."""
    g = torch.Generator(device="cuda").manual_seed(M + 3 * N + 7 * K)
    a = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    b = torch.randn(N, K, device="cuda", generator=g).to(dtype).t() if b_t else \
        torch.randn(K, N, device="cuda", generator=g).to(dtype)
    ref = a.double() @ b.double()
    for _ in range(2):
        c = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
        gemm.matmul(a, b, cfg, out=c)
        assert torch.isfinite(c).all()
        assert ((c.double() - ref).norm() / ref.norm()).item() <= gsweep.tolerance(dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", FP32_SMALL_M)
@pytest.mark.parametrize("b_t", [False, True])
def test_gpu_fma_small_m_fp32(M, N, K, b_t, isolated_tables):
    """The zoo's fp32 small-M shapes through the cold rule (no tuning table: a shipped table may
    send them to cuBLAS), B row-major or K-major: the FMA
    kernel where the rule takes it (within FMA_TOL: true fp32, not tf32), the tf32 kernels
    elsewhere (tf32's tolerance); fresh inputs, poisoned outputs, twice (the split-K counters
    reset themselves), against float64. B row-major with M <= FMA_MAX_M always takes the FMA
    kernel; B K-major takes whatever the fitted region table names (it may be the FMA kernel too,
    whose pointer loads read either layout)."""
    g = torch.Generator(device="cuda").manual_seed(M + 5 * N + 3 * K)
    for _ in range(2):
        a = torch.randn(M, K, device="cuda", generator=g)
        b = torch.randn(N, K, device="cuda", generator=g).t() if b_t else torch.randn(K, N, device="cuda", generator=g)
        c = torch.full((M, N), float("nan"), device="cuda")
        glaunch.clear_plans()   # plans made with the shipped tables by earlier tests
        gemm.matmul(a, b, out=c)
        torch.cuda.synchronize()
        fma = glaunch.plan_for(a, b, None, c).kind == "fma"
        if not b_t:
            assert fma == (M <= gcold.FMA_MAX_M)
        ref = a.double() @ b.double()
        assert torch.isfinite(c).all()
        err = ((c.double() - ref).norm() / ref.norm()).item()
        assert err <= (FMA_TOL if fma else gsweep.tolerance(torch.float32)), err


# Unaligned shapes (some operand's rows not 16-byte multiples), padded for TMA: large ones the cold
# rule sends to the padded kernel, and the edges, one row (M = 1) and one column (N = 1) of C.
# (M, N, K, B a transposed view): whose rows are unaligned in the comment.
PADDED_GPU_CASES = [
    (8191, 8193, 1000, False),   # B's and C's (issue 43's shape)
    (4500, 4500, 4500, False),   # all three
    (1025, 2048, 1027, False),   # A's
    (3000, 4097, 2048, True),    # C's alone
    (2049, 1024, 1033, True),    # A's and B's
    (1, 4097, 1000, False),      # one row of C; B's and C's
    (1, 4096, 1001, False),      # one row; A's
    (4097, 1, 1000, False),      # one column of C: B's and C's rows one element
    (3000, 1, 1001, True),       # one column, A's and B's rows too
    (1, 1, 1025, False),         # one element
]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("M,N,K,b_t", PADDED_GPU_CASES)
def test_gpu_padded_unaligned_shapes(M, N, K, b_t, dtype, isolated_tables):
    """The cold rule's choice (no tuning table) and the padded persistent tiles (128x256 with tail
    slices, 128x128, 64x128) on unaligned shapes: fresh inputs, NaN-poisoned outputs, twice in a
    row, against an fp32 reference; large unaligned shapes run ours, padded, through TMA."""
    from kernels.gemm import select as gselect

    g = torch.Generator(device="cuda").manual_seed(M + 3 * N + 7 * K + b_t)
    a = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    b = torch.randn(N, K, device="cuda", generator=g).to(dtype).t() if b_t else \
        torch.randn(K, N, device="cuda", generator=g).to(dtype)
    ref = a.float() @ b.float()
    call = glaunch._call(a, b, None, M, N, K, False, False)
    assert not call.aligned
    cands = gselect.candidates(call)
    cfgs = {"cold rule": None, **{n: cands[n].config for n in ("t128x256", "t128x128", "t64x128")}}
    for name, cfg in cfgs.items():
        for _ in range(2):
            c = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
            gemm.matmul(a, b, cfg, out=c)
            torch.cuda.synchronize()
            assert torch.isfinite(c).all(), (name, "unwritten (NaN-poisoned) or non-finite outputs")
            err = ((c.float() - ref).norm() / ref.norm()).item()
            assert err <= gsweep.tolerance(dtype), (name, err)
        p = glaunch.plan_for(a, b, cfg, c)
        if cfg is not None:
            assert p.kind == "tma" and bool(p.pad_a) == (not call.a_ok) and bool(p.pad_b) == (not call.b_ok), name
    if gcold.shape_class(M, N, K, dtype, call.aligned, call.sms) == "bigpad":   # ours padded there, not cuBLAS
        p = glaunch.plan_for(a, b, None, c)
        assert p.choice.source == "cold" and p.kind != "library" and p.choice.candidate.variant != "library", \
            p.choice


@pytest.mark.gpu
def test_gpu_refuses_warp_specialization(monkeypatch):
    monkeypatch.delenv("WORKBENCH_ALLOW_WS", raising=False)
    a = torch.randn(256, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="WORKBENCH_ALLOW_WS"):
        gemm.matmul(a, a, dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3,
                               warp_specialize=True, tma_store=False, flatten=False))


# ----------------------------------------------------------------- stream-K
@pytest.mark.parametrize("tiles,programs,k_steps", [(2048, 132, 128), (512, 132, 64), (128, 132, 112),
                                                    (45, 7, 8), (45, 4, 8), (5, 132, 3)])
def test_stream_k_plan_covers_the_tail_once(tiles, programs, k_steps):
    plan = gconfig.stream_k_plan(tiles, programs, k_steps)
    tail = tiles - plan.dp_tiles
    if plan.sk_programs == 0:
        assert plan.dp_tiles == tiles
        return
    assert plan.dp_tiles % programs == 0 and 0 < tail < programs or plan.dp_tiles == 0
    ranges = [plan.sk_iters_per + (p < plan.sk_extra) for p in range(plan.sk_programs)]
    assert sum(ranges) == tail * k_steps  # every K-step of every tail tile, exactly once
    assert min(ranges) >= gconfig.SK_MIN_STEPS and plan.sk_programs <= programs
    assert plan.sk_programs <= tail * gconfig.SK_MAX_SPLIT


def test_tail_slices_fit_the_last_round_in_one_more():
    """Slices per tile of the last, partial round: the most (up to the config's) whose slices
    all run at once; none for whole rounds or where even 2 per tile would not fit."""
    assert gconfig.last_round(156, 132) == 24 and gconfig.last_round(264, 132) == 0
    assert gconfig.last_round(70, 132) == 70
    assert gconfig.tail_slices(156, 132, 4) == 4      # 24 left: 96 slices
    assert gconfig.tail_slices(156, 132, 2) == 2      # the config's most
    assert gconfig.tail_slices(299, 132, 4) == 2      # 35 left: 140 > 132, 70 fit
    assert gconfig.tail_slices(264, 132, 4) == 1      # whole rounds
    assert gconfig.tail_slices(70, 132, 4) == 1       # one round of 70: 140 slices would not fit
    assert gconfig.tail_slices(4, 8, 4) == 2
    cfg = gconfig.GemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4)
    assert [gconfig.tail_stages(cfg, s) for s in (1, 2, 4)] == [4, 6, 8]   # same shared memory, narrower steps


def test_stream_k_plan_skips_whole_rounds_and_short_k():
    assert gconfig.stream_k_plan(264, 132, 64).sk_programs == 0  # no partial round
    assert gconfig.stream_k_plan(133, 132, 1).sk_programs == 0   # one K-step: nothing to split


@pytest.mark.parametrize("M,N,K", [(8192, 8192, 8192), (4096, 14336, 4096), (2048, 7168, 2048),
                                   (512, 4096, 7168), (16, 4096, 4096), (1, 57344, 8192), (909, 4152, 2912),
                                   (8147, 32, 514), (64, 64, 64), (12075, 8, 896)])
def test_heuristic_is_the_cost_models_argmin(M, N, K):
    """Outside the tiling study's domain the rule is a cost model over candidates: what it
    returns is the candidate with the least modelled time, for 16-bit and fp32, with and
    without Gluon; inside, the tiling study's rule."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for gl in (True, False):
            cfg = gemm.heuristic(M, N, K, dtype, num_sms=132, gluon=gl)
            if gcold.in_tiling_domain(M, N, K, dtype, True, True):
                assert cfg == gcold.tiling_rule(M, N, K, dtype, 132, gl)
                continue
            cands = gconfig.candidates(M, N, K, dtype, 132, gluon=gl)
            if dtype == torch.float32 and M <= gcold.FMA_MAX_M:   # a stated rule, not the model
                assert cfg == cands["fma"]
                continue
            if dtype != torch.float32 and N <= gcold.TALL_MAX_N and M > gconfig.SMALL_M:   # likewise
                assert cfg == cands["tall"]
                continue
            est = {n: gcold.estimate_us(c, M, N, K, dtype, 132, gcold.COST[n])
                   for n, c in cands.items() if n in gcold.COST}
            assert cfg == cands[min(est, key=est.get)]
            assert cfg.gluon is None or (gl and dtype != torch.float32)
    assert gemm.heuristic(M, N, K, num_sms=132, hopper=False).gluon is None


def test_goal_shapes_keep_the_tiling_studys_choices():
    """The 8 goal shapes of the tiling study run what its goal tables measured (runs 10-12)."""
    want = {(8192, 8192, 8192): "sk", (4096, 4096, 4096): "gl-coop", (4096, 14336, 4096): "gl-coop",
            (16384, 3584, 8192): "sk", (2048, 7168, 2048): "gl-pp", (8192, 28672, 8192): "gl-pp",
            (1024, 4096, 14336): "128x256x64 w8 s4", (512, 4096, 7168): "128x128x64 w4 s6"}
    for (M, N, K), label in want.items():
        assert label in gemm.heuristic(M, N, K, torch.bfloat16, 132).label(), (M, N, K)


def test_heuristic_few_columns_take_the_tall_tile():
    """16-bit, at most TALL_MAX_N columns and M > SMALL_M: the 128 x 16 "tall" tile, split over K
    where its row blocks are few; from 32 columns, or small M, or fp32, the other rules."""
    for M, N, K in [(12075, 8, 896), (5572, 2, 2160), (512, 8, 4096), (65, 16, 64)]:
        cfg = gemm.heuristic(M, N, K, torch.bfloat16, 132, tma=(N * 2) % 16 == 0 and (K * 2) % 16 == 0)
        assert (cfg.block_m, cfg.block_n, cfg.split_k is not None) == (128, 16, True), (M, N, K, cfg.label())
    for M, N, K, dtype in [(8147, 32, 512, torch.bfloat16), (32, 8, 4096, torch.bfloat16),
                           (12075, 8, 896, torch.float32)]:
        assert gemm.heuristic(M, N, K, dtype, 132) == gcold.cost_model_rule(M, N, K, dtype, 132), (M, N, K)


def test_heuristic_small_m_takes_the_split_k_kernel():
    for M, N, K in [(1, 4096, 4096), (16, 14336, 4096), (8, 8192, 28672)]:
        cfg = gemm.heuristic(M, N, K, num_sms=132)
        assert cfg.split_k is not None and cfg.block_m <= 64, cfg.label()


def test_heuristic_fp32_small_m_takes_the_fma_kernel():
    """fp32 with M <= FMA_MAX_M and B row-major: the FMA kernel (tl.dot in ieee precision, 16 x 64
    tiles up to M = 16, 32 x 128 beyond), on Hopper or not; with B K-major, larger M or 16-bit
    types the other rules; "fma" is a sweep candidate for fp32 up to SMALL_M, either layout."""
    for M, N, K in FP32_SMALL_M + [(3, 1678, 2150), (4, 192, 224)]:
        if M > gcold.FMA_MAX_M:
            assert not gemm.heuristic(M, N, K, torch.float32, 132).fma
            assert "fma" in gconfig.candidates(M, N, K, torch.float32, 132)
            continue
        for hopper in (True, False):
            cfg = gemm.heuristic(M, N, K, torch.float32, 132, hopper=hopper)
            assert cfg.fma and cfg == gconfig.candidates(M, N, K, torch.float32, 132)["fma"], (M, N, K)
            assert (cfg.block_m, cfg.block_n) == ((16, 64) if M <= 16 else (32, 128)), cfg.label()
            assert cfg.split_k * cfg.block_m * math.ceil(M / cfg.block_m) <= max(1, K // 2)   # partials <= B
            assert gconfig.smem_bytes(cfg, 4) <= gconfig.SMEM_LIMIT_SM90
        assert not gemm.heuristic(M, N, K, torch.float32, 132, b_kmajor=True).fma   # the swap kernel reads it
        assert not gemm.heuristic(M, N, K, torch.bfloat16, 132).fma
        assert "fma" not in gconfig.candidates(M, N, K, torch.bfloat16, 132)
    assert "fma" not in gconfig.candidates(65, 3584, 3584, torch.float32, 132)
    cfg = gemm.heuristic(1, 3584, 3584, torch.float32, 132)
    tiles = math.ceil(3584 / cfg.block_n)
    assert cfg.split_k * tiles >= 132 and gcold.fma_bound_us(1, 3584, 3584) == pytest.approx(12.0, abs=0.1)


def test_probe_fp32_small_parses_and_dry_runs():
    """experiments/probes/probe_gemm_gaps.py --fp32-small (a GPU timing) lists what it would time
    without a GPU: every fp32 zoo shape with M <= 64, both B layouts, the FMA kernel first."""
    probe = str(ROOT / "experiments" / "probes" / "probe_gemm_gaps.py")
    r = subprocess.run([sys.executable, probe, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "--fp32-small" in r.stdout and "--dry-run" in r.stdout, r.stderr
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, probe, "--out", "unused", "--fp32-small", "--dry-run"], capture_output=True,
                       text=True, timeout=120, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    fma = [line.split() for line in r.stdout.splitlines() if line.split()[2:3] == ["fma"]]
    want = {(f"{M}x{N}x{K}", layout) for M, N, K in FP32_SMALL_M for layout in ("row", "t")}
    assert want <= {(f[0], f[1]) for f in fma} and all(f[-1] == "fma" for f in fma)
    assert "tf32_rule" in r.stdout and "swap" in r.stdout and "cublas_fp32" in r.stdout


def test_heuristic_pads_unaligned_operands():
    cfg = gemm.heuristic(2313, 1024, 113, num_sms=132, gluon=False, tma=False)
    assert cfg.pad and cfg.tma is not False and not cfg.gluon
    assert gcold.pad_bytes(2313, 1024, 113, torch.bfloat16) == 2313 * 113 * 2   # A only: N is aligned


def test_gluon_config_validation_and_cpu_refusal():
    with pytest.raises(ValueError, match="gluon="):
        gconfig.validate_config(gemm.GemmConfig(gluon="warp"))
    with pytest.raises(ValueError, match="stream_k"):
        gconfig.validate_config(gemm.GemmConfig(gluon="coop", stream_k=True))
    with pytest.raises(ValueError, match="shared memory"):
        gconfig.validate_config(gemm.GemmConfig(gluon="coop", num_stages=8))
    cfg = gemm.GemmConfig(block_n=128, num_stages=5, gluon="pingpong")
    assert cfg.label() == "gl-pp 128x128x64 s5 g8" and not cfg.ws_config().cooperative
    assert gemm.GemmConfig(block_k=32, num_stages=6, gluon="coop").label().startswith("gl-coop 128x256x32 s6")
    # Sweep constraints see the Gluon kernel's shared memory and per-thread accumulator.
    assert gconfig.smem_bytes(cfg) == gconfig.ws_smem_bytes(cfg.ws_config()) > gconfig.smem_bytes(dataclasses.replace(cfg, gluon=None))
    d = gsweep.derived({"M": 256, "N": 256, "K": 64}, torch.bfloat16, {**cfg.as_params()})
    assert d["acc_regs"] == 128 and d["smem_bytes"] <= d["SMEM_LIMIT"]
    with pytest.raises(ValueError, match="gluon=None"):
        gemm.matmul(torch.randn(64, 64, dtype=torch.bfloat16), torch.randn(64, 64, dtype=torch.bfloat16), cfg)


def test_compile_args_of_a_gluon_config_build_the_ws_kernel():
    args = glaunch.compile_args(gemm.GemmConfig(block_n=128, num_stages=5, gluon="pingpong"))
    assert args["fn"] is ggluon._gemm_ws_kernel
    assert "NVMMASharedLayout" in args["signature"]["a_desc"]


def test_stream_k_needs_the_tma_path():
    with pytest.raises(ValueError, match="stream_k"):
        gemm.matmul(torch.randn(8, 8), torch.randn(8, 8), dict(TINY, tma=False, stream_k=True))


# ------------------------------------------- launch plans (interpreter, CPU)
def _check(c, a, b, dtype=torch.float16):
    ref = a.double() @ b.double()
    assert torch.isfinite(c).all()
    assert ((c.double() - ref).norm() / ref.norm()).item() <= gsweep.tolerance(dtype)


def test_plan_is_reused_for_the_same_signature():
    glaunch._PLANS.clear()
    g = torch.Generator().manual_seed(11)
    a, b = torch.randn(24, 40, generator=g).half(), torch.randn(40, 33, generator=g).half()
    p1 = glaunch.plan_for(a, b, SMALL)
    c = gemm.matmul(a, b, SMALL)
    a2, b2 = torch.randn(24, 40, generator=g).half(), torch.randn(40, 33, generator=g).half()  # fresh values
    c2 = gemm.matmul(a2, b2, SMALL)
    assert glaunch.plan_for(a2, b2, SMALL) is p1 and len(glaunch._PLANS) == 1
    _check(c, a, b)
    _check(c2, a2, b2)


def test_plans_are_separate_where_they_must_be():
    """Same shape but another alignment class, a transposed view, a slice with an
    offset, an output given then not given: each its own plan, each correct."""
    glaunch._PLANS.clear()
    g = torch.Generator().manual_seed(12)
    tma = dict(SMALL, tma=True)
    M, K, N = 32, 64, 48
    a = torch.randn(M, K, generator=g).half()
    b = torch.randn(K, N, generator=g).half()
    _check(gemm.matmul(a, b, tma), a, b)
    # The same shape, one element off 16-byte alignment: the TMA plan must not be reused.
    buf = torch.randn(M * K + 1, generator=g).half()
    a_off = buf[1:].view(M, K)
    assert a_off.data_ptr() % 16 and a_off.shape == a.shape and a_off.stride() == a.stride()
    with pytest.raises(ValueError, match="16-byte aligned"):
        gemm.matmul(a_off, b, tma)
    _check(gemm.matmul(a_off, b, SMALL), a_off, b)   # the pointer path takes it
    # A transposed view of B, and a slice of A with an offset.
    bt = torch.randn(N, K, generator=g).half().t()
    _check(gemm.matmul(a, bt, SMALL), a, bt)
    big = torch.randn(M + 5, K + 7, generator=g).half()
    a_sl = big[3:3 + M, 5:5 + K]
    _check(gemm.matmul(a_sl, b, SMALL), a_sl, b)
    # An output given (poisoned, strided), then not given.
    out = torch.full((M, 2 * N), float("nan"), dtype=torch.float16)[:, ::2]
    c = gemm.matmul(a, b, SMALL, out=out)
    assert c is out and torch.isfinite(out).all()
    _check(out, a, b)
    c2 = gemm.matmul(a, b, SMALL)
    assert c2 is not out and c2.is_contiguous()
    _check(c2, a, b)
    assert len(glaunch._PLANS) == 6


def test_plan_cache_is_bounded(monkeypatch):
    monkeypatch.setattr(glaunch, "_PLANS", glaunch.PlanCache(size=3))
    g = torch.Generator().manual_seed(13)
    for m in range(1, 7):
        a, b = torch.randn(m, 16, generator=g).half(), torch.randn(16, 8, generator=g).half()
        _check(gemm.matmul(a, b, TINY), a, b)
    assert len(glaunch._PLANS) == 3


def test_device_descriptors_only_for_short_eager_kernels(monkeypatch):
    """Device descriptors where switched on, for kernels under DEVICE_DESC_MAX_US by the
    bound (every size by default), never while a CUDA graph is captured (host descriptors go into the graph once);
    each outcome is its own plan."""
    monkeypatch.setattr(glaunch, "_PLANS", glaunch.PlanCache())
    monkeypatch.setattr(glaunch, "DEVICE_DESCRIPTORS", True)
    tma = dict(SMALL, tma=True)
    a, b = torch.randn(64, 96).half(), torch.randn(96, 48).half()
    assert glaunch._descriptors_on_device(64, 48, 96, 2, False, True, True) == (True, True)
    assert glaunch.plan_for(a, b, tma).device_desc
    assert glaunch._descriptors_on_device(8192, 8192, 8192, 2, False, True, True) == (True, True)   # every size
    monkeypatch.setattr(glaunch, "DEVICE_DESC_MAX_US", 20.0)   # a bound keeps host descriptors above it
    assert gconfig.bound_us(8192, 8192, 8192, 2) > glaunch.DEVICE_DESC_MAX_US
    assert glaunch._descriptors_on_device(8192, 8192, 8192, 2, False, True, True) == (False, False)
    monkeypatch.setattr(glaunch, "DEVICE_DESC_MAX_US", gconfig.DEVICE_DESC_MAX_US)
    assert glaunch._descriptors_on_device(64, 48, 96, 2, True, True, True) == (False, False)   # capturing
    assert glaunch._descriptors_on_device(64, 48, 96, 2, False, False, True) == (False, True)
    monkeypatch.setattr(glaunch, "capturing", lambda t: True)
    p = glaunch.plan_for(a, b, tma)
    assert not p.device_desc and p.kind == "tma"
    assert len(glaunch._PLANS) == 2
    monkeypatch.setattr(glaunch, "capturing", lambda t: False)
    assert glaunch.plan_for(a, b, tma).device_desc and len(glaunch._PLANS) == 2
    monkeypatch.setattr(glaunch, "DEVICE_DESC_MAX_US", 0.0)   # the bound is part of the key too
    assert not glaunch.plan_for(a, b, tma).device_desc and len(glaunch._PLANS) == 3


def test_device_descriptors_only_where_legal(monkeypatch):
    """DEVICE_DESCRIPTORS on: the TMA plans (persistent and split-K) encode their
    descriptors in the kernel where every descriptor is legal there; elsewhere the
    host-descriptor or pointer plan they had before. The setting is part of the key."""
    from kernels.gemm.triton import _gemm_splitk_kernel, _gemm_tma_dev_kernel, _gemm_tma_kernel

    monkeypatch.setattr(glaunch, "_PLANS", glaunch.PlanCache())
    tma, split = dict(SMALL, tma=True), dict(SPLIT, tma=True, split_k=2)
    a, b = torch.randn(64, 96).half(), torch.randn(96, 48).half()
    monkeypatch.setattr(glaunch, "DEVICE_DESCRIPTORS", False)
    p = glaunch.plan_for(a, b, tma)
    assert (p.kind, p.device_desc, p.launch.fn) == ("tma", False, _gemm_tma_kernel)
    monkeypatch.setattr(glaunch, "DEVICE_DESCRIPTORS", True)
    p = glaunch.plan_for(a, b, tma)
    assert (p.kind, p.device_desc, p.launch.fn) == ("tma", True, _gemm_tma_dev_kernel)
    assert p.args[:6] == (96, 48, 48, 64, 48, 96)   # row strides of A, B, C, then M, N, K
    assert len(glaunch._PLANS) == 2
    # C given with rows TMA cannot store: no TMA store, so A and B alone decide.
    c_odd = torch.empty(64, 50).half()[:, :48]
    p = glaunch.plan_for(a, b, dict(tma, tma_store=False), c_odd)
    assert p.device_desc and p.args[2] == 50
    # A broadcast along M (row stride 0): a host descriptor takes it, a device one may not.
    a_bc = torch.randn(1, 96).half().expand(64, 96)
    p = glaunch.plan_for(a_bc, b, tma)
    assert (p.kind, p.device_desc) == ("tma", False)
    # pad=True: the aligned copies' row strides (K=33, N=41 -> 40 and 48 columns).
    a33, b41 = torch.randn(5, 33).half(), torch.randn(33, 41).half()
    p = glaunch.plan_for(a33, b41, dict(tma, tma_store=False, pad=True))
    assert (p.kind, p.device_desc, p.pad_a, p.pad_b) == ("tma", True, 40, 48) and p.args[:2] == (40, 48)
    # Split-K: aligned -> device descriptors, no host boxes; unaligned rows -> pointer loads.
    p = glaunch.plan_for(a, b, split)
    assert (p.kind, p.device_desc, p.blocks, p.launch.fn) == ("splitk", True, (), _gemm_splitk_kernel)
    assert p.launch.kwargs["DEVICE_DESC"] and p.launch.kwargs["USE_TMA"]
    p = glaunch.plan_for(a33, b41, dict(SPLIT, split_k=2))
    assert (p.kind, p.device_desc) == ("splitk", False) and not p.launch.kwargs["USE_TMA"]
    # No TMA asked for (the pointer kernel), or an operand TMA cannot address at all.
    assert not glaunch.plan_for(a, b, SMALL).device_desc
    a_off = torch.randn(64 * 96 + 1).half()[1:].view(64, 96)
    assert not glaunch.plan_for(a_off, b, SMALL).device_desc


def test_device_desc_ok():
    ok = glaunch.device_desc_ok
    t = torch.randn(16, 24).half()
    assert ok(t) and ok(None, 16, 24, 24, 2) and ok(torch.randn(4, 8, dtype=torch.float32))
    assert not ok(t.t())                                      # inner stride 16
    assert not ok(torch.randn(16 * 24 + 1).half()[1:].view(16, 24))   # base off 16-byte alignment
    assert not ok(torch.randn(16, 25).half()[:, :24])        # 50-byte rows
    assert not ok(torch.randn(1, 24).half().expand(16, 24))  # row stride 0
    assert not ok(None, 2**31, 8, 8, 2) and not ok(None, 0, 8, 8, 2) and not ok(None, 4, 8, 4, 2)


def test_wrong_out_is_refused_before_anything_is_written():
    a, b = torch.randn(8, 16).half(), torch.randn(16, 8).half()
    out = torch.full((8, 9), 7.0, dtype=torch.float16)
    with pytest.raises(ValueError, match="out must be"):
        gemm.matmul(a, b, TINY, out=out)
    assert (out == 7.0).all()


# ------------------------------------------------------------- the shape zoo
def _zoo():
    sys.path.insert(0, str(ROOT / "experiments"))
    from run_gemm_zoo import load_shapes

    return load_shapes()


def test_zoo_is_what_the_generator_writes():
    r = subprocess.run([sys.executable, str(ROOT / "experiments" / "make_gemm_shapes.py"), "--check"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    zoo = _zoo()
    bf16 = [s for s in zoo if s["dtype"] == "bfloat16"]
    assert len(bf16) >= 80
    assert sum(s["source"].startswith("irregular") for s in bf16) >= 40
    assert {s["dtype"] for s in zoo} == {"bfloat16", "float16", "float32"}
    halves = {s["split"] for s in bf16}
    assert halves == {"fit", "held_out"}


def test_heuristic_gives_a_valid_config_for_every_zoo_shape():
    """No GPU needed: every zoo shape (aligned or not) gets a config that validates,
    fits sm_90's shared memory and keeps the accumulator within the registers."""
    for s in _zoo():
        dtype = getattr(torch, s["dtype"])
        es = dtype.itemsize
        aligned = (s["K"] * es) % 16 == 0 and (s["N"] * es) % 16 == 0
        cfg = gemm.heuristic(s["M"], s["N"], s["K"], dtype, 132, gluon=aligned, tma=aligned)
        gconfig.validate_config(cfg)
        assert gconfig.smem_bytes(cfg, es) <= gconfig.SMEM_LIMIT_SM90, (s, cfg)
        warps = 8 if cfg.gluon == "coop" else 4 if cfg.gluon else cfg.num_warps
        assert cfg.block_m * cfg.block_n // (32 * warps) <= 128, (s, cfg)
        if not aligned:
            assert not cfg.gluon and not cfg.stream_k and cfg.tma is not True, (s, cfg)


@pytest.mark.gpu
def test_gpu_heuristic_on_the_zoo():
    """matmul with no config on every zoo shape up to 1e11 FLOP, outputs poisoned."""
    for s in _zoo():
        if 2 * s["M"] * s["N"] * s["K"] > 1e11:
            continue
        dtype = getattr(torch, s["dtype"])
        inp = gsweep.make_inputs(s, dtype, "cuda", seed=7)
        gsweep.poison(inp)
        gemm.matmul(inp.a, inp.b, out=inp.out)
        ref = gemm.reference(inp)
        assert torch.isfinite(inp.out).all(), s
        err = ((inp.out.float() - ref).norm() / ref.norm()).item()
        assert err <= gsweep.tolerance(dtype), (s, err)


_XC_SMEM_SCRIPT = textwrap.dedent("""
    import json, sys, tempfile
    sys.path.insert(0, {root!r})
    import torch
    from kernels.gemm import launch as glaunch
    from kernels.gemm.config import GemmConfig
    from workbench.asm.compile import cross_compile
    out = []
    for params, dt in json.loads(sys.argv[1]):
        e = cross_compile(targets="sm90", cache_dir=tempfile.mkdtemp(),
                          **glaunch.compile_args(GemmConfig(**params), getattr(torch, dt)))[0]
        out.append(e.metadata.get("shared"))
    print(json.dumps(out))
""")


def test_heuristic_fp32_configs_fit_shared_memory_as_compiled():
    """The fp32 (tf32) configs the heuristic gives the zoo, cross-compiled for sm_90:
    Triton's own shared-memory count (which adds a K-major copy of B that the
    16-bit kernels do not need) stays within the 227 KiB an sm_90 block may use."""
    try:
        import workbench.asm.compile  # noqa: F401
    except Exception as exc:
        pytest.skip(f"workbench.asm.compile not available: {exc}")
    cfgs = set()
    for s in _zoo():
        if s["dtype"] != "float32":
            continue
        aligned = s["K"] % 4 == 0 and s["N"] % 4 == 0
        cfgs.add(gemm.heuristic(s["M"], s["N"], s["K"], torch.float32, 132, gluon=False, tma=aligned,
                                c_aligned=s["N"] % 4 == 0))
    todo = [(dataclasses.asdict(c), "float32") for c in cfgs]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _XC_SMEM_SCRIPT.format(root=str(ROOT)), json.dumps(todo)],
                       capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    shared = json.loads(r.stdout.strip().splitlines()[-1])
    for (params, _), smem in zip(todo, shared):
        assert smem <= gconfig.SMEM_LIMIT_SM90, (params, smem)


@pytest.mark.parametrize("tiles,k_steps", [(48, 32), (15, 23), (1, 100), (200, 64), (132, 2), (7, 1)])
def test_split_for_leaves_no_empty_piece_and_no_extra_round(tiles, k_steps):
    split = gconfig.split_for(tiles, k_steps, 132)
    pieces, per = gconfig.split_pieces(k_steps, split)
    assert pieces == split and (pieces - 1) * per < k_steps <= pieces * per   # every piece has K-steps
    if tiles < 132 and split > 1:
        assert tiles * pieces <= 132 or per >= gconfig.SPLIT_MIN_STEPS  # a second round only when pieces stay long
    if tiles >= 132:
        assert split == 1 or math.ceil(tiles * split / 132) * per < math.ceil(tiles / 132) * k_steps


def test_plan_pads_only_what_tma_cannot_address(monkeypatch):
    """pad=True copies A when K's rows are unaligned and B when N's are, nothing else."""
    monkeypatch.setattr(glaunch, "_PLANS", glaunch.PlanCache())
    cfg = dict(SPLIT, tma=True, pad=True, split_k=2)
    for (M, N, K), (pa, pb) in {(5, 40, 33): (40, 0), (5, 33, 40): (0, 40), (5, 33, 33): (40, 40),
                                (5, 40, 40): (0, 0)}.items():
        a = torch.randn(M, K).to(torch.bfloat16)
        b = torch.randn(K, N).to(torch.bfloat16)
        p = glaunch.plan_for(a, b, cfg)
        assert (p.kind, p.pad_a, p.pad_b) == ("splitk", pa, pb)
        if pa:
            ap = glaunch._padded(a, pa)
            assert ap.stride(0) == pa and torch.equal(ap, a)


def test_quick_run_sweeps_a_subset_of_the_committed_sweep():
    """`run_gemm_tiling.py --quick` (the notebook's quick run) sweeps the spec's first three
    shapes; every such point is one of the committed full sweep's, and the goal table it
    compares keeps the committed table's shapes."""
    import pandas as pd

    sys.path.insert(0, str(ROOT / "experiments"))
    try:
        import run_gemm_tiling as run
    finally:
        sys.path.remove(str(ROOT / "experiments"))
    res = subprocess.run([sys.executable, str(ROOT / "experiments" / "run_gemm_tiling.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--quick" in res.stdout and "--sweep-shapes" in res.stdout, res.stderr
    spec = str(ROOT / "experiments" / "gemm_tiling.yaml")
    n, shapes = run._first_shapes_points(spec, False, run.QUICK_SWEEP_SHAPES)
    goal = [tuple(v for _, v in s) for s in shapes]
    assert goal == [tuple(s) for s in run.GOAL_SHAPES[:3]] and n == 222
    from workbench.spec import load_spec
    from workbench.sweep import expand

    rows = pd.read_parquet(ROOT / "results" / "gemm_tiling" / "rows.parquet")
    committed = set(zip(rows.study, rows.M, rows.N, rows.K, rows.variant, rows.config))
    quick = set()
    for p in expand(load_spec(spec)):
        m, nn, k = (v for _, v in p.shape)
        if (m, nn, k) not in goal:
            continue
        label = "cublas" if p.baseline else gemm.GemmConfig(**dict(p.params)).label()
        quick.add((p.study, m, nn, k, p.baseline or "triton", label))
    assert len(quick) == n and quick <= committed, sorted(quick - committed)[:5]
    table = pd.read_csv(ROOT / "results" / "gemm_tiling" / "heuristic_vs_cublas_eager_graph_run13.csv")
    assert set(zip(table.M, table.N, table.K)) == set(run.GOAL_SHAPES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's run of the probe kernel (CPU)")
def test_pitch_probe_views_and_pointer_kernel_are_right():
    """experiments/probes/probe_gemm_pitch.py times a problem as contiguous tensors and as views into
    buffers with 128-byte rows: the views hold the same values at a padded pitch. Its pointer-load
    kernel (probe_gemm_cpasync.py), given strides, N and K divided by 8, is right on both layouts
    with a ragged last K step and partial tiles, into a NaN-poisoned C."""
    from kernels.common import interpreter

    from experiments.probes.probe_gemm_cpasync import run
    from experiments.probes.probe_gemm_pitch import padded_view

    interpreter.patch()
    g = torch.Generator().manual_seed(43)
    M, N, K = 70, 104, 88
    a = torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(K, N, generator=g).bfloat16()
    pa, pb = padded_view(a), padded_view(b)
    assert pa.stride(0) == 128 and pb.stride(0) == 128 and torch.equal(pa, a) and torch.equal(pb, b)
    ref = a.double() @ b.double()
    for x, y in ((a, b), (pa, pb)):
        for cache in ("", ".ca"):
            c = torch.full((M, N), float("nan")).bfloat16()
            run(x, y, c, (32, 64, 32, 4, 2, cache), 3)
            err = float((c.double() - ref).norm() / ref.norm())
            assert err < 1e-2, (x.stride(), cache, err)


def test_library_calls_skip_the_plan_lookup_on_their_short_key(monkeypatch):
    """A signature whose plan is the library's goes to torch.mm on a key of shapes, strides, dtypes
    and ``tune`` alone, from its second call: planning is not asked again. A different stride, a
    dtype, an explicit config or an out= still plan; clear_plans() forgets the short keys too."""
    from kernels.gemm.plan import GemmPlan

    planned = []

    def fake_plan_for(a, b, config=None, out=None, tune=None):
        planned.append((tuple(a.stride()), a.dtype, config is not None, out is not None))
        return GemmPlan("library", a.shape[0], b.shape[1], a.shape[1])

    monkeypatch.setattr(glaunch, "plan_for", fake_plan_for)
    glaunch.clear_plans()
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(24, 40, generator=g), torch.randn(40, 16, generator=g)
    ref = a.double() @ b.double()
    for _ in range(3):
        c = glaunch.matmul(a, b)
        assert torch.allclose(c.double(), ref, rtol=1e-4, atol=1e-4)
    assert len(planned) == 1
    glaunch.matmul(a.t().contiguous().t(), b)          # another stride: planned
    glaunch.matmul(a.double(), b.double())              # another dtype: planned
    glaunch.matmul(a, b, tune=True)                     # tuning asked: its own key
    out = torch.full((24, 16), float("nan"))
    glaunch.matmul(a, b, out=out)                       # out= always plans (it is checked there)
    assert torch.allclose(out.double(), ref, rtol=1e-4, atol=1e-4)
    assert len(planned) == 5 and planned[-1][3]
    glaunch.clear_plans()
    glaunch.matmul(a, b)
    assert len(planned) == 6
    glaunch.clear_plans()


def test_pitch_split_of_the_committed_times_is_the_readmes():
    """probe_gemm_pitch.py --from-times (no GPU) splits the best of ours over cuBLAS by which operands'
    rows are whole 128-byte lines: on the committed H200 times, what results/gemm_selection/README.md
    cites (large shapes: 1.001x with both, 0.818x with neither, 34 and 24 shapes)."""
    from experiments.probes.probe_gemm_pitch import pitch_split

    sel = ROOT / "results" / "gemm_selection"
    split = pitch_split([sel / "h200" / "times_gemm.csv", sel / "h200_regions" / "times_gemm.csv",
                         sel / "h200_narrow_pad" / "times_gemm.csv"]).set_index(["large", "pitch"])
    assert set(split.index.get_level_values("pitch")) <= {"AB", "Ab", "aB", "ab"}
    assert split.loc[(True, "AB"), "shapes"] == 34 and split.loc[(True, "ab"), "shapes"] == 24
    assert split.loc[(True, "AB"), "ours_vs_cublas_geomean"] == pytest.approx(1.001, abs=5e-4)
    assert split.loc[(True, "ab"), "ours_vs_cublas_geomean"] == pytest.approx(0.818, abs=5e-4)
    assert (split.least <= split.ours_vs_cublas_geomean).all()
