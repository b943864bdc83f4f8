"""Notebook widgets: a side-by-side ISA diff and a sweep explorer.

Both are ipywidgets for JupyterLab AND render statically: their mime bundle
carries a `text/html` snapshot of the current state next to the live widget
view, so a notebook exported to HTML without a kernel (``workbench report``)
shows what the run produced. ``w.static()`` returns that snapshot as an
``IPython.display.HTML`` for explicit use, ``w.to_html()`` as a string.

    from workbench.widgets import IsaDiffWidget, SweepExplorer
    IsaDiffWidget({"no hint": e0, "hint": e1}, stage="ptx")
    IsaDiffWidget({"no hint": e0, "hint": e1}, counters={"no hint": "hint0.ncu-rep", "hint": "hint1.ncu-rep"})
    SweepExplorer(df, x="block", y="gbps", color="variant", filters=["dtype"])

All assembly text is escaped (``html.escape``) before it goes into HTML.
"""
from __future__ import annotations

import html
import math
import os
from typing import Any, Iterable, Mapping, Sequence

import ipywidgets as W
import pandas as pd

# Memory instruction width (bits per thread) -> (background, border). 16-bit
# red, 32 orange, 64 yellow, 128 green, as the seeds' dwordx4-vs-short story reads.
WIDTH_COLORS: dict[int, tuple[str, str]] = {
    8: ("#f3e5f5", "#8e24aa"),
    16: ("#ffcdd2", "#e53935"),
    32: ("#ffe0b2", "#fb8c00"),
    64: ("#fff59d", "#f9a825"),
    128: ("#c8e6c9", "#43a047"),
    256: ("#b2dfdb", "#00897b"),
}
_UNKNOWN_WIDTH = ("#eceff1", "#90a4ae")
_TAG_MARK = {"equal": "", "replace": "~", "delete": "-", "insert": "+"}
_TAG_BG = {"replace": "#e3f2fd", "delete": "#fbe9e7", "insert": "#e8f5e9"}
_ISA_STAGES = ("ptx", "sass", "amdgcn")
_STAGE_ORDER = ("python", "source", "ttir", "ttgir", "llir", "ptx", "sass", "amdgcn")

_CSS = """
<style>
.wb-isa { font-family: var(--jp-ui-font-family, sans-serif); font-size: 12px; line-height: 1.35; }
.wb-isa table.wb-diff, .wb-isa table.wb-mix { line-height: 1.3; }
.wb-isa h4 { margin: 6px 0; }
.wb-isa table.wb-diff { border-collapse: collapse; table-layout: fixed; width: 100%; }
.wb-isa table.wb-diff td { padding: 0 4px; vertical-align: top; border: 0; }
.wb-isa table.wb-diff td.wb-no { width: 3.5em; color: #999; text-align: right; user-select: none; }
.wb-isa table.wb-diff td.wb-tag { width: 1.2em; text-align: center; font-weight: bold; color: #555; }
.wb-isa table.wb-diff td.wb-code { font-family: var(--jp-code-font-family, monospace);
  white-space: pre-wrap; word-break: break-all; text-align: left; tab-size: 4; }
.wb-isa tr.wb-skip td { color: #888; font-style: italic; background: #fafafa; text-align: center; }
.wb-isa table.wb-mix { border-collapse: collapse; margin-top: 6px; }
.wb-isa table.wb-mix td, .wb-isa table.wb-mix th { border: 1px solid #ddd; padding: 1px 6px; text-align: right; }
.wb-isa table.wb-mix th { background: #f5f5f5; }
.wb-isa .wb-legend span { display: inline-block; padding: 0 6px; margin-right: 4px; border-left: 4px solid; }
.wb-isa .wb-srcbox { max-height: 26em; overflow: auto; border: 1px solid #ddd; margin: 4px 0 8px 0; }
.wb-isa table.wb-src { border-collapse: collapse; table-layout: fixed; width: 100%; line-height: 1.3; }
.wb-isa table.wb-src td, .wb-isa table.wb-src th { padding: 0 6px; border: 0; text-align: left; vertical-align: top; }
.wb-isa table.wb-src th { background: #f5f5f5; position: sticky; top: 0; }
.wb-isa table.wb-src td.wb-no { color: #999; text-align: right; user-select: none; width: 3.5em; }
.wb-isa table.wb-src td.wb-pysrc { font-family: var(--jp-code-font-family, monospace); white-space: pre-wrap;
  word-break: break-word; tab-size: 4; }
.wb-isa table.wb-src tr[data-key] { cursor: pointer; }
.wb-isa table.wb-src tr.wb-srcchg td.wb-no { box-shadow: inset 4px 0 0 #8e24aa; color: #555; font-weight: bold; }
.wb-isa table.wb-src tr.wb-hl td, .wb-isa table.wb-src tr.wb-pin td { background: #fff8e1; }
.wb-isa table.wb-diff td.wb-hl { outline: 2px solid #1e88e5; outline-offset: -2px; }
.wb-isa table.wb-diff td.wb-pin { outline: 2px solid #d81b60; outline-offset: -2px; }
</style>
"""


