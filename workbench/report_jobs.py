"""Study notebooks as work units: what ``workbench report`` hands to its executor (``workbench.executors``).

    workbench report --all                                                 # here, one after another
    workbench report --all --executor slurm --partition h100 --measure quick --out results/reports
    workbench report --collect --out results/reports      # after --detach or Ctrl-C: the index of what ended

Each notebook is one unit, ``report.run_report`` into ``--out`` (the HTML, the executed notebook
and the record land there), asking for the GPUs its study needs: the ``gpus_needed=`` its
``datasource.plan(...)`` call names (an expression of the notebook's parameters, e.g.
``int(world_size)``, evaluated with the closed evaluator of ``workbench.safe_expr``), or
``--gpus-per-job`` for every notebook. A 2-GPU study starts its world inside its unit, through
``workbench.dist``, on the GPUs it was given. Notebooks that need the same GPUs go in one
submission (``--jobs N``: at most N of them at once); an executor that runs units here runs
them in the order given.

The index is rebuilt as units end. A notebook whose cell failed, and a job that died (cancelled,
timed out, its node lost), are marked failed in the index, a job with its id and log
(``<out>/<executor>/<run>/logs/<jobid>_0_log.out``).
"""
from __future__ import annotations

import ast
import dataclasses
import datetime as _dt
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Mapping

from . import executors, jobs, report, safe_expr
from .executors import Executor

NOTEBOOKS_FILE = "notebooks.json"

__all__ = ["Reports", "study_gpus", "run_notebook"]


def study_gpus(notebook: str | Path, params: Mapping[str, Any]) -> int:
    """The GPUs a study notebook needs: its ``datasource.plan(..., gpus_needed=EXPR)`` with EXPR
    evaluated on its parameters (defaults and overrides); 1 when it names none."""
    with open(notebook, "rb") as fh:  # a notebook the caller checked (report.check_notebook)
        cells = json.loads(fh.read(report.MAX_NOTEBOOK_BYTES)).get("cells") or []
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


def run_notebook(notebook: str, params: dict, out_dir: str, timeout: float | None, progress: bool = False) -> dict:
    """One unit: one report, as ``workbench report`` makes it."""
    res = report.run_report(notebook, params, out_dir, progress=progress, timeout=timeout, write_index=False)
    return {"name": res.name, "ok": res.ok, "error": res.error, "html": res.html}


