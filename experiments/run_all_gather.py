"""All-gather on a multi-GPU node: checks against NCCL, bandwidth against SM count, hints,
tiles, and the NVLink peer copy bandwidth, in one command.

    python experiments/run_all_gather.py --world-sizes 2,4 --out results/all_gather
    python experiments/run_all_gather.py --world-sizes 8 --out results/all_gather   # an 8-GPU node

Each world size is one torchrun world (`workbench.dist.launch`) running this
file with ``--worker``: one process per GPU, NVLink multicast off. The parent
merges the rows, adds provenance and writes ``bw.csv`` (one row per timed
point), ``peer.csv`` (NVLink copy), ``checks.csv`` (bit-for-bit against NCCL)
and ``summary.csv`` (best of ours against NCCL per message; bandwidths there are
the slower of the median call and the whole timed loop), then prints the summary. ``--check-only`` runs only the checks (what the multigpu test uses).
The grid comes from experiments/all_gather.yaml (``--quick``: its quick set, 2, 8
and 32 MiB per rank). ``--timeout`` bounds each world: a rank that hangs ends its
world, not the run, and the launch error names the step it hung in (each rank marks
the heap, each check, the clocks' warm-up and each point's variant as its stage). The
exit status is 1 when a world failed or ran past its timeout, or a check differs from
NCCL (the tables written so far stay), so a caller (``notebooks/03_all_gather.ipynb``
measuring afresh) sees the failure.
"""
import argparse
import itertools
import json
import math
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from workbench import dist  # noqa: E402  (sets NVLink multicast off before anything else)
from workbench.dtypes import element_size  # noqa: E402

SPEC = REPO / "experiments" / "all_gather.yaml"
CHECK_SHAPES = [((6, 40), "float16"), ((3, 24), "float32"), ((257, 1000), "bfloat16"), ((1031, 77), "int32"),
                ((128, 8192), "float16")]


# --------------------------------------------------------------------------
# Plan: the spec's studies expanded to points
# --------------------------------------------------------------------------
def load_plan(path: Path, quick: bool) -> dict:
    import yaml

    spec = yaml.safe_load(path.read_text())
    if quick:
        spec.update(spec.get("quick") or {})
    sets = spec["shapes"]
    points = []
    for study in spec["grid"]:
        names = study.get("shapes") or list(sets)
        configs = study.get("configs") or [{}]
        params = study.get("params") or {}
        keys = list(params)
        for name in names:
            for shape in sets[name]:
                for cfg in configs:
                    for values in itertools.product(*(params[k] for k in keys)):
                        p = {"variant": "triton", "num_sms": None, "block_m": None, "block_n": None,
                             "num_warps": None, "hints": True, **cfg, **dict(zip(keys, values))}
                        points.append({"study": study["study"], "M": shape["M"], "N": shape["N"], **p})
    return {"points": points, "dtype": spec.get("dtypes", ["float16"])[0], "seed": spec.get("seed", 0),
            "baselines": spec.get("baselines", [])}


# --------------------------------------------------------------------------
# Worker (one rank)
# --------------------------------------------------------------------------
def _iters(total_bytes: int) -> int:
    return max(5, min(50, int(8e9 / max(total_bytes, 1))))


def run_checks(w, heap, torch, tdist):
    """Every variant against NCCL's all_gather_into_tensor, bit for bit, on odd shapes."""
    from kernels import comm
    from kernels.comm import sweep as agsweep

    rows = []
    for (M, N), dname in CHECK_SHAPES:
        dtype = getattr(torch, dname)
        x = agsweep.shard(M, N, dtype, seed=11, rank=heap.rank, device=heap.device)
        ref = torch.empty((heap.world_size * M, N), dtype=dtype, device=heap.device)
        tdist.all_gather_into_tensor(ref, x)
        runs = [("triton", True), ("gluon", True), ("copy_engine", True)]
        runs += [("triton", False), ("gluon", False)] if M == 257 else []
        for variant, hints in runs:
            w.stage(f"check {variant} {M}x{N} {dname}")
            row = {"kind": "check", "variant": variant, "hints": hints, "M": M, "N": N, "dtype": dname}
            try:
                out = comm.out_buffer(heap, (heap.world_size * M, N), dtype)
                out.view(torch.uint8).fill_(0xFF)  # poison
                heap.barrier()
                got = comm.all_gather(x, heap, variant=variant, hints=hints).clone()
                heap.barrier()  # nobody refills `out` while a peer still reads it
                bad = int((got.view(torch.uint8) != ref.view(torch.uint8)).sum())
                row.update(ok=bad == 0, bytes_differ=bad, error="")
            except Exception as exc:  # noqa: BLE001
                row.update(ok=False, bytes_differ=-1, error=f"{type(exc).__name__}: {exc}"[:500])
                heap.resync_flags()
            rows.append(row)
            w.emit(row)
        w.stage(f"checks {M}x{N} {dname}: done, heap reset")
        heap.reset()
    return rows


