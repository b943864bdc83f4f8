"""``--executor local`` (the default): the units run here, in this process, one after another.

`submit` queues them; `wait` runs them in order, calling ``on_end`` after each, so a command's
flow is the same as with a scheduler's jobs. A unit that raises ends ``failed`` (its error in
the status) and the next one runs; `result` raises that exception again, as a job's would.
Ctrl-C stops the unit that runs and leaves the rest unrun. There is nothing to collect later.
"""
from __future__ import annotations

import itertools
import socket
import sys
from typing import Any, Callable, Sequence

from ..jobs import JobRef, JobStatus, clip
from . import Executor

_IDS = itertools.count(1)


class LocalExecutor(Executor):
    NAME = "local"
    HELP = "run here, in this process (default)"
    RUNS_HERE = True
    TAKES_JOB_FLAGS = False

    def __init__(self, args=None):
        super().__init__(args)
        self._queued: dict[str, tuple[Callable, tuple]] = {}
        self._status: dict[str, JobStatus] = {}
        self._value: dict[str, Any] = {}
        self._error: dict[str, BaseException] = {}

    def submit(self, fn, calls, *, folder=None, names, gpus=0, label="workbench", place=None, logs=None,
               parallelism=None, requeue=False) -> list[JobRef]:
        refs = []
        for args, name in zip(calls, names):
            jid = f"local-{next(_IDS)}"
            self._queued[jid] = (fn, tuple(args))
            self._status[jid] = JobStatus(jid, name, "pending", "PENDING", node=socket.gethostname())
            refs.append(JobRef(job_id=jid, name=name, folder=str(folder or ""), status="", executor=self.NAME))
        return refs

    def _run(self, ref: JobRef) -> JobStatus:
        fn, args = self._queued.pop(ref.job_id)
        st = self._status[ref.job_id]
        st.phase, st.state = "running", "RUNNING"
        try:
            self._value[ref.job_id] = fn(*args)
        except Exception as exc:  # the unit failed: said in its status, the next one runs
            self._error[ref.job_id] = exc
            st.phase, st.state, st.error = "failed", "FAILED", clip(f"{type(exc).__name__}: {exc}")
        else:
            st.phase, st.state = "done", "COMPLETED"
        return st

    def statuses(self, refs: Sequence[JobRef]) -> dict[str, JobStatus]:
        return {r.job_id: self._status[r.job_id] for r in refs}

    def wait(self, refs, *, on_end=None, poll=None, hint="", log=None) -> dict[str, JobStatus]:
        log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        todo = [r for r in refs if r.job_id in self._queued]
        for i, ref in enumerate(todo, 1):
            if len(todo) > 1:
                log(f"[{i}/{len(todo)}] running {ref.name} ...")
            st = self._run(ref)
            if on_end is not None:
                on_end(ref, st)
            if poll is not None:
                poll(self.statuses(refs))
        return self.statuses(refs)

    def result(self, ref: JobRef) -> Any:
        if ref.job_id in self._error:
            raise self._error[ref.job_id]
        if ref.job_id not in self._value:
            raise RuntimeError(f"unit {ref.job_id} [{ref.name}] has not run (wait for it first)")
        return self._value[ref.job_id]

    def cancel(self, refs: Sequence[JobRef]) -> None:
        for r in refs:
            if self._queued.pop(r.job_id, None) is not None:
                st = self._status[r.job_id]
                st.phase, st.state, st.error = "failed", "CANCELLED", "cancelled before it ran"


BACKEND = LocalExecutor
