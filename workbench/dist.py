"""Multi-GPU work: start a world with torchrun (peer memory: ``workbench.heap``).

Three parts, one per way a study meets several ranks (the last two live in
``workbench.heap`` and are re-exported here):

``launch(script, world_size, args, timeout_s)``
    Runs ``torchrun --standalone --nproc-per-node=N script args`` from Python
    (a notebook, ``workbench sweep``), watches it against a deadline (and,
    optionally, a limit on the time a rank spends in one stage) and
    returns the rows every rank wrote. A rank that dies, raises or hangs
    fails the run with a `LaunchError` / `LaunchTimeout` naming the rank, its
    last stage and its last output lines, instead of hanging the caller.
    The script wraps its body in ``with dist.worker() as w:`` to get the
    process group, a heartbeat and ``w.emit(rows)``.

``SymmetricHeap(nbytes, group)`` and ``SimulatedWorld(world_size)``
    Peer memory on GPUs (PyTorch symmetric memory) and all ranks of a world in
    one CPU process (Triton's interpreter): see ``workbench.heap``.

NVLink multicast stays off in this process and in every process started here
(``MULTICAST_OFF``): a program using it can take shared GPUs out of service.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from workbench.bench import _quantile  # one quartile definition for every timing

# The heap module sets MULTICAST_OFF in this process's environment as it loads, before
# anything here could initialize NCCL (torch is imported later, inside functions).
from workbench.heap import (  # noqa: F401  (re-exported: dist.SymmetricHeap etc.)
    MULTICAST_OFF, RankError, SimHeap, SimulatedWorld, SymmetricHeap, interpreted,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
ENV_RUN_DIR = "WORKBENCH_RUN_DIR"
ENV_HEARTBEAT = "WORKBENCH_HEARTBEAT_S"
ENV_BACKEND = "WORKBENCH_DIST_BACKEND"

__all__ = ["launch_rows", "MULTICAST_OFF", "launch", "LaunchResult", "LaunchError", "LaunchTimeout", "worker", "Worker",
           "time_collective", "SymmetricHeap", "SimulatedWorld", "SimHeap", "RankError", "interpreted",
           "child_env"]


# ==========================================================================
# Launching a world
# ==========================================================================
class LaunchError(RuntimeError):
    """The world failed; ``ranks`` are the ranks held responsible."""

    def __init__(self, message: str, ranks: Sequence[int] = (), run_dir: Path | None = None,
                 states: dict[int, dict] | None = None):
        super().__init__(message)
        self.ranks = list(ranks)
        self.run_dir = run_dir
        self.states = states or {}  # rank -> what it last said (status, stage, ages, pid, error)

    @property
    def rows(self) -> list[dict]:
        """Rows the ranks emitted before the failure (partial results)."""
        return _collect_rows(self.run_dir) if self.run_dir else []


class LaunchTimeout(LaunchError):
    """The deadline passed before every rank finished, or a rank stalled in one stage."""


@dataclasses.dataclass
class LaunchResult:
    rows: list[dict]  # every rank's emitted rows, rank-major, each with a "rank" field
    world_size: int
    run_dir: Path
    elapsed_s: float
    log: str  # torchrun's combined output

    def frame(self):
        import pandas as pd

        return pd.DataFrame(self.rows)


def child_env(extra: dict | None = None) -> dict:
    """Environment for a process started from here: ours, the repo on PYTHONPATH, multicast off."""
    env = dict(os.environ)
    env.update(extra or {})
    env.update(MULTICAST_OFF)  # last: nothing switches multicast back on
    if "TRITON_INTERPRET" not in (extra or {}):
        env.pop("TRITON_INTERPRET", None)  # a CPU test session must not make GPU ranks interpret
    path = env.get("PYTHONPATH", "")
    if str(REPO_ROOT) not in path.split(os.pathsep):
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), path) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _target_args(script_or_module: str | os.PathLike) -> tuple[list[str], str]:
    s = str(script_or_module)
    p = Path(s)
    if p.suffix == ".py" or p.exists():
        if not p.exists():
            raise FileNotFoundError(f"dist.launch: no script {p}")
        return [str(p.resolve())], p.name
    if re.fullmatch(r"[A-Za-z_][\w.]*", s):
        return ["-m", s], s
    raise ValueError(f"dist.launch: {s!r} is neither a .py script nor a module name (pkg.module)")


def launch(script_or_module: str | os.PathLike, world_size: int, args: Sequence[str] = (),
           timeout_s: float = 600.0, *, run_dir: str | os.PathLike | None = None, env: dict | None = None,
           backend: str | None = None, heartbeat_s: float = 1.0, python: str | None = None,
           echo: bool = False, stage_timeout_s: float | None = None,
           on_poll: Callable[[Path], Any] | None = None) -> LaunchResult:
    """Run ``script_or_module`` as a world of ``world_size`` processes under torchrun.

    Returns the rows the ranks emitted (``Worker.emit``), merged rank-major.
    Raises `LaunchTimeout` when ``timeout_s`` passes first (the world is
    killed; the message names the ranks that had not finished and what each
    was doing), `LaunchError` when a rank fails (named, with its exit code or
    exception and its last output lines). Per-rank heartbeat, rows and error
    files stay in ``run_dir`` (a fresh temporary folder by default).

    stage_timeout_s: also kill the world (`LaunchTimeout`) when a rank stays
        longer than this in one stage of its own (``Worker.stage``); the
        Worker's own stages (process start, ``init_process_group``, and
        "running" until the script names a stage) count only against
        ``timeout_s``. The message names the stalled rank first.
    on_poll: called with ``run_dir`` about ten times a second while the world
        runs (e.g. to read rows as they are emitted); what it raises stops
        the world and reaches the caller.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"dist.launch: world_size must be a positive integer, got {world_size!r}")
    target, name = _target_args(script_or_module)
    run_dir = Path(run_dir) if run_dir else Path(tempfile.mkdtemp(prefix="workbench_dist_"))
    run_dir.mkdir(parents=True, exist_ok=True)
    for old in run_dir.glob("rank*.*"):
        old.unlink()
    extra = {ENV_RUN_DIR: str(run_dir), ENV_HEARTBEAT: str(heartbeat_s), **(env or {})}
    if backend:
        extra[ENV_BACKEND] = backend
    cmd = [python or sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1",
           f"--nproc-per-node={world_size}", "--max-restarts=0", "--monitor-interval=0.2",
           f"--log-dir={run_dir / 'torchrun'}", "--tee=3", *target, *map(str, args)]
    log_path = run_dir / "launch.log"
    start = last_check = time.monotonic()
    with open(log_path, "w") as log:
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env(extra),
                                cwd=str(REPO_ROOT), start_new_session=True)
        try:
            while True:
                rc = proc.poll()
                if rc is not None:
                    break
                now = time.monotonic()
                if now - start > timeout_s:
                    states = _rank_states(run_dir, world_size)
                    _kill_world(proc, states)
                    text = log_path.read_text(errors="replace")
                    raise LaunchTimeout(_timeout_message(name, world_size, timeout_s, states, text, run_dir),
                                        [r for r, s in states.items() if s["status"] != "done"], run_dir, states)
                if stage_timeout_s and now - last_check >= min(1.0, stage_timeout_s / 4):
                    last_check = now
                    states = _rank_states(run_dir, world_size)
                    stalled = _stalled(states, stage_timeout_s)
                    if stalled:
                        _kill_world(proc, states)
                        text = log_path.read_text(errors="replace")
                        raise LaunchTimeout(_stall_message(name, world_size, stage_timeout_s, stalled, states, text,
                                                           run_dir), stalled, run_dir, states)
                if on_poll is not None:
                    on_poll(run_dir)
                time.sleep(0.1)
        except BaseException:
            if proc.poll() is None:  # KeyboardInterrupt and friends: leave nothing running
                _kill_world(proc, _rank_states(run_dir, world_size))
            raise
    elapsed = time.monotonic() - start
    text = log_path.read_text(errors="replace")
    if echo:
        print(text, end="")
    states = _rank_states(run_dir, world_size)
    if rc != 0 or any(s["status"] != "done" for s in states.values()):
        msg, ranks = _failure_message(name, world_size, rc, states, text, run_dir)
        raise LaunchError(msg, ranks, run_dir, states)
    return LaunchResult(_collect_rows(run_dir), world_size, run_dir, elapsed, text)


