"""Where a study notebook's numbers come from: measured afresh here, or committed.

Every study notebook has the parameter ``measure``:

``"auto"`` (the default)
    ``"quick"`` when this machine has the GPUs the study needs, else ``"committed"``.
``"committed"``
    render the results committed under ``results/<study>/``.
``"quick"``
    measure a reduced grid (minutes); ``"full"``: the whole study.

A GPU mode asked for on a machine without those GPUs renders the committed
results and says so in the report, with the command a GPU run would have used.

Fresh data go to a run directory, ``$WORKBENCH_FRESH_DIR/<study>/`` (``workbench
report`` sets it to ``<out>/fresh``), else ``results/fresh/<study>/``, with a
``provenance.json`` (git sha, versions, device, world size, command, clocks,
start/end, exit code) and the command's log. A measurement that fails or runs
past its timeout raises `MeasureError` with the log's tail: the notebook's cell
fails, and the report holds every output up to it.

Every figure and table is shown through `StudyData.show`, which labels it with
its data: fresh (and from which run) or committed (and from which file, and
where that was measured). `StudyData.compare` puts a fresh run's headline ratios
next to the committed ones, case by case, and says for each difference whether
it is noise, our kernel, the baseline, or the machine.
"""
from __future__ import annotations

import datetime as _dt
import html
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

REPO_ROOT = Path(__file__).resolve().parents[1]
MODES = ("auto", "committed", "quick", "full")
ENV_FRESH_DIR = "WORKBENCH_FRESH_DIR"
ENV_TIMEOUT = "WORKBENCH_MEASURE_TIMEOUT_S"
META_KEY = "workbench"  # output metadata key the report reads (see workbench.report.data_sources)
LOG_TAIL_LINES = 40
GPU_REASON = "needs {n} CUDA GPU(s) (sm_90: H100 or H200)"

__all__ = ["MODES", "MeasureError", "StudyData", "plan", "compare_cases"]


class MeasureError(RuntimeError):
    """A fresh measurement failed or ran past its timeout (the message ends with the log's tail)."""


def _gpu_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    try:
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # a broken driver counts as no GPU, the study renders committed data
        return 0


