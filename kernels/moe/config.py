"""Configurations of the MoE family, their validation, and the config tables.

``GroupedConfig``: every knob of the Triton grouped kernels
(``kernels.moe.triton``); ``pick_config`` is the one ``grouped_gemm`` /
``grouped_gemm_wgrad`` run when none is given and the Gluon kernel does not
take the call; ``tail_width`` sizes the narrow tiles of a last column strip.
``GroupedWsConfig``: the knobs of the warp-specialised Gluon kernel
(``kernels.moe.gluon``, the dense ``kernels.gemm.config.WsConfig`` with 5
stages by default); ``pick_ws_config`` is the default path's choice; its
limits (``WS_MAX_GROUPS``, ``check_alignment``) say what that kernel takes.
``pick_ws_config`` / ``pick_config`` are the cold rule of the selection layer
(``kernels.moe.select``); ``LibraryConfig`` names ``torch._grouped_mm`` as a
candidate, and ``WS_CANDIDATES``, ``TRITON_CANDIDATES`` and
``INTERPRET_CANDIDATES`` are the configs a tuning run times.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import torch
import triton

from kernels.common import interpreter
from kernels.common.configs import config_of
from kernels.gemm import config as dense

DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # the Triton kernels'
MAX_GROUPS = 4096  # groups the Triton kernels take (their sizes vector lives in registers)
OPS = ("fwd", "dgrad", "wgrad")
FALLBACK = "use kernels.moe.grouped_gemm instead"  # what the Gluon kernel's refusals suggest


# --------------------------------------------------------------------------
# The Triton kernels
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class GroupedConfig:
    """One launch configuration of the Triton grouped kernels. For wgrad, BLOCK_M
    tiles K, BLOCK_N tiles N and BLOCK_K steps through the rows of a group."""

    BLOCK_M: int = 128
    BLOCK_N: int = 256
    BLOCK_K: int = 64
    GROUP_M: int = 8
    num_warps: int = 8
    num_stages: int = 3
    EPI_SUBTILE: bool = True
    FLATTEN: bool = True
    USE_TMA: bool | None = None   # None: TMA whenever the device and strides allow it
    CTAS_PER_SM: int = 1
    NARROW_TAIL: bool = True      # fwd/dgrad: a last column strip <= BLOCK_N/2 wide gets narrow tiles

    def as_dict(self) -> dict:
        return asdict(self)

    def label(self) -> str:
        tma = {None: "auto", True: "tma", False: "ptr"}[self.USE_TMA]
        return (f"{self.BLOCK_M}x{self.BLOCK_N}x{self.BLOCK_K}_g{self.GROUP_M}_w{self.num_warps}"
                f"_s{self.num_stages}_{'sub' if self.EPI_SUBTILE else 'full'}"
                f"_{'flat' if self.FLATTEN else 'nest'}_{tma}_o{self.CTAS_PER_SM}"
                f"{'' if self.NARROW_TAIL else '_wide'}")


FIELDS = tuple(f.name for f in dataclasses.fields(GroupedConfig))


def as_config(config: GroupedConfig | Mapping[str, Any] | None) -> GroupedConfig | None:
    """A GroupedConfig from a config or a dict of its fields (None stays None)."""
    return config_of(config, GroupedConfig, "grouped_gemm")


def validate_config(c: GroupedConfig) -> GroupedConfig:
    """The config, or a ValueError naming the knob that cannot work."""
    for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K"):
        v = getattr(c, name)
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"grouped_gemm: {name}={v!r} must be a power of two >= 16 (tl.dot's smallest)")
    if c.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"grouped_gemm: num_warps={c.num_warps!r} must be 1, 2, 4, 8 or 16")
    for name in ("num_stages", "GROUP_M", "CTAS_PER_SM"):
        v = getattr(c, name)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"grouped_gemm: {name}={v!r} must be an int >= 1")
    if c.USE_TMA not in (None, True, False):
        raise ValueError(f"grouped_gemm: USE_TMA={c.USE_TMA!r} must be None, True or False")
    return c


# Config table, derived from the H200 sweep recorded under results/grouped_gemm/
# (experiments/run_grouped_gemm.py --sweep). Keys: (op, N, K) of the
# *call* (fwd/dgrad: N the output width, K the reduction; wgrad: the layer's N
# and K); a missing key falls back to the op's default. Launch plans keep the config
# they picked: after changing the table at run time, call kernels.moe.launch.clear_plans().
_DEFAULT = {
    "fwd": GroupedConfig(),
    "dgrad": GroupedConfig(),
    "wgrad": GroupedConfig(),
}
_S4 = GroupedConfig(num_stages=4)
_TABLE: dict[tuple[str, int, int], GroupedConfig] = {
    # measured 2026-11-21 on an H200 (results/grouped_gemm/sweep.csv, run 7): 128x256x64 tiles,
    # 8 warps, one CTA per SM, 4 stages won everywhere but two wgrad keys (3 stages, within
    # 0.2%); the narrow tail strip (N = 2880, 5760) gained 0.5-1.3% over whole 256-wide tiles.
    # Earlier sweeps (run 2, and run 6 on the gpt-oss shapes): 128x128 tiles (8 warps, or 4 warps
    # with 2 CTAs per SM), 256x128, BLOCK_K=128, pointer loads instead of TMA and unflattened
    # loops were all slower.
    ("fwd", 4096, 7168): _S4, ("fwd", 7168, 2048): _S4,
    ("fwd", 5760, 2880): _S4, ("fwd", 2880, 2880): _S4,
    ("dgrad", 7168, 4096): _S4, ("dgrad", 2048, 7168): _S4,
    ("dgrad", 2880, 5760): _S4, ("dgrad", 2880, 2880): _S4,
    ("wgrad", 4096, 7168): _S4, ("wgrad", 7168, 2048): GroupedConfig(),
    ("wgrad", 5760, 2880): _S4, ("wgrad", 2880, 2880): GroupedConfig(),
}

# Tiny tiles for the interpreter: correctness only.
_INTERPRET_CONFIG = GroupedConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1,
                                  num_stages=1, EPI_SUBTILE=False, FLATTEN=False, USE_TMA=False)


def default_config(op: str) -> GroupedConfig:
    """The op's config where the table has no entry."""
    if op not in _DEFAULT:
        raise ValueError(f"op must be one of {sorted(_DEFAULT)}, got {op!r}")
    return _DEFAULT[op]


