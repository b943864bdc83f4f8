"""Where work runs: the executor that a command hands its work units to.

    workbench sweep SPEC [--executor local|slurm ...]      (also `workbench report`, `workbench tune`)

A command describes its work as units, each a call ``fn(*args)`` with a name and the GPUs it
needs, and hands them to the executor its command line chose; it never asks which one it is::

    ex = executors.from_args(args)                 # --executor NAME and the flags that go with it
    refs = ex.submit(fn, [(a1,), (a2,)], folder=run_dir, names=["one", "two"], gpus=1)
    ends = ex.wait(refs, on_end=lambda ref, st: print(st.line()))   # {job_id: JobStatus}
    value = ex.result(refs[0])                     # fn's return value; raises what fn raised

The one thing a command may ask is `Executor.RUNS_HERE`: whether the units run in this process,
one after another, while it waits (`local`), so that a unit may write the command's own output
folder itself; elsewhere (a job array on a cluster) each unit writes a folder of its own, the
command merges them as jobs end, and ``--detach`` / ``--collect`` split submitting from
collecting.

Backends, one module each in this package, found by module name (``--executor NAME``):

- ``local`` (the default): here, in this process, in order.
- ``slurm``: Slurm jobs through submitit (``sbatch`` underneath), followed and collected.

A new backend (Ray, a list of SSH hosts ...) is one new module here defining ``BACKEND``, a
subclass of `Executor`: its flags (`Executor.add_args`, in a group of their own) and the methods
below. The refs and statuses it returns, the job-side wrapper and the files jobs leave are
``workbench.jobs``'.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

from ..jobs import JobRef, JobStatus

DEFAULT = "local"

__all__ = ["Executor", "ExecutorError", "names", "backend", "add_args", "from_args", "for_ref", "DEFAULT"]


class ExecutorError(RuntimeError):
    """A request an executor cannot take (a bad flag, no scheduler here, the submission refused): exit 2."""


class Executor:
    """Runs a command's work units and follows them. Subclasses set NAME and HELP and, where the
    units run elsewhere, RUNS_HERE = False and TAKES_JOB_FLAGS = True."""

    NAME: ClassVar[str] = ""
    HELP: ClassVar[str] = ""
    RUNS_HERE: ClassVar[bool] = False        # units run in this process, in order, while the command waits
    TAKES_JOB_FLAGS: ClassVar[bool] = True   # --jobs, --gpus-per-job, --detach, --cancel-on-interrupt
    PLACE_COLUMN: ClassVar[str | None] = None  # the results' column naming where a row was measured (a partition)

    def __init__(self, args: argparse.Namespace | None = None):
        get = (lambda k, d=None: getattr(args, k, d)) if args is not None else (lambda k, d=None: d)
        self.jobs: int | None = get("jobs")
        self.gpus_per_job: int | None = get("gpus_per_job")
        self.detach: bool = bool(get("detach", False))
        self.cancel_on_interrupt: bool = bool(get("cancel_on_interrupt", False))

    # -- flags ----------------------------------------------------------------------------------
    @classmethod
    def add_args(cls, parser: argparse.ArgumentParser, *, multi_place: bool = False) -> None:
        """This backend's own flags (a group of their own); none by default."""

    @classmethod
    def flags_used(cls, args) -> list[str]:
        """Which of this backend's own flags the command line set (refused with another executor)."""
        return []

    def check(self, *, multi_place: bool = False) -> None:
        """Raise ExecutorError for a value of this backend's flags that cannot work."""

    # -- where ----------------------------------------------------------------------------------
    def places(self) -> list[str | None]:
        """Where the command line asked the units to run (partitions ...); [None]: the default place."""
        return [None]

    def place(self) -> str | None:
        """The one place units go to when the command line names none (a cluster's default partition)."""
        return self.places()[0]

    def gpus_for(self, needed: int) -> int:
        """GPUs a unit asks for: what it needs, or --gpus-per-job."""
        return needed if self.gpus_per_job is None else self.gpus_per_job

    # -- units ----------------------------------------------------------------------------------
    def submit(self, fn: Callable, calls: Sequence[tuple], *, folder: str | Path, names: Sequence[str],
               gpus: int = 0, label: str = "workbench", place: str | None = None, logs: str | Path | None = None,
               parallelism: int | None = None, requeue: bool = False) -> list[JobRef]:
        """``fn(*args)`` for each tuple of ``calls``; one ref each. ``folder``: where the units' files go
        (``logs``: their logs, default ``folder/logs``); ``gpus``: what each needs; ``label``: a short
        name for the scheduler; ``parallelism``: at most that many at once; ``requeue``: a unit may be
        started again from the start (at a time limit) and picks up where it stopped."""
        raise NotImplementedError

    def statuses(self, refs: Sequence[JobRef]) -> dict[str, JobStatus]:
        """What each unit is doing now, or how it ended."""
        raise NotImplementedError

    def wait(self, refs: Sequence[JobRef], *, on_end: Callable[[JobRef, JobStatus], Any] | None = None,
             poll: Callable[[dict[str, JobStatus]], Any] | None = None, hint: str = "",
             log: Callable[[str], Any] | None = None) -> dict[str, JobStatus]:
        """Follow the units until each ended, calling ``on_end(ref, status)`` once per unit and
        ``poll({job_id: status})`` now and then; on Ctrl-C say what goes on and ``hint`` (how to
        collect later), cancel only with --cancel-on-interrupt, and raise KeyboardInterrupt."""
        raise NotImplementedError

    def result(self, ref: JobRef) -> Any:
        """What the unit's ``fn`` returned; raises if it failed."""
        raise NotImplementedError

    def cancel(self, refs: Sequence[JobRef]) -> None:
        raise NotImplementedError

    def cancel_command(self, refs: Sequence[JobRef]) -> str:
        """The command a user types to cancel these units."""
        return ""

    def describe(self, refs: Sequence[JobRef]) -> str:
        """The units' ids, short, for a message."""
        return ", ".join(r.job_id for r in refs)


