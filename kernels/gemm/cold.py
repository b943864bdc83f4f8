"""The GEMM family's cold-start rule: the configuration ``matmul`` runs for a problem no tuning
table has and no one asked to tune (``kernels.gemm.select`` consults the tables first).

First the region table (``REGIONS``, fitted by ``experiments/fit_gemm_cold_rule.py`` on measured
candidates and shipped as ``cold_rule.json``) where it has the problem's region: its class region
(large unaligned, narrow-N or long-K problems, ``shape_class``), or the class's default where the
table has no fit points of the class (``UNFITTED``: large unaligned problems run our padded TMA
kernel), else its general region; else two rules, each where it was measured: large aligned 16-bit problems take the tiling study's
``tiling_rule``; everything else takes, of ``kernels.gemm.config.candidates``, the one the
cost model ``estimate_us`` says is fastest (constants ``COST``, fitted on the fit half of the
shape zoo by ``experiments/fit_gemm_heuristic.py``). fp32 at small M takes the FMA kernel,
few columns the narrow "tall" tile.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

from kernels.gemm.config import (
    _GLUON_COOP, _GLUON_PINGPONG, _STREAM_K_CONFIG, SMALL_M, TAIL_SPLIT, GemmConfig, _fit_smem, candidates,
    fma_config, smem_bytes, split_pieces,
)
from workbench.dtypes import element_size

# Earlier rule (before the shape zoo): per-tile rates fitted to the 35 shapes of
# results/gemm_tiling/ and a hand-made hand-over to the Gluon kernels; it ran
# 1.01-1.05x cuBLAS on its own 8 goal shapes and 0.58-0.96x on shapes it had not
# seen (16x4096x4096, 4000x3000x2000, 3072^3). The findings behind the fixed
# configurations kept below: 128x256x64 with 8 warps is the best large-shape
# tile; 128x128x64 wants a 6-deep pipeline; GROUP_M 8 is as good as any.
#

# What the model charges for work outside the tiles, from measured ceilings of an
# H200 (device-to-device copy, read + write; the zoo's first run:
# git show 28d4ba6:results/gemm_zoo/ceilings_run1.json):
HBM_GBPS = 4275.0
PAD_LAUNCH_US = 2.0  # one more kernel (the copy into an aligned buffer) in the stream

# Per candidate of ``candidates``: (TFLOP/s per program, GB/s per program, us per
# tile, us per launch, GB/s of the whole kernel streaming its operands), fitted by
# experiments/fit_gemm_heuristic.py to the fit half
# of the shape zoo (results/gemm_zoo/sweep.csv, CUDA-graph times); see
# ``estimate_us`` for the model. Candidates that were rarely the fastest were
# pruned first (the fit half's per-shape best loses 1% geomean without them);
# a candidate without constants is never chosen.
COST: dict[str, tuple[float, float, float, float, float]] = {
    "gl_pp": (7.48, 89.6, 1.58, 7.18, 4188),
    "swap_n64": (1.5, 104, 0, 8.14, 3413),
    "t128x256": (7.48, 77.4, 1.92, 7.26, 2267),
    "t64x128": (5.12, 89.6, 0, 8.05, 2978),
    "tall": (1.03, 20.8, 0.926, 5.46, 1726),
}


def _resident(cfg: GemmConfig, elem: int) -> int:
    """Programs of the split-K kernel one SM holds at once (shared memory decides)."""
    return max(1, min(4, SMEM_PER_SM // (smem_bytes(cfg, elem) + 1024)))


SMEM_PER_SM = 233472  # bytes of shared memory per SM on sm_90 (228 KiB)


def work_units(cfg: GemmConfig, M: int, N: int, K: int, dtype: torch.dtype, num_sms: int) -> dict:
    """The quantities the cost model counts for one config: rounds of programs
    over the SMs, one program's FLOP (whole tile) and bytes loaded (rows past the
    edge are not read) per round, and the fewest bytes the product moves."""
    elem = element_size(dtype)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    tiles = math.ceil(M / bm) * math.ceil(N / bn)
    k_steps = math.ceil(K / bk)
    pieces, per = split_pieces(k_steps, cfg.split_k) if cfg.split_k is not None else (1, k_steps)
    # Persistent kernels: programs beyond the SMs share them (two CTAs per SM run
    # at about half speed each), so rounds count tiles per SM; the split-K kernel's
    # programs are short and several fit on an SM at once.
    slots = num_sms * _resident(cfg, elem) if cfg.split_k is not None else num_sms
    programs = tiles * pieces
    rounds = programs / slots if cfg.stream_k else math.ceil(programs / slots)
    k_len = min(K, per * bk)
    return {"rounds": rounds, "flop": 2.0 * bm * bn * k_len, "bytes": (min(bm, M) + min(bn, N)) * k_len * elem,
            "partials": 2.0 * 4 * bm * bn * programs if pieces > 1 else 0.0, "programs": programs,
            "bytes_min": float(M * K + K * N + M * N) * elem}


def estimate_us(cfg: GemmConfig, M: int, N: int, K: int, dtype: torch.dtype, num_sms: int,
                const: tuple[float, ...], pad_bytes: float = 0.0) -> float:
    """Modelled time of ``cfg`` on an M x N x K product, with the candidate's
    constants ``(rate, bandwidth, per_tile, per_launch, stream)``::

        max(rounds * (max(flop / rate, bytes / bandwidth) + per_tile),
            fewest bytes / stream) + per_launch
          + (split-K partials + padding copies) / HBM bandwidth

    ``rounds`` counts wave quantisation (a last, partial round costs a whole one;
    stream-K's tail is spread, so there it is fractional); flop and bytes are one
    program's share of a round (its tile, over its K range); ``stream`` is the
    whole kernel's bandwidth (GB/s) when it only streams its operands through
    (small M); tf32 (fp32 inputs) runs at half the 16-bit rate. The extra terms
    use the measured copy bandwidth."""
    rate, bw, per_tile, per_launch, stream = const
    if dtype == torch.float32:
        rate = rate / 2
    w = work_units(cfg, M, N, K, dtype, num_sms)
    tile_us = max(w["flop"] / (rate * 1e6), w["bytes"] / (bw * 1e3)) + per_tile
    body = max(w["rounds"] * tile_us, w["bytes_min"] / (stream * 1e3))
    extra = (w["partials"] + 2.0 * pad_bytes) / (HBM_GBPS * 1e3) + (PAD_LAUNCH_US if pad_bytes else 0.0)
    return body + per_launch + extra


def pad_bytes(M: int, N: int, K: int, dtype: torch.dtype) -> float:
    """Bytes the padding copies read (and write again): A when its rows (K) are
    not 16-byte multiples, B when N's are not."""
    es = element_size(dtype)
    return (M * K * es if (K * es) % 16 else 0) + (K * N * es if (N * es) % 16 else 0)


# The tiling study's rule (run 5-12 goal tables: 8 large aligned shapes, 1.010-1.013x cuBLAS in every
# repeat) holds where it was measured: 16-bit operands TMA can address, M >= 512, N and K >= 2048.
# Per tile (BM, BN, BK, warps, stages): (per-SM TFLOP/s, fixed us per tile), least squares on 35
# shapes of results/gemm_tiling/rows.parquet; ping-pong / cooperative Gluon kernels and the
# stream-K tail for multi-round problems (see results/gemm_tiling/README.md).
TILING_DOMAIN = dict(min_m=512, min_n=2048, min_k=2048)
_TILING_TILES: dict[tuple[int, int, int, int, int], tuple[float, float]] = {
    (128, 256, 64, 8, 4): (5.54, 2.0),
    (128, 128, 64, 4, 6): (5.20, 0.6),
    (64, 128, 64, 4, 6): (4.40, 0.5),
    (128, 64, 64, 4, 4): (3.42, 0.8),
}
SK_MIN_ROUNDS = 12  # whole rounds of 128x256 tiles before the stream-K tail pays (variants.csv)
GLUON_PP_MIN_FILL = 0.99  # ping-pong where 128x128 tiles fill the last round this well
GLUON_SK_MIN_K = 8192  # with a long K the stream-K tail beats the cooperative Gluon kernel


def in_tiling_domain(M: int, N: int, K: int, dtype: torch.dtype, tma: bool, c_aligned: bool) -> bool:
    d = TILING_DOMAIN
    return (tma and c_aligned and dtype in (torch.bfloat16, torch.float16)
            and M >= d["min_m"] and N >= d["min_n"] and K >= d["min_k"])


def tiling_rule(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16, num_sms: int = 132,
                gluon: bool = True) -> GemmConfig:
    """The tiling study's choice: the cheapest of ``_TILING_TILES`` by rounds x (work / rate + fixed),
    handed to the Gluon kernels or the stream-K tail when the problem takes several rounds."""
    best, best_t = None, float("inf")
    for key, (rate, fixed) in _TILING_TILES.items():
        bm, bn, bk, w, st = key
        rounds = math.ceil(math.ceil(M / bm) * math.ceil(N / bn) / num_sms)
        t = rounds * (2.0 * bm * bn * max(K, 1) / (rate * 1e12) * 1e6 + fixed)
        if t < best_t:
            best, best_t = GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=st,
                                      tma_store=False, group_m=8,
                                      tail_split=TAIL_SPLIT if bm == 128 and bn >= 128 else 1), t
    tiles = math.ceil(M / best.block_m) * math.ceil(N / best.block_n)
    stream_k = best.block_n == 256 and tiles % num_sms and tiles // num_sms >= SK_MIN_ROUNDS
    big_tiles = math.ceil(M / 128) * math.ceil(N / 256)
    if gluon and big_tiles > num_sms and best.block_m == 128:
        pp_tiles = math.ceil(M / 128) * math.ceil(N / 128)
        pp_fill = pp_tiles / (math.ceil(pp_tiles / num_sms) * num_sms)   # last round's share of SMs busy
        if best.block_n == 128 or pp_fill >= GLUON_PP_MIN_FILL:
            return _GLUON_PINGPONG
        if best.block_n == 256 and not (stream_k and K >= GLUON_SK_MIN_K):
            return _GLUON_COOP
    if stream_k:
        best = _STREAM_K_CONFIG
    return _fit_smem(best, element_size(dtype))


