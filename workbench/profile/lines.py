"""Which line of my kernel stalls? A report's counters per source line, joined with `asm lines`.

`pc_table(prof, attr)` gives one row per SASS instruction: the report's counters,
the instruction's class (``workbench.asm.isa``) and, when the Triton cache entry
of the profiled kernel is at hand (`join_entry`), its source line and chain of
call sites exactly as ``workbench asm lines`` attributes it (the cubin's line
table through ``nvdisasm``, matched by address: the report's PCs are the
function's start plus the same offsets). Without the entry the line is the one
the report correlates (``ncu_report``'s ``source_info``: the innermost line,
no call sites).

`line_table` sums it per source line, in source order: instructions, instructions
executed, warp-state samples (all and not issued) by stall reason, the memory
tables' traffic, the line's share of the kernel's samples, and (``calls_*``) what
inlined helpers called from that line cost. Instructions without a line are one
row of their own, so the rows add up to the kernel's totals.

`diff_lines` compares two kernels line by line (the hint pair: the store line's
samples and L2 traffic before and after).
"""
from __future__ import annotations

import os
import re

import pandas as pd

from .report import KernelProfile, ProfileError, reason_label

__all__ = ["join_entry", "pc_table", "line_table", "diff_lines", "source_text", "top_reasons", "MEMORY_COLUMNS",
           "no_line_note", "via_str", "find_entry"]

# memory-table columns shown per line where the kernel has any (name -> label)
MEMORY_COLUMNS = {"l2_sectors_global": "L2 sectors (global)", "l1_wavefronts_shared": "shared wavefronts",
                  "l1_tag_requests_global": "L1 requests (global)"}
COUNTERS = ("inst_executed", "thread_inst_executed", "samples", "samples_not_issued", *MEMORY_COLUMNS)
_SASS_ADDR = re.compile(r"/\*([0-9a-fA-F]{4,})\*/")
NO_LINE_INFO = ("the kernel carries no line info: a library kernel (no Triton source, e.g. cuBLAS), or a Triton "
                "kernel compiled with TRITON_DISABLE_LINE_INFO=1 (unset it, clear the kernel's cache entry and "
                "profile again)")


def via_str(via) -> str:
    """(('/x/remote.py', 83), ('/x/remote.py', 90)) -> 'remote.py:83 < remote.py:90'."""
    return " < ".join(f"{os.path.basename(f)}:{ln}" for f, ln in via)


def no_line_note(prof: KernelProfile) -> str | None:
    return None if prof.line_info else NO_LINE_INFO


# ---------------------------------------------------------------------------
# the join with the cache entry


def _entry_offsets(attr) -> dict[int, object]:
    """{SASS address: LineInstr} of a SASS attribution (the text's /*addr*/ of each instruction)."""
    out = {}
    lines = attr.text_lines
    for i in attr.instrs:
        raw = lines[i.text_line - 1] if 0 < i.text_line <= len(lines) else ""
        m = _SASS_ADDR.search(raw)
        if m:
            out[int(m.group(1), 16)] = i
    return out


def _opcode(text: str) -> str:
    """'@!P0 STG.E.128 [R2], R4' -> 'STG'."""
    toks = text.split()
    if toks and toks[0].startswith("@"):
        toks = toks[1:]
    return toks[0].split(".")[0] if toks else ""


