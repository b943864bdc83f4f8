"""Fit the GEMM cold-start rule on the zoo's fit half, timed on every GPU given, and report it
on the held-out half and on the fresh shapes, against the per-shape best candidate and cuBLAS,
overall and per region class.

    python experiments/fit_gemm_cold_rule.py --times results/gemm_selection/h100/times_gemm.csv \\
        results/gemm_selection/h200/times_gemm.csv --out results/gemm_selection --write-rule

Input: the per-candidate times ``workbench tune gemm --times`` writes (every candidate of a shape
timed in the same tuning run, cuBLAS among them). Two rules are compared:

* ``cost model``: the rule in ``kernels/gemm/cold.py`` without a region table (the cost model
  fitted earlier on one H200's zoo sweep, and the class defaults, ``cold.UNFITTED``);
* ``regions``: a table from a few coarse features to one candidate per region
  (``kernels.gemm.cold.regions``: the class regions of large unaligned, narrow-N and long-K
  problems first, then general ones at three levels of detail). A region with at least
  ``--min-shapes`` fit shapes takes the candidate of least geometric-mean regret over them on
  every GPU; one with fewer takes the candidate with the best worst case over the shapes it
  has (never the library by default); one with none is left out, so a problem takes its
  class's default (``cold.UNFITTED``) or its next, coarser region, else the cost model.

Which is kept is decided on the fit half alone, by 5-fold cross-validation (shapes split by a
hash of their key, both GPUs' timings of a shape in the same fold): the region table is kept
(``--write-rule`` writes ``kernels/gemm/cold_rule.json``) only if its cross-validated regret
beats the cost model's by more than ``--margin``; otherwise the simpler of the two that is
within the margin. Then both are reported on the held-out half and the fresh shapes, which
took no part in the choice: ``cold_rule_report.csv`` (per shape and GPU: the pick, the region
that named it, the regret), ``cold_rule_summary.csv`` / ``.md`` (per rule, set and GPU: regret
against the per-shape best of ours and cuBLAS, ratio to cuBLAS, and the best of ours alone) and
``cold_rule_regions.csv`` (the same per region class: bigpad, narrow, longk, other).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RULE_PATH = ROOT / "kernels" / "gemm" / "cold_rule.json"
SMS = 132  # H100 SXM and H200: the rule's features count rounds over this many SMs
LIBRARY = "cublas"
MIN_SHAPES = 3


def load_times(paths: list[Path]) -> dict:
    """{(device, key): {"shape": {...}, "us": {candidate: us}}} from ``--times`` CSVs."""
    import pandas as pd

    out: dict = {}
    for p in paths:
        df = pd.read_csv(p)
        df = df[(df.family == "gemm") & (df.status == "ok")]
        for r in df.itertuples():
            rec = out.setdefault((r.device, r.key), {"shape": json.loads(r.shape), "us": {}})
            rec["us"][r.candidate] = float(r.us)
    return out


def split_of(shape: dict) -> str:
    s = str(shape.get("split", ""))
    return "fresh" if s.startswith("fresh") else s or "unknown"


def fake_call(shape: dict):
    """The planning facts of a shape on an sm_90 GPU with SMS SMs, off the GPU (meta tensors)."""
    import torch

    from kernels.gemm import tuning as gtuning
    from kernels.gemm.plan import Call

    s = gtuning.shape_of(shape)
    dtype = gtuning.DTYPES[s["dtype"]]
    M, N, K = s["M"], s["N"], s["K"]
    es = torch.empty((), dtype=dtype).element_size()
    a = torch.empty(M, K, dtype=dtype, device="meta")
    b = torch.empty(N, K, dtype=dtype, device="meta").t() if s["b"] == "t" else torch.empty(K, N, dtype=dtype,
                                                                                           device="meta")
    a_ok, c_ok = (K * es) % 16 == 0, (N * es) % 16 == 0
    b_ok = (K * es) % 16 == 0 if s["b"] == "t" else (N * es) % 16 == 0
    return Call(a, b, None, M, N, K, on_gpu=True, hopper=True, sm90=True, sms=SMS, a_ok=a_ok, b_ok=b_ok,
                b_km=s["b"] == "t" and b_ok, c_ok=c_ok, device_descriptors=True, gluon_device_descriptors=True)


def facts(shape: dict) -> dict:
    """What the rule looks at: M, N, K, dtype, whether every operand is TMA-aligned; the regions
    the table is keyed on, most specific first (``kernels.gemm.cold.regions``); the class."""
    from kernels.gemm import cold

    call = fake_call(shape)
    args = (call.M, call.N, call.K, call.dtype, call.aligned, SMS)
    return {"args": args, "region": cold.regions(*args), "class": cold.shape_class(*args) or "other"}


def cost_model_pick(shape: dict) -> str:
    from kernels.gemm import cold, select as gselect

    saved = cold.REGIONS
    cold.REGIONS = {}
    try:
        return gselect.cold(fake_call(shape)).name
    finally:
        cold.REGIONS = saved


def _repo_path(p: Path) -> str:
    """``p`` relative to the repository when it lies inside it (what a committed rule should name)."""
    try:
        return str(Path(p).resolve().relative_to(ROOT))
    except ValueError:
        return str(p)


def geomean(xs) -> float:
    xs = [x for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


GEOMEAN, WORST = "least geomean regret", "best worst case"


def serving_regions(rec: dict) -> list[str]:
    """The regions a record is fitted into: every level of a shape outside the classes; a class
    shape's class regions alone. The class regions serve every shape of a class the table has fit
    points of, so a general region never serves one; fitted on them, it served the other shapes
    of its region what won there (at 256 x 16384 x 16384, a general region fitted on long-K class
    shapes alone, at 1 or 2 tiles per SM, named t64x128, 0.6x cuBLAS on its nearest measured shapes)."""
    cls = rec.get("class", "other")
    return rec["region"] if cls == "other" else [r for r in rec["region"] if r.startswith(cls)]


def fit_regions(recs: list[dict], min_shapes: int) -> tuple[dict[str, str], dict[str, dict]]:
    """(region -> candidate, region -> {shapes, how}) over the records (each a shape on one GPU),
    among the candidates timed on all of a region's records: least geometric-mean regret where
    the region has at least ``min_shapes`` shapes, else the best worst-case regret (few points:
    the candidate that is never far off on any of them)."""
    by_region: dict[str, list[dict]] = defaultdict(list)
    for r in recs:
        for reg in serving_regions(r):
            by_region[reg].append(r)
    table, info = {}, {}
    for reg, rows in sorted(by_region.items()):
        shapes = len({r["key"] for r in rows})
        common = set.intersection(*(set(r["us"]) for r in rows))
        if not common:
            continue
        regrets = {c: [r["us"][c] / min(r["us"].values()) for r in rows] for c in sorted(common)}
        how = GEOMEAN if shapes >= min_shapes else WORST
        score = (lambda c: geomean(regrets[c])) if how == GEOMEAN else (lambda c: (max(regrets[c]),
                                                                                   geomean(regrets[c])))
        table[reg] = min(regrets, key=score)
        info[reg] = {"shapes": shapes, "how": how}
    return table, info


def pick(rule: str, table: dict, rec: dict) -> tuple[str, str]:
    """(candidate, what named it) for one record under ``rule``: the region table's pick as
    ``kernels.gemm.cold.region_pick`` makes it (the region, or a class default), else the cost model."""
    if rule == "regions":
        from kernels.gemm import cold

        c, via = cold.region_pick(*rec["args"], table=table)
        if c is not None and c in rec["us"]:
            return c, via
    return rec["cost_model"], "cost model"


def regret(rule: str, table: dict, recs: list[dict]) -> list[float]:
    out = []
    for r in recs:
        c = pick(rule, table, r)[0]
        out.append(r["us"][c] / min(r["us"].values()) if c in r["us"] else math.nan)
    return out


def summarize(g, **keys) -> dict:
    """One summary row of report rows ``g``: regret against the per-shape best of ours and cuBLAS,
    ratio to cuBLAS, and what the best of ours alone reaches."""
    ours_best = g.cublas_us / g.best_ours
    return {**keys, "shapes": len(g),
            "regret_geomean": geomean(g.regret), "regret_worst": g.regret.max(),
            "vs_cublas_geomean": geomean(g.vs_cublas), "vs_cublas_min": g.vs_cublas.min(),
            "below_0.80": int((g.vs_cublas < 0.8).sum()), "below_0.90": int((g.vs_cublas < 0.9).sum()),
            "library_picked": int((g["pick"] == LIBRARY).sum()),
            "tables_vs_cublas_geomean": geomean(g.cublas_us / g.best_us),
            "tables_vs_cublas_min": float((g.cublas_us / g.best_us).min()),
            "best_ours_vs_cublas_geomean": geomean(ours_best), "best_ours_vs_cublas_min": float(ours_best.min())}


def score_candidates(table: dict, paths: list[Path]):
    """The rule's pick (``table``, as ``pick`` makes it) per shape and mode of
    ``run_gemm_selection.py``'s candidates.csv files: its time against the per-shape best of every
    candidate of ours timed there and cuBLAS (1.0: the best ran; NaN where the pick was not timed), and
    our best candidate alone against cuBLAS (> 1: ours faster)."""
    import pandas as pd

    rows = []
    for path in paths:
        df = pd.read_csv(path)
        df = df[(df.status == "ok") & df.method.str.startswith("ours:")]
        for (M, N, K, dtype, b, mode), g in df.groupby(["M", "N", "K", "dtype", "b", "mode"]):
            us = dict(zip(g.method.str.slice(len("ours:")), g.median_us))
            us[LIBRARY] = float(g.cublas_us.median())
            shape = {"M": int(M), "N": int(N), "K": int(K), "dtype": dtype, "b": "t" if b == "t" else "row"}
            rec = {"us": us, **facts(shape), "cost_model": cost_model_pick(shape)}
            c, via = pick("regions", table, rec)
            rows.append({"file": str(path), "M": M, "N": N, "K": K, "dtype": dtype, "b": b, "mode": mode,
                         "class": rec["class"], "pick": c, "via": via, "best": min(us, key=us.get),
                         "pick_vs_best": min(us.values()) / us.get(c, math.nan),
                         "ours_alone_vs_cublas": us[LIBRARY] / min(v for n, v in us.items() if n != LIBRARY)})
    return pd.DataFrame(rows)


def fold_of(key: str, k: int = 5) -> int:
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % k


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--times", type=Path, nargs="+", required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--min-shapes", type=int, default=MIN_SHAPES,
                    help="fit shapes a region needs for its least-geomean pick (fewer: best worst case)")
    ap.add_argument("--margin", type=float, default=0.005, help="CV regret the region table must win by")
    ap.add_argument("--write-rule", action="store_true", help="write kernels/gemm/cold_rule.json if it is kept")
    ap.add_argument("--score", type=Path, nargs="*", default=[],
                    help="run_gemm_selection.py candidates.csv files (every candidate of ours and cuBLAS timed per "
                         "shape, graph and eager): the kept rule's pick scored on them (cold_rule_scored.csv)")
    ap.add_argument("--rule-out", type=Path, default=None,
                    help="with --write-rule: write the rule here instead (try it with WORKBENCH_GEMM_COLD_RULE=PATH)")
    args = ap.parse_args(argv)
    import pandas as pd

    times = load_times(args.times)
    recs = []
    for (device, key), rec in times.items():
        if LIBRARY not in rec["us"] or len(rec["us"]) < 2:
            continue
        shape = rec["shape"]
        recs.append({"device": device, "key": key, "shape": shape, "split": split_of(shape), "us": rec["us"],
                     **facts(shape), "cost_model": cost_model_pick(shape)})
    fit = [r for r in recs if r["split"] == "fit"]
    # Cross-validation on the fit half only.
    cv = {"cost model": [], "regions": []}
    for k in range(5):
        train = [r for r in fit if fold_of(r["key"]) != k]
        test = [r for r in fit if fold_of(r["key"]) == k]
        table, _ = fit_regions(train, args.min_shapes)
        for rule in cv:
            cv[rule] += regret(rule, table, test)
    cv_gm = {rule: geomean(v) for rule, v in cv.items()}
    keep = "regions" if cv_gm["regions"] < cv_gm["cost model"] * (1 - args.margin) else "cost model"
    table, info = fit_regions(fit, args.min_shapes)
    print(f"5-fold CV on the fit half ({len(fit)} shape-GPU records): regret cost model {cv_gm['cost model']:.3f}, "
          f"regions {cv_gm['regions']:.3f} -> keep {keep}")
    few = {r: i for r, i in info.items() if i["how"] == WORST}
    print(f"{len(table)} regions fitted, {len(few)} of them on fewer than {args.min_shapes} shapes (best worst case)")
    rows = []
    for r in recs:
        best = min(r["us"], key=r["us"].get)
        for rule in ("cost model", "regions"):
            c, via = pick(rule, table, r)
            t = r["us"].get(c, math.nan)
            rows.append({"device": r["device"], "key": r["key"], "split": r["split"], "class": r["class"],
                         "region": r["region"][0], "rule": rule, "pick": c, "via": via,
                         "via_shapes": info.get(via, {}).get("shapes", 0), "us": t, "best": best,
                         "best_us": r["us"][best], "cublas_us": r["us"][LIBRARY], "regret": t / r["us"][best],
                         "vs_cublas": r["us"][LIBRARY] / t,
                         "best_ours": min((v for n, v in r["us"].items() if n != LIBRARY), default=math.nan)})
    df = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out / "cold_rule_report.csv", index=False)
    sdf = pd.DataFrame([summarize(g, rule=rule, set=split, device=dev)
                        for (rule, split, dev), g in df.groupby(["rule", "split", "device"])])
    sdf.to_csv(args.out / "cold_rule_summary.csv", index=False)
    cdf = pd.DataFrame([summarize(g, rule=rule, set=split, device=dev, **{"class": cls})
                        for (rule, split, dev, cls), g in df.groupby(["rule", "split", "device", "class"])])
    cdf.to_csv(args.out / "cold_rule_regions.csv", index=False)
    fmt = lambda x: f"{x:.3f}"   # noqa: E731
    md = ["# GEMM cold rule: fitted on the fit half, reported on the others\n",
          f"5-fold cross-validated regret on the fit half: cost model {cv_gm['cost model']:.3f}, region table "
          f"{cv_gm['regions']:.3f}; kept: **{keep}** (margin {args.margin}). Regions with fewer than "
          f"{args.min_shapes} fit shapes take the candidate with the best worst case over them "
          f"({len(few)} of {len(table)}).\n",
          "Regret: time over the per-shape best of every candidate timed, ours and cuBLAS; `best_ours`: the best "
          "of our kernels alone.\n",
          "```", sdf.to_string(index=False, float_format=fmt), "```", "",
          "Per region class (bigpad: large unaligned 16-bit; narrow: N <= 1024, tall M; longk: long K, small M "
          "and N; `kernels.gemm.cold.shape_class`):\n",
          "```", cdf.to_string(index=False, float_format=fmt), "```", ""]
    (args.out / "cold_rule_summary.md").write_text("\n".join(md))
    print(sdf.to_string(index=False, float_format=fmt))
    print(cdf[cdf.set != "fit"].to_string(index=False, float_format=fmt))
    if args.score:
        scored = score_candidates(table if keep == "regions" else {}, args.score)
        scored.to_csv(args.out / "cold_rule_scored.csv", index=False)
        print(scored.groupby(["file", "mode", "class"]).pick_vs_best.agg([geomean, "min", "size"])
              .to_string(float_format=fmt))
    if args.write_rule:
        doc = {"format": "kernel-workbench gemm cold rule", "version": 1, "rule": keep,
               "regions": table if keep == "regions" else {}, "sms": SMS,
               "region_info": info if keep == "regions" else {}, "min_shapes": args.min_shapes,
               "fitted_on": sorted({_repo_path(p) for p in args.times}), "cv_regret": cv_gm,
               "fit_records": len(fit)}
        path = args.rule_out or RULE_PATH
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
        print(f"wrote {path} ({keep}, {len(doc['regions'])} regions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
