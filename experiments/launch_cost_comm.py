"""Host time per call of every multi-rank launcher variant, beside the library calls it
replaces, all timed the same way (``experiments/launch_cost.py --comm`` runs this under
torchrun; one process per GPU):

    torchrun --nproc-per-node 2 experiments/launch_cost.py --comm --out results/launch_cost/comm_w2

Each case is a problem; each impl one way to solve it: every variant of ours by name
(``config=...``), ``auto`` (``config=None``: what rank 0's decision picks), and the library
calls a user would otherwise write, with their buffers made once (as a tuned loop would):

* ``all_gather`` (8 and 32 MiB per rank): variants triton, gluon, copy_engine, auto;
  ``nccl`` = ``all_gather_into_tensor`` into a preallocated tensor.
* ``all_gather_matmul`` (1024 and 4096 x 3584 x 8192, both gather dims): fused,
  copy_engine, chunked, pipelined, sequential, nccl (the launcher's library path), auto;
  ``nccl+cublas`` = ``baselines.NcclCublas`` (all_gather_into_tensor, the re-layout for
  the K convention, cuBLAS), ``torch_fused`` = ``fused_all_gather_matmul``.
* ``gemm_all_scatter`` (16 and 1024 x 4096 x 4096): fused, senders, nccl, sequential, auto;
  ``cublas+nccl`` = ``torch.mm`` into a buffer, ``all_gather_into_tensor``, the permute
  into C (``baselines.column_blocks``).
* ``torch.mm`` on a small problem: this host's pace for one library launch.

``host_us``: ``workbench.bench.host_time_us`` (median of CALLS back-to-back calls, no
synchronization in between; every rank runs the same calls, so the peers' waits are met);
``vs_library``: host_us over the library call's (the goal: at most 1.3). ``--breakdown``
adds the parts of one ``chunked`` and one ``pipelined`` call (each part timed alone, 200
times), so a table says where a call's host time goes.

``comm_cases`` builds the same calls on a simulated world's heap (``--dry-run`` of
``tests/test_launch_cost.py``): every variant is wired and runs, without timing anything.
"""
from __future__ import annotations

import itertools
from typing import Callable

AG_SHAPES = ((1024, 3584, 8192), (4096, 3584, 8192))
SCATTER_SHAPES = ((16, 4096, 4096), (1024, 4096, 4096))
AG_VARIANTS = ("fused", "copy_engine", "chunked", "pipelined", "sequential", "nccl")
SCATTER_VARIANTS = ("fused", "senders", "nccl", "sequential")
GOAL = 1.3   # host time per call at most this many times the library's



def _ag_config(variant: str, simulated_config=None):
    """A variant's configuration as the launcher runs it by default (the pipelined variant's own
    tile: ``kernels.ag_gemm.config.PIPELINED``), or the simulated world's small one."""
    from kernels.ag_gemm.config import PIPELINED, AgGemmConfig

    if simulated_config is not None:
        return simulated_config.replace(variant=variant)
    return AgGemmConfig(**PIPELINED) if variant == "pipelined" else AgGemmConfig(variant=variant)

