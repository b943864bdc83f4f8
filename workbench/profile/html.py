"""A kernel's source coloured by its share of stall samples, as static HTML (notebooks and reports).

`profile_html(prof)` is one profiled kernel's source: per line the instructions
it made, how often they ran, its warp-state samples and their share of the
kernel's (the row's colour), the top stall reasons; hovering a row shows every
reason and the memory traffic (a ``title``, so the exported report keeps it
with no kernel and no network). `stall_cells` gives the same colour and hover
for the source pane of the ISA diff widget (`workbench.widgets`).
`top_lines_figure` is a plotly bar chart of the costliest lines by stall reason.

All source text is escaped (``html.escape``) before it goes into HTML.
"""
from __future__ import annotations

import html
import os

import pandas as pd

from .lines import MEMORY_COLUMNS, line_table, no_line_note
from .report import KernelProfile, reason_label

__all__ = ["heat", "line_hover", "stall_cells", "profile_html", "top_lines_figure", "CSS"]

CSS = """
<style>
.wb-prof { font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px; line-height: 1.3; }
.wb-prof .wb-profbox { max-height: 40em; overflow: auto; border: 1px solid #ddd; margin: 4px 0 8px 0; }
.wb-prof table { border-collapse: collapse; width: 100%; table-layout: fixed; }
.wb-prof tr.wb-gap td { color: #999; font-style: italic; text-align: center; background: #fafafa; }
.wb-prof th { background: #f5f5f5; position: sticky; top: 0; text-align: left; padding: 1px 6px; }
.wb-prof td { padding: 0 6px; vertical-align: top; border: 0; }
.wb-prof td.wb-no { color: #999; text-align: right; width: 3.5em; }
.wb-prof td.wb-num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
.wb-prof td.wb-pysrc { font-family: var(--jp-code-font-family, monospace); white-space: pre-wrap; tab-size: 4; }
.wb-prof tr.wb-file td { font-weight: bold; background: #fafafa; }
.wb-prof tr.wb-via td { color: #777; font-size: 11px; }
.wb-stall { white-space: nowrap; }
</style>
"""


def heat(share: float) -> str:
    """Background colour of a line by its share of the kernel's samples: white (0) to red (>= 50%)."""
    s = max(0.0, min(1.0, (share or 0.0) / 0.5)) ** 0.6
    light = 100 - 45 * s
    return f"hsl({int(40 - 40 * s)}, 100%, {light:.0f}%)"


def line_hover(row: dict, prof: KernelProfile) -> str:
    """The hover text of one line: samples and share, every stall reason, executed counts, memory traffic."""
    samples = row.get("samples", 0) or 0
    parts = [f"{samples:,.0f} warp-state samples ({row.get('share', 0):.1%} of the kernel's "
             f"{prof.total_samples:,}), {row.get('samples_not_issued', 0):,.0f} not issued"]
    reasons = sorted(((row.get(f"stall_{r}", 0) or 0, r) for r in prof.reasons), reverse=True)
    reasons = [(v, r) for v, r in reasons if v]
    if reasons:
        parts.append("stalls: " + ", ".join(f"{reason_label(r)} {v:,.0f} ({v / samples:.0%})" for v, r in reasons))
    parts.append(f"{row.get('inst_executed', 0):,.0f} warp instructions executed, "
                 f"{row.get('instructions', 0)} SASS instructions" + (f" ({row['mix']})" if row.get("mix") else ""))
    for col, label in MEMORY_COLUMNS.items():
        if row.get(col):
            parts.append(f"{label}: {row[col]:,.0f}")
    if row.get("calls_samples"):
        parts.append(f"inlined helpers called here: {row['calls_samples']:,.0f} samples ({row['calls_share']:.1%})")
    if row.get("via"):
        parts.append(f"inlined, called from {row['via']}")
    return "\n".join(parts)


def _cell(row: dict, prof: KernelProfile) -> str:
    share = row.get("share", 0) or 0
    top = (row.get("top_reasons") or "").split(",")[0].rsplit(" ", 1)[0]  # 'long scoreboard 99%' -> its name
    text = f"{share:.1%} {top}".strip()
    return (f'<td class="wb-stall" data-share="{share:.4f}" style="background:{heat(share)}" '
            f'title="{html.escape(line_hover(row, prof), quote=True)}">{html.escape(text)}</td>')


def stall_cells(prof: KernelProfile | None, table: pd.DataFrame | None = None) -> dict[tuple, str]:
    """{(file name, line): '<td ...>' coloured by the line's share, reasons on hover}; (None, None): no line."""
    if prof is None:
        return {}
    table = line_table(prof) if table is None else table
    out = {}
    for row in table.to_dict(orient="records"):
        line = None if pd.isna(row["line"]) else int(row["line"])
        key = (os.path.basename(row["file"]) if isinstance(row["file"], str) else None, line)
        out[key] = _cell(row, prof)
    return out


def _num(v) -> str:
    return f"{v:,.0f}" if v else ""


