"""Which GEMM configuration runs, checked on shapes the rule was not fitted on: ``matmul`` as
users call it (tuning tables present), the cold rule alone (no table) and cuBLAS, timed in the
same run, CUDA-graph replayed and eager, plus the host time per call; and the cost of a first
call that tunes (tune-on-miss).

    python experiments/run_gemm_selection.py --out results/gemm_selection/h200 \\
        --fresh-yaml results/gemm_selection/h200/fresh.yaml --split held_out
    python experiments/run_gemm_selection.py --fresh 20 --write-fresh fresh.yaml   # draw today's shapes only

Shapes: the zoo's ``--split`` half (``experiments/gemm_shapes.yaml``) and the fresh shapes of
``--fresh-yaml`` (``--fresh N --write-fresh PATH`` draws them: M, N, K uniform in [1, 16384],
N and K multiples of 8, seeded by the date, so everyone drawing on the same day gets the same
ones). Every method runs once on NaN-poisoned outputs and is checked against an fp32
reference before it is timed (``workbench.bench.interleave``: L2 flushed, turns taken run by
run). ``--tune-on-miss N``: N more fresh shapes (drawn after the others) called once with
``tune=True`` into an empty table: the first call's wall time and the later calls' host time.
Writes ``verify.csv`` (one row per shape, method and mode, with provenance) and ``tune_on_miss.csv``.
Without a GPU it runs in Triton's interpreter (``--small``: tiny shapes, not performance).
"""
from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FRESH_MAX = 16384


def fresh_shapes(n: int, day: str | None = None, skip: int = 0) -> list[dict]:
    """``n`` shapes drawn uniformly (M in [1, 16384]; N, K multiples of 8 in [8, 16384]), seeded
    by the date (YYYYMMDD, default today in UTC); ``skip`` draws are discarded first."""
    day = day or dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d")
    rng = random.Random(int(day))
    out = []
    for i in range(skip + n):
        s = {"M": rng.randint(1, FRESH_MAX), "N": 8 * rng.randint(1, FRESH_MAX // 8),
             "K": 8 * rng.randint(1, FRESH_MAX // 8), "dtype": "bfloat16", "split": f"fresh-{day}",
             "source": f"fresh {day} #{i}"}
        if i >= skip:
            out.append(s)
    return out


def write_yaml(path: Path, shapes: list[dict]) -> None:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# fresh shapes drawn by experiments/run_gemm_selection.py (seeded by the date)\n"
                    + yaml.safe_dump({"shapes": shapes}, sort_keys=False))


def _rel_err(out, ref) -> float:
    import torch

    o = out.float()
    if not torch.isfinite(o).all():
        return math.nan
    return float(torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref))