def comm_cases(heap, *, dtype=None, sizes=None, simulated_config=None) -> dict[str, tuple[str, dict[str, Callable]]]:
    """{case: (library impl name, {impl: call})} for one rank. ``sizes`` shrinks the problems
    (a simulated world: ``{"ag": [...], "scatter": [...], "gather_rows": [...]}``);
    ``simulated_config`` gives the tiles that the interpreter can run."""
    import torch

    from kernels import ag_gemm, comm, gemm_scatter
    from kernels.ag_gemm.baselines import NcclCublas, TorchFused, torch_fused_available

    dtype = dtype or torch.bfloat16
    dev, W, sim = heap.device, heap.world_size, heap.simulated
    if not sim:
        import torch.distributed as tdist
    g = torch.Generator(device=dev).manual_seed(heap.rank)
    cases = {}
    sizes = sizes or {}
    for rows in sizes.get("gather_rows", ((8 << 20) // 2 // 4096, (32 << 20) // 2 // 4096)):
        x = torch.randn(rows, 4096 if not sim else 24, generator=g, device=dev).to(dtype)
        impls = {v: (lambda v=v, x=x: comm.all_gather(x, heap, variant=v)) for v in
                 (("triton", "gluon", "copy_engine", "auto") if not sim else ("triton", "copy_engine"))}
        if not sim:
            flat = torch.empty((W * x.shape[0], x.shape[1]), device=dev, dtype=dtype)
            impls["nccl"] = lambda x=x, flat=flat: tdist.all_gather_into_tensor(flat, x, group=heap.group)
        cases[f"all_gather {x.numel() * x.element_size() >> 20} MiB/rank W{W}"] = ("nccl", impls)
    for (M, N, K), gd in itertools.product(sizes.get("ag", AG_SHAPES), (1, 0)):
        shard = (M, K // W) if gd == 1 else (M // W, K)
        a = torch.randn(*shard, generator=g, device=dev).to(dtype)
        b = torch.randn(K, N, generator=torch.Generator(device=dev).manual_seed(7), device=dev).to(dtype)
        impls = {}
        for v in AG_VARIANTS + ("auto",):
            cfg = None if v == "auto" else _ag_config(v, simulated_config)
            if v == "auto" and sim:
                continue
            ag_gemm.prepare(a, b, heap, gather_dim=gd, config=cfg)
            impls[v] = (lambda cfg=cfg, a=a, b=b, gd=gd: ag_gemm.all_gather_matmul(a, b, heap, gather_dim=gd,
                                                                                  config=cfg))
        if not sim:
            nccl = NcclCublas(a, W, gd, group=heap.group)
            impls["nccl+cublas"] = lambda nccl=nccl, a=a, b=b: nccl(a, b)
            if torch_fused_available():
                tf = TorchFused(heap.group.group_name, gd)
                impls["torch_fused"] = lambda tf=tf, a=a, b=b: tf(a, b)
        cases[f"all_gather_matmul {M}x{N}x{K} gather_dim={gd} W{W}"] = ("nccl+cublas", impls)
    for M, N, K in sizes.get("scatter", SCATTER_SHAPES):
        a = torch.randn(M, K, generator=torch.Generator(device=dev).manual_seed(3), device=dev).to(dtype)
        b = torch.randn(K, N // W, generator=g, device=dev).to(dtype)
        impls = {}
        for v in SCATTER_VARIANTS + ("auto",):
            if v == "auto" and sim:
                continue
            cfg = None if v == "auto" else scatter_config(v, M, N // W, K, W, sim)
            impls[v] = (lambda cfg=cfg, a=a, b=b: gemm_scatter.gemm_all_scatter(a, b, heap, config=cfg))
        if not sim:
            c_loc = torch.empty(M, N // W, device=dev, dtype=dtype)
            gathered = torch.empty(W * M, N // W, device=dev, dtype=dtype)
            c = torch.empty(M, N, device=dev, dtype=dtype)

            def lib(a=a, b=b, c_loc=c_loc, gathered=gathered, c=c):
                torch.mm(a, b, out=c_loc)
                tdist.all_gather_into_tensor(gathered, c_loc, group=heap.group)
                gemm_scatter.column_blocks(gathered, W, c)
            impls["cublas+nccl"] = lib
            impls["torch.mm"] = lambda a=a, b=b, c_loc=c_loc: torch.mm(a, b, out=c_loc)
        cases[f"gemm_all_scatter {M}x{N}x{K} W{W}"] = ("cublas+nccl", impls)
    return cases


def scatter_config(variant: str, M: int, n_local: int, K: int, W: int, sim: bool):
    """gemm_all_scatter's configuration for ``variant``: the tile rule's tiles (the fused kernel
    keeps the rule's small-M split pieces; the senders run the persistent kernel), or the
    interpreter's small tiles in a simulated world."""
    import dataclasses

    from kernels import gemm_scatter

    if sim:
        return gemm_scatter.ScatterConfig(block_m=16, block_n=16, block_k=16, num_warps=2, num_stages=2, num_sms=5,
                                          group_m=2, senders=2, variant=variant)
    rule = gemm_scatter.heuristic(M, n_local, K)
    if variant == "fused":
        return rule
    return dataclasses.replace(rule, variant=variant, split_k=1, swap_ab=False)


def measure(rows: list, bench, calls: int, breakdown: bool = False) -> None:
    """Every case of ``comm_cases`` on this rank's GPU heap, host time per call, rank 0's rows."""
    import torch.distributed as tdist

    from kernels import ag_gemm, comm, gemm_scatter
    from workbench.dist import SymmetricHeap

    W = tdist.get_world_size()
    heap = SymmetricHeap(W * (96 << 20) + (192 << 20))
    for case, (lib, impls) in comm_cases(heap).items():
        tdist.barrier()
        host = {}
        for name, fn in impls.items():
            fn()   # plans made, kernels compiled and the decision shared before timing
            tdist.barrier()
            host[name] = bench.host_time_us(fn, calls=calls)
            tdist.barrier()
        for check in (comm.check_all_gather, ag_gemm.check, gemm_scatter.check_gemm_all_scatter):
            check(heap)
        if heap.rank == 0:
            ref = host[lib]["median_us"] if lib in host else float("nan")
            for name, h in host.items():
                rows.append({"case": case, "impl": name, "host_us": h["median_us"], "host_q25_us": h["q25_us"],
                             "host_q75_us": h["q75_us"], "host_calls": h["calls"], "library": lib,
                             "vs_library": h["median_us"] / ref, "within_goal": h["median_us"] <= GOAL * ref})
            print(f"{case}: host us " + " / ".join(f"{k} {h['median_us']:.1f}" for k, h in host.items()),
                  flush=True)
        heap.reset()
    if breakdown:
        _breakdown(rows, bench, heap, calls)


def _breakdown(rows, bench, heap, calls) -> None:
    """The parts of one chunked and one pipelined call (1024x3584x8192, gathered along M), each
    timed alone: what the whole call's host time is made of."""
    import torch
    import torch.distributed as tdist

    from kernels import ag_gemm
    from kernels.ag_gemm import copies
    from kernels.ag_gemm.launch import _args, _shared, get_plan
    from kernels.comm.clock import timeout_us

    W = heap.world_size
    a = torch.randn(1024 // W, 8192, device=heap.device).bfloat16()
    b = torch.randn(8192, 3584, device=heap.device).bfloat16()
    for variant in ("chunked", "pipelined"):
        cfg = _ag_config(variant)
        ag_gemm.prepare(a, b, heap, gather_dim=0, config=cfg)
        ag_gemm.all_gather_matmul(a, b, heap, gather_dim=0, config=cfg)
        plan, s = get_plan(a, b, heap, gather_dim=0, config=cfg), _shared(heap)
        c = torch.empty(plan.out_shape, device=heap.device, dtype=a.dtype)
        args = _args(a, b, heap, plan, None, c, s, timeout_us())
        cur = torch.cuda.current_stream()
        dst, src = plan.chunks[0][1:3] if variant == "chunked" else plan.chunks[0][:2]

        def side_cycle():
            plan.side.fork(cur)
            plan.side.leave(cur)
            plan.side.join(cur)

        parts = {"whole call": lambda: ag_gemm.all_gather_matmul(a, b, heap, gather_dim=0, config=cfg),
                 "plan lookup": lambda: get_plan(a, b, heap, gather_dim=0, config=cfg),
                 "output allocation": lambda: torch.empty(plan.out_shape, device=heap.device, dtype=a.dtype),
                 "argument tuple": lambda: _args(a, b, heap, plan, None, c, s, timeout_us()),
                 "publish kernel launch": lambda: copies.publish(heap, plan, args, (0, c.stride(0))),
                 "side stream fork + leave + join": side_cycle,
                 "one peer copy (cudaMemcpyAsync)": lambda: dst.copy_(src, non_blocking=True),
                 "status watch poll + arm": lambda: (s["watch"].poll(), s["watch"].arm())}
        if variant == "chunked":
            ev = plan.events[0]
            parts.update({"one event record + wait": lambda: (ev.record(), cur.wait_event(ev)),
                          "finish kernel launch": lambda: copies.finish(heap, plan, s, timeout_us()),
                          "one cuBLAS product into C's rows": lambda: torch.mm(a, b, out=c[:a.shape[0]])})
        else:   # (its GEMM kernel's launch costs what the publish kernel's does: the same kernel and arguments)
            sig, val = plan.chunks[0][2:4]
            parts["one signal copy"] = lambda: sig.copy_(val, non_blocking=True)
        for name, fn in parts.items():
            tdist.barrier()
            h = bench.host_time_us(fn, calls=calls)
            if heap.rank == 0:
                rows.append({"case": f"breakdown {variant} 1024x3584x8192 gather_dim=0 W{W}", "impl": name,
                             "host_us": h["median_us"], "host_q25_us": h["q25_us"], "host_q75_us": h["q75_us"],
                             "host_calls": h["calls"]})
                print(f"  {variant}: {name:<36} {h['median_us']:7.1f} us", flush=True)
        torch.cuda.synchronize()
        tdist.barrier()
        ag_gemm.recover(heap)   # the parts timed alone leave the flags out of step: start afresh
    heap.reset()
