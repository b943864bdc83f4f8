"""Configuration of the fused all-gather + GEMM and its auto-config.

``AgGemmConfig`` holds every knob; ``auto_config`` picks one per problem, in this order:

1. this GPU's tuning tables (the selection layer's, ``kernels.comm.choices``: family
   ``ag_gemm``, the user's over the shipped ones), written from the fit half of the LLM shape
   set by ``experiments/run_ag_gemm.py`` (``OUT/tables/``): per measured problem (world size,
   gather dim, M, N, K, dtype) the fastest way in eager calls, one of our variants or
   ``"sequential"``, ``"nccl"`` (NCCL + cuBLAS) or ``"torch"`` (PyTorch's fused op) where
   those win;
   read for the problem's own entry only;
2. this GPU's choice model (``kernels.comm.choice_model``, ``<GPU>/ag_gemm.model.json`` beside the
   tables): every candidate's time predicted on the shape asked, in the mode being served (eager
   calls, or a CUDA graph being captured), the fastest taken;
3. without a model for the world size and gather dim: the nearest measured entry of 1., else of
   ``results/ag_gemm/auto_table.json``, the seed-shape study's table (its README names the node);
4. where none covers the world size, a PLACEHOLDER rule, not fitted to any GPU data.

``auto_source()`` says which, and the benchmark rows carry it (``auto_source`` column), so a
result can never pass a placeholder off as a measurement.
"""
from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

from kernels.common.configs import config_of, table_entries

VARIANTS = ("fused", "copy_engine", "chunked", "pipelined", "sequential", "nccl", "torch")
# the variants that are not our fused kernels: ours in sequence, the libraries in sequence, and
# PyTorch's own fused op (async-TP), each chosen where it is the fastest way to do the work
FALLBACKS = ("sequential", "nccl", "torch")
# Variants the choice model never takes off the table, per gather dim, whatever the fitted
# shapes said. PyTorch's fused op gathered along K adds the shards' partial products in the
# output dtype: on 2 H200s its bf16 error sat at 1.4-2.2x the tolerance's absolute term on every
# shape (ours: at most 1.35x) and missed the tolerance on 4 of 20 random shapes the fit never saw
# (K >= 11264), at 4 ranks on 13 of 15 LLM shapes. Passing on the fitted shapes proves nothing
# for the next one. copy_engine and pipelined: their GEMM polled on every SM for copies the
# driver may run as kernels, and timed out (2 and 4 ranks, some shapes, eager and graph); the GEMM
# now leaves SMs free (``copies.CE_SPARE_SMS``), checked at 2 ranks (eager and graph) but not yet
# at 4, and the models' times of both predate it: until both are done the model does not pick
# them. A measured table entry of the problem itself may still name any of them.
_POLLS_FOR_COPIES = ("its GEMM, polling on every SM, starved copies the driver ran as kernels (timeouts at 4 "
                     "ranks); leaving SMs free it passed at 2 ranks, not yet run at 4, and the fitted times predate it")
NEVER_OFF_TABLE = {0: {"copy_engine": _POLLS_FOR_COPIES, "pipelined": _POLLS_FOR_COPIES},
                   1: {"torch": "adds the K shards' partial products in the output dtype: error near or past "
                                "the tolerance, unpredictable off the measured shapes",
                       "copy_engine": _POLLS_FOR_COPIES, "pipelined": _POLLS_FOR_COPIES}}
LAYOUTS = ("k", "m")
K_SCHEDULES = ("rows", "sum")
FETCH_ORDERS = ("m", "k")
AUTO_TABLE_PATH = Path(__file__).resolve().parents[2] / "results" / "ag_gemm" / "auto_table.json"
MAX_TABLE_BYTES = 1 << 20  # the table is untrusted input: bounded read


