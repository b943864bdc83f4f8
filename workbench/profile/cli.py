"""`workbench profile`: hardware counters per source line (Nsight Compute).

    workbench profile run SCRIPT_OR_MODULE[:FN] [--kernel REGEX] [--launch N] [--sections S ...] [--out DIR]
    workbench profile show REPORT [--kernel K] [--json] [--by pc] [--cache DIR] [--entry HASH]

`run` needs a GPU node with ncu; `show` runs anywhere (it reads the report with
NVIDIA's ``ncu-report`` package, no ncu, no GPU). Errors print one line that
says what to do and exit with 2; no traceback unless WORKBENCH_DEBUG=1.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from .report import ProfileError

# the columns of `show`'s table: (column, heading, width)
_NUM = [("instructions", "instr", 6), ("inst_executed", "executed", 12), ("samples", "samples", 8),
        ("samples_not_issued", "not issued", 10)]


def configure(parser: argparse.ArgumentParser) -> None:
    from . import run as run_module

    sub = parser.add_subparsers(dest="profile_command", metavar="SUBCOMMAND", required=True)
    p = sub.add_parser("run", help="profile one kernel launch with ncu (GPU node): report + JSON summary",
                       description=run_module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="SCRIPT_OR_MODULE[:FN]",
                   help="a script (run as __main__), or SCRIPT.py:FN / package.module:FN (FN() is called)")
    p.add_argument("--kernel", metavar="REGEX",
                   help="profile a kernel whose name matches (default: the first launched)")
    p.add_argument("--launch", type=int, default=1, metavar="N", help="its N-th matching launch (default 1)")
    p.add_argument("--sections", nargs="+", metavar="S", default=None,
                   help="ncu sections (default: SourceCounters WarpStateStats MemoryWorkloadAnalysis_Tables)")
    p.add_argument("--out", default="profiles", metavar="DIR", help="where the report goes (default profiles/)")
    p.add_argument("--name", help="file name of the report (default: FN, or the script's name)")
    p.add_argument("--cache", metavar="DIR",
                   help="Triton cache for the run (default: a fresh one, OUT/NAME.triton-cache)")
    p.add_argument("--ncu", metavar="PATH", help="the ncu to run (default: $NCU, PATH, /usr/local/cuda/bin/ncu)")
    p.add_argument("--clock-control", default="none", choices=["none", "base"],
                   help="ncu --clock-control (default none: the GPU's clocks are left alone)")
    p.add_argument("--timeout", type=float, default=600.0, metavar="S", help="stop the run after S seconds")
    p.add_argument("--csv", action="store_true", help="also write ncu's own per-instruction CSV (NAME.sass.csv)")
    p.add_argument("args", nargs="*", metavar="-- ARGS", help="arguments for the script (after --)")
    p.set_defaults(profile_func=cmd_run)

    p = sub.add_parser("show", help="the report's counters per source line (CPU, no ncu)")
    p.add_argument("report", metavar="REPORT", help="an .ncu-rep file")
    p.add_argument("--kernel", metavar="K", help="which kernel of the report: its number (from 0) or a regex")
    p.add_argument("--by", choices=["line", "pc"], default="line",
                   help="per source line (default) or per SASS instruction")
    p.add_argument("--cache", metavar="DIR", help="Triton cache holding the profiled kernel (adds inlined helpers' "
                                                  "call sites; default: the one named in the report's summary)")
    p.add_argument("--entry", metavar="HASH", help="the cache entry of the profiled kernel (hash prefix or directory)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(profile_func=cmd_show)


def run(args) -> int:
    from ..asm.cache import CacheError
    from ..cli_errors import run_command

    return run_command(args.profile_func, args, (ProfileError, CacheError))


# -- run -----------------------------------------------------------------------------


def cmd_run(args) -> int:
    from .run import DEFAULT_SECTIONS, profile

    extra = list(args.args)
    profile(args.target, out=args.out, name=args.name, kernel=args.kernel, launch=args.launch,
            sections=args.sections or DEFAULT_SECTIONS, cache=args.cache, ncu=args.ncu,
            clock_control=args.clock_control, timeout_s=args.timeout, args=extra, csv=args.csv,
            echo=lambda s: print(s, flush=True))
    return 0


# -- show ----------------------------------------------------------------------------


def open_report(report, kernel=None, cache=None, entry=None, sass=True):
    """(profile, SASS attribution or None, entry or None, notes) of one kernel of `report`.

    The entry of the profiled kernel: `entry` / `cache` as given, else the one
    the report's summary names. While a child reads the report, the entry is
    disassembled here. An entry the user named must be the profiled kernel; one
    from the summary that is missing or differs becomes a note.
    """
    from .report import read_summary, start

    explicit = bool(entry or cache)
    spec, where, notes = entry, cache, []
    summary, _ = read_summary(Path(report))
    if not explicit and summary and summary.get("hash") and summary.get("cache"):
        spec, where = str(summary["hash"]), Path(report).parent / str(summary["cache"])
    pending = start(report, kernel, sass)  # first: pandas and the disassembly below overlap with the child
    from ..asm.cache import CacheError
    from .lines import find_entry, join_entry

    early = None
    try:
        if spec:
            try:
                early = _disassemble(spec, where)
            except (CacheError, ProfileError) as exc:
                if explicit:
                    raise
                notes.append(f"the report's Triton cache entry is not usable here ({exc}): lines as the report "
                             "gives them, without inlined helpers' call sites")
                spec = where = None
        prof = pending.result()
    finally:
        pending.kill()
    if not (spec or where):
        return prof, None, None, notes
    try:
        if early is not None:
            return prof, join_entry(prof, early[0], early[1]), early[0], notes
        found, attr = find_entry(prof, where)
        return prof, attr, found, notes
    except ProfileError as exc:
        if explicit:
            raise
        notes.append(f"{exc}; lines as the report gives them")
        return prof, None, None, notes


def _disassemble(spec, where):
    """(entry, its SASS attribution)."""
    from ..asm.cache import get_entry
    from ..asm.lines import entry_lines

    found = get_entry(spec, where)
    return found, entry_lines(found, "sass")


def cmd_show(args) -> int:
    # the line view needs no SASS text from the report (the library's disassembly is most of its reading time)
    prof, attr, entry, notes = open_report(args.report, args.kernel, args.cache, args.entry, sass=args.by == "pc")
    from .lines import line_table, no_line_note, pc_table

    notes = prof.notes + notes
    if no_line_note(prof):
        notes.append(no_line_note(prof))
    if len(prof.kernels) > 1:
        notes.append(f"kernel {prof.index} of {len(prof.kernels)} in the report (--kernel picks another: "
                     + ", ".join(f"{i}: {n}" for i, n in enumerate(prof.kernels[:8])) + ")")
    pcs = pc_table(prof, attr)
    table = line_table(prof, attr, pcs) if args.by == "line" else pcs
    if args.json:
        print(json.dumps(_json(prof, entry, table, args.by, notes), indent=1, default=_jsonable))
        return 0
    print("\n".join(_header(prof, entry, pcs) + (_render_lines(prof, table) if args.by == "line"
                                             else _render_pcs(prof, table))
                    + [f"note: {n}" for n in notes]))
    return 0


def _jsonable(v):
    if hasattr(v, "item"):
        return v.item()
    return None if v is None or v != v else str(v)


def _reasons(row, prof, not_issued=False) -> dict:
    out = {r: row.get(f"stall_{r}_not_issued" if not_issued else f"stall_{r}", 0) for r in prof.reasons}
    return {r: v for r, v in sorted(out.items(), key=lambda kv: -kv[1]) if v}


def _json(prof, entry, table, by, notes) -> dict:
    import pandas as pd

    rows = []
    drop = set(prof.reason_columns()) | set(prof.reason_columns(not_issued=True))
    for rec in table.to_dict(orient="records"):
        row = {k: (None if v is pd.NA or (isinstance(v, float) and v != v) else v) for k, v in rec.items()
               if k not in drop}
        if by == "pc":
            row["via"] = [list(x) for x in rec.get("via") or ()]
        row["reasons"] = _reasons(rec, prof)
        row["reasons_not_issued"] = _reasons(rec, prof, not_issued=True)
        rows.append(row)
    return {"report": str(prof.path), "kernel": prof.name, "index": prof.index, "kernels": prof.kernels,
            "launch": prof.launch, "entry": {"hash": entry.hash, "path": str(entry.path)} if entry else None,
            "line_info": prof.line_info, "reasons": prof.reasons,
            "totals": {k: prof.totals.get(k) for k in ("samples", "samples_not_issued", "inst_executed")},
            "by": by, "rows": rows, "notes": notes}


def _header(prof, entry, t) -> list[str]:
    lines = [prof.label()]
    if entry is not None:
        lines.append(f"lines and call sites from Triton cache entry {entry.hash[:12]} ({entry.path.parent})")
    known = t["sass"].notna() & (t["sass"] != "")
    lines.append(f"{int(t['samples'].sum()):,} warp-state samples ({int(t['samples_not_issued'].sum()):,} not issued), "
                 f"{int(t['inst_executed'].sum()):,} warp instructions executed"
                 + (f", {int(known.sum()):,} SASS instructions" if known.any() else ""))
    return lines + [""]


def _memory_cols(prof, table) -> list[tuple[str, str]]:
    from .lines import MEMORY_COLUMNS

    return [(c, label) for c, label in MEMORY_COLUMNS.items() if c in table.columns and table[c].sum() > 0]


def _fmt(v) -> str:
    import pandas as pd

    if v is None or v is pd.NA or v != v:
        return ""
    return f"{int(v):,}" if float(v).is_integer() else f"{v:,.1f}"


def _clip(text: str, width: int) -> str:
    text = text.rstrip().expandtabs(4)
    return text if len(text) <= width else text[: width - 3] + "..."


def _render_lines(prof, table) -> list[str]:
    import pandas as pd

    mem = _memory_cols(prof, table)
    width = min(56, max([len(str(s).strip()) for s in table["source"]] + [20]))
    head = (f"  {'line':>5}  {'source':<{width}}" + "".join(f"  {h:>{w}}" for _, h, w in _NUM)
            + f"  {'share':>6}  {'top stall reasons':<44}" + "".join(f"  {label:>20}" for _, label in mem))
    out, last = [], object()
    for r in table.to_dict(orient="records"):
        if r["file"] != last:
            out += [f"  {r['file'] if isinstance(r['file'], str) else ''}", head]
            last = r["file"]
        num = "" if r["line"] is pd.NA or r["line"] is None else r["line"]
        src = str(r["source"]).strip() if num != "" else str(r["source"])
        row = (f"  {num:>5}  {_clip(src, width):<{width}}" + "".join(f"  {_fmt(r[c]):>{w}}" for c, _, w in _NUM)
               + f"  {r['share']:>6.1%}  {_clip(r['top_reasons'], 44):<44}"
               + "".join(f"  {_fmt(r[c]):>20}" for c, _ in mem))
        out.append(row.rstrip())
        extra = []
        if r.get("via"):
            extra.append(f"inlined, called from {r['via']}")
        if r.get("calls_samples"):
            extra.append(f"+{_fmt(r['calls_samples'])} samples ({r['calls_share']:.1%}) in the helpers it inlines")
        if extra:
            out.append(f"  {'':>5}    " + "; ".join(extra))
    total = {c: table[c].sum() if table[c].notna().any() else None for c, _, _ in _NUM}
    out.append(f"  {'total':>5}  {'':<{width}}" + "".join(f"  {_fmt(total[c]):>{w}}" for c, _, w in _NUM)
               + f"  {table['share'].sum():>6.1%}")
    return out


def _render_pcs(prof, pcs) -> list[str]:
    import pandas as pd

    from .lines import top_reasons, via_str

    mem = _memory_cols(prof, pcs)
    head = (f"  {'offset':>6}  {'sass':<44}  {'line':<22}  {'executed':>12}  {'samples':>8}  {'not issued':>10}  "
            f"{'top stall reasons':<36}" + "".join(f"  {label:>20}" for _, label in mem))
    out = [head]
    for r in pcs.to_dict(orient="records"):
        where = "" if r["line"] is pd.NA or r["line"] is None else f"{os.path.basename(r['file'])}:{r['line']}"
        if r.get("via"):
            where += " < " + via_str(r["via"])
        reasons = top_reasons({x: r.get(f"stall_{x}", 0) for x in prof.reasons}, r["samples"], 2)
        out.append((f"  {r['offset']:>6x}  {_clip(r['sass'] or '', 44):<44}  {_clip(where, 22):<22}  "
                    f"{_fmt(r['inst_executed']):>12}  {_fmt(r['samples']):>8}  {_fmt(r['samples_not_issued']):>10}  "
                    f"{_clip(reasons, 36):<36}" + "".join(f"  {_fmt(r[c]):>20}" for c, _ in mem)).rstrip())
    return out
