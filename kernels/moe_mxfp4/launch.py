"""The public launcher: validate -> plan (cached per call signature) -> launch.

    from kernels.moe_mxfp4 import default_config, moe_mxfp4_down, prepare_routing
    cfg = default_config(M, top_k, E, I)
    routing = prepare_routing(topk_ids, topk_weights, E, cfg.BLOCK_M)   # no host sync
    out = moe_mxfp4_down(a, w, w_scale, routing, config=cfg)           # [M, H] bf16

Prepacked weights (the fast path; a model loader prepacks once and serves every M with them):

    from kernels.moe_mxfp4 import block_m_for, prepare_weights
    weights = prepare_weights(w, w_scale)                               # at load time: Mxfp4Weights, level 2
    routing = prepare_routing(topk_ids, topk_weights, E, block_m_for(M, top_k, E))
    out = moe_mxfp4_down(a, weights, routing)                           # the prepacked default config

The layout level travels with the weights (``Mxfp4Weights``), so the plan knows it (it is part
of the plan's key): without a config the launcher runs the prepacked default for the routing's
BLOCK_M (``config_for_block_m(..., prepacked=level)``), and a config whose PREPACK differs from
the weights' level is refused (ValueError), as is a PREPACK config with plain tensors.

Everything that depends only on the call's signature (shapes, strides, dtypes,
device, 16-byte alignment of every pointer, the config, the mode) is checked
and decided once and kept in a plan: config, grid, constexprs and, for the
deterministic mode, the per-pair workspace. A repeated call is a dict lookup,
a memset of the output (atomic mode, unless ``accumulate``) and one or two
kernel launches; nothing is read back from the GPU. The plan's workspace is
reused by every call with that signature: calls that overlap on different
streams need separate plans (pass ``config`` objects that differ), or the
atomic mode.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from kernels.common import interpreter
from kernels.common.launcher import PlannedLaunch
from kernels.common.plans import PlanCache, config_key, sm_count, tensor_signature

from .config import MoeMxfp4Config, config_for_block_m, default_config, with_split_k
from .quant import Mxfp4Weights
from .routing import Routing
from .triton import _dequant_kernel, _moe_mxfp4_down_kernel, _reduce_topk_kernel

__all__ = ["dequantize_weights_bf16", "moe_mxfp4_down", "plan_cache_info"]

_PLANS = PlanCache()
# K steps the kernel unrolls; a longer reduction runs as a loop (compile time: 112 unrolled steps
# took minutes). The CPU tests lower it to run the loop in the interpreter.
MAX_UNROLLED_STEPS = 16


@dataclass
class _Plan:
    config: MoeMxfp4Config
    grid: tuple
    constexprs: dict
    M: int
    H: int
    workspace: torch.Tensor | None
    reduce_grid: tuple | None
    reduce_constexprs: dict | None
    launch: PlannedLaunch | None = None       # the kernel with its grid and constexprs, compiled once
    reduce: PlannedLaunch | None = None

    def __post_init__(self):
        self.launch = PlannedLaunch.of(_moe_mxfp4_down_kernel, self.grid, self.constexprs)
        if self.reduce_grid is not None:
            self.reduce = PlannedLaunch.of(_reduce_topk_kernel, self.reduce_grid, self.reduce_constexprs)


def _sig(t: torch.Tensor | None):
    return None if t is None else tensor_signature(t)


def _fail(msg: str):
    raise ValueError(f"moe_mxfp4_down: {msg}")


def _validate(a, a_scale, w, w_scale, routing, out, accumulate) -> tuple[int, int, int, int]:
    if not isinstance(routing, Routing):
        _fail(f"routing must come from prepare_routing(), got {type(routing).__name__}")
    for name, t in (("a", a), ("w", w), ("w_scale", w_scale)):
        if not isinstance(t, torch.Tensor):
            _fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if w.dim() != 3 or w.dtype != torch.uint8:
        _fail(f"w must be packed MXFP4, uint8 [E, H, I / 2], got {w.dtype} {tuple(w.shape)}")
    E, H, K2 = w.shape
    K = 2 * K2
    if K % 32:
        _fail(f"the intermediate size I={K} must be a multiple of 32 (one scale per 32 values)")
    if w_scale.dtype != torch.uint8 or tuple(w_scale.shape) != (E, H, K // 32):
        _fail(f"w_scale must be uint8 [E, H, I / 32] = {(E, H, K // 32)}, got {w_scale.dtype} {tuple(w_scale.shape)}")
    if routing.num_experts != E:
        _fail(f"routing was prepared for {routing.num_experts} experts but w has E={E}")
    n = routing.num_pairs
    if a_scale is None:
        if a.dtype != torch.bfloat16 or tuple(a.shape) != (n, K):
            _fail(f"a must be bf16 [M * top_k, I] = {(n, K)} (w4a16), or packed uint8 [M * top_k, I / 2] "
                  f"with a_scale (a4w4); got {a.dtype} {tuple(a.shape)}")
    else:
        if a.dtype != torch.uint8 or tuple(a.shape) != (n, K // 2):
            _fail(f"with a_scale, a must be packed MXFP4 uint8 [M * top_k, I / 2] = {(n, K // 2)}, "
                  f"got {a.dtype} {tuple(a.shape)}")
        if not isinstance(a_scale, torch.Tensor) or a_scale.dtype != torch.uint8 or \
                tuple(a_scale.shape) != (n, K // 32):
            _fail(f"a_scale must be uint8 [M * top_k, I / 32] = {(n, K // 32)}, got "
                  f"{getattr(a_scale, 'dtype', None)} {tuple(getattr(a_scale, 'shape', ()))}")
    for name, t in (("a", a), ("a_scale", a_scale), ("w", w), ("w_scale", w_scale)):
        if t is not None and t.dim() and t.stride(-1) != 1:
            _fail(f"{name} must have unit stride along I (got strides {tuple(t.stride())}); call .contiguous()")
    if w.stride(1) < K2 or w_scale.stride(1) < K // 32:
        _fail("w and w_scale rows must not overlap; call .contiguous()")
    devs = {t.device for t in (a, w, w_scale, routing.sorted_ids, routing.expert_ids) if t is not None}
    if a_scale is not None:
        devs.add(a_scale.device)
    if len(devs) != 1:
        _fail(f"all tensors (and the routing) must be on one device, got {sorted(map(str, devs))}")
    dev = a.device
    if dev.type == "cpu" and not interpreter.active():
        _fail("CPU tensors run only in Triton's interpreter (TRITON_INTERPRET=1 before importing triton); "
              "use kernels.moe_mxfp4.reference() otherwise")
    if dev.type not in ("cpu", "cuda"):
        _fail(f"unsupported device {dev}")
    M = n // routing.top_k
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or tuple(out.shape) != (M, H) \
                or out.device != dev or out.stride(-1) != 1:
            _fail(f"out must be a bf16 [M, H] = {(M, H)} tensor on {dev} with unit inner stride")
    elif accumulate:
        _fail("accumulate=True needs an out tensor to add to")
    return M, H, K, E


def _unwrap_weights(w, w_scale, routing):
    """(w, w_scale, routing, layout level, one_mul): Mxfp4Weights carry their level and whether
    every scale byte is at most 128; plain tensors are level 0, scales unknown.
    ``moe_mxfp4_down(a, weights, routing)`` puts the routing where w_scale goes; it is moved back."""
    if not isinstance(w, Mxfp4Weights):
        return w, w_scale, routing, 0, False
    if routing is None and isinstance(w_scale, Routing):
        w_scale, routing = None, w_scale
    if w_scale is not None:
        _fail("w is Mxfp4Weights, which holds its scales: call moe_mxfp4_down(a, weights, routing) "
              "without w_scale")
    return w.w, w.w_scale, routing, w.level, w.one_mul


def _check_layout(config: MoeMxfp4Config, level: int) -> None:
    """The config must read the layout the weights are in: nothing silently wrong."""
    if config.PREPACK == level:
        return
    if level:
        _fail(f"the weights are prepacked at level {level} (Mxfp4Weights) but config.PREPACK={config.PREPACK}: "
              f"pass config=None (the prepacked default for the routing's BLOCK_M), or a config with "
              f"PREPACK={level} (default_config(..., prepacked={level}) or config.replace(PREPACK={level}))")
    _fail(f"config.PREPACK={config.PREPACK} reads prepacked weights, but w and w_scale are plain tensors "
          f"(read as the plain layout): pass prepare_weights(w, w_scale, level={config.PREPACK}) in place of "
          f"(w, w_scale), or Mxfp4Weights(w, w_scale, {config.PREPACK}) for tensors already prepacked at that level")


def _build_plan(a, a_scale, w, w_scale, level, one_mul, routing, out, accumulate, config) -> _Plan:
    M, H, K, E = _validate(a, a_scale, w, w_scale, routing, out, accumulate)
    if config is None:
        if level:
            config = config_for_block_m(routing.block_m, K, prepacked=level, H=H)
        elif interpreter.active():
            config = default_config(M, routing.top_k, E, K, interpreter=True).replace(BLOCK_M=routing.block_m)
        else:
            config = config_for_block_m(routing.block_m, K)
        # too few output tiles for the SMs: split K (partial sums through the atomic epilogue)
        config = with_split_k(config, routing.max_blocks, H, K, _sms(a.device))
    if not isinstance(config, MoeMxfp4Config):
        _fail(f"config must be a MoeMxfp4Config, got {type(config).__name__}")
    config.validate(K)
    _check_layout(config, level)
    if config.PREPACK and H % config.BLOCK_N:
        _fail(f"PREPACK needs H % BLOCK_N == 0 (H={H}, BLOCK_N={config.BLOCK_N})")
    if config.BLOCK_M != routing.block_m:
        _fail(f"config.BLOCK_M={config.BLOCK_M} but the routing was padded to {routing.block_m} rows; "
              f"call prepare_routing(..., block_m={config.BLOCK_M})")
    det = config.DETERMINISTIC
    workspace = None
    if det:
        workspace = torch.empty((routing.num_pairs, H), dtype=torch.bfloat16, device=a.device)
    grid = (routing.max_blocks, triton.cdiv(H, config.BLOCK_N), config.SPLIT_K)
    constexprs = dict(_kernel_constexprs(config, top_k=routing.top_k, a_fp4=a_scale is not None, H=H, K=K,
                                         one_mul=one_mul, expand="fp32" if interpreter.active() else config.EXPAND),
                      **_launch_options(config))
    reduce_grid = reduce_constexprs = None
    if det:
        bh = min(1024, triton.next_power_of_2(H))
        bt = 4 if interpreter.active() else 1
        reduce_grid = (triton.cdiv(M, bt), triton.cdiv(H, bh))
        reduce_constexprs = dict(TOP_K=routing.top_k, ACCUMULATE=accumulate, BT=bt, BH=bh, num_warps=4)
    return _Plan(config, grid, constexprs, M, H, workspace, reduce_grid, reduce_constexprs)


def _kernel_constexprs(cfg: MoeMxfp4Config, *, top_k: int, a_fp4: bool, H: int, K: int, one_mul: bool,
                       expand: str) -> dict:
    """The down-projection kernel's constexprs for a config (the launcher and compile_for_target)."""
    return dict(TOP_K=top_k, A_FP4=a_fp4, ATOMIC=not cfg.DETERMINISTIC, NT=cfg.NT, EARLY_LOADS=cfg.EARLY_LOADS,
                PREFETCH_EPILOGUE=cfg.PREFETCH_EPILOGUE, SWAP_AB=cfg.swap_ab, EVEN_N=H % cfg.BLOCK_N == 0,
                EXPAND=expand, K=K, BM=cfg.BLOCK_M, BN=cfg.BLOCK_N, BK=cfg.BLOCK_K, LOAD_AHEAD=cfg.LOAD_AHEAD,
                PREPACK=cfg.PREPACK, ONE_MUL=bool(cfg.PREPACK and cfg.ONE_MUL and one_mul), SPLIT_K=cfg.SPLIT_K,
                MAX_UNROLL=MAX_UNROLLED_STEPS if cfg.UNROLL else 0)


