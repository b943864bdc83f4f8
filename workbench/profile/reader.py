"""Read one kernel of an Nsight Compute report into plain JSON (runs in a child process).

    python workbench/profile/reader.py REPORT [--kernel K] [--no-sass]

A report is untrusted input handed to a native library (NVIDIA's ``ncu_report``
reader): `workbench.profile.report.load` runs this module in a child process,
with a memory limit and a deadline, so that a report that crashes or hangs the
library costs an error message, not the caller. The child writes one JSON
object to stdout: the report's kernels, and for the chosen one its SASS
instructions (offset from the function's start, text, source file and line;
with --no-sass only those with a counter, without their text: the library
disassembles the kernel for the text, most of the time a large kernel takes),
the per-PC counters (instruction counts, warp-state samples by stall reason,
memory traffic), each as the metric's correlation ids and values, and ncu's
warp instructions executed per opcode.
Errors go out as ``{"error": "..."}`` with exit status 2.

`check_container` (also used by the parent before it starts a child) walks the
report's framing without the library: the ``NVR\\0`` magic, a length-prefixed
file header, then blocks, each a length-prefixed header whose protobuf field 5
is the size of the payload that follows. The walk must end exactly at the end
of the file: a truncated report, or one whose sizes are corrupt, fails here
with the byte where it breaks. (Layout read from reports of ncu 2025.3.1.)

Only the standard library and ``ncu_report`` are imported here: the child
starts in well under a second.
"""
from __future__ import annotations

import json
import os
import re
import resource
import struct
import sys

MAGIC = b"NVR\x00"
MAX_HEADER_BYTES = 1 << 20   # a block header is ~130 bytes, the file header 2
MAX_BLOCKS = 1 << 22
MAX_INSTRUCTIONS = 1 << 21   # SASS instructions walked in one function (the largest here: 1,744)
MAX_INSTANCES = 1 << 22      # values of one per-PC metric
MAX_TEXT = 1 << 12           # characters of one SASS line or name kept
STALL_PREFIX = "smsp__pcsamp_warps_issue_stalled_"
# Per-PC metrics besides the stall reasons (found by STALL_PREFIX): name in the report.
PER_PC = (
    "inst_executed", "thread_inst_executed", "thread_inst_executed_true", "smsp__pcsamp_sample_count",
    "memory_l2_theoretical_sectors_global", "memory_l2_theoretical_sectors_global_ideal",
    "derived__memory_l2_theoretical_sectors_global_excessive", "memory_l1_tag_requests_global",
    "memory_l1_wavefronts_shared", "memory_l1_wavefronts_shared_ideal",
    "derived__memory_l1_wavefronts_shared_excessive", "smsp__branch_targets_threads_divergent",
)
# Single-value metrics kept for the kernel's header line.
LAUNCH = {
    "grid": ("launch__grid_dim_x", "launch__grid_dim_y", "launch__grid_dim_z"),
    "block": ("launch__block_dim_x", "launch__block_dim_y", "launch__block_dim_z"),
    "registers": ("launch__registers_per_thread",),
    "shared_bytes": ("launch__shared_mem_per_block",),
    "device": ("device__attribute_display_name",),
    "cc": ("device__attribute_compute_capability_major", "device__attribute_compute_capability_minor"),
    "duration_ns": ("gpu__time_duration.sum",),
    "sample_interval_cycles": ("smsp__pcsamp_interval_cycles",),
    "samples_dropped_bytes": ("smsp__pcsamp_dropped_bytes",),
}


class ReportError(Exception):
    """The report cannot be read; the message says why and what to do."""


# ---------------------------------------------------------------------------
# the container, without the library


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        if i >= len(buf) or shift > 63:
            raise ValueError("bad varint")
        c = buf[i]
        i += 1
        value |= (c & 0x7F) << shift
        shift += 7
        if not c & 0x80:
            return value, i


