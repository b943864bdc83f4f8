"""A notebook as ONE self-contained HTML file that needs no network (``workbench.report`` runs
the notebook; this module exports it).

plotly figures are rendered from their JSON with plotly.js inlined once per report, and the
lab template's CDN scripts (require.js, MathJax, mermaid, the widget manager) are left out.
Widgets show the static snapshot they put next to their live view (see ``workbench.widgets``).
The page opens with a banner (status, parameters, versions, machine, where its data came
from: `data_sources`), shows the cells tagged ``findings`` again right after the title and folds
the cells tagged ``setup`` into closed ``<details>`` (``workbench.report_layout``).
"""
from __future__ import annotations

import html
import json
import os
import sys
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import report_layout

PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"

__all__ = ["export_html", "make_offline", "remote_references", "data_sources", "data_html", "kv_table"]


# The lab template minus everything it would fetch from a CDN, plus a
# provenance banner and (when the notebook has plotly figures) plotly.js inline.
_OFFLINE_TEMPLATE = r"""{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block html_head_css -%}
<style type="text/css">{{ resources.wb_css }}</style>
{%- if resources.wb_plotly_js %}
<script type="text/javascript">window.PlotlyConfig = {MathJaxConfig: 'local'};</script>
<script type="text/javascript">{{ resources.wb_plotly_js }}</script>
{%- endif %}
{%- endblock html_head_css -%}
{%- block body_header -%}
{{ super() }}
{{ resources.wb_banner }}
{%- endblock body_header -%}
{%- block any_cell scoped -%}
{%- if cell.metadata.get("wb_box_open") %}{{ cell.metadata.get("wb_box_open") }}{% endif -%}
{%- if cell.metadata.get("wb_fold_open") %}<details class="wb-setup"><summary>{{ cell.metadata.get("wb_fold_open") | e }}</summary>{% endif -%}
{{ super() }}
{%- if cell.metadata.get("wb_fold_close") %}</details>{% endif -%}
{%- if cell.metadata.get("wb_box_close") %}</section>{% endif -%}
{%- endblock any_cell -%}
"""

_REPORT_CSS = """
.wb-banner { font-family: var(--jp-ui-font-family, sans-serif); font-size: 13px; margin: 8px 16px 16px;
  padding: 8px 12px; border: 1px solid #ccc; border-radius: 4px; background: #f7f7f7; }
.wb-banner.wb-failed { border-color: #c62828; background: #fdecea; }
.wb-banner table { border-collapse: collapse; }
.wb-banner td, .wb-banner th { padding: 1px 8px; text-align: left; vertical-align: top; }
.wb-status-ok { color: #2e7d32; font-weight: bold; }
.wb-status-failed { color: #c62828; font-weight: bold; }
.wb-widget-note { color: #666; font-style: italic; }
.wb-data { font-size: 12px; color: #555; margin: 2px 0; }
.wb-data-fresh { color: #1b5e20; } .wb-data-committed { color: #0d47a1; }
.wb-data::before { content: "data \2014  "; font-weight: bold; }
""" + report_layout.CSS


def _fmt_value(v: Any) -> str:
    return json.dumps(v) if _jsonable(v) else repr(v)


def _jsonable(v: Any) -> bool:
    try:
        json.dumps(v)
        return True
    except (TypeError, ValueError):
        return False


def kv_table(d: Mapping[str, Any], bold: Iterable[str] = (), quote: bool = True) -> str:
    bold = set(bold)
    rows = []
    for k, v in d.items():
        val = html.escape(_fmt_value(v) if quote or not isinstance(v, str) else v)
        if k in bold:
            val = f"<b>{val}</b>"
        rows.append(f"<tr><td>{html.escape(str(k))}</td><td><code>{val}</code></td></tr>")
    return "<table>" + "".join(rows) + "</table>" if rows else "<i>none</i>"


