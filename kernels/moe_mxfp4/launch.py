"""The public launcher: validate -> plan (cached per call signature) -> launch.

    from kernels.moe_mxfp4 import default_config, moe_mxfp4_down, prepare_routing
    cfg = default_config(M, top_k, E, I)
    routing = prepare_routing(topk_ids, topk_weights, E, cfg.BLOCK_M)   # one launch, no host sync
    out = moe_mxfp4_down(a, w, w_scale, routing, config=cfg)           # [M, H] bf16

Prepacked weights (the fast path; a model loader prepacks once and serves every M with them):

    from kernels.moe_mxfp4 import block_m_for, prepare_weights
    weights = prepare_weights(w, w_scale)                               # at load time: Mxfp4Weights, level 2
    routing = prepare_routing(topk_ids, topk_weights, E, block_m_for(M, top_k, E))
    out = moe_mxfp4_down(a, weights, routing)                           # the prepacked default config
    out = moe_mxfp4_down(a, weights, (topk_ids, topk_weights))          # the same, routing prepared in the call

Given the router's ids, an eager call at small M makes one launch, the routing made by the kernel's
first programs (``ROUTE_IN_KERNEL``, chosen by ``one_launch_us``); otherwise, and under CUDA graph
capture, the routing kernel and then the down-projection.

At large M (``ws_fits``: at least 4096 pairs and 64 per expert) a call with no config, bf16
activations and weights of the plain or level-2 layout runs the warp-specialised Gluon kernel
(``gluon.py``) on a Hopper GPU: the routing for 128-row blocks, the activations gathered, one
persistent launch. ``WS_LARGE_M = False`` turns it off.

The layout level travels with the weights (``Mxfp4Weights``), so the plan knows it (it is part
of the plan's key), and a config whose PREPACK differs from the weights' level is refused
(ValueError), as is a PREPACK config with plain tensors.

Without a config the selection layer (``kernels.moe_mxfp4.select``) names the config, among
those of the routing's row tile and the weights' layout: a tuning table's entry for this GPU
(the user's, ``$WORKBENCH_TUNING_DIR``, over the package's), a tuning run on this call when
asked (``tune=True`` or ``WORKBENCH_TUNE=1``; never while a CUDA graph is captured), else the
cold rule, the heuristic it has always run (``default_config``: ``config_for_block_m(BM, I,
prepacked=level)`` with the SPLIT_K of ``split_k_for``). The plan keeps that choice
(``plan_for(...).choice``); ``deterministic=True`` asks for the deterministic epilogue.

Everything that depends only on the call's signature (shapes, strides, dtypes,
device, 16-byte alignment of every pointer, the config, the mode) is checked
and decided once and kept in a plan (``kernels.moe_mxfp4.plan``): config, grid,
constexprs and, for the deterministic mode, the per-pair workspace. A repeated call is a
dict lookup, a memset of the output (atomic mode, unless ``accumulate``) and one or two
kernel launches; nothing is read back from the GPU. The plan's workspace is
reused by every call with that signature: calls that overlap on different
streams need separate plans (pass ``config`` objects that differ), or the
atomic mode.
"""
from __future__ import annotations

import functools

import torch
import triton

from kernels.common import interpreter
from kernels.common import select as common_select
from kernels.common.plans import PlanCache, capturing, config_key, tensor_signature

from . import gluon as ws_kernel
from . import metrics
from . import plan as mplan
from . import select as mselect
from .config import MoeMxfp4Config, block_m_for
from .quant import Mxfp4Weights, weights_signature
from .routing import Routing, prepare_routing, prepare_routing_and_output, routing_signature
from .triton import _dequant_kernel, _moe_mxfp4_down_kernel, _moe_mxfp4_down_routed_kernel

__all__ = ["clear_plans", "dequantize_weights_bf16", "moe_mxfp4_down", "one_launch_us", "plan_cache_info", "plan_for",
           "ws_fits"]

_PLANS = PlanCache()


def _sig(t: torch.Tensor | None):
    return None if t is None else tensor_signature(t)