@dataclasses.dataclass(frozen=True)
class AgGemmConfig:
    """Every knob. ``num_sms``: programs in all (fetchers + GEMM; default: the
    device's SM count, 4 + fetchers in a simulated world)."""

    variant: str = "fused"
    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_stages: int = 3
    num_warps: int = 8
    fetchers: int = 16        # fused: programs that fetch (the rest compute)
    k_per_flag: int = 8       # BLOCK_K tiles per ready flag (a k-group)
    layout: str = "k"         # staging: "k" (k-contiguous) or "m" (m-contiguous)
    num_sms: int | None = None
    ce_chunks: int = 4        # copy_engine, pipelined: chunk copies per peer shard; chunked along K: row chunks
    # chunked along K: "rows" (row chunks of C over the whole K, as every shard's rows land) or
    # "sum" (our shard's product at once, each peer's added as it lands, summed in fp32)
    k_schedule: str = "rows"
    chunk_growth: int = 1     # chunked along K, rows: each row chunk this many times the previous one
    max_spins: int | None = None  # DEPRECATED and ignored: waits are bounded in time (all_gather_matmul's timeout_s)
    staged_flag: bool = True  # one more flag, "all staged": GEMM programs stop polling once it is set
    tma: bool = True          # GEMM programs load A and B through TMA where the operands allow (launch.tma_allowed)
    claim_tiles: bool = True  # GEMM tiles taken from a counter; on a GPU fetchers join the GEMM once done
    fetch_order: str = "m"    # fused: a peer's tiles row tile by row tile ("m") or k-group by k-group ("k")
    wait_growth: int = 2      # GEMM programs wait on spans of 1, g, g^2, ... k-groups (1: group by group)
    publish_all: bool = True  # every program helps copy our shard into the heap first (False: the fetchers only)
    skip_rank: int = -1       # fault injection for tests: fetchers skip this rank's shard

    def replace(self, **kw) -> "AgGemmConfig":
        return dataclasses.replace(self, **kw)


def _pow2(x) -> bool:
    return isinstance(x, int) and x >= 1 and not x & (x - 1)


def as_config(config) -> AgGemmConfig | None:
    return config_of(config, AgGemmConfig, "all_gather_matmul")


SMEM_LIMIT_SM90 = 232448   # bytes of shared memory one block may use on sm_90


def pipelined_smem(c: AgGemmConfig, esize: int = 2) -> int:
    """Shared memory the pipelined variant's GEMM launch asks for: two pipelined loops (our
    shard's rows and the peers' chunks), each with its own ``num_stages`` A and B tiles. Cross-
    compiled for sm_90 (bf16, 128x256x64, 3 stages): 294,968 bytes, this count plus 56."""
    return 2 * c.num_stages * (c.block_m * c.block_k + c.block_k * c.block_n) * esize


# The pipelined variant's default tile: 128x128 with 3 stages fits twice (196,664 bytes cross-compiled,
# 122 registers); 128x256 with 3 stages does not (the other variants' default, one loop).
PIPELINED = dict(variant="pipelined", block_n=128)


