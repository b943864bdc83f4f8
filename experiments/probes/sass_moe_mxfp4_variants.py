#!/usr/bin/env python3
"""Probe: SASS instructions per weight of the MXFP4 down-projection's variants (sm_90, cross-compiled).

No GPU needed: the yardstick for the cost of expanding the weights (issue 17).

For each variant (KIMI-K2.5 shapes: H = 7168, I = 512, top-9, w4a16, atomic epilogue) prints the
SASS instructions per thread divided by the weights each thread expands (BLOCK_N * I / threads),
by class, with registers, programs per SM and the shared-memory traffic (STS / LDS / BAR), for
the plain layout and the prepacked levels 1-3.

    python3 experiments/probes/sass_moe_mxfp4_variants.py [--csv out.csv]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from kernels.moe_mxfp4 import MoeMxfp4Config  # noqa: E402
from kernels.moe_mxfp4.launch import compile_for_target  # noqa: E402

C = MoeMxfp4Config
VARIANTS = {
    "default (BM16 BN64)": C(BLOCK_M=16, BLOCK_N=64),
    "BM16 BN64 prepack1": C(BLOCK_M=16, BLOCK_N=64, PREPACK=1),
    "BM16 BN64 prepack2": C(BLOCK_M=16, BLOCK_N=64, PREPACK=2),
    "BM16 BN64 prepack2 la1": C(BLOCK_M=16, BLOCK_N=64, PREPACK=2, LOAD_AHEAD=1),
    # PREPACK configs scale with one multiply per pair (ONE_MUL) when every scale byte is <= 128,
    # as for trained weights (compile_for_target's one_mul); the two-multiply path for comparison
    "BM16 BN64 prepack2 la1 2mul": C(BLOCK_M=16, BLOCK_N=64, PREPACK=2, LOAD_AHEAD=1, ONE_MUL=False),
    "BM16 BN64 prepack2 la1 sk2": C(BLOCK_M=16, BLOCK_N=64, PREPACK=2, LOAD_AHEAD=1, SPLIT_K=2),
    # level 3: the codes paired (K = j, K = 64 + j), so the bf16 activations are not split
    "BM16 BN64 prepack3 la1": C(BLOCK_M=16, BLOCK_N=64, PREPACK=3, LOAD_AHEAD=1),
    "BM16 BN64 prepack3 la1 2mul": C(BLOCK_M=16, BLOCK_N=64, PREPACK=3, LOAD_AHEAD=1, ONE_MUL=False),
    "BM16 BN128 prepack2": C(BLOCK_M=16, BLOCK_N=128, PREPACK=2),
    "BM32 BN64 prepack2": C(BLOCK_M=32, BLOCK_N=64, PREPACK=2),
    # the prepacked defaults at large M (config.py _BY_BLOCK_M_PREPACKED): the swapped kernel
    "BM64 BN64 prepack2 swap": C(BLOCK_M=64, BLOCK_N=64, SWAP_AB=True, NT=False, PREPACK=2),
    "BM128 BN64 prepack2 swap": C(BLOCK_M=128, BLOCK_N=64, SWAP_AB=True, NT=False, PREPACK=2),
    "BM32 BN64 prepack3": C(BLOCK_M=32, BLOCK_N=64, PREPACK=3),
    "BM64 BN64 prepack3 swap": C(BLOCK_M=64, BLOCK_N=64, SWAP_AB=True, NT=False, PREPACK=3),
    "BM128 BN128 prepack2 swap": C(BLOCK_M=128, BLOCK_N=128, SWAP_AB=True, NT=False, PREPACK=2),
    "BM128 BN128 prepack3 swap": C(BLOCK_M=128, BLOCK_N=128, SWAP_AB=True, NT=False, PREPACK=3),
}
CLASSES = {  # class -> opcode prefixes
    "bit ops (LOP3 SHF PRMT IMAD LEA IADD3 VIADD)": ("LOP3", "SHF", "PRMT", "IMAD", "LEA", "IADD3", "VIADD"),
    "HMUL2": ("HMUL2",),
    "ISETP+SEL": ("ISETP", "SEL"),
    "STS+LDS+BAR": ("STS", "LDS", "BAR"),
    "HGMMA+LDG": ("HGMMA", "LDG"),
}


def count(cfg: MoeMxfp4Config, cache: str, I: int = 512) -> dict:
    e = compile_for_target(cfg, cache_dir=cache)[0]
    ops = Counter(dict(e.opcodes("sass")[["opcode", "count"]].itertuples(index=False)))
    per_thread = cfg.BLOCK_N * I / cfg.SPLIT_K / (32 * cfg.num_warps)
    res = e.resources()
    row = {"config": cfg.label(), "instr": sum(ops.values()), "per_weight": sum(ops.values()) / per_thread}
    for cls, prefixes in CLASSES.items():
        row[cls] = sum(v for k, v in ops.items() if k.startswith(prefixes)) / per_thread
    row.update(registers=res["registers"], spills=res["spill_stores"], programs_per_sm=res["blocks_per_sm"],
               STS=ops["STS"], LDS=ops["LDS"], BAR=ops["BAR"])
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--csv", default=None)
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as cache:
        rows = {name: count(cfg, cache) for name, cfg in VARIANTS.items()}
    import pandas as pd

    df = pd.DataFrame.from_dict(rows, orient="index")
    with pd.option_context("display.width", 250, "display.max_columns", 30, "display.precision", 2):
        print(df.drop(columns=["config"]))
    if args.csv:
        df.to_csv(args.csv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