def _plan_key(a, a_scale, w, w_scale, level, one_mul, routing, out, accumulate, config, deterministic=False,
              tune=False, capture=False, shape=None, wsig=None) -> tuple:
    """Everything a plan depends on; the weights' layout level, scale range and logical shape
    included (same tensors either way); without a config also the epilogue asked for, whether
    tuning was asked and (then) whether a CUDA graph is being captured (no tuning there: a later
    eager call tunes). The weights' and the routing's parts are made once where they can be
    (``Mxfp4Weights.signature``: wsig; ``Routing.sig``): 7 tensor signatures fewer per call."""
    return (_sig(a), _sig(a_scale), wsig if wsig is not None else weights_signature(w, w_scale, level, one_mul, shape),
            _sig(out), routing_signature(routing), bool(accumulate), config_key(config),
            bool(deterministic) if config is None else None, bool(tune), bool(capture))


def _build_plan(a, a_scale, w, w_scale, level, one_mul, routing, out, accumulate, config, *,
                deterministic: bool = False, tune: bool = False, capture: bool = False, shape=None) -> mplan.Plan:
    """A call signature's plan; without a config, for the selection layer's choice (kept in the plan)."""
    choice = None
    if config is None:
        M, H, K, E = mplan.validate(a, a_scale, w, w_scale, routing, out, accumulate, shape)
        call = mplan.make_call(a, a_scale, w, w_scale, level, one_mul, routing, M, H, K, E, deterministic)
        choice = mselect.choose(call, mplan.builder(call), tune=tune, capturing=capture)
        config = choice.candidate.config
    elif deterministic and isinstance(config, MoeMxfp4Config) and not config.DETERMINISTIC:
        mplan.fail("deterministic=True with a config whose DETERMINISTIC is False: pass "
                   "config.replace(DETERMINISTIC=True), or config=None")
    return mplan.build(a, a_scale, w, w_scale, level, one_mul, routing, out, accumulate, config, choice, shape=shape)


def _plan_for(a, a_scale, w, w_scale, level, one_mul, routing, out, accumulate, config, deterministic,
              tune, shape=None, wsig=None) -> mplan.Plan:
    want_tune = config is None and common_select.tune_requested(tune)
    try:
        cap = want_tune and capturing(a)
        key = _plan_key(a, a_scale, w, w_scale, level, one_mul, routing, out, accumulate, config, deterministic,
                        want_tune, cap, shape, wsig)
    except AttributeError:       # not tensors / not a Routing: let validation say what is wrong
        mplan.validate(a, a_scale, w, w_scale, routing, out, accumulate, shape)
        raise
    plan = _PLANS.get(key)
    if plan is None:
        if interpreter.active():
            interpreter.patch()
        plan = _PLANS.put(key, _build_plan(a, a_scale, w, w_scale, level, one_mul, routing, out, accumulate,
                                           config, deterministic=deterministic, tune=want_tune, capture=cap,
                                           shape=shape))
    return plan


def _routing_of(routing, w, config, out_cols: int = 0):
    """(routing, out): a Routing as it is, or the router's (topk_ids, topk_weights) prepared here
    (``prepare_routing``, one launch) for the config's row tile, or without a config ``block_m_for``'s;
    with out_cols, that launch also zeroes the call's output [M, out_cols] (else out is None)."""
    if isinstance(routing, Routing) or not isinstance(routing, (tuple, list)):
        return routing, None
    if len(routing) != 2 or not isinstance(routing[0], torch.Tensor) or routing[0].dim() != 2 \
            or not isinstance(w, torch.Tensor):
        mplan.fail(f"routing must come from prepare_routing(), or be the router's (topk_ids, topk_weights) with "
                   f"topk_ids a 2-D [M, top_k] tensor; got {type(routing).__name__} of "
                   f"{[type(x).__name__ for x in routing][:3]}")
    ids, wts = routing
    E = w.shape[0]
    bm = config.BLOCK_M if isinstance(config, MoeMxfp4Config) else block_m_for(ids.shape[0], ids.shape[1], E)
    if out_cols:
        return prepare_routing_and_output(ids, wts, E, bm, out_cols)
    return prepare_routing(ids, wts, E, bm), None


