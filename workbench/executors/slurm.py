"""``--executor slurm``: the units as Slurm jobs, through submitit (``sbatch`` underneath).

No scheduler of our own: Slurm places, starts, requeues and cancels jobs; this backend only
asks it. `submit` sends a command's units as ONE job array (one job when there is one unit),
each job asking for the GPUs its unit needs; inside, ``workbench.jobs.JobCall`` writes the
job's status file and runs the unit. `statuses` combines Slurm's word (``sacct`` where
accounting is on, as submitit reads it, else ``scontrol show job``) with the job's own: pending,
running, done, failed (the exception the unit raised, ``NODE_FAIL on gpu07``, ...), with its log.

Flags (their own help group): ``--partition P`` (``P1,P2`` where the command sends units to
several: `Executor.places`), ``--time T`` (minutes, ``H:MM:SS`` or ``D-HH:MM``), ``--account
A``, ``--qos Q``, ``--slurm-arg KEY=VALUE`` (any other ``sbatch`` option, repeatable); and the
job flags every such backend takes (``workbench.executors``): ``--gpus-per-job``, ``--jobs``,
``--detach``, ``--cancel-on-interrupt``.

Inside a job, ``TRITON_INTERPRET`` is not inherited from the submitting shell (which, without a
GPU, may have set it for itself): as in a local run, a node with a GPU compiles kernels and one
without interprets them. NVLink multicast stays off (``workbench.dist.MULTICAST_OFF``). A job at
its time limit is requeued by submitit when its unit was submitted with ``requeue=True``.
"""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from ..jobs import JobCall, JobRef, JobStatus, read_json, record
from . import Executor, ExecutorError

LIVE_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED",
               "RESIZING", "SUSPENDED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD"}
_KEY = re.compile(r"^[A-Za-z][A-Za-z0-9_-]*$")
# flags that have their own option: --slurm-arg may not set them behind its back
_OWN_FLAGS = {"partition": "--partition", "time": "--time", "account": "--account", "qos": "--qos",
              "gpus_per_node": "--gpus-per-job", "gpus": "--gpus-per-job", "array": "--jobs",
              "output": "(the log path)", "error": "(the log path)"}

__all__ = ["SlurmExecutor", "BACKEND", "parse_time_min", "partitions", "slurm_parameters", "job_info",
           "default_partition", "LIVE_STATES"]


