"""Configuration of the fused GEMM + all-scatter: ``ScatterConfig``, its
validation, and the tile rule (``heuristic``) as a function of tiles per SM.

The tile rule. The kernel is persistent: ``num_sms`` programs each take every
``num_sms``-th tile, so its time is about ``rounds = ceil(tiles / SMs)``
rounds of one tile each. Bigger tiles reuse each loaded byte more (a higher
per-SM rate) but make fewer tiles: when a problem has fewer tiles than SMs
the big tile leaves SMs idle, and a smaller tile that fills them wins even at
a lower rate. The seed found exactly this on MI300X (``total_tiles <
num_sms`` -> 64x64 tiles, else 128x64). ``heuristic`` scores every tile of
``TILES`` by::

    rounds * max(2 * BM * BN * K / rate + fixed,           # the MMA work of one tile
                 (min(BM, M) * K + K * BN) * esize / per_sm_bw)   # its A rows and B columns

and takes the cheapest (ties: the smaller tile, which wastes less MMA work on
rows past M). ``rate`` and ``fixed`` are the GEMM family's least-squares fit
to its H200 tiling sweep (``kernels.gemm.cold._TILING_TILES``,
``results/gemm_tiling/``), with the
warps and stages that sweep found best per tile; ``per_sm_bw`` is each SM's
share of the measured HBM copy bandwidth (``results/ceilings/``): a problem
with few tiles cannot stream B at full bandwidth, which is what makes small M
favour more, smaller tiles. 64x64 was not in that sweep: its rate is assumed
at 3/4 of 64x128's (one warpgroup issuing half-width wgmma); notebook 06 shows
the rule's regret against the best measured tile. The scatter's stores are
posted writes that drain while the next tile's mainloop runs, so they are
left out of the per-tile cost (the NVLink bound is in ``metrics.bounds_us``).

Few tiles and a long K. Up to ``kernels.gemm``'s MID_M rows and from
``SPLIT_MIN_K`` on, the same model also scores ``SPLIT_TILE`` with its K range cut into
``kernels.gemm.config.split_for`` pieces (each piece a program of the small-M
kernel, its partial sums meeting in an fp32 workspace: written once and read
once more, charged at the copy bandwidth) and takes it when cheaper. On an H200
the 64x128 tile, 2 pieces, ran 128x4096x14336 in 48.8 us and 256x2048x14336 in
41.6 us against 59.6 and 55.9 for the persistent 64x128 tile (one piece)
(``kernels.gemm``'s split-K kernel, ``results/gemm_zoo/gaps/mid_m.csv``). With K = 4096
the model's load term, which charges every program's bytes at one SM's share of
HBM, still prefers pieces, but there the pieces ran 24.8 us against 19.1 for the
persistent 64x64 tiles (128x4096x4096; ``results/gemm_scatter/times_w1.parquet``),
hence ``SPLIT_MIN_K``. Five measured shapes set this rule; the spec's other
shapes are its test.
"""
from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Mapping

import torch

from kernels.common.configs import config_of, table_entries
from kernels.gemm.cold import _TILING_TILES as _GEMM_FIT, heuristic as gemm_heuristic
from kernels.gemm.config import MID_M, SMALL_M, split_for, split_pieces
from workbench.asm.resources import smem_per_block

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMEM_LIMIT_SM90 = smem_per_block(90)

