"""The split-K kernel's two ways of meeting a tile's pieces, timed side by side on one GPU.

Serial: every piece stores its fp32 partial in a slot of its own and the last to arrive reads the
others' slots one after another. Atomic (``ATOMIC_SPLIT``, from ``config.SPLIT_ATOMIC_MIN_PIECES``
pieces): every piece adds its partial into the tile's one sum, and the last reads that. For every
split-K candidate of ours that cuts K into 3 or more pieces on a shape, both plans are made (the
threshold set either way), checked against an fp32 reference on a NaN-poisoned output, then timed
taking turns with cuBLAS (CUDA-graph replay, L2 flushed before each run). Shapes: issue 43's long-K
held-out shapes (small M and N, K of 10-46 thousand) and small-M (decode) shapes where the swapped
split-K tiles run. Writes OUT/rows.csv and prints a table.

    python3 experiments/probes/probe_splitk_reduce.py --out results/gemm_zoo/splitk_reduce
"""
from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

# (M, N, K): the long-K class of h200_regions/selection (held out), then small-M shapes
LONG_K = [(512, 4096, 12288), (495, 320, 35984), (118, 1136, 18368), (90, 256, 23216), (298, 80, 10240),
          (550, 248, 11128), (117, 64, 14216), (1199, 80, 26040), (768, 768, 49152)]
SMALL_M = [(1, 3584, 3584), (16, 24576, 4096), (32, 7168, 16384), (8, 28672, 4096), (1, 57344, 8192),
           (12, 3744, 2464), (1, 7168, 18432)]


def _worst_error(fn, c, ref, calls: int) -> float:
    """The largest relative error over ``calls`` calls, each into a NaN-poisoned output (a NaN
    left anywhere counts as infinite): a race that shows once in a hundred calls shows here.
    The errors stay on the GPU until the end, so the calls run back to back."""
    import torch
    errs = []
    for _ in range(max(calls, 2)):   # at least twice: the sums and counters must reset themselves
        c.fill_(float("nan"))
        fn()
        errs.append(torch.nan_to_num((c.float() - ref).norm() / ref.norm(), nan=math.inf))
    return float(torch.stack(errs).max().item())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=240, help="start no shape after this many seconds")
    ap.add_argument("--rep-ms", type=float, default=8)
    ap.add_argument("--stress", type=int, default=200, help="calls per candidate, every output checked")
    args = ap.parse_args(argv)
    import pandas as pd
    import torch

    from kernels.gemm import config as gconfig, launch as glaunch, select as gselect, sweep as gsweep, variants
    from workbench import bench, provenance

    prov = provenance.flat(provenance.collect())
    rows, t0 = [], time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    for i, (M, N, K) in enumerate(LONG_K + SMALL_M):
        if time.time() - t0 > args.budget_s:
            print(f"budget spent: shapes from {M}x{N}x{K} on not run", flush=True)
            break
        g = torch.Generator(device="cuda").manual_seed(i)
        a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        b = torch.randn(K, N, device="cuda", generator=g).bfloat16()
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ b.float()
        call = glaunch._call(a, b, c, M, N, K, False, False)
        fns = {"cublas": lambda: torch.matmul(a, b, out=c)}
        pieces = {}
        saved = gconfig.SPLIT_ATOMIC_MIN_PIECES
        for name, cand in gselect.candidates(call).items():
            for mode, least in (("atomic", 3), ("serial", 1 << 30)):
                gconfig.SPLIT_ATOMIC_MIN_PIECES = least
                glaunch.clear_plans()
                try:
                    p = glaunch.plan_for(a, b, cand.config, c)
                except ValueError:
                    continue
                if p.kind != "splitk" or not p.sk_tiles or p.programs < 3:
                    continue
                fns[f"{name} {mode}"] = (lambda p=p: variants.execute(p, a, b, c))
                pieces[name] = p.programs
        gconfig.SPLIT_ATOMIC_MIN_PIECES = saved
        glaunch.clear_plans()
        errs = {}
        for n, fn in list(fns.items()):
            err = _worst_error(fn, c, ref, args.stress)
            errs[n] = err
            if not err <= gsweep.tolerance(torch.bfloat16):
                print(f"{M}x{N}x{K} {n}: WRONG (rel err {err})", flush=True)
                del fns[n]
        tm = bench.interleave(fns, warmup_ms=5, rep_ms=args.rep_ms, min_reps=10, max_reps=100, mode="graph")
        cub = tm["cublas"].median_ms * 1e3
        for n, t in tm.items():
            cand, _, mode = n.partition(" ")
            rows.append(dict(M=M, N=N, K=K, dtype="bfloat16", candidate=cand, reduce=mode or "library",
                             pieces=pieces.get(cand, 0), median_us=t.median_ms * 1e3, q25_us=t.q25_ms * 1e3,
                             q75_us=t.q75_ms * 1e3, n_runs=t.n, cublas_us=cub, vs_cublas=cub / (t.median_ms * 1e3),
                             rel_err=errs.get(n, math.nan), checked_calls=args.stress, **prov))
        line = "  ".join(f"{n} {t.median_ms * 1e3:.1f}" for n, t in sorted(tm.items()))
        print(f"[{time.time() - t0:4.0f}s] {M}x{N}x{K}: {line}", flush=True)
        pd.DataFrame(rows).to_csv(args.out / "rows.csv", index=False)
        del a, b, c, ref
    df = pd.DataFrame(rows)
    if len(df):
        ours = df[df.reduce != "library"]
        piv = ours.pivot_table(index=["M", "N", "K", "candidate", "pieces"], columns="reduce", values="median_us")
        piv["serial_over_atomic"] = piv["serial"] / piv["atomic"]
        piv["cublas"] = ours.groupby(["M", "N", "K", "candidate", "pieces"]).cublas_us.first()
        text = piv.round(3).to_string()
        (args.out / "summary.txt").write_text(text + "\n")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
