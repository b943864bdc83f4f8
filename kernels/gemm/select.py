"""The GEMM family in the selection layer (``kernels.common.select``): a call's problem key,
its candidates as (variant, config) pairs, the cold rule's candidate, table entries, and
tune-on-miss on the call's own operands.

Problem key: ``dtype=bf16,M=..,N=..,K=..,b=row|t|other,tma=ABC`` (``b``: B row-major, a
transposed view (K-major) or any other strides; ``tma``: whether A, B and C rows are each
TMA-addressable, 1 or 0), exactly the facts the candidates and the cold rule depend on.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch

from kernels.common import select as common
from kernels.common import tune as common_tune
from kernels.gemm import cold as cold_rule
from kernels.gemm import config as gconfig
from kernels.gemm import variants
from kernels.gemm.metrics import tolerance
from kernels.gemm.plan import Call

NAME = "gemm"
_DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
LIBRARY = "cublas"   # the library candidate's name


def problem(call: Call) -> dict[str, Any]:
    b = call.b
    layout = "t" if call.b_kmajor_layout else "row" if b.stride(1) == 1 else "other"
    return {"dtype": _DT[call.dtype], "M": call.M, "N": call.N, "K": call.K, "b": layout,
            "tma": f"{int(call.a_ok)}{int(call.b_ok)}{int(call.c_ok)}"}


def _flags(call: Call) -> dict:
    """The candidates' and the cold rule's view of the call (as ``matmul`` has always planned)."""
    aligned = call.aligned
    return dict(num_sms=call.sms, gluon=aligned and call.sm90, c_aligned=call.c_ok, b_kmajor=call.b_kmajor_layout)


def candidates(call: Call) -> dict[str, common.Candidate]:
    """Every candidate worth timing on this call: the library (cuBLAS, on a GPU) first, as it
    needs no compiling and is the baseline every table entry is read against, then ours,
    cheapest by the cost model first."""
    f = _flags(call)
    flat = gconfig.candidates(call.M, call.N, call.K, call.dtype, f["num_sms"], aligned=call.aligned,
                              gluon=f["gluon"], c_aligned=f["c_aligned"], b_kmajor=f["b_kmajor"])
    out = {}
    for name, cfg in flat.items():
        mod, vcfg = variants.of(cfg)
        out[name] = common.Candidate(name, mod.NAME, vcfg)
    ranked = {}
    if call.on_gpu:
        ranked[LIBRARY] = common.Candidate(LIBRARY, variants.library.NAME, variants.library.Config())
    for n in sorted(out, key=lambda n: _estimate(call, flat[n], n)):
        ranked[n] = out[n]
    return ranked


def _estimate(call: Call, cfg: gconfig.GemmConfig, name: str) -> float:
    const = cold_rule.COST.get(name)
    if const is None:
        return float("inf")
    pad = 0.0 if call.aligned else cold_rule.pad_bytes(call.M, call.N, call.K, call.dtype)
    return cold_rule.estimate_us(cfg, call.M, call.N, call.K, call.dtype, call.sms, const, pad)


def cold(call: Call) -> common.Candidate:
    """The cold rule's candidate: the region table's pick for the call's region, or its class's
    default where the table has none (``kernels.gemm.cold.region_pick``; on sm_90+, when that
    candidate exists for the call), else ``kernels.gemm.cold.heuristic``'s, named as the
    candidate it equals (else "cold")."""
    if call.hopper:
        name, _ = cold_rule.region_pick(call.M, call.N, call.K, call.dtype, call.aligned, call.sms)
        cands = candidates(call) if name else {}
        if name in cands:
            return cands[name]
    f = _flags(call)
    cfg = cold_rule.heuristic(call.M, call.N, call.K, call.dtype, f["num_sms"], hopper=call.hopper,
                              gluon=f["gluon"], tma=call.aligned, c_aligned=f["c_aligned"], b_kmajor=f["b_kmajor"])
    mod, vcfg = variants.of(cfg)
    name = "cold"
    if call.hopper:
        flat = gconfig.candidates(call.M, call.N, call.K, call.dtype, f["num_sms"], aligned=call.aligned,
                                  gluon=f["gluon"], c_aligned=f["c_aligned"], b_kmajor=f["b_kmajor"])
        name = next((n for n, c in flat.items() if c == cfg), name)
    return common.Candidate(name, mod.NAME, vcfg)


@dataclasses.dataclass
class Family:
    """The selection layer's view of one call (``from_entry`` checks an entry against it)."""

    call: Call
    name: str = NAME

    def from_entry(self, entry: Mapping[str, Any], problem: Mapping[str, Any]) -> common.Candidate:
        mod, cfg = variants.from_dict(str(entry["variant"]), dict(entry["config"]))
        mod.usable(self.call, cfg)
        return common.Candidate(str(entry["candidate"]), mod.NAME, cfg)

    def to_entry(self, candidate: common.Candidate) -> dict:
        knobs = dataclasses.asdict(candidate.config)
        return {"candidate": candidate.name, "variant": candidate.variant, "config": knobs}


