"""Declared parameter sweeps: experiment YAML -> points -> rows (parquet).

    workbench sweep experiments/gemm_tiling.yaml [--quick] [--results DIR]
    workbench sweep experiments/all_gather.yaml       # worlds of 2 and 4 GPUs (torchrun)

(the command: ``workbench.sweep_command``, which hands the sweep to an executor) or from Python::

    from workbench import sweep
    df = sweep.run_spec("experiments/gemm_tiling.yaml", quick=True)

The spec format is ``workbench.spec``'s (its docstring); this module runs it. One point's
inputs, checked run and timing are ``workbench.sweep_point``'s; the rows on disk
(``rows.parquet``, resume) ``workbench.sweep_rows``'.

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
import contextlib
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
from typing import Callable, Mapping

from .spec import (  # noqa: F401  (load_spec, parse_spec, expand, Spec, SpecError: this module's public names too)
    DTYPE_NAMES, REPO_ROOT, Point, Spec, SpecError, load_kernel_module, expand, load_spec, parse_spec,
)
from .sweep_point import Job, PointRunner, SweepAborted, base_row, point_to_json, untimed
from .sweep_rows import RETRY_STATUSES, RowStore, best_per_shape, load_rows  # noqa: F401  (public here too)

__all__ = ["SpecError", "Spec", "Point", "load_spec", "parse_spec", "expand", "run_spec", "load_rows",
           "best_per_shape", "default_results_dir", "module_root", "RowStore", "RETRY_STATUSES", "SweepAborted",
           "DTYPE_NAMES"]


def default_results_dir(spec: Spec) -> Path:
    """results/<name>/ beside the spec's experiments/ folder (else the repository's)."""
    root = spec.path.resolve().parent.parent if spec.path else REPO_ROOT
    if not (root / "results").exists() and (REPO_ROOT / "results").exists():
        root = REPO_ROOT
    return root / "results" / spec.name


class _Recorder:
    """Finished rows -> provenance, the store (flushed often), the progress bar, counts, on_row."""

    def __init__(self, store: RowStore, bar, prov_for: Callable[[int], dict], flush_every: int, flush_s: float,
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


def module_root(module, kernel: str) -> str | None:
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


def _run_world(spec: Spec, job: Job, W: int, tasks: list, rec: _Recorder, log, deadline_at: float | None) -> int:
    """The points of world size ``W`` in one torchrun world; returns how many were left unrun
    (stopped at the deadline, for a resumed run)."""
    capacity = _world_capacity(job.device)
    if capacity is not None and capacity < W:
        reason = (f"skipped: world size {W} needs {W} GPUs and this machine has {capacity}; run the sweep on a "
                  f"node with {W} or more (skipped rows are tried again by the next run)")
        log(f"sweep {spec.name}: world size {W}: {len(tasks)} rows skipped: this machine has {capacity} GPU(s)")
        for p, rep in tasks:
            rec.add(untimed(base_row(job, p, rep), "skipped", reason, job.device))
        return 0
    from . import dist

    backend = "nccl" if job.device == "cuda" else "gloo"
    run_dir = Path(tempfile.mkdtemp(prefix=f"sweep_{spec.name}_w{W}_"))
    plan = {**job.to_plan(), "backend": backend, "deadline_at": deadline_at,
            "sys_path": [r for r in [module_root(job.module, job.kernel)] if r],
            "tasks": [[point_to_json(p), rep] for p, rep in tasks]}
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
    at = f" at point {culprit + 1} ({base_row(job, *tasks[culprit])['config']})" if culprit is not None else ""
    for i in pending:
        p, rep = tasks[i]
        if i == culprit:
            rec.add(untimed(base_row(job, p, rep), status, text, job.device))
        else:
            rec.add(untimed(base_row(job, p, rep), "not_run",
                             f"not run: the world of {W} ranks stopped{at} ({status}); tried again on resume. "
                             + text.splitlines()[0], job.device))
    return 0


def _run_here(spec: Spec, job: Job, tasks: list, rec: _Recorder, inflight: Path, t_start: float,
              deadline_s: float | None) -> tuple[int, str | None]:
    """The points of world size 1, in this process; returns (rows left at the deadline, abort message)."""
    runner = PointRunner(job)
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
    module = spec.module or load_kernel_module(spec.kernel, spec.path)
    spec.module = module
    points = expand(spec)

    device = "cuda" if bench.gpu_timing_available() else "cpu"
    folder = Path(results_dir) if results_dir else default_results_dir(spec)
    folder.mkdir(parents=True, exist_ok=True)
    store = RowStore(folder)
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
    job = Job(sweep=spec.name, kernel=spec.kernel, variant=spec.variant, seed=spec.seed,
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
                    row = untimed(base_row(job, match, key[2]), "crashed",
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


def _all_param_names(spec: Spec, points: list[Point]) -> list[str]:
    names = dict.fromkeys(getattr(spec.module, "PARAMS", {}) or {})
    for p in points:
        for k, _ in p.params:
            names.setdefault(k)
    return list(names)
