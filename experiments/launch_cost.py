"""Host time per call of every public launcher, beside the library it is compared with.

    python experiments/launch_cost.py --out results/launch_cost            # one GPU
    torchrun --nproc-per-node 2 experiments/launch_cost.py --out results/launch_cost --comm   # + all_gather

For each case: ``bench.host_time_us`` (median of >= 200 back-to-back calls, no
synchronization in between) of ours and of the library call, then the same
call timed eager and graph-replayed (``bench.interleave``), so a table shows
what a user's Python loop pays and what the GPU alone takes. A bare
``@triton.jit`` launch (one tiny kernel) is the floor every launcher pays.
Rows go to ``OUT/launch_cost.csv`` with provenance.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

# Dense shapes: the goal table's and shapes it was not tuned on (decode-sized M, ragged sizes).
GEMM_SHAPES = [(4096, 4096, 4096), (512, 4096, 7168), (16, 4096, 4096), (128, 8192, 8192),
               (4000, 3000, 2000), (3072, 3072, 3072), (1, 4096, 4096), (2048, 7168, 2048)]
# MoE layers: (experts, tokens, N, K) for fwd; wgrad uses the same.
GROUPED = [(8, 4096, 2880, 2880), (32, 8192, 4096, 7168), (8, 512, 5760, 2880)]
CALLS = 200


@triton.jit
def _noop_kernel(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


def _row(case, impl, host, eager=None, graph=None, **extra):
    r = {"case": case, "impl": impl, "host_us": host["median_us"], "host_q25_us": host["q25_us"],
         "host_q75_us": host["q75_us"], "host_calls": host["calls"]}
    for name, t in (("eager", eager), ("graph", graph)):
        r[f"{name}_ms"] = t.median_ms if t is not None else math.nan
    r.update(extra)
    return r


def _pair(case, ours, lib, lib_name, bench, rows, flops=None):
    """Host time, eager and graph time of ``ours`` and ``lib`` (interleaved)."""
    h = {"ours": bench.host_time_us(ours, calls=CALLS), lib_name: bench.host_time_us(lib, calls=CALLS)}
    fns = {"ours": ours, lib_name: lib}
    eager = bench.interleave(fns, warmup_ms=20, rep_ms=60, mode="eager")
    graph = bench.interleave(fns, warmup_ms=20, rep_ms=60, mode="graph")
    for name in fns:
        rows.append(_row(case, name, h[name], eager.get(name), graph.get(name), flops=flops or math.nan))
    e = eager["ours"].median_ms, eager[lib_name].median_ms
    g = graph["ours"].median_ms, graph[lib_name].median_ms
    print(f"{case:<34} host {h['ours']['median_us']:6.1f} / {h[lib_name]['median_us']:6.1f} us   "
          f"eager {e[1] / e[0]:.3f}x  graph {g[1] / g[0]:.3f}x  ({lib_name} / ours)", flush=True)


def single_gpu(rows, bench) -> None:
    import torch

    from kernels import gemm

    x = torch.randn(1 << 12, device="cuda")
    _noop_kernel[(4,)](x, x.numel(), BLOCK=1024)
    rows.append(_row("bare triton launch", "triton", bench.host_time_us(
        lambda: _noop_kernel[(4,)](x, x.numel(), BLOCK=1024), calls=CALLS)))
    a = torch.randn(256, 256, device="cuda")
    rows.append(_row("torch.mm 256^3", "torch", bench.host_time_us(lambda: torch.mm(a, a), calls=CALLS)))
    print(f"bare triton launch {rows[-2]['host_us']:.1f} us, torch.mm {rows[-1]['host_us']:.1f} us", flush=True)

    for M, N, K in GEMM_SHAPES:
        g = torch.Generator(device="cuda").manual_seed(M + N + K)
        A = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        B = torch.randn(K, N, device="cuda", generator=g).bfloat16()
        C = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        gemm.matmul(A, B, out=C)
        ref = gemm.reference(A, B)
        err = float((C.float() - ref).norm() / ref.norm())
        assert err < 1e-2, f"matmul {M}x{N}x{K}: rel err {err}"
        _pair(f"matmul {M}x{N}x{K}", lambda: gemm.matmul(A, B), lambda: torch.mm(A, B), "torch.mm", bench, rows,
              2 * M * N * K)
    _grouped(rows, bench)


def _grouped(rows, bench) -> None:
    import torch

    from kernels import moe
    from kernels.moe import baselines as mb, routing

    for G, T, N, K in GROUPED:
        g = torch.Generator(device="cuda").manual_seed(G + T)
        sizes = routing.mild(T, G, seed=G, device="cuda")
        offs = mb.grouped_mm_offsets(sizes)   # a library user computes these once per routing too
        x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
        w = torch.randn(G, K, N, device="cuda", generator=g).bfloat16()
        dy = torch.randn(T, N, device="cuda", generator=g).bfloat16()
        moe.grouped_gemm(x, w, sizes)
        moe.grouped_gemm_wgrad(x, dy, sizes)
        _pair(f"grouped_gemm G{G} T{T} {N}x{K}", lambda: moe.grouped_gemm(x, w, sizes),
              lambda: mb.grouped_mm("fwd", x, w, sizes, offs=offs), "torch._grouped_mm", bench, rows, 2 * T * N * K)
        _pair(f"grouped_gemm_wgrad G{G} T{T} {N}x{K}", lambda: moe.grouped_gemm_wgrad(x, dy, sizes),
              lambda: mb.grouped_mm("wgrad", x, dy, sizes, offs=offs), "torch._grouped_mm", bench, rows, 2 * T * N * K)


def breakdown(rows, bench) -> None:
    """Where a planned matmul call's host time goes (TMA kernel, 512^3 bf16 so the GPU keeps up)."""
    import torch

    from kernels import gemm
    from kernels.gemm import launch as gl
    from triton.tools.tensor_descriptor import TensorDescriptor as TD

    A = torch.randn(512, 512, device="cuda").bfloat16()
    B = torch.randn(512, 512, device="cuda").bfloat16()
    C = gemm.matmul(A, B)
    p = gl.plan_for(A, B)
    ab, bb, cb = p.blocks
    descs = (TD.from_tensor(A, ab), TD.from_tensor(B, bb), TD.from_tensor(C, cb) if cb else None)
    parts = {
        "whole matmul(a, b)": lambda: gemm.matmul(A, B),
        "matmul(a, b, out=c)": lambda: gemm.matmul(A, B, out=C),
        "plan lookup": lambda: gl.plan_for(A, B),
        "output allocation": lambda: torch.empty((512, 512), device="cuda", dtype=torch.bfloat16),
        "descriptor objects": lambda: [TD.from_tensor(t, blk) for t, blk in ((A, ab), (B, bb), (C, cb)) if blk],
        "launch with ready descriptors": lambda: p.launch(*descs, C, C.stride(0), *p.args, C, C),
        "launch through Triton's JIT": lambda: p.launch.fn[p.launch.grid](*descs, C, C.stride(0), *p.args, C, C,
                                                                            **p.launch.kwargs),
    }
    print(f"breakdown of a planned matmul (512^3 bf16, {p.config.label()}):", flush=True)
    for name, fn in parts.items():
        h = bench.host_time_us(fn, calls=CALLS)
        rows.append(_row(f"breakdown: {name}", "ours", h))
        print(f"  {name:<32} {h['median_us']:6.1f} us", flush=True)


