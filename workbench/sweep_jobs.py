"""A sweep's points as jobs: what ``workbench sweep SPEC --executor slurm`` (or any executor whose
units run elsewhere, ``workbench.executors``) does.

    workbench sweep experiments/gemm_tiling.yaml --executor slurm --partition h100 --jobs 8
    workbench sweep experiments/gemm_tiling.yaml --executor slurm --jobs 8 --detach   # submit, return
    workbench sweep experiments/gemm_tiling.yaml --collect [--wait]                 # merge what finished

The parent expands the spec, leaves out what is already recorded (rows measured where these
jobs run, e.g. on the same partition, in ``rows.parquet``) and what jobs still queued or
running will write, splits the rest into ``--jobs`` shares (contiguous, so each shape's inputs
are made once per job) and hands them to the executor as one submission of units. Each job
runs its share with ``sweep.run_spec`` into a folder of its own, its rows carrying full
provenance (with a Slurm job: its job id, array index, partition, node and GPUs). The parent
follows the jobs (a progress bar of points done across the cluster) and merges their rows into
``rows.parquet`` as they come: a row is merged once, however often a merge runs
(``merged.json`` per submission, and the row's identity run/point/variant/repeat in the table).

Faults. A job's rows reach its folder within seconds of each point, and SIGTERM (scancel,
preemption, the time limit) makes it save them all before it ends, so a job stopped mid-sweep
loses at most the point it was on. A job at its time limit is requeued (submitted with
``requeue=True``) and goes on from its own rows (no point twice); so is a job the scheduler
requeues. A job that died by itself (FAILED, no status of its own: a crash that killed the
process, or stuck in a point past its time limit) leaves the point it was on in
``inflight.json``: the next submission records that point as ``crashed`` and skips it, as a
local run does. A resumed sweep (the default, or ``--resume``) merges everything first and
submits only the points still missing. Ctrl-C while waiting cancels nothing
(``--cancel-on-interrupt`` does) and says how to collect later.

Files, under the results folder, in a folder named for the executor (``slurm/``):
``<run>/plan.json`` (what was submitted), ``<run>/jobs.json`` (the job ids), ``<run>/task_<i>/``
(job i's rows), ``<run>/status/`` (each job's status), ``<run>/logs/`` (each job's log:
``<jobid>_0_log.out``) and ``<run>/merged.json``.
"""
from __future__ import annotations

import datetime as _dt
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

from . import executors, jobs, sweep
from .executors import Executor, ExecutorError
from .spec import Spec, SpecError, expand, load_spec

PLAN = "plan.json"
LEDGER = "merged.json"
MERGE_EVERY_S = 30.0
# How a job ended when the point it was on is to blame, provided the job never said how it ended: its
# process died (FAILED, OUT_OF_MEMORY), or stayed stuck past its time limit, deaf to SIGTERM (TIMEOUT;
# a responsive job saves its rows and says "stopped"). Not NODE_FAIL, CANCELLED, PREEMPTED.
CRASH_STATES = ("FAILED", "OUT_OF_MEMORY", "TIMEOUT")

__all__ = ["SweepJobs", "run_share", "split"]


# --------------------------------------------------------------------------
# In the job
# --------------------------------------------------------------------------
def run_share(plan_path: str, index: int) -> dict:
    """One job of the array: share ``index`` of the plan, into ``task_<index>/`` (resumes there)."""
    plan = jobs.read_json(plan_path, {})
    for entry in reversed(plan.get("sys_path") or []):
        if entry not in sys.path:
            sys.path.insert(0, entry)
    task_dir = Path(plan_path).parent / f"task_{index}"
    if jobs.current().get("restarts"):
        # Requeued by Slurm (node failure, preemption): the point in flight was not the point's fault.
        (task_dir / "inflight.json").unlink(missing_ok=True)
    spec = load_spec(plan["spec"], quick=bool(plan.get("quick")))
    mine = {tuple(k) for k in plan["shares"][index]}
    lost = mine - set(_keys(spec))
    if lost:
        raise SpecError(f"{spec.path}: {len(lost)} of the {len(mine)} points given to this job are not in the spec "
                        "any more (edited after it was submitted?): run the sweep again to submit it as it is now")
    df = sweep.run_spec(spec, results_dir=task_dir, only=mine, run_id=plan["run_id"], progress=False,
                        flush_s=2.0, log=lambda s: print(s, file=sys.stderr, flush=True))
    counts = df["status"].value_counts().to_dict() if len(df) else {}
    return {"rows": int(len(df)), "status": {str(k): int(v) for k, v in counts.items()}}