def join_entry(prof: KernelProfile, entry, attr=None):
    """The SASS attribution of `entry` (`workbench.asm.lines.entry_lines`), checked to be the profiled kernel.

    With the report's SASS text: the same instructions, the same opcode at
    every offset. Without it: every counted PC is an instruction of the entry,
    and the warp instructions executed per opcode (the report's per-PC counts
    summed by the entry's opcodes) equal ncu's own per-opcode sums. Raises
    ProfileError when the entry's code is not the report's: another kernel, or
    the same kernel compiled differently.
    """
    from ..asm.lines import entry_lines

    if attr is None:
        attr = entry_lines(entry, "sass")
    at = _entry_offsets(attr)
    where = f"cache entry {entry.hash[:12]} ({entry.name})"
    if not at:
        raise ProfileError(f"{where} has no SASS to match the report against")
    pcs = prof.pcs[prof.pcs["sass"] != ""] if prof.has_sass else prof.pcs
    missing = [o for o in pcs["offset"] if o not in at]
    if prof.has_sass:
        differ = sum(_opcode(t) != at[o].mnemonic.split(".")[0] for o, t in zip(pcs["offset"], pcs["sass"]) if o in at)
        wrong = (f"{len(at)} instructions against the report's {len(pcs)}, {differ} with another opcode at the "
                 "same offset")
        bad = bool(missing or differ or len(at) != len(pcs))
    else:
        ours: dict[str, float] = {}
        for off, n in zip(pcs["offset"], pcs["inst_executed"]):
            if n and off in at:
                op = at[off].mnemonic.split(".")[0]
                ours[op] = ours.get(op, 0) + n
        theirs = {op: n for op, n in prof.opcodes.items() if n}
        differ = sorted(op for op in set(ours) | set(theirs) if ours.get(op, 0) != theirs.get(op, 0))
        wrong = (f"{len(missing)} counted instructions are not in it, the instructions executed per opcode differ "
                 f"for {len(differ)} opcode(s){' (' + ', '.join(differ[:6]) + ')' if differ else ''}")
        bad = bool(missing or differ or not theirs)
    if bad:
        raise ProfileError(f"{where} is not the kernel {prof.name} this report profiled: {wrong}; give the cache of "
                           "the profiled run (workbench profile run keeps it beside the report)")
    return attr


def find_entry(prof: KernelProfile, cache=None, spec: str | None = None, limit: int = 8):
    """(entry, its SASS attribution) of the profiled kernel.

    `spec`: a hash prefix or an entry directory (checked against the report);
    else the entries of `cache` named like the kernel, newest first, the first
    whose code is the report's (at most `limit` are disassembled). Raises
    ProfileError (or the cache's CacheError) when none is.
    """
    from ..asm.cache import get_entry, list_entries

    if spec:
        entry = get_entry(spec, cache)
        return entry, join_entry(prof, entry)
    hits = [e for e in list_entries(cache) if e.name == prof.name and e.ok and "cubin" in e.stages]
    hits.sort(key=lambda e: e.mtime, reverse=True)
    for entry in hits[:limit]:
        try:
            return entry, join_entry(prof, entry)
        except ProfileError:
            continue
    where = cache or "the Triton cache"
    raise ProfileError(f"no entry of {where} is the kernel {prof.name} this report profiled "
                       f"({len(hits)} of that name looked at)")


# ---------------------------------------------------------------------------
# per instruction


def pc_table(prof: KernelProfile, attr=None) -> pd.DataFrame:
    """One row per SASS instruction: offset, sass, file, line, via, class columns and the counters.

    `attr`: the entry's SASS attribution from `join_entry`: lines and call
    sites as `asm lines` gives them, and the entry's instructions (all of
    them, never-executed ones with zero counters, when the report's text was
    not read). Without it, the report's own lines, and classes from the
    report's SASS text where it was read.
    """
    from ..asm.isa import classify
    from ..asm.lines import instr_text

    df = prof.pcs.copy()
    at = _entry_offsets(attr) if attr is not None else {}
    if at and not prof.has_sass:  # the entry's code stands in for the text the report was not asked for
        extra = sorted(set(at) - set(df["offset"]))
        if extra:
            zeros = pd.DataFrame({c: 0 for c in df.columns if c not in ("offset", "pc", "sass", "file", "line")},
                                 index=range(len(extra)))
            start = int(df["pc"].iat[0] - df["offset"].iat[0]) if len(df) else 0
            add = pd.concat([pd.DataFrame({"offset": extra, "pc": [start + o for o in extra], "sass": None,
                                           "file": None, "line": pd.array([None] * len(extra), dtype="Int64")}),
                             zeros], axis=1)
            df = pd.concat([df, add[df.columns]], ignore_index=True).sort_values("offset").reset_index(drop=True)
        df["sass"] = [instr_text(attr, at[o]) if o in at else t for o, t in zip(df["offset"], df["sass"])]
    if at:
        classes = [at.get(o) for o in df["offset"]]
    else:
        classes = [classify(t, "sass") if t else None for t in df["sass"]]
    df["mnemonic"] = [c.mnemonic if c else "" for c in classes]
    df["category"] = [c.category if c else "other" for c in classes]
    df["space"] = [c.space if c else None for c in classes]
    df["kind"] = [c.kind if c else None for c in classes]
    df["width_bits"] = pd.array([c.width_bits if c else None for c in classes], dtype="Int64")
    df["via"] = [tuple(c.via) if at and c is not None else () for c in classes]
    if at:
        df["file"] = [(c.file if c.line is not None else None) if c is not None else f
                      for c, f in zip(classes, df["file"])]
        df["line"] = pd.array([c.line if c is not None else ln for c, ln in zip(classes, df["line"])], dtype="Int64")
    return df