def heuristic(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16, num_sms: int = 132,
              hopper: bool = True, gluon: bool = True, tma: bool = True, c_aligned: bool = True,
              b_kmajor: bool = False) -> GemmConfig:
    """The config ``matmul`` runs when none is given. Two rules, each where it was measured:
    large aligned 16-bit problems (``in_tiling_domain``) take the tiling study's ``tiling_rule``;
    everything else (small M, irregular and unaligned sizes, fp32) takes, of ``candidates``,
    the one ``estimate_us`` (constants ``COST``, fitted on the fit half of the shape zoo) says is
    fastest. ``tma=False``: some operand's rows are not 16-byte aligned (the candidates then
    copy it into an aligned buffer first, and the model charges the copy); ``gluon=False``
    keeps to the Triton kernels; ``c_aligned=False``: C's rows are not aligned (no TMA stores).
    fp32 with M <= ``FMA_MAX_M`` and B row-major takes the FMA kernel (``fma_config``), on any
    GPU and in the interpreter; ``b_kmajor``: B is a transposed view, K contiguous.
    16-bit products at most ``TALL_MAX_N`` wide with M > SMALL_M take the "tall" candidate."""
    if dtype == torch.float32 and M <= FMA_MAX_M and not b_kmajor:
        return fma_config(M, N, K, num_sms, b_kmajor)
    if not hopper:
        # Pointer path (interpreter, pre-Hopper): modest tiles.
        return GemmConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3, group_m=8)
    if in_tiling_domain(M, N, K, dtype, tma, c_aligned):
        return tiling_rule(M, N, K, dtype, num_sms, gluon)
    if N <= TALL_MAX_N and M > SMALL_M and dtype != torch.float32:
        return candidates(M, N, K, dtype, num_sms, aligned=tma, gluon=gluon, c_aligned=c_aligned)["tall"]
    return cost_model_rule(M, N, K, dtype, num_sms, gluon, tma, c_aligned)


