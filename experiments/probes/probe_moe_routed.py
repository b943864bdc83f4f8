#!/usr/bin/env python3
"""Probe: the MXFP4 down-projection called with the router's ids, routing made in its own kernel
(one launch) against the routing kernel plus the down-projection (two launches), per model and M.

Issue 42 asks for at most 40 us of host time per eager call and eager within 1.3x of graph replay
from M = 16. A call given the router's ``(topk_ids, topk_weights)`` used to launch the routing
kernel (which also zeroed the output) and then the down-projection; eager, the launcher now runs
one kernel whose first programs make the routing and zero the output while the others wait for
them (``_moe_mxfp4_down_routed_kernel``). This probe times the forms as users call them, on the
study's model shapes (random weights, the study's routing draws):

- ``graph_us``: one call replayed from a CUDA graph, L2 flushed before each (the GPU time, as
  ``models.csv`` times the kernel; the one-launch forms captured as one launch, at every M);
- ``loop_eager_us`` / ``loop_graph_us``: a user's loop, calls back to back over four routings in
  turn without a flush, eager (CUDA events per call) and graph-replayed;
- ``host_us``: host time per call (median of 300 back-to-back calls, no sync in between).

Every form is checked against the fp32 reference of the study (the quantizer's own decode) first.

    python3 experiments/probes/probe_moe_routed.py --out results/moe_mxfp4/routed
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
import run_moe_mxfp4 as study  # noqa: E402  (the study's shapes, weights, routing draws, reference, check)
from kernels.moe_mxfp4 import block_m_for, moe_mxfp4_down, prepare_weights  # noqa: E402
from kernels.moe_mxfp4 import launch as mlaunch  # noqa: E402
from kernels.moe_mxfp4 import plan as mplan  # noqa: E402
from kernels.moe_mxfp4.routing import prepare_routing_and_output  # noqa: E402
from workbench import bench  # noqa: E402
from workbench import provenance  # noqa: E402

M_LISTS = {"kimi-k2.5": (1, 4, 8, 16, 32, 64, 128, 256, 512),
           "gpt-oss-120b": (1, 3, 8, 16, 48, 64, 128, 256, 512, 1024),
           "gpt-oss-20b": (1, 8, 16, 48, 128, 256, 512, 1024)}
SETS = 4


def log(msg: str) -> None:
    print(msg, flush=True)


def forms(w2):
    """name -> (setup, call): the one launch with its registers capped at the plain kernel's (the
    launcher's) and left to ptxas, both at every M and captured too; the two launches (routing
    kernel, then the plain kernel) as the launcher made them before; and the launcher as shipped
    (its rule picks the form eagerly; graph capture takes the two launches)."""
    E, H = study.E, study.H
    defaults = (mlaunch.ROUTE_IN_KERNEL_MAX_US, mlaunch.ROUTE_IN_KERNEL_IN_GRAPHS)

    def routed(s):
        return moe_mxfp4_down(s[0], w2, (s[1], s[2]))

    def two_launches(s):
        r, out = prepare_routing_and_output(s[1], s[2], E, block_m_for(s[1].shape[0], study.TOP_K, E), H)
        return moe_mxfp4_down(s[0], w2, r, out=out, accumulate=True)

    def policy(cap, forced=True):
        def setup():
            mplan.CAP_ROUTED_REGISTERS = cap
            mlaunch.ROUTE_IN_KERNEL_MAX_US, mlaunch.ROUTE_IN_KERNEL_IN_GRAPHS = (float("inf"), True) if forced \
                else defaults
            mlaunch._ROUTED.clear()
        return setup
    return {"one launch": (policy(True), routed), "one launch, ptxas registers": (policy(False), routed),
            "two launches": (policy(True), two_launches), "as chosen": (policy(True, False), routed)}


def run_model(name: str, m_list, args, prov) -> tuple[list, list]:
    study.use_model(name)
    g = torch.Generator(device="cuda").manual_seed(study.SEED)
    w, ws = study.quantized_weights(g)
    w_bf16 = study.decoded_bf16(w, ws)
    w2 = prepare_weights(w, ws, 2)
    rows, checks = [], []
    for M in m_list:
        t0 = time.time()
        sets = []
        for _ in range(SETS):
            ids, wts = study.route(M, g)
            sets.append((torch.randn(M * study.TOP_K, study.I, device="cuda", generator=g).bfloat16(), ids, wts))
        cfg = mlaunch.plan_for(sets[0][0], w2, (sets[0][1], sets[0][2])).config
        if cfg.SPLIT_K > 1:     # partial rows rounded one by one (the study's check of the same config)
            ref, mag = study.split_reference(sets[0][0].float(), w_bf16, sets[0][1], sets[0][2], cfg.SPLIT_K,
                                             cfg.BLOCK_K)
        else:
            ref, mag = study.reference(sets[0][0].float(), w_bf16, sets[0][1], sets[0][2])
        for form, (setup, fn) in forms(w2).items():
            if form not in args.forms:
                continue
            setup()
            c = study.check(fn(sets[0]), ref, mag, slack=float(cfg.SPLIT_K))
            checks.append(dict(model=name, M=M, form=form, **c))
            if not c["ok"]:
                log(f"{name} M={M} {form}: CHECK FAILED {c}")
                continue
            one = bench.measure(lambda: fn(sets[0]), mode="graph", flush_l2=True, warmup_ms=10, rep_ms=args.rep_ms)
            loop = {m: bench.measure(fn, mode=m, flush_l2=False, input_sets=sets, warmup_ms=10, rep_ms=args.rep_ms)
                    for m in ("eager", "graph")}
            it = iter(range(1 << 30))
            host = bench.host_time_us(lambda: fn(sets[next(it) % SETS]), calls=300)
            rows.append(dict(model=name, M=M, pairs=M * study.TOP_K, form=form,
                             block_m=cfg.BLOCK_M, split_k=cfg.SPLIT_K, graph_us=one.median_ms * 1e3,
                             loop_eager_us=loop["eager"].median_ms * 1e3, loop_graph_us=loop["graph"].median_ms * 1e3,
                             host_us=host["median_us"], host_q25_us=host["q25_us"], host_q75_us=host["q75_us"],
                             **prov))
        for x in rows:
            if x["model"] == name and x["M"] == M:
                log(f"{name} M={M} {x['form']:>28}: graph {x['graph_us']:7.1f} us; "
                    f"loop eager {x['loop_eager_us']:7.1f}, "
                    f"graph {x['loop_graph_us']:7.1f}; host {x['host_us']:5.1f}")
        log(f"{name} M={M}: {time.time() - t0:.0f} s")
    return rows, checks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for rows.csv, checks.csv")
    ap.add_argument("--models", nargs="*", default=list(M_LISTS), choices=list(M_LISTS))
    ap.add_argument("--m", type=int, nargs="*", default=None, help="token counts (default: each model's list)")
    ap.add_argument("--rep-ms", type=float, default=30.0)
    ap.add_argument("--forms", nargs="*", default=["one launch", "one launch, ptxas registers", "two launches"],
                    help="of: 'one launch', 'one launch, ptxas registers', 'two launches', 'as chosen'")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_moe_routed.py needs a CUDA GPU (sm_90)", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance.columns("experiments/probes/probe_moe_routed.py", argv)
    rows, checks = [], []
    for name in args.models:
        r, c = run_model(name, tuple(args.m) if args.m else M_LISTS[name], args, prov)
        rows += r
        checks += c
        pd.DataFrame(rows).to_csv(out / "rows.csv", index=False)
        pd.DataFrame(checks).to_csv(out / "checks.csv", index=False)
    bad = [c for c in checks if not c["ok"]]
    log(f"{len(checks) - len(bad)} of {len(checks)} checks ok")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
