"""Run workbench commands as Slurm jobs through submitit: the plumbing `sweep`, `report` and `tune` share.

``--executor local`` (the default) runs where the command is typed, as always;
``--executor slurm`` submits jobs through submitit (``sbatch`` underneath),
follows them and collects what they wrote. No scheduler of our own: Slurm
places, starts, requeues and cancels jobs; this module only asks it.

A command adopts it in a few lines (``workbench tune``: one job per partition and family)::

    from workbench import cluster

    def configure(parser):
        cluster.add_executor_args(parser, multi_partition=True)    # the flags below

    def run(args):
        cluster.check_args(args, multi_partition=True)    # ClusterError: a bad flag, said with its name
        if args.executor == "slurm":
            refs = []
            for part in cluster.partitions(args):         # --partition h100,h200
                ex = cluster.make_executor(args, folder / part / "logs", gpus=1, partition=part,
                                           name=f"wb-tune-{part}")
                refs += cluster.submit(ex, folder / part, tune_family, [(f,) for f in families],
                                       names=[f"{part}/{f}" for f in families])
            cluster.wait(refs, on_end=lambda ref, st: print(st.line()),   # or return here with --detach
                         hint="collect later with: workbench tune ... --collect",
                         cancel_on_interrupt=args.cancel_on_interrupt)
        # a later process (--collect): refs = cluster.load_jobs(folder / part); cluster.statuses(refs)

API
---
``add_executor_args(parser, *, multi_partition=False)``
    ``--executor local|slurm``, ``--partition P`` (``P1,P2`` with ``multi_partition``:
    ``partitions(args)`` splits it), ``--gpus-per-job N``, ``--time T`` (minutes,
    ``H:MM:SS`` or ``D-HH:MM``), ``--jobs N``, ``--account A``, ``--qos Q``,
    ``--slurm-arg KEY=VALUE`` (any other ``sbatch`` option, repeatable), ``--detach``,
    ``--cancel-on-interrupt``.
``check_args(args, *, multi_partition=False, collecting=False)``
    Raises `ClusterError` for a bad value or a cluster flag without ``--executor slurm``
    (``collecting``: a ``--collect`` run, which takes no submission flag).
``slurm_parameters(args, *, gpus, partition=None, name, parallelism=None) -> dict``
    submitit's SlurmExecutor parameters for those flags (pure: no Slurm needed).
``make_executor(args, folder, *, gpus, partition=None, name, parallelism=None)``
    A ``submitit.SlurmExecutor`` writing its pickles and job logs to ``folder``.
``submit(executor, folder, fn, arg_tuples, *, names, requeue=False) -> list[JobRef]``
    ``fn(*args)`` for each tuple, as ONE job array (one job when there is one tuple).
    Each job writes its status file (running / done / failed, with the job id, array
    index, node and GPUs) and ``fn``'s return value goes back through submitit.
    ``requeue``: a job that reaches its time limit is requeued by submitit (``fn`` must
    pick up where it stopped). The refs are appended to ``folder/jobs.json``.
``load_jobs(folder) -> list[JobRef]``
    The refs ``submit`` recorded there (for ``--collect`` in a later process).
``statuses(refs) -> {job_id: JobStatus}``
    What each job is doing or how it ended, from Slurm (``sacct``; ``scontrol show job``
    where accounting is off) and the job's status file: pending,
    running, done, failed (with the error, e.g. the exception the job raised, or
    ``NODE_FAIL on gpu07``) and its log path. ``JobStatus.line()`` says it in one line.
``wait(refs, *, on_end=None, poll=None, hint="", cancel_on_interrupt=False) -> {job_id: JobStatus}``
    Follows the jobs until every one ended, calling ``on_end(ref, status)`` once per
    job and ``poll({job_id: status})`` about every second (progress bars, merging). On Ctrl-C it
    says what is still on the cluster and ``hint`` (how to collect later), cancels
    only with ``cancel_on_interrupt``, and raises KeyboardInterrupt.
``result(ref)``
    The value ``fn`` returned in a job that is done (submitit's result pickle).
``cancel(refs)``
    ``scancel`` the given jobs.

Inside a job, ``TRITON_INTERPRET`` is not inherited from the submitting shell
(which, without a GPU, may have set it for itself): as in a local run, a node
with a GPU compiles kernels and one without interprets them. NVLink multicast
stays off (``workbench.dist.MULTICAST_OFF``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

EXECUTORS = ("local", "slurm")
LIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
               "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD"}
STATUS_FILE = "status.json"
JOBS_FILE = "jobs.json"
MAX_STATUS_BYTES = 1 << 20  # a status file is ours, but read bounded all the same
_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
# flags that have their own option: --slurm-arg may not set them behind its back
_OWN_FLAGS = {"partition": "--partition", "time": "--time", "account": "--account", "qos": "--qos",
              "gpus_per_node": "--gpus-per-job", "gpus": "--gpus-per-job", "array": "--jobs",
              "output": "(the log path)", "error": "(the log path)"}

__all__ = ["ClusterError", "JobRef", "JobStatus", "add_executor_args", "check_args", "partitions",
           "slurm_parameters", "make_executor", "submit", "load_jobs", "statuses", "wait", "result", "cancel",
           "default_partition", "parse_time_min", "job_info"]


class ClusterError(RuntimeError):
    """A cluster request that cannot go ahead (bad flag, no Slurm here, sbatch refused): exit 2."""


# --------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------
def add_executor_args(parser: argparse.ArgumentParser, *, multi_partition: bool = False) -> None:
    """The cluster flags, in their own help group."""
    g = parser.add_argument_group("cluster (Slurm, through submitit)")
    g.add_argument("--executor", choices=EXECUTORS, default="local",
                   help="local: run here (default); slurm: submit Slurm jobs and collect what they write")
    g.add_argument("--partition", metavar="P1,P2" if multi_partition else "P",
                   help="Slurm partition" + (" (several, comma-separated: one set of jobs each)"
                                             if multi_partition else "") + " (default: the cluster's default)")
    g.add_argument("--gpus-per-job", type=int, metavar="N",
                   help="GPUs each job asks for (default: what the work needs; 0 for CPU-only partitions)")
    g.add_argument("--time", metavar="T", help="each job's time limit: minutes, H:MM:SS or D-HH:MM (default 60)")
    g.add_argument("--jobs", type=int, metavar="N", help="how many jobs to split the work over / run at once")
    g.add_argument("--account", metavar="A", help="Slurm account to charge")
    g.add_argument("--qos", metavar="Q", help="Slurm quality of service")
    g.add_argument("--slurm-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="any other sbatch option, e.g. --slurm-arg constraint=h100 --slurm-arg mem=64G "
                        "(KEY alone for a flag: --slurm-arg exclusive); repeatable")
    g.add_argument("--detach", action="store_true", help="submit, print the job ids and return (collect later)")
    g.add_argument("--cancel-on-interrupt", action="store_true",
                   help="Ctrl-C while waiting cancels the jobs (default: they go on; collect later)")


def _slurm_extra(items: Iterable[str]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    for item in items or []:
        key, eq, value = str(item).partition("=")
        key = key.strip().lstrip("-")
        if not _KEY.match(key):
            raise ClusterError(f"--slurm-arg {item!r}: expected KEY=VALUE with KEY an sbatch option name "
                               "(letters, digits, - and _), e.g. constraint=h100")
        norm = key.replace("-", "_")
        if norm in _OWN_FLAGS:
            raise ClusterError(f"--slurm-arg {item!r}: use {_OWN_FLAGS[norm]} for that")
        if eq and ("\n" in value or "\r" in value or not value.strip()):
            raise ClusterError(f"--slurm-arg {item!r}: the value must be one non-empty line")
        extra[norm] = value.strip() if eq else True
    return extra


def parse_time_min(text: str | int | None, default: int = 60) -> int:
    """A Slurm time limit as whole minutes: ``90``, ``MM:SS``, ``H:MM:SS``, ``D-H``, ``D-HH:MM``, ``D-HH:MM:SS``."""
    if text is None or str(text).strip() == "":
        return default
    s = str(text).strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", s)
    if not m:
        raise ClusterError(f"--time {s!r}: expected minutes, H:MM:SS or D-HH:MM")
    days, a, b, c = m.groups()
    if days is None:
        if b is None:
            secs = int(a) * 60  # minutes
        elif c is None:
            secs = int(a) * 60 + int(b)  # MM:SS
        else:
            secs = int(a) * 3600 + int(b) * 60 + int(c)
    else:
        secs = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    minutes = -(-secs // 60)
    if minutes < 1:
        raise ClusterError(f"--time {s!r}: at least one minute")
    return minutes


def partitions(args) -> list[str | None]:
    """The partitions asked for (``[None]``: the cluster's default)."""
    parts = [p.strip() for p in str(args.partition or "").split(",") if p.strip()]
    return parts or [None]


def check_args(args, *, multi_partition: bool = False, collecting: bool = False) -> None:
    """Raise ClusterError for a value that cannot work, before anything is submitted.

    ``collecting``: the command only collects jobs submitted earlier (``--collect``): the
    flags that shape a submission are refused, ``--cancel-on-interrupt`` is allowed."""
    slurm = getattr(args, "executor", "local") == "slurm"
    used = [flag for flag, on in (("--partition", args.partition), ("--gpus-per-job", args.gpus_per_job is not None),
                                  ("--time", args.time), ("--jobs", args.jobs is not None),
                                  ("--account", args.account), ("--qos", args.qos),
                                  ("--slurm-arg", args.slurm_arg), ("--detach", args.detach),
                                  ("--cancel-on-interrupt", args.cancel_on_interrupt and not collecting)) if on]
    if collecting and (used or slurm):
        raise ClusterError(f"--collect submits nothing: leave out {', '.join(used or ['--executor slurm'])}")
    if used and not slurm:
        raise ClusterError(f"{', '.join(used)}: only with --executor slurm")
    if args.gpus_per_job is not None and args.gpus_per_job < 0:
        raise ClusterError(f"--gpus-per-job {args.gpus_per_job}: must be 0 or more")
    if args.jobs is not None and args.jobs < 1:
        raise ClusterError(f"--jobs {args.jobs}: must be 1 or more")
    for p in partitions(args):
        if p is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", p):
            raise ClusterError(f"--partition {p!r}: not a partition name")
    if not multi_partition and len(partitions(args)) > 1:
        raise ClusterError(f"--partition {args.partition}: one partition here")
    parse_time_min(args.time)
    _slurm_extra(args.slurm_arg)


# --------------------------------------------------------------------------
# Submitting
# --------------------------------------------------------------------------
def slurm_parameters(args, *, gpus: int, partition: str | None = None, name: str = "workbench",
                     parallelism: int | None = None) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for the cluster flags (``gpus``: per job, unless --gpus-per-job)."""
    gpus = args.gpus_per_job if args.gpus_per_job is not None else gpus
    params: dict[str, Any] = {"job_name": name, "time": parse_time_min(args.time), "nodes": 1,
                              "ntasks_per_node": 1, "stderr_to_stdout": True}
    part = partition if partition is not None else (partitions(args)[0] if args.partition else None)
    if part:
        params["partition"] = part
    if gpus:
        params["gpus_per_node"] = int(gpus)
    if args.account:
        params["account"] = args.account
    if args.qos:
        params["qos"] = args.qos
    if parallelism:
        params["array_parallelism"] = int(parallelism)
    extra = _slurm_extra(args.slurm_arg)
    if extra:
        params["additional_parameters"] = extra
    return params


def make_executor(args, folder: str | os.PathLike, *, gpus: int, partition: str | None = None,
                  name: str = "workbench", parallelism: int | None = None):
    """A submitit SlurmExecutor for the flags; its pickles and job logs go to ``folder``."""
    try:
        import submitit
    except ImportError:
        raise ClusterError("--executor slurm needs submitit (pip install submitit)") from None
    missing = [t for t in ("sbatch", "srun", "scontrol", "scancel") if shutil.which(t) is None]
    if missing:
        raise ClusterError(f"--executor slurm: {', '.join(missing)} not found: run on a Slurm login node "
                           "(where sbatch works), or use --executor local")
    ex = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=3)
    try:
        ex.update_parameters(**slurm_parameters(args, gpus=gpus, partition=partition, name=name,
                                                parallelism=parallelism))
    except ValueError as exc:
        raise ClusterError(f"--slurm-arg: {str(exc).splitlines()[0]}") from None
    return ex


@dataclasses.dataclass
class JobRef:
    """One submitted job (an array task or a single job) and where its files are."""

    job_id: str                # "1234_5" for array task 5 of array 1234, "1234" for a single job
    name: str                  # what it does, for messages (a notebook, "share 3 of 8", ...)
    folder: str                # submitit's folder (pickles, the log)
    status: str                # the job's status file

    @property
    def log(self) -> Path:
        """The job's log (stdout and stderr together)."""
        from submitit.core.utils import JobPaths

        return JobPaths(self.folder, job_id=self.job_id, task_id=0).stdout

    @property
    def array_id(self) -> str:
        return self.job_id.split("_", 1)[0]


@dataclasses.dataclass
class JobStatus:
    job_id: str
    name: str
    phase: str                  # pending, running, done, failed
    state: str                  # Slurm's word (RUNNING, COMPLETED, NODE_FAIL, ...) or UNKNOWN
    node: str = ""
    error: str = ""
    log: str = ""
    info: dict = dataclasses.field(default_factory=dict)  # the job's status file

    @property
    def ended(self) -> bool:
        return self.phase in ("done", "failed")

    def line(self) -> str:
        where = f" on {self.node}" if self.node else ""
        state = f" ({self.state})" if self.state not in ("UNKNOWN", "") and self.state.lower() != self.phase else ""
        err = f": {self.error}" if self.error else ""
        return f"job {self.job_id} [{self.name}] {self.phase}{where}{state}{err}; log: {self.log}"


class JobCall:
    """What runs in the job: status file around ``fn(*args)``; a submitit Checkpointable when ``requeue``.

    submitit requeues a Checkpointable job that reaches its time limit (Slurm signals it
    ``signal_delay_s`` before); ``fn`` then runs again from the start and must skip what it
    already wrote. SIGTERM (scancel, preemption, the time limit itself) raises `JobStopped`
    in ``fn``, so it can save what it has before Slurm kills the job.
    """

    def __init__(self, fn: Callable, requeue: bool = False):
        self.fn, self.requeue = fn, requeue

    def __call__(self, status_path: str, *args):
        os.environ.pop("TRITON_INTERPRET", None)  # the node decides: GPU -> compiled, none -> interpreter
        from . import dist  # noqa: F401  (NVLink multicast off before anything initializes)

        status = Path(status_path)
        info = {**job_info(), "state": "running", "pid": os.getpid(),
                "started": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}
        _write_json(status, info)
        before = signal.signal(signal.SIGTERM, _stop)
        try:
            out = self.fn(*args)
        except BaseException as exc:
            state = "stopped" if isinstance(exc, (JobStopped, SystemExit, KeyboardInterrupt)) else "failed"
            _write_json(status, {**info, "state": state, "error": _clip(f"{type(exc).__name__}: {exc}"),
                                 "ended": _now()})
            raise
        finally:
            signal.signal(signal.SIGTERM, before)  # done: a late SIGTERM must not raise while Python exits
        _write_json(status, {**info, "state": "done", "ended": _now()})
        return out

    def checkpoint(self, status_path: str, *args):
        """submitit asks before requeueing at the time limit: the same call again, or None (not requeued)."""
        if not self.requeue:
            return None
        from submitit.core.utils import DelayedSubmission

        return DelayedSubmission(self, status_path, *args)


class JobStopped(BaseException):
    """The job was told to stop (SIGTERM: cancelled, preempted, or at its time limit). A BaseException,
    like KeyboardInterrupt, so that no failure isolation (a sweep's per-point ``except Exception``)
    records it as the point's error and goes on."""


def _stop(signum, frame):
    raise JobStopped("SIGTERM: the job was cancelled, preempted or reached its time limit")


def job_info() -> dict[str, Any]:
    """Inside a Slurm job: its id, array index, partition, node and GPUs (empty values elsewhere)."""
    env = os.environ
    array = env.get("SLURM_ARRAY_JOB_ID")
    jid = f"{array}_{env.get('SLURM_ARRAY_TASK_ID')}" if array else env.get("SLURM_JOB_ID", "")
    return {"job_id": jid, "slurm_job_id": env.get("SLURM_JOB_ID", ""),
            "array_index": env.get("SLURM_ARRAY_TASK_ID", ""), "partition": env.get("SLURM_JOB_PARTITION", ""),
            "node": env.get("SLURMD_NODENAME") or socket.gethostname(),
            "gpus": env.get("SLURM_JOB_GPUS") or env.get("CUDA_VISIBLE_DEVICES", ""),
            "restarts": int(env.get("SLURM_RESTART_COUNT") or 0)}


def submit(executor, folder: str | os.PathLike, fn: Callable, arg_tuples: Sequence[tuple], *,
           names: Sequence[str], requeue: bool = False) -> list[JobRef]:
    """Submit ``fn(*args)`` for every tuple as one job array; record and return the refs."""
    folder = Path(folder)
    status_dir = folder / "status"
    status_dir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:10]  # this submission's status files (a folder may hold several)
    paths = [str(status_dir / f"{tag}_{i}.json") for i in range(len(arg_tuples))]
    call = JobCall(fn, requeue=requeue)
    columns = list(zip(*arg_tuples)) if arg_tuples and arg_tuples[0] else []
    try:
        jobs = executor.map_array(call, paths, *columns)
    except Exception as exc:  # sbatch refused (bad partition, account, GPU request ...)
        text = str(exc).strip()
        m = re.search(r"sbatch: error: (.*)", text)
        raise ClusterError(f"sbatch refused the jobs: {m.group(1) if m else text[-800:]}") from None
    refs = [JobRef(job_id=str(j.job_id), name=n, folder=str(executor.folder), status=p)
            for j, n, p in zip(jobs, names, paths)]
    _write_json(folder / JOBS_FILE, [dataclasses.asdict(r) for r in load_jobs(folder) + refs])
    return refs


