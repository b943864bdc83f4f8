#!/usr/bin/env python3
"""Probe: the MXFP4 down-projection at large M, warp-specialised (the expansion in warps of its own
beside the wgmma, ``kernels/moe_mxfp4/gluon.py``) against the Triton kernel and the bf16-weight
grouped GEMM, per model and M; and the launcher's rule between the two kernels (``launch.ws_fits``).

Issue 42 asks for at least the bf16-weight grouped GEMM (``torch._grouped_mm`` on the same routing,
its gather and combine included) at M = 16384 (KIMI-K2.5) and M = 8192 (gpt-oss-120b); the Triton
kernel runs the expansion and the MMA one after the other (0.55-0.62x at gpt-oss-120b M = 8192).
Forms, each a call as users make it with the router's (topk_ids, topk_weights):

- ``triton kernel``: ``moe_mxfp4_down`` with the warp-specialised path turned off;
- ``as chosen``: ``moe_mxfp4_down`` as shipped (the rule picks the kernel);
- ``ws level 2`` / ``ws level 0``: the warp-specialised kernel with the prepacked (level 2, the
  default) or the plain weights, the routing for 128-row blocks prepared outside the timed call;
- ``bf16 grouped_mm``: the study's peer (gather, ``torch._grouped_mm``, combine);

each checked against the study's fp32 reference first, then timed CUDA-graph replayed with the L2
flushed before each run, and eager. ``set``: "fit" for the (model, M) the rule's thresholds were
read from, "held out" for the others. Level 2's output is also compared with level 0's bit for bit.

    python3 experiments/probes/probe_moe_mxfp4_ws.py --out results/moe_mxfp4/ws
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "experiments")]
import run_moe_mxfp4 as study  # noqa: E402  (the study's weights, routing draws, reference, check)
from kernels.moe_mxfp4 import Mxfp4Weights, baselines, moe_mxfp4_down, prepare_weights  # noqa: E402
from kernels.moe_mxfp4 import gluon as ws_kernel  # noqa: E402
from kernels.moe_mxfp4 import launch as mlaunch  # noqa: E402
from kernels.moe_mxfp4.routing import prepare_routing  # noqa: E402
from workbench import bench  # noqa: E402
from workbench import provenance  # noqa: E402

# (E, H, I, top_k) and the M of each set: the rule's thresholds were read from the fit M (first run),
# the held-out M and the two held-out models were run after it was fixed
MODELS = {"gpt-oss-120b": ((128, 2880, 2880, 4), (1024, 2048, 4096, 8192), (3072, 6144, 16384)),
          "kimi-k2.5": ((385, 7168, 512, 9), (2048, 4096, 8192, 16384), (1536, 3072, 12288)),
          "gpt-oss-20b": ((32, 2880, 2880, 4), (1024, 4096, 8192), (2048, 3072, 16384)),
          "qwen3-235b-a22b": ((128, 4096, 1536, 8), (), (1024, 2048, 8192)),
          "deepseek-v3": ((256, 7168, 2048, 8), (), (2048, 4096, 8192))}


def log(msg: str) -> None:
    print(msg, flush=True)


def use(name: str) -> None:
    study.MODEL = name
    study.E, study.H, study.I, study.TOP_K = MODELS[name][0]


def triton_kernel(a, w2, ids, wts):
    """moe_mxfp4_down with the warp-specialised path off (the Triton kernels alone)."""
    mlaunch.WS_LARGE_M = False
    try:
        return moe_mxfp4_down(a, w2, (ids, wts))
    finally:
        mlaunch.WS_LARGE_M = True


def ws_call(a, weights, routing, M: int, atomic: bool = True) -> torch.Tensor:
    """The warp-specialised kernel as one call: the output zeroed and added into (atomic), or each
    pair's row stored and summed per token in slot order (atomic=False: no atomics' order)."""
    args = dict(level=weights.level, shape=weights.shape, one_mul=weights.one_mul)
    if atomic:
        return ws_kernel.launch(a, weights.w, weights.w_scale, routing,
                                torch.zeros(M, study.H, dtype=torch.bfloat16, device="cuda"), **args)
    pairs = torch.empty(M * study.TOP_K, study.H, dtype=torch.bfloat16, device="cuda")
    ws_kernel.launch(a, weights.w, weights.w_scale, routing, pairs, atomic=False, **args)
    return ws_kernel.reduce_pairs(pairs, torch.empty(M, study.H, dtype=torch.bfloat16, device="cuda"), study.TOP_K)


def run_model(name: str, args, prov) -> tuple[list, list]:
    use(name)
    _, fit, held = MODELS[name]
    g = torch.Generator(device="cuda").manual_seed(study.SEED)
    w, ws = study.quantized_weights(g)
    w_bf16 = study.decoded_bf16(w, ws)
    w2 = prepare_weights(w, ws, 2)
    w0 = Mxfp4Weights(w, ws, 0, w2.max_scale)
    rows, checks = [], []
    for M in sorted(fit + held):
        if args.m and M not in args.m:
            continue
        t0 = time.time()
        ids, wts = study.route(M, g)
        a = torch.randn(M * study.TOP_K, study.I, device="cuda", generator=g).bfloat16()
        ref, mag = study.reference(a.float(), w_bf16, ids, wts)
        r = prepare_routing(ids, wts, study.E, mlaunch.WS_BLOCK_M)
        sr = baselines.sorted_rows(ids, study.E)
        fns = {"triton kernel": lambda: triton_kernel(a, w2, ids, wts),
               "as chosen": lambda: moe_mxfp4_down(a, w2, (ids, wts)),
               "ws level 2": lambda: ws_call(a, w2, r, M),
               "ws level 0": lambda: ws_call(a, w0, r, M),
               "bf16 grouped_mm": lambda: baselines.bf16_grouped_mm(a, w_bf16, sr, wts)}
        meta = dict(model=name, M=M, set="fit" if M in fit else "held out",
                    pairs_per_expert=M * study.TOP_K / study.E, rule_picks_ws=mlaunch.ws_fits(M, study.TOP_K, study.E))
        for form, fn in fns.items():
            try:
                c = study.check(fn(), ref, mag)
            except Exception as exc:   # a form that does not compile or launch: say so, go on
                log(f"{name} M={M} {form}: FAILED {type(exc).__name__}: {str(exc)[:300]}")
                checks.append(dict(meta, form=form, ok=False, error=str(exc)[:300]))
                continue
            checks.append(dict(meta, form=form, **c))
            if not c["ok"]:
                log(f"{name} M={M} {form}: CHECK FAILED {c}")
                continue
            t = {m: bench.measure(fn, mode=m, flush_l2=True, warmup_ms=10, rep_ms=args.rep_ms)
                 for m in ("graph", "eager")}
            flops = 2.0 * M * study.TOP_K * study.H * study.I
            rows.append(dict(meta, form=form, graph_us=t["graph"].median_ms * 1e3, eager_us=t["eager"].median_ms * 1e3,
                             tflops_graph=flops / (t["graph"].median_ms * 1e-3) / 1e12, **prov))
            log(f"{name} M={M} {form:>16}: graph {rows[-1]['graph_us']:8.1f} us, eager {rows[-1]['eager_us']:8.1f}"
                f" ({rows[-1]['tflops_graph']:.0f} TFLOP/s of bf16 work)")
        o2, o0 = (ws_call(a, wl, r, M, atomic=False) for wl in (w2, w0))
        same = bool(torch.equal(o2.view(torch.int16), o0.view(torch.int16)))
        checks.append(dict(meta, form="ws level 2 == ws level 0, bit for bit", ok=same))
        log(f"{name} M={M}: level 2 and level 0 bit-identical: {same}; {time.time() - t0:.0f} s")
    return rows, checks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for rows.csv, checks.csv")
    ap.add_argument("--models", nargs="*", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--m", type=int, nargs="*", default=None, help="only these token counts")
    ap.add_argument("--rep-ms", type=float, default=15.0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_moe_mxfp4_ws.py needs a CUDA GPU (sm_90)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance.columns("experiments/probes/probe_moe_mxfp4_ws.py", argv)
    found = {"rows": [], "checks": []}
    for name in args.models:
        for key, part in zip(found, run_model(name, args, prov)):
            found[key] += part
            pd.DataFrame(found[key]).to_csv(out / f"{key}.csv", index=False)     # after each model
    bad = [c for c in found["checks"] if not c["ok"]]
    log(f"{len(found['checks']) - len(bad)} of {len(found['checks'])} checks ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