def profile_html(prof: KernelProfile, attr=None, *, title: str | None = None, context: int | None = None,
                 max_rows: int = 800) -> str:
    """One profiled kernel's source, each line coloured by its share of the stall samples (static HTML).

    `attr`: the entry's SASS attribution (`workbench.profile.lines.join_entry`)
    for inlined helpers' call sites; `context`: source lines shown around the
    lines that made instructions (None: only those lines).
    """
    table = line_table(prof, attr)
    mem = [(c, label) for c, label in MEMORY_COLUMNS.items() if c in table.columns and table[c].sum() > 0]
    head = ("<tr><th>line</th><th>source</th><th>instructions</th><th>executed</th><th>samples</th>"
            "<th>share, top reason</th>" + "".join(f"<th>{html.escape(label)}</th>" for _, label in mem) + "</tr>")
    body, shown = [], 0
    by_file: dict = {}
    for row in table.to_dict(orient="records"):
        by_file.setdefault(row["file"] if isinstance(row["file"], str) else None, []).append(row)
    span = 6 + len(mem)
    for file, rows in by_file.items():
        body.append(f'<tr class="wb-file"><td colspan="{span}">{html.escape(file or "(no source line)")}</td></tr>')
        last = None
        for row in _with_context(prof, file, rows, context):
            if shown >= max_rows:
                body.append(f'<tr><td colspan="{span}"><i>&#8943; truncated at {max_rows} rows</i></td></tr>')
                break
            line = None if pd.isna(row["line"]) else int(row["line"])
            if last is not None and line is not None and line > last + 1:
                body.append(f'<tr class="wb-gap"><td colspan="{span}">&#8943; lines {last + 1}-{line - 1} '
                            "made no instruction &#8943;</td></tr>")
            last = line
            shown += 1
            body.append(_row_html(row, prof, mem))
    note = no_line_note(prof)
    caption = title or f"{prof.label()}: {prof.total_samples:,} warp-state samples"
    notes = "".join(f"<div><i>{html.escape(n)}</i></div>" for n in ([note] if note else []) + prof.notes)
    cols = ('<colgroup><col style="width:3.5em"><col style="width:33%"><col style="width:15%"><col style="width:8%">'
            '<col style="width:6%"><col style="width:18%">' + '<col style="width:7%">' * len(mem) + "</colgroup>")
    return (f'{CSS}<div class="wb-prof"><b>{html.escape(caption)}</b>: each line coloured by its share of the '
            f"kernel's stall samples (white none, red half or more); hover a line for every stall reason and its "
            f'memory traffic{notes}<div class="wb-profbox"><table>{cols}<thead>{head}</thead>'
            f'<tbody>{"".join(body)}</tbody></table></div></div>')


def _with_context(prof, file, rows, context):
    if context is None or file is None:
        return rows
    from .lines import source_text

    text, _ = source_text(prof, file)
    have = {int(r["line"]): r for r in rows if not pd.isna(r["line"])}
    if not have:
        return rows
    keep = sorted({n for ln in have for n in range(max(1, ln - context), ln + context + 1)
                   if text is None or n <= len(text)})
    return [have.get(n) or {"file": file, "line": n, "source": text[n - 1] if text else "", "blank": True}
            for n in keep]


def _row_html(row: dict, prof: KernelProfile, mem) -> str:
    line = "" if pd.isna(row["line"]) else row["line"]
    src = f'<td class="wb-pysrc">{html.escape(str(row["source"]).rstrip())}</td>'
    if row.get("blank"):
        return f'<tr><td class="wb-no">{line}</td>{src}<td colspan="{4 + len(mem)}"></td></tr>'
    share = row.get("share", 0) or 0
    style = f' style="background:{heat(share)}"' if share else ""
    tip = html.escape(line_hover(row, prof), quote=True)
    cells = (f'<td class="wb-no">{line}</td>{src}<td>{html.escape(row.get("mix") or "")}</td>'
             f'<td class="wb-num">{_num(row.get("inst_executed"))}</td>'
             f'<td class="wb-num">{_num(row.get("samples"))}</td>'
             f'<td class="wb-share">{share:.1%} {html.escape(row.get("top_reasons") or "")}</td>'
             + "".join(f'<td class="wb-num">{_num(row.get(c))}</td>' for c, _ in mem))
    extra = ""
    if row.get("via") or row.get("calls_samples"):
        bits = [f"inlined, called from {row['via']}"] if row.get("via") else []
        if row.get("calls_samples"):
            bits.append(f"+{row['calls_samples']:,.0f} samples ({row['calls_share']:.1%}) in the helpers it inlines")
        extra = (f'<tr class="wb-via" title="{tip}"><td></td><td colspan="{4 + len(mem) + 1}">'
                 f"{html.escape('; '.join(bits))}</td></tr>")
    return f'<tr class="wb-line" data-share="{share:.4f}"{style} title="{tip}">{cells}</tr>{extra}'


def top_lines_figure(prof: KernelProfile, n: int = 10, attr=None, table: pd.DataFrame | None = None):
    """Plotly: the `n` lines with the most samples, one bar each, stacked by stall reason."""
    import plotly.express as px

    table = line_table(prof, attr) if table is None else table
    top = table.sort_values("samples", ascending=False).head(n)
    rows = []
    for r in top.to_dict(orient="records"):
        where = (f"{os.path.basename(r['file'])}:{r['line']}" if isinstance(r["file"], str) else "(no line)")
        label = f"{where} {str(r['source']).strip()[:50]}"
        for reason in prof.reasons:
            v = r.get(f"stall_{reason}", 0)
            if v:
                rows.append({"line": label, "reason": reason_label(reason), "samples": v,
                             "share": v / prof.total_samples if prof.total_samples else 0})
    df = pd.DataFrame(rows, columns=["line", "reason", "samples", "share"])
    fig = px.bar(df, y="line", x="samples", color="reason", orientation="h", hover_data={"share": ":.1%"},
                 title=f"{prof.name}: the {len(top)} lines with the most warp-state samples, by stall reason")
    fig.update_layout(yaxis={"categoryorder": "total ascending", "title": None}, height=120 + 32 * len(top),
                      legend_title_text="stall reason")
    return fig
