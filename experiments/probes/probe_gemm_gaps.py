"""Probe: which cuBLAS kernel runs the zoo shapes where kernels.gemm lags, and how other tilings fare.

    PYTHONUNBUFFERED=1 python experiments/probes/probe_gemm_gaps.py --out results/gemm_zoo/gaps

1. ``cublas_kernels.csv``: for every shape, the kernels ``torch.matmul`` launches
   (names from ``torch.profiler``; cuBLAS names carry the tile, cluster and
   whether it splits K or streams), with their mean GPU time.
2. ``configs.csv``: extra configurations of ours (tilings the heuristic does not
   offer, fp32 tilings with B copied K-major or not), and
   the heuristic with B K-major (``x @ w.t()``, an nn.Linear weight), each
   checked against the fp32 reference on a NaN-poisoned output, then timed
   against cuBLAS by ``workbench.bench.interleave`` (CUDA-graph replays, L2
   flushed, taking turns). fp32 runs on the tensor cores (tf32) in both.
3. ``--mid-m`` alone -> ``mid_m.csv``: M 64-1024 with few tiles and a long K, the
   split-K kernel's tiles at several splits against the persistent ones.
4. ``--tail`` alone -> ``tail.csv``: the last, partial round's tiles in 2 or 4 column
   slices (``GemmConfig.tail_split``) against the same tile whole and stream-K.
5. ``--wide`` alone -> ``wide.csv``: tiles between the powers of two (``GemmConfig.extra_n``:
   128 rows by 144-320 columns, two MMAs per K-step) on the 1-4 round shapes, against
   the 128x256 and 128x128 tiles (whole and with their tail slices) and cuBLAS, whose
   kernels on these shapes use such widths (``cublas_kernels.csv``).
6. ``--fp32-small`` alone -> ``fp32_small.csv``: the zoo's fp32 shapes with M <= 64,
   B row-major and K-major: the FMA kernel as the heuristic configures it and
   variants of it, the tf32 kernel the cost model picks without it (the split-K
   "swap" kernel), cuBLAS with tf32 (as the zoo compares) and in true fp32; each
   checked against float64 on a NaN-poisoned output (the FMA kernel and fp32
   cuBLAS to 1e-5, tf32 to 2e-3), timed as CUDA-graph replays. ``--dry-run``
   prints what it would time and needs no GPU.
Rows carry provenance; a shape whose budget is spent is skipped and said so.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# The zoo's worst held-out and fit shapes (results/gemm_zoo/final.csv, run 4).
EDGE = [(1539, 2824, 4224), (771, 2352, 4280), (2958, 3120, 2144), (909, 4152, 2912), (519, 5920, 6856),
        (1024, 4608, 3584), (2440, 4112, 6736), (128, 37888, 3584), (256, 24576, 1536)]
SMALL = [(64, 2048, 768), (32, 7168, 16384), (1, 57344, 8192), (43, 72, 360), (12075, 8, 896)]
FP32 = [(1024, 8192, 8192), (2958, 3120, 2144), (128, 4096, 4096), (16384, 128, 2880), (64, 3584, 3584),
        (1, 3584, 3584), (10, 7770, 11683)]

_ST = dict(tma_store=False, group_m=8)
EDGE_CONFIGS = {
    "t128x128sk": dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6, stream_k=True, **_ST),
    "t128x256sk_st": dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, stream_k=True, **_ST),
    "t256x128": dict(block_m=256, block_n=128, block_k=64, num_warps=8, num_stages=4, **_ST),
    "t64x256": dict(block_m=64, block_n=256, block_k=64, num_warps=4, num_stages=5, **_ST),
    "t128x256": dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, **_ST),
}
# fp32 on the persistent kernel copies B K-major first (transpose_b, the default for fp32);
# "ntb": the same tile reading B N-major (the tiles' re-layout through registers).
FP32_CONFIGS = {
    "f128x256x32s2": dict(block_m=128, block_n=256, block_k=32, num_warps=8, num_stages=2, **_ST),
    "f128x256x32s2ntb": dict(block_m=128, block_n=256, block_k=32, num_warps=8, num_stages=2, transpose_b=False,
                             **_ST),
    "f128x128x32s4": dict(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=4, **_ST),
    "f128x128x32s4w4": dict(block_m=128, block_n=128, block_k=32, num_warps=4, num_stages=4, **_ST),
    "f128x128x64s2": dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=2, **_ST),
    "f64x128x64s3": dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3, **_ST),
    "f128x64x64s3": dict(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=3, **_ST),
    "f64x256x32s4": dict(block_m=64, block_n=256, block_k=32, num_warps=4, num_stages=4, **_ST),
    "f128x128x32s4tma": dict(block_m=128, block_n=128, block_k=32, num_warps=8, num_stages=4, group_m=8),
}
# B as x @ w.t() passes an nn.Linear weight: K-major (bf16, real-model layers of the zoo).
LINEAR = [(4096, 14336, 4096), (1024, 8192, 8192), (512, 128256, 4096), (2048, 4096, 4096), (256, 24576, 4096),
          (16, 4096, 14336), (1, 57344, 8192), (64, 6144, 4096), (16384, 4608, 3584)]


def cublas_kernels(shapes, dtype, prov) -> list[dict]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    rows = []
    for M, N, K in shapes:
        a = torch.randn(M, K, device="cuda").to(dtype)
        b = torch.randn(K, N, device="cuda").to(dtype)
        torch.matmul(a, b)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                torch.matmul(a, b)
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if ev.device_type.name == "CUDA" and ev.count:
                rows.append(dict(M=M, N=N, K=K, dtype=str(dtype).split(".")[-1], kernel=ev.key[:300],
                                 calls=ev.count, mean_us=ev.device_time_total / ev.count, **prov))
    return rows


def check_each(fns: dict, c, ref, label, tol) -> tuple[dict, dict, dict]:
    """Run every callable once into ``c`` poisoned with NaN, against ``ref``; one that
    raises or misses ``tol(name, label)`` (relative error) is dropped from ``fns`` (not
    timed). Returns (status, labels, errors) by name; ``label(name)`` names what ran."""
    import torch

    status, labels, errs = {}, {}, {}
    for name, fn in list(fns.items()):
        c.fill_(float("nan"))
        try:
            fn()
            torch.cuda.synchronize()
            errs[name] = err = float((c.double() - ref).norm() / ref.norm())
            labels[name] = label(name)
            bound = tol(name, labels[name])
            status[name] = "ok" if err <= bound else f"wrong: rel_err {err:.2e} > {bound:.0e}"
        except Exception as exc:
            status[name] = f"error: {type(exc).__name__}: {str(exc)[:160]}"
        if status[name] != "ok":
            del fns[name]
    return status, labels, errs


def time_configs(shapes, dtype, configs: dict, args, prov, b_layout: str = "row") -> list[dict]:
    import torch

    from kernels import gemm
    from kernels.gemm import launch as glaunch, sweep as gsweep
    from workbench import bench

    rows, t0 = [], time.time()
    for i, (M, N, K) in enumerate(shapes):
        if time.time() - t0 > args.budget_s:
            print(f"budget spent: {len(shapes) - i} {dtype} shapes not run", flush=True)
            break
        shape = dict(M=M, N=N, K=K)
        inp = gsweep.make_inputs(shape, dtype, "cuda", seed=77 + i)
        ref = gemm.reference(inp)
        a, b, c = inp.a, inp.b, inp.out
        if b_layout == "t":   # same values, K-major: the transposed view of an (N, K) tensor
            b = b.t().contiguous().t()
        fns = {"cublas": lambda: gemm.cublas(a, b, out=c), "heuristic": lambda: gemm.matmul(a, b, out=c)}
        fns.update({n: (lambda p=p: gemm.matmul(a, b, p, out=c)) for n, p in configs.items()})
        status, labels, _ = check_each(
            fns, c, ref, lambda name: "cuBLAS" if name == "cublas" else glaunch.plan_for(
                a, b, None if name == "heuristic" else configs[name], c).config.label(),
            lambda name, label: gsweep.tolerance(dtype))
        t = bench.interleave(fns, warmup_ms=20, rep_ms=args.rep_ms, min_reps=10, max_reps=100, mode="graph")
        base = t["cublas"].median_ms if "cublas" in t else float("nan")
        for name in list(configs) + ["heuristic", "cublas"]:
            tm = t.get(name)
            ms = tm.median_ms if tm else float("nan")
            rows.append(dict(M=M, N=N, K=K, dtype=str(dtype).split(".")[-1], b_layout=b_layout, variant=name,
                             config=labels.get(name, ""), status=status.get(name, "not timed"), mode="graph",
                             median_ms=ms, tflops=2 * M * N * K / ms / 1e9 if tm else float("nan"),
                             ratio_vs_cublas=base / ms if tm else float("nan"), cublas_ms=base, **prov))
            print(f"{M}x{N}x{K} {dtype} {name:16s} {labels.get(name, ''):40s} {ms * 1e3:9.1f} us "
                  f"{base / ms if tm else float('nan'):6.3f}x  {status.get(name, '')}", flush=True)
        del ref, inp
    return rows


# Stream-K on 1-3 round shapes: the split of the partial round's tiles (SK_MAX_SPLIT programs per
# tile at most), against the data-parallel kernel and one exactly full round (1536x2816: 132 tiles).
SK_SHAPES = [(1539, 2824, 4224), (1536, 2816, 4224), (771, 2352, 4280), (2958, 3120, 2144), (909, 4152, 2912)]
SK_SPLITS = (2, 4, 8, 16)


def time_stream_k(args, prov) -> list[dict]:
    """Each SK_MAX_SPLIT gets its own plan cache (plans are keyed by call signature,
    not by this module constant), swapped in before its calls."""
    import torch

    from kernels import gemm
    from kernels.gemm import cold as gcold, config as gconfig, launch as glaunch, sweep as gsweep
    from workbench import bench

    base = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, tma_store=False)
    default_split, rows = gconfig.SK_MAX_SPLIT, []
    for i, (M, N, K) in enumerate(SK_SHAPES):
        inp = gsweep.make_inputs(dict(M=M, N=N, K=K), torch.bfloat16, "cuda", seed=300 + i)
        ref = gemm.reference(inp)
        a, b, c = inp.a, inp.b, inp.out
        caches = {split: glaunch.PlanCache() for split in SK_SPLITS}

        def run(cfg, split=None):
            if split is not None:
                gconfig.SK_MAX_SPLIT, glaunch._PLANS = split, caches[split]
            gemm.matmul(a, b, cfg, out=c)

        fns = {"cublas": lambda: gemm.cublas(a, b, out=c), "dp": lambda: run(base)}
        fns.update({f"sk{split}": (lambda split=split: run(dict(base, stream_k=True), split)) for split in SK_SPLITS})
        status = {}
        saved = glaunch._PLANS
        for name, fn in list(fns.items()):
            c.fill_(float("nan"))
            fn()
            torch.cuda.synchronize()
            err = float((c.float() - ref).norm() / ref.norm())
            status[name] = "ok" if err <= gsweep.tolerance(torch.bfloat16) else f"wrong: rel_err {err:.2e}"
            if status[name] != "ok":
                del fns[name]
        t = bench.interleave(fns, warmup_ms=20, rep_ms=args.rep_ms, min_reps=10, max_reps=100, mode="graph")
        gconfig.SK_MAX_SPLIT, glaunch._PLANS = default_split, saved
        base_ms = t["cublas"].median_ms
        for name in fns:
            plan = None
            if name.startswith("sk"):
                gconfig.SK_MAX_SPLIT = int(name[2:])
                plan = glaunch._plan(a, b, c, dict(base, stream_k=True))
                gconfig.SK_MAX_SPLIT = default_split
            ms = t[name].median_ms
            rows.append(dict(M=M, N=N, K=K, dtype="bfloat16", variant=name, status=status[name], mode="graph",
                             median_ms=ms, tflops=2 * M * N * K / ms / 1e9, ratio_vs_cublas=base_ms / ms,
                             cublas_ms=base_ms, sk_tiles=plan.sk_tiles if plan else 0,
                             sk_programs=plan.args[6] if plan and plan.sk_tiles else 0, **prov))
            print(f"{M}x{N}x{K} {name:8s} {ms * 1e3:8.1f} us {base_ms / ms:6.3f}x  {status[name]}", flush=True)
    return rows


# --mid-m: M 64-1024 with few output tiles (under two rounds of 128x128) and a long K, where the
# persistent kernel leaves SMs idle: the split-K kernel's tiles at several splits against the
# persistent tiles of the same size (the fused GEMM + all-scatter's open shapes first).
MID_SHAPES = [(128, 4096, 14336), (256, 2048, 14336), (64, 4096, 4096), (128, 4096, 4096), (256, 4096, 14336),
              (128, 8192, 28672), (512, 4096, 12288), (521, 2080, 5152), (128, 37888, 3584), (165, 3168, 8009),
              (771, 2352, 4280), (909, 4152, 2912), (519, 5920, 6856), (1024, 4608, 3584), (256, 14336, 4096)]
MID_TILES = {   # name -> (BM, BN, warps, stages); BLOCK_K 64
    "k64x128": (64, 128, 4, 5), "k64x128s6": (64, 128, 4, 6), "k128x128": (128, 128, 8, 4),
    "k128x128w4": (128, 128, 4, 6), "k128x256": (128, 256, 8, 4), "k64x256": (64, 256, 4, 4),
}
MID_SPLITS = (1, 2, 3, 4, 6)


def mid_m_configs(M: int, N: int, K: int, num_sms: int) -> dict:
    """Persistent 64x128 / 128x128 / 128x256 tiles, and each MID_TILES tile in the split-K kernel at
    every MID_SPLITS split whose programs fit in two rounds (plus the split ``split_for`` picks)."""
    import math

    from kernels.gemm import cold as gcold, config as gconfig

    st = dict(tma_store=False, group_m=8)
    out = {"t64x128": dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=6, **st),
           "t128x128": dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6, **st),
           "t128x256": dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, **st)}
    for name, (bm, bn, w, s) in MID_TILES.items():
        tiles = math.ceil(M / bm) * math.ceil(N / bn)
        rule = gconfig.split_for(tiles, math.ceil(K / 64), num_sms)
        for split in sorted(set(MID_SPLITS) | {rule}):
            if tiles * split <= 2 * num_sms or split == rule:
                out[f"{name}_k{split}"] = dict(block_m=bm, block_n=bn, block_k=64, num_warps=w, num_stages=s,
                                               tma_store=False, split_k=split)
    return out


def time_mid_m(args, prov) -> list[dict]:
    import torch

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, t0 = [], time.time()
    for M, N, K in MID_SHAPES:
        if time.time() - t0 > args.budget_s:
            print(f"budget spent: {M}x{N}x{K} and later not run", flush=True)
            break
        rows += time_configs([(M, N, K)], torch.bfloat16, mid_m_configs(M, N, K, sms), args, prov)
    return rows


# --tail: the last, partial round of a persistent tile in column slices (GemmConfig.tail_split)
# against the same tile whole, stream-K's K-split tail and cuBLAS, on the zoo's 1-4 round tile-edge
# shapes (both halves) and a few multi-round ones.
TAIL_SHAPES = [(1539, 2824, 4224), (771, 2352, 4280), (2958, 3120, 2144), (909, 4152, 2912), (519, 5920, 6856),
               (1024, 4608, 3584), (2440, 4112, 6736), (521, 2080, 5152), (1536, 2816, 4224), (8192, 8192, 8192),
               (4096, 14336, 4096), (16384, 4608, 3584), (2048, 7168, 2048)]
_T256 = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4, **_ST)
_T128 = dict(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6, **_ST)
TAIL_CONFIGS = {"t128x256": _T256, "t128x256ts2": dict(_T256, tail_split=2), "t128x256ts4": dict(_T256, tail_split=4),
                "t128x256sk": dict(_T256, stream_k=True), "t128x128": _T128,
                "t128x128ts2": dict(_T128, tail_split=2), "t128x128ts4": dict(_T128, tail_split=4)}


# --wide: 128-row tiles block_n + extra_n wide (GemmConfig.extra_n), the widths cuBLAS's kernels take on
# the 1-4 round shapes (256x144, 128x232, ...): fewer rounds, or a last round that fills more SMs, at the
# price of a second, narrower MMA per K-step. Stages: as many as fit in shared memory (sm_90
# cross-compiles: the plain-store epilogue takes 32 KiB more at 8 warps, 8 KiB at 4).
WIDE_SHAPES = TAIL_SHAPES + [(128, 37888, 3584), (256, 24576, 1536), (256, 24576, 4096), (4861, 1104, 184)]
_W8 = dict(block_m=128, block_k=64, num_warps=8, **_ST)
_W4 = dict(block_m=128, block_k=64, num_warps=4, **_ST)
WIDE_CONFIGS = {"t128x256": _T256, "t128x256ts4": dict(_T256, tail_split=4), "t128x128": _T128,
                "t128x128ts4": dict(_T128, tail_split=4),
                "w128x320": dict(_W8, block_n=256, extra_n=64, num_stages=3),
                "w128x288": dict(_W8, block_n=256, extra_n=32, num_stages=3),
                "w128x192": dict(_W8, block_n=128, extra_n=64, num_stages=4),
                "w128x160": dict(_W8, block_n=128, extra_n=32, num_stages=4),
                "w128x160w4": dict(_W4, block_n=128, extra_n=32, num_stages=5),
                "w128x144": dict(_W4, block_n=128, extra_n=16, num_stages=6),
                "w128x96": dict(_W4, block_n=64, extra_n=32, num_stages=6)}


# --fp32-small: the FMA kernel (GemmConfig.fma) at the zoo's fp32 shapes with M <= 64.
FMA_TOL = 1e-5   # true fp32 against float64 (tests/test_gemm.py FMA_TOL says why)


def fp32_small_shapes() -> list[tuple[int, int, int]]:
    sys.path.insert(0, str(ROOT / "experiments"))
    from run_gemm_zoo import load_shapes

    from kernels.gemm.config import SMALL_M

    return sorted({(s["M"], s["N"], s["K"]) for s in load_shapes() if s["dtype"] == "float32" and s["M"] <= SMALL_M})


def fp32_small_variants(M: int, N: int, K: int, num_sms: int, b_kmajor: bool, aligned: bool) -> dict:
    """name -> config ("fma": the FMA kernel's own tiles, ``fma_config``; None: the heuristic,
    which takes them for M <= FMA_MAX_M with B row-major, the tf32 rule otherwise)."""
    import torch

    from kernels.gemm import cold as gcold, config as gconfig

    rule = gconfig.fma_config(M, N, K, num_sms, b_kmajor)
    pieces = rule.split_k
    dot_m = min(64, max(16, 1 << max(0, M - 1).bit_length()))
    out = {
        "fma": rule,
        "heuristic": None,
        "fma_split_half": dataclasses.replace(rule, split_k=max(1, pieces // 2)),
        "fma_split_double": dataclasses.replace(rule, split_k=2 * pieces),
        "fma_rows8": gconfig.GemmConfig(block_m=min(8, dot_m), block_n=512, block_k=4, num_warps=4, num_stages=1,
                                        tma_store=False, fma=True),
        "fma_dot_n128": gconfig.GemmConfig(block_m=dot_m, block_n=128, block_k=32, num_warps=4, num_stages=3,
                                           tma_store=False, fma=True),
        "fma_dot_n64": gconfig.GemmConfig(block_m=dot_m, block_n=64, block_k=32, num_warps=4, num_stages=4,
                                          tma_store=False, fma=True),
        # What the heuristic ran before the FMA kernel: the cost model's tf32 pick (the "swap" kernel).
        "tf32_rule": gcold.cost_model_rule(M, N, K, torch.float32, num_sms, gluon=False, tma=aligned),
    }
    return out


def _cublas_fp32(a, b, c):
    """cuBLAS without tf32 (its gemv at M = 1, an FFMA sgemm otherwise)."""
    import torch

    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        torch.matmul(a, b, out=c)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def time_fp32_small(args, prov) -> list[dict]:
    import torch

    from kernels import gemm
    from kernels.gemm import cold as gcold, config as gconfig, launch as glaunch
    from workbench import bench

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, t0 = [], time.time()
    for i, (M, N, K) in enumerate(fp32_small_shapes()):
        for b_layout in ("row", "t"):
            if time.time() - t0 > args.budget_s:
                print(f"budget spent: {M}x{N}x{K} {b_layout} and later not run", flush=True)
                return rows
            g = torch.Generator(device="cuda").manual_seed(500 + i)
            a = torch.randn(M, K, device="cuda", generator=g)
            b = torch.randn(K, N, device="cuda", generator=g)
            if b_layout == "t":   # same values, K-major: the transposed view of an (N, K) tensor
                b = b.t().contiguous().t()
            c = torch.empty(M, N, device="cuda")
            ref = a.double() @ b.double()
            aligned = glaunch._tma_ok(a) and (glaunch._tma_ok(b) or glaunch._kmajor_ok(b))
            configs = fp32_small_variants(M, N, K, sms, b_layout == "t", aligned)
            fns = {"cublas": lambda: gemm.cublas(a, b, out=c), "cublas_fp32": lambda: _cublas_fp32(a, b, c)}
            fns.update({n: (lambda p=p: gemm.matmul(a, b, p, out=c)) for n, p in configs.items()})

            def label(name):
                if name.startswith("cublas"):
                    return "cuBLAS" + (" fp32" if name == "cublas_fp32" else " tf32")
                p = glaunch.plan_for(a, b, configs[name], c)
                return f"{p.kind}: {p.config.label()}"

            def tol(name, label):   # tf32 products: cuBLAS tf32 and the tensor-core kernels
                tf32 = name in ("cublas", "tf32_rule") or (name == "heuristic" and label[:4] != "fma:")
                return 2e-3 if tf32 else FMA_TOL

            status, labels, errs = check_each(fns, c, ref, label, tol)
            t = bench.interleave(fns, warmup_ms=20, rep_ms=args.rep_ms, min_reps=10, max_reps=100, mode="graph")
            base = t["cublas"].median_ms if "cublas" in t else float("nan")
            bound_us = gcold.fma_bound_us(M, N, K)
            for name in ["cublas", "cublas_fp32"] + list(configs):
                tm = t.get(name)
                ms = tm.median_ms if tm else float("nan")
                rows.append(dict(M=M, N=N, K=K, dtype="float32", b_layout=b_layout, variant=name,
                                 config=labels.get(name, ""), status=status.get(name, "not timed"), mode="graph",
                                 rel_err=errs.get(name, float("nan")), median_ms=ms,
                                 b_gbps=K * N * 4 / ms / 1e6 if tm else float("nan"),
                                 ratio_vs_cublas=base / ms if tm else float("nan"), cublas_ms=base,
                                 b_bound_us=bound_us, **prov))
                print(f"{M}x{N}x{K} {b_layout:3s} {name:17s} {labels.get(name, ''):44s} {ms * 1e3:8.1f} us "
                      f"{base / ms if tm else float('nan'):6.3f}x cuBLAS  B bound {bound_us:6.1f} us  "
                      f"{status.get(name, '')}", flush=True)
    return rows


def dry_run_fp32_small(num_sms: int = 132) -> None:
    """What --fp32-small would time, with the configs an sm_90 GPU of ``num_sms`` SMs gets (no GPU used)."""
    for M, N, K in fp32_small_shapes():
        for b_layout in ("row", "t"):
            for name, cfg in fp32_small_variants(M, N, K, num_sms, b_layout == "t", True).items():
                if cfg is None:
                    from kernels.gemm import cold as gcold, config as gconfig
                    import torch

                    cfg = gcold.heuristic(M, N, K, torch.float32, num_sms, b_kmajor=b_layout == "t")
                print(f"{M}x{N}x{K} {b_layout:3s} {name:17s} {cfg.label()}")
            print(f"{M}x{N}x{K} {b_layout:3s} cublas, cublas_fp32")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=150.0, help="per part: no new shape starts after this")
    ap.add_argument("--rep-ms", type=float, default=15.0)
    ap.add_argument("--skip-names", action="store_true", help="leave out part 1 (cuBLAS kernel names)")
    ap.add_argument("--stream-k", action="store_true",
                    help="only the stream-K split probe (SK_MAX_SPLIT 2-16 on 1-3 round shapes) -> stream_k.csv")
    ap.add_argument("--fp32-small", action="store_true",
                    help="only the fp32 M <= 64 probe (FMA kernel, tf32 swap kernel, cuBLAS) -> fp32_small.csv")
    ap.add_argument("--tail", action="store_true",
                    help="only the tail-split probe (the last round's tiles in column slices) -> tail.csv")
    ap.add_argument("--wide", action="store_true",
                    help="only the probe of tiles between the powers of two (extra_n) -> wide.csv")
    ap.add_argument("--mid-m", action="store_true",
                    help="only the split-K probe at M 64-1024 with few tiles and a long K -> mid_m.csv")
    ap.add_argument("--dry-run", action="store_true", help="with --fp32-small: list what it would time, no GPU")
    args = ap.parse_args(argv)
    if args.dry_run:
        if not args.fp32_small:
            ap.error("--dry-run goes with --fp32-small")
        dry_run_fp32_small()
        return 0
    import pandas as pd
    import torch

    from workbench import provenance

    if not torch.cuda.is_available():
        raise SystemExit("probe_gemm_gaps needs a CUDA GPU (sm_90: H100 or H200)")
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 baseline on the tensor cores, as ours
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance.flat(provenance.collect())
    if args.stream_k:
        pd.DataFrame(time_stream_k(args, prov)).to_csv(out / "stream_k.csv", index=False)
        return 0
    if args.mid_m:
        pd.DataFrame(time_mid_m(args, prov)).to_csv(out / "mid_m.csv", index=False)
        return 0
    if args.tail:
        rows = time_configs(TAIL_SHAPES, torch.bfloat16, TAIL_CONFIGS, args, prov)
        pd.DataFrame(rows).to_csv(out / "tail.csv", index=False)
        return 0
    if args.wide:
        rows = time_configs(WIDE_SHAPES, torch.bfloat16, WIDE_CONFIGS, args, prov)
        pd.DataFrame(rows).to_csv(out / "wide.csv", index=False)
        return 0
    if args.fp32_small:
        pd.DataFrame(time_fp32_small(args, prov)).to_csv(out / "fp32_small.csv", index=False)
        return 0
    if not args.skip_names:
        names = cublas_kernels(EDGE + SMALL, torch.bfloat16, prov) + cublas_kernels(FP32, torch.float32, prov)
        pd.DataFrame(names).to_csv(out / "cublas_kernels.csv", index=False)
        print(pd.DataFrame(names)[["M", "N", "K", "dtype", "kernel", "mean_us"]].to_string(), flush=True)
    rows = time_configs(EDGE, torch.bfloat16, EDGE_CONFIGS, args, prov)
    rows += time_configs(FP32, torch.float32, FP32_CONFIGS, args, prov)
    rows += time_configs(LINEAR, torch.bfloat16, {}, args, prov, b_layout="t")
    pd.DataFrame(rows).to_csv(out / "configs.csv", index=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
