"""Probe: all_gather_matmul's copy-engine variants gathered along K when a shard's K is not a
multiple of BLOCK_K (at 4 ranks, random shapes with K/4 = 32 mod 64 timed out in `copy_engine`).

Each trial: one eager call, then one replay of a captured call, each followed by a synchronizing
`check` (a short `timeout_s`, so a stuck call costs seconds); a timeout is recorded and the flags
resynchronized (`recover`). Rank 0 prints one line per trial: the variant, the shard's K, what
the trial changed (fewer GEMM programs than SMs: whether the copy waits for a free SM), and
eager / graph outcomes with the wall time and the error against an fp32 reference (then the time
per call of 10 back-to-back calls or replays). Exits 1 if any call timed out.

    torchrun --nproc-per-node 4 experiments/probes/probe_ce_partial_k.py 3424 3456   # shard K values
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist

sys.path[:0] = [str(Path(__file__).resolve().parents[2])]
from kernels import ag_gemm  # noqa: E402
from kernels.ag_gemm.config import PIPELINED  # noqa: E402
from workbench import dist  # noqa: E402
from workbench.bench import capture  # noqa: E402

TRIALS = (("copy_engine", {}), ("copy_engine", {"num_sms": 100}), ("copy_engine", {"tma": False}),
          ("copy_engine", {"ce_chunks": 1}), ("pipelined", PIPELINED))


def _outcome(heap, fn, ref) -> str:
    t0 = time.perf_counter()
    failed = 0
    try:
        c = fn()
        torch.cuda.synchronize()
        ag_gemm.check(heap)
        err = f"{float((c.float() - ref).abs().max()):.3g}"
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(10):
            fn()
        end.record()
        torch.cuda.synchronize()
        ag_gemm.check(heap)
        err += f" {start.elapsed_time(end) / 10:.3f} ms/call"
    except Exception as exc:  # noqa: BLE001 - a timeout (ours or the all-gather's): record, resync
        failed, err = 1, f"{type(exc).__name__} " + str(exc).split(":", 3)[-1][:90]
    flag = torch.tensor([failed], device=heap.device)
    tdist.all_reduce(flag)
    if int(flag.item()):
        ag_gemm.recover(heap)
    return f"{time.perf_counter() - t0:6.2f}s {err}"


def _graph(fn):
    """A call of ``fn`` replayed from a CUDA graph, as a call that returns its result."""
    replay, out = capture(fn)
    return lambda: (replay(), out)[1]


def main() -> int:
    failures = 0
    with dist.worker():
        W, rank = tdist.get_world_size(), tdist.get_rank()
        heap = dist.SymmetricHeap(1 << 30)
        dev = heap.device
        for s_k in [int(x) for x in (sys.argv[1:] or ["3424", "3456"])]:
            M, N, K = 2048, 4096, W * s_k
            torch.manual_seed(7 + rank)
            a = torch.randn(M, s_k, device=dev).bfloat16()
            torch.manual_seed(11)
            b = torch.randn(K, N, device=dev).bfloat16()
            parts = [torch.empty_like(a) for _ in range(W)]
            tdist.all_gather(parts, a)
            ref = torch.cat(parts, 1).float() @ b.float()
            for variant, change in TRIALS:
                cfg = ag_gemm.AgGemmConfig(**dict(change, variant=variant))

                def fn():
                    return ag_gemm.all_gather_matmul(a, b, heap, gather_dim=1, config=cfg, timeout_s=4)
                ag_gemm.prepare(a, b, heap, gather_dim=1, config=cfg)
                tdist.barrier()
                eager = _outcome(heap, fn, ref)
                tdist.barrier()
                graph = _outcome(heap, _graph(fn), ref)
                tdist.barrier()
                failures += ("Timeout" in eager) + ("Timeout" in graph)
                if rank == 0:
                    print(f"W={W} S_K={s_k} {variant} {change}: eager {eager} | graph {graph}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
