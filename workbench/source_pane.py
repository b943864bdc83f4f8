"""The ISA diff's source pane: which Python line made which instruction, and what each line costs.

`source_pane(a, b, stage)` lists the kernel's source lines with the instruction
classes each made in entry A and in entry B (`workbench.asm.lines`); hovering a
line outlines its instructions in the diff beside it, a click pins it. With
Nsight Compute profiles of the two kernels, a column per side colours each line
by its share of that kernel's stall samples (`workbench.profile.html`).
Everything works in a static HTML export: plain DOM code in attributes, hover
text in ``title``. All text is escaped before it goes into HTML.
"""
from __future__ import annotations

import html
import os

import pandas as pd

__all__ = ["source_pane", "MAX_SOURCE_ROWS"]


# Hover a source row to outline its instructions in A and B; click to pin (click
# again to unpin). Plain DOM code in attributes, so a static HTML export (no
# kernel, no server, no <script> run by a widget) keeps it working.
_PANE_JS = (
    "var H=function(t,c,k){var r=t.closest('.wb-isa');"
    "r.querySelectorAll('.'+c).forEach(function(e){e.classList.remove(c)});"
    "if(!k)return null;var f=null;"
    "r.querySelectorAll('[data-src~=\"'+k+'\"]').forEach(function(e){e.classList.add(c);"
    "if(!f&&e.tagName==='TD')f=e});return f};"
)
_PANE_OVER = _PANE_JS + "var tr=event.target.closest('tr[data-key]');H(this,'wb-hl',tr&&tr.dataset.key);"
_PANE_LEAVE = _PANE_JS + "H(this,'wb-hl',null);"
_PANE_CLICK = (_PANE_JS + "var tr=event.target.closest('tr[data-key]');if(!tr)return;"
               "var f=H(this,'wb-pin',tr.classList.contains('wb-pin')?null:tr.dataset.key);"
               "if(f)f.scrollIntoView({block:'nearest'});")
MAX_SOURCE_ROWS = 600


def _src_token(files: dict[str, int], file: str | None, line: int) -> str:
    """'F:L', F numbering files by base name (two checkouts of one kernel match)."""
    base = os.path.basename(file or "")
    return f"{files.setdefault(base, len(files))}:{line}"


def _text_line_tokens(attr, files: dict[str, int]) -> dict[int, str]:
    """{stage text line: tokens of the source line that made it and of its call sites}."""
    out: dict[int, list[str]] = {}
    for i in attr.instrs:
        if i.line is None:
            continue
        toks = out.setdefault(i.text_line, [])
        for f, ln in ((i.file, i.line), *i.via):
            t = _src_token(files, f, ln)
            if t not in toks:
                toks.append(t)
    return {k: " ".join(v) for k, v in out.items()}


