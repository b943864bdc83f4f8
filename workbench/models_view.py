"""Several models' rows side by side: a kernel's fraction of the HBM bound by M, graph and eager.

Study 07 runs one experiment script over several models, each writing its own ``rows.csv`` (the
tidy rows of ``experiments/run_moe_mxfp4.py``: ``M``, ``name``, ``method``, ``frac_hbm_bound``).
`load` reads the ones that are there and says, for each model whose file is not, that it is not
measured yet; `figure` draws the measured ones; `missing_note` is the note, with the command that
measures them. A file that arrives later fills its model in: nothing here names a model.

The files are data from elsewhere: each is read only below a size cap, with the columns it must
have checked, and a bad one is a ValueError that names the file and what to do.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

import pandas as pd

__all__ = ["MAX_BYTES", "COLUMNS", "Loaded", "load", "figure", "table", "sources", "missing_note"]

MAX_BYTES = 64 << 20          # a study's rows.csv is a few MB at most
COLUMNS = ("M", "name", "method", "frac_hbm_bound")
METHODS = ("graph", "eager")  # CUDA-graph replay (GPU time) first, then eager (as a user's loop gets it)
PROVENANCE = {"device": "prov_device_name", "git": "prov_git_sha", "measured": "prov_timestamp",
              "command": "prov_command"}


@dataclass
class Loaded:
    """The rows shown (one per model, variant, method and M) and, per model not shown, why."""

    rows: pd.DataFrame
    missing: dict[str, str] = field(default_factory=dict)
    files: dict[str, list[Path]] = field(default_factory=dict)    # model -> the files its rows came from
    provenance: dict[tuple, dict] = field(default_factory=dict)    # (model, file) -> device, git, measured, command

    @property
    def models(self) -> list[str]:
        return list(dict.fromkeys(self.rows.model)) if len(self.rows) else []


def _read(path: Path) -> pd.DataFrame:
    size = path.stat().st_size
    if size > MAX_BYTES:
        raise ValueError(f"{path}: {size} bytes, over the {MAX_BYTES} this view reads; is it a study's rows.csv? "
                         f"Re-run the experiment that writes it")
    try:
        df = pd.read_csv(path, dtype={c: str for c in PROVENANCE.values()})   # a sha of digits stays text
    except (pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a readable CSV ({type(exc).__name__}: {str(exc)[:200]}); re-run the "
                         f"experiment that writes it") from exc
    lacking = [c for c in COLUMNS if c not in df.columns]
    if lacking:
        raise ValueError(f"{path}: no column(s) {', '.join(lacking)} (it has {', '.join(map(str, df.columns[:12]))}"
                         f"{' ...' if len(df.columns) > 12 else ''}); this view reads experiments/run_moe_mxfp4.py's "
                         f"rows")
    return df


def _provenance(path: Path, first: pd.Series) -> dict:
    """device, git, measured, command: from the row's provenance columns, else from an info.json
    beside the file (the variant studies keep the command and the GPU there), else '?'."""
    out = {k: str(first[c]) if c in first.index and pd.notna(first[c]) else "?" for k, c in PROVENANCE.items()}
    info_path = path.parent / "info.json"
    if "?" in out.values() and info_path.is_file() and info_path.stat().st_size <= 1 << 20:
        try:
            info = json.loads(info_path.read_text())
        except (ValueError, UnicodeDecodeError):
            info = {}
        if isinstance(info, dict):
            for k, keys in (("command", ("command",)), ("device", ("gpu_name", "device"))):
                got = next((info[x] for x in keys if isinstance(info.get(x), str)), None)
                if out[k] == "?" and got:
                    out[k] = got
    return out


def _shown(path: Path, root: Path | None) -> str:
    """path relative to root where it lies under it (what a report shows), else as given."""
    try:
        return str(Path(path).resolve().relative_to(Path(root).resolve())) if root is not None else str(path)
    except ValueError:
        return str(path)


def load(files: Mapping[str, Path | Sequence[Path]], variants: Sequence[str], root: Path | None = None) -> Loaded:
    """Each model's rows of `variants` (kernel names in the rows' ``name``), in the order given.

    A model may name several files, the main one first: a (variant, method, M) it has wins over the
    later files' (which fill in what it lacks, e.g. an earlier study's rows). A model none of whose
    files exists, or whose files hold none of `variants`, is listed in ``missing`` with the reason;
    a file that is too large, unreadable or lacks a column raises ValueError. root: the reasons name
    paths relative to it."""
    frames, missing, used, prov = [], {}, {}, {}
    for model, paths in files.items():
        paths = [Path(paths)] if isinstance(paths, (str, Path)) else [Path(p) for p in paths]
        found = [p for p in paths if p.is_file()]
        if not found:
            missing[model] = f"no {paths[0].name} under {_shown(paths[0].parent, root)}"
            continue
        parts = []
        for path in found:
            df = _read(path)
            df = df[df.name.isin(variants) & df.method.isin(METHODS)]
            frac = pd.to_numeric(df.frac_hbm_bound, errors="coerce")
            M = pd.to_numeric(df.M, errors="coerce")
            keep = frac.notna() & M.notna()
            if not keep.any():
                continue
            parts.append(pd.DataFrame({"model": model, "variant": df.name[keep], "method": df.method[keep],
                                       "M": M[keep].astype(int), "frac_hbm_bound": frac[keep], "file": str(path)}))
            first = df[keep].iloc[0]
            used.setdefault(model, []).append(path)
            prov[(model, str(path))] = _provenance(path, first)
        if not parts:
            missing[model] = f"{', '.join(_shown(p, root) for p in found)}: no rows of {', '.join(variants)}"
            continue
        frames.append(pd.concat(parts).drop_duplicates(["variant", "method", "M"], keep="first"))
    cols = ["model", "variant", "method", "M", "frac_hbm_bound", "file"]
    rows = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=cols)
    return Loaded(rows.sort_values(["model", "variant", "method", "M"], key=_order(files, variants))
                  .reset_index(drop=True), missing, used, prov)


def _order(files: Mapping[str, Path], variants: Sequence[str]):
    """Sort keys that keep the models and variants in the order they were given."""
    rank = {"model": {m: i for i, m in enumerate(files)}, "variant": {v: i for i, v in enumerate(variants)},
            "method": {m: i for i, m in enumerate(METHODS)}}
    return lambda s: s.map(rank[s.name]) if s.name in rank else s


def figure(loaded: Loaded, *, goal: float | None = None, title: str = ""):
    """Fraction of the HBM bound against M (log), one line per model (colour) and variant (dash),
    graph replay and eager side by side; None when no model has rows."""
    import plotly.express as px

    if loaded.rows.empty:
        return None
    fig = px.line(loaded.rows, x="M", y="frac_hbm_bound", color="model", line_dash="variant", facet_col="method",
                  log_x=True, markers=True, category_orders={"method": list(METHODS), "model": loaded.models},
                  labels={"frac_hbm_bound": "fraction of the HBM bound"}, title=title)
    top = max(1.0, float(loaded.rows.frac_hbm_bound.max()))
    fig.update_yaxes(range=[0, top * 1.05])
    if goal is not None:
        fig.add_hline(y=goal, line_dash="dot", annotation_text=f"goal {goal:g}")
    return fig


def table(loaded: Loaded) -> pd.DataFrame:
    """The figure's numbers: one row per model, variant and method, one column per M."""
    if loaded.rows.empty:
        return pd.DataFrame()
    return loaded.rows.pivot_table(index=["model", "variant", "method"], columns="M", values="frac_hbm_bound",
                                   sort=False)


def sources(loaded: Loaded, root: Path | None = None) -> pd.DataFrame:
    """Where each shown model's rows come from: per file (relative to root, where it lies under it),
    the rows shown from it and the provenance of its first such row."""
    out = [{"model": m, "file": _shown(p, root), "rows": int(((loaded.rows.model == m) & (loaded.rows.file == str(p))).sum()),
            **loaded.provenance.get((m, str(p)), {})} for m in loaded.models for p in loaded.files[m]]
    return pd.DataFrame(out)


def missing_note(loaded: Loaded, command: str) -> str:
    """Markdown: each model not shown, why, and the command that measures it ('' when none)."""
    if not loaded.missing:
        return ""
    lines = [f"- **{model}: not measured yet** ({why})" for model, why in loaded.missing.items()]
    return ("\n".join(lines) + f"\n\nTo measure them, on one H100 or H200 run\n\n    {command}\n\n"
            "and re-run this notebook: their rows fill this figure in.")
