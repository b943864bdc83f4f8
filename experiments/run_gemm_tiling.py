"""One scripted GPU run for the GEMM tiling study (needs only torch, triton,
pandas, pyarrow, pyyaml, tqdm: what a bare GPU node has).

    PYTHONUNBUFFERED=1 python experiments/run_gemm_tiling.py --out results/gemm_tiling/run          # full
    PYTHONUNBUFFERED=1 python experiments/run_gemm_tiling.py --out results/gemm_tiling/run --quick  # quick

1. measures the device ceilings (copy bandwidth, cuBLAS bf16/fp16 GEMM);
2. times, on the goal shapes, the heuristic's configuration (kernels.gemm.heuristic),
   cuBLAS and any ``--variant`` configurations, taking turns run by run in this
   same process, and prints the table with the geometric mean of the ratios
   (heuristic_vs_cublas.csv; every variant in variants.csv);
3. runs experiments/gemm_tiling.yaml (every point checked, then timed; rows.parquet),
   under a watchdog that ends the process if a kernel hangs;
4. times the heuristic, the sweep's best configuration and cuBLAS again on the
   goal shapes (regret.csv) and writes best_per_shape.csv.

Files written under --out: ceilings.json, heuristic_vs_cublas.csv, rows.parquet,
best_per_shape.csv, regret.csv.

``--quick`` (what notebooks/02_gemm_tiling.ipynb runs on a GPU node by default, about 2-3
minutes on one H200): the table in one round, the sweep on the spec's first three shapes
(the goal shapes 8192^3, 4096^3 and 1024x4096x14336 with every study: 222 of the 1,078
points, so every quick point is a point of the full sweep; no new point after 120 s) and no
regret table (step 4). The full run (no flag) takes about 4-6 minutes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GOAL_SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (1024, 4096, 14336), (4096, 14336, 4096),
               (16384, 3584, 8192), (2048, 7168, 2048), (512, 4096, 7168), (8192, 28672, 8192)]
QUICK_SWEEP_SHAPES = 3  # --quick sweeps the spec's first three shapes (8192^3, 4096^3, 1024x4096x14336)
QUICK_SWEEP_BUDGET_S = 120.0  # ... and starts no new point after this (a cold Triton cache stays in bounds)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the result files")
    ap.add_argument("--spec", default=str(ROOT / "experiments" / "gemm_tiling.yaml"))
    ap.add_argument("--quick", action="store_true",
                    help=f"a quick run: --rounds 1, --sweep-shapes {QUICK_SWEEP_SHAPES}, --sweep-budget-s "
                         f"{QUICK_SWEEP_BUDGET_S:.0f} and no regret table (every point is one of the full sweep's)")
    ap.add_argument("--spec-quick", action="store_true",
                    help="sweep the spec's own quick: subset instead (tiny shapes, a smoke test)")
    ap.add_argument("--sweep-shapes", type=int, default=None, metavar="N",
                    help="sweep only the points of the spec's first N shapes (the goal shapes come first); "
                         f"default: all ({QUICK_SWEEP_SHAPES} with --quick)")
    ap.add_argument("--skip-sweep", action="store_true", help="only ceilings and the table")
    ap.add_argument("--rounds", type=int, default=None,
                    help="the table times each variant for rounds x rep-ms (default 3; 1 with --quick)")
    ap.add_argument("--rep-ms", type=float, default=150, help="see --rounds")
    ap.add_argument("--variant", action="append", metavar="NAME=JSON",
                    help='also time this config in the table: fields replacing the heuristic\'s, e.g. '
                         'sk=\'{"stream_k": true}\' (repeatable; all variants go to variants.csv)')
    ap.add_argument("--sweep-budget-s", type=float, default=None,
                    help="start no new sweep point after this many seconds (the tables still run; "
                         f"default 330, {QUICK_SWEEP_BUDGET_S:.0f} with --quick)")
    ap.add_argument("--hang-s", type=float, default=60, help="watchdog: exit if no sweep row for this long")
    ap.add_argument("--best-from", metavar="CSV",
                    help="with --skip-sweep: a best_per_shape.csv of an earlier sweep, timed in the table too")
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 1 if args.quick else 3
    if args.sweep_budget_s is None:
        args.sweep_budget_s = QUICK_SWEEP_BUDGET_S if args.quick else 330.0
    if args.sweep_shapes is None and args.quick:
        args.sweep_shapes = QUICK_SWEEP_SHAPES
    if args.sweep_shapes is not None and args.sweep_shapes < 1:
        ap.error("--sweep-shapes must be at least 1")

    import torch

    from kernels import gemm
    from workbench import bench, provenance, roofline, sweep

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not bench.gpu_timing_available():
        print("run_gemm_tiling: needs a CUDA GPU (and TRITON_INTERPRET unset)", file=sys.stderr)
        return 2
    prov = provenance.collect()
    print(f"device {prov['device_name']} x{prov['device_count']}, torch {prov['torch_version']}, "
          f"triton {prov['triton_version']}, CUDA {prov['cuda_version']}, git {prov['git_sha']} "
          f"(dirty={prov['git_dirty']}, from {prov['git_source']})", flush=True)

    t0 = time.time()
    ceil = roofline.measure_ceilings(save=True)
    (out / "ceilings.json").write_text(json.dumps(ceil, indent=1, default=str) + "\n")
    print(f"ceilings: copy {ceil['copy_gbps']:.0f} GB/s, cuBLAS bf16 {ceil['bf16_tflops']:.1f} TFLOP/s, "
          f"fp16 {ceil['fp16_tflops']:.1f} TFLOP/s ({time.time() - t0:.0f} s)", flush=True)

    sms = torch.cuda.get_device_properties(0).multi_processor_count

    # ---- 1. the goal table: heuristic vs cuBLAS, measured before anything else ----
    t0 = time.time()
    best0 = None
    if args.best_from:
        import pandas as pd

        best0 = pd.read_csv(args.best_from)
    long_rows: list[dict] = []
    table = _table(gemm, bench, provenance, prov, sms, args, best=best0, long_rows=long_rows)
    table.to_csv(out / "heuristic_vs_cublas.csv", index=False)
    import pandas as pd

    pd.DataFrame(long_rows).to_csv(out / "variants.csv", index=False)
    _report(table, "heuristic vs cuBLAS")
    print(f"({time.time() - t0:.0f} s)", flush=True)

    # ---- 2. the sweep (a watchdog ends the process if a kernel hangs) ----
    if not args.skip_sweep:
        beat = [time.monotonic()]
        _watchdog(beat, out, args.hang_s)
        t0 = time.time()
        limit = None
        if args.sweep_shapes is not None:
            limit, shapes = _first_shapes_points(args.spec, args.spec_quick, args.sweep_shapes)
            print(f"sweep: the first {len(shapes)} shape(s) of the spec, {limit} points: "
                  + ", ".join("x".join(str(v) for _, v in s) for s in shapes), flush=True)
        try:
            df = sweep.run_spec(args.spec, quick=args.spec_quick, results_dir=out, resume=True, ceilings=ceil,
                                progress=True, deadline_s=args.sweep_budget_s, limit=limit,
                                on_row=lambda row: beat.__setitem__(0, time.monotonic()))
        except sweep.SweepAborted as exc:
            print(f"sweep aborted: {exc}", file=sys.stderr)
            df = sweep.load_rows(out / "rows.parquet")
        beat[0] = None  # watchdog off
        (out / "inflight.json").unlink(missing_ok=True)
        ok = df[(df.status == "ok") & (~df.is_baseline.astype(bool))]
        print(f"sweep: {len(df)} rows, {len(ok)} ok kernel points in {time.time() - t0:.0f} s; status counts: "
              f"{df.status.value_counts().to_dict()}", flush=True)
        best = sweep.best_per_shape(df)
        best.to_csv(out / "best_per_shape.csv", index=False)

        # ---- 3. regret: the heuristic, the sweep's best and cuBLAS, interleaved again ----
        if args.quick:
            return 0
        t0 = time.time()
        table2 = _table(gemm, bench, provenance, prov, sms, args, best=best)
        table2.to_csv(out / "regret.csv", index=False)
        _report(table2, "heuristic vs cuBLAS, with the sweep's best")
        print(f"({time.time() - t0:.0f} s)", flush=True)
    return 0


def _first_shapes_points(spec_path: str, spec_quick: bool, n: int) -> tuple[int, list]:
    """(number of points, shapes) of the spec's first ``n`` (dtype, shape) groups.

    run_spec runs its points grouped by (dtype, shape) in the order the spec first
    names them (the goal shapes lead), so its first ``limit`` rows are exactly these
    groups' points when the results folder starts empty."""
    from workbench.spec import load_spec
    from workbench.sweep import expand

    points = expand(load_spec(spec_path, quick=spec_quick))
    groups = list(dict.fromkeys((p.dtype, p.shape) for p in points))[:n]
    return sum(1 for p in points if (p.dtype, p.shape) in groups), [shape for _, shape in groups]