def tail_width(N: int, block_n: int) -> int:
    """Width of the narrow tiles for the last column strip of an N-wide output in
    block_n-wide tiles, or 0 when that strip is full or too wide to be worth it
    (more than half a tile). A power of two >= 16 (tl.dot's smallest)."""
    rem = N % block_n
    if rem == 0:
        return 0
    width = max(16, triton.next_power_of_2(rem))
    return width if width <= block_n // 2 else 0


def pick_config(op: str, N: int, K: int, device: torch.device | None = None) -> GroupedConfig:
    """The launch configuration for one call (host-side shapes only)."""
    default = default_config(op)
    if interpreter.active() or (device is not None and device.type == "cpu"):
        return _INTERPRET_CONFIG
    return _TABLE.get((op, N, K), default)


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 operands: exact fp32 products (the matrix units' tf32 mode is opt-in elsewhere).
    return "ieee" if dtype == torch.float32 else "tf32"


def g_pad_triton(G: int) -> int:
    """Entries of the Triton kernels' in-register sizes vectors (a power of two >= 64)."""
    return max(64, triton.next_power_of_2(G))


# --------------------------------------------------------------------------
# The Gluon kernel
# --------------------------------------------------------------------------
# The dense kernel's limits and config helpers hold here too (same partitions,
# registers, ring and staging buffers): kernels.gemm.config.
WS_DTYPES, SMEM_LIMIT_SM90, TOTAL_WARPS, MAXNREG, WS_EXTRA_SMEM, WS_DEVICE_DESC_SMEM = (
    dense.WS_DTYPES, dense.SMEM_LIMIT_SM90, dense.TOTAL_WARPS, dense.MAXNREG, dense.WS_EXTRA_SMEM,
    dense.WS_DEVICE_DESC_SMEM)
num_consumers, num_warps = dense.num_consumers, dense.num_warps
default_partition_regs, consumer_regs_of = dense.default_partition_regs, dense.consumer_regs_of
WS_MAX_GROUPS = 512  # G_PAD / 32 registers per sizes vector; the 40-register producer spills at G_PAD = 1024


@dataclasses.dataclass(frozen=True)
class GroupedWsConfig(dense.WsConfig):
    """``kernels.gemm.config.WsConfig``'s knobs; 5 stages by default (the probe's best
    on the seed layers); group_m: rows of tiles per L2 band inside an expert."""

    num_stages: int = 5
    WHO = "grouped_gemm_ws"  # the name errors about this config start with


def smem_bytes(config: GroupedConfig | GroupedWsConfig | Mapping[str, Any] | None = None,
               elem_bytes: int = 2) -> int:
    """Shared memory per CTA a config asks for (an upper bound). A ``GroupedConfig``:
    its operand stages and the epilogue's staging buffer; otherwise (a
    ``GroupedWsConfig``, a dict of its fields, None for the default) the Gluon
    kernel's, as ``kernels.gemm.config.ws_smem_bytes``."""
    if isinstance(config, GroupedConfig):
        c = config
        epilogue = c.BLOCK_M * (c.BLOCK_N // 2 if c.EPI_SUBTILE else c.BLOCK_N) * elem_bytes
        return c.num_stages * (c.BLOCK_M * c.BLOCK_K + c.BLOCK_K * c.BLOCK_N) * elem_bytes + epilogue
    return dense.ws_smem_bytes(config, elem_bytes, GroupedWsConfig)


def validate_ws(config: GroupedWsConfig | Mapping[str, Any] | None) -> GroupedWsConfig:
    """The Gluon kernel's config, or a ValueError naming the knob that cannot work."""
    return dense.validate_ws(config, GroupedWsConfig)


def check_groups(G: int) -> None:
    if not isinstance(G, int) or G < 1 or G > WS_MAX_GROUPS:
        raise ValueError(f"grouped_gemm_ws: G={G!r} groups; this kernel takes 1 to {WS_MAX_GROUPS} (the sizes "
                         f"live in registers of every partition); {FALLBACK}, which takes up to {MAX_GROUPS}")


def g_pad(G: int) -> int:
    """Entries of the Gluon kernel's in-register sizes vectors (a power of two >= 32,
    the lanes of a warp)."""
    check_groups(G)
    return max(32, 1 << (G - 1).bit_length())


def check_alignment(N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """ValueError unless the TMA engine can address x [M, K], w and out [M, N]
    packed row-major: 16-byte row strides, so K and N multiples of 8 (16-bit)."""
    per16 = 16 // dtype.itemsize
    if K % per16 or N % per16:
        raise ValueError(f"grouped_gemm_ws: K={K} and N={N} must be multiples of {per16} for {dtype} (TMA needs "
                         f"16-byte aligned row strides); {FALLBACK}, which handles any shape")


# Stages per (op, N, K) of grouped_gemm's default path, from the probe of
# results/grouped_gemm (run 12, H200): ping-pong with 5 stages beat our Triton kernel
# on every layer (geomean 1.009-1.054 per model, layer and op), except gpt-oss-20B's
# Down (2880 x 2880), where 4 stages did better (1.025 vs 1.009-1.011).
WS_DEFAULT_CONFIG = GroupedWsConfig()
WS_TABLE: dict[tuple[str, int, int], GroupedWsConfig] = {
    ("fwd", 2880, 2880): GroupedWsConfig(num_stages=4),
    ("dgrad", 2880, 2880): GroupedWsConfig(num_stages=4),
}


def pick_ws_config(op: str, N: int, K: int) -> GroupedWsConfig:
    """The Gluon kernel's config on the default path for one (op, N, K): output width N, reduction K."""
    return WS_TABLE.get((op, N, K), WS_DEFAULT_CONFIG)


# --------------------------------------------------------------------------
# The library, and the candidates the selection layer times (kernels.moe.select)
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class LibraryConfig:
    """``torch._grouped_mm`` (CUTLASS's grouped GEMM on sm_90): no knobs, the library picks
    its own kernel. A candidate like ours, so that where none of ours is faster a tuned table
    runs the library; never the cold rule's pick. bf16 only, on a CUDA GPU."""

    def label(self) -> str:
        return "torch._grouped_mm"

    def as_dict(self) -> dict:
        return {}


# Candidates worth timing, by name (the names tables record). Gluon (fwd/dgrad on sm_90):
# the probe of results/grouped_gemm run 12 (`git show 72a8714:results/grouped_gemm/probe_ws_run12.csv`, 96 fwd/dgrad
# cases on an H200):
# ping-pong with 5 stages was fastest in 63 cases, 4 stages in 16, cooperative 128x256 with
# 3 stages in 9 (cooperative 256x128 in none, so it is not offered).
WS_CANDIDATES: dict[str, GroupedWsConfig] = {
    "ws_s5": GroupedWsConfig(),
    "ws_s4": GroupedWsConfig(num_stages=4),
    "coop_128x256_s3": GroupedWsConfig(cooperative=True, block_n=256, num_stages=3),
}
# Triton (every op; the only kernel of wgrad): the table's two (run 7's sweep: 4 stages won but
# on two wgrad keys, 3 stages within 0.2%), and two 128-wide tiles that tied on gpt-oss Down
# in run 6 and may suit narrower layers than the study's (more tiles per expert).
TRITON_CANDIDATES: dict[str, GroupedConfig] = {
    "t128x256_s4": _S4,
    "t128x256_s3": GroupedConfig(),
    "t128x128_w4_s3_x2": GroupedConfig(BLOCK_N=128, num_warps=4, num_stages=3, CTAS_PER_SM=2),
    "t128x128_w8_s4": GroupedConfig(BLOCK_N=128, num_stages=4),
}
# In Triton's interpreter (correctness only: what a tuning run without a GPU can try).
INTERPRET_CANDIDATES: dict[str, GroupedConfig] = {
    "i16x16": _INTERPRET_CONFIG,
    "i32x16": dataclasses.replace(_INTERPRET_CONFIG, BLOCK_M=32),
    "i16x16_tma": dataclasses.replace(_INTERPRET_CONFIG, USE_TMA=True),
}