# (BLOCK_M, BLOCK_N) -> (BLOCK_K, warps, stages, per-SM TFLOP/s, fixed us per tile); see the module docstring
TILES = {(bm, bn): (bk, w, st, rate, fixed) for (bm, bn, bk, w, st), (rate, fixed) in _GEMM_FIT.items()}
TILES[(64, 64)] = (64, 4, 4, 0.75 * TILES[(64, 128)][3], TILES[(64, 128)][4])
CANDIDATES = tuple(TILES)
SPLIT_TILE = (64, 128, 64, 4, 6)  # (BM, BN, BK, warps, stages) of the split rule (results/gemm_zoo/gaps/mid_m.csv)
SPLIT_MIN_K = 8192  # shorter reductions stay whole (see the module docstring)
HBM_GBPS, DEVICE_SMS = 4277.0, 132  # H200: measured copy bandwidth (results/ceilings/nvidia-h200.json), SMs
# variant: "fused" (every program stores its tiles to every rank), "senders" (GEMM programs store locally,
# SENDERS programs push finished row bands to the peers), or the unfused paths "nccl" (cuBLAS, NCCL's
# all-gather, the permute) and "sequential" (our GEMM, our all-gather, the permute)
VARIANTS = ("fused", "senders", "nccl", "sequential")
FALLBACKS = ("nccl", "sequential")


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
    split_k: int = 1  # > 1, or swap_ab: the small-M kernel, each tile's K range in up to this many pieces
    swap_ab: bool = False  # small-M kernel: compute C^T = B^T A^T (the short M side as the MMA's N)
    variant: str = "fused"  # see VARIANTS
    senders: int = 8  # variant "senders": programs that push finished row bands (of num_sms)

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
        if self.split_kernel:
            s += f" split{self.split_k}" + (" swap" if self.swap_ab else "")
        if self.variant == "senders":
            s += f" senders{self.senders}"
        elif self.variant != "fused":
            s = self.variant
        return s

    @property
    def split_kernel(self) -> bool:
        """Whether this runs the small-M kernel (one program per tile piece, not persistent)."""
        return self.split_k > 1 or self.swap_ab

    def as_params(self) -> dict:
        return dataclasses.asdict(self)


PARAMS = ScatterConfig().as_params()  # the names a sweep grid or a dict config may use


def as_config(config: ScatterConfig | Mapping[str, Any] | None) -> ScatterConfig | None:
    return config_of(config, ScatterConfig, "gemm_all_scatter")


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
    if not isinstance(c.split_k, int) or isinstance(c.split_k, bool) or c.split_k < 1:
        raise ValueError(f"gemm_all_scatter: split_k={c.split_k!r} must be an int >= 1")
    if not isinstance(c.swap_ab, bool):
        raise ValueError(f"gemm_all_scatter: swap_ab={c.swap_ab!r} must be True or False")
    if c.swap_ab and c.block_n < 16 * c.num_warps:
        raise ValueError(f"gemm_all_scatter: swap_ab makes BLOCK_N the MMA's M side, at least 16 rows per warp: "
                         f"block_n={c.block_n} with num_warps={c.num_warps}; use block_n >= {16 * c.num_warps}")
    if c.variant not in VARIANTS:
        raise ValueError(f"gemm_all_scatter: variant={c.variant!r} must be one of {VARIANTS}")
    if not isinstance(c.senders, int) or isinstance(c.senders, bool) or c.senders < 1:
        raise ValueError(f"gemm_all_scatter: senders={c.senders!r} must be an int >= 1")
    if c.variant == "senders" and (c.split_kernel or c.flatten or not c.from_registers):
        raise ValueError("gemm_all_scatter: variant 'senders' runs the persistent kernel whose senders push from "
                         "C: use split_k=1, swap_ab=False, flatten=False, from_registers=True")
    if c.variant == "senders" and c.num_sms is not None and c.num_sms <= c.senders:
        raise ValueError(f"gemm_all_scatter: num_sms={c.num_sms} must exceed senders={c.senders}: the GEMM needs "
                         "programs of its own")
    if c.split_kernel and (c.flatten or not c.from_registers):
        raise ValueError("gemm_all_scatter: the small-M kernel (split_k > 1 or swap_ab) scatters from registers "
                         "and has no tile loop: use flatten=False, from_registers=True")
    need = smem_bytes(c, elem_bytes)
    if need > SMEM_LIMIT_SM90:
        raise ValueError(f"gemm_all_scatter: {c.label()} needs {need} bytes of shared memory for its "
                         f"{c.num_stages} pipeline stages, more than the {SMEM_LIMIT_SM90} an sm_90 block may "
                         f"use; lower num_stages or block_k")