def comm_world(rows, bench) -> None:
    """all_gather at 8 MiB and 32 MiB per rank against NCCL (under torchrun)."""
    import torch
    import torch.distributed as tdist

    from kernels import comm
    from workbench.dist import SymmetricHeap

    W = tdist.get_world_size()
    heap = SymmetricHeap(W * (64 << 20) + (8 << 20))
    for mib in (8, 32):
        x = torch.randn((mib << 20) // 2 // 4096, 4096, device=heap.device).bfloat16()
        out = torch.empty((W * x.shape[0], 4096), device=heap.device, dtype=x.dtype)
        comm.all_gather(x, heap, variant="auto")
        comm.check_all_gather(heap)
        host = {"ours": bench.host_time_us(lambda: comm.all_gather(x, heap, variant="auto"), calls=CALLS),
                "nccl": bench.host_time_us(lambda: tdist.all_gather_into_tensor(out, x), calls=CALLS)}
        comm.check_all_gather(heap)
        if heap.rank == 0:
            for name, h in host.items():
                rows.append(_row(f"all_gather {mib} MiB/rank W{W}", name, h))
            print(f"all_gather {mib} MiB W{W}: host {host['ours']['median_us']:.1f} / "
                  f"{host['nccl']['median_us']:.1f} us", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for launch_cost.csv (e.g. results/launch_cost)")
    ap.add_argument("--comm", action="store_true", help="under torchrun: all_gather vs NCCL (world size >= 2)")
    ap.add_argument("--breakdown", action="store_true", help="only: where a planned matmul call's host time goes")
    args = ap.parse_args(argv)

    import pandas as pd

    from workbench import bench, provenance

    if not bench.gpu_timing_available():
        print("launch_cost: needs a CUDA GPU (H200 or other sm_90), and TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    rows: list[dict] = []
    if args.comm:
        from workbench import dist

        with dist.worker():
            comm_world(rows, bench)
    elif args.breakdown:
        breakdown(rows, bench)
    else:
        single_gpu(rows, bench)
    if rows:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        prov = provenance.flat(provenance.collect())
        df = pd.DataFrame([{**r, **prov} for r in rows])
        name = "launch_cost_comm.csv" if args.comm else "breakdown.csv" if args.breakdown else "launch_cost.csv"
        df.to_csv(out / name, index=False)
        print(f"wrote {out / name} ({len(df)} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
