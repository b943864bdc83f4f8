"""A study notebook's profiled kernels: committed reports here, or profiled afresh on a GPU node.

    prof = study.plan("isa_hints", measure, ["hint0", "hint1"])   # results/profiles/isa_hints/, or a fresh run
    profs = study.load_reports(prof, ["hint0", "hint1"])          # {name: KernelProfile}; {} with a note if unreadable

`plan` is `workbench.datasource.plan` for the study's folder under
``results/profiles/``: with ``measure`` quick or full on a GPU node that has
ncu, it runs ``python experiments/profile_cases.py --out RUN_DIR CASE ...``
(one `workbench profile run` per case) and the notebook shows that run; else
the committed reports, with a note saying why. `reports_table` says, for each
report, its file, size, kernel, GPU, totals and how it was made.
"""
from __future__ import annotations

from pathlib import Path

from .report import INSTALL_HINT, ProfileError, read_summary, reader_missing

__all__ = ["plan", "load_reports", "reports_table", "entry_of"]

REPO = Path(__file__).resolve().parents[2]


def plan(study: str, measure: str, cases: list[str], *, timeout_s: float = 570.0):
    """The study's profiles (`workbench.datasource.StudyData`), profiled afresh where the node can."""
    from .. import datasource
    from .run import find_ncu

    data = datasource.plan(f"profiles_{study}", measure, committed_dir=REPO / "results" / "profiles" / study,
                           gpus_needed=1)
    why = None if not data.fresh else ("no ncu (Nsight Compute)" if find_ncu() is None
                                       else "no report reader (`pip install 'ncu-report==2026.3.1'`)"
                                       if reader_missing() else None)
    if why:  # a GPU but nothing to profile with, or to read the result: the committed reports, and why
        _note(f"*Profiles: this machine has a GPU but {why}, so the committed reports are shown "
              f"(`results/profiles/{study}/`).*")
        data = datasource.plan(f"profiles_{study}", "committed", committed_dir=REPO / "results" / "profiles" / study)
    data.measure([REPO / "experiments" / "profile_cases.py", "--out", data.out, *cases], timeout_s=timeout_s)
    return data


def load_reports(data, names: list[str]) -> dict:
    """{name: KernelProfile} of `data`'s reports NAME.ncu-rep; a note instead of any that cannot be read."""
    from .report import load

    missing = reader_missing()
    if missing:
        _note(f"*Profiles not shown: {INSTALL_HINT}.*")
        return {}
    out = {}
    for name in names:
        path = data.path(f"{name}.ncu-rep")
        if not path.is_file():
            _note(f"*No report `{path}`: profile on a GPU node with "
                  f"`python experiments/profile_cases.py --out {path.parent} {name}`.*")
            continue
        try:
            out[name] = load(path)
        except ProfileError as exc:
            _note(f"*Report `{path.name}` not shown: {exc}*")
    return out


def entry_of(prof):
    """The Triton cache entry the report's summary names, when it is beside the report (else None)."""
    from ..asm.cache import get_entry

    summary = prof.summary or {}
    if not summary.get("hash") or not summary.get("cache"):
        return None
    where = prof.path.parent / str(summary["cache"])
    try:
        return get_entry(str(summary["hash"]), where) if where.is_dir() else None
    except Exception:  # a damaged or foreign entry: the report stands alone
        return None


def reports_table(profs: dict):
    """One row per report: file, size, kernel, GPU, samples, instructions executed, date, how it was made."""
    import pandas as pd

    rows = []
    for name, p in profs.items():
        s, _ = read_summary(p.path)
        s = s or {}
        rows.append({"report": _rel(p.path), "kB": round(p.path.stat().st_size / 1024), "kernel": p.name,
                     "GPU": p.launch.get("device"), "samples": p.total_samples,
                     "instructions executed": int(p.pcs["inst_executed"].sum()),
                     "Triton entry": (s.get("hash") or "-")[:12], "made": s.get("created", "?"),
                     "command": s.get("command", "?")})
    return pd.DataFrame(rows)


def _rel(p: Path) -> str:
    try:
        return str(p.resolve().relative_to(REPO))
    except ValueError:
        return str(p)


def _note(markdown: str) -> None:
    from IPython.display import Markdown, display

    display(Markdown(markdown))