def _banner(res) -> str:
    """The provenance banner of a ``report.ReportResult``."""
    status = f'<span class="wb-status-{res.status}">{res.status}</span>'
    err = f"<div><b>error:</b> <code>{html.escape(res.error)}</code></div>" if res.error else ""
    vers = ", ".join(f"{k} {html.escape(v)}" for k, v in res.versions.items())
    mach = ", ".join(f"{k}: {html.escape(v)}" for k, v in res.machine.items())
    return (
        f'<div class="wb-banner{" wb-failed" if not res.ok else ""}">'
        f"<div><b>{html.escape(res.name)}</b> ({html.escape(res.notebook)}): {status}, "
        f"run {html.escape(res.started)} in {res.duration_s:.1f} s</div>{err}"
        f"{data_html(res.data)}"
        f"<div><b>parameters</b> (bold: set on the command line)"
        f"{kv_table(res.params, res.overrides)}</div>"
        f"<div><b>versions:</b> {vers}</div><div><b>machine:</b> {mach}</div></div>"
    )


def data_sources(nb) -> dict[str, Any]:
    """What the notebook's `workbench.datasource` outputs say about its data.

    {"source": "fresh" | "committed" | "mixed" | "none", "mode", "dir", "note",
     "labels": {"fresh": n, "committed": n, "computed": n}, "files": [...],
     "skipped": [planned commands], "headlines": [...]}
    """
    from .datasource import META_KEY

    out: dict[str, Any] = {"source": "none", "mode": None, "dir": None, "note": None,
                           "labels": {}, "files": [], "skipped": [], "headlines": []}
    kinds = set()
    for cell in nb.get("cells", []):
        for o in cell.get("outputs", []) or []:
            meta = (o.get("metadata") or {}).get(META_KEY)
            if not isinstance(meta, Mapping):
                continue
            kind = meta.get("kind")
            if kind == "data-summary":
                out.update(mode=meta.get("mode"), dir=meta.get("dir"), note=meta.get("note"))
                kinds.add(meta.get("source"))
            elif kind == "data":
                src = str(meta.get("source"))
                out["labels"][src] = out["labels"].get(src, 0) + 1
                if src != "computed":
                    kinds.add(src)
                for f in meta.get("files") or []:
                    if f not in out["files"]:
                        out["files"].append(f)
            elif kind == "measure-skipped":
                out["skipped"].append(str(meta.get("command")))
            elif kind == "headline":
                out["headlines"].append({k: meta.get(k) for k in ("what", "cases", "fresh", "committed",
                                                                   "change", "why")})
    kinds.discard(None)
    out["source"] = kinds.pop() if len(kinds) == 1 else "mixed" if kinds else "none"
    return out


def data_html(data: Mapping[str, Any]) -> str:
    if not data or data.get("source") in (None, "none"):
        return ""
    labels = ", ".join(f"{n} {k}" for k, n in sorted((data.get("labels") or {}).items()))
    where = f" from <code>{html.escape(str(data.get('dir')))}</code>" if data.get("dir") else ""
    mode = f" ({html.escape(str(data['mode']))})" if data.get("mode") and data["source"] != "committed" else ""
    note = f" <i>{html.escape(str(data.get('note')))}</i>" if data.get("note") else ""
    lines = [f'<div class="wb-data-line" data-source="{html.escape(str(data["source"]))}"><b>data:</b> '
             f'{html.escape(str(data["source"]))}{mode}{where}; labelled outputs: {labels or "none"}.{note}</div>']
    for h in data.get("headlines") or []:
        try:
            lines.append(f"<div><b>{html.escape(str(h['what']))}</b>: {h['fresh']:.3f}x fresh vs "
                         f"{h['committed']:.3f}x committed over {h['cases']} cases ({h['change']:+.1%}): "
                         f"{html.escape(str(h['why']))}</div>")
        except (KeyError, TypeError, ValueError):
            continue
    return "".join(lines)


def _plotly_html(fig: Mapping[str, Any]) -> str:
    """An html rendering of a plotly mimetype bundle that needs a global `Plotly` (inlined once)."""
    import plotly.io as pio

    fig = dict(fig)
    config = fig.pop("config", None) or {}
    layout = fig.get("layout") or {}
    height = layout.get("height") if isinstance(layout, Mapping) else None
    return pio.to_html(fig, config=config, include_plotlyjs=False, include_mathjax=False,
                       full_html=False, validate=False, default_width="100%",
                       default_height=f"{int(height) if height else 480}px")