# ---------------------------------------------------------------------------
# entries and stages


def entry_label(entry) -> str:
    """A short, unique-enough label: kernel, target, the constexprs it was compiled with, hash."""
    parts = [entry.name or "?", entry.arch]
    try:
        const = entry.specialization().get("constexprs") or {}
    except Exception:
        const = {}
    if const:
        parts.append(", ".join(f"{k}={v}" for k, v in const.items()))
    parts.append(entry.hash[:8])
    return " | ".join(parts)


def available_stages(*entries) -> list[str]:
    """Stages every given entry can show, in pipeline order (SASS when a cubin is there)."""
    common = None
    for e in entries:
        have = set(e.stages)
        if "cubin" in have:
            have.add("sass")
        if "source" in have or "ttir" in have:
            have.add("python")
        common = have if common is None else common & have
    return [s for s in _STAGE_ORDER if s in (common or set())]


def _default_stage(a, b, stages: Sequence[str]) -> str | None:
    final = a.final_stage if a.final_stage == b.final_stage else None
    if final in stages:
        return final
    for s in ("ptx", "amdgcn", "sass", "ttgir"):
        if s in stages:
            return s
    return stages[0] if stages else None


# ---------------------------------------------------------------------------
# HTML pieces


def _width_style(width: int | None) -> tuple[str, str]:
    if width is None or (isinstance(width, float) and math.isnan(width)):
        return _UNKNOWN_WIDTH
    return WIDTH_COLORS.get(int(width), _UNKNOWN_WIDTH)


def legend_html() -> str:
    spans = "".join(
        f'<span class="wb-w{w}" style="background:{bg};border-color:{bd}">{w}-bit</span>'
        for w, (bg, bd) in WIDTH_COLORS.items() if w in (16, 32, 64, 128))
    return (f'<div class="wb-legend">memory instructions by width per thread: {spans}'
            f'<span style="background:{_UNKNOWN_WIDTH[0]};border-color:{_UNKNOWN_WIDTH[1]}">other / unknown</span>'
            "&nbsp; change marks: ~ replaced, - only in A, + only in B</div>")


def _classifier(stage: str):
    if stage not in _ISA_STAGES:
        return lambda line: None
    from .asm.isa import classify

    def cls(line: str):
        if not line.strip():
            return None
        try:
            ins = classify(line, stage)
        except Exception:
            return None
        return ins if ins is not None and ins.category == "memory" else None

    return cls


def _code_cell(text: str, ins, tag_bg: str | None, src: str | None = None) -> str:
    body = html.escape(text)
    if src:
        return _code_cell(text, ins, tag_bg).replace("<td ", f'<td data-src="{html.escape(src, quote=True)}" ', 1)
    if ins is not None:
        bg, bd = _width_style(ins.width_bits)
        w = "?" if ins.width_bits is None else int(ins.width_bits)
        title = html.escape(f"{ins.space or ''} {ins.kind or ''} {w}-bit".strip(), quote=True)
        return (f'<td class="wb-code wb-mem wb-w{w}" data-width="{w}" title="{title}" '
                f'style="background:{bg};box-shadow:inset 4px 0 0 {bd}">{body}</td>')
    style = f' style="background:{tag_bg}"' if tag_bg else ""
    return f'<td class="wb-code"{style}>{body}</td>'


def _visible_rows(rows, context, keep_row=None):
    """(row, 0) for rows to show and (None, n) for a run of n hidden rows.

    `context`: None shows every row; an int shows changed rows with that many
    rows around them; 'memory' shows rows where `keep_row(i)` (a memory
    instruction on either side) is true.
    """
    n = len(rows)
    if context is None:
        return [(r, 0) for r in rows]
    keep = [False] * n
    if context == "memory":
        keep = [bool(keep_row and keep_row(i)) for i in range(n)]
    else:
        for i, r in enumerate(rows):
            if r.tag != "equal":
                for j in range(max(0, i - context), min(n, i + context + 1)):
                    keep[j] = True
    out, hidden = [], 0
    for r, k in zip(rows, keep):
        if k:
            if hidden:
                out.append((None, hidden))
                hidden = 0
            out.append((r, 0))
        else:
            hidden += 1
    if hidden:
        out.append((None, hidden))
    return out