def _watchdog(beat, out: Path, hang_s: float) -> None:
    """Exit the process if no sweep row finished for hang_s seconds (a hung kernel
    cannot be interrupted; the rows written so far stay on disk)."""
    import threading

    def loop():
        while True:
            time.sleep(5)
            if beat[0] is None:
                return
            if time.monotonic() - beat[0] > hang_s:
                info = (out / "inflight.json").read_text() if (out / "inflight.json").exists() else "?"
                msg = f"watchdog: no sweep row for {hang_s:.0f} s; hung point: {info}"
                print(msg, file=sys.stderr, flush=True)
                (out / "HUNG.txt").write_text(msg + "\n")
                os._exit(3)

    threading.Thread(target=loop, daemon=True).start()


def _variant_configs(gemm, heur, extras: list[str], triton_heur=None) -> dict:
    """``--variant NAME=JSON`` -> {NAME: config}: JSON fields replace the heuristic's
    (e.g. ``sk={"stream_k": true}``), the defaults' (``"base": "default"``) or those of
    the heuristic restricted to the Triton kernel (``"base": "triton"``)."""
    import dataclasses

    out = {}
    for spec in extras:
        name, _, text = spec.partition("=")
        fields = json.loads(text)
        base = {"default": gemm.GemmConfig(), "triton": triton_heur or heur}.get(fields.pop("base", "heuristic"), heur)
        out[name.strip()] = dataclasses.replace(base, **fields)
    return out


