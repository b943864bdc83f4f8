"""The grouped GEMM family (fwd, dgrad, wgrad) in the selection layer (``kernels.common.select``):
a call's problem key, its candidates as (variant, config) pairs, the cold rule's candidate,
table entries, and tune-on-miss on the call's own tensors; plus the hooks of
``workbench tune grouped`` (``shape_of``, ``key_of``, ``tune_shape``).

Problem key: ``op=fwd,dtype=bf16,G=..,N=..,K=..,M=..,tma=1``. N and K are the layer's (its
weight is [G, K, N]: fwd writes [M, N] from x [M, K]; dgrad writes [M, K] from dy [M, N];
wgrad writes dw [G, K, N]), so one layer has the same N and K in all three ops. M is the
token count (rows of x or dy) rounded up to a power of two: one entry serves every count in
(M/2, M]. The routing (how the tokens split over the experts) is not in the key: the sizes
live on the GPU and reading them on the host would cost every call a sync. So one entry
serves every routing of a layer, and ``workbench tune`` picks the candidate that is best
across the routings a spec lists (the geometric mean of its times). ``tma``: every operand
(and a given ``out``) is TMA-addressable (16-byte aligned base and strides), 1 or 0.

Variants: ``gluon`` (``GroupedWsConfig``: the warp-specialised kernel, fwd/dgrad on sm_90),
``triton`` (``GroupedConfig``: every op, every device, the interpreter) and ``library``
(``LibraryConfig``: ``torch._grouped_mm``, bf16 on an sm_90 GPU; named "grouped_mm"; never
the cold rule's pick). The candidates are named in ``kernels.moe.config`` (``WS_CANDIDATES``,
``TRITON_CANDIDATES``, ``INTERPRET_CANDIDATES``). The cold rule is today's default path:
the Gluon kernel with ``pick_ws_config`` where it takes the call, else the Triton kernel
with ``pick_config``.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import torch

from kernels.common import select as common
from kernels.common import tune as common_tune
from kernels.common.configs import config_of
from kernels.moe import config as mconfig, routing as mrouting
from kernels.moe.reference import tolerance

NAME = "grouped"
LIBRARY = "grouped_mm"   # the library candidate's name
WS_MAX_GROUPS = mconfig.WS_MAX_GROUPS
_DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclasses.dataclass(frozen=True)
class Call:
    """The selection layer's view of one validated call (``kernels.moe.launch._call`` makes it).
    fwd/dgrad: a = x (dgrad: dy), b = w; wgrad: a = x, b = dy. N, K: the layer's."""

    op: str
    a: torch.Tensor
    b: torch.Tensor
    sizes: torch.Tensor
    out: torch.Tensor | None
    M: int
    N: int
    K: int
    G: int
    on_gpu: bool
    tma: bool                 # every operand (and a given out) TMA-addressable
    ws_ok: bool               # the Gluon kernel takes this call (fwd/dgrad, sm_90, bf16/fp16, aligned)
    device_descriptors: bool = False
    gluon_device_descriptors: bool = False
    sm90: bool = False        # a CUDA GPU of compute capability 9.x (H100, H200)

    @property
    def out_width(self) -> int:
        return self.K if self.op == "dgrad" else self.N

    @property
    def reduction(self) -> int:
        return self.N if self.op == "dgrad" else self.K

    @property
    def out_shape(self) -> tuple:
        return (self.G, self.K, self.N) if self.op == "wgrad" else (self.M, self.out_width)

    @property
    def dtype(self) -> torch.dtype:
        return self.a.dtype


def bucket(tokens: int) -> int:
    """The token count rounded up to a power of two (the key's M)."""
    return 1 << max(0, int(tokens) - 1).bit_length()


def problem(call: Call) -> dict[str, Any]:
    return {"op": call.op, "dtype": _DT[call.dtype], "G": call.G, "N": call.N, "K": call.K, "M": bucket(call.M),
            "tma": int(call.tma)}