class SlurmExecutor(Executor):
    NAME = "slurm"
    HELP = "submit Slurm jobs (through submitit) and collect what they write"
    PLACE_COLUMN = "slurm_partition"  # workbench.provenance's column: the partition a row was measured on

    def __init__(self, args=None):
        super().__init__(args)
        self.args = args
        self.partition = getattr(args, "partition", None)
        self.time = getattr(args, "time", None)
        self.account = getattr(args, "account", None)
        self.qos = getattr(args, "qos", None)
        self.slurm_arg = list(getattr(args, "slurm_arg", None) or [])
        self._default: list[str | None] = []

    # -- flags ----------------------------------------------------------------------------------
    @classmethod
    def add_args(cls, parser, *, multi_place: bool = False) -> None:
        g = parser.add_argument_group("Slurm (--executor slurm, through submitit)")
        g.add_argument("--partition", metavar="P1,P2" if multi_place else "P",
                       help="Slurm partition" + (" (several, comma-separated: one set of jobs each)"
                                                 if multi_place else "") + " (default: the cluster's default)")
        g.add_argument("--time", metavar="T", help="each job's time limit: minutes, H:MM:SS or D-HH:MM (default 60)")
        g.add_argument("--account", metavar="A", help="Slurm account to charge")
        g.add_argument("--qos", metavar="Q", help="Slurm quality of service")
        g.add_argument("--slurm-arg", action="append", default=[], metavar="KEY=VALUE",
                       help="any other sbatch option, e.g. --slurm-arg constraint=h100 --slurm-arg mem=64G "
                            "(KEY alone for a flag: --slurm-arg exclusive); repeatable")

    @classmethod
    def flags_used(cls, args) -> list[str]:
        return [flag for flag, on in (("--partition", getattr(args, "partition", None)),
                                      ("--time", getattr(args, "time", None)),
                                      ("--account", getattr(args, "account", None)),
                                      ("--qos", getattr(args, "qos", None)),
                                      ("--slurm-arg", getattr(args, "slurm_arg", None))) if on]

    def check(self, *, multi_place: bool = False) -> None:
        for p in self.places():
            if p is not None and not re.fullmatch(r"[A-Za-z0-9_.-]+", p):
                raise ExecutorError(f"--partition {p!r}: not a partition name")
        if not multi_place and len(self.places()) > 1:
            raise ExecutorError(f"--partition {self.partition}: one partition here")
        parse_time_min(self.time)
        _slurm_extra(self.slurm_arg)

    # -- where ----------------------------------------------------------------------------------
    def places(self) -> list[str | None]:
        return partitions(self)

    def place(self) -> str | None:
        if self.places()[0] is not None:
            return self.places()[0]
        if not self._default:
            self._default = [default_partition()]
        return self._default[0]

    # -- units ----------------------------------------------------------------------------------
    def submit(self, fn, calls, *, folder, names, gpus=0, label="workbench", place=None, logs=None,
               parallelism=None, requeue=False) -> list[JobRef]:
        folder = Path(folder)
        ex = make_executor(self, logs or folder / "logs", gpus=gpus, partition=place, name=label,
                           parallelism=parallelism)
        status_dir = folder / "status"
        status_dir.mkdir(parents=True, exist_ok=True)
        tag = uuid.uuid4().hex[:10]  # this submission's status files (a folder may hold several)
        paths = [str(status_dir / f"{tag}_{i}.json") for i in range(len(calls))]
        call = (_Requeueable if requeue else JobCall)(fn, requeue=requeue, where=job_info)
        columns = list(zip(*calls)) if calls and calls[0] else []
        try:
            jobs = ex.map_array(call, paths, *columns)
        except Exception as exc:  # sbatch refused (bad partition, account, GPU request ...)
            text = str(exc).strip()
            m = re.search(r"sbatch: error: (.*)", text)
            raise ExecutorError(f"sbatch refused the jobs: {m.group(1) if m else text[-800:]}") from None
        refs = [JobRef(job_id=str(j.job_id), name=n, folder=str(ex.folder), status=p, executor=self.NAME,
                       log_file=str(_log_path(str(ex.folder), str(j.job_id))))
                for j, n, p in zip(jobs, names, paths)]
        record(folder, refs)
        return refs

    def statuses(self, refs: Sequence[JobRef]) -> dict[str, JobStatus]:
        view = _SchedulerView()
        view.refresh([r.job_id for r in refs])
        return {r.job_id: _status(r, view) for r in refs}

    def wait(self, refs, *, on_end=None, poll=None, hint="", log=None) -> dict[str, JobStatus]:
        return _follow(refs, on_end=on_end, poll=poll, hint=hint, cancel_on_interrupt=self.cancel_on_interrupt, log=log)

    def result(self, ref: JobRef) -> Any:
        import submitit

        return submitit.SlurmJob(folder=ref.folder, job_id=ref.job_id).result()

    def cancel(self, refs: Sequence[JobRef]) -> None:
        if refs:
            subprocess.run(["scancel", *sorted({r.job_id for r in refs})], capture_output=True, timeout=60)

    def cancel_command(self, refs: Sequence[JobRef]) -> str:
        return "scancel " + " ".join(sorted({r.array_id for r in refs}))

    def describe(self, refs: Sequence[JobRef]) -> str:
        return _compact([r.job_id for r in refs])


class _Requeueable(JobCall):
    """A JobCall that submitit requeues at the time limit (Slurm signals it ``signal_delay_s``
    before): the same call again, which picks up where it stopped."""

    def checkpoint(self, status_path: str, *args):
        from submitit.core.utils import DelayedSubmission

        return DelayedSubmission(self, status_path, *args)


def _log_path(folder: str, job_id: str) -> Path:
    from submitit.core.utils import JobPaths

    return JobPaths(folder, job_id=job_id, task_id=0).stdout


# --------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------
def _slurm_extra(items: Iterable[str]) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    for item in items or []:
        key, eq, value = str(item).partition("=")
        key = key.strip().lstrip("-")
        if not _KEY.match(key):
            raise ExecutorError(f"--slurm-arg {item!r}: expected KEY=VALUE with KEY an sbatch option name "
                                "(letters, digits, - and _), e.g. constraint=h100")
        norm = key.replace("-", "_")
        if norm in _OWN_FLAGS:
            raise ExecutorError(f"--slurm-arg {item!r}: use {_OWN_FLAGS[norm]} for that")
        if eq and ("\n" in value or "\r" in value or not value.strip()):
            raise ExecutorError(f"--slurm-arg {item!r}: the value must be one non-empty line")
        extra[norm] = value.strip() if eq else True
    return extra


