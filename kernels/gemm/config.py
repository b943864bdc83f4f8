"""Configurations of the GEMM family, their validation, and the heuristic.

``GemmConfig``: every knob of the Triton kernel (``kernels.gemm.triton``), and
with ``gluon="pingpong"|"coop"`` the Gluon kernel's (``kernels.gemm.gluon``),
which ``WsConfig`` describes in that kernel's own terms; ``fma=True`` runs the
fp32 small-M kernel on the FMA units (``fma_config``). ``heuristic`` is the
config ``matmul`` runs when none is given; ``stream_k_plan`` splits the last
round of tiles along K.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Mapping

import torch

from kernels.common.configs import config_of
from workbench.asm.resources import smem_per_block
from workbench.dtypes import element_size

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMEM_LIMIT_SM90 = smem_per_block(90)  # bytes of shared memory one block may use on sm_90

@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Every knob of the kernel. ``None`` means "decide from the device"."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    num_sms: int | None = None  # programs launched; None = every SM
    tma: bool | None = None  # None = TMA when the device and operands allow it
    warp_specialize: bool = False  # Hopper: needs tma_store=False and flatten=False
    tma_store: bool = True  # TMA path: store C through a descriptor (else plain stores)
    epilogue_split: int = 1  # 1 or 2 (descriptor stores only)
    flatten: bool = True
    stream_k: bool = False  # TMA path: split the last wave's tiles along K over every SM
    # TMA path: the last, partial round's tiles run as up to this many column slices each
    # (BLOCK_N / tail_split wide; 1, 2 or 4), so they take that many more SMs and less time
    # each. Nothing to add up: each slice is a whole output block (unlike stream-K's pieces).
    tail_split: int = 1
    # TMA path: tiles block_n + extra_n columns wide (extra_n 0, or a power of two from 16 up to
    # block_n), run as two MMAs per K-step that share A's tile: widths between the powers of
    # two, so a 1-3 round problem can be cut into tiles that fill the SMs (cuBLAS picks such
    # widths: 144, 232, ...). Plain stores for the extra columns. Measured on an H200 the second
    # MMA runs far below the first's rate (results/gemm_zoo/gaps/wide.csv): no rule picks it.
    extra_n: int = 0
    # "pingpong" or "coop": run the Gluon warp-specialised kernel (kernels.gemm.gluon)
    # with this tile, stages, group and SM count; num_warps and the other
    # Triton-kernel knobs do not apply (4 warps per consumer warpgroup there).
    gluon: str | None = None
    # An int runs the split-K kernel (``_gemm_splitk_kernel``: one program per tile
    # and K piece, not persistent) with this many K pieces (1: no split); None: the
    # persistent kernel. swap_ab (split-K kernel only): compute C^T = B^T A^T, the
    # short M side as the MMA's narrow N.
    split_k: int | None = None
    swap_ab: bool = False
    # Copy an operand whose rows TMA cannot address (row stride not a multiple of 16
    # bytes, e.g. K or N odd in bf16; or not unit-stride) into a fresh aligned buffer
    # first, so the TMA kernels run on it instead of the pointer kernel.
    pad: bool = False
    # Copy a row-major B K-major before the persistent TMA kernel (one pass over B):
    # tf32 wgmma reads B only K-major, and Triton otherwise moves each B tile through
    # registers, which serialises the pipeline. None: for fp32 only. A K-major B (a
    # transposed view such as ``x @ w.t()``) runs as it is, with or without this.
    transpose_b: bool | None = None
    # fp32 only: run ``_gemm_fma_kernel`` (FMA units, true fp32 products, no tensor cores),
    # the small-M path, bound by reading B once. block_m < 16: one outer product per row of
    # B (block_k rows unrolled per K-step); block_m >= 16: tl.dot in ieee precision.
    # split_k: K pieces, as for the split-K kernel; None: ``fma_split`` decides per device.
    fma: bool = False

    def label(self) -> str:
        if self.gluon:
            return self.ws_config().label().replace("ws ", "gl-pp ").replace("coop ", "gl-coop ")
        width = f"{self.block_n}+{self.extra_n}" if self.extra_n else f"{self.block_n}"
        s = f"{self.block_m}x{width}x{self.block_k} w{self.num_warps} s{self.num_stages} g{self.group_m}"
        if self.num_sms is not None:
            s += f" sm{self.num_sms}"
        if self.warp_specialize:
            s += " ws"
        if not self.tma_store:
            s += " st"
        if self.epilogue_split != 1:
            s += f" e{self.epilogue_split}"
        if not self.flatten:
            s += " nf"
        if self.tma is False:
            s += " ptr"
        if self.stream_k:
            s += " sk"
        if self.tail_split != 1:
            s += f" ts{self.tail_split}"
        if self.split_k is not None:
            s += f" k{self.split_k}"
        if self.swap_ab:
            s += " swap"
        if self.pad:
            s += " pad"
        if self.transpose_b is not None:
            s += " tb" if self.transpose_b else " ntb"
        if self.fma:
            s += " fma"
        return s

    def as_params(self) -> dict:
        return dataclasses.asdict(self)

    def ws_config(self):
        """The kernels.gemm.gluon configuration of a ``gluon`` config."""
        return WsConfig(block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                                num_stages=self.num_stages, group_m=self.group_m, num_sms=self.num_sms,
                                cooperative=self.gluon == "coop")


PARAMS = GemmConfig().as_params()  # the names a sweep grid may use, with defaults


class FlatKnobs:
    """For a variant's config (``kernels.gemm.variants``) whose knobs are some of ``GemmConfig``'s:
    its flat form (with the fields the variant implies, ``FLAT``), and through it the label and
    the validation every GemmConfig gets."""

    FLAT: dict = {}

    def flat(self) -> GemmConfig:
        return GemmConfig(**dataclasses.asdict(self), **self.FLAT)

    def label(self) -> str:
        return self.flat().label()

    def validate(self):
        validate_config(self.flat())
        return self


def _as_config(config: GemmConfig | Mapping[str, Any] | None) -> GemmConfig | None:
    return config_of(config, GemmConfig, "gemm")


def smem_bytes(config: GemmConfig, elem_bytes: int = 2, tma: bool = True) -> int:
    """Shared memory the config asks for: the pipeline's A and B stages plus,
    on the TMA path, the epilogue's staging buffer for C."""
    if isinstance(config, WsConfig):
        return ws_smem_bytes(config, elem_bytes)
    c = _as_config(config)
    if c.gluon:   # the Gluon kernel's ring, C buffers, barriers and partition state
        return ws_smem_bytes(c.ws_config(), elem_bytes)
    if c.fma:   # outer products in registers; tl.dot (block_m >= 16) stages A and B tiles
        return 0 if c.block_m < 16 else (c.block_m * c.block_k + c.block_k * c.block_n) * elem_bytes * c.num_stages
    stages = (c.block_m * c.block_k + c.block_k * (c.block_n + c.extra_n)) * elem_bytes * c.num_stages
    if elem_bytes == 4 and (c.transpose_b is False or c.split_k is not None):
        # tf32 wgmma reads both operands K-major: with B N-major in memory Triton copies
        # each B tile into one more shared buffer (seen on an H200: 128x256x64, 2 stages,
        # asked for 196,608 + 65,560 bytes). The persistent kernel copies B K-major first
        # instead (``transpose_b``), unless told not to.
        stages += c.block_k * c.block_n * elem_bytes
    if c.split_k is not None:  # plain stores; swap_ab transposes the fp32 tile through shared memory
        return stages + (c.block_m * c.block_n * 4 if c.swap_ab else 0)
    if elem_bytes == 4 and not (tma and c.tma_store):
        # fp32 C by plain stores: the accumulator is re-laid out through shared memory
        # (sm_90 cross-compiles, 8 warps: 128x128 +65,568 bytes, 128x256 +131,096)
        return stages + c.block_m * c.block_n * 4
    epilogue = c.block_m * c.block_n * elem_bytes // c.epilogue_split if tma and c.tma_store else 0
    return stages + epilogue


