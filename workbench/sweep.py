"""Declared parameter sweeps: experiment YAML -> points -> rows (parquet).

    workbench sweep experiments/gemm_tiling.yaml [--quick] [--results DIR]
    workbench sweep experiments/all_gather.yaml       # worlds of 2 and 4 GPUs (torchrun)

or from Python::

    from workbench import sweep
    df = sweep.run_spec("experiments/gemm_tiling.yaml", quick=True)

The spec format is ``workbench.spec``'s (its docstring); this module runs it.

Kernel-module protocol
----------------------
Required (module level)::

    make_inputs(shape: dict, dtype: torch.dtype, device: str, seed: int) -> inputs
    run(inputs, **params) -> output tensor          # the kernel under study
    reference(inputs) -> tensor                     # higher precision truth
    flops(shape) -> int
    bytes_moved(shape, dtype) -> int                # fewest bytes: inputs once, outputs once
    tolerance(dtype) -> float                       # max ||out - ref|| / ||ref||
    baselines: dict[str, Callable[[inputs], tensor]]

Optional::

    PARAMS: dict[str, default]        # parameter names a grid may use (validated)
    poison(inputs)                    # fill outputs with NaN before the checked run
    check(out, ref, dtype) -> (ok, rel_err, message)   # replaces the norm check
    derived(shape, dtype, params) -> dict             # extra names for constraints
    label(params) -> str              # short configuration label for plots
    WORLD_SIZES: tuple[int, ...]      # world sizes above 1 the module supports (required for them)
    recover(inputs)                   # after a point failed: bring shared state back (e.g. zero
                                      # device flags); in a world every rank calls it, together

Every point runs once on poisoned outputs and is checked against
``reference`` before it is timed; baselines are checked the same way.

Worlds
------
Points of world size 1 run in this process. For each larger world size the
points still to run go to one torchrun world of that size
(``workbench.dist.launch`` of ``python -m workbench.sweep_rank``; one launch
per world size, smallest first), NCCL on GPUs, gloo on a machine without
CUDA (where each rank runs the module's CPU path). Every rank runs the same
points in the same order through the same per-point code as the single
process (make inputs once per shape, poison, run once and check, time) and
the ranks agree after each step over a gloo group of their own, so a step
that fails on one rank fails the point everywhere (``error`` names the rank:
``rank 1: RuntimeError: ...``) and the world goes on with the next point.
Inside a rank the module sees ``torch.distributed`` initialized and makes
its own rank's inputs (e.g. from a symmetric heap); ``reference`` and
``check`` are this rank's view. A point is timed with
``dist.time_collective``: every rank makes the same number of calls (from
the spec's ``bench`` budgets and the slowest rank's estimate; no L2 flush,
``cuda_graph`` replays graphs of several calls) and the row holds the
slowest rank's median (``slowest_rank``, ``ms_per_rank``, ``loop_ms``).
Rank 0 emits one row per (point, variant, repeat); rows reach
``rows.parquet`` as they come, with provenance for that world size.

A world needs one GPU per rank: on a machine with fewer, its points are
recorded as ``skipped`` (with the reason). A rank that dies, or stays in one
step longer than ``point_timeout_s`` (or a world that outlives
``launch_timeout_s``), ends that world: the point it was on is recorded as
``crashed`` / ``timeout`` with the launch error naming the rank, the world's
other points as ``not_run``, and the sweep goes on with the next world size.
A module whose rank raises while its peers wait for it in a collective makes
them wait until ``point_timeout_s``: use bounded waits, as
``kernels.comm.sweep`` does.

Rows
----
One row per (point, variant, repeat): shape columns (``M``, ``N``, ``K``...),
``dtype``, ``world_size``, ``params`` (JSON) and ``p_<name>`` columns, ``config``
label, ``status`` (ok, wrong_result, compile_error, out_of_resources,
out_of_memory, invalid_config, runtime_error, cuda_error, crashed, timeout,
skipped, not_run), ``error``, ``rel_err``, timing (``median_ms``, ``q25_ms``,
``q75_ms``, ``n_runs``, ``is_performance``, ``timing_method``), metrics
(``tflops``, ``gbps``, ``frac_of_peak``) and provenance (git sha and dirty
flag, versions, device, world size, knobs, timestamp, hostname).

Rows are appended to ``results/<name>/rows.parquet`` every few points, so an
interrupted sweep loses little; a re-run skips every (point, variant, repeat)
already recorded on the same kind of device (``device_name``), except
``skipped`` and ``not_run`` rows, which it runs again (and replaces). A
point that kills the process (a sticky CUDA error) is marked in
``inflight.json`` first, recorded as ``crashed`` on the next run and
skipped; so is the point a world died or hung on.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from .spec import (  # noqa: F401  (load_spec, parse_spec, expand, Spec, SpecError: this module's public names too)
    DTYPE_NAMES, REPO_ROOT, Point, Spec, SpecError, _clip, _import_kernel, _torch_dtype, expand, load_spec,
    parse_spec,
)

__all__ = ["SpecError", "Spec", "Point", "load_spec", "parse_spec", "expand", "run_spec", "load_rows",
           "best_per_shape", "configure", "run", "DTYPE_NAMES"]


# --------------------------------------------------------------------------
# Running
# --------------------------------------------------------------------------
def _classify(exc: BaseException) -> str:
    names = {c.__name__ for c in type(exc).__mro__}
    mod = type(exc).__module__ or ""
    if "OutOfResources" in names:
        return "out_of_resources"
    if "OutOfMemoryError" in names:
        return "out_of_memory"
    if "CompilationError" in names or "CompileTimeAssertionFailure" in names or (
            mod.startswith("triton.compiler") and "Error" in type(exc).__name__):
        return "compile_error"
    text = str(exc)
    if "PassManager::run failed" in text or "ptxas" in text.lower():
        return "compile_error"
    if "CUDA error" in text or "cudaError" in text or "CUDA driver error" in text or "AcceleratorError" in names:
        return "cuda_error"
    if isinstance(exc, ValueError):
        return "invalid_config"
    return "runtime_error"


def _error_text(exc: BaseException, limit: int = 2000) -> str:
    return _clip(f"{type(exc).__name__}: {exc}".strip(), limit)


def _default_check(out, ref, tol):
    import torch

    o = out.float()
    r = ref.float()
    bad = (~torch.isfinite(o)).sum().item()
    if bad:
        return False, math.nan, f"{bad} of {o.numel()} outputs are not finite (unwritten outputs are poisoned with NaN)"
    denom = torch.linalg.vector_norm(r).item()
    err = torch.linalg.vector_norm(o - r).item() / (denom if denom > 0 else 1.0)
    if err > tol:
        return False, err, f"relative error {err:.3e} > tolerance {tol:.1e}"
    return True, err, ""


def _context_alive() -> bool:
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception:
        return False
    return True


RETRY_STATUSES = ("skipped", "not_run")  # recorded, but a resumed run tries these points again


def _row_keys(df) -> list[tuple]:
    dev = df["device_name"] if "device_name" in df else [None] * len(df)
    return list(zip(df["point_id"], df["variant"], df["repeat"].astype(int), dev))


class _RowStore:
    """rows.parquet under the results folder, rewritten atomically on each flush.

    Rows whose status is in ``RETRY_STATUSES`` do not count as done, and are
    replaced when the same (point, variant, repeat) is recorded again on the
    same kind of device."""

    def __init__(self, folder: Path):
        import pandas as pd

        self.folder = folder
        self.path = folder / "rows.parquet"
        self.pending: list[dict] = []
        self.existing = pd.read_parquet(self.path) if self.path.exists() else None

    def done_keys(self, device_name: str | None = None) -> set:
        """(point_id, variant, repeat) already recorded (on ``device_name``, if given)."""
        df = self.existing
        if df is None or df.empty:
            return set()
        if device_name is not None and "device_name" in df:
            df = df[df["device_name"] == device_name]
        if "status" in df:
            df = df[~df["status"].isin(RETRY_STATUSES)]
        return set(zip(df["point_id"], df["variant"], df["repeat"].astype(int)))

    def add(self, row: dict) -> None:
        self.pending.append(row)

    def flush(self) -> None:
        import pandas as pd

        if not self.pending:
            return
        new = pd.DataFrame(self.pending)
        old = self.existing
        if old is not None and not old.empty and "status" in old and old["status"].isin(RETRY_STATUSES).any():
            fresh = set(_row_keys(new))
            replaced = old["status"].isin(RETRY_STATUSES) & pd.Series([k in fresh for k in _row_keys(old)],
                                                                      index=old.index)
            old = old[~replaced]
        frames = [f for f in (old, new) if f is not None and not f.empty]
        df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        df = _normalize_frame(df)
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".parquet.tmp")
        df.to_parquet(tmp, index=False)
        os.replace(tmp, self.path)
        self.existing = df
        self.pending = []

    def frame(self):
        import pandas as pd

        self.flush()
        return self.existing if self.existing is not None else pd.DataFrame()


def _normalize_frame(df):
    # Mixed-type object columns (e.g. a parameter that is None or an int) must be one type for parquet.
    for col in df.columns:
        if df[col].dtype == object:
            kinds = {type(v) for v in df[col] if v is not None and not (isinstance(v, float) and math.isnan(v))}
            if len(kinds) > 1 and not kinds <= {int, float}:
                df[col] = df[col].map(lambda v: None if v is None or (isinstance(v, float) and math.isnan(v))
                                      else str(v))
    return df


def default_results_dir(spec: Spec) -> Path:
    root = spec.path.resolve().parent.parent if spec.path else REPO_ROOT
    if not (root / "results").exists() and (REPO_ROOT / "results").exists():
        root = REPO_ROOT
    return root / "results" / spec.name


def _peak(ceil: Mapping | None, dtype: str):
    if not ceil:
        return None, None
    key = {"bfloat16": "bf16_tflops", "float16": "fp16_tflops"}.get(dtype)
    return (ceil.get(key) if key else None), ceil.get("copy_gbps")


# --------------------------------------------------------------------------
# One point, in this process or in every rank of a world
# --------------------------------------------------------------------------
@dataclasses.dataclass
class _Job:
    """What a process needs to turn points into rows; a rank gets it as JSON (`to_plan`)."""

    sweep: str
    kernel: str
    variant: str
    seed: int
    bench: dict
    param_names: list
    meta: dict  # sweep, kernel, run_id: the first columns of every row
    device: str  # "cuda" or "cpu"
    ceilings: dict | None
    module: Any = dataclasses.field(default=None, repr=False)

    def to_plan(self) -> dict:
        plan = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "module"}
        plan["ceilings"] = {k: v for k, v in (self.ceilings or {}).items()
                            if isinstance(v, (int, float)) and not isinstance(v, bool)} or None
        return plan

    @classmethod
    def from_plan(cls, plan: Mapping, module) -> "_Job":
        names = {f.name for f in dataclasses.fields(cls)} - {"module"}
        return cls(**{k: plan[k] for k in names}, module=module)


def _point_to_json(p: Point) -> dict:
    return {"study": p.study, "shape": [list(kv) for kv in p.shape], "dtype": p.dtype,
            "params": [list(kv) for kv in p.params], "world_size": p.world_size, "baseline": p.baseline}


def _point_from_json(d: Mapping) -> Point:
    return Point(d["study"], tuple(tuple(kv) for kv in d["shape"]), d["dtype"], tuple(tuple(kv) for kv in d["params"]),
                 int(d["world_size"]), d["baseline"])


def _base_row(job: _Job, p: Point, rep: int) -> dict:
    module = job.module
    shape = p.shape_dict
    params = p.params_dict
    label_fn = getattr(module, "label", None)
    row = {**job.meta, "study": p.study, "point_id": p.point_id(job.kernel),
           "variant": p.baseline or job.variant, "is_baseline": p.baseline is not None, "repeat": rep,
           **shape, "shape": json.dumps(shape), "dtype": p.dtype, "world_size": p.world_size,
           "params": json.dumps(params, sort_keys=True),
           "config": p.baseline if p.baseline else (label_fn(params) if callable(label_fn) else
                                                    json.dumps(params, sort_keys=True)),
           "flops": int(module.flops(shape)), "bytes": int(module.bytes_moved(shape, _torch_dtype(p.dtype)))}
    for k in job.param_names:
        row[f"p_{k}"] = params.get(k)
    return row


def _untimed(row: dict, status: str, error: str, device: str) -> dict:
    """``row`` for a point that produced no measurement."""
    row.update(status=status, error=error, rel_err=math.nan, median_ms=math.nan, tflops=math.nan, gbps=math.nan,
               frac_of_peak=math.nan, is_performance=device == "cuda",
               timestamp=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()))
    return row


class _Solo:
    """The ranks of a world of one: this process."""

    rank, world_size, group = 0, 1, None

    def stage(self, text: str) -> None:
        pass

    def gather(self, obj) -> list:
        return [obj]

    def log(self, text: str) -> None:
        pass


class _WorldComm:
    """This rank of a launched world: stages go to its heartbeat, agreements over a gloo group
    of their own (not the kernels' group, so they never pair with a kernel's collective, and
    they work even when a rank's CUDA context is gone)."""

    def __init__(self, worker, group):
        self.worker, self.group = worker, group
        self.rank, self.world_size = worker.rank, worker.world_size

    def stage(self, text: str) -> None:
        self.worker.stage(text)

    def gather(self, obj) -> list:
        import torch.distributed as tdist

        out = [None] * self.world_size
        tdist.all_gather_object(out, obj, group=self.group)
        return out

    def log(self, text: str) -> None:
        print(f"[sweep rank {self.rank}] {text}", file=sys.stderr, flush=True)


def _by_rank(fails: list[tuple[int, str]]) -> str:
    """'rank 1: E' or 'ranks 0, 2: E; rank 1: F' (identical errors grouped)."""
    groups: dict[str, list[int]] = {}
    for r, e in fails:
        groups.setdefault(e, []).append(r)
    return "; ".join(f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {e}" for e, rs in groups.items())


def _time_world(fn, bench_kw: Mapping, device: str, group):
    """Time a point in a world: every rank makes the same number of calls, and the slowest
    rank's median is the point's time (`workbench.dist.time_collective`)."""
    from . import bench, dist

    cuda = device == "cuda"
    est = dist.time_collective(fn, warmup=1, iters=3, group=group)["ms"]  # the same number on every rank
    min_reps = bench_kw.get("min_reps") or (5 if cuda else 1)
    n_warm, n_rep = bench._counts(est, bench_kw["warmup_ms"], bench_kw["rep_ms"], min_reps,
                                  bench_kw.get("max_reps", 10000))
    graph = max(1, min(100, math.ceil(1.0 / max(est, 1e-4)))) if (cuda and bench_kw.get("cuda_graph")) else 0
    t = dist.time_collective(fn, warmup=n_warm, iters=n_rep, group=group, graph=graph)
    method = ("collective-cuda-graph" if t["graph"] else "collective-cuda-events") if cuda else "collective-host-timer"
    if cuda:
        import torch

        name = torch.cuda.get_device_name()
    else:
        name = "cpu"
    timing = bench.Timing(median_ms=t["ms"], q25_ms=t["q25_ms"], q75_ms=t["q75_ms"], n=t["iters"],
                          is_performance=cuda, method=method, l2_flushed=False, calls_per_sample=max(1, t["graph"]),
                          device=name)
    extra = {"slowest_rank": t["slowest_rank"], "loop_ms": t["loop_ms"],
             "ms_per_rank": json.dumps([round(v, 6) for v in t["ms_per_rank"]])}
    return timing, extra


class _PointRunner:
    """Turns points into rows, one after another, in this process.

    The single-process sweep (a world of one) and every rank of a launched
    world run the same `run`: make the inputs (once per shape), poison the
    outputs, run once and check against the reference, then time. In a world
    every rank runs the same points in the same order, and after each step
    the ranks agree on how it went (`_step`), so a step that failed on one
    rank fails the point on all of them (the row names the rank) and the
    ranks stay in step for the next point.
    """

    def __init__(self, job: _Job, comm=None):
        self.job = job
        self.comm = comm or _Solo()
        self.inputs = self.ref = None
        self.key = None  # (dtype, shape, world size) the inputs were made for
        self.aborted: str | None = None
        self._dead = False

    def _sync(self) -> None:
        if self.job.device == "cuda":
            import torch

            torch.cuda.synchronize()

    def _step(self, where: str, name: str, body: Callable[[], tuple], *, share: bool = False):
        """``body() -> (status, error, value)`` here, then agreed by every rank.

        Returns the agreed (status, error) and the value: this rank's, or every
        rank's in a list when ``share``."""
        self.comm.stage(f"{where}: {name}")
        value = None
        try:
            status, error, value = body()
        except Exception as exc:  # failure isolation: record and go on
            status, error = _classify(exc), _error_text(exc)
            if self.job.device == "cuda" and not _context_alive():
                status, self._dead = "cuda_error", True
        if self.comm.world_size == 1:
            return status, error, ([value] if share else value)
        if status != "ok":
            self.comm.log(f"{where}: {name}: {status}: {error}")
        self.comm.stage(f"{where}: {name} done, waiting for the other ranks")
        views = self.comm.gather((status, error, value if share else None))
        fails = [(r, v[0], v[1]) for r, v in enumerate(views) if v[0] != "ok"]
        if share:
            value = [v[2] for v in views]
        if not fails:
            return "ok", "", value
        status = "cuda_error" if any(st == "cuda_error" for _, st, _ in fails) else fails[0][1]
        return status, _clip(_by_rank([(r, e) for r, _, e in fails])), value

    def _prepare(self, p: Point, key, dtype, poison):
        if key != self.key:
            self.inputs = self.ref = None
            self.key = None
            if self.job.device == "cuda":
                import torch

                torch.cuda.empty_cache()
            seed = self.job.seed + int(hashlib.sha1(json.dumps(p.shape).encode()).hexdigest()[:6], 16)
            self.inputs = self.job.module.make_inputs(p.shape_dict, dtype, self.job.device, seed)
            self.ref = self.job.module.reference(self.inputs)
            self.key = key
        if callable(poison):
            poison(self.inputs)
        if self.comm.world_size > 1:
            self._sync()  # poisoned here before any rank runs (the agreement that follows is the barrier)
        return "ok", "", None

    def _checked_run(self, fn, check, dtype, tol):
        out = fn()
        self._sync()
        if callable(check):
            ok, rel_err, msg = check(out, self.ref, dtype)
        else:
            ok, rel_err, msg = _default_check(out, self.ref, tol)
        return ("ok", "", float(rel_err)) if ok else ("wrong_result", msg, float(rel_err))

    def _time(self, fn):
        if self.comm.world_size == 1:
            from . import bench

            return "ok", "", (bench.measure(fn, **self.job.bench), {})
        return "ok", "", _time_world(fn, self.job.bench, self.job.device, self.comm.group)

    def _recover(self, where: str) -> None:
        """After a failed run or timing: the module's ``recover(inputs)`` (every rank together)."""
        recover = getattr(self.job.module, "recover", None)
        if not callable(recover) or self.key is None:
            return
        def body():
            recover(self.inputs)
            return "ok", "", None

        status, error, _ = self._step(where, "recover", body)
        if status != "ok":
            self.comm.log(f"{where}: recover failed ({error}); inputs are made again")
            self.key = None

    def run(self, p: Point, rep: int, where: str = "") -> dict:
        """The row of one (point, repeat); never raises for a failure of the kernel."""
        job, module = self.job, self.job.module
        row = _base_row(job, p, rep)
        dtype = _torch_dtype(p.dtype)
        tol = float(module.tolerance(dtype))
        row["tolerance"] = tol
        where = f"{where} ({row['config']}, {p.dtype} {row['shape']})".strip()
        if p.baseline:
            def fn():
                return module.baselines[p.baseline](self.inputs)
        else:
            params = p.params_dict

            def fn():
                return module.run(self.inputs, **params)

        timing, extra, rel_err = None, {}, math.nan
        status, error, _ = self._step(where, "inputs", lambda: self._prepare(
            p, (p.dtype, p.shape, p.world_size), dtype, getattr(module, "poison", None)))
        if status != "ok":
            self.key = None  # every rank makes its inputs again for the next point
        else:
            status, error, rels = self._step(where, "checked run", lambda: self._checked_run(
                fn, getattr(module, "check", None), dtype, tol), share=True)
            rels = [math.nan if r is None else r for r in rels]
            rel_err = math.nan if any(math.isnan(r) for r in rels) else max(rels)
            if status == "ok":
                status, error, got = self._step(where, "timing", lambda: self._time(fn))
                if status == "ok":
                    timing, extra = got
            if status != "ok" and not self._dead:
                self._recover(where)
        if self._dead and self.aborted is None:
            self.aborted = (f"the CUDA context is unusable after point {row['point_id']} ({row['config']}, "
                            f"shape {p.shape_dict}); rows are saved; re-run to resume (this point is skipped)")
        row.update(status=status, error=error, rel_err=rel_err)
        if timing is not None:
            row.update(timing.as_row())
            row.update(extra)
            row["tflops"] = timing.tflops(row["flops"])
            row["gbps"] = timing.gbps(row["bytes"])
            peak_t, peak_bw = _peak(job.ceilings, p.dtype)
            row["frac_of_peak"] = timing.fraction_of_ceiling(
                flops=row["flops"], nbytes=row["bytes"], peak_tflops=peak_t, peak_gbps=peak_bw) \
                if (peak_t or peak_bw) else math.nan
        else:
            row.update(median_ms=math.nan, tflops=math.nan, gbps=math.nan, frac_of_peak=math.nan,
                       is_performance=job.device == "cuda")
        row["timestamp"] = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime())
        return row


# --------------------------------------------------------------------------
# The sweep: points here, worlds through workbench.dist.launch
# --------------------------------------------------------------------------
class _Recorder:
    """Finished rows -> provenance, the store (flushed often), the progress bar, counts, on_row."""

    def __init__(self, store: _RowStore, bar, prov_for: Callable[[int], dict], flush_every: int, flush_s: float,
                 on_row: Callable[[dict], None] | None):
        self.store, self.bar, self.prov_for = store, bar, prov_for
        self.flush_every, self.flush_s, self.on_row = flush_every, flush_s, on_row
        self.counts: dict[str, int] = {}
        self.last_flush = time.monotonic()

    def add(self, row: dict) -> None:
        row.update({k: v for k, v in self.prov_for(int(row["world_size"])).items() if k != "timestamp"})
        row.setdefault("timestamp", time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()))
        self.store.add(row)
        self.counts[row["status"]] = self.counts.get(row["status"], 0) + 1
        self.bar.update(1)
        ms = row.get("median_ms")
        if isinstance(ms, (int, float)) and not math.isnan(ms):
            rate = f"{row['tflops']:.1f} TFLOP/s" if row.get("flops") else f"{row['gbps']:.1f} GB/s"
            ws = f"w{row['world_size']} " if int(row["world_size"]) > 1 else ""
            self.bar.set_postfix_str(f"{ws}{str(row['config'])[:28]} {rate}", refresh=False)
        if len(self.store.pending) >= self.flush_every or time.monotonic() - self.last_flush > self.flush_s:
            self.store.flush()
            self.last_flush = time.monotonic()
        if self.on_row is not None:
            self.on_row(row)