def launch_rows(script_or_module: str | os.PathLike, world_size: int, args: Sequence[str] = (), *,
                env: dict | None = None, **kwargs) -> tuple[list[dict], str]:
    """``launch`` on the first ``world_size`` GPUs this process may use, for a study script:
    (rows, error). A world that fails still gives the rows its ranks wrote before it did,
    with ``error`` the launch error's text ("" when the world succeeded), so one bad world
    size loses no others."""
    env = {"CUDA_VISIBLE_DEVICES": first_gpus(world_size), **(env or {})}
    try:
        return launch(script_or_module, world_size, args, env=env, **kwargs).rows, ""
    except LaunchError as exc:
        return exc.rows, str(exc)


def first_gpus(world_size: int) -> str:
    """CUDA_VISIBLE_DEVICES for a world: the first ``world_size`` of those already visible
    (a user who chose GPUs 2,3 gets 2,3, and two worlds on one node stay apart), else 0 .. W-1."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return ",".join(map(str, range(world_size)))
    return ",".join([d.strip() for d in visible.split(",") if d.strip()][:world_size])


def _collect_rows(run_dir: Path) -> list[dict]:
    rows: list[dict] = []
    files = sorted(run_dir.glob("rank*.jsonl"), key=lambda p: int(re.sub(r"\D", "", p.stem) or 0))
    for path in files:
        for line in path.read_text().splitlines():
            if line.strip():
                with contextlib.suppress(ValueError):  # a line cut by a kill
                    rows.append(json.loads(line))
    return rows


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _rank_states(run_dir: Path, world_size: int) -> dict[int, dict]:
    """What each rank last said: status (done/error/running/silent), stage, ages, pid."""
    now = time.time()
    out = {}
    for r in range(world_size):
        beat = _read_json(run_dir / f"rank{r}.heartbeat") or {}
        err = _read_json(run_dir / f"rank{r}.error")
        done = (run_dir / f"rank{r}.done").exists()
        status = "done" if done else "error" if err else "running" if beat else "silent"
        out[r] = {"status": status, "stage": beat.get("stage"), "pid": beat.get("pid"),
                  "stage_age_s": now - beat["stage_since"] if "stage_since" in beat else None,
                  "beat_age_s": now - beat["beat"] if "beat" in beat else None,
                  "error": err}
    return out


def _kill_world(proc: subprocess.Popen, states: dict[int, dict]) -> None:
    """SIGTERM torchrun's process group and the ranks we know of, then SIGKILL what is left."""
    pids = [s["pid"] for s in states.values() if s.get("pid")]

    def send(sig):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    send(signal.SIGTERM)
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        pass
    send(signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


def _rank_lines(text: str, rank: int, n: int = 6) -> list[str]:
    """Last lines torchrun's --tee prefixed with this (local) rank."""
    pat = re.compile(rf"^\[(?:default|rank)?{rank}\]:(.*)$")
    lines = [m.group(1) for line in text.splitlines() if (m := pat.match(line)) and m.group(1).strip()]
    return lines[-n:]


def _describe(r: int, s: dict, text: str) -> str:
    bits = [f"rank {r}: {s['status']}"]
    if s["stage"]:
        age = f" for {s['stage_age_s']:.1f} s" if s["stage_age_s"] is not None else ""
        bits.append(f"in stage '{s['stage']}'{age}")
    if s["beat_age_s"] is not None and s["status"] == "running":
        bits.append(f"last heartbeat {s['beat_age_s']:.1f} s ago")
    if s["error"]:
        bits.append(f"raised {s['error'].get('exception', '?')}")
    desc = ", ".join(bits)
    tail = _rank_lines(text, r)
    if tail:
        desc += "\n      | " + "\n      | ".join(tail)
    return desc


def _timeout_message(name, world_size, timeout_s, states, text, run_dir) -> str:
    stuck = [r for r, s in states.items() if s["status"] != "done"]
    lines = [f"dist.launch({name}, world_size={world_size}): timed out after {timeout_s:g} s; "
             f"rank(s) {', '.join(map(str, stuck))} did not finish (the world was killed)."]
    lines += ["  " + _describe(r, s, text) for r, s in states.items()]
    lines.append(f"  heartbeats, rows and the log: {run_dir}")
    return "\n".join(lines)


# Stages the Worker sets itself (start, process group, "running" until the script names one):
# covered by launch's timeout_s alone.
STARTUP_STAGES = ("starting", "init_process_group", "running")


def _stalled(states: dict[int, dict], limit_s: float) -> list[int]:
    """Running ranks that have been in one stage of their own for over ``limit_s``, longest first."""
    late = [r for r, s in states.items() if s["status"] == "running" and s["stage"] not in STARTUP_STAGES
            and s["stage_age_s"] is not None and s["stage_age_s"] > limit_s]
    return sorted(late, key=lambda r: -states[r]["stage_age_s"])


def _stall_message(name, world_size, limit_s, stalled, states, text, run_dir) -> str:
    first = stalled[0]
    lines = [f"dist.launch({name}, world_size={world_size}): rank {first} made no progress for "
             f"{states[first]['stage_age_s']:.0f} s in stage '{states[first]['stage']}' (stage timeout "
             f"{limit_s:g} s); the world was killed."]
    lines += ["  " + _describe(r, s, text) for r, s in states.items()]
    lines.append(f"  heartbeats, rows and the log: {run_dir}")
    return "\n".join(lines)


_ROOT_CAUSE = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")


def _failure_message(name, world_size, rc, states, text, run_dir) -> tuple[str, list[int]]:
    raised = [r for r, s in states.items() if s["status"] == "error"]
    root = _ROOT_CAUSE.findall(text.split("Root Cause", 1)[-1]) if "Root Cause" in text else []
    exit_codes = {int(r): int(c) for r, c in root}
    # A rank that died without a word (killed, os._exit, a crash) is the cause: the
    # others' errors (a peer's connection closed) follow from it. Else the first to raise.
    silent = [r for r in exit_codes if states[r]["error"] is None and states[r]["status"] != "done"]
    if silent:
        ranks = silent
    elif raised:
        ranks = [min(raised, key=lambda r: states[r]["error"].get("time", 0.0))]
    elif exit_codes:
        ranks = list(exit_codes)
    else:
        ranks = [r for r, s in states.items() if s["status"] != "done"] or list(range(world_size))
    later = [r for r in raised if r not in ranks]
    why = []
    for r in ranks:
        s = states[r]
        if s["error"]:
            why.append(f"rank {r} raised {s['error'].get('exception')}")
        elif r in exit_codes:
            code = exit_codes[r]
            why.append(f"rank {r} exited with code {code}" + (f" (signal {-code})" if code < 0 else ""))
        else:
            why.append(f"rank {r} ended without finishing")
    for r, code in exit_codes.items():
        if states[r]["status"] == "running":
            states[r]["status"] = f"exited with code {code}"
    if later:
        why.append(f"then rank(s) {', '.join(map(str, later))} failed too")
    lines = [f"dist.launch({name}, world_size={world_size}): {'; '.join(why)} (torchrun exit code {rc})."]
    lines += ["  " + _describe(r, s, text) for r, s in states.items()]
    for r in [r for r in ranks if r in raised] + later:
        tb = (states[r]["error"] or {}).get("traceback", "").rstrip().splitlines()[-8:]
        if tb:
            lines.append(f"  rank {r} traceback (end):\n      " + "\n      ".join(tb))
    lines.append(f"  heartbeats, rows and the log: {run_dir}")
    return "\n".join(lines), ranks


# --------------------------------------------------------------------------
# The rank's side
# --------------------------------------------------------------------------
def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + f".tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


class Worker:
    """One rank of a launched world: process group, heartbeat, rows, exit record.

    Use as ``with dist.worker() as w:``; outside ``launch`` (no run folder)
    it still initializes the process group from torchrun's variables and
    simply records nothing.
    """

    def __init__(self, backend: str | None = None, *, init: bool = True):
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        run_dir = os.environ.get(ENV_RUN_DIR)
        self.run_dir = Path(run_dir) if run_dir else None
        self.backend = backend or os.environ.get(ENV_BACKEND)
        self.init = init
        self.interval = float(os.environ.get(ENV_HEARTBEAT, "1.0"))
        self._stage = "starting"
        self._stage_since = time.time()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.device = None

    # heartbeat -------------------------------------------------------------
    def _beat(self) -> None:
        if self.run_dir is None:
            return
        _atomic_write(self.run_dir / f"rank{self.rank}.heartbeat", json.dumps(
            {"rank": self.rank, "pid": os.getpid(), "stage": self._stage, "stage_since": self._stage_since,
             "beat": time.time()}))

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            with contextlib.suppress(OSError):
                self._beat()

    def stage(self, name: str) -> None:
        """Say what this rank is doing now (a timeout names the stage it was stuck in)."""
        self._stage, self._stage_since = str(name), time.time()
        with contextlib.suppress(OSError):
            self._beat()

    def emit(self, rows: dict | Iterable[dict]) -> None:
        """Append result rows (JSON-able dicts); ``launch`` returns them merged, tagged with the rank."""
        if isinstance(rows, dict):
            rows = [rows]
        rows = [{"rank": self.rank, **r} for r in rows]
        if self.run_dir is None:
            return
        with open(self.run_dir / f"rank{self.rank}.jsonl", "a") as fh:
            for r in rows:
                fh.write(json.dumps(r, default=str) + "\n")

    # context ---------------------------------------------------------------
    def __enter__(self) -> "Worker":
        os.environ.update(MULTICAST_OFF)
        self._beat()
        self._thread = threading.Thread(target=self._loop, name="workbench-heartbeat", daemon=True)
        self._thread.start()
        if self.init and self.world_size >= 1:
            import torch
            import torch.distributed as tdist

            if torch.cuda.is_available():
                torch.cuda.set_device(self.local_rank)
                self.device = torch.device("cuda", self.local_rank)
            else:
                self.device = torch.device("cpu")
            if not tdist.is_initialized():
                self.stage("init_process_group")
                backend = self.backend or ("nccl" if self.device.type == "cuda" else "gloo")
                kw = {"device_id": self.device} if backend == "nccl" else {}
                tdist.init_process_group(backend=backend, **kw)
        self.stage("running")
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        ok = exc_type is None or (exc_type is SystemExit and exc.code in (None, 0))
        self._stop.set()
        if self.run_dir is not None:
            if ok:
                _atomic_write(self.run_dir / f"rank{self.rank}.done", json.dumps({"rank": self.rank}))
            else:
                _atomic_write(self.run_dir / f"rank{self.rank}.error", json.dumps({
                    "rank": self.rank, "stage": self._stage, "time": time.time(),
                    "exception": f"{exc_type.__name__}: {exc}"[:2000],
                    "traceback": "".join(traceback.format_exception(exc_type, exc, tb))[-8000:]}))
        if ok and self.init:
            import torch.distributed as tdist

            if tdist.is_initialized():
                with contextlib.suppress(Exception):
                    tdist.barrier()
                    tdist.destroy_process_group()
        return False


def worker(backend: str | None = None, *, init: bool = True) -> Worker:
    """The current rank's `Worker` (use in a ``with`` statement)."""
    return Worker(backend, init=init)


def time_collective(fn: Callable[[], Any], *, warmup: int = 3, iters: int = 10, group=None,
                    sync: Callable[[], Any] | None = None, graph: int = 0) -> dict:
    """Time a collective the way the seeds do: median per rank, slowest rank reported.

    Every rank runs ``warmup`` calls, meets the others, then times ``iters``
    back-to-back calls, each between its own pair of CUDA events (host clock
    on CPU). With ``graph=G`` (CUDA only) the warmed-up calls are captured
    ``G`` at a time in a CUDA graph and each of ``iters`` replays is timed
    (per call: replay time / G): the GPU's time without the host's launch
    overhead. Returns the same dict on every rank: ``ms`` (the slowest rank's
    median), ``q25_ms``/``q75_ms`` of that rank, ``ms_per_rank``,
    ``slowest_rank``, ``iters``, ``loop_ms`` (whole timed loop / calls: the
    throughput view nccl-tests reports) and ``graph``.
    """
    import torch
    import torch.distributed as tdist

    cuda = torch.cuda.is_available()
    meet = (lambda: tdist.barrier(group=group)) if tdist.is_initialized() else (lambda: None)
    if graph and cuda:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        meet()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(graph):
                fn()
        torch.cuda.synchronize()
        meet()
        g.replay()
        torch.cuda.synchronize()
        if sync is not None:
            sync()
        meet()
        run, per = g.replay, graph
    else:
        for _ in range(warmup):
            fn()
        if cuda:
            torch.cuda.synchronize()
        if sync is not None:
            sync()
        meet()
        run, per = fn, 1
    if cuda:
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
        for a, b in ev:
            a.record()
            run()
            b.record()
        torch.cuda.synchronize()
        times = [a.elapsed_time(b) / per for a, b in ev]
        loop = ev[0][0].elapsed_time(ev[-1][1]) / (per * iters)
    else:
        times = []
        t_all = time.perf_counter()
        for _ in range(iters):
            t0 = time.perf_counter()
            run()
            times.append((time.perf_counter() - t0) * 1e3 / per)
        loop = (time.perf_counter() - t_all) * 1e3 / (per * iters)
    s = sorted(times)
    # the quartiles of workbench.bench (linear interpolation), so a collective's
    # spread reads the same as a kernel's in one table
    mine = (statistics.median(s), _quantile(s, 0.25), _quantile(s, 0.75), loop)
    if tdist.is_initialized():
        allv = [None] * tdist.get_world_size(group)
        tdist.all_gather_object(allv, mine, group=group)
    else:
        allv = [mine]
    slow = max(range(len(allv)), key=lambda r: allv[r][0])
    return {"ms": allv[slow][0], "q25_ms": allv[slow][1], "q75_ms": allv[slow][2], "slowest_rank": slow,
            "ms_per_rank": [v[0] for v in allv], "iters": iters, "loop_ms": max(v[3] for v in allv),
            "graph": graph if (graph and cuda) else 0}
