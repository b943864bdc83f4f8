#!/usr/bin/env python3
"""Grouped GEMM on one GPU: correctness and timing of every backend in one call.

For the seed study's shapes (DeepSeek-V3 and gpt-oss-20B MoE layers, see
experiments/grouped_gemm.yaml) under balanced, mild and extreme routing, for
forward, dgrad and wgrad, this script

1. checks every backend against a per-group fp32 reference (relative error,
   our outputs poisoned with NaN first),
2. optionally (--sweep) times our kernel over a few launch configurations per
   (op, N, K) and keeps the best (by geometric mean over sizes and routings),
3. times triton (ours), torch._grouped_mm, the per-expert cuBLAS loop and the
   autotuner (which times the three once per (op, G, N, K, dtype) key),
4. writes tidy rows with provenance under --out, and prints the seed's tables.

Timing: the card's clocks drift by several percent within seconds (power,
temperature), so the backends of a case take turns run by run (REPS runs each,
L2 flushed before every run, CUDA events around each) instead of being timed
one after another; `median_ms`/`q25_ms`/`q75_ms` are over those runs.
torch._grouped_mm gets its int32 offsets and the cuBLAS loop its host sizes
precomputed, outside the timed region; ours takes the sizes tensor as it is.

Usage (on a GPU node, sm_90: H100 or H200):
    python3 experiments/run_grouped_gemm.py --out results/grouped_gemm/run [--sweep] [--quick]

The whole table (144 cases x 4 backends, eager and graph-replayed) takes about
4.5 minutes on one H200 with a warm autotuner cache (run 15: 269 s) and about
6.5 with an empty one (--out a fresh directory: the autotuner times its 72 keys
afresh, about 80 s more; first-call kernel compilation comes on top). --quick
is 36 of those cases (`cases(quick=True)`: each model's smallest B and M), the
same inputs and seeds as in the whole table: about 2 minutes. The notebook
(notebooks/04_grouped_gemm.ipynb, `measure` = quick or full) runs this script.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from kernels import moe  # noqa: E402
from kernels.moe import autotune as ga  # noqa: E402
from kernels.moe import config as mconfig  # noqa: E402
from kernels.moe import launch as mlaunch  # noqa: E402
from kernels.moe import routing as rt  # noqa: E402
from workbench import bench  # noqa: E402
from workbench import provenance as wb_provenance  # noqa: E402

MODELS = {
    "DeepSeek-V3": {"B": [16, 32], "M": [2048, 4096], "layers": {"GateUP": (4096, 7168), "Down": (7168, 2048)}},
    "gpt-oss-20B": {"B": [4, 32], "M": [2048, 4096], "layers": {"GateUP": (5760, 2880), "Down": (2880, 2880)}},
}
OPS = ("fwd", "dgrad", "wgrad")
ROUTINGS = ("balanced", "mild", "extreme")
BACKENDS = ("cublas_loop", "grouped_mm", "triton", "autotune")
SEED = 1234
DEV = "cuda"

C = moe.GroupedConfig
SWEEP_CONFIGS = {
    # 128x256 tiles, one CTA (two consumer warpgroups) per SM; and 128x128 tiles with one
    # warpgroup per CTA and two CTAs per SM, whose main loops and epilogues interleave.
    "fwd": [C(), C(num_stages=4), C(BLOCK_N=128, num_warps=4, num_stages=3, CTAS_PER_SM=2),
            C(BLOCK_N=128, BLOCK_K=32, num_warps=4, num_stages=4, CTAS_PER_SM=2)],
}
SWEEP_CONFIGS["dgrad"] = SWEEP_CONFIGS["fwd"]
SWEEP_CONFIGS["wgrad"] = SWEEP_CONFIGS["fwd"]
REPS = 40           # at least this many timed runs per callable, the callables taking turns run by run
REP_MS = 150        # main table: about this much timed time per backend and case (eager)
GRAPH_REP_MS = 100  # the same, graph-replayed


def log(*a):
    print(*a, flush=True)


# ---------------------------------------------------------------------------
# Timing and provenance
# ---------------------------------------------------------------------------


def _stats(t) -> tuple[float, float, float]:
    return t.median_ms, t.q25_ms, t.q75_ms


def measure(fn, warmup_ms=10, rep_ms=50):
    """(median, q25, q75) milliseconds of one measurement (L2 flushed before each run)."""
    return _stats(bench.measure(fn, warmup_ms=warmup_ms, rep_ms=rep_ms))


def measure_turns(fns: dict, rep_ms: float, mode: str = "eager") -> dict:
    """name -> (median, q25, q75, host_us): ms, the callables taking turns run by run
    (`workbench.bench.interleave`, ``mode`` eager or graph); NaN for one that failed to run."""
    timings = bench.interleave(fns, warmup_ms=30, rep_ms=rep_ms, min_reps=REPS, mode=mode)
    for n in fns:
        if n not in timings:
            log(f"  timing {n} ({mode}) failed in its first call")
    return {n: ((*_stats(timings[n]), timings[n].host_us) if n in timings else (math.nan,) * 4) for n in fns}


def provenance(command: str) -> dict:
    """workbench.provenance's fields, prefixed ``prov_``, plus the command line."""
    info = wb_provenance.flat(wb_provenance.collect(world_size=1))
    info["command"] = command
    return {f"prov_{k}": v for k, v in info.items()}