def verify(shapes: list[dict], args, prov, out_csv: Path) -> None:
    import pandas as pd
    import torch

    from kernels.gemm import launch as glaunch, select as gselect, sweep as gsweep, tuning as gtuning
    from workbench import bench, provenance

    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    device = "cuda" if on_gpu else "cpu"
    t0 = time.time()
    for i, s in enumerate(shapes):
        if time.time() - t0 > args.budget_s:
            print(f"verify: budget of {args.budget_s:.0f} s spent; {len(shapes) - i} shapes not run", flush=True)
            break
        s = gtuning.shape_of(s)
        a, b = gtuning.operands(s, device, seed=7000 + i)
        M, K = a.shape
        N = b.shape[1]
        c = torch.empty(M, N, dtype=a.dtype, device=device)
        ref = a.float() @ b.float()
        plan = glaunch.plan_for(a, b, None, c)
        call = glaunch._call(a, b, c, M, N, K, False, False)
        cold = gselect.cold(call)
        fns = {"ours": lambda: glaunch.matmul(a, b, out=c),
               "cold": lambda: glaunch.matmul(a, b, cold.config, out=c),
               "cublas": lambda: torch.matmul(a, b, out=c)}
        status, errs = {}, {}
        for name, fn in list(fns.items()):
            c.fill_(float("nan"))
            try:
                fn()
                errs[name] = _rel_err(c, ref)
                status[name] = "ok" if errs[name] <= gsweep.tolerance(a.dtype) else f"wrong: rel_err {errs[name]:.2e}"
            except Exception as exc:   # recorded, not timed
                status[name] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
            if status[name] != "ok":
                del fns[name]
        timings = {m: bench.interleave(fns, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, min_reps=10,
                                       max_reps=args.max_reps, mode=m) for m in ("graph", "eager")}
        host = {n: bench.host_time_us(fns[n], calls=args.host_calls, warmup=10)["median_us"]
                for n in ("ours", "cublas") if n in fns}
        rows = []
        for name in status:
            for mode, tm in timings.items():
                t, cub = tm.get(name), tm.get("cublas")
                rows.append(dict(
                    s, b_layout=s["b"], method=name, mode=mode, status=status[name], rel_err=errs.get(name, math.nan),
                    candidate={"ours": plan.choice.candidate.name if plan.choice else "explicit", "cold": cold.name,
                               "cublas": "cublas"}[name],
                    source={"ours": plan.choice.source if plan.choice else "", "cold": "cold", "cublas": ""}[name],
                    median_us=t.median_ms * 1e3 if t else math.nan, q25_us=t.q25_ms * 1e3 if t else math.nan,
                    q75_us=t.q75_ms * 1e3 if t else math.nan, n_runs=t.n if t else 0,
                    host_us=host.get(name, math.nan) if mode == "eager" else math.nan,
                    vs_cublas=cub.median_ms / t.median_ms if t and cub else math.nan,
                    cublas_us=cub.median_ms * 1e3 if cub else math.nan, **provenance.flat(prov)))
        pd.DataFrame(rows).to_csv(out_csv, mode="a", header=not out_csv.exists(), index=False)
        g = timings["graph"]
        ratio = (lambda n: g["cublas"].median_ms / g[n].median_ms if n in g and "cublas" in g else math.nan)
        print(f"[{i + 1}/{len(shapes)} {time.time() - t0:4.0f}s] {M}x{N}x{K} {s['dtype']} {s.get('split', ''):10} "
              f"ours {plan.choice.candidate.name if plan.choice else '-'} ({plan.choice.source if plan.choice else '-'})"
              f" x{ratio('ours'):.3f}  cold {cold.name} x{ratio('cold'):.3f}  host ours "
              f"{host.get('ours', math.nan):.1f} us cuBLAS {host.get('cublas', math.nan):.1f} us"
              + ("" if all(v == "ok" for v in status.values()) else f"  NOT OK: {status}"), flush=True)
        del a, b, c, ref
        if on_gpu:
            torch.cuda.empty_cache()


