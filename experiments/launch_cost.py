"""Host time per call of every public launcher, beside the library it is compared with.

    python experiments/launch_cost.py --out results/launch_cost            # one GPU (MXFP4 MoE routing included)
    python experiments/launch_cost.py --out results/launch_cost --paths 12 # every GEMM config path, held-out shapes
    torchrun --nproc-per-node 2 experiments/launch_cost.py --out results/launch_cost/comm_w2 --comm [--breakdown]
        # every variant of the multi-rank launchers beside the library calls (experiments/launch_cost_comm.py)
    python experiments/launch_cost.py --out results/launch_cost --breakdown-mxfp4  # an MXFP4 MoE call, part by part
    python experiments/launch_cost.py --out DIR --descriptors              # host vs device TMA descriptors
    python experiments/launch_cost.py --out DIR --descriptors --only gluon # the Gluon kernels' rows alone
    python experiments/launch_cost.py --out DIR --descriptors --dry-run    # its CPU part (interpreter)

For each case: ``bench.host_time_us`` (median of >= 200 back-to-back calls, no
synchronization in between) of ours and of the library call, then the same
call timed eager and graph-replayed (``bench.interleave``), so a table shows
what a user's Python loop pays and what the GPU alone takes. A bare
``@triton.jit`` launch (one tiny kernel) is the floor every launcher pays.
Rows go to ``OUT/launch_cost.csv`` with provenance.

``--descriptors`` compares, in one process, the Triton kernels' two ways of
getting their TMA descriptors (``kernels.gemm.launch.DEVICE_DESCRIPTORS``,
``kernels.moe.launch.DEVICE_DESCRIPTORS``): ``host`` (a ``TensorDescriptor``
per operand, encoded by Triton's launcher on every call) and ``device`` (the
kernel encodes them into the launcher's scratch buffer), beside ``torch.mm``
/ ``torch._grouped_mm``. Per shape: both variants checked against a float64
reference on NaN-poisoned outputs, host time per call (median of 200), and
eager and graph-replayed time taken in turns (a kernel that got slower from
building its descriptors shows in ``graph_ms``). Shapes: this script's, the
GEMM goal table's (``experiments/run_gemm_tiling.py``) and small M. Shapes the
plan sends to the Gluon kernel (host descriptors in both variants) are also
run with the Triton kernel forced. Files: ``descriptors.csv`` (timings),
``descriptors_check.csv`` (errors), ``descriptors_log.txt``; rewritten after
every shape, so a run cut short keeps what it measured. ``--budget-s``: no new
shape after that many seconds.

The Gluon rows compare the same two ways for the Gluon kernels, under their own
switches (``kernels.gemm.launch.GLUON_DEVICE_DESCRIPTORS``,
``kernels.moe.launch.GLUON_DEVICE_DESCRIPTORS``; the Triton ones stay as they
are): ``matmul`` on the shapes the plan sends to the Gluon kernel
(``GLUON_SHAPES``; a shape it does not send there is logged and skipped) and
``grouped_gemm`` fwd and dgrad on its default path (the Gluon kernel), each
``host`` (three Gluon ``TensorDescriptor`` per call) against ``device``
(``_gemm_ws_dev_kernel`` / ``_grouped_gemm_ws_dev_kernel``) beside ``torch.mm`` /
``torch._grouped_mm``, with the same checks and timings, and a breakdown of
one Gluon call's host time. ``--only gluon`` runs these alone (files
``descriptors_gluon*``), ``--only triton`` the rest; the default runs both.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--dry-run" in sys.argv:   # the CPU check runs the kernels in Triton's interpreter: set before triton loads
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)

# Dense shapes: the goal table's and shapes it was not tuned on (decode-sized M, ragged sizes).
GEMM_SHAPES = [(4096, 4096, 4096), (512, 4096, 7168), (16, 4096, 4096), (128, 8192, 8192),
               (4000, 3000, 2000), (3072, 3072, 3072), (1, 4096, 4096), (2048, 7168, 2048)]
# MoE layers: (experts, tokens, N, K) for fwd; wgrad uses the same.
GROUPED = [(8, 4096, 2880, 2880), (32, 8192, 4096, 7168), (8, 512, 5760, 2880)]
# MXFP4 MoE down-projection layers (name, experts, H, I, top-k) and token counts: a user's loop with
# the routing prepared in the call (one launch) against the routing by torch ops (before issue 42)
MOE_MXFP4 = [("gpt-oss-120b", 128, 2880, 2880, 4, (1, 16, 64, 256)), ("kimi-k2.5", 385, 7168, 512, 9, (4, 16, 64, 256))]
# Shapes the matmul plan sends to the Gluon kernel on an H200 (results/launch_cost/descriptors).
GLUON_SHAPES = [(4096, 4096, 4096), (3072, 3072, 3072), (2048, 7168, 2048), (4096, 14336, 4096),
                (8192, 28672, 8192)]
CALLS = 200
PATH_CALLS = 300   # --paths: the host-time goal of issue 43 is read on medians of at least 300 calls


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
    _moe_mxfp4(rows, bench)


def config_paths(rows, bench, n_shapes: int, calls: int = PATH_CALLS) -> None:
    """Every config path of ``matmul`` (each candidate of ``kernels.gemm.select.candidates``: persistent
    TMA, stream-K, tail slices, split-K / swap-AB, Gluon, padded operands, the library) and the
    selection's own choice (tables, as users call it), host time per call (median of ``calls``)
    beside ``torch.mm``, on the first ``n_shapes`` held-out zoo shapes (16-bit, at most 50 GFLOP);
    each row names its plan's kind (``kind``: library, tma, splitk, gluon, ...; ``padded``: operands
    copied first); then a profile of the slowest path's calls. ``paths_summary.md``
    (``experiments/gemm_selection_report.paths_summary``): per path, the ratio to ``torch.mm``
    against the goal (library 1.1x, ours 1.2x)."""
    import cProfile
    import pstats

    import torch

    from experiments.run_gemm_zoo import load_shapes
    from kernels.gemm import launch as glaunch, select as gselect, tuning as gtuning

    # Held-out shapes short enough that 200 queued calls cost the GPU little (at most 50 GFLOP each).
    shapes = [s for s in load_shapes() if s["split"] == "held_out" and s["dtype"] in ("bfloat16", "float16")
              and 2 * s["M"] * s["N"] * s["K"] <= 50e9][:n_shapes]
    worst = (0.0, None, "")
    for i, s in enumerate(shapes):
        s = gtuning.shape_of(s)
        A, B = gtuning.operands(s, "cuda", seed=i)
        M, K = A.shape
        N = B.shape[1]
        call = glaunch._call(A, B, None, M, N, K, False, False)
        cfgs = {f"{name} [{cand.variant}]": cand.config for name, cand in gselect.candidates(call).items()}
        # each function keeps this shape's operands (the slowest one is called again after the loop)
        fns = {"torch.mm": lambda A=A, B=B: torch.mm(A, B),
               "matmul (selected)": lambda A=A, B=B: glaunch.matmul(A, B)}
        fns.update({name: (lambda cfg=cfg, A=A, B=B: glaunch.matmul(A, B, cfg)) for name, cfg in cfgs.items()})
        base = None
        for name, fn in fns.items():
            try:
                fn()
                torch.cuda.synchronize()
            except Exception as exc:   # a path this shape cannot take
                print(f"  {M}x{N}x{K} {name}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)
                continue
            h = bench.host_time_us(fn, calls=calls, warmup=10)
            base = h["median_us"] if name == "torch.mm" else base
            ratio = h["median_us"] / base if base else math.nan
            p = glaunch.plan_for(A, B, cfgs.get(name)) if name != "torch.mm" else None
            rows.append(_row(f"paths {M}x{N}x{K}", name, h, ratio_vs_torch_mm=ratio, dtype=s["dtype"], b=s["b"],
                             kind=p.kind if p is not None else "torch.mm",
                             padded=bool(p is not None and (p.pad_a or p.pad_b))))
            if name != "torch.mm" and ratio > worst[0]:
                worst = (ratio, fn, f"{M}x{N}x{K} {name}")
        line = ", ".join(f"{r['impl'].split(' ')[0]} {r['host_us']:.0f}" for r in rows if r["case"] == f"paths {M}x{N}x{K}")
        print(f"paths {M}x{N}x{K} (host us per call): {line}", flush=True)
    if worst[1] is not None:
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(200):
            worst[1]()
        prof.disable()
        torch.cuda.synchronize()
        print(f"profile of the slowest path ({worst[2]}: {worst[0]:.2f}x torch.mm), 200 calls:", flush=True)
        pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def write_paths_summary(df, out: Path) -> str:
    """``paths_summary.md`` and ``.csv``: per config path, host time per call over ``torch.mm``'s."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gemm_selection_report as rep

    summ = rep.paths_summary(df)
    summ.to_csv(out / "paths_summary.csv", index=False)
    dev = ", ".join(map(str, df.device_name.dropna().unique())) if "device_name" in df else ""
    text = (f"# Host time per call of each GEMM config path, beside torch.mm ({dev})\n\n"
            f"Median of {int(df.host_calls.min())}+ back-to-back calls per path and shape "
            f"(`experiments/launch_cost.py --paths`); ratio: the path's median over torch.mm's on the same shape. "
            f"Goal: the library path within {rep.HOST_LIBRARY}x, ours within {rep.HOST_OURS}x.\n\n"
            + rep._table(summ) + "\n")
    (out / "paths_summary.md").write_text(text)
    return text


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


