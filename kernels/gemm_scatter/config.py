"""Configuration of the fused GEMM + all-scatter: ``ScatterConfig``, its
validation, and the tile rule (``heuristic``) as a function of tiles per SM.

The tile rule. The kernel is persistent: ``num_sms`` programs each take every
``num_sms``-th tile, so its time is about ``rounds = ceil(tiles / SMs)``
rounds of one tile each, and a tile of ``BM x BN`` costs about
``BM * BN * K / rate(tile)`` on one SM plus its scatter (``W`` stores of the
tile). Bigger tiles reuse each loaded byte more (a higher per-SM rate) but
make fewer tiles: when a problem has fewer tiles than SMs, the big tile leaves
SMs idle, and the smaller tile that fills them wins even at a lower rate. The
seed found exactly this on MI300X (``total_tiles < num_sms`` -> 64x64 tiles,
else 128x64). ``heuristic`` scores every tile of ``CANDIDATES`` by::

    estimate = ceil(tiles / SMs) * BM * BN / RELATIVE_RATE[tile]

and takes the cheapest (ties: the bigger tile). ``RELATIVE_RATE`` is the per-SM
throughput of each tile on Hopper's wgmma relative to 128x256 (from the GEMM
family's H200 tiling sweep, ``results/gemm_tiling/``: 64-row tiles use one
warpgroup's 64-row wgmma, half the issue width of a 128-row tile). Notebook 06
plots the rule against tiles-per-SM and its regret against the best measured
tile when GPU results are committed.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import torch

from workbench.asm.resources import smem_per_block

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMEM_LIMIT_SM90 = smem_per_block(90)
DEFAULT_MAX_SPINS = 1 << 26   # polls before a wait gives up (bounded: a silent peer is reported, never hangs)

# (BLOCK_M, BLOCK_N) -> per-SM throughput relative to 128x256 (see the module docstring)
RELATIVE_RATE = {(128, 256): 1.0, (128, 128): 0.85, (64, 128): 0.55, (64, 64): 0.35}
CANDIDATES = tuple(RELATIVE_RATE)


@dataclasses.dataclass(frozen=True)
class ScatterConfig:
    """Every knob of ``gemm_all_scatter``. ``None`` means "decide from the device"."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 4  # the pipeline depth (the seed's second overlap optimization: 2 -> 3 on MI300X)
    num_sms: int | None = None  # programs launched; None = every SM (never more than tiles)
    from_registers: bool = True  # scatter from the accumulator (True) or store C locally, then copy (False)
    tma_loads: bool | None = None  # Hopper: A and B through TMA descriptors (None: when the device allows)
    flatten: bool = False  # fuse the tile and K loops (pipeline across tiles)

    def label(self) -> str:
        s = f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages} g{self.group_m}"
        if self.num_sms is not None:
            s += f" sm{self.num_sms}"
        if not self.from_registers:
            s += " copy"
        if self.tma_loads is False:
            s += " ptr"
        if self.flatten:
            s += " flat"
        return s

    def as_params(self) -> dict:
        return dataclasses.asdict(self)


PARAMS = ScatterConfig().as_params()  # the names a sweep grid or a dict config may use


def as_config(config: ScatterConfig | Mapping[str, Any] | None) -> ScatterConfig | None:
    if config is None or isinstance(config, ScatterConfig):
        return config
    if isinstance(config, Mapping):
        unknown = sorted(set(config) - set(PARAMS))
        if unknown:
            raise ValueError(f"gemm_all_scatter: unknown config field(s) {unknown}; known: {sorted(PARAMS)}")
        return ScatterConfig(**config)
    raise ValueError(f"gemm_all_scatter: config must be a ScatterConfig or a dict of its fields, got "
                     f"{type(config).__name__}")


def smem_bytes(c: ScatterConfig, elem_bytes: int = 2) -> int:
    """Shared memory the pipeline asks for: A and B stages (C leaves from registers)."""
    return (c.block_m * c.block_k + c.block_k * c.block_n) * elem_bytes * c.num_stages


def validate(c: ScatterConfig, elem_bytes: int = 2) -> None:
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(c, name)
        if not isinstance(v, int) or v < 16 or v & (v - 1):
            raise ValueError(f"gemm_all_scatter: {name}={v!r} must be a power of two >= 16")
    if c.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"gemm_all_scatter: num_warps={c.num_warps!r} must be 1, 2, 4, 8 or 16")
    if not isinstance(c.num_stages, int) or c.num_stages < 1:
        raise ValueError(f"gemm_all_scatter: num_stages={c.num_stages!r} must be an int >= 1")
    if not isinstance(c.group_m, int) or c.group_m < 1:
        raise ValueError(f"gemm_all_scatter: group_m={c.group_m!r} must be an int >= 1")
    if c.num_sms is not None and (not isinstance(c.num_sms, int) or isinstance(c.num_sms, bool) or c.num_sms < 1):
        raise ValueError(f"gemm_all_scatter: num_sms={c.num_sms!r} must be None or an int >= 1")
    need = smem_bytes(c, elem_bytes)
    if need > SMEM_LIMIT_SM90:
        raise ValueError(f"gemm_all_scatter: {c.label()} needs {need} bytes of shared memory for its "
                         f"{c.num_stages} pipeline stages, more than the {SMEM_LIMIT_SM90} an sm_90 block may "
                         f"use; lower num_stages or block_k")


def tiles_of(M: int, n_local: int, block_m: int, block_n: int) -> int:
    return math.ceil(M / block_m) * math.ceil(n_local / block_n)


def tile_estimate(M: int, n_local: int, tile: tuple[int, int], num_sms: int) -> float:
    """The rule's cost of one tile shape (arbitrary units: rounds x tile work / rate)."""
    bm, bn = tile
    return math.ceil(tiles_of(M, n_local, bm, bn) / num_sms) * bm * bn / RELATIVE_RATE[tile]


def pick_tile(M: int, n_local: int, num_sms: int) -> tuple[int, int]:
    """The rule's (BLOCK_M, BLOCK_N) for an (M, n_local) output on ``num_sms`` SMs."""
    return min(CANDIDATES, key=lambda t: (tile_estimate(M, n_local, t, num_sms), -t[0] * t[1]))


def heuristic(M: int, n_local: int, K: int, dtype: torch.dtype = torch.bfloat16, num_sms: int = 132) -> ScatterConfig:
    """The config ``gemm_all_scatter`` runs when none is given."""
    bm, bn = pick_tile(M, n_local, num_sms)
    esize = torch.empty((), dtype=dtype).element_size()
    bk = 64 if esize <= 2 else 32
    warps = 8 if bm * bn >= 128 * 128 else 4
    cfg = ScatterConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=4)
    while cfg.num_stages > 2 and smem_bytes(cfg, esize) > SMEM_LIMIT_SM90:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg
