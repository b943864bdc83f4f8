"""Probe: the warp-specialised Gluon grouped GEMM's variants against our Triton kernel and the libraries.

kernels.moe.grouped_gemm_ws on one GPU against our Triton grouped GEMM, the per-expert cuBLAS loop
and torch._grouped_mm, bf16, forward and dgrad, on the seed's MoE layers (run 12 of
results/grouped_gemm/README.md).

    PYTHONUNBUFFERED=1 python experiments/probes/probe_grouped_gemm_ws.py --out results/grouped_gemm/probe [--quick] [--model gpt-oss-20B]

Cases: gpt-oss-20B (B = 4, 32 experts; GateUP N, K = 5760, 2880 and Down 2880, 2880)
and DeepSeek-V3 (B = 16, 32; GateUP 4096, 7168 and Down 7168, 2048), M = 2048 and
4096 tokens per expert, routings balanced / mild / extreme (kernels.moe.routing.make,
seed 1234 + B + M as experiments/run_grouped_gemm.py), ops fwd
(``x [T, K] @ w[g]``, out [T, N]) and dgrad (``dy [T, N] @ w[g].T``, out [T, K],
our kernels with trans_w=True on the stored [G, K, N] weight).

1. Every variant of ``grouped_gemm_ws`` first runs in a child process with a time
   limit (``--child-timeout``): compile, then one case per (model, layer, op) at
   the smallest B and M, mild and extreme routing (empty experts), against an fp32
   reference into NaN-poisoned output. A warp-specialised kernel with a
   synchronisation bug hangs instead of failing, and only a child can be killed.
   A variant that hung is dropped everywhere, one that failed a (model, layer, op)
   is dropped there; checks.json says why.
2. In this process, case by case: the relative error of every backend (ours into
   NaN-poisoned outputs), then ``workbench.bench.interleave`` times them run by run
   in turn (L2 flushed before each run). A watchdog (faulthandler) ends the process
   if one case takes longer than ``--hang-s``.

Written under --out: probe.csv (one row per case x backend: median_ms, q25_ms,
q75_ms, tflops, vs_cublas_loop = cuBLAS-loop time / this time, vs_triton = our
Triton kernel's time / this time, rel_err, status, error), appended case by case
so a run cut short keeps what it measured; checks.json; meta.json. The summary
printed at the end: the geometric mean of vs_triton (and vs_cublas_loop) per
variant, model, layer and op, and the gpt-oss-20B B=4 M=4096 mild rows in full.

About 2-3 minutes on an H200 for the whole grid (96 cases x 7 backends); --quick
keeps the first B and M of each model (24 cases), --model one model.
"""
from __future__ import annotations

import argparse
import csv
import faulthandler
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from workbench.child import run_records  # noqa: E402

MODELS = {
    "gpt-oss-20B": {"B": [4, 32], "M": [2048, 4096], "layers": {"GateUP": (5760, 2880), "Down": (2880, 2880)}},
    "DeepSeek-V3": {"B": [16, 32], "M": [2048, 4096], "layers": {"GateUP": (4096, 7168), "Down": (7168, 2048)}},
}
ROUTINGS = ("balanced", "mild", "extreme")
OPS = ("fwd", "dgrad")
SEED = 1234

# name -> GroupedWsConfig fields (defaults: ping-pong 128x128x64, 5 stages, GROUP_M 8, 232/40 registers)
VARIANTS = {
    "ws-s5": {},
    "ws-s4": dict(num_stages=4),
    "coop-128x256-s3": dict(cooperative=True, block_n=256, num_stages=3),
    "coop-256x128-s3": dict(cooperative=True, block_m=256, num_stages=3),
}
BASELINES = ("cublas_loop", "grouped_mm", "triton")

FIELDS = ["model", "layer", "B", "M", "tokens", "N", "K", "op", "routing", "backend", "config",
          "median_ms", "q25_ms", "q75_ms", "tflops", "vs_cublas_loop", "vs_triton", "rel_err", "status", "error"]

# The child: compile one variant and check it on every check case; one JSON line
# per case on stdout (flushed), so a parent that kills it knows how far it got.
_CHILD = """
import json, math, sys, time
import torch
sys.path.insert(0, {root!r})
from kernels.moe import GroupedWsConfig, grouped_gemm_ws, routing as rt
from kernels.moe.reference import reference, tolerance
cfg = GroupedWsConfig(**json.loads(sys.argv[1]))
for i, (model, layer, B, M, N, K, routing, op) in enumerate(json.loads(sys.argv[2])):
    t0 = time.perf_counter()
    rec = {{"case": [model, layer, B, M, routing, op]}}
    try:
        T = B * M
        g = torch.Generator(device="cuda").manual_seed(100 + i)
        w = (torch.randn(B, K, N, device="cuda", generator=g) / math.sqrt(K)).to(torch.bfloat16)
        a = torch.randn(T, N if op == "dgrad" else K, device="cuda", generator=g).to(torch.bfloat16)
        s = rt.make(routing, T, B, seed={seed} + B + M, device="cuda")
        out = torch.full((T, K if op == "dgrad" else N), float("nan"), device="cuda", dtype=torch.bfloat16)
        grouped_gemm_ws(a, w, s, trans_w=(op == "dgrad"), config=cfg, out=out)
        torch.cuda.synchronize()
        ref = reference(a, w, s, trans_w=(op == "dgrad"), dtype=torch.float32)
        rec["finite"] = bool(torch.isfinite(out).all())
        rec["rel_err"] = float((out.float() - ref).norm() / ref.norm())
        rec["ok"] = rec["finite"] and rec["rel_err"] < tolerance(torch.bfloat16)
        del a, w, out, ref
    except Exception as exc:
        rec["ok"] = False
        rec["error"] = f"{{type(exc).__name__}}: {{exc}}"[:500]
    rec["seconds"] = round(time.perf_counter() - t0, 2)
    print(json.dumps(rec), flush=True)
"""


def log(*a):
    print(*a, flush=True)


def cases(models, quick: bool):
    """(model, layer, B, M, N, K) problems, each run under every routing and op."""
    for model in models:
        spec = MODELS[model]
        for B in spec["B"][:1] if quick else spec["B"]:
            for M in spec["M"][:1] if quick else spec["M"]:
                for layer, (N, K) in spec["layers"].items():
                    yield model, layer, B, M, N, K


def check_cases(models, ops):
    out = []
    for model in models:
        spec = MODELS[model]
        for layer, (N, K) in spec["layers"].items():
            for op in ops:
                for routing in ("mild", "extreme"):
                    out.append([model, layer, spec["B"][0], spec["M"][0], N, K, routing, op])
    return out


def _check_key(model, layer, op) -> str:
    return f"{model}/{layer}/{op}"


def check_variant(fields: dict, check: list, timeout_s: float) -> dict:
    """Run the child for one variant: {'hung', 'error', 'cases': {model/layer/op: [records]}}."""
    child = run_records(_CHILD.format(root=str(ROOT), seed=SEED), [json.dumps(fields), json.dumps(check)],
                        timeout_s, ROOT)
    res = {"hung": child.hung, "error": child.error, "cases": {}}
    for rec in child.records:
        model, layer, B, M, routing, op = rec["case"]
        res["cases"].setdefault(_check_key(model, layer, op), []).append(rec)
    done = len(child.records)
    if res["hung"]:
        nxt = check[done] if done < len(check) else "exit"
        res["error"] = f"no exit within {timeout_s:.0f} s (hang?) while on {nxt}, after {done} case(s)"
    return res


def variant_ok(chk: dict, model, layer, op, n_expected: int) -> tuple[bool, str | None]:
    if chk["hung"]:
        return False, chk["error"]
    recs = chk["cases"].get(_check_key(model, layer, op), [])
    if len(recs) < n_expected:
        return False, chk["error"] or "not checked"
    bad = [r for r in recs if not r.get("ok")]
    if bad:
        r = bad[0]
        return False, r.get("error") or f"wrong result in the child check (rel_err {r.get('rel_err')}, " \
                                        f"finite {r.get('finite')}, case {r['case']})"
    return True, None


