"""Probe: the warp-specialised Gluon GEMM's variants against cuBLAS and the Triton GEMM on the goal shapes.

kernels.gemm.gluon on one GPU, bf16, the 8 goal shapes (run 9a of results/gemm_tiling/README.md).

    PYTHONUNBUFFERED=1 python experiments/probes/probe_gemm_ws.py --out results/gemm_tiling/probe

1. Every ``matmul_ws`` variant first runs in a child process, with a time limit
   (``--child-timeout``): compile, then every shape against an fp32 reference
   into NaN-poisoned output. A warp-specialised kernel with a synchronisation
   bug hangs the GPU instead of failing, and only a child can be killed then.
   Variants that hung are dropped for every shape, ones that failed on a shape
   are dropped for that shape; checks.json says why.
2. In this process, per shape: fresh inputs, the relative error of every
   callable (NaN-poisoned ``out``), then ``workbench.bench.interleave`` times
   cuBLAS (torch.matmul), kernels.gemm.matmul (its heuristic) and the surviving
   variants run by run in turn, with an L2 flush before each run. A watchdog
   (faulthandler) ends the process if one shape takes longer than ``--hang-s``.

Written under --out: probe.csv (one row per shape x variant: median_ms, q25_ms,
q75_ms, tflops, speed_vs_cublas = cuBLAS time / this time, rel_err, status,
error), checks.json, meta.json; rows are appended shape by shape, so a run cut
short keeps what it measured.
"""
from __future__ import annotations

import argparse
import csv
import faulthandler
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from workbench.child import run_records  # noqa: E402

SHAPES = [(8192, 8192, 8192), (4096, 4096, 4096), (1024, 4096, 14336), (4096, 14336, 4096),
          (16384, 3584, 8192), (2048, 7168, 2048), (512, 4096, 7168), (8192, 28672, 8192)]

# name -> WsConfig fields (defaults: ping-pong 128x128x64, 4 stages, GROUP_M 8, 232/40 registers)
VARIANTS = {
    "ws-128x128x64-s4": {},
    "ws-128x128x64-s3": dict(num_stages=3),
    "ws-128x128x64-s5": dict(num_stages=5),
    "ws-64x256x64-s4": dict(block_m=64, block_n=256),
    "ws-128x128x64-s4-r240/24": dict(consumer_regs=240, producer_regs=24),
    "coop-128x256x64-s3": dict(cooperative=True, block_n=256, num_stages=3),
    "coop-256x128x64-s3": dict(cooperative=True, block_m=256, num_stages=3),
    "coop-128x256x32-s6": dict(cooperative=True, block_n=256, block_k=32, num_stages=6),
}

FIELDS = ["M", "N", "K", "dtype", "variant", "config", "median_ms", "q25_ms", "q75_ms", "tflops",
          "speed_vs_cublas", "rel_err", "status", "error"]

# The child: compile one variant and check it on every shape; one JSON line per
# shape on stdout (flushed), so a parent that kills it knows how far it got.
_CHILD = """
import json, sys, time
import torch
sys.path.insert(0, {root!r})
from kernels import gemm
from kernels.gemm import sweep as gsweep
cfg = gemm.WsConfig(**json.loads(sys.argv[1]))
for i, (M, N, K) in enumerate(json.loads(sys.argv[2])):
    t0 = time.perf_counter()
    g = torch.Generator(device="cuda").manual_seed(100 + i)
    a = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(K, N, device="cuda", generator=g).to(torch.bfloat16)
    c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    rec = {{"shape": [M, N, K]}}
    try:
        gemm.matmul_ws(a, b, config=cfg, out=c)
        torch.cuda.synchronize()
        ref = gemm.reference(a, b)
        rec["rel_err"] = float((c.float() - ref).norm() / ref.norm())
        rec["finite"] = bool(torch.isfinite(c).all())
        rec["ok"] = rec["finite"] and rec["rel_err"] < gsweep.tolerance(torch.bfloat16)
    except Exception as exc:
        rec["ok"] = False
        rec["error"] = f"{{type(exc).__name__}}: {{exc}}"[:500]
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(rec), flush=True)
    del a, b, c
"""


def check_variant(fields: dict, shapes, timeout_s: float) -> dict:
    """Run the child for one variant; {'hung': bool, 'error': str|None, 'shapes': {MxNxK: record}}."""
    child = run_records(_CHILD.format(root=str(ROOT)), [json.dumps(fields), json.dumps(shapes)], timeout_s, ROOT)
    res = {"hung": child.hung, "error": child.error,
           "shapes": {"x".join(map(str, rec["shape"])): rec for rec in child.records}}
    if res["hung"]:
        done = len(res["shapes"])
        nxt = "x".join(map(str, shapes[done])) if done < len(shapes) else "exit"
        res["error"] = f"no exit within {timeout_s:.0f} s (hang?) while on {nxt}, after {done} shape(s)"
    return res


def _rel_err(fn, out, ref) -> float:
    import torch

    out.fill_(float("nan"))
    fn()
    torch.cuda.synchronize()
    return float((out.float() - ref).norm() / ref.norm())