def validate(c: AgGemmConfig, world_size: int, esize: int = 2) -> None:
    """Raise ValueError naming the bad field and what to use instead."""
    if c.variant not in VARIANTS:
        raise ValueError(f"all_gather_matmul: variant must be one of {VARIANTS}, got {c.variant!r}")
    if c.fetch_order not in FETCH_ORDERS:
        raise ValueError(f"all_gather_matmul: fetch_order must be 'm' (row tile by row tile) or 'k' (k-group by "
                         f"k-group across the row tiles), got {c.fetch_order!r}")
    if c.k_schedule not in K_SCHEDULES:
        raise ValueError(f"all_gather_matmul: k_schedule must be 'rows' (row chunks over the whole K) or 'sum' "
                         f"(per-shard products summed in fp32), got {c.k_schedule!r}")
    if c.layout not in LAYOUTS:
        raise ValueError(f"all_gather_matmul: layout must be 'k' (k-contiguous) or 'm' (m-contiguous), "
                         f"got {c.layout!r}")
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(c, name)
        if not _pow2(v) or v < 16:
            raise ValueError(f"all_gather_matmul: {name} must be a power of two >= 16 (tl.dot's minimum), got {v!r}")
    if c.max_spins is not None:
        warnings.warn("AgGemmConfig.max_spins is ignored: waits are bounded in time, not in polls; pass "
                      "timeout_s= to all_gather_matmul (or set $WORKBENCH_WAIT_TIMEOUT_S) and drop max_spins",
                      FutureWarning, stacklevel=3)
    for name in ("group_m", "num_stages", "k_per_flag", "ce_chunks", "wait_growth", "chunk_growth"):
        v = getattr(c, name)
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"all_gather_matmul: {name} must be a positive integer, got {v!r}")
    if c.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"all_gather_matmul: num_warps must be 1, 2, 4, 8 or 16, got {c.num_warps!r}")
    if not isinstance(c.fetchers, int) or c.fetchers < 1:
        raise ValueError(f"all_gather_matmul: fetchers must be a positive integer, got {c.fetchers!r}")
    if c.num_sms is not None and (not isinstance(c.num_sms, int) or c.num_sms < 2):
        raise ValueError(f"all_gather_matmul: num_sms must be an integer >= 2 (fetchers + GEMM programs), "
                         f"got {c.num_sms!r}")
    if c.variant == "fused" and c.num_sms is not None and c.fetchers >= c.num_sms:
        raise ValueError(f"all_gather_matmul: fetchers ({c.fetchers}) must be fewer than num_sms ({c.num_sms}): "
                         "GEMM programs need the rest")
    if c.variant == "pipelined" and pipelined_smem(c, esize) > SMEM_LIMIT_SM90:
        raise ValueError(f"all_gather_matmul: variant 'pipelined' runs two pipelined loops of {c.num_stages} stages "
                         f"of {c.block_m}x{c.block_n}x{c.block_k} tiles: {pipelined_smem(c, esize)} bytes of shared "
                         f"memory, over sm_90's {SMEM_LIMIT_SM90}; use block_n=128 (its default tile) or fewer stages")
    if c.variant in ("copy_engine", "chunked", "pipelined") and c.layout != "k":
        raise ValueError(f"all_gather_matmul: variant {c.variant!r} copies whole shards, which needs the "
                         "k-contiguous staging layout: use layout='k'")
    for name in ("staged_flag", "tma", "claim_tiles", "publish_all"):
        if not isinstance(getattr(c, name), bool):
            raise ValueError(f"all_gather_matmul: {name} must be True or False, got {getattr(c, name)!r}")
    if not isinstance(c.skip_rank, int) or c.skip_rank >= world_size or c.skip_rank < -1:
        raise ValueError(f"all_gather_matmul: skip_rank must be -1 or a rank below {world_size}, got {c.skip_rank!r}")


# --------------------------------------------------------------------------
# Auto-config
# --------------------------------------------------------------------------
# PLACEHOLDER rule (not fitted; see the module docstring). Reasoning it encodes:
# the fused kernel hides the gather behind the GEMM only when the GEMM is long
# enough to hide it: below PLACEHOLDER_MIN_FLOP (per rank) the sequential path
# (one all-gather launch + one GEMM) is taken. Fetchers: enough to pull
# (W-1) shards at NVLink speed while the GEMM runs, ~1/8 of the SMs (they join the GEMM
# when done). Tiles: the default 128x256 (on one H200 at world size 1, N 3584, K 8192:
# 88 us against 122 us for 128x128 at M 1024, whose 112 wide tiles leave SMs idle,
# and 350 against 429 us at M 4096; results/ag_gemm/w1_local).
PLACEHOLDER_MIN_FLOP = 2 * 1024 * 1024 * 1024  # 2 GFLOP: ~3 us of an H200's tensor cores
PLACEHOLDER_FETCH_FRACTION = 8
_SIM_CONFIG = AgGemmConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_stages=1, num_warps=1, fetchers=2,
                           k_per_flag=2, num_sms=5, ce_chunks=2)