def validate_config(c: GemmConfig) -> None:
    if not isinstance(c.fma, bool):
        raise ValueError(f"gemm: fma={c.fma!r} must be True (the fp32 FMA kernel) or False")
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(c, name)
        lo = 1 if c.fma and name != "block_n" else 16   # the FMA kernel takes short M blocks and K-steps
        if not isinstance(v, int) or v < lo or v > 1024 or v & (v - 1):  # bounded: specs set these
            raise ValueError(f"gemm: {name}={v!r} must be a power of two from {lo} to 1024")
    if c.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"gemm: num_warps={c.num_warps!r} must be 1, 2, 4, 8 or 16")
    if not isinstance(c.num_stages, int) or not 1 <= c.num_stages <= 32:
        raise ValueError(f"gemm: num_stages={c.num_stages!r} must be an int from 1 to 32")
    if not isinstance(c.group_m, int) or c.group_m < 1:
        raise ValueError(f"gemm: group_m={c.group_m!r} must be an int >= 1")
    if c.num_sms is not None and (not isinstance(c.num_sms, int) or not 1 <= c.num_sms <= 4096):
        raise ValueError(f"gemm: num_sms={c.num_sms!r} must be None or an int from 1 to 4096")
    if c.epilogue_split not in (1, 2):
        raise ValueError(f"gemm: epilogue_split={c.epilogue_split!r} must be 1 or 2")
    if c.fma:   # before the other kernels' rules: it names every knob it cannot take
        _validate_fma(c)
    if c.tail_split not in (1, 2, 4):
        raise ValueError(f"gemm: tail_split={c.tail_split!r} must be 1, 2 or 4")
    if c.tail_split != 1 and c.block_n // c.tail_split < 16:
        raise ValueError(f"gemm: tail_split={c.tail_split} needs block_n / tail_split >= 16 (block_n={c.block_n})")
    if not isinstance(c.extra_n, int) or isinstance(c.extra_n, bool) or (
            c.extra_n and (c.extra_n < 16 or c.extra_n > c.block_n or c.extra_n & (c.extra_n - 1))):
        raise ValueError(f"gemm: extra_n={c.extra_n!r} must be 0 or a power of two from 16 to block_n "
                         f"({c.block_n})")
    # Both live in the persistent TMA kernel's own loops (and not together).
    for knob, other, on in (("tail_split", "extra_n", c.tail_split != 1), ("extra_n", "tail_split", c.extra_n != 0)):
        if on and (c.stream_k or c.warp_specialize or c.tma is False or c.gluon or c.split_k is not None or c.fma
                   or (c.tail_split != 1 and c.extra_n)):
            raise ValueError(f"gemm: {knob} runs on the persistent TMA kernel without stream_k, {other}, warp "
                             "specialisation, split_k, gluon or fma")
    if c.stream_k and (c.warp_specialize or c.tma is False):
        raise ValueError("gemm: stream_k=True runs on the TMA path without warp specialisation "
                         "(set tma=None or True and warp_specialize=False)")
    if c.gluon is not None:
        if c.gluon not in GLUON_SCHEDULES:
            raise ValueError(f"gemm: gluon={c.gluon!r} must be None (the Triton kernel) or one of {GLUON_SCHEDULES}")
        if c.stream_k or c.warp_specialize or c.tma is False:
            raise ValueError("gemm: gluon configs run kernels.gemm.gluon (TMA, its own warp specialisation, no "
                             "stream-K): leave stream_k, warp_specialize and tma at their defaults")
        validate_ws(c.ws_config())
    if c.split_k is not None:
        if not isinstance(c.split_k, int) or isinstance(c.split_k, bool) or c.split_k < 1:
            raise ValueError(f"gemm: split_k={c.split_k!r} must be None (the persistent kernel) or an int >= 1")
        if c.stream_k or c.gluon or c.warp_specialize:
            raise ValueError("gemm: split_k runs its own kernel (kernels.gemm.triton._gemm_splitk_kernel): "
                             "leave stream_k, gluon and warp_specialize at their defaults")
    if c.transpose_b not in (None, True, False):
        raise ValueError(f"gemm: transpose_b={c.transpose_b!r} must be None (fp32 only), True or False")
    if c.transpose_b and (c.split_k is not None or c.gluon):
        raise ValueError("gemm: transpose_b=True belongs to the persistent Triton kernel; leave split_k and "
                         "gluon at None")
    if c.swap_ab and c.split_k is None:
        raise ValueError("gemm: swap_ab=True belongs to the split-K kernel; set split_k (1 = no split) too")
    if c.swap_ab and c.block_n < 64:
        raise ValueError(f"gemm: swap_ab=True makes block_n the MMA's M side, which needs block_n >= 64, "
                         f"got {c.block_n}")
    if c.warp_specialize and (c.tma_store or c.flatten):
        raise ValueError("gemm: warp_specialize=True needs tma_store=False and flatten=False (Triton 3.6's "
                         "Hopper warp specialisation rejects descriptor stores and flattened loops)")


