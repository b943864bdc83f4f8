"""The index of a reports folder: ``index.html`` (every report found there, with its parameters,
versions, machine, date and where its data came from) and ``summary.md`` (a few lines per report,
small enough to commit), both made from the reports' records (``<name>.report.json``).
"""
from __future__ import annotations

import datetime as _dt
import html
import json
import os
from pathlib import Path
from typing import Any

from .report_html import data_html, kv_table

DEFAULT_OUT = Path("results/reports")
RECORD_SUFFIX = ".report.json"

__all__ = ["build_index", "write_summary", "load_records", "DEFAULT_OUT", "RECORD_SUFFIX"]

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
        if job and not ok:  # a report made by a job (workbench.report_jobs)
            kind = str(job.get("executor") or "slurm").capitalize()  # the executor that ran it: "Slurm job ..."
            err += (f"<div><small>{html.escape(kind)} job <code>{html.escape(str(job.get('job_id')))}</code> on "
                    f"{html.escape(str(job.get('node') or '?'))}; log: <code>{html.escape(str(job.get('log')))}"
                    "</code></small></div>")
        vers = rec.get("versions") or {}
        mach = rec.get("machine") or {}
        rows.append(
            f'<tr class="report {"failed-row" if not ok else ""}" data-status="{status}" '
            f'data-name="{html.escape(name)}">'
            f"<td>{link}{nb_link}<div><small>{html.escape(str(rec.get('notebook', '')))}</small></div></td>"
            f'<td class="{status}">{status}{err}</td>'
            f"<td>{data_html(rec.get('data') or {}) or '<i>no data labels</i>'}</td>"
            f"<td>{kv_table(rec.get('params') or {}, rec.get('overrides') or ())}</td>"
            f"<td>{kv_table(vers, quote=False)}</td>"
            f"<td>{kv_table({k: mach[k] for k in ('hostname', 'gpu') if k in mach}, quote=False)}</td>"
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
