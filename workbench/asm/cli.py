"""`workbench asm`: list, show, measure, diff and cross-compile kernels in the Triton cache;
map instructions to the source lines that made them (`lines`, `diff --by-line`).

Every sub-command takes --cache DIR and --json. Errors print one line that
says what to do and exit with 2; no traceback reaches the user unless
WORKBENCH_DEBUG=1.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from datetime import datetime

from .cache import ALL_STAGES, CacheError, Entry, get_entry, group_entries, list_entries, select

LS_COLUMNS = ["hash", "name", "backend", "arch", "num_warps", "num_stages", "shared", "triton_version", "stages", "mtime"]


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="asm_command", metavar="SUBCOMMAND", required=True)

    def add(name, help_, func):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--cache", metavar="DIR", help="Triton cache (default $TRITON_CACHE_DIR, else ~/.triton/cache)")
        p.add_argument("--json", action="store_true", help="print JSON instead of a table")
        p.set_defaults(asm_func=func)
        return p

    p = add("ls", "list entries (metadata only; assembly is not read)", cmd_ls)
    p.add_argument("--name", help="kernel name (exact or regex)")
    p.add_argument("--backend", help="cuda or hip")
    p.add_argument("--arch", help="e.g. sm90, gfx942")
    p.add_argument("--groups", action="store_true", help="group specializations of one kernel and show what differs")

    p = add("show", "print one stage of an entry", cmd_show)
    p.add_argument("entry", help="hash prefix, entry directory, or kernel name")
    p.add_argument("--stage", default=None, help=f"one of {', '.join(ALL_STAGES)} (default: final assembly)")

    p = add("mix", "instruction mix: memory ops by space, kind and width; matrix ops; barriers", cmd_mix)
    p.add_argument("entry")
    p.add_argument("--stage", default=None, help="ptx, amdgcn or sass (default: ptx or amdgcn)")
    p.add_argument("--opcodes", action="store_true",
                   help="count every instruction by opcode instead (arithmetic and bit operations included)")

    p = add("lines", "the kernel's source, one row per line, with the instructions each line produced", cmd_lines)
    p.add_argument("entry")
    p.add_argument("--stage", action="append", default=None,
                   help="source, ttir, ttgir, llir, ptx, sass or amdgcn (repeat or comma-separate; "
                        "default: ptx or amdgcn)")
    p.add_argument("--line", type=int, metavar="N", help="print the instructions of source line N")
    p.add_argument("--file", help="with --line: the source file (name or path) when several are involved")
    p.add_argument("--counters", metavar="REPORT", help="add the measured counters of an Nsight Compute report of "
                                                        "this kernel per line (workbench profile run makes one)")

    p = add("res", "resource use: registers, spills, scratch, shared memory, occupancy", cmd_res)
    p.add_argument("entry")

    p = add("diff", "diff two entries: stage text, mix and opcode deltas, metadata", cmd_diff)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--stage", default=None)
    p.add_argument("--context", type=int, default=2, help="unchanged lines shown around each change")
    p.add_argument("--by-line", action="store_true",
                   help="show which source lines' instruction mix changed instead of the text diff")
    p.add_argument("--counters", nargs=2, metavar=("REPORT_A", "REPORT_B"),
                   help="with --by-line: also which lines' stall samples and memory traffic changed, from an "
                        "Nsight Compute report of each kernel")

    p = add("compile", "cross-compile MODULE:FUNCTION for named targets (no GPU needed)", cmd_compile)
    p.add_argument("function", metavar="MODULE:FUNCTION")
    p.add_argument("--target", action="append", required=True, help="sm90, sm100, gfx942, gfx950, gfx1100, ... (repeat or comma-separate)")
    p.add_argument("--arg", action="append", default=[], metavar="NAME=TYPE", help="type of a runtime argument, e.g. x_ptr=*fp16 n=i32")
    p.add_argument("--constexpr", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--divisible", action="append", default=[], metavar="NAME", help="argument known 16-byte aligned / divisible by 16")
    p.add_argument("--num-warps", type=int)
    p.add_argument("--num-stages", type=int)


def run(args) -> int:
    from ..profile.report import ProfileError
    from ..cli_errors import run_command

    return run_command(args.asm_func, args, (CacheError, ProfileError))


# -- helpers -------------------------------------------------------------------


def _emit(args, obj, table: str) -> None:
    if args.json:
        print(json.dumps(obj, indent=1, default=str))
    else:
        print(table)


def _frame(rows: list[dict], columns: list[str] | None = None):
    import pandas as pd

    df = pd.DataFrame(rows, columns=columns)
    return df


def _resolve(spec: str, cache) -> Entry:
    """Hash prefix or directory; failing that, a unique kernel name."""
    try:
        return get_entry(spec, cache)
    except CacheError as first:
        if os.sep in spec:
            raise
        hits = select(list_entries(cache), name=spec) if spec.replace("_", "").isalnum() else []
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            opts = ", ".join(f"{e.hash[:10]} ({e.arch}, {e.num_warps}w)" for e in hits[:8])
            raise CacheError(f"{len(hits)} entries of kernel {spec!r}: pick one by hash prefix: {opts}") from None
        raise first


def _short(row: dict) -> dict:
    out = dict(row)
    out["hash"] = row["hash"][:12]
    out["stages"] = ",".join(row["stages"])
    try:  # a damaged file system can carry any time stamp
        out["mtime"] = datetime.fromtimestamp(row["mtime"]).strftime("%Y-%m-%d %H:%M") if row["mtime"] else ""
    except (ValueError, OverflowError, OSError):
        out["mtime"] = "?"
    return out


def _problem_lines(entries: list[Entry]) -> list[str]:
    return [f"  {e.path}: {p}" for e in entries for p in e.problems]


def _warn(entry: Entry, since: int = 0) -> None:
    """Print the entry's problems from index `since` on (later ones come from reading assembly)."""
    for p in entry.problems[since:]:
        print(f"warning: {entry.path}: {p}", file=sys.stderr)