class Problem:
    """Inputs for one (model, layer, B, M): x [T, K], w [B, K, N], dy [T, N], bf16
    (seeded as experiments/run_grouped_gemm.py)."""

    def __init__(self, B, M, N, K):
        import torch

        from kernels.moe import routing as rt
        from kernels.moe.baselines import grouped_mm_offsets

        self.B, self.T, self.N, self.K = B, B * M, N, K
        g = torch.Generator(device="cuda").manual_seed(SEED + B * 7 + M + N + K)
        self.x = torch.randn(self.T, K, device="cuda", dtype=torch.bfloat16, generator=g)
        self.w = (torch.randn(B, K, N, device="cuda", generator=g) / math.sqrt(K)).to(torch.bfloat16)
        self.dy = torch.randn(self.T, N, device="cuda", dtype=torch.bfloat16, generator=g)
        self.sizes = {}
        for r in ROUTINGS:
            s = rt.make(r, self.T, B, seed=SEED + B + M, device="cuda")
            self.sizes[r] = (s, grouped_mm_offsets(s), [int(v) for v in s.tolist()])

    def operand(self, op):
        return self.dy if op == "dgrad" else self.x

    def out_width(self, op):
        return self.K if op == "dgrad" else self.N


def _rel_err(out, ref) -> float:
    out = out.float()
    if not bool((out == out).all()):  # NaN left: some tile never written
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def probe_case(p: Problem, model, layer, M, routing, op, variants, checks, n_check, args) -> list[dict]:
    """Rows for one case: the baselines and each variant that passed its check."""
    import torch

    from kernels import moe
    from kernels.moe import autotune as ga
    from kernels.moe.reference import reference, tolerance
    from workbench import bench

    s, offs, host = p.sizes[routing]
    a = p.operand(op)
    trans = op == "dgrad"
    out = torch.empty(p.T, p.out_width(op), device="cuda", dtype=torch.bfloat16)
    fns = {
        "cublas_loop": lambda: ga.run_backend("cublas_loop", op, a, p.w, s, host_sizes=host),
        "grouped_mm": lambda: ga.run_backend("grouped_mm", op, a, p.w, s, offs=offs),
        "triton": lambda: moe.grouped_gemm(a, p.w, s, trans_w=trans, out=out),
    }
    labels = {"cublas_loop": "torch.mm per expert", "grouped_mm": "torch._grouped_mm",
              "triton": moe.pick_config(op, p.out_width(op), p.N if trans else p.K, a.device).label()}
    rows = {}
    for name, fields in variants.items():
        cfg = moe.GroupedWsConfig(**fields)
        labels[name] = cfg.label()
        ok, why = variant_ok(checks[name], model, layer, op, n_check)
        if not ok:
            rows[name] = dict(status="skipped", error=why)
            continue
        fns[name] = (lambda cfg=cfg: moe.grouped_gemm_ws(a, p.w, s, trans_w=trans, config=cfg, out=out))

    ref = reference(a, p.w, s, trans_w=trans, dtype=torch.float32)
    errs = {}
    for name, fn in list(fns.items()):
        try:
            out.fill_(float("nan"))
            res = fn()
            torch.cuda.synchronize()
            errs[name] = _rel_err(res, ref)
            del res
        except Exception as exc:
            rows[name] = dict(status="error", error=f"{type(exc).__name__}: {exc}"[:500])
            del fns[name]
    del ref
    timings = bench.interleave(fns, warmup_ms=args.warmup_ms, rep_ms=args.rep_ms, min_reps=args.min_reps,
                               max_reps=args.max_reps)
    flop = moe.flops(p.T, p.N, p.K)
    base = timings.get("cublas_loop")
    tri = timings.get("triton")
    out_rows = []
    for name in [*BASELINES, *variants]:
        row = dict(model=model, layer=layer, B=p.B, M=M, tokens=p.T, N=p.N, K=p.K, op=op, routing=routing,
                   backend=name, config=labels.get(name), rel_err=errs.get(name))
        t = timings.get(name)
        if t is not None:
            row.update(median_ms=t.median_ms, q25_ms=t.q25_ms, q75_ms=t.q75_ms, tflops=t.tflops(flop),
                       vs_cublas_loop=base.median_ms / t.median_ms if base else None,
                       vs_triton=tri.median_ms / t.median_ms if tri else None, status="ok")
            tol = tolerance(torch.bfloat16)
            if errs.get(name) is not None and not errs[name] < tol:
                row.update(status="wrong", error=f"rel_err {errs[name]:.3g} over {tol}")
        else:
            row.update(rows.get(name, dict(status="error", error="raised in its first timed call")))
        out_rows.append(row)
    return out_rows


