"""Probe: GPU timeline of all_gather_matmul calls, eager and CUDA-graph replayed (torch.profiler).

Rank 0 prints every kernel and copy of two eager calls and of one replay of a graph of two calls,
with start times and durations: whether the copies overlap the GEMMs as the variant intends.

    torchrun --nproc-per-node 2 experiments/probes/profile_ag_gemm.py --variant chunked --shape 4096x3584x8192 --gather-dim 0
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as tdist
from torch.profiler import ProfilerActivity, profile

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
from kernels import ag_gemm  # noqa: E402
from run_ag_gemm import parse_shapes  # noqa: E402  (experiments/: the study script's own)
from workbench import dist  # noqa: E402


def timeline(prof, limit: int = 40) -> list[str]:
    evs = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                 key=lambda e: e.time_range.start)
    t0 = evs[0].time_range.start if evs else 0
    return [f"{e.time_range.start - t0:9.1f} {e.time_range.elapsed_us():8.1f} us  {e.name[:70]}" for e in evs[:limit]]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="chunked", help="AgGemmConfig.variant (default chunked)")
    ap.add_argument("--shape", default="4096x3584x8192", help="MxNxK of the gathered problem")
    ap.add_argument("--gather-dim", type=int, default=0, choices=(0, 1))
    args = ap.parse_args(argv)
    try:
        shapes = parse_shapes(args.shape)
    except ValueError:
        shapes = []
    if len(shapes) != 1:
        ap.error(f"--shape {args.shape!r}: expected one MxNxK of positive integers, e.g. 4096x3584x8192")
    (M, N, K), = shapes
    with dist.worker():
        W = tdist.get_world_size()
        if M % W or K % W:
            raise ValueError(f"--shape {args.shape}: M and K must be multiples of the world size {W}")
        heap = dist.SymmetricHeap(3 * M * K * 2 + (64 << 20))
        dev = heap.device
        a = torch.randn(*((M // W, K) if args.gather_dim == 0 else (M, K // W)), device=dev).bfloat16()
        b = torch.randn(K, N, device=dev).bfloat16()
        cfg = ag_gemm.AgGemmConfig(variant=args.variant)
        ag_gemm.prepare(a, b, heap, gather_dim=args.gather_dim, config=cfg)
        tdist.barrier()

        def call():
            return ag_gemm.all_gather_matmul(a, b, heap, gather_dim=args.gather_dim, config=cfg)

        side = torch.cuda.Stream()  # warm up off the default stream, as graph capture wants
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(5):
                call()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        tdist.barrier()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            call()
            call()
        torch.cuda.synchronize()
        tdist.barrier()
        g.replay()
        torch.cuda.synchronize()
        tdist.barrier()
        for mode in ("eager", "graph"):
            with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
                for _ in range(2):
                    g.replay() if mode == "graph" else (call(), call())
                torch.cuda.synchronize()
            tdist.barrier()
            if tdist.get_rank() == 0:
                print(f"== {mode}: {args.variant} {args.shape} gather_dim={args.gather_dim}, W={W}", flush=True)
                print("\n".join(timeline(prof)), flush=True)
        ag_gemm.check(heap)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
