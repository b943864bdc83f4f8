"""The overlap study on a node with 2 GPUs, in one command (about 8 minutes):

    python experiments/run_overlap.py --out results/overlap/h100_w2     # a node with 2 H100s
    python experiments/run_overlap.py --out results/overlap/h200_w2     # a node with 2 H200s

1. the multi-GPU tests of the three families (``pytest -m multigpu``: the all-gather against
   NCCL, all-gather + GEMM and GEMM + all-scatter against the reference on the seed shapes,
   repeated calls and a CUDA-graph replay bit-identical): ``pytest_multigpu.txt`` (its last line
   goes into summary.md);
2. ``run_ag_gemm.py --shape-set llm-reduced`` at world size 2 (``--world-size N``: N): every variant of ours, NCCL +
   cuBLAS, PyTorch's ``fused_all_gather_matmul`` (both gather dims; timed even where it
   misses the tolerance, which its check row says), the GEMM alone and the all-gather alone,
   eager and graph-replayed in rotating passes: ``ag_gemm/`` (bench.csv, checks.csv,
   summary.csv with comm hidden, auto_table.json = the variant choice fitted on the fit half,
   held_out.csv, variant_choice.csv);
3. ``run_gemm_scatter.py --shape-set llm-reduced`` likewise: ``gemm_scatter/`` (times_w2.csv,
   checks_w2.csv, summary_w2.csv, auto_table.json, held_out_w2.csv, variant_choice_w2.csv);
4. ``summary.md``: the tests' result and, per family and mode, the held-out score against the
   best library and the comm hidden (also printed).

Each step has a time limit (``--budget-s`` of the benchmarks stops starting new shapes, what
is left is listed as skipped; ``--timeout`` kills a step that hangs). The exit status is 1
when a test or a step failed. NVLink multicast stays off in every process.
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
for _p in (REPO, REPO / "experiments"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

TEST_FILES = ("tests/test_all_gather.py", "tests/test_ag_gemm.py", "tests/test_gemm_scatter.py")
# seconds: (the step's own budget for starting new work, the limit after which it is killed)
LIMITS = {"pytest": (None, 240), "ag_gemm": (180, 250), "gemm_scatter": (75, 140)}


def steps(out: Path, world_size: int = 2, scale: float = 1.0, random: tuple = (0, None)
          ) -> list[tuple[str, list[str], float, Path]]:
    """(name, command, time limit in s, log file) of each step; ``scale`` shortens (or lengthens)
    every step's budget and limit; ``random``: (count, seed) of the shapes drawn at run time that
    both benchmarks measure besides the set (scored, never fitted)."""
    py = sys.executable
    ag, gs = ([x * scale for x in LIMITS[k]] for k in ("ag_gemm", "gemm_scatter"))
    extra = ["--random-shapes", str(random[0]), "--random-seed", str(random[1])] if random[0] else []
    return [
        ("pytest", [py, "-m", "pytest", "-m", "multigpu", "-q", "-p", "no:cacheprovider", *TEST_FILES],
         LIMITS["pytest"][1] * scale, out / "pytest_multigpu.txt"),
        ("ag_gemm", [py, "experiments/run_ag_gemm.py", "--world-sizes", str(world_size), "--shape-set", "llm-reduced",
                     "--iters", "16", "--budget-s", f"{ag[0]:.0f}", "--timeout", f"{ag[1] - 10:.0f}",
                     "--out", str(out / "ag_gemm"), *extra], ag[1], out / "ag_gemm.log"),
        # 4 GiB of symmetric heap per GPU: each variant of a shape keeps its own C there (M 16384 x N 10240
        # in bf16 is 320 MiB; the default 512 MiB ran out on an H200 at the second variant)
        ("gemm_scatter", [py, "experiments/run_gemm_scatter.py", "--world-sizes", str(world_size), "--shape-set",
                          "llm-reduced", "--heap-mib", "4096", "--budget-s", f"{gs[0]:.0f}", "--timeout", f"{gs[1] - 10:.0f}",
                          "--out", str(out / "gemm_scatter"), *extra], gs[1], out / "gemm_scatter.log"),
    ]


def run_step(cmd: list[str], limit: float, log: Path) -> tuple[int, float]:
    """Run one step from the repository root, its output into ``log``; (exit status, seconds).
    A step past its limit is killed (status 124)."""
    from workbench.dist import child_env

    t0 = time.time()
    with open(log, "w") as fh:
        try:
            rc = subprocess.run(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT, timeout=limit,
                                env=child_env()).returncode
        except subprocess.TimeoutExpired:
            fh.write(f"\nrun_overlap: killed after {limit:g} s\n")
            rc = 124
    return rc, time.time() - t0


def summarize(out: Path, results: dict, world_size: int = 2) -> list[str]:
    """The lines of summary.md: each step's status and time, the tests' last line, and per family
    the held-out score (overlap.summary_lines) from the tables the benchmarks wrote."""
    import pandas as pd

    import overlap

    where = out.relative_to(REPO) if out.is_relative_to(REPO) else out
    lines = [f"# Overlap study, world size {world_size}: {where}", ""]
    for name, (rc, secs) in results.items():
        lines.append(f"- {name}: {'ok' if rc == 0 else f'FAILED (exit {rc})'} in {secs:.0f} s")
    tests = out / "pytest_multigpu.txt"
    if tests.exists():
        last = [x for x in tests.read_text().splitlines() if x.strip()][-1:] or ["(no output)"]
        lines.append(f"- tests: {last[0].strip('= ')}")
    lines.append("")
    for family, path, group in (("all_gather_matmul", out / "ag_gemm" / "held_out.csv", ["world_size", "gather_dim"]),
                                ("gemm_all_scatter", out / "gemm_scatter" / f"held_out_w{world_size}.csv",
                                 ["world_size"])):
        held = pd.read_csv(path) if path.exists() else None
        lines += [f"- {x}" for x in overlap.summary_lines(held, family, group)]
        scores = path.with_name(path.name.replace("held_out", "choice_scores"))
        lines += [f"- {x}" for x in _choice_lines(scores, family, group)]
    gs = out / "gemm_scatter" / f"summary_w{world_size}.csv"
    if gs.exists():   # the GEMM + all-scatter bar: at most 1.2x max(GEMM alone, all-gather alone) from M = 256 on
        s = pd.read_csv(gs)
        s = s[s["M"] >= 256]
        for timing, g in s.groupby("timing"):
            best = g[[c for c in ("fused_vs_max_alone", "senders_vs_max_alone") if c in g]].min(axis=1)
            lines.append(f"- gemm_all_scatter {timing}, M >= 256: the better fused variant at {best.min():.2f}x-"
                         f"{best.max():.2f}x max(GEMM alone, all-gather alone) ({int((best <= 1.2).sum())} of "
                         f"{len(best)} shapes within 1.2x)")
    lines += ["", "Tables: ag_gemm/ and gemm_scatter/ (the variant choice: auto_table.json, variant_choice*.csv)."]
    return lines


def _choice_lines(path: Path, family: str, group: list[str]) -> list[str]:
    """The choice model's score beside the nearest entry's, on the held-out half and on the shapes
    drawn at run time (``choice_scores*.csv``, written by ``overlap.model_and_scores``)."""
    import pandas as pd

    import overlap

    try:
        scores = pd.read_csv(path)
    except (FileNotFoundError, pd.errors.EmptyDataError):
        return []
    if not {"split", "rule"} <= set(scores):
        return []
    lines = []
    for (split, rule), g in scores.groupby(["split", "rule"]):
        if (split, rule) == ("held_out", "nearest"):   # the family's held-out lines, already there
            continue
        name = f"{family} [{split}, {overlap.RULES.get(rule, rule)}]"
        lines += overlap.summary_lines(g, name, group)
    return lines


def _table(path: Path):
    """A run's benchmark table, CSV or parquet (``path`` with either suffix)."""
    import pandas as pd

    for p in (path.with_suffix(".parquet"), path.with_suffix(".csv")):
        if p.exists():
            return pd.read_parquet(p) if p.suffix == ".parquet" else pd.read_csv(p)
    raise FileNotFoundError(f"run_overlap --refit: no {path.with_suffix('.csv').name} (or .parquet) in {path.parent}")


