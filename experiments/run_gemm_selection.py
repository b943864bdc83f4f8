"""Which GEMM configuration runs, checked on shapes the rule was not fitted on: ``matmul`` as users
call it (tuning tables, else the cold rule), the cold rule alone, cuBLAS and every candidate of
ours, timed in the same run, CUDA-graph replayed and eager; the report of issue 43 from them; and
the cost of a first call that tunes (tune-on-miss).

    python experiments/run_gemm_selection.py --out results/gemm_selection/h200 --split held_out --fresh 20
    python experiments/run_gemm_selection.py --out DIR --split held_out --fresh 20 --resume   # go on after a cut
    python experiments/run_gemm_selection.py --out DIR --report-only       # the report again, from DIR's rows
    python experiments/run_gemm_selection.py --out DIR --split none --tune-on-miss 3        # first calls alone
    python experiments/run_gemm_selection.py --fresh 20 --write-fresh fresh.yaml   # draw fresh shapes only

Shapes: the zoo's ``--split`` half (``experiments/gemm_shapes.yaml``, 16-bit by default:
``--dtypes``) and ``--fresh N`` shapes drawn at run time (M, N, K uniform in [1, 16384], N and K
multiples of 8, bf16) from ``--seed`` (default: the date, YYYYMMDD in UTC); the seed is printed,
kept in ``OUT/fresh.yaml`` (a resumed run draws nothing new) and written at the head of the
report. ``--fresh-yaml`` adds shapes drawn elsewhere (e.g. before a tuning run, so that the
tables hold them). Every method runs once on a NaN-poisoned output and is checked against an
fp32 reference; then all are timed taking turns run by run (``workbench.bench.interleave``, L2
flushed before each run), CUDA-graph replayed (``graph``: GPU time) and eager (``eager``: as a
Python loop calls it, host cost included), with the host time per call of ``matmul`` and
cuBLAS (``--host-calls``; ``experiments/launch_cost.py --paths`` measures every path's).

Files (appended shape by shape, so a cut run keeps what it measured; ``--resume`` skips the
shapes already there): ``verify.csv`` (per shape and mode: ``ours``, ``matmul`` as users call it;
``cold``, the cold rule's config; ``cublas``), ``candidates.csv`` (the same for every candidate
of ours, method ``ours:<name>``), then the report (``experiments/gemm_selection_report.py``):
``report.md``, ``selection_shapes.csv``, ``selection_summary.csv``, ``selection_by_class.csv``,
``selection_goals.csv``: regret against the per-shape best of ours and cuBLAS, as chosen and
ours alone side by side, per set (held-out, fresh, both), mode and region class.

``--tune-on-miss N``: N more fresh shapes (drawn after the others), each called once with
``tune=True`` into an empty table, in a new process with an empty Triton cache (every kernel
compiles: compile time counted, as a user's first call pays it; ``--warm-cache`` keeps the usual
cache): the first call's wall time against the budget, what was timed and skipped, later calls'
host time. -> ``tune_on_miss.csv``. Without a GPU it runs in Triton's interpreter (``--small``:
tiny shapes and two candidates, not performance).
"""
from __future__ import annotations

import argparse
import datetime as dt
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))
FRESH_MAX = 16384
SHAPE_KEY = ["set", "M", "N", "K", "dtype", "b"]


