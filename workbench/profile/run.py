"""`workbench profile run`: profile one kernel launch with Nsight Compute, on a GPU node.

    workbench profile run experiments/profile_cases.py:hint1 --kernel remote_store_kernel --out profiles/

runs ``ncu`` on the program (`workbench.profile.target` calls the function) with
the source counters, the warp-state sampling and the memory tables
(``--section SourceCounters --section WarpStateStats --section
MemoryWorkloadAnalysis_Tables``), the kernel's source embedded (``--import-source
yes``; Triton emits line info unless ``TRITON_DISABLE_LINE_INFO=1``) and the
GPU's clocks left alone (``--clock-control none``). It writes, under ``--out``:

- ``NAME.ncu-rep``: the report (open it with ``workbench profile show``, or ncu-ui);
- ``NAME.json``: a small summary: the kernel, the Triton cache entry it was
  compiled into (``hash``, found by matching its code against the report's),
  the command, ncu's version, the GPU, the commit, the kernel's totals;
- ``NAME.triton-cache/``: the run's own Triton cache (unless ``--cache``), so
  the entry named in the summary stays beside the report;
- ``NAME.log``: the program's and ncu's output;
- ``NAME.sass.csv`` with ``--csv``: ncu's own per-instruction table
  (``ncu --import NAME.ncu-rep --page source --csv --print-source sass``).

Where ncu is missing, or the GPU's counters are not open to this user
(``ERR_NVGPUCTRPERM``), it says so and what to do, and exits with 2.
"""
from __future__ import annotations

import datetime as _dt
import glob
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .report import ProfileError, summary_path

DEFAULT_SECTIONS = ("SourceCounters", "WarpStateStats", "MemoryWorkloadAnalysis_Tables")
NCU_PLACES = ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/*/ncu", "/usr/local/cuda-*/bin/ncu")
DEFAULT_TIMEOUT_S = 600.0
LOG_TAIL = 25
PERMISSION = (
    "the GPU's performance counters are not open to this user (ERR_NVGPUCTRPERM): run as root, or let every "
    "user profile (as root: `echo 'options nvidia NVreg_RestrictProfilingToAdminUsers=0' > "
    "/etc/modprobe.d/ncu-counters.conf`, then reload the nvidia driver or reboot; "
    "https://developer.nvidia.com/ERR_NVGPUCTRPERM); in a container, start it with --cap-add=SYS_ADMIN")
NO_NCU = ("ncu (Nsight Compute) not found: install Nsight Compute (the CUDA toolkit ships it as "
          "/usr/local/cuda/bin/ncu), put it on PATH, or pass --ncu PATH")


def find_ncu(explicit: str | None = None) -> str | None:
    """The ncu to run: `explicit`, $NCU, `ncu` on PATH, the CUDA toolkit's, the newest standalone install."""
    for cand in (explicit, os.environ.get("NCU")):
        if cand:
            path = shutil.which(cand) or (cand if os.access(cand, os.X_OK) and os.path.isfile(cand) else None)
            if path is None:
                raise ProfileError(f"{cand}: not an executable ncu ({NO_NCU})")
            return path
    found = shutil.which("ncu")
    if found:
        return found
    for pattern in NCU_PLACES:
        hits = sorted(p for p in glob.glob(pattern) if os.access(p, os.X_OK))
        if hits:
            return hits[-1]
    return None


def ncu_command(ncu: str, target: str, report_base: Path, *, kernel: str | None = None, launch: int = 1,
                sections=DEFAULT_SECTIONS, clock_control: str = "none", args=()) -> list[str]:
    """The ncu command line that profiles launch `launch` (from 1) of the kernels matching `kernel`."""
    cmd = [ncu, "--clock-control", clock_control]
    for s in sections:
        cmd += ["--section", s]
    cmd += ["--import-source", "yes", "--launch-skip", str(launch - 1), "--launch-count", "1"]
    if kernel:
        cmd += ["-k", f"regex:{kernel}"]
    cmd += ["-f", "-o", str(report_base), sys.executable, "-m", "workbench.profile.target", target]
    if args:
        cmd += ["--", *args]
    return cmd


