"""Re-run study notebooks headless and export them as self-contained HTML.

    workbench report notebooks/01_isa_hints.ipynb -p targets '[sm90, gfx942]' --out results/reports
    workbench report --all

Each notebook is executed with papermill (defaults live in the cell tagged
``parameters``; ``-p NAME VALUE`` overrides them, VALUE parsed as YAML), then
the executed notebook is exported with nbconvert to ONE HTML file that needs
no network: plotly figures are rendered from their JSON with plotly.js
inlined once per report, and the template's CDN scripts (require.js, MathJax,
mermaid, the widget manager) are left out. Widgets show the static snapshot
they put next to their live view (see ``workbench.widgets``). The HTML shows the
cells tagged ``findings`` again right after the title and folds the cells tagged
``setup`` (parameters, imports, data-source plumbing) into closed ``<details>``
(``workbench.report_layout``); the executed notebook keeps every cell as it ran.

A failing cell still gives an executed notebook and an HTML report with every
output up to the error and the error itself; the command then exits 1 and the
index marks the report failed. ``index.html`` in the output directory lists
every report found there, with its parameters, versions, machine and date.

Python API: ``run_report(notebook, params, out_dir) -> ReportResult`` and
``build_index(out_dir) -> Path``.
"""
from __future__ import annotations

import argparse
import ast
import datetime as _dt
import hashlib
import html
import json
import os
import platform
import re
import socket
import sys
import time
from dataclasses import asdict, dataclass, field
from html.parser import HTMLParser
from pathlib import Path
from typing import Any, Iterable, Mapping

from . import report_layout

DEFAULT_OUT = Path("results/reports")
KERNEL_NAME = "python3"
NOTEBOOK_GLOB = "[0-9]*.ipynb"
RECORD_SUFFIX = ".report.json"
PLOTLY_MIME = "application/vnd.plotly.v1+json"
WIDGET_VIEW_MIME = "application/vnd.jupyter.widget-view+json"
REPO_ROOT = Path(__file__).resolve().parents[1]


class ReportUsageError(Exception):
    """A problem with what was asked (bad path, not a notebook, bad parameter): exit 2."""


@dataclass
class ReportResult:
    """What one `run_report` produced. `ok` is False when a cell (or the kernel) failed."""

    name: str
    notebook: str
    ok: bool
    html: str | None
    executed: str | None
    params: dict[str, Any] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    error: str | None = None
    started: str = ""
    duration_s: float = 0.0
    versions: dict[str, str] = field(default_factory=dict)
    machine: dict[str, str] = field(default_factory=dict)
    record: str | None = None
    data: dict[str, Any] = field(default_factory=dict)  # where its figures' data came from (data_sources)

    @property
    def status(self) -> str:
        return "ok" if self.ok else "failed"


# ---------------------------------------------------------------------------
# inputs


MAX_NOTEBOOK_BYTES = 256 << 20


def check_notebook(path: str | os.PathLike) -> Path:
    """Return `path` as a Path if it is a readable Jupyter notebook, else raise ReportUsageError."""
    import nbformat

    p = Path(path)
    if not p.exists():
        raise ReportUsageError(f"{p}: no such file")
    if p.is_dir():
        raise ReportUsageError(f"{p}: is a directory, not a notebook (use --all for notebooks/)")
    if p.suffix != ".ipynb":
        raise ReportUsageError(f"{p}: not a notebook (expected a .ipynb file)")
    if not p.is_file():  # a FIFO or device would block or never end
        raise ReportUsageError(f"{p}: not a regular file")
    if p.stat().st_size > MAX_NOTEBOOK_BYTES:
        raise ReportUsageError(f"{p}: {p.stat().st_size:,} bytes; notebooks over {MAX_NOTEBOOK_BYTES >> 20} MB "
                               "are not read (clear its outputs?)")
    try:
        nb = nbformat.read(str(p), as_version=4)
    except Exception as exc:  # NotJSONError, ValidationError, UnicodeDecodeError, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ReportUsageError(f"{p}: not a readable Jupyter notebook ({first[:200]})") from None
    if not isinstance(nb.get("cells"), list):
        raise ReportUsageError(f"{p}: not a Jupyter notebook (no cells)")
    return p