def load_table(path: Path | None = None) -> list[dict] | None:
    """The measured table, validated (None when absent). Bad content -> ValueError naming the file."""
    path = Path(path or AUTO_TABLE_PATH)
    entries = table_entries(path, MAX_TABLE_BYTES, "an auto-config table", "experiments/run_ag_gemm.py")
    if entries is None:
        return None
    known = {f.name for f in dataclasses.fields(AgGemmConfig)}
    out = []
    for i, e in enumerate(entries):
        try:
            key = {k: int(e[k]) for k in ("world_size", "gather_dim", "M", "N", "K")}
            cfg = {k: v for k, v in dict(e["config"]).items() if k in known and k != "max_spins"}
            config = AgGemmConfig(**cfg)
            validate(config, key["world_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: entry {i} is malformed ({exc}); re-run experiments/run_ag_gemm.py") from None
        out.append({**key, "config": config})
    return out


_TABLE: dict = {}
FAMILY = "ag_gemm"   # the selection layer's tables (kernels.comm.choices)


def _config_of(fields) -> AgGemmConfig:
    known = {f.name for f in dataclasses.fields(AgGemmConfig)}
    return AgGemmConfig(**{k: v for k, v in dict(fields).items() if k in known and k != "max_spins"})


def _tuned(world_size: int, gather_dim: int, dtype) -> tuple[list[dict], str]:
    """This GPU's tuning-table entries of the world size and gather dim (and dtype, when given)
    as {M, N, K, config, ...}, and where they come from; ([], '') when it has none."""
    from kernels.comm import choices

    def make(fields) -> AgGemmConfig:
        cfg = _config_of(fields)
        validate(cfg, world_size)
        return cfg
    return choices.usable(FAMILY, make, dtype, world_size=world_size, gather_dim=gather_dim)


def _measured(world_size: int | None, gather_dim: int | None = None, dtype=None) -> tuple[list[dict], str]:
    """The measured choices that serve a problem: this GPU's tuning tables where they have
    entries of its world size (and gather dim), else ``AUTO_TABLE_PATH`` (measured on the node
    its README names); ([], '') when neither has any."""
    if world_size is not None:
        for gd in ((gather_dim,) if gather_dim is not None else (0, 1)):
            rows, where = _tuned(world_size, gd, dtype)
            if rows:
                return rows, where
    if "t" not in _TABLE:
        _TABLE["t"] = load_table()
    rows = [e for e in _TABLE["t"] or [] if (world_size is None or e["world_size"] == world_size)
            and (gather_dim is None or e["gather_dim"] == gather_dim)]
    return rows, (f"measured ({AUTO_TABLE_PATH.name})" if rows else "")


def auto_source(world_size: int | None = None) -> str:
    """Where ``auto_config``'s choices come from for ``world_size`` (any, when None): 'choice model
    (<file>)', 'tuning table (<GPU>)', 'measured (auto_table.json)', or 'placeholder rule (not fitted)'."""
    model, where = _model()
    if model is not None and any(world_size in (None, g["match"].get("world_size")) for g in model["groups"]):
        return f"choice model ({Path(where).name})"
    return _measured(world_size)[1] or "placeholder rule (not fitted)"


def model_features(M: int, N: int, K: int, world_size: int, esize: int = 2) -> dict:
    """What the choice model reads of a problem (``kernels.comm.choice_model``): the GEMM's FLOP
    and bytes on one rank, and the bytes of A a rank receives."""
    from kernels.ag_gemm import metrics

    return {"flop": float(metrics.flops(M, N, K)), "gemm_bytes": float(metrics.gemm_bytes(M, N, K, esize)),
            "comm_bytes": float(metrics.gathered_bytes(M, K, world_size, esize))}


def _model():
    from kernels.comm import choice_model, choices

    return choice_model.lookup(FAMILY, choices.current_device())


def modelled(M: int, N: int, K: int, world_size: int, gather_dim: int, mode: str, esize: int = 2,
             model: dict | None = None) -> AgGemmConfig | None:
    """The choice model's pick for a problem in ``mode`` ('eager' or 'graph'), None where the model
    (this GPU's, or ``model``) has no group for the world size and gather dim."""
    from kernels.comm import choice_model

    model = model if model is not None else _model()[0]
    if model is None:
        return None
    never = NEVER_OFF_TABLE.get(gather_dim, {})   # also where a model fitted without the rule names it
    exclude = {n for n, c in model["configs"].items() if isinstance(c, dict) and c.get("variant") in never}
    name = choice_model.choose(model, mode, model_features(M, N, K, world_size, esize), exclude=exclude,
                               world_size=world_size, gather_dim=gather_dim)
    if name is None:
        return None
    cfg = _config_of(model["configs"][name])
    validate(cfg, world_size, esize)
    return cfg


def auto_config(M: int, N: int, K: int, world_size: int, gather_dim: int, num_sms: int,
                simulated: bool = False, dtype=None, mode: str = "eager") -> AgGemmConfig:
    """The configuration for a gathered problem C (M x N) = A (M x K) @ B (K x N): the family's
    one decision function. With ``config=None`` rank 0 calls it once per new problem and every
    rank runs what it returned (``kernels.comm.decide``), so it may read per-device tables that
    differ between ranks. It may return any variant, ``"nccl"`` (NCCL + cuBLAS), ``"torch"``
    (PyTorch's fused op) and ``"sequential"`` included, where nothing fused wins: the entry of
    the problem's own measured entry, else the choice model's pick for ``mode`` ('eager', or
    'graph' while a CUDA graph is captured), else the nearest measured problem's (``_measured``),
    else the placeholder rule."""
    if simulated:
        return _SIM_CONFIG
    from kernels.comm.choices import nearest

    table, _ = _measured(world_size, gather_dim, dtype)
    own = [e for e in table if (e["M"], e["N"], e["K"]) == (M, N, K)]
    if own:
        return own[0]["config"]
    esize = 4 if "float32" in str(dtype) else 2
    try:
        picked = modelled(M, N, K, world_size, gather_dim, mode, esize)
    except (KeyError, TypeError, ValueError) as exc:   # a model naming a config that cannot run: said, passed over
        from kernels.common.tables import warn_once

        warn_once(FAMILY, "model config", f"all_gather_matmul: the choice model names a config that cannot run "
                                          f"({exc}); fit it again (python3 experiments/run_overlap.py --refit)")
        picked = None
    if picked is not None:
        return picked
    if table:
        best = nearest(table, M, N, K)
        # A fallback was measured where fusing lost, which happens on short GEMMs (too little to
        # hide the gather behind): it covers problems up to its own size. A larger problem takes
        # the nearest entry that fuses (held out at 4 ranks, M-gathered 2048x3584x8192 was sent to
        # the fallback of M 1024 and lost 1.2x to the fused entry of M 4096, equally near).
        fused = [e for e in table if e["config"].variant not in FALLBACKS]
        if best["config"].variant in FALLBACKS and M * N * K > best["M"] * best["N"] * best["K"] and fused:
            best = nearest(fused, M, N, K)
        return best["config"]
    if 2 * M * N * K / world_size < PLACEHOLDER_MIN_FLOP:
        return AgGemmConfig(variant="sequential")
    fetchers = max(4, num_sms // PLACEHOLDER_FETCH_FRACTION)
    return AgGemmConfig(variant="fused", fetchers=fetchers, num_sms=num_sms)
