"""Probe: the chunked variant of all_gather_matmul, its schedules against the libraries.

Gathered along K (``--gather-dim 1``, the default), ``chunked`` copies each row chunk of every
peer's shard into the gathered A (copy engine, ``kernels.common.memcpy2d``) and runs cuBLAS on each
chunk's rows over the whole K as it lands (``k_schedule="rows"``), or sums the shards' products in
fp32 (``"sum"``). This times both, rows at several chunk counts and growths, beside, in the same
run, the GEMM alone (cuBLAS on the gathered A), NCCL + cuBLAS and PyTorch's fused op, eager and graph-
replayed (``workbench.dist.time_collective``: the slowest rank's median), and checks every C of
ours against the GEMM alone's (bf16 tolerance of ``kernels.ag_gemm.reference``). Gathered along M
(``--gather-dim 0``): each peer's shard whole, its GEMM on the caller's stream after ours (``m``). (A
schedule that ran the peers' GEMMs on the copies' stream beside ours, ``mc``, gained nothing and is
gone: ``git show 7a70471``.)

    torchrun --nproc-per-node 2 experiments/probes/probe_ag_chunked.py --profile gemm,r4,g3 \
        --out results/overlap/probe_k_rows
    torchrun --nproc-per-node 2 experiments/probes/probe_ag_chunked.py --gather-dim 0 --out results/overlap/probe_m
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.distributed as tdist

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]
from kernels import ag_gemm  # noqa: E402
from kernels.ag_gemm.baselines import NcclCublas, TorchFused, gathered_a, torch_fused_available  # noqa: E402
from kernels.ag_gemm.reference import tolerance  # noqa: E402
from run_ag_gemm import parse_shapes  # noqa: E402  (experiments/: the study script's own)
from workbench import dist  # noqa: E402
from workbench.dist import time_collective  # noqa: E402

SHAPES = ("4096x8192x8192,256x16384x16384,512x8192x8192,1536x12288x4096,2048x4096x14336,"
          "7168x5120x3072,10000x4096x4096,16384x8192x2048,3072x12288x12288,768x4096x4096")


def _calls(a, b, heap, W, gd, schedules):
    group = tdist.group.WORLD
    nccl = NcclCublas(a, W, gd)
    calls = {"nccl": lambda: nccl(a, b)}
    if torch_fused_available():
        fused = TorchFused(group.group_name, gd)
        calls["torch"] = lambda: fused(a, b)
    for name in schedules:
        cfg = ag_gemm.AgGemmConfig(variant="chunked", **_schedule(name))
        ag_gemm.prepare(a, b, heap, gather_dim=gd, config=cfg)
        calls[name] = (lambda cfg=cfg: ag_gemm.all_gather_matmul(a, b, heap, gather_dim=gd, config=cfg))
    return calls


def _schedule(name: str) -> dict:
    """'sum' -> k_schedule='sum'; 'r4' -> 4 equal row chunks; 'g3' -> 3 row chunks, each twice the last;
    'm' -> gathered along M (one schedule)."""
    if name in ("sum", "m"):
        return {"sum": dict(k_schedule="sum"), "m": {}}[name]
    if name[:1] in ("r", "g") and name[1:].isdigit():
        return dict(k_schedule="rows", ce_chunks=int(name[1:]), chunk_growth=2 if name[0] == "g" else 1)
    raise ValueError(f"--schedules: {name!r} is not 'sum', rN (N equal row chunks), gN (N growing ones) or m")


def _profile(calls, M, N, K, rank, trace_dir=None) -> None:
    """PyTorch's profiler table of 5 calls of each (every rank calls; rank 0's table is
    printed): the GEMMs' and the copies' GPU time."""
    from torch.profiler import ProfilerActivity, profile

    for name, fn in calls.items():
        fn()
        torch.cuda.synchronize()
        tdist.barrier()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        if trace_dir is not None:   # every rank's timeline: each kernel and copy with its stream and times
            prof.export_chrome_trace(str(trace_dir / f"trace_{name}_{M}x{N}x{K}_rank{rank}.json"))
        if rank:
            continue
        print(f"profile of 5 calls of {name} at {M}x{N}x{K}:", flush=True)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8), flush=True)


def _shape_rows(M, N, K, heap, schedules, rank, W, gd, profile=(), trace_dir=None):
    dev = heap.device
    g = torch.Generator(device=dev).manual_seed(1000 * M + rank)
    a = torch.randn(*((M // W, K) if gd == 0 else (M, K // W)), device=dev, generator=g).bfloat16()
    b = torch.randn(K, N, device=dev, generator=torch.Generator(device=dev).manual_seed(7)).bfloat16()
    flat = torch.empty(W * a.shape[0], a.shape[1], dtype=a.dtype, device=dev)
    tdist.all_gather_into_tensor(flat, a)
    A = gathered_a(flat, W, gd).contiguous()
    ref = A.float() @ b.float()
    atol, rtol = tolerance(a.dtype, K)
    calls = {"gemm": lambda: torch.matmul(A, b), **_calls(a, b, heap, W, gd, schedules)}
    if profile:
        _profile({k: calls[k] for k in profile if k in calls}, M, N, K, rank, trace_dir)
    rows = []
    for name, fn in calls.items():
        err = (fn().float() - ref).abs()
        ok = bool((err <= atol + rtol * ref.abs()).all())
        eager = time_collective(fn, warmup=5, iters=20)
        graph = time_collective(fn, warmup=3, iters=20, graph=4)
        rows.append(dict(M=M, N=N, K=K, world_size=W, gather_dim=gd, method=name, eager_ms=eager["ms"],
                         graph_ms=graph["ms"], ok=ok, max_err=float(err.max())))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="MxNxK of the gathered problems")
    ap.add_argument("--gather-dim", type=int, default=1, choices=(0, 1), help="1: shards of K; 0: shards of M")
    ap.add_argument("--schedules", default=None,
                    help="the chunked variant's schedules to time: along K sum, rN (N equal row chunks), gN (N "
                         "growing ones), default sum,r1,r2,r4,g2,g3,g4; along M m")
    ap.add_argument("--out", type=Path, required=True, help="folder for rows.csv")
    ap.add_argument("--profile", default="", help="methods to profile (rank 0) on the first shape, e.g. gemm,r4,sum")
    ap.add_argument("--trace", action="store_true", help="with --profile: each rank's Chrome trace of them in --out")
    args = ap.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    default = "sum,r1,r2,r4,g2,g3,g4" if args.gather_dim == 1 else "m"
    schedules = [c.strip() for c in (args.schedules or default).split(",") if c.strip()]
    for c in schedules:
        _schedule(c)
    with dist.worker():
        import pandas as pd

        W, rank = tdist.get_world_size(), tdist.get_rank()
        if args.gather_dim == 0 and any(M % W for M, _, _ in shapes):
            raise SystemExit(f"--gather-dim 0: every M must split evenly over the {W} ranks, got {args.shapes}")
        args.out.mkdir(parents=True, exist_ok=True)
        most = max(M * K for M, _, K in shapes)
        heap = dist.SymmetricHeap(4 * most * 2 // W + (64 << 20))
        rows = []
        for M, N, K in shapes:
            new = _shape_rows(M, N, K, heap, schedules, rank, W, args.gather_dim,
                              args.profile.split(",") if args.profile and (M, N, K) == shapes[0] else (),
                              args.out if args.trace else None)
            rows += new
            if rank == 0:
                print(pd.DataFrame(new).to_string(index=False), flush=True)
        if rank == 0:
            df = pd.DataFrame(rows)
            df["device"] = torch.cuda.get_device_name()
            df.to_csv(args.out / "rows.csv", index=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