# --------------------------------------------------------------------------
# Candidates, the cold rule, table entries
# --------------------------------------------------------------------------
def check_library(call: Call) -> None:
    """ValueError unless ``torch._grouped_mm`` takes the call (bf16 on an sm_90 GPU, TMA-aligned)."""
    if not call.on_gpu:
        raise ValueError("grouped_gemm: the library candidate (torch._grouped_mm) runs on a CUDA GPU; in the "
                         "interpreter use a Triton config")
    if not call.sm90:
        # Its CUTLASS kernels are built for sm_90 here; elsewhere it may take a per-group fallback
        # that reads the offsets on the host (a sync, and no CUDA graph).
        raise ValueError("grouped_gemm: the library candidate (torch._grouped_mm) is offered on sm_90 GPUs only")
    if call.dtype != torch.bfloat16:
        raise ValueError(f"grouped_gemm: torch._grouped_mm takes bf16 only, got {call.dtype}")
    if not call.tma:
        raise ValueError("grouped_gemm: torch._grouped_mm needs 16-byte aligned operands and strides")
    if getattr(torch, "_grouped_mm", None) is None:
        raise ValueError("grouped_gemm: this torch has no torch._grouped_mm")


def _library_ok(call: Call) -> bool:
    try:
        check_library(call)
    except ValueError:
        return False
    return True


def candidates(call: Call) -> dict[str, common.Candidate]:
    """Every candidate worth timing on this call: the library first (no compile: it is timed
    even when the budget runs short), then the Gluon configs where that kernel takes the
    call, then the Triton configs (tiny ones in the interpreter)."""
    out: dict[str, common.Candidate] = {}
    if _library_ok(call):
        out[LIBRARY] = common.Candidate(LIBRARY, "library", mconfig.LibraryConfig())
    if call.ws_ok:
        out.update({n: common.Candidate(n, "gluon", c) for n, c in mconfig.WS_CANDIDATES.items()})
    triton = mconfig.TRITON_CANDIDATES if call.on_gpu else mconfig.INTERPRET_CANDIDATES
    out.update({n: common.Candidate(n, "triton", c) for n, c in triton.items()})
    return out


def cold(call: Call) -> common.Candidate:
    """The cold rule's candidate: ``grouped_gemm``'s default path before tables (the Gluon
    kernel with ``pick_ws_config`` where it takes the call, else the Triton kernel with
    ``pick_config``), named as the candidate it equals (else "cold")."""
    if call.ws_ok:
        variant, cfg = "gluon", mconfig.pick_ws_config(call.op, call.out_width, call.reduction)
    else:
        variant, cfg = "triton", mconfig.pick_config(call.op, call.out_width, call.reduction, call.a.device)
    name = next((n for n, c in candidates(call).items() if c.variant == variant and c.config == cfg), "cold")
    return common.Candidate(name, variant, cfg)


def _check_usable(call: Call, cand: common.Candidate) -> None:
    """ValueError if the call cannot run the candidate (checked for table entries)."""
    if cand.variant == "library":
        check_library(call)
    elif cand.variant == "gluon":
        if not call.ws_ok:
            raise ValueError("the Gluon kernel does not take this call (it needs sm_90, bf16/fp16, K and N multiples "
                             f"of 8, at most {WS_MAX_GROUPS} groups, TMA-aligned operands; fwd/dgrad only)")
    elif cand.variant == "triton":
        if call.on_gpu and mconfig.smem_bytes(cand.config, call.a.element_size()) > mconfig.SMEM_LIMIT_SM90:
            raise ValueError(f"{cand.config.label()} needs more shared memory than an sm_90 SM has")