def _keys(spec: Spec) -> list[tuple]:
    """(point_id, variant, repeat) of every row the spec asks for, in the order run_spec runs them."""
    points = expand(spec)
    order: dict = {}
    for p in points:
        order.setdefault((p.world_size, p.dtype, p.shape), len(order))
    points.sort(key=lambda p: (p.world_size, order[(p.world_size, p.dtype, p.shape)]))
    return [(p.point_id(spec.kernel), p.baseline or spec.variant, r) for p in points for r in range(spec.repeats)]


def split(keys: list, n: int) -> list[list]:
    """``n`` contiguous shares as equal as can be (none empty)."""
    n = max(1, min(n, len(keys)))
    q, r = divmod(len(keys), n)
    out, at = [], 0
    for i in range(n):
        size = q + (i < r)
        out.append(keys[at:at + size])
        at += size
    return out


# --------------------------------------------------------------------------
# In the parent
# --------------------------------------------------------------------------
class _Run:
    """One submission: its plan, jobs and merge ledger."""

    def __init__(self, folder: Path, ex: Executor | None = None):
        self.folder, self.ex = folder, ex  # ex: the executor that follows its jobs
        self.plan = jobs.read_json(folder / PLAN, {}) or {}
        self.refs = jobs.load(folder)
        self.ledger = jobs.read_json(folder / LEDGER, {}) or {}
        self.shares = [[tuple(k) for k in s] for s in self.plan.get("shares") or []]
        # how each job ended, kept when the submission is closed (no need to ask the scheduler again)
        self.status = {jid: jobs.JobStatus(**d) for jid, d in (self.ledger.get("jobs") or {}).items()
                       if isinstance(d, dict)} if self.closed else {}
        self._mtimes: dict[int, float] = {}  # task -> its rows' mtime at the last merge
        self._counts: dict[int, tuple] = {}  # task -> (mtime, rows) for the progress bar

    @property
    def closed(self) -> bool:
        return bool(self.ledger.get("closed"))

    def index(self, ref: jobs.JobRef) -> int:
        return self.refs.index(ref)

    def merge(self, store, indices=None, force: bool = False) -> int:
        """Rows of the jobs' folders not merged yet -> the store (flushed); returns how many."""
        import pandas as pd

        merged = {int(k): {tuple(x) for x in v} for k, v in (self.ledger.get("keys") or {}).items()}
        have = _row_ids(store)
        added = 0
        for i in range(len(self.shares)) if indices is None else indices:
            path = self.folder / f"task_{i}" / "rows.parquet"
            try:
                mtime = path.stat().st_mtime
            except OSError:
                continue
            if not force and self._mtimes.get(i) == mtime:
                continue
            self._mtimes[i] = mtime
            share, done = set(self.shares[i]), merged.setdefault(i, set())
            for row in pd.read_parquet(path).to_dict("records"):
                key = (row.get("point_id"), row.get("variant"), int(row.get("repeat", -1)))
                if key not in share or key in done or (str(row.get("run_id")), *key) in have:
                    continue
                store.add(row)
                done.add(key)
                added += 1
        if added:
            store.flush()
            self.ledger["keys"] = {str(k): sorted(map(list, v)) for k, v in merged.items() if v}
            jobs.write_json(self.folder / LEDGER, self.ledger)
        return added

    def close(self) -> None:
        """Every job ended and its rows are merged: remember how each ended, look no more."""
        import dataclasses

        self.ledger["closed"] = True
        self.ledger["jobs"] = {jid: {**dataclasses.asdict(st), "info": {}} for jid, st in self.status.items()}
        jobs.write_json(self.folder / LEDGER, self.ledger)

    def task_rows(self, i: int) -> int:
        """Rows job i has written so far (read from the parquet footer, when the file changed)."""
        import pyarrow.parquet as pq

        path = self.folder / f"task_{i}" / "rows.parquet"
        try:
            mtime = path.stat().st_mtime
            if self._counts.get(i, (None, 0))[0] != mtime:
                self._counts[i] = (mtime, min(len(self.shares[i]), pq.ParquetFile(path).metadata.num_rows))
        except (OSError, ValueError, IndexError):
            pass
        return self._counts.get(i, (None, 0))[1]


