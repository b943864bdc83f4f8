"""Which configuration runs: one selection layer for every kernel family.

A family offers *candidates* for a problem: named (variant, config) pairs, where the variant
names the kernel that runs (its own plan builder) and the config carries that variant's
knobs only. When a launcher makes a plan for a call signature it asks ``choose``, which takes,
in this order:

1. an entry of the per-device tuning tables (``kernels.common.tables``): the user's own
   (``$WORKBENCH_TUNING_DIR``) over the ones shipped in the package;
2. tune-on-miss, when the caller asked (``tune=True``, or ``WORKBENCH_TUNE=1``) and no CUDA
   graph is being captured: the candidates are timed on the caller's device within a time
   budget (``kernels.common.tune``) and the winner is written to the user's table;
3. the family's cold-start rule.

The plan cache above it (``kernels.common.plans``) keeps the outcome, so a repeated call
never selects again. An entry that names a config the family refuses (hand-edited, or made by
other code) is said once and the cold rule serves. The multi-GPU families make their variant
choice on rank 0 and share it with every rank (``kernels.comm.decide.shared_choice``).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import os
from typing import Any, Callable, Mapping, Protocol

from kernels.common import tables as _tables

TUNE_ENV = "WORKBENCH_TUNE"


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One way to run a problem: ``variant`` names the kernel (its plan builder), ``config``
    that variant's knobs; ``name`` is the candidate's name within its family."""

    name: str
    variant: str
    config: Any


@dataclasses.dataclass(frozen=True)
class Choice:
    """What ``choose`` decided and why: ``source`` is 'table', 'tuned' or 'cold'; ``where``
    says which table, or why the cold rule served."""

    candidate: Candidate
    source: str
    where: str = ""
    entry: Mapping[str, Any] | None = None


class Family(Protocol):
    """What a kernel family gives the selection layer (see ``kernels.gemm.select`` for one)."""

    name: str

    def from_entry(self, entry: Mapping[str, Any], problem: Mapping[str, Any]) -> Candidate:
        """The candidate a table entry names, checked against the problem (ValueError if it cannot run)."""

    def to_entry(self, candidate: Candidate) -> dict:
        """{'candidate', 'variant', 'config'}: a JSON-able description of a candidate."""


TABLES = _tables.Tables()


def problem_key(problem: Mapping[str, Any]) -> str:
    """The problem's key in a table: its fields as ``name=value`` in the family's order."""
    return ",".join(f"{k}={v}" for k, v in problem.items())


def tune_requested(tune: bool | None) -> bool:
    """``tune`` if given, else ``WORKBENCH_TUNE`` (1/true/yes/on)."""
    if tune is not None:
        return bool(tune)
    return os.environ.get(TUNE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def choose(family: Family, problem: Mapping[str, Any], device: Mapping[str, str], *,
           cold: Callable[[], Candidate], tune: bool = False, capturing: bool = False,
           tuner: Callable[[Candidate], "Any"] | None = None, tables: _tables.Tables | None = None) -> Choice:
    """The candidate to run ``problem`` with on ``device`` ({'name', 'capability'}).

    ``cold()`` gives the cold rule's candidate. ``tuner(cold_candidate)``, called only when
    ``tune`` is set, no graph is being captured and no table has the problem, times the
    family's candidates and returns a ``kernels.common.tune.Result`` (None: it could not
    run); its winner is saved to the user's table."""
    tables = tables or TABLES
    key = problem_key(problem)
    entry, where = tables.lookup(device, family.name, key)
    if entry is not None:
        try:
            return Choice(family.from_entry(entry, problem), "table", where, entry)
        except (ValueError, TypeError, KeyError) as exc:
            _tables.warn_once(where, f"entry {key}", f"{where}: the entry for {family.name} {key} names a "
                                                     f"config that cannot run here ({exc}); the cold rule serves "
                                                     f"instead (delete the entry, or re-run `workbench tune`)")
    start = cold()
    if not tune:
        return Choice(start, "cold", "no table entry")
    if capturing:
        return Choice(start, "cold", "a CUDA graph is being captured: no tuning")
    if tuner is None:
        return Choice(start, "cold", "no timer for this call")
    result = tuner(start)
    if result is None:
        return Choice(start, "cold", "tuning could not run")
    entry = record(family, result, start)
    saved = tables.save(device, family.name, key, entry)
    winner = result.candidate
    return Choice(winner, "tuned", f"tuned now, saved to {saved}" if saved else "tuned now (not saved)", entry)


def record(family: Family, result, cold: Candidate, by: str = "tune-on-miss") -> dict:
    """A table entry for a tuning result, with how and when it was measured."""
    from workbench import provenance

    versions = provenance.versions()
    entry = family.to_entry(result.candidate)
    entry.update({
        "us": round(result.times_us[result.candidate.name], 3),
        "cold": cold.name, "cold_us": round(result.times_us.get(cold.name, float("nan")), 3),
        "timed": len(result.times_us), "of": result.considered, "kept": result.kept,
        "skipped": len(result.skipped), "first_runs_s": round(sum(result.first_run_s.values()), 3),
        "how": result.how, "elapsed_s": round(result.elapsed_s, 3),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "git": provenance.git_info()["git_sha"], "torch": versions.get("torch_version"), "by": by,
    })
    return entry


def device_of(index: int | None) -> dict[str, str]:
    """{'name', 'capability'} of a CUDA device, or the interpreter's (index None)."""
    if index is None:
        return {"name": "Triton interpreter", "capability": "cpu"}
    from kernels.common.plans import capability, device_name

    major, minor = capability(index)
    return {"name": device_name(index), "capability": f"{major}.{minor}"}
