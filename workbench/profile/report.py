"""An Nsight Compute report, one row per SASS instruction: `load(path) -> KernelProfile`.

The report is read by NVIDIA's ``ncu_report`` package (the optional extra
``profile``: ``pip install 'kernel-workbench[profile]'``) in a child process
(`workbench.profile.reader`: its docstring says why), bounded:

- the file: a regular file of at most 1 GiB (``$WORKBENCH_PROFILE_MAX_MB``),
  its framing checked before the library sees it (a truncated copy, another
  tool's file or a corrupt one is refused with what is wrong);
- the reader: at most 4 GiB of memory plus four times the report, and
  ``$WORKBENCH_PROFILE_TIMEOUT_S`` seconds (default 120), then killed;
- its answer: at most 512 MiB of JSON, every per-PC value checked to be a number.

`KernelProfile.pcs` holds, per SASS instruction of the kernel (by offset from
its first instruction): the text, the source file and line the report
correlates it with, and the counters: ``inst_executed``,
``thread_inst_executed``, ``samples`` (warp-state samples, all: the sum over
stall reasons, which is what ncu's source page calls "Warp Stall Sampling (All
Samples)"), ``samples_not_issued``, one ``stall_<reason>`` and
``stall_<reason>_not_issued`` column per stall reason the report sampled, and
the memory tables' ``l2_sectors_global``, ``l1_wavefronts_shared``, ...
(`CSV_COLUMNS` names the column of ``ncu --page source --csv`` each matches).
"""
from __future__ import annotations

import importlib.util
import json
import os
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from .reader import STALL_PREFIX, ReportError, check_container

__all__ = ["KernelProfile", "ProfileError", "load", "start", "CSV_COLUMNS", "ncu_csv_column", "INSTALL_HINT",
           "reader_missing", "reason_label"]

ENV_MAX_MB = "WORKBENCH_PROFILE_MAX_MB"
ENV_TIMEOUT = "WORKBENCH_PROFILE_TIMEOUT_S"
DEFAULT_MAX_BYTES = 1 << 30      # the largest report here is 1.4 MB; a many-kernel report can be hundreds of MB
DEFAULT_TIMEOUT_S = 120.0
MAX_ANSWER_BYTES = 512 << 20
SUMMARY_LIMIT = 1 << 20          # the JSON summary `workbench profile run` writes beside a report
NCU_REPORT_VERSION = "2026.3.1"
READER = Path(__file__).with_name("reader.py")   # the child's script
INSTALL_HINT = (f"the Nsight Compute report reader is not installed: pip install 'ncu-report=={NCU_REPORT_VERSION}' "
                "(or pip install -e '.[profile]' in the repository)")

# report metric -> our column
METRIC_COLUMNS = {
    "inst_executed": "inst_executed",
    "thread_inst_executed": "thread_inst_executed",
    "thread_inst_executed_true": "thread_inst_executed_true",
    "smsp__pcsamp_sample_count": "sample_count",
    "memory_l2_theoretical_sectors_global": "l2_sectors_global",
    "memory_l2_theoretical_sectors_global_ideal": "l2_sectors_global_ideal",
    "derived__memory_l2_theoretical_sectors_global_excessive": "l2_sectors_global_excessive",
    "memory_l1_tag_requests_global": "l1_tag_requests_global",
    "memory_l1_wavefronts_shared": "l1_wavefronts_shared",
    "memory_l1_wavefronts_shared_ideal": "l1_wavefronts_shared_ideal",
    "derived__memory_l1_wavefronts_shared_excessive": "l1_wavefronts_shared_excessive",
    "smsp__branch_targets_threads_divergent": "divergent_branches",
}
# our column -> the column of `ncu --import R --page source --csv --print-source sass`
CSV_COLUMNS = {
    "samples": "Warp Stall Sampling (All Samples)",
    "samples_not_issued": "Warp Stall Sampling (Not-issued Samples)",
    "sample_count": "# Samples",
    "inst_executed": "Instructions Executed",
    "thread_inst_executed": "Thread Instructions Executed",
    "thread_inst_executed_true": "Predicated-On Thread Instructions Executed",
    "divergent_branches": "Divergent Branches",
    "l1_tag_requests_global": "L1 Tag Requests Global",
    "l1_wavefronts_shared": "L1 Wavefronts Shared",
    "l1_wavefronts_shared_ideal": "L1 Wavefronts Shared Ideal",
    "l1_wavefronts_shared_excessive": "L1 Wavefronts Shared Excessive",
    "l2_sectors_global": "L2 Theoretical Sectors Global",
    "l2_sectors_global_ideal": "L2 Theoretical Sectors Global Ideal",
    "l2_sectors_global_excessive": "L2 Theoretical Sectors Global Excessive",
}
# stall reason -> its short name in that CSV (all samples; not issued differs for 'sleeping' only)
_CSV_REASON = {"dispatch_stall": "dispatch", "imc_miss": "imc", "lg_throttle": "lg", "long_scoreboard": "long_sb",
               "math_pipe_throttle": "math", "mio_throttle": "mio", "no_instructions": "no_inst",
               "short_scoreboard": "short_sb", "sleeping": "sleep", "tex_throttle": "tex"}