# At most this many columns (and M > SMALL_M), 16-bit: the "tall" candidate (128 x 16 tiles), whose
# MMA does no work past N, where a 64-128 wide tile does 4-64x the useful work. On the fit half of
# the zoo (run 11's sweep) it was the fastest candidate on all three such shapes (512x8x4096,
# 5572x2x2160, 5787x8x80), while the cost model picked it on one; held out (one shape, 12075x8x896)
# it is the fastest there too, 15.5 us against 20.4 for the model's pick (gl_pp). From N = 32 the
# wider tiles won on the fit half (t128x64 at 8147x32x514 and 8303x48x880).
TALL_MAX_N = 16


def cost_model_rule(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16, num_sms: int = 132,
                    gluon: bool = True, tma: bool = True, c_aligned: bool = True) -> GemmConfig:
    """Of ``candidates``, the one the zoo-fitted cost model says is fastest."""
    extra = 0.0 if tma else pad_bytes(M, N, K, dtype)
    best, best_t = None, float("inf")
    for name, cfg in candidates(M, N, K, dtype, num_sms, aligned=tma, gluon=gluon, c_aligned=c_aligned).items():
        const = COST.get(name)
        if const is None:
            continue
        t = estimate_us(cfg, M, N, K, dtype, num_sms, const, extra)
        if t < best_t:
            best, best_t = cfg, t
    if best is None:  # no fitted constants (never in a release): the large-tile default
        best = candidates(M, N, K, dtype, num_sms, aligned=tma, gluon=False, c_aligned=c_aligned)["t128x256"]
    return best



