"""Probe: one torch.mm (cuBLAS) call signature, run a few times: a target for a profiler, the
library's side of ``run_one_gemm.py`` (same operands, same ``--pitch`` views).

    ncu --clock-control none --kernel-name regex:gemm --launch-skip 3 --launch-count 1 \
        python experiments/probes/run_one_mm.py 9688 13224 12120 --pitch ab
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for d in "MNK":
        ap.add_argument(d, type=int)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--pitch", default="", choices=("", "a", "b", "ab"),
                    help="operands held in buffers whose rows are padded to 128 bytes (views of the same shape)")
    args = ap.parse_args(argv)
    import torch

    from experiments.probes.probe_gemm_pitch import padded_view

    a = torch.randn(args.M, args.K, device="cuda").bfloat16()
    b = torch.randn(args.K, args.N, device="cuda").bfloat16()
    a = padded_view(a) if "a" in args.pitch else a
    b = padded_view(b) if "b" in args.pitch else b
    for _ in range(args.iters):
        c = torch.mm(a, b)
    torch.cuda.synchronize()
    print(f"{args.M}x{args.N}x{args.K} torch.mm pitch={args.pitch or 'none'} {c.shape}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