def load_jobs(folder: str | os.PathLike) -> list[JobRef]:
    """The refs recorded in ``folder/jobs.json`` ([] when there is none)."""
    data = _read_json(Path(folder) / JOBS_FILE, default=[])
    fields = {f.name for f in dataclasses.fields(JobRef)}
    return [JobRef(**{k: str(v) for k, v in d.items() if k in fields}) for d in data
            if isinstance(d, dict) and fields <= set(d)]


def result(ref: JobRef) -> Any:
    """What the job's function returned (submitit's result pickle); raises if it failed."""
    import submitit

    return submitit.SlurmJob(folder=ref.folder, job_id=ref.job_id).result()


def cancel(refs: Sequence[JobRef]) -> None:
    if refs:
        subprocess.run(["scancel", *sorted({r.job_id for r in refs})], capture_output=True, timeout=60)


# --------------------------------------------------------------------------
# Following jobs
# --------------------------------------------------------------------------
class _SchedulerView:
    """Slurm's state of each job: ``sacct`` where accounting is on (as submitit reads it), else
    ``scontrol show job`` (which knows pending and running jobs and, for ``MinJobAge`` after
    the end, finished ones). Calls are spaced out (2 s at first, then up to ``max_delay_s``)
    so that following a big array does not flood the controller."""

    def __init__(self, max_delay_s: float = 30.0):
        self.max_delay_s = max_delay_s
        self.sacct_works: bool | None = None
        self.info: dict[str, dict[str, str]] = {}
        self.last = float("-inf")
        self.started = time.monotonic()

    def refresh(self, ids: Iterable[str], *, soon: bool = False) -> None:
        """Ask Slurm when it is due (``soon``: when a second has passed, e.g. a job's own status changed)."""
        arrays = sorted({i.split("_", 1)[0] for i in ids})
        if not arrays:
            return
        delay = 1.0 if soon else min(self.max_delay_s, max(2.0, (time.monotonic() - self.started) / 4))
        if time.monotonic() - self.last < delay:
            return
        self.last = time.monotonic()
        if self.sacct_works is not False:
            got = self._sacct(arrays)
            self.sacct_works = got is not None
            if got is not None:
                self.info.update(got)
                return
        for a in arrays:
            self.info.update(self._scontrol(a))

    @staticmethod
    def _sacct(arrays: list[str]) -> dict | None:
        from submitit.slurm.slurm import SlurmInfoWatcher

        cmd = ["sacct", "-o", "JobID,State,NodeList", "--parsable2", *[x for a in arrays for x in ("-j", a)]]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return None
        if r.returncode != 0:
            return None
        out = SlurmInfoWatcher().read_info(r.stdout)
        return {k: {"state": v.get("State", "").split()[0] if v.get("State") else "",
                    "node": v.get("NodeList", "")} for k, v in out.items()}

    @staticmethod
    def _scontrol(array: str) -> dict:
        try:
            r = subprocess.run(["scontrol", "show", "job", "-o", array], capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.SubprocessError):
            return {}
        if r.returncode != 0:
            # "Invalid job id": Slurm has forgotten it (finished longer than MinJobAge ago)
            return {array: {"state": "FORGOTTEN", "node": ""}} if "nvalid job id" in r.stderr else {}
        out = {}
        for line in r.stdout.splitlines():
            f = dict(kv.split("=", 1) for kv in line.split() if "=" in kv)
            state = {"state": f.get("JobState", ""), "node": "" if f.get("NodeList") in (None, "(null)")
                     else f["NodeList"]}
            if f.get("ArrayJobId") and f.get("ArrayTaskId"):
                for idx in _expand(f["ArrayTaskId"]):
                    out[f"{f['ArrayJobId']}_{idx}"] = state
            elif f.get("JobId"):
                out[f["JobId"]] = state
        return out

    def state(self, job_id: str) -> tuple[str, str]:
        got = self.info.get(job_id) or self.info.get(job_id.split("_", 1)[0])
        if got is None:
            return "UNKNOWN", ""
        return got["state"] or "UNKNOWN", got["node"]