# The rule (``heuristic``): fp32 with M <= FMA_MAX_M and B row-major runs the FMA kernel. Its
# modelled time is B's bytes at the copy bandwidth, ``fma_bound_us`` (B is read once; A and C
# are small). Measured on an H200 (results/gemm_zoo/gaps/fp32_small.csv, commit 2bb2790, the 8
# fp32 zoo shapes with M <= 64, both halves: the rule below was read off them, so fp32 has no
# clean held-out test): with B row-major, tl.dot tiles of 16 x 64 (M <= 16) and 32 x 128 ran
# 1.10-2.32x the split-K "swap" kernel (tf32) at M 1-19; at M = 64 they ran 0.79-0.80x of it,
# where FMA throughput, not B, bounds them (2*M*N*K FLOP at about 67 TFLOP/s is 25 us on
# 64x3584x3584; B takes 12). With B K-major the swap kernel reads B as it is and was faster at
# every M (0.3-0.9x for the FMA kernel). The outer-product form (block_m < 16) ran 1.3-2.6x
# slower than the 16 x 64 tl.dot tile at M 1-4: it stays an explicit config.
FMA_MAX_M = 32


def fma_bound_us(M: int, N: int, K: int) -> float:
    """The FMA kernel's modelled time: fp32 B (K x N) read once at HBM_GBPS."""
    return K * N * 4 / (HBM_GBPS * 1e3)



# --------------------------------------------------------------------------
# The region table: fitted on measured candidates (experiments/fit_gemm_cold_rule.py)
# --------------------------------------------------------------------------
RULE_PATH = Path(__file__).resolve().parent / "cold_rule.json"
# A rule file to use instead of the shipped one (a refit being tried before it ships: what
# ``experiments/tune_gpu.py`` points its checks at after refitting), read once at import.
RULE_ENV = "WORKBENCH_GEMM_COLD_RULE"
MAX_RULE_BYTES = 1 << 20