def _open(spec: str, cache) -> Entry:
    """The entry `spec` names, its known problems printed as warnings."""
    entry = _resolve(spec, cache)
    _warn(entry)
    return entry


# -- sub-commands ----------------------------------------------------------------


def cmd_ls(args) -> int:
    entries = list_entries(args.cache)
    entries = select(entries, name=args.name, backend=args.backend, arch=args.arch)
    if args.groups:
        return _ls_groups(args, entries)
    rows = [e.summary() for e in entries]
    if args.json:
        _emit(args, rows, "")
        return 0
    if not rows:
        print("no entries")
        return 0
    table = _frame([_short(r) for r in rows], LS_COLUMNS).to_string(index=False)
    problems = _problem_lines(entries)
    if problems:
        table += f"\n\n{sum(bool(e.problems) for e in entries)} entries with problems:\n" + "\n".join(problems)
    print(table)
    return 0


def _ls_groups(args, entries) -> int:
    groups = group_entries(entries)
    data = [{"name": g.name, "location": list(g.location) if g.location else None,
             "hashes": [e.hash for e in g.entries], "differences": g.differences()} for g in groups]
    lines = []
    for g, d in zip(groups, data):
        where = f"{g.location[0]}:{g.location[1]}" if g.location else "?"
        lines.append(f"{g.name}  ({len(g.entries)} entries, {where})")
        header = "    " + "  ".join(e.hash[:10] for e in g.entries)
        lines.append(header)
        for section, keys in d["differences"].items():
            for key, vals in keys.items():
                lines.append(f"    {section}.{key}: " + " | ".join(str(v) for v in vals))
    _emit(args, data, "\n".join(lines) or "no entries")
    return 0


def cmd_show(args) -> int:
    entry = _open(args.entry, args.cache)
    stage = args.stage or entry.final_stage
    text = entry.text(stage)
    _emit(args, {"hash": entry.hash, "path": str(entry.path), "stage": stage, "text": text}, text.rstrip("\n"))
    return 0


