"""The GEMM shape zoo on one GPU: every candidate configuration and cuBLAS, or the
heuristic against cuBLAS, on every shape of experiments/gemm_shapes.yaml.

    PYTHONUNBUFFERED=1 python experiments/run_gemm_zoo.py --out results/gemm_zoo

Phases (``--phase``, default both):

* ``sweep``: on every bf16 shape, each of ``kernels.gemm.config.candidates`` (the
  configurations the heuristic chooses among) and cuBLAS, checked on NaN-poisoned
  outputs against an fp32 reference, then timed taking turns run by run
  (``workbench.bench.interleave``, L2 flushed before each run), in CUDA-graph
  replays (GPU time alone) and eagerly (as a Python loop calls it). -> sweep.csv
* ``final``: on every shape (bf16, fp16, fp32), ``kernels.gemm.matmul`` with no
  config (the heuristic's choice, as a user calls it), cuBLAS and, with
  ``--best-from`` a sweep.csv, the sweep's fastest candidate, the same way; plus
  the host time per call of ours and cuBLAS's. -> final.csv (``--b-layout t``:
  B K-major, as ``x @ w.t()`` passes an nn.Linear weight -> final_bt.csv)

Also ceilings.json (measured copy bandwidth and cuBLAS bf16/fp16 TFLOP/s). fp32
runs on the tensor cores (tf32) in both ours and cuBLAS (allow_tf32 set for the
baseline; the reference is fp32 with tf32 off). Rows are appended shape by
shape, so an interrupted run keeps what it measured; ``--budget-s`` stops
starting new shapes after that many seconds.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SHAPES = ROOT / "experiments" / "gemm_shapes.yaml"
MAX_SHAPE_READ = 1 << 20  # bytes of the shapes file read at most


def load_shapes(path: Path = SHAPES) -> list[dict]:
    """The zoo's rows, checked (the file is data: never evaluated)."""
    import yaml

    with open(path, "rb") as f:
        text = f.read(MAX_SHAPE_READ + 1)
    if len(text) > MAX_SHAPE_READ:
        raise ValueError(f"{path}: over {MAX_SHAPE_READ} bytes; is this the shapes file?")
    doc = yaml.safe_load(text)
    rows = doc.get("shapes") if isinstance(doc, dict) else None
    if not isinstance(rows, list):
        raise ValueError(f"{path}: expected a mapping with a 'shapes' list")
    out = []
    for i, r in enumerate(rows):
        try:
            M, N, K = (int(r[k]) for k in ("M", "N", "K"))
            dtype, split = str(r["dtype"]), str(r["split"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: shape {i} needs integer M, N, K and dtype, split: {exc}") from None
        if min(M, N, K) < 1 or dtype not in ("bfloat16", "float16", "float32") or split not in ("fit", "held_out"):
            raise ValueError(f"{path}: shape {i} {r!r}: sizes >= 1, dtype bfloat16/float16/float32, "
                             f"split fit/held_out")
        b = str(r.get("b", "row"))
        if b not in ("row", "t"):
            raise ValueError(f"{path}: shape {i} {r!r}: b must be row or t (B a transposed view)")
        out.append({"M": M, "N": N, "K": K, "dtype": dtype, "split": split, "source": str(r.get("source", "")),
                    "b": b})
    return out


def _rel_err(out, ref) -> float:
    import torch

    o = out.float()
    if not torch.isfinite(o).all():
        return math.nan
    return float(torch.linalg.vector_norm(o - ref) / torch.linalg.vector_norm(ref))


def _time_shape(variants: dict, args, bench) -> dict:
    """{mode: {name: Timing}} for graph and eager."""
    res = {}
    for mode in ("graph", "eager"):
        res[mode] = bench.interleave(variants, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, min_reps=10,
                                     max_reps=args.max_reps, mode=mode)
    return res


def run_shapes(shapes: list[dict], phase: str, args, prov, out_csv: Path, best: dict | None = None) -> int:
    import pandas as pd
    import torch

    from kernels import gemm
    from kernels.gemm import config as gconfig, launch as glaunch, sweep as gsweep
    from workbench import bench, provenance

    on_gpu = args.device == "cuda"
    sms = torch.cuda.get_device_properties(0).multi_processor_count if on_gpu else 4
    t_start = time.time()
    done = 0
    for i, s in enumerate(shapes):
        if time.time() - t_start > args.budget_s:
            print(f"{phase}: budget of {args.budget_s:.0f} s spent; {len(shapes) - i} shapes not run", flush=True)
            break
        M, N, K, dt = s["M"], s["N"], s["K"], getattr(torch, s["dtype"])
        inp = gsweep.make_inputs(s, dt, args.device, seed=1000 + i)
        ref = gemm.reference(inp)
        a, b, c = inp.a, inp.b, inp.out
        if args.b_layout == "t":   # the same B K-major: x @ w.t() with an nn.Linear weight w (N, K)
            b = b.t().contiguous().t()
        aligned = on_gpu and glaunch._tma_ok(a) and (glaunch._tma_ok(b) or glaunch._kmajor_ok(b))
        c_aligned = on_gpu and glaunch._tma_ok(c)
        configs = {}
        if phase == "sweep":
            configs = gconfig.candidates(M, N, K, dt, sms, aligned=aligned,
                                         gluon=aligned and c_aligned and args.b_layout == "row",
                                         c_aligned=c_aligned, b_kmajor=args.b_layout == "t")
        else:
            configs["heuristic"] = None
            hit = (best or {}).get((M, N, K, s["dtype"]))
            if hit is not None:
                configs["best"] = hit
        fns = {"cublas": lambda: gemm.cublas(a, b, out=c)}
        fns.update({n: (lambda cfg=cfg: gemm.matmul(a, b, cfg, out=c)) for n, cfg in configs.items()})
        labels = {"cublas": "cuBLAS"}
        status, errs, plan_cfg = {}, {}, {}
        for name, fn in list(fns.items()):
            c.fill_(float("nan"))
            try:
                fn()
                if on_gpu:
                    torch.cuda.synchronize()
                if name != "cublas":
                    plan_cfg[name] = glaunch.plan_for(a, b, configs[name], c).config
                    labels[name] = plan_cfg[name].label()
            except Exception as exc:  # recorded, not timed
                status[name] = f"error: {type(exc).__name__}: {str(exc)[:200]}"
                del fns[name]
                continue
            errs[name] = _rel_err(c, ref)
            if not errs[name] <= gsweep.tolerance(dt):
                status[name] = f"wrong: rel_err {errs[name]:.2e}"
                del fns[name]
            else:
                status[name] = "ok"
        del ref
        timings = _time_shape(fns, args, bench)
        host = {}
        if phase == "final":
            for name in ("heuristic", "cublas"):
                if name in fns:
                    host[name] = bench.host_time_us(fns[name], calls=100, warmup=10)["median_us"]
        flop = 2.0 * M * N * K
        nbytes = gemm.bytes_moved(s, dt)
        rows = []
        for name in list(status):
            for mode in ("graph", "eager"):
                t = timings[mode].get(name)
                cub = timings[mode].get("cublas")
                row = dict(s, phase=phase, b_layout=args.b_layout, variant=name, config=labels.get(name, ""),
                           params=json.dumps(plan_cfg[name].as_params()) if name in plan_cfg else "",
                           status=status[name], rel_err=errs.get(name, math.nan), mode=mode,
                           median_ms=t.median_ms if t else math.nan, q25_ms=t.q25_ms if t else math.nan,
                           q75_ms=t.q75_ms if t else math.nan, n_runs=t.n if t else 0,
                           host_us=t.host_us if t else math.nan,
                           host_per_call_us=host.get(name, math.nan) if mode == "eager" else math.nan,
                           tflops=flop / t.median_ms / 1e9 if t else math.nan,
                           gbps=nbytes / t.median_ms / 1e6 if t else math.nan,
                           ratio_vs_cublas=cub.median_ms / t.median_ms if t and cub else math.nan,
                           cublas_ms=cub.median_ms if cub else math.nan, flop=flop, bytes=nbytes,
                           b_bytes=K * N * dt.itemsize, num_sms=sms)
                row.update(provenance.flat(prov))
                rows.append(row)
        df = pd.DataFrame(rows)
        df.to_csv(out_csv, mode="a", header=not out_csv.exists(), index=False)
        g = timings["graph"]
        ours = {n: g[n].median_ms for n in g if n != "cublas"}
        pick = min(ours, key=ours.get) if ours else "-"
        bad = [f"{n}:{v}" for n, v in status.items() if v != "ok"]
        print(f"[{i + 1}/{len(shapes)} {time.time() - t_start:5.0f}s] {M}x{N}x{K} {s['dtype']} {s['split']:8} "
              f"cuBLAS {g['cublas'].median_ms * 1e3 if 'cublas' in g else math.nan:8.1f} us  "
              + (f"best {pick} {labels.get(pick, '')} x{g['cublas'].median_ms / ours[pick]:.3f}" if ours and
                 'cublas' in g else "")
                + (f"  heuristic x{g['cublas'].median_ms / ours['heuristic']:.3f}" if 'heuristic' in ours else "")
                + (f"  NOT OK: {bad}" if bad else ""), flush=True)
        done += 1
        del inp, a, b, c
        if on_gpu:
            torch.cuda.empty_cache()
    return done


def _best_from(path: Path) -> dict:
    """(M, N, K, dtype) -> the fastest ok candidate of a sweep.csv (graph mode)."""
    import pandas as pd

    import torch

    from kernels.gemm import config as gconfig

    df = pd.read_csv(path)
    ok = df[(df["mode"] == "graph") & (df["status"] == "ok") & (df["variant"] != "cublas")].dropna(subset=["median_ms"])
    best = ok.loc[ok.groupby(["M", "N", "K", "dtype"]).median_ms.idxmin()]
    out = {}
    for r in best.itertuples():  # the candidate as the sweep made it (Gluon rows record the kernel's own config)
        es = getattr(torch, r.dtype).itemsize
        aligned = (r.K * es) % 16 == 0 and (r.N * es) % 16 == 0
        cfg = gconfig.candidates(int(r.M), int(r.N), int(r.K), getattr(torch, r.dtype), int(r.num_sms),
                                 aligned=aligned, gluon=aligned, c_aligned=(r.N * es) % 16 == 0,
                                 b_kmajor=getattr(r, "b_layout", "row") == "t").get(r.variant)
        if cfg is not None:
            out[(int(r.M), int(r.N), int(r.K), r.dtype)] = cfg
    return out


def summary(csv: Path) -> None:
    """The short table: geomean ratios per split and mode."""
    import pandas as pd

    df = pd.read_csv(csv)
    ours = df[(df.variant == "heuristic") & (df.status == "ok")]
    if not len(ours):
        return
    for (split, mode), g in ours.groupby(["split", "mode"]):
        r = g.ratio_vs_cublas.dropna()
        geo = math.exp(r.map(math.log).mean()) if len(r) else math.nan
        print(f"heuristic vs cuBLAS, {split:8} {mode:5}: geomean {geo:.3f}, min {r.min():.3f} "
              f"({len(r)} shapes)", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for sweep.csv, final.csv, ceilings.json")
    ap.add_argument("--phase", choices=("sweep", "final", "both"), default="both")
    ap.add_argument("--shapes", default=str(SHAPES))
    ap.add_argument("--best-from", metavar="CSV", help="final phase: also time each shape's fastest candidate "
                                                       "from this sweep.csv")
    ap.add_argument("--rep-ms", type=float, default=30, help="timed runs per variant and mode, in ms")
    ap.add_argument("--warmup-ms", type=float, default=15)
    ap.add_argument("--max-reps", type=int, default=120)
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new shape after this many seconds "
                                                                "(per phase)")
    ap.add_argument("--b-layout", choices=("row", "t"), default="row",
                    help="B row-major (K, N), or t: K-major, the transposed view of an (N, K) tensor as "
                         "x @ w.t() passes an nn.Linear weight (final phase -> final_bt.csv)")
    ap.add_argument("--host-descriptors", action="store_true",
                    help="the kernels' host-descriptor variants (TMA descriptors encoded by the launcher on "
                         "every call) instead of the default device descriptors (final phase -> final_host.csv)")
    ap.add_argument("--limit", type=int, default=0, help="only the first N shapes (smoke test)")
    ap.add_argument("--dry-run", action="store_true", help="no GPU: three tiny shapes in Triton's interpreter "
                                                          "(TRITON_INTERPRET=1), to test this script")
    args = ap.parse_args(argv)
    args.device = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        return _dry_run(args)

    import torch

    from workbench import bench, provenance, roofline

    if not bench.gpu_timing_available():
        print("run_gemm_zoo: needs a CUDA GPU (sm_90: H100 or H200) and TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = True  # fp32 baseline on the tensor cores, as ours
    if args.host_descriptors:
        from kernels.gemm import launch as glaunch

        glaunch.DEVICE_DESCRIPTORS = glaunch.GLUON_DEVICE_DESCRIPTORS = False
    prov = provenance.collect(knobs={"descriptors": "host" if args.host_descriptors else "device"})
    print(f"device {prov['device_name']}, torch {prov['torch_version']}, triton {prov['triton_version']}, "
          f"git {prov['git_sha']} (dirty={prov['git_dirty']})", flush=True)
    ceil = roofline.measure_ceilings(save=False, rep_ms=100)
    (out / "ceilings.json").write_text(json.dumps(ceil, indent=1, default=str) + "\n")
    print(f"ceilings: copy {ceil['copy_gbps']:.0f} GB/s, cuBLAS bf16 {ceil['bf16_tflops']:.0f} TFLOP/s", flush=True)
    _reserve_workspaces(torch)

    shapes = load_shapes(Path(args.shapes))
    random.Random(0).shuffle(shapes)  # a budget cut leaves a sample of every kind, not the file's tail
    if args.limit:
        shapes = shapes[:args.limit]
    if args.phase in ("sweep", "both"):
        csv = out / "sweep.csv"
        csv.unlink(missing_ok=True)
        n = run_shapes([s for s in shapes if s["dtype"] == "bfloat16"], "sweep", args, prov, csv)
        print(f"sweep: {n} shapes -> {csv}", flush=True)
    if args.phase in ("final", "both"):
        csv = out / ("final" + ("" if args.b_layout == "row" else f"_b{args.b_layout}")
                     + ("_host" if args.host_descriptors else "") + ".csv")
        csv.unlink(missing_ok=True)
        best = _best_from(Path(args.best_from)) if args.best_from else None
        n = run_shapes(shapes, "final", args, prov, csv, best)
        print(f"final: {n} shapes -> {csv}", flush=True)
        summary(csv)
    return 0


def _dry_run(args) -> int:
    from workbench import provenance

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    shapes = [{"M": 5, "N": 40, "K": 48, "dtype": "bfloat16", "split": "fit", "source": "dry"},
              {"M": 70, "N": 33, "K": 20, "dtype": "float32", "split": "held_out", "source": "dry"}]
    args.rep_ms, args.warmup_ms, args.max_reps = 1, 1, 10
    for phase in ("sweep", "final"):
        csv = out / f"{phase}.csv"
        csv.unlink(missing_ok=True)
        run_shapes(shapes[:1] if phase == "sweep" else shapes, phase, args, provenance.collect(), csv,
                   _best_from(out / "sweep.csv") if phase == "final" else None)
    summary(out / "final.csv")
    return 0


def _reserve_workspaces(torch) -> None:
    """Size the split-K/stream-K workspaces up front on this stream and on the one
    CUDA graphs are captured on, so no capture allocates (or zeroes) one."""
    from kernels.gemm import launch as glaunch

    dev = torch.device("cuda", torch.cuda.current_device())
    glaunch.workspace(dev, 32 << 20, 1 << 16)
    torch.cuda.graph(torch.cuda.CUDAGraph())  # creates the default capture stream
    cap = torch.cuda.graphs.graph.default_capture_stream
    if cap is not None:
        with torch.cuda.stream(cap):
            glaunch.workspace(dev, 32 << 20, 1 << 16)
    torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())