class Reports:
    """The reports of one ``--out`` folder: `submit` hands notebooks to ``ex`` and follows them (or
    returns with --detach); `collect` (``ex`` None) records the jobs of earlier submissions that ended."""

    def __init__(self, args, out_dir: Path, ex: Executor | None):
        self.args, self.out, self.ex = args, Path(out_dir), ex

    def log(self, text: str) -> None:
        print(f"workbench report: {text}", file=sys.stderr, flush=True)

    def _collect_cmd(self) -> str:
        return shlex.join(["workbench", "report", "--collect", "--out", str(self.out)])

    def submit(self, paths: list[Path], params: dict) -> int:
        ex = self.ex
        run = self.out / ex.NAME / ("r" + _dt.datetime.now().strftime("%Y%m%d%H%M%S%f")[:-3])
        groups: dict[int, list[Path]] = {}
        for nb in paths:
            need = study_gpus(nb, {**report.notebook_parameters(nb), **params})
            groups.setdefault(ex.gpus_for(need), []).append(nb)
        refs: dict[Path, jobs.JobRef] = {}
        for gpus, nbs in sorted(groups.items()):
            for nb in nbs:  # what an earlier run left must not pass for this run's report
                name = report.report_name(nb, params)
                for suffix in (".html", ".ipynb", report.RECORD_SUFFIX):
                    (self.out / f"{name}{suffix}").unlink(missing_ok=True)
            calls = [(str(nb.resolve()), params, str(self.out.resolve()), self.args.timeout,
                      ex.RUNS_HERE and not self.args.no_progress) for nb in nbs]
            got = ex.submit(run_notebook, calls, folder=run, names=[report.report_name(nb, params) for nb in nbs],
                            gpus=gpus, label="wb-report", parallelism=ex.jobs)
            refs.update(zip(nbs, got))
            if not ex.RUNS_HERE:
                self.log(f"submitted {len(got)} notebook job(s) ({ex.describe(got)}) with {gpus} GPU(s) each: "
                         f"{', '.join(nb.name for nb in nbs)}")
        ordered = [refs[nb] for nb in paths]  # the order asked for (an executor here runs them so)
        if not ex.RUNS_HERE:  # for --collect: which notebook each job ran
            jobs.write_json(run / NOTEBOOKS_FILE, {r.job_id: str(nb) for nb, r in refs.items()})
            self.log(f"logs: {run / 'logs'}")
        if ex.detach:
            self.log(f"detached; index what ended with: {self._collect_cmd()}")
            return 0
        return self._follow([run], ordered, ex)

    def _runs(self) -> list[tuple[Path, Executor]]:
        out = []
        for name in executors.names():
            if executors.backend(name).RUNS_HERE:
                continue
            ex = executors.backend(name)(self.args)
            out += [(d, ex) for d in sorted((self.out / name).glob("*")) if (d / jobs.JOBS_FILE).exists()]
        return out

    def collect(self, wait: bool = False) -> int:
        runs = [(d, ex) for d, ex in self._runs() if not (d / "collected").exists()]
        if not runs:
            self.log(f"no report jobs to collect under {self.out}")
            return 0
        by_ex: dict[str, tuple[Executor, list[jobs.JobRef]]] = {}
        for d, ex in runs:
            by_ex.setdefault(ex.NAME, (ex, []))[1].extend(jobs.load(d))
        if not any(refs for _, refs in by_ex.values()):
            self.log(f"no report jobs to collect under {self.out}")
            return 0
        sts = {jid: st for ex, refs in by_ex.values() for jid, st in ex.statuses(refs).items()}
        refs = [r for _, rs in by_ex.values() for r in rs]
        live = [r for r in refs if not sts[r.job_id].ended]
        if live and wait:
            return max(self._follow([d for d, e in runs if e.NAME == name], rs, ex)
                       for name, (ex, rs) in by_ex.items())
        failed = sum(self._record(r, sts[r.job_id]) for r in refs if sts[r.job_id].ended)
        index = self._index()
        self.log(f"{len(refs) - len(live) - failed} ok, {failed} failed, {len(live)} still queued or running; "
                 f"index: {index}" + (f"; again later: {self._collect_cmd()}" if live else ""))
        if not live:
            for d, _ in runs:
                (d / "collected").touch()
        return 1 if failed else 0

    def _follow(self, runs: list[Path], refs: list[jobs.JobRef], ex: Executor) -> int:
        failed = 0

        def on_end(ref, st):
            nonlocal failed
            failed += self._record(ref, st)
            self._index()

        try:
            ex.wait(refs, on_end=on_end, hint=f"Index them later with: {self._collect_cmd()}", log=self.log)
        except KeyboardInterrupt:
            self._index()
            return 130
        index = self._index()
        for d in runs:
            if d.exists():
                (d / "collected").touch()
        self.log(f"{len(refs) - failed} ok, {failed} failed; index: {index}")
        return 1 if failed else 0

    def _record(self, ref: jobs.JobRef, st: jobs.JobStatus) -> int:
        """Say how a unit ended and, for a job, make its record say it too (its id and log); 1 if failed."""
        path = self.out / f"{ref.name}{report.RECORD_SUFFIX}"
        rec = jobs.read_json(path, None)
        as_job = bool(ref.status)  # a unit that ran as a job of its own (it wrote its own status)
        job = {"job_id": st.job_id, "node": st.node, "state": st.state, "log": st.log, "executor": ref.executor}
        where = f" (job {st.job_id} on {st.node or '?'})" if as_job else ""
        if isinstance(rec, dict) and rec.get("name") == ref.name:
            ok = bool(rec.get("ok"))
            if not ok:
                self.log(f"{ref.name} FAILED ({rec.get('error')})"
                         + (f" in job {st.job_id} on {st.node or '?'}; log: {st.log}" if as_job else "")
                         + f"; report with the outputs up to the error: {rec.get('html')}")
            else:
                self.log(f"{ref.name} ok in {float(rec.get('duration_s') or 0):.1f} s{where} -> {rec.get('html')}")
            if not as_job:
                return 0 if ok else 1
            rec["job"] = job
        else:  # the unit died before its report was written
            notebooks = jobs.read_json(Path(ref.status).parents[1] / NOTEBOOKS_FILE, {}) if as_job else {}
            res = report.ReportResult(name=ref.name, notebook=str((notebooks or {}).get(ref.job_id, ref.name)),
                                      ok=False, html=None, executed=None, error=f"no report: {st.error or st.state}",
                                      started=str(st.info.get("started") or ""), machine={"hostname": st.node})
            rec = {**dataclasses.asdict(res), **({"job": job} if as_job else {})}
            ok = False
            self.log(f"{ref.name} FAILED: {st.line()}")
        jobs.write_json(path, rec)
        return 0 if ok else 1

    def _index(self) -> Path:
        return report.build_index(self.out)
