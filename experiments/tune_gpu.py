"""One GPU node, one command: tune every family's shipped shape list into tables for this GPU,
then check the tables as users call the kernels (held-out and fresh shapes, eager and graph,
the library in the same run), and measure each config path's host time.

    python experiments/tune_gpu.py --out results/tuning/h200              # everything, in order
    python experiments/tune_gpu.py --out DIR --only tune-gemm,verify-gemm  # some phases
    python experiments/tune_gpu.py --out DIR --list                        # the phases and their commands

Phases run one after another as subprocesses, each with its own time limit, under one overall
deadline (``--deadline-s``): a phase that would start after the deadline is skipped and said.
Tables go to ``OUT/work/tables/<device>/<family>.json`` (``WORKBENCH_TUNING_DIR`` points there,
so the checks that follow use them; copy them into ``kernels/common/tables/`` to ship them),
every candidate's time to ``OUT/work/times_<family>.csv``, the checks' tables beside them, each
phase's output to ``OUT/log.txt``; after every phase ``OUT/work`` and the log are packed into
``OUT/results.tar.gz`` (so a run stopped by its time limit keeps what it finished).

Issue 43's measurements, in this order (each call fits a 10-minute slot; the same ``--out``):

    python experiments/tune_gpu.py --out OUT --only tests,tune-gemm-regions,refit-gemm --gemm-budget-s 0.8
    python experiments/tune_gpu.py --out OUT --only report-gemm     # again until it measures nothing new
    python experiments/tune_gpu.py --out OUT --only tune-on-miss,paths-all

``refit-gemm`` writes ``OUT/work/cold_rule/cold_rule.json`` (and its report); every phase started
after that file exists runs with ``WORKBENCH_GEMM_COLD_RULE`` pointing at it, so the checks measure
the refitted rule before it ships (copy it to ``kernels/gemm/cold_rule.json`` to ship it).
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
# The per-candidate times the shipped GEMM cold rule was fitted on (refit-gemm adds this run's)
COMMITTED_TIMES = ["results/gemm_selection/h100/times_gemm.csv", "results/gemm_selection/h200/times_gemm.csv",
                   "results/gemm_selection/h200_regions/times_gemm.csv",
                   "results/gemm_selection/h200_narrow_pad/times_gemm.csv",
                   "results/gemm_selection/h200_rule_classes/times_gemm.csv"]


def phases(out: Path, fresh: int, day: str | None, gemm_budget: float,
           mx_where: list[str] = ()) -> list[tuple[str, list[str], float]]:
    """(name, argv, time limit in seconds) of every phase, in the order they run."""
    day_args = ["--day", day] if day else []
    wb = [PY, "-m", "workbench.cli", "tune"]
    fresh_yaml = out / "fresh.yaml"
    return [
        ("tests", [PY, "-m", "pytest", "-q", "-x", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_select.py",
                   "tests/test_gemm.py", "tests/test_gemm_ws.py"], 220),
        ("draw-fresh", [PY, "experiments/run_gemm_selection.py", "--fresh", str(fresh), "--write-fresh",
                        str(fresh_yaml), *day_args], 30),
        ("tune-gemm-fresh", [*wb, "gemm", "--shapes", str(fresh_yaml), "--budget-s", str(gemm_budget),
                             "--times", str(out / "times_gemm.csv")], 90),
        ("tune-gemm", [*wb, "gemm", "--shapes", "experiments/gemm_shapes.yaml", "--budget-s", str(gemm_budget),
                       "--times", str(out / "times_gemm.csv")], 280),
        # The zoo in its two halves, for a node whose time allows one at a time (the checks need the
        # held-out half's entries; the cold rule's fit needs the fit half's times).
        ("tune-gemm-held-out", [*wb, "gemm", "--shapes", "experiments/gemm_shapes.yaml", "--budget-s", str(gemm_budget),
                                "--where", "split=held_out", "--times", str(out / "times_gemm.csv")], 150),
        ("tune-gemm-fit", [*wb, "gemm", "--shapes", "experiments/gemm_shapes.yaml", "--budget-s", str(gemm_budget),
                           "--where", "split=fit", "--times", str(out / "times_gemm.csv")], 300),
        ("tests-moe", [PY, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", "tests/test_select_grouped.py",
                       "tests/test_moe_mxfp4_select.py", "tests/test_moe_launch.py", "tests/test_grouped_gemm.py",
                       "tests/test_moe_mxfp4.py"], 150),
        ("tune-grouped", [*wb, "grouped", "--shapes", "experiments/grouped_gemm_layers.yaml", "--budget-s", "0.6",
                          "--times", str(out / "times_grouped.csv")], 110),
        ("measure-grouped", [PY, "experiments/measure_grouped_gemm.py", "--shapes", "experiments/grouped_gemm_layers.yaml",
                             "--out", str(out / "grouped"), "--rep-ms", "20"], 100),
        ("tune-moe-mxfp4", [*wb, "moe_mxfp4", "--shapes", "experiments/moe_mxfp4_tiles.yaml", "--budget-s", "1.0",
                            "--times", str(out / "times_moe_mxfp4.csv"), *mx_where], 60),
        ("measure-moe-mxfp4", [PY, "experiments/run_moe_mxfp4.py", "--selection", "--out", str(out / "moe_mxfp4"),
                               "--rep-ms", "20"], 60),
        ("verify-gemm", [PY, "experiments/run_gemm_selection.py", "--out", str(out / "gemm"), "--split", "held_out",
                         "--fresh-yaml", str(fresh_yaml), "--tune-on-miss", "3", "--fresh", str(fresh),
                         *day_args, "--budget-s", "100", "--host-calls", "60"], 120),
        ("paths", [PY, "experiments/launch_cost.py", "--out", str(out / "launch_cost"), "--paths", "8"], 60),
        # Issue 43: the region shapes' fit half tuned (every candidate's time), the cold rule refitted
        # on them and the committed times into OUT/cold_rule/ (the phases after it use that rule:
        # see main), then the report: the held-out half and fresh shapes drawn now, every candidate
        # of ours timed beside the choice (resumed across runs: call again until it says done),
        # tune-on-miss in a new process with an empty Triton cache, every path's host time.
        ("tune-gemm-regions", [*wb, "gemm", "--shapes", "experiments/gemm_shapes.yaml", "--budget-s",
                               str(gemm_budget), "--where", "group=regions", "--where", "split=fit",
                               "--times", str(out / "times_gemm.csv")], 420),
        ("refit-gemm", [PY, "experiments/fit_gemm_cold_rule.py", "--times", *COMMITTED_TIMES,
                        str(out / "times_gemm.csv"), "--out", str(out / "cold_rule"), "--write-rule",
                        "--rule-out", str(out / "cold_rule" / "cold_rule.json")], 60),
        ("report-gemm", [PY, "experiments/run_gemm_selection.py", "--out", str(out / "selection"), "--split",
                         "held_out", "--fresh", str(fresh), *day_args, "--resume", "--budget-s", "420"], 560),
        ("tune-on-miss", [PY, "experiments/run_gemm_selection.py", "--out", str(out / "selection"), "--split", "none",
                          "--tune-on-miss", "3", *day_args], 120),
        ("paths-all", [PY, "experiments/launch_cost.py", "--out", str(out / "launch_cost"), "--paths", "1000"], 500),
    ]


def pack(top: Path) -> None:
    """``top/work`` and ``top/log.txt`` into ``top/results.tar.gz`` (replaced atomically)."""
    tmp = top / "results.tar.gz.tmp"
    with tarfile.open(tmp, "w:gz") as tar:
        for p in [top / "log.txt", *sorted((top / "work").rglob("*"))]:
            if p.is_file():
                tar.add(p, arcname=str(p.relative_to(top)))
    tmp.replace(top / "results.tar.gz")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--only", default="", help="comma-separated phase names, run in that order (default: all)")
    ap.add_argument("--skip", default="", help="comma-separated phase names to leave out")
    ap.add_argument("--deadline-s", type=float, default=570, help="start no phase after this many seconds")
    ap.add_argument("--fresh", type=int, default=20, help="fresh shapes drawn by date")
    ap.add_argument("--day", default=None, help="YYYYMMDD seeding the fresh shapes (default: today, UTC)")
    ap.add_argument("--gemm-budget-s", type=float, default=1.2, help="tuning seconds per GEMM shape")
    ap.add_argument("--mxfp4-where", action="append", default=[], metavar="FIELD=VALUE",
                    help="tune only these MXFP4 shapes (e.g. source=kimi-k2.5); repeatable")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args(argv)
    top = args.out.resolve()
    out = top / "work"
    todo = phases(out, args.fresh, args.day, args.gemm_budget_s,
                  [a for w in args.mxfp4_where for a in ("--where", w)])
    only = {s for s in args.only.split(",") if s}
    skip = {s for s in args.skip.split(",") if s}
    unknown = (only | skip) - {n for n, _, _ in todo}
    if unknown:
        ap.error(f"unknown phase(s) {sorted(unknown)}; phases: {', '.join(n for n, _, _ in todo)}")
    if only:   # in the order --only names them
        order = [s for s in args.only.split(",") if s]
        todo = sorted((t for t in todo if t[0] in only), key=lambda t: order.index(t[0]))
    todo = [t for t in todo if t[0] not in skip]
    if args.list:
        for name, argv_, limit in todo:
            print(f"{name} ({limit:.0f} s): {shlex.join(argv_)}")
        return 0
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, WORKBENCH_TUNING_DIR=str(out / "tables"), PYTHONUNBUFFERED="1",
               PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    t0 = time.time()
    status = []
    rule = out / "cold_rule" / "cold_rule.json"
    with open(top / "log.txt", "a") as log:
        for name, argv_, limit in todo:
            left = args.deadline_s - (time.time() - t0)
            if left < 20:
                status.append(f"{name}: skipped (deadline)")
                continue
            if rule.is_file():   # refit-gemm ran (now or in an earlier call with this OUT): check that rule
                env["WORKBENCH_GEMM_COLD_RULE"] = str(rule)
            log.write(f"\n===== {name}: {shlex.join(argv_)}\n")
            log.flush()
            start = time.time()
            try:
                rc = subprocess.run(argv_, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=min(limit, left)).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            status.append(f"{name}: rc {rc} in {time.time() - start:.0f} s")
            print(status[-1], flush=True)
            log.write(f"===== {status[-1]}\n")
            log.flush()
            pack(top)
    print("\n".join(status))
    return 0


if __name__ == "__main__":
    sys.exit(main())