def _rel(p: Path) -> str:
    """`p` relative to the repository (a relative `p` is taken from the repository root, where runs start)."""
    p = Path(p)
    if not p.is_absolute():
        p = REPO_ROOT / p
    try:
        return str(p.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(p)


@dataclass
class StudyData:
    """The data one study notebook shows, and where they come from."""

    study: str
    asked: str                 # the `measure` parameter as given
    mode: str                  # "committed", "quick" or "full"
    committed_dir: Path
    run_dir: Path | None       # the fresh run's directory (None: committed)
    gpus: int
    gpus_needed: int
    note: str                  # why this mode, in a sentence
    provenance: dict[str, Any] = field(default_factory=dict)
    measured: bool = False     # a fresh run finished here

    @property
    def fresh(self) -> bool:
        return self.mode in ("quick", "full")

    @property
    def quick(self) -> bool:
        """A quick run: the one measured here, or (nothing measured) the one a GPU run would be, so that
        ``*(["--quick"] if data.quick else [])`` also gives the planned command its quick flags."""
        return self.grid == "quick"

    @property
    def dir(self) -> Path:
        """Where the tables are read: the run directory when fresh, else the committed one."""
        return self.run_dir if self.fresh and self.run_dir is not None else self.committed_dir

    @property
    def out(self) -> str:
        """The run directory for a measuring command (a placeholder when nothing is measured)."""
        return str(self.run_dir) if self.run_dir is not None else "RUN_DIR"

    def path(self, name: str) -> Path:
        return self.dir / name

    # -- measuring ---------------------------------------------------------

    def measure(self, args: Sequence[str], *, timeout_s: float = 570.0, world_size: int = 1) -> Path | None:
        """Run ``python ARGS`` (an experiment script writing into `run_dir`) when fresh.

        Committed mode: show the command a GPU run would have used and return None.
        The run's stdout/stderr go to ``run_dir/log.txt``; ``provenance.json`` is
        written before (state "running") and after. Raises `MeasureError` on a
        non-zero exit or after ``timeout_s`` (``$WORKBENCH_MEASURE_TIMEOUT_S`` caps it).
        """
        cmd = [sys.executable, *map(str, args)]
        # scripts and paths as the repository names them, so a record reads the same on every machine
        shown = " ".join(shlex.quote(_rel(Path(a)) if a.endswith(".py") or os.path.isabs(a) else a)
                         for a in map(str, args))
        if not self.fresh or self.run_dir is None:
            _display_note(f"**Not measured here:** {self.note} A {self.grid} run would be: "
                          f"`python {shown}`", {"kind": "measure-skipped", "study": self.study,
                                                "mode": self.grid, "command": shown})
            return None
        env_cap = os.environ.get(ENV_TIMEOUT, "").strip()
        if env_cap:
            try:
                timeout_s = min(timeout_s, float(env_cap))
            except ValueError:
                raise MeasureError(f"${ENV_TIMEOUT}={env_cap!r} is not a number of seconds") from None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.run_dir / "log.txt"
        prov = self._start_provenance(shown, world_size, timeout_s)
        self._write_provenance(prov)
        print(f"measuring afresh ({self.mode}, timeout {timeout_s:.0f} s): python {shown}", flush=True)
        t0 = time.monotonic()
        rc, timed_out = _run_logged(cmd, log_path, timeout_s)
        prov.update(finished=_now(), duration_s=round(time.monotonic() - t0, 1), returncode=rc,
                    timed_out=timed_out, clocks_after=_clocks(), state="ok" if rc == 0 else "failed")
        self._write_provenance(prov)
        self.provenance = prov
        tail = _tail(log_path)
        if timed_out:
            raise MeasureError(f"{self.study}: the {self.mode} run passed its {timeout_s:.0f} s timeout and was "
                               f"stopped; its log ({_rel(log_path)}) ends with:\n{tail}")
        if rc != 0:
            raise MeasureError(f"{self.study}: the {self.mode} run exited with {rc}; its log ({_rel(log_path)}) "
                               f"ends with:\n{tail}")
        self.measured = True
        print(f"done in {prov['duration_s']} s; tables in {_rel(self.run_dir)}", flush=True)
        return self.run_dir

    @property
    def grid(self) -> str:
        """"quick" or "full": the grid measured here, or the one a GPU run would measure (committed mode)."""
        return self.mode if self.fresh else ("full" if self.asked == "full" else "quick")

    def _start_provenance(self, shown: str, world_size: int, timeout_s: float) -> dict[str, Any]:
        from . import provenance

        info = provenance.collect(world_size=world_size)
        info.pop("knobs", None)
        return {"study": self.study, "mode": self.mode, "command": f"python {shown}", "cwd": _rel(REPO_ROOT),
                "timeout_s": timeout_s, "state": "running", "started": _now(), "clocks_before": _clocks(),
                **info}

    def _write_provenance(self, prov: dict[str, Any]) -> None:
        assert self.run_dir is not None
        tmp = self.run_dir / "provenance.json.tmp"
        tmp.write_text(json.dumps(prov, indent=1, default=str) + "\n")
        tmp.replace(self.run_dir / "provenance.json")

    # -- reading and labelling ----------------------------------------------

    def read(self, name: str):
        """A table (csv or parquet) from `dir`; an empty DataFrame when the file is not there."""
        import pandas as pd

        p = self.path(name)
        if not p.is_file():
            return pd.DataFrame()
        return pd.read_parquet(p) if p.suffix == ".parquet" else pd.read_csv(p)

    def read_committed(self, name: str):
        import pandas as pd

        p = self.committed_dir / name
        if not p.is_file():
            return pd.DataFrame()
        return pd.read_parquet(p) if p.suffix == ".parquet" else pd.read_csv(p)

    def label(self, *names: str) -> str:
        """One line: fresh or committed, the files, and where they were measured."""
        if not names:
            return "computed in this notebook on this machine (no measured data)"
        files = ", ".join(_rel(self.path(n)) for n in names) or _rel(self.dir)
        if self.fresh:
            p = self.provenance
            return (f"fresh data ({self.mode} run, {p.get('started', '?')}, {p.get('device_name', '?')}"
                    f" x{p.get('device_count', '?')}, git {str(p.get('git_sha', '?'))[:12]}): {files}")
        where = _committed_origin(self.committed_dir, names)
        return f"committed data: {files}{' (' + where + ')' if where else ''}"

    def badge(self, *names: str) -> None:
        """Display the data label of the figure or table that follows."""
        kind = "computed" if not names else "fresh" if self.fresh else "committed"
        text = self.label(*names)
        page = f'<div class="wb-data wb-data-{kind}" data-source="{kind}">{html.escape(text)}</div>'
        _display_html(page, {"kind": "data", "source": kind, "study": self.study, "mode": self.mode,
                             "files": [_rel(self.path(n)) for n in names], "label": text})

    def show(self, fig, *names: str) -> None:
        """Show a plotly figure (or a DataFrame) labelled with the data it was drawn from."""
        self.badge(*names)
        if hasattr(fig, "update_layout") and hasattr(fig, "show"):
            src = f"{'fresh' if self.fresh else 'committed'}: {', '.join(names)}" if names else "computed here"
            fig.add_annotation(text=src, xref="paper", yref="paper", x=1, y=1.0,
                               xanchor="right", yanchor="bottom", showarrow=False, font={"size": 10},
                               opacity=0.7)
            fig.show()
        else:
            from IPython.display import display

            display(fig)

    def summary(self) -> None:
        """Display where this study's data come from (call after `measure`)."""
        kind = "fresh" if self.fresh else "committed"
        if self.fresh:
            p = self.provenance
            rows = {"data": f"measured now ({self.mode})", "run directory": _rel(self.dir),
                    "command": p.get("command", ""), "device": f"{p.get('device_name')} x{p.get('device_count')}",
                    "git": f"{str(p.get('git_sha'))[:12]} (dirty: {p.get('git_dirty')})",
                    "torch / triton / CUDA": f"{p.get('torch_version')} / {p.get('triton_version')} / "
                                             f"{p.get('cuda_version')}",
                    "took": f"{p.get('duration_s', '?')} s"}
        else:
            rows = {"data": "committed results (not measured on this machine)",
                    "directory": _rel(self.committed_dir), "why": self.note}
        cells = "".join(f"<tr><td>{html.escape(k)}</td><td><code>{html.escape(str(v))}</code></td></tr>"
                        for k, v in rows.items())
        _display_html(f'<div class="wb-data-summary wb-data-{kind}"><table>{cells}</table></div>',
                      {"kind": "data-summary", "source": kind, "study": self.study, "mode": self.mode,
                       "dir": _rel(self.dir), "note": self.note})

    # -- fresh against committed ------------------------------------------------

    def compare(self, cases: Callable[[Any], Any], name: str, *, what: str, noise: float = 0.03,
                committed_name: str | None = None):
        """Fresh headline ratios next to the committed ones (a regression check).

        ``cases(table) -> DataFrame`` indexed by case with columns ``ours`` and
        ``baseline`` (times, lower is better) is applied to the fresh and the
        committed file ``name``. Shows one row per case both runs have, plus the
        geometric mean, and returns that frame (None when there is nothing fresh).
        ``noise``: the relative run-to-run spread below which a difference is noise.
        """
        from IPython.display import Markdown, display

        if not self.fresh:
            display(Markdown(f"*{what}: committed numbers only (nothing measured here to compare).*"))
            return None
        fresh = cases(self.read(name))
        committed = cases(self.read_committed(committed_name or name))
        table = compare_cases(fresh, committed, noise=noise)
        if table.empty:
            display(Markdown(f"*{what}: the fresh run and the committed one have no case in common.*"))
            return table
        gm = table.attrs["geomean"]
        _display_html(
            f"<div class='wb-headline'><b>{html.escape(what)}</b>: geometric mean over {len(table)} cases "
            f"{gm['fresh']:.3f}x fresh vs {gm['committed']:.3f}x committed "
            f"({gm['change']:+.1%}): {html.escape(gm['why'])}</div>",
            {"kind": "headline", "study": self.study, "what": what, "cases": len(table), **gm})
        display(table.round(4))
        return table


def compare_cases(fresh, committed, *, noise: float = 0.03):
    """Join two ``cases`` frames (``ours``, ``baseline`` times) on their index and explain each change.

    ratio = baseline / ours (above 1: ours faster). ``why`` says, per case, whether
    the ratio moved within ``noise``; else which side moved: ours alone
    (a change of ours), the baseline alone (the library or the machine), or both
    (the machine: clocks, power, other load).
    """
    import pandas as pd

    cols = ["ours", "baseline"]
    for df, which in ((fresh, "fresh"), (committed, "committed")):
        missing = [c for c in cols if c not in df.columns]
        if missing and not df.empty:
            raise ValueError(f"compare: the {which} cases lack column(s) {missing}; give 'ours' and 'baseline' times")
    if fresh.empty or committed.empty:
        return pd.DataFrame()
    both = fresh[cols].add_suffix("_fresh").join(committed[cols].add_suffix("_committed"), how="inner").dropna()
    both = both[(both > 0).all(axis=1)]
    if both.empty:
        return pd.DataFrame()
    out = pd.DataFrame(index=both.index)
    out["fresh"] = both.baseline_fresh / both.ours_fresh
    out["committed"] = both.baseline_committed / both.ours_committed
    out["change"] = out.fresh / out.committed - 1
    ours_moved = both.ours_fresh / both.ours_committed - 1
    base_moved = both.baseline_fresh / both.baseline_committed - 1
    out["ours_time_change"] = ours_moved
    out["baseline_time_change"] = base_moved
    out["why"] = [_why(c, o, b, noise) for c, o, b in zip(out.change, ours_moved, base_moved)]
    gm_f = math.exp(sum(map(math.log, out.fresh)) / len(out))
    gm_c = math.exp(sum(map(math.log, out.committed)) / len(out))
    gm_change = gm_f / gm_c - 1
    counts = out.why.str.split(":").str[0].value_counts().to_dict()
    summary = _why(gm_change, _gmean(1 + ours_moved) - 1, _gmean(1 + base_moved) - 1, noise)
    out.attrs["geomean"] = {"fresh": gm_f, "committed": gm_c, "change": gm_change, "why": summary,
                            "noise": noise, "by_reason": counts}
    return out


def _gmean(values) -> float:
    vals = [float(v) for v in values]
    return math.exp(sum(map(math.log, vals)) / len(vals))


def _why(change: float, ours: float, base: float, noise: float) -> str:
    if abs(change) <= noise:
        return f"noise: within ±{noise:.0%}"
    better = change > 0
    ours_moved, base_moved = abs(ours) > noise, abs(base) > noise
    if ours_moved and not base_moved:
        return ("ours: faster than committed, baseline unchanged" if better
                else "ours: REGRESSION, ours slower than committed while the baseline held")
    if base_moved and not ours_moved:
        return f"baseline: the library {'slower' if better else 'faster'} than committed, ours unchanged"
    if ours_moved and base_moved:
        return ("machine: both moved (clocks, power, other load, another GPU or driver); "
                f"ours {ours:+.1%}, baseline {base:+.1%}")
    return f"split: ours {ours:+.1%}, baseline {base:+.1%}, each within noise"


# ---------------------------------------------------------------------------


def plan(study: str, measure: str = "auto", *, committed_dir: str | os.PathLike, gpus_needed: int = 1,
         fresh_dir: str | os.PathLike | None = None) -> StudyData:
    """Decide where `study`'s data come from, and show it; see the module docstring."""
    asked = str(measure).strip().lower()
    if asked in ("true", "yes", "1"):  # the old boolean parameter: measure=True meant a quick run
        asked = "quick"
    elif asked in ("false", "no", "0", "none", ""):
        asked = "committed"
    if asked not in MODES:
        raise ValueError(f"measure={measure!r}: choose one of {', '.join(MODES)} "
                         "(auto: quick on a machine with the study's GPUs, committed elsewhere)")
    committed = Path(committed_dir)
    if not committed.is_absolute():
        committed = REPO_ROOT / committed
    gpus = _gpu_count()
    need = GPU_REASON.format(n=gpus_needed)
    if asked == "committed":
        mode, note = "committed", "`measure` is \"committed\"."
    elif gpus >= gpus_needed:
        mode = "quick" if asked == "auto" else asked
        note = f"`measure` is \"{asked}\" and this machine has {gpus} GPU(s)."
    else:
        mode = "committed"
        note = f"this study {need}; this machine has {gpus}."
    run_dir = None
    if mode != "committed":
        root = Path(fresh_dir) if fresh_dir else Path(os.environ.get(ENV_FRESH_DIR) or REPO_ROOT / "results" / "fresh")
        run_dir = root / study
        if run_dir.exists():  # one study's fresh data never mix two runs
            stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
            run_dir = root / f"{study}-{stamp}"
    data = StudyData(study=study, asked=asked, mode=mode, committed_dir=committed, run_dir=run_dir, gpus=gpus,
                     gpus_needed=gpus_needed, note=note)
    return data


def _committed_origin(directory: Path, names: Sequence[str]) -> str:
    """'measured on <device>, git <sha>' from the first named table's provenance columns, if it has them."""
    for n in names:
        p = directory / n
        if not p.is_file() or p.suffix not in (".csv", ".parquet") or p.stat().st_size > 64 << 20:
            continue
        try:
            import pandas as pd

            row = (pd.read_parquet(p) if p.suffix == ".parquet" else pd.read_csv(p, nrows=1)).iloc[0]
        except Exception:
            continue
        dev = next((row[c] for c in ("prov_device_name", "device_name", "device") if c in row.index), None)
        sha = next((row[c] for c in ("prov_git_sha", "git_sha") if c in row.index), None)
        bits = [f"measured on {dev}" if dev is not None else "", f"git {str(sha)[:12]}" if sha is not None else ""]
        return ", ".join(b for b in bits if b)
    return ""


def _run_logged(cmd: list[str], log_path: Path, timeout_s: float) -> tuple[int, bool]:
    """Run `cmd` in its own process group, output to `log_path`; kill the group at the timeout."""
    from .dist import child_env  # multicast off, the repo on PYTHONPATH, no interpreter leaking in

    with open(log_path, "w") as log:
        log.write("$ " + " ".join(shlex.quote(c) for c in cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT), env=child_env(),
                                start_new_session=True)
        try:
            return proc.wait(timeout=timeout_s), False
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            return proc.returncode if proc.returncode is not None else -9, True
        except BaseException:  # an interrupted notebook leaves nothing running on the GPUs
            _kill_group(proc)
            raise


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(timeout=5)
            return
        except subprocess.TimeoutExpired:
            continue


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 16384))
        text = f.read().decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])


def _clocks() -> dict[str, str] | None:
    """SM/memory clocks, power and temperature per GPU from nvidia-smi (None without it)."""
    query = "index,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu"
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    if r.returncode != 0:
        return None
    keys = query.split(",")
    return {line.split(",")[0].strip(): dict(zip(keys[1:], (v.strip() for v in line.split(",")[1:])))
            for line in r.stdout.strip().splitlines()[:16]}


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _display_html(page: str, meta: dict[str, Any]) -> None:
    from IPython.display import HTML, display

    display(HTML(page), metadata={META_KEY: meta})


def _display_note(markdown: str, meta: dict[str, Any]) -> None:
    from IPython.display import Markdown, display

    display(Markdown(markdown), metadata={META_KEY: meta})
