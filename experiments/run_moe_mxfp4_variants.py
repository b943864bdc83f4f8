#!/usr/bin/env python3
"""MXFP4 MoE down-projection: one sweep over the kernel's variants (issue 17), bounded in time.

KIMI-K2.5 (385 experts, hidden 7168, intermediate 512, top-9, w4a16, atomic epilogue). For
every M in {4, 8, 16, 32, 64, 128, 256, 16384} and every variant (the heuristic's current
default, the default with LOAD_AHEAD 1-3, and at M <= 256 other BM16 tiles with the loads of
later K steps issued ahead), the sweep

1. checks the variant against the fp32 reference (output poisoned with NaN first; the bound
   of run_moe_mxfp4.py); a variant that fails is reported and not timed;
2. times it with CUDA-graph replay (L2 flushed before each replay) and eagerly (CUDA
   events, L2 flushed), next to the baselines (graph replay only): dequantize-then-our-
   grouped-GEMM and the bf16-weight grouped GEMM (the same pipelines as run_moe_mxfp4.py);
3. appends the rows to ``rows.csv`` after every point (a point = one M x callable x
   method), so a run that is stopped keeps what it measured.

Choice of a new default, fair: for each M range the fastest correct variant (graph replay)
at ONE fitting point, M in {4, 16, 64, 256} (ranges M <= 11, 12-47, 48-191, 192-4095); the
held-out M {8, 32, 128} are then scored with the pick of their range against the best
variant there (``regret``), and printed separately. M = 16384 keeps the BM128 default unless
one of its own LOAD_AHEAD variants is faster (no pick from the small-M table).

Prepacked variants (``PREPACK`` 1 and 2, issue 17): the same weights in quant.prepack_mxfp4's
layouts, made once before the sweep (not timed); same bytes, so the same HBM bound. A PREPACK
pick cannot go into config.py's heuristic as is: the launcher cannot tell prepacked weights from
plain ones, so adopting one means the model loader prepacks (and the caller passes the config).

Time guard: ``--budget-s`` (default 320 s) stops starting new timings once spent (the rest is
written as skipped), and a watchdog (faulthandler, ``--point-timeout-s``) ends the process
with a traceback if one point hangs; rows.csv then holds every point measured before.

Writes under --out: rows.csv, checks.csv, picks.csv, summary.md, run_log.txt, info.json.

    python3 experiments/run_moe_mxfp4_variants.py --out results/moe_mxfp4_variants
    TRITON_INTERPRET=1 python3 experiments/run_moe_mxfp4_variants.py --out /tmp/v --small   # CPU smoke run
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

import run_moe_mxfp4 as base  # noqa: E402
from kernels.moe_mxfp4 import MoeMxfp4Config, default_config, moe_mxfp4_down, prepare_routing  # noqa: E402
from kernels.moe_mxfp4 import baselines as bl  # noqa: E402
from kernels.moe_mxfp4 import dequantize_weights_bf16, metrics, prepack_mxfp4  # noqa: E402
from workbench import bench  # noqa: E402

M_LIST = (4, 8, 16, 32, 64, 128, 256, 16384)
FIT_M = (4, 16, 64, 256)
HELD_OUT_M = (8, 32, 128)
# (lowest M, highest M, fitting point) of each range the new default is picked for
RANGES = ((1, 11, 4), (12, 47, 16), (48, 191, 64), (192, 4095, 256))
SMALL_M_MAX = 256


def variants(M: int, top_k: int, E: int, I: int) -> dict[str, MoeMxfp4Config]:
    """name -> config (w4a16, atomic). Names are stable across M so that a pick can be applied."""
    d = default_config(M, top_k, E, I)
    v = {"default": d}
    for la in (1, 2, 3):
        v[f"default la{la}"] = d.replace(LOAD_AHEAD=la)
    if M <= SMALL_M_MAX:
        C = MoeMxfp4Config
        v.update({
            # BM16 x BN64 (the current small-M default) with K steps of 256 (2 steps, 1 ahead: all
            # of K in flight) and BN128 / BN32 tiles (BN32 falls back to mma.sync with 2 warps)
            "BM16 BN64 BK256 la1": C(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, NT=True, LOAD_AHEAD=1),
            "BM16 BN128 la1": C(BLOCK_M=16, BLOCK_N=128, NT=True, LOAD_AHEAD=1),
            "BM16 BN128 la3": C(BLOCK_M=16, BLOCK_N=128, NT=True, LOAD_AHEAD=3),
            "BM16 BN32 w2": C(BLOCK_M=16, BLOCK_N=32, num_warps=2, NT=True),
            "BM16 BN32 w2 la3": C(BLOCK_M=16, BLOCK_N=32, num_warps=2, NT=True, LOAD_AHEAD=3),
            "BM16 BN64 w4 la3 noNT": C(BLOCK_M=16, BLOCK_N=64, NT=False, LOAD_AHEAD=3),
            "BM32 BN64 la3": C(BLOCK_M=32, BLOCK_N=64, NT=True, LOAD_AHEAD=3),
            # issue 17: weights prepacked in wgmma's register order (quant.prepack_mxfp4): level 1 has
            # no shared-memory pass and no per-scale compares (5.19 SASS instructions per weight at
            # BM16 x BN64 x BK128 against the default's 6.81), level 2 also stores the code bits so
            # that each bf16x2 pattern is one rotation and one mask (4.06; 66 registers, 7 programs/SM)
            "BM16 BN64 prepack1": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=1),
            "BM16 BN64 prepack2": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2),
            "BM16 BN64 prepack2 la1": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, LOAD_AHEAD=1),
            "BM16 BN128 prepack2": C(BLOCK_M=16, BLOCK_N=128, NT=True, PREPACK=2),
            "BM32 BN64 prepack2": C(BLOCK_M=32, BLOCK_N=64, NT=True, PREPACK=2),
        })
    return v


def prepacked(w: torch.Tensor, w_scale: torch.Tensor, level: int, chunk: int = 32):
    """quant.prepack_mxfp4 a few experts at a time (its int64 temporaries stay small)."""
    out_w, out_s = torch.empty_like(w), torch.empty_like(w_scale)
    for e0 in range(0, w.shape[0], chunk):
        out_w[e0:e0 + chunk], out_s[e0:e0 + chunk] = prepack_mxfp4(w[e0:e0 + chunk], w_scale[e0:e0 + chunk], level)
    return out_w, out_s


def range_of(M: int):
    for lo, hi, fit in RANGES:
        if lo <= M <= hi:
            return fit
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=320.0, help="no new timing starts after this many seconds")
    ap.add_argument("--point-timeout-s", type=float, default=90.0, help="watchdog: one point longer than this ends the run")
    ap.add_argument("--rep-ms", type=float, default=25.0, help="timed milliseconds per callable and method")
    ap.add_argument("--m", type=int, nargs="*", default=None, help="token counts (default: all eight)")
    ap.add_argument("--small", action="store_true", help="tiny shapes in Triton's interpreter (no GPU): a smoke run")
    args = ap.parse_args(argv)
    t0 = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_f = open(out_dir / "run_log.txt", "a")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{time.time() - t0:5.0f}s] {msg}"
        print(line, flush=True)
        log_f.write(line + "\n")
        log_f.flush()

    m_list = tuple(args.m) if args.m else M_LIST
    if args.small:
        base.E, base.H, base.I, base.TOP_K = (base.SMALL[k] for k in ("E", "H", "I", "TOP_K"))
        m_list = tuple(args.m) if args.m else (4, 8, 16)
    if not torch.cuda.is_available():
        from kernels.common.interpreter import active

        if not (args.small and active()):
            print("needs a CUDA GPU (sm_90); without one only `TRITON_INTERPRET=1 ... --small` runs", file=sys.stderr)
            return 2
        base.DEV = "cpu"
    E, H, I, TOP_K, DEV = base.E, base.H, base.I, base.TOP_K, base.DEV
    command = "python3 experiments/run_moe_mxfp4_variants.py " + " ".join(sys.argv[1:] if argv is None else argv)
    faulthandler.enable(file=sys.stderr)

    def arm(what: str):                 # the watchdog for one point
        faulthandler.cancel_dump_traceback_later()
        faulthandler.dump_traceback_later(args.point_timeout_s, exit=True)
        return what

    rows, checks = [], []

    def save():
        pd.DataFrame(rows).to_csv(out_dir / "rows.csv", index=False)
        pd.DataFrame(checks).to_csv(out_dir / "checks.csv", index=False)

    arm("copy")
    n = (1 << 30) // 4 if DEV == "cuda" else 1 << 16
    src = torch.randn(n, device=DEV)
    dst = torch.empty_like(src)
    copy_gbps = bench.measure(lambda: dst.copy_(src), warmup_ms=20, rep_ms=100, flush_l2=False).gbps(2 * n * 4)
    del src, dst
    log(f"copy bandwidth {copy_gbps:.0f} GB/s; shapes E={E} H={H} I={I} top_k={TOP_K}; M {m_list}")

    arm("weights")
    g = torch.Generator(device=DEV).manual_seed(base.SEED)
    w, w_scale = base.quantized_weights(g)
    w_bf16 = dequantize_weights_bf16(w, w_scale)
    w_buf = torch.empty_like(w_bf16)
    # the PREPACK variants read the same weights in quant.prepack_mxfp4's layouts (same bytes)
    packed = {0: (w, w_scale)}
    if not args.small:
        packed.update({lvl: prepacked(w, w_scale, lvl) for lvl in (1, 2)})
    log("weights ready")

    over = False
    for M in M_LIST if not args.small else m_list:
        ids, wts = base.route(M, g)     # every M draws, as in run_moe_mxfp4.py (same inputs per M)
        a = torch.randn(M * TOP_K, I, device=DEV, generator=g).bfloat16()
        if M not in m_list:
            continue
        arm(f"M={M} setup")
        srt = bl.sorted_rows(ids, E)
        active = int((srt.counts > 0).sum())
        ref, mag = base.reference(a.float(), w_bf16, ids, wts)
        routings = {}
        out = torch.empty(M, H, dtype=torch.bfloat16, device=DEV)
        nbytes = metrics.hbm_bytes(M, TOP_K, H, I, active)
        bound_us = nbytes / (copy_gbps * 1e9) * 1e6
        fns = {}
        for name, cfg in variants(M, TOP_K, E, I).items():
            if args.small:
                if cfg.PREPACK:          # needs H % 64 and I % 128: not at the smoke run's shapes
                    continue
                cfg = cfg.replace(BLOCK_N=32, BLOCK_K=32, num_warps=1)
            arm(f"M={M} {name} check")
            if cfg.BLOCK_M not in routings:
                routings[cfg.BLOCK_M] = prepare_routing(ids, wts, E, cfg.BLOCK_M)
            r = routings[cfg.BLOCK_M]

            def run(r=r, cfg=cfg, wq=packed[cfg.PREPACK]):
                return moe_mxfp4_down(a, wq[0], wq[1], r, config=cfg, out=out)

            try:
                run()
                out.fill_(float("nan"))
                res = base.check(run(), ref, mag)
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, the sweep goes on
                res = dict(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            checks.append(dict(M=M, name=name, config=cfg.label(), **res))
            log(f"M={M} {name:24s} {cfg.label():60s} {'ok' if res['ok'] else 'FAILED ' + str(res)[:200]}")
            if res["ok"]:
                fns[name] = (run, cfg)
        save()
        base_fns = {"dequant+grouped_gemm": lambda: bl.dequant_grouped_gemm(a, w, w_scale, srt, wts, w_bf16_buf=w_buf),
                    "bf16 grouped_gemm": lambda: bl.bf16_grouped_gemm(a, w_bf16, srt, wts)}
        if DEV == "cpu":
            base_fns = {}
        # graph replay: variants, then baselines; then eager, the variants taking turns
        for name, (fn, cfg) in list(fns.items()) + [(k, (f, None)) for k, f in base_fns.items()]:
            if time.time() - t0 > args.budget_s:
                over = True
                rows.append(dict(M=M, name=name, method="graph", skipped="budget"))
                continue
            arm(f"M={M} {name} graph")
            try:
                t = bench.measure(fn, cuda_graph=True, flush_l2=True, warmup_ms=5, rep_ms=args.rep_ms,
                                  min_reps=5 if DEV == "cuda" else 1, max_reps=400)
            except Exception as exc:  # noqa: BLE001
                log(f"M={M} {name}: graph timing failed ({type(exc).__name__}: {str(exc)[:150]})")
                continue
            rows.append(dict(M=M, name=name, method="graph", kind="ours" if cfg else "baseline",
                             config=cfg.label() if cfg else "", load_ahead=cfg.LOAD_AHEAD if cfg else None,
                             median_us=t.median_ms * 1e3, q25_us=t.q25_ms * 1e3, q75_us=t.q75_ms * 1e3, n_runs=t.n,
                             active_experts=active, hbm_bytes=nbytes, hbm_bound_us=bound_us,
                             frac_hbm_bound=bound_us / (t.median_ms * 1e3), copy_gbps=copy_gbps,
                             timing_method=t.method))
            save()
        if fns and time.time() - t0 <= args.budget_s:
            arm(f"M={M} eager")
            try:
                et = bench.interleave({k: f for k, (f, _) in fns.items()}, warmup_ms=10, rep_ms=args.rep_ms,
                                      min_reps=10 if DEV == "cuda" else 1, max_reps=100)
                for name, t in et.items():
                    cfg = fns[name][1]
                    rows.append(dict(M=M, name=name, method="eager", kind="ours", config=cfg.label(),
                                     load_ahead=cfg.LOAD_AHEAD, median_us=t.median_ms * 1e3, q25_us=t.q25_ms * 1e3,
                                     q75_us=t.q75_ms * 1e3, n_runs=t.n, active_experts=active, hbm_bytes=nbytes,
                                     hbm_bound_us=bound_us, frac_hbm_bound=bound_us / (t.median_ms * 1e3),
                                     copy_gbps=copy_gbps, timing_method=t.method))
            except Exception as exc:  # noqa: BLE001
                log(f"M={M}: eager timing failed ({type(exc).__name__}: {str(exc)[:150]})")
            save()
        elif fns:
            over = True
        log(f"M={M}: {len(fns)} variants correct of {len(variants(M, TOP_K, E, I))}; {active} experts routed")
        del ref, mag, routings
    faulthandler.cancel_dump_traceback_later()
    save()
    text = summarize(pd.DataFrame(rows), pd.DataFrame(checks), out_dir)
    (out_dir / "summary.md").write_text(f"command: `{command}`\n\n{text}\n")
    (out_dir / "info.json").write_text(json.dumps(dict(command=command, copy_gbps=copy_gbps, E=E, H=H, I=I, top_k=TOP_K,
                                                       M=list(m_list), wall_s=time.time() - t0, budget_hit=over,
                                                       gpu_name=torch.cuda.get_device_name() if DEV == "cuda" else "cpu"),
                                                  indent=1))
    print(text)
    n_bad = sum(not c["ok"] for c in checks)
    log(f"done in {time.time() - t0:.0f} s; {len(checks) - n_bad}/{len(checks)} checks ok"
        f"{'; BUDGET HIT: some points skipped' if over else ''}; wrote {out_dir}")
    return 0


def summarize(df: pd.DataFrame, ck: pd.DataFrame, out_dir: Path) -> str:
    if df.empty or "median_us" not in df:
        return "no timings"
    df = df[df.median_us.notna()]
    gr = df[df.method == "graph"].pivot_table(index="M", columns="name", values="median_us")
    ea = df[df.method == "eager"].pivot_table(index="M", columns="name", values="median_us")
    bound = df[df.method == "graph"].groupby("M").hbm_bound_us.first()
    ours = [c for c in gr.columns if c not in ("dequant+grouped_gemm", "bf16 grouped_gemm")]
    lines = ["Latency in us, CUDA-graph replay, L2 flushed (eager in eager_table below).", "",
             "Every variant, graph (us):", "", gr.round(1).to_string(), "",
             "Every variant, eager (us):", "", ea.round(1).to_string() if not ea.empty else "(none)", ""]

    # picks: fastest correct variant at each fitting M; applied to its range
    picks = {}
    for lo, hi, fit in RANGES:
        if fit in gr.index:
            r = gr.loc[fit, ours].dropna()
            if not r.empty:
                picks[fit] = r.idxmin()
    big = None
    if 16384 in gr.index:
        r = gr.loc[16384, [c for c in ours if c.startswith("default")]].dropna()
        big = r.idxmin() if not r.empty else None

    def row(M, name, role):
        t = gr.loc[M, name] if (M in gr.index and name in gr.columns) else float("nan")
        d = gr.loc[M, "default"] if "default" in gr.columns else float("nan")
        best = gr.loc[M, ours].dropna()
        dq = gr.loc[M, "dequant+grouped_gemm"] if "dequant+grouped_gemm" in gr.columns else float("nan")
        bf = gr.loc[M, "bf16 grouped_gemm"] if "bf16 grouped_gemm" in gr.columns else float("nan")
        return dict(M=M, role=role, pick=name, pick_us=t, default_us=d, pick_vs_default=d / t,
                    hbm_bound_us=bound.get(M), pick_frac_bound=bound.get(M) / t, default_frac_bound=bound.get(M) / d,
                    best_variant=best.idxmin() if not best.empty else "", best_us=best.min() if not best.empty else float("nan"),
                    regret=t / best.min() if not best.empty else float("nan"),
                    eager_us=ea.loc[M, name] if (M in ea.index and name in ea.columns) else float("nan"),
                    speedup_vs_dequant=dq / t, vs_bf16_grouped_gemm=bf / t)

    prow = []
    for M in gr.index:
        fit = range_of(M)
        if M == 16384 or fit is None:
            if big is not None:
                prow.append(row(M, big, "own (BM128 + LOAD_AHEAD variants)"))
        elif fit in picks:
            prow.append(row(M, picks[fit], "fit" if M in FIT_M else f"held-out (pick of M={fit})"
                            if M in HELD_OUT_M else f"range of M={fit}"))
    pk = pd.DataFrame(prow)
    pk.to_csv(out_dir / "picks.csv", index=False)
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    if not pk.empty:
        fit_rows = pk[~pk.role.str.startswith("held-out")]
        held = pk[pk.role.str.startswith("held-out")]
        lines += ["New default per M range, picked at M in {4, 16, 64, 256} only "
                  f"(ranges {', '.join(f'{lo}-{hi} <- M={f}' for lo, hi, f in RANGES)}); M = 16384 from its own "
                  "LOAD_AHEAD variants:", "", fit_rows.to_string(index=False, float_format=fmt), "",
                  "HELD-OUT M {8, 32, 128} (not used for the picks; regret = pick / best variant at that M):", "",
                  held.to_string(index=False, float_format=fmt) if not held.empty else "(none measured)", "",
                  "Goal: pick_frac_bound >= 0.75 at M 4-256, speedup_vs_dequant >= 2, at 16384 vs_bf16_grouped_gemm >= 0.85.",
                  "To adopt: set kernels/moe_mxfp4/config.py _BY_M_RANGE (per M range) or _BY_BLOCK_M from `pick`."]
    bad = ck[~ck.ok] if not ck.empty else ck
    lines += ["", f"checks: {len(ck) - len(bad)}/{len(ck)} ok" + ("" if bad.empty else "; FAILED: " +
                                                                   ", ".join(f"M={r.M} {r.name}" for r in bad.itertuples()))]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
