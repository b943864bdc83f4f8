"""Plotly figure builders for kernel studies (imported only where plotly is).

Every builder takes tidy tables (rows of ``workbench.sweep`` or the
heuristic-vs-cuBLAS table of ``experiments/run_gemm_tiling.py``) and returns a
``plotly.graph_objects.Figure``. Numbers that are not GPU measurements
(``is_performance`` False) are labelled so in the title.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import plotly.graph_objects as go

__all__ = ["roofline", "scatter_mnk", "study_lines", "heuristic_vs_best", "regret", "PALETTE"]

# A long qualitative palette (many configurations share one figure).
PALETTE = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
    "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd", "#e6550d", "#31a354",
    "#756bb1", "#636363", "#6baed6", "#fd8d3c", "#74c476", "#9e9ac8", "#969696", "#9c9ede", "#cedb9c",
    "#e7ba52", "#e7969c", "#de9ed6", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896", "#c5b0d5", "#c49c94",
]

_DTYPE_KEY = {"bf16": "bf16_tflops", "bfloat16": "bf16_tflops", "fp16": "fp16_tflops", "float16": "fp16_tflops"}


def _not_performance(df) -> bool:
    return df is not None and "is_performance" in df and len(df) and not bool(df["is_performance"].astype(bool).all())


def _title(title: str, df=None) -> str:
    return title + (" [CPU/interpreter timings: not performance]" if _not_performance(df) else "")


def _roof_xy(peak_tflops: float, bw_gbps: float, x_min: float, x_max: float):
    ridge = peak_tflops * 1e12 / (bw_gbps * 1e9)
    xs = [x_min, min(max(ridge, x_min), x_max), x_max]
    ys = [min(peak_tflops, x * bw_gbps / 1e3) for x in xs]
    return xs, ys, ridge


def roofline(points=None, ceil: Mapping[str, Any] | None = None, *, dtype: str = "bf16",
             color: str | None = "config", title: str | None = None, x_range: Sequence[float] = (1, 1e4)):
    """Roofline (log-log): attainable TFLOP/s against FLOP per byte.

    ceil: ``workbench.roofline.ceilings()``: measured ceilings (solid) and the
    datasheet's (dashed). points: a table with ``flops``, ``bytes`` and
    ``tflops`` columns (e.g. sweep rows), coloured by ``color``.
    """
    fig = go.Figure()
    ceil = ceil or {}
    key = _DTYPE_KEY.get(dtype, "bf16_tflops")
    roofs = []
    m = ceil.get("measured")
    if m and m.get(key) and m.get("copy_gbps"):
        roofs.append((f"measured {m.get('date', '')}: {m[key]:.0f} TFLOP/s, {m['copy_gbps']:.0f} GB/s",
                      m[key], m["copy_gbps"], "solid"))
    s = ceil.get("datasheet")
    if s and s.get(key) and s.get("hbm_gbps"):
        roofs.append((f"datasheet: {s[key]:.0f} TFLOP/s, {s['hbm_gbps']:.0f} GB/s", s[key], s["hbm_gbps"], "dash"))
    for name, peak, bw, dash in roofs:
        xs, ys, ridge = _roof_xy(peak, bw, *x_range)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=name, line=dict(color="black", dash=dash)))
        fig.add_vline(x=ridge, line=dict(color="grey", dash="dot", width=1))
        # On a log axis an annotation's x is log10 of the value (a shape's is not).
        fig.add_annotation(x=math.log10(ridge), y=0, yref="paper", yanchor="bottom", xanchor="left",
                           text=f"ridge {ridge:.0f} FLOP/B", showarrow=False, font=dict(size=10))
    if points is not None and len(points):
        df = points.copy()
        if "intensity" not in df:
            df["intensity"] = df["flops"] / df["bytes"]
        groups = df.groupby(color, sort=True) if color and color in df else [("points", df)]
        for i, (name, g) in enumerate(groups):
            fig.add_trace(go.Scatter(x=g["intensity"], y=g["tflops"], mode="markers", name=str(name),
                                     marker=dict(size=6, color=PALETTE[i % len(PALETTE)]),
                                     hovertext=_hover(g), hoverinfo="text"))
    fig.update_layout(title=_title(title or f"Roofline ({ceil.get('device_name', '?')}, {dtype})", points),
                      xaxis=dict(type="log", title="arithmetic intensity (FLOP / byte)"),
                      yaxis=dict(type="log", title="TFLOP/s"), legend=dict(font=dict(size=9)))
    return fig


def _hover(df) -> list[str]:
    cols = [c for c in ("config", "variant", "M", "N", "K", "tflops", "median_ms") if c in df]
    out = []
    for _, r in df[cols].iterrows():
        out.append("<br>".join(f"{c}={r[c]:.4g}" if isinstance(r[c], float) else f"{c}={r[c]}" for c in cols))
    return out


def scatter_mnk(df, ceil: Mapping[str, Any] | None = None, *, color: str = "config", dtype: str = "bf16",
                baseline: str | None = "cublas", title: str | None = None):
    """TFLOP/s against M*N*K, one colour per configuration, baseline in black,
    measured and datasheet compute ceilings as horizontal lines."""
    rows = df[df["status"] == "ok"].copy()
    rows["MNK"] = rows["M"].astype(float) * rows["N"].astype(float) * rows["K"].astype(float)
    kern = rows[~rows["is_baseline"].astype(bool)]
    fig = go.Figure()
    for i, (name, g) in enumerate(kern.groupby(color, sort=True)):
        fig.add_trace(go.Scatter(x=g["MNK"], y=g["tflops"], mode="markers", name=str(name),
                                 marker=dict(size=5, color=PALETTE[i % len(PALETTE)], opacity=0.8),
                                 hovertext=_hover(g), hoverinfo="text"))
    if baseline is not None:
        b = rows[rows["variant"] == baseline]
        if len(b):
            fig.add_trace(go.Scatter(x=b["MNK"], y=b["tflops"], mode="markers", name=baseline,
                                     marker=dict(size=9, color="black", symbol="x"),
                                     hovertext=_hover(b), hoverinfo="text"))
    ceil = ceil or {}
    key = _DTYPE_KEY.get(dtype, "bf16_tflops")
    if (ceil.get("measured") or {}).get(key):
        v = ceil["measured"][key]
        fig.add_hline(y=v, line=dict(color="black"), annotation_text=f"measured cuBLAS {v:.0f} TFLOP/s "
                      f"({ceil['measured'].get('date', '')})", annotation_position="top left")
    if (ceil.get("datasheet") or {}).get(key):
        v = ceil["datasheet"][key]
        fig.add_hline(y=v, line=dict(color="black", dash="dash"), annotation_text=f"datasheet {v:.0f} TFLOP/s",
                      annotation_position="top left")
    n = len(kern)
    fig.update_layout(title=_title(title or f"{n} measured points: TFLOP/s vs M*N*K", rows),
                      xaxis=dict(type="log", title="M*N*K"), yaxis=dict(title="TFLOP/s", rangemode="tozero"),
                      legend=dict(font=dict(size=8)), height=650)
    return fig


def study_lines(df, study: str, param: str, *, shape_cols: Sequence[str] = ("M", "N", "K"),
                group: str = "config_base", title: str | None = None):
    """TFLOP/s against one parameter of a study, one line per (shape, base configuration)."""
    rows = df[(df["study"] == study) & (df["status"] == "ok")].copy()
    col = f"p_{param}" if f"p_{param}" in rows else param
    rows["shape_label"] = rows[list(shape_cols)].astype(int).astype(str).agg("x".join, axis=1)
    if group not in rows:
        rows[group] = rows["config"].str.replace(r"\s*(g\d+|sm\d+|s\d+)", "", regex=True)
    fig = go.Figure()
    for i, ((shape, base), g) in enumerate(rows.groupby(["shape_label", group], sort=True)):
        g = g.sort_values(col)
        fig.add_trace(go.Scatter(x=g[col].astype(float), y=g["tflops"], mode="lines+markers",
                                 name=f"{shape} {base}", line=dict(color=PALETTE[i % len(PALETTE)])))
    fig.update_layout(title=_title(title or f"{study}: TFLOP/s vs {param}", rows), xaxis_title=param,
                      yaxis_title="TFLOP/s", legend=dict(font=dict(size=8)))
    return fig


def heuristic_vs_best(table, *, title: str | None = None):
    """Grouped bars per goal shape: cuBLAS, the heuristic's configuration, the sweep's best."""
    labels = [f"{r.M}x{r.N}x{r.K}" for r in table.itertuples()]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=labels, y=table["cublas_tflops"], name="cuBLAS", marker_color="black"))
    fig.add_trace(go.Bar(x=labels, y=table["heuristic_tflops"], name="Triton, heuristic config",
                         hovertext=table["heuristic_config"], marker_color=PALETTE[0]))
    if "best_ms" in table and table["best_ms"].notna().any():
        flops = 2.0 * table["M"] * table["N"] * table["K"]
        fig.add_trace(go.Bar(x=labels, y=flops / table["best_ms"] / 1e9, name="Triton, sweep's best",
                             hovertext=table["best_config"], marker_color=PALETTE[1]))
    geo = math.exp(sum(math.log(x) for x in table["ratio_heuristic_vs_cublas"]) / len(table))
    fig.update_layout(barmode="group", yaxis_title="TFLOP/s", xaxis_title="M x N x K",
                      title=title or f"Heuristic vs cuBLAS: geomean ratio {geo:.3f}")
    return fig


def regret(table, *, title: str | None = None):
    """Heuristic time over the sweep's best time, per shape (1.0 = no regret)."""
    labels = [f"{r.M}x{r.N}x{r.K}" for r in table.itertuples()]
    fig = go.Figure(go.Bar(x=labels, y=table["regret"], text=[f"{v:.3f}" for v in table["regret"]],
                           hovertext=[f"heuristic {h}<br>best {b}" for h, b in
                                      zip(table["heuristic_config"], table["best_config"])]))
    fig.add_hline(y=1.0, line=dict(color="black", dash="dash"))
    fig.update_layout(title=title or "Regret of the heuristic (time / best time)", yaxis_title="regret",
                      xaxis_title="M x N x K")
    return fig
