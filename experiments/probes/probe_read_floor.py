#!/usr/bin/env python3
"""Probe: how long one launch takes to read the bytes an MXFP4 down-projection must read (issue 42).

The HBM bound of ``results/moe_mxfp4/models.csv`` divides those bytes (the active experts' codes and
scales, the activations, the output) by the copy bandwidth of a 1 GiB copy. At small M the bytes are
18-130 MB, and one launch that only reads them also pays the launch, the ramp of the first loads and the
tail of the last: this probe measures that time, so that each row can say which limit it meets (the
read floor, or the kernel's own work).

For every committed row of ``models.csv`` (graph replay) it times, CUDA-graph replayed with the L2
flushed before each run, one Triton launch that reads exactly that many bytes (16 KiB per program,
16-byte loads, a per-program sum written so that nothing is dead), an empty launch, and the 1 GiB copy;
then writes ``read_floor.csv``: bytes, the copy bound, the read floor, the kernel's committed time and
its fraction of either.

    python3 experiments/probes/probe_read_floor.py --out results/moe_mxfp4/read_floor
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pandas as pd
import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "experiments")]
from kernels.moe_mxfp4 import metrics  # noqa: E402
from run_moe_mxfp4 import MODELS  # noqa: E402  (the study's model shapes)
from workbench import bench  # noqa: E402
from workbench import provenance  # noqa: E402
from workbench import roofline  # noqa: E402

CHUNK = 16384        # bytes per program: 128 threads x 8 loads of 16 bytes


@triton.jit
def _read_kernel(src_ptr, sums_ptr, n_words, WORDS: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * WORDS + tl.arange(0, WORDS)
    x = tl.load(src_ptr + offs, mask=offs < n_words, other=0)
    tl.store(sums_ptr + pid, tl.sum(x, axis=0))


@triton.jit
def _empty_kernel(sums_ptr):
    pass


def read_call(nbytes: int, device):
    """A callable that reads nbytes (rounded up to 16) in one launch."""
    words = -(-nbytes // 4)
    src = torch.randint(0, 1 << 20, (words,), dtype=torch.int32, device=device)
    grid = (triton.cdiv(words, CHUNK // 4),)
    sums = torch.empty(grid[0], dtype=torch.int32, device=device)
    return lambda: _read_kernel[grid](src, sums, words, WORDS=CHUNK // 4, num_warps=4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--models-csv", default=str(ROOT / "results" / "moe_mxfp4" / "models.csv"))
    ap.add_argument("--rep-ms", type=float, default=60)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("probe_read_floor.py needs a CUDA GPU", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")

    _, copy_gbps = roofline.measure_copy(1 << 30, device=dev, warmup_ms=30, rep_ms=200)   # as run_moe_mxfp4.py
    sums = torch.empty(1, dtype=torch.int32, device=dev)
    empty_us = bench.measure(lambda: _empty_kernel[(1,)](sums), cuda_graph=True, flush_l2=True,
                             warmup_ms=10, rep_ms=args.rep_ms).median_ms * 1e3
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; an empty launch {empty_us:.2f} us (graph, L2 flushed)", flush=True)

    committed = pd.read_csv(args.models_csv)
    committed = committed[committed.method == "graph"]
    rows = []
    for r in committed.itertuples():
        m = MODELS[r.model]
        nbytes = metrics.hbm_bytes(r.M, m.TOP_K, m.H, m.I, r.active_experts)
        t = bench.measure(read_call(nbytes, dev), cuda_graph=True, flush_l2=True, warmup_ms=10, rep_ms=args.rep_ms)
        floor_us = t.median_ms * 1e3
        bound_us = nbytes / (copy_gbps * 1e3)
        rows.append(dict(model=r.model, M=r.M, bytes=nbytes, copy_bound_us=bound_us, read_floor_us=floor_us,
                         read_floor_gbps=nbytes / (floor_us * 1e3), empty_launch_us=empty_us,
                         committed_us=r.prepacked_default_us, committed_frac_bound=r.frac_hbm_bound,
                         frac_read_floor=floor_us / r.prepacked_default_us, copy_gbps=copy_gbps))
        print(f"{r.model:13s} M={r.M:<6d} {nbytes / 1e6:8.1f} MB  copy bound {bound_us:7.1f} us  read floor "
              f"{floor_us:7.1f} us  ours (committed) {r.prepacked_default_us:7.1f} us", flush=True)
    df = pd.DataFrame(rows)
    for k, v in provenance.flat(provenance.collect()).items():
        df[f"prov_{k}"] = v
    df["prov_command"] = "python3 experiments/probes/probe_read_floor.py " + " ".join(sys.argv[1:] if argv is None else argv)
    df.to_csv(out / "read_floor.csv", index=False)
    print(f"wrote {out / 'read_floor.csv'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
