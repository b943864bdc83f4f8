"""The public launchers of the MoE family: ``grouped_gemm`` (forward, and dgrad with
``trans_w``), ``grouped_gemm_wgrad``, ``grouped_gemm_ws`` (the Gluon kernel
alone) and the differentiable ``grouped_linear``.

A call is validated, then planned once per call signature: the shapes,
strides, dtypes and devices of x, w (or dy), group_sizes and out, whether each
base pointer is 16-byte aligned, ``trans_w``, the explicit config, whether
``out`` is given, whether a CUDA graph is being captured and whether tuning was
asked decide the kernel, its config, grid, constants and the descriptors'
shapes, strides and boxes. An explicit config runs the Triton kernel with it.
Without one, the selection layer (``kernels.moe.select``) names the candidate,
a (variant, config) pair: a tuning table's entry for this GPU and problem, a
tuning run on this call when asked (``tune=True`` or ``WORKBENCH_TUNE=1``), else
the cold rule (the Gluon kernel where it takes the call, else the Triton config
table); the variant's plan builder (``_variant_plan``: Gluon, Triton or the
library, ``torch._grouped_mm``) does the rest, and the plan keeps the choice
(``plan.choice``: what ran and why). Plans live in bounded LRUs
(``kernels.gemm.launch.PlanCache``); a repeated call is a dictionary lookup,
the output's allocation (when none is given), the TMA descriptors (their base
pointers change from call to call) and a launch.

What a repeated call still does on the host, and why: a signature of each
tensor (a few attribute reads: the plan must not be reused for another layout
or alignment), the lookup, the output's allocation when none is given, a
device copy of group_sizes if it is strided (the kernels read it with unit
stride), making the device's CUDA context current where descriptors are built
(autograd's backward thread may have none), the 3 or 5 host TMA descriptors
from the plan's shapes, strides and boxes (their base pointers change), and
the launch through the plan's kept kernel (``kernels.common.launcher``). With
``DEVICE_DESCRIPTORS`` the Triton kernels encode those descriptors themselves
from the pointers and strides, so no descriptor is built on the host (the
context step stays: the launch itself needs the right context). With
``GLUON_DEVICE_DESCRIPTORS`` the Gluon kernel does the same
(``kernels.moe.gluon._grouped_gemm_ws_dev_kernel``: the producer encodes x's
and w's descriptors, each consumer out's row window); a separate switch,
because that variant has not been measured yet.

Nothing here reads the group sizes on the host: the kernels read them on the
GPU, so no call synchronizes and every call can be captured in a CUDA graph;
the sizes may change between calls that share a plan. A strided group_sizes
tensor is copied to a contiguous one on the device (no sync).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import triton

from kernels.common import cuda_context, interpreter
from kernels.common import select as common_select
from kernels.common.launcher import PlannedLaunch
from kernels.common.plans import PlanCache, capturing, config_key, tensor_signature
from kernels.common.plans import capability as _capability, sm_count as _sm_count
from kernels.gemm.launch import _tma_ok
from kernels.moe import gluon, select as mselect, triton as kernels
from kernels.moe.config import (
    DTYPES, FALLBACK, MAX_GROUPS, MAXNREG, WS_DTYPES, GroupedConfig, GroupedWsConfig, as_config, check_alignment,
    check_groups, default_config, dot_precision, g_pad, g_pad_triton, num_warps, pick_config,
    tail_width, validate_config, validate_ws,
)
from kernels.gemm.config import ws_device_desc_fits
from workbench.dtypes import triton_type

# Where the Triton kernels' TMA descriptors are encoded, where both sides may: True, in the kernel
# (no per-call host encoding; kernels.common.launcher supplies the global scratch); False, on the
# host. Part of every plan key. The Gluon kernel keeps host descriptors.
# Measured on an H200 (results/launch_cost/descriptors/): 10-30 us less host time per call and
# the same or less GPU time (graph ratio device/host 0.99-1.23 over 20 cases), so True.
DEVICE_DESCRIPTORS = True
# The same choice for the Gluon kernel (grouped_gemm's default fwd/dgrad path and grouped_gemm_ws):
# True, _grouped_gemm_ws_dev_kernel (its partitions encode their descriptors); False, host
# descriptors. Part of every plan key. Measured on an H200
# (results/launch_cost/descriptors/descriptors_gluon_log.txt): host time per call 17-18 us instead
# of 30-31, GPU time the same (graph ratio 1.001-1.016), so True.
GLUON_DEVICE_DESCRIPTORS = True
_I32 = 2**31


# --------------------------------------------------------------------------
# Validation (once per plan)
# --------------------------------------------------------------------------
def _signature(who: str, name: str, t) -> tuple:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{who}: {name} must be a torch.Tensor, got {type(t).__name__}")
    return tensor_signature(t)


def _check_common(name_a: str, a: torch.Tensor, name_b: str, b: torch.Tensor,
                  group_sizes: torch.Tensor, dim_b: int) -> None:
    if a.dim() != 2:
        raise ValueError(f"grouped_gemm: {name_a} must be 2-D [tokens, features], got shape {tuple(a.shape)}")
    if b.dim() != dim_b:
        raise ValueError(f"grouped_gemm: {name_b} must be {dim_b}-D, got shape {tuple(b.shape)}")
    if group_sizes.dim() != 1:
        raise ValueError(f"grouped_gemm: group_sizes must be 1-D [G], got shape {tuple(group_sizes.shape)}")
    if group_sizes.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_gemm: group_sizes must be int32 or int64, got {group_sizes.dtype}")
    if a.dtype not in DTYPES:
        raise ValueError(f"grouped_gemm: {name_a}.dtype must be one of bf16/fp16/fp32, got {a.dtype}")
    if b.dtype != a.dtype:
        raise ValueError(f"grouped_gemm: {name_a} and {name_b} dtypes differ ({a.dtype} vs {b.dtype})")
    if not (a.device == b.device == group_sizes.device):
        raise ValueError(f"grouped_gemm: {name_a} ({a.device}), {name_b} ({b.device}) and group_sizes "
                         f"({group_sizes.device}) must be on one device; group sizes stay on the GPU")
    if a.device.type == "cpu" and not interpreter.active():
        raise ValueError("grouped_gemm: CPU tensors run only in Triton's interpreter "
                         "(set TRITON_INTERPRET=1 before importing triton); use reference() otherwise")
    if a.device.type not in ("cpu", "cuda"):
        raise ValueError(f"grouped_gemm: unsupported device {a.device}")
    if a.stride(-1) != 1 or (a.shape[0] > 1 and a.stride(0) < a.shape[1]):
        raise ValueError(f"grouped_gemm: {name_a} must be row-major with unit inner stride "
                         f"(got strides {a.stride()}); call .contiguous()")


def _check_g(G: int, group_sizes: torch.Tensor, what: str) -> None:
    if group_sizes.shape[0] != G:
        raise ValueError(f"grouped_gemm: group_sizes has {group_sizes.shape[0]} entries but {what} has G={G}")
    if G < 1 or G > MAX_GROUPS:
        raise ValueError(f"grouped_gemm: G must be in [1, {MAX_GROUPS}], got {G}")


def _check_out(out: torch.Tensor | None, shape: tuple, like: torch.Tensor, who: str, contiguous: bool) -> None:
    if out is None:
        return
    if (tuple(out.shape) != shape or out.dtype != like.dtype or out.device != like.device
            or (contiguous and not out.is_contiguous())):
        what = "a contiguous" if contiguous else "a"
        raise ValueError(f"{who}: out must be {what} {like.dtype} {list(shape)} tensor on {like.device}, got "
                         f"{out.dtype} {list(out.shape)} on {out.device} with strides {out.stride()}")


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4   # interpreter: a few programs, so the persistent loop really loops
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _strides_ok(strides, elem_bytes: int) -> bool:
    return strides[-1] == 1 and all((s * elem_bytes) % 16 == 0 for s in strides[:-1])


def _triton_tma_ok(device: torch.device, tensors, fresh_strides, forced: bool) -> bool:
    """TMA for the Triton kernels: sm_90+, 16-byte aligned bases and leading strides
    (``fresh_strides``: those of an output allocated by the call). In the
    interpreter the descriptor path runs (emulated) only when a config asks for
    it (``forced``), so tests can cover it on a CPU."""
    if interpreter.active():
        if not forced:
            return False
    elif device.type != "cuda" or _capability(device.index if device.index is not None
                                               else torch.cuda.current_device())[0] < 9:
        return False
    es = tensors[0].element_size()
    if fresh_strides is not None and not _strides_ok(fresh_strides, es):
        return False
    return all(t.data_ptr() % 16 == 0 and _strides_ok(t.stride(), es) for t in tensors)


def _device_desc_ok(tensors, fresh_shape=None) -> bool:
    """On top of ``_triton_tma_ok``: what the kernel-built descriptors take as 32-bit
    sizes (every dimension) and positive strides (a broadcast stride of 0 is left to
    host descriptors)."""
    shapes = [tuple(t.shape) for t in tensors] + ([tuple(fresh_shape)] if fresh_shape is not None else [])
    return (all(0 < d < _I32 for shape in shapes for d in shape)
            and all(0 < st < _I32 for t in tensors for st in t.stride()[:-1]))


def _ws_tma_ok(t: torch.Tensor) -> bool:
    return _tma_ok(t) and _strides_ok(t.stride(), t.element_size())


def _check_device(device: torch.device) -> None:
    """ValueError unless device is a CUDA device of compute capability 9.x."""
    if device.type != "cuda":
        raise ValueError(f"grouped_gemm_ws: tensors on {device}: this kernel needs an sm_90 (Hopper) CUDA GPU; "
                         f"{FALLBACK}")
    cap = _capability(device.index if device.index is not None else torch.cuda.current_device())
    if cap[0] != 9:
        raise ValueError(f"grouped_gemm_ws: this kernel needs an sm_90 (Hopper) GPU, found sm_{cap[0]}{cap[1]} "
                         f"(wgmma and setmaxnreg as used here are Hopper's); {FALLBACK}")


def _check_ws_operands(x, w, group_sizes, trans_w: bool) -> tuple[int, int, int, int]:
    """(M, N, K, G) of operands the Gluon kernel takes, else a ValueError naming the fallback."""
    if interpreter.active():
        raise ValueError("grouped_gemm_ws: Gluon kernels do not run in Triton's interpreter (TRITON_INTERPRET=1 "
                         f"is set); {FALLBACK}")
    for name, t in (("x", x), ("w", w), ("group_sizes", group_sizes)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"grouped_gemm_ws: {name} must be a torch.Tensor, got {type(t).__name__}")
    layout = "[G, N, K]" if trans_w else "[G, K, N]"
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_gemm_ws: need x [M, K] and w {layout}, got x{tuple(x.shape)} and w{tuple(w.shape)}")
    if group_sizes.dim() != 1 or group_sizes.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"grouped_gemm_ws: group_sizes must be a 1-D int32 or int64 tensor, got "
                         f"{group_sizes.dtype} of shape {tuple(group_sizes.shape)}")
    if x.dtype != w.dtype or x.dtype not in WS_DTYPES:
        raise ValueError(f"grouped_gemm_ws: x and w must both be bfloat16 or both float16, got {x.dtype} and "
                         f"{w.dtype}; {FALLBACK}")
    if not (x.device == w.device == group_sizes.device):
        raise ValueError(f"grouped_gemm_ws: x ({x.device}), w ({w.device}) and group_sizes ({group_sizes.device}) "
                         "must be on one device; the group sizes stay on the GPU")
    _check_device(x.device)
    M, K = x.shape
    G = w.shape[0]
    N, Kw = (w.shape[1], w.shape[2]) if trans_w else (w.shape[2], w.shape[1])
    if Kw != K:
        raise ValueError(f"grouped_gemm_ws: x is [M={M}, K={K}] but w {layout} is {tuple(w.shape)} (K={Kw}); "
                         f"did you mean trans_w={not trans_w}?")
    if group_sizes.shape[0] != G:
        raise ValueError(f"grouped_gemm_ws: group_sizes has {group_sizes.shape[0]} entries but w has G={G}")
    check_groups(G)
    check_alignment(N, K, x.dtype)
    return M, N, K, G


def can_run(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, out: torch.Tensor | None,
            trans_w: bool) -> bool:
    """Whether ``grouped_gemm_ws`` takes these operands (``grouped_gemm`` asks before
    it hands its default fwd/dgrad path over; ``out=None``: a new one)."""
    try:
        _check_ws_operands(x, w, group_sizes, trans_w)
    except ValueError:
        return False
    return all(_ws_tma_ok(t) for t in (x, w) + ((out,) if out is not None else ()))


# --------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Plan:
    """Everything a launcher decides for one call signature."""

    kind: str                 # "empty" (nothing to compute), "zero" (fill out with zeros) or "launch"
    out_shape: tuple
    label: str                # the kernel and config, for tables
    kernel: Any = None        # the @triton.jit / @gluon.jit function
    gluon: bool = False       # the Gluon kernel (descriptors, or with device_desc pointers) or Triton's
    grid: tuple = (1,)
    descs: tuple = ()         # descriptor recipes: everything but the base pointers
    args: tuple = ()          # run-time scalars after the tensors and descriptors
    meta: dict = dataclasses.field(default_factory=dict)  # constexprs and launch options
    tma: bool = False         # TMA on a CUDA device: make its context current first (host descriptors and launch)
    sizes_contiguous: bool = True
    launcher: Any = dataclasses.field(default=None, compare=False)  # made from kernel, grid and meta
    device_desc: bool = False  # the kernel encodes its TMA descriptors itself (Triton: descs all None; Gluon: none)
    choice: Any = dataclasses.field(default=None, compare=False)  # the selection layer's Choice (no config given)

    def __post_init__(self):
        if self.kind == "launch" and self.launcher is None:
            object.__setattr__(self, "launcher", PlannedLaunch.of(self.kernel, self.grid, self.meta))


_PLANS = PlanCache()        # grouped_gemm
_WGRAD_PLANS = PlanCache()  # grouped_gemm_wgrad
_WS_PLANS = PlanCache()     # grouped_gemm_ws


def _ws_plan(x, w, group_sizes, out, cfg: GroupedWsConfig, trans_w: bool, M: int, N: int, K: int, G: int,
             label: str, device_descriptors: bool = False) -> _Plan:
    """The Gluon kernel's plan: host descriptor recipes, or (``device_descriptors`` and
    legal: ``_device_desc_ok`` for x, w and out, the config's shared memory with the
    descriptors' staging on top) the variant that encodes them itself."""
    out_stride = out.stride(0) if out is not None else N
    grid = (grid_size(M, N, G, cfg, _num_sms(x.device)),)
    meta = dict(NUM_STAGES=cfg.num_stages, COOPERATIVE=cfg.cooperative, TRANS_W=bool(trans_w), G_PAD=g_pad(G),
                CONSUMER_REGS=cfg.consumer_regs, PRODUCER_REGS=cfg.producer_regs, num_warps=num_warps(cfg),
                maxnreg=MAXNREG)
    if (device_descriptors and _device_desc_ok((x, w) + ((out,) if out is not None else ()), (M, N))
            and ws_device_desc_fits(cfg, x.element_size())):
        kernels.row_window(M, N, out_stride, "grouped_gemm_ws")   # its limit on rows holds here too
        meta.update(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
        args = (M, N, K, G, x.stride(0), w.stride(0), w.stride(1), out_stride, cfg.group_m)
        return _Plan("launch", (M, N), label, gluon._grouped_gemm_ws_dev_kernel, True, grid, (), args, meta, True,
                     group_sizes.stride(0) == 1, device_desc=True)
    descs = gluon.descriptor_recipes(x.shape, x.stride(), w.shape, w.stride(), M, N, out_stride, x.dtype, cfg,
                                     trans_w)
    return _Plan("launch", (M, N), label, gluon._grouped_gemm_ws_kernel, True, grid, descs, (M, G, cfg.group_m),
                 meta, True, group_sizes.stride(0) == 1)


def _plan_mm(x, w, group_sizes, trans_w: bool, config, out, device_descriptors: bool = False,
             gluon_device_descriptors: bool = False, capture: bool = False, tune: bool = False) -> _Plan:
    _check_common("x", x, "w", w, group_sizes, 3)
    G = w.shape[0]
    _check_g(G, group_sizes, "w")
    M, K = x.shape
    N, Kw = (w.shape[1], w.shape[2]) if trans_w else (w.shape[2], w.shape[1])
    if Kw != K:
        layout = "[G, N, K]" if trans_w else "[G, K, N]"
        raise ValueError(f"grouped_gemm: x is [M={M}, K={K}] but w {layout} is {tuple(w.shape)} "
                         f"(K={Kw}); did you mean trans_w={not trans_w}?")
    if w.stride(-1) != 1:
        raise ValueError(f"grouped_gemm: w must have unit inner stride (got {w.stride()}); "
                         f"pass the stored layout with trans_w instead of a transposed view")
    _check_out(out, (M, N), x, "grouped_gemm", contiguous=True)
    op = "dgrad" if trans_w else "fwd"
    cfg = as_config(config)
    if cfg is not None or not (M and N and K):
        # An explicit config runs the Triton kernel; with nothing to compute there is nothing to choose.
        cfg = validate_config(cfg or pick_config(op, N, K, x.device))
        return _triton_mm_plan(x, w, group_sizes, trans_w, cfg, out, M, N, K, G, device_descriptors)
    call = _call(op, x, w, group_sizes, out, device_descriptors, gluon_device_descriptors)
    return _chosen(call, tune, capture)


def _chosen(call: mselect.Call, tune: bool, capture: bool) -> _Plan:
    """The plan of the candidate the selection layer names for ``call`` (a tuning table's
    entry, a tuning run on this call when asked, else the cold rule: the Gluon kernel where it
    takes the call, else the Triton kernel's config table), with that choice kept."""
    choice = mselect.choose(call, tune=tune, capturing=capture, prepare=_prepare)
    return dataclasses.replace(_variant_plan(call, choice.candidate), choice=choice)


def _call(op: str, a, b, group_sizes, out, device_descriptors: bool = False,
          gluon_device_descriptors: bool = False) -> mselect.Call:
    """The selection layer's view of validated operands: fwd/dgrad a = x (or dy), b = w;
    wgrad a = x, b = dy. N and K are the layer's (its weight is [G, K, N])."""
    M = a.shape[0]
    if op == "wgrad":
        G, K, N = group_sizes.shape[0], a.shape[1], b.shape[1]
        es = a.element_size()
        fresh_ok = (N * es) % 16 == 0
        tma = fresh_ok if out is None else _strides_ok(out.stride(), es) and out.data_ptr() % 16 == 0
        tma = tma and all(t.data_ptr() % 16 == 0 and _strides_ok(t.stride(), es) for t in (a, b))
        ws_ok = False
    else:
        G, K, N = b.shape[0], b.shape[1], b.shape[2]
        width = K if op == "dgrad" else N
        fresh_ok = (width * a.element_size()) % 16 == 0
        tma = all(_ws_tma_ok(t) for t in (a, b) + ((out,) if out is not None else ())) and (out is not None or fresh_ok)
        ws_ok = a.device.type == "cuda" and can_run(a, b, group_sizes, out, op == "dgrad")
    on_gpu = a.device.type == "cuda"
    sm90 = on_gpu and _capability(a.device.index if a.device.index is not None else torch.cuda.current_device())[0] == 9
    return mselect.Call(op, a, b, group_sizes, out, M, N, K, G, on_gpu, tma, ws_ok, device_descriptors,
                        gluon_device_descriptors, sm90=sm90)


def _variant_plan(call: mselect.Call, cand) -> _Plan:
    """The plan of one candidate (variant, config) for a call (ValueError if it cannot run it)."""
    a, b, s, out = call.a, call.b, call.sizes, call.out
    if cand.variant == "library":
        mselect.check_library(call)
        return _Plan("library", call.out_shape, "library " + cand.config.label(), args=(call.op,))
    if cand.variant == "gluon":
        if not call.ws_ok:
            raise ValueError(f"grouped_gemm: the Gluon kernel does not take this call (sm_90, bf16/fp16, TMA-aligned "
                             f"operands, at most {mselect.WS_MAX_GROUPS} groups)")
        cfg = validate_ws(cand.config)
        return _ws_plan(a, b, s, out, cfg, call.op == "dgrad", call.M, call.out_width, call.reduction, call.G,
                        "gluon " + cfg.label(), call.gluon_device_descriptors)
    if cand.variant != "triton":
        raise ValueError(f"grouped_gemm: unknown variant {cand.variant!r} (gluon, triton or library)")
    cfg = validate_config(cand.config)
    if call.op == "wgrad":
        return _triton_wgrad_plan(a, b, s, cfg, out, call.M, call.K, call.N, call.G, call.device_descriptors)
    return _triton_mm_plan(a, b, s, call.op == "dgrad", cfg, out, call.M, call.out_width, call.reduction, call.G,
                           call.device_descriptors)


def _prepare(call: mselect.Call, cand):
    """For tuning: ``run(out)`` runs one candidate's plan on the call's operands (``out`` None:
    a new output, as the call itself would)."""
    p = _variant_plan(call, cand)
    return lambda out=None: _launch(p, call.a, call.b, call.sizes, out)


mselect.use_launcher(_call, _prepare)   # what ``workbench tune grouped`` builds and runs calls with


def _triton_mm_plan(x, w, group_sizes, trans_w: bool, cfg: GroupedConfig, out, M: int, N: int, K: int, G: int,
                    device_descriptors: bool) -> _Plan:
    """The Triton kernel's fwd/dgrad plan: N the output width, K the reduction."""
    if M == 0 or N == 0:
        return _Plan("empty", (M, N), cfg.label())
    if K == 0:
        return _Plan("zero", (M, N), cfg.label())
    out_stride = out.stride(0) if out is not None else N
    use_tma = cfg.USE_TMA is not False and _triton_tma_ok(
        x.device, (x, w) + ((out,) if out is not None else ()), None if out is not None else (N, 1),
        forced=bool(cfg.USE_TMA))
    BM, BN, BK = cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K
    tail = tail_width(N, BN) if cfg.NARROW_TAIL else 0
    descs = (None,) * 5
    dev = use_tma and device_descriptors and _device_desc_ok((x, w) + ((out,) if out is not None else ()), (M, N))
    if use_tma and not dev:
        x_d = (0, list(x.shape), list(x.stride()), [BM, BK])
        w_d = (1, list(w.shape), list(w.stride()), [1, BN, BK] if trans_w else [1, BK, BN])
        window = kernels.row_window(M, N, out_stride)
        out_d = (2, *window, [1, 1, BM, BN // 2 if cfg.EPI_SUBTILE else BN])
        w_tail = (1, list(w.shape), list(w.stride()), [1, tail, BK] if trans_w else [1, BK, tail]) if tail else None
        out_tail = (2, *window, [1, 1, BM, tail]) if tail else None
        descs = (x_d, w_d, out_d, w_tail, out_tail)
    # Logical [G, K, N] strides of w for the pointer path.
    s_g, s_a, s_b = w.stride()
    stride_wk, stride_wn = (s_b, s_a) if trans_w else (s_a, s_b)
    max_tiles = (triton.cdiv(M, BM) + G) * triton.cdiv(N, BN)     # an upper bound, known on the host
    programs = max(1, min(_num_sms(x.device) * cfg.CTAS_PER_SM, max_tiles))
    meta = dict(TRANS_W=bool(trans_w), USE_TMA=use_tma, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, TAIL_N=tail,
                GROUP_M=cfg.GROUP_M, G_PAD=g_pad_triton(G), NUM_PROGRAMS=programs,
                EPI_SUBTILE=cfg.EPI_SUBTILE and use_tma, FLATTEN=cfg.FLATTEN, EVEN_K=(K % BK == 0),
                DOT_PRECISION=dot_precision(x.dtype), DEVICE_DESC=dev, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    args = (M, N, K, G, x.stride(0), s_g, stride_wk, stride_wn, out_stride)
    return _Plan("launch", (M, N), cfg.label(), kernels._grouped_mm_kernel, False, (programs,), descs, args, meta,
                 use_tma and x.device.type == "cuda", group_sizes.stride(0) == 1, device_desc=dev)


def _plan_wgrad(x, dy, group_sizes, config, out, device_descriptors: bool = False, capture: bool = False,
                tune: bool = False) -> _Plan:
    _check_common("x", x, "dy", dy, group_sizes, 2)
    if dy.stride(-1) != 1 or (dy.shape[0] > 1 and dy.stride(0) < dy.shape[1]):
        raise ValueError(f"grouped_gemm_wgrad: dy must be row-major (got strides {dy.stride()}); "
                         f"call .contiguous()")
    M, K = x.shape
    if dy.shape[0] != M:
        raise ValueError(f"grouped_gemm_wgrad: x has {M} rows but dy has {dy.shape[0]}")
    N = dy.shape[1]
    G = group_sizes.shape[0]
    _check_g(G, group_sizes, "group_sizes")
    _check_out(out, (G, K, N), x, "grouped_gemm_wgrad", contiguous=True)
    cfg = as_config(config)
    if cfg is not None or not (M and N and K):
        cfg = validate_config(cfg or pick_config("wgrad", N, K, x.device))
        return _triton_wgrad_plan(x, dy, group_sizes, cfg, out, M, K, N, G, device_descriptors)
    return _chosen(_call("wgrad", x, dy, group_sizes, out, device_descriptors), tune, capture)


def _triton_wgrad_plan(x, dy, group_sizes, cfg: GroupedConfig, out, M: int, K: int, N: int, G: int,
                       device_descriptors: bool) -> _Plan:
    if K == 0 or N == 0:
        return _Plan("empty", (G, K, N), cfg.label())
    if M == 0:
        return _Plan("zero", (G, K, N), cfg.label())
    dw_strides = tuple(out.stride()) if out is not None else (K * N, N, 1)
    use_tma = cfg.USE_TMA is not False and _triton_tma_ok(
        x.device, (x, dy) + ((out,) if out is not None else ()), None if out is not None else dw_strides,
        forced=bool(cfg.USE_TMA))
    BM, BN, BK = cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K
    descs = (None,) * 3
    dev = use_tma and device_descriptors and _device_desc_ok((x, dy) + ((out,) if out is not None else ()),
                                                             (G, K, N))
    if use_tma and not dev:
        descs = ((0, *kernels.row_window(M, K, x.stride(0)), [1, 1, BK, BM]),
                 (1, *kernels.row_window(M, N, dy.stride(0)), [1, 1, BK, BN]),
                 (2, [G, K, N], list(dw_strides), [1, BM, BN // 2 if cfg.EPI_SUBTILE else BN]))
    total = G * triton.cdiv(K, BM) * triton.cdiv(N, BN)
    programs = max(1, min(_num_sms(x.device) * cfg.CTAS_PER_SM, total))
    meta = dict(USE_TMA=use_tma, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.GROUP_M, G_PAD=g_pad_triton(G),
                NUM_PROGRAMS=programs, EPI_SUBTILE=cfg.EPI_SUBTILE and use_tma, FLATTEN=cfg.FLATTEN,
                DOT_PRECISION=dot_precision(x.dtype), DEVICE_DESC=dev, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    args = (M, K, N, G, x.stride(0), dy.stride(0), dw_strides[0], dw_strides[1])
    return _Plan("launch", (G, K, N), cfg.label(), kernels._grouped_mm_wgrad_kernel, False, (programs,), descs,
                 args, meta, use_tma and x.device.type == "cuda", group_sizes.stride(0) == 1,
                 device_desc=dev)


def _plan_ws(x, w, group_sizes, trans_w: bool, config, out, gluon_device_descriptors: bool = False) -> _Plan:
    cfg = validate_ws(config)
    M, N, K, G = _check_ws_operands(x, w, group_sizes, trans_w)
    _check_out(out, (M, N), x, "grouped_gemm_ws", contiguous=False)
    if M == 0 or N == 0:
        return _Plan("empty", (M, N), cfg.label())
    if K == 0:
        return _Plan("zero", (M, N), cfg.label())
    if not all(_ws_tma_ok(t) for t in (x, w) + ((out,) if out is not None else ())):
        raise ValueError("grouped_gemm_ws: x, w and out need unit inner stride and 16-byte aligned base pointers "
                         f"and strides (TMA); {FALLBACK}, which takes any row-major strides")
    return _ws_plan(x, w, group_sizes, out, cfg, trans_w, M, N, K, G, cfg.label(), gluon_device_descriptors)


def plan_for(x, w, group_sizes, *, trans_w: bool = False, config=None, out=None, tune: bool | None = None) -> _Plan:
    """The plan ``grouped_gemm(x, w, group_sizes, trans_w=..., config=..., out=..., tune=...)``
    runs (made once per call signature, descriptor settings, whether a CUDA graph is being
    captured (its descriptors are then encoded on the host, once, into the graph) and whether
    tuning was asked). A plan keeps the choice it was made with: after editing a tuning table
    at run time, call ``clear_plans()``."""
    cap = isinstance(x, torch.Tensor) and capturing(x)
    dd, gdd = DEVICE_DESCRIPTORS and not cap, GLUON_DEVICE_DESCRIPTORS and not cap
    want_tune = config is None and common_select.tune_requested(tune)
    key = (_signature("grouped_gemm", "x", x), _signature("grouped_gemm", "w", w),
           _signature("grouped_gemm", "group_sizes", group_sizes), bool(trans_w), config_key(config),
           None if out is None else _signature("grouped_gemm", "out", out), dd, gdd, cap, want_tune)
    return _PLANS.get(key) or _PLANS.put(key, _plan_mm(x, w, group_sizes, bool(trans_w), config, out, dd, gdd,
                                                       cap, want_tune))


def plan_for_wgrad(x, dy, group_sizes, *, config=None, out=None, tune: bool | None = None) -> _Plan:
    """The plan ``grouped_gemm_wgrad(x, dy, group_sizes, config=..., out=..., tune=...)`` runs."""
    who = "grouped_gemm_wgrad"
    cap = isinstance(x, torch.Tensor) and capturing(x)
    dd = DEVICE_DESCRIPTORS and not cap
    want_tune = config is None and common_select.tune_requested(tune)
    key = (_signature(who, "x", x), _signature(who, "dy", dy), _signature(who, "group_sizes", group_sizes),
           config_key(config), None if out is None else _signature(who, "out", out), dd, cap, want_tune)
    return _WGRAD_PLANS.get(key) or _WGRAD_PLANS.put(key, _plan_wgrad(x, dy, group_sizes, config, out, dd, cap,
                                                                      want_tune))


def plan_for_ws(x, w, group_sizes, *, trans_w: bool = False, config=None, out=None) -> _Plan:
    """The plan ``grouped_gemm_ws(...)`` runs."""
    who = "grouped_gemm_ws"
    gdd = GLUON_DEVICE_DESCRIPTORS
    key = (_signature(who, "x", x), _signature(who, "w", w), _signature(who, "group_sizes", group_sizes),
           bool(trans_w), config_key(config), None if out is None else _signature(who, "out", out), gdd)
    return _WS_PLANS.get(key) or _WS_PLANS.put(key, _plan_ws(x, w, group_sizes, bool(trans_w), config, out, gdd))


def clear_plans() -> None:
    """Forget every plan (they are remade on the next calls)."""
    for cache in (_PLANS, _WGRAD_PLANS, _WS_PLANS):
        cache.clear()


def _launch(p: _Plan, a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor,
            out: torch.Tensor | None) -> torch.Tensor:
    """Run plan ``p`` on operands of its signature: out (or a new one) filled."""
    if p.kind == "library":
        res = _library(p.args[0], a, b, group_sizes)
        return res if out is None else out.copy_(res)
    if out is None:
        out = torch.empty(p.out_shape, device=a.device, dtype=a.dtype)
    if p.kind == "launch":
        # Sizes on the host cost nothing to look at (no device sync); a negative one would write out of
        # bounds. Checked on every call: a plan is keyed on the sizes' layout, not their values.
        if group_sizes.device.type == "cpu" and bool((group_sizes < 0).any()):
            raise ValueError(f"grouped_gemm: group_sizes must be >= 0, got {group_sizes.tolist()[:16]}")
        if not p.sizes_contiguous:
            group_sizes = group_sizes.contiguous()  # the kernels read sizes_ptr + g (a device copy, no sync)
        if p.tma:
            cuda_context.ensure_current(a.device)   # autograd's backward thread may have no current context
        if p.device_desc:   # the kernel encodes its descriptors (Triton: descs all None; Gluon: no descs)
            p.launcher(a, b, out, group_sizes, *p.descs, *p.args)
        elif p.gluon:
            p.launcher(*gluon.build(p.descs, (a, b, out)), group_sizes, *p.args)
        else:
            p.launcher(a, b, out, group_sizes, *kernels.build(p.descs, (a, b, out)), *p.args)
    elif p.kind == "zero":
        out.zero_()
    return out


def _library(op: str, a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` for one op (checked when the plan was made: ``select.check_library``);
    its int32 end offsets are computed on the device (no sync)."""
    offs = torch.cumsum(group_sizes, 0, dtype=torch.int32)
    if op == "fwd":
        return torch._grouped_mm(a, b, offs=offs)
    if op == "dgrad":
        return torch._grouped_mm(a, b.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(a.t(), b, offs=offs)   # wgrad: [K, M] x [M, N] -> [G, K, N]


# --------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------
def grouped_gemm(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *,
                 trans_w: bool = False, config: GroupedConfig | Mapping[str, Any] | None = None,
                 out: torch.Tensor | None = None, tune: bool | None = None) -> torch.Tensor:
    """Grouped x @ w[g] (or x @ w[g].T with ``trans_w``) over row groups of x.

    x: [M, K]; w: [G, K, N] ([G, N, K] with trans_w); group_sizes: int tensor
    [G] on x's device, summing to M (not checked: that would need a host sync;
    rows past the sum are left unwritten, groups are clipped at M).
    Returns out [M, N] in x's dtype (fp32 accumulation). A ``config``
    (``GroupedConfig`` or a dict of its fields) runs the Triton kernel with it.
    Without one the selection layer (``kernels.moe.select``) names the kernel: a
    tuning table's entry for this GPU and problem (which may name the Gluon kernel,
    a Triton config or ``torch._grouped_mm``), else the cold rule: operands the
    warp-specialised Gluon kernel takes (sm_90, bf16/fp16, K and N multiples of 8)
    go to it (``kernels.moe.gluon``), any other case to the Triton kernel.
    ``tune=True`` (or ``WORKBENCH_TUNE=1``): a problem no table has is tuned on this
    call's own tensors (bounded by ``WORKBENCH_TUNE_BUDGET_S``, 2 s by default; never
    while a CUDA graph is captured; reads the group sizes once, on that first call)
    and the winner saved to the user's table (``$WORKBENCH_TUNING_DIR``).
    Everything but the launch is decided once per call signature (``plan_for``).
    """
    p = plan_for(x, w, group_sizes, trans_w=trans_w, config=config, out=out, tune=tune)
    return _launch(p, x, w, group_sizes, out)


def default_label(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *, trans_w: bool = False) -> str:
    """Which kernel and config ``grouped_gemm`` runs for these operands without a config."""
    return plan_for(x, w, group_sizes, trans_w=trans_w).label


def grouped_gemm_wgrad(x: torch.Tensor, dy: torch.Tensor, group_sizes: torch.Tensor, *,
                       config: GroupedConfig | Mapping[str, Any] | None = None,
                       out: torch.Tensor | None = None, tune: bool | None = None) -> torch.Tensor:
    """dw[g] = x[rows of g].T @ dy[rows of g] -> [G, K, N]; an empty group gives zeros.

    x: [M, K], dy: [M, N], group_sizes: int tensor [G] on their device. Planned
    once per call signature, like ``grouped_gemm``; without a ``config`` the
    selection layer chooses (a table, ``tune``, else the Triton config table).
    """
    p = plan_for_wgrad(x, dy, group_sizes, config=config, out=out, tune=tune)
    return _launch(p, x, dy, group_sizes, out)


def grid_size(M: int, N: int, G: int, config: GroupedWsConfig, num_sms: int) -> int:
    """CTAs the Gluon kernel launches: one per SM (or ``config.num_sms``), never more
    than the tiles could be (an upper bound known on the host: cdiv(M, BM) + G row blocks)."""
    max_tiles = (-(-M // config.block_m) + G) * -(-N // config.block_n)
    return max(1, min(config.num_sms or num_sms, max_tiles))


def grouped_gemm_ws(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *, trans_w: bool = False,
                    config: GroupedWsConfig | Mapping[str, Any] | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """Grouped ``x @ w[g]`` (or ``x @ w[g].T`` with ``trans_w``) over row groups of x,
    with the warp-specialised Gluon kernel alone (sm_90 only).

    x: [M, K]; w: [G, K, N] ([G, N, K] with trans_w), both bf16 or both fp16,
    K and N multiples of 8; group_sizes: int32/int64 [G] on x's device, summing
    to M (not checked: that would need a host sync; rows past the sum are left
    unwritten, groups are clipped at M). Returns out [M, N] (fp32 accumulation).
    Raises ValueError, naming ``kernels.moe.grouped_gemm`` as the fallback, for
    anything this kernel cannot take. Planned once per call signature.
    """
    return _launch(plan_for_ws(x, w, group_sizes, trans_w=trans_w, config=config, out=out), x, w, group_sizes, out)


# --------------------------------------------------------------------------
# Autograd
# --------------------------------------------------------------------------
class GroupedGemmFunction(torch.autograd.Function):
    """out = grouped_gemm(x, w, group_sizes, trans_w); dx through dgrad, dw through wgrad
    (each call planned once per signature, like the launchers')."""

    @staticmethod
    def forward(ctx, x, w, group_sizes, trans_w=False):
        ctx.save_for_backward(x, w, group_sizes)
        ctx.trans_w = trans_w
        return grouped_gemm(x, w, group_sizes, trans_w=trans_w)

    @staticmethod
    def backward(ctx, dy):
        x, w, group_sizes = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            # d/dx of x @ W_g is dy @ W_g.T: flip the weight's orientation.
            dx = grouped_gemm(dy, w, group_sizes, trans_w=not ctx.trans_w)
        if ctx.needs_input_grad[1]:
            if ctx.trans_w:   # w[g] is [N, K]: dw[g] = dy_g.T @ x_g
                dw = grouped_gemm_wgrad(dy, x, group_sizes)
            else:             # w[g] is [K, N]: dw[g] = x_g.T @ dy_g
                dw = grouped_gemm_wgrad(x, dy, group_sizes)
        return dx, dw, None, None


def grouped_linear(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *,
                   trans_w: bool = False) -> torch.Tensor:
    """Differentiable grouped GEMM: rows of group g of x times w[g] ([G, K, N])."""
    return GroupedGemmFunction.apply(x, w, group_sizes, trans_w)


# --------------------------------------------------------------------------
# Cross-compilation (no GPU needed): read the assembly the compiler produces
# --------------------------------------------------------------------------
def compile_for_target(op: str = "fwd", *, dtype: torch.dtype = torch.bfloat16,
                       config: GroupedConfig | None = None, arch: int = 90, G: int = 32, N: int | None = None,
                       device_desc: bool = False):
    """Compile one Triton kernel variant for `sm_{arch}` without a GPU.

    op: 'fwd', 'dgrad' (the trans_w variant) or 'wgrad'. N (fwd/dgrad: the output
    width), when given, decides the narrow tail strip (`tail_width`). Returns Triton's
    CompiledKernel; its ``asm`` dict holds 'ttgir', 'ptx' (and 'cubin').
    Integer arguments are marked 16-divisible as they are at the seed's shapes.
    ``device_desc``: the variant that encodes its TMA descriptors in the kernel.
    """
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    cfg = as_config(config) or default_config(op)
    use_tma = cfg.USE_TMA is not False and arch >= 90
    t = triton_type(dtype)
    BM, BN, BK = cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K
    sub = cfg.EPI_SUBTILE and use_tma
    dd = bool(device_desc and use_tma)
    common = dict(USE_TMA=use_tma, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK, GROUP_M=cfg.GROUP_M,
                  G_PAD=g_pad_triton(G), EPI_SUBTILE=sub, FLATTEN=cfg.FLATTEN, DOT_PRECISION=dot_precision(dtype),
                  DEVICE_DESC=dd)
    if op in ("fwd", "dgrad"):
        fn = kernels._grouped_mm_kernel
        trans = op == "dgrad"
        sig = {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "out_ptr": f"*{t}", "sizes_ptr": "*i32",
               "M_total": "i32", "N": "i32", "K": "i32", "G": "i32",
               "stride_xm": "i32", "stride_wg": "i32", "stride_wk": "i32", "stride_wn": "i32",
               "stride_om": "i32", "NUM_PROGRAMS": "i32"}
        tail = tail_width(N, BN) if N and cfg.NARROW_TAIL else 0
        constexprs = dict(common, TRANS_W=trans, EVEN_K=True, TAIL_N=tail)
        if use_tma and not dd:
            sig["x_desc"] = f"tensordesc<{t}[{BM}, {BK}]>"
            sig["w_desc"] = f"tensordesc<{t}[1, {BN}, {BK}]>" if trans else f"tensordesc<{t}[1, {BK}, {BN}]>"
            sig["out_desc"] = f"tensordesc<{t}[1, 1, {BM}, {BN // 2 if sub else BN}]>"
        else:
            constexprs.update(x_desc=None, w_desc=None, out_desc=None)
        if use_tma and tail and not dd:
            sig["w_tail_desc"] = (f"tensordesc<{t}[1, {tail}, {BK}]>" if trans
                                  else f"tensordesc<{t}[1, {BK}, {tail}]>")
            sig["out_tail_desc"] = f"tensordesc<{t}[1, 1, {BM}, {tail}]>"
        else:
            constexprs.update(w_tail_desc=None, out_tail_desc=None)
        # trans: w is [G, N, K] so its K stride is 1
        if trans:
            constexprs["stride_wk"] = 1
            del sig["stride_wk"]
        else:
            constexprs["stride_wn"] = 1
            del sig["stride_wn"]
        divisible = ["x_ptr", "w_ptr", "out_ptr", "sizes_ptr", "N", "K", "stride_xm", "stride_wg",
                     "stride_om", "stride_wn" if trans else "stride_wk"]
    elif op == "wgrad":
        fn = kernels._grouped_mm_wgrad_kernel
        sig = {"x_ptr": f"*{t}", "dy_ptr": f"*{t}", "dw_ptr": f"*{t}", "sizes_ptr": "*i32",
               "M_total": "i32", "K": "i32", "N": "i32", "G": "i32",
               "stride_xm": "i32", "stride_dym": "i32", "stride_dwg": "i32", "stride_dwk": "i32",
               "NUM_PROGRAMS": "i32"}
        constexprs = dict(common)
        if use_tma and not dd:
            sig["x_desc"] = f"tensordesc<{t}[1, 1, {BK}, {BM}]>"
            sig["dy_desc"] = f"tensordesc<{t}[1, 1, {BK}, {BN}]>"
            sig["dw_desc"] = f"tensordesc<{t}[1, {BM}, {BN // 2 if sub else BN}]>"
        else:
            constexprs.update(x_desc=None, dy_desc=None, dw_desc=None)
        divisible = ["x_ptr", "dy_ptr", "dw_ptr", "sizes_ptr", "K", "N", "stride_xm", "stride_dym",
                     "stride_dwg", "stride_dwk"]
    else:
        raise ValueError(f"op must be fwd, dgrad or wgrad, got {op!r}")
    if not isinstance(fn, JITFunction):
        raise RuntimeError("compile_for_target: this process imported triton with TRITON_INTERPRET=1, "
                           "so the kernels are interpreted functions; cross-compile in a process without it")
    for name in constexprs:
        sig[name] = "constexpr"
    ordered = {name: sig[name] for name in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    src = ASTSource(fn=fn, signature=ordered, constexprs={(fn.arg_names.index(k),): v for k, v in constexprs.items()},
                    attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": cfg.num_warps, "num_stages": cfg.num_stages})


def compile_args_ws(config: GroupedWsConfig | Mapping[str, Any] | None = None, dtype: torch.dtype = torch.bfloat16,
                    trans_w: bool = False, G: int = 32, shape: Mapping[str, int] | tuple[int, int] | None = None,
                    sizes_dtype: torch.dtype = torch.int32, device_desc: bool = False) -> dict:
    """Keyword arguments for ``workbench.asm.compile.cross_compile`` that build the
    Gluon kernel ``grouped_gemm_ws`` launches for ``config`` (``fn`` included)::

        cross_compile(targets="sm90", cache_dir=d, **compile_args_ws(cfg, torch.float16, trans_w=True))

    G sets the in-register sizes vectors' length (``g_pad``); the descriptors carry
    the problem size at run time, so ``shape`` (N, K of the call: output width,
    reduction) only checks the alignment rule (and, with ``device_desc``, decides
    which sizes count as multiples of 16). ``device_desc``: the variant that encodes
    its descriptors in the kernel (``_grouped_gemm_ws_dev_kernel``; x, w and out
    row-major with 16-byte aligned bases and strides, out packed).
    """
    cfg = validate_ws(config)
    if dtype not in WS_DTYPES:
        raise ValueError(f"grouped_gemm_ws: dtype {dtype} is not supported; use torch.bfloat16 or torch.float16 "
                         f"({FALLBACK} for others)")
    N, K = 5760, 2880
    if shape is not None:
        N, K = (shape["N"], shape["K"]) if isinstance(shape, Mapping) else shape
        check_alignment(N, K, dtype)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    constexprs = {"NUM_STAGES": cfg.num_stages, "COOPERATIVE": cfg.cooperative, "TRANS_W": bool(trans_w),
                  "G_PAD": g_pad(G), "CONSUMER_REGS": cfg.consumer_regs, "PRODUCER_REGS": cfg.producer_regs}
    out = {"num_warps": num_warps(cfg), "options": {"maxnreg": MAXNREG}}
    if device_desc:
        t = triton_type(dtype)
        sig = {"x_ptr": f"*{t}", "w_ptr": f"*{t}", "out_ptr": f"*{t}", "sizes_ptr": "*" + triton_type(sizes_dtype),
               "M_total": "i32", "N": "i32", "K": "i32", "G": "i32", "stride_xm": "i32", "stride_wg": "i32",
               "stride_w1": "i32", "stride_om": "i32", "group_m": "i32"}
        # w packed: [G, K, N] (stride_w1 = N) or, trans_w, [G, N, K] (stride_w1 = K)
        strides = (("N", N), ("K", K), ("stride_xm", K), ("stride_wg", K * N), ("stride_w1", K if trans_w else N),
                   ("stride_om", N))
        divisible = ["x_ptr", "w_ptr", "out_ptr", "sizes_ptr"] + [name for name, v in strides if v % 16 == 0]
        return {**out, "fn": gluon._grouped_gemm_ws_dev_kernel, "signature": sig, "divisible": divisible,
                "constexprs": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **constexprs}}
    sig = {"x_desc": gluon._desc_type(dtype, [bm, bk]),
           "w_desc": gluon._desc_type(dtype, [1, bn, bk] if trans_w else [1, bk, bn]),
           "out_desc": gluon._desc_type(dtype, [1, 1, bm, bn]),
           "sizes_ptr": "*" + triton_type(sizes_dtype), "M_total": "i32", "G": "i32", "group_m": "i32"}
    return {**out, "fn": gluon._grouped_gemm_ws_kernel, "signature": sig, "constexprs": constexprs,
            "divisible": ["sizes_ptr"]}