# ---------------------------------------------------------------------------
# per line


def top_reasons(counts: dict[str, float], total: float, n: int = 3) -> str:
    """'long scoreboard 78%, wait 9%, selected 6%': the `n` largest reasons with at least 1% of `total` samples."""
    if not total:
        return ""
    top = sorted(((v, r) for r, v in counts.items() if v), reverse=True)[:n]
    kept = [(v, r) for i, (v, r) in enumerate(top) if i == 0 or v / total >= 0.01]
    return ", ".join(f"{reason_label(r)} {v / total:.0%}" for v, r in kept)


def source_text(prof: KernelProfile, file: str | None) -> tuple[list[str] | None, str | None]:
    """(lines, note) of a source file: the text the report embedded (what was profiled), else the file here.

    The note says where the text came from when that matters: the file here
    differs from the profiled one, or neither is available.
    """
    from ..asm.lines import read_source

    if not file:
        return None, None
    embedded = prof.sources.get(file)
    if embedded is None:  # another checkout's path: match by name
        base = os.path.basename(file)
        hits = [t for f, t in prof.sources.items() if os.path.basename(f) == base]
        embedded = hits[0] if len(hits) == 1 else None
    here, problem = read_source(file)
    if embedded is not None:
        lines = embedded.splitlines()
        if here is not None and here != lines:
            return lines, f"{file}: changed since it was profiled; the text shown is the report's"
        return lines, None
    if here is None:
        return None, f"{file}: no text (the report embeds none and {problem})"
    return here, None


def line_table(prof: KernelProfile, attr=None, pcs: pd.DataFrame | None = None) -> pd.DataFrame:
    """One row per source line that has instructions, in source order, plus one for instructions without a line.

    Columns: file, line, source, via (call chains of the line's instructions),
    instructions, mix (their classes), the counters (inst_executed,
    thread_inst_executed, samples, samples_not_issued, memory traffic), share
    (of the kernel's samples), top_reasons, calls_samples / calls_inst_executed
    (what inlined helpers called from this line cost), and stall_<reason>
    columns. The rows' counters add up to the kernel's totals.
    """
    from ..asm.lines import summarize_line

    df = pc_table(prof, attr) if pcs is None else pcs
    reason_cols = prof.reason_columns() + prof.reason_columns(not_issued=True)
    sums = [c for c in COUNTERS + tuple(reason_cols) if c in df.columns]
    has_line = df["line"].notna()
    # one key per row: (file, line), or ("", -1) for the instructions without a line
    keys = list(zip(df["file"].where(has_line, "").fillna(""), df["line"].fillna(-1).astype(int)))
    df = df.assign(_key=keys)
    out = df.groupby("_key", sort=False)[sums].sum()
    # SASS instructions per line; unknown (NA) when neither the report's text nor the entry was read
    out["instructions"] = (df.groupby("_key", sort=False).size() if df["sass"].notna().any()
                           else pd.Series(pd.NA, index=out.index, dtype="Int64"))
    mix: dict[tuple, dict] = {}
    vias: dict[tuple, set] = {}
    calls: dict[tuple, list] = {}
    for k, cat, space, kind, width, via, samples, executed in zip(
            keys, df["category"], df["space"], df["kind"], df["width_bits"], df["via"], df["samples"],
            df["inst_executed"]):
        if cat != "other":
            cls = (cat, space, kind, None if width is pd.NA or width is None else int(width))
            m = mix.setdefault(k, {})
            m[cls] = m.get(cls, 0) + 1
        if via:
            vias.setdefault(k, set()).add(via_str(via))
            for site in set(via):
                c = calls.setdefault((site[0], int(site[1])), [0, 0])
                c[0] += samples
                c[1] += executed
    total = float(df["samples"].sum())
    out = out.reset_index()
    out["file"] = [f or None for f, _ in out["_key"]]
    out["line"] = pd.array([ln if ln >= 0 else None for _, ln in out["_key"]], dtype="Int64")
    out["source"] = _source_column(prof, out["_key"])
    out["via"] = ["; ".join(sorted(vias.get(k, ()))) for k in out["_key"]]
    out["mix"] = [summarize_line(mix.get(k, {})) for k in out["_key"]]
    out["share"] = out["samples"] / total if total else 0.0
    reasons = out[prof.reason_columns()].to_numpy() if prof.reasons else None
    out["top_reasons"] = [top_reasons(dict(zip(prof.reasons, reasons[i])), out["samples"].iat[i])
                          if reasons is not None else "" for i in range(len(out))]
    out["calls_samples"] = [calls.get(k, (0, 0))[0] for k in out["_key"]]
    out["calls_inst_executed"] = [calls.get(k, (0, 0))[1] for k in out["_key"]]
    out["calls_share"] = out["calls_samples"] / total if total else 0.0
    out = out.assign(_nofile=out["file"].isna(), _order=out["line"].astype("float").fillna(float("inf")))
    out = out.sort_values(["_nofile", "file", "_order"], kind="stable").reset_index(drop=True)
    first = ["file", "line", "source", "via", "instructions", "mix"]
    rest = [c for c in out.columns if c not in first and not c.startswith("_")]
    return out[first + rest]


