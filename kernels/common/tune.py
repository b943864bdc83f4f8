"""Timing a family's candidates on one problem, within a time budget (tune-on-miss and
``workbench tune``).

``tune`` runs the cold rule's candidate first (it is the reference), then the others in the
order given (the family lists its likeliest first), each once to compile and to check that
its result agrees with the cold candidate's within the dtype's tolerance, then times it
(``workbench.bench.measure``: CUDA events, L2 flushed before each run, the median). It starts
no candidate once the budget is spent (a compile already under way finishes), so a new
problem costs about the budget. The fastest is kept only if it beats the cold candidate by
more than the noise: ``margin`` or the two timings' relative spreads together, whichever is
larger; otherwise the cold candidate stays (no table entry churns on noise).
"""
from __future__ import annotations

import dataclasses
import math
import os
import time
from typing import Any, Callable, Mapping, Sequence

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


def tune(candidates: Sequence[Candidate], cold: Candidate, make: Callable[[Candidate], Callable[[], Any]], *,
         agree: Callable[[Any, Any], bool] | None = None, budget: float | None = None,
         margin: float = DEFAULT_MARGIN, timer: Timer | None = None,
         progress: Callable[[str], None] | None = None, count_first_runs: bool = True) -> Result:
    """Time ``candidates`` (the cold one first) and pick one; see the module docstring.

    ``make(candidate)`` returns a callable that runs it once and returns its output (it may
    raise ValueError/RuntimeError: that candidate is skipped). ``agree(cold_out, out)``: whether
    an output matches the cold candidate's within tolerance (a disagreeing candidate is never
    kept). ``timer(fn, rep_ms)`` -> (median us, relative spread, how) replaces the GPU timer
    (tests use a fake). ``count_first_runs=False`` (``workbench tune``): each candidate's first
    run, which compiles it, is not counted against the budget (a first call of a user's
    program that tunes counts everything)."""
    budget = budget_s(budget)
    timer = timer or gpu_timer
    order = [cold] + [c for c in candidates if c.name != cold.name]
    start = time.monotonic()
    deadline = start + budget
    # Each candidate gets an equal share of the budget for its timed runs (compiles come on top).
    rep_ms = max(2.0, 1e3 * budget / (2 * len(order)))
    times: dict[str, float] = {}
    spreads: dict[str, float] = {}
    failed: dict[str, str] = {}
    how = ""
    reference = None
    for i, cand in enumerate(order):
        if i > 0 and time.monotonic() >= deadline:
            break
        try:
            fn = make(cand)
            t_first = time.monotonic()
            out = fn()
            if not count_first_runs:
                deadline += time.monotonic() - t_first
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
        times[cand.name], spreads[cand.name] = us, spread
        if progress is not None:
            progress(f"{cand.name}: {us:.1f} us")
    best = min(times, key=times.get)
    cold_us = times[cold.name]
    need = max(margin, spreads.get(best, 0.0) + spreads.get(cold.name, 0.0))
    kept = best != cold.name and times[best] < cold_us * (1.0 - need)
    chosen = next(c for c in order if c.name == best) if kept else cold
    return Result(chosen, kept, times, spreads, failed, len(order), time.monotonic() - start, how)
