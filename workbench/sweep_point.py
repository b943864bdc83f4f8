"""One point of a sweep, in this process or in every rank of a world: inputs, the checked run,
the timing, and the row that says how it went (``workbench.sweep`` runs the points).

`PointRunner` turns points into rows one after another: make the inputs (once per shape),
poison the outputs, run once and check against the reference, then time. The single-process
sweep runs it with `Solo` (a world of one); every rank of a launched world
(``workbench.sweep_rank``) runs it with `WorldComm`, and after each step the ranks agree on how
it went, so a step that failed on one rank fails the point on all of them (``error`` names the
rank) and the ranks stay in step. A rank gets its `Job` (what turns points into rows) and its
points as JSON (`Job.to_plan`, `point_to_json`).

A failure of the kernel never raises: the row's ``status`` says what happened (ok, wrong_result,
compile_error, out_of_resources, out_of_memory, invalid_config, runtime_error, cuda_error). A
CUDA context that no longer works sets ``PointRunner.aborted``: the sweep then stops with
`SweepAborted`.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import sys
import time
from typing import Any, Callable, Mapping

from .spec import Point, clip_text, torch_dtype

__all__ = ["Job", "PointRunner", "Solo", "WorldComm", "SweepAborted", "base_row", "untimed", "point_to_json",
           "point_from_json"]


class SweepAborted(RuntimeError):
    """The process can no longer run kernels (sticky CUDA error); rows are saved."""


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
    return clip_text(f"{type(exc).__name__}: {exc}".strip(), limit)


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


def _peak(ceil: Mapping | None, dtype: str):
    if not ceil:
        return None, None
    key = {"bfloat16": "bf16_tflops", "float16": "fp16_tflops"}.get(dtype)
    return (ceil.get(key) if key else None), ceil.get("copy_gbps")


@dataclasses.dataclass
class Job:
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
    def from_plan(cls, plan: Mapping, module) -> "Job":
        names = {f.name for f in dataclasses.fields(cls)} - {"module"}
        return cls(**{k: plan[k] for k in names}, module=module)


def point_to_json(p: Point) -> dict:
    return {"study": p.study, "shape": [list(kv) for kv in p.shape], "dtype": p.dtype,
            "params": [list(kv) for kv in p.params], "world_size": p.world_size, "baseline": p.baseline}


def point_from_json(d: Mapping) -> Point:
    return Point(d["study"], tuple(tuple(kv) for kv in d["shape"]), d["dtype"], tuple(tuple(kv) for kv in d["params"]),
                 int(d["world_size"]), d["baseline"])


def base_row(job: Job, p: Point, rep: int) -> dict:
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
           "flops": int(module.flops(shape)), "bytes": int(module.bytes_moved(shape, torch_dtype(p.dtype)))}
    for k in job.param_names:
        row[f"p_{k}"] = params.get(k)
    return row


def untimed(row: dict, status: str, error: str, device: str) -> dict:
    """``row`` for a point that produced no measurement."""
    row.update(status=status, error=error, rel_err=math.nan, median_ms=math.nan, tflops=math.nan, gbps=math.nan,
               frac_of_peak=math.nan, is_performance=device == "cuda",
               timestamp=time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()))
    return row


class Solo:
    """The ranks of a world of one: this process."""

    rank, world_size, group = 0, 1, None

    def stage(self, text: str) -> None:
        pass

    def gather(self, obj) -> list:
        return [obj]

    def log(self, text: str) -> None:
        pass


class WorldComm:
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
    n_warm, n_rep = bench.rep_counts(est, bench_kw["warmup_ms"], bench_kw["rep_ms"], min_reps,
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


class PointRunner:
    """Turns points into rows, one after another, in this process.

    The single-process sweep (a world of one) and every rank of a launched
    world run the same `run`: make the inputs (once per shape), poison the
    outputs, run once and check against the reference, then time. In a world
    every rank runs the same points in the same order, and after each step
    the ranks agree on how it went (`_step`), so a step that failed on one
    rank fails the point on all of them (the row names the rank) and the
    ranks stay in step for the next point.
    """

    def __init__(self, job: Job, comm=None):
        self.job = job
        self.comm = comm or Solo()
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
        return status, clip_text(_by_rank([(r, e) for r, _, e in fails])), value

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
        row = base_row(job, p, rep)
        dtype = torch_dtype(p.dtype)
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
