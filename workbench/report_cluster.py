"""``workbench report --executor slurm``: one Slurm job per notebook (``workbench.cluster``).

    workbench report --all --executor slurm --partition h100 --measure quick --out results/reports
    workbench report --collect --out results/reports      # after --detach or Ctrl-C: the index of what ended

Each notebook runs in a job of its own that asks for the GPUs its study needs:
the ``gpus_needed=`` its ``datasource.plan(...)`` call names (an expression
of the notebook's parameters, e.g. ``int(world_size)``, evaluated with the
closed evaluator of ``workbench.safe_expr``), or ``--gpus-per-job`` for every
notebook. A 2-GPU study starts its world inside its job, through
``workbench.dist``, on the GPUs Slurm gave it. Notebooks that need the same
GPUs go in one job array (``--jobs N``: at most N of them at once).

The job runs ``report.run_report`` into ``--out``, as a local run would: the
HTML, the executed notebook and the record land there, and the parent builds
the usual ``index.html`` as jobs end. A notebook whose cell failed, and a job
that died (cancelled, timed out, its node lost), are marked failed in the
index with the Slurm job id and the job's log
(``<out>/slurm/<run>/logs/<jobid>_0_log.out``).
"""
from __future__ import annotations

import ast
import dataclasses
import datetime as _dt
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping

from . import cluster

__all__ = ["add_args", "dispatch", "study_gpus", "run_notebook"]


def add_args(parser) -> None:
    cluster.add_executor_args(parser)
    parser.add_argument("--collect", action="store_true",
                        help="after --detach (or Ctrl-C): mark the report jobs that ended, rebuild the index")
    parser.add_argument("--wait", action="store_true", help="with --collect: wait for the jobs still running")


def study_gpus(notebook: str | Path, params: Mapping[str, Any]) -> int:
    """The GPUs a study notebook needs: its ``datasource.plan(..., gpus_needed=EXPR)`` with EXPR
    evaluated on its parameters (defaults and overrides); 1 when it names none."""
    import json

    from . import safe_expr
    from .report import MAX_NOTEBOOK_BYTES

    with open(notebook, "rb") as fh:  # a notebook the caller checked (report.check_notebook)
        cells = json.loads(fh.read(MAX_NOTEBOOK_BYTES)).get("cells") or []
    for cell in cells:
        if not isinstance(cell, dict) or cell.get("cell_type") != "code":
            continue
        src = cell.get("source")
        try:
            tree = ast.parse("".join(src) if isinstance(src, list) else str(src or ""))
        except SyntaxError:  # IPython magics: not a plan call anyway
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                for kw in node.keywords:
                    if kw.arg == "gpus_needed":
                        try:
                            return max(0, int(safe_expr.evaluate(ast.unparse(kw.value), dict(params))))
                        except (safe_expr.ExprError, TypeError, ValueError):
                            return 1
    return 1


def run_notebook(notebook: str, params: dict, out_dir: str, timeout: float | None) -> dict:
    """In the job: one report, as ``workbench report`` makes it here."""
    from . import report

    res = report.run_report(notebook, params, out_dir, progress=False, timeout=timeout, write_index=False)
    return {"name": res.name, "ok": res.ok, "error": res.error, "html": res.html}


def dispatch(args, out_dir: Path) -> int | None:
    """The cluster side of ``workbench report``; None for a local run."""
    try:
        cluster.check_args(args, collecting=args.collect)
        if args.wait and not args.collect:
            raise cluster.ClusterError("--wait: only with --collect")
        if args.collect and (args.notebooks or args.all):
            raise cluster.ClusterError("--collect runs no notebook: give only --out")
    except cluster.ClusterError as exc:
        print(f"workbench report: error: {exc}", file=sys.stderr)
        return 2
    if args.collect:
        return _Reports(args, out_dir).collect()
    if args.executor != "slurm":
        return None
    from .report import ReportUsageError, _measure_env, _resolve

    try:
        paths, params = _resolve(args)
    except ReportUsageError as exc:
        print(f"workbench report: error: {exc}", file=sys.stderr)
        return 2
    if args.measure:
        params.setdefault("measure", args.measure)
    _measure_env(out_dir, args.timeout)  # the jobs inherit these (sbatch exports this environment)
    try:
        return _Reports(args, out_dir).submit(paths, params)
    except cluster.ClusterError as exc:
        print(f"workbench report: error: {exc}", file=sys.stderr)
        return 2


