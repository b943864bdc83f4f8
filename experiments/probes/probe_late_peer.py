"""Where does a rank stand when its peer is later than the wait bound? (2 GPUs)

Each scenario is a world of its own (``workbench.dist.launch``, killed after ``--limit``
seconds): rank 1 sleeps ``--late`` seconds before its call, every call takes the bound
``--bound``; each rank logs, with times, when its call returned on the host, when its
stream drained (an event polled, so a kernel still spinning shows as such), what it
raised, and then makes a second call that must be right. Python stacks of every rank are
dumped every ``--limit / 3`` seconds (faulthandler), so a hang names its line.

    python experiments/probes/probe_late_peer.py --out results/late_peer/
"""
import argparse
import faulthandler
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from workbench import dist  # noqa: E402

SCENARIOS = ("ag_auto", "ag_fused", "ag_copy_engine", "ag_pipelined", "ag_chunked", "ag_sequential",
             "all_gather", "gemm_scatter")


def _log(out: Path, rank: int, t0: float, what: str, **kw) -> None:
    line = json.dumps({"rank": rank, "t": round(time.time() - t0, 3), "what": what, **kw})
    print(line, flush=True)
    with open(out / f"rank{rank}.log", "a") as fh:
        fh.write(line + "\n")


def _drain(out, rank, t0, limit_s):
    """Poll an event until the stream drains (or limit_s passes): the device's own time."""
    import torch

    ev = torch.cuda.Event()
    ev.record()
    start = time.time()
    while not ev.query():
        if time.time() - start > limit_s:
            _log(out, rank, t0, "stream still busy", after_s=round(time.time() - start, 1))
            return False
        time.sleep(0.01)
    _log(out, rank, t0, "stream drained")
    return True


def _call(scenario, heap, rank, W, bound, x):
    import torch

    from kernels import comm, gemm_scatter
    from kernels.ag_gemm import AgGemmConfig, all_gather_matmul

    a, b = x
    if scenario == "all_gather":
        return comm.all_gather(a, heap, timeout_s=bound)
    if scenario == "gemm_scatter":
        return gemm_scatter.gemm_all_scatter(a, b[:, : b.shape[1] // W].contiguous(), heap, timeout_s=bound)
    variant = scenario[3:]
    cfg = None if variant == "auto" else AgGemmConfig(variant=variant)
    return all_gather_matmul(a, b, heap, gather_dim=1, config=cfg, timeout_s=bound)


def _check(scenario):
    from kernels import comm, gemm_scatter
    from kernels import ag_gemm

    return {"all_gather": comm.check_all_gather, "gemm_scatter": gemm_scatter.check_gemm_all_scatter}.get(
        scenario, ag_gemm.check)


def worker(args):
    import torch

    out = Path(args.out) / args.scenario
    out.mkdir(parents=True, exist_ok=True)
    faulthandler.dump_traceback_later(max(5.0, args.limit / 3), repeat=True,
                                      file=open(out / f"stacks{dist.Worker().rank}.txt", "w"))
    with dist.worker() as w:
        rank, W = w.rank, w.world_size
        t0 = time.time()
        heap = dist.SymmetricHeap(256 << 20)
        g = torch.Generator(device="cuda").manual_seed(rank)
        a = torch.randn(1024, 2048, generator=g, device="cuda").to(torch.bfloat16)
        gb = torch.Generator(device="cuda").manual_seed(7)
        b = torch.randn(2048 * W, 1024, generator=gb, device="cuda").to(torch.bfloat16)
        torch.cuda.synchronize()
        torch.distributed.barrier()
        t0 = time.time()
        for attempt in ("late", "next"):
            w.stage(f"{args.scenario} {attempt}")
            if attempt == "late" and rank == 1:
                time.sleep(args.late)
            _log(out, rank, t0, f"{attempt}: call")
            err = ""
            try:
                _call(args.scenario, heap, rank, W, args.bound, (a, b))
                _log(out, rank, t0, f"{attempt}: returned")
                _drain(out, rank, t0, args.limit)
                _check(args.scenario)(heap)
                _log(out, rank, t0, f"{attempt}: checked ok")
            except Exception as exc:  # noqa: BLE001 - the finding
                err = f"{type(exc).__name__}: {exc}"
                _log(out, rank, t0, f"{attempt}: raised", error=err[:600])
            w.emit({"scenario": args.scenario, "attempt": attempt, "error": err[:600], "t": time.time() - t0})
        faulthandler.cancel_dump_traceback_later()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--scenario", help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--bound", type=float, default=2.0)
    ap.add_argument("--late", type=float, default=6.0)
    ap.add_argument("--limit", type=float, default=45.0)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for s in args.scenarios.split(","):
        t = time.time()
        try:
            res = dist.launch(Path(__file__), 2, ["--worker", "--scenario", s, "--out", args.out, "--bound",
                                                  str(args.bound), "--late", str(args.late), "--limit",
                                                  str(args.limit)], timeout_s=args.limit + 40)
            print(f"== {s}: finished in {time.time() - t:.1f} s: {res.rows}", flush=True)
        except Exception as exc:  # noqa: BLE001
            print(f"== {s}: FAILED after {time.time() - t:.1f} s: {str(exc)[:1500]}", flush=True)


if __name__ == "__main__":
    main()