def run_rows(out: Path, world_size: int) -> tuple:
    """A finished run's timed rows: all-gather + GEMM's benchmark rows, GEMM + all-scatter's times."""
    bench = _table(out / "ag_gemm" / "bench")
    bench = bench[bench["kind"] == "bench"] if "kind" in bench else bench
    return bench, _table(out / "gemm_scatter" / f"times_w{world_size}")


def refit(out: Path, world_size: int, model_splits: tuple = ("fit",)) -> int:
    """The variant choice fitted again from a finished run's benchmark tables (after a change to
    the fit, or to write the tuning tables of a run made before they existed)."""
    import run_ag_gemm
    import run_gemm_scatter

    bench, times = run_rows(out, world_size)
    written = run_ag_gemm.fit_and_hold_out(bench, out / "ag_gemm", model_splits)
    written += run_gemm_scatter.fit_and_hold_out(times, out / "gemm_scatter", world_size, model_splits)
    old = (out / "summary.md").read_text().splitlines() if (out / "summary.md").exists() else []
    # the run's own step lines (status and time) are kept; everything else is derived again, the
    # tests' line too where their log is there (results/ keeps the line, not the log)
    steps = [x for x in old if re.match(r"- (pytest|ag_gemm|gemm_scatter): ", x)]
    tests = [] if (out / "pytest_multigpu.txt").exists() else [x for x in old if x.startswith("- tests: ")]
    lines = summarize(out, {}, world_size)
    fitted = "" if model_splits == ("fit",) else " (the choice model on the fit half and the shapes drawn at run time)"
    lines[2:2] = steps + [f"- the variant choice re-fitted from these tables (run_overlap.py --refit){fitted}"] + tests
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines + ["", "wrote: " + ", ".join(written)]), flush=True)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for every table, log and summary.md")
    ap.add_argument("--skip-tests", action="store_true", help="the benchmarks only")
    ap.add_argument("--world-size", type=int, default=2, help="ranks (GPUs of this node) for both benchmarks")
    ap.add_argument("--refit", action="store_true",
                    help="no GPU: fit the variant choice again from the tables a finished run left in --out "
                         "(held_out*.csv, variant_choice*.csv, auto_table.json, the tuning tables under tables/) "
                         "and rewrite summary.md")
    ap.add_argument("--fit-random", action="store_true",
                    help="with --refit: fit the choice model on the shapes drawn at run time too (more of the space "
                         "covered; then only the held-out half and a later run's fresh shapes score it)")
    ap.add_argument("--random-shapes", type=int, default=0,
                    help="both benchmarks also measure this many shapes drawn at run time (experiments/overlap.py "
                         "random_shapes; the seed is printed): scored against the best candidate, never fitted")
    ap.add_argument("--random-seed", type=int, default=None, help="their seed (default: drawn and printed)")
    ap.add_argument("--shape-set", default="llm-reduced", help=argparse.SUPPRESS)  # what random_seed checks
    ap.add_argument("--scale", type=float, default=1.0,
                    help="multiply every step's time budget and limit (0.8: a shorter run, fewer shapes)")
    args = ap.parse_args(argv)
    if args.refit:
        return refit(Path(args.out).resolve(), args.world_size, ("fit", "random") if args.fit_random else ("fit",))
    import torch

    if args.world_size < 2 or torch.cuda.device_count() < args.world_size:
        print(f"run_overlap: needs a node with {max(2, args.world_size)} CUDA GPUs (sm_90: H100 or H200), found "
              f"{torch.cuda.device_count()}", file=sys.stderr)
        return 2
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results = {}
    import overlap

    seed = overlap.random_seed(ap, args, worker=False) if args.random_shapes else None
    for name, cmd, limit, log in steps(out, args.world_size, scale=args.scale, random=(args.random_shapes, seed)):
        if name == "pytest" and args.skip_tests:
            continue
        print(f"run_overlap: {name} (at most {limit:g} s) ...", flush=True)
        results[name] = run_step(cmd, limit, log)
        print(f"run_overlap: {name}: exit {results[name][0]} in {results[name][1]:.0f} s (log: {log})", flush=True)
    lines = summarize(out, results, args.world_size)
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return 0 if all(rc == 0 for rc, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