# Classes of problem the region table keys apart from the rest, each with levels of its own ahead
# of the general ones (issue 43's user tried them: our kernels won 2-4.5x on the first and lost on
# the other two, while the general regions, fitted on few or none of them, sent all three to cuBLAS):
#   bigpad: 16-bit, some operand's rows (A: K, B: N or K, C: N) not 16-byte multiples, so ours pad them
#           and TMA runs, while cuBLAS takes a slower unaligned kernel; M, N and K all >= BIG_MIN, or,
#           outside the narrow class, M >= BIG_MIN_M and 2 M N K >= BIG_FLOP (one of K, N small: on the
#           fit half one of ours ran 1.00-4.3x cuBLAS on all 11 such records; below it the
#           padding copies and cuBLAS's small-problem kernels make it a toss-up, 0.56-1.56x);
#   narrow: N <= NARROW_MAX_N with tall M (>= NARROW_MIN_M): few tiles across, many down;
#   longk:  K >= LONG_K_MIN with small M (above SMALL_M) and N: fewer 128x128 tiles than SMs, so the
#           work is in K (split-K or stream-K territory).
BIG_MIN = 1024
BIG_MIN_M = 512
BIG_FLOP = 1.5e9
NARROW_MAX_N = 1024
NARROW_MIN_M = 4096
LONG_K_MIN = 8192
# A class the table has no fit points of takes this (else the general regions serve). bigpad: the
# padded persistent TMA kernel, 128x256 tiles (measured 2.0-4.5x cuBLAS on the seven large
# unaligned shapes issue 43 reports, padding inside the timed call); the design rule is that the
# cold rule never gives the library a problem class where ours win.
UNFITTED = {"bigpad": "t128x256"}


def shape_class(M: int, N: int, K: int, dtype: torch.dtype, aligned: bool, num_sms: int) -> str | None:
    """'bigpad', 'narrow', 'longk' (see above), or None for the rest."""
    narrow = N <= NARROW_MAX_N and M >= NARROW_MIN_M
    if dtype != torch.float32 and not aligned and (
            min(M, N, K) >= BIG_MIN or (not narrow and M >= BIG_MIN_M and 2.0 * M * N * K >= BIG_FLOP)):
        return "bigpad"
    if narrow:
        return "narrow"
    if K >= LONG_K_MIN and M > SMALL_M and math.ceil(M / 128) * math.ceil(N / 128) < num_sms:
        return "longk"
    return None


def _rounds_class(M: int, N: int, num_sms: int) -> str:
    rounds = math.ceil(M / 128) * math.ceil(N / 256) / max(1, num_sms)
    return "r<1" if rounds < 1 else "r<4" if rounds < 4 else "r4+"


def class_regions(M: int, N: int, K: int, dtype: torch.dtype, aligned: bool, num_sms: int) -> list[str]:
    """The problem's class regions, most specific first: class, dtype, alignment, N at most 64 or
    more, and rounds of 128x256 tiles; class, dtype and alignment; the class alone ([] outside the
    classes). N's width splits the narrow class: on the fit half (H200) cuBLAS or the "tall" tile
    won at N <= 32, our 64- to 256-wide tiles by 1.2-2.4x at N 148-500 with unaligned rows."""
    cls = shape_class(M, N, K, dtype, aligned, num_sms)
    if cls is None:
        return []
    feats = [cls, "fp32" if dtype == torch.float32 else "16", "tma" if aligned else "pad",
             "n64" if N <= 64 else "n", _rounds_class(M, N, num_sms)]
    return [",".join(feats[:n]) for n in (5, 3, 1)]


def general_regions(M: int, N: int, K: int, dtype: torch.dtype, aligned: bool, num_sms: int) -> list[str]:
    """The coarse classes every problem has, the most specific first: dtype (16-bit or fp32),
    operands TMA-aligned or padded, N and K whole tiles (N % 128, K % 64) or ragged, M (<= 16,
    <= 64, <= 512, more), N <= 64, rounds of 128x256 tiles over the SMs (< 1, < 4, more) and K
    (>= 8192: long); then the same without K, and dtype, alignment, evenness and M alone."""
    dt = "fp32" if dtype == torch.float32 else "16"
    m = "m16" if M <= 16 else "m64" if M <= 64 else "m512" if M <= 512 else "mbig"
    # N and K whole tiles or not (on the fit half, 0.71-0.75x cuBLAS for the best of ours on large
    # ragged shapes against 0.99-1.01x on even ones, both GPUs). The cause is the rows' pitch, not
    # the edges: rows that are not 128-byte multiples cost our TMA loads 2.4-3.1 L2 requests per
    # box row and leave the kernel L2-request bound, while cuBLAS multicasts one operand over a
    # 2-CTA cluster; the same problems with padded rows ran level with cuBLAS
    # (results/gemm_selection/README.md, "the row pitch")
    even = "even" if N % 128 == 0 and K % 64 == 0 else "ragged"
    feats = [dt, "tma" if aligned else "pad", even, m, "n64" if N <= 64 else "n", _rounds_class(M, N, num_sms),
             "klong" if K >= 8192 else "k"]
    return [",".join(feats[:n]) for n in (7, 6, 4)]