# --------------------------------------------------------------------------
# Backends
# --------------------------------------------------------------------------
def names() -> list[str]:
    """Every backend of this package (its module names), the default first."""
    found = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return sorted(found, key=lambda n: n != DEFAULT)


def backend(name: str) -> type[Executor]:
    if name not in names():
        raise ExecutorError(f"--executor {name!r}: choose one of {', '.join(names())}")
    cls = importlib.import_module(f"{__name__}.{name}").BACKEND
    assert issubclass(cls, Executor) and cls.NAME == name, f"{__name__}.{name}.BACKEND"
    return cls


def for_ref(ref: JobRef) -> Executor:
    """The executor that follows an earlier submission's unit (its flags at their defaults)."""
    return backend(ref.executor)()


# --------------------------------------------------------------------------
# Flags
# --------------------------------------------------------------------------
def add_args(parser: argparse.ArgumentParser, *, multi_place: bool = False) -> None:
    """--executor, the flags of executors whose units run elsewhere, and each backend's own flags."""
    backends = [backend(n) for n in names()]
    g = parser.add_argument_group("where the work runs")
    g.add_argument("--executor", choices=[b.NAME for b in backends], default=DEFAULT,
                   help="; ".join(f"{b.NAME}: {b.HELP}" for b in backends))
    takers = ", ".join(b.NAME for b in backends if b.TAKES_JOB_FLAGS)
    g = parser.add_argument_group(f"jobs (--executor {takers})")
    g.add_argument("--gpus-per-job", type=int, metavar="N",
                   help="GPUs each job asks for (default: what the work needs; 0 for CPU-only partitions)")
    g.add_argument("--jobs", type=int, metavar="N", help="how many jobs to split the work over / run at once")
    g.add_argument("--detach", action="store_true", help="submit, print the job ids and return (collect later)")
    g.add_argument("--cancel-on-interrupt", action="store_true",
                   help="Ctrl-C while waiting cancels the jobs (default: they go on; collect later)")
    for b in backends:
        b.add_args(parser, multi_place=multi_place)


def _job_flags_used(args, collecting: bool) -> list[str]:
    return [flag for flag, on in (("--gpus-per-job", args.gpus_per_job is not None), ("--jobs", args.jobs is not None),
                                  ("--detach", args.detach),
                                  ("--cancel-on-interrupt", args.cancel_on_interrupt and not collecting)) if on]


def from_args(args, *, multi_place: bool = False, collecting: bool = False) -> Executor:
    """The executor the command line chose, its flags checked (ExecutorError names a bad one).

    ``collecting``: the command only collects units submitted earlier (``--collect``): the flags
    that shape a submission are refused, ``--cancel-on-interrupt`` is allowed."""
    name = getattr(args, "executor", DEFAULT) or DEFAULT
    chosen = backend(name)
    backends = [backend(n) for n in names()]
    own = {b.NAME: b.flags_used(args) for b in backends}
    job_flags = _job_flags_used(args, collecting)
    used = [f for b in backends if b.NAME != name for f in own[b.NAME]]
    if collecting and (used or job_flags or own[name] or name != DEFAULT):
        raise ExecutorError(f"--collect submits nothing: leave out "
                            f"{', '.join((job_flags + own[name] + used) or [f'--executor {name}'])}")
    if job_flags and not chosen.TAKES_JOB_FLAGS:
        takers = [b.NAME for b in backends if b.TAKES_JOB_FLAGS]
        raise ExecutorError(f"{', '.join(job_flags)}: only with --executor {' or '.join(takers)}")
    for b in backends:
        if b.NAME != name and own[b.NAME]:
            raise ExecutorError(f"{', '.join(own[b.NAME])}: only with --executor {b.NAME}")
    if args.gpus_per_job is not None and args.gpus_per_job < 0:
        raise ExecutorError(f"--gpus-per-job {args.gpus_per_job}: must be 0 or more")
    if args.jobs is not None and args.jobs < 1:
        raise ExecutorError(f"--jobs {args.jobs}: must be 1 or more")
    ex = chosen(args)
    ex.check(multi_place=multi_place)
    return ex
