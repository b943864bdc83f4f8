"""A world of 2 GPUs in which rank 1 is late (run by tests/test_bounded_waits.py through
``workbench.dist.launch``; also by hand:
``python -m torch.distributed.run --nproc-per-node 2 tests/late_peer_world.py --bound 2``).

For each scenario (one family and variant of ours) every rank, after a first call that
compiles:

1. ``late``: rank 1 calls 2 x ``--bound`` later than rank 0; rank 0 must raise after about the
   bound, naming rank 1; rank 1 must raise too (its peer gave up on the call), at once;
2. ``next``: both call again at once: the right result on both, nothing raised;
3. ``half``: rank 1 calls half the bound late: the right result on both.

Each phase is a stage of the rank (a launch timeout names it). Rows: scenario, phase, raised,
error, seconds (from the rank's own call to its result or error), ok (the result within the
dtype's tolerance of an fp32 product of the gathered inputs), library_wait (the sequential
variant's gather ran NCCL, whose wait has NCCL's bound, not ours: the late call then simply
waits and is right).
"""
import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from workbench import dist  # noqa: E402  (NVLink multicast off before anything else)

FAST = ("ag_fused", "ag_copy_engine", "ag_sequential", "all_gather_triton", "all_gather_gluon", "scatter")
SLOW = ("ag_pipelined", "ag_chunked", "ag_fused_resident", "all_gather_copy_engine", "scatter_senders",
        "scatter_split")


def _scenario(name, heap, torch):
    """(call(timeout_s) -> C, check(), reference C in fp32) for one scenario on this rank."""
    import torch.distributed as tdist

    from kernels import ag_gemm, comm
    from kernels import gemm_scatter as gs

    rank, W, dev = heap.rank, heap.world_size, heap.device
    g = torch.Generator(device=dev).manual_seed(100 + rank)
    gb = torch.Generator(device=dev).manual_seed(7)   # the same B on every rank

    def gathered(x):
        out = torch.empty((W * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=dev)
        tdist.all_gather_into_tensor(out, x.contiguous())
        return out

    if name.startswith("ag_"):
        variant = name[3:].replace("_resident", "")
        a = torch.randn(1024, 2048, generator=g, device=dev).to(torch.bfloat16)
        if name.endswith("_resident"):   # the shard in the heap: peers read it in place
            a = heap.alloc(a.shape, a.dtype).copy_(a)
        b = torch.randn(2048, 1024, generator=gb, device=dev).to(torch.bfloat16)
        from kernels.ag_gemm.config import PIPELINED

        cfg = ag_gemm.AgGemmConfig(**PIPELINED) if variant == "pipelined" else ag_gemm.AgGemmConfig(variant=variant)
        ref = gathered(a).float() @ b.float()     # gathered along M
        return (lambda t: ag_gemm.all_gather_matmul(a, b, heap, gather_dim=0, config=cfg, timeout_s=t),
                lambda: ag_gemm.check(heap), ref)
    if name.startswith("all_gather_"):
        x = torch.randn(512, 4096, generator=g, device=dev).to(torch.bfloat16)
        variant = name[len("all_gather_"):]
        return (lambda t: comm.all_gather(x, heap, variant=variant, timeout_s=t).clone(),
                lambda: comm.check_all_gather(heap), gathered(x).float())
    a = torch.randn(96 if name == "scatter_split" else 2048, 4096, generator=gb, device=dev).to(torch.bfloat16)
    b_local = torch.randn(4096, 1024, generator=g, device=dev).to(torch.bfloat16)
    cfg = {"scatter": gs.ScatterConfig(), "scatter_senders": gs.ScatterConfig(variant="senders"),
           "scatter_split": gs.ScatterConfig(block_m=64, block_n=128, split_k=4, num_warps=4)}[name]
    ref = a.float() @ gathered(b_local.t().contiguous()).float().t()   # [B_0 | B_1] = [B_0^T; B_1^T]^T
    return (lambda t: gs.gemm_all_scatter(a, b_local, heap, config=cfg, timeout_s=t).clone(),
            lambda: gs.check_gemm_all_scatter(heap), ref)


def _phase(w, torch, heap, name, phase, call, check, ref, bound, delay):
    import torch.distributed as tdist

    from kernels.comm.waits import WaitTimeout

    w.stage(f"{name}: {phase}")
    tdist.barrier()
    if heap.rank == 1 and delay:
        time.sleep(delay)
    t0 = time.monotonic()
    err, ok = "", False
    try:
        c = call(bound)
        check()
        ok = bool(torch.isfinite(c).all()) and bool(((c.float() - ref).abs() <= 2e-2 * ref.abs() + 0.5).all())
    except WaitTimeout as exc:
        err = str(exc)
    took = time.monotonic() - t0
    torch.cuda.synchronize()
    # the sequential variant gathers with our all-gather's auto choice: NCCL's wait is not ours to bound
    library = name == "ag_sequential" and heap.cache("all_gather").get("last variant") == "nccl"
    w.emit({"scenario": name, "phase": phase, "raised": bool(err), "error": err[:600], "seconds": took, "ok": ok,
            "bound": bound, "library_wait": library})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bound", type=float, default=2.0)
    ap.add_argument("--scenarios", default=",".join(FAST))
    args = ap.parse_args()
    import torch

    with dist.worker() as w:
        w.stage("symmetric heap")
        heap = dist.SymmetricHeap(256 << 20)
        for name in args.scenarios.split(","):
            w.stage(f"{name}: inputs and first call")
            call, check, ref = _scenario(name, heap, torch)
            call(60.0)
            check()
            torch.cuda.synchronize()
            for phase, delay in (("late", 2 * args.bound), ("next", 0.0), ("half", args.bound / 2)):
                _phase(w, torch, heap, name, phase, call, check, ref, args.bound, delay)
            heap.reset()


if __name__ == "__main__":
    main()
