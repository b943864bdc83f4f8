"""``workbench sweep``: run a declared parameter sweep into results/NAME/rows.parquet.

    workbench sweep experiments/gemm_tiling.yaml [--quick] [--results DIR] [--fresh] [--limit N]
    workbench sweep experiments/gemm_tiling.yaml --executor slurm --partition h100 --jobs 8 [--detach]
    workbench sweep experiments/gemm_tiling.yaml --collect [--wait]

The command line chooses the executor (``workbench.executors``) and the sweep is handed to it.
With one that runs units here (``local``, the default) the whole sweep is one unit,
``sweep.run_spec`` into the results folder (which resumes, marks the point in flight, moves old
rows aside with --fresh); with one whose units run elsewhere the points are split into shares,
one job each, followed and merged (``workbench.sweep_jobs``).
"""
from __future__ import annotations

import argparse
import functools
import sys

from . import executors, sweep
from .executors import ExecutorError
from .spec import SpecError, expand, load_spec
from .sweep_jobs import SweepJobs


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Run a declared parameter sweep (experiments/NAME.yaml) into results/NAME/rows.parquet."
    parser.add_argument("spec", help="experiment spec, e.g. experiments/gemm_tiling.yaml")
    parser.add_argument("--quick", action="store_true", help="run the spec's quick: subset")
    parser.add_argument("--results", metavar="DIR", help="results folder (default results/NAME)")
    parser.add_argument("--fresh", action="store_true",
                        help="do not resume: move existing rows aside and run every point again")
    parser.add_argument("--limit", type=int, metavar="N", help="run at most N new rows")
    parser.add_argument("--dry-run", action="store_true", help="validate and count points, run nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    executors.add_args(parser)
    g = parser.add_argument_group("sweeps as jobs")
    g.add_argument("--resume", action="store_true",
                   help="run only the points not recorded yet (the default; the opposite of --fresh)")
    g.add_argument("--collect", action="store_true",
                   help="merge the rows of submitted jobs that finished, show each job's status, submit nothing")
    g.add_argument("--wait", action="store_true", help="with --collect: wait for the jobs still running")


def _dry_run(spec) -> int:
    points = expand(spec)
    kern = sum(1 for p in points if p.baseline is None)
    worlds = "" if spec.world_sizes == [1] else f" and world sizes {', '.join(map(str, spec.world_sizes))}"
    print(f"{spec.path}: {kern} kernel points + {len(points) - kern} baseline points x {spec.repeats} "
          f"repeat(s) over {sum(len(v) for v in spec.shapes.values())} shapes{worlds}; spec OK")
    return 0


def _here(args, spec, ex) -> int:
    """The whole sweep as one unit that writes its results folder itself (resume, the crash
    marker, --fresh): nothing to split, follow or merge."""
    unit = functools.partial(sweep.run_spec, results_dir=args.results, resume=not args.fresh,
                             progress=not args.no_progress, limit=args.limit)
    (ref,) = ex.submit(unit, [(spec,)], folder=args.results, names=[spec.name])
    ex.wait([ref])
    ex.result(ref)  # what the sweep raised, raised here
    return 0


def run(args) -> int:
    try:
        spec = load_spec(args.spec, quick=args.quick)
    except SpecError as exc:
        print(f"workbench sweep: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        return _dry_run(spec)
    try:
        ex = executors.from_args(args, collecting=args.collect)
        if args.resume and args.fresh:
            raise ExecutorError("--resume and --fresh: choose one")
        if args.wait and not args.collect:
            raise ExecutorError("--wait: only with --collect (a submitting sweep waits unless --detach)")
        if args.collect:
            return SweepJobs(args, spec, None).collect(wait=args.wait)
        if ex.RUNS_HERE:
            return _here(args, spec, ex)
        return SweepJobs(args, spec, ex).run()
    except (ExecutorError, SpecError) as exc:
        print(f"workbench sweep: error: {exc}", file=sys.stderr)
        return 2
    except sweep.SweepAborted as exc:
        print(f"workbench sweep: aborted: {exc}", file=sys.stderr)
        return 1