def probe_shape(M, N, K, variants: dict, checks: dict, args) -> list[dict]:
    """Rows for one shape: cuBLAS, kernels.gemm, and each variant that passed its check."""
    import torch

    from kernels import gemm
    from workbench import bench

    g = torch.Generator(device="cuda").manual_seed(M * 31 + N * 7 + K)
    a = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    b = torch.randn(K, N, device="cuda", generator=g).to(torch.bfloat16)
    out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
    ref = gemm.reference(a, b)
    key = f"{M}x{N}x{K}"
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count

    fns = {"cublas": (lambda: torch.matmul(a, b, out=out)),
           "triton-heuristic": (lambda: gemm.matmul(a, b, out=out))}
    labels = {"cublas": "torch.matmul", "triton-heuristic": gemm.heuristic(M, N, K, torch.bfloat16, sms).label()}
    rows = {}
    for name, fields in variants.items():
        cfg = gemm.WsConfig(**fields)
        labels[name] = cfg.label()
        chk = checks[name]
        rec = chk["shapes"].get(key, {})
        if chk["hung"] or not rec.get("ok"):
            why = chk["error"] if chk["hung"] or key not in chk["shapes"] else rec.get("error") or (
                f"wrong result in the child check (rel_err {rec.get('rel_err')}, finite {rec.get('finite')})")
            rows[name] = dict(status="skipped", error=why or "not checked")
            continue
        fns[name] = (lambda cfg=cfg: gemm.matmul_ws(a, b, config=cfg, out=out))

    errs = {}
    for name, fn in list(fns.items()):
        try:
            errs[name] = _rel_err(fn, out, ref)
        except Exception as exc:
            rows[name] = dict(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
            del fns[name]
    timings = bench.interleave(fns, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms)
    base = timings.get("cublas")
    flop = gemm.flops({"M": M, "N": N, "K": K})
    out_rows = []
    for name in ["cublas", "triton-heuristic", *variants]:
        row = dict(M=M, N=N, K=K, dtype="bf16", variant=name, config=labels[name], rel_err=errs.get(name))
        t = timings.get(name)
        if t is not None:
            row.update(median_ms=t.median_ms, q25_ms=t.q25_ms, q75_ms=t.q75_ms, tflops=t.tflops(flop),
                       speed_vs_cublas=base.median_ms / t.median_ms if base else None, status="ok")
        else:
            row.update(rows.get(name, dict(status="error", error="raised in its first timed call")))
        out_rows.append(row)
    return out_rows  # the tensors die with this frame; main empties the allocator cache


def print_table(rows: list[dict]) -> None:
    print(f"{'shape':>20} {'variant':<26} {'ms':>8} {'TFLOP/s':>8} {'vs cuBLAS':>9} {'rel_err':>8}  status")
    for r in rows:
        shape = f"{r['M']}x{r['N']}x{r['K']}"
        ms = f"{r['median_ms']:.4f}" if r.get("median_ms") else "-"
        tf = f"{r['tflops']:.0f}" if r.get("tflops") else "-"
        sp = f"{r['speed_vs_cublas']:.3f}x" if r.get("speed_vs_cublas") else "-"
        er = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-"
        note = r["status"] + (f": {r['error'][:90]}" if r.get("error") else "")
        print(f"{shape:>20} {r['variant']:<26} {ms:>8} {tf:>8} {sp:>9} {er:>8}  {note}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the result files")
    ap.add_argument("--variants", help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--child-timeout", type=float, default=60, help="seconds for one variant's child check")
    ap.add_argument("--hang-s", type=float, default=120, help="watchdog: exit if one shape's timing takes longer")
    ap.add_argument("--warmup-ms", type=float, default=50)
    ap.add_argument("--rep-ms", type=float, default=100)
    args = ap.parse_args(argv)

    import torch
    import triton

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    variants = {k: VARIANTS[k] for k in args.variants.split(",")} if args.variants else dict(VARIANTS)
    t_start = time.perf_counter()
    cap = torch.cuda.get_device_capability()
    meta = dict(device=torch.cuda.get_device_name(), capability=list(cap), torch=torch.__version__,
                triton=triton.__version__, python=sys.version.split()[0], variants=variants,
                shapes=SHAPES)
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    print(json.dumps(meta), flush=True)
    if cap[0] != 9:
        print(f"the Gluon GEMM needs sm_90; this is sm_{cap[0]}{cap[1]}", file=sys.stderr)
        return 2

    # 1. Children: compile and check each variant, killed if they hang.
    checks = {}
    for name, fields in variants.items():
        t0 = time.perf_counter()
        checks[name] = check_variant(fields, SHAPES, args.child_timeout)
        ok = sum(bool(r.get("ok")) for r in checks[name]["shapes"].values())
        print(f"check {name:<26} {ok}/{len(SHAPES)} shapes ok in {time.perf_counter() - t0:.1f} s"
              + (f"  [{checks[name]['error']}]" if checks[name]["error"] else ""), flush=True)
        for rec in checks[name]["shapes"].values():
            if not rec.get("ok"):
                print(f"    {rec}", flush=True)
    (out / "checks.json").write_text(json.dumps(checks, indent=1))

    # 2. Timing, shape by shape, rows appended as they come.
    csv_path = out / "probe.csv"
    all_rows = []
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for M, N, K in SHAPES:
            faulthandler.dump_traceback_later(args.hang_s, exit=True)  # a hang here ends the run
            t0 = time.perf_counter()
            rows = probe_shape(M, N, K, variants, checks, args)
            faulthandler.cancel_dump_traceback_later()
            torch.cuda.empty_cache()
            for r in rows:
                writer.writerow({k: r.get(k) for k in FIELDS})
            f.flush()
            all_rows += rows
            best = max((r for r in rows if r["variant"] in variants and r.get("speed_vs_cublas")),
                       key=lambda r: r["speed_vs_cublas"], default=None)
            tri = next(r for r in rows if r["variant"] == "triton-heuristic")
            print(f"{M}x{N}x{K}: {time.perf_counter() - t0:.1f} s; triton {tri.get('speed_vs_cublas') or 0:.3f}x, "
                  f"best ws {best['variant'] if best else '-'} {best['speed_vs_cublas'] if best else 0:.3f}x cuBLAS",
                  flush=True)
    print()
    print_table(all_rows)
    print(f"\nwrote {csv_path}, {out / 'checks.json'}; {time.perf_counter() - t_start:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