def diff_table_html(rows, stage: str, context: int | str | None = 3, max_rows: int = 4000,
                    src_a: Mapping[int, str] | None = None, src_b: Mapping[int, str] | None = None) -> str:
    """A side-by-side diff table (rows from workbench.asm.diff) with memory lines coloured by width.

    `context`: rows of context around changes (int), None for all rows, or
    'memory' for only the rows with a memory instruction on either side.
    `src_a`/`src_b`: {text line: source-line tokens} (see `workbench.source_pane`);
    cells get them as `data-src`, which the source pane highlights.
    """
    src_a, src_b = src_a or {}, src_b or {}
    cls = _classifier(stage)
    classes = [(cls(r.a) if r.a_no is not None else None, cls(r.b) if r.b_no is not None else None)
               for r in rows]
    index = {id(r): i for i, r in enumerate(rows)}
    parts = ['<table class="wb-diff"><colgroup><col style="width:3.5em"><col>'
             '<col style="width:1.2em"><col style="width:3.5em"><col></colgroup><tbody>']
    shown = 0
    keep = lambda i: classes[i][0] is not None or classes[i][1] is not None  # noqa: E731
    for row, hidden in _visible_rows(rows, context, keep):
        if row is None:
            what = "line(s) without memory instructions" if context == "memory" else "unchanged line(s)"
            parts.append(f'<tr class="wb-skip"><td colspan="5">&#8943; {hidden} {what} &#8943;</td></tr>')
            continue
        if shown >= max_rows:
            parts.append(f'<tr class="wb-skip"><td colspan="5">&#8943; truncated at {max_rows} rows &#8943;</td></tr>')
            break
        shown += 1
        tag_bg = _TAG_BG.get(row.tag)
        a_ins, b_ins = classes[index[id(row)]]
        parts.append(
            f'<tr class="wb-row wb-{row.tag}">'
            f'<td class="wb-no">{"" if row.a_no is None else row.a_no}</td>'
            f"{_code_cell(row.a, a_ins, tag_bg if row.a_no is not None else None, src_a.get(row.a_no))}"
            f'<td class="wb-tag">{_TAG_MARK.get(row.tag, "")}</td>'
            f'<td class="wb-no">{"" if row.b_no is None else row.b_no}</td>'
            f"{_code_cell(row.b, b_ins, tag_bg if row.b_no is not None else None, src_b.get(row.b_no))}</tr>")
    if not rows:
        parts.append('<tr class="wb-skip"><td colspan="5">both texts are empty</td></tr>')
    parts.append("</tbody></table>")
    return "".join(parts)


def mix_table_html(mix: pd.DataFrame) -> str:
    """The mix delta (count_a, count_b, delta per instruction class, or per opcode) as an HTML table."""
    if mix is None or mix.empty:
        return "<p><i>no instruction mix for this stage (only PTX, SASS and AMDGCN are classified)</i></p>"
    cols = [c for c in ("opcode", "category", "space", "kind", "width_bits", "mnemonics", "count_a", "count_b",
                        "delta") if c in mix.columns]
    head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
    body = []
    for _, r in mix.iterrows():
        cells = []
        for c in cols:
            v = r[c]
            text = "" if v is None or (isinstance(v, float) and math.isnan(v)) else str(v)
            style = ""
            if c == "width_bits" and r.get("category") == "memory" and text != "":
                bg, bd = _width_style(int(float(text)))
                style = f' style="background:{bg};box-shadow:inset 4px 0 0 {bd}"'
            elif c == "delta" and text not in ("", "0"):
                style = ' style="color:#2e7d32;font-weight:bold"' if int(v) > 0 else ' style="color:#c62828;font-weight:bold"'
            align = (' style="text-align:left"' if c in ("opcode", "category", "space", "kind", "mnemonics")
                     and not style else style)
            cells.append(f"<td{align}>{html.escape(text)}</td>")
        body.append(f'<tr class="wb-mixrow">{"".join(cells)}</tr>')
    return f'<table class="wb-mix"><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table>'