def portable_command(cmd: list[str], cwd: str | os.PathLike | None = None) -> str:
    """`cmd` as a shell line another machine can read: ncu and Python by name, paths under `cwd` relative."""
    here = Path(cwd or os.getcwd()).resolve()
    words = []
    for i, word in enumerate(cmd):
        if i == 0:
            word = Path(word).name
        elif word == sys.executable:
            word = "python3"
        elif os.path.isabs(word) and Path(word).is_relative_to(here):
            word = str(Path(word).relative_to(here))
        words.append(word)
    return shlex.join(words)


def _why_failed(log: str, rc: int, report: Path, kernel: str | None, launch: int) -> str | None:
    """What went wrong, in a sentence, from ncu's output (None: nothing recognised)."""
    if "ERR_NVGPUCTRPERM" in log:
        return PERMISSION
    if "No kernels were profiled" in log or (rc == 0 and not report.is_file()):
        which = f"matching --kernel {kernel!r}" if kernel else "at all"
        return (f"ncu profiled no kernel: the program launched none {which} (or fewer than {launch} such "
                "launches); check the name with `workbench asm ls`, or leave --kernel out to take the first launch")
    if "==ERROR==" in log:
        first = next(line for line in log.splitlines() if "==ERROR==" in line)
        return f"ncu failed: {first.strip()[:400]}"
    return None


def _tail(text: str, n: int = LOG_TAIL) -> str:
    return "\n".join(text.splitlines()[-n:])


def _ncu_version(ncu: str) -> str | None:
    try:
        r = subprocess.run([ncu, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    lines = [x for x in r.stdout.splitlines() if x.strip()]
    return lines[-1].strip() if lines else None


def _run_logged(cmd: list[str], log_path: Path, env: dict, timeout_s: float) -> tuple[int, bool]:
    """Run `cmd` in its own process group with its output in `log_path`; kill the group at the timeout."""
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            return _stop(proc), True
        except BaseException:  # Ctrl-C: nothing left profiling on the GPU
            _stop(proc)
            raise


def _stop(proc: subprocess.Popen) -> int:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            break
        try:
            return proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def _safe_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("._") or "profile"


def default_name(target: str) -> str:
    """'experiments/profile_cases.py:hint1' -> 'hint1'; 'x.py' -> 'x'; 'pkg.mod:run' -> 'run'."""
    where, _, fn = target.rpartition(":")
    if fn.isidentifier() and where:
        return _safe_name(fn)
    return _safe_name(Path(target).stem if target.endswith(".py") else target.rsplit(".", 1)[-1])


def write_ncu_csv(ncu: str, report: Path, out: Path, timeout_s: float = 300.0) -> None:
    """ncu's own per-SASS-instruction table of `report` (the ground truth `profile show --by pc` matches)."""
    cmd = [ncu, "--import", str(report), "--page", "source", "--csv", "--print-source", "sass"]
    with open(out, "w") as fh:
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.PIPE, text=True, timeout=timeout_s)
    if r.returncode != 0:
        raise ProfileError(f"{shlex.join(cmd)} exited with {r.returncode}: {r.stderr.strip()[-400:]}")


def profile(target: str, *, out: str | os.PathLike = "profiles", name: str | None = None, kernel: str | None = None,
            launch: int = 1, sections=DEFAULT_SECTIONS, cache: str | os.PathLike | None = None,
            ncu: str | None = None, clock_control: str = "none", timeout_s: float = DEFAULT_TIMEOUT_S,
            args=(), csv: bool = False, echo=print) -> dict:
    """Profile one launch; write the report, its summary and log under `out`; return the summary."""
    from . import target as _target

    try:
        _target.split(target)
    except _target.TargetError as exc:
        raise ProfileError(str(exc)) from None
    if launch < 1:
        raise ProfileError(f"--launch {launch}: launches count from 1")
    if kernel:
        try:
            re.compile(kernel)
        except re.error as exc:
            raise ProfileError(f"--kernel {kernel!r} is not a regular expression ({exc})") from None
    exe = find_ncu(ncu)
    if exe is None:
        raise ProfileError(NO_NCU)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    name = _safe_name(name) if name else default_name(target)
    base = out / name
    report = base.with_name(name + ".ncu-rep")
    cache_dir = Path(cache).expanduser() if cache else out / f"{name}.triton-cache"
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache_dir.resolve()))
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    if env.get("TRITON_DISABLE_LINE_INFO", "0") not in ("", "0"):
        echo("warning: TRITON_DISABLE_LINE_INFO is set: the kernel will carry no line info, and the report no "
             "source lines")
    cmd = ncu_command(exe, target, base, kernel=kernel, launch=launch, sections=sections,
                      clock_control=clock_control, args=list(args))
    if report.exists():
        report.unlink()
    echo(f"profiling with {exe} (log: {base.with_name(name + '.log')}) ...")
    t0 = time.monotonic()
    log_path = base.with_name(name + ".log")
    rc, timed_out = _run_logged(cmd, log_path, env, timeout_s)
    log = log_path.read_text(errors="replace")
    if timed_out:
        raise ProfileError(f"the profiled run passed its {timeout_s:.0f} s timeout and was stopped (--timeout); "
                           f"{log_path} ends with:\n{_tail(log)}")
    why = _why_failed(log, rc, report, kernel, launch)
    if why or rc != 0 or not report.is_file():
        raise ProfileError((why or f"the profiled program exited with {rc}") + f"; {log_path} ends with:\n"
                           + _tail(log))
    facts = {"target": target, "kernel_regex": kernel, "launch": launch, "sections": list(sections),
             "clock_control": clock_control, "command": portable_command(cmd), "ncu": Path(exe).name,
             "ncu_version": _ncu_version(exe),
             "seconds": round(time.monotonic() - t0, 1)}
    summary = write_summary(report, cache_dir, facts)
    if csv:
        write_ncu_csv(exe, report, report.with_name(summary_path(report).stem + ".sass.csv"))
    entry = summary["hash"]
    where = f"Triton cache entry {entry[:12]} ({cache_dir})" if entry else summary["entry_note"]
    samples = f"{summary['totals']['samples']:,} warp-state samples; " if summary["totals"] else ""
    echo(f"{summary['kernel'] or 'the kernel'}: {report} ({summary['report_bytes'] / 1024:,.0f} kB), summary "
         f"{summary_path(report)}; {where}\n  {samples}per source line: workbench profile show {report}")
    return summary