def agree(ref: torch.Tensor, out: torch.Tensor) -> bool:
    """Two candidates' results agree: each is within the dtype's tolerance of the exact
    product, so they are within twice it of each other."""
    diff = torch.linalg.vector_norm((out.float() - ref.float()).flatten())
    scale = torch.linalg.vector_norm(ref.float().flatten())
    return bool(torch.isfinite(out.float()).all() and diff <= 2 * tolerance(ref.dtype) * scale)


# What compiling a candidate's kernel costs, by kind of kernel (``compile_kind``), in seconds:
# starting guesses until this process has compiled one of the kind, then what it measured
# (``kernels.common.tune.CompileCosts``). Measured on an H200 node's host with an empty Triton
# cache (experiments/probes/probe_compile_costs.py, results/gemm_selection/compile_costs/): plain
# persistent tiles 0.33-1.15 s, tail slices 0.77-1.5, stream-K 1.1-3.0, split-K 0.3-2.0, Gluon
# 0.4-1.1, the pointer kernel 2.4; the guesses sit near the top of each range, so that a guess
# errs long (a candidate skipped, never the budget overrun), and the process's first compile
# costs about a second more (3.1 s for a tail-slice kernel that later compiled in 0.9-1.5).
# cuBLAS compiles nothing. An earlier set of guesses, from a 2-core CPU's cross-compiles, let a
# first call that tuned take 2.21 s of a 2 s budget on the H200.
COMPILE_GUESS_S = {"library": 0.0, "ptr": 2.4, "tma": 1.1, "tma-tail": 1.5, "tma-sk": 2.4, "splitk": 1.0,
                   "fma": 1.0, "gluon": 1.1}
COMPILE_FIRST_EXTRA_S = 1.0
COMPILE_COSTS = common_tune.CompileCosts(COMPILE_GUESS_S, default_s=2.4, first_extra_s=COMPILE_FIRST_EXTRA_S)


def _plan_of(call: Call, cand: common.Candidate):
    """The candidate's plan for this call, or None where it cannot be made (the tuner then says
    why when it tries the candidate; an estimate must never be what fails a user's call)."""
    try:
        return variants.VARIANTS[cand.variant].plan(call, cand.config, explicit=True)
    except Exception:
        return None


def compile_kind(call: Call, cand: common.Candidate) -> str:
    """The kind of kernel a candidate compiles for this call (``COMPILE_GUESS_S``'s keys)."""
    p = _plan_of(call, cand)
    if p is None:
        return "unknown"
    if p.kind == "tma":
        kw = p.launch.kwargs
        return "tma-sk" if kw.get("STREAM_K") else "tma-tail" if kw.get("TAIL_SPLIT", 1) > 1 else "tma"
    return p.kind


def compile_key(call: Call, cand: common.Candidate):
    """What Triton would cache the candidate's kernel under for this call, as near as a plan says
    without compiling: the kernel, its constexprs and options, the dtype, and how each integer
    argument specializes (== 1, a multiple of 16)."""
    p = _plan_of(call, cand)
    if p is None or p.launch is None:
        return (cand.variant, cand.name, "no kernel" if p is not None else "no plan")
    ints = tuple((a == 1, a % 16 == 0) for a in p.args if isinstance(a, int) and not isinstance(a, bool))
    fn = getattr(getattr(p.launch.fn, "fn", p.launch.fn), "__qualname__", str(p.launch.fn))
    return (fn, tuple(sorted((k, repr(v)) for k, v in p.launch.kwargs.items())), str(call.dtype), ints,
            p.device_desc, call.b_kmajor_layout)


def compiles(call: Call) -> common_tune.Compiles:
    """This call's view of the family's compile costs (for ``kernels.common.tune.tune``)."""
    return common_tune.Compiles(COMPILE_COSTS, lambda c: compile_kind(call, c), lambda c: compile_key(call, c))


def tuner(call: Call, budget: float | None = None, timer=None, progress=None, count_first_runs: bool = True):
    """The tune-on-miss callable for ``common.choose``: times this call's candidates on its own
    A and B (results into scratch outputs; the caller's C is untouched), compiles counted against
    the budget unless ``count_first_runs`` is False (``workbench tune``)."""
    def run(cold_candidate: common.Candidate):
        cands = list(candidates(call).values())
        scratch = torch.empty((call.M, call.N), dtype=call.dtype, device=call.a.device)

        def make(cand: common.Candidate):
            p = variants.VARIANTS[cand.variant].plan(call, cand.config, explicit=True)
            first = [True]

            def once():
                # The first run writes a copy the others are compared with (the cold one's).
                out = torch.empty_like(scratch) if first[0] else scratch
                first[0] = False
                variants.execute(p, call.a, call.b, out)
                return out
            return once

        return common_tune.tune(cands, cold_candidate, make, agree=agree, budget=budget, timer=timer,
                                progress=progress, count_first_runs=count_first_runs, compiles=compiles(call))
    return run


def choose(call: Call, *, tune: bool = False, capturing: bool = False, budget: float | None = None,
           timer=None, tables=None) -> common.Choice:
    """Which candidate runs this call when no config was given (see ``kernels.common.select``)."""
    index = None
    if call.on_gpu:
        index = call.a.device.index if call.a.device.index is not None else torch.cuda.current_device()
    device = common.device_of(index)
    return common.choose(Family(call), problem(call), device, cold=lambda: cold(call), tune=tune,
                         capturing=capturing, tuner=tuner(call, budget, timer), tables=tables)