def make_offline(nb) -> bool:
    """Rewrite `nb` in place for an offline HTML export; True if plotly.js is needed.

    - plotly mimetype outputs get a `text/html` rendering (it replaces any html
      plotly itself wrote, which would load plotly.js from a CDN or require.js);
    - widget views are dropped (no widget manager offline): the widget's own
      `text/html` snapshot shows instead, else a short note;
    - the notebook's saved widget state is dropped (it would pull the manager from a CDN).
    """
    needs_plotly = False
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        for out in cell.get("outputs", []) or []:
            data = out.get("data")
            if not data:
                continue
            if PLOTLY_MIME in data:
                fig = data[PLOTLY_MIME]
                if isinstance(fig, str):
                    fig = json.loads(fig)
                data["text/html"] = _plotly_html(fig)
                del data[PLOTLY_MIME]
            if WIDGET_VIEW_MIME in data:
                del data[WIDGET_VIEW_MIME]
                if "text/html" not in data:
                    data["text/html"] = ('<div class="wb-widget-note">(interactive widget: open the '
                                         "notebook in JupyterLab to use it)</div>")
                    data.pop("text/plain", None)
            page = data.get("text/html")
            if isinstance(page, list):
                page = "".join(page)
            if isinstance(page, str) and "Plotly.newPlot" in page:
                needs_plotly = True
    return needs_plotly


class _RemoteRefs(HTMLParser):
    def __init__(self):
        super().__init__()
        self.found: list[str] = []

    def handle_starttag(self, tag, attrs):
        for key, val in attrs:
            if key in ("src", "href", "data", "poster") and not (tag == "a" and key == "href"):
                v = (val or "").strip().lower()
                if v.startswith(("http:", "https:", "//")):
                    self.found.append(f"<{tag} {key}={val}>")


def remote_references(page: str) -> list[str]:
    """Tags in `page` that would fetch something over the network (links to follow excepted)."""
    p = _RemoteRefs()
    p.feed(page)
    return p.found


def export_html(nb_or_path, html_path: str | os.PathLike, result=None) -> Path:
    """Export a notebook (node or path) to one self-contained HTML file at `html_path`; ``result``:
    the ``report.ReportResult`` its banner shows."""
    import jinja2
    import nbformat
    from nbconvert import HTMLExporter

    if isinstance(nb_or_path, (str, os.PathLike)):
        nb = nbformat.read(str(nb_or_path), as_version=4)
    else:
        nb = nbformat.from_dict(json.loads(json.dumps(nb_or_path)))  # a deep copy
    html_path = Path(html_path)
    report_layout.arrange(nb)  # findings first, setup folded (this copy only)
    needs_plotly = make_offline(nb)
    plotly_js = ""
    if needs_plotly:
        from plotly.offline import get_plotlyjs

        plotly_js = get_plotlyjs()
    exporter = HTMLExporter(
        template_name="lab",
        extra_loaders=[jinja2.DictLoader({"wb_offline.html.j2": _OFFLINE_TEMPLATE})],
        template_file="wb_offline.html.j2",
        embed_images=True,
        require_js_url="", mathjax_url="", mermaid_js_url="", mermaid_layout_elk_js_url="",
        jquery_url="", jupyter_widgets_base_url="", widget_renderer_url="",
    )
    resources = {
        "metadata": {"name": result.name if result else html_path.stem,
                     "path": str(Path(result.notebook).parent) if result else ""},
        "wb_css": _REPORT_CSS,
        "wb_plotly_js": plotly_js,
        "wb_banner": _banner(result) if result else "",
    }
    body, _ = exporter.from_notebook_node(nb, resources=resources)
    remote = remote_references(body)
    if remote:
        print(f"workbench report: warning: {html_path.name} is not self-contained; it fetches "
              f"{', '.join(remote[:5])}{' ...' if len(remote) > 5 else ''} (an output's own html)", file=sys.stderr)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(body, encoding="utf-8")
    return html_path