def _source_column(prof: KernelProfile, keys) -> list[str]:
    texts: dict[str, list[str] | None] = {}
    out = []
    what = "no line info" if not prof.line_info else "no line: compiler-generated or padding"
    for file, line in keys:
        if not file:
            out.append(f"({what})")
            continue
        if file not in texts:
            texts[file] = source_text(prof, file)[0]
        text = texts[file]
        out.append(text[line - 1] if text and 0 < line <= len(text) else "")
    return out


# ---------------------------------------------------------------------------
# two kernels


def diff_lines(a: pd.DataFrame, b: pd.DataFrame) -> pd.DataFrame:
    """Two `line_table`s joined by (file name, line): samples, share, reasons and traffic before and after.

    Lines are matched by file name, not directory (two checkouts compile the same
    file at different paths). Rows: every line either kernel has, in source
    order, with ``*_a`` / ``*_b`` columns and ``share_change`` (b - a, in
    fractions of each kernel's samples).
    """
    cols = ["instructions", "inst_executed", "samples", "samples_not_issued", "share", "top_reasons",
            "l2_sectors_global", "l1_wavefronts_shared", "mix"]

    def prep(t):
        t = t.copy()
        t["base"] = [os.path.basename(f) if isinstance(f, str) else "" for f in t["file"]]
        t["key_line"] = t["line"].astype("float").fillna(-1).astype(int)
        for c in cols:
            if c not in t.columns:
                t[c] = 0
        return t[["base", "key_line", "file", "source"] + cols]

    m = pd.merge(prep(a), prep(b), on=["base", "key_line"], how="outer", suffixes=("_a", "_b"))
    for c in cols:
        fill = "" if c in ("top_reasons", "mix") else 0
        for s in ("_a", "_b"):
            m[c + s] = m[c + s].fillna(fill)
            if fill == 0 and c != "share" and (m[c + s] % 1 == 0).all():  # counts stay integers
                m[c + s] = m[c + s].astype("int64")
    m["file"] = m["file_b"].where(m["file_b"].notna(), m["file_a"])
    m["source"] = m["source_b"].where(m["source_b"].fillna("") != "", m["source_a"]).fillna("")
    m["line"] = m["key_line"].where(m["key_line"] >= 0, pd.NA).astype("Int64")
    m["share_change"] = m["share_b"] - m["share_a"]
    m = m.assign(_nofile=m["base"] == "", _order=m["key_line"].where(m["key_line"] >= 0, 1 << 30)).sort_values(
        ["_nofile", "base", "_order"], kind="stable")
    keep = ["file", "line", "source"] + [c + s for c in cols for s in ("_a", "_b")] + ["share_change"]
    return m[keep].reset_index(drop=True)
