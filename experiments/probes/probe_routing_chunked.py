#!/usr/bin/env python3
"""Probe: the routing preparation of the MXFP4 down-projection at many pairs, one launch against three.

``prepare_routing`` sorts the (token, slot) pairs by expert. The one-launch kernel gives each program
a group of experts and has every program read all the pairs, twice, one chunk after another; from
``routing.CHUNKED_MIN_PAIRS`` pairs three launches over chunks of pairs do it instead (counts per chunk,
offsets, each chunk sorted and scattered), each pair read twice in all. This probe times both on the
study's models at large M (CUDA-graph replayed with the L2 flushed, and eager), with the output's
zeroing as the down-projection's calls make it (``prepare_routing_and_output``), after checking that
both give the same rows, bit for bit.

    python3 experiments/probes/probe_routing_chunked.py --out results/moe_mxfp4/routing_chunked
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT)]
from kernels.moe_mxfp4 import routing as mr  # noqa: E402
from workbench import bench  # noqa: E402
from workbench import provenance  # noqa: E402

# (E, H, top_k) and M
CASES = {"gpt-oss-120b": ((128, 2880, 4), (2048, 4096, 8192, 16384)),
         "gpt-oss-20b": ((32, 2880, 4), (2048, 8192)),
         "kimi-k2.5": ((385, 7168, 9), (1024, 4096, 16384))}
FIELDS = ("sorted_ids", "expert_ids", "num_rows", "counts")


def prepare(ids, wts, E, H, chunked: bool):
    mr.CHUNKED_MIN_PAIRS = 1 if chunked else 1 << 62
    mr._PLANS.clear()
    return lambda: mr.prepare_routing_and_output(ids, wts, E, 128, H)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for rows.csv")
    ap.add_argument("--rep-ms", type=float, default=20.0)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_routing_chunked.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    prov = provenance.columns("experiments/probes/probe_routing_chunked.py", argv)
    shipped = mr.CHUNKED_MIN_PAIRS
    rows, bad = [], 0
    g = torch.Generator(device="cuda").manual_seed(7)
    for model, ((E, H, top_k), ms) in CASES.items():
        for M in ms:
            ids = torch.rand(M, E, device="cuda", generator=g).topk(top_k, dim=1).indices.to(torch.int32)
            wts = torch.softmax(torch.randn(M, top_k, device="cuda", generator=g), -1)
            got = {}
            for form, chunked in (("one launch", False), ("three launches", True)):
                fn = prepare(ids, wts, E, H, chunked)
                r, o = fn()
                got[form] = r
                t = {m: bench.measure(fn, mode=m, flush_l2=True, warmup_ms=5, rep_ms=args.rep_ms)
                     for m in ("graph", "eager")}
                rows.append(dict(model=model, M=M, pairs=M * top_k, experts=E, form=form,
                                 graph_us=t["graph"].median_ms * 1e3, eager_us=t["eager"].median_ms * 1e3,
                                 output_zeroed=bool((o == 0).all()), **prov))
            a, b = got.values()
            same = all(torch.equal(getattr(a, f), getattr(b, f)) for f in FIELDS) and \
                torch.equal(a.sorted_weights.view(torch.int32), b.sorted_weights.view(torch.int32))
            bad += not same
            for x in rows[-2:]:
                x["same_rows"] = same
            print(f"{model} M={M}: one launch {rows[-2]['graph_us']:8.1f} us, three {rows[-1]['graph_us']:8.1f} us "
                  f"(graph); same rows: {same}", flush=True)
    mr.CHUNKED_MIN_PAIRS = shipped
    pd.DataFrame(rows).to_csv(out / "rows.csv", index=False)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
