#!/usr/bin/env python3
"""MXFP4 MoE down-projection on one GPU: correctness and timing of every variant and baseline,
for the models people run: KIMI-K2.5, gpt-oss-120b and gpt-oss-20b.

Models (experts, hidden H, intermediate I, top-k; token counts M):

* ``kimi-k2.5`` (385, 7168, 512, 9): M in {4, 8, 16, 32, 64, 128, 256} and the long context 16384;
* ``gpt-oss-120b`` (128, 2880, 2880, 4): M in {1, 3, 8, 16, 48, 64, 128, 200, 256} and 8192;
* ``gpt-oss-20b`` (32, 2880, 2880, 4): M in {1, 3, 8, 16, 48, 64, 128, 200, 256}.

For each model and M this script

1. routes the tokens (random distinct top-k experts per token, softmax weights) and prepares the
   routing (``prepare_routing``: one kernel launch) for the row tiles the variants need;
2. checks every variant and baseline against an fp32 reference built from the weights decoded by
   the quantizer's own torch decode (``dequantize_mxfp4``, not the kernel's expansion; exact in
   bf16), the per-element bound of tests/test_moe_mxfp4.py, on outputs (and the deterministic
   mode's workspace) poisoned with NaN, and that the deterministic mode gives the same bits twice;
3. times them both ways: ``graph`` (CUDA-graph replay, one call per replay, L2 flushed before
   each: GPU time alone, as the seed measures) and ``eager`` (the callables of one M taking turns
   run by run, CUDA events around each call, L2 flushed: workbench.bench.interleave; the flush
   kernel runs while the host queues the call, so these eager rows hide up to its length of host
   time);
4. times a user's loop (``user loop``: ``moe_mxfp4_down(a, weights, (topk_ids, topk_weights))``,
   the routing prepared in the call; ``user loop (torch routing)``: the same with the routing by
   torch ops, as before issue 42) back to back with no flush, four routings in turn so that L2 does
   not serve one call's experts to the next: ``eager`` (CUDA events around each call: the host's
   time shows where it exceeds the GPU's) against ``graph`` (the same calls unrolled into one CUDA
   graph); and the host time per call (``host_us``, 200 calls, no sync) of the loop, of
   ``prepare_routing`` and of the torch routing, at M <= 256;
5. measures the copy bandwidth (HBM bound = bytes of the routed experts' weights and scales +
   activations + output, over that bandwidth) and writes, under --out, for KIMI-K2.5 ``rows.csv``
   (one row per M, form, variant and method, with provenance), ``checks.csv``, ``info.json``,
   ``summary.md``, the same files for each gpt-oss model under ``--out/<model>/``, and
   ``models.csv`` (per model, M and method: the prepacked default's time and fraction of the
   HBM bound, level 3, the plain layout, the user's loop eager and graph, the bf16-weight and
   dequantize peers) and ``peers.json`` (what became of the gpt-oss reference implementation).

Variants (w4a16 unless named a4w4). KIMI-K2.5, as before: BM16/BM32 x NT on/off (both latency
switches on, atomic epilogue); at M <= 256 BM16 NT with 64-wide column tiles (``BN64``) and with
the expansion in Triton integer ops (``bits``); at M <= 32 BM16 NT with each latency switch off;
the heuristic's config for plain weights (``default``), its deterministic mode (``default det``)
and the a4w4 form of both; BM64/BM128 at M = 16384. Every model: ``default`` (plain layout: what
gpt-oss ran before issue 42, its I = 2880 not a multiple of 128), ``prepacked default``
(``prepare_weights(w, w_scale)``, level 2, the no-config cold rule's config passed explicitly so a
tuning table on the machine does not replace it) and ``prepacked L3`` (level 3, its cold rule).
Baselines: ``dequant+grouped_gemm`` and ``dequant+grouped_mm`` (dequantize all experts to bf16,
gather rows, our grouped GEMM or ``torch._grouped_mm``, weighted sum), ``bf16 grouped_gemm`` and
``bf16 grouped_mm`` (bf16 weights, the same pipeline on the same routing), the GEMMs alone on
pre-gathered rows (``(gemm only)``), and for gpt-oss the reference implementation's own MoE
(``gpt-oss reference``) where its package and ``triton_kernels`` import on the node
(``baselines.gpt_oss_reference``; else peers.json says why).

``--selection``: the launcher as users call it instead of the variants: weights prepared once
(``prepare_weights``, level 2), the routing padded to ``block_m_for``'s row tile, and no config,
so the selection layer picks the config (this GPU's tuning tables, ``$WORKBENCH_TUNING_DIR`` over
the package's; else the cold rule): ``launcher``; next to it the cold rule's config passed
explicitly (``cold rule``) and the baselines. Its rows name the config that ran and where it came
from (``selected_source``: table or cold, ``selected_where``).

Usage on a GPU node (every model: about 5 minutes on an H200, within 8 by design; the KIMI-K2.5
part alone took 47 s before issue 42):
    python3 experiments/run_moe_mxfp4.py --out results/moe_mxfp4
    python3 experiments/run_moe_mxfp4.py --out /tmp/x --quick      # each model's first and fourth M
    python3 experiments/run_moe_mxfp4.py --out /tmp/x --models gpt-oss-120b --m 1 48 8192
    python3 experiments/run_moe_mxfp4.py --out results/moe_mxfp4/selection --selection --models kimi-k2.5
    TRITON_INTERPRET=1 python3 experiments/run_moe_mxfp4.py --out /tmp/x --small --rep-ms 1   # no GPU
    TRITON_INTERPRET=1 python3 experiments/run_moe_mxfp4.py --out /tmp/x --small --models gpt-oss-20b --m 3 --rep-ms 1
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

from kernels.moe_mxfp4 import (MoeMxfp4Config, block_m_for, default_config, dequantize_mxfp4,  # noqa: E402
                               moe_mxfp4_down, prepare_routing, prepare_weights, quantize_mxfp4)
from kernels.moe_mxfp4 import baselines as bl  # noqa: E402
from kernels.moe_mxfp4 import launch as mx_launch  # noqa: E402
from kernels.moe_mxfp4 import metrics  # noqa: E402
from kernels.moe_mxfp4 import plan as mx_plan  # noqa: E402
from kernels.moe_mxfp4 import select as mx_select  # noqa: E402
from kernels.moe_mxfp4.quant import PREPACK_H_MULTIPLE  # noqa: E402
from kernels.moe_mxfp4.routing import torch_routing  # noqa: E402
from workbench import bench  # noqa: E402
from workbench import provenance as wb_provenance  # noqa: E402
from workbench import roofline  # noqa: E402


class Model(NamedTuple):
    E: int
    H: int
    I: int  # noqa: E741 (the intermediate size is I throughout)
    TOP_K: int
    M_LIST: tuple
    quick: tuple


KIMI = "kimi-k2.5"
MODELS = {
    KIMI: Model(385, 7168, 512, 9, (4, 8, 16, 32, 64, 128, 256, 16384), (4, 32)),
    "gpt-oss-120b": Model(128, 2880, 2880, 4, (1, 3, 8, 16, 48, 64, 128, 200, 256, 8192), (1, 48)),
    "gpt-oss-20b": Model(32, 2880, 2880, 4, (1, 3, 8, 16, 48, 64, 128, 200, 256), (1, 48)),
}
# The model being run (module globals: run_moe_mxfp4_variants.py reads and sets them too).
MODEL = KIMI
E, H, I, TOP_K = 385, 7168, 512, 9
M_LIST = MODELS[KIMI].M_LIST
DEV = "cuda"
# --small: a CPU smoke run of this script's own logic (TRITON_INTERPRET=1, no GPU), at the
# CPU tests' sizes (H and I not multiples of 64 and 128: the prepacked layouts pad them); its
# timings are host-timer numbers and mean nothing.
SMALL = dict(E=6, H=72, I=96, TOP_K=3, M_LIST=(1, 5, 33))
SEED = 1234
LOOP_SETS = 4          # routings a user's loop takes in turn (L2 does not serve one call to the next)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def use_model(name: str, small: bool = False) -> None:
    """Set the module's shape globals to a model's (or --small's)."""
    global MODEL, E, H, I, TOP_K, M_LIST
    MODEL = name
    if small:
        E, H, I, TOP_K, M_LIST = (SMALL[k] for k in ("E", "H", "I", "TOP_K", "M_LIST"))
    else:
        m = MODELS[name]
        E, H, I, TOP_K, M_LIST = m.E, m.H, m.I, m.TOP_K, m.M_LIST


def quantized_weights(g: torch.Generator):
    """Random [E, H, I] weights (std 0.02) quantized expert chunk by chunk (bounded temporaries)."""
    w = torch.empty(E, H, I // 2, dtype=torch.uint8, device=DEV)
    ws = torch.empty(E, H, I // 32, dtype=torch.uint8, device=DEV)
    step = max(1, (1 << 28) // (H * I))
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        w[e0:e1], ws[e0:e1] = quantize_mxfp4(torch.randn(e1 - e0, H, I, device=DEV, generator=g) * 0.02)
    return w, ws


def decoded_bf16(w: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """The weights decoded by the quantizer's torch decode (a lookup and a power of two per block,
    not the kernel's expansion), bf16 (exact), chunk by chunk: the reference's weights and the
    bf16-weight baselines'."""
    out = torch.empty(E, H, I, dtype=torch.bfloat16, device=w.device)
    step = max(1, (1 << 28) // (H * I))
    for e0 in range(0, E, step):
        out[e0:e0 + step] = dequantize_mxfp4(w[e0:e0 + step], ws[e0:e0 + step], torch.bfloat16)
    return out


def route(M: int, g: torch.Generator):
    ids = torch.rand(M, E, device=DEV, generator=g).topk(TOP_K, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(M, TOP_K, device=DEV, generator=g), -1)
    return ids, wts


def reference(a_f32: torch.Tensor, w_bf16: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor):
    """(sum over slots, sum of magnitudes) in fp32; w_bf16 is exact (decoded_bf16)."""
    M = ids.shape[0]
    flat = ids.reshape(-1).long()
    y = torch.zeros(M * TOP_K, H, device=DEV)
    for e in torch.unique(flat).tolist():
        sel = (flat == e).nonzero().squeeze(1)
        y[sel] = a_f32[sel] @ w_bf16[e].float().T
    y = (y * wts.reshape(-1, 1)).view(M, TOP_K, H)
    return y.sum(1), y.abs().sum(1)


def split_reference(a_f32: torch.Tensor, w_bf16: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor,
                    parts: int, block_k: int):
    """reference() for SPLIT_K = parts: each program's partial row (cdiv(steps, parts) K steps of
    block_k, the last part ragged) is rounded and added on its own, so the bound's magnitudes are
    the partial rows' (cancelling parts can exceed the whole row's)."""
    step = -(-(-(-a_f32.shape[1] // block_k)) // parts) * block_k
    rows = [reference(a_f32[:, j * step:(j + 1) * step], w_bf16[:, :, j * step:(j + 1) * step], ids, wts)
            for j in range(parts)]
    return sum(x for x, _ in rows), sum(m for _, m in rows)


def check(out: torch.Tensor, ref, mag, slack: float = 1.0) -> dict:
    err = (out.float() - ref).abs()
    bound = slack * (TOP_K + 1) * 2.0 ** -8 * mag + 1e-6
    finite = bool(out.isfinite().all())
    return {"ok": finite and bool((err <= bound).all()), "finite": finite,
            "max_abs_err": float(err.max()), "worst_err_over_bound": float((err / bound).max()),
            "rel_fro_err": float((out.float() - ref).norm() / ref.norm())}


def _sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 0


def variants(M: int) -> dict[str, tuple[MoeMxfp4Config, bool]]:
    """name -> (config, a4w4). KIMI-K2.5 (and --small) keeps every variant of the earlier runs (the
    study notebook reads them); every model has the plain default and the prepacked defaults."""
    d = default_config(M, TOP_K, E, I)
    v: dict[str, tuple[MoeMxfp4Config, bool]] = {}
    if MODEL == KIMI:
        for bm in (16, 32):
            for nt in (True, False):
                v[f"BM{bm}{' NT' if nt else ''}"] = (MoeMxfp4Config(BLOCK_M=bm, NT=nt), False)
        if M <= 256:
            v["BM16 NT BN64"] = (MoeMxfp4Config(BLOCK_M=16, BLOCK_N=64, NT=True), False)
            v["BM16 NT bits"] = (MoeMxfp4Config(BLOCK_M=16, NT=True, EXPAND="bits"), False)
        if M <= 32:
            v["BM16 NT early-off"] = (MoeMxfp4Config(NT=True, EARLY_LOADS=False), False)
            v["BM16 NT prefetch-off"] = (MoeMxfp4Config(NT=True, PREFETCH_EPILOGUE=False), False)
            v["BM16 NT both-off"] = (MoeMxfp4Config(NT=True, EARLY_LOADS=False, PREFETCH_EPILOGUE=False), False)
        if M >= 4096:
            v["BM64"] = (MoeMxfp4Config(BLOCK_M=64, NT=False), False)
            v["BM128"] = (MoeMxfp4Config(BLOCK_M=128, num_warps=8, NT=False), False)
            v["BM128 BN256"] = (MoeMxfp4Config(BLOCK_M=128, BLOCK_N=256, num_warps=8, NT=False), False)
        v["default det"] = (d.replace(DETERMINISTIC=True), False)
        v["a4w4 default"] = (d, True)
        v["a4w4 det"] = (d.replace(DETERMINISTIC=True), True)
    v["default"] = (d, False)
    if DEV == "cpu":        # --small in the interpreter: tiles that fit H = 72, I = 96
        v = {n: (c.replace(BLOCK_N=32, BLOCK_K=32, num_warps=1), fp4) for n, (c, fp4) in v.items()}
    if prepackable():       # weights prepared once (prepare_weights), the cold rule's config for them
        for name, level in (("prepacked default", 2), ("prepacked L3", 3)):
            v[name] = (default_config(M, TOP_K, E, I, prepacked=level, H=H, sms=_sms()), False)
    return v


def selection_variants(M: int) -> dict[str, tuple[MoeMxfp4Config | None, bool, int, int]]:
    """--selection: name -> (config, a4w4, weights' level, routing's BLOCK_M): the launcher with no
    config (config None: the selection layer picks) and the cold rule's config for the same call
    (filled in by ``cold_for`` once the call's tensors exist)."""
    level, bm = (2 if prepackable() else 0), block_m_for(M, TOP_K, E)
    return {"launcher": (None, False, level, bm), "cold rule": (None, False, level, bm)}


def cold_for(a, weights, routing) -> MoeMxfp4Config:
    """What the launcher runs for this call without a tuning table (the selection layer's cold rule)."""
    return mx_select.cold_config(mx_plan.call_of(a, None, weights, routing))


def prepackable() -> bool:
    """Whether the shapes allow the prepacked layouts (H % 8 == 0 and I % 32 == 0, the rule of
    prepare_weights: rows padded to 64 and I to 128)."""
    return H % PREPACK_H_MULTIPLE == 0 and I % 32 == 0


def measured_ms(quick: bool, model: str = KIMI) -> tuple[int, ...]:
    """The token counts a run measures: every M, or with --quick the model's two (KIMI-K2.5: 4 and 32)."""
    m = MODELS[model]
    return m.quick if quick else m.M_LIST


def time_both(fns: dict, *, rep_ms: float, log_prefix: str, min_reps: int = 15) -> dict[str, dict[str, bench.Timing]]:
    """{name: {'graph': Timing, 'eager': Timing}}; a callable that fails is left out (and logged)."""
    res: dict[str, dict[str, bench.Timing]] = {n: {} for n in fns}
    for name, fn in fns.items():
        try:
            res[name]["graph"] = bench.measure(fn, cuda_graph=True, flush_l2=True, warmup_ms=10, rep_ms=rep_ms)
        except Exception as exc:  # a baseline that cannot be captured still gets its eager time
            log(f"{log_prefix} {name}: graph timing failed ({type(exc).__name__}: {str(exc)[:120]})")
    for name, t in bench.interleave(fns, warmup_ms=20, rep_ms=rep_ms, min_reps=min_reps, max_reps=200).items():
        res[name]["eager"] = t
    return res


def time_loop(fn, sets, *, rep_ms: float, host_calls: int) -> dict[str, bench.Timing | dict]:
    """A user's loop: ``fn(set)`` back to back over the input sets in turn, no L2 flush: eager (CUDA
    events around each call) and graph (the calls unrolled into one CUDA graph); with host_calls,
    also the host time per call (workbench.bench.host_time_us, no sync in between)."""
    res: dict[str, bench.Timing | dict] = {
        "eager": bench.measure(fn, mode="eager", flush_l2=False, input_sets=sets, warmup_ms=10, rep_ms=rep_ms),
        "graph": bench.measure(fn, mode="graph", flush_l2=False, input_sets=sets, warmup_ms=10, rep_ms=rep_ms)}
    if host_calls:
        it = iter(range(1 << 30))
        res["host"] = bench.host_time_us(lambda: fn(sets[next(it) % len(sets)]), calls=host_calls)
    return res


class Ctx(NamedTuple):
    """What every M of one model's run shares (a NamedTuple: the tests load this script without
    registering it as a module, which dataclasses need)."""
    args: argparse.Namespace
    prov: dict
    copy_gbps: float
    w: torch.Tensor
    w_scale: torch.Tensor
    w_bf16: torch.Tensor
    w_buf: torch.Tensor
    weights: dict
    peer: object
    peer_note: str


def run_model(ctx: Ctx, m_list: tuple, g: torch.Generator) -> tuple[list, list]:
    """Rows and checks of one model over its M (every M draws its routing and activations, measured
    or not, so a --quick or --m run sees the same experts and inputs as a full run at its M)."""
    args, rows, checks = ctx.args, [], []
    for M in M_LIST + tuple(m for m in m_list if m not in M_LIST):
        t_m = time.time()
        ids, wts = route(M, g)
        a = torch.randn(M * TOP_K, I, device=DEV, generator=g).bfloat16()
        if M not in m_list:
            continue
        r, c = run_point(ctx, M, ids, wts, a, g)
        rows += r
        checks += c
        bad = [x for x in c if not x["ok"]]
        log(f"{MODEL} M={M}: {len({x['name'] for x in r})} callables timed, "
            f"{'all checks ok' if not bad else f'{len(bad)} CHECKS FAILED'} ({time.time() - t_m:.0f} s)")
    return rows, checks


def run_point(ctx: Ctx, M: int, ids, wts, a, g) -> tuple[list, list]:
    args, w, w_scale, w_bf16, w_buf, weights = ctx.args, ctx.w, ctx.w_scale, ctx.w_bf16, ctx.w_buf, ctx.weights
    rows, checks = [], []
    a4, a4_s = quantize_mxfp4(a.float())
    srt = bl.sorted_rows(ids, E)
    active = int((srt.counts > 0).sum())
    ref, mag = reference(a.float(), w_bf16, ids, wts)
    ref4 = mag4 = None                              # the a4w4 reference, made when an a4w4 variant runs
    routings = {bm: prepare_routing(ids, wts, E, bm) for bm in (16, 32, 64, 128)}
    out = torch.empty(M, H, dtype=torch.bfloat16, device=DEV)

    fns, meta = {}, {}
    specs = (selection_variants(M) if args.selection
             else {n: (c, fp4, c.PREPACK, c.BLOCK_M) for n, (c, fp4) in variants(M).items()})
    for name, (cfg, fp4, level, bm) in specs.items():
        r = routings[bm]
        aa, asc = (a4, a4_s) if fp4 else (a, None)
        if name == "cold rule":
            cfg = cold_for(aa, weights[level], r)

        def run(aa=aa, asc=asc, r=r, cfg=cfg, wq=weights[level]):
            return moe_mxfp4_down(aa, wq, routing=r, a_scale=asc, config=cfg, out=out)

        try:
            run()                                   # compile, build the plan (and its workspace)
        except Exception as exc:
            log(f"{MODEL} M={M} {name}: failed to run ({type(exc).__name__}: {str(exc)[:200]})")
            checks.append(dict(M=M, name=name, config=cfg.label() if cfg else "", form="a4w4" if fp4 else "w4a16",
                               ok=False))
            continue
        plan = mx_launch.plan_for(aa, weights[level], routing=r, a_scale=asc, config=cfg, out=out)
        choice = plan.choice
        cfg = plan.config                           # what runs (the selected one for the launcher)
        out.fill_(float("nan"))
        for p in mx_launch._PLANS.values():
            if p.workspace is not None:
                p.workspace.fill_(float("nan"))
        if fp4 and ref4 is None:
            ref4, mag4 = reference(dequantize_mxfp4(a4, a4_s), w_bf16, ids, wts)
        if cfg.SPLIT_K > 1:                        # the default path's split (gpt-oss at small M): partial rows
            res = check(run(), *split_reference(dequantize_mxfp4(a4, a4_s) if fp4 else a.float(), w_bf16, ids, wts,
                                                cfg.SPLIT_K, cfg.BLOCK_K), slack=float(cfg.SPLIT_K))
        else:
            res = check(run(), ref4 if fp4 else ref, mag4 if fp4 else mag)
        if cfg.DETERMINISTIC:
            first = out.clone()
            res["bit_identical"] = bool(torch.equal(run(), first))
            res["ok"] = res["ok"] and res["bit_identical"]
        checks.append(dict(M=M, name=name, config=cfg.label(), form="a4w4" if fp4 else "w4a16", **res))
        fns[name] = run
        meta[name] = dict(kind="ours", config=cfg.label(), form="a4w4" if fp4 else "w4a16",
                          block_m=cfg.BLOCK_M, nt=cfg.NT, early_loads=cfg.EARLY_LOADS,
                          prefetch_epilogue=cfg.PREFETCH_EPILOGUE, deterministic=cfg.DETERMINISTIC,
                          prepack=cfg.PREPACK, selected_source=choice.source if choice else "explicit",
                          selected_where=choice.where if choice else "")
        if choice is not None:
            log(f"{MODEL} M={M} {name}: {cfg.label()} ({choice.source}: {choice.where})")

    x_sorted = a.index_select(0, srt.order)
    base = {
        "dequant+grouped_gemm": lambda: bl.dequant_grouped_gemm(a, w, w_scale, srt, wts, w_bf16_buf=w_buf),
        "dequant+grouped_mm": lambda: bl.dequant_grouped_mm(a, w, w_scale, srt, wts, w_bf16_buf=w_buf),
        "bf16 grouped_gemm": lambda: bl.bf16_grouped_gemm(a, w_bf16, srt, wts),
        "bf16 grouped_mm": lambda: bl.bf16_grouped_mm(a, w_bf16, srt, wts),
        "bf16 grouped_gemm (gemm only)": lambda: bl.grouped_gemm(x_sorted, w_bf16, srt.counts, trans_w=True),
        "bf16 grouped_mm (gemm only)": lambda: torch._grouped_mm(x_sorted, w_bf16.transpose(-2, -1),
                                                                 offs=srt.offsets),
    }
    if ctx.peer is not None:
        try:
            base["gpt-oss reference"] = ctx.peer(a, ids, wts)
        except Exception as exc:
            log(f"{MODEL} M={M} gpt-oss reference: could not be set up ({type(exc).__name__}: {str(exc)[:160]})")
    for name, fn in base.items():
        try:
            y = fn()
        except Exception as exc:
            log(f"{MODEL} M={M} {name}: unavailable ({type(exc).__name__}: {str(exc)[:120]})")
            continue
        if "gemm only" not in name:
            checks.append(dict(M=M, name=name, config="", form="w4a16", **check(y, ref, mag, slack=2.0)))
        fns[name] = fn
        meta[name] = dict(kind="baseline", config="", form="w4a16")
    bm_call = block_m_for(M, TOP_K, E)
    for bm in sorted({16, 32, bm_call}):
        fns[f"routing prep BM{bm}"] = lambda bm=bm: prepare_routing(ids, wts, E, bm)
        meta[f"routing prep BM{bm}"] = dict(kind="routing", config="", form="")
    fns["routing prep (torch ops)"] = lambda: torch_routing(ids, wts, E, bm_call)
    meta["routing prep (torch ops)"] = dict(kind="routing", config=f"BM{bm_call}", form="")

    timings = time_both(fns, rep_ms=args.rep_ms, log_prefix=f"{MODEL} M={M}", min_reps=15 if DEV == "cuda" else 1)
    timings.update(time_user_loop(ctx, M, g, bm_call, meta))
    fl = metrics.flops(M, TOP_K, H, I)
    for name, by_method in timings.items():
        m = meta[name]
        nbytes = metrics.hbm_bytes(M, TOP_K, H, I, active, a_fp4=m["form"] == "a4w4")
        bound_us = nbytes / (ctx.copy_gbps * 1e9) * 1e6
        host = by_method.pop("host", None)
        for method, t in by_method.items():
            rows.append(dict(model=MODEL, M=M, name=name, method=method, **m, active_experts=active,
                             median_us=t.median_ms * 1e3, q25_us=t.q25_ms * 1e3, q75_us=t.q75_ms * 1e3,
                             n_runs=t.n, flops=fl, hbm_bytes=nbytes, hbm_bound_us=bound_us,
                             frac_hbm_bound=bound_us / (t.median_ms * 1e3), tflops=t.tflops(fl),
                             gbps=t.gbps(nbytes), copy_gbps=ctx.copy_gbps, timing_method=t.method,
                             l2_flushed=t.l2_flushed, input_sets=t.input_sets,
                             host_us=(host or {}).get("median_us", t.host_us) if method == "eager" else float("nan"),
                             **ctx.prov))
    return rows, checks


def time_user_loop(ctx: Ctx, M: int, g: torch.Generator, bm: int, meta: dict) -> dict:
    """The user loop rows (module doc, step 4): LOOP_SETS routings and activations drawn for this M
    (after the shared ones, so the other rows' inputs do not move)."""
    if ctx.args.selection or 2 not in ctx.weights:
        return {}
    sets = []
    for _ in range(LOOP_SETS):
        ids, wts = route(M, g)
        sets.append((torch.randn(M * TOP_K, I, device=DEV, generator=g).bfloat16(), ids, wts))
    w2 = ctx.weights[2]
    loops = {"user loop": lambda s: moe_mxfp4_down(s[0], w2, (s[1], s[2])),
             "user loop (torch routing)": lambda s: moe_mxfp4_down(s[0], w2, torch_routing(s[1], s[2], E, bm)),
             "prepare_routing": lambda s: prepare_routing(s[1], s[2], E, bm),
             "routing by torch ops": lambda s: torch_routing(s[1], s[2], E, bm)}
    res = {}
    host_calls = 200 if M <= 256 and DEV == "cuda" else 0
    for name, fn in loops.items():
        try:
            res[name] = time_loop(fn, sets, rep_ms=ctx.args.rep_ms / 2, host_calls=host_calls)
        except Exception as exc:
            log(f"{MODEL} M={M} {name}: loop timing failed ({type(exc).__name__}: {str(exc)[:160]})")
            continue
        # routing alone is kind "routing" (no FLOPs of its own), as the interleaved routing rows
        meta[name] = dict(kind="loop" if "loop" in name else "routing", config=f"BM{bm}",
                          form="w4a16" if "loop" in name else "")
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="directory for rows.csv, checks.csv, info.json, summary.md, "
                                                 "models.csv, peers.json (gpt-oss models in <out>/<model>/)")
    ap.add_argument("--quick", action="store_true",
                    help="each model's two M only (KIMI-K2.5: 4 and 32; gpt-oss: 1 and 48), with the same routing "
                         "and inputs as a full run's")
    ap.add_argument("--models", nargs="*", default=None, choices=list(MODELS),
                    help=f"the models to run (default: all: {', '.join(MODELS)}; with --small, {KIMI}'s part only)")
    ap.add_argument("--m", type=int, nargs="*", default=None, help="token counts (default: each model's list)")
    ap.add_argument("--rep-ms", type=float, default=60.0, help="timed milliseconds per callable and method")
    ap.add_argument("--small", action="store_true",
                    help="tiny shapes; without a GPU a smoke run of the script in Triton's interpreter")
    ap.add_argument("--selection", action="store_true",
                    help="time the launcher as users call it (prepared weights, no config: tuning tables, else the "
                         "cold rule) against the cold rule's config and the baselines")
    args = ap.parse_args(argv)
    global DEV
    if not torch.cuda.is_available():
        from kernels.common.interpreter import active

        if not (args.small and active()):
            print("run_moe_mxfp4.py needs a CUDA GPU (sm_90: H100 or H200); without one only "
                  "`TRITON_INTERPRET=1 ... --small` runs (a smoke test)", file=sys.stderr)
            return 2
        DEV = "cpu"
    t_start = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    command = "python3 experiments/run_moe_mxfp4.py " + " ".join(sys.argv[1:] if argv is None else argv)
    prov = {f"prov_{k}": v for k, v in wb_provenance.flat(wb_provenance.collect()).items()}
    prov["prov_command"] = command

    # HBM bound: measured copy bandwidth (read + write counted).
    t_copy, copy_gbps = roofline.measure_copy(1 << 30 if DEV == "cuda" else 1 << 22, device=DEV, warmup_ms=30,
                                              rep_ms=200)
    log(f"device {prov['prov_device_name']}  copy bandwidth {copy_gbps:.0f} GB/s")
    if args.selection:   # the tables this process reads (the launcher's choice comes from them)
        from kernels.common import tables as wb_tables

        tuning = f"{wb_tables.user_root()} over {wb_tables.SHIPPED_ROOT}"
        prov["prov_tuning_tables"] = tuning
        log(f"tuning tables: {tuning}")

    models = list(dict.fromkeys(args.models)) if args.models else ([KIMI] if args.small else list(MODELS))
    peers, bad_total, frames = {}, 0, {}
    for name in models:
        use_model(name, small=args.small)
        m_list = tuple(args.m) if args.m else (M_LIST if args.small else measured_ms(args.quick, name))
        model_dir = out_dir if name == KIMI else out_dir / name
        model_dir.mkdir(parents=True, exist_ok=True)
        t_model = time.time()
        g = torch.Generator(device=DEV).manual_seed(SEED)
        w, w_scale = quantized_weights(g)
        w_bf16 = decoded_bf16(w, w_scale)
        # the weights as a loader keeps them: plain, and prepared once (not timed) at levels 2 and 3
        weights = {0: prepare_weights(w, w_scale, 0)}
        if prepackable():
            weights.update({lvl: prepare_weights(w, w_scale, lvl) for lvl in (2, 3)})
        peer, note = (None, "not a gpt-oss model") if not name.startswith("gpt-oss") else bl.gpt_oss_reference(w, w_scale)
        peers[name] = note
        log(f"{name}: weights ready ({time.time() - t_model:.0f} s; E={E} H={H} I={I} top_k={TOP_K}); "
            f"gpt-oss reference: {note}")
        ctx = Ctx(args, prov, copy_gbps, w, w_scale, w_bf16, torch.empty_like(w_bf16), weights, peer, note)
        rows, checks = run_model(ctx, m_list, g)
        df, ck = pd.DataFrame(rows), pd.DataFrame(checks)
        for col, val in prov.items():
            ck[col] = val
        ck["model"] = name
        df.to_csv(model_dir / "rows.csv", index=False)
        ck.to_csv(model_dir / "checks.csv", index=False)
        (model_dir / "info.json").write_text(json.dumps(
            {"command": command, "model": name, "copy_gbps": copy_gbps, "copy_timing": t_copy.as_row(), "E": E, "H": H,
             "I": I, "top_k": TOP_K, "M": list(m_list), "seed": SEED, "wall_s": time.time() - t_model,
             "gpt_oss_reference": note, "provenance": {k[5:]: v for k, v in prov.items()}}, indent=1, default=str))
        text = selection_summary(df) if args.selection else summary(df)
        (model_dir / "summary.md").write_text(f"command: `{command}`\n\nmodel: {name}\n\n{text}\n")
        print(f"{name}:\n{text}", flush=True)
        n_bad = int((~ck.ok.astype(bool)).sum()) if len(ck) else 0
        bad_total += n_bad
        frames[name] = df
        log(f"{name}: {len(ck) - n_bad}/{len(ck)} checks ok ({time.time() - t_model:.0f} s)")
        del ctx, w, w_scale, w_bf16, weights
        mx_launch.clear_plans()
        gc.collect()
        if DEV == "cuda":
            torch.cuda.empty_cache()
    (out_dir / "peers.json").write_text(json.dumps({"gpt-oss reference": peers, "command": command}, indent=1))
    if not args.selection:
        table = models_table(frames)
        table.to_csv(out_dir / "models.csv", index=False)
        print(table.to_string(float_format=lambda v: f"{v:.3g}"), flush=True)
    log(f"done in {time.time() - t_start:.0f} s; {bad_total} checks failed; wrote {out_dir}")
    return 1 if bad_total else 0


def models_table(frames: dict[str, pd.DataFrame]) -> pd.DataFrame:
    """One row per model, M and method: the prepacked default's time and fraction of the HBM bound,
    level 3's, the plain layout's, the user's loop (eager, graph, host time per call), and the
    bf16-weight and dequantize peers' times (ratios > 1: ours faster)."""
    out = []
    for model, df in frames.items():
        if df.empty:
            continue
        for (M, method), d in df.groupby(["M", "method"]):
            t = d.set_index("name").median_us
            bound = d.hbm_bound_us.iloc[0]
            loop = df[(df.M == M) & (df.name == "user loop")].set_index("method")
            row = dict(model=model, M=M, method=method, active_experts=int(d.active_experts.iloc[0]),
                       hbm_bound_us=bound)
            for col, name in (("prepacked_default_us", "prepacked default"), ("prepacked_l3_us", "prepacked L3"),
                              ("plain_default_us", "default"), ("bf16_grouped_mm_us", "bf16 grouped_mm"),
                              ("bf16_grouped_mm_gemm_only_us", "bf16 grouped_mm (gemm only)"),
                              ("dequant_grouped_mm_us", "dequant+grouped_mm"), ("gpt_oss_reference_us", "gpt-oss reference")):
                row[col] = t.get(name, float("nan"))
            best = min(row["prepacked_default_us"], row["prepacked_l3_us"])
            row["frac_hbm_bound"] = bound / row["prepacked_default_us"]
            row["frac_hbm_bound_l3"] = bound / row["prepacked_l3_us"]
            row["vs_bf16_grouped_mm"] = row["bf16_grouped_mm_us"] / best
            row["vs_dequant_grouped_mm"] = row["dequant_grouped_mm_us"] / best
            row["user_loop_eager_us"] = loop.median_us.get("eager", float("nan"))
            row["user_loop_graph_us"] = loop.median_us.get("graph", float("nan"))
            row["user_loop_eager_over_graph"] = row["user_loop_eager_us"] / row["user_loop_graph_us"]
            row["user_loop_host_us"] = loop.host_us.get("eager", float("nan"))
            out.append(row)
    return pd.DataFrame(out)


def selection_summary(df: pd.DataFrame) -> str:
    """--selection: per M, the launcher (tables, else cold) against the cold rule's config and the
    baselines, graph replay and eager."""
    lines = ["latency in us (L2 flushed), MXFP4 MoE down-projection, w4a16, prepared weights; launcher = no config "
             "(the selection layer: tuning table, else the cold rule)", ""]
    for method in ("graph", "eager"):
        g = df[df.method == method].pivot_table(index="M", columns="name", values="median_us")
        if g.empty or "launcher" not in g:
            continue
        cols = [c for c in ("launcher", "cold rule", "dequant+grouped_gemm", "dequant+grouped_mm", "bf16 grouped_gemm",
                            "bf16 grouped_mm (gemm only)") if c in g.columns]
        t = g[cols].copy()
        if "cold rule" in g:
            t["cold/launcher"] = g["cold rule"] / g["launcher"]
        for base in ("dequant+grouped_mm", "bf16 grouped_gemm", "bf16 grouped_mm (gemm only)"):
            if base in g:
                t[f"{base}/launcher"] = g[base] / g["launcher"]
        ours = df[(df.method == method) & (df.name == "launcher")].set_index("M")
        t["launcher/HBM bound"] = ours.hbm_bound_us / g["launcher"]
        t["source"] = ours.selected_source
        t["config"] = ours.config
        lines += [f"{method}:", "", t.to_string(float_format=lambda v: f"{v:.3g}"), ""]
    return "\n".join(lines)


def summary(df: pd.DataFrame) -> str:
    """Latency (us, graph replay) per M for the main variants and baselines, the goal ratios, and
    the user's loop eager against graph."""
    if df.empty:
        return "(no rows)"
    g = df[df.method == "graph"].pivot_table(index="M", columns="name", values="median_us")
    cols = [c for c in ("BM16 NT", "BM16", "BM32 NT", "BM32", "default", "default det", "a4w4 default",
                        "prepacked default", "prepacked L3", "dequant+grouped_gemm", "dequant+grouped_mm",
                        "bf16 grouped_gemm", "bf16 grouped_mm", "bf16 grouped_gemm (gemm only)", "gpt-oss reference")
            if c in g.columns]
    t = g[cols].copy()
    bound = df[(df.method == "graph") & (df.name == "default")].set_index("M").hbm_bound_us
    t["HBM bound"] = bound
    t["default/bound"] = bound / g["default"]
    for name, col in (("prepacked default", "prepacked/bound"), ("prepacked L3", "L3/bound")):
        if name in g:
            t[col] = bound / g[name]
    ours = g["prepacked default"] if "prepacked default" in g else g["default"]
    if "dequant+grouped_gemm" in g:
        t["speedup vs dequant+gg"] = g["dequant+grouped_gemm"] / ours
    if "bf16 grouped_mm" in g:
        t["vs bf16 grouped_mm"] = g["bf16 grouped_mm"] / ours
    variant_cols = [c for c in ("BM16 NT", "BM16", "BM32 NT", "BM32", "BM16 NT BN64", "BM64", "BM128", "BM128 BN256")
                    if c in g]
    if variant_cols:
        t["fastest variant"] = g[variant_cols].apply(lambda r: r.dropna().idxmin() if r.notna().any() else "", axis=1)
    text = ("latency in us (CUDA-graph replay, L2 flushed), w4a16 unless named; ratios > 1: ours (prepacked "
            "default where the shapes allow) faster\n\n" + t.to_string(float_format=lambda v: f"{v:.3g}"))
    loop = df[df.name.isin(["user loop", "user loop (torch routing)", "prepare_routing", "routing by torch ops"])]
    if not loop.empty:
        p = loop.pivot_table(index="M", columns=["name", "method"], values="median_us")
        p.columns = [f"{n} {m}" for n, m in p.columns]
        if {"user loop eager", "user loop graph"} <= set(p.columns):
            p["user loop eager/graph"] = p["user loop eager"] / p["user loop graph"]
        hosts = loop[loop.method == "eager"].pivot_table(index="M", columns="name", values="host_us")
        p = p.join(hosts.add_suffix(" host_us"))
        text += ("\n\nuser's loop (back to back, no flush, 4 routings in turn; us per call; host_us: host time per "
                 "call, 200 calls, no sync)\n\n" + p.to_string(float_format=lambda v: f"{v:.3g}"))
    return text


if __name__ == "__main__":
    sys.exit(main())