def find_study_notebooks(root: str | os.PathLike | None = None) -> list[Path]:
    """Every `notebooks/[0-9]*.ipynb`, sorted: under `root`, else ./notebooks, else the repo's."""
    if root is None:
        here = Path.cwd() / "notebooks"
        root_dir = here if here.is_dir() else REPO_ROOT / "notebooks"
    else:
        root_dir = Path(root)
    return sorted(p for p in root_dir.glob(NOTEBOOK_GLOB) if p.is_file())


def parse_value(text: str) -> Any:
    """A `-p` value: YAML (so 3, 0.5, true, [sm90, gfx942], {a: 1} work), else the string itself.

    ValueError (safe_yaml.YamlError) when the YAML unfolds too large (aliases) or nests too deeply.
    """
    from . import safe_yaml

    try:
        return safe_yaml.load_text(text, "the value")
    except safe_yaml.YamlError as exc:
        if "not valid YAML" in str(exc):
            return text
        raise


def _literal(text: str) -> Any:
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return text  # an expression (e.g. 2**20): keep its source text


def notebook_parameters(path: str | os.PathLike) -> dict[str, Any]:
    """The defaults in the notebook's `parameters` cell ({} if it has none)."""
    import papermill

    try:
        info = papermill.inspect_notebook(str(path))
    except Exception:
        return {}
    return {name: _literal(p.get("default", "")) for name, p in info.items()}


# ---------------------------------------------------------------------------
# provenance


# Git, python/torch/triton/CUDA versions and the device come from
# workbench.provenance, as in every results row, so a report and the rows it
# shows cannot disagree (and a copy without .git still finds its commit via
# WORKBENCH_GIT_SHA). Only the notebook tooling is the report's own.
_REPORT_TOOLS = ("plotly", "papermill", "nbconvert")


def collect_versions() -> dict[str, str]:
    """Versions for the banner and the index: python, torch, triton, the report tools, cuda, workbench (git)."""
    from importlib import metadata

    from . import provenance

    prov = provenance.versions()
    out = {"python": prov["python_version"],
           "torch": prov["torch_version"] or "not installed",
           "triton": prov["triton_version"] or "not installed"}
    for dist in _REPORT_TOOLS:
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = "not installed"
    if prov["torch_version"] is None:
        out["cuda"] = "unknown"
    else:
        out["cuda"] = prov["cuda_version"] or "none (CPU build)"
    out["workbench"] = _git_describe()
    return out


def _git_describe() -> str:
    """'<sha[:12]>' plus '-dirty' when the tracked files differ from the commit."""
    from . import provenance

    info = provenance.git_info(REPO_ROOT)
    if info["git_sha"] == "unknown":
        return "unknown (not a git checkout, and WORKBENCH_GIT_SHA is not set)"
    return str(info["git_sha"])[:12] + ("-dirty" if info["git_dirty"] else "")


def collect_machine() -> dict[str, str]:
    """hostname, cpu, cpus and gpu ('N x NAME', or 'no GPU') for the banner and the index."""
    from . import provenance

    dev = provenance.devices()
    out = {"hostname": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
           "cpus": str(os.cpu_count() or "?"), "gpu": "no GPU"}
    n = dev["device_count"]
    if dev.get("device_error"):  # a broken driver must not stop the report
        out["gpu"] = f"no GPU (torch.cuda failed: {dev['device_error'].split(':')[0]})"
    elif n:
        out["gpu"] = f"{n} x {dev['device_name']}" if n > 1 else dev["device_name"]
    return out


# ---------------------------------------------------------------------------
# HTML export

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


def _kv_table(d: Mapping[str, Any], bold: Iterable[str] = (), quote: bool = True) -> str:
    bold = set(bold)
    rows = []
    for k, v in d.items():
        val = html.escape(_fmt_value(v) if quote or not isinstance(v, str) else v)
        if k in bold:
            val = f"<b>{val}</b>"
        rows.append(f"<tr><td>{html.escape(str(k))}</td><td><code>{val}</code></td></tr>")
    return "<table>" + "".join(rows) + "</table>" if rows else "<i>none</i>"