GLUON_SCHEDULES = ("pingpong", "coop")
FMA_MAX_UNROLL = 32  # block_k of the outer-product form (block_m < 16): rows of B unrolled per K-step


def _validate_fma(c: GemmConfig) -> None:
    """The knobs the FMA kernel (``_gemm_fma_kernel``) cannot take."""
    other = [name for name, v in (("gluon", c.gluon), ("stream_k", c.stream_k), ("warp_specialize", c.warp_specialize),
                                  ("swap_ab", c.swap_ab), ("tma", c.tma), ("pad", c.pad), ("transpose_b", c.transpose_b))
             if v]
    if other:
        raise ValueError(f"gemm: fma=True runs kernels.gemm.triton._gemm_fma_kernel (pointer loads, FMA units, no "
                         f"tensor cores), which takes none of {', '.join(other)}: leave them at their defaults")
    if c.block_m < 16 and c.block_k > FMA_MAX_UNROLL:
        raise ValueError(f"gemm: fma=True with block_m={c.block_m} (< 16: one outer product per row of B, block_k "
                         f"rows unrolled per K-step) needs block_k <= {FMA_MAX_UNROLL}, got {c.block_k}")
    if c.block_m >= 16 and c.block_k < 16:
        raise ValueError(f"gemm: fma=True with block_m={c.block_m} (>= 16: tl.dot in ieee precision) needs "
                         f"block_k >= 16, got {c.block_k}; or take block_m < 16")


def _refuse_ws_on_gpu() -> None:
    # Seen on an H200 (2026-11-21, Triton 3.6.0): the warp-specialised
    # persistent kernel compiles (12 warps, setmaxnreg) but never finishes.
    if os.environ.get("WORKBENCH_ALLOW_WS", "0") != "1":
        raise ValueError("gemm: warp_specialize=True hung the GPU with Triton 3.6 on an H200 (the kernel never "
                         "finished); set WORKBENCH_ALLOW_WS=1 to run it anyway (interpreter runs are fine)")


# --------------------------------------------------------------------------
# Configurations the candidates share (the cold rule, kernels.gemm.cold, picks among them)
# --------------------------------------------------------------------------
# The findings behind the fixed configurations kept below: 128x256x64 with 8 warps is the
# best large-shape tile; 128x128x64 wants a 6-deep pipeline; GROUP_M 8 is as good as any.
#
# Stream-K tail (`stream_k_plan`) for big problems: the goal-shape table of
# results/gemm_tiling/variants.csv (H200, 2026-11-21, cuBLAS in the same run)
# measured it +1.5-2% on 8192^3 (15 whole rounds of 128x256 tiles + 68 of 132
# SMs' worth), +0.6-1.1% on 8192x28672x8192 (54 rounds), +0.7% on
# 16384x3584x8192 (13 rounds), and -8% on 4096^3 (3 rounds), -11% on
# 2048x7168x2048 (6 rounds), -20 to -38% when every tile is split (fewer tiles
# than SMs): a split tile costs a pipeline refill, a partial written and read
# back, and staggered K positions across SMs, which only a long run of whole
# rounds pays for. Best there: 3 stages with C through TMA stores in two halves.
# (On the shape zoo it was the fastest candidate on 2 of 96 shapes and was pruned.)

