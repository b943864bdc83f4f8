"""Probe: where all_gather_matmul's library path spends its host time per eager call.

The overlap runs measured `auto` eager calls that ran NCCL + cuBLAS at 1.13-1.55x the same library
calls made bare (graph replays equal: host time, not GPU time). This times, on every rank, host
microseconds per call (median of back-to-back calls, no synchronization between them) of:

* `bare`: `baselines.NcclCublas` called directly (what the benchmark's baseline does);
* `nccl`: `all_gather_matmul(..., config=AgGemmConfig(variant="nccl"))`;
* `auto`: `all_gather_matmul(..., config=None)` (prints what it runs);
* `preamble`: the launcher's work before the library calls (`get_plan`, the watch's poll);

then rank 0 prints the cProfile of 500 `nccl` calls, the top 15 functions by own time. With
``--gpu``, also each call's eager time as the overlap study takes it (``workbench.dist.time_collective``:
every call between its own pair of CUDA events, the slowest rank's median; the study measured the
launcher's `nccl` path at 1.2x `bare` this way at 256x16384x16384) and PyTorch's profiler table of 10
calls of `bare` and of `nccl` (CUDA kernels and the host calls that launch them).

    torchrun --nproc-per-node 2 experiments/probes/probe_launcher_host.py --shape 256x5120x8192 --gather-dim 0
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
from kernels import ag_gemm  # noqa: E402
from kernels.ag_gemm import launch  # noqa: E402
from kernels.ag_gemm.baselines import NcclCublas  # noqa: E402
from run_ag_gemm import parse_shapes  # noqa: E402  (experiments/: the study script's own)
from workbench import dist  # noqa: E402
from workbench.bench import host_time_us  # noqa: E402


def _gpu_lines(calls: dict) -> list[str]:
    """Eager time per call of each, as the overlap study takes it, then the profiler's tables of
    `bare` and `nccl` (every rank profiles; rank 0's tables are printed)."""
    from torch.profiler import ProfilerActivity, profile

    from workbench.dist import time_collective

    lines = []
    for name, fn in calls.items():
        t = time_collective(fn, warmup=5, iters=20)
        lines.append(f"  {name:9s} eager {t['ms'] * 1e3:7.1f} us per call (slowest rank; per rank "
                     f"{', '.join(f'{m * 1e3:.1f}' for m in t['ms_per_rank'])}; loop {t['loop_ms'] * 1e3:.1f})")
    for name in ("bare", "nccl"):
        tdist.barrier()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                calls[name]()
            torch.cuda.synchronize()
        lines += [f"profile of 10 {name} calls:", prof.key_averages().table(sort_by="cuda_time_total", row_limit=12)]
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="256x5120x8192", help="MxNxK of the gathered problem")
    ap.add_argument("--gather-dim", type=int, default=0, choices=(0, 1))
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--gpu", action="store_true", help="also eager GPU time per call and the profiler's tables")
    args = ap.parse_args(argv)
    shapes = parse_shapes(args.shape)
    if len(shapes) != 1:
        ap.error(f"--shape {args.shape!r}: expected one MxNxK, e.g. 256x5120x8192")
    (M, N, K), = shapes
    with dist.worker():
        W, rank = tdist.get_world_size(), tdist.get_rank()
        heap = dist.SymmetricHeap(3 * M * K * 2 + (64 << 20))
        dev = heap.device
        a = torch.randn(*((M // W, K) if args.gather_dim == 0 else (M, K // W)), device=dev).bfloat16()
        b = torch.randn(K, N, device=dev).bfloat16()
        nccl_cfg = ag_gemm.AgGemmConfig(variant="nccl")
        bare = NcclCublas(a, W, args.gather_dim)
        calls = {
            "bare": lambda: bare(a, b),
            "nccl": lambda: ag_gemm.all_gather_matmul(a, b, heap, gather_dim=args.gather_dim, config=nccl_cfg),
            "auto": lambda: ag_gemm.all_gather_matmul(a, b, heap, gather_dim=args.gather_dim),
            "preamble": lambda: (launch._shared(heap)["watch"].poll(),
                                 launch.get_plan(a, b, heap, gather_dim=args.gather_dim, config=nccl_cfg)),
        }
        for cfg in (nccl_cfg, None):
            ag_gemm.prepare(a, b, heap, gather_dim=args.gather_dim, config=cfg)
        auto_plan = launch.get_plan(a, b, heap, gather_dim=args.gather_dim)
        lines = [f"W={W} {M}x{N}x{K} gather_dim={args.gather_dim}: auto runs {auto_plan.cfg.variant} eagerly"]
        for name, fn in calls.items():
            tdist.barrier()
            t = host_time_us(fn, calls=args.calls)
            lines.append(f"  {name:9s} host {t['median_us']:7.1f} us per call (q25 {t['q25_us']:.1f}, "
                         f"q75 {t['q75_us']:.1f})")
        if args.gpu:
            lines += _gpu_lines({k: v for k, v in calls.items() if k != "preamble"})
        tdist.barrier()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            calls["nccl"]()
        prof.disable()
        torch.cuda.synchronize()
        tdist.barrier()
        if rank == 0:
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(15)
            print("\n".join(lines), out.getvalue(), sep="\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