def _world_capacity(device: str) -> int | None:
    """How many ranks a world may have here: the GPUs on a GPU machine, any number on the CPU (gloo)."""
    if device != "cuda":
        return None
    import torch

    return torch.cuda.device_count()


def _module_root(module, kernel: str) -> str | None:
    """The sys.path entry ``kernel`` was imported from (ranks add it when it is not the repository)."""
    f = getattr(module, "__file__", None)
    if not f:
        return None
    root = Path(f).resolve().parent
    for _ in range(kernel.count(".") + (Path(f).name == "__init__.py")):
        root = root.parent
    return None if root == REPO_ROOT else str(root)


class _Tail:
    """Complete JSON lines appended to a file since the last read."""

    def __init__(self, path: Path):
        self.path, self.pos = path, 0

    def read(self) -> list[dict]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.pos)
                data = fh.read()
        except FileNotFoundError:
            return []
        end = data.rfind(b"\n") + 1
        self.pos += end
        rows = []
        for line in data[:end].decode(errors="replace").splitlines():
            if line.strip():
                with contextlib.suppress(ValueError):
                    rows.append(json.loads(line))
        return rows


_STAGE_POINT = re.compile(r"point (\d+)/\d+")


def _point_in_flight(err, pending: set[int]) -> int | None:
    """Index of the point the failed world was on: from the stages of the ranks it blames."""
    states = getattr(err, "states", None) or {}
    found = []
    for r in list(err.ranks) or list(states):
        m = _STAGE_POINT.match(str((states.get(r) or {}).get("stage") or ""))
        if m and int(m.group(1)) - 1 in pending:
            found.append(int(m.group(1)) - 1)
    return min(found) if found else None