def write_summary(report: Path, cache_dir: Path | None, facts: dict) -> dict:
    """Write NAME.json beside `report`: the kernel, its Triton cache entry (found in `cache_dir` by matching
    its code against the report's), `facts` (how the report was made) and the provenance of this run.

    Without the report reader (the `profile` extra) the summary says how the report was made and what to
    install to read it; the kernel's details stay empty.
    """
    from .. import provenance
    from .lines import find_entry
    from .report import load, reader_missing

    summary = {"report": report.name, "kernel": None, "kernels": None, "hash": None, "cache": None,
               "entry_note": None, **facts, "device": None, "launch_config": None, "line_info": None,
               "totals": None, "report_bytes": report.stat().st_size}
    missing = reader_missing()
    if missing:
        summary["entry_note"] = f"not read here: {missing}"
    else:
        prof = load(report)
        summary.update(kernel=prof.name, kernels=prof.kernels, device=prof.launch.get("device"),
                       launch_config=prof.launch, line_info=prof.line_info,
                       totals={k: prof.totals.get(k) for k in ("samples", "samples_not_issued", "inst_executed")})
        if cache_dir is not None and Path(cache_dir).is_dir():
            try:
                summary["hash"] = find_entry(prof, cache_dir)[0].hash
            except Exception as exc:  # a library kernel has no entry; the report stands without one
                summary["entry_note"] = f"no Triton cache entry: {exc}"
        else:
            summary["entry_note"] = "no Triton cache was kept"
    if summary["hash"]:
        try:
            summary["cache"] = os.path.relpath(Path(cache_dir).resolve(), report.parent.resolve())
        except ValueError:
            summary["cache"] = str(Path(cache_dir).resolve())
    for key, value in {"created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                       **provenance.git_info(), **provenance.versions()}.items():
        summary.setdefault(key, value)
    path = summary_path(report)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(summary, indent=1, default=str) + "\n")
    tmp.replace(path)
    return summary