def regions(M: int, N: int, K: int, dtype: torch.dtype, aligned: bool, num_sms: int) -> list[str]:
    """Every region of a problem the table may hold, the most specific first: its class regions
    (``class_regions``), then the general ones (``general_regions``). A region the fit saw too few
    shapes of holds the candidate with the best worst case over the shapes it saw
    (``experiments/fit_gemm_cold_rule.py``); one it saw none of is absent, and the next serves."""
    return (class_regions(M, N, K, dtype, aligned, num_sms)
            + general_regions(M, N, K, dtype, aligned, num_sms))


def region(M: int, N: int, K: int, dtype: torch.dtype, aligned: bool, num_sms: int) -> str:
    """The most specific of ``regions``."""
    return regions(M, N, K, dtype, aligned, num_sms)[0]


def region_pick(M: int, N: int, K: int, dtype: torch.dtype, aligned: bool, num_sms: int,
                table: dict[str, str] | None = None) -> tuple[str | None, str]:
    """(candidate, the region that named it) from the region table (``REGIONS`` unless ``table``):
    the problem's most specific class region the table has; else, for a class it has none of,
    ``UNFITTED``'s candidate for the class; else its most specific general region the table has.
    (None, "") when none applies (the cost model serves)."""
    table = REGIONS if table is None else table
    cls_regions = class_regions(M, N, K, dtype, aligned, num_sms)
    for r in cls_regions:
        if r in table:
            return table[r], r
    cls = cls_regions[-1] if cls_regions else None
    if cls in UNFITTED:
        return UNFITTED[cls], f"{cls} (no fit points: default)"
    for r in general_regions(M, N, K, dtype, aligned, num_sms):
        if r in table:
            return table[r], r
    return None, ""


def load_regions(path: Path = RULE_PATH) -> dict[str, str]:
    """region -> candidate name, from the fitted rule file (empty when absent, or when the fit kept
    the cost model). The file ships with the package; a damaged one is an error naming it."""
    if not path.is_file():
        return {}
    with open(path, "rb") as fh:
        raw = fh.read(MAX_RULE_BYTES + 1)
    try:
        doc = json.loads(raw) if len(raw) <= MAX_RULE_BYTES else None
    except ValueError:
        doc = None
    regions = doc.get("regions") if isinstance(doc, dict) else None
    if not isinstance(regions, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                for k, v in regions.items()):
        raise ValueError(f"{path}: not a GEMM cold rule (expected {{'regions': {{region: candidate}}}}); re-run "
                         f"experiments/fit_gemm_cold_rule.py --write-rule, or delete it to use the cost model")
    return dict(regions)


def _rule_path() -> Path:
    """``$WORKBENCH_GEMM_COLD_RULE`` when set (it must name a file: a typo is an error, not the
    shipped rule in disguise), else the shipped ``cold_rule.json``."""
    given = os.environ.get(RULE_ENV, "").strip()
    if not given:
        return RULE_PATH
    path = Path(given).expanduser()
    if not path.is_file():
        raise ValueError(f"{RULE_ENV}={given!r}: no such file; point it at a rule written by "
                         f"experiments/fit_gemm_cold_rule.py --write-rule, or unset it to use the shipped rule")
    return path


REGIONS = load_regions(_rule_path())