def _banner(res: ReportResult) -> str:
    status = f'<span class="wb-status-{res.status}">{res.status}</span>'
    err = f"<div><b>error:</b> <code>{html.escape(res.error)}</code></div>" if res.error else ""
    vers = ", ".join(f"{k} {html.escape(v)}" for k, v in res.versions.items())
    mach = ", ".join(f"{k}: {html.escape(v)}" for k, v in res.machine.items())
    return (
        f'<div class="wb-banner{" wb-failed" if not res.ok else ""}">'
        f"<div><b>{html.escape(res.name)}</b> ({html.escape(res.notebook)}): {status}, "
        f"run {html.escape(res.started)} in {res.duration_s:.1f} s</div>{err}"
        f"{_data_html(res.data)}"
        f"<div><b>parameters</b> (bold: set on the command line)"
        f"{_kv_table(res.params, res.overrides)}</div>"
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


def _data_html(data: Mapping[str, Any]) -> str:
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


def export_html(nb_or_path, html_path: str | os.PathLike, result: ReportResult | None = None) -> Path:
    """Export a notebook (node or path) to one self-contained HTML file at `html_path`."""
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


# ---------------------------------------------------------------------------
# running


def _report_name(nb_path: Path, overrides: Mapping[str, Any]) -> str:
    if not overrides:
        return nb_path.stem
    key = json.dumps(overrides, sort_keys=True, default=repr)
    return f"{nb_path.stem}-p{hashlib.sha1(key.encode()).hexdigest()[:8]}"


def _error_summary(exc: BaseException) -> str:
    ename = getattr(exc, "ename", None)
    evalue = getattr(exc, "evalue", None)
    if ename:
        cell = getattr(exc, "exec_count", None)
        where = f" in cell [{cell}]" if cell is not None else ""
        return f"{ename}: {evalue}{where}"
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:500]


def _error_notebook(source: Path, message: str):
    """A stand-in when papermill wrote nothing (the kernel never started, ...)."""
    import nbformat

    try:
        nb = nbformat.read(str(source), as_version=4)
    except Exception:
        nb = nbformat.v4.new_notebook()
    note = nbformat.v4.new_markdown_cell(
        "**The notebook could not be executed:**\n\n```\n" + message.replace("```", "'''") + "\n```")
    nb.cells.insert(0, note)
    return nb


def run_report(notebook: str | os.PathLike, params: Mapping[str, Any] | None = None,
               out_dir: str | os.PathLike = DEFAULT_OUT, *, progress: bool = True,
               timeout: float | None = None, kernel_name: str = KERNEL_NAME,
               write_index: bool = True) -> ReportResult:
    """Execute `notebook` with papermill and export it to `<out_dir>/<name>.html`.

    `name` is the notebook's stem, plus a short hash of `params` when any are
    given. Never raises for a failing cell: the result says `ok=False` and
    carries the error. Raises ReportUsageError when `notebook` is not a notebook.
    """
    import papermill as pm

    nb_path = check_notebook(notebook)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    overrides = dict(params or {})
    defaults = notebook_parameters(nb_path)
    name = _report_name(nb_path, overrides)
    executed = out_dir / f"{name}.ipynb"
    html_path = out_dir / f"{name}.html"
    record = out_dir / f"{name}{RECORD_SUFFIX}"
    for stale in (executed, html_path):
        if stale.exists():
            stale.unlink()

    res = ReportResult(
        name=name, notebook=_display_path(nb_path), ok=False, html=None, executed=None,
        params={**defaults, **overrides}, overrides=sorted(overrides),
        started=_dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        versions=collect_versions(), machine=collect_machine(),
    )
    t0 = time.perf_counter()
    error: BaseException | None = None
    try:
        pm.execute_notebook(
            str(nb_path), str(executed), parameters=overrides or None, kernel_name=kernel_name,
            progress_bar=progress, cwd=str(nb_path.resolve().parent),
            execution_timeout=timeout, log_output=False,
        )
    except Exception as exc:  # PapermillExecutionError, kernel death, timeouts ...
        error = exc
    res.duration_s = round(time.perf_counter() - t0, 2)
    res.ok = error is None
    res.error = None if error is None else _error_summary(error)

    if executed.exists():
        res.executed = str(executed)
        source = executed
        try:
            import nbformat

            res.data = data_sources(nbformat.read(str(executed), as_version=4))
        except Exception:  # an unreadable executed notebook still gets its report below
            res.data = {}
    else:
        source = _error_notebook(nb_path, res.error or "unknown error")
    try:
        export_html(source, html_path, res)
        res.html = str(html_path)
    except Exception as exc:
        res.ok = False
        msg = f"HTML export failed: {_error_summary(exc)}"
        res.error = f"{res.error}; {msg}" if res.error else msg
        html_path.write_text(f"<!DOCTYPE html><html><head><meta charset='utf-8'><title>{html.escape(name)}"
                             f"</title></head><body><h1>{html.escape(name)}</h1>"
                             f"<pre>{html.escape(res.error)}</pre></body></html>", encoding="utf-8")
        res.html = str(html_path)
    res.record = str(record)
    record.write_text(json.dumps(asdict(res), indent=1, default=repr) + "\n", encoding="utf-8")
    if write_index:
        build_index(out_dir)
    return res