def gmean(v):
    v = [x for x in v if x and x > 0 and math.isfinite(x)]
    return math.exp(sum(math.log(x) for x in v) / len(v)) if v else float("nan")


def print_summary(rows: list[dict], variants) -> None:
    ok = [r for r in rows if r["status"] == "ok"]
    log("\nGeomean speed of each backend vs our Triton kernel (triton time / its time; > 1: faster) "
        "and vs the cuBLAS loop, per model, layer and op:")
    backends = ["cublas_loop", "grouped_mm", *variants]
    head = f"{'model':<12} {'layer':<7} {'op':<6} {'n':>3}  " + "  ".join(f"{b:>17}" for b in backends)
    log(head)
    keys = sorted({(r["model"], r["layer"], r["op"]) for r in ok})
    for key in keys:
        sel = [r for r in ok if (r["model"], r["layer"], r["op"]) == key]
        cells = []
        for b in backends:
            vt = gmean([r["vs_triton"] for r in sel if r["backend"] == b])
            vc = gmean([r["vs_cublas_loop"] for r in sel if r["backend"] == b])
            cells.append(f"{vt:7.3f} /{vc:6.3f}cb")
        n = len({(r["B"], r["M"], r["routing"]) for r in sel})
        log(f"{key[0]:<12} {key[1]:<7} {key[2]:<6} {n:>3}  " + "  ".join(f"{c:>17}" for c in cells))
    for b in backends:
        log(f"  {b:<17} overall vs triton {gmean([r['vs_triton'] for r in ok if r['backend'] == b]):.3f}, "
            f"vs cuBLAS loop {gmean([r['vs_cublas_loop'] for r in ok if r['backend'] == b]):.3f}")
    full = []
    for M in (4096, 2048):  # --quick has M = 2048 only
        full = full or [r for r in rows if r["model"] == "gpt-oss-20B" and r["B"] == 4 and r["M"] == M
                        and r["routing"] == "mild"]
    if full:
        log(f"\ngpt-oss-20B B=4 M={full[0]['M']} mild, every row:")
        log(f"{'layer':<7} {'op':<6} {'backend':<16} {'config':<28} {'ms':>8} {'q25':>8} {'q75':>8} {'TFLOP/s':>8} "
            f"{'vs cb':>6} {'vs tri':>6} {'rel_err':>8}  status")
        for r in full:
            def f(k, fmt):
                return format(r[k], fmt) if r.get(k) is not None else "-"
            log(f"{r['layer']:<7} {r['op']:<6} {r['backend']:<16} {str(r['config'])[:28]:<28} {f('median_ms', '8.4f')} "
                f"{f('q25_ms', '8.4f')} {f('q75_ms', '8.4f')} {f('tflops', '8.1f')} {f('vs_cublas_loop', '6.3f')} "
                f"{f('vs_triton', '6.3f')} {f('rel_err', '8.1e')}  {r['status']}"
                + (f": {r['error'][:80]}" if r.get("error") else ""))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for the result files")
    ap.add_argument("--model", choices=list(MODELS), action="append", help="only this model (repeatable)")
    ap.add_argument("--quick", action="store_true", help="first B and M of each model only")
    ap.add_argument("--ops", default="fwd,dgrad", help="comma-separated subset of fwd,dgrad")
    ap.add_argument("--routings", default=",".join(ROUTINGS), help="comma-separated subset of the routings")
    ap.add_argument("--variants", help=f"comma-separated subset of {', '.join(VARIANTS)}")
    ap.add_argument("--child-timeout", type=float, default=120, help="seconds for one variant's child check")
    ap.add_argument("--hang-s", type=float, default=120, help="watchdog: exit if one case takes longer")
    ap.add_argument("--warmup-ms", type=float, default=20)
    ap.add_argument("--rep-ms", type=float, default=60)
    ap.add_argument("--min-reps", type=int, default=10)
    ap.add_argument("--max-reps", type=int, default=60)
    args = ap.parse_args(argv)

    import torch
    import triton

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    models = args.model or list(MODELS)
    ops = [o for o in args.ops.split(",") if o]
    routings = [r for r in args.routings.split(",") if r]
    variants = {k: VARIANTS[k] for k in args.variants.split(",")} if args.variants else dict(VARIANTS)
    t_start = time.perf_counter()
    cap = torch.cuda.get_device_capability()
    meta = dict(device=torch.cuda.get_device_name(), capability=list(cap), torch=torch.__version__,
                triton=triton.__version__, python=sys.version.split()[0], variants=variants, models=models,
                ops=ops, routings=routings, quick=args.quick, argv=sys.argv[1:])
    (out_dir / "meta.json").write_text(json.dumps(meta, indent=1))
    log(json.dumps(meta))
    if cap[0] != 9:
        print(f"kernels.moe.grouped_gemm_ws needs sm_90; this is sm_{cap[0]}{cap[1]}", file=sys.stderr)
        return 2

    # 1. Children: compile and check each variant, killed if they hang.
    check = check_cases(models, ops)
    n_check = 2  # records per (model, layer, op): mild and extreme
    checks = {}
    for name, fields in variants.items():
        t0 = time.perf_counter()
        checks[name] = check_variant(fields, check, args.child_timeout)
        recs = [r for rs in checks[name]["cases"].values() for r in rs]
        log(f"check {name:<17} {sum(bool(r.get('ok')) for r in recs)}/{len(check)} ok in "
            f"{time.perf_counter() - t0:.1f} s" + (f"  [{checks[name]['error']}]" if checks[name]["error"] else ""))
        for r in recs:
            if not r.get("ok"):
                log(f"    {r}")
    (out_dir / "checks.json").write_text(json.dumps(checks, indent=1))

    # 2. Timing, case by case, rows appended as they come.
    csv_path = out_dir / "probe.csv"
    all_rows = []
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=FIELDS)
        writer.writeheader()
        for model, layer, B, M, N, K in cases(models, args.quick):
            p = Problem(B, M, N, K)
            for routing in routings:
                for op in ops:
                    faulthandler.dump_traceback_later(args.hang_s, exit=True)  # a hang here ends the run
                    t0 = time.perf_counter()
                    rows = probe_case(p, model, layer, M, routing, op, variants, checks, n_check, args)
                    faulthandler.cancel_dump_traceback_later()
                    for r in rows:
                        writer.writerow({k: r.get(k) for k in FIELDS})
                    f.flush()
                    all_rows += rows
                    by = {r["backend"]: r for r in rows}
                    cells = " ".join(f"{b}={by[b]['vs_triton']:.3f}" if by[b].get("vs_triton") else f"{b}=-"
                                     for b in ["cublas_loop", "grouped_mm", *variants])
                    log(f"{model} {layer} B={B} M={M} {routing:<8} {op:<5} {time.perf_counter() - t0:5.1f} s  "
                        f"vs triton: {cells}")
            del p
            torch.cuda.empty_cache()
    print_summary(all_rows, variants)
    log(f"\nwrote {csv_path}, {out_dir / 'checks.json'}; {time.perf_counter() - t_start:.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
