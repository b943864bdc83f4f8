"""Work units as jobs: what an executor (``workbench.executors``) hands back and what a job leaves.

A command hands its work to an executor as units, each a call ``fn(*args)`` with a name. An
executor that runs them elsewhere (a Slurm job array, ...) returns a `JobRef` per unit, records
the refs in ``<folder>/jobs.json`` (`record` / `load`) so a later process can collect them, and
says what each is doing as a `JobStatus`.

Inside the job, `JobCall` runs the unit: it writes the job's own status file (running, then done,
failed or stopped, with where it ran), turns SIGTERM (cancelled, preempted, at its time limit)
into `JobStopped` so the unit can save what it has, and lets the node decide how kernels run:
``TRITON_INTERPRET`` is not carried over from the submitting shell. `current()` tells the unit
which job it is in (e.g. whether it was requeued).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import os
import signal
import socket
from pathlib import Path
from typing import Any, Callable, Sequence

JOBS_FILE = "jobs.json"
MAX_STATUS_BYTES = 1 << 20  # a status file is ours, but read bounded all the same

__all__ = ["JobRef", "JobStatus", "JobCall", "JobStopped", "JOBS_FILE", "record", "load", "current", "read_json",
           "write_json", "clip", "now"]


@dataclasses.dataclass
class JobRef:
    """One unit handed to an executor that runs it as a job, and where its files are."""

    job_id: str                # e.g. "1234_5" for array task 5 of array 1234, "1234" for a single job
    name: str                  # what it does, for messages (a notebook, "share 3 of 8", ...)
    folder: str                # the executor's folder for it (pickles, the log)
    status: str                # the job's own status file (written by JobCall)
    executor: str = "slurm"    # the backend that runs it (workbench.executors.<executor>)
    log_file: str = ""         # its log, where the backend names one

    @property
    def log(self) -> Path:
        """The job's log (stdout and stderr together): as the backend recorded it, else submitit's
        name for it in the job's folder."""
        return Path(self.log_file) if self.log_file else Path(self.folder) / f"{self.job_id}_0_log.out"

    @property
    def array_id(self) -> str:
        return self.job_id.split("_", 1)[0]


@dataclasses.dataclass
class JobStatus:
    job_id: str
    name: str
    phase: str                  # pending, running, done, failed
    state: str                  # the scheduler's word (RUNNING, COMPLETED, NODE_FAIL, ...) or UNKNOWN
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
        log = f"; log: {self.log}" if self.log else ""
        return f"job {self.job_id} [{self.name}] {self.phase}{where}{state}{err}{log}"


# --------------------------------------------------------------------------
# In the job
# --------------------------------------------------------------------------
_CURRENT: dict[str, Any] = {}


def current() -> dict[str, Any]:
    """Inside a unit run by `JobCall`: the job's own info (job id, node, ``restarts`` ...); {} elsewhere."""
    return dict(_CURRENT)


def _here() -> dict[str, Any]:
    return {"node": socket.gethostname(), "restarts": 0}


class JobStopped(BaseException):
    """The job was told to stop (SIGTERM: cancelled, preempted, or at its time limit). A BaseException,
    like KeyboardInterrupt, so that no failure isolation (a sweep's per-point ``except Exception``)
    records it as the point's error and goes on."""


def _stop(signum, frame):
    raise JobStopped("SIGTERM: the job was cancelled, preempted or reached its time limit")


class JobCall:
    """What runs in the job: its status file around ``fn(*args)``.

    ``where()`` (picklable: a module-level function of the backend) says where the job runs
    (job id, node, GPUs, ``restarts``); ``requeue``: the backend may requeue the job at its time
    limit, and ``fn`` then runs again from the start and must skip what it already wrote.
    """

    def __init__(self, fn: Callable, requeue: bool = False, where: Callable[[], dict] = _here):
        self.fn, self.requeue, self.where = fn, requeue, where

    def __call__(self, status_path: str, *args):
        os.environ.pop("TRITON_INTERPRET", None)  # the node decides: GPU -> compiled, none -> interpreter
        from . import dist  # noqa: F401  (NVLink multicast off before anything initializes)

        status = Path(status_path)
        info = {**self.where(), "state": "running", "pid": os.getpid(), "started": now()}
        _CURRENT.clear()
        _CURRENT.update(info)
        write_json(status, info)
        before = signal.signal(signal.SIGTERM, _stop)
        try:
            out = self.fn(*args)
        except BaseException as exc:
            state = "stopped" if isinstance(exc, (JobStopped, SystemExit, KeyboardInterrupt)) else "failed"
            write_json(status, {**info, "state": state, "error": clip(f"{type(exc).__name__}: {exc}"), "ended": now()})
            raise
        finally:
            signal.signal(signal.SIGTERM, before)  # done: a late SIGTERM must not raise while Python exits
        write_json(status, {**info, "state": "done", "ended": now()})
        return out


# --------------------------------------------------------------------------
# The files jobs leave
# --------------------------------------------------------------------------
def record(folder: str | os.PathLike, refs: Sequence[JobRef]) -> None:
    """Append ``refs`` to ``folder/jobs.json`` (for a later `load`)."""
    write_json(Path(folder) / JOBS_FILE, [dataclasses.asdict(r) for r in load(folder) + list(refs)])


def load(folder: str | os.PathLike) -> list[JobRef]:
    """The refs recorded in ``folder/jobs.json`` ([] when there is none)."""
    data = read_json(Path(folder) / JOBS_FILE, default=[])
    fields = {f.name for f in dataclasses.fields(JobRef)}
    need = {f.name for f in dataclasses.fields(JobRef) if f.default is dataclasses.MISSING}
    return [JobRef(**{k: str(v) for k, v in d.items() if k in fields}) for d in data or []
            if isinstance(d, dict) and need <= set(d)]


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def clip(text: str, limit: int = 2000) -> str:
    return text if len(text) <= limit else text[: limit // 2] + "\n...\n" + text[-limit // 2:]


def write_json(path: str | os.PathLike, data: Any) -> None:
    """Write JSON atomically (a reader never sees half a file)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def read_json(path: str | os.PathLike, default: Any = None) -> Any:
    """A JSON file a command or a job wrote, read bounded; ``default`` when missing or damaged."""
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