def _display_path(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(p)


# ---------------------------------------------------------------------------
# index

_INDEX_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif; margin: 24px; color: #222; }
table.reports { border-collapse: collapse; width: 100%; }
table.reports > tbody > tr > td, table.reports > thead > tr > th {
  border: 1px solid #ddd; padding: 6px 8px; vertical-align: top; text-align: left; font-size: 13px; }
table.reports > thead > tr > th { background: #f0f0f0; }
td table td { padding: 0 6px 0 0; font-size: 12px; }
.ok { color: #2e7d32; font-weight: bold; } .failed { color: #c62828; font-weight: bold; }
tr.failed-row { background: #fdecea; }
code { font-size: 12px; }
"""


def load_records(out_dir: str | os.PathLike) -> list[dict[str, Any]]:
    """The report records (`*.report.json`) in `out_dir`, sorted by name."""
    recs = []
    for p in sorted(Path(out_dir).glob(f"*{RECORD_SUFFIX}")):
        try:
            rec = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(rec, dict) and rec.get("name"):
            recs.append(rec)
    return recs


def build_index(out_dir: str | os.PathLike = DEFAULT_OUT) -> Path:
    """Write `<out_dir>/index.html` listing every report there; return its path."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for rec in load_records(out_dir):
        name = rec["name"]
        ok = bool(rec.get("ok"))
        status = "ok" if ok else "failed"
        html_file = f"{name}.html"
        link = (f'<a href="{html.escape(html_file)}">{html.escape(name)}</a>'
                if (out_dir / html_file).exists() else html.escape(name))
        nb_link = (f' (<a href="{html.escape(name)}.ipynb">executed notebook</a>)'
                   if (out_dir / f"{name}.ipynb").exists() else "")
        err = f"<div><code>{html.escape(rec['error'])}</code></div>" if rec.get("error") else ""
        job = rec.get("job") if isinstance(rec.get("job"), dict) else None
        if job and not ok:  # a report made by a Slurm job (workbench.report_cluster)
            err += (f"<div><small>Slurm job <code>{html.escape(str(job.get('job_id')))}</code> on "
                    f"{html.escape(str(job.get('node') or '?'))}; log: <code>{html.escape(str(job.get('log')))}"
                    "</code></small></div>")
        vers = rec.get("versions") or {}
        mach = rec.get("machine") or {}
        rows.append(
            f'<tr class="report {"failed-row" if not ok else ""}" data-status="{status}" '
            f'data-name="{html.escape(name)}">'
            f"<td>{link}{nb_link}<div><small>{html.escape(str(rec.get('notebook', '')))}</small></div></td>"
            f'<td class="{status}">{status}{err}</td>'
            f"<td>{_data_html(rec.get('data') or {}) or '<i>no data labels</i>'}</td>"
            f"<td>{_kv_table(rec.get('params') or {}, rec.get('overrides') or ())}</td>"
            f"<td>{_kv_table(vers, quote=False)}</td>"
            f"<td>{_kv_table({k: mach[k] for k in ('hostname', 'gpu') if k in mach}, quote=False)}</td>"
            f"<td>{html.escape(str(rec.get('started', '')))}<div><small>"
            f"{float(rec.get('duration_s') or 0):.1f} s</small></div></td></tr>"
        )
    body = ("".join(rows) if rows else
            '<tr><td colspan="7"><i>no reports yet: run <code>workbench report --all</code></i></td></tr>')
    now = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    page = (
        "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<title>Workbench reports</title>"
        f"<style>{_INDEX_CSS}</style></head><body>"
        "<h1>Workbench reports</h1>"
        f"<p>{len(rows)} report(s) in <code>{html.escape(str(out_dir))}</code>, index written {now}. "
        "Parameters in bold were set on the command line.</p>"
        '<table class="reports"><thead><tr><th>report</th><th>status</th><th>data</th><th>parameters</th>'
        "<th>versions</th><th>machine</th><th>date</th></tr></thead>"
        f"<tbody>{body}</tbody></table></body></html>\n"
    )
    index = out_dir / "index.html"
    index.write_text(page, encoding="utf-8")
    write_summary(out_dir)
    return index


def write_summary(out_dir: str | os.PathLike) -> Path:
    """`summary.md`: per report its status, data source, headline comparisons and error (small, to commit)."""
    out_dir = Path(out_dir)
    lines = ["# Report summary", "", "| report | status | s | data | machine | headline: fresh vs committed |",
             "| --- | --- | --- | --- | --- | --- |"]
    for rec in load_records(out_dir):
        data = rec.get("data") or {}
        heads = "; ".join(
            f"{h.get('what')}: {h.get('fresh'):.3f}x vs {h.get('committed'):.3f}x ({h.get('change'):+.1%}, "
            f"{str(h.get('why')).split(':')[0]})"
            for h in data.get("headlines") or [] if isinstance(h.get("fresh"), (int, float)))
        src = str(data.get("source", "?")) + (f" ({data['mode']})" if data.get("mode") and
                                              data.get("source") == "fresh" else "")
        error = " ".join(str(rec.get("error") or "").split()).replace("|", "\\|")  # one table row
        status = "ok" if rec.get("ok") else f"FAILED: {error[:160]}"
        lines.append(f"| {rec['name']} | {status} | {float(rec.get('duration_s') or 0):.0f} | {src} | "
                     f"{(rec.get('machine') or {}).get('gpu', '?')} | {heads or '-'} |")
    path = out_dir / "summary.md"
    path.write_text("\n".join(lines).replace("|  |", "| |") + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------
# command line


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = "Re-run notebooks headless (papermill) into self-contained HTML reports."
    parser.add_argument("notebooks", nargs="*", metavar="NOTEBOOK", help="notebooks (.ipynb) to run")
    parser.add_argument("--all", action="store_true",
                        help=f"run every notebooks/{NOTEBOOK_GLOB} (sorted)")
    parser.add_argument("-p", "--param", nargs=2, action="append", default=[],
                        metavar=("NAME", "VALUE"),
                        help="override a parameter; VALUE is YAML (3, 0.5, true, '[sm90, gfx942]')")
    parser.add_argument("--out", default=str(DEFAULT_OUT), metavar="DIR",
                        help=f"output directory (default {DEFAULT_OUT}/)")
    parser.add_argument("--timeout", type=float, default=None, metavar="S",
                        help="per-cell timeout in seconds (default: none)")
    parser.add_argument("--no-progress", action="store_true", help="no per-cell progress bar")
    parser.add_argument("--measure", choices=("auto", "committed", "quick", "full"), default=None,
                        help="the studies' `measure` parameter: auto (quick where the study's GPUs are here, "
                             "else committed), committed, quick (a reduced grid, minutes) or full")
    from . import report_cluster

    report_cluster.add_args(parser)  # --executor slurm: one job per notebook (workbench.cluster)


_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def _resolve(args) -> tuple[list[Path], dict[str, Any]]:
    paths: list[Path] = []
    if args.all:
        found = find_study_notebooks()
        if not found:
            raise ReportUsageError(f"--all: no notebooks matching notebooks/{NOTEBOOK_GLOB} "
                                   f"(looked in {Path.cwd() / 'notebooks'} and {REPO_ROOT / 'notebooks'})")
        paths.extend(found)
    paths.extend(Path(p) for p in args.notebooks)
    if not paths:
        raise ReportUsageError("give one or more NOTEBOOK paths, or --all")
    problems = []
    checked: list[Path] = []
    for p in paths:
        try:
            checked.append(check_notebook(p))
        except ReportUsageError as exc:
            problems.append(str(exc))
    if problems:
        raise ReportUsageError("\n".join(problems))
    params: dict[str, Any] = {}
    for name, value in args.param or []:
        if not _IDENT.match(name):
            raise ReportUsageError(f"-p {name}: a parameter name must be a Python identifier")
        try:
            params[name] = parse_value(value)
        except ValueError as exc:
            raise ReportUsageError(f"-p {name}: {exc}") from None
    if params:
        known: set[str] = set()
        for p in checked:
            known |= set(notebook_parameters(p))
        unknown = sorted(set(params) - known)
        if unknown:
            raise ReportUsageError(
                f"unknown parameter(s) {', '.join(unknown)}; the notebooks' parameters cells define: "
                f"{', '.join(sorted(known)) or 'nothing'}")
    # the same notebook twice runs once
    seen, unique = set(), []
    for p in checked:
        key = p.resolve()
        if key not in seen:
            seen.add(key)
            unique.append(p)
    return unique, params


def _measure_env(out_dir: Path, timeout: float | None) -> None:
    """Fresh data beside the reports (<out>/fresh/<study>/), and a measuring run that ends before its cell's timeout."""
    from .datasource import ENV_FRESH_DIR, ENV_TIMEOUT

    os.environ.setdefault(ENV_FRESH_DIR, str((out_dir / "fresh").resolve()))
    if timeout:
        os.environ[ENV_TIMEOUT] = str(max(1.0, timeout - 20))


def run(args) -> int:
    from . import report_cluster

    cluster_rc = report_cluster.dispatch(args, Path(args.out))  # None: run here, as below
    if cluster_rc is not None:
        return cluster_rc
    try:
        paths, params = _resolve(args)
    except ReportUsageError as exc:
        print(f"workbench report: error: {exc}", file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    if out_dir.exists() and not out_dir.is_dir():
        print(f"workbench report: error: --out {out_dir}: exists and is not a directory", file=sys.stderr)
        return 2
    if args.measure:
        params.setdefault("measure", args.measure)
    _measure_env(out_dir, args.timeout)
    failed = 0
    for i, nb in enumerate(paths, 1):
        print(f"workbench report: [{i}/{len(paths)}] running {nb} ...", file=sys.stderr, flush=True)
        try:
            res = run_report(nb, params, out_dir, progress=not args.no_progress,
                             timeout=args.timeout, write_index=False)
        except ReportUsageError as exc:
            print(f"workbench report: error: {exc}", file=sys.stderr)
            return 2
        if res.ok:
            print(f"workbench report: [{i}/{len(paths)}] ok in {res.duration_s:.1f} s -> {res.html}",
                  file=sys.stderr)
        else:
            failed += 1
            print(f"workbench report: [{i}/{len(paths)}] FAILED ({res.error}); "
                  f"report with the outputs up to the error: {res.html}", file=sys.stderr)
    index = build_index(out_dir)
    print(f"workbench report: {len(paths) - failed} ok, {failed} failed; index: {index}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="workbench report")
    configure(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