def cmd_mix(args) -> int:
    entry = _open(args.entry, args.cache)
    stage = args.stage or entry.final_stage
    known = len(entry.problems)
    df = entry.opcodes(stage) if args.opcodes else entry.mix(stage)
    _warn(entry, known)  # e.g. truncated assembly
    rows = json.loads(df.to_json(orient="records"))
    title = f"{entry.name} {entry.arch} [{entry.hash[:12]}] {stage}\n"
    _emit(args, rows, title + (df.to_string(index=False) if len(df) else "no instructions recognised"))
    return 0


def cmd_res(args) -> int:
    entry = _open(args.entry, args.cache)
    res = entry.resources()
    lines = [f"{entry.name} {entry.arch} [{entry.hash[:12]}]"] + [f"  {k}: {v}" for k, v in res.items()]
    _emit(args, res, "\n".join(lines))
    return 0


def cmd_diff(args) -> int:
    from .diff import diff_entries

    if args.counters and not args.by_line:
        raise CacheError("--counters compares the reports line by line: give --by-line too")
    a, b = _open(args.a, args.cache), _open(args.b, args.cache)
    if args.by_line:
        return _diff_by_line(args, a, b)
    known = len(a.problems), len(b.problems)
    d = diff_entries(a, b, args.stage)
    _warn(a, known[0])
    _warn(b, known[1])
    if args.json:
        _emit(args, {
            "stage": d.stage, "a": a.hash, "b": b.hash,
            "metadata": {k: list(v) for k, v in d.metadata.items()},
            "mix": json.loads(d.mix.to_json(orient="records")),
            "opcodes": json.loads(d.opcodes[d.opcodes["delta"] != 0].to_json(orient="records")),
            "rows": [r.__dict__ for r in d.rows if r.tag != "equal"],
        }, "")
        return 0
    out = [f"a: {a.name} {a.arch} [{a.hash[:12]}]", f"b: {b.name} {b.arch} [{b.hash[:12]}]", f"stage: {d.stage}", ""]
    if d.metadata:
        out.append("metadata that differs:")
        out += [f"  {k}: {va} -> {vb}" for k, (va, vb) in d.metadata.items()]
        out.append("")
    changed = d.mix[d.mix["delta"] != 0] if len(d.mix) else d.mix
    if len(changed):
        out.append("instruction mix delta (a -> b):")
        out += ["  " + line for line in changed.to_string(index=False).splitlines()]
        out.append("")
    ops = d.opcodes[d.opcodes["delta"] != 0]
    if len(ops):
        out.append("opcodes whose count changed (a -> b):")
        out += ["  " + line for line in ops.to_string(index=False).splitlines()]
        out.append("")
    out.append(f"{d.changed_lines} changed lines:")
    out += _render_side_by_side(d.rows, args.context)
    print("\n".join(out))
    return 0


