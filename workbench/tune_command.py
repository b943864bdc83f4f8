"""``workbench tune``: build a family's tuning table for this GPU from a list of shapes (``workbench.tune``).

    workbench tune gemm --shapes experiments/gemm_shapes.yaml               # into your tables, here
    workbench tune gemm --shapes SPEC --executor slurm --partition h100,h200 --out DIR   # a job per partition
    workbench tune --collect --out DIR                                       # after --detach: how the jobs ended
    workbench tune --show [FAMILY] [--device "NVIDIA H100 80GB HBM3"]        # what a device's tables hold

The command line chooses the executor (``workbench.executors``); the tuning is handed to it as
one unit per place the command line names (``--partition h100,h200``: one each; here: one),
each tuning the shapes on its own GPU into the tables under ``--out``.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from . import executors, jobs, tune
from .executors import Executor, ExecutorError
from .tune import FAMILIES, MULTI_GPU, TuneError


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = tune.__doc__.splitlines()[0]
    parser.add_argument("family", nargs="?", help=f"one of: {', '.join(FAMILIES)}")
    parser.add_argument("--shapes", help="a YAML/JSON shape list, or shapes inline: M=..,N=..,K=..;M=..,...")
    parser.add_argument("--where", action="append", default=[], metavar="FIELD=VALUE",
                        help="keep the shapes whose FIELD is VALUE (e.g. split=held_out); repeatable")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="seconds of timing per shape (default: $WORKBENCH_TUNE_BUDGET_S, else 2)")
    parser.add_argument("--out", type=Path, default=None,
                        help="tables root to write (default: $WORKBENCH_TUNING_DIR, else ~/.cache/kernel-workbench/"
                             "tuning; kernels/common/tables: the tables the package ships)")
    parser.add_argument("--times", type=Path, default=None, help="append every candidate's time per shape (CSV)")
    parser.add_argument("--redo", action="store_true", help="tune shapes already in the table again")
    parser.add_argument("--show", action="store_true", help="list what the tables of a device hold")
    parser.add_argument("--device", default=None, help="with --show: a device name (default: this GPU)")
    parser.add_argument("--collect", action="store_true", help="how the jobs of an earlier --detach ended")
    executors.add_args(parser, multi_place=True)


def tune_unit(family_name: str, shapes: list[dict], root: str | None, budget: float | None, redo: bool,
              times: str | None) -> dict:
    """One unit: ``tune`` on the GPU where it runs; a summary back. In a job on a node without a
    GPU the kernels run in Triton's interpreter (set before any kernel module is imported there:
    ``@triton.jit`` reads it then); here, as the shell says."""
    import torch

    if jobs.current() and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    done = tune.tune(family_name, shapes, root=Path(root) if root else None, budget=budget, redo=redo,
                     times_csv=Path(times) if times else None)
    return {"device": tune.this_device()["name"], "entries": len(done)}


def _jobs_folder(args, name: str) -> Path:
    from kernels.common import tables

    return Path(args.out if args.out is not None else tables.user_root()) / name / "tune"


def _hand_over(args, ex: Executor, family: str, shapes: list[dict]) -> int:
    """One unit per place for ``family``: handed to ``ex``, then followed (or left with --detach)."""
    folder = _jobs_folder(args, ex.NAME)
    refs = []
    for place in ex.places():
        times = args.times
        if times is not None and place is not None:   # one file per place: units never append to the same file
            times = times.with_name(f"{times.stem}_{place}{times.suffix}")
        refs += ex.submit(tune_unit, [(family, shapes, str(args.out) if args.out is not None else None, args.budget_s,
                                       args.redo, str(times) if times is not None else None)],
                          folder=folder, names=[f"{place or 'default'}/{family}"], gpus=1, label=f"wb-tune-{family}",
                          place=place, logs=folder / (place or "default") / "logs")
    if not ex.RUNS_HERE:
        print(f"workbench tune: submitted {len(refs)} job(s) ({', '.join(r.name for r in refs)}); logs under "
              f"{folder}", file=sys.stderr)
    hint = f"workbench tune --collect{f' --out {args.out}' if args.out is not None else ''}"
    if ex.detach:
        print(f"workbench tune: see how they ended later with: {hint}", file=sys.stderr)
        return 0

    def on_end(ref, st):
        if ref.status or st.phase != "done":  # a job of its own, or a unit that failed: how it ended
            print(st.line(), file=sys.stderr)

    return _report(ex, refs, ex.wait(refs, on_end=on_end, hint=hint))


def _report(ex: Executor, refs, ends) -> int:
    bad = 0
    for ref in refs:
        st = ends[ref.job_id]
        if st.phase == "done":
            got = ex.result(ref)
            print(f"{ref.name}: {got['entries']} entries tuned on {got['device']}", file=sys.stderr)
        else:
            bad += 1
    return 1 if bad else 0


def _collect(args) -> int:
    found = 0
    bad = 0
    for name in executors.names():
        if executors.backend(name).RUNS_HERE:
            continue
        refs = jobs.load(_jobs_folder(args, name))
        if not refs:
            continue
        found += len(refs)
        ex = executors.backend(name)(args)
        ends = ex.statuses(refs)
        for ref in refs:
            print(ends[ref.job_id].line(), file=sys.stderr)
        if all(st.ended for st in ends.values()):
            bad += _report(ex, refs, ends)
    if not found:
        raise TuneError(f"no tuning jobs recorded under {_jobs_folder(args, '<executor>').parent.parent}")
    return 1 if bad else 0


def _show(args) -> int:
    from kernels.common import tables

    if args.family and args.family not in MULTI_GPU:
        tune.family_module(args.family)
    roots = [("user", tables.user_root()), ("shipped", tables.SHIPPED_ROOT)]
    if args.out is not None:
        roots.insert(0, ("given", args.out))
    return tune.show(args.family, args.device, roots)


def run(args) -> int:
    try:
        ex = executors.from_args(args, multi_place=True, collecting=args.collect)
        if args.collect:
            return _collect(args)
        if args.show:
            return _show(args)
        if not args.family or not args.shapes:
            raise TuneError("give a family and --shapes SPEC (or --show); e.g. workbench tune gemm --shapes "
                            "experiments/gemm_shapes.yaml")
        where = {}
        for w in args.where:
            if "=" not in w:
                raise TuneError(f"--where {w!r}: expected FIELD=VALUE")
            k, v = w.split("=", 1)
            where[k] = v
        shapes = tune.load_shapes(args.shapes, tune.family_module(args.family), where)
        t0 = time.time()
        rc = _hand_over(args, ex, args.family, shapes)
        if ex.RUNS_HERE:
            print(f"tune {args.family}: {time.time() - t0:.0f} s", file=sys.stderr)
        return rc
    except (TuneError, ExecutorError) as exc:
        print(f"workbench tune: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench tune")
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