def _launch_options(cfg: MoeMxfp4Config) -> dict:
    return dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))


def _sms(device: torch.device) -> int:
    """SMs the no-config SPLIT_K rule fills; 0 in the interpreter (no split: the CPU tests compare
    the default path's bits with explicit configs; they test the rule with this patched)."""
    if interpreter.active() or device.type != "cuda":
        return 0
    return sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _plan_key(a, a_scale, w, w_scale, level, one_mul, routing, out, accumulate, config) -> tuple:
    """Everything a plan depends on; the weights' layout level and scale range included (same
    shapes either way)."""
    return (_sig(a), _sig(a_scale), _sig(w), _sig(w_scale), level, one_mul, _sig(out), _sig(routing.sorted_ids),
            _sig(routing.sorted_weights), _sig(routing.expert_ids), _sig(routing.num_rows),
            routing.num_pairs, routing.top_k, routing.num_experts, routing.block_m, routing.max_blocks,
            bool(accumulate), config_key(config))


def moe_mxfp4_down(a: torch.Tensor, w: torch.Tensor | Mxfp4Weights, w_scale: torch.Tensor | None = None,
                   routing: Routing | None = None, *, a_scale: torch.Tensor | None = None,
                   config: MoeMxfp4Config | None = None, out: torch.Tensor | None = None,
                   accumulate: bool = False) -> torch.Tensor:
    """MoE down-projection with MXFP4 weights: out[t] = sum_k w_tk * a[t*top_k+k] @ W[e_tk].T.

    a: bf16 [M * top_k, I] (w4a16), or packed MXFP4 uint8 [M * top_k, I / 2] with
    a_scale uint8 [M * top_k, I / 32] (a4w4); row t * top_k + k is token t's k-th slot.
    w / w_scale: MXFP4 weights uint8 [E, H, I / 2] / [E, H, I / 32] (``quantize_mxfp4``
    of a [E, H, I] tensor, plain layout); or w = ``Mxfp4Weights`` (``prepare_weights``:
    the weights with their layout level, prepacked by default) and no w_scale, called as
    ``moe_mxfp4_down(a, weights, routing)``. routing: ``prepare_routing(topk_ids,
    topk_weights, E, BM)`` with BM = config.BLOCK_M. Returns out bf16 [M, H] (written, or
    added to with ``accumulate=True``). Without a config, the heuristic's config for the
    routing's BLOCK_M and the weights' layout runs (``config_for_block_m(BM, I,
    prepacked=level)``), with the SPLIT_K of ``config.split_k_for`` (``default_config(M, top_k,
    E, I, prepacked=level, H=H, sms=...)`` names it); a config must read the weights' layout
    (config.PREPACK == level, else ValueError). Weights from ``prepare_weights`` whose scale
    bytes are all <= 128 run the one-multiply expansion (``MoeMxfp4Config.ONE_MUL``). No host
    synchronization.
    """
    w, w_scale, routing, level, one_mul = _unwrap_weights(w, w_scale, routing)
    try:
        key = _plan_key(a, a_scale, w, w_scale, level, one_mul, routing, out, accumulate, config)
    except AttributeError:       # not tensors / not a Routing: let validation say what is wrong
        _validate(a, a_scale, w, w_scale, routing, out, accumulate)
        raise
    plan = _PLANS.get(key)
    if plan is None:
        if interpreter.active():
            interpreter.patch()
        plan = _PLANS.put(key, _build_plan(a, a_scale, w, w_scale, level, one_mul, routing, out, accumulate,
                                           config))
    if out is None:
        out = (torch.zeros if plan.workspace is None else torch.empty)(
            (plan.M, plan.H), dtype=torch.bfloat16, device=a.device)
    elif plan.workspace is None and not accumulate:
        out.zero_()
    if plan.M == 0:
        return out
    target = out if plan.workspace is None else plan.workspace
    plan.launch(a, a if a_scale is None else a_scale, w, w_scale, target,
                routing.sorted_ids, routing.sorted_weights, routing.expert_ids, routing.num_rows,
                routing.num_pairs, plan.H,
                a.stride(0), 0 if a_scale is None else a_scale.stride(0), w.stride(0), w.stride(1),
                w_scale.stride(0), w_scale.stride(1), target.stride(0))
    if plan.reduce is not None:
        plan.reduce(plan.workspace, out, plan.M, plan.H, plan.workspace.stride(0), out.stride(0))
    return out


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
                       top_k: int = 9, H: int = 7168, K: int = 512, one_mul: bool = True, cache_dir) -> list:
    """Cross-compile the down-projection kernel for `target` (no GPU needed) into `cache_dir`;
    returns workbench.asm entries (``.text('sass')``, ``.mix()``, ``.resources()``). one_mul: the
    weights' scale bytes are all at most 128 (as for trained weights), so a config's ONE_MUL applies.

    Pointers, H, K and the row strides are marked 16-divisible, as they are at KIMI-K2.5's
    shapes (H = 7168, I = 512), so the loads vectorize as they do there.
    """
    from workbench.asm.compile import cross_compile

    cfg = config or MoeMxfp4Config()
    sig = {"a_ptr": "*u8" if a_fp4 else "*bf16", "a_scale_ptr": "*u8" if a_fp4 else "*bf16",
           "w_ptr": "*u8", "w_scale_ptr": "*u8", "out_ptr": "*bf16",
           "sorted_ids_ptr": "*i32", "sorted_weights_ptr": "*fp32", "expert_ids_ptr": "*i32",
           "num_rows_ptr": "*i32", "num_pairs": "i32", "H": "i32",
           "stride_am": "i32", "stride_asm": "i32", "stride_we": "i32", "stride_wn": "i32",
           "stride_wse": "i32", "stride_wsn": "i32", "stride_om": "i32"}
    divisible = ["a_ptr", "a_scale_ptr", "w_ptr", "w_scale_ptr", "out_ptr", "sorted_ids_ptr",
                 "sorted_weights_ptr", "expert_ids_ptr", "H", "stride_am", "stride_we", "stride_wn",
                 "stride_wse", "stride_wsn", "stride_om"]
    if a_fp4:
        divisible.append("stride_asm")
    constexprs = _kernel_constexprs(cfg, top_k=top_k, a_fp4=a_fp4, H=H, K=K, one_mul=one_mul, expand=cfg.EXPAND)
    return cross_compile(_moe_mxfp4_down_kernel, target, signature=sig, constexprs=constexprs,
                         divisible=divisible, options=_launch_options(cfg), cache_dir=cache_dir)