def _table(gemm, bench, provenance, prov, sms, args, best=None, long_rows=None):
    """The goal shapes: the heuristic, cuBLAS, the sweep's best (if given) and the
    ``--variant`` configurations, each checked on NaN-poisoned outputs against an
    fp32 reference, then timed taking turns run by run (``bench.interleave``)."""
    import pandas as pd
    import torch

    from kernels.gemm import sweep as gsweep

    rows = []
    for (M, N, K) in GOAL_SHAPES:
        shape = {"M": M, "N": N, "K": K}
        inp = gsweep.make_inputs(shape, torch.bfloat16, "cuda", seed=1234 + M + N + K)
        ref = gemm.reference(inp)
        heur = gemm.heuristic(M, N, K, torch.bfloat16, sms)
        configs = {"heuristic": heur}
        best_label = ""
        if best is not None and len(best):
            hit = best[(best.M == M) & (best.N == N) & (best.K == K)]
            if len(hit):
                configs["best"] = gemm.GemmConfig(**json.loads(hit.iloc[0]["params"]))
                best_label = configs["best"].label()
        configs.update(_variant_configs(gemm, heur, args.variant or [],
                                        gemm.heuristic(M, N, K, torch.bfloat16, sms, gluon=False)))
        variants = {"cublas": lambda: gemm.cublas(inp.a, inp.b, out=inp.out)}
        variants.update({k: (lambda c=c: gemm.matmul(inp.a, inp.b, c, out=inp.out)) for k, c in configs.items()})
        errs = {}
        for name, fn in list(variants.items()):
            inp.out.fill_(float("nan"))
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as exc:  # a variant that does not compile or launch: noted, not timed
                print(f"  {M}x{N}x{K} {name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
                del variants[name]
                continue
            o = inp.out.float()
            errs[name] = float("nan") if not torch.isfinite(o).all() else \
                float(torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref))
            del o
        del ref
        timings = bench.interleave(variants, warmup_ms=100, rep_ms=args.rep_ms * args.rounds, mode="eager")
        graphs = bench.interleave(variants, warmup_ms=50, rep_ms=args.rep_ms * args.rounds, mode="graph")
        flops = gemm.flops(shape)
        gms = {k: t.median_ms for k, t in graphs.items()}
        ms = {k: t.median_ms for k, t in timings.items()}
        for name, t in timings.items():
            if long_rows is not None:
                long_rows.append({"M": M, "N": N, "K": K, "dtype": "bfloat16", "variant": name,
                                  "config": configs[name].label() if name in configs else "cuBLAS",
                                  "params": json.dumps(configs[name].as_params()) if name in configs else "",
                                  "median_ms": t.median_ms, "q25_ms": t.q25_ms, "q75_ms": t.q75_ms, "n_runs": t.n,
                                  "tflops": flops / t.median_ms / 1e9, "ratio_vs_cublas": ms["cublas"] / t.median_ms,
                                  "rel_err": errs.get(name, math.nan), **provenance.flat(prov)})
        row = {"M": M, "N": N, "K": K, "dtype": "bfloat16",
               "heuristic_config": heur.label(), "heuristic_params": json.dumps(heur.as_params()),
               "heuristic_ms": ms["heuristic"], "heuristic_tflops": flops / ms["heuristic"] / 1e9,
               "heuristic_rel_err": errs["heuristic"], "heuristic_runs": timings["heuristic"].n,
               "heuristic_iqr_rel": timings["heuristic"].rel_spread,
               "cublas_ms": ms["cublas"], "cublas_tflops": flops / ms["cublas"] / 1e9,
               "cublas_rel_err": errs["cublas"], "cublas_runs": timings["cublas"].n,
               "cublas_iqr_rel": timings["cublas"].rel_spread,
               "ratio_heuristic_vs_cublas": ms["cublas"] / ms["heuristic"],
               "best_config": best_label,
               "best_params": json.dumps(configs["best"].as_params()) if best_label else "",
               "best_ms": ms.get("best", math.nan),
               "best_rel_err": errs.get("best", math.nan),
               "ratio_best_vs_cublas": ms["cublas"] / ms["best"] if "best" in ms else math.nan,
               "regret": ms["heuristic"] / ms["best"] if "best" in ms else math.nan,
               "heuristic_host_us": timings["heuristic"].host_us, "cublas_host_us": timings["cublas"].host_us,
               "heuristic_graph_ms": gms.get("heuristic", math.nan), "cublas_graph_ms": gms.get("cublas", math.nan),
               "ratio_heuristic_vs_cublas_graph": gms.get("cublas", math.nan) / gms.get("heuristic", math.nan),
               "timing": "bench.interleave: *_ms eager (host cost included), *_graph_ms CUDA-graph replays",
               "rep_ms": args.rep_ms * args.rounds}
        row.update(provenance.flat(prov))
        rows.append(row)
        extra = "".join(f"  {k} {ms['cublas'] / v:.3f}" for k, v in ms.items() if k not in ("cublas", "heuristic"))
        print(f"{M:>6} {N:>6} {K:>6}  heuristic {row['heuristic_config']:<28} {row['heuristic_tflops']:7.1f} "
              f"TFLOP/s  cuBLAS {row['cublas_tflops']:7.1f}  ratio eager {row['ratio_heuristic_vs_cublas']:.3f} "
              f"graph {row['ratio_heuristic_vs_cublas_graph']:.3f} host {row['heuristic_host_us']:.0f}/"
              f"{row['cublas_host_us']:.0f} us"
              f"{extra}  err {errs['heuristic']:.1e}", flush=True)
        del inp
        torch.cuda.empty_cache()
    return pd.DataFrame(rows)


def _report(table, title: str) -> None:
    ratios = table["ratio_heuristic_vs_cublas"].tolist()
    geo = math.exp(sum(math.log(r) for r in ratios) / len(ratios))
    wins = sum(r >= 1.0 for r in ratios)
    line = f"{title}: eager geomean {geo:.3f}, {wins}/{len(ratios)} shapes >= 1.0x"
    if "ratio_heuristic_vs_cublas_graph" in table:
        gr = table["ratio_heuristic_vs_cublas_graph"].dropna().tolist()
        if gr:
            line += f"; graph geomean {math.exp(sum(math.log(r) for r in gr) / len(gr)):.3f}"
    best_r = table["ratio_best_vs_cublas"].dropna().tolist()
    if best_r:
        line += f"; sweep-best vs cuBLAS geomean {math.exp(sum(math.log(r) for r in best_r) / len(best_r)):.3f}"
    print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main())