def _launch_summary(err, limit: int = 1500) -> str:
    """A failed world's message for a row: its first line (who failed, how) and the blamed
    ranks' lines (stage, last output), not the other ranks' follow-on errors."""
    lines = str(err).splitlines()
    keep, mine = [f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__], False
    for line in lines[1:]:
        m = re.match(r"\s{2}rank (\d+)(?::| traceback)", line)
        if m:
            mine = int(m.group(1)) in err.ranks
        elif not line.startswith("      "):
            mine = line.lstrip().startswith("heartbeats, rows and the log")
        if mine:
            keep.append(line)
    text = "\n".join(keep)
    return text if len(text) <= limit else text[:limit] + " ..."


def _run_world(spec: Spec, job: _Job, W: int, tasks: list, rec: _Recorder, log, deadline_at: float | None) -> int:
    """The points of world size ``W`` in one torchrun world; returns how many were left unrun
    (stopped at the deadline, for a resumed run)."""
    capacity = _world_capacity(job.device)
    if capacity is not None and capacity < W:
        reason = (f"skipped: world size {W} needs {W} GPUs and this machine has {capacity}; run the sweep on a "
                  f"node with {W} or more (skipped rows are tried again by the next run)")
        log(f"sweep {spec.name}: world size {W}: {len(tasks)} rows skipped: this machine has {capacity} GPU(s)")
        for p, rep in tasks:
            rec.add(_untimed(_base_row(job, p, rep), "skipped", reason, job.device))
        return 0
    from . import dist

    backend = "nccl" if job.device == "cuda" else "gloo"
    run_dir = Path(tempfile.mkdtemp(prefix=f"sweep_{spec.name}_w{W}_"))
    plan = {**job.to_plan(), "backend": backend, "deadline_at": deadline_at,
            "sys_path": [r for r in [_module_root(job.module, job.kernel)] if r],
            "tasks": [[_point_to_json(p), rep] for p, rep in tasks]}
    plan_path = run_dir / "plan.json"
    plan_path.write_text(json.dumps(plan))
    index = {(p.point_id(job.kernel), p.baseline or job.variant, rep): i for i, (p, rep) in enumerate(tasks)}
    recorded: set[int] = set()
    tail = _Tail(run_dir / "rank0.jsonl")

    def collect(_run_dir=None):
        for row in tail.read():
            row.pop("rank", None)
            i = index.get((row.get("point_id"), row.get("variant"), int(row.get("repeat", -1))))
            if i is None or i in recorded:
                continue
            recorded.add(i)
            rec.add(row)

    from kernels.common.interpreter import active

    env = {"TRITON_INTERPRET": "1"} if active() else {}
    log(f"sweep {spec.name}: world size {W}: {len(tasks)} rows on {W} ranks (torchrun, {backend})")
    t0 = time.monotonic()
    err = None
    try:
        dist.launch("workbench.sweep_rank", W, [str(plan_path)], timeout_s=spec.launch_timeout_s, run_dir=run_dir,
                    backend=backend, env=env, stage_timeout_s=spec.point_timeout_s, on_poll=collect)
    except dist.LaunchError as exc:
        err = exc
    collect()
    pending = [i for i in range(len(tasks)) if i not in recorded]
    if err is None:
        log(f"sweep {spec.name}: world size {W}: {len(recorded)} rows in {time.monotonic() - t0:.0f} s")
        shutil.rmtree(run_dir, ignore_errors=True)
        return len(pending)
    # A rank died or hung: the point it was on is recorded as crashed / timeout (skipped on
    # resume, like a point that kills the single process), the rest of this world as not_run
    # (tried again on resume); the sweep goes on with the next world size.
    log(f"sweep {spec.name}: world size {W} failed after {len(recorded)} rows:\n{err}")
    culprit = _point_in_flight(err, set(pending))
    text = _launch_summary(err)
    status = "timeout" if isinstance(err, dist.LaunchTimeout) else "crashed"
    at = f" at point {culprit + 1} ({_base_row(job, *tasks[culprit])['config']})" if culprit is not None else ""
    for i in pending:
        p, rep = tasks[i]
        if i == culprit:
            rec.add(_untimed(_base_row(job, p, rep), status, text, job.device))
        else:
            rec.add(_untimed(_base_row(job, p, rep), "not_run",
                             f"not run: the world of {W} ranks stopped{at} ({status}); tried again on resume. "
                             + text.splitlines()[0], job.device))
    return 0


