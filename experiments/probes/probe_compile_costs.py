"""What compiling each GEMM candidate costs on this node, by kind of kernel (the tuner's
``COMPILE_GUESS_S``), with an empty Triton cache.

For every candidate of each shape: the plan, its first launch (the compile, with Triton's cache
emptied for this process) and a synchronize, timed on the host; then a second launch (no
compile) to take the launch itself off. Writes OUT/compile_costs.csv and prints, per kind, the
median and largest compile. Shapes: issue 43's tune-on-miss shapes and a few of other classes.

    python3 experiments/probes/probe_compile_costs.py --out results/gemm_selection/compile_costs
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SHAPES = [(13914, 6888, 15232), (7336, 6488, 9928), (4029, 13808, 8280), (8191, 8193, 1000), (16311, 69, 5432),
          (90, 256, 23216), (8, 28672, 4096), (2048, 2048, 2048)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=150, help="start no shape after this many seconds")
    args = ap.parse_args(argv)
    os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="compile-costs-")   # before Triton loads
    import pandas as pd
    import torch

    from kernels.gemm import launch as glaunch, select as gselect, variants
    from workbench import provenance

    prov = provenance.flat(provenance.collect())
    rows, t0 = [], time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    for M, N, K in SHAPES:
        if time.monotonic() - t0 > args.budget_s:
            print(f"budget spent: shapes from {M}x{N}x{K} on not run", flush=True)
            break
        a = torch.randn(M, K, device="cuda").bfloat16()
        b = torch.randn(K, N, device="cuda").bfloat16()
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        call = glaunch._call(a, b, c, M, N, K, False, False)
        for name, cand in gselect.candidates(call).items():
            if cand.variant == "library":
                continue
            kind, key = gselect.compile_kind(call, cand), gselect.compile_key(call, cand)
            try:
                s = time.perf_counter()
                p = glaunch.plan_for(a, b, cand.config, c)
                variants.execute(p, a, b, c)
                torch.cuda.synchronize()
                first = time.perf_counter() - s
                s = time.perf_counter()
                variants.execute(p, a, b, c)
                torch.cuda.synchronize()
                again = time.perf_counter() - s
            except (ValueError, RuntimeError) as exc:
                print(f"{M}x{N}x{K} {name}: {type(exc).__name__}: {exc}"[:200], flush=True)
                continue
            rows.append(dict(M=M, N=N, K=K, candidate=name, kind=kind, first_s=first, again_s=again,
                             compile_s=first - again, key=hash(key), **prov))
            print(f"{M}x{N}x{K} {name} ({kind}): first {first:.3f} s, again {again * 1e3:.2f} ms", flush=True)
        pd.DataFrame(rows).to_csv(args.out / "compile_costs.csv", index=False)
    df = pd.DataFrame(rows)
    if len(df):
        # a kernel compiled for an earlier shape is loaded, not compiled: those runs say nothing here
        new = df[df.compile_s > 0.1]
        text = new.groupby("kind").compile_s.describe()[["count", "50%", "max"]].round(3).to_string()
        (args.out / "summary.txt").write_text(text + "\n")
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
