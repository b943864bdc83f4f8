"""The measured columns `workbench asm lines --counters` and `asm diff --by-line --counters` add.

`counters_for(entry, report)` reads the kernel of `report` that `entry` compiled
(checked: same code at the same offsets) and sums its counters per source line
with the entry's own attribution (`workbench.profile.lines.line_table`).
`annotate_view` puts them beside `workbench.asm.lines.source_view`'s rows;
`changed_lines` picks, from two kernels' tables, the lines whose cost moved.
"""
from __future__ import annotations

import os
import re

import pandas as pd

from .lines import diff_lines, join_entry, line_table, pc_table
from .report import KernelProfile, start

__all__ = ["counters_for", "annotate_view", "changed_lines", "describe_line_changes", "COUNTER_VIEW_COLUMNS"]

COUNTER_VIEW_COLUMNS = ["inst_executed", "samples", "samples_not_issued", "share", "top_reasons", "l2_sectors_global"]


def counters_for(entry, report, attr=None) -> tuple[KernelProfile, pd.DataFrame]:
    """(the profile, its per-line counters) of the kernel `entry` compiled, from `report`."""
    from ..asm.lines import entry_lines

    # the entry gives the instructions: the report is read without its SASS text (no disassembly there)
    pending = start(report, f"^{re.escape(entry.name)}$" if entry.name else None, sass=False)
    try:
        if attr is None:  # disassembled while the child reads the report
            attr = entry_lines(entry, "sass")
        prof = pending.result()
    finally:
        pending.kill()
    attr = join_entry(prof, entry, attr)
    return prof, line_table(prof, attr, pc_table(prof, attr))


def _keyed(table: pd.DataFrame) -> pd.DataFrame:
    t = table[table["line"].notna()].copy()
    t["_base"] = [os.path.basename(f) for f in t["file"]]
    t["_line"] = t["line"].astype(int)
    return t


def annotate_view(view: pd.DataFrame, counters: pd.DataFrame) -> pd.DataFrame:
    """`source_view` rows with the line's counters (joined by file name and line; zeros where none)."""
    v = view.copy()
    v["_base"] = [os.path.basename(f) if isinstance(f, str) else "" for f in v["file"]]
    v["_line"] = pd.to_numeric(v["line"], errors="coerce").fillna(-1).astype(int)
    c = _keyed(counters)[["_base", "_line"] + [x for x in COUNTER_VIEW_COLUMNS if x in counters.columns]]
    out = v.merge(c, on=["_base", "_line"], how="left")
    none = counters[counters["line"].isna()]
    if len(none):  # the instructions without a line go to source_view's row without a line
        for col in c.columns[2:]:
            out.loc[out["line"].isna(), col] = none[col].iloc[0]
    for col in COUNTER_VIEW_COLUMNS:
        if col in out.columns:
            out[col] = out[col].fillna("" if col == "top_reasons" else 0)
    return out.drop(columns=["_base", "_line"])


def changed_lines(a: pd.DataFrame, b: pd.DataFrame, min_share: float = 0.005) -> pd.DataFrame:
    """`diff_lines(a, b)` rows whose samples, L2 traffic, executed count or instructions changed, and that hold
    at least `min_share` of either kernel's samples (or changed their instruction mix)."""
    d = diff_lines(a, b)
    moved = ((d["samples_a"] != d["samples_b"]) | (d["l2_sectors_global_a"] != d["l2_sectors_global_b"])
             | (d["inst_executed_a"] != d["inst_executed_b"]))
    big = (d["share_a"] >= min_share) | (d["share_b"] >= min_share) | (d["mix_a"] != d["mix_b"])
    return d[moved & big].reset_index(drop=True)


def _n(v) -> str:
    return f"{int(v):,}" if float(v).is_integer() else f"{v:,.1f}"


def describe_line_changes(d: pd.DataFrame) -> list[str]:
    """One sentence per line: 'remote.py:38 `tl.store(...)`: samples 250 (14.1%) -> 1,328 (75.3%), ...'."""
    out = []
    for r in d.itertuples(index=False):
        located = isinstance(r.file, str) and not pd.isna(r.line)
        where = f"{os.path.basename(r.file)}:{r.line}" if located else "(no line)"
        src = f" `{r.source.strip()}`" if r.source else ""
        parts = [f"samples {_n(r.samples_a)} ({r.share_a:.1%}) -> {_n(r.samples_b)} ({r.share_b:.1%})"]
        if r.top_reasons_a or r.top_reasons_b:
            parts.append(f"stalls [{r.top_reasons_a or 'none'}] -> [{r.top_reasons_b or 'none'}]")
        if r.l2_sectors_global_a or r.l2_sectors_global_b:
            parts.append(f"L2 sectors {_n(r.l2_sectors_global_a)} -> {_n(r.l2_sectors_global_b)}")
        parts.append(f"executed {_n(r.inst_executed_a)} -> {_n(r.inst_executed_b)}")
        if r.mix_a != r.mix_b:
            parts.append(f"instructions [{r.mix_a or 'none'}] -> [{r.mix_b or 'none'}]")
        out.append(f"{where}{src}: " + "; ".join(parts))
    return out