def _payload_size(header: bytes) -> int:
    """Field 5 (a varint) of a block header; 0 when absent. Raises ValueError on a malformed header."""
    i, size = 0, 0
    while i < len(header):
        key, i = _varint(header, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(header, i)
            if field == 5:
                size = value
        elif wire == 2:
            n, i = _varint(header, i)
            i += n
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ValueError(f"wire type {wire}")
        if i > len(header):
            raise ValueError("field runs past the header")
    return size


def check_container(path: str, size: int | None = None) -> int:
    """Walk the report's framing; return the number of blocks. Raises ReportError where it breaks."""
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size if size is None else size
        head = fh.read(8)
        if len(head) < 8 or head[:4] != MAGIC:
            shown = head[:8].hex(" ") if head else "nothing"
            raise ReportError(f"{path}: not an Nsight Compute report (a .ncu-rep starts with 'NVR\\0'; this one "
                              f"with {shown}): give the report ncu wrote with -o / --export")
        pos = 8 + struct.unpack_from("<I", head, 4)[0]
        blocks, broken = 0, None
        while pos < size and broken is None:
            fh.seek(pos)
            raw = fh.read(4)
            n = struct.unpack("<I", raw)[0] if len(raw) == 4 else None
            if n is None or n > MAX_HEADER_BYTES or pos + 4 + n > size:
                broken = f"the block header at byte {pos:,} runs past the end"
                break
            try:
                payload = _payload_size(fh.read(n))
            except ValueError:
                broken = f"the block header at byte {pos:,} is not readable"
                break
            if pos + 4 + n + payload > size:
                broken = (f"the block at byte {pos:,} holds {payload:,} bytes but the file ends "
                          f"{size - pos - 4 - n:,} bytes after its header")
            pos += 4 + n + payload
            blocks += 1
            if blocks > MAX_BLOCKS:
                broken = f"more than {MAX_BLOCKS:,} blocks"
        if broken is None and (pos != size or blocks == 0):
            broken = "it holds no block" if blocks == 0 else f"its header claims {pos - size:,} bytes past the end"
        if broken is not None:
            raise ReportError(f"{path}: truncated or corrupt report ({size:,} bytes): {broken} (a copy cut short, "
                              "or a report still being written?); profile again or copy the whole file")
        return blocks


# ---------------------------------------------------------------------------
# the library


def _text(s) -> str:
    return s[:MAX_TEXT] if isinstance(s, str) else ""


def _value(metric, i=None):
    v = metric.value() if i is None else metric.value(i)
    if isinstance(v, float) and v != v:  # NaN
        return None
    return v if isinstance(v, (int, float, str)) else None


def _instanced(action, name: str) -> dict | None:
    m = action.metric_by_name(name)
    if m is None:
        return None
    n = m.num_instances()
    if n == 0 or not m.has_correlation_ids():
        return None
    if n > MAX_INSTANCES:
        raise ReportError(f"metric {name} has {n:,} instances (more than {MAX_INSTANCES:,}): not a kernel's per-PC "
                          "counters; refusing the report")
    ids = m.correlation_ids()
    if ids is None or ids.num_instances() != n:
        raise ReportError(f"metric {name}: {n} values but the correlation ids do not match; the report is corrupt")
    # the typed getters: IMetric.value() dispatches on the kind per call, ten times slower
    kind = m.kind()
    get = m.as_double if kind in (m.ValueKind_DOUBLE, m.ValueKind_FLOAT) else m.as_uint64
    pcs, vals = [ids.as_uint64(i) for i in range(n)], [get(i) for i in range(n)]
    if not all(isinstance(pc, int) for pc in pcs) or not all(isinstance(v, (int, float)) and v == v for v in vals):
        raise ReportError(f"metric {name}: a value that is not a number at a PC; the report is corrupt")
    total = _value(m)
    return {"pcs": pcs, "values": vals, "total": total if isinstance(total, (int, float)) else None}


def _single(action, names) -> list:
    out = []
    for n in names:
        m = action.metric_by_name(n)
        out.append(None if m is None else _value(m))
    return out


def _kernels(ctx) -> list[tuple[int, int, object]]:
    out = []
    for r in range(ctx.num_ranges()):
        rng = ctx.range_by_idx(r)
        for a in range(rng.num_actions()):
            out.append((r, a, rng.action_by_idx(a)))
    return out


def _pick(kernels, want: str | None):
    names = [_text(a.name()) for _, _, a in kernels]
    if not kernels:
        raise ReportError("the report holds no kernel (corrupt, or ncu profiled nothing: check its -k filter)")
    if want is None or want == "":
        return 0
    if re.fullmatch(r"\d+", want):
        i = int(want)
        if i >= len(kernels):
            raise ReportError(f"--kernel {want}: the report holds {len(kernels)} kernel(s), numbered from 0: "
                              + ", ".join(f"{k}: {n}" for k, n in enumerate(names[:20])))
        return i
    try:
        pattern = re.compile(want)
    except re.error as exc:
        raise ReportError(f"--kernel {want!r} is not a regular expression ({exc})") from None
    for i, n in enumerate(names):
        if pattern.search(n):
            return i
    raise ReportError(f"--kernel {want!r} matches none of the report's kernels: " + ", ".join(names[:20]))


def _source(action, pc: int, files: dict) -> tuple[int, int | None]:
    info = action.source_info(pc)
    if info is None:
        return -1, None
    f = _text(info.file_name())
    if not f:
        return -1, None
    ln = info.line()
    return files.setdefault(f, len(files)), (ln if isinstance(ln, int) and ln > 0 else None)


def _instructions(action, start: int, counted: set, sass: bool) -> tuple[list, list]:
    """[[offset, SASS text or None, file index, line]] and the files.

    With `sass`, every instruction of the function, walked from its first one
    (the library disassembles the kernel on the first call: most of this
    process's time on a large kernel); without, the instructions that have a
    counter, their text left out.
    """
    files: dict[str, int] = {}
    rows = []
    if not sass:
        for pc in sorted(counted):
            rows.append([pc - start, None, *_source(action, pc, files)])
        return rows, list(files)
    off = 0
    while off < 16 * MAX_INSTRUCTIONS:
        text = action.sass_by_pc(start + off)
        if not text:
            break
        rows.append([off, _text(text).strip(), *_source(action, start + off, files)])
        off += 16
    return rows, list(files)


def _opcodes(action) -> dict:
    """{opcode: warp instructions executed} (ncu's own sums, which the join with a cache entry checks)."""
    m = action.metric_by_name("sass__inst_executed_per_opcode")
    if m is None or not m.has_correlation_ids() or not 0 < m.num_instances() <= MAX_INSTANCES:
        return {}
    ids = m.correlation_ids()
    out = {}
    for i in range(m.num_instances()):
        op, v = ids.value(i), _value(m, i)
        if isinstance(op, str) and isinstance(v, (int, float)):
            out[op[:MAX_TEXT]] = v
    return out


def read(path: str, kernel: str | None = None, sass: bool = True) -> dict:
    """The report's kernels and the chosen one's instructions and per-PC counters (see the module docstring)."""
    import ncu_report

    ctx = ncu_report.load_report(path)
    kernels = _kernels(ctx)
    k = _pick(kernels, kernel)
    r_idx, a_idx, action = kernels[k]
    name = action.name()
    if not isinstance(name, str) or not name:
        raise ReportError("the chosen kernel has no name: the report is truncated or corrupt")
    names = action.metric_names()
    metrics, totals = {}, {}
    wanted = list(PER_PC) + sorted(n for n in names if isinstance(n, str) and n.startswith(STALL_PREFIX))
    for n in wanted:
        got = _instanced(action, n)
        if got is not None:
            totals[n] = got.pop("total")
            metrics[n] = got
    if "inst_executed" not in metrics and not any(n.startswith(STALL_PREFIX) for n in metrics):
        raise ReportError(f"kernel {name}: no source counters (inst_executed) and no warp-state sampling in the "
                          "report: profile with --section SourceCounters --section WarpStateStats "
                          "(workbench profile run does)")
    fpc = action.metric_by_name("launch__function_pcs")  # instanced: one value, the kernel's first PC
    start = None if fpc is None else _value(fpc, 0) if fpc.num_instances() else _value(fpc)
    if not isinstance(start, int) or start <= 0:
        pcs = [pc for m in metrics.values() for pc in m["pcs"]]
        start = min(pcs) if pcs else 0
    counted = {pc for m in metrics.values() for pc in m["pcs"]}
    instructions, files = _instructions(action, start, counted, sass)
    sources = {}
    try:
        embedded = action.source_files()
    except Exception:  # the counters stand without the text
        embedded = {}
    for f, text in dict(embedded).items():
        if isinstance(f, str) and isinstance(text, str) and text:
            sources[f[:MAX_TEXT]] = text
    launch = {key: _single(action, ms) for key, ms in LAUNCH.items()}
    launch = {k: (v[0] if len(v) == 1 else v) for k, v in launch.items()}
    return {
        "format": 1,
        "kernels": [{"index": i, "range": r, "name": _text(a.name())} for i, (r, _, a) in enumerate(kernels)],
        "kernel": {"index": k, "range": r_idx, "action": a_idx, "name": name[:MAX_TEXT],
                   "mangled": _text(action.name(ncu_report.IAction.NameBase_MANGLED)),
                   "function_pc": start, "launch": launch},
        "instructions": instructions, "sass": sass, "files": files, "sources": sources,
        "opcodes": _opcodes(action),
        "metrics": metrics, "totals": totals,
    }


def _limit_memory(path: str) -> None:
    """The native reader gets at most 4 GiB plus four times the report (a real one needs < 1 GiB)."""
    cap = (4 << 30) + 4 * os.path.getsize(path)
    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (cap if hard == resource.RLIM_INFINITY else min(cap, hard), hard))
    except (ValueError, OSError):  # a platform without RLIMIT_AS: the parent's deadline still holds
        pass


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="reader.py")
    p.add_argument("report")
    p.add_argument("--kernel", default=None)
    p.add_argument("--no-sass", action="store_true", help="leave the SASS text out (no disassembly)")
    args = p.parse_args(argv)
    try:
        check_container(args.report)
        _limit_memory(args.report)
        out = read(args.report, args.kernel, sass=not args.no_sass)
    except ReportError as exc:
        out, rc = {"error": str(exc)}, 2
    except ImportError as exc:
        out, rc = {"error": f"cannot import ncu_report ({exc})", "missing": "ncu_report"}, 3
    except MemoryError:
        out, rc = {"error": "the reader ran out of its memory limit on this report"}, 2
    except Exception as exc:  # the library's own errors on a damaged report
        out, rc = {"error": f"the report cannot be read ({type(exc).__name__}: {str(exc)[:300]})"}, 2
    else:
        rc = 0
    sys.stdout.write(json.dumps(out, separators=(",", ":")))
    sys.stdout.flush()
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