def _render_side_by_side(rows, context: int) -> list[str]:
    width = max(40, (shutil.get_terminal_size((160, 24)).columns - 16) // 2)
    keep = set()
    for i, r in enumerate(rows):
        if r.tag != "equal":
            keep.update(range(max(0, i - context), min(len(rows), i + context + 1)))
    mark = {"equal": " ", "replace": "|", "delete": "<", "insert": ">"}
    lines, last = [], -1
    for i in sorted(keep):
        if last >= 0 and i != last + 1:
            lines.append("  ...")
        r = rows[i]
        a = r.a.expandtabs(4)[:width].ljust(width)
        b = r.b.expandtabs(4)[:width]
        lines.append(f"{r.a_no or '':>5} {a} {mark[r.tag]} {r.b_no or '':>5} {b}")
        last = i
    return lines


def _parse_value(text: str):
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _pairs(items: list[str], what: str) -> dict:
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise CacheError(f"--{what} {item!r}: write NAME=VALUE")
        out[name.strip()] = value.strip()
    return out


def cmd_compile(args) -> int:
    from .cache import cache_dir
    from .compile import cross_compile

    targets = [t for group in args.target for t in group.split(",") if t]
    cache = cache_dir(args.cache, create=True)
    constexprs = {k: _parse_value(v) for k, v in _pairs(args.constexpr, "constexpr").items()}
    sys.path.insert(0, os.getcwd())  # MODULE may be a file of the current directory
    entries = cross_compile(
        args.function, targets, signature=_pairs(args.arg, "arg"), constexprs=constexprs,
        divisible=args.divisible, num_warps=args.num_warps, num_stages=args.num_stages, cache_dir=cache,
    )
    rows = [e.summary() for e in entries]
    _emit(args, rows, _frame([_short(r) for r in rows], LS_COLUMNS + ["path"]).to_string(index=False))
    return 0


# -- source lines -----------------------------------------------------------------


def _stages_arg(values, entry: Entry) -> list[str]:
    from .cache import normalize_stage

    stages = [normalize_stage(s) for v in (values or [entry.final_stage]) for s in v.split(",") if s]
    return list(dict.fromkeys(stages))


def _note(entry: Entry, attr) -> None:
    if attr.note:
        print(f"warning: {entry.path}: {attr.note}", file=sys.stderr)


def cmd_lines(args) -> int:
    from .lines import entry_lines, line_instructions, line_table, source_view

    entry = _open(args.entry, args.cache)
    if args.file and args.line is None:
        raise CacheError("--file picks the file of --line N: give --line too")
    counters = None
    if args.counters:  # the report's counters per line, through this entry's SASS attribution
        from ..profile.inspector import counters_for

        counters = counters_for(entry, args.counters)[1]
    out_rows, meta, text_out, instrs = [], {}, [], []
    for stage in _stages_arg(args.stage, entry):
        attr = entry_lines(entry, stage)
        _note(entry, attr)
        meta[stage] = {"line_info": attr.line_info, "note": attr.note}
        table = line_table(attr)
        text_out.append(f"{entry.name} {entry.arch} [{entry.hash[:12]}] {stage}")
        if args.line is not None:
            picked = line_instructions(attr, args.line, args.file)
            for i in picked:
                row = _instr_row(attr, i)
                instrs.append(row)
                if i.category != "other":
                    out_rows.append(row)
            text_out += _render_line(attr, args.line, picked)
        else:
            out_rows += json.loads(table.to_json(orient="records"))
            view = source_view(attr)
            if counters is not None:
                from ..profile.inspector import annotate_view

                view = annotate_view(view, counters)
            text_out += _render_source(view)
        text_out.append("")
    obj = {"hash": entry.hash, "name": entry.name, "arch": entry.arch, "stages": meta, "rows": out_rows}
    if counters is not None:
        obj["counters"] = _counter_rows(counters)
    if args.line is not None:
        obj = dict(obj, line=args.line, rows=_count_rows(out_rows), instructions=instrs)
    _emit(args, obj, "\n".join(text_out).rstrip())
    return 0


def _instr_row(attr, i) -> dict:
    from .lines import via_text, instr_text

    return {"stage": i.stage, "text_line": i.text_line, "text": instr_text(attr, i),
            "file": i.file, "line": i.line, "via": via_text(i.via), "category": i.category, "space": i.space,
            "kind": i.kind, "width_bits": i.width_bits, "mnemonic": i.mnemonic}


def _count_rows(rows: list[dict]) -> list[dict]:
    """--line's JSON rows: counts per (stage, file, line, via, class), like the table's."""
    keys = ("file", "line", "via", "stage", "category", "space", "kind", "width_bits")
    counts: dict[tuple, int] = {}
    for r in rows:
        k = tuple(r[c] for c in keys)
        counts[k] = counts.get(k, 0) + 1
    return [dict(zip(keys, k), count=n) for k, n in counts.items()]


def _render_source(view) -> list[str]:
    import pandas as pd

    width = min(72, max([len(s.rstrip()) for s in view["source"]] + [20]))
    lines, last = [], object()
    for r in view.itertuples(index=False):
        if r.file != last and isinstance(r.file, str):
            lines.append(f"  {r.file}")
        last = r.file
        src = r.source.rstrip().expandtabs(4)
        src = src if len(src) <= width else src[: width - 3] + "..."
        what = r.instructions
        if r.calls:
            what = (what + "; " if what else "") + f"{r.calls} from inlined calls"
        num = "" if pd.isna(r.line) else r.line
        measured = ""
        if "samples" in view.columns:  # --counters: samples, share, the top stall reason
            top = r.top_reasons.split(",")[0]
            measured = (f"{int(r.samples):>8,} {r.share:>6.1%}  {top:<24} "
                        if r.samples or r.inst_executed else f"{'':>8} {'':>6}  {'':<24} ")
        lines.append(f"  {num:>5}  {src:<{width}}  {measured}{what}".rstrip())
    return lines


def _counter_rows(table) -> list[dict]:
    cols = ["file", "line", "via", "instructions", "inst_executed", "samples", "samples_not_issued", "share",
            "top_reasons", "l2_sectors_global", "l1_wavefronts_shared", "calls_samples"]
    return json.loads(table[[c for c in cols if c in table.columns]].to_json(orient="records"))


def _render_line(attr, line: int, picked) -> list[str]:
    from .lines import class_phrase, instr_text

    if not picked:
        why = attr.note or "no instruction of this stage comes from that line"
        return [f"  line {line}: {why}"]
    out = []
    for i in picked:
        tag = "" if i.line == line else f"  (inlined: {i.file and i.file.rsplit('/', 1)[-1]}:{i.line})"
        cls = "" if i.category == "other" else class_phrase(i.space, i.kind, i.width_bits, 1, i.category)[:-3]
        text = instr_text(attr, i)
        text = text if len(text) <= 72 else text[:69] + "..."
        out.append(f"  {i.text_line:>6}  {text:<72}  {cls}{tag}")
    return out


def _diff_by_line(args, a: Entry, b: Entry) -> int:
    from .lines import describe_changes, diff_by_line, entry_lines

    stage = args.stage or a.final_stage
    la, lb = entry_lines(a, stage), entry_lines(b, stage)
    _note(a, la)
    _note(b, lb)
    d = diff_by_line(la, lb)
    moved = None
    if args.counters:  # which lines' measured cost changed
        from ..profile.inspector import changed_lines, counters_for

        sa = la if la.stage == "sass" else None
        sb = lb if lb.stage == "sass" else None
        moved = changed_lines(counters_for(a, args.counters[0], sa)[1], counters_for(b, args.counters[1], sb)[1])
    if args.json:
        obj = {"stage": la.stage, "a": a.hash, "b": b.hash, "line_info": [la.line_info, lb.line_info],
               "rows": json.loads(d.to_json(orient="records"))}
        if moved is not None:
            obj["counters"] = json.loads(moved.to_json(orient="records"))
        _emit(args, obj, "")
        return 0
    out = [f"a: {a.name} {a.arch} [{a.hash[:12]}]", f"b: {b.name} {b.arch} [{b.hash[:12]}]", f"stage: {la.stage}", ""]
    if d.empty:
        out.append("no source line's instruction mix changed")
    else:
        out.append(f"{d[['file', 'line']].drop_duplicates().shape[0]} source line(s) whose instruction mix changed (a -> b):")
        out += ["  " + s for s in describe_changes(d)]
    if moved is not None:
        from ..profile.inspector import describe_line_changes

        out += ["", f"{len(moved)} source line(s) whose measured cost changed (a -> b; share of each kernel's "
                    "warp-state samples):"] + ["  " + s for s in describe_line_changes(moved)]
    print("\n".join(out))
    return 0