def _expand(spec: str) -> list[str]:
    """Slurm's array index list ('0-3,7%2') as indices."""
    out = []
    for part in spec.split("%", 1)[0].split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit() and (not hi or hi.isdigit()):
            out.extend(str(i) for i in range(int(lo), int(hi or lo) + 1))
    return out


def _status(ref: JobRef, view: _SchedulerView) -> JobStatus:
    state, node = view.state(ref.job_id)
    info = _read_json(Path(ref.status), default={}) if ref.status else {}
    info = info if isinstance(info, dict) else {}
    node = node or str(info.get("node") or "")
    st = JobStatus(ref.job_id, ref.name, "pending", state, node, "", str(ref.log), info)
    own = info.get("state")
    if state in LIVE_STATES:  # Slurm first: a job that stopped and was requeued is pending again
        st.phase = "running" if state in ("RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT") else "pending"
    elif own == "done":
        st.phase = "done"
    elif own in ("failed", "stopped"):
        st.phase, st.error = "failed", str(info.get("error") or own)
    elif state in ("UNKNOWN", ""):  # not asked yet, no answer, or just submitted: nothing to conclude
        st.phase = "running" if own == "running" else "pending"
    else:  # Slurm says it ended, and the job never said how
        st.phase, st.error = "failed", _why_ended(state, node, own, ref)
    return st