def day_seed(day: str | None = None) -> int:
    """The fresh shapes' default seed: the date as YYYYMMDD (today in UTC unless ``day``)."""
    return int(day or dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d"))


def fresh_shapes(n: int, day: str | None = None, skip: int = 0, seed: int | None = None) -> list[dict]:
    """``n`` shapes drawn uniformly (M in [1, 16384]; N, K multiples of 8 in [8, 16384]), bf16, from
    ``seed`` (default: ``day_seed(day)``); ``skip`` draws are discarded first."""
    seed = day_seed(day) if seed is None else seed
    rng = random.Random(seed)
    out = []
    for i in range(skip + n):
        s = {"M": rng.randint(1, FRESH_MAX), "N": 8 * rng.randint(1, FRESH_MAX // 8),
             "K": 8 * rng.randint(1, FRESH_MAX // 8), "dtype": "bfloat16", "split": f"fresh-{seed}",
             "source": f"fresh seed {seed} #{i}"}
        if i >= skip:
            out.append(s)
    return out


def write_yaml(path: Path, shapes: list[dict], seed: int | None = None) -> None:
    import yaml

    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {"seed": seed, "shapes": shapes} if seed is not None else {"shapes": shapes}
    path.write_text(f"# fresh shapes drawn by experiments/run_gemm_selection.py (seed {seed})\n"
                    + yaml.safe_dump(doc, sort_keys=False))


def set_of(shape: dict) -> str:
    s = str(shape.get("split", ""))
    return "fresh" if s.startswith("fresh") else s or "other"


def _rel_err(out, ref) -> float:
    import torch

    o = out.float()
    if not torch.isfinite(o).all():
        return math.nan
    return float(torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref))


def _done(out_dir: Path) -> set[tuple]:
    """The shapes ``verify.csv`` already holds (``--resume``)."""
    import pandas as pd

    path = out_dir / "verify.csv"
    if not path.exists():
        return set()
    df = pd.read_csv(path)
    if "set" not in df:
        return set()
    df["b"] = df["b"].fillna("row") if "b" in df else "row"
    return {tuple(r) for r in df[SHAPE_KEY].itertuples(index=False)}


def _methods(a, b, c, max_candidates: int | None):
    """{method: (fn, candidate name)}: matmul as users call it, the cold rule's config, cuBLAS, and
    each candidate of ours; plus the plan of the first and the cold rule's candidate."""
    import torch

    from kernels.gemm import launch as glaunch, select as gselect

    M, K = a.shape
    N = b.shape[1]
    plan = glaunch.plan_for(a, b, None, c)
    call = glaunch._call(a, b, c, M, N, K, False, False)
    cold = gselect.cold(call)
    fns = {"ours": (lambda: glaunch.matmul(a, b, out=c),
                    plan.choice.candidate.name if plan.choice else "explicit"),
           "cold": (lambda: glaunch.matmul(a, b, cold.config, out=c), cold.name)}
    if a.device.type == "cuda":
        fns["cublas"] = (lambda: torch.matmul(a, b, out=c), "cublas")
    ours = [(n, cand) for n, cand in gselect.candidates(call).items() if cand.variant != "library"]
    for name, cand in ours[:max_candidates]:
        fns[f"ours:{name}"] = ((lambda cfg=cand.config: glaunch.matmul(a, b, cfg, out=c)), name)
    return fns, plan, call, cold


def _append(path: Path, df) -> None:
    """Rows appended to a CSV in the columns its header already has (a resumed run's rows line up
    with the first run's; a column the file lacks is left out)."""
    import pandas as pd

    if path.exists():
        df = df.reindex(columns=pd.read_csv(path, nrows=0).columns)
    df.to_csv(path, mode="a", header=not path.exists(), index=False)


def verify(shapes: list[dict], args, prov, out_dir: Path) -> None:
    import pandas as pd
    import torch

    from kernels.gemm import cold as cold_rule, sweep as gsweep, tuning as gtuning
    from workbench import bench, provenance

    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    device = "cuda" if on_gpu else "cpu"
    done = _done(out_dir) if args.resume else set()
    t0 = time.time()
    measured = 0
    for i, s in enumerate(shapes):
        s = gtuning.shape_of(s)
        key = (set_of(s), s["M"], s["N"], s["K"], s["dtype"], s["b"])
        if key in done:
            continue
        if time.time() - t0 > args.budget_s:
            print(f"verify: budget of {args.budget_s:.0f} s spent; shapes from #{i} not run (--resume goes on)",
                  flush=True)
            break
        a, b = gtuning.operands(s, device, seed=7000 + i)
        M, K = a.shape
        N = b.shape[1]
        c = torch.empty(M, N, dtype=a.dtype, device=device)
        ref = a.float() @ b.float()
        fns, plan, call, cold = _methods(a, b, c, args.max_candidates)
        cls = cold_rule.shape_class(M, N, K, a.dtype, call.aligned, call.sms) or "other"
        status, errs = {}, {}
        for name, (fn, _) in list(fns.items()):
            c.fill_(float("nan"))
            try:
                fn()
                errs[name] = _rel_err(c, ref)
                status[name] = "ok" if errs[name] <= gsweep.tolerance(a.dtype) else f"wrong: rel_err {errs[name]:.2e}"
            except Exception as exc:   # recorded, not timed
                status[name] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
        live = {n: fn for n, (fn, _) in fns.items() if status[n] == "ok"}
        timings = {m: bench.interleave(live, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, min_reps=10,
                                       max_reps=args.max_reps, mode=m) for m in ("graph", "eager")}
        host = {n: bench.host_time_us(live[n], calls=args.host_calls, warmup=10)["median_us"]
                for n in ("ours", "cublas") if n in live}
        rows = []
        for name, (_, cand) in fns.items():
            for mode, tm in timings.items():
                t, cub = tm.get(name), tm.get("cublas")
                rows.append(dict(
                    {k: s[k] for k in ("M", "N", "K", "dtype", "b")}, set=key[0], split=s.get("split"),
                    origin=s.get("source", ""), group=s.get("group", ""), b_layout=s["b"], **{"class": cls},
                    method=name, mode=mode,
                    status=status[name] if t is not None or status[name] != "ok" else "not timed",
                    rel_err=errs.get(name, math.nan), candidate=cand,
                    source={"ours": plan.choice.source if plan.choice else "", "cold": "cold"}.get(name, ""),
                    median_us=t.median_ms * 1e3 if t else math.nan, q25_us=t.q25_ms * 1e3 if t else math.nan,
                    q75_us=t.q75_ms * 1e3 if t else math.nan, n_runs=t.n if t else 0,
                    host_us=host.get(name, math.nan) if mode == "eager" else math.nan,
                    vs_cublas=cub.median_ms / t.median_ms if t and cub else math.nan,
                    cublas_us=cub.median_ms * 1e3 if cub else math.nan, **provenance.flat(prov)))
        df = pd.DataFrame(rows)
        _append(out_dir / "verify.csv", df[~df.method.str.startswith("ours:")])
        _append(out_dir / "candidates.csv", df[df.method.str.startswith("ours:")])
        g = timings["graph"]
        ratio = (lambda n: g["cublas"].median_ms / g[n].median_ms if n in g and "cublas" in g else math.nan)
        ours = {n: g[n].median_ms for n in g if n.startswith("ours:")}
        best = min(ours, key=ours.get) if ours else "-"
        print(f"[{i + 1}/{len(shapes)} {time.time() - t0:4.0f}s] {M}x{N}x{K} {s['dtype']} b={s['b']} {key[0]:8} {cls:6} "
              f"chosen {fns['ours'][1]} ({plan.choice.source if plan.choice else '-'}) x{ratio('ours'):.3f}  "
              f"cold {cold.name} x{ratio('cold'):.3f}  best of ours {best[5:]} x{ratio(best):.3f}  host "
              f"{host.get('ours', math.nan):.1f} / cuBLAS {host.get('cublas', math.nan):.1f} us"
              + ("" if all(v == "ok" for v in status.values()) else
                 f"  NOT OK: { {k: v for k, v in status.items() if v != 'ok'} }"), flush=True)
        measured += 1
        del a, b, c, ref
        if on_gpu:
            torch.cuda.empty_cache()
    have = _done(out_dir)
    left = sum((set_of(s), s["M"], s["N"], s["K"], s["dtype"], s.get("b", "row")) not in have for s in shapes)
    print(f"verify: {measured} shapes measured now, {len(shapes) - left} of {len(shapes)} in {out_dir / 'verify.csv'}"
          + (f"; {left} left (run again with --resume)" if left else "; done"), flush=True)


def tune_on_miss(shapes: list[dict], args, prov, out_csv: Path) -> None:
    """First call with tune=True into an empty table: its wall time; then the host time of later
    calls. Run in a process of its own (``main`` starts it) so that nothing is compiled before."""
    import pandas as pd
    import torch

    from kernels.common import select, tables, tune
    from kernels.gemm import launch as glaunch, tuning as gtuning
    from workbench import bench, provenance

    on_gpu = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") != "1"
    device = "cuda" if on_gpu else "cpu"
    budget = tune.budget_s(args.tune_budget_s)
    os.environ[tune.BUDGET_ENV] = str(budget)   # what matmul(tune=True) reads
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
            rows.append(dict(s, first_call_s=first_s, budget_s=budget, within_budget=first_s <= 1.1 * budget,
                             candidate=plan.choice.candidate.name, source=plan.choice.source,
                             timed=entry.get("timed"), of=entry.get("of"), skipped=entry.get("skipped"),
                             first_runs_s=entry.get("first_runs_s"), tuning_s=entry.get("elapsed_s"),
                             us=entry.get("us"), cold=entry.get("cold"), cold_us=entry.get("cold_us"),
                             later_host_us=host["median_us"], torch_mm_host_us=host_mm["median_us"],
                             ok=bool(torch.isfinite(c).all()), **provenance.flat(prov)))
            print(f"tune-on-miss {s['M']}x{s['N']}x{s['K']}: first call {first_s:.2f} s (budget {budget:.1f} s"
                  f"{'' if first_s <= 1.1 * budget else ', OVER budget + 10%'}), {plan.choice.candidate.name} "
                  f"({entry.get('timed')}/{entry.get('of')} timed, {entry.get('skipped')} skipped, first runs "
                  f"{entry.get('first_runs_s')} s), later calls {host['median_us']:.1f} us host "
                  f"(torch.matmul {host_mm['median_us']:.1f})", flush=True)
    pd.DataFrame(rows).to_csv(out_csv, index=False)


def report(out_dir: Path, head: str = "") -> str:
    """The report's tables from ``verify.csv`` and ``candidates.csv`` in ``out_dir``."""
    import pandas as pd

    import gemm_selection_report as rep

    parts = [pd.read_csv(out_dir / n) for n in ("verify.csv", "candidates.csv") if (out_dir / n).exists()]
    if not parts:
        raise SystemExit(f"run_gemm_selection: no verify.csv in {out_dir}: measure first (without --report-only)")
    rows = pd.concat(parts, ignore_index=True)
    rows["method"] = rows.method.replace({"ours": "chosen"})   # verify.csv's "ours": matmul as users call it
    if "set" not in rows:   # a verify.csv of an earlier version
        rows["set"] = [("fresh" if str(s).startswith("fresh") else s) for s in rows.split]
    if "class" not in rows:
        rows["class"] = "other"
    rows["b"] = rows["b"].fillna("row") if "b" in rows else "row"
    shapes = rep.per_shape(rows)
    shapes.to_csv(out_dir / "selection_shapes.csv", index=False)
    rep.summary(shapes).to_csv(out_dir / "selection_summary.csv", index=False)
    rep.by_class(shapes).to_csv(out_dir / "selection_by_class.csv", index=False)
    rep.goals(shapes).to_csv(out_dir / "selection_goals.csv", index=False)
    seeds = sorted({str(x)[len("fresh-"):] for x in rows.split.dropna() if str(x).startswith("fresh-")})
    seed = ", ".join(seeds)
    dev = rows.device_name.dropna().unique() if "device_name" in rows else []
    sha = rows.git_sha.dropna().unique() if "git_sha" in rows else []
    text = rep.markdown(shapes, head or (
        f"# GEMM selection report: {', '.join(map(str, dev)) or 'unknown device'}\n\n"
        f"Commit {', '.join(str(x)[:10] for x in sha)}; fresh shapes drawn with seed {seed or '(none)'}; "
        f"rows: {out_dir / 'verify.csv'} and {out_dir / 'candidates.csv'} "
        f"(`python experiments/run_gemm_selection.py --out {out_dir} --report-only` writes this again).\n"))
    (out_dir / "report.md").write_text(text)
    return text


def _tune_on_miss_child(args, extra_shapes: list[dict]) -> int:
    """Run tune-on-miss in a new process: nothing compiled yet in it, and (unless ``--warm-cache``)
    an empty Triton cache, so each first call compiles what it runs."""
    import yaml

    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "shapes.yaml"
        spec.write_text(yaml.safe_dump({"shapes": extra_shapes}))
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        if not args.warm_cache:
            env["TRITON_CACHE_DIR"] = str(Path(tmp) / "triton-cache")
        argv = [sys.executable, str(Path(__file__).resolve()), "--out", str(args.out), "--tune-on-miss-shapes",
                str(spec), "--host-calls", str(args.host_calls)]
        if args.tune_budget_s is not None:
            argv += ["--tune-budget-s", str(args.tune_budget_s)]
        return subprocess.run(argv, env=env).returncode


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="directory for the rows and the report")
    p.add_argument("--split", default="held_out", help="zoo half to verify: held_out, fit, all or none")
    p.add_argument("--dtypes", default="bfloat16,float16", help="zoo dtypes to verify (comma-separated)")
    p.add_argument("--fresh-yaml", type=Path, default=None, help="fresh shapes drawn elsewhere, verified too")
    p.add_argument("--fresh", type=int, default=0, help="draw this many fresh shapes now")
    p.add_argument("--seed", type=int, default=None, help="their seed (default: the date, YYYYMMDD)")
    p.add_argument("--day", default=None, help="the date that seeds them (YYYYMMDD; default today, UTC)")
    p.add_argument("--write-fresh", type=Path, default=None, help="write the drawn fresh shapes here and stop")
    p.add_argument("--resume", action="store_true", help="skip the shapes OUT/verify.csv already holds")
    p.add_argument("--report-only", action="store_true", help="write the report from OUT's rows; measure nothing")
    p.add_argument("--tune-on-miss", type=int, default=0, help="this many more fresh shapes, tuned on first call")
    p.add_argument("--tune-budget-s", type=float, default=None)
    p.add_argument("--warm-cache", action="store_true", help="tune-on-miss with the usual Triton cache")
    p.add_argument("--tune-on-miss-shapes", type=Path, default=None, help=argparse.SUPPRESS)   # the child
    p.add_argument("--small", action="store_true", help="tiny shapes, two candidates (the interpreter)")
    p.add_argument("--max-candidates", type=int, default=None, help="time at most this many of ours per shape")
    p.add_argument("--budget-s", type=float, default=1e9, help="stop starting shapes after this many seconds")
    p.add_argument("--rep-ms", type=float, default=20)
    p.add_argument("--warmup-ms", type=float, default=10)
    p.add_argument("--max-reps", type=int, default=100)
    p.add_argument("--host-calls", type=int, default=100)
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else day_seed(args.day)
    if args.write_fresh:
        write_yaml(args.write_fresh, fresh_shapes(args.fresh, seed=seed), seed)
        print(f"wrote {args.fresh} fresh shapes (seed {seed}) to {args.write_fresh}")
        return 0
    if args.out is None:
        p.error("--out is required (or --fresh N --write-fresh PATH)")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.report_only:
        print(report(args.out))
        return 0
    from experiments.run_gemm_zoo import load_shapes
    from kernels.gemm import tuning as gtuning
    from workbench import provenance
    from workbench.tune import load_shapes as load_spec

    prov = provenance.collect(knobs={"script": "experiments/run_gemm_selection.py", "argv": " ".join(sys.argv[1:])})
    if args.tune_on_miss_shapes:   # the child process of --tune-on-miss
        tune_on_miss(load_spec(str(args.tune_on_miss_shapes), gtuning), args, prov, args.out / "tune_on_miss.csv")
        return 0
    if args.small:
        shapes = [dict(M=m, N=n, K=k, dtype="float16", split="held_out") for m, n, k in ((5, 24, 40), (33, 40, 64))]
        args.max_candidates = 2 if args.max_candidates is None else args.max_candidates
    else:
        dtypes = set(args.dtypes.split(","))
        shapes = [] if args.split == "none" else [s for s in load_shapes() if s["dtype"] in dtypes and
                                                   (args.split == "all" or s["split"] == args.split)]
        if args.fresh_yaml:
            shapes += load_spec(str(args.fresh_yaml), gtuning)
    if args.fresh and not args.small:
        fresh_file = args.out / "fresh.yaml"
        if args.resume and fresh_file.exists():
            drawn = load_spec(str(fresh_file), gtuning)
            import yaml

            seed = yaml.safe_load(fresh_file.read_text()).get("seed", seed)
        else:
            drawn = fresh_shapes(args.fresh, seed=seed)
            write_yaml(fresh_file, drawn, seed)
        print(f"fresh shapes: {len(drawn)} drawn with seed {seed} (M, N, K uniform in [1, {FRESH_MAX}], N and K "
              f"multiples of 8, bf16; {fresh_file})", flush=True)
        shapes += drawn
    if shapes:
        verify(shapes, args, prov, args.out)
        print(report(args.out), flush=True)
    if args.tune_on_miss:
        extra = ([dict(M=9, N=16, K=24, dtype="float16")] if args.small else
                 fresh_shapes(args.tune_on_miss, seed=seed, skip=max(args.fresh, 20)))
        return _tune_on_miss_child(args, extra)
    return 0


if __name__ == "__main__":
    sys.exit(main())