def tiles_of(M: int, n_local: int, block_m: int, block_n: int) -> int:
    return math.ceil(M / block_m) * math.ceil(n_local / block_n)


def tile_estimate(M: int, n_local: int, K: int, tile: tuple[int, int], num_sms: int, esize: int = 2) -> float:
    """The rule's time estimate (us) for one tile shape: rounds x the slower of the
    tile's MMA work and its loads at one SM's share of HBM bandwidth."""
    bm, bn = tile
    rate, fixed = TILES[tile][3], TILES[tile][4]
    mma_us = 2.0 * bm * bn * K / (rate * 1e6) + fixed
    load_us = (min(bm, M) * K + K * bn) * esize / (HBM_GBPS / DEVICE_SMS * 1e3)
    return math.ceil(tiles_of(M, n_local, bm, bn) / num_sms) * max(mma_us, load_us)


def split_estimate(M: int, n_local: int, K: int, num_sms: int, esize: int = 2) -> tuple[float, int]:
    """(the rule's time estimate in us, pieces) for ``SPLIT_TILE`` with each tile's K range
    in ``split_for`` pieces, one program each, partial sums written and read back once."""
    bm, bn, bk = SPLIT_TILE[:3]
    tiles, k_steps = tiles_of(M, n_local, bm, bn), math.ceil(K / bk)
    pieces, per = split_pieces(k_steps, split_for(tiles, k_steps, num_sms))
    k_len = min(K, per * bk)
    rate, fixed = TILES[(bm, bn)][3], TILES[(bm, bn)][4]
    mma_us = 2.0 * bm * bn * k_len / (rate * 1e6) + fixed
    load_us = (min(bm, M) * k_len + k_len * bn) * esize / (HBM_GBPS / DEVICE_SMS * 1e3)
    partial_us = 2.0 * 4 * bm * bn * tiles * pieces / (HBM_GBPS * 1e3) if pieces > 1 else 0.0
    return math.ceil(tiles * pieces / num_sms) * max(mma_us, load_us) + partial_us, pieces


def pick_tile(M: int, n_local: int, K: int, num_sms: int = DEVICE_SMS, esize: int = 2) -> tuple[int, int]:
    """The rule's (BLOCK_M, BLOCK_N) for an (M, n_local) output with reduction K on ``num_sms`` SMs."""
    return min(CANDIDATES, key=lambda t: (tile_estimate(M, n_local, K, t, num_sms, esize), t[0] * t[1]))


def heuristic(M: int, n_local: int, K: int, dtype: torch.dtype = torch.bfloat16,
              num_sms: int = DEVICE_SMS, tma: bool = True) -> ScatterConfig:
    """The config ``gemm_all_scatter`` runs when none is given. M up to
    ``kernels.gemm``'s SMALL_M with TMA-addressable operands: the GEMM family's
    small-M choice (its cost model, fitted on the GEMM shape zoo) when that is a
    split or swapped tile, run by the small-M kernel. Otherwise the rule's tile with
    the BLOCK_K, warps and stages the GEMM sweep found best for it (fewer stages
    if they would not fit in shared memory), or (M up to MID_M) ``SPLIT_TILE`` in K
    pieces where the rule scores that cheaper (the module docstring)."""
    if tma and M <= SMALL_M and dtype in (torch.bfloat16, torch.float16):
        g = gemm_heuristic(M, n_local, K, dtype, num_sms)
        if g.split_k is not None and g.tma is not False and not g.pad:
            return ScatterConfig(block_m=g.block_m, block_n=g.block_n, block_k=g.block_k, num_warps=g.num_warps,
                                 num_stages=g.num_stages, split_k=g.split_k, swap_ab=g.swap_ab)
    esize = torch.empty((), dtype=dtype).element_size()
    bm, bn = pick_tile(M, n_local, K, num_sms, esize)
    if tma and M <= MID_M and K >= SPLIT_MIN_K and esize == 2:
        est, pieces = split_estimate(M, n_local, K, num_sms, esize)
        if pieces > 1 and est < tile_estimate(M, n_local, K, (bm, bn), num_sms, esize):
            sbm, sbn, sbk, warps, stages = SPLIT_TILE
            return ScatterConfig(block_m=sbm, block_n=sbn, block_k=sbk, num_warps=warps, num_stages=stages,
                                 split_k=pieces)
    bk, warps, stages = TILES[(bm, bn)][:3]
    cfg = ScatterConfig(block_m=bm, block_n=bn, block_k=bk if esize <= 2 else bk // 2, num_warps=warps,
                        num_stages=stages)
    while cfg.num_stages > 2 and smem_bytes(cfg, esize) > SMEM_LIMIT_SM90:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