def ncu_csv_column(column: str) -> str | None:
    """The ncu source-page CSV column of one of our per-PC columns (None: ncu prints none, e.g. warpgroup_arrive)."""
    if column in CSV_COLUMNS:
        return CSV_COLUMNS[column]
    if not column.startswith("stall_"):
        return None
    reason, not_issued = column[len("stall_"):], column.endswith("_not_issued")
    if not_issued:
        reason = reason[: -len("_not_issued")]
    if reason == "warpgroup_arrive":
        return None
    short = "sleeping" if reason == "sleeping" and not_issued else _CSV_REASON.get(reason, reason)
    return f"stall_{short} (Not Issued)" if not_issued else f"stall_{short}"


def reason_label(reason: str) -> str:
    """'long_scoreboard' -> 'long scoreboard'."""
    return reason.replace("_", " ")


class ProfileError(Exception):
    """A report that cannot be used, or a request it cannot answer; the message says what to do."""


def reader_missing() -> str | None:
    """Why the report reader cannot run here (None: it can)."""
    return INSTALL_HINT if importlib.util.find_spec("ncu_report") is None else None


def _positive_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ProfileError(f"${name}={raw!r} is not a number") from None
    if not value > 0:
        raise ProfileError(f"${name}={raw!r} must be positive")
    return value


def max_report_bytes() -> int:
    return int(_positive_env(ENV_MAX_MB, DEFAULT_MAX_BYTES / 2**20) * 2**20)


@dataclass
class KernelProfile:
    """One kernel of a report: its SASS instructions with their source lines and counters."""

    path: Path
    name: str
    index: int                       # the kernel's number in the report (from 0)
    kernels: list[str]               # every kernel the report holds
    launch: dict                     # grid, block, registers, device, cc, duration_ns, sample interval ...
    pcs: "pandas.DataFrame"          # one row per SASS instruction (see the module docstring)
    reasons: list[str]               # the stall reasons sampled (column stall_<reason>)
    sources: dict[str, str]          # source files the report embeds: path -> text
    totals: dict                     # the report's own kernel totals (ncu's sums over all PCs)
    has_sass: bool = True            # the SASS text was read (else `sass` is None, rows are the counted PCs)
    opcodes: dict = field(default_factory=dict)  # ncu's warp instructions executed per opcode
    summary: dict | None = None      # the JSON `workbench profile run` wrote beside the report
    notes: list[str] = field(default_factory=list)

    @property
    def line_info(self) -> bool:
        return bool(self.pcs["line"].notna().any())

    @property
    def total_samples(self) -> int:
        return int(self.pcs["samples"].sum())

    def reason_columns(self, not_issued: bool = False) -> list[str]:
        return [f"stall_{r}_not_issued" if not_issued else f"stall_{r}" for r in self.reasons]

    def label(self) -> str:
        g = self.launch.get("grid") or []
        b = self.launch.get("block") or []
        bits = [self.launch.get("device") or "?"]
        if g and all(isinstance(x, int) for x in g):
            bits.append("grid " + "x".join(map(str, g)))
        if b and all(isinstance(x, int) for x in b):
            bits.append("block " + "x".join(map(str, b)))
        return f"{self.name} [{self.path.name}: {', '.join(bits)}]"


# ---------------------------------------------------------------------------
# loading


def _check_file(path: Path) -> int:
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such report") from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if stat.S_ISDIR(st.st_mode):
        raise ProfileError(f"{path} is a directory: give the .ncu-rep file ncu wrote")
    if not stat.S_ISREG(st.st_mode):
        raise ProfileError(f"{path} is not a regular file (a FIFO, socket or device): not read")
    limit = max_report_bytes()
    if st.st_size > limit:
        raise ProfileError(f"{path}: {st.st_size / 2**20:,.0f} MiB, over the {limit / 2**20:,.0f} MiB a report may "
                           f"have here; profile fewer kernels (ncu -k / --launch-count) or raise ${ENV_MAX_MB}")
    try:
        check_container(str(path), st.st_size)
    except ReportError as exc:
        raise ProfileError(str(exc)) from None
    except OSError as exc:
        raise ProfileError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    return st.st_size