class _Reports:
    def __init__(self, args, out_dir: Path):
        self.args, self.out = args, Path(out_dir)
        self.state = self.out / "slurm"

    def log(self, text: str) -> None:
        print(f"workbench report: {text}", file=sys.stderr, flush=True)

    def _collect_cmd(self) -> str:
        return shlex.join(["workbench", "report", "--collect", "--out", str(self.out)])

    def submit(self, paths: list[Path], params: dict) -> int:
        from .report import RECORD_SUFFIX, _report_name, notebook_parameters

        run = self.state / ("r" + _dt.datetime.now().strftime("%Y%m%d%H%M%S%f")[:-3])
        groups: dict[int, list[Path]] = {}
        for nb in paths:
            need = study_gpus(nb, {**notebook_parameters(nb), **params})
            gpus = need if self.args.gpus_per_job is None else self.args.gpus_per_job
            groups.setdefault(gpus, []).append(nb)
        refs = []
        for gpus, nbs in sorted(groups.items()):
            for nb in nbs:  # what an earlier run left must not pass for this run's report
                name = _report_name(nb, params)
                for suffix in (".html", ".ipynb", RECORD_SUFFIX):
                    (self.out / f"{name}{suffix}").unlink(missing_ok=True)
            ex = cluster.make_executor(self.args, run / "logs", gpus=gpus, name="wb-report",
                                       parallelism=self.args.jobs)
            calls = [(str(nb.resolve()), params, str(self.out.resolve()), self.args.timeout) for nb in nbs]
            names = [_report_name(nb, params) for nb in nbs]
            got = cluster.submit(ex, run, run_notebook, calls, names=names)
            refs += got
            self.log(f"submitted {len(got)} notebook job(s) ({cluster._compact([r.job_id for r in got])}) with "
                     f"{gpus} GPU(s) each: {', '.join(nb.name for nb in nbs)}")
        cluster.write_json(run / "notebooks.json", {r.job_id: str(nb) for r, nb in
                                                   zip(refs, [nb for _, nbs in sorted(groups.items()) for nb in nbs])})
        self.log(f"logs: {run / 'logs'}")
        if self.args.detach:
            self.log(f"detached; index what ended with: {self._collect_cmd()}")
            return 0
        return self._follow([run], refs)

    def _runs(self) -> list[Path]:
        return sorted(d for d in self.state.glob("*") if (d / cluster.JOBS_FILE).exists())

    def collect(self) -> int:
        runs = [d for d in self._runs() if not (d / "collected").exists()]
        refs = [r for d in runs for r in cluster.load_jobs(d)]
        if not refs:
            self.log(f"no report jobs to collect under {self.state}")
            return 0
        sts = cluster.statuses(refs)
        live = [r for r in refs if not sts[r.job_id].ended]
        if live and self.args.wait:
            return self._follow(runs, refs)
        failed = sum(self._record(r, sts[r.job_id]) for r in refs if sts[r.job_id].ended)
        index = self._index()
        self.log(f"{len(refs) - len(live) - failed} ok, {failed} failed, {len(live)} still queued or running; "
                 f"index: {index}" + (f"; again later: {self._collect_cmd()}" if live else ""))
        if not live:
            for d in runs:
                (d / "collected").touch()
        return 1 if failed else 0

    def _follow(self, runs: list[Path], refs: list[cluster.JobRef]) -> int:
        failed = 0

        def on_end(ref, st):
            nonlocal failed
            failed += self._record(ref, st)
            self._index()

        try:
            cluster.wait(refs, on_end=on_end, hint=f"Index them later with: {self._collect_cmd()}",
                         cancel_on_interrupt=self.args.cancel_on_interrupt, log=self.log)
        except KeyboardInterrupt:
            self._index()
            return 130
        index = self._index()
        for d in runs:
            (d / "collected").touch()
        self.log(f"{len(refs) - failed} ok, {failed} failed; index: {index}")
        return 1 if failed else 0

    def _record(self, ref: cluster.JobRef, st: cluster.JobStatus) -> int:
        """Say how a job ended and make its record say it too (with the job id and log); 1 if failed."""
        from .report import RECORD_SUFFIX, ReportResult

        path = self.out / f"{ref.name}{RECORD_SUFFIX}"
        rec = cluster.read_json(path, None)
        job = {"job_id": st.job_id, "node": st.node, "state": st.state, "log": st.log}
        if isinstance(rec, dict) and rec.get("name") == ref.name:
            rec["job"] = job
            ok = bool(rec.get("ok"))
            if not ok:
                self.log(f"{ref.name} FAILED ({rec.get('error')}) in job {st.job_id} on {st.node or '?'}; "
                         f"log: {st.log}; report with the outputs up to the error: {rec.get('html')}")
            else:
                self.log(f"{ref.name} ok in {float(rec.get('duration_s') or 0):.1f} s (job {st.job_id} on "
                         f"{st.node or '?'}) -> {rec.get('html')}")
        else:  # the job died before its report was written
            notebooks = cluster.read_json(Path(ref.status).parents[1] / "notebooks.json", {}) or {}
            res = ReportResult(name=ref.name, notebook=str(notebooks.get(ref.job_id, ref.name)), ok=False,
                               html=None, executed=None, error=f"no report: {st.error or st.state}",
                               started=str(st.info.get("started") or ""), machine={"hostname": st.node})
            rec = {**dataclasses.asdict(res), "job": job}
            ok = False
            self.log(f"{ref.name} FAILED: {st.line()}")
        cluster.write_json(path, rec)
        return 0 if ok else 1

    def _index(self) -> Path:
        from .report import build_index

        return build_index(self.out)