# --------------------------------------------------------------------------
# The variant: the family's one decision function
# --------------------------------------------------------------------------
AUTO_TABLE_PATH = Path(__file__).resolve().parents[2] / "results" / "gemm_scatter" / "auto_table.json"
MAX_TABLE_BYTES = 1 << 20   # the table is untrusted input: bounded read
_TABLE: dict = {}


def load_table(path: Path | None = None) -> list[dict] | None:
    """The measured variant table (``experiments/run_gemm_scatter.py --fit``), validated; None when
    absent. Bad content -> ValueError naming the file."""
    path = Path(path or AUTO_TABLE_PATH)
    entries = table_entries(path, MAX_TABLE_BYTES, "a variant table", "experiments/run_gemm_scatter.py")
    if entries is None:
        return None
    try:
        out = []
        for e in entries:
            key = {k: int(e[k]) for k in ("world_size", "M", "N", "K")}
            known = {f.name for f in dataclasses.fields(ScatterConfig)}
            cfg = ScatterConfig(**{k: v for k, v in dict(e["config"]).items() if k in known})
            validate(cfg)
            out.append({**key, "config": cfg})
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: not a variant table ({exc}); delete it or re-run "
                         f"experiments/run_gemm_scatter.py") from None
    return out


FAMILY = "gemm_scatter"   # the selection layer's tables (kernels.comm.choices)


def _tuned(world_size: int | None, dtype) -> tuple[list[dict], str]:
    """This GPU's tuning-table entries of the world size (any when None; and dtype, when given)
    as {world_size, M, N, K, config, ...}, and where they come from; ([], '') when it has none."""
    from kernels.comm import choices

    known = {f.name for f in dataclasses.fields(ScatterConfig)}

    def make(fields) -> ScatterConfig:
        cfg = ScatterConfig(**{k: v for k, v in dict(fields).items() if k in known})
        validate(cfg)
        return cfg
    return choices.usable(FAMILY, make, dtype, world_size=world_size)


def _measured(world_size: int | None, dtype=None) -> tuple[list[dict], str]:
    """This GPU's tuning-table entries of the world size where it has any, else those of
    ``AUTO_TABLE_PATH``; ([], '') when neither has one."""
    rows, where = _tuned(world_size, dtype)
    if rows:
        return rows, where
    if "t" not in _TABLE:
        _TABLE["t"] = load_table()
    rows = [e for e in _TABLE["t"] or [] if world_size is None or e["world_size"] == world_size]
    return rows, (f"measured ({AUTO_TABLE_PATH.name})" if rows else "")


def auto_source(world_size: int | None = None) -> str:
    """Where the choice comes from for ``world_size`` (any when None): 'tuning table (<GPU>)',
    'measured (auto_table.json)', else 'tile rule (fused; no measured table)'."""
    return _measured(world_size)[1] or "tile rule (fused; no measured table)"