# Eager calls given the router's ids may run the routing inside the down-projection's launch (its
# first programs; ``triton._moe_mxfp4_down_routed_kernel``): one launch per call instead of two,
# which is most of an eager call's host time (one H200: 22-46 us against 57-123 per call,
# results/moe_mxfp4/routed/). Its tiles start later (two round trips to L2 each before their
# loads, and the routing first), so its GPU time is higher: 1.1-1.2x the two launches at gpt-oss'
# 23 K steps, 1.4-2.3x at KIMI-K2.5's 4. So a call takes the one launch only where the GPU would
# otherwise wait for the host: where the estimated GPU time of the one launch (``one_launch_us``)
# is at most ROUTE_IN_KERNEL_MAX_US, about the host time of the two launches there. Under CUDA
# graph capture (no host time to save) the two launches are captured, unless
# ROUTE_IN_KERNEL_IN_GRAPHS. ROUTE_IN_KERNEL = False: always the two launches.
ROUTE_IN_KERNEL = True
ROUTE_IN_KERNEL_IN_GRAPHS = False
ROUTE_IN_KERNEL_MAX_US = 80.0
# the estimate's rates (an H200's copy bandwidth; the kernel's bf16 rate at mid-size M) and the
# one launch's cost over the two launches' GPU time, 1 + 2 / K steps (fit on the first probe run)
_EST_BYTES_PER_S, _EST_FLOPS_PER_S = 4.2e12, 2.0e14


@functools.lru_cache(maxsize=1024)
def _one_launch_fits(M: int, top_k: int, E: int, H: int, I: int, limit_us: float) -> bool:
    return one_launch_us(M, top_k, E, H, I) <= limit_us


