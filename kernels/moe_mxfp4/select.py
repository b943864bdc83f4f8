"""The MXFP4 down-projection in the selection layer (``kernels.common.select``): a call's
problem key, its candidates as (variant, config) pairs, the cold rule's candidate, table
entries, tune-on-miss on the call's own tensors, and ``workbench tune moe_mxfp4``.

Problem key: ``M=..,top_k=..,E=..,H=..,K=..,act=bf16|mxfp4,prepack=0..3,det=0|1,bm=..``:
tokens M rounded up to a power of two (one entry serves M 65-128, ...), the layer's
shape (experts E, output columns H, reduction K = I), the activations' format, the
layout level of the weights (``Mxfp4Weights.level``: a config must read that layout),
the epilogue asked for (atomic, or the deterministic mode) and the row tile the routing
was padded to (``prepare_routing(..., block_m)``: a config's BLOCK_M must equal it, so
the launcher chooses among that row tile's configs; ``block_m_for`` picks the row tile).
Which tokens go to which experts is not in the key.

Variants: ``atomic`` (one kernel adding each pair's row into the output with bf16 atomics;
SPLIT_K programs per tile allowed) and ``deterministic`` (per-pair rows into a workspace,
then a reduction kernel); the key's ``det`` fixes which one a call may run.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

import torch
from triton.errors import TritonError

from kernels.common import select as common
from kernels.common import tune as common_tune

from .config import (INTERPRET_CONFIG, MoeMxfp4Config, block_m_for, config_for_block_m, every_part_has_a_step,
                     with_split_k)
from .plan import Call, builder, call_of
from .quant import PREPACK_H_MULTIPLE

NAME = "moe_mxfp4"
ACTS = ("bf16", "mxfp4")
ATOMIC, DETERMINISTIC = "atomic", "deterministic"


def bucket(M: int) -> int:
    """Tokens rounded up to a power of two (0 stays 0)."""
    return 0 if M <= 0 else 1 << (M - 1).bit_length()


def _key_fields(M, top_k, E, H, K, act, prepack, det, bm) -> dict[str, Any]:
    return {"M": bucket(M), "top_k": top_k, "E": E, "H": H, "K": K, "act": act, "prepack": prepack,
            "det": int(bool(det)), "bm": bm}


def problem(call: Call) -> dict[str, Any]:
    return _key_fields(call.M, call.top_k, call.E, call.H, call.K, call.act, call.level, call.deterministic,
                       call.block_m)


def variant_of(config: MoeMxfp4Config) -> str:
    return DETERMINISTIC if config.DETERMINISTIC else ATOMIC


# --------------------------------------------------------------------------
# The cold rule and the candidates
# --------------------------------------------------------------------------
def cold_config(call: Call) -> MoeMxfp4Config:
    """What the launcher has always run without a config (``default_config``'s rule for the
    routing's row tile and the weights' layout, with the SPLIT_K of ``split_k_for``), in the
    epilogue the call asks for."""
    det, bm, K, H = call.deterministic, call.block_m, call.K, call.H
    if call.level:
        cfg = config_for_block_m(bm, K, prepacked=call.level, H=H, deterministic=det)
    elif call.interpret:
        cfg = INTERPRET_CONFIG.replace(BLOCK_M=bm, BLOCK_K=64 if K % 64 == 0 else 32, DETERMINISTIC=det)
    else:
        cfg = config_for_block_m(bm, K, deterministic=det)
    # too few output tiles for the SMs: split K (partial sums through the atomic epilogue)
    return with_split_k(cfg, call.routing.max_blocks, H, K, call.sms)


def cold(call: Call) -> common.Candidate:
    cfg = cold_config(call)
    return common.Candidate(cfg.label(), variant_of(cfg), cfg)


# Each candidate is a compile (seconds: unrolled K steps with inline PTX) before it is timed, so
# the lists hold the defaults and the variants that came within a few percent of them in the
# study (results/moe_mxfp4/README.md, KIMI-K2.5 on the H200), not every tile that runs.
def _prepacked_tiles(bm: int, level: int) -> list[MoeMxfp4Config]:
    """Tiles for weights prepacked at ``level`` (SWAP_AB, 4 warps, BLOCK_N % 64, BLOCK_K % 128)."""
    C = MoeMxfp4Config
    if bm == 16:   # the default (la1); la0 (1-2% slower), a 64-register cap (1-2% faster), BN128 (within 1%)
        base = C(BLOCK_M=16, BLOCK_N=64, NT=True, PREPACK=level)
        return [base.replace(LOAD_AHEAD=1), base, base.replace(LOAD_AHEAD=1, maxnreg=64),
                base.replace(BLOCK_N=128, LOAD_AHEAD=1)]
    if bm == 32:   # the default (BN64); not measured in its own range (M 685-2053 at KIMI-K2.5)
        base = C(BLOCK_M=32, BLOCK_N=64, NT=True, PREPACK=level)
        return [base, base.replace(LOAD_AHEAD=1), base.replace(BLOCK_N=128)]
    # BM64 / BM128 swap (the weights are wgmma's 64-row side), NT off (an expert's row blocks reread
    # them); at M = 16384 BN128 ran 1.2-1.4x faster than BN64 (where H % 128 == 0)
    base = C(BLOCK_M=bm, BLOCK_N=64, SWAP_AB=True, NT=False, PREPACK=level)
    return [base.replace(BLOCK_N=128), base]


def _plain_tiles(bm: int, bk: int, interpret: bool) -> list[MoeMxfp4Config]:
    """Tiles for the plain layout (``config._BY_BLOCK_M`` and its measured neighbours); in the
    interpreter, small ones (correctness only: its timings mean nothing)."""
    C = MoeMxfp4Config
    if interpret:
        base = INTERPRET_CONFIG.replace(BLOCK_M=bm, BLOCK_K=min(bk, 64))
        return [base, base.replace(BLOCK_N=64)]
    if bm == 16:   # BN64 (6-12% ahead of BN128 at most M), the seed's two latency switches off (1-3.5% at M 16-32)
        base = C(BLOCK_M=16, BLOCK_N=64, BLOCK_K=bk, NT=True)
        return [base, base.replace(BLOCK_N=128), base.replace(EARLY_LOADS=False, PREFETCH_EPILOGUE=False)]
    if bm == 32:
        base = C(BLOCK_M=32, BLOCK_N=128, BLOCK_K=bk, NT=True)
        return [base, base.replace(BLOCK_N=64)]
    if bm == 64:
        base = C(BLOCK_M=64, BLOCK_N=128, BLOCK_K=bk, NT=False)
        return [base, base.replace(BLOCK_N=64)]
    base = C(BLOCK_M=128, BLOCK_N=256, BLOCK_K=bk, num_warps=8, NT=False)   # 18% ahead of BN128 at M = 16384
    return [base, base.replace(BLOCK_N=128)]


def _splits(cfg: MoeMxfp4Config, K: int) -> list[int]:
    """SPLIT_K values next to ``cfg``'s (half and double, of 1, 2, 4) that keep at least two K
    steps per program and one in every part: where the rule may be one step off."""
    total = -(-K // cfg.BLOCK_K)
    return [s for s in (cfg.SPLIT_K // 2, cfg.SPLIT_K * 2)
            if s in (1, 2, 4) and -(-total // s) >= 2 and every_part_has_a_step(total, s)]


def candidates(call: Call) -> dict[str, common.Candidate]:
    """Every candidate worth timing on this call, the cold rule's first: the row tile's
    configurations for the weights' layout, each in the call's epilogue (atomic: with the
    SPLIT_K rule's split for that tile), and the cold tile with the SPLIT_K next to the rule's.
    Only configs this call can run."""
    start = cold_config(call)
    bk = 128
    while call.K % bk and bk > 32:
        bk //= 2
    tiles = (_prepacked_tiles(call.block_m, call.level) if call.level
             else _plain_tiles(call.block_m, bk, call.interpret))
    blocks = call.routing.max_blocks
    configs = [start] + [with_split_k(t.replace(DETERMINISTIC=call.deterministic), blocks, call.H, call.K, call.sms)
                         for t in tiles]
    if not call.deterministic:
        configs += [start.replace(SPLIT_K=s) for s in _splits(start, call.K)]
    out: dict[str, common.Candidate] = {}
    for cfg in configs:
        name = cfg.label()
        if name in out:
            continue
        try:
            usable(call, cfg)
        except ValueError:
            continue
        out[name] = common.Candidate(name, variant_of(cfg), cfg)
    return out


def usable(call: Call, config: MoeMxfp4Config) -> None:
    """Raise ValueError unless ``config`` can run this call (what the launcher would refuse,
    and the epilogue the call asked for)."""
    if not isinstance(config, MoeMxfp4Config):
        raise ValueError(f"moe_mxfp4: a candidate must be a MoeMxfp4Config, got {type(config).__name__}")
    config.validate(call.K)
    if config.BLOCK_M != call.block_m:
        raise ValueError(f"BLOCK_M={config.BLOCK_M} but the routing was padded to {call.block_m} rows")
    if config.PREPACK != call.level:
        raise ValueError(f"PREPACK={config.PREPACK} but the weights are in layout level {call.level}")
    if config.DETERMINISTIC != call.deterministic:
        raise ValueError(f"DETERMINISTIC={config.DETERMINISTIC} but the call asked for the "
                         f"{'deterministic' if call.deterministic else 'atomic'} epilogue")


# --------------------------------------------------------------------------
# Table entries
# --------------------------------------------------------------------------
_NULLABLE = {"SWAP_AB": bool, "maxnreg": int}


def config_from_dict(knobs: Mapping[str, Any]) -> MoeMxfp4Config:
    """A MoeMxfp4Config from a table entry's ``config`` (fields missing take their defaults);
    an unknown field or a value of the wrong type is a ValueError."""
    if not isinstance(knobs, Mapping):
        raise ValueError(f"config must be a mapping of MoeMxfp4Config fields, got {type(knobs).__name__}")
    fields = {f.name: f for f in dataclasses.fields(MoeMxfp4Config)}
    unknown = sorted(set(knobs) - set(fields))
    if unknown:
        raise ValueError(f"no knob(s) {unknown} in MoeMxfp4Config")
    for name, value in knobs.items():
        want = _NULLABLE.get(name) or type(fields[name].default)
        if value is None and name in _NULLABLE:
            continue
        if type(value) is not want:   # exact: a bool is not an int here, nor 64.0
            raise ValueError(f"{name}={value!r} must be {want.__name__}" + (" or null" if name in _NULLABLE else ""))
    return MoeMxfp4Config(**knobs)


@dataclasses.dataclass
class Family:
    """The selection layer's view of one call (``from_entry`` checks an entry against it)."""

    call: Call | None
    name: str = NAME

    def from_entry(self, entry: Mapping[str, Any], problem: Mapping[str, Any]) -> common.Candidate:
        cfg = config_from_dict(entry["config"])
        usable(self.call, cfg)
        if entry["variant"] != variant_of(cfg):
            raise ValueError(f"variant {entry['variant']!r} but the config's epilogue is {variant_of(cfg)!r}")
        return common.Candidate(str(entry["candidate"]), variant_of(cfg), cfg)

    def to_entry(self, candidate: common.Candidate) -> dict:
        return {"candidate": candidate.name, "variant": candidate.variant,
                "config": dataclasses.asdict(candidate.config)}


# --------------------------------------------------------------------------
# Tune-on-miss
# --------------------------------------------------------------------------
def agree(ref: torch.Tensor, out: torch.Tensor, top_k: int) -> bool:
    """Two candidates' outputs agree: the same NaN and infinities, and every finite element
    within (top_k + 1) * 2**-7 of its output row's RMS. The configs add the same bf16-rounded
    rows in other orders (atomics, SPLIT_K partial rows, level 3's K order), errors of about
    2**-8 of the row's scale; an unwritten or misplaced tile is off by the element itself."""
    r, o = ref.float(), out.float()
    if not (torch.equal(r.isnan(), o.isnan()) and torch.equal(r.isinf(), o.isinf())):
        return False
    fin = r.isfinite()
    rf, of = torch.where(fin, r, 0.0), torch.where(fin, o, 0.0)
    rms = rf.pow(2).mean(dim=-1, keepdim=True).sqrt()
    return bool(((of - rf).abs() <= (top_k + 1) * 2.0 ** -7 * rms + 1e-6).all())


Build = Any   # callable(config) -> run(out) -> out: the launcher's plan for that config (explicit)


def tuner(call: Call, build: Build, budget: float | None = None, timer=None, progress=None, warm: bool = False):
    """The tune-on-miss callable for ``common.choose``: times this call's candidates on its own
    tensors, into scratch outputs (the caller's ``out`` is untouched). ``build(config)`` gives a
    runner of the launcher's plan for that config. ``warm``: run every candidate once before the
    timing starts (compiles outside the budget: ``workbench tune``)."""
    def run(cold_candidate: common.Candidate):
        cands = list(candidates(call).values())
        scratch = torch.empty((call.M, call.H), dtype=torch.bfloat16, device=call.a.device)
        runners: dict[str, Any] = {}

        def runner(cand):
            if cand.name not in runners:
                runners[cand.name] = _runtime_errors(build(cand.config))
            return runners[cand.name]

        if warm:
            for cand in [cold_candidate] + cands:
                try:
                    runner(cand)(scratch)
                except (ValueError, RuntimeError, TypeError):
                    pass   # tune() runs it again and says why it failed

        def make(cand: common.Candidate):
            go = runner(cand)
            first = [True]

            def once():
                # The first run writes a copy the others are compared with (the cold one's).
                out = torch.empty_like(scratch) if first[0] else scratch
                first[0] = False
                return go(out)
            once.candidate = cand.name
            return once

        return common_tune.tune(cands, cold_candidate, make, agree=functools.partial(agree, top_k=call.top_k),
                                budget=budget, timer=timer, progress=progress)
    return run


def _runtime_errors(run):
    """``run`` with Triton's compile and resource errors (not RuntimeErrors) raised as RuntimeError,
    which the tuner reports as that candidate's failure instead of failing the user's call."""
    def checked(out):
        try:
            return run(out)
        except TritonError as exc:
            raise RuntimeError(f"{type(exc).__name__}: {str(exc)[:300]}") from exc
    return checked


def choose(call: Call, build: Build, *, tune: bool = False, capturing: bool = False, budget: float | None = None,
           timer=None, tables=None) -> common.Choice:
    """Which candidate runs this call when no config was given (see ``kernels.common.select``)."""
    if call.M == 0:   # nothing to run: no table, no tuning
        return common.Choice(cold(call), "cold", "empty call")
    index = None
    if call.a.device.type == "cuda" and not call.interpret:
        index = call.a.device.index if call.a.device.index is not None else torch.cuda.current_device()
    device = common.device_of(index)
    return common.choose(Family(call), problem(call), device, cold=lambda: cold(call), tune=tune,
                         capturing=capturing, tuner=tuner(call, build, budget, timer), tables=tables)


# --------------------------------------------------------------------------
# ``workbench tune moe_mxfp4``: one shape of a spec at a time
# --------------------------------------------------------------------------
MAX_TOKENS = 1 << 20
MAX_EXPERTS = 4096
MAX_DIM = 1 << 16
MAX_WEIGHT_BYTES = 16 << 30
FIELDS = ("M", "E", "top_k", "H", "K")


def shape_of(row: Mapping[str, Any]) -> dict:
    """A shape spec row checked: M tokens (1 .. 2^20), E experts, top_k (1 .. E), H output
    columns, K = I the reduction (a multiple of 32), act (bf16 or mxfp4 activations, default
    bf16), prepack (the weights' layout level 0-3, default 2 as ``prepare_weights`` makes; 1-3
    need H % 8 == 0),
    deterministic (0/1, default 0), block_m (the routing's row tile, default ``block_m_for``).
    Other fields (source, ...) are kept as they are."""
    def bad(msg: str):
        raise ValueError(f"moe_mxfp4 shape {dict(row)}: {msg}")

    out = dict(row)
    limits = {"M": MAX_TOKENS, "E": MAX_EXPERTS, "top_k": 64, "H": MAX_DIM, "K": MAX_DIM}
    for k in FIELDS:
        v = row.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= limits[k]:
            bad(f"{k} must be an integer from 1 to {limits[k]}, got {v!r}")
    M, E, top_k, H, K = (row[k] for k in FIELDS)
    if top_k > E:
        bad(f"top_k={top_k} is more than the E={E} experts (each token picks top_k distinct experts)")
    if K % 32:
        bad(f"K={K} (the intermediate size I) must be a multiple of 32, one MXFP4 scale per 32 values")
    act = row.get("act", "bf16")
    if act not in ACTS:
        bad(f"act must be 'bf16' (w4a16) or 'mxfp4' (a4w4 activations), got {act!r}")
    prepack = row.get("prepack", 2)
    if isinstance(prepack, bool) or prepack not in (0, 1, 2, 3):
        bad(f"prepack must be the weights' layout level 0 (plain), 1, 2 or 3, got {prepack!r}")
    if prepack and H % PREPACK_H_MULTIPLE:
        bad(f"prepack={prepack} needs H % {PREPACK_H_MULTIPLE} == 0 (got H={H}); use prepack: 0")
    det = row.get("deterministic", 0)
    if det not in (0, 1):          # True / False are 1 / 0
        bad(f"deterministic must be 0 or 1 (true/false), got {det!r}")
    bm = row.get("block_m", block_m_for(M, top_k, E))
    if isinstance(bm, bool) or bm not in (16, 32, 64, 128):
        bad(f"block_m (the routing's row tile) must be 16, 32, 64 or 128, got {bm!r}")
    if E * H * K // 2 > MAX_WEIGHT_BYTES:
        bad(f"the packed weights would take {E * H * K // 2 / 2**30:.1f} GiB, more than {MAX_WEIGHT_BYTES >> 30}")
    out.update(act=act, prepack=int(prepack), deterministic=int(det), block_m=int(bm))
    return out


def key_of(shape: Mapping[str, Any]) -> str:
    """The table key ``tune_shape`` writes for this shape."""
    return common.problem_key(_key_fields(shape["M"], shape["top_k"], shape["E"], shape["H"], shape["K"],
                                          shape["act"], shape["prepack"], shape["deterministic"], shape["block_m"]))


@functools.lru_cache(maxsize=1)
def _weights(E: int, H: int, K: int, level: int, device: str):
    """Random [E, H, K] weights (std 0.02), quantized and prepared at ``level``: one layer's,
    kept while the spec's shapes of that layer are tuned."""
    from .quant import prepare_weights, quantize_mxfp4

    g = torch.Generator(device=device).manual_seed(E * 7 + H * 11 + K * 13)
    w = torch.empty(E, H, K // 2, dtype=torch.uint8, device=device)
    ws = torch.empty(E, H, K // 32, dtype=torch.uint8, device=device)
    step = max(1, (1 << 28) // (H * K))          # about 1 GiB of fp32 temporaries at a time
    for e0 in range(0, E, step):
        e1 = min(E, e0 + step)
        w[e0:e1], ws[e0:e1] = quantize_mxfp4(torch.randn(e1 - e0, H, K, device=device, generator=g) * 0.02)
    return prepare_weights(w, ws, level)


def operands(shape: Mapping[str, Any], device: str, seed: int = 0):
    """(activations, their scales or None, topk_ids, topk_weights) for a shape: random bf16
    activations (quantized for act: mxfp4), each token routed to top_k distinct random experts
    with softmax weights."""
    from .quant import quantize_mxfp4

    M, E, top_k, K = shape["M"], shape["E"], shape["top_k"], shape["K"]
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.rand(M, E, device=device, generator=g).topk(top_k, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(M, top_k, device=device, generator=g), -1)
    a = torch.randn(M * top_k, K, device=device, generator=g).bfloat16()
    if shape["act"] == "mxfp4":
        q, s = quantize_mxfp4(a.float())
        return q, s, ids, wts
    return a, None, ids, wts


def tune_shape(shape: Mapping[str, Any], *, budget: float | None = None, progress=None, timer=None,
               seed: int = 0) -> tuple[str, dict, Any]:
    """Tune one shape on this process's device (the interpreter without a GPU): (table key,
    entry, ``kernels.common.tune.Result``). Every candidate is compiled and run once first, so
    ``budget`` is timing only."""
    from kernels.common import interpreter

    from .routing import prepare_routing

    device = "cpu" if interpreter.active() or not torch.cuda.is_available() else "cuda"
    weights = _weights(shape["E"], shape["H"], shape["K"], shape["prepack"], device)
    a, a_scale, ids, wts = operands(shape, device, seed)
    routing = prepare_routing(ids, wts, shape["E"], shape["block_m"])
    call = call_of(a, a_scale, weights, routing, deterministic=bool(shape["deterministic"]))
    start = cold(call)
    result = tuner(call, builder(call), budget, timer, progress, warm=True)(start)
    entry = common.record(Family(call), result, start, by="workbench tune")
    return common.problem_key(problem(call)), entry, result