# Gluon warp-specialised kernels (kernels.gemm.gluon): a producer warp feeds the
# consumers through an mbarrier ring, so a tile's epilogue overlaps loads (coop)
# or another tile's mainloop (ping-pong). The goal-shape probe
# (results/gemm_tiling/ws_probe_run9a.csv, H200, cuBLAS in the same run) put them
# ahead of this module's Triton kernel wherever a problem takes several rounds
# of tiles: 4096x14336x4096 0.984 -> 1.002 (ping-pong) / 0.995 (coop),
# 16384x3584x8192 0.982 -> 0.996 (coop), 4096^3 0.992 -> 0.999 (coop),
# 2048x7168x2048 1.034 -> 1.054 (ping-pong); 8192^3 1.034 -> 1.027 (coop; the
# stream-K tail is worth more there). With a round or less of tiles the Triton
# kernel stays ahead (512x4096x7168: 1.002 vs 0.961; 1024x4096x14336: 1.002 vs
# 0.997): a warp-specialised CTA has no second tile to overlap with.
# Which one (goal table run 9b, three repeats): ping-pong (128x128 tiles) where
# Triton's own pick is 128x128, or where 128x128 tiles fill the last round
# (8192x28672x8192: 1.018 vs coop 1.009); the Triton stream-K kernel where it
# applies with a long K (8192^3: 1.030 vs coop 1.019; the split tiles' partial
# sums are paid back over K, while a hidden epilogue is worth less the longer
# the mainloop); else cooperative 128x256 tiles (4096^3, 4096x14336x4096).
_GLUON_PINGPONG = GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=5, group_m=8, num_warps=4,
                             gluon="pingpong")
_GLUON_COOP = GemmConfig(block_m=128, block_n=256, block_k=32, num_stages=6, group_m=8, num_warps=8,
                         gluon="coop")
_STREAM_K_CONFIG = GemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, group_m=8,
                              tma_store=True, epilogue_split=2, stream_k=True)
# The same schedule on 128x128 tiles (twice the tiles: a finer last round), 5 stages as the
# 128x128 persistent tile likes them deep; a candidate only, for the tuner (not yet measured).
_STREAM_K_128 = GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=5, group_m=8,
                           tma_store=True, epilogue_split=2, stream_k=True)
SK_LONG_K_STEPS = 64  # K-steps of 64 from which stream-K over every tile is a candidate (K >= 4096)


def _fit_smem(cfg: GemmConfig, elem_bytes: int, limit: int = SMEM_LIMIT_SM90) -> GemmConfig:
    """Shrink a config until its shared memory fits (wider types need it):
    split the epilogue, then fewer stages down to 3, then BLOCK_K down to 32,
    then stages down to 2, then BLOCK_K again. (fp32 on an H200: 128x128x32 with
    4 stages ran 1.4x as fast as 128x128x64 with 2, results/gemm_zoo/gaps/.)"""
    while smem_bytes(cfg, elem_bytes) > limit:
        if cfg.tma_store and cfg.epilogue_split == 1:
            cfg = dataclasses.replace(cfg, epilogue_split=2)
        elif cfg.num_stages > 3:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 32:
            cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
        elif cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 16:
            cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
        else:
            break
    return cfg


# --------------------------------------------------------------------------
# Stream-K tail
# --------------------------------------------------------------------------
SK_MAX_SPLIT = 4  # programs per tail tile at most: a finishing program reads the others' partials
SK_MIN_STEPS = 2  # K-steps per stream-K program at least


@dataclasses.dataclass(frozen=True)
class StreamKPlan:
    """How ``_gemm_tma_kernel`` splits its work: tiles ``0 .. dp_tiles-1`` whole,
    strided over the programs; the rest as ``sk_programs`` contiguous ranges of
    K-steps, ``sk_iters_per`` each plus one for the first ``sk_extra``."""

    dp_tiles: int
    sk_programs: int
    sk_iters_per: int
    sk_extra: int


# Device descriptors (the kernel encodes its TMA descriptors) save the launcher
# 10-30 us of host time per call (results/launch_cost/descriptors/: matmul 14.7-31.6 us
# against 24-59 with host descriptors, GPU time no worse: graph ratio 0.99-1.23). In eager
# calls they are taken at every size: with host descriptors the longer kernels' calls cost
# 2-3x torch.mm's host time (a user measured 38-89 us against 24 on held-out shapes), and a
# call's host time is what a Python loop pays whether or not the GPU hides it. The price: a
# few microseconds of GPU time per kernel (on the zoo's fit half the eager regret was 1.090
# with device descriptors everywhere against 1.078 with them below 20 us of modelled time,
# results/gemm_zoo/descriptors/), at most 2% of a 100 us kernel. Set a bound (in us of
# ``bound_us``) to keep host descriptors above it; under CUDA-graph capture host descriptors
# are always used (encoded once, into the graph).
DEVICE_DESC_MAX_US = math.inf
_PEAK_FLOPS, _PEAK_BYTES = 660e12, 3.3e12   # the bound below: H200-like 16-bit MMA and HBM rates


def bound_us(M: int, N: int, K: int, elem_bytes: int) -> float:
    """A lower bound of the product's GPU time (compute or one pass over A, B, C)."""
    return max(2.0 * M * N * K / _PEAK_FLOPS, (M * K + K * N + M * N) * elem_bytes / _PEAK_BYTES) * 1e6


def last_round(tiles: int, programs: int) -> int:
    """Tiles in a persistent kernel's last, partial round (0: the rounds are whole; all of
    them when there are fewer tiles than programs)."""
    return tiles % programs if tiles > programs else tiles