def source_pane(a, b, stage: str, counters=(None, None)) -> tuple[str, dict, dict]:
    """(HTML of the source pane, tokens of A's text lines, tokens of B's) for one stage.

    The pane lists the kernel's source lines with the instruction classes each
    made in A and in B; lines whose mix differs are marked. An entry without
    line info (or a stage without instructions) gives a note instead.
    `counters`: (profile of A, profile of B), either None: a column per side
    with each line's share of that kernel's stall samples (coloured; the
    reasons, counts and memory traffic on hover).
    """
    from .asm import lines as L

    if stage not in L.LINE_STAGES:
        return "", {}, {}
    try:
        la, lb = L.entry_lines(a, stage), L.entry_lines(b, stage)
    except Exception as exc:  # the diff itself still shows
        return (f'<div class="wb-srcnote"><i>no source lines: {html.escape(f"{type(exc).__name__}: {exc}")}</i>'
                "</div>", {}, {})
    notes = [f"{side}: {x.note}" for side, x in (("A", la), ("B", lb)) if x.note]
    stalls = [{}, {}]
    if any(c is not None for c in counters):
        from .profile.html import stall_cells

        stalls = [stall_cells(c) for c in counters]
        notes += [f"{side}: the counters are of kernel {c.name}, not {e.name}" for side, c, e in
                  (("A", counters[0], a), ("B", counters[1], b)) if c is not None and c.name != e.name]
    files: dict[str, int] = {}
    src_a, src_b = _text_line_tokens(la, files), _text_line_tokens(lb, files)
    rows = _pane_rows(L.source_view(la), L.source_view(lb), files)
    note = "".join(f"<div><i>{html.escape(n)}</i></div>" for n in notes)
    if not rows:
        return f'<div class="wb-srcnote">{note}</div>', src_a, src_b
    body = []
    last_file = None
    measured = any(stalls)
    ncols = 6 if measured else 4
    for r in rows[:MAX_SOURCE_ROWS]:
        if r["file"] != last_file:
            body.append(f'<tr><td colspan="{ncols}"><b>{html.escape(r["file"] or "(no line)")}</b></td></tr>')
            last_file = r["file"]
        key = r["key"]
        attrs = f' data-key="{key}" data-src="{key}"' if key else ""
        cls = ' class="wb-srcchg"' if r["a"] != r["b"] else ""
        skey = (os.path.basename(r["file"]) if r["file"] else None, r["line"] if r["line"] != "" else None)
        sa, sb = ((s.get(skey, "<td></td>") for s in stalls) if measured else ("", ""))
        body.append(f"<tr{cls}{attrs}><td class=\"wb-no\">{r['line']}</td>"
                    f'<td class="wb-pysrc">{html.escape(r["source"])}</td>'
                    f"<td>{html.escape(r['a'])}</td>{sa}<td>{html.escape(r['b'])}</td>{sb}</tr>")
    if len(rows) > MAX_SOURCE_ROWS:
        body.append(f'<tr><td colspan="{ncols}"><i>&#8943; {len(rows) - MAX_SOURCE_ROWS} more line(s)</i></td></tr>')
    handlers = " ".join(f'{ev}="{html.escape(js, quote=True)}"' for ev, js in
                        (("onmouseover", _PANE_OVER), ("onmouseleave", _PANE_LEAVE), ("onclick", _PANE_CLICK)))
    changed = sum(r["a"] != r["b"] for r in rows)
    cols = ('<col style="width:40%"><col><col style="width:9em"><col><col style="width:9em">' if measured
            else '<col style="width:50%"><col><col>')
    heads = ("<th>A</th><th>A stalls</th><th>B</th><th>B stalls</th>" if measured else "<th>A</th><th>B</th>")
    how = ("; the stall columns: each line's share of its kernel's warp-state samples and the top reason "
           "(hover for every reason)" if measured else "")
    return (f'<div class="wb-srcpane"><b>source</b> ({changed} line(s) whose instructions differ, marked): '
            f"hover a line to outline its instructions in A and B, click to pin it{how}"
            f'{note}<div class="wb-srcbox"><table class="wb-src" {handlers}><colgroup><col style="width:3.5em">'
            f'{cols}</colgroup><thead><tr><th>line</th><th>source</th>'
            f"{heads}</tr></thead><tbody>{''.join(body)}</tbody></table></div></div>",
            src_a, src_b)


def _pane_rows(va: pd.DataFrame, vb: pd.DataFrame, files: dict[str, int]) -> list[dict]:
    """Both sides' source views joined by (file base name, line)."""
    rows: dict[tuple, dict] = {}
    for side, view in (("a", va), ("b", vb)):
        for r in view.itertuples(index=False):
            line = None if pd.isna(r.line) else int(r.line)
            base = os.path.basename(r.file) if isinstance(r.file, str) else None
            row = rows.setdefault((base is None, base or "", line or 0), {
                "file": r.file if isinstance(r.file, str) else None, "line": "" if line is None else line,
                "source": r.source.rstrip(), "a": "", "b": "",
                "key": _src_token(files, r.file, line) if line is not None else ""})
            what = r.instructions
            if r.calls:
                what = (what + "; " if what else "") + f"{r.calls} from inlined calls"
            row[side] = what
            if not row["source"] and r.source:
                row["source"] = r.source.rstrip()
    return [rows[k] for k in sorted(rows)]