def parse_time_min(text: str | int | None, default: int = 60) -> int:
    """A Slurm time limit as whole minutes: ``90``, ``MM:SS``, ``H:MM:SS``, ``D-H``, ``D-HH:MM``, ``D-HH:MM:SS``."""
    if text is None or str(text).strip() == "":
        return default
    s = str(text).strip()
    m = re.fullmatch(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", s)
    if not m:
        raise ExecutorError(f"--time {s!r}: expected minutes, H:MM:SS or D-HH:MM")
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
        raise ExecutorError(f"--time {s!r}: at least one minute")
    return minutes


def partitions(flags) -> list[str | None]:
    """The partitions asked for (``[None]``: the cluster's default); ``flags``: the parsed command
    line or a SlurmExecutor."""
    parts = [p.strip() for p in str(getattr(flags, "partition", None) or "").split(",") if p.strip()]
    return parts or [None]


# --------------------------------------------------------------------------
# Submitting
# --------------------------------------------------------------------------
def slurm_parameters(flags, *, gpus: int, partition: str | None = None, name: str = "workbench",
                     parallelism: int | None = None) -> dict[str, Any]:
    """submitit SlurmExecutor parameters for the flags (``gpus``: per job, unless --gpus-per-job);
    ``flags``: the parsed command line or a SlurmExecutor."""
    gpus_per_job = getattr(flags, "gpus_per_job", None)
    gpus = gpus_per_job if gpus_per_job is not None else gpus
    params: dict[str, Any] = {"job_name": name, "time": parse_time_min(getattr(flags, "time", None)), "nodes": 1,
                              "ntasks_per_node": 1, "stderr_to_stdout": True}
    part = partition if partition is not None else (partitions(flags)[0] if getattr(flags, "partition", None)
                                                    else None)
    if part:
        params["partition"] = part
    if gpus:
        params["gpus_per_node"] = int(gpus)
    if getattr(flags, "account", None):
        params["account"] = flags.account
    if getattr(flags, "qos", None):
        params["qos"] = flags.qos
    if parallelism:
        params["array_parallelism"] = int(parallelism)
    extra = _slurm_extra(getattr(flags, "slurm_arg", None))
    if extra:
        params["additional_parameters"] = extra
    return params


def make_executor(flags, folder: str | os.PathLike, *, gpus: int, partition: str | None = None,
                  name: str = "workbench", parallelism: int | None = None):
    """A submitit SlurmExecutor for the flags; its pickles and job logs go to ``folder``."""
    try:
        import submitit
    except ImportError:
        raise ExecutorError("--executor slurm needs submitit (pip install submitit)") from None
    missing = [t for t in ("sbatch", "srun", "scontrol", "scancel") if shutil.which(t) is None]
    if missing:
        raise ExecutorError(f"--executor slurm: {', '.join(missing)} not found: run on a Slurm login node "
                            "(where sbatch works), or use --executor local")
    ex = submitit.SlurmExecutor(folder=str(folder), max_num_timeout=3)
    try:
        ex.update_parameters(**slurm_parameters(flags, gpus=gpus, partition=partition, name=name,
                                                parallelism=parallelism))
    except ValueError as exc:
        raise ExecutorError(f"--slurm-arg: {str(exc).splitlines()[0]}") from None
    return ex


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
    info = read_json(Path(ref.status), default={}) if ref.status else {}
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


def _follow(refs: Sequence[JobRef], *, on_end: Callable[[JobRef, JobStatus], Any] | None = None,
         poll: Callable[[dict[str, JobStatus]], Any] | None = None, interval_s: float = 1.0, hint: str = "",
         cancel_on_interrupt: bool = False, log: Callable[[str], Any] | None = None,
         grace_s: float = 10.0) -> dict[str, JobStatus]:
    """Follow ``refs`` until every job ended; return their final statuses (`Executor.wait`)."""
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
            SlurmExecutor().cancel(live)
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


BACKEND = SlurmExecutor