def _metadata_html(meta: Mapping[str, tuple]) -> str:
    if not meta:
        return ""
    items = "".join(f"<li><code>{html.escape(str(k))}</code>: {html.escape(repr(a))} &rarr; {html.escape(repr(b))}</li>"
                    for k, (a, b) in meta.items())
    return f"<div><b>metadata that differs</b><ul>{items}</ul></div>"


def isa_diff_html(a, b, stage: str | None = None, *, label_a: str | None = None, label_b: str | None = None,
                  context: int | str | None = 3, counters_a=None, counters_b=None) -> str:
    """Static HTML of the diff of two cache entries at one stage: legend, side-by-side text, mix delta.

    `counters_a` / `counters_b`: Nsight Compute profiles of the two kernels
    (`workbench.profile.load`): the source pane colours each line by its share
    of the kernel's stall samples, the reasons on hover.
    """
    from .asm.diff import diff_entries

    stages = available_stages(a, b)
    stage = stage or _default_stage(a, b, stages)
    label_a = label_a or entry_label(a)
    label_b = label_b or entry_label(b)
    head = (f"<h4>ISA diff ({html.escape(str(stage))}): A = {html.escape(label_a)} &nbsp;vs&nbsp; "
            f"B = {html.escape(label_b)}</h4>")
    try:
        d = diff_entries(a, b, stage)
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}"
        return f'{_CSS}<div class="wb-isa">{head}<p><b>cannot diff:</b> <code>{html.escape(msg)}</code></p></div>'
    changed = sum(r.tag != "equal" for r in d.rows)
    ctx = {None: "all lines", "memory": "memory instructions only"}.get(context, f"{context} line(s) of context")
    from .source_pane import source_pane

    pane, src_a, src_b = source_pane(a, b, d.stage, counters=(counters_a, counters_b))
    return (f'{_CSS}<div class="wb-isa" data-stage="{html.escape(d.stage, quote=True)}">{head}'
            f"{legend_html()}{pane}<div>{changed} changed row(s) of {len(d.rows)}; {ctx}</div>"
            f"{diff_table_html(d.rows, d.stage, context, src_a=src_a, src_b=src_b)}"
            f"<h4>instruction mix: A, B and B &minus; A</h4>{mix_table_html(d.mix)}"
            f"{_opcodes_html(d.opcodes)}{_metadata_html(d.metadata)}</div>")


def _opcodes_html(ops: pd.DataFrame) -> str:
    """The opcodes whose count changed (arithmetic and bit operations too, which the mix leaves out)."""
    changed = ops[ops["delta"] != 0]
    if changed.empty:
        return ""
    return f"<h4>opcodes whose count changed: A, B and B &minus; A</h4>{mix_table_html(changed)}"


# ---------------------------------------------------------------------------
# widgets


class _StaticMixin:
    """Adds the text/html snapshot to the widget's mime bundle, plus static()/to_html()."""

    def to_html(self) -> str:  # pragma: no cover - overridden
        raise NotImplementedError

    def static(self):
        from IPython.display import HTML

        return HTML(self.to_html())

    def _repr_mimebundle_(self, **kwargs):
        data = super()._repr_mimebundle_(**kwargs) or {}
        data["text/html"] = self.to_html()
        return data


_CONTEXT_CHOICES = [("changes, 3 lines of context", 3), ("changes, 10 lines of context", 10),
                    ("memory instructions only", "memory"), ("all lines", None)]