def ceilings() -> dict:
    """Measured bf16 matrix rate and copy bandwidth on this card (ceilings for the roofline)."""
    n = 8192
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    ms, _, _ = measure(lambda: torch.mm(a, b), 25, 200)
    src = torch.empty(2 * 1024**3 // 2, device=DEV, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    cms, _, _ = measure(lambda: dst.copy_(src), 10, 100)
    out = {"mm_bf16_tflops": 2 * n**3 / ms / 1e9, "copy_tbps": 2 * src.numel() * 2 / cms / 1e9}
    del a, b, src, dst
    torch.cuda.empty_cache()
    return out


def cpu_overhead() -> dict:
    """Host microseconds per call (no sync), gpt-oss Down B=4 M=2048 shapes: launch cost."""
    p = Problem(4, 2048, 2880, 2880)
    s, offs, host = p.sizes["balanced"]
    res = {}
    for name, fn in (("triton", lambda: p.ours("fwd", s)),
                     ("grouped_mm", lambda: ga.run_backend("grouped_mm", "fwd", p.x, p.w, s, offs=offs)),
                     ("triton_wgrad", lambda: p.ours("wgrad", s))):
        try:
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(100):
                fn()
            res[f"cpu_us_{name}"] = (time.perf_counter() - t0) * 1e4
            torch.cuda.synchronize()
        except Exception as exc:
            log(f"  cpu overhead {name}: {type(exc).__name__}: {exc}")
    del p
    torch.cuda.empty_cache()
    return res


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------


def cases(quick: bool, models=None):
    """(model, layer, B, M, N, K) of the table; quick: each model's first B and M only (a subset
    of the whole table with the same inputs, so a quick run's rows compare with a full run's)."""
    for model, spec in MODELS.items():
        if models and model not in models:
            continue
        for B in spec["B"]:
            for Mper in spec["M"]:
                if quick and (B, Mper) != (spec["B"][0], spec["M"][0]):
                    continue
                for layer, (N, K) in spec["layers"].items():
                    yield model, layer, B, Mper, N, K


class Problem:
    """Inputs for one (model, layer, B, M): x [M, K], w [B, K, N], dy [M, N], bf16."""

    def __init__(self, B, Mper, N, K):
        self.B, self.M, self.N, self.K = B, B * Mper, N, K
        g = torch.Generator(device=DEV).manual_seed(SEED + B * 7 + Mper + N + K)
        self.x = torch.randn(self.M, K, device=DEV, dtype=torch.bfloat16, generator=g)
        self.w = (torch.randn(B, K, N, device=DEV, generator=g) / math.sqrt(K)).to(torch.bfloat16)
        self.dy = torch.randn(self.M, N, device=DEV, dtype=torch.bfloat16, generator=g)
        self.sizes = {}
        for r in ROUTINGS:
            s = rt.make(r, self.M, B, seed=SEED + B + Mper, device=DEV)
            self.sizes[r] = (s, moe.baselines.grouped_mm_offsets(s), [int(v) for v in s.tolist()])

    def operands(self, op):
        return {"fwd": (self.x, self.w), "dgrad": (self.dy, self.w), "wgrad": (self.x, self.dy)}[op]

    def reference(self, op, sizes):
        a, b = self.operands(op)
        if op == "wgrad":
            return moe.reference_wgrad(a, b, sizes, dtype=torch.float32)
        return moe.reference(a, b, sizes, trans_w=(op == "dgrad"), dtype=torch.float32)

    def ours(self, op, sizes, out=None, config=None):
        a, b = self.operands(op)
        if op == "wgrad":
            return moe.grouped_gemm_wgrad(a, b, sizes, out=out, config=config)
        return moe.grouped_gemm(a, b, sizes, trans_w=(op == "dgrad"), out=out, config=config)

    def out_shape(self, op):
        return {"fwd": (self.M, self.N), "dgrad": (self.M, self.K), "wgrad": (self.B, self.K, self.N)}[op]


def rel_err(out, ref):
    out = out.float()
    if not torch.isfinite(out).all():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def key_of(op, N, K):
    """Config-table key of the call: (op, output width, reduction) for fwd/dgrad, (wgrad, N, K)."""
    return (op, K, N) if op == "dgrad" else (op, N, K)


# ---------------------------------------------------------------------------
# Phases
# ---------------------------------------------------------------------------


def run_sweep(quick, models=None):
    """Time each candidate config on every size and routing, the cuBLAS loop taking
    turns with them as the yardstick; keep the best config per (op, N, K)."""
    rows = []
    problems = {}
    for model, layer, B, Mper, N, K in cases(quick, models):
        problems.setdefault((N, K), []).append((model, layer, B, Mper))
    chosen = {}

    def gmean(v):
        return math.exp(sum(math.log(max(t, 1e-9)) for t in v) / len(v))

    for (N, K), members in problems.items():
        per_cfg = {op: {} for op in OPS}
        for model, layer, B, Mper in members:
            p = Problem(B, Mper, N, K)
            for r in ROUTINGS:
                s = p.sizes[r][0]
                for op in OPS:
                    fns = {}
                    for ci, cfg in enumerate(SWEEP_CONFIGS[op]):
                        try:
                            p.ours(op, s, config=cfg)          # compile and check it launches
                            fns[ci] = (lambda c=cfg: p.ours(op, s, config=c))
                        except Exception as exc:  # a config that does not compile or launch
                            log(f"  sweep {op} {N}x{K} {cfg.label()}: {type(exc).__name__}: {str(exc)[:200]}")
                    a, b = p.operands(op)
                    host = p.sizes[r][2]
                    fns["cublas_loop"] = lambda: ga.run_backend("cublas_loop", op, a, b, s, host_sizes=host)
                    times = measure_turns(fns, rep_ms=60)
                    med = times["cublas_loop"][0]
                    rows.append(dict(model=model, layer=layer, B=B, M=Mper, N=N, K=K, op=op, routing=r,
                                     config="cublas_loop", median_ms=med, q25_ms=times["cublas_loop"][1],
                                     q75_ms=times["cublas_loop"][2], tflops=moe.flops(p.M, N, K) / med / 1e9))
                    for ci, cfg in enumerate(SWEEP_CONFIGS[op]):
                        med, q25, q75 = times.get(ci, (math.inf,) * 3)
                        tf = moe.flops(p.M, N, K) / med / 1e9 if math.isfinite(med) else 0.0
                        per_cfg[op].setdefault(ci, []).append(tf)
                        rows.append(dict(model=model, layer=layer, B=B, M=Mper, N=N, K=K, op=op, routing=r,
                                         config=cfg.label(), median_ms=med, q25_ms=q25, q75_ms=q75, tflops=tf))
            del p
            torch.cuda.empty_cache()
        for op in OPS:
            best = max(per_cfg[op], key=lambda ci: gmean(per_cfg[op][ci]))
            cfg = SWEEP_CONFIGS[op][best]
            chosen[key_of(op, N, K)] = cfg
            mconfig._TABLE[key_of(op, N, K)] = cfg
            mlaunch.clear_plans()   # plans made before keep the table's old choice
            log(f"sweep {op:5s} N={N} K={K}: " + "  ".join(
                f"{SWEEP_CONFIGS[op][ci].label()}={gmean(v):.0f}" for ci, v in per_cfg[op].items()) +
                f"  -> {cfg.label()}")
    return rows, chosen


def run_main(quick, prov, tuner_path, partial_csv=None, models=None):
    import pandas as pd

    tuner = ga.GroupedGemmAutotuner(tuner_path)
    rows = []
    for model, layer, B, Mper, N, K in cases(quick, models):
        p = Problem(B, Mper, N, K)
        for r in ROUTINGS:
            s, offs, host = p.sizes[r]
            for op in OPS:
                a, b = p.operands(op)
                kw = dict(offs=offs, host_sizes=host)
                # correctness: fp32 per-group reference; ours poisoned first
                ref = p.reference(op, s)
                poisoned = torch.full(p.out_shape(op), float("nan"), device=DEV, dtype=torch.bfloat16)
                errs = {"triton": rel_err(p.ours(op, s, out=poisoned), ref)}
                for name in ("grouped_mm", "cublas_loop"):
                    try:
                        errs[name] = rel_err(ga.run_backend(name, op, a, b, s, **kw), ref)
                    except Exception as exc:
                        errs[name] = float("nan")
                        log(f"  {name} {op} failed: {type(exc).__name__}: {str(exc)[:200]}")
                choice = tuner.choose(op, a, b, s, **kw)
                errs["autotune"] = rel_err(tuner(op, a, b, s, **kw), ref)
                del ref, poisoned
                fns = {
                    "cublas_loop": lambda: ga.run_backend("cublas_loop", op, a, b, s, **kw),
                    "grouped_mm": lambda: ga.run_backend("grouped_mm", op, a, b, s, **kw),
                    "triton": lambda: p.ours(op, s),
                    "autotune": lambda: tuner(op, a, b, s, **kw),
                }
                times = measure_turns({name: fns[name] for name in BACKENDS}, rep_ms=REP_MS)
                gtimes = measure_turns({name: fns[name] for name in BACKENDS}, rep_ms=GRAPH_REP_MS, mode="graph")
                fl = moe.flops(p.M, N, K)
                gmm = times["grouped_mm"][0]
                ggmm = gtimes["grouped_mm"][0]
                cfg_label = (mlaunch.plan_for_wgrad(a, b, s).label if op == "wgrad"
                             else mlaunch.default_label(a, b, s, trans_w=(op == "dgrad")))
                for name in BACKENDS:
                    med, q25, q75, host_us = times[name]
                    gmed = gtimes[name][0]
                    rows.append(dict(
                        model=model, layer=layer, B=B, M=Mper, tokens=p.M, N=N, K=K, op=op, routing=r,
                        backend=name, median_ms=med, q25_ms=q25, q75_ms=q75, host_us=host_us,
                        graph_median_ms=gmed, ratio_vs_grouped_mm_graph=ggmm / gmed if gmed == gmed else math.nan,
                        timing="median_ms: eager (host cost included); graph_median_ms: CUDA-graph replays",
                        tflops=fl / med / 1e9 if med == med else math.nan,
                        ratio_vs_grouped_mm=gmm / med if med == med and gmm == gmm else math.nan,
                        rel_err=errs.get(name, math.nan),
                        flops=fl, bytes=moe.bytes_moved(op, p.M, B, N, K,
                                                       active_groups=sum(1 for v in host if v)),
                        config=cfg_label if name == "triton" else (choice if name == "autotune" else ""),
                        **prov))
                line = "  ".join(f"{n}={fl / times[n][0] / 1e9:6.0f}" for n in BACKENDS)
                log(f"{model:12s} {layer:6s} B={B:2d} M={Mper} {r:8s} {op:5s} {line}  "
                    f"ours/gmm={gmm / times['triton'][0]:.3f} at={choice} "
                    f"err={errs['triton']:.1e}/{errs.get('grouped_mm', math.nan):.1e}")
        del p
        torch.cuda.empty_cache()
        if partial_csv is not None:      # survive a time-out: what was measured so far
            pd.DataFrame(rows).to_csv(partial_csv, index=False)
    return rows


def summarize(df) -> str:
    import pandas as pd

    lines = []
    piv = df.pivot_table(index=["model", "routing", "layer", "B", "M", "N", "K", "op"], columns="backend",
                         values="tflops", sort=False)
    piv["ours/gmm"] = piv["triton"] / piv["grouped_mm"]
    piv["autotune/gmm"] = piv["autotune"] / piv["grouped_mm"]
    best = piv[["cublas_loop", "grouped_mm", "triton"]].max(axis=1)
    piv["autotune/best"] = piv["autotune"] / best
    with pd.option_context("display.width", 200, "display.max_rows", 500, "display.float_format", "{:.3f}".format):
        for (model, routing), sub in piv.groupby(level=[0, 1], sort=False):
            lines.append(f"\n## {model} - {routing}\n")
            lines.append(sub.droplevel([0, 1]).round(3).to_string())
        r = piv["ours/gmm"]
        lines.append("\n## Summary\n")
        summ = piv.groupby(level=[0, 1], sort=False)[["cublas_loop", "grouped_mm", "triton", "autotune"]].mean()
        summ["ours/gmm (geomean)"] = piv.groupby(level=[0, 1], sort=False)["ours/gmm"].apply(
            lambda v: math.exp(sum(map(math.log, v)) / len(v)))
        summ["ours wins"] = piv.groupby(level=[0, 1], sort=False)["ours/gmm"].apply(
            lambda v: f"{int((v >= 1.0).sum())}/{len(v)}")
        lines.append(summ.round(3).to_string())
        lines.append("\n## Per op\n")
        per_op = piv.groupby(level="op", sort=False)[["cublas_loop", "grouped_mm", "triton", "autotune"]].mean()
        per_op["ours/gmm (geomean)"] = piv.groupby(level="op", sort=False)["ours/gmm"].apply(
            lambda v: math.exp(sum(map(math.log, v)) / len(v)))
        lines.append(per_op.round(3).to_string())
        gm = math.exp(sum(map(math.log, r)) / len(r))
        if "graph_median_ms" in df:
            gp = df.pivot_table(index=["model", "routing", "layer", "B", "M", "N", "K", "op"], columns="backend",
                                values="graph_median_ms", sort=False)
            gr = gp["grouped_mm"] / gp["triton"]
            lines.append(f"\nGraph-replayed ours/torch._grouped_mm: geomean "
                         f"{math.exp(sum(map(math.log, gr.dropna())) / max(1, len(gr.dropna()))):.3f}, "
                         f"min {gr.min():.3f}")
        lines.append(f"\nEager ours/torch._grouped_mm: geomean {gm:.3f}, min {r.min():.3f} "
                     f"({r.idxmin()}), cases below 0.8: {int((r < 0.8).sum())}/{len(r)}")
        ab = piv["autotune/best"]
        lines.append(f"autotune/best backend: min {ab.min():.3f} ({ab.idxmin()}), "
                     f"cases below 0.98: {int((ab < 0.98).sum())}/{len(ab)}")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "grouped_gemm"))
    ap.add_argument("--sweep", action="store_true",
                    help="time our Triton kernel's launch configs first and keep the best per (op, N, K) "
                         "(on sm_90 that changes wgrad only: fwd/dgrad run the Gluon kernel); adds about "
                         "30 s to --quick, 2.5 minutes to the whole table")
    ap.add_argument("--quick", action="store_true",
                    help="36 of the 144 cases: each model's smallest B and M (DeepSeek-V3 B=16, "
                         "gpt-oss-20B B=4, M=2048), every layer, routing and op; about 2 minutes")
    ap.add_argument("--model", action="append", choices=sorted(MODELS), help="only this model (repeatable)")
    ap.add_argument("--sweep-only", action="store_true", help="stop after the sweep (no main table)")
    ap.add_argument("--configs", metavar="JSON",
                    help='sweep these configs instead, e.g. \'[{}, {"BLOCK_N": 128, "num_warps": 4}]\' '
                         "(GemmConfig fields; {} is the default)")
    args = ap.parse_args(argv)
    if args.configs:
        try:
            configs = [moe.GroupedConfig(**c) for c in json.loads(args.configs)]
        except (ValueError, TypeError) as exc:
            sys.exit(f"--configs: {exc}")
        for op in OPS:
            SWEEP_CONFIGS[op] = configs
    if not torch.cuda.is_available():
        sys.exit("run_grouped_gemm.py needs a CUDA GPU; the notebook renders committed results without one")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    command = "python3 experiments/run_grouped_gemm.py " + " ".join(sys.argv[1:] if argv is None else argv)
    t0 = time.time()
    prov = provenance(command)
    ceil = ceilings()
    log(f"device {prov.get('prov_device_name')}  mm bf16 {ceil['mm_bf16_tflops']:.0f} TFLOP/s  "
        f"copy {ceil['copy_tbps']:.2f} TB/s  ({time.time() - t0:.0f}s)")
    import pandas as pd

    if args.sweep:
        srows, chosen = run_sweep(args.quick, args.model)
        pd.DataFrame(srows).assign(**prov).to_csv(out / "sweep.csv", index=False)
        (out / "chosen_configs.json").write_text(json.dumps(
            {"|".join(map(str, k)): v.as_dict() for k, v in chosen.items()}, indent=1))
        log(f"sweep done ({time.time() - t0:.0f}s)")
        if args.sweep_only:
            return
    ceil.update(cpu_overhead())
    log("host overhead per call (us): " + ", ".join(f"{k[7:]}={v:.1f}" for k, v in ceil.items()
                                                    if k.startswith("cpu_us_")))
    rows = run_main(args.quick, prov, out / "autotune_cache.json", out / "grouped_gemm.csv", args.model)
    df = pd.DataFrame(rows)
    for k, v in ceil.items():
        df[f"ceiling_{k}"] = v
    df.to_parquet(out / "grouped_gemm.parquet", index=False)
    df.to_csv(out / "grouped_gemm.csv", index=False)
    text = summarize(df)
    (out / "summary.md").write_text(f"command: {command}\n{text}\n")
    log(text)
    bad = df[(df.rel_err > 2e-2) | df.rel_err.isna()]
    log(f"correctness: max rel err ours {df[df.backend == 'triton'].rel_err.max():.2e}; "
        f"rows over 2e-2 or failed: {len(bad)}")
    log(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