def _run_here(spec: Spec, job: _Job, tasks: list, rec: _Recorder, inflight: Path, t_start: float,
              deadline_s: float | None) -> tuple[int, str | None]:
    """The points of world size 1, in this process; returns (rows left at the deadline, abort message)."""
    runner = _PointRunner(job)
    for i, (p, rep) in enumerate(tasks):
        if deadline_s is not None and time.monotonic() - t_start > deadline_s:
            return len(tasks) - i, None
        inflight.write_text(json.dumps({"point_id": p.point_id(job.kernel), "variant": p.baseline or job.variant,
                                        "repeat": rep}))
        rec.add(runner.run(p, rep))
        inflight.unlink(missing_ok=True)
        if runner.aborted:
            return 0, runner.aborted
    return 0, None


def run_spec(spec: Spec | str | os.PathLike, *, quick: bool = False, results_dir: str | os.PathLike | None = None,
             resume: bool = True, progress: bool = True, limit: int | None = None, flush_every: int = 20,
             ceilings: Mapping | None = None, deadline_s: float | None = None, flush_s: float = 10.0,
             on_row: Callable[[dict], None] | None = None, log: Callable[[str], None] | None = None,
             only: set | None = None, run_id: str | None = None):
    """Run a sweep; return all rows of its results folder as a DataFrame.

    Points of world size 1 run in this process; those of each larger world
    size run in one torchrun world of that size (see the module docs).

    resume: skip (point, variant, repeat) triples already in rows.parquet.
    limit: run at most this many new rows (for a look before the full run).
    deadline_s: start no new row after this many seconds (the rest stays for a
        resumed run).
    flush_s / flush_every: rows reach the parquet file at least this often.
    on_row: called with each finished row (e.g. a watchdog's heartbeat).
    only: run only these (point_id, variant, repeat) keys (a cluster job's share).
    run_id: the rows' ``run_id`` (default: a fresh one; a cluster job is given its submission's).
    ceilings: measured ceilings (``workbench.roofline``) for ``frac_of_peak``;
        by default the cached ones for this device, if any.
    """
    from tqdm.auto import tqdm

    from . import bench, provenance

    if log is None:
        def log(s):
            tqdm.write(s, file=sys.stderr)
    if not isinstance(spec, Spec):
        spec = load_spec(spec, quick=quick)
    module = spec.module or _import_kernel(spec.kernel, spec.path)
    spec.module = module
    points = expand(spec)

    device = "cuda" if bench.gpu_timing_available() else "cpu"
    folder = Path(results_dir) if results_dir else default_results_dir(spec)
    folder.mkdir(parents=True, exist_ok=True)
    store = _RowStore(folder)
    knobs = {"sweep": spec.name, "quick": spec.quick}
    prov = provenance.flat(provenance.collect(world_size=1, knobs=knobs))
    provs = {1: prov}

    def prov_for(W: int) -> dict:
        if W not in provs:
            from . import dist

            os.environ.update(dist.MULTICAST_OFF)  # the ranks' environment: their knobs say so
            provs[W] = provenance.flat(provenance.collect(world_size=W, knobs={
                **knobs, "dist_backend": "nccl" if device == "cuda" else "gloo",
                "launch_timeout_s": spec.launch_timeout_s, "point_timeout_s": spec.point_timeout_s}))
        return provs[W]

    # Resume skips what this kind of device already measured (rows from another
    # device, e.g. committed H200 results on a laptop, are kept but not counted).
    done = store.done_keys(prov["device_name"]) if resume else set()
    if not resume and store.existing is not None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        os.replace(store.path, folder / f"rows.{stamp}.parquet.bak")
        store.existing = None
        log(f"sweep {spec.name}: previous rows moved to rows.{stamp}.parquet.bak")
    if ceilings is None and device == "cuda":
        try:
            from . import roofline

            ceilings = roofline.load_ceilings()
        except Exception:
            ceilings = None

    run_id = run_id or hashlib.sha1(f"{prov['timestamp']}{os.getpid()}".encode()).hexdigest()[:10]
    job = _Job(sweep=spec.name, kernel=spec.kernel, variant=spec.variant, seed=spec.seed,
               bench={"warmup_ms": 25, "rep_ms": 100, "flush_l2": True, "cuda_graph": False, **spec.bench},
               param_names=_all_param_names(spec, points),
               meta={"sweep": spec.name, "kernel": spec.kernel, "run_id": run_id}, device=device,
               ceilings=dict(ceilings) if ceilings else None, module=module)
    inflight = folder / "inflight.json"

    # A point that killed the previous process: record it and skip it.
    if inflight.exists():
        try:
            info = json.loads(inflight.read_text())
            key = (info["point_id"], info["variant"], int(info["repeat"]))
            if key not in done:
                match = next((p for p in points if p.point_id(spec.kernel) == key[0]
                              and (p.baseline or spec.variant) == key[1]), None)
                if match is not None:
                    row = _untimed(_base_row(job, match, key[2]), "crashed",
                                   "the process died while running this point (sticky CUDA error, kill or "
                                   "timeout); marked and skipped on resume", device)
                    row.update({k: v for k, v in prov_for(match.world_size).items() if k != "timestamp"})
                    store.add(row)
                    store.flush()
                    done.add(key)
                    log(f"sweep {spec.name}: point {key[0]} ({key[1]}) crashed the last run; recorded and skipped")
        except (ValueError, KeyError, OSError):
            pass
        inflight.unlink(missing_ok=True)

    tasks = [(p, r) for p in points for r in range(spec.repeats)
             if (p.point_id(spec.kernel), p.baseline or spec.variant, r) not in done
             and (only is None or (p.point_id(spec.kernel), p.baseline or spec.variant, r) in only)]
    skipped = (len(only) if only is not None else len(points) * spec.repeats) - len(tasks)
    # Group by (dtype, shape) so inputs and the reference are made once per shape.
    order = {}
    for p, _ in tasks:
        order.setdefault((p.dtype, p.shape, p.world_size), len(order))
    tasks.sort(key=lambda t: order[(t[0].dtype, t[0].shape, t[0].world_size)])
    if limit is not None:
        tasks = tasks[:limit]

    t_start = time.monotonic()
    stopped = 0
    aborted = None
    bar = tqdm(total=len(tasks), desc=f"sweep {spec.name}", unit="pt", file=sys.stderr, disable=not progress,
               dynamic_ncols=True, mininterval=0.5)
    rec = _Recorder(store, bar, prov_for, flush_every, flush_s, on_row)
    try:
        for W in sorted({p.world_size for p, _ in tasks}):
            mine = [t for t in tasks if t[0].world_size == W]
            if deadline_s is not None and time.monotonic() - t_start > deadline_s:
                stopped += len(mine)
                continue
            if W == 1:
                left, aborted = _run_here(spec, job, mine, rec, inflight, t_start, deadline_s)
                if device == "cuda" and not aborted:
                    import torch

                    torch.cuda.empty_cache()  # the worlds that follow use this GPU too
            else:
                deadline_at = None if deadline_s is None else time.time() + deadline_s - (time.monotonic() - t_start)
                left = _run_world(spec, job, W, mine, rec, log, deadline_at)
            stopped += left
            if aborted:
                break
    except BaseException:  # Ctrl-C, or a cluster job told to stop: keep every finished row
        store.flush()
        inflight.unlink(missing_ok=True)
        bar.close()
        raise
    bar.close()
    store.flush()
    df = store.frame()
    counts = rec.counts
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items(), key=lambda kv: -kv[1])) or "nothing new"
    log(f"sweep {spec.name}: {sum(counts.values())} rows run ({summary}); {skipped} already recorded; "
        f"{len(df)} rows in {store.path}" + ("" if device == "cuda" else " [CPU/interpreter: not performance]")
        + (f"; stopped at the deadline with {stopped} rows left (re-run to resume)" if stopped else ""))
    if aborted:
        raise SweepAborted(aborted)
    return df