class IsaDiffWidget(_StaticMixin, W.VBox):
    """Pick two cache entries and a stage; see them side by side and the mix delta.

    `entries`: a list of Entry, a {label: Entry} dict, or None for every entry of
    `cache_dir` (default $TRITON_CACHE_DIR or ~/.triton/cache). `a`/`b` pick the
    initial pair (Entry, label or index; default the first two); `stage` the
    initial stage (default the final assembly). `counters`: {label or entry
    hash: Nsight Compute profile (`workbench.profile.load`) or report path} of
    the kernels that have one: the source pane colours their lines by share of
    stall samples.
    """

    def __init__(self, entries=None, *, cache_dir=None, a=None, b=None, stage: str | None = None,
                 context: int | str | None = 3, counters: Mapping[str, Any] | None = None, **kwargs):
        if entries is None:
            from .asm.cache import list_entries

            entries = [e for e in list_entries(cache_dir) if e.ok]
        if isinstance(entries, Mapping):
            items = [(str(k), v) for k, v in entries.items()]
        else:
            items = [(entry_label(e), e) for e in entries]
        if len(items) < 1:
            raise ValueError("IsaDiffWidget needs at least one cache entry (compile something first)")
        labels = _unique([k for k, _ in items])
        self._entries = dict(zip(labels, (e for _, e in items)))
        self._counters = _load_counters(counters)
        ia = self._pick(a, 0)
        ib = self._pick(b, 1 if len(labels) > 1 else 0)
        style = {"description_width": "initial"}
        lay = W.Layout(width="48%")
        self.pick_a = W.Dropdown(options=labels, value=labels[ia], description="A:", style=style, layout=lay)
        self.pick_b = W.Dropdown(options=labels, value=labels[ib], description="B:", style=style, layout=lay)
        self.pick_stage = W.Dropdown(description="stage:", style=style)
        choices = list(_CONTEXT_CHOICES)
        if context not in [v for _, v in choices]:
            if not isinstance(context, int) or context < 0:
                raise ValueError(f"context {context!r}: a number of lines, 'memory' or None (all lines)")
            choices.insert(0, (f"changes, {context} lines of context", context))
        self.pick_context = W.Dropdown(options=choices, value=context, description="show:", style=style)
        self.view = W.HTML()
        super().__init__([W.HBox([self.pick_a, self.pick_b]), W.HBox([self.pick_stage, self.pick_context]),
                          self.view], **kwargs)
        self._update_stages(stage)
        self._render()
        self.pick_a.observe(self._on_pair, "value")
        self.pick_b.observe(self._on_pair, "value")
        self.pick_stage.observe(lambda _: self._render(), "value")
        self.pick_context.observe(lambda _: self._render(), "value")

    def _pick(self, want, default: int) -> int:
        labels = list(self._entries)
        if want is None:
            return default
        if isinstance(want, int):
            return want
        if isinstance(want, str):
            if want in self._entries:
                return labels.index(want)
            raise ValueError(f"no entry labelled {want!r}; have: {', '.join(labels)}")
        for i, e in enumerate(self._entries.values()):
            if e is want or getattr(e, "path", None) == getattr(want, "path", object()):
                return i
        raise ValueError(f"entry {want!r} is not among the widget's entries")

    @property
    def a(self):
        return self._entries[self.pick_a.value]

    @property
    def b(self):
        return self._entries[self.pick_b.value]

    @property
    def stage(self) -> str | None:
        return self.pick_stage.value

    def _update_stages(self, want: str | None = None):
        stages = available_stages(self.a, self.b)
        cur = want or self.pick_stage.value
        self.pick_stage.options = stages
        if cur in stages:
            self.pick_stage.value = cur
        else:
            self.pick_stage.value = _default_stage(self.a, self.b, stages)

    def _on_pair(self, _change):
        self._update_stages()
        self._render()

    def _render(self):
        self.view.value = self._diff_html()

    def to_html(self) -> str:
        return self.view.value  # the diff the last pick rendered; not computed again

    def _diff_html(self) -> str:
        if self.stage is None:
            return '<div class="wb-isa"><i>the two entries share no stage</i></div>'
        return isa_diff_html(self.a, self.b, self.stage, label_a=self.pick_a.value, label_b=self.pick_b.value,
                             context=self.pick_context.value,
                             counters_a=self._counters_of(self.pick_a.value, self.a),
                             counters_b=self._counters_of(self.pick_b.value, self.b))

    def _counters_of(self, label: str, entry):
        return self._counters.get(label, self._counters.get(getattr(entry, "hash", None)))


def _load_counters(counters) -> dict:
    """{key: profile}: report paths read (`workbench.profile.load`), profiles kept."""
    out = {}
    for key, value in (counters or {}).items():
        if isinstance(value, (str, os.PathLike)):
            from .profile import load

            value = load(value)
        out[str(key)] = value
    return out


def _unique(labels: list[str]) -> list[str]:
    seen: dict[str, int] = {}
    out = []
    for lab in labels:
        if lab in seen:
            seen[lab] += 1
            lab = f"{lab} ({seen[lab]})"
        else:
            seen[lab] = 0
        out.append(lab)
    return out


_ALL = "(all)"