def _why_ended(state: str, node: str, own: str | None, ref: JobRef) -> str:
    if state == "NODE_FAIL":
        what = f"node {node or '?'} failed (NODE_FAIL) while the job ran"
    elif state in ("CANCELLED", "TIMEOUT", "PREEMPTED", "OUT_OF_MEMORY", "DEADLINE", "BOOT_FAIL"):
        what = f"Slurm ended the job: {state}"
    elif state == "FORGOTTEN":
        what = "Slurm no longer knows the job and it left no final status (node lost or job killed)"
    else:
        what = f"the job ended ({state})"
    before = " before its program started" if own is None else " before it finished"
    tail = _log_tail(ref.log)
    return what + before + (f"; last log line: {tail}" if tail else "")


def _log_tail(path: Path, n: int = 1) -> str:
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 4096))
            lines = [ln for ln in fh.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-n:])[:300]


def statuses(refs: Sequence[JobRef]) -> dict[str, JobStatus]:
    """Each job's status now."""
    view = _SchedulerView()
    view.refresh([r.job_id for r in refs])
    return {r.job_id: _status(r, view) for r in refs}


def wait(refs: Sequence[JobRef], *, on_end: Callable[[JobRef, JobStatus], Any] | None = None,
         poll: Callable[[dict[str, JobStatus]], Any] | None = None, interval_s: float = 1.0, hint: str = "",
         cancel_on_interrupt: bool = False, log: Callable[[str], Any] | None = None,
         grace_s: float = 10.0) -> dict[str, JobStatus]:
    """Follow ``refs`` until every job ended; return their final statuses (see the module docs)."""
    log = log or (lambda s: print(s, file=sys.stderr, flush=True))
    view = _SchedulerView()
    left = {r.job_id: r for r in refs}
    final: dict[str, JobStatus] = {}
    # Slurm says a job ended but its status file does not (yet): a shared filesystem may show
    # the file late, so wait grace_s before calling it failed.
    odd_since: dict[str, float] = {}
    soon = False
    try:
        while left:
            view.refresh(list(left), soon=soon)
            now = {jid: _status(r, view) for jid, r in left.items()}
            soon = any(st.info.get("state") in ("done", "failed", "stopped") and not st.ended for st in now.values())
            for jid, st in now.items():
                if st.phase == "failed" and st.info.get("state") not in ("failed", "stopped"):
                    if time.monotonic() - odd_since.setdefault(jid, time.monotonic()) < grace_s:
                        st.phase = "running"
                        continue
                if st.ended:
                    final[jid] = st
                    ref = left.pop(jid)
                    if on_end is not None:
                        on_end(ref, st)
            if poll is not None:
                poll({**now, **final})
            if left:
                time.sleep(interval_s)
    except KeyboardInterrupt:
        live = list(left.values())
        ids = _compact([r.job_id for r in live])
        if cancel_on_interrupt and live:
            cancel(live)
            log(f"interrupted: cancelled {len(live)} job(s) ({ids}). {hint}".rstrip())
        else:
            log(f"interrupted: {len(live)} job(s) still on the cluster ({ids}); nothing was cancelled "
                f"(scancel {' '.join(sorted({r.array_id for r in live}))} would). {hint}".rstrip())
        raise
    return final