def tail_slices(tiles: int, programs: int, most: int) -> int:
    """Column slices per tile of the last, partial round (``GemmConfig.tail_split``): the most,
    up to ``most``, whose slices all run at once on the programs; 1 when there is no partial
    round or no split fits."""
    tail = last_round(tiles, programs)
    if tail == 0:
        return 1
    for s in (4, 2):
        if s <= most and tail * s <= programs:
            return s
    return 1


TAIL_MAX_STAGES = 8
# The 128 x 128 and 128 x 256 persistent tiles run a partial last round in up to this many column
# slices (``tail_slices``). On an H200 (results/gemm_zoo/gaps/tail.csv, 13 shapes, graph) that made
# the 128 x 256 tile 9-25% faster wherever its last round was partial (1024x4608x3584: 78.3 -> 58.4
# us, 909x4152x2912: 75.1 -> 62.0) and the 128 x 128 tile up to 9% faster (one shape 3% slower),
# and changed nothing elsewhere beyond noise; the sliced round still costs 0.7-0.9 of a whole one.
TAIL_SPLIT = 4


def tail_stages(cfg: GemmConfig, slices: int) -> int:
    """Pipeline stages of the tail slices' loop: as many of their (narrower) K-steps as the
    whole tile's stages take shared memory for, up to TAIL_MAX_STAGES."""
    whole = cfg.block_m * cfg.block_k + cfg.block_k * cfg.block_n
    part = cfg.block_m * cfg.block_k + cfg.block_k * (cfg.block_n // slices)
    return max(cfg.num_stages, min(TAIL_MAX_STAGES, cfg.num_stages * whole // part))


def stream_k_plan(tiles: int, programs: int, k_steps: int) -> StreamKPlan:
    """A persistent kernel runs ``ceil(tiles / programs)`` rounds of whole tiles,
    so a last round of ``tiles % programs`` tiles leaves the other SMs idle
    (8192^3 in 128x256 tiles on 132 SMs: 15.5 rounds of work take 16). Here the
    whole rounds stay data-parallel and the last round's K-steps are spread over
    up to ``SK_MAX_SPLIT`` programs per tile. Returns a plan with
    ``sk_programs == 0`` when there is nothing to gain (no partial round, or too
    few K-steps to split).

    Streaming one whole round more with the partial one ("two-tile" stream-K,
    each program 1-2 tiles' worth, at most two pieces per tile) was measured on
    an H200 and ran 0-10% slower on the zoo's 1-3 round shapes
    (results/gemm_zoo/gaps/)."""
    tail = last_round(tiles, programs)
    none = StreamKPlan(tiles, 0, 1, 0)
    if tail == 0:
        return none
    steps = tail * k_steps
    sk_programs = min(programs, tail * SK_MAX_SPLIT, steps // SK_MIN_STEPS)
    if sk_programs <= tail:
        return none
    per, extra = divmod(steps, sk_programs)
    return StreamKPlan(tiles - tail, sk_programs, per, extra)




# --------------------------------------------------------------------------
# Split-K
# --------------------------------------------------------------------------
SPLIT_MIN_STEPS = 2  # K-steps per piece at least: a piece costs a pipeline fill and a partial written
SPLIT_PENALTY = 0.5  # K-steps a piece's partial (written, read back) costs, in the choice below
# From this many pieces per tile the split-K kernel adds its partials into one sum with atomics
# (``ATOMIC_SPLIT``) instead of having the last piece read every other one's slot in turn; None:
# never. One H200, issue 43's long-K shapes at 7-26 pieces: 1.01-3.55x the serial sum (90 x 256 x
# 23216 at 26 pieces 42.0 -> 20.2 us); at 4-5 pieces 0.955-1.075x, so they keep the serial sum
# (experiments/probes/probe_splitk_reduce.py, results/gemm_selection/h200_splitk_reduce/).
SPLIT_ATOMIC_MIN_PIECES: int | None = 7


def split_for(tiles: int, k_steps: int, num_sms: int, max_split: int = 32) -> int:
    """K pieces per tile: the split whose programs finish soonest, counting the
    rounds they take (``ceil(tiles * split / SMs)``, wave quantisation) times the
    K-steps of one piece, plus SPLIT_PENALTY per piece beyond the first; each
    piece at least SPLIT_MIN_STEPS K-steps long."""
    best, best_cost = 1, float("inf")
    for split in range(1, max(1, min(max_split, k_steps // SPLIT_MIN_STEPS)) + 1):
        pieces, per = split_pieces(k_steps, split)
        cost = math.ceil(tiles * pieces / num_sms) * per + SPLIT_PENALTY * (pieces > 1) * pieces
        if cost < best_cost:
            best, best_cost = pieces, cost
    return best


def split_pieces(k_steps: int, split: int) -> tuple[int, int]:
    """(pieces, steps per piece) for a requested split: no piece is left empty."""
    per = -(-k_steps // max(1, min(split, k_steps)))
    return -(-k_steps // per), per



# --------------------------------------------------------------------------
# The Gluon kernel's configuration (kernels.gemm.gluon)
# --------------------------------------------------------------------------
WS_DTYPES = (torch.bfloat16, torch.float16)
REGS_PER_SM = 65536
TOTAL_WARPS = 12  # both modes: 2 consumer warpgroups + the producer's warpgroup (1 warp used, 4 allocated)
MAXNREG = (REGS_PER_SM // (TOTAL_WARPS * 32)) // 8 * 8  # 168: registers per thread at launch
# Triton 3.6 keeps the worker partitions' state (and alignment padding) in shared
# memory too: 168 bytes in every config cross-compiled for sm_90.
WS_EXTRA_SMEM = 256
# The device-descriptor variant (kernels.gemm.gluon._gemm_ws_dev_kernel, and the grouped
# kernel's) stages each descriptor it encodes in shared memory first: 144-224 bytes more
# than the host-descriptor kernel in the configs cross-compiled for sm_90 (cooperative,
# ping-pong). A plan takes it only where the config fits with this much on top.
WS_DEVICE_DESC_SMEM = 256


@dataclasses.dataclass(frozen=True)
class WsConfig:
    """Every knob of the kernel (``num_sms=None``: every SM of the device)."""

    block_m: int = 128  # tile rows. Ping-pong: 64 or 128 (one warpgroup); cooperative: 128 or 256
    block_n: int = 128  # 64, 128 or 256 (one wgmma instruction wide)
    block_k: int = 64  # 32 or 64
    num_stages: int = 4  # depth of the shared-memory ring
    group_m: int = 8  # rows of tiles per L2 band
    num_sms: int | None = None  # CTAs launched (one per SM)
    cooperative: bool = False  # False: ping-pong (2 consumers, alternate tiles); True: 1 consumer of 8 warps
    consumer_regs: int = 232  # per thread, consumer 1's warpgroup (ping-pong only; see consumer_regs_of)
    producer_regs: int = 40  # per thread, the producer's warpgroup

    def label(self) -> str:
        s = f"{'coop' if self.cooperative else 'ws'} {self.block_m}x{self.block_n}x{self.block_k} " \
            f"s{self.num_stages} g{self.group_m}"
        if self.num_sms is not None:
            s += f" sm{self.num_sms}"
        if self.producer_regs != 40 or (self.consumer_regs != 232 and not self.cooperative):
            s += f" r{consumer_regs_of(self)}/{self.producer_regs}"
        return s

    def as_params(self) -> dict:
        return dataclasses.asdict(self)

    def validate(self) -> "WsConfig":
        return validate_ws(self, type(self))

    WHO = "gemm_ws"  # the name errors about this config start with


def _who(cls) -> str:
    """The name errors start with: the config class's ``WHO`` (gemm_ws, or a subclass's)."""
    return getattr(cls, "WHO", cls.__name__)


def as_ws_config(config, cls: type | None = None):
    """A ``cls`` (default ``WsConfig``) from None (the defaults), an instance or a dict of its fields."""
    cls = cls or WsConfig
    return cls() if config is None else config_of(config, cls, _who(cls))


def num_consumers(config: WsConfig) -> int:
    return 1 if config.cooperative else 2


def num_warps(config: WsConfig) -> int:
    """The kernel's num_warps: its default partition (consumer 0) - one or two warpgroups."""
    return 8 if config.cooperative else 4


def ws_smem_bytes(config: WsConfig | Mapping[str, Any] | None = None, elem_bytes: int = 2,
               cls: type | None = None) -> int:
    """Shared memory per CTA (an upper bound): the ring, one C staging buffer per
    consumer, the mbarriers, and what Triton adds for warp specialisation."""
    c = as_ws_config(config, cls)
    ring = c.num_stages * (c.block_m * c.block_k + c.block_k * c.block_n) * elem_bytes
    staging = num_consumers(c) * c.block_m * c.block_n * elem_bytes
    barriers = 8 * (2 * c.num_stages + 2)
    return ring + staging + barriers + WS_EXTRA_SMEM


def default_partition_regs(config: WsConfig) -> int:
    """Registers per thread the compiler leaves the default partition (consumer 0):
    the 3 warpgroups' ``3 * MAXNREG`` less what the workers asked for."""
    total = TOTAL_WARPS // 4 * MAXNREG
    if config.cooperative:
        return (total - config.producer_regs) // 2 // 8 * 8  # two warpgroups share it
    return total - config.producer_regs - config.consumer_regs


def consumer_regs_of(config: WsConfig) -> int:
    """Registers per thread every consumer thread gets."""
    if config.cooperative:
        return default_partition_regs(config)
    return min(config.consumer_regs, default_partition_regs(config))


def _validate_tile(c: WsConfig) -> None:
    threads = 32 * num_warps(c)
    who = _who(type(c))
    if c.block_m not in ((128, 256) if c.cooperative else (64, 128)):
        raise ValueError(f"{who}: block_m={c.block_m!r} must be " + (
            "128 or 256 (cooperative: 2 warpgroups)" if c.cooperative else "64 or 128 (one warpgroup per consumer)"))
    if c.block_n not in (64, 128, 256):
        raise ValueError(f"{who}: block_n={c.block_n!r} must be 64, 128 or 256 (one wgmma instruction)")
    if c.block_k not in (32, 64):
        raise ValueError(f"{who}: block_k={c.block_k!r} must be 32 or 64 (one 128-byte swizzled row)")
    if c.block_m * c.block_n > 128 * threads:
        raise ValueError(f"{who}: a {c.block_m}x{c.block_n} fp32 accumulator needs "
                         f"{c.block_m * c.block_n // threads} registers per consumer thread; at most 128 fit "
                         + ("(use 128x256 or 256x128)" if c.cooperative else "(use 128x128 or 64x256)"))


def ws_device_desc_fits(config: WsConfig, elem_bytes: int = 2) -> bool:
    """Whether the config's device-descriptor variant fits sm_90's shared memory
    (``ws_smem_bytes`` plus ``WS_DEVICE_DESC_SMEM``)."""
    return ws_smem_bytes(config, elem_bytes, type(config)) + WS_DEVICE_DESC_SMEM <= SMEM_LIMIT_SM90


def validate_ws(config: WsConfig | Mapping[str, Any] | None, cls: type | None = None) -> WsConfig:
    """The config (a ``cls``, default ``WsConfig``), or a ValueError naming the knob that cannot work."""
    c = as_ws_config(config, cls)
    who = _who(type(c))
    if not isinstance(c.cooperative, bool):
        raise ValueError(f"{who}: cooperative={c.cooperative!r} must be True or False")
    _validate_tile(c)
    if not isinstance(c.num_stages, int) or c.num_stages < 2:
        raise ValueError(f"{who}: num_stages={c.num_stages!r} must be an int >= 2")
    if not isinstance(c.group_m, int) or c.group_m < 1:
        raise ValueError(f"{who}: group_m={c.group_m!r} must be an int >= 1")
    if c.num_sms is not None and (not isinstance(c.num_sms, int) or c.num_sms < 1):
        raise ValueError(f"{who}: num_sms={c.num_sms!r} must be None or an int >= 1")
    for name in ("consumer_regs", "producer_regs"):
        r = getattr(c, name)
        if not isinstance(r, int) or r % 8 or not 24 <= r <= 256:
            raise ValueError(f"{who}: {name}={r!r} must be a multiple of 8 in [24, 256] (setmaxnreg)")
    if not c.cooperative and default_partition_regs(c) < c.consumer_regs:
        raise ValueError(f"{who}: producer_regs + 2 * consumer_regs = {c.producer_regs + 2 * c.consumer_regs} "
                         f"exceeds the {TOTAL_WARPS // 4} warpgroups' {TOTAL_WARPS // 4 * MAXNREG} registers "
                         f"per thread (65536 per SM over {TOTAL_WARPS * 32} threads)")
    need = ws_smem_bytes(c)
    if need > SMEM_LIMIT_SM90:
        raise ValueError(f"{who}: {c.label()} needs {need} bytes of shared memory, over sm_90's "
                         f"{SMEM_LIMIT_SM90} per block; use fewer stages or a smaller tile")
    return c



# --------------------------------------------------------------------------
# The candidates the zoo sweep measures and the heuristic chooses among
# --------------------------------------------------------------------------
SMALL_M = 64  # M up to this: memory-bound on B; the split-K family's narrow tiles
MID_M = 4096  # M up to this (and fewer tiles than two rounds): split-K of 64/128-row tiles too


def _short_side(M: int) -> int:
    """A tile side covering M rows: 16, 32 or 64."""
    return 16 if M <= 16 else 32 if M <= 32 else 64


def candidates(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16, num_sms: int = 132,
               aligned: bool = True, gluon: bool = True, c_aligned: bool = True,
               b_kmajor: bool = False) -> dict[str, GemmConfig]:
    """Named configurations worth trying on this problem (the zoo sweep times them
    all; ``heuristic`` estimates each one's time and takes the cheapest), for an
    sm_90 GPU. ``aligned``: A's and B's rows are 16-byte aligned (TMA takes them
    as they are; else every candidate pads them, and "ptr", the pointer kernel,
    is added for comparison); ``gluon``: the Gluon kernels may run (sm_90, 16-bit,
    aligned); ``c_aligned``: C's rows are aligned too (TMA stores). fp32 with M <= SMALL_M
    adds "fma", the FMA kernel (``fma_config``; ``b_kmajor``: B is a transposed view)."""
    elem = element_size(dtype)
    st = dict(tma_store=False, group_m=8)
    out: dict[str, GemmConfig] = {
        "t128x256": GemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=4,
                               tail_split=TAIL_SPLIT, **st),
        "t128x128": GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6,
                               tail_split=TAIL_SPLIT, **st),
        "t64x128": GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=6, **st),
        "t128x64": GemmConfig(block_m=128, block_n=64, block_k=64, num_warps=4, num_stages=4, **st),
    }
    if M > SMALL_M:  # two CTAs per SM: the tail of one overlaps the other's mainloop
        out["t128x128x2"] = GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3,
                                       num_sms=2 * num_sms, **st)
    tiles256 = math.ceil(M / 128) * math.ceil(N / 256)
    k_steps64 = math.ceil(K / 64)
    # Stream-K: the last, partial round's K-steps spread over every SM; under one round with a
    # long K (1536x1536x24576: 72 tiles of 128x256 on 132 SMs) that is every tile's K, split over
    # all the SMs with the fix-up in the kernel (no second pass). A split tile costs a partial
    # written and read back, which only a long K pays for (SK_LONG_K_STEPS).
    if (tiles256 > num_sms and tiles256 % num_sms) or (tiles256 < num_sms and k_steps64 >= SK_LONG_K_STEPS):
        out["t128x256sk"] = _STREAM_K_CONFIG if c_aligned else dataclasses.replace(
            _STREAM_K_CONFIG, tma_store=False, epilogue_split=1)
    tiles128 = math.ceil(M / 128) * math.ceil(N / 128)
    if tiles128 % num_sms and (tiles128 > num_sms or k_steps64 >= SK_LONG_K_STEPS) and M > SMALL_M:
        out["t128x128sk"] = _STREAM_K_128 if c_aligned else dataclasses.replace(
            _STREAM_K_128, tma_store=False, epilogue_split=1)
    if gluon and aligned and c_aligned and dtype in (torch.bfloat16, torch.float16) and M > SMALL_M:
        out["gl_pp"] = _GLUON_PINGPONG
        out["gl_coop"] = _GLUON_COOP
    k_steps = math.ceil(K / 128)
    if M <= SMALL_M:
        bm = _short_side(M)
        t128 = math.ceil(N / 128)
        t64 = math.ceil(N / 64)
        sk = dict(num_warps=4, block_k=128, tma_store=False)
        out["swap"] = GemmConfig(block_m=bm, block_n=128, num_stages=4, swap_ab=True,
                                 split_k=split_for(t128, k_steps, num_sms), **sk)
        out["swap_k64"] = GemmConfig(block_m=bm, block_n=128, num_stages=6, swap_ab=True,
                                     split_k=split_for(t128, math.ceil(K / 64), num_sms),
                                     **dict(sk, block_k=64))
        out["swap_n64"] = GemmConfig(block_m=bm, block_n=64, num_stages=5, swap_ab=True,
                                     split_k=split_for(t64, k_steps, num_sms), **sk)
        out["narrow"] = GemmConfig(block_m=bm, block_n=128, num_stages=4,
                                   split_k=split_for(t128, k_steps, num_sms), **sk)
    if N <= SMALL_M:  # tall and skinny: a narrow tile on the N side, split-K for the SMs
        bn = _short_side(N)
        t = math.ceil(M / 128)
        out["tall"] = GemmConfig(block_m=128, block_n=bn, block_k=128, num_warps=4, num_stages=4,
                                 tma_store=False, split_k=split_for(t, k_steps, num_sms))
    if M <= MID_M:
        k64 = math.ceil(K / 64)
        t = math.ceil(M / 64) * math.ceil(N / 128)
        if t < 2 * num_sms:
            out["splitk64"] = GemmConfig(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=6,
                                         tma_store=False, split_k=split_for(t, k64, num_sms))
        t = math.ceil(M / 128) * math.ceil(N / 128)
        if t < 2 * num_sms and M > SMALL_M:
            out["splitk128"] = GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=6,
                                          tma_store=False, split_k=split_for(t, k64, num_sms))
    if not aligned:
        out = {name: dataclasses.replace(c, pad=True) for name, c in out.items()}
        out["ptr"] = GemmConfig(block_m=128, block_n=128, block_k=64, num_warps=4, num_stages=3, group_m=8,
                                tma=False)
    fitted = {name: _fit_smem(c, elem) for name, c in out.items()}
    if dtype == torch.float32 and M <= SMALL_M:   # no padding: it reads any strides as they are
        fitted["fma"] = fma_config(M, N, K, num_sms, b_kmajor)
    # A persistent tile squeezed to two stages cannot overlap its loads with its MMAs
    # (fp32 on an H200: 128x256x32 with 2 stages ran at 0.50-0.84x the speed of 128x128x32
    # with 4, results/gemm_zoo/gaps/): leave it out when another tile remains.
    deep = {name: c for name, c in fitted.items() if c.split_k is not None or c.gluon or c.num_stages >= 3}
    return deep or fitted



# --------------------------------------------------------------------------
# fp32 at small M: the FMA kernel (kernels.gemm.triton._gemm_fma_kernel)
# --------------------------------------------------------------------------
# (The rule that sends fp32 at small M here: kernels.gemm.cold.FMA_MAX_M.)
FMA_PROGRAMS_PER_SM = 4  # programs the split aims for per SM (several resident: loads in flight)



def fma_split(tiles: int, k_steps: int, m_rows: int, K: int, num_sms: int) -> int:
    """K pieces per tile: enough for FMA_PROGRAMS_PER_SM programs on every SM, each
    piece at least SPLIT_MIN_STEPS K-steps, and no more pieces than K / (2 * m_rows)
    (``m_rows``: M rounded up to whole blocks), so the partials, written once and
    read back once (2 * pieces * m_rows * N * 4 bytes), never outweigh B itself."""
    want = -(-FMA_PROGRAMS_PER_SM * num_sms // tiles)
    return max(1, min(want, k_steps // SPLIT_MIN_STEPS, K // (2 * m_rows)))


def fma_config(M: int, N: int, K: int, num_sms: int = 132, b_kmajor: bool = False) -> GemmConfig:
    """The FMA kernel's configuration for an M x N x K fp32 product: tl.dot in ieee precision,
    3 stages of 32-deep K-steps, 16 x 64 tiles up to M = 16, 32 x 128 up to 32, 64 x 64 beyond
    (the fastest of the tiles timed at M 1-19, results/gemm_zoo/gaps/fp32_small.csv; sm_90
    cross-compiles: 96-204 registers, no spills). K is split by ``fma_split``. (The
    outer-product form, block_m < 16, is an explicit config only: it ran slower.)"""
    rows = 1 << max(0, M - 1).bit_length()   # M rounded up to a power of two
    bm = min(64, max(16, rows))
    bn, bk, stages = {16: 64, 32: 128}.get(bm, 64), 32, 3
    tiles = math.ceil(M / bm) * math.ceil(N / bn)
    k_steps = math.ceil(K / bk)
    split = fma_split(tiles, k_steps, math.ceil(M / bm) * bm, K, num_sms)
    return GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=4, num_stages=stages, group_m=1,
                      tma_store=False, split_k=split_pieces(k_steps, split)[0], fma=True)