class Pending:
    """A report being read by the child; `result()` waits for it (the caller may work meanwhile)."""

    def __init__(self, path: Path, kernel: str | None, timeout_s: float, sass: bool = True):
        self.path, self.kernel, self.timeout_s = path, kernel, timeout_s
        self.t0 = time.monotonic()
        # the reader runs as a script: only the standard library and ncu_report are imported there
        cmd = [sys.executable, str(READER), str(path)]
        if kernel is not None:
            cmd += ["--kernel", str(kernel)]
        if not sass:
            cmd.append("--no-sass")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def _answer(self) -> dict:
        left = max(1.0, self.timeout_s - (time.monotonic() - self.t0))
        try:
            out, err = self.proc.communicate(timeout=left)
        except subprocess.TimeoutExpired:
            self.kill()
            raise ProfileError(f"{self.path}: the report reader did not finish in {self.timeout_s:.0f} s and was "
                               f"stopped (a damaged report?); a large one may need ${ENV_TIMEOUT} higher") from None
        finally:
            self.kill()
        rc = self.proc.returncode
        if len(out) > MAX_ANSWER_BYTES:
            raise ProfileError(f"{self.path}: the reader's answer is over {MAX_ANSWER_BYTES >> 20} MiB; not read")
        try:
            data = json.loads(out) if out else None
        except (ValueError, RecursionError):
            data = None
        if isinstance(data, dict) and "error" in data:
            if data.get("missing") == "ncu_report":
                raise ProfileError(INSTALL_HINT)
            msg = str(data["error"])[:2000]
            raise ProfileError(msg if msg.startswith(str(self.path)) else f"{self.path}: {msg}")
        if rc != 0 or not isinstance(data, dict):
            how = f"was killed by signal {-rc}" if rc < 0 else f"exited with {rc}"
            tail = err.decode("utf-8", "replace").strip().splitlines()[-3:]
            raise ProfileError(f"{self.path}: the report reader {how} on this file (a corrupt report?)"
                               + (": " + " | ".join(tail)[:600] if tail else ""))
        return data

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, 9)
            except (ProcessLookupError, PermissionError):
                pass
            self.proc.wait()

    def result(self) -> KernelProfile:
        return _profile(self.path, self._answer())


def start(path: str | os.PathLike, kernel: str | int | None = None, sass: bool = True) -> Pending:
    """Check the report and start reading it; `.result()` gives the KernelProfile (see `load`)."""
    path = Path(path)
    _check_file(path)
    missing = reader_missing()
    if missing:
        raise ProfileError(missing)
    return Pending(path, None if kernel is None else str(kernel), _positive_env(ENV_TIMEOUT, DEFAULT_TIMEOUT_S), sass)


def load(path: str | os.PathLike, kernel: str | int | None = None, sass: bool = True) -> KernelProfile:
    """One kernel of an Nsight Compute report (`kernel`: its number from 0, or a regex of its name; default the first).

    `sass=False` leaves the SASS text out: the rows are then the instructions
    that have a counter, and reading a large kernel takes a fraction of the time
    (the library disassembles the kernel for the text). `workbench profile show`
    reads it so, and takes the text from the Triton cache entry when it has one.
    """
    return start(path, kernel, sass).result()


def summary_path(report: Path) -> Path:
    """Where `workbench profile run` writes the JSON summary of `report` (NAME.ncu-rep -> NAME.json)."""
    name = report.name[: -len(".ncu-rep")] if report.name.endswith(".ncu-rep") else report.stem
    return report.with_name(name + ".json")


def read_summary(report: Path) -> tuple[dict | None, str | None]:
    """(the summary beside the report, None) or (None, why it was not used); (None, None) when there is none."""
    p = summary_path(report)
    try:
        st = os.stat(p)
    except OSError:
        return None, None
    if not stat.S_ISREG(st.st_mode) or st.st_size > SUMMARY_LIMIT:
        return None, f"{p}: not a small regular file; ignored"
    try:
        with open(p, "rb") as fh:
            data = json.loads(fh.read(SUMMARY_LIMIT + 1))
    except (OSError, ValueError, RecursionError) as exc:
        return None, f"{p}: unreadable JSON ({type(exc).__name__}); ignored"
    if not isinstance(data, dict):
        return None, f"{p}: not a JSON object; ignored"
    return data, None