def one_launch_us(M: int, top_k: int, E: int, H: int, I: int) -> float:
    """Estimated GPU time (us) of the one-launch form: the larger of the bytes bound (every expert
    a pair could reach counted active) and the FLOPs at the kernel's rate, times 1 + 2 / K steps."""
    active = min(E, M * top_k)
    t = max(metrics.hbm_bytes(M, top_k, H, I, active) / _EST_BYTES_PER_S, metrics.flops(M, top_k, H, I) /
            _EST_FLOPS_PER_S)
    return t * 1e6 * (1 + 2 / -(-I // 128))


_ROUTED = PlanCache()


def _one_launch_stream(a, w, routing, shape):
    """The raw handle of the current CUDA stream of a's device (0 in the interpreter) where the
    one-launch form runs; None where it does not (the rule says two launches, a CUDA graph captured,
    off the GPU). The rule first: a cached function of the shapes, so the calls that take the two
    launches pay no more than a lookup for asking."""
    if a.is_cuda:
        try:
            M, top_k = routing[0].shape
        except (AttributeError, TypeError, ValueError):      # let the two-launch path say what is wrong
            return None
        H, I = shape if shape else (w.shape[1], 2 * w.shape[2])
        if not _one_launch_fits(M, top_k, w.shape[0], H, I, ROUTE_IN_KERNEL_MAX_US):
            return None
        if not ROUTE_IN_KERNEL_IN_GRAPHS and torch.cuda.is_current_stream_capturing():
            return None
        return torch._C._cuda_getCurrentRawStream(a.get_device())
    return 0 if interpreter.active() else None


def _routed_plan_for(a, a_scale, w, w_scale, level, one_mul, routing, config, tune, shape, wsig):
    """The one-launch plan of a call given the router's (topk_ids, topk_weights) that the rule sends to
    it, or False where the call takes the two launches after all (strided ids, an odd output size, the
    deterministic epilogue chosen): decided once per call signature."""
    want_tune = config is None and common_select.tune_requested(tune)
    try:
        ids, wts = routing
        key = (_sig(a), _sig(a_scale),
               wsig if wsig is not None else weights_signature(w, w_scale, level, one_mul, shape),
               tensor_signature(ids), tensor_signature(wts), config_key(config), want_tune)
    except (AttributeError, TypeError, ValueError):     # let the two-launch path say what is wrong
        return False
    rplan = _ROUTED.get(key)
    if rplan is None:
        rplan = _ROUTED.put(key, _make_routed(a, a_scale, w, w_scale, level, one_mul, ids, wts, config, tune, shape,
                                              wsig))
    return rplan


def _make_routed(a, a_scale, w, w_scale, level, one_mul, ids, wts, config, tune, shape, wsig):
    E = w.shape[0]
    H = shape[0] if shape else w.shape[1]
    if ids.dim() != 2 or not ids.is_contiguous() or not wts.is_contiguous() or ids.numel() == 0 or \
            ids.shape[0] * H % 2:
        return False
    bm = config.BLOCK_M if isinstance(config, MoeMxfp4Config) else block_m_for(ids.shape[0], ids.shape[1], E)
    routing = prepare_routing(ids, wts, E, bm)           # checks the ids; the plan's choice is made with it
    plan = _plan_for(a, a_scale, w, w_scale, level, one_mul, routing, None, False, config, False, tune, shape, wsig)
    if plan.workspace is not None:
        return False
    regs = None
    if mplan.CAP_ROUTED_REGISTERS and a.is_cuda:
        mplan.execute(plan, a, a_scale, w, w_scale, routing, None, False)     # compiles the plain kernel, once
        regs = getattr(plan.launch.compiled, "n_regs", None)
    return mplan.RoutedPlan(plan, E, ids.numel(), mplan.sms(a.device) or 132, regs)


# Large M: the warp-specialised kernel (``gluon.py``: the expansion in warps of its own beside the
# wgmma, persistent), for bf16 activations and weights of the plain or the level-2 layout, given the
# router's ids or a routing of 128-row blocks, no config, not deterministic, on a Hopper GPU, where
# the pairs per expert fill its 128-row blocks. The thresholds are the fit set's smallest winners
# (results/moe_mxfp4/ws/, one H200: faster than the Triton kernel from 64 pairs per expert and 4096
# pairs, slower at 32-48 per expert); on the held-out shapes the rule picks the faster kernel at 14
# of 15. WS_LARGE_M = False: never.
WS_LARGE_M = True
WS_MIN_PAIRS, WS_MIN_PAIRS_PER_EXPERT, WS_BLOCK_M = 4096, 64, 128


def ws_fits(M: int, top_k: int, E: int) -> bool:
    """Whether a call of M tokens, top_k experts each, E experts takes the warp-specialised kernel."""
    pairs = M * top_k
    return pairs >= WS_MIN_PAIRS and pairs >= WS_MIN_PAIRS_PER_EXPERT * E


@functools.lru_cache(maxsize=8)
def _hopper(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] == 9


def _ws_call(a, a_scale, w, w_scale, level, one_mul, shape, routing, out, accumulate, config, deterministic):
    """The call through the warp-specialised kernel, or None where it does not apply (then the
    Triton kernels run, and say what is wrong with arguments they refuse). The size first: at small
    M, where eager calls are host-bound, asking costs a shape read and the rule's cached answer."""
    mk = _pairs_of(routing)
    if mk is None or not isinstance(w, torch.Tensor) or w.dim() != 3 or not _ws_fits(*mk, w.shape[0]):
        return None
    M, top_k = mk
    E = w.shape[0]
    H, I = shape if shape else (w.shape[1], 2 * w.shape[2])
    if config is not None or deterministic or a_scale is not None or not a.is_cuda or a.dtype != torch.bfloat16 \
            or tuple(a.shape) != (M * top_k, I) or a.stride(1) != 1 or level not in ws_kernel.LEVELS \
            or not _hopper(a.get_device()):
        return None
    if isinstance(routing, Routing) and (routing.block_m != WS_BLOCK_M or routing.num_experts != E):
        return None
    if out is not None and (tuple(out.shape) != (M, H) or out.dtype != torch.bfloat16 or out.stride(1) != 1):
        return None
    if isinstance(routing, Routing):
        r = routing
    elif out is None:
        r, out = prepare_routing_and_output(routing[0], routing[1], E, WS_BLOCK_M, H)
        accumulate = True
    else:
        r = prepare_routing(routing[0], routing[1], E, WS_BLOCK_M)
    if out is None:
        out = torch.zeros((M, H), dtype=torch.bfloat16, device=a.device)
    elif not accumulate:
        out.zero_()
    return ws_kernel.launch(a, w, w_scale, r, out, level=level, shape=(H, I), one_mul=one_mul)


def _pairs_of(routing) -> tuple[int, int] | None:
    """(M, top_k) of a prepared Routing or of the router's (topk_ids, topk_weights); None otherwise."""
    if isinstance(routing, Routing):
        return routing.num_pairs // max(routing.top_k, 1), routing.top_k
    if isinstance(routing, (tuple, list)) and len(routing) == 2:
        shape = getattr(routing[0], "shape", ())
        if len(shape) == 2:
            return shape[0], shape[1]
    return None


@functools.lru_cache(maxsize=1024)
def _ws_fits(M: int, top_k: int, E: int) -> bool:
    return ws_fits(M, top_k, E)


def plan_for(a: torch.Tensor, w: torch.Tensor | Mxfp4Weights, w_scale: torch.Tensor | None = None,
             routing: Routing | None = None, *, a_scale: torch.Tensor | None = None,
             config: MoeMxfp4Config | None = None, out: torch.Tensor | None = None, accumulate: bool = False,
             deterministic: bool = False, tune: bool | None = None) -> mplan.Plan:
    """The plan ``moe_mxfp4_down`` runs for these arguments (made once per call signature; without
    a config its ``choice`` says which candidate runs and why: after editing a tuning table at run
    time, call ``clear_plans()``)."""
    wsig = w.signature if isinstance(w, Mxfp4Weights) else None
    w, w_scale, routing, level, one_mul, shape = mplan.unwrap_weights(w, w_scale, routing)
    routing, _ = _routing_of(routing, w, config)
    return _plan_for(a, a_scale, w, w_scale, level, one_mul, routing, out, accumulate, config, deterministic, tune,
                     shape, wsig)


def clear_plans() -> None:
    """Forget every plan (they are made again, with the tables as they are now)."""
    _PLANS.clear()
    _ROUTED.clear()


def moe_mxfp4_down(a: torch.Tensor, w: torch.Tensor | Mxfp4Weights, w_scale: torch.Tensor | None = None,
                   routing: Routing | tuple | None = None, *, a_scale: torch.Tensor | None = None,
                   config: MoeMxfp4Config | None = None, out: torch.Tensor | None = None,
                   accumulate: bool = False, deterministic: bool = False, tune: bool | None = None) -> torch.Tensor:
    """MoE down-projection with MXFP4 weights: out[t] = sum_k w_tk * a[t*top_k+k] @ W[e_tk].T.

    a: bf16 [M * top_k, I] (w4a16), or packed MXFP4 uint8 [M * top_k, I / 2] with
    a_scale uint8 [M * top_k, I / 32] (a4w4); row t * top_k + k is token t's k-th slot.
    w / w_scale: MXFP4 weights uint8 [E, H, I / 2] / [E, H, I / 32] (``quantize_mxfp4``
    of a [E, H, I] tensor, plain layout); or w = ``Mxfp4Weights`` (``prepare_weights``:
    the weights with their layout level, prepacked by default) and no w_scale, called as
    ``moe_mxfp4_down(a, weights, routing)``. routing: ``prepare_routing(topk_ids,
    topk_weights, E, BM)`` with BM = config.BLOCK_M, or the router's ``(topk_ids, topk_weights)``
    themselves (prepared in the call, one launch: BM from the config, else ``block_m_for``; with no
    out, that launch also zeroes the output the call returns, so the call makes no zeroing launch;
    eager calls whose estimated GPU time is at most ROUTE_IN_KERNEL_MAX_US make the routing inside
    the down-projection's own launch instead: one launch per call; calls that ``ws_fits`` takes, with
    no config and bf16 activations, run the warp-specialised kernel).
    Returns out bf16 [M, H] (written, or
    added to with ``accumulate=True``). A config must read the weights' layout
    (config.PREPACK == level, else ValueError). Without a config, the selection layer's
    choice among the configs of the routing's BM and the weights' layout runs: this GPU's
    tuning table entry, else (``tune=True`` or ``WORKBENCH_TUNE=1``) the winner of a tuning
    run on this call's tensors on its first call (bounded by ``WORKBENCH_TUNE_BUDGET_S``, 2 s
    by default; never while a CUDA graph is captured; saved to the user's table), else the
    cold rule (``default_config(M, top_k, E, I, prepacked=level, H=H, sms=...)``: the
    heuristic's config for BM, with the SPLIT_K of ``config.split_k_for``).
    ``deterministic=True`` (no config): the deterministic epilogue. Weights from
    ``prepare_weights`` whose scale bytes are all <= 128 run the one-multiply expansion
    (``MoeMxfp4Config.ONE_MUL``). No host synchronization (a first call that tunes does, once).
    """
    wsig = w.signature if isinstance(w, Mxfp4Weights) else None        # made once per weights object
    w, w_scale, routing, level, one_mul, shape = mplan.unwrap_weights(w, w_scale, routing)
    if WS_LARGE_M:          # large M: the warp-specialised kernel, where it applies
        done = _ws_call(a, a_scale, w, w_scale, level, one_mul, shape, routing, out, accumulate, config, deterministic)
        if done is not None:
            return done
    # The router's ids with no out given: the routing's launch also zeroes the output for the atomic
    # epilogue (one allocation and one launch fewer per call), which the call then adds to.
    fold = out is None and not accumulate and not deterministic and isinstance(w, torch.Tensor) and w.dim() == 3 \
        and not getattr(config, "DETERMINISTIC", False)
    routers = fold and ROUTE_IN_KERNEL and isinstance(routing, (tuple, list))
    stream = _one_launch_stream(a, w, routing, shape) if routers else None
    if stream is not None:
        # the routing made by the down-projection's own first programs: one launch per call
        rplan = _routed_plan_for(a, a_scale, w, w_scale, level, one_mul, routing, config, tune, shape, wsig)
        if rplan:
            return rplan(a, a_scale, w, w_scale, routing[0], routing[1], stream)
    routing, zeroed = _routing_of(routing, w, config, (shape[0] if shape else w.shape[1]) if fold else 0)
    if zeroed is not None:
        out, accumulate = zeroed, True
    plan = _plan_for(a, a_scale, w, w_scale, level, one_mul, routing, out, accumulate, config, deterministic, tune,
                     shape, wsig)
    return mplan.execute(plan, a, a_scale, w, w_scale, routing, out, accumulate)


def plan_cache_info() -> dict:
    """How many plans are cached, and the bound."""
    return {"plans": len(_PLANS), "max": _PLANS.size}


def dequantize_weights_bf16(w: torch.Tensor, w_scale: torch.Tensor, out: torch.Tensor | None = None, *,
                            expand: str = "ptx") -> torch.Tensor:
    """MXFP4 [..., I / 2] + scales [..., I / 32] -> bf16 [..., I] on the GPU, with the kernel's expansion
    (what a user without the fused kernel runs before a bf16 grouped GEMM)."""
    if w.dtype != torch.uint8 or w_scale.dtype != torch.uint8 or not w.is_contiguous() or \
            not w_scale.is_contiguous() or w_scale.shape[:-1] != w.shape[:-1] or w_scale.shape[-1] * 16 != w.shape[-1]:
        raise ValueError(f"dequantize_weights_bf16: need contiguous uint8 packed [..., C] and scales [..., C / 16], "
                         f"got {w.dtype} {tuple(w.shape)} and {w_scale.dtype} {tuple(w_scale.shape)}")
    if interpreter.active():
        interpreter.patch()
    C = w.shape[-1]
    R = w.numel() // C if C else 0
    if out is None:
        out = torch.empty((*w.shape[:-1], 2 * C), dtype=torch.bfloat16, device=w.device)
    if R == 0:
        return out
    bc = 64 if C % 64 == 0 else 32 if C % 32 == 0 else 16
    br = 16 if interpreter.active() else 64
    _dequant_kernel[(triton.cdiv(R, br), C // bc)](w, w_scale, out, R, C,
                                                     EXPAND="fp32" if interpreter.active() else expand,
                                                     BR=br, BC=bc, num_warps=4)
    return out


def compile_for_target(config: MoeMxfp4Config | None = None, *, a_fp4: bool = False, target: str = "sm90",
                       top_k: int = 9, H: int = 7168, K: int = 512, one_mul: bool = True,
                       routed_experts: int = 0, pairs: int = 144, cache_dir) -> list:
    """Cross-compile the down-projection kernel for `target` (no GPU needed) into `cache_dir`;
    returns workbench.asm entries (``.text('sass')``, ``.mix()``, ``.resources()``). one_mul: the
    weights' scale bytes are all at most 128 (as for trained weights), so a config's ONE_MUL applies.
    routed_experts: the one-launch form (``_moe_mxfp4_down_routed_kernel``) for that many experts,
    its routing tiles sized for ``pairs`` (token, slot) pairs, as ``plan.RoutedPlan`` sizes them.

    Pointers, H, K and the row strides are marked 16-divisible, as they are at KIMI-K2.5's
    shapes (H = 7168, I = 512), so the loads vectorize as they do there.
    """
    from workbench.asm.compile import cross_compile

    cfg = config or MoeMxfp4Config()
    head = {"a_ptr": "*u8" if a_fp4 else "*bf16", "a_scale_ptr": "*u8" if a_fp4 else "*bf16",
            "w_ptr": "*u8", "w_scale_ptr": "*u8", "out_ptr": "*bf16"}
    strides = {"num_pairs": "i32", "H": "i32", "stride_am": "i32", "stride_asm": "i32", "stride_we": "i32",
               "stride_wn": "i32", "stride_wse": "i32", "stride_wsn": "i32", "stride_om": "i32"}
    divisible = ["a_ptr", "a_scale_ptr", "w_ptr", "w_scale_ptr", "out_ptr", "H", "stride_am", "stride_we",
                 "stride_wn", "stride_wse", "stride_wsn", "stride_om"]
    if a_fp4:
        divisible.append("stride_asm")
    constexprs = mplan.kernel_constexprs(cfg, top_k=top_k, a_fp4=a_fp4, H=H, K=K, one_mul=one_mul, expand=cfg.EXPAND)
    if routed_experts:
        kernel = _moe_mxfp4_down_routed_kernel
        sig = {**head, "ids_ptr": "*i32", "wts_ptr": "*fp32", "sorted_ids_ptr": "*i32", "sorted_weights_ptr": "*fp32",
               "expert_ids_ptr": "*i32", "num_rows_ptr": "*i32", "sync_ptr": "*i64", **strides,
               **{n: "i32" for n in ("out_words", "max_rows", "max_blocks", "programs", "part_stride")}}
        divisible += ["ids_ptr", "wts_ptr", "sorted_ids_ptr", "sorted_weights_ptr", "expert_ids_ptr", "sync_ptr",
                      "out_words", "max_rows", "max_blocks"]
        constexprs.update(mplan.routed_constexprs(routed_experts, pairs, top_k, cfg.BLOCK_M))
    else:
        kernel = _moe_mxfp4_down_kernel
        sig = {**head, "sorted_ids_ptr": "*i32", "sorted_weights_ptr": "*fp32", "expert_ids_ptr": "*i32",
               "num_rows_ptr": "*i32", **strides}
        divisible += ["sorted_ids_ptr", "sorted_weights_ptr", "expert_ids_ptr"]
    return cross_compile(kernel, target, signature=sig, constexprs=constexprs,
                         divisible=divisible, options=mplan.launch_options(cfg), cache_dir=cache_dir)