def _row_ids(store) -> set:
    df = store.existing
    if df is None or df.empty or "run_id" not in df:
        return set()
    return set(zip(df["run_id"].astype(str), df["point_id"], df["variant"], df["repeat"].astype(int)))


class SweepJobs:
    """The sweep's submissions under its results folder. `run` submits the points still missing
    through ``ex`` and follows them (or returns with --detach); `collect` (``ex`` None: each
    submission is followed by the executor that made it) merges what finished."""

    def __init__(self, args, spec: Spec, ex: Executor | None):
        self.args, self.spec, self.ex = args, spec, ex
        self.folder = Path(args.results) if args.results else sweep.default_results_dir(spec)
        self.store = sweep.RowStore(self.folder)
        names = [ex.NAME] if ex is not None else [n for n in executors.names() if not executors.backend(n).RUNS_HERE]
        self.runs = []
        for name in names:  # each executor's submissions in a folder named for it (slurm/)
            follower = ex if ex is not None else executors.backend(name)(args)
            self.runs += [_Run(d, follower) for d in sorted((self.folder / name).glob("*")) if (d / PLAN).exists()]
        self.log = lambda s: print(f"workbench sweep: {s}", file=sys.stderr, flush=True)
        self.told: set[str] = set()  # jobs whose failure was said already

    # -- the command ---------------------------------------------------------------------------
    def run(self) -> int:
        if self.args.fresh:
            self._fresh()
        open_runs = [r for r in self.runs if not r.closed]
        self._refresh(open_runs)
        new = self._submit()
        if new is not None:
            open_runs.append(new)
        if not self._live(open_runs):
            self.log(f"{self.spec.name}: nothing to run: every point is recorded in {self.store.path}")
            return 0
        if self.ex.detach:
            self.log(f"detached; merge the rows later with: {self._collect_cmd()} (add --wait to wait for them)")
            return 0
        return self._wait(open_runs)

    def collect(self, wait: bool = False) -> int:
        open_runs = [r for r in self.runs if not r.closed]
        self._refresh(open_runs)
        live = self._live(open_runs)
        if live and wait:
            return self._wait(open_runs, report=self.runs)
        return self._report(self.runs, still=len(live))

    def _collect_cmd(self) -> str:
        parts = ["workbench", "sweep", self.args.spec, "--collect"]
        if self.args.quick:
            parts.append("--quick")
        if self.args.results:
            parts += ["--results", self.args.results]
        return shlex.join(parts)

    def _fresh(self) -> None:
        live = self._live([r for r in self.runs if not r.closed], refresh=True)
        if live:
            raise ExecutorError(f"--fresh: {len(live)} job(s) of earlier submissions still queued or running "
                                f"({self.ex.cancel_command(live)}, then again)")
        stamp = time.strftime("%Y%m%d-%H%M%S")
        if self.store.path.exists():
            os.replace(self.store.path, self.folder / f"rows.{stamp}.parquet.bak")
            self.store.existing = None
            self.log(f"previous rows moved to rows.{stamp}.parquet.bak")
        state = self.folder / self.ex.NAME
        if state.exists():
            os.replace(state, self.folder / f"{self.ex.NAME}.{stamp}.bak")
        self.runs = []

    def _refresh(self, runs: list[_Run]) -> None:
        """Merge every finished row of these submissions; note each job's status."""
        for run in runs:
            run.status = run.ex.statuses(run.refs) if run.refs else {}
            run.merge(self.store, force=True)
            if run.refs and all(st.ended for st in run.status.values()):
                run.close()

    def _live(self, runs: list[_Run], refresh: bool = False) -> list[jobs.JobRef]:
        if refresh:
            for run in runs:
                run.status = run.ex.statuses(run.refs) if run.refs else {}
        return [ref for run in runs for ref in run.refs
                if ref.job_id in run.status and not run.status[ref.job_id].ended]

    # -- submitting ----------------------------------------------------------------------------
    def _done_keys(self, place: str | None, column: str | None) -> set:
        """(point_id, variant, repeat) recorded where jobs at ``place`` run (the rows' ``column``
        names it: a partition), not counting rows to try again."""
        df = self.store.existing
        if df is None or df.empty or not column or column not in df:
            return set()
        where = df[column]
        df = df[where.astype(str) == str(place)] if place else df[where.notna()]
        df = df[~df["status"].isin(sweep.RETRY_STATUSES)]
        return set(zip(df["point_id"], df["variant"], df["repeat"].astype(int)))

    def _submit(self) -> _Run | None:
        spec, ex = self.spec, self.ex
        partition = ex.place()
        keys = _keys(spec)
        done = self._done_keys(partition, ex.PLACE_COLUMN)
        in_flight = {k for run in self.runs if not run.closed for ref in run.refs
                     if ref.job_id in run.status and not run.status[ref.job_id].ended
                     for k in run.shares[run.index(ref)]}
        missing = [k for k in keys if k not in done and k not in in_flight]
        if self.args.limit is not None:
            missing = missing[:self.args.limit]
        recorded = sum(1 for k in keys if k in done)
        coming = sum(1 for k in keys if k in in_flight and k not in done)
        self.log(f"{spec.name}: {len(keys)} rows in the spec, {recorded} recorded on partition "
                 f"{partition or '(default)'}, {coming} to come from jobs still queued or running, "
                 f"{len(missing)} to submit")
        if not missing:
            return None
        shares = split(missing, ex.jobs or 1)
        run_id = "c" + _dt.datetime.now().strftime("%Y%m%d%H%M%S") + f"{os.getpid() % 10000:04d}"
        folder = self.folder / ex.NAME / run_id
        folder.mkdir(parents=True)
        root = sweep.module_root(spec.module, spec.kernel)
        plan = {"run_id": run_id, "spec": str(Path(spec.path).resolve()), "quick": spec.quick,
                "partition": partition, "created": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
                "command": shlex.join(sys.argv), "sys_path": [root] if root else [],
                "shares": [[list(k) for k in s] for s in shares]}
        jobs.write_json(folder / PLAN, plan)
        self._carry_crashes(folder, shares)
        gpus = max(p.world_size for p in expand(spec))
        names = [f"share {i + 1}/{len(shares)}: {len(s)} rows" for i, s in enumerate(shares)]
        try:
            refs = ex.submit(run_share, [(str(folder / PLAN), i) for i in range(len(shares))], folder=folder,
                             names=names, gpus=gpus, label=f"wb-sweep-{spec.name}"[:64], place=partition,
                             parallelism=len(shares), requeue=True)
        except ExecutorError:
            shutil.rmtree(folder, ignore_errors=True)  # nothing was submitted: no submission to follow
            raise
        run = _Run(folder, ex)
        run.status = {r.job_id: jobs.JobStatus(r.job_id, r.name, "pending", "PENDING", log=str(r.log))
                      for r in refs}
        self.runs.append(run)
        self.log(f"submitted {len(refs)} job(s) ({ex.describe(refs)}) to partition {partition or '(default)'}, "
                 f"{ex.gpus_for(gpus)} GPU(s) each; logs: {folder / 'logs'}")
        return run

    def _carry_crashes(self, folder: Path, shares: list[list]) -> None:
        """A point that killed its job's process: hand it to the share that gets it, as inflight.json,
        so that job records it as crashed and skips it (what a local run does)."""
        where = {k: i for i, s in enumerate(shares) for k in s}
        for run in self.runs:
            for ref in run.refs:
                st = run.status.get(ref.job_id)
                if st is None or st.phase != "failed" or st.info.get("state") not in (None, "running") \
                        or st.state not in CRASH_STATES:
                    continue
                info = jobs.read_json(run.folder / f"task_{run.index(ref)}" / "inflight.json", None)
                try:
                    key = (info["point_id"], info["variant"], int(info["repeat"]))
                except (TypeError, KeyError, ValueError):
                    continue
                if key in where:
                    jobs.write_json(folder / f"task_{where[key]}" / "inflight.json", info)
                    self.log(f"point {key[0]} ({key[1]}) killed job {ref.job_id}: it is recorded as crashed")

    # -- waiting -------------------------------------------------------------------------------
    def _wait(self, runs: list[_Run], report: list[_Run] | None = None) -> int:
        from tqdm.auto import tqdm

        runs = [r for r in runs if any(not st.ended for st in r.status.values())]
        by_id = {ref.job_id: (run, ref) for run in runs for ref in run.refs if not run.status[ref.job_id].ended}
        total = sum(len(run.shares[run.index(ref)]) for run, ref in by_id.values())
        followers = {run.ex.NAME: run.ex for run in runs}
        bar = tqdm(total=total, desc=f"sweep {self.spec.name} ({', '.join(followers)})", unit="pt", file=sys.stderr,
                   disable=self.args.no_progress, dynamic_ncols=True, mininterval=0.5)
        last_merge = time.monotonic()

        def on_end(ref, st):
            run, _ = by_id[ref.job_id]
            run.status[ref.job_id] = st
            run.merge(self.store, [run.index(ref)])
            if st.phase == "failed":
                self.told.add(st.job_id)
                tqdm.write(f"workbench sweep: {st.line()}", file=sys.stderr)

        def poll(now):
            nonlocal last_merge
            bar.n = sum(run.task_rows(run.index(ref)) for run, ref in by_id.values())
            phases = [st.phase for st in now.values()]
            bar.set_postfix_str(", ".join(f"{phases.count(p)} {p}" for p in ("running", "pending", "done", "failed")
                                          if phases.count(p)), refresh=False)
            bar.refresh()
            if time.monotonic() - last_merge > MERGE_EVERY_S:
                for run in runs:
                    run.merge(self.store)
                last_merge = time.monotonic()

        try:
            for name, ex in followers.items():  # (one executor, unless --collect finds several's submissions)
                ex.wait([ref for run, ref in by_id.values() if run.ex.NAME == name], on_end=on_end, poll=poll,
                        hint=f"Merge their rows later with: {self._collect_cmd()}",
                        log=lambda s: tqdm.write(f"workbench sweep: {s}", file=sys.stderr))
        except KeyboardInterrupt:
            bar.close()
            for run in runs:
                run.merge(self.store, force=True)
            return 130
        bar.close()
        for run in runs:
            run.merge(self.store, force=True)
            run.close()
        return self._report(report or runs, still=0)

    def _report(self, runs: list[_Run], still: int) -> int:
        """One summary line, a line per failed job whose points are still missing; 1 if there is one."""
        recorded: dict = {}

        def missing(run, ref) -> bool:
            where = (run.plan.get("partition"), run.ex.PLACE_COLUMN)
            if where not in recorded:
                recorded[where] = self._done_keys(*where)
            return not set(run.shares[run.index(ref)]) <= recorded[where]

        sts = [(run, ref, run.status.get(ref.job_id)) for run in runs for ref in run.refs]
        failed = [st for run, ref, st in sts if st is not None and st.phase == "failed" and missing(run, ref)]
        counts: dict[str, int] = {}
        for _, _, st in sts:
            if st is not None:
                counts[st.phase] = counts.get(st.phase, 0) + 1
        for st in failed:
            if st.job_id not in self.told:
                self.log(st.line())
        rows = len(self.store.existing) if self.store.existing is not None else 0
        summary = ", ".join(f"{n} {p}" for p, n in counts.items()) or "no jobs"
        self.log(f"{self.spec.name}: jobs: {summary}; {rows} rows in {self.store.path}"
                 + (f"; {still} job(s) still queued or running: {self._collect_cmd()} again later"
                    " (--wait to wait)" if still else ""))
        if failed:
            self.log(f"{len(failed)} job(s) failed with points missing: fix the cause, then run the sweep again "
                     "(--resume) to submit only the missing points")
        return 1 if failed else 0
