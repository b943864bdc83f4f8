"""Timing a family's candidates on one problem, within a time budget (tune-on-miss and
``workbench tune``).

``tune`` runs the cold rule's candidate first (it is the reference), then the others in the
order given (the family lists its likeliest first), each once to compile and to check that
its result agrees with the cold candidate's within the dtype's tolerance, then times it
(``workbench.bench.measure``: CUDA events, L2 flushed before each run, the median). The
fastest is kept only if it beats the cold candidate by more than the noise: ``margin`` or the
two timings' relative spreads together, whichever is larger; otherwise the cold candidate
stays (no table entry churns on noise).

The budget. A user's first call that tunes (tune-on-miss) counts everything against it,
compiles included: Triton compiles a kernel in about a second, several times what timing it
costs, so a tuner that only stopped *starting* candidates once the budget was spent overran it
by a compile or two. Given ``compiles`` (a ``Compiles``: what compiling each candidate is
expected to cost), ``tune`` starts a candidate only when its expected compile plus a timing
fits in what is left of the budget, and takes the candidates whose kernels are compiled
already (or cheapest to compile) first; it measures each compile as it goes, and the estimate
of that kind of kernel follows the measurements. The cold candidate always runs (the call needs
its result, and would compile it without tuning too). ``workbench tune`` (``count_first_runs=False``)
does not count first runs: it times every candidate the budget's timing share allows.
Without ``compiles`` a candidate is started while the budget lasts (what families that do
not estimate compiles get).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable, Hashable, Mapping, Sequence

from kernels.common.select import Candidate

DEFAULT_BUDGET_S = 2.0
DEFAULT_MARGIN = 0.03
BUDGET_ENV = "WORKBENCH_TUNE_BUDGET_S"
MAX_REPS = 100   # timed runs per candidate at most (a median of 100 is steady to well under 1%)


@dataclasses.dataclass(frozen=True)
class Result:
    candidate: Candidate               # the one to run: the winner, or the cold candidate
    kept: bool                         # True: a candidate beat the cold one beyond the noise
    times_us: Mapping[str, float]      # median time of every candidate timed
    spreads: Mapping[str, float]       # their interquartile range over the median
    failed: Mapping[str, str]          # candidates that could not run or disagreed, and why
    considered: int                    # candidates offered
    elapsed_s: float
    how: str                           # how the times were taken
    first_run_s: Mapping[str, float] = dataclasses.field(default_factory=dict)   # each one's first run (its compile)
    skipped: Mapping[str, str] = dataclasses.field(default_factory=dict)   # not started: the budget, and why


class CompileCosts:
    """What compiling costs in this process, per kind of kernel (a family's own words: "tma",
    "gluon", ...): a starting guess per kind until a compile of that kind has been measured,
    then the longest measured; and which kernels are compiled already (keys the family
    chooses), which cost nothing more. A first run shorter than ``cache_hit_s`` is a kernel
    loaded from Triton's cache, not a compile: it marks the kernel compiled and leaves the
    kind's estimate as it was. ``first_extra_s``: what the process's first compile costs on
    top (the compiler's tools read from disk and started for the first time), added until a
    compile has been measured; a first run of a kind guessed to compile nothing (a library
    call: its first run sets up the library, 0.12 s for cuBLAS on an H200) is not one."""

    def __init__(self, guesses_s: Mapping[str, float], default_s: float, cache_hit_s: float = 0.1,
                 first_extra_s: float = 0.0):
        self.guesses_s = dict(guesses_s)
        self.default_s = float(default_s)
        self.cache_hit_s = float(cache_hit_s)
        self.first_extra_s = float(first_extra_s)
        self.measured_s: dict[str, float] = {}
        self.compiled: set[Hashable] = set()

    def _guess(self, kind: str) -> float:
        return self.guesses_s.get(kind, self.default_s)

    def estimate(self, kind: str, key: Hashable) -> float:
        if key in self.compiled:
            return 0.0
        compiled_once = any(self._guess(k) > 0 for k in self.measured_s)
        first = self.first_extra_s if self._guess(kind) > 0 and not compiled_once else 0.0
        return first + self.measured_s.get(kind, self._guess(kind))

    def observe(self, kind: str, key: Hashable, seconds: float) -> None:
        self.compiled.add(key)
        if seconds >= self.cache_hit_s:
            self.measured_s[kind] = max(seconds, self.measured_s.get(kind, 0.0))


@dataclasses.dataclass(frozen=True)
class Compiles:
    """A family's view of compile costs for one problem: ``kind(candidate)`` names the kind of
    kernel it compiles, ``key(candidate)`` the compiled kernel itself (what Triton would cache
    it under, as near as the family can say without compiling)."""

    costs: CompileCosts
    kind: Callable[[Candidate], str]
    key: Callable[[Candidate], Hashable]

    def estimate(self, cand: Candidate) -> float:
        return self.costs.estimate(self.kind(cand), self.key(cand))

    def observe(self, cand: Candidate, seconds: float) -> None:
        self.costs.observe(self.kind(cand), self.key(cand), seconds)


def budget_s(budget: float | None = None) -> float:
    """The tuning budget per new problem in seconds: ``budget``, else ``WORKBENCH_TUNE_BUDGET_S``,
    else DEFAULT_BUDGET_S. A bad environment value is a ValueError that says what to set."""
    if budget is None:
        text = os.environ.get(BUDGET_ENV, "").strip()
        if not text:
            return DEFAULT_BUDGET_S
        try:
            budget = float(text)
        except ValueError:
            raise ValueError(f"{BUDGET_ENV}={text!r}: set it to a number of seconds, e.g. 2") from None
    if not (isinstance(budget, (int, float)) and math.isfinite(budget) and budget > 0):
        raise ValueError(f"tuning budget {budget!r}: must be a positive number of seconds")
    return float(budget)


Timer = Callable[[Callable[[], Any], float], tuple[float, float, str]]


def gpu_timer(fn: Callable[[], Any], rep_ms: float) -> tuple[float, float, str]:
    """(median us, relative spread, how) of ``fn`` on the current device: CUDA events, L2
    flushed before each run (host timer, not a performance number, without a GPU)."""
    from workbench import bench

    # At most MAX_REPS runs: each run is preceded by an L2 flush (tens of microseconds), which
    # rep_ms does not count, so a short kernel would otherwise spend the budget many times over.
    t = bench.measure(fn, warmup_ms=min(10.0, rep_ms / 4), rep_ms=rep_ms, flush_l2=True, min_reps=5,
                      max_reps=MAX_REPS)
    how = f"{t.method}, {'L2 flushed, ' if t.l2_flushed else ''}median of {t.n}"
    return t.median_ms * 1e3, (t.rel_spread if math.isfinite(t.rel_spread) else 0.0), how


def _order(candidates: Sequence[Candidate], cold: Candidate, compiles: Compiles | None) -> list[Candidate]:
    """The cold candidate, then the others: as given, or (with ``compiles``) compiled ones first
    and the rest cheapest compile first, the family's order kept among equals."""
    rest = [c for c in candidates if c.name != cold.name]
    if compiles is not None:
        rest = sorted(rest, key=compiles.estimate)   # stable: the family's order among equals
    return [cold] + rest


def tune(candidates: Sequence[Candidate], cold: Candidate, make: Callable[[Candidate], Callable[[], Any]], *,
         agree: Callable[[Any, Any], bool] | None = None, budget: float | None = None,
         margin: float = DEFAULT_MARGIN, timer: Timer | None = None,
         progress: Callable[[str], None] | None = None, count_first_runs: bool = True,
         compiles: Compiles | None = None) -> Result:
    """Time ``candidates`` (the cold one first) and pick one; see the module docstring.

    ``make(candidate)`` returns a callable that runs it once and returns its output (it may
    raise ValueError/RuntimeError: that candidate is skipped). ``agree(cold_out, out)``: whether
    an output matches the cold candidate's within tolerance (a disagreeing candidate is never
    kept). ``timer(fn, rep_ms)`` -> (median us, relative spread, how) replaces the GPU timer
    (tests use a fake). ``count_first_runs=False`` (``workbench tune``): each candidate's first
    run, which compiles it, is not counted against the budget (a first call of a user's
    program that tunes counts everything). ``compiles``: expected compile costs, so that the
    budget holds with compiles counted (see the module docstring)."""
    budget = budget_s(budget)
    timer = timer or gpu_timer
    order = _order(candidates, cold, compiles if count_first_runs else None)
    start = time.monotonic()
    deadline = start + budget
    # Each candidate gets an equal share of the budget for its timed runs (compiles come on top).
    rep_ms = max(2.0, 1e3 * budget / (2 * len(order)))
    times: dict[str, float] = {}
    spreads: dict[str, float] = {}
    failed: dict[str, str] = {}
    first_runs: dict[str, float] = {}
    skipped: dict[str, str] = {}
    rest_s = 0.0   # the most a candidate has cost besides its first run (building, checking, timing)
    how = ""
    reference = None
    for i, cand in enumerate(order):
        now = time.monotonic()
        if i > 0:
            if compiles is not None and count_first_runs:
                need = compiles.estimate(cand) + rest_s
                if now + need > deadline:
                    skipped[cand.name] = (f"{need:.2f} s expected (compile {need - rest_s:.2f} s), "
                                          f"{max(0.0, deadline - now):.2f} s of the budget left")
                    continue
            elif now >= deadline:
                skipped.update({c.name: "budget spent" for c in order[i:]})
                break
        t_first = 0.0
        try:
            fn = make(cand)
            t0 = time.monotonic()
            out = fn()
            t_first = time.monotonic() - t0
            first_runs[cand.name] = t_first
            if compiles is not None:
                compiles.observe(cand, t_first)
            if not count_first_runs:
                deadline += t_first
            if i == 0:
                reference = out
            elif agree is not None and not agree(reference, out):
                failed[cand.name] = "result differs from the cold candidate's beyond tolerance"
                continue
            us, spread, how = timer(fn, rep_ms)
        except Exception as exc:   # a config this problem cannot take (refused, failed to compile, out of resources)
            if i == 0:
                raise
            failed[cand.name] = f"{type(exc).__name__}: {exc}"[:300]
            continue
        finally:
            rest_s = max(rest_s, time.monotonic() - now - t_first)
        times[cand.name], spreads[cand.name] = us, spread
        if progress is not None:
            progress(f"{cand.name}: {us:.1f} us")
    best = min(times, key=times.get)
    cold_us = times[cold.name]
    need = max(margin, spreads.get(best, 0.0) + spreads.get(cold.name, 0.0))
    kept = best != cold.name and times[best] < cold_us * (1.0 - need)
    chosen = next(c for c in order if c.name == best) if kept else cold
    return Result(chosen, kept, times, spreads, failed, len(order), time.monotonic() - start, how,
                  first_runs, skipped)