def _profile(path: Path, data: dict) -> KernelProfile:
    import numpy as np
    import pandas as pd

    k = data.get("kernel") or {}
    instrs = data.get("instructions") or []
    files = [str(f) for f in (data.get("files") or [])]
    metrics = data.get("metrics") or {}
    start_pc = int(k.get("function_pc") or 0)
    file_of = lambda fi: files[fi] if isinstance(fi, int) and 0 <= fi < len(files) else None  # noqa: E731
    has_sass = bool(data.get("sass", True))
    base = pd.DataFrame({"offset": [int(r[0]) for r in instrs],
                         "sass": pd.array([str(r[1]) if has_sass else None for r in instrs], dtype=object),
                         "file": [file_of(r[2]) for r in instrs],
                         "line": pd.array([r[3] if file_of(r[2]) else None for r in instrs], dtype="Int64")})
    series, reasons = {}, []
    for name, m in metrics.items():
        if name.startswith(STALL_PREFIX):
            reason = name[len(STALL_PREFIX):]
            col = f"stall_{reason}"
            if not reason.endswith("_not_issued"):
                reasons.append(reason)
        elif name in METRIC_COLUMNS:
            col = METRIC_COLUMNS[name]
        else:
            continue
        s = pd.Series(m["values"], index=np.asarray(m["pcs"], dtype=np.int64) - start_pc)
        series[col] = s.groupby(level=0).sum() if s.index.has_duplicates else s
    reasons.sort()
    # a counted PC outside the function's code gets a row of its own, so that no count is lost
    counted = pd.Index(sorted({o for s in series.values() for o in s.index}))
    extra = counted.difference(pd.Index(base["offset"]))
    if len(extra):
        base = pd.concat([base, pd.DataFrame({"offset": extra, "sass": "" if has_sass else None, "file": None,
                                              "line": pd.array([None] * len(extra), dtype="Int64")})])
    base = base.sort_values("offset", kind="stable").reset_index(drop=True)
    base.insert(1, "pc", base["offset"] + start_pc)
    index = pd.Index(base["offset"])
    counters = {}
    for col in (list(METRIC_COLUMNS.values()) + [f"stall_{r}" for r in reasons]
                + [f"stall_{r}_not_issued" for r in reasons]):
        vals = series[col].reindex(index, fill_value=0) if col in series else pd.Series(0, index=index)
        vals = vals.to_numpy()
        counters[col] = vals.astype(np.int64) if np.all(np.mod(vals, 1) == 0) else vals.astype(float)
    zero = np.zeros(len(index), dtype=np.int64)
    counters["samples"] = sum((counters[f"stall_{r}"] for r in reasons), zero)
    counters["samples_not_issued"] = sum((counters[f"stall_{r}_not_issued"] for r in reasons), zero)
    df = pd.concat([base, pd.DataFrame(counters)], axis=1)
    raw_totals = data.get("totals") or {}
    totals = {METRIC_COLUMNS.get(n, n): v for n, v in raw_totals.items()}
    totals["samples"] = sum(v for n, v in raw_totals.items() if n.startswith(STALL_PREFIX)
                            and not n.endswith("_not_issued") and isinstance(v, (int, float)))
    totals["samples_not_issued"] = sum(v for n, v in raw_totals.items() if n.startswith(STALL_PREFIX)
                                       and n.endswith("_not_issued") and isinstance(v, (int, float)))
    summary, why = read_summary(path)
    prof = KernelProfile(path=path, name=str(k.get("name") or "?"), index=int(k.get("index") or 0),
                         kernels=[str(x.get("name")) for x in data.get("kernels") or []],
                         launch=dict(k.get("launch") or {}), pcs=df, reasons=reasons,
                         sources={str(f): str(t) for f, t in (data.get("sources") or {}).items()},
                         totals=totals, has_sass=has_sass, opcodes=dict(data.get("opcodes") or {}),
                         summary=summary, notes=[why] if why else [])
    dropped = prof.launch.get("samples_dropped_bytes")
    if isinstance(dropped, (int, float)) and dropped > 0:
        prof.notes.append(f"ncu dropped {dropped:,.0f} bytes of warp samples (its buffer was full): the samples "
                          "undercount; profile again with a larger --warp-sampling-buffer-size")
    if not reasons:
        prof.notes.append("the report has no warp-state sampling: profile with --section WarpStateStats "
                          "--section SourceCounters (workbench profile run does)")
    return prof