@dataclasses.dataclass
class Family:
    """The selection layer's view of one call (``from_entry`` checks an entry against it)."""

    call: Call | None
    name: str = NAME

    def from_entry(self, entry: Mapping[str, Any], problem: Mapping[str, Any]) -> common.Candidate:
        variant, knobs = str(entry["variant"]), dict(entry["config"])
        if variant == "gluon":
            cfg = mconfig.validate_ws(config_of(knobs, mconfig.GroupedWsConfig, "grouped_gemm"))
        elif variant == "triton":
            cfg = mconfig.validate_config(config_of(knobs, mconfig.GroupedConfig, "grouped_gemm"))
        elif variant == "library":
            if knobs:
                raise ValueError(f"the library variant has no knobs, got {sorted(knobs)}")
            cfg = mconfig.LibraryConfig()
        else:
            raise ValueError(f"unknown grouped variant {variant!r} (gluon, triton or library)")
        cand = common.Candidate(str(entry["candidate"]), variant, cfg)
        if self.call is not None:
            _check_usable(self.call, cand)
        return cand

    def to_entry(self, candidate: common.Candidate) -> dict:
        return {"candidate": candidate.name, "variant": candidate.variant,
                "config": dataclasses.asdict(candidate.config)}


# --------------------------------------------------------------------------
# Tune-on-miss
# --------------------------------------------------------------------------
def agree(ref: torch.Tensor, out: torch.Tensor) -> bool:
    """Two candidates' results agree: each within the dtype's tolerance of the exact product,
    so within twice it of each other (and every element written: finite)."""
    if isinstance(ref, tuple):   # one output per routing (``tune_shape``)
        return all(agree(r, o) for r, o in zip(ref, out))
    diff = torch.linalg.vector_norm((out.float() - ref.float()).flatten())
    scale = torch.linalg.vector_norm(ref.float().flatten())
    return bool(torch.isfinite(out.float()).all() and diff <= 2 * tolerance(ref.dtype) * scale)


Prepare = Callable[[Call, common.Candidate], Callable[..., torch.Tensor]]


def _maker(call: Call, prepare: Prepare):
    """``make(candidate)`` for ``kernels.common.tune.tune``: a callable that runs the candidate
    on the call's operands. Its first run writes into a NaN-poisoned output (an element it
    leaves unwritten then fails ``agree``) and returns the rows the groups cover; later runs
    allocate (or reuse the caller's ``out``) as the call itself would."""
    rows = call.M if call.op == "wgrad" else min(call.M, int(call.sizes.sum()))   # tuning reads it: one sync

    def make(cand: common.Candidate):
        run = prepare(call, cand)
        state = {"first": True, "out": None}

        def once():
            try:
                if state["first"]:
                    state["first"] = False
                    state["out"] = torch.full(call.out_shape, float("nan"), dtype=call.dtype, device=call.a.device)
                    res = run(state["out"])
                    return res if call.op == "wgrad" else res[:rows]
                return run(None if call.out is None else state["out"])
            except (ValueError, RuntimeError, TypeError):
                raise
            except Exception as exc:   # Triton's compile and resource errors: this candidate cannot run
                raise RuntimeError(f"{type(exc).__name__}: {exc}") from exc
        once.name = cand.name
        return once
    return make


def tuner(call: Call, prepare: Prepare, budget: float | None = None, timer=None, progress=None):
    """The tune-on-miss callable for ``common.choose``: times this call's candidates on its own
    operands (results into scratch outputs; the caller's ``out`` is untouched)."""
    def run(cold_candidate: common.Candidate):
        return common_tune.tune(list(candidates(call).values()), cold_candidate, _maker(call, prepare), agree=agree,
                                budget=budget, timer=timer, progress=progress)
    return run


def device_of(call: Call) -> dict[str, str]:
    index = None
    if call.on_gpu:
        index = call.a.device.index if call.a.device.index is not None else torch.cuda.current_device()
    return common.device_of(index)


def choose(call: Call, *, prepare: Prepare, tune: bool = False, capturing: bool = False,
           budget: float | None = None, timer=None, tables=None) -> common.Choice:
    """Which candidate runs this call when no config was given (see ``kernels.common.select``).
    ``prepare(call, candidate)`` -> ``run(out)``: the launcher's plan builder, for tuning."""
    return common.choose(Family(call), problem(call), device_of(call), cold=lambda: cold(call), tune=tune,
                         capturing=capturing, tuner=tuner(call, prepare, budget, timer), tables=tables)