def model_features(M: int, n_local: int, K: int, world_size: int, esize: int = 2) -> dict:
    """What the choice model reads of a problem (``kernels.comm.choice_model``): one rank's GEMM
    FLOP and bytes (its N / W columns), and the bytes of C every rank receives."""
    return {"flop": 2.0 * M * n_local * K, "gemm_bytes": float((M * K + K * n_local + M * n_local) * esize),
            "comm_bytes": float(M * n_local * world_size * esize)}


def _model():
    from kernels.comm import choice_model, choices

    return choice_model.lookup(FAMILY, choices.current_device())


def modelled(M: int, n_local: int, K: int, world_size: int, mode: str, esize: int = 2,
             model: dict | None = None) -> ScatterConfig | None:
    """The choice model's variant for a problem in ``mode`` ('eager' or 'graph') as a config (the
    fused kernels with ``heuristic``'s tiles, set by ``auto_config``); None where the model (this
    GPU's, or ``model``) has no group for the world size."""
    from kernels.comm import choice_model

    model = model if model is not None else _model()[0]
    if model is None:
        return None
    name = choice_model.choose(model, mode, model_features(M, n_local, K, world_size, esize), world_size=world_size)
    if name is None:
        return None
    known = {f.name for f in dataclasses.fields(ScatterConfig)}
    cfg = ScatterConfig(**{k: v for k, v in dict(model["configs"][name]).items() if k in known})
    validate(cfg)
    return cfg


def auto_config(M: int, n_local: int, K: int, world_size: int, dtype: torch.dtype = torch.bfloat16,
                num_sms: int = DEVICE_SMS, tma: bool = True, mode: str = "eager") -> ScatterConfig:
    """What ``gemm_all_scatter`` runs when no config is given: the family's one decision
    function (rank 0 runs it; ``kernels.comm.decide`` shares the result with every rank).

    The measured entry (this GPU's tuning tables, family ``gemm_scatter``, written by
    ``experiments/run_gemm_scatter.py``; else ``AUTO_TABLE_PATH``) nearest in log M, N, K among
    those of this world size, which may be any variant: "fused", "senders", or "nccl" /
    "sequential" where neither fused kernel beat the libraries. Without one, the tile rule
    (``heuristic``) with the fused kernel: the "senders" variant is chosen only where it was
    measured to win.

    Before the nearest entry: the problem's own entry, else this GPU's choice model
    (``kernels.comm.choice_model``) for ``mode`` ('eager', or 'graph' while a CUDA graph is captured)."""
    table, _ = _measured(world_size, dtype)
    own = [e for e in table if (e["M"], e["N"], e["K"]) == (M, n_local * world_size, K)]
    try:
        picked = own[0]["config"] if own else modelled(M, n_local, K, world_size, mode, 4 if dtype == torch.float32
                                                       else 2)
    except (KeyError, TypeError, ValueError) as exc:   # a model naming a config that cannot run: said, passed over
        from kernels.common.tables import warn_once

        warn_once(FAMILY, "model config", f"gemm_all_scatter: the choice model names a config that cannot run "
                                          f"({exc}); fit it again (python3 experiments/run_overlap.py --refit)")
        picked = None
    if picked is not None:
        table = [{"M": M, "N": n_local * world_size, "K": K, "config": picked}]
    if table:
        from kernels.comm.choices import nearest

        best = nearest(table, M, n_local * world_size, K)["config"]
        if best.variant in FALLBACKS:
            return best
        if best.variant == "senders" or not best.split_kernel:
            # the measured variant, with this problem's tiles (the table's were another problem's)
            rule = heuristic(M, n_local, K, dtype, num_sms, tma)
            if not rule.split_kernel:
                return dataclasses.replace(rule, variant=best.variant, senders=best.senders)
            return rule
        return best
    return heuristic(M, n_local, K, dtype, num_sms, tma)
