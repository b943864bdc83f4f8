"""Re-run study notebooks headless and export them as self-contained HTML.

    workbench report notebooks/01_isa_hints.ipynb -p targets '[sm90, gfx942]' --out results/reports
    workbench report --all

(the command: ``workbench.report_command``, which hands each notebook to an executor).

Each notebook is executed with papermill (defaults live in the cell tagged
``parameters``; ``-p NAME VALUE`` overrides them, VALUE parsed as YAML), then
the executed notebook is exported with nbconvert to ONE HTML file that needs
no network (``workbench.report_html``: plotly inlined, no CDN; the cells tagged
``findings`` shown again after the title, those tagged ``setup`` folded); the
executed notebook keeps every cell as it ran.

A failing cell still gives an executed notebook and an HTML report with every
output up to the error and the error itself; the command then exits 1 and the
index marks the report failed. ``index.html`` in the output directory lists
every report found there, with its parameters, versions, machine and date
(``workbench.report_index``).

Python API: ``run_report(notebook, params, out_dir) -> ReportResult`` and
``build_index(out_dir) -> Path``.
"""
from __future__ import annotations

import ast
import datetime as _dt
import hashlib
import html
import json
import os
import platform
import socket
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .report_html import data_sources, export_html, make_offline, remote_references  # noqa: F401  (public here too)
from .report_index import DEFAULT_OUT, RECORD_SUFFIX, build_index, load_records, write_summary  # noqa: F401

KERNEL_NAME = "python3"
NOTEBOOK_GLOB = "[0-9]*.ipynb"
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
# running


def report_name(nb_path: Path, overrides: Mapping[str, Any]) -> str:
    """The report's file stem: the notebook's, plus a short hash of the overrides when any."""
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
    name = report_name(nb_path, overrides)
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
