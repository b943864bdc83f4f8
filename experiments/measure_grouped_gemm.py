#!/usr/bin/env python3
"""Our grouped GEMM as users call it against torch._grouped_mm, on every layer of a shape spec.

"As users call it": ``grouped_gemm(x, w, sizes)`` (dgrad: ``trans_w=True``) and
``grouped_gemm_wgrad(x, dy, sizes)`` with no config, so the selection layer chooses: this
GPU's tuning tables (the user's, ``$WORKBENCH_TUNING_DIR``, over the ones shipped in
``kernels/common/tables``), else the cold rule. Every row of the spec (one problem key) is
measured on each of its routings, fwd/dgrad/wgrad as the row says, in one process:

1. correctness: ours into a NaN-poisoned output and ``torch._grouped_mm``, each against the
   per-group fp32 reference (relative Frobenius error);
2. timing, the two taking turns run by run (``workbench.bench.interleave``, L2 flushed before
   every run): eager (each call between CUDA events, host cost included) and graph-replayed
   (the call captured in a CUDA graph: GPU time alone). ``torch._grouped_mm`` gets its int32
   offsets computed outside the timed region, as in notebook 04's study; ours takes the sizes
   tensor as it is.

Written under --out: ``grouped_vs_library.csv`` (one row per case: times, ratios
``grouped_mm time / ours``, errors, which candidate ours ran and where that choice came from,
provenance columns ``prov_*``), rewritten after every row so a run cut short keeps what it
measured; ``summary.md`` (geometric mean and lowest ratio, eager and graph, overall and per
op, model and routing; the goal check: geomean >= 1.05, none below 0.95).

    python experiments/measure_grouped_gemm.py --shapes experiments/grouped_gemm_layers.yaml --out DIR
    python experiments/measure_grouped_gemm.py --small --out /tmp/grouped_small   # no GPU needed

About 1.5-2 minutes on an H100 or H200 for the 60 rows x 3 routings of
experiments/grouped_gemm_layers.yaml once the kernels are compiled (right after `workbench tune
grouped` on the same spec), about a minute more from a cold Triton cache. ``--small`` runs the
spec's first rows shrunk to a few dozen tokens in Triton's interpreter, against one torch.mm per
expert (torch._grouped_mm needs a GPU): it checks this script, its numbers are no performance.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

if "--small" in sys.argv:   # before triton is imported: without a GPU the kernels run interpreted
    try:
        import torch as _t
        if not _t.cuda.is_available():
            os.environ.setdefault("TRITON_INTERPRET", "1")
    except ImportError:
        pass

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kernels import moe  # noqa: E402
from kernels.moe import baselines, launch, select as mselect  # noqa: E402
from kernels.moe.reference import tolerance  # noqa: E402
from workbench import bench, provenance  # noqa: E402

GOAL_GEOMEAN, GOAL_MIN = 1.05, 0.95
CSV = "grouped_vs_library.csv"


def log(*a):
    print(*a, flush=True)


def gmean(values) -> float:
    v = [x for x in values if x == x and x > 0]
    return math.exp(sum(map(math.log, v)) / len(v)) if v else math.nan


def shrink(row: dict) -> dict:
    """A spec row at interpreter size (its op, dtype and routings kept)."""
    return {**row, "G": min(row["G"], 3), "N": 24, "K": 16, "M": 40}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out = out.double()
    if not torch.isfinite(out).all():
        return math.inf   # an unwritten (NaN-poisoned) element
    den = ref.double().norm().item()
    return (out - ref.double()).norm().item() / den if den else (out - ref.double()).norm().item()


def reference(op, a, b, sizes):
    dt = torch.float32 if a.is_cuda else torch.float64
    if op == "wgrad":
        return moe.reference_wgrad(a, b, sizes, dtype=dt)
    return moe.reference(a, b, sizes, trans_w=(op == "dgrad"), dtype=dt)


def ours(op, a, b, sizes, out=None):
    if op == "wgrad":
        return moe.grouped_gemm_wgrad(a, b, sizes, out=out)
    return moe.grouped_gemm(a, b, sizes, trans_w=(op == "dgrad"), out=out)


def plan_of(op, a, b, sizes):
    if op == "wgrad":
        return launch.plan_for_wgrad(a, b, sizes)
    return launch.plan_for(a, b, sizes, trans_w=(op == "dgrad"))


def out_shape(row, op):
    return {"fwd": (row["M"], row["N"]), "dgrad": (row["M"], row["K"]), "wgrad": (row["G"], row["K"], row["N"])}[op]


def measure_row(row: dict, seed: int, dev: str, args, on_gpu: bool) -> list[dict]:
    op = row["op"]
    a, b = mselect.operands(row, dev, seed)
    flops = moe.flops(row["M"], row["N"], row["K"])
    out_rows = []
    for i, routing in enumerate(row["routing"]):
        sizes = mselect.group_sizes(row, routing, dev, seed + i)
        host = [int(v) for v in sizes.tolist()]
        if on_gpu:
            offs = baselines.grouped_mm_offsets(sizes)
            base_name = "grouped_mm"
            base = lambda: baselines.grouped_mm(op, a, b, sizes, offs=offs)   # noqa: E731
        else:
            base_name = "cublas_loop"   # torch._grouped_mm runs on CUDA only
            base = lambda: baselines.cublas_loop(op, a, b, sizes, host_sizes=host)   # noqa: E731
        ref = reference(op, a, b, sizes)
        poisoned = torch.full(out_shape(row, op), float("nan"), device=dev, dtype=a.dtype)
        err_ours = rel_err(ours(op, a, b, sizes, out=poisoned), ref)
        try:
            err_base = rel_err(base(), ref)
        except baselines.BackendUnavailable as exc:
            log(f"  {base_name} cannot run: {exc}")
            err_base = math.nan
        del ref, poisoned
        plan = plan_of(op, a, b, sizes)
        choice = plan.choice
        fns = {"ours": lambda: ours(op, a, b, sizes), base_name: base}
        eager = bench.interleave(fns, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, min_reps=args.min_reps,
                                 mode="eager")
        graph = (bench.interleave(fns, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, min_reps=args.min_reps,
                                  mode="graph") if on_gpu else {})

        def ms(t, name):
            return t[name].median_ms if name in t else math.nan

        rec = {k: row.get(k) for k in ("model", "layer", "op", "G", "N", "K", "M", "tokens_per_expert", "dtype")}
        rec.update(routing=routing, key=mselect.key_of(row), baseline=base_name,
                   ours_candidate=choice.candidate.name if choice else plan.label, ours_variant=(
                       choice.candidate.variant if choice else ""),
                   ours_source=choice.source if choice else "", ours_where=choice.where if choice else "",
                   ours_label=plan.label,
                   ours_ms=ms(eager, "ours"), base_ms=ms(eager, base_name),
                   ours_q25_ms=eager["ours"].q25_ms if "ours" in eager else math.nan,
                   ours_q75_ms=eager["ours"].q75_ms if "ours" in eager else math.nan,
                   ours_graph_ms=ms(graph, "ours"), base_graph_ms=ms(graph, base_name),
                   ours_host_us=eager["ours"].host_us if "ours" in eager else math.nan,
                   base_host_us=eager[base_name].host_us if base_name in eager else math.nan,
                   err_ours=err_ours, err_base=err_base, flops=flops,
                   timing=("eager: CUDA events, L2 flushed, in turn; graph: CUDA-graph replays" if on_gpu
                           else "host timer in Triton's interpreter: not a performance number"))
        rec["ratio_eager"] = rec["base_ms"] / rec["ours_ms"]
        rec["ratio_graph"] = rec["base_graph_ms"] / rec["ours_graph_ms"]
        rec["ours_tflops"] = flops / rec["ours_ms"] / 1e9
        out_rows.append(rec)
        log(f"{row.get('model', '')} {row.get('layer', '')} {op:5s} G={row['G']} M={row['M']} {routing:8s} "
            f"ours {rec['ours_ms']:.3f} ms ({rec['ours_candidate']}, {rec['ours_source']}) {base_name} "
            f"{rec['base_ms']:.3f} ms: x{rec['ratio_eager']:.3f} eager, x{rec['ratio_graph']:.3f} graph; "
            f"err {err_ours:.1e}/{err_base:.1e}")
    return out_rows


def summarize(df, tol: float) -> str:
    lines = []
    base = {"grouped_mm": "torch._grouped_mm", "cublas_loop": "torch.mm per expert"}[df.baseline.iloc[0]]
    for col, what in (("ratio_eager", "eager"), ("ratio_graph", "graph-replayed")):
        r = df[col].dropna()
        if not len(r):
            continue
        lines.append(f"## {base} time / ours, {what}\n")
        met = gmean(r) >= GOAL_GEOMEAN and r.min() >= GOAL_MIN
        lines.append(f"overall: geomean {gmean(r):.3f}, lowest {r.min():.3f} ({len(r)} cases; goal: geomean >= "
                     f"{GOAL_GEOMEAN}, none below {GOAL_MIN}: {'met' if met else 'NOT met'})")
        worst = df.loc[df[col].idxmin()]
        lines.append(f"lowest case: {worst['model']} {worst['layer']} {worst['op']} G={worst['G']} M={worst['M']} "
                     f"{worst['routing']} ({worst['ours_candidate']}, {worst['ours_source']})")
        for by in ("op", "model", "routing"):
            g = df.groupby(by, sort=False)[col]
            lines.append("")
            lines.append(f"| {by} | geomean | lowest | cases |\n| --- | --- | --- | --- |")
            for name, s in g:
                lines.append(f"| {name} | {gmean(s):.3f} | {s.min():.3f} | {s.count()} |")
        lines.append("")
    src = df["ours_source"].value_counts().to_dict()
    lines.append(f"ours served by: {src}; candidates run: {df['ours_candidate'].value_counts().to_dict()}")
    bad = df[(df.err_ours > tol) | df.err_ours.isna()]
    lines.append(f"correctness: max relative error ours {df.err_ours.max():.2e}, {df.baseline.iloc[0]} "
                 f"{df.err_base.max():.2e}; cases of ours over {tol:g}: {len(bad)}")
    return "\n".join(lines)


def main(argv=None) -> int:
    import pandas as pd

    from kernels.common import interpreter
    from workbench import tune as wtune

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=str(ROOT / "experiments" / "grouped_gemm_layers.yaml"),
                    help="a grouped shape spec (workbench tune grouped's format)")
    ap.add_argument("--out", required=True, help="directory for the CSV and the summary")
    ap.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE",
                    help="keep the rows whose FIELD is VALUE (e.g. model=DeepSeek-V3); repeatable")
    ap.add_argument("--small", action="store_true",
                    help="the spec's first rows at interpreter size (no GPU needed; checks the script only)")
    ap.add_argument("--rows", type=int, default=None, help="only the first ROWS rows (after --where)")
    ap.add_argument("--rep-ms", type=float, default=30.0, help="timed time per callable and mode (default 30)")
    ap.add_argument("--min-reps", type=int, default=10, help="at least this many timed runs each (default 10)")
    ap.add_argument("--warmup-ms", type=float, default=10.0)
    args = ap.parse_args(argv)
    on_gpu = torch.cuda.is_available() and not interpreter.active()
    if not on_gpu and not args.small:
        print("measure_grouped_gemm.py: needs a CUDA GPU; --small runs tiny shapes in Triton's interpreter",
              file=sys.stderr)
        return 2
    where = dict(w.split("=", 1) for w in args.where if "=" in w)
    try:
        rows = wtune.load_shapes(args.shapes, mselect, where)
    except ValueError as exc:
        print(f"measure_grouped_gemm.py: {exc}", file=sys.stderr)
        return 2
    if args.small:
        rows = [shrink(r) for r in rows[:args.rows or 3]]
        for r in rows:
            r["routing"] = r["routing"][:2]
        args.rep_ms, args.min_reps, args.warmup_ms = 1.0, 2, 0.0
    elif args.rows:
        rows = rows[:args.rows]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if on_gpu:
        torch.backends.cuda.matmul.allow_tf32 = False
    dev = "cuda" if on_gpu else "cpu"
    command = "python experiments/measure_grouped_gemm.py " + " ".join(sys.argv[1:] if argv is None else argv)
    prov = {f"prov_{k}": v for k, v in provenance.flat(provenance.collect(world_size=1)).items()}
    prov["prov_command"] = command
    log(f"{len(rows)} rows on {prov.get('prov_device_name', dev)}; tuning tables: user "
        f"{os.environ.get('WORKBENCH_TUNING_DIR') or '(default)'} over shipped")
    t0 = time.time()
    records = []
    for i, row in enumerate(rows):
        records += measure_row(row, 1000 + i, dev, args, on_gpu)
        df = pd.DataFrame(records).assign(**prov)
        df.to_csv(out / CSV, index=False)   # what was measured so far survives a time-out
        if on_gpu:
            torch.cuda.empty_cache()
    df = pd.DataFrame(records).assign(**prov)
    df.to_csv(out / CSV, index=False)
    tol = max(tolerance(mselect.DTYPES[r["dtype"]]) for r in rows)
    text = summarize(df, tol)
    (out / "summary.md").write_text(f"command: {command}\n\n{text}\n")
    log(text)
    log(f"wrote {out / CSV} and {out / 'summary.md'} ({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
