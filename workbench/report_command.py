"""``workbench report``: re-run study notebooks headless into self-contained HTML reports.

    workbench report notebooks/01_isa_hints.ipynb -p targets '[sm90, gfx942]' --out results/reports
    workbench report --all [--measure quick]
    workbench report --all --executor slurm --partition h200 --measure quick --out results/reports
    workbench report --collect --out results/reports      # after --detach or Ctrl-C

The command line chooses the executor (``workbench.executors``); each notebook is a unit handed
to it (``workbench.report_jobs``), which runs ``workbench.report.run_report``; the index is
rebuilt as they end. Exit status: 0 when every report is ok, 1 when one failed, 2 for a usage
error (nothing ran).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path
from typing import Any

from . import executors, report
from .executors import ExecutorError
from .report_jobs import Reports


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Re-run notebooks headless (papermill) into self-contained HTML reports."
    parser.add_argument("notebooks", nargs="*", metavar="NOTEBOOK", help="notebooks (.ipynb) to run")
    parser.add_argument("--all", action="store_true",
                        help=f"run every notebooks/{report.NOTEBOOK_GLOB} (sorted)")
    parser.add_argument("-p", "--param", nargs=2, action="append", default=[],
                        metavar=("NAME", "VALUE"),
                        help="override a parameter; VALUE is YAML (3, 0.5, true, '[sm90, gfx942]')")
    parser.add_argument("--out", default=str(report.DEFAULT_OUT), metavar="DIR",
                        help=f"output directory (default {report.DEFAULT_OUT}/)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="per-cell timeout in seconds (default: none)")
    parser.add_argument("--no-progress", action="store_true", help="no per-cell progress bar")
    parser.add_argument("--measure", choices=("auto", "committed", "quick", "full"), default=None,
                        help="the studies' `measure` parameter: auto (quick where the study's GPUs are here, "
                             "else committed), committed, quick (a reduced grid, minutes) or full")
    executors.add_args(parser)
    parser.add_argument("--collect", action="store_true",
                        help="after --detach (or Ctrl-C): mark the report jobs that ended, rebuild the index")
    parser.add_argument("--wait", action="store_true", help="with --collect: wait for the jobs still running")


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def resolve(args) -> tuple[list[Path], dict[str, Any]]:
    """The notebooks asked for (each checked, each once) and the -p overrides (checked against their
    parameters cells); report.ReportUsageError says what is wrong."""
    paths: list[Path] = []
    if args.all:
        found = report.find_study_notebooks()
        if not found:
            raise report.ReportUsageError(f"--all: no notebooks matching notebooks/{report.NOTEBOOK_GLOB} "
                                   f"(looked in {Path.cwd() / 'notebooks'} and {report.REPO_ROOT / 'notebooks'})")
        paths.extend(found)
    paths.extend(Path(p) for p in args.notebooks)
    if not paths:
        raise report.ReportUsageError("give one or more NOTEBOOK paths, or --all")
    problems = []
    checked: list[Path] = []
    for p in paths:
        try:
            checked.append(report.check_notebook(p))
        except report.ReportUsageError as exc:
            problems.append(str(exc))
    if problems:
        raise report.ReportUsageError("\n".join(problems))
    params: dict[str, Any] = {}
    for name, value in args.param or []:
        if not _IDENT.match(name):
            raise report.ReportUsageError(f"-p {name}: a parameter name must be a Python identifier")
        try:
            params[name] = report.parse_value(value)
        except ValueError as exc:
            raise report.ReportUsageError(f"-p {name}: {exc}") from None
    if params:
        known: set[str] = set()
        for p in checked:
            known |= set(report.notebook_parameters(p))
        unknown = sorted(set(params) - known)
        if unknown:
            raise report.ReportUsageError(
                f"unknown parameter(s) {', '.join(unknown)}; the notebooks' parameters cells define: "
                f"{', '.join(sorted(known)) or 'nothing'}")
    # the same notebook twice runs once
    seen, unique = set(), []
    for p in checked:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique, params


def measure_env(out_dir: Path, timeout: float | None) -> None:
    """Fresh data beside the reports (<out>/fresh/<study>/), and a measuring run that ends before its cell's timeout."""
    from .datasource import ENV_FRESH_DIR, ENV_TIMEOUT

    os.environ.setdefault(ENV_FRESH_DIR, str((out_dir / "fresh").resolve()))
    if timeout:
        os.environ[ENV_TIMEOUT] = str(max(1.0, timeout - 20))


def run(args) -> int:
    out_dir = Path(args.out)
    try:
        ex = executors.from_args(args, collecting=args.collect)
        if args.wait and not args.collect:
            raise ExecutorError("--wait: only with --collect")
        if args.collect and (args.notebooks or args.all):
            raise ExecutorError("--collect runs no notebook: give only --out")
        if args.collect:
            return Reports(args, out_dir, None).collect(wait=args.wait)
        paths, params = resolve(args)
        if out_dir.exists() and not out_dir.is_dir():
            raise ExecutorError(f"--out {out_dir}: exists and is not a directory")
        if args.measure:
            params.setdefault("measure", args.measure)
        measure_env(out_dir, args.timeout)  # units elsewhere inherit these (sbatch exports this environment)
        return Reports(args, out_dir, ex).submit(paths, params)
    except (report.ReportUsageError, ExecutorError) as exc:
        print(f"workbench report: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench report")
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
