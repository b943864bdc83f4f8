"""The tables of the GEMM selection report, from measured rows (no GPU needed): what
``experiments/run_gemm_selection.py`` (``verify.csv``) and ``experiments/launch_cost.py --paths``
(``paths.csv``) write, summarised against the goals of issue 43.

Per shape and mode (graph, eager), from ``verify.csv`` (one row per shape, method and mode):

* ``best``: the per-shape best of our best candidate and cuBLAS (every candidate of ours timed in
  the same run, taking turns with the others);
* as chosen (``matmul`` as users call it: tables, else the cold rule): its regret (time over
  ``best``), and its ratio to cuBLAS;
* ours alone: the best of our candidates against cuBLAS (a loss of our kernels cannot hide
  behind a choice of the library);
* the cold rule alone: its regret and its ratio to cuBLAS.

``summary`` gives one row per set (held-out half, fresh shapes, both) and mode; ``by_class`` the
same per region class (``kernels.gemm.cold.shape_class``: bigpad, narrow, longk, other);
``goals`` checks each goal of the issue; ``paths_summary`` the host time per call of each config
path against ``torch.mm``. ``markdown`` renders them all.
"""
from __future__ import annotations

import math

import pandas as pd

LIBRARY = "cublas"
OURS_PREFIX = "ours:"     # methods "ours:<candidate>": each of our candidates, named
SHAPE_COLS = ["set", "M", "N", "K", "dtype", "b"]
# The goals of issue 43 (H200; graph and eager)
CHOSEN_GEOMEAN, CHOSEN_MIN = 0.99, 0.95            # as chosen / per-shape best, held-out + fresh
BIGPAD_GEOMEAN, BIGPAD_MIN = 2.0, 1.5              # as chosen vs cuBLAS, large unaligned shapes
LARGE_MIN = 1024   # issue 43's large unaligned shapes: M, N and K all at least this (the rule's class is wider)
OURS_FRESH_GEOMEAN, OURS_FRESH_MIN = 1.0, 0.85     # ours alone vs cuBLAS, fresh (aligned) shapes
HOST_LIBRARY, HOST_OURS = 1.1, 1.2                 # host time per call / torch.mm's