class SweepAborted(RuntimeError):
    """The process can no longer run kernels (sticky CUDA error); rows are saved."""


def _all_param_names(spec: Spec, points: list[Point]) -> list[str]:
    names = dict.fromkeys(getattr(spec.module, "PARAMS", {}) or {})
    for p in points:
        for k, _ in p.params:
            names.setdefault(k)
    return list(names)


# --------------------------------------------------------------------------
# Reading results
# --------------------------------------------------------------------------
def load_rows(name_or_path: str | os.PathLike):
    """Rows of a sweep: a results folder, a parquet/CSV file, or a sweep name under results/."""
    import pandas as pd

    p = Path(name_or_path)
    if not p.exists():
        p = REPO_ROOT / "results" / str(name_or_path)
    if p.is_dir():
        files = sorted(p.glob("*.parquet"))
        if not files:
            raise FileNotFoundError(f"{p}: no parquet files (run `workbench sweep experiments/{p.name}.yaml`)")
        return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    if p.suffix == ".csv":
        return pd.read_csv(p)
    return pd.read_parquet(p)


def best_per_shape(df, *, shape_cols: Iterable[str] = ("M", "N", "K"), baseline: str | None = "cublas"):
    """The fastest ok kernel row per (shape, dtype), with the baseline's time and the ratio."""
    import pandas as pd

    cols = list(shape_cols) + ["dtype"]
    ok = df[(df["status"] == "ok") & (~df["is_baseline"].astype(bool))]
    if ok.empty:
        return pd.DataFrame()
    best = ok.loc[ok.groupby(cols)["median_ms"].idxmin()].copy()
    if baseline is not None:
        base = df[(df["variant"] == baseline) & (df["status"] == "ok")].groupby(cols)["median_ms"].median()
        best = best.join(base.rename(f"{baseline}_ms"), on=cols)
        best[f"speedup_vs_{baseline}"] = best[f"{baseline}_ms"] / best["median_ms"]
    return best.reset_index(drop=True)