def _compact(ids: Sequence[str]) -> str:
    """'12_[0-2,5], 14' for display."""
    groups: dict[str, list[int]] = {}
    singles = []
    for i in ids:
        a, _, t = i.partition("_")
        if t.isdigit():
            groups.setdefault(a, []).append(int(t))
        else:
            singles.append(i)
    parts = []
    for a, ts in groups.items():
        ts.sort()
        runs, start = [], ts[0]
        for prev, cur in zip(ts, ts[1:] + [None]):
            if cur != prev + 1:
                runs.append(f"{start}" if start == prev else f"{start}-{prev}")
                start = cur
        parts.append(f"{a}_[{','.join(runs)}]")
    return ", ".join(parts + singles)


def default_partition() -> str | None:
    """The cluster's default partition (``sinfo`` marks it with ``*``), or None when unknown."""
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    for line in r.stdout.split():
        if line.endswith("*"):
            return line[:-1]
    return None


# --------------------------------------------------------------------------
# small helpers
# --------------------------------------------------------------------------
def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _clip(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[: limit // 2] + "\n...\n" + text[-limit // 2:]


def _write_json(path: Path, data: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _read_json(path: Path, default: Any = None) -> Any:
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_STATUS_BYTES + 1)
    except OSError:
        return default
    if len(data) > MAX_STATUS_BYTES:
        return default
    try:
        return json.loads(data)
    except ValueError:
        return default


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """A JSON file this module (or a job) wrote, read bounded; ``default`` when missing or damaged."""
    return _read_json(Path(path), default)


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write JSON atomically (a reader never sees half a file)."""
    _write_json(Path(path), data)