def geomean(xs) -> float:
    xs = [float(x) for x in xs if x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def per_shape(rows: pd.DataFrame) -> pd.DataFrame:
    """One row per (shape, set, mode): the times of the chosen config, the cold rule's, cuBLAS
    and our best candidate (rows whose status is not "ok" are left out), the per-shape best of
    ours and cuBLAS, and the ratios the report tables summarise."""
    ok = rows[rows.status == "ok"].copy()
    ok["b"] = ok["b"].fillna("row") if "b" in ok else "row"
    out = []
    for key, g in ok.groupby(SHAPE_COLS + ["mode"], sort=False):
        t = dict(zip(g.method, g.median_us))
        ours = {m[len(OURS_PREFIX):]: v for m, v in t.items() if m.startswith(OURS_PREFIX) and v > 0}
        if LIBRARY not in t or not ours or "chosen" not in t:
            continue
        best_ours_name = min(ours, key=ours.get)
        best_ours = ours[best_ours_name]
        best = min(best_ours, t[LIBRARY])
        chosen = g[g.method == "chosen"].iloc[0]
        rec = dict(zip(SHAPE_COLS + ["mode"], key))
        rec.update({"class": chosen.get("class", "other"), "chosen": chosen.candidate, "source": chosen.source,
                    "chosen_us": t["chosen"], "cold": g[g.method == "cold"].candidate.iloc[0] if "cold" in t else "",
                    "cold_us": t.get("cold", math.nan), "cublas_us": t[LIBRARY], "best_ours": best_ours_name,
                    "best_ours_us": best_ours, "best_us": best, "ours_timed": len(ours),
                    "chosen_vs_best": best / t["chosen"], "chosen_vs_cublas": t[LIBRARY] / t["chosen"],
                    "ours_vs_cublas": t[LIBRARY] / best_ours,
                    "cold_vs_best": best / t["cold"] if "cold" in t else math.nan,
                    "cold_vs_cublas": t[LIBRARY] / t["cold"] if "cold" in t else math.nan})
        out.append(rec)
    return pd.DataFrame(out)


def _row(g: pd.DataFrame, **keys) -> dict:
    return {**keys, "shapes": len(g),
            "chosen_vs_best_geomean": geomean(g.chosen_vs_best), "chosen_vs_best_min": g.chosen_vs_best.min(),
            f"chosen_below_{CHOSEN_MIN}": int((g.chosen_vs_best < CHOSEN_MIN).sum()),
            "chosen_vs_cublas_geomean": geomean(g.chosen_vs_cublas), "chosen_vs_cublas_min": g.chosen_vs_cublas.min(),
            "ours_vs_cublas_geomean": geomean(g.ours_vs_cublas), "ours_vs_cublas_min": g.ours_vs_cublas.min(),
            f"ours_below_{OURS_FRESH_MIN}": int((g.ours_vs_cublas < OURS_FRESH_MIN).sum()),
            "cold_vs_best_geomean": geomean(g.cold_vs_best), "cold_vs_best_min": g.cold_vs_best.min(),
            "cold_vs_cublas_geomean": geomean(g.cold_vs_cublas),
            "library_chosen": int((g.chosen == LIBRARY).sum()), "tuned_or_table": int((g.source != "cold").sum())}


def _with_all(shapes: pd.DataFrame) -> pd.DataFrame:
    """The shapes once per set and once more under set "all" (the held-out half and the fresh
    shapes together, what the goal is stated on)."""
    both = shapes[shapes.set.isin(["held_out", "fresh"])].assign(set="all")
    return pd.concat([shapes, both], ignore_index=True)


def summary(shapes: pd.DataFrame) -> pd.DataFrame:
    """Per set (held_out, fresh, all) and mode: as chosen and ours alone side by side."""
    if shapes.empty:
        return pd.DataFrame()
    return pd.DataFrame([_row(g, set=s, mode=m) for (s, m), g in _with_all(shapes).groupby(["set", "mode"])])


def by_class(shapes: pd.DataFrame) -> pd.DataFrame:
    """The same per region class (bigpad, narrow, longk, other)."""
    if shapes.empty:
        return pd.DataFrame()
    return pd.DataFrame([_row(g, set=s, mode=m, **{"class": c})
                         for (s, m, c), g in _with_all(shapes).groupby(["set", "mode", "class"])])


def goals(shapes: pd.DataFrame) -> pd.DataFrame:
    """Each performance goal of issue 43, per mode: the value measured, the goal, met or not
    (None: no shapes of that kind measured)."""
    out = []
    for mode in sorted(shapes["mode"].unique()) if not shapes.empty else []:
        g = shapes[shapes["mode"] == mode]
        both = g[g.set.isin(["held_out", "fresh"])]
        big = g[(g["class"] == "bigpad") & (g[["M", "N", "K"]].min(axis=1) >= LARGE_MIN)]
        fresh = g[g.set == "fresh"]
        checks = [
            ("as chosen / best of ours and cuBLAS, geomean (held-out + fresh)", geomean(both.chosen_vs_best),
             CHOSEN_GEOMEAN, len(both)),
            ("as chosen / best of ours and cuBLAS, least (held-out + fresh)", both.chosen_vs_best.min(),
             CHOSEN_MIN, len(both)),
            ("as chosen vs cuBLAS, geomean (large unaligned)", geomean(big.chosen_vs_cublas), BIGPAD_GEOMEAN,
             len(big)),
            ("as chosen vs cuBLAS, least (large unaligned)", big.chosen_vs_cublas.min(), BIGPAD_MIN, len(big)),
            ("ours alone vs cuBLAS, geomean (fresh)", geomean(fresh.ours_vs_cublas), OURS_FRESH_GEOMEAN, len(fresh)),
            ("ours alone vs cuBLAS, least (fresh)", fresh.ours_vs_cublas.min(), OURS_FRESH_MIN, len(fresh)),
        ]
        for what, value, goal, n in checks:
            met = None if n == 0 or not math.isfinite(value) else bool(value >= goal)
            out.append({"mode": mode, "goal": what, "value": value, "target": goal, "shapes": n, "met": met})
    return pd.DataFrame(out)


# --------------------------------------------------------------------------
# Host time per call of each config path (experiments/launch_cost.py --paths)
# --------------------------------------------------------------------------
def path_class(impl: str, kind: str, padded: bool = False) -> str:
    """A paths.csv row's path: 'torch.mm', 'library' (matmul running cuBLAS, chosen or named), or
    ours by plan kind ('tma', 'splitk', 'gluon', ...; with operands copied first: 'tma (padded)')."""
    if impl == "torch.mm":
        return "torch.mm"
    if kind == "library":
        return "library"
    return f"{kind or 'unknown'}{' (padded)' if padded else ''}"


def paths_summary(rows: pd.DataFrame) -> pd.DataFrame:
    """Per path (``path_class`` of each row, and the selected path apart): the host time per call
    over torch.mm's on the same shape (median, least and most over the shapes), the number of
    calls each median took, and the goal (library: 1.1x, ours: 1.2x)."""
    rows = rows[rows.case.str.startswith("paths ")].copy()
    if rows.empty:
        return pd.DataFrame()
    padded = rows.padded.fillna(False).astype(bool) if "padded" in rows else [False] * len(rows)
    rows["path"] = [("selected: " if i == "matmul (selected)" else "") + path_class(i, k, p)
                    for i, k, p in zip(rows.impl, rows.kind.fillna(""), padded)]
    out = []
    for path, g in rows[rows.impl != "torch.mm"].groupby("path"):
        goal = HOST_LIBRARY if path.endswith("library") else HOST_OURS
        r = g.ratio_vs_torch_mm
        out.append({"path": path, "shapes": g.case.nunique(), "host_us_median": g.host_us.median(),
                    "ratio_median": r.median(), "ratio_min": r.min(), "ratio_max": r.max(),
                    "calls_min": int(g.host_calls.min()), "goal": goal, "met": bool(r.max() <= goal)})
    mm = rows[rows.impl == "torch.mm"]
    out.append({"path": "torch.mm", "shapes": mm.case.nunique(), "host_us_median": mm.host_us.median(),
                "ratio_median": 1.0, "ratio_min": 1.0, "ratio_max": 1.0,
                "calls_min": int(mm.host_calls.min()) if len(mm) else 0, "goal": math.nan, "met": None})
    return pd.DataFrame(out)


def _table(df: pd.DataFrame) -> str:
    if df.empty:
        return "(no rows)"
    return "```\n" + df.to_string(index=False, float_format=lambda x: f"{x:.3f}") + "\n```"


def markdown(shapes: pd.DataFrame, head: str = "") -> str:
    """The report: goals, the summary and the per-class table (as chosen and ours alone side by
    side in each), then every shape."""
    cols = ["set", "mode", "class", "M", "N", "K", "dtype", "b", "chosen", "source", "chosen_vs_best",
            "chosen_vs_cublas", "best_ours", "ours_vs_cublas", "cold", "cold_vs_best"]
    parts = [head, "## Goals (issue 43)\n", _table(goals(shapes)), "",
             "## As chosen and ours alone, per set\n",
             "`chosen_vs_best`: the per-shape best of {our best candidate, cuBLAS} over the chosen config's time "
             "(1.0: the best ran); `ours_vs_cublas`: cuBLAS's time over our best candidate's (ours alone); "
             "`cold_*`: the cold rule alone.\n", _table(summary(shapes)), "",
             "## Per region class\n", _table(by_class(shapes)), "",
             "## Every shape\n", _table(shapes[[c for c in cols if c in shapes]] if not shapes.empty else shapes), ""]
    return "\n".join(parts)