# --------------------------------------------------------------------------
# ``workbench tune grouped``: one row of a spec (one problem key) at a time
# --------------------------------------------------------------------------
DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}
OPS = mconfig.OPS
ROUTINGS = mrouting.ROUTINGS   # balanced, mild (the seed's "unbalanced"), extreme
MAX_DIM = 1 << 20
MAX_TOKENS = 1 << 24


def _routings(value: Any, row: Mapping[str, Any]) -> list[str]:
    names = value if isinstance(value, (list, tuple)) else str(value).split("+")
    out = []
    for name in names:
        name = str(name).strip()
        if name not in ROUTINGS:
            raise ValueError(f"grouped shape {dict(row)}: routing {name!r} is not one of {', '.join(ROUTINGS)} "
                             f"(kernels.moe.routing; mild is the seed's 'unbalanced', extreme leaves most experts "
                             f"empty); give one, a list, or names joined by '+'")
        if name not in out:
            out.append(name)
    if not out:
        raise ValueError(f"grouped shape {dict(row)}: routing is empty; give balanced, mild or extreme")
    return out


def shape_of(row: Mapping[str, Any]) -> dict:
    """A shape spec row checked: op (fwd, dgrad or wgrad), G experts (1 .. 4096), N and K the
    layer's (its weight [G, K, N]; 1 .. 2^20), M the token count (1 .. 2^24), dtype
    (bfloat16/float16/float32, default bfloat16), routing: one of balanced, mild, extreme, or
    several (a list, or names joined by '+'; default balanced). The routings of a row are
    timed together and its table entry is the candidate best across them (the key has no
    routing). Other fields (model, layer, ...) are kept as they are."""
    out = dict(row)
    op = row.get("op")
    if op not in OPS:
        raise ValueError(f"grouped shape {dict(row)}: op must be one of {', '.join(OPS)}, got {op!r}")
    for k, hi in (("G", mconfig.MAX_GROUPS), ("N", MAX_DIM), ("K", MAX_DIM), ("M", MAX_TOKENS)):
        v = row.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= hi:
            raise ValueError(f"grouped shape {dict(row)}: {k} must be an integer from 1 to {hi}, got {v!r}")
    dtype = str(row.get("dtype", "bfloat16"))
    if dtype not in DTYPES:
        raise ValueError(f"grouped shape {dict(row)}: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out.update(dtype=dtype, routing=_routings(row.get("routing", "balanced"), row))
    return out


def key_of(shape: Mapping[str, Any]) -> str:
    """The table key ``tune_shape`` writes for this shape (fresh contiguous operands)."""
    dtype = DTYPES[shape["dtype"]]
    es = torch.empty((), dtype=dtype).element_size()
    tma = (shape["K"] * es) % 16 == 0 and (shape["N"] * es) % 16 == 0
    return common.problem_key({"op": shape["op"], "dtype": _DT[dtype], "G": shape["G"], "N": shape["N"],
                               "K": shape["K"], "M": bucket(shape["M"]), "tma": int(tma)})


def operands(shape: Mapping[str, Any], device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random (a, b) for a shape: fwd x [M, K] and w [G, K, N]; dgrad dy [M, N] and w;
    wgrad x and dy (w scaled by 1/sqrt(K), as in the study)."""
    dtype = DTYPES[shape["dtype"]]
    op, G, N, K, M = (shape[k] for k in ("op", "G", "N", "K", "M"))
    g = torch.Generator(device=device).manual_seed(seed)
    if op == "wgrad":
        return (torch.randn(M, K, device=device, generator=g).to(dtype),
                torch.randn(M, N, device=device, generator=g).to(dtype))
    a = torch.randn(M, N if op == "dgrad" else K, device=device, generator=g).to(dtype)
    w = (torch.randn(G, K, N, device=device, generator=g) / math.sqrt(K)).to(dtype)
    return a, w


def group_sizes(shape: Mapping[str, Any], routing: str, device: str, seed: int = 0) -> torch.Tensor:
    """The shape's M tokens over its G experts as ``kernels.moe.routing`` makes them."""
    return mrouting.make(routing, shape["M"], shape["G"], seed=seed, device=device)


class _Across:
    """One candidate run on several routings' inputs: calling it runs each once (their outputs
    as a tuple); ``parts`` lets the timer time each routing on its own."""

    def __init__(self, name: str, parts: list, routings: list[str]):
        self.name, self.parts, self.routings = name, parts, routings

    def __call__(self):
        return tuple(p() for p in self.parts)


def _across_timer(timer, record: dict):
    """A timer for ``_Across`` callables: each routing timed on its own (an equal share of the
    time), the geometric mean of their medians returned, the largest spread; the per-routing
    medians go to ``record[name]``."""
    def time_it(fn, rep_ms):
        parts = getattr(fn, "parts", None)
        if not parts:
            return timer(fn, rep_ms)
        res = [timer(p, max(2.0, rep_ms / len(parts))) for p in parts]
        record[fn.name] = {r: us for r, (us, _, _) in zip(fn.routings, res)}
        us = math.exp(sum(math.log(max(r[0], 1e-9)) for r in res) / len(res))
        how = f"{res[0][2]}; geometric mean over routings {'/'.join(fn.routings)}"
        return us, max(r[1] for r in res), how
    return time_it


# The launcher's call builder and plan runner for ``tune_shape``. ``kernels.moe.launch`` hands
# them over when it is imported, and importing any module of this package imports it first
# (``kernels/moe/__init__.py``), so this module, which the launcher imports, never imports it.
_LAUNCHER: dict[str, Callable] = {}


def use_launcher(make_call: Callable[..., Call], prepare: Prepare) -> None:
    """Called by ``kernels.moe.launch``: ``make_call(op, a, b, sizes, out, device_descriptors,
    gluon_device_descriptors)`` -> ``Call``; ``prepare(call, candidate)`` -> ``run(out)``."""
    _LAUNCHER.update(make_call=make_call, prepare=prepare)


def tune_shape(shape: Mapping[str, Any], *, budget: float | None = None, progress=None, timer=None,
               seed: int = 0) -> tuple[str, dict, Any]:
    """Tune one shape row on this process's device (the interpreter without a GPU): fresh
    random operands, the group sizes of each of its routings; every candidate is compiled and
    checked once first (outside the budget: the budget is timing), then timed on each routing
    and kept by the geometric mean of its times (``kernels.common.tune``: beyond the noise
    margin of the cold pick). Returns (table key, entry, ``kernels.common.tune.Result``)."""
    from kernels.common import interpreter

    device = "cpu" if interpreter.active() or not torch.cuda.is_available() else "cuda"
    a, b = operands(shape, device, seed)
    routings = list(shape["routing"])
    # Descriptors encoded in the kernels, as an eager call makes them by default.
    calls = [_LAUNCHER["make_call"](shape["op"], a, b, group_sizes(shape, r, device, seed + i), None, True, True)
             for i, r in enumerate(routings)]
    makers = [_maker(c, _LAUNCHER["prepare"]) for c in calls]

    def make(cand: common.Candidate):
        return _Across(cand.name, [m(cand) for m in makers], routings)

    start = cold(calls[0])
    cands = list(candidates(calls[0]).values())
    for cand in cands:   # compile and first-run outside the budget (failures are the tuner's to record)
        try:
            make(cand)()
        except (ValueError, RuntimeError, TypeError):
            pass
    by_routing: dict[str, dict] = {}
    result = common_tune.tune(cands, start, make, agree=agree, budget=budget,
                              timer=_across_timer(timer or common_tune.gpu_timer, by_routing), progress=progress)
    entry = common.record(Family(calls[0]), result, start, by="workbench tune")
    entry.update(tokens=shape["M"], routings=routings,
                 us_by_routing={n: {r: round(v, 3) for r, v in t.items()} for n, t in by_routing.items()
                                if n in (result.candidate.name, start.name)})
    return common.problem_key(problem(calls[0])), entry, result