class SweepExplorer(_StaticMixin, W.VBox):
    """Filter a table of sweep rows with dropdowns and plot it with plotly.

    `df`: one row per (point, variant); `x`, `y`: columns to plot; `color`,
    `facet_col`: optional columns; `filters`: columns that get a dropdown
    (default: the low-cardinality columns other than x and y); `kind`: 'line',
    'bar' or 'scatter'; `initial`: {column: value} to start from.
    """

    def __init__(self, df: pd.DataFrame, *, x: str, y: str, color: str | None = None,
                 facet_col: str | None = None, filters: Iterable[str] | None = None, kind: str = "line",
                 title: str | None = None, log_x: bool = False, log_y: bool = False,
                 initial: Mapping[str, Any] | None = None, table_rows: int = 20, **kwargs):
        if not isinstance(df, pd.DataFrame):
            raise ValueError("SweepExplorer needs a pandas DataFrame")
        missing = [c for c in (x, y, color, facet_col) if c is not None and c not in df.columns]
        if missing:
            raise ValueError(f"columns {missing} are not in the table (it has: {', '.join(map(str, df.columns))})")
        if kind not in ("line", "bar", "scatter"):
            raise ValueError(f"kind {kind!r}: choose line, bar or scatter")
        self.df = df.reset_index(drop=True)
        self.x, self.y, self.color, self.facet_col, self.kind = x, y, color, facet_col, kind
        self.title, self.log_x, self.log_y, self.table_rows = title, log_x, log_y, table_rows
        if filters is None:
            filters = [c for c in self.df.columns if c not in (x, y)
                       and 1 < self.df[c].nunique(dropna=True) <= 30 and not pd.api.types.is_float_dtype(self.df[c])]
        self.filters = list(filters)
        initial = dict(initial or {})
        self.dropdowns: dict[str, W.Dropdown] = {}
        for col in self.filters:
            if col not in self.df.columns:
                raise ValueError(f"filter column {col!r} is not in the table")
            values = sorted(self.df[col].dropna().unique().tolist(), key=_sort_key)
            options = [(_ALL, _ALL)] + [(str(v), v) for v in values]
            value = initial.get(col, _ALL)
            if value != _ALL and value not in values:
                raise ValueError(f"initial {col}={value!r} is not among {values}")
            dd = W.Dropdown(options=options, value=value, description=f"{col}:",
                            style={"description_width": "initial"})
            dd.observe(lambda _: self._render(), "value")
            self.dropdowns[col] = dd
        self.out = W.Output()
        self.summary = W.HTML()
        super().__init__([W.HBox(list(self.dropdowns.values()), layout=W.Layout(flex_flow="row wrap")),
                          self.summary, self.out], **kwargs)
        self._render()

    def selection(self) -> dict[str, Any]:
        return {c: d.value for c, d in self.dropdowns.items() if d.value != _ALL}

    def filtered(self) -> pd.DataFrame:
        d = self.df
        for col, val in self.selection().items():
            d = d[d[col] == val]
        return d

    def figure(self):
        import plotly.express as px

        d = self.filtered()
        sel = self.selection()
        title = self.title or f"{self.y} vs {self.x}"
        if sel:
            title += " (" + ", ".join(f"{k}={v}" for k, v in sel.items()) + ")"
        args = dict(x=self.x, y=self.y, color=self.color, facet_col=self.facet_col, title=title,
                    log_x=self.log_x, log_y=self.log_y)
        if self.kind == "bar":
            fig = px.bar(d, barmode="group", **args)
        elif self.kind == "scatter":
            fig = px.scatter(d, **args)
        else:
            d = d.sort_values(self.x, kind="stable")
            fig = px.line(d, markers=True, **args)
        fig.update_layout(height=420, margin=dict(l=50, r=20, t=60, b=40))
        return fig

    def _summary_html(self) -> str:
        sel = self.selection()
        what = ", ".join(f"{html.escape(str(k))} = {html.escape(str(v))}" for k, v in sel.items()) or "no filter"
        return f"<div><b>{len(self.filtered())}</b> of {len(self.df)} rows ({what})</div>"

    def _render(self):
        from IPython.display import display

        self.summary.value = self._summary_html()
        self.out.clear_output(wait=True)
        with self.out:
            display(self.figure())

    def to_html(self) -> str:
        fig_html = self.figure().to_html(full_html=False, include_plotlyjs=False, default_height="420px")
        table = self.filtered().head(self.table_rows).to_html(index=False, classes="wb-sweep-table", border=0,
                                                              escape=True)
        more = len(self.filtered()) - self.table_rows
        more_html = f"<div><i>&hellip; {more} more row(s)</i></div>" if more > 0 else ""
        return (f'<div class="wb-sweep">{self._summary_html()}{fig_html}'
                f"<details><summary>rows</summary>{table}{more_html}</details></div>")


def _sort_key(v):
    return (0, v, "") if isinstance(v, (int, float)) and not isinstance(v, bool) else (1, 0, str(v))