# --------------------------------------------------------------------------
# CLI: workbench sweep
# --------------------------------------------------------------------------
def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Run a declared parameter sweep (experiments/NAME.yaml) into results/NAME/rows.parquet."
    parser.add_argument("spec", help="experiment spec, e.g. experiments/gemm_tiling.yaml")
    parser.add_argument("--quick", action="store_true", help="run the spec's quick: subset")
    parser.add_argument("--results", metavar="DIR", help="results folder (default results/NAME)")
    parser.add_argument("--fresh", action="store_true",
                        help="do not resume: move existing rows aside and run every point again")
    parser.add_argument("--limit", type=int, metavar="N", help="run at most N new rows")
    parser.add_argument("--dry-run", action="store_true", help="validate and count points, run nothing")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    from . import sweep_cluster

    sweep_cluster.add_args(parser)  # --executor slurm and friends (workbench.cluster)


def run(args) -> int:
    try:
        spec = load_spec(args.spec, quick=args.quick)
    except SpecError as exc:
        print(f"workbench sweep: error: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        points = expand(spec)
        kern = sum(1 for p in points if p.baseline is None)
        worlds = "" if spec.world_sizes == [1] else f" and world sizes {', '.join(map(str, spec.world_sizes))}"
        print(f"{spec.path}: {kern} kernel points + {len(points) - kern} baseline points x {spec.repeats} "
              f"repeat(s) over {sum(len(v) for v in spec.shapes.values())} shapes{worlds}; spec OK")
        return 0
    from . import sweep_cluster

    cluster_rc = sweep_cluster.dispatch(args, spec)  # None: a local sweep, as below
    if cluster_rc is not None:
        return cluster_rc
    try:
        run_spec(spec, results_dir=args.results, resume=not args.fresh, progress=not args.no_progress,
                 limit=args.limit)
    except SpecError as exc:
        print(f"workbench sweep: error: {exc}", file=sys.stderr)
        return 2
    except SweepAborted as exc:
        print(f"workbench sweep: aborted: {exc}", file=sys.stderr)
        return 1
    return 0