def measure_peer(w, heap, torch, tdist, mib: int):
    """One direction of one NVLink pair (rank 0 writes rank 1; the others wait):
    the copy engine (dst.copy_(src) into the peer's heap) and an SM copy kernel."""
    from kernels.comm.remote import put_kernel

    if heap.world_size < 2:
        return
    n = mib << 20
    src = torch.randint(0, 255, (n,), dtype=torch.uint8, device=heap.device)
    dst = heap.alloc((n,), torch.uint8)
    sms = torch.cuda.get_device_properties(heap.device).multi_processor_count
    tdist.barrier()
    if heap.rank == 0:
        peer = heap.peer_view(dst, 1)
        src16 = src.view(torch.float16)
        dst16 = dst.view(torch.float16)
        methods = [("copy_engine", None, lambda: peer.copy_(src))]
        for grid in (sms, 2 * sms):
            methods.append((f"sm_put_{grid}", grid, lambda g=grid: put_kernel[(g,)](
                src16, dst16, src16.numel(), heap.heap_bases, 0, 1, BLOCK=8192, HINT=True, num_warps=8)))
        for name, grid, fn in methods:
            w.stage(f"peer {name}")
            for _ in range(3):
                fn()
            torch.cuda.synchronize()
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(10)]
            for a, b in ev:
                a.record()
                fn()
                b.record()
            torch.cuda.synchronize()
            ts = sorted(a.elapsed_time(b) for a, b in ev)
            ms = ts[len(ts) // 2]
            w.emit({"kind": "peer", "method": name, "grid": grid, "bytes": n, "ms": ms, "q25_ms": ts[2],
                    "q75_ms": ts[7], "gbps": n / (ms * 1e-3) / 1e9, "src_rank": 0, "dst_rank": 1})
        ok = bool(torch.equal(heap.peer_view(dst, 1)[: 1 << 20], src[: 1 << 20]))
        w.emit({"kind": "peer", "method": "check", "ok": ok})
    torch.cuda.synchronize()
    tdist.barrier()
    heap.reset()


def _graph_calls(total_bytes: int) -> tuple[int, int]:
    """(calls per CUDA graph, timed replays) for a message of `total_bytes` gathered bytes."""
    per = max(1, min(20, int(4e8 / max(total_bytes, 1))))
    return per, max(5, min(20, int(4e9 / max(total_bytes * per, 1))))


def run_grid(w, heap, torch, tdist, plan, modes):
    from kernels import comm
    from kernels.comm import sweep as agsweep

    W, rank = heap.world_size, heap.rank
    dtype = getattr(torch, plan["dtype"])
    esize = element_size(dtype)
    sms_here = torch.cuda.get_device_properties(heap.device).multi_processor_count
    shapes = sorted({(p["M"], p["N"]) for p in plan["points"]}, key=lambda s: s[0] * s[1])
    # bring the clocks up before the first timed point (the GPUs idle at a few hundred MHz)
    M, N = shapes[-1]
    warm_x = torch.randn((M, N), device=heap.device).to(dtype)
    warm_out = torch.empty((W * M, N), dtype=dtype, device=heap.device)
    # for about 0.5 s; every rank must make the same number of collectives (a rank that
    # stopped one round early hung the next collective at world size 4), so they agree on
    # whether to go on: the round ends only when every rank's clock says so
    w.stage("clocks up (all-gathers for 0.5 s)")
    t0 = time.time()
    go_on = torch.ones(1, dtype=torch.int32, device=heap.device)
    while True:
        for _ in range(5):
            tdist.all_gather_into_tensor(warm_out, warm_x)
        go_on.fill_(int(time.time() - t0 < 0.5))
        tdist.all_reduce(go_on, op=tdist.ReduceOp.MAX)
        if not int(go_on.item()):
            break
    del warm_x, warm_out
    for mode in modes:  # every eager point first: a failed graph capture cannot cost eager rows
        for M, N in shapes:
            nbytes = M * N * esize
            w.stage(f"{mode} {nbytes >> 20} MiB: inputs")
            x = agsweep.shard(M, N, dtype, seed=plan["seed"], rank=rank, device=heap.device)
            iters = _iters(W * nbytes)
            per, replays = _graph_calls(W * nbytes)
            base = {"kind": "bw", "timing": mode, "M": M, "N": N, "dtype": plan["dtype"], "bytes_per_rank": nbytes,
                    "world_size": W}
            todo = [dict(p, baseline=False) for p in plan["points"] if (p["M"], p["N"]) == (M, N)]
            if "nccl" in plan["baselines"]:
                todo.insert(0, {"study": "baseline", "variant": "nccl", "baseline": True, "num_sms": None,
                                "block_m": None, "block_n": None, "num_warps": None, "hints": None})
            nccl_out = torch.empty((W * M, N), dtype=dtype, device=heap.device)
            for p in todo:
                label = f"{mode} {p['variant']} sms={p['num_sms']} block={p['block_m']}x{p['block_n']} " \
                        f"warps={p['num_warps']} hints={p['hints']}"
                w.stage(f"{nbytes >> 20} MiB {label}")
                row = {**base, **{k: v for k, v in p.items() if k not in ("M", "N")}}
                failed = 0
                try:
                    if p["variant"] == "nccl":
                        def fn():
                            tdist.all_gather_into_tensor(nccl_out, x)
                    else:
                        block = (p["block_m"], p["block_n"]) if p["block_m"] else None
                        kw = dict(variant=p["variant"], num_sms=p["num_sms"], block=block, hints=p["hints"],
                                  num_warps=p["num_warps"], check=False)
                        if p["variant"] in ("triton", "gluon"):
                            cfg = comm.pick_config(M, N, esize, p["variant"], block, p["num_sms"], W, sms_here,
                                                 p["num_warps"])
                            row.update(grid=cfg["grid"], block_m=cfg["BLOCK_M"], block_n=cfg["BLOCK_N"],
                                       vec=cfg["VEC"], num_warps=cfg["num_warps"])

                        def fn():
                            comm.all_gather(x, heap, **kw)
                    if mode == "graph":
                        t = dist.time_collective(fn, warmup=3, iters=replays, graph=per)
                    else:
                        t = dist.time_collective(fn, warmup=max(5, iters // 4), iters=iters)
                    if p["variant"] in ("triton", "gluon"):
                        comm.check_all_gather(heap)
                    alg, bus = comm.bus_bandwidth_gbps(nbytes, W, t["ms"])
                    row.update(ms=t["ms"], q25_ms=t["q25_ms"], q75_ms=t["q75_ms"], loop_ms=t["loop_ms"],
                               slowest_rank=t["slowest_rank"], graph_calls=t["graph"],
                               ms_per_rank=json.dumps([round(v, 5) for v in t["ms_per_rank"]]),
                               iters=t["iters"], algbw_gbps=alg, busbw_gbps=bus,
                               loop_busbw_gbps=comm.bus_bandwidth_gbps(nbytes, W, t["loop_ms"])[1],
                               status="ok", error="")
                except Exception as exc:  # noqa: BLE001 - record, resync, go on
                    failed = 1
                    row.update(status="error", error=f"{type(exc).__name__}: {exc}"[:800])
                    traceback.print_exc()
                # all ranks agree whether this point failed anywhere, then carry on in step
                flag = torch.tensor([failed], device=heap.device)
                tdist.all_reduce(flag)
                if int(flag.item()):
                    heap.resync_flags()
                    if row.get("status") == "ok":
                        row.update(status="peer_error", error="another rank failed this point")
                w.emit(row)
            del nccl_out
            heap.reset()
            torch.cuda.empty_cache()


def worker(args):
    import torch
    import torch.distributed as tdist

    from kernels.comm import sweep as agsweep

    with dist.worker() as w:
        plan = load_plan(Path(args.spec), args.quick)
        W = w.world_size
        dtype = getattr(torch, plan["dtype"])
        biggest = max((p["M"] * p["N"] for p in plan["points"]), default=1) * dtype.itemsize
        heap_bytes = (64 << 20) if args.check_only else max(W * biggest, args.peer_mib << 20) + (16 << 20)
        w.stage("symmetric heap")
        heap = agsweep.process_heap(heap_bytes)
        w.emit({"kind": "info", "heap_bytes": heap_bytes, "heap_bases": [hex(b) for b in heap.heap_bases.tolist()],
                "device": torch.cuda.get_device_name(heap.device),
                "nccl_version": str(torch.cuda.nccl.version()),
                "peer_access": [torch.cuda.can_device_access_peer(heap.device.index, d)
                                for d in range(torch.cuda.device_count()) if d != heap.device.index]})
        run_checks(w, heap, torch, tdist)
        if args.check_only:
            w.stage("done")
            return
        w.stage("peer bandwidth")
        measure_peer(w, heap, torch, tdist, args.peer_mib)
        run_grid(w, heap, torch, tdist, plan, [m for m in args.modes.split(",") if m])
        w.stage("done")


# --------------------------------------------------------------------------
# Parent: one world per size, rows -> CSV with provenance
# --------------------------------------------------------------------------
OURS = ("triton", "gluon", "copy_engine")


def fixed_cost_us(ms: float, nbytes: int, W: int, peer_gbps: float) -> float:
    """What one call costs beyond moving its bytes: the time of a (small) call less
    the time its (W-1) * nbytes outbound bytes take at the peer copy bandwidth."""
    return ms * 1e3 - (W - 1) * nbytes / (peer_gbps * 1e3)


def busbw_bound(nbytes: int, W: int, fixed_us: float, peer_gbps: float) -> float:
    """The highest busBW (GB/s) a call with this fixed cost can show: each GPU sends
    (W-1) * nbytes, no faster than the peer copy bandwidth, after fixed_us."""
    sent = (W - 1) * nbytes
    return sent / (fixed_us * 1e3 + sent / peer_gbps)


def summarize(bw, peer):
    """Best of ours vs NCCL per (world size, message, timing): busBW, ratios, fraction of the NVLink copy."""
    import pandas as pd

    if bw.empty:
        return pd.DataFrame()
    ok = bw[(bw["status"] == "ok") & (bw["rank"] == 0)].copy()
    if "timing" not in ok:
        ok["timing"] = "eager"
    # Conservative bandwidth: the slower of the median call (the seeds' way) and the whole
    # timed loop over its calls (nccl-tests' way); a bimodal point cannot flatter itself.
    loop = ok["loop_busbw_gbps"] if "loop_busbw_gbps" in ok else ok["busbw_gbps"]
    ok["bw"] = ok[["busbw_gbps"]].assign(loop=loop).min(axis=1)
    p = peer.dropna(subset=["gbps"]) if (not peer.empty and "gbps" in peer) else pd.DataFrame()

    def peer_best(W, prefix):
        if p.empty:
            return None
        q = p[(p["world_size"] == W) & p["method"].str.startswith(prefix)]["gbps"]
        return float(q.max()) if len(q) else None

    def n(v):
        return "all" if pd.isna(v) else int(v)

    rows = []
    for (W, nbytes, timing), g in ok.groupby(["world_size", "bytes_per_rank", "timing"]):
        nccl = g[g["variant"] == "nccl"]["bw"].max()
        row = {"world_size": W, "bytes_per_rank": nbytes, "MiB_per_rank": nbytes / 2**20, "timing": timing,
               "nccl_busbw": nccl}
        for v in OURS:
            gv = g[(g["variant"] == v) & (g["hints"].astype(str) == "True")]
            if len(gv):
                best = gv.loc[gv["bw"].idxmax()]
                row[f"{v}_busbw"] = best["bw"]
                if v != "copy_engine":
                    row[f"{v}_best"] = (f"sms={n(best['num_sms'])} block={n(best['block_m'])}x"
                                        f"{n(best['block_n'])} warps={n(best['num_warps'])}")
        sm_best = max(row.get("triton_busbw", 0), row.get("gluon_busbw", 0))
        best_v = max(OURS, key=lambda v: row.get(f"{v}_busbw", 0))
        ours = row.get(f"{best_v}_busbw", math.nan)
        row["best_ours"] = best_v
        row["ratio_vs_nccl"] = ours / nccl if nccl else math.nan
        row["sm_kernels_ratio_vs_nccl"] = sm_best / nccl if nccl else math.nan
        row["peer_copy_gbps"] = peer_best(W, "copy_engine")
        row["frac_of_peer_copy"] = ours / row["peer_copy_gbps"] if row["peer_copy_gbps"] else math.nan
        row["sm_kernels_frac_of_peer_copy"] = sm_best / row["peer_copy_gbps"] if row["peer_copy_gbps"] else math.nan
        row["peer_sm_put_gbps"] = peer_best(W, "sm_put")
        row["ours_ms"] = g[g["variant"].isin(OURS) & (g["hints"].astype(str) == "True")]["ms"].min()
        rows.append(row)
    out = pd.DataFrame(rows)
    # The fixed cost per call, from the smallest message of each world (our fastest variant
    # there), and the busBW it allows at every size even at the full peer bandwidth. Graph
    # replays only: eager calls of small messages are bound by the host's launch cost, which
    # overlaps the GPU's work once messages are large.
    out["fixed_us"] = math.nan
    out["bound_busbw"] = math.nan
    for (W, timing), g in out[out["timing"] == "graph"].groupby(["world_size", "timing"]):
        small = g.loc[g["bytes_per_rank"].idxmin()]
        if not small["peer_copy_gbps"] or pd.isna(small["ours_ms"]):
            continue
        fixed = fixed_cost_us(small["ours_ms"], int(small["bytes_per_rank"]), int(W), small["peer_copy_gbps"])
        out.loc[g.index, "fixed_us"] = fixed
        out.loc[g.index, "bound_busbw"] = [busbw_bound(int(n), int(W), fixed, small["peer_copy_gbps"])
                                           for n in g["bytes_per_rank"]]
    out["bound_frac_of_peer_copy"] = out["bound_busbw"] / out["peer_copy_gbps"]
    return out


def write_tables(all_rows, out: Path):
    import pandas as pd

    df = pd.DataFrame(all_rows)
    written = []
    for kind, name in (("bw", "bw.csv"), ("peer", "peer.csv"), ("check", "checks.csv"), ("info", "info.csv")):
        part = df[df["kind"] == kind].dropna(axis=1, how="all") if "kind" in df else pd.DataFrame()
        if len(part):
            part.to_csv(out / name, index=False)
            written.append(name)
    bw = df[df["kind"] == "bw"] if "kind" in df else pd.DataFrame()
    peer = df[df["kind"] == "peer"] if "kind" in df else pd.DataFrame()
    summary = summarize(bw, peer)
    if len(summary):
        summary.to_csv(out / "summary.csv", index=False)
        written.append("summary.csv")
    return df, bw, peer, summary, written


def parent(args):
    import pandas as pd
    import torch

    from workbench import provenance

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.world_sizes.split(",") if s.strip()]
    have = torch.cuda.device_count()
    all_rows = []
    failed_worlds = []
    for W in sizes:
        if have < W:
            print(f"world size {W}: skipped, this machine has {have} GPU(s)", flush=True)
            continue
        prov = provenance.flat(provenance.collect(world_size=W))
        cmd_args = ["--worker", "--spec", args.spec, "--peer-mib", str(args.peer_mib), "--modes", args.modes]
        cmd_args += ["--quick"] if args.quick else []
        cmd_args += ["--check-only"] if args.check_only else []
        t0 = time.time()
        print(f"world size {W}: launching ...", flush=True)
        run_dir = Path(args.run_dir) / f"w{W}" if args.run_dir else None
        rows, err = dist.launch_rows(Path(__file__), W, cmd_args, timeout_s=args.timeout, run_dir=run_dir)
        if err:
            print(err, flush=True)
            failed_worlds.append(W)
        print(f"world size {W}: {len(rows)} rows in {time.time() - t0:.0f} s", flush=True)
        for r in rows:
            r.setdefault("world_size", W)
            r.update({k: v for k, v in prov.items() if k != "world_size"})
            r["launch_error"] = err[:500]
            r["command"] = " ".join(sys.argv)
        all_rows += rows
        df, bw, peer, summary, written = write_tables(all_rows, out)  # after every world: a kill loses little
    if not all_rows:
        print("no rows")
        return 1
    checks = df[df["kind"] == "check"] if "kind" in df else pd.DataFrame()
    pd.set_option("display.width", 250)
    bad = checks.iloc[:0]
    if len(checks):
        bad = checks[~checks["ok"].astype(bool)]
        print(f"checks: {len(checks) - len(bad)}/{len(checks)} bit-for-bit equal to NCCL")
        if len(bad):
            print(bad[["world_size", "rank", "variant", "hints", "M", "N", "dtype", "bytes_differ", "error"]]
                  .to_string(index=False))
    if len(peer):
        print(peer[[c for c in ("world_size", "method", "grid", "gbps", "ms", "ok") if c in peer]]
              .to_string(index=False))
    if len(bw):
        errs = bw[bw["status"] != "ok"]
        if len(errs):
            print(f"{len(errs)} error rows; first: {errs.iloc[0]['error']}")
        r0 = bw[(bw["rank"] == 0) & (bw["status"] == "ok")].copy()
        r0["num_sms"] = r0["num_sms"].fillna(0).astype(int)
        sm = r0[r0["study"].isin(["sm_scaling", "baseline"])]
        if len(sm):
            piv = sm.pivot_table(index=["timing", "world_size", "bytes_per_rank"], columns=["variant", "num_sms"],
                                 values="busbw_gbps")
            print(piv.round(0).to_string())
        hints = r0[r0["study"] == "hints"]
        if len(hints):
            print(hints.pivot_table(index=["world_size", "bytes_per_rank"], columns=["timing", "variant"],
                                    values="busbw_gbps").round(0).to_string())
    if len(summary):
        cols = ["timing", "world_size", "MiB_per_rank", "nccl_busbw", "triton_busbw", "gluon_busbw",
                "copy_engine_busbw", "best_ours", "ratio_vs_nccl", "sm_kernels_ratio_vs_nccl", "frac_of_peer_copy",
                "sm_kernels_frac_of_peer_copy"]
        print(summary[[c for c in cols if c in summary]].round(3).to_string(index=False))
        print("peer copy GB/s:", summary["peer_copy_gbps"].unique(), "sm put:", summary["peer_sm_put_gbps"].unique())
    print("wrote", ", ".join(written), "to", out)
    # a world that failed or a check that differs from NCCL fails the run (the tables above stay written)
    if failed_worlds:
        print(f"FAILED: world size(s) {', '.join(map(str, failed_worlds))} did not finish (see above)", flush=True)
    if len(bad):
        print(f"FAILED: {len(bad)} check(s) differ from NCCL", flush=True)
    return 1 if failed_worlds or len(bad) else 0


def resummarize(folder: Path) -> int:
    """Recompute summary.csv from a results folder's bw.csv and peer.csv."""
    import pandas as pd

    bw = pd.read_csv(folder / "bw.csv")
    peer = pd.read_csv(folder / "peer.csv") if (folder / "peer.csv").exists() else pd.DataFrame()
    summary = summarize(bw, peer)
    summary.to_csv(folder / "summary.csv", index=False)
    print(summary.drop(columns=[c for c in summary if c.endswith("_best")]).round(3).to_string(index=False))
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world-sizes", default="2,4", help="comma-separated world sizes (default 2,4)")
    ap.add_argument("--out", default=str(REPO / "results" / "all_gather"), help="folder for the CSVs")
    ap.add_argument("--spec", default=str(SPEC), help="experiment spec (default experiments/all_gather.yaml)")
    ap.add_argument("--quick", action="store_true", help="the spec's quick subset")
    ap.add_argument("--check-only", action="store_true", help="only check every variant against NCCL")
    ap.add_argument("--peer-mib", type=int, default=1024, help="MiB copied to measure NVLink (default 1024)")
    ap.add_argument("--timeout", type=float, default=480,
                    help="seconds per world before it is killed (a hang ends that world; the run then exits 1)")
    ap.add_argument("--modes", default="eager,graph",
                    help="timing modes: eager (per-call launches) and/or graph (CUDA-graph replays)")
    ap.add_argument("--run-dir", help="folder for the ranks' heartbeats, rows and logs (default: temporary)")
    ap.add_argument("--summarize", metavar="DIR", help="only recompute DIR/summary.csv from DIR/bw.csv")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.summarize:
        return resummarize(Path(args.summarize))
    if args.worker:
        worker(args)
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