def _moe_mxfp4(rows, bench) -> None:
    """MXFP4 down-projection (prepared weights, level 2): host time of ``prepare_routing`` and of the
    torch ops it replaced, then a user's loop, ``moe_mxfp4_down(a, weights, (topk_ids, topk_weights))``
    (the routing prepared in the call) against the same call on a routing by torch ops."""
    import torch

    from kernels.moe_mxfp4 import block_m_for, moe_mxfp4_down, prepare_routing, prepare_weights, quantize_mxfp4
    from kernels.moe_mxfp4.routing import torch_routing

    for name, E, H, I, top_k, ms in MOE_MXFP4:
        g = torch.Generator(device="cuda").manual_seed(E)
        w = torch.empty(E, H, I // 2, dtype=torch.uint8, device="cuda")
        ws = torch.empty(E, H, I // 32, dtype=torch.uint8, device="cuda")
        for e0 in range(0, E, 16):
            w[e0:e0 + 16], ws[e0:e0 + 16] = quantize_mxfp4(
                torch.randn(min(16, E - e0), H, I, device="cuda", generator=g) * 0.02)
        weights = prepare_weights(w, ws, 2)
        for M in ms:
            ids = torch.rand(M, E, device="cuda", generator=g).topk(top_k, dim=1).indices.int()
            wts = torch.softmax(torch.randn(M, top_k, device="cuda", generator=g), -1)
            a = torch.randn(M * top_k, I, device="cuda", generator=g).bfloat16()
            bm = block_m_for(M, top_k, E)
            ref = moe_mxfp4_down(a, weights, torch_routing(ids, wts, E, bm)).float()
            err = float((moe_mxfp4_down(a, weights, (ids, wts)).float() - ref).norm() / ref.norm())
            assert err < 1e-2, f"moe_mxfp4_down {name} M={M}: rel err {err} against the torch routing's"
            for impl, fn in (("ours", lambda: prepare_routing(ids, wts, E, bm)),
                             ("torch ops", lambda: torch_routing(ids, wts, E, bm))):
                rows.append(_row(f"moe_mxfp4 {name} M{M}: routing preparation", impl,
                                 bench.host_time_us(fn, calls=CALLS)))
            _pair(f"moe_mxfp4 {name} M{M}: user loop", lambda: moe_mxfp4_down(a, weights, (ids, wts)),
                  lambda: moe_mxfp4_down(a, weights, torch_routing(ids, wts, E, bm)), "torch routing", bench, rows)
        del w, ws, weights
        torch.cuda.empty_cache()


def breakdown_mxfp4(rows, bench, device: str = "cuda") -> None:
    """Where a user's MXFP4 down-projection call's host time goes, ``moe_mxfp4_down(a, weights, (ids, wts))``:
    the routing's plan lookup, its one allocation and views, its launch, the down-projection's plan lookup,
    the output's zeroing and its launch, each alone, beside the whole call and a bare Triton launch."""
    import torch

    from kernels.moe_mxfp4 import block_m_for, moe_mxfp4_down, prepare_routing, prepare_weights, quantize_mxfp4
    from kernels.moe_mxfp4 import routing as mrouting
    from kernels.moe_mxfp4.launch import plan_for
    from kernels.moe_mxfp4.plan import execute, unwrap_weights

    x = torch.randn(1 << 12, device=device)
    _noop_kernel[(4,)](x, x.numel(), BLOCK=1024)
    floor = bench.host_time_us(lambda: _noop_kernel[(4,)](x, x.numel(), BLOCK=1024), calls=CALLS)
    rows.append(_row("breakdown mxfp4: bare triton launch", "triton", floor))
    print(f"bare triton launch {floor['median_us']:6.1f} us", flush=True)
    for name, E, H, I, top_k, ms in MOE_MXFP4:
        g = torch.Generator(device=device).manual_seed(E)
        # the weights' values do not change the host's work: small random codes, one expert's scales repeated
        w, ws = quantize_mxfp4(torch.randn(1, H, I, device=device, generator=g) * 0.02)
        weights = prepare_weights(w.expand(E, -1, -1).contiguous(), ws.expand(E, -1, -1).contiguous(), 2)
        for M in ms[:2]:
            ids = torch.rand(M, E, device=device, generator=g).topk(top_k, dim=1).indices.int()
            wts = torch.softmax(torch.randn(M, top_k, device=device, generator=g), -1)
            a = torch.randn(M * top_k, I, device=device, generator=g).bfloat16()
            bm = block_m_for(M, top_k, E)
            routing = prepare_routing(ids, wts, E, bm)
            rkey = (mrouting.tensor_signature(ids), mrouting.tensor_signature(wts), E, bm, 0)   # prepare_routing's
            rplan = mrouting._PLANS.get(rkey)
            bufs = torch.empty(rplan.total, dtype=torch.int32, device=rplan.device).split_with_sizes(rplan.sizes)
            w_, ws_, _, _, _, _ = unwrap_weights(weights, routing, None)
            plan = plan_for(a, weights, routing)
            out = moe_mxfp4_down(a, weights, routing)
            parts = {
                "whole call, router's ids and weights": lambda: moe_mxfp4_down(a, weights, (ids, wts)),
                "whole call, prepared routing": lambda: moe_mxfp4_down(a, weights, routing),
                "prepare_routing": lambda: prepare_routing(ids, wts, E, bm),
                "routing: plan lookup": lambda: mrouting._PLANS.get(
                    (mrouting.tensor_signature(ids), mrouting.tensor_signature(wts), E, bm, 0)),
                "routing: one allocation and its views": lambda: torch.empty(
                    rplan.total, dtype=torch.int32, device=rplan.device).split_with_sizes(rplan.sizes),
                "routing: launch": lambda: rplan.launch(ids, wts, bufs[0], bufs[1].view(torch.float32), bufs[2],
                                                        bufs[6], bufs[4], rplan.n, rplan.E, rplan.rows,
                                                        rplan.blocks, ids.stride(0), ids.stride(1),
                                                        wts.stride(0), wts.stride(1), bufs[0], 0, 0),
                "down: plan lookup": lambda: plan_for(a, weights, routing),
                "down: output zeroed": lambda: torch.zeros((M, H), dtype=torch.bfloat16, device=device),
                "down: launch (output given, accumulated)": lambda: execute(plan, a, None, w_, ws_, routing, out,
                                                                           True),
            }
            print(f"{name} M={M}:", flush=True)
            for part, fn in parts.items():
                h = bench.host_time_us(fn, calls=CALLS)
                rows.append(_row(f"breakdown mxfp4 {name} M{M}: {part}", "ours", h))
                print(f"  {part:<40} {h['median_us']:6.1f} us", flush=True)
        del w, ws, weights
        torch.cuda.empty_cache()


def breakdown(rows, bench) -> None:
    """Where a planned matmul call's host time goes (TMA kernel, 512^3 bf16 so the GPU keeps up)."""
    import torch

    from kernels import gemm
    from kernels.gemm import launch as gl
    from triton.tools.tensor_descriptor import TensorDescriptor as TD

    A = torch.randn(512, 512, device="cuda").bfloat16()
    B = torch.randn(512, 512, device="cuda").bfloat16()
    gl.DEVICE_DESCRIPTORS = False   # this breakdown is of the host-descriptor launch
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


# --------------------------------------------------------------------------
# --descriptors: host vs device TMA descriptors
# --------------------------------------------------------------------------
SMALL_SHAPES = [(1, 4096, 4096), (16, 4096, 4096), (128, 4096, 4096), (128, 8192, 8192), (512, 512, 512)]
VARIANTS = ("host", "device")


def _desc_shapes():
    """This script's shapes first (the host-time goal), then the goal table's, then small M."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from run_gemm_tiling import GOAL_SHAPES   # the GEMM goal table

    seen, out = set(), []
    for s in GEMM_SHAPES + GOAL_SHAPES + SMALL_SHAPES:
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


class _Log:
    """print() that also appends to a log file."""

    def __init__(self, path: Path):
        self.path = path
        path.write_text("")

    def __call__(self, *parts):
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        with self.path.open("a") as f:
            f.write(line + "\n")


def _set_variant(variant: str) -> None:
    from kernels.gemm import launch as gl
    from kernels.moe import launch as ml

    gl.DEVICE_DESCRIPTORS = ml.DEVICE_DESCRIPTORS = variant == "device"


def _set_gluon_variant(variant: str) -> None:
    """The Gluon kernels' descriptors: "host" or "device" (the Triton kernels' switches untouched)."""
    from kernels.gemm import launch as gl
    from kernels.moe import launch as ml

    gl.GLUON_DEVICE_DESCRIPTORS = ml.GLUON_DEVICE_DESCRIPTORS = variant == "device"


def _rel_err(out, ref) -> tuple[float, bool]:
    finite = bool(out.isfinite().all())
    den = float(ref.norm()) or 1.0
    return float((out.double() - ref).norm()) / den, finite


def _measure(case, fns: dict, bench, rows, log, info: dict, calls: int, setter=_set_variant) -> dict:
    """Host time of each callable (its variant set once with ``setter``, then plain calls), then
    eager and graph times taken in turns (each call sets its own variant first: the same cost
    for both)."""
    host = {}
    for name, (variant, fn) in fns.items():
        if variant:
            setter(variant)
        host[name] = bench.host_time_us(fn, calls=calls)

    def turn(variant, fn):
        if variant is None:
            return fn

        def call():
            setter(variant)
            return fn()
        return call

    turns = {name: turn(v, fn) for name, (v, fn) in fns.items()}
    eager = bench.interleave(turns, warmup_ms=20, rep_ms=60, mode="eager")
    graph = bench.interleave(turns, warmup_ms=20, rep_ms=60, mode="graph")
    res = {}
    for name in fns:
        missing = [m for m, t in (("eager", eager), ("graph", graph)) if name not in t]
        if missing:
            log(f"  {name}: no {'/'.join(missing)} timing (its first call or capture raised)")
        rows.append(_row(case, name, host[name], eager.get(name), graph.get(name), **info.get(name, {})))
        res[name] = rows[-1]
    return res


def _fmt(res: dict, base: str = "host", lib: str = "torch.mm") -> str:
    h = "  ".join(f"{n} {r['host_us']:5.1f}" for n, r in res.items())
    out = f"host us: {h}"
    if "device" in res and base in res:
        d, b = res["device"], res[base]
        out += (f" | device/host eager {d['eager_ms'] / b['eager_ms']:.3f}x graph {d['graph_ms'] / b['graph_ms']:.3f}x")
    if lib in res and "device" in res:
        out += f" | {lib}/device graph {res[lib]['graph_ms'] / res['device']['graph_ms']:.3f}x"
    return out


def descriptors(out_dir: Path, bench, budget_s: float, calls: int = CALLS, only: str = "all") -> int:
    """The --descriptors run on one GPU (see the module docstring). Returns the exit code.
    Order: the Gluon rows (unless ``only`` is "triton": GLUON_SHAPES, then the grouped cases'
    fwd and dgrad), then (unless ``only`` is "gluon") this script's matmul shapes, the grouped
    cases, the goal table's and small-M shapes, and the Triton kernel forced where the plan
    took the Gluon kernel."""
    import pandas as pd
    import torch

    from kernels.common import launcher
    from workbench import provenance

    t_start = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = "descriptors" if only == "all" else f"descriptors_{only}"
    log = _Log(out_dir / f"{stem}_log.txt")
    prov = provenance.flat(provenance.collect())
    log(f"descriptors ({only}): {torch.cuda.get_device_name()} torch {torch.__version__} git {prov.get('git_sha')} "
        f"({prov.get('git_source')}, dirty {prov.get('git_dirty')}); budget {budget_s:.0f} s")
    st = _DescRun(bench, log, calls)

    def save():
        pd.DataFrame([{**r, **prov} for r in st.rows]).to_csv(out_dir / f"{stem}.csv", index=False)
        pd.DataFrame([{**r, **prov} for r in st.checks]).to_csv(out_dir / f"{stem}_check.csv", index=False)

    # Floors: a bare Triton launch and torch.mm on a tiny product.
    x = torch.randn(1 << 12, device="cuda")
    _noop_kernel[(4,)](x, x.numel(), BLOCK=1024)
    st.rows.append(_row("bare triton launch", "triton", bench.host_time_us(
        lambda: _noop_kernel[(4,)](x, x.numel(), BLOCK=1024), calls=calls)))
    a = torch.randn(256, 256, device="cuda")
    st.rows.append(_row("torch.mm 256^3", "torch", bench.host_time_us(lambda: torch.mm(a, a), calls=calls)))
    log(f"floors: bare triton launch {st.rows[-2]['host_us']:.1f} us, torch.mm 256^3 {st.rows[-1]['host_us']:.1f} us")
    if only != "triton":
        _gluon_breakdown(st.rows, bench, log, calls)
    if only != "gluon":
        _desc_breakdown(st.rows, bench, log, calls)
    save()

    gluon_shapes = []
    tasks = []
    if only != "triton":
        tasks += [("gluon matmul", s) for s in GLUON_SHAPES] + [("gluon grouped", c) for c in GROUPED]
    if only != "gluon":
        tasks += ([("matmul", s) for s in GEMM_SHAPES] + [("grouped", c) for c in GROUPED]
                  + [("matmul", s) for s in _desc_shapes() if s not in GEMM_SHAPES])
    skipped = []
    while tasks:
        what, arg = tasks.pop(0)
        elapsed = time.monotonic() - t_start
        if elapsed > budget_s:
            skipped.append(f"{what} {arg}")
            continue
        log(f"[{elapsed:4.0f} s] {what} {arg}")
        try:
            if what == "matmul":
                if st.matmul(*arg) == "gluon":
                    gluon_shapes.append(arg)
            elif what == "grouped":
                st.grouped(*arg)
            elif what == "gluon matmul":
                st.gluon_matmul(*arg)
            elif what == "gluon grouped":
                st.gluon_grouped(*arg)
            else:
                st.matmul(*arg, force_triton=True)
        except Exception as exc:   # logged as a failure; the next shapes still run (a CUDA error stops them)
            import traceback

            st.failures.append(f"{what} {arg}: {type(exc).__name__}: {exc}"[:500])
            log(f"  FAIL {what} {arg} raised:\n{traceback.format_exc()[-3000:]}")
            _set_variant("device")
            _set_gluon_variant("host")
        if not tasks and gluon_shapes:
            tasks = [("triton", s) for s in gluon_shapes]
            gluon_shapes = []
        save()

    _set_variant("host")
    _set_gluon_variant("host")
    pool = {f"dev{d} stream {s:#x}": int(size) for (d, s), (_, size, _) in launcher._SCRATCH.items()}
    log(f"scratch pool: {pool}; {len(launcher._SCRATCH_RETIRED)} outgrown buffers kept")
    from triton.runtime import _allocation
    if _allocation._allocator.get() is not _allocation._NULL_ALLOCATOR:
        st.failures.append("a Triton allocator was set during the run")
    _summary(st.rows, log)
    if skipped:
        log(f"budget of {budget_s:.0f} s spent: not measured: {', '.join(skipped)}")
    log(f"{len(st.checks)} checks, {len(st.failures)} failed; {time.monotonic() - t_start:.0f} s")
    for f in st.failures:
        log(f"  FAILED: {f}")
    save()
    return 1 if st.failures else 0


class _DescRun:
    """One --descriptors run's rows, checks and measurements."""

    def __init__(self, bench, log, calls):
        self.bench, self.log, self.calls = bench, log, calls
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.failures: list[str] = []

    def check(self, case, impl, got, ref, tol, **extra) -> bool:
        err, finite = _rel_err(got, ref)
        ok = finite and err <= tol
        self.checks.append(dict(case=case, impl=impl, rel_err=err, tol=tol, finite=finite, ok=ok, **extra))
        if not ok:
            self.failures.append(f"{case} {impl}: rel err {err:.2e} (tol {tol:.0e}), finite {finite}")
            self.log(f"  FAIL {case} {impl}: rel err {err:.2e} (tol {tol:.0e}), finite {finite}")
        return ok

    def matmul(self, M, N, K, force_triton=False) -> str:
        """Both variants of matmul (the plan's kernel, or the Triton kernel forced) checked and
        timed beside torch.mm; returns the plan's kind."""
        import torch

        from kernels import gemm
        from kernels.gemm import launch as gl
        from kernels.gemm.cold import heuristic

        case = f"matmul {M}x{N}x{K}" + (" triton" if force_triton else "")
        g = torch.Generator(device="cuda").manual_seed(M * 3 + N * 5 + K)
        A = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        B = torch.randn(K, N, device="cuda", generator=g).bfloat16()
        ref = A.double() @ B.double()
        cfg = None
        if force_triton:
            sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            cfg = heuristic(M, N, K, torch.bfloat16, sms, hopper=True, gluon=False, tma=True, c_aligned=True)
        info = {}
        for v in VARIANTS:
            _set_variant(v)
            C = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            gemm.matmul(A, B, cfg, out=C)
            p = gl.plan_for(A, B, cfg)
            info[v] = dict(kind=p.kind, device_desc=p.device_desc, config=p.config.label(), flops=2 * M * N * K)
            self.check(case, v, C, ref, 1e-2, **info[v])
        self.check(case, "torch.mm", torch.mm(A, B), ref, 1e-2)
        info["torch.mm"] = dict(flops=2 * M * N * K)
        fns = {v: (v, lambda: gemm.matmul(A, B, cfg)) for v in VARIANTS}
        fns["torch.mm"] = (None, lambda: torch.mm(A, B))
        res = _measure(case, fns, self.bench, self.rows, self.log, info, self.calls)
        d = info["device"]
        self.log(f"{case:<34} {d['kind']:<6} {d['config']:<26} {_fmt(res)}")
        return d["kind"]

    def grouped(self, G, T, N, K) -> None:
        """wgrad (the Triton kernel by default) and fwd with the Triton kernel forced, both
        variants, beside torch._grouped_mm; fwd as planned (the Gluon kernel) once."""
        import torch

        from kernels import moe
        from kernels.moe import baselines as mb, config as mc, launch as ml, routing
        from kernels.moe.reference import tolerance

        case = f"G{G} T{T} {N}x{K}"
        g = torch.Generator(device="cuda").manual_seed(G + T)
        sizes = routing.mild(T, G, seed=G, device="cuda")
        offs = mb.grouped_mm_offsets(sizes)   # a library user computes these once per routing too
        xg = torch.randn(T, K, device="cuda", generator=g).bfloat16()
        w = torch.randn(G, K, N, device="cuda", generator=g).bfloat16()
        dy = torch.randn(T, N, device="cuda", generator=g).bfloat16()
        tol = tolerance(torch.bfloat16)
        fwd_cfg = mc.pick_config("fwd", N, K, xg.device)
        refs = {"wgrad": moe.reference_wgrad(xg, dy, sizes), "fwd": moe.reference(xg, w, sizes)}
        ops = {"wgrad": ("grouped_gemm_wgrad", dy, lambda out=None: moe.grouped_gemm_wgrad(xg, dy, sizes, out=out),
                         lambda out=None: ml.plan_for_wgrad(xg, dy, sizes, out=out)),
               "fwd": ("grouped_gemm triton", w,
                       lambda out=None: moe.grouped_gemm(xg, w, sizes, config=fwd_cfg, out=out),
                       lambda out=None: ml.plan_for(xg, w, sizes, config=fwd_cfg, out=out))}
        for op, (name, lib_b, run, plan) in ops.items():
            c = f"{name} {case}"
            info = {}
            for v in VARIANTS:
                _set_variant(v)
                out = torch.full(plan().out_shape, float("nan"), device="cuda", dtype=torch.bfloat16)
                run(out)
                p = plan(out)
                info[v] = dict(kind=p.label, device_desc=p.device_desc, flops=2 * T * N * K)
                self.check(c, v, out, refs[op], tol, **info[v])
            fns = {v: (v, run) for v in VARIANTS}
            fns["torch._grouped_mm"] = (None, lambda op=op, b=lib_b: mb.grouped_mm(op, xg, b, sizes, offs=offs))
            res = _measure(c, fns, self.bench, self.rows, self.log, info, self.calls)
            self.log(f"{c:<44} {_fmt(res, lib='torch._grouped_mm')}")
        _set_variant("host")
        c = f"grouped_gemm {case}"
        p = ml.plan_for(xg, w, sizes)
        out = torch.full(p.out_shape, float("nan"), device="cuda", dtype=torch.bfloat16)
        moe.grouped_gemm(xg, w, sizes, out=out)
        self.check(c, "default", out, refs["fwd"], tol, kind=p.label)
        res = _measure(c, {"default": ("host", lambda: moe.grouped_gemm(xg, w, sizes)),
                           "torch._grouped_mm": (None, lambda: mb.grouped_mm("fwd", xg, w, sizes, offs=offs))},
                       self.bench, self.rows, self.log, {"default": dict(kind=p.label)}, self.calls)
        self.log(f"{c:<44} {_fmt(res, lib='torch._grouped_mm')}")

    def _plan_ok(self, case, v, kind_ok: bool, device_desc: bool, what: str) -> None:
        """The plan a Gluon row runs: the Gluon kernel, with device descriptors exactly in "device"."""
        if not kind_ok or device_desc != (v == "device"):
            msg = f"{case} {v}: the plan is {what}, device_desc={device_desc}"
            self.failures.append(msg)
            self.log(f"  FAIL {msg}")

    def gluon_matmul(self, M, N, K) -> None:
        """matmul on a shape the plan sends to the Gluon kernel: both ways of making its
        descriptors (GLUON_DEVICE_DESCRIPTORS), checked and timed beside torch.mm."""
        import torch

        from kernels import gemm
        from kernels.gemm import launch as gl

        case = f"matmul {M}x{N}x{K} gluon"
        g = torch.Generator(device="cuda").manual_seed(M * 7 + N * 3 + K)
        A = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        B = torch.randn(K, N, device="cuda", generator=g).bfloat16()
        _set_gluon_variant("host")
        if gl.plan_for(A, B).kind != "gluon":
            self.log(f"  {case}: the plan takes the {gl.plan_for(A, B).kind} kernel here, not Gluon: skipped")
            return
        ref = A.double() @ B.double()
        info = {}
        for v in VARIANTS:
            _set_gluon_variant(v)
            C = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            gemm.matmul(A, B, out=C)
            p = gl.plan_for(A, B, None, C)
            info[v] = dict(kind=p.kind, device_desc=p.device_desc, config=p.config.label(), flops=2 * M * N * K)
            self.check(case, v, C, ref, 1e-2, **info[v])
            self._plan_ok(case, v, p.kind == "gluon", p.device_desc, p.kind)
        self.check(case, "torch.mm", torch.mm(A, B), ref, 1e-2)
        del ref
        info["torch.mm"] = dict(flops=2 * M * N * K)
        fns = {v: (v, lambda: gemm.matmul(A, B)) for v in VARIANTS}
        fns["torch.mm"] = (None, lambda: torch.mm(A, B))
        res = _measure(case, fns, self.bench, self.rows, self.log, info, self.calls, setter=_set_gluon_variant)
        _set_gluon_variant("host")
        d = info["device"]
        self.log(f"{case:<34} {d['kind']:<6} {d['config']:<26} {_fmt(res)}")

    def gluon_grouped(self, G, T, N, K) -> None:
        """grouped_gemm fwd and dgrad on the default path (the Gluon kernel): both ways of
        making its descriptors, checked and timed beside torch._grouped_mm."""
        import torch

        from kernels import moe
        from kernels.moe import baselines as mb, launch as ml, routing
        from kernels.moe.reference import tolerance

        case = f"G{G} T{T} {N}x{K}"
        g = torch.Generator(device="cuda").manual_seed(G * 3 + T)
        sizes = routing.mild(T, G, seed=G + 1, device="cuda")
        offs = mb.grouped_mm_offsets(sizes)
        w = torch.randn(G, K, N, device="cuda", generator=g).bfloat16()
        operands = {"fwd": (torch.randn(T, K, device="cuda", generator=g).bfloat16(), False, N),
                    "dgrad": (torch.randn(T, N, device="cuda", generator=g).bfloat16(), True, K)}
        tol = tolerance(torch.bfloat16)
        for op, (a, trans_w, width) in operands.items():
            c = f"grouped_gemm gluon {op} {case}"
            ref = moe.reference(a, w, sizes, trans_w=trans_w)
            info = {}
            for v in VARIANTS:
                _set_gluon_variant(v)
                out = torch.full((T, width), float("nan"), device="cuda", dtype=torch.bfloat16)
                moe.grouped_gemm(a, w, sizes, trans_w=trans_w, out=out)
                p = ml.plan_for(a, w, sizes, trans_w=trans_w, out=out)
                info[v] = dict(kind=p.label, device_desc=p.device_desc, flops=2 * T * N * K)
                self.check(c, v, out, ref, tol, **info[v])
                self._plan_ok(c, v, p.gluon, p.device_desc, p.label)
            lib = lambda op=op, a=a: mb.grouped_mm(op, a, w, sizes, offs=offs)   # noqa: E731
            self.check(c, "torch._grouped_mm", lib(), ref, tol)
            fns = {v: (v, lambda a=a, t=trans_w: moe.grouped_gemm(a, w, sizes, trans_w=t)) for v in VARIANTS}
            fns["torch._grouped_mm"] = (None, lib)
            res = _measure(c, fns, self.bench, self.rows, self.log, info, self.calls, setter=_set_gluon_variant)
            self.log(f"{c:<44} {info['device']['kind']:<22} {_fmt(res, lib='torch._grouped_mm')}")
        _set_gluon_variant("host")


def _gluon_breakdown(rows, bench, log, calls) -> None:
    """Where a Gluon matmul call's host time goes (512^3 bf16, the ping-pong kernel forced, so
    the GPU keeps up), host vs device descriptors."""
    import torch

    from kernels import gemm
    from kernels.common import cuda_context
    from kernels.gemm import gluon as ggluon, launch as gl

    A = torch.randn(512, 512, device="cuda").bfloat16()
    B = torch.randn(512, 512, device="cuda").bfloat16()
    cfg = dict(gluon="pingpong", block_n=128, num_stages=5, num_warps=4)
    parts = {}
    for v in VARIANTS:
        _set_gluon_variant(v)
        C = gemm.matmul(A, B, cfg)
        p = gl.plan_for(A, B, cfg)
        parts[f"gluon {v}: whole matmul(a, b)"] = (v, lambda: gemm.matmul(A, B, cfg))
        parts[f"gluon {v}: matmul(a, b, out=c)"] = (v, lambda C=C: gemm.matmul(A, B, cfg, out=C))
        parts[f"gluon {v}: plan lookup"] = (v, lambda: gl.plan_for(A, B, cfg))
        if p.device_desc:
            parts[f"gluon {v}: launch with ready arguments"] = (v, lambda p=p, C=C: p.launch(A, B, C, *p.args))
        else:
            (ab, al), (bb, bl), (cb, cl) = p.blocks
            D = ggluon.TensorDescriptor
            descs = (D.from_tensor(A, ab, al), D.from_tensor(B, bb, bl), D.from_tensor(C, cb, cl))
            parts[f"gluon {v}: descriptor objects"] = (v, lambda C=C, blocks=p.blocks: [
                D.from_tensor(t, blk, lay) for t, (blk, lay) in zip((A, B, C), blocks)])
            parts[f"gluon {v}: launch with ready descriptors"] = (v, lambda p=p, d=descs: p.launch(*d, *p.args))
    parts["gluon: current context check"] = (None, lambda: cuda_context.ensure_current(A.device))
    log("gluon breakdown (512^3 bf16, ping-pong):")
    _time_parts(parts, _set_gluon_variant, rows, bench, log, calls, width=44)


def _desc_breakdown(rows, bench, log, calls) -> None:
    """Where a device-descriptor matmul call's host time goes (512^3 bf16), beside the host one."""
    import torch

    from kernels import gemm
    from kernels.common import launcher
    from kernels.gemm import launch as gl
    from triton.tools.tensor_descriptor import TensorDescriptor as TD

    A = torch.randn(512, 512, device="cuda").bfloat16()
    B = torch.randn(512, 512, device="cuda").bfloat16()
    parts = {}
    for v in VARIANTS:
        _set_variant(v)
        C = gemm.matmul(A, B)
        p = gl.plan_for(A, B)
        parts[f"{v}: whole matmul(a, b)"] = (v, lambda: gemm.matmul(A, B))
        parts[f"{v}: matmul(a, b, out=c)"] = (v, lambda C=C: gemm.matmul(A, B, out=C))
        parts[f"{v}: plan lookup"] = (v, lambda: gl.plan_for(A, B))
        if p.device_desc:
            parts[f"{v}: launch with ready arguments"] = (v, lambda p=p, C=C: p.launch(A, B, C, *p.args, C, C))
            dev, stream = launcher._current_device_stream()
            parts[f"{v}: scratch lookup"] = (v, lambda d=dev, s=stream: launcher.scratch(d, s, 1024))
            parts[f"{v}: device and stream"] = (v, launcher._current_device_stream)
        else:
            ab, bb, cb = p.blocks
            descs = (TD.from_tensor(A, ab), TD.from_tensor(B, bb), TD.from_tensor(C, cb) if cb else None)
            parts[f"{v}: descriptor objects"] = (v, lambda: [TD.from_tensor(t, blk) for t, blk in
                                                            ((A, ab), (B, bb), (C, cb)) if blk])
            parts[f"{v}: launch with ready descriptors"] = (v, lambda p=p, C=C, d=descs: p.launch(
                *d, C, C.stride(0), *p.args, C, C))
    parts["output allocation: torch.empty"] = (None, lambda: torch.empty((512, 512), device=A.device,
                                                                          dtype=torch.bfloat16))
    parts["output allocation: a.new_empty"] = (None, lambda: A.new_empty((512, 512)))
    log("breakdown (512^3 bf16):")
    _time_parts(parts, _set_variant, rows, bench, log, calls, width=40)


def _time_parts(parts: dict, setter, rows, bench, log, calls, width: int) -> None:
    """Host time of each breakdown part {name: (variant or None, fn)}, under its variant; host after."""
    for name, (v, fn) in parts.items():
        if v:
            setter(v)
        h = bench.host_time_us(fn, calls=calls)
        rows.append(_row(f"breakdown: {name}", "ours", h))
        log(f"  {name:<{width}} {h['median_us']:6.1f} us")
    setter("host")


def _summary(rows, log) -> None:
    """Per matmul shape: host us of host/device/torch.mm, and whether device meets 30 us."""
    by = {}
    for r in rows:
        if r["case"].startswith(("matmul", "grouped_gemm")):
            by.setdefault(r["case"], {})[r["impl"]] = r
    log("summary: host us per call (median of 200): host / device / library; device <= 30 us?")
    for case, res in by.items():
        lib = next((n for n in res if n.startswith("torch")), None)
        d = res.get("device") or res.get("default")
        cells = " / ".join(f"{res[n]['host_us']:5.1f}" if n in res else "  -  " for n in ("host", "device", lib))
        log(f"  {case:<48} {cells}   {'yes' if d and d['host_us'] <= 30 else 'NO'}")


def dry_run(out_dir: Path) -> int:
    """The CPU part of --descriptors: both variants in Triton's interpreter on small shapes
    (TMA forced: the interpreter takes the pointer kernel otherwise), fresh random inputs,
    NaN-poisoned outputs, plans checked; writes descriptors_dry.csv."""
    import pandas as pd
    import torch

    from kernels import gemm, moe
    from kernels.common import interpreter
    from kernels.gemm import launch as gl
    from kernels.moe import launch as ml

    if not interpreter.active():
        print("dry run: TRITON_INTERPRET=1 must be set before triton is imported", file=sys.stderr)
        return 2
    out_dir.mkdir(parents=True, exist_ok=True)
    small = dict(block_m=32, block_n=32, block_k=32, num_warps=4, num_stages=2, tma=True)
    cases = [("tma", 40, 48, 64, small), ("tma-store-split", 33, 64, 96, dict(small, epilogue_split=2)),
             ("split-k", 3, 64, 96, dict(small, block_m=16, split_k=2))]
    rows, bad = [], 0
    for i, (name, M, N, K, cfg) in enumerate(cases):
        for v in VARIANTS:
            _set_variant(v)
            g = torch.Generator().manual_seed(100 + 2 * i + (v == "device"))
            a, b = torch.randn(M, K, generator=g).half(), torch.randn(K, N, generator=g).half()
            c = torch.full((M, N), float("nan"), dtype=torch.float16)
            gemm.matmul(a, b, cfg, out=c)
            p = gl.plan_for(a, b, cfg, c)
            err, finite = _rel_err(c, a.double() @ b.double())
            ok = finite and err <= 2e-3 and p.device_desc == (v == "device")
            bad += not ok
            rows.append(dict(case=f"matmul {name} {M}x{N}x{K}", impl=v, kind=p.kind, device_desc=p.device_desc,
                             rel_err=err, finite=finite, ok=ok))
    gcfg = moe.GroupedConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1,
                             EPI_SUBTILE=False, FLATTEN=True, USE_TMA=True)
    for v in VARIANTS:
        _set_variant(v)
        g = torch.Generator().manual_seed(7 + (v == "device"))
        sizes = torch.tensor([5, 0, 19, 8])
        x, dy = torch.randn(32, 48, generator=g).half(), torch.randn(32, 32, generator=g).half()
        out = torch.full((4, 48, 32), float("nan"), dtype=torch.float16)
        moe.grouped_gemm_wgrad(x, dy, sizes, config=gcfg, out=out)
        p = ml.plan_for_wgrad(x, dy, sizes, config=gcfg, out=out)
        err, finite = _rel_err(out, moe.reference_wgrad(x, dy, sizes))
        ok = finite and err <= 2e-3 and p.device_desc == (v == "device")
        bad += not ok
        rows.append(dict(case="grouped_gemm_wgrad G4 T32 32x48", impl=v, kind=p.label, device_desc=p.device_desc,
                         rel_err=err, finite=finite, ok=ok))
    _set_variant("host")
    pd.DataFrame(rows).to_csv(out_dir / "descriptors_dry.csv", index=False)
    for r in rows:
        print(f"{r['case']:<36} {r['impl']:<7} {r['kind']:<8} device_desc={r['device_desc']!s:<5} "
              f"rel err {r['rel_err']:.1e} {'ok' if r['ok'] else 'FAIL'}")
    print(f"dry run: {len(rows) - bad} of {len(rows)} ok; wrote {out_dir / 'descriptors_dry.csv'}")
    return 1 if bad else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for launch_cost.csv (e.g. results/launch_cost)")
    ap.add_argument("--comm", action="store_true",
                    help="under torchrun: every variant of all_gather, all_gather_matmul and gemm_all_scatter beside "
                         "the library calls (experiments/launch_cost_comm.py)")
    ap.add_argument("--breakdown", action="store_true",
                    help="only: where a planned matmul call's host time goes (with --comm: also the parts of a "
                         "chunked and a pipelined all_gather_matmul call)")
    ap.add_argument("--breakdown-mxfp4", action="store_true",
                    help="where a user's MXFP4 down-projection call's host time goes, part by part")
    ap.add_argument("--paths", type=int, default=0, metavar="N",
                    help="only: every GEMM config path's host time on N held-out zoo shapes (paths.csv, "
                         "paths_summary.md); a large N takes them all")
    ap.add_argument("--calls", type=int, default=PATH_CALLS, help="with --paths: calls per median (default 300)")
    ap.add_argument("--descriptors", action="store_true",
                    help="only: host vs device TMA descriptors (files descriptors*.csv, descriptors_log.txt)")
    ap.add_argument("--dry-run", action="store_true",
                    help="with --descriptors: the CPU part only (Triton's interpreter, small shapes)")
    ap.add_argument("--budget-s", type=float, default=420,
                    help="with --descriptors: start no new shape after this many seconds (default 420)")
    ap.add_argument("--only", choices=("all", "triton", "gluon"), default="all",
                    help="with --descriptors: the Gluon kernels' rows alone (gluon), the Triton kernels' "
                         "alone (triton), or both (all, the default)")
    args = ap.parse_args(argv)
    if args.only != "all" and not args.descriptors:
        ap.error("--only goes with --descriptors")
    if args.dry_run and args.only == "gluon":
        ap.error("--dry-run covers the Triton kernels only (Gluon kernels do not run in Triton's interpreter); "
                 "the Gluon rows need an sm_90 GPU")

    import pandas as pd

    from workbench import bench, provenance

    if args.dry_run:
        if not args.descriptors:
            ap.error("--dry-run goes with --descriptors")
        return dry_run(Path(args.out))

    if not bench.gpu_timing_available():
        print("launch_cost: needs a CUDA GPU (sm_90: H100 or H200), and TRITON_INTERPRET unset", file=sys.stderr)
        return 2
    if args.descriptors:
        return descriptors(Path(args.out), bench, args.budget_s, only=args.only)
    rows: list[dict] = []
    world = 1
    if args.comm:
        import torch.distributed as tdist

        from launch_cost_comm import measure
        from workbench import dist

        with dist.worker():
            world = tdist.get_world_size()
            measure(rows, bench, CALLS, breakdown=args.breakdown)
    elif args.breakdown_mxfp4:
        breakdown_mxfp4(rows, bench)
    elif args.breakdown:
        breakdown(rows, bench)
    elif args.paths:
        config_paths(rows, bench, args.paths, calls=args.calls)
    else:
        single_gpu(rows, bench)
    if rows:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        prov = provenance.flat(provenance.collect(world_size=world))
        df = pd.DataFrame([{**r, **prov} for r in rows])
        name = ("launch_cost_comm.csv" if args.comm else "breakdown_mxfp4.csv" if args.breakdown_mxfp4 else
                "breakdown.csv" if args.breakdown else
                "paths.csv" if args.paths else "launch_cost.csv")
        df.to_csv(out / name, index=False)
        print(f"wrote {out / name} ({len(df)} rows)")
        if args.paths:
            print(write_paths_summary(df, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
