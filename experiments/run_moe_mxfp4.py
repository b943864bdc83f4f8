#!/usr/bin/env python3
"""MXFP4 MoE down-projection on one GPU: correctness and timing of every variant and baseline.

KIMI-K2.5's expert layer (385 experts, hidden 7168, intermediate 512, top-9), token
counts M in {4, 8, 16, 32, 64, 128, 256, 16384}. For each M this script

1. routes the tokens (random distinct top-9 experts per token, softmax weights),
   prepares the routing for BM16/32/64/128 and times the preparation;
2. checks every variant and baseline against the fp32 reference (the per-element
   bound of tests/test_moe_mxfp4.py; our outputs, and the deterministic mode's
   workspace, poisoned with NaN first), and checks that the deterministic mode gives
   the same bits twice;
3. times them both ways: ``graph`` (CUDA-graph replay, one call per replay, L2 flushed
   before each: GPU time alone, as the seed measures) and ``eager`` (the variants of
   one M taking turns run by run, CUDA events around each call, L2 flushed:
   workbench.bench.interleave), launch cost included;
4. measures the copy bandwidth (HBM bound = bytes of the routed experts' weights and
   scales + activations + output, over that bandwidth) and writes, under --out,
   ``rows.csv`` (one row per M, form, variant and method, with provenance),
   ``checks.csv``, ``info.json`` and ``summary.md``, and prints a short table.

Variants (w4a16 unless named a4w4): BM16/BM32 x NT on/off (both latency switches on,
atomic epilogue); at M <= 256 BM16 NT with 64-wide column tiles (``BN64``) and with the
expansion in Triton integer ops instead of inline PTX (``bits``); at M <= 32 BM16 NT with
each latency switch off (``early-off``/``prefetch-off``/``both-off``); the heuristic's
config (``default``), its deterministic mode (``det``) and the a4w4 form of both;
BM64/BM128 at M = 16384; ``prepacked default``: what a model loader that prepacks its weights
once gets at every M (``moe_mxfp4_down(a, prepare_weights(w, w_scale), routing)``, the
heuristic's config for prepacked weights; not in --small, whose H and I the layout does not
allow). Baselines: ``dequant+grouped_gemm`` and ``dequant+grouped_mm`` (dequantize all experts
to bf16, gather rows, grouped GEMM, weighted sum), ``bf16 grouped_gemm`` (bf16 weights, same
pipeline) and the GEMMs alone on pre-gathered rows (``bf16 grouped_gemm (gemm only)``,
``bf16 grouped_mm (gemm only)``).

``--selection``: the launcher as users call it instead of the variants: weights prepared once
(``prepare_weights``, level 2 where the shapes allow), the routing padded to ``block_m_for``'s
row tile, and no config, so the selection layer picks the config (this GPU's tuning tables,
``$WORKBENCH_TUNING_DIR`` over the package's; else the cold rule): ``launcher``; next to it the
cold rule's config passed explicitly (``cold rule``: what runs without tables) and the baselines.
Its rows name the config that ran and where it came from (``selected_source``: table or cold,
``selected_where``). About 1 minute on an H100 or H200.

Usage on a GPU node (about 1-2 minutes on an H200; the committed run took 47 s):
    python3 experiments/run_moe_mxfp4.py --out results/moe_mxfp4
    python3 experiments/run_moe_mxfp4.py --out /tmp/x --quick      # M in {4, 32}, under a minute
    python3 experiments/run_moe_mxfp4.py --out results/moe_mxfp4/selection --selection   # the tuned launcher
    TRITON_INTERPRET=1 python3 experiments/run_moe_mxfp4.py --out /tmp/x --small --rep-ms 1   # no GPU
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from kernels.moe_mxfp4 import (MoeMxfp4Config, block_m_for, default_config, dequantize_mxfp4,  # noqa: E402
                               dequantize_weights_bf16, moe_mxfp4_down, prepare_routing, prepare_weights,
                               quantize_mxfp4)
from kernels.moe_mxfp4 import baselines as bl  # noqa: E402
from kernels.moe_mxfp4 import launch as mx_launch  # noqa: E402
from kernels.moe_mxfp4 import metrics  # noqa: E402
from kernels.moe_mxfp4 import plan as mx_plan  # noqa: E402
from kernels.moe_mxfp4 import select as mx_select  # noqa: E402
from workbench import bench  # noqa: E402
from workbench import provenance as wb_provenance  # noqa: E402

E, H, I, TOP_K = 385, 7168, 512, 9
M_LIST = (4, 8, 16, 32, 64, 128, 256, 16384)
DEV = "cuda"
# --small: a CPU smoke run of this script's own logic (TRITON_INTERPRET=1, no GPU), at the
# CPU tests' sizes; its timings are host-timer numbers and mean nothing.
SMALL = dict(E=6, H=96, I=64, TOP_K=3, M_LIST=(1, 5, 33))
SEED = 1234


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def quantized_weights(g: torch.Generator):
    """Random [E, H, I] weights (std 0.02) quantized expert chunk by chunk (bounded temporaries)."""
    w = torch.empty(E, H, I // 2, dtype=torch.uint8, device=DEV)
    ws = torch.empty(E, H, I // 32, dtype=torch.uint8, device=DEV)
    for e0 in range(0, E, 64):
        e1 = min(E, e0 + 64)
        w[e0:e1], ws[e0:e1] = quantize_mxfp4(torch.randn(e1 - e0, H, I, device=DEV, generator=g) * 0.02)
    return w, ws


def route(M: int, g: torch.Generator):
    ids = torch.rand(M, E, device=DEV, generator=g).topk(TOP_K, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(M, TOP_K, device=DEV, generator=g), -1)
    return ids, wts


def reference(a_f32: torch.Tensor, w_bf16: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor):
    """(sum over slots, sum of magnitudes) in fp32; w_bf16 is exact (the expansion loses nothing)."""
    M = ids.shape[0]
    flat = ids.reshape(-1).long()
    y = torch.zeros(M * TOP_K, H, device=DEV)
    for e in torch.unique(flat).tolist():
        sel = (flat == e).nonzero().squeeze(1)
        y[sel] = a_f32[sel] @ w_bf16[e].float().T
    y = (y * wts.reshape(-1, 1)).view(M, TOP_K, H)
    return y.sum(1), y.abs().sum(1)


def check(out: torch.Tensor, ref, mag, slack: float = 1.0) -> dict:
    err = (out.float() - ref).abs()
    bound = slack * (TOP_K + 1) * 2.0 ** -8 * mag + 1e-6
    finite = bool(out.isfinite().all())
    return {"ok": finite and bool((err <= bound).all()), "finite": finite,
            "max_abs_err": float(err.max()), "worst_err_over_bound": float((err / bound).max()),
            "rel_fro_err": float((out.float() - ref).norm() / ref.norm())}


def variants(M: int) -> dict[str, tuple[MoeMxfp4Config, bool]]:
    """name -> (config, a4w4)."""
    d = default_config(M, TOP_K, E, I)
    v: dict[str, tuple[MoeMxfp4Config, bool]] = {}
    for bm in (16, 32):
        for nt in (True, False):
            v[f"BM{bm}{' NT' if nt else ''}"] = (MoeMxfp4Config(BLOCK_M=bm, NT=nt), False)
    if M <= 256:
        v["BM16 NT BN64"] = (MoeMxfp4Config(BLOCK_M=16, BLOCK_N=64, NT=True), False)
        v["BM16 NT bits"] = (MoeMxfp4Config(BLOCK_M=16, NT=True, EXPAND="bits"), False)
    if M <= 32:
        v["BM16 NT early-off"] = (MoeMxfp4Config(NT=True, EARLY_LOADS=False), False)
        v["BM16 NT prefetch-off"] = (MoeMxfp4Config(NT=True, PREFETCH_EPILOGUE=False), False)
        v["BM16 NT both-off"] = (MoeMxfp4Config(NT=True, EARLY_LOADS=False, PREFETCH_EPILOGUE=False), False)
    if M >= 4096:
        v["BM64"] = (MoeMxfp4Config(BLOCK_M=64, NT=False), False)
        v["BM128"] = (MoeMxfp4Config(BLOCK_M=128, num_warps=8, NT=False), False)
        v["BM128 BN256"] = (MoeMxfp4Config(BLOCK_M=128, BLOCK_N=256, num_warps=8, NT=False), False)
    v["default"] = (d, False)
    v["default det"] = (d.replace(DETERMINISTIC=True), False)
    v["a4w4 default"] = (d, True)
    v["a4w4 det"] = (d.replace(DETERMINISTIC=True), True)
    if DEV == "cpu":        # --small in the interpreter: tiles that fit H = 96, I = 64
        v = {n: (c.replace(BLOCK_N=32, BLOCK_K=min(c.BLOCK_K, I), num_warps=1), fp4) for n, (c, fp4) in v.items()}
    if prepackable():       # weights prepacked once (prepare_weights, level 2), the default config for them
        v["prepacked default"] = (default_config(M, TOP_K, E, I, prepacked=2), False)
    return v


def selection_variants(M: int) -> dict[str, tuple[MoeMxfp4Config | None, bool, int, int]]:
    """--selection: name -> (config, a4w4, weights' level, routing's BLOCK_M): the launcher with no
    config (config None: the selection layer picks) and the cold rule's config for the same call
    (filled in by ``cold_for`` once the call's tensors exist)."""
    level, bm = (2 if prepackable() else 0), block_m_for(M, TOP_K, E)
    return {"launcher": (None, False, level, bm), "cold rule": (None, False, level, bm)}


def cold_for(a, weights, routing) -> MoeMxfp4Config:
    """What the launcher runs for this call without a tuning table (the selection layer's cold rule)."""
    return mx_select.cold_config(mx_plan.call_of(a, None, weights, routing))


def prepackable() -> bool:
    """Whether the shapes allow the prepacked layout (H % 64 == 0 and I % 128 == 0)."""
    return H % 64 == 0 and I % 128 == 0


def measured_ms(quick: bool) -> tuple[int, ...]:
    """The token counts a run measures: every M, or with --quick the first and the fourth (4 and 32)."""
    return M_LIST[:1] + M_LIST[3:4] if quick else M_LIST


def time_both(fns: dict, *, rep_ms: float, log_prefix: str, min_reps: int = 15) -> dict[str, dict[str, bench.Timing]]:
    """{name: {'graph': Timing, 'eager': Timing}}; a callable that fails is left out (and logged)."""
    res: dict[str, dict[str, bench.Timing]] = {n: {} for n in fns}
    for name, fn in fns.items():
        try:
            res[name]["graph"] = bench.measure(fn, cuda_graph=True, flush_l2=True, warmup_ms=10, rep_ms=rep_ms)
        except Exception as exc:  # a baseline that cannot be captured still gets its eager time
            log(f"{log_prefix} {name}: graph timing failed ({type(exc).__name__}: {str(exc)[:120]})")
    for name, t in bench.interleave(fns, warmup_ms=20, rep_ms=rep_ms, min_reps=min_reps, max_reps=200).items():
        res[name]["eager"] = t
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for rows.csv, checks.csv, info.json, summary.md")
    ap.add_argument("--quick", action="store_true",
                    help="M in {4, 32} only (under a minute on an H200; the same routing and inputs as a full run's)")
    ap.add_argument("--rep-ms", type=float, default=60.0, help="timed milliseconds per callable and method")
    ap.add_argument("--small", action="store_true",
                    help="tiny shapes; without a GPU a smoke run of the script in Triton's interpreter")
    ap.add_argument("--selection", action="store_true",
                    help="time the launcher as users call it (prepared weights, no config: tuning tables, else the "
                         "cold rule) against the cold rule's config and the baselines (about a minute)")
    args = ap.parse_args(argv)
    global E, H, I, TOP_K, M_LIST, DEV
    if args.small:
        E, H, I, TOP_K, M_LIST = (SMALL[k] for k in ("E", "H", "I", "TOP_K", "M_LIST"))
    if not torch.cuda.is_available():
        from kernels.common.interpreter import active

        if not (args.small and active()):
            print("run_moe_mxfp4.py needs a CUDA GPU (sm_90: H100 or H200); without one only "
                  "`TRITON_INTERPRET=1 ... --small` runs (a smoke test)", file=sys.stderr)
            return 2
        DEV = "cpu"
    t_start = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python3 experiments/run_moe_mxfp4.py " + " ".join(sys.argv[1:] if argv is None else argv)
    prov = {f"prov_{k}": v for k, v in wb_provenance.flat(wb_provenance.collect()).items()}
    prov["prov_command"] = command

    # HBM bound: measured copy bandwidth (read + write counted).
    n = (1 << 30) // 4 if DEV == "cuda" else 1 << 20
    src = torch.randn(n, device=DEV)
    dst = torch.empty_like(src)
    t_copy = bench.measure(lambda: dst.copy_(src), warmup_ms=30, rep_ms=200, flush_l2=False)
    copy_gbps = t_copy.gbps(2 * n * 4)
    del src, dst
    log(f"device {prov['prov_device_name']}  copy bandwidth {copy_gbps:.0f} GB/s")

    g = torch.Generator(device=DEV).manual_seed(SEED)
    w, w_scale = quantized_weights(g)
    w_bf16 = dequantize_weights_bf16(w, w_scale)                     # exact: the bf16-weight baseline's weights
    # the weights as a loader keeps them: plain, and prepacked once (not timed) where the shapes allow
    weights = {0: prepare_weights(w, w_scale, 0), **({2: prepare_weights(w, w_scale, 2)} if prepackable() else {})}
    if args.selection:   # the tables this process reads (the launcher's choice comes from them)
        from kernels.common import tables as wb_tables

        tuning = f"{wb_tables.user_root()} over {wb_tables.SHIPPED_ROOT}"
        prov["prov_tuning_tables"] = tuning
        log(f"tuning tables: {tuning}")
    w_buf = torch.empty_like(w_bf16)                                  # the dequantize baselines write here
    log(f"weights quantized ({time.time() - t_start:.0f} s)")

    rows, checks = [], []
    m_list = measured_ms(args.quick)
    for M in M_LIST:
        t_m = time.time()
        # Every M draws its routing and activations, measured or not, so that a quick run's M
        # sees the same experts and inputs as a full run's (its rows are comparable case by case).
        ids, wts = route(M, g)
        a = (torch.randn(M * TOP_K, I, device=DEV, generator=g)).bfloat16()
        if M not in m_list:
            continue
        a4, a4_s = quantize_mxfp4(a.float())
        srt = bl.sorted_rows(ids, E)
        active = int((srt.counts > 0).sum())
        ref, mag = reference(a.float(), w_bf16, ids, wts)
        ref4, mag4 = reference(dequantize_mxfp4(a4, a4_s), w_bf16, ids, wts)
        routings = {bm: prepare_routing(ids, wts, E, bm) for bm in (16, 32, 64, 128)}
        out = torch.empty(M, H, dtype=torch.bfloat16, device=DEV)

        fns, meta = {}, {}
        specs = (selection_variants(M) if args.selection
                 else {n: (c, fp4, c.PREPACK, c.BLOCK_M) for n, (c, fp4) in variants(M).items()})
        for name, (cfg, fp4, level, bm) in specs.items():
            r = routings[bm]
            aa, asc = (a4, a4_s) if fp4 else (a, None)
            if name == "cold rule":
                cfg = cold_for(aa, weights[level], r)

            def run(aa=aa, asc=asc, r=r, cfg=cfg, wq=weights[level]):
                return moe_mxfp4_down(aa, wq, routing=r, a_scale=asc, config=cfg, out=out)

            try:
                run()                                   # compile, build the plan (and its workspace)
            except Exception as exc:
                log(f"M={M} {name}: failed to run ({type(exc).__name__}: {str(exc)[:200]})")
                checks.append(dict(M=M, name=name, config=cfg.label() if cfg else "", form="a4w4" if fp4 else "w4a16",
                                   ok=False))
                continue
            plan = mx_launch.plan_for(aa, weights[level], routing=r, a_scale=asc, config=cfg, out=out)
            choice = plan.choice
            cfg = plan.config                           # what runs (the selected one for the launcher)
            out.fill_(float("nan"))
            for plan in mx_launch._PLANS.values():
                if plan.workspace is not None:
                    plan.workspace.fill_(float("nan"))
            res = check(run(), ref4 if fp4 else ref, mag4 if fp4 else mag)
            if cfg.DETERMINISTIC:
                first = out.clone()
                res["bit_identical"] = bool(torch.equal(run(), first))
                res["ok"] = res["ok"] and res["bit_identical"]
            checks.append(dict(M=M, name=name, config=cfg.label(), form="a4w4" if fp4 else "w4a16", **res))
            fns[name] = run
            meta[name] = dict(kind="ours", config=cfg.label(), form="a4w4" if fp4 else "w4a16",
                              block_m=cfg.BLOCK_M, nt=cfg.NT, early_loads=cfg.EARLY_LOADS,
                              prefetch_epilogue=cfg.PREFETCH_EPILOGUE, deterministic=cfg.DETERMINISTIC,
                              prepack=cfg.PREPACK, selected_source=choice.source if choice else "explicit",
                              selected_where=choice.where if choice else "")
            if choice is not None:
                log(f"M={M} {name}: {cfg.label()} ({choice.source}: {choice.where})")

        x_sorted = a.index_select(0, srt.order)
        base = {
            "dequant+grouped_gemm": lambda: bl.dequant_grouped_gemm(a, w, w_scale, srt, wts, w_bf16_buf=w_buf),
            "dequant+grouped_mm": lambda: bl.dequant_grouped_mm(a, w, w_scale, srt, wts, w_bf16_buf=w_buf),
            "bf16 grouped_gemm": lambda: bl.bf16_grouped_gemm(a, w_bf16, srt, wts),
            "bf16 grouped_gemm (gemm only)": lambda: bl.grouped_gemm(x_sorted, w_bf16, srt.counts, trans_w=True),
            "bf16 grouped_mm (gemm only)": lambda: torch._grouped_mm(x_sorted, w_bf16.transpose(-2, -1),
                                                                     offs=srt.offsets),
        }
        for name, fn in base.items():
            try:
                y = fn()
            except Exception as exc:
                log(f"M={M} {name}: unavailable ({type(exc).__name__}: {str(exc)[:120]})")
                continue
            if "gemm only" not in name:
                checks.append(dict(M=M, name=name, config="", form="w4a16", **check(y, ref, mag, slack=2.0)))
            fns[name] = fn
            meta[name] = dict(kind="baseline", config="", form="w4a16")
        prep = {bm: (lambda bm=bm: prepare_routing(ids, wts, E, bm)) for bm in (16, 32)}
        for bm, fn in prep.items():
            fns[f"routing prep BM{bm}"] = fn
            meta[f"routing prep BM{bm}"] = dict(kind="routing", config="", form="")

        timings = time_both(fns, rep_ms=args.rep_ms, log_prefix=f"M={M}", min_reps=15 if DEV == "cuda" else 1)
        fl = metrics.flops(M, TOP_K, H, I)
        for name, by_method in timings.items():
            m = meta[name]
            nbytes = metrics.hbm_bytes(M, TOP_K, H, I, active, a_fp4=m["form"] == "a4w4")
            bound_us = nbytes / (copy_gbps * 1e9) * 1e6
            for method, t in by_method.items():
                rows.append(dict(M=M, name=name, method=method, **m, active_experts=active,
                                 median_us=t.median_ms * 1e3, q25_us=t.q25_ms * 1e3, q75_us=t.q75_ms * 1e3,
                                 n_runs=t.n, flops=fl, hbm_bytes=nbytes, hbm_bound_us=bound_us,
                                 frac_hbm_bound=bound_us / (t.median_ms * 1e3), tflops=t.tflops(fl),
                                 gbps=t.gbps(nbytes), copy_gbps=copy_gbps, timing_method=t.method, **prov))
        bad = [c for c in checks if c["M"] == M and not c["ok"]]
        log(f"M={M}: {len(fns)} callables timed, {active} experts routed to, "
            f"{'all checks ok' if not bad else f'{len(bad)} CHECKS FAILED'} ({time.time() - t_m:.0f} s)")

    df = pd.DataFrame(rows)
    ck = pd.DataFrame(checks)
    for col, val in prov.items():
        ck[col] = val
    df.to_csv(out_dir / "rows.csv", index=False)
    ck.to_csv(out_dir / "checks.csv", index=False)
    (out_dir / "info.json").write_text(json.dumps(
        {"command": command, "copy_gbps": copy_gbps, "copy_timing": t_copy.as_row(), "E": E, "H": H, "I": I,
         "top_k": TOP_K, "M": list(m_list), "seed": SEED, "wall_s": time.time() - t_start,
         "provenance": {k[5:]: v for k, v in prov.items()}}, indent=1, default=str))
    text = selection_summary(df) if args.selection else summary(df)
    (out_dir / "summary.md").write_text(f"command: `{command}`\n\n{text}\n")
    print(text)
    n_bad = int((~ck.ok).sum())
    log(f"done in {time.time() - t_start:.0f} s; {len(ck) - n_bad}/{len(ck)} checks ok; wrote {out_dir}")
    return 1 if n_bad else 0


def selection_summary(df: pd.DataFrame) -> str:
    """--selection: per M, the launcher (tables, else cold) against the cold rule's config and the
    baselines, graph replay and eager."""
    lines = ["latency in us (L2 flushed), KIMI-K2.5 down-projection, w4a16, prepared weights; launcher = no config "
             "(the selection layer: tuning table, else the cold rule)", ""]
    for method in ("graph", "eager"):
        g = df[df.method == method].pivot_table(index="M", columns="name", values="median_us")
        if g.empty or "launcher" not in g:
            continue
        cols = [c for c in ("launcher", "cold rule", "dequant+grouped_gemm", "dequant+grouped_mm", "bf16 grouped_gemm",
                            "bf16 grouped_mm (gemm only)") if c in g.columns]
        t = g[cols].copy()
        if "cold rule" in g:
            t["cold/launcher"] = g["cold rule"] / g["launcher"]
        for base in ("dequant+grouped_mm", "bf16 grouped_gemm", "bf16 grouped_mm (gemm only)"):
            if base in g:
                t[f"{base}/launcher"] = g[base] / g["launcher"]
        ours = df[(df.method == method) & (df.name == "launcher")].set_index("M")
        t["launcher/HBM bound"] = ours.hbm_bound_us / g["launcher"]
        t["source"] = ours.selected_source
        t["config"] = ours.config
        lines += [f"{method}:", "", t.to_string(float_format=lambda v: f"{v:.3g}"), ""]
    return "\n".join(lines)


def summary(df: pd.DataFrame) -> str:
    """Latency (us, graph replay) per M for the main variants and baselines, plus the goal ratios."""
    g = df[df.method == "graph"].pivot_table(index="M", columns="name", values="median_us")
    cols = [c for c in ("BM16 NT", "BM16", "BM32 NT", "BM32", "default", "default det", "a4w4 default",
                        "prepacked default", "dequant+grouped_gemm", "dequant+grouped_mm", "bf16 grouped_gemm",
                        "bf16 grouped_gemm (gemm only)") if c in g.columns]
    t = g[cols].copy()
    bound = df[(df.method == "graph") & (df.name == "default")].set_index("M").hbm_bound_us
    t["HBM bound"] = bound
    t["default/bound"] = bound / g["default"]
    if "prepacked default" in g:
        t["prepacked/bound"] = bound / g["prepacked default"]
    if "dequant+grouped_gemm" in g:
        t["speedup vs dequant+gg"] = g["dequant+grouped_gemm"] / g["default"]
    if "bf16 grouped_gemm (gemm only)" in g:
        t["vs bf16 gemm only"] = g["bf16 grouped_gemm (gemm only)"] / g["default"]
    variant_cols = [c for c in ("BM16 NT", "BM16", "BM32 NT", "BM32", "BM16 NT BN64", "BM64", "BM128", "BM128 BN256")
                    if c in g]
    t["fastest variant"] = g[variant_cols].apply(lambda r: r.dropna().idxmin() if r.notna().any() else "", axis=1)
    return ("latency in us (CUDA-graph replay, L2 flushed), KIMI-K2.5 down-projection, w4a16 unless named\n\n"
            + t.to_string(float_format=lambda v: f"{v:.3g}"))


if __name__ == "__main__":
    sys.exit(main())
