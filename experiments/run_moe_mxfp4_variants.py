#!/usr/bin/env python3
"""MXFP4 MoE down-projection: one sweep over the kernel's variants (issue 17), bounded in time.

KIMI-K2.5 (385 experts, hidden 7168, intermediate 512, top-9, w4a16, atomic epilogue). For
every M in {4, 8, 16, 32, 64, 128, 256, 16384} and every variant (the heuristic's current
default, the default with LOAD_AHEAD 1-3, the prepacked default, and below large M other BM16
tiles, with the loads of later K steps issued ahead or prepacked weights), the sweep

1. checks the variant against the fp32 reference (output poisoned with NaN first; the bound
   of run_moe_mxfp4.py); a variant that fails is reported and not timed;
2. times it with CUDA-graph replay (L2 flushed before each replay) and eagerly (CUDA
   events, L2 flushed), next to the baselines (graph replay only): dequantize-then-our-
   grouped-GEMM and the bf16-weight grouped GEMM (the same pipelines as run_moe_mxfp4.py);
3. appends the rows to ``rows.csv`` after every point (a point = one M x callable x
   method), so a run that is stopped keeps what it measured.

Choice of a new default, fair: for each M range the fastest correct variant (graph replay)
at ONE fitting point, M in {4, 16, 64, 256} (ranges M <= 11, 12-47, 48-191, 192-4095); the
held-out M {8, 32, 128} are then scored with the pick of their range against the best
variant there (``regret``), and printed separately. M = 16384 keeps the BM128 default unless
one of its own LOAD_AHEAD variants is faster (no pick from the small-M table).

Prepacked variants (``PREPACK`` 1 to 3, issue 17): the same weights as ``Mxfp4Weights`` of
levels 1 to 3 (``prepare_weights``), made once before the sweep (not timed); same bytes, so the
same HBM bound. ``prepacked default`` is what a loader that prepacks gets at every M
(``default_config(..., prepacked=2)``: config.py's ``_BY_BLOCK_M_PREPACKED``, fit at M 4, 16,
64, 256 in the run of commit efb9efe); at large M (the heuristic's row tile 64 or 128: M =
16384 here) the sweep adds large-tile prepacked variants (BM64/BM128 with SWAP_AB) and the plain
layout's kernel with the prepacked default's tile, in place of the small-M tiles.
``prepacked_defaults.csv`` (and the summary) score that default at every M measured: against
the best variant there (``regret``; the held-out M 8, 32, 128 and 16384 are the test of the
fit), against the best prepacked variant, and against the plain default.

Time guard: ``--budget-s`` (default 320 s) stops starting new timings once spent (the rest is
written as skipped), and a watchdog (faulthandler, ``--point-timeout-s``) ends the process
with a traceback if one point hangs; rows.csv then holds every point measured before.

Writes under --out: rows.csv, checks.csv, picks.csv, prepacked_defaults.csv, summary.md,
run_log.txt, info.json.

    python3 experiments/run_moe_mxfp4_variants.py --out results/moe_mxfp4_variants
    python3 experiments/run_moe_mxfp4_variants.py --out results/moe_mxfp4/variants_prepack \
        --m 8 32 128 16384 --budget-s 200          # the prepacked defaults at the held-out M
    TRITON_INTERPRET=1 python3 experiments/run_moe_mxfp4_variants.py --out /tmp/v --small   # CPU smoke run

``--small``: E 6, H 128, I 128, top-3 (H and I allow the prepacked layout) at M 4, 8 and 100
(100 plays the large M: 50 rows per expert, the BM64/BM128 variants), about 3.5 minutes on two
CPU cores; timings mean nothing.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

import pandas as pd  # noqa: E402
import torch  # noqa: E402

import run_moe_mxfp4 as base  # noqa: E402
from kernels.moe_mxfp4 import MoeMxfp4Config, block_m_for, default_config, moe_mxfp4_down, prepare_routing  # noqa: E402
from kernels.moe_mxfp4.config import every_part_has_a_step  # noqa: E402
from kernels.moe_mxfp4 import baselines as bl  # noqa: E402
from kernels.moe_mxfp4 import dequantize_weights_bf16, metrics, prepare_weights  # noqa: E402
from kernels.common.plans import sm_count  # noqa: E402
from workbench import bench  # noqa: E402

M_LIST = (4, 8, 16, 32, 64, 128, 256, 16384)
FIT_M = (4, 16, 64, 256)
HELD_OUT_M = (8, 32, 128)
# (lowest M, highest M, fitting point) of each range the new default is picked for
RANGES = ((1, 11, 4), (12, 47, 16), (48, 191, 64), (192, 4095, 256))
# --small (Triton's interpreter): H and I of whole prepacked tiles (H % 64, I % 128: no padding)
SMALL = dict(base.SMALL, H=128, I=128)
SMALL_M = (4, 8, 100)
BASELINES = ("dequant+grouped_gemm", "bf16 grouped_gemm")
# --shape: other models' down-projections (E, H, I, top-k), where the output tiles per launch differ
# from KIMI-K2.5's by orders of magnitude (SPLIT_K's rule: config.split_k_for)
SHAPES = {"kimi-k2.5": dict(E=385, H=7168, I=512, TOP_K=9),
          "deepseek-v3": dict(E=256, H=7168, I=2048, TOP_K=8),
          "mixtral-8x7b": dict(E=8, H=4096, I=14336, TOP_K=2),
          # held out from SPLIT_K's rule 1 (then rule 2 was fit on all five above)
          "qwen3-235b-a22b": dict(E=128, H=4096, I=1536, TOP_K=8),
          "llama4-maverick": dict(E=128, H=5120, I=8192, TOP_K=1),
          # held out from rule 2 (config.split_k_for)
          "dbrx": dict(E=16, H=6144, I=10752, TOP_K=4),
          "phi3.5-moe": dict(E=16, H=4096, I=6400, TOP_K=2),
          "qwen2-57b-a14b": dict(E=64, H=3584, I=2560, TOP_K=8),
          "qwen3-30b-a3b": dict(E=128, H=2048, I=768, TOP_K=8),
          # issue 42: I = H = 2880 (not whole 128 x 64 tiles: the prepacked layouts pad I to 2944 and the
          # kernel's last K step reads I's tail; 23 steps of 128, unrolled, split raggedly at small M)
          "gpt-oss-120b": dict(E=128, H=2880, I=2880, TOP_K=4),
          "gpt-oss-20b": dict(E=32, H=2880, I=2880, TOP_K=4)}


def variants(M: int, top_k: int, E: int, I: int) -> dict[str, MoeMxfp4Config]:
    """name -> config (w4a16, atomic). Names are stable across M so that a pick can be applied."""
    d = default_config(M, top_k, E, I)
    v = {"default": d}
    for la in (1, 2, 3):
        v[f"default la{la}"] = d.replace(LOAD_AHEAD=la)
    # what moe_mxfp4_down(a, prepare_weights(w, w_scale), routing) runs with no config and no
    # tuning table (the selection layer's cold rule, its SPLIT_K too: default_config with H and the
    # SMs); passed explicitly, so that a tuning table on the machine does not replace it
    sms = sm_count(0) if torch.cuda.is_available() else 0
    pdef = v["prepacked default"] = default_config(M, top_k, E, I, prepacked=2, H=base.H, sms=sms)
    C = MoeMxfp4Config
    if is_large(M, top_k, E):
        # large M on the one prepacked layout: row tiles 64 and 128 need SWAP_AB (4 warps, BN % 64).
        # Cross-compiled for sm_90 (KIMI shapes): BM128 BN64 220 registers, no spills (2 programs
        # per SM); BM128 BN64 la1 and BM128 BN128 spill a little; BM64 BN64 126 registers (4 per SM).
        sw = dict(SWAP_AB=True, num_warps=4, BLOCK_K=128)
        v.update({
            "BM128 BN64 prepack1": C(BLOCK_M=128, BLOCK_N=64, NT=False, PREPACK=1, **sw),
            "BM128 BN64 prepack2": C(BLOCK_M=128, BLOCK_N=64, NT=False, PREPACK=2, **sw),
            "BM128 BN64 prepack2 la1": C(BLOCK_M=128, BLOCK_N=64, NT=False, PREPACK=2, LOAD_AHEAD=1, **sw),
            "BM128 BN64 prepack2 NT": C(BLOCK_M=128, BLOCK_N=64, NT=True, PREPACK=2, **sw),
            "BM128 BN128 prepack2": C(BLOCK_M=128, BLOCK_N=128, NT=False, PREPACK=2, **sw),
            "BM64 BN64 prepack2": C(BLOCK_M=64, BLOCK_N=64, NT=False, PREPACK=2, **sw),
            "BM64 BN128 prepack2": C(BLOCK_M=64, BLOCK_N=128, NT=False, PREPACK=2, **sw),
            "BM128 BN128 prepack2 2mul": C(BLOCK_M=128, BLOCK_N=128, NT=False, PREPACK=2, ONE_MUL=False, **sw),
            # level 3 (codes paired K = j, 64 + j: the activations meet the nibbles unsplit; cross-compiled
            # 4.16 SASS instructions per weight and no spills, against 5.16 and 4 spill stores at level 2)
            "BM128 BN128 prepack3": C(BLOCK_M=128, BLOCK_N=128, NT=False, PREPACK=3, **sw),
            "BM64 BN64 prepack3": C(BLOCK_M=64, BLOCK_N=64, NT=False, PREPACK=3, **sw),
            # the prepacked default's tile on the plain layout: what the layout alone changes
            "prepacked default tile, plain": pdef.replace(PREPACK=0),
            # issue 42: gpt-oss' 2880 rows at BN128 (the last tile's block past the rows masked off), its
            # 23 steps unrolled (cross-compiled: 255 registers, 38 spill stores) or as the loop
            "BM128 BN128 prepack2 loop": C(BLOCK_M=128, BLOCK_N=128, NT=False, PREPACK=2, UNROLL=False, **sw),
            # level 3 with loads ahead: cross-compiled at gpt-oss' shapes (23 steps unrolled), level 3 holds
            # far fewer registers than level 2 (BM128 BN64 la1 165 and 3 programs per SM against level 2's
            # 220 and 2 without loads ahead; BM64 BN64 la1 115 and 4 against 184 and 2). Measured at
            # gpt-oss-120b M = 8192: BM64 level 3 la1 7% ahead of the prepacked default, BM128 level 3 behind
            # (results/moe_mxfp4/level3_tiles/)
            "BM128 BN64 prepack3 la1": C(BLOCK_M=128, BLOCK_N=64, NT=False, PREPACK=3, LOAD_AHEAD=1, **sw),
            "BM128 BN64 prepack3": C(BLOCK_M=128, BLOCK_N=64, NT=False, PREPACK=3, **sw),
            "BM64 BN64 prepack3 la1": C(BLOCK_M=64, BLOCK_N=64, NT=False, PREPACK=3, LOAD_AHEAD=1, **sw),
        })
    else:
        # the prepacked default's K steps as a loop the compiler pipelines over num_stages (the
        # loads staged through shared memory: more bytes in flight without more registers)
        for st in (2, 3, 4):
            v[f"prepacked default loop s{st}"] = pdef.replace(UNROLL=False, LOAD_AHEAD=0, num_stages=st)
        v.update({
            # BM16 x BN64 (the current small-M default) with K steps of 256 (2 steps, 1 ahead: all
            # of K in flight) and BN128 / BN32 tiles (BN32 falls back to mma.sync with 2 warps)
            "BM16 BN64 BK256 la1": C(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, NT=True, LOAD_AHEAD=1),
            "BM16 BN128 la1": C(BLOCK_M=16, BLOCK_N=128, NT=True, LOAD_AHEAD=1),
            "BM16 BN128 la3": C(BLOCK_M=16, BLOCK_N=128, NT=True, LOAD_AHEAD=3),
            "BM16 BN32 w2": C(BLOCK_M=16, BLOCK_N=32, num_warps=2, NT=True),
            "BM16 BN32 w2 la3": C(BLOCK_M=16, BLOCK_N=32, num_warps=2, NT=True, LOAD_AHEAD=3),
            "BM16 BN64 w4 la3 noNT": C(BLOCK_M=16, BLOCK_N=64, NT=False, LOAD_AHEAD=3),
            "BM32 BN64 la3": C(BLOCK_M=32, BLOCK_N=64, NT=True, LOAD_AHEAD=3),
            # issue 17: weights prepacked in wgmma's register order (quant.prepack_mxfp4): level 1 has
            # no shared-memory pass and no per-scale compares (5.19 SASS instructions per weight at
            # BM16 x BN64 x BK128 against the default's 6.81), level 2 also stores the code bits so
            # that each bf16x2 pattern is one rotation and one mask (4.06; 66 registers, 7 programs/SM)
            "BM16 BN64 prepack1": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=1),
            "BM16 BN64 prepack2": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2),
            "BM16 BN64 prepack2 la1": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, LOAD_AHEAD=1),
            "BM16 BN128 prepack2": C(BLOCK_M=16, BLOCK_N=128, NT=True, PREPACK=2),
            "BM32 BN64 prepack2": C(BLOCK_M=32, BLOCK_N=64, NT=True, PREPACK=2),
            # more of each program's weights in flight on the prepacked layout (after the first
            # prepacked run: 49-62% of the HBM bound): loads of 2-3 K steps ahead, all of K=512 in
            # two steps, and 128 columns per program
            "BM16 BN64 prepack2 la2": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, LOAD_AHEAD=2),
            "BM16 BN64 prepack2 la3": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, LOAD_AHEAD=3),
            "BM16 BN64 BK256 prepack2 la1": C(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, NT=True, PREPACK=2,
                                              LOAD_AHEAD=1),
            "BM16 BN128 prepack2 la1": C(BLOCK_M=16, BLOCK_N=128, NT=True, PREPACK=2, LOAD_AHEAD=1),
            "BM16 BN128 prepack2 la3": C(BLOCK_M=16, BLOCK_N=128, NT=True, PREPACK=2, LOAD_AHEAD=3),
            # (while BM16 is the row tile, the prepacked default is "BM16 BN64 prepack2 la1": a repeat)
            # after 0.49-0.62 of the HBM bound (Nsight Compute at M 4 and 64: ALU the busiest pipe at
            # 59-66%, issue slots 60-68% busy, DRAM 51-55%; at M = 4 5.09 waves of programs):
            # the prepacked tiles above now scale each pair with one multiply (ONE_MUL; 3.31 SASS
            # instructions per weight against 4.06), "2mul" is the two-multiply path they ran with
            # before; SPLIT_K 2 / 4: more, shorter programs (each half or a quarter of I = 512)
            "BM16 BN64 prepack2 la1 2mul": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, LOAD_AHEAD=1, ONE_MUL=False),
            "BM16 BN64 prepack2 la1 sk1": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, LOAD_AHEAD=1),
            "BM16 BN64 prepack2 la1 sk2": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, LOAD_AHEAD=1, SPLIT_K=2),
            "BM16 BN64 prepack2 sk2": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, SPLIT_K=2),
            "BM16 BN64 prepack2 sk4": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, SPLIT_K=4),
            "BM16 BN64 prepack2 la1 sk4": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, LOAD_AHEAD=1, SPLIT_K=4),
            # a register cap for more programs per SM (79 registers, 6 per SM uncapped; 64: 8 per SM
            # with 4 spill stores; 72: 7 per SM with 5), cross-compiled for sm_90
            "BM16 BN64 prepack2 la1 r64": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, LOAD_AHEAD=1, maxnreg=64),
            "BM16 BN64 prepack2 la1 r72": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, LOAD_AHEAD=1, maxnreg=72),
            "BM16 BN64 prepack2 r64": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, maxnreg=64),
            "BM16 BN128 prepack2 la1 sk2": C(BLOCK_M=16, BLOCK_N=128, NT=True, PREPACK=2, LOAD_AHEAD=1, SPLIT_K=2),
            # level 3: each 128-K tile's codes paired (K = j, K = 64 + j) and its 4-byte register groups
            # stored whole, so neither the activations' even/odd split nor the weights' row regrouping
            # costs a PRMT (cross-compiled for sm_90: 3.06 SASS instructions per weight against 3.31 for
            # the prepacked default; 79 registers, 6 programs per SM; LOAD_AHEAD 0: 66 and 7; capped
            # at 64: 56 registers, 9 per SM, no spills; capped at 72 with LOAD_AHEAD 1: 7 per SM)
            "BM16 BN64 prepack3 la1": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=3, LOAD_AHEAD=1),
            "BM16 BN64 prepack3": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=3),
            "BM16 BN64 prepack3 r64": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=3, maxnreg=64),
            "BM16 BN64 prepack3 la1 r72": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=3, LOAD_AHEAD=1, maxnreg=72),
            # issue 42: N_TILES column tiles per program, one after the other (the routing's ids,
            # expert and weights loaded once; the next tile's first weights in flight under the
            # finished tile's atomics; N_TILES times fewer programs). Cross-compiled for sm_90 (with
            # the scale patterns' one mad per two bytes): 3.25 SASS instructions per weight at one
            # tile, 3.06 at two (94 registers, 5 programs per SM), 3.02 at two with LOAD_AHEAD 0
            # (76, 6 per SM); the column tiles (H / 64) must divide by N_TILES
            "BM16 BN64 prepack2 la1 tiles2": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, LOAD_AHEAD=1, N_TILES=2),
            "BM16 BN64 prepack2 tiles2": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, N_TILES=2),
            "BM16 BN64 prepack2 tiles4": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, N_TILES=4),
            "BM16 BN64 prepack3 tiles2": C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=3, N_TILES=2),
            # each activation tile serves 128 columns instead of 64 (half the activations' traffic per
            # weight); cross-compiled at gpt-oss' shapes: 92 registers, 5 programs per SM. Measured: behind the
            # 64-column default at every M timed (results/moe_mxfp4/level3_tiles/)
            "BM16 BN128 prepack3 la1": C(BLOCK_M=16, BLOCK_N=128, NT=True, PREPACK=3, LOAD_AHEAD=1),
        })
        # issue 42: ragged splits (gpt-oss' 23 K steps: 8 + 8 + 7, 6 x 3 + 5, 3 x 7 + 2), where every
        # part keeps a step
        steps = -(-I // 128)
        for sk in (3, 6, 8):
            if every_part_has_a_step(steps, sk):
                v[f"BM16 BN64 prepack2 la1 sk{sk}"] = C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=2, LOAD_AHEAD=1,
                                                        SPLIT_K=sk)
        if M * top_k >= E * 16:
            # issue 42: few experts, all active (gpt-oss-20b: 32 experts, 16-32 rows each from M = 128):
            # a 16- or 32-row tile expands each expert's weights once per row block, and with rows
            # spread unevenly most experts take two; a 64- or 128-row tile expands them once
            sw = dict(SWAP_AB=True, num_warps=4, BLOCK_K=128)
            for bm in (64, 128):
                for bn in (64, 128):
                    v[f"BM{bm} BN{bn} prepack2"] = C(BLOCK_M=bm, BLOCK_N=bn, NT=False, PREPACK=2, **sw)
            # (measured: 1.6-3.8x slower than BM16 / BM32 there.) The small tiles without the evict-first
            # hint: an expert's second row block, a neighbouring program, may then find its weights in L2
            v["BM16 BN64 prepack2 la1 noNT"] = C(BLOCK_M=16, BLOCK_N=64, NT=False, PREPACK=2, LOAD_AHEAD=1)
            v["BM32 BN64 prepack2 noNT"] = C(BLOCK_M=32, BLOCK_N=64, NT=False, PREPACK=2)
            v["BM32 BN64 prepack2 la1 noNT"] = C(BLOCK_M=32, BLOCK_N=64, NT=False, PREPACK=2, LOAD_AHEAD=1)
            # Level 3 at the larger tiles, with loads ahead (never timed there). Cross-compiled at gpt-oss'
            # shapes: BM64 BN64 level 3 113 registers (4 programs per SM), 115 with a step ahead, 127 with
            # two; level 2 151 (3 per SM) and 184 (2) with one. BM32 level 3 70-72 (7 per SM) against 94-105.
            for bm, la in ((32, 0), (32, 1), (64, 0), (64, 1), (64, 2), (128, 1)):
                v[f"BM{bm} BN64 prepack3{f' la{la}' if la else ''}"] = C(
                    BLOCK_M=bm, BLOCK_N=64, NT=bm < 64, PREPACK=3, LOAD_AHEAD=la,
                    **(dict(SWAP_AB=True, num_warps=4, BLOCK_K=128) if bm >= 64 else {}))
            # (measured, gpt-oss-20b at M 128-256: BM32 level 3 3-11% ahead of the prepacked default,
            # BM64 and BM128 behind.) With 32 rows, the activation tile is twice the weight tile's bytes
            # per step at 64 columns: 128 columns halve that (104 and 115 registers, 4 programs per SM;
            # measured: 1.23-1.27x slower than BM32 BN64 level 3 at M 128-256)
            for la in (0, 1):
                v[f"BM32 BN128 prepack3{f' la{la}' if la else ''}"] = C(BLOCK_M=32, BLOCK_N=128, NT=True, PREPACK=3,
                                                                       LOAD_AHEAD=la)
    return v


def is_large(M: int, top_k: int, E: int) -> bool:
    """Large M: the heuristic pads to 64- or 128-row tiles (more than 48 rows per expert)."""
    return block_m_for(M, top_k, E) >= 64


def range_of(M: int):
    for lo, hi, fit in RANGES:
        if lo <= M <= hi:
            return fit
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--budget-s", type=float, default=320.0, help="no new timing starts after this many seconds")
    ap.add_argument("--point-timeout-s", type=float, default=90.0, help="watchdog: one point longer than this ends the run")
    ap.add_argument("--rep-ms", type=float, default=25.0, help="timed milliseconds per callable and method")
    ap.add_argument("--m", type=int, nargs="*", default=None, help="token counts (default: all eight)")
    ap.add_argument("--small", action="store_true", help="tiny shapes in Triton's interpreter (no GPU): a smoke run")
    ap.add_argument("--shape", default="kimi-k2.5", choices=sorted(SHAPES),
                    help="the MoE layer (experts, hidden, intermediate, top-k); default KIMI-K2.5's")
    ap.add_argument("--only", default=None,
                    help="regular expression: time only the variants whose name matches (the defaults always run)")
    args = ap.parse_args(argv)
    only = re.compile(args.only[:200]) if args.only else None
    t0 = time.time()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    log_f = open(out_dir / "run_log.txt", "a")

    def log(msg: str) -> None:
        line = f"[{time.strftime('%H:%M:%S')} +{time.time() - t0:5.0f}s] {msg}"
        print(line, flush=True)
        log_f.write(line + "\n")
        log_f.flush()

    m_list = tuple(args.m) if args.m else M_LIST
    base.E, base.H, base.I, base.TOP_K = (SHAPES[args.shape][k] for k in ("E", "H", "I", "TOP_K"))
    if args.small:
        base.E, base.H, base.I, base.TOP_K = (SMALL[k] for k in ("E", "H", "I", "TOP_K"))
        m_list = tuple(args.m) if args.m else SMALL_M
    if not torch.cuda.is_available():
        from kernels.common.interpreter import active

        if not (args.small and active()):
            print("needs a CUDA GPU (sm_90); without one only `TRITON_INTERPRET=1 ... --small` runs", file=sys.stderr)
            return 2
        base.DEV = "cpu"
    E, H, I, TOP_K, DEV = base.E, base.H, base.I, base.TOP_K, base.DEV
    command = "python3 experiments/run_moe_mxfp4_variants.py " + " ".join(sys.argv[1:] if argv is None else argv)
    faulthandler.enable(file=sys.stderr)

    def arm(what: str):                 # the watchdog for one point
        faulthandler.cancel_dump_traceback_later()
        faulthandler.dump_traceback_later(args.point_timeout_s, exit=True)
        return what

    rows, checks = [], []

    def save():
        pd.DataFrame(rows).to_csv(out_dir / "rows.csv", index=False)
        pd.DataFrame(checks).to_csv(out_dir / "checks.csv", index=False)

    arm("copy")
    n = (1 << 30) // 4 if DEV == "cuda" else 1 << 16
    src = torch.randn(n, device=DEV)
    dst = torch.empty_like(src)
    copy_gbps = bench.measure(lambda: dst.copy_(src), warmup_ms=20, rep_ms=100, flush_l2=False).gbps(2 * n * 4)
    del src, dst
    log(f"copy bandwidth {copy_gbps:.0f} GB/s; shapes E={E} H={H} I={I} top_k={TOP_K}; M {m_list}")

    arm("weights")
    g = torch.Generator(device=DEV).manual_seed(base.SEED)
    w, w_scale = base.quantized_weights(g)
    w_bf16 = dequantize_weights_bf16(w, w_scale)
    w_buf = torch.empty_like(w_bf16)
    # the PREPACK variants read the same weights in quant.prepack_mxfp4's layouts (same bytes),
    # as a model loader keeps them: Mxfp4Weights, whose level the launcher checks against PREPACK
    packed = {lvl: prepare_weights(w, w_scale, lvl) for lvl in (0, 1, 2, 3)}
    log("weights ready")

    over = False
    for M in (M_LIST + tuple(m for m in m_list if m not in M_LIST)) if not args.small else m_list:
        ids, wts = base.route(M, g)     # every M draws, as in run_moe_mxfp4.py (same inputs per M)
        a = torch.randn(M * TOP_K, I, device=DEV, generator=g).bfloat16()
        if M not in m_list:
            continue
        arm(f"M={M} setup")
        srt = bl.sorted_rows(ids, E)
        active = int((srt.counts > 0).sum())
        ref, mag = base.reference(a.float(), w_bf16, ids, wts)
        routings = {}
        out = torch.empty(M, H, dtype=torch.bfloat16, device=DEV)
        splits = {1: (ref, mag)}

        def split_reference(n, bk):
            """(sum, magnitude bound) for SPLIT_K = n: each program's partial row (cdiv(steps, n)
            K steps of bk, the last part's ragged) is rounded and added on its own, so the bound's
            magnitudes are the partial rows' (cancelling halves can exceed the whole row's)."""
            if n == 1:
                return splits[1]
            if (n, bk) not in splits:
                splits[n, bk] = base.split_reference(a.float(), w_bf16, ids, wts, n, bk)
            return splits[n, bk]

        nbytes = metrics.hbm_bytes(M, TOP_K, H, I, active)
        bound_us = nbytes / (copy_gbps * 1e9) * 1e6
        fns = {}
        for name, cfg in variants(M, TOP_K, E, I).items():
            if only and not only.search(name) and name not in ("default", "prepacked default"):
                continue
            if args.small and not cfg.PREPACK:      # prepacked tiles are already the smallest allowed
                cfg = cfg.replace(BLOCK_N=32, BLOCK_K=32, num_warps=1)
            arm(f"M={M} {name} check")
            if cfg.BLOCK_M not in routings:
                routings[cfg.BLOCK_M] = prepare_routing(ids, wts, E, cfg.BLOCK_M)
            r = routings[cfg.BLOCK_M]

            def run(r=r, cfg=cfg, wq=packed[cfg.PREPACK]):
                return moe_mxfp4_down(a, wq, routing=r, config=cfg, out=out)

            try:
                run()
                out.fill_(float("nan"))
                # SPLIT_K adds partial rows, each rounded: more additions in the bound (the CPU tests
                # bound it rigorously with the partial rows' magnitudes)
                res = base.check(run(), *split_reference(cfg.SPLIT_K, cfg.BLOCK_K), slack=float(cfg.SPLIT_K))
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run is reported, the sweep goes on
                res = dict(ok=False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
            checks.append(dict(M=M, name=name, config=cfg.label(), prepack=cfg.PREPACK, **res))
            log(f"M={M} {name:24s} {cfg.label():60s} {'ok' if res['ok'] else 'FAILED ' + str(res)[:200]}")
            if res["ok"]:
                fns[name] = (run, cfg)
        save()
        base_fns = {"dequant+grouped_gemm": lambda: bl.dequant_grouped_gemm(a, w, w_scale, srt, wts, w_bf16_buf=w_buf),
                    "bf16 grouped_gemm": lambda: bl.bf16_grouped_gemm(a, w_bf16, srt, wts)}
        if DEV == "cpu":
            base_fns = {}
        # graph replay: variants, then baselines; then eager, the variants taking turns
        for name, (fn, cfg) in list(fns.items()) + [(k, (f, None)) for k, f in base_fns.items()]:
            if time.time() - t0 > args.budget_s:
                over = True
                rows.append(dict(M=M, name=name, method="graph", skipped="budget"))
                continue
            arm(f"M={M} {name} graph")
            try:
                t = bench.measure(fn, cuda_graph=True, flush_l2=True, warmup_ms=5, rep_ms=args.rep_ms,
                                  min_reps=5 if DEV == "cuda" else 1, max_reps=400)
            except Exception as exc:  # noqa: BLE001
                log(f"M={M} {name}: graph timing failed ({type(exc).__name__}: {str(exc)[:150]})")
                continue
            rows.append(dict(M=M, name=name, method="graph", kind="ours" if cfg else "baseline",
                             config=cfg.label() if cfg else "", load_ahead=cfg.LOAD_AHEAD if cfg else None,
                             prepack=cfg.PREPACK if cfg else None,
                             median_us=t.median_ms * 1e3, q25_us=t.q25_ms * 1e3, q75_us=t.q75_ms * 1e3, n_runs=t.n,
                             active_experts=active, hbm_bytes=nbytes, hbm_bound_us=bound_us,
                             frac_hbm_bound=bound_us / (t.median_ms * 1e3), copy_gbps=copy_gbps,
                             timing_method=t.method))
            save()
        if fns and time.time() - t0 <= args.budget_s:
            arm(f"M={M} eager")
            try:
                et = bench.interleave({k: f for k, (f, _) in fns.items()}, warmup_ms=10, rep_ms=args.rep_ms,
                                      min_reps=10 if DEV == "cuda" else 1, max_reps=100)
                for name, t in et.items():
                    cfg = fns[name][1]
                    rows.append(dict(M=M, name=name, method="eager", kind="ours", config=cfg.label(),
                                     load_ahead=cfg.LOAD_AHEAD, prepack=cfg.PREPACK, median_us=t.median_ms * 1e3,
                                     q25_us=t.q25_ms * 1e3,
                                     q75_us=t.q75_ms * 1e3, n_runs=t.n, active_experts=active, hbm_bytes=nbytes,
                                     hbm_bound_us=bound_us, frac_hbm_bound=bound_us / (t.median_ms * 1e3),
                                     copy_gbps=copy_gbps, timing_method=t.method))
            except Exception as exc:  # noqa: BLE001
                log(f"M={M}: eager timing failed ({type(exc).__name__}: {str(exc)[:150]})")
            save()
        elif fns:
            over = True
        log(f"M={M}: {len(fns)} variants correct of {len(variants(M, TOP_K, E, I))}; {active} experts routed")
        del ref, mag, routings, splits
    faulthandler.cancel_dump_traceback_later()
    save()
    text = summarize(pd.DataFrame(rows), pd.DataFrame(checks), out_dir)
    (out_dir / "summary.md").write_text(f"command: `{command}`\n\n{text}\n")
    (out_dir / "info.json").write_text(json.dumps(dict(command=command, copy_gbps=copy_gbps, E=E, H=H, I=I, top_k=TOP_K,
                                                       M=list(m_list), wall_s=time.time() - t0, budget_hit=over,
                                                       gpu_name=torch.cuda.get_device_name() if DEV == "cuda" else "cpu"),
                                                  indent=1))
    print(text)
    n_bad = sum(not c["ok"] for c in checks)
    log(f"done in {time.time() - t0:.0f} s; {len(checks) - n_bad}/{len(checks)} checks ok"
        f"{'; BUDGET HIT: some points skipped' if over else ''}; wrote {out_dir}")
    return 0


def role_of(M: int) -> str:
    return ("fit" if M in FIT_M else "held-out" if M in HELD_OUT_M
            else "held-out, large M" if is_large(M, base.TOP_K, base.E) else "not fit")


def summarize(df: pd.DataFrame, ck: pd.DataFrame, out_dir: Path) -> str:
    if df.empty or "median_us" not in df:
        return "no timings"
    df = df[df.median_us.notna()]
    gr = df[df.method == "graph"].pivot_table(index="M", columns="name", values="median_us")
    ea = df[df.method == "eager"].pivot_table(index="M", columns="name", values="median_us")
    bound = df[df.method == "graph"].groupby("M").hbm_bound_us.first()
    ours = [c for c in gr.columns if c not in BASELINES]
    # the layout a variant reads, from its config label (older rows.csv have no prepack column)
    labels = df[df.kind == "ours"].groupby("name").config.first()
    prepacked_names = {n for n, lab in labels.items() if "_prepack" in str(lab)}
    layouts = {"plain": ([c for c in ours if c not in prepacked_names], "default", "_BY_M_RANGE or _BY_BLOCK_M"),
               "prepacked": ([c for c in ours if c in prepacked_names], "prepacked default",
                             "_BY_BLOCK_M_PREPACKED")}
    lines = ["Latency in us, CUDA-graph replay, L2 flushed (eager in eager_table below).", "",
             "Every variant, graph (us):", "", gr.round(1).to_string(), "",
             "Every variant, eager (us):", "", ea.round(1).to_string() if not ea.empty else "(none)", ""]
    fmt = lambda v: f"{v:.3g}" if isinstance(v, float) else str(v)  # noqa: E731
    col = lambda M, name: gr.loc[M, name] if name in gr.columns else float("nan")  # noqa: E731

    def row(M, name, role, cands, default_name):
        t = col(M, name)
        d = col(M, default_name)
        best = gr.loc[M, cands].dropna()
        return dict(M=M, role=role, pick=name, pick_us=t, default_us=d, pick_vs_default=d / t,
                    hbm_bound_us=bound.get(M), pick_frac_bound=bound.get(M) / t, default_frac_bound=bound.get(M) / d,
                    best_variant=best.idxmin() if not best.empty else "",
                    best_us=best.min() if not best.empty else float("nan"),
                    regret=t / best.min() if not best.empty else float("nan"),
                    eager_us=ea.loc[M, name] if (M in ea.index and name in ea.columns) else float("nan"),
                    speedup_vs_dequant=col(M, BASELINES[0]) / t, vs_bf16_grouped_gemm=col(M, BASELINES[1]) / t)

    # picks, per layout (a loader keeps one): the fastest correct variant at each fitting M,
    # applied to its range; M = 16384 from its own variants (plain: the default's LOAD_AHEAD ones)
    prow = []
    for layout, (cands, default_name, table) in layouts.items():
        if not cands:
            continue
        picks = {}
        for lo, hi, fit in RANGES:
            if fit in gr.index:
                r = gr.loc[fit, cands].dropna()
                if not r.empty:
                    picks[fit] = r.idxmin()
        big = None
        if 16384 in gr.index:
            own = [c for c in cands if c.startswith("default")] if layout == "plain" else cands
            r = gr.loc[16384, own].dropna() if own else pd.Series(dtype=float)
            big = r.idxmin() if not r.empty else None
        for M in gr.index:
            fit = range_of(M)
            if M == 16384 or fit is None:
                if big is not None:
                    prow.append(dict(layout=layout, **row(M, big, "own variants", cands, default_name)))
            elif fit in picks:
                role = ("fit" if M in FIT_M else f"held-out (pick of M={fit})" if M in HELD_OUT_M
                        else f"range of M={fit}")
                prow.append(dict(layout=layout, **row(M, picks[fit], role, cands, default_name)))
    pk = pd.DataFrame(prow)
    pk.to_csv(out_dir / "picks.csv", index=False)
    no_fit = not any(M in gr.index for M in FIT_M)
    if no_fit:
        lines += ["No fitting M (4, 16, 64, 256) in this run: no new picks below M = 16384; the held-out M "
                  "score config.py's defaults (PREPACKED DEFAULTS below).", ""]
    if not pk.empty:
        for layout, (cands, default_name, table) in layouts.items():
            sel = pk[pk.layout == layout].drop(columns="layout")
            if sel.empty:
                continue
            fit_rows = sel[~sel.role.str.startswith("held-out")]
            held = sel[sel.role.str.startswith("held-out")]
            lines += [f"{layout.upper()} weights: new default per M range, picked among the {layout} layout's "
                      f"variants at M in {{4, 16, 64, 256}} only (ranges "
                      f"{', '.join(f'{lo}-{hi} <- M={f}' for lo, hi, f in RANGES)}); M = 16384 from its own "
                      f"variants; default = `{default_name}`:", "",
                      fit_rows.to_string(index=False, float_format=fmt) if not fit_rows.empty else "(none)", "",
                      "HELD-OUT M {8, 32, 128} (not used for the picks; regret = pick / best variant of the "
                      "layout at that M):", "",
                      held.to_string(index=False, float_format=fmt) if not held.empty
                      else "(no fitting M in this run)" if no_fit else "(none measured)", "",
                      f"To adopt: kernels/moe_mxfp4/config.py {table} from `pick`.", ""]

    # the prepacked defaults as config.py has them now (fit at M 4, 16, 64, 256 at commit efb9efe),
    # at every M measured: the held-out M are the test of that fit
    pre_rows = []
    pre_cands = layouts["prepacked"][0]
    for M in gr.index:
        t = col(M, "prepacked default")
        if t != t:                       # not measured at this M
            continue
        best = gr.loc[M, ours].dropna()
        best_pre = gr.loc[M, pre_cands].dropna()
        cfg = df[(df.M == M) & (df.name == "prepacked default")].config.iloc[0]
        pre_rows.append(dict(
            M=M, role=role_of(M), config=cfg, prepacked_default_us=t,
            best_variant=best.idxmin(), best_us=best.min(), regret=t / best.min(),
            best_prepacked=best_pre.idxmin(), regret_prepacked=t / best_pre.min(),
            plain_default_us=col(M, "default"), vs_plain_default=col(M, "default") / t,
            hbm_bound_us=bound.get(M), frac_bound=bound.get(M) / t,
            eager_us=ea.loc[M, "prepacked default"] if (M in ea.index and "prepacked default" in ea.columns)
            else float("nan"),
            speedup_vs_dequant=col(M, BASELINES[0]) / t, vs_bf16_grouped_gemm=col(M, BASELINES[1]) / t))
    pre = pd.DataFrame(pre_rows)
    pre.to_csv(out_dir / "prepacked_defaults.csv", index=False)
    if not pre.empty:
        lines += ["PREPACKED DEFAULTS (config.py _BY_BLOCK_M_PREPACKED: what moe_mxfp4_down(a, prepare_weights(w, "
                  "w_scale), routing) runs; fit at M 4, 16, 64, 256 at commit efb9efe) at every M measured; "
                  "regret = prepacked default / best variant at that M (any layout), regret_prepacked = / best "
                  "prepacked variant, vs_plain_default = plain default / prepacked default (> 1: prepacking pays):",
                  "", pre.drop(columns="config").to_string(index=False, float_format=fmt), "",
                  "configs: " + "; ".join(f"M={r.M}: {r.config}" for r in pre.itertuples()), ""]
    lines += ["Goal: frac_bound >= 0.75 at M 4-256, speedup_vs_dequant >= 2, at 16384 vs_bf16_grouped_gemm >= 0.85."]
    bad = ck[~ck.ok] if not ck.empty else ck
    lines += ["", f"checks: {len(ck) - len(bad)}/{len(ck)} ok" + ("" if bad.empty else "; FAILED: " +
                                                                   ", ".join(f"M={r.M} {r.name}" for r in bad.itertuples()))]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
