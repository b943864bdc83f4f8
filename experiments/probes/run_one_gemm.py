"""Probe: one kernels.gemm.matmul call signature, run a few times: a target for a profiler.

    ncu --clock-control none --kernel-name regex:_gemm --launch-skip 3 --launch-count 1 \
        python experiments/probes/run_one_gemm.py 1539 2824 4224 --config '{"stream_k": true}'

Fresh random bf16 (or --dtype) operands, the config as JSON (a dict of GemmConfig
fields; omitted: the heuristic), ``--iters`` calls, then one check against an fp32
reference so a profile of a wrong kernel does not go unnoticed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

MAX_CONFIG_CHARS = 2000  # the --config string is parsed as JSON, never evaluated


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("M", type=int)
    ap.add_argument("N", type=int)
    ap.add_argument("K", type=int)
    ap.add_argument("--config", default="", help="JSON dict of GemmConfig fields (default: the heuristic)")
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    ap.add_argument("--b-layout", default="row", choices=("row", "t"), help="t: B K-major (x @ w.t())")
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--pitch", default="", choices=("", "a", "b", "ab"),
                    help="operands held in buffers whose rows are padded to 128 bytes (views of the same shape)")
    args = ap.parse_args(argv)
    if len(args.config) > MAX_CONFIG_CHARS:
        raise SystemExit(f"--config is longer than {MAX_CONFIG_CHARS} characters")
    config = json.loads(args.config) if args.config else None
    if config is not None and not isinstance(config, dict):
        raise SystemExit("--config must be a JSON object of GemmConfig fields, e.g. '{\"stream_k\": true}'")

    import torch

    from kernels import gemm
    from kernels.gemm import launch as glaunch

    if not torch.cuda.is_available():
        raise SystemExit("run_one_gemm needs a CUDA GPU (sm_90: H100 or H200)")
    dtype = getattr(torch, args.dtype)
    a = torch.randn(args.M, args.K, device="cuda").to(dtype)
    b = torch.randn(args.K, args.N, device="cuda").to(dtype)
    if args.b_layout == "t":
        b = b.t().contiguous().t()
    if args.pitch:
        from experiments.probes.probe_gemm_pitch import padded_view

        a = padded_view(a) if "a" in args.pitch else a
        b = padded_view(b) if "b" in args.pitch else b
    for _ in range(args.iters):
        c = gemm.matmul(a, b, config)
    torch.cuda.synchronize()
    ref = a.float() @ b.float()
    err = float((c.float() - ref).norm() / ref.norm())
    plan = glaunch.plan_for(a, b, config)
    print(f"{args.M}x{args.N}x{args.K} {args.dtype} {plan.kind} {plan.config.label()} rel_err {err:.2e}")
    return 0 if err < 2e-2 else 1


if __name__ == "__main__":
    raise SystemExit(main())
