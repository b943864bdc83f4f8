"""A sweep's rows on disk: ``rows.parquet`` in its results folder, and reading them back.

`RowStore` appends rows and rewrites the file atomically on each flush, so an interrupted sweep
loses little. A row's identity is (point_id, variant, repeat) on a kind of device
(``device_name``): `RowStore.done_keys` says what a resumed run skips. Rows whose status is in
`RETRY_STATUSES` (``skipped``, ``not_run``) are recorded but do not count as done, and are
replaced when the same row is recorded again on the same kind of device.

`load_rows` reads a sweep's rows (a results folder, a parquet/CSV file, or a sweep name under
results/); `best_per_shape` picks the fastest ok kernel row per shape against a baseline.
"""
from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterable

from .spec import REPO_ROOT

__all__ = ["RowStore", "RETRY_STATUSES", "load_rows", "best_per_shape"]


RETRY_STATUSES = ("skipped", "not_run")  # recorded, but a resumed run tries these points again


def _row_keys(df) -> list[tuple]:
    dev = df["device_name"] if "device_name" in df else [None] * len(df)
    return list(zip(df["point_id"], df["variant"], df["repeat"].astype(int), dev))


class RowStore:
    """rows.parquet under the results folder, rewritten atomically on each flush.

    Rows whose status is in ``RETRY_STATUSES`` do not count as done, and are
    replaced when the same (point, variant, repeat) is recorded again on the
    same kind of device."""

    def __init__(self, folder: Path):
        import pandas as pd

        self.folder = folder
        self.path = folder / "rows.parquet"
        self.pending: list[dict] = []
        self.existing = pd.read_parquet(self.path) if self.path.exists() else None

    def done_keys(self, device_name: str | None = None) -> set:
        """(point_id, variant, repeat) already recorded (on ``device_name``, if given)."""
        df = self.existing
        if df is None or df.empty:
            return set()
        if device_name is not None and "device_name" in df:
            df = df[df["device_name"] == device_name]
        if "status" in df:
            df = df[~df["status"].isin(RETRY_STATUSES)]
        return set(zip(df["point_id"], df["variant"], df["repeat"].astype(int)))

    def add(self, row: dict) -> None:
        self.pending.append(row)

    def flush(self) -> None:
        import pandas as pd

        if not self.pending:
            return
        new = pd.DataFrame(self.pending)
        old = self.existing
        if old is not None and not old.empty and "status" in old and old["status"].isin(RETRY_STATUSES).any():
            fresh = set(_row_keys(new))
            replaced = old["status"].isin(RETRY_STATUSES) & pd.Series([k in fresh for k in _row_keys(old)],
                                                                      index=old.index)
            old = old[~replaced]
        frames = [f for f in (old, new) if f is not None and not f.empty]
        df = pd.concat(frames, ignore_index=True) if len(frames) > 1 else frames[0]
        df = _normalize_frame(df)
        self.folder.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".parquet.tmp")
        df.to_parquet(tmp, index=False)
        os.replace(tmp, self.path)
        self.existing = df
        self.pending = []

    def frame(self):
        import pandas as pd

        self.flush()
        return self.existing if self.existing is not None else pd.DataFrame()


def _normalize_frame(df):
    # Mixed-type object columns (e.g. a parameter that is None or an int) must be one type for parquet.
    for col in df.columns:
        if df[col].dtype == object:
            kinds = {type(v) for v in df[col] if v is not None and not (isinstance(v, float) and math.isnan(v))}
            if len(kinds) > 1 and not kinds <= {int, float}:
                df[col] = df[col].map(lambda v: None if v is None or (isinstance(v, float) and math.isnan(v))
                                      else str(v))
    return df


def load_rows(name_or_path: str | os.PathLike):
    """Rows of a sweep: a results folder, a parquet/CSV file, or a sweep name under results/."""
    import pandas as pd

    p = Path(name_or_path)
    if not p.exists():
        p = REPO_ROOT / "results" / str(name_or_path)
    if p.is_dir():
        files = sorted(p.glob("*.parquet"))
        if not files:
            raise FileNotFoundError(f"{p}: no parquet files (run `workbench sweep experiments/{p.name}.yaml`)")
        return pd.concat([pd.read_parquet(f) for f in files], ignore_index=True)
    if p.suffix == ".csv":
        return pd.read_csv(p)
    return pd.read_parquet(p)


def best_per_shape(df, *, shape_cols: Iterable[str] = ("M", "N", "K"), baseline: str | None = "cublas"):
    """The fastest ok kernel row per (shape, dtype), with the baseline's time and the ratio."""
    import pandas as pd

    cols = list(shape_cols) + ["dtype"]
    ok = df[(df["status"] == "ok") & (~df["is_baseline"].astype(bool))]
    if ok.empty:
        return pd.DataFrame()
    best = ok.loc[ok.groupby(cols)["median_ms"].idxmin()].copy()
    if baseline is not None:
        base = df[(df["variant"] == baseline) & (df["status"] == "ok")].groupby(cols)["median_ms"].median()
        best = best.join(base.rename(f"{baseline}_ms"), on=cols)
        best[f"speedup_vs_{baseline}"] = best[f"{baseline}_ms"] / best["median_ms"]
    return best.reset_index(drop=True)