def tune_on_miss(shapes: list[dict], args, prov, out_csv: Path) -> None:
    """First call with tune=True into an empty table: its wall time; then the host time of later calls."""
    import pandas as pd
    import torch

    from kernels.common import select, tables, tune
    from kernels.gemm import launch as glaunch, tuning as gtuning
    from workbench import bench, provenance

    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    device = "cuda" if on_gpu else "cpu"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["WORKBENCH_TUNING_DIR"] = tmp
        select.TABLES = tables.Tables(shipped=Path(tmp) / "none")   # nothing shipped either: a miss
        for i, s in enumerate(shapes):
            s = gtuning.shape_of(s)
            a, b = gtuning.operands(s, device, seed=9000 + i)
            if on_gpu:
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            c = glaunch.matmul(a, b, tune=True)
            if on_gpu:
                torch.cuda.synchronize()
            first_s = time.perf_counter() - t1
            plan = glaunch.plan_for(a, b, None, None, tune=True)
            host = bench.host_time_us(lambda: glaunch.matmul(a, b, tune=True), calls=args.host_calls, warmup=10)
            host_mm = bench.host_time_us(lambda: torch.matmul(a, b), calls=args.host_calls, warmup=10)
            entry = plan.choice.entry or {}
            rows.append(dict(s, first_call_s=first_s, budget_s=tune.budget_s(args.tune_budget_s),
                             candidate=plan.choice.candidate.name, source=plan.choice.source,
                             timed=entry.get("timed"), of=entry.get("of"), us=entry.get("us"),
                             cold=entry.get("cold"), cold_us=entry.get("cold_us"),
                             later_host_us=host["median_us"], torch_mm_host_us=host_mm["median_us"],
                             ok=bool(torch.isfinite(c).all()), **provenance.flat(prov)))
            print(f"tune-on-miss {s['M']}x{s['N']}x{s['K']}: first call {first_s:.2f} s, {plan.choice.candidate.name} "
                  f"({entry.get('timed')}/{entry.get('of')} timed), later calls {host['median_us']:.1f} us host "
                  f"(torch.matmul {host_mm['median_us']:.1f})", flush=True)
    pd.DataFrame(rows).to_csv(out_csv, index=False)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="directory for verify.csv and tune_on_miss.csv")
    p.add_argument("--split", default="held_out", help="zoo half to verify: held_out, fit, all or none")
    p.add_argument("--fresh-yaml", type=Path, default=None, help="fresh shapes to verify too (a shape list)")
    p.add_argument("--fresh", type=int, default=0, help="draw this many fresh shapes (with --write-fresh)")
    p.add_argument("--write-fresh", type=Path, default=None, help="write the drawn fresh shapes here and stop")
    p.add_argument("--day", default=None, help="the date that seeds the fresh shapes (YYYYMMDD; default today)")
    p.add_argument("--tune-on-miss", type=int, default=0, help="this many more fresh shapes, tuned on first call")
    p.add_argument("--tune-budget-s", type=float, default=None)
    p.add_argument("--small", action="store_true", help="tiny shapes (the interpreter)")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting shapes after this many seconds")
    p.add_argument("--rep-ms", type=float, default=20)
    p.add_argument("--warmup-ms", type=float, default=10)
    p.add_argument("--max-reps", type=int, default=100)
    p.add_argument("--host-calls", type=int, default=100)
    args = p.parse_args(argv)
    if args.write_fresh:
        write_yaml(args.write_fresh, fresh_shapes(args.fresh, args.day))
        print(f"wrote {args.fresh} fresh shapes to {args.write_fresh}")
        return 0
    if args.out is None:
        p.error("--out is required (or --fresh N --write-fresh PATH)")
    from experiments.run_gemm_zoo import load_shapes
    from workbench import provenance
    from workbench.tune import load_shapes as load_spec
    from kernels.gemm import tuning as gtuning

    if args.small:
        shapes = [dict(M=m, N=n, K=k, dtype="float16", split="small") for m, n, k in ((5, 24, 40), (33, 40, 64))]
    else:
        shapes = [] if args.split == "none" else [s for s in load_shapes()
                                                   if args.split == "all" or s["split"] == args.split]
        if args.fresh_yaml:
            shapes += load_spec(str(args.fresh_yaml), gtuning)
    args.out.mkdir(parents=True, exist_ok=True)
    prov = provenance.collect(knobs={"script": "experiments/run_gemm_selection.py", "argv": " ".join(sys.argv[1:])})
    verify(shapes, args, prov, args.out / "verify.csv")
    if args.tune_on_miss:
        extra = ([dict(M=9, N=16, K=24, dtype="float16")] if args.small else
                 fresh_shapes(args.tune_on_miss, args.day, skip=max(args.fresh, 20)))
        tune_on_miss(extra, args, prov, args.out / "tune_on_miss.csv")
    return 0


if __name__ == "__main__":
    sys.exit(main())
