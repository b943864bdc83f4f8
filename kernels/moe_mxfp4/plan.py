"""What the MXFP4 down-projection's launcher and its selection layer share: the facts of one
call (``Call``), the call's checks, the plan of a call signature for a config (``build``: grid,
constexprs, the deterministic mode's workspace, the compiled kernels) and one call of a plan
(``execute``). ``kernels.moe_mxfp4.launch`` caches plans per call signature and asks the selection
layer (``kernels.moe_mxfp4.select``) for the config when none is given; the selection layer builds
plans here to time candidates (``builder``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton

from kernels.common import interpreter
from kernels.common.launcher import PlannedLaunch
from kernels.common.plans import sm_count

from .config import MoeMxfp4Config
from .quant import Mxfp4Weights, prepacked_shape
from .routing import Routing
from . import triton_routing
from .triton import _moe_mxfp4_down_kernel, _moe_mxfp4_down_routed_kernel, _reduce_topk_kernel

# K steps the kernel unrolls; a longer reduction runs as a loop (compile time: 112 unrolled steps
# took minutes). 24 takes gpt-oss' 23 steps of 128 (cross-compiled for sm_90 in 8.8 s, 70 registers,
# no spills), so they keep their loads ahead, which the loop form has not. The CPU tests lower it
# to run the loop in the interpreter.
MAX_UNROLLED_STEPS = 24


@dataclass
class Plan:
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
    choice: Any = None    # kernels.common.select.Choice: which candidate runs and why (no explicit config)
    # the kernel's row strides (a, a_scale, w, w_scale, output): fixed by the plan's key (every tensor's
    # signature), so taken once, on the first call (eight stride reads fewer per call)
    strides: tuple | None = None

    def __post_init__(self):
        self.launch = PlannedLaunch.of(_moe_mxfp4_down_kernel, self.grid, self.constexprs)
        if self.reduce_grid is not None:
            self.reduce = PlannedLaunch.of(_reduce_topk_kernel, self.reduce_grid, self.reduce_constexprs)


@dataclass(frozen=True)
class Call:
    """The facts of one call that selection reads (the tensors are kept only while a plan is
    made, for tune-on-miss; a plan never keeps them)."""

    a: torch.Tensor
    a_scale: torch.Tensor | None
    w: torch.Tensor               # as the kernel reads them (Mxfp4Weights unwrapped)
    w_scale: torch.Tensor
    level: int                    # the weights' layout (0 plain, 1-3 prepacked)
    one_mul: bool
    routing: Routing
    M: int
    H: int
    K: int
    E: int
    deterministic: bool           # the epilogue asked for
    sms: int                      # SMs the SPLIT_K rule fills (0 in the interpreter)
    interpret: bool

    @property
    def top_k(self) -> int:
        return self.routing.top_k

    @property
    def block_m(self) -> int:
        return self.routing.block_m

    @property
    def act(self) -> str:
        return "mxfp4" if self.a_scale is not None else "bf16"


def fail(msg: str):
    raise ValueError(f"moe_mxfp4_down: {msg}")


def validate(a, a_scale, w, w_scale, routing, out, accumulate, shape=None) -> tuple[int, int, int, int]:
    """(M, H, K, E) of a call, after every check; shape: the weights' logical (H, I) when they are
    stored padded (``Mxfp4Weights.shape``; None: the tensors' own)."""
    if not isinstance(routing, Routing):
        fail(f"routing must come from prepare_routing() (or be the router's (topk_ids, topk_weights)), got "
             f"{type(routing).__name__}")
    for name, t in (("a", a), ("w", w), ("w_scale", w_scale)):
        if not isinstance(t, torch.Tensor):
            fail(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if w.dim() != 3 or w.dtype != torch.uint8:
        fail(f"w must be packed MXFP4, uint8 [E, H, I / 2], got {w.dtype} {tuple(w.shape)}")
    E, Hw, K2 = w.shape
    H, K = (Hw, 2 * K2) if shape is None else shape
    if (H, K) != (Hw, 2 * K2) and prepacked_shape(H, K) != (Hw, 2 * K2):
        fail(f"weights of logical (H, I) = {(H, K)} cannot be stored as w {tuple(w.shape)} (the prepacked layouts "
             f"pad to {prepacked_shape(H, K)})")
    if K % 32:
        fail(f"the intermediate size I={K} must be a multiple of 32 (one scale per 32 values)")
    if w_scale.dtype != torch.uint8 or tuple(w_scale.shape) != (E, Hw, K2 // 16):
        fail(f"w_scale must be uint8 [E, H, I / 32] = {(E, Hw, K2 // 16)}, got {w_scale.dtype} {tuple(w_scale.shape)}")
    if routing.num_experts != E:
        fail(f"routing was prepared for {routing.num_experts} experts but w has E={E}")
    n = routing.num_pairs
    if a_scale is None:
        if a.dtype != torch.bfloat16 or tuple(a.shape) != (n, K):
            hint = ("; prepacked tensors padded to whole 128-K tiles need Mxfp4Weights(..., shape=(H, I)), "
                    "which prepare_weights sets") if shape is None and isinstance(a, torch.Tensor) and \
                a.dim() == 2 and a.shape[1] < K else ""
            fail(f"a must be bf16 [M * top_k, I] = {(n, K)} (w4a16), or packed uint8 [M * top_k, I / 2] "
                 f"with a_scale (a4w4); got {a.dtype} {tuple(a.shape)}{hint}")
    else:
        if a.dtype != torch.uint8 or tuple(a.shape) != (n, K // 2):
            fail(f"with a_scale, a must be packed MXFP4 uint8 [M * top_k, I / 2] = {(n, K // 2)}, "
                 f"got {a.dtype} {tuple(a.shape)}")
        if not isinstance(a_scale, torch.Tensor) or a_scale.dtype != torch.uint8 or \
                tuple(a_scale.shape) != (n, K // 32):
            fail(f"a_scale must be uint8 [M * top_k, I / 32] = {(n, K // 32)}, got "
                 f"{getattr(a_scale, 'dtype', None)} {tuple(getattr(a_scale, 'shape', ()))}")
    for name, t in (("a", a), ("a_scale", a_scale), ("w", w), ("w_scale", w_scale)):
        if t is not None and t.dim() and t.stride(-1) != 1:
            fail(f"{name} must have unit stride along I (got strides {tuple(t.stride())}); call .contiguous()")
    if w.stride(1) < K2 or w_scale.stride(1) < K // 32:
        fail("w and w_scale rows must not overlap; call .contiguous()")
    devs = {t.device for t in (a, w, w_scale, routing.sorted_ids, routing.expert_ids) if t is not None}
    if a_scale is not None:
        devs.add(a_scale.device)
    if len(devs) != 1:
        fail(f"all tensors (and the routing) must be on one device, got {sorted(map(str, devs))}")
    dev = a.device
    if dev.type == "cpu" and not interpreter.active():
        fail("CPU tensors run only in Triton's interpreter (TRITON_INTERPRET=1 before importing triton); "
             "use kernels.moe_mxfp4.reference() otherwise")
    if dev.type not in ("cpu", "cuda"):
        fail(f"unsupported device {dev}")
    M = n // routing.top_k
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.dtype != torch.bfloat16 or tuple(out.shape) != (M, H) \
                or out.device != dev or out.stride(-1) != 1:
            fail(f"out must be a bf16 [M, H] = {(M, H)} tensor on {dev} with unit inner stride")
    elif accumulate:
        fail("accumulate=True needs an out tensor to add to")
    return M, H, K, E


def unwrap_weights(w, w_scale, routing):
    """(w, w_scale, routing, layout level, one_mul, shape): Mxfp4Weights carry their level, whether
    every scale byte is at most 128 and their logical (H, I) (``shape``: None unless the stored
    tensors are padded); plain tensors are level 0, scales unknown, shape None.
    ``moe_mxfp4_down(a, weights, routing)`` puts the routing where w_scale goes; it is moved back."""
    if not isinstance(w, Mxfp4Weights):
        return w, w_scale, routing, 0, False, None
    if routing is None and isinstance(w_scale, (Routing, tuple, list)):
        w_scale, routing = None, w_scale
    if w_scale is not None:
        fail("w is Mxfp4Weights, which holds its scales: call moe_mxfp4_down(a, weights, routing) "
             "without w_scale")
    return w.w, w.w_scale, routing, w.level, w.one_mul, (w.shape if w.padded else None)


def check_layout(config: MoeMxfp4Config, level: int) -> None:
    """The config must read the layout the weights are in: nothing silently wrong."""
    if config.PREPACK == level:
        return
    if level:
        fail(f"the weights are prepacked at level {level} (Mxfp4Weights) but config.PREPACK={config.PREPACK}: "
             f"pass config=None (the prepacked default for the routing's BLOCK_M), or a config with "
             f"PREPACK={level} (default_config(..., prepacked={level}) or config.replace(PREPACK={level}))")
    fail(f"config.PREPACK={config.PREPACK} reads prepacked weights, but w and w_scale are plain tensors "
         f"(read as the plain layout): pass prepare_weights(w, w_scale, level={config.PREPACK}) in place of "
         f"(w, w_scale), or Mxfp4Weights(w, w_scale, {config.PREPACK}) for tensors already prepacked at that level")


def make_call(a, a_scale, w, w_scale, level, one_mul, routing, M, H, K, E, deterministic) -> Call:
    return Call(a, a_scale, w, w_scale, level, one_mul, routing, M, H, K, E, bool(deterministic), sms(a.device),
                interpreter.active())


def call_of(a, a_scale, w, routing, *, w_scale=None, deterministic: bool = False) -> Call:
    """A call's facts (validated as ``moe_mxfp4_down`` validates it; w may be ``Mxfp4Weights``)."""
    w, w_scale, routing, level, one_mul, shape = unwrap_weights(w, w_scale, routing)
    M, H, K, E = validate(a, a_scale, w, w_scale, routing, None, False, shape)
    if interpreter.active():
        interpreter.patch()
    return make_call(a, a_scale, w, w_scale, level, one_mul, routing, M, H, K, E, deterministic)


def builder(call: Call):
    """``build(config) -> run(out) -> out``: this call's plan for an explicit config, run into
    ``out`` (what tune-on-miss times; such plans are not cached)."""
    def build_one(config: MoeMxfp4Config):
        plan = build(call.a, call.a_scale, call.w, call.w_scale, call.level, call.one_mul, call.routing, None,
                     False, config, shape=(call.H, call.K))

        def run(out: torch.Tensor) -> torch.Tensor:
            return execute(plan, call.a, call.a_scale, call.w, call.w_scale, call.routing, out, False)
        return run
    return build_one


def build(a, a_scale, w, w_scale, level, one_mul, routing, out, accumulate, config, choice=None, *,
          shape=None) -> Plan:
    """The plan of one call signature for ``config`` (checked against the call: ValueError)."""
    M, H, K, E = validate(a, a_scale, w, w_scale, routing, out, accumulate, shape)
    if not isinstance(config, MoeMxfp4Config):
        fail(f"config must be a MoeMxfp4Config, got {type(config).__name__}")
    config.validate(K)
    check_layout(config, level)
    if config.BLOCK_M != routing.block_m:
        fail(f"config.BLOCK_M={config.BLOCK_M} but the routing was padded to {routing.block_m} rows; "
             f"call prepare_routing(..., block_m={config.BLOCK_M})")
    det = config.DETERMINISTIC
    workspace = None
    if det:
        workspace = torch.empty((routing.num_pairs, H), dtype=torch.bfloat16, device=a.device)
    check_n_tiles(config, H, K)
    grid = (routing.max_blocks, triton.cdiv(H, config.BLOCK_N) // config.N_TILES, config.SPLIT_K)
    constexprs = dict(kernel_constexprs(config, top_k=routing.top_k, a_fp4=a_scale is not None, H=H, K=K,
                                        one_mul=one_mul, expand="fp32" if interpreter.active() else config.EXPAND),
                      **launch_options(config))
    reduce_grid = reduce_constexprs = None
    if det:
        bh = min(1024, triton.next_power_of_2(H))
        bt = 4 if interpreter.active() else 1
        reduce_grid = (triton.cdiv(M, bt), triton.cdiv(H, bh))
        reduce_constexprs = dict(TOP_K=routing.top_k, ACCUMULATE=accumulate, BT=bt, BH=bh, num_warps=4)
    return Plan(config, grid, constexprs, M, H, workspace, reduce_grid, reduce_constexprs, choice=choice)


def check_n_tiles(config: MoeMxfp4Config, H: int, K: int) -> None:
    """N_TILES > 1: whole column tiles per program, all of them unrolled (ValueError otherwise)."""
    if config.N_TILES == 1:
        return
    tiles = triton.cdiv(H, config.BLOCK_N)
    if tiles % config.N_TILES:
        fail(f"N_TILES={config.N_TILES} must divide the {tiles} column tiles (H={H} / BLOCK_N={config.BLOCK_N}, "
             f"rounded up); use a divisor of {tiles}")
    steps = triton.cdiv(triton.cdiv(K, config.BLOCK_K), config.SPLIT_K)
    if steps * config.N_TILES > MAX_UNROLLED_STEPS:
        fail(f"N_TILES={config.N_TILES} unrolls {steps} K steps per tile, {steps * config.N_TILES} in all, over "
             f"the {MAX_UNROLLED_STEPS} the kernel unrolls; use N_TILES=1 (the looped reduction)")


def kernel_constexprs(cfg: MoeMxfp4Config, *, top_k: int, a_fp4: bool, H: int, K: int, one_mul: bool,
                      expand: str) -> dict:
    """The down-projection kernel's constexprs for a config (the launcher and compile_for_target)."""
    return dict(TOP_K=top_k, A_FP4=a_fp4, ATOMIC=not cfg.DETERMINISTIC, NT=cfg.NT, EARLY_LOADS=cfg.EARLY_LOADS,
                PREFETCH_EPILOGUE=cfg.PREFETCH_EPILOGUE, SWAP_AB=cfg.swap_ab, EVEN_N=H % cfg.BLOCK_N == 0,
                EXPAND=expand, K=K, BM=cfg.BLOCK_M, BN=cfg.BLOCK_N, BK=cfg.BLOCK_K, LOAD_AHEAD=cfg.LOAD_AHEAD,
                PREPACK=cfg.PREPACK, ONE_MUL=bool(cfg.PREPACK and cfg.ONE_MUL and one_mul), SPLIT_K=cfg.SPLIT_K,
                MAX_UNROLL=MAX_UNROLLED_STEPS if cfg.UNROLL else 0, N_TILES=cfg.N_TILES)


def launch_options(cfg: MoeMxfp4Config) -> dict:
    return dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}))


def sms(device: torch.device) -> int:
    """SMs the no-config SPLIT_K rule fills; 0 in the interpreter (no split: the CPU tests compare
    the default path's bits with explicit configs; they test the rule with this patched)."""
    if interpreter.active() or device.type != "cuda":
        return 0
    return sm_count(device.index if device.index is not None else torch.cuda.current_device())


def row_strides(a, a_scale, w, w_scale, out) -> tuple:
    """The kernels' row strides of a, a_scale (0 without), w, w_scale and the output, in their order."""
    return (a.stride(0), 0 if a_scale is None else a_scale.stride(0), w.stride(0), w.stride(1),
            w_scale.stride(0), w_scale.stride(1), out.stride(0))


def execute(plan: Plan, a, a_scale, w, w_scale, routing, out, accumulate) -> torch.Tensor:
    """One call of a plan: the output zeroed (atomic mode, unless accumulating), the kernel, and
    the deterministic mode's reduction."""
    if out is None:
        out = (torch.zeros if plan.workspace is None else torch.empty)(
            (plan.M, plan.H), dtype=torch.bfloat16, device=a.device)
    elif plan.workspace is None and not accumulate:
        out.zero_()
    if plan.M == 0:
        return out
    target = out if plan.workspace is None else plan.workspace
    if plan.strides is None:
        plan.strides = row_strides(a, a_scale, w, w_scale, target)
    plan.launch(a, a if a_scale is None else a_scale, w, w_scale, target,
                routing.sorted_ids, routing.sorted_weights, routing.expert_ids, routing.num_rows,
                routing.num_pairs, plan.H, *plan.strides)
    if plan.reduce is not None:
        plan.reduce(plan.workspace, out, plan.M, plan.H, plan.workspace.stride(0), out.stride(0))
    return out


# The one-launch kernel's registers capped at the plain kernel's compiled count, so its tiles keep the
# plain kernel's occupancy (cross-compiled for sm_90 without the cap: 96 registers against 79 at KIMI-K2.5's
# M = 16, 82 against 80 at gpt-oss). Measured, ptxas' own count took 0.95-1.02x the capped time at the M
# where the one launch runs (results/moe_mxfp4/routed/): no clear difference. False: ptxas decides.
CAP_ROUTED_REGISTERS = True


class RoutedPlan:
    """A plan's config run from the router's ids in one launch (``_moe_mxfp4_down_routed_kernel``):
    its first programs make the routing and zero the output, the others are the plan's tiles.
    A call is an allocation (the output) and that launch. The routing's buffers and the kernel's
    two counters are a workspace kept per CUDA stream (made on a stream's first call, never freed;
    under CUDA graph capture in the graph's memory, the counters' zeroing captured with it): the
    launches of one stream run in order, so one workspace serves them all; calls on two streams
    use two. As for every planned launch's scratch, graphs meant to replay concurrently are
    captured on different streams."""

    def __init__(self, plan: Plan, num_experts: int, num_pairs: int, sms: int, maxnreg: int | None = None):
        self.plan = plan
        self.num_pairs = num_pairs
        cx = routed_constexprs(num_experts, num_pairs, plan.constexprs["TOP_K"], plan.config.BLOCK_M, sms=sms)
        self.max_blocks = plan.grid[0]
        self.max_rows = self.max_blocks * plan.config.BLOCK_M
        self.programs = plan.grid[0] * plan.grid[1] * plan.grid[2]
        self.launch = PlannedLaunch.of(_moe_mxfp4_down_routed_kernel, plan.grid,
                                       dict(plan.constexprs, **cx, **({"maxnreg": maxnreg} if maxnreg else {})))
        self.strides = None
        self.workspaces: dict = {}

    @property
    def config(self) -> MoeMxfp4Config:
        return self.plan.config

    @property
    def choice(self):
        return self.plan.choice

    def _workspace(self, device: torch.device, stream: int):
        ws = self.workspaces.get(stream)
        if ws is None:   # sorted ids, sorted weights, expert of each block, rows used; the two counters
            buf = torch.empty(2 * self.max_rows + self.max_blocks + 4, dtype=torch.int32, device=device)
            ids, wts, experts, rows = buf.split_with_sizes([self.max_rows, self.max_rows, self.max_blocks, 4])
            ws = self.workspaces[stream] = (ids, wts.view(torch.float32), experts, rows,
                                            torch.zeros(2, dtype=torch.int64, device=device))
        return ws

    def __call__(self, a, a_scale, w, w_scale, topk_ids, topk_weights, stream: int) -> torch.Tensor:
        plan = self.plan
        out = torch.empty((plan.M, plan.H), dtype=torch.bfloat16, device=a.device)
        ws = self._workspace(a.device, stream)
        if self.strides is None:
            self.strides = (*row_strides(a, a_scale, w, w_scale, out), plan.M * plan.H // 2, self.max_rows,
                            self.max_blocks, self.programs, 1 if interpreter.active() else self.programs)
        self.launch(a, a if a_scale is None else a_scale, w, w_scale, out, topk_ids, topk_weights, *ws,
                    self.num_pairs, plan.H, *self.strides)
        return out


def routed_constexprs(num_experts: int, num_pairs: int, top_k: int, block_m: int, *, sms: int = 132) -> dict:
    """The routing constexprs of the one-launch kernel: the routing kernel's, with its [CH, G] tiles
    kept to 256 elements, two per thread (they share the kernel's registers with the tiles' loop:
    cross-compiled for sm_90, the routing alone holds 85 registers at [256, 4], 56 at [64, 4])."""
    _, cx = triton_routing.routing_constexprs(num_pairs, num_experts, top_k, block_m, sms=sms)
    ch = max(16, min(triton.next_power_of_2(max(num_pairs, 1)), 256 // cx["G"]))
    return dict(NE=num_experts, NB=cx["NB"], CH=ch, G=cx["G"], FILL=cx["FILL"])
