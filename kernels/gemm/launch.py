"""The public launchers of the GEMM family: ``matmul`` (and ``matmul_ws`` for the
Gluon kernel alone).

A call is validated, then planned once per call signature: shapes, strides,
dtype, device, 16-byte alignment of each pointer and the explicit config
decide the plan. With no config, the selection layer (``kernels.gemm.select``)
names the candidate, a (variant, config) pair: a tuning table's entry for this
device, a tuning run on this call when asked (``tune=True`` or ``WORKBENCH_TUNE=1``),
else the cold rule (``kernels.gemm.cold``). The variant's own plan builder
(``kernels.gemm.variants``) then fixes the kernel, its grid and constants and the
workspace. Plans live in a bounded LRU (``PLAN_CACHE_SIZE``); a repeated call
is a dictionary lookup, the output's allocation and a launch (a signature planned to the
library: a shorter key's lookup and ``torch.mm``, see ``_LIBRARY_CALLS``). Nothing
synchronizes the host (a first call that tunes does, once).

The TMA descriptors of the Triton kernels are encoded either on the host (a
``TensorDescriptor`` per operand and call, which Triton 3.6's launcher turns
into a ``CUtensorMap`` each time: about 2 + 2 us of host time per descriptor)
or, with ``DEVICE_DESCRIPTORS``, by the kernel itself (``tl.make_tensor_descriptor``
into a global scratch buffer that ``kernels.common.launcher`` keeps per stream),
so the launch passes pointers and integers only. Device descriptors cost the
kernel a few microseconds, and save the host 10-30 us, so a plan takes them in eager
calls at every size (``DEVICE_DESC_MAX_US`` may bound them) and only where they are legal
(``device_desc_ok``); under CUDA-graph capture host descriptors are encoded
once, into the graph (``_descriptors_on_device``). The outcome is part of the
plan key, so flipping the setting at run time makes new plans.

The Gluon kernel (``kernels.gemm.gluon``) has the same two variants, under a
switch of its own, ``GLUON_DEVICE_DESCRIPTORS``: host descriptors (Gluon's
``TensorDescriptor`` with its shared-memory layout, three per call), or
``_gemm_ws_dev_kernel``, whose partitions encode the descriptors they use
(``tma.make_tensor_descriptor``; the launcher supplies the scratch as for the
Triton kernels). Same legality rule (``device_desc_ok`` for A, B and C), plus
the config's shared memory with the descriptors' staging on top
(``ws_device_desc_fits``); also part of the plan key.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from kernels.common import interpreter
from kernels.common import select as common_select
from kernels.common.configs import config_of
from kernels.common.plans import PLAN_CACHE_SIZE, PlanCache, capturing, config_key, tensor_signature  # noqa: F401
from kernels.common.plans import capability as _capability, sm_count as _sm_count
from kernels.gemm import select as gselect
from kernels.gemm import variants

from kernels.gemm.config import DEVICE_DESC_MAX_US, DTYPES, WS_DTYPES, GemmConfig, WsConfig, bound_us, validate_ws
from kernels.gemm.metrics import _mnk
from kernels.gemm.plan import Call, GemmPlan, TensorDescriptor, kmajor_ok, tma_ok
from kernels.gemm.plan import aligned_cols as _aligned_cols, device_desc_ok, padded as _padded  # noqa: F401
from kernels.gemm.plan import workspace  # noqa: F401  (the multi-GPU families share it)
from kernels.gemm.variants import gluon as gv
from kernels.gemm.variants.gluon import check_alignment, grid_size  # noqa: F401
from kernels.gemm.variants.gluon import ws_device_desc_ok as _ws_device_desc_ok  # noqa: F401

_tma_ok, _kmajor_ok, _GemmPlan = tma_ok, kmajor_ok, GemmPlan   # the names other families and tests use
_FALLBACK = "use kernels.gemm.matmul instead"
# Where the Triton TMA kernels' descriptors are encoded, where both sides may: True, in the
# kernel (device descriptors: no per-call host encoding); False, on the host (TensorDescriptor).
# Measured on an H200 (results/launch_cost/descriptors/): 10-30 us less host time per call and
# the same or less GPU time (graph ratio device/host 0.99-1.23 over 20 cases), so True.
DEVICE_DESCRIPTORS = True
# The same choice for the Gluon kernel (kernels.gemm.gluon): True, _gemm_ws_dev_kernel (its
# partitions encode their descriptors); False, host descriptors (three Gluon TensorDescriptors
# per call). Measured on an H200 (results/launch_cost/descriptors/descriptors_gluon_log.txt): host
# time per call 15-18 us instead of 27-36, GPU time the same (graph ratio 1.000-1.016), so True.
GLUON_DEVICE_DESCRIPTORS = True


# --------------------------------------------------------------------------
# Checks (once per plan)
# --------------------------------------------------------------------------
def _check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ValueError("gemm: a and b must be torch tensors")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"gemm: a and b must be 2-D, got a{tuple(a.shape)} and b{tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} "
                         f"(need a (M, K) and b (K, N))")
    if a.dtype != b.dtype:
        raise ValueError(f"gemm: a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if a.dtype not in DTYPES:
        raise ValueError(f"gemm: dtype {a.dtype} is not supported; use one of "
                         f"{', '.join(str(d) for d in DTYPES)}")
    if a.device != b.device:
        raise ValueError(f"gemm: a is on {a.device} and b on {b.device}; put both on one device")
    if a.device.type == "cuda":
        return
    if a.device.type == "cpu" and interpreter.active():
        return
    raise ValueError(f"gemm: tensors on {a.device} need a CUDA GPU, or TRITON_INTERPRET=1 set before "
                     f"triton is imported to run them in Triton's interpreter")


def prepare_output(out: torch.Tensor | None, M: int, N: int, K: int, like: torch.Tensor, who: str = "gemm"):
    """(C, done) for a product with an (M, N) result and reduction length K, in
    ``like``'s dtype and device: ``out`` checked, or a new tensor; ``done`` when
    nothing is left to compute (C is empty, or K == 0 and C zeroed)."""
    if out is None:
        out = torch.empty((M, N), dtype=like.dtype, device=like.device)
    elif not isinstance(out, torch.Tensor):
        raise ValueError(f"{who}: out must be a torch tensor ({M}, {N}) {like.dtype} on {like.device}, "
                         f"got {type(out).__name__}")
    elif out.shape != (M, N) or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"{who}: out must be ({M}, {N}) {like.dtype} on {like.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if M == 0 or N == 0:
        return out, True
    if K == 0:
        return out.zero_(), True
    return out, False


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


# --------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------
_PLANS = PlanCache()


def _as_config(config):
    """A variant's own config as it is; a GemmConfig, or a dict of its fields, as a GemmConfig."""
    if any(type(config) is m.Config for m in variants.VARIANTS.values()):
        return config
    return config_of(config, GemmConfig, "gemm")


def _call(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, M: int, N: int, K: int,
          device_descriptors: bool, gluon_device_descriptors: bool) -> Call:
    on_gpu = a.device.type == "cuda"
    dev_index = _device_index(a) if on_gpu else 0
    major = _capability(dev_index)[0] if on_gpu else 0
    # A fresh C is contiguous: its rows are aligned when N's are; a given one is judged by itself.
    b_km = not tma_ok(b) and kmajor_ok(b)
    return Call(a, b, out, M, N, K, on_gpu, hopper=on_gpu and major >= 9, sm90=on_gpu and major == 9,
                sms=_sm_count(dev_index) if on_gpu else 4, a_ok=tma_ok(a), b_ok=tma_ok(b) or b_km, b_km=b_km,
                c_ok=tma_ok(out) if out is not None else (N * a.element_size()) % 16 == 0,
                device_descriptors=device_descriptors, gluon_device_descriptors=gluon_device_descriptors)


def _plan(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, config,
          device_descriptors: bool = False, gluon_device_descriptors: bool = False,
          capture: bool = False, tune: bool = False) -> GemmPlan:
    _check_operands(a, b)
    M, K = a.shape
    N = b.shape[1]
    device_descriptors, gluon_device_descriptors = _descriptors_on_device(
        M, N, K, a.element_size(), capture, device_descriptors, gluon_device_descriptors)
    if out is not None:
        prepare_output(out, M, N, K, a)   # raises on a wrong out; nothing written
    if M == 0 or N == 0:
        return GemmPlan("empty", M, N, K)
    if K == 0:
        return GemmPlan("zero", M, N, K)
    call = _call(a, b, out, M, N, K, device_descriptors, gluon_device_descriptors)
    cfg = _as_config(config)
    if cfg is not None:
        mod, vcfg = variants.of(cfg)
        return mod.plan(call, vcfg, explicit=True)
    choice = gselect.choose(call, tune=tune, capturing=capture)
    cand = choice.candidate
    p = variants.VARIANTS[cand.variant].plan(call, cand.config, explicit=False)
    return GemmPlan(**{**p.__dict__, "choice": choice})


def plan_for(a: torch.Tensor, b: torch.Tensor, config=None, out: torch.Tensor | None = None,
             tune: bool | None = None) -> GemmPlan:
    """The plan ``matmul(a, b, config, out, tune=tune)`` runs (made once per call signature,
    ``DEVICE_DESCRIPTORS`` / ``GLUON_DEVICE_DESCRIPTORS`` / ``DEVICE_DESC_MAX_US`` setting,
    whether a CUDA graph is being captured (see ``_descriptors_on_device``) and ``tune``
    (``WORKBENCH_TUNE`` is read when a signature is first planned); a plan keeps the choice it
    was made with: after editing a tuning table at run time, call ``clear_plans()``)."""
    dd, gdd = DEVICE_DESCRIPTORS, GLUON_DEVICE_DESCRIPTORS
    try:
        cap = capturing(a)
        # ``tune`` as given: WORKBENCH_TUNE is read when a signature is first planned (reading the
        # environment on every call was a tenth of the library path's host time)
        key = (tensor_signature(a), tensor_signature(b), None if out is None else tensor_signature(out),
               config_key(config), dd, gdd, cap, DEVICE_DESC_MAX_US, tune)
    except AttributeError:   # not tensors: planning says what is wrong (and raises)
        return _plan(a, b, out, config, dd, gdd)
    plan = _PLANS.get(key)
    if plan is None:
        want_tune = config is None and common_select.tune_requested(tune)
        plan = _PLANS.put(key, _plan(a, b, out, config, dd, gdd, cap, want_tune))
    return plan


def clear_plans() -> None:
    """Forget every plan (they are made again, with the tables as they are now)."""
    _PLANS.clear()
    _WS_PLANS.clear()
    _LIBRARY_CALLS.clear()


# The call signatures whose plan is the library's (no config or the library's, no out): ``matmul``
# sends them to ``torch.mm`` on a shorter key than the plan's: shapes, strides, dtypes, ``tune``
# and whether a config was given. What the full key adds (the device, each base pointer's
# alignment, a CUDA-graph capture, the descriptor switches) can change which kernel of ours a plan
# takes, never whether torch.mm's answer is right (it checks devices itself): a call that matches
# runs cuBLAS, as its signature's plan chose. On a 2-core CPU the short key costs about 0.8 us
# where the plan's lookup cost 2.5-4 us.
_LIBRARY_CALLS: dict = {}
_LIBRARY_CONFIG = variants.library.Config


def _remember_library(key) -> None:
    if len(_LIBRARY_CALLS) >= PLAN_CACHE_SIZE:   # bounded like the plans: start again
        _LIBRARY_CALLS.clear()
    _LIBRARY_CALLS[key] = True


def _descriptors_on_device(M: int, N: int, K: int, elem_bytes: int, cap: bool, dd: bool,
                           gdd: bool) -> tuple[bool, bool]:
    """(Triton, Gluon) kernels encode their own TMA descriptors: where switched on
    (``dd``, ``gdd``), not under CUDA-graph capture (``cap``: host descriptors are
    then encoded once, at capture) and only for kernels shorter than
    ``DEVICE_DESC_MAX_US``, where the host's launch cost is what an eager call
    waits for."""
    if cap:
        return False, False
    short = bound_us(M, N, K, elem_bytes) < DEVICE_DESC_MAX_US
    return dd and short, gdd and short


# --------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------
def matmul(a: torch.Tensor, b: torch.Tensor, config: GemmConfig | Mapping[str, Any] | None = None,
           out: torch.Tensor | None = None, *, tune: bool | None = None) -> torch.Tensor:
    """``a @ b`` with this family's kernels.

    a: (M, K), b: (K, N), same dtype (bf16, fp16 or fp32) and device; any
    strides. ``config`` picks the kernel and its knobs: a ``GemmConfig`` (or a dict of
    its fields), or a variant's own config (``kernels.gemm.variants``); ``None`` asks the
    selection layer (a tuning table's entry for this GPU, else the cold rule).
    ``tune=True`` (or ``WORKBENCH_TUNE=1``): a problem no table has is tuned on its first
    call (bounded by ``WORKBENCH_TUNE_BUDGET_S``, 2 s by default; never while a CUDA graph
    is captured) and the winner saved to the user's table (``$WORKBENCH_TUNING_DIR``).
    ``out`` (M, N), if given, receives C. Everything but the launch is decided once per
    call signature (``plan_for``).
    """
    key = None
    if out is None and (config is None or type(config) is _LIBRARY_CONFIG):
        try:
            key = (a.shape, b.shape, a.stride(), b.stride(), a.dtype, b.dtype, tune, config is None)
        except AttributeError:   # not tensors: planning says what is wrong
            pass
        if key in _LIBRARY_CALLS:
            return torch.mm(a, b)
    p = plan_for(a, b, config, out, tune)
    if p.kind == "library":   # cuBLAS as torch.mm calls it (2-D: no torch.matmul dispatch); it allocates C
        if key is not None:
            _remember_library(key)
        return torch.mm(a, b) if out is None else torch.mm(a, b, out=out)
    if out is None:
        out = torch.empty((p.M, p.N), dtype=a.dtype, device=a.device)
    if p.kind == "zero":
        out.zero_()
    elif p.kind != "empty":
        variants.execute(p, a, b, out)
    return out


# --------------------------------------------------------------------------
# The Gluon kernel alone
# --------------------------------------------------------------------------
def _check_ws_operands(a, b) -> None:
    if interpreter.active():
        raise ValueError("gemm_ws: Gluon kernels do not run in Triton's interpreter (TRITON_INTERPRET=1 is set); "
                         f"{_FALLBACK}")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ValueError("gemm_ws: a and b must be torch tensors")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm_ws: need a (M, K) and b (K, N), got a{tuple(a.shape)} and b{tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in WS_DTYPES:
        raise ValueError(f"gemm_ws: a and b must both be bfloat16 or both float16, got {a.dtype} and {b.dtype}; "
                         f"{_FALLBACK}")
    if a.device != b.device:
        raise ValueError(f"gemm_ws: a is on {a.device} and b on {b.device}; put both on one device")
    if a.device.type != "cuda":
        raise ValueError(f"gemm_ws: tensors on {a.device}: this kernel needs an sm_90 (Hopper) CUDA GPU; "
                         f"{_FALLBACK}")
    cap = _capability(a.device.index if a.device.index is not None else torch.cuda.current_device())
    if cap[0] != 9:
        raise ValueError(f"gemm_ws: this kernel needs an sm_90 (Hopper) GPU, found sm_{cap[0]}{cap[1]} "
                         f"(wgmma and setmaxnreg as used here are Hopper's); {_FALLBACK}")


def _plan_ws(a, b, out, config, gluon_device_descriptors: bool = False) -> GemmPlan:
    cfg = validate_ws(config)
    _check_ws_operands(a, b)
    M, K = a.shape
    N = b.shape[1]
    gv.check_alignment(M, N, K, a.dtype)
    if out is not None:
        prepare_output(out, M, N, K, a, who="gemm_ws")
    if M == 0 or N == 0:
        return GemmPlan("empty", M, N, K)
    if K == 0:
        return GemmPlan("zero", M, N, K)
    if not all(tma_ok(t) for t in (a, b) + (() if out is None else (out,))):
        raise ValueError("gemm_ws: a, b and out need unit column stride, 16-byte aligned base pointers and "
                         f"row strides (TMA); {_FALLBACK}, which takes any strides")
    return gv.ws_plan(M, N, K, cfg, _sm_count(_device_index(a)), a.dtype,
                    gluon_device_descriptors and gv.ws_device_desc_ok(a, b, out, cfg),
                    (a.stride(0), b.stride(0), out.stride(0) if out is not None else N))


def plan_for_ws(a: torch.Tensor, b: torch.Tensor, config=None, out: torch.Tensor | None = None) -> GemmPlan:
    """The plan ``matmul_ws(a, b, config=config, out=out)`` runs (made once per call
    signature and ``GLUON_DEVICE_DESCRIPTORS`` setting)."""
    gdd = GLUON_DEVICE_DESCRIPTORS
    try:
        key = (tensor_signature(a), tensor_signature(b), None if out is None else tensor_signature(out),
               config_key(config), gdd)
    except AttributeError:   # not tensors: planning says what is wrong (and raises)
        _plan_ws(a, b, out, config)
        raise
    return _WS_PLANS.get(key) or _WS_PLANS.put(key, _plan_ws(a, b, out, config, gdd))


def matmul_ws(a: torch.Tensor, b: torch.Tensor, *, config: WsConfig | Mapping[str, Any] | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` with the warp-specialised Gluon kernel alone (sm_90 only).

    a: (M, K), b: (K, N), both bf16 or both fp16, with unit column stride and
    16-byte aligned rows (K, N multiples of 8). ``out`` (M, N), if given,
    receives C. Raises ValueError, naming ``kernels.gemm.matmul`` as the
    fallback, for anything this kernel cannot take. Planned once per call
    signature (and ``GLUON_DEVICE_DESCRIPTORS`` setting), like ``matmul``.
    """
    p = plan_for_ws(a, b, config, out)
    if out is None:
        out = torch.empty((p.M, p.N), dtype=a.dtype, device=a.device)
    if p.kind == "gluon":
        gv.launch(p, a, b, out)
    elif p.kind == "zero":
        out.zero_()
    return out


_WS_PLANS = PlanCache()


# --------------------------------------------------------------------------
# Cross-compilation (no GPU needed): arguments for workbench.asm.compile
# --------------------------------------------------------------------------
def compile_args_ws(config: WsConfig | Mapping[str, Any] | None = None, dtype: torch.dtype = torch.bfloat16,
                    shape: Mapping[str, int] | tuple[int, int, int] | None = None, device_desc: bool = False,
                    b_kmajor: bool = False) -> dict:
    """Keyword arguments for ``workbench.asm.compile.cross_compile`` that build
    the kernel ``matmul_ws`` launches for ``config`` (``fn`` included)::

        cross_compile(targets="sm90", cache_dir=d, **compile_args(cfg, torch.float16))

    The descriptors carry the problem size at run time, so ``shape`` (M, N, K)
    only checks the alignment rule (and, with ``device_desc``, decides which
    sizes count as multiples of 16). ``device_desc``: the variant that encodes
    its descriptors in the kernel (``_gemm_ws_dev_kernel``; row-major A, B and C,
    16-byte aligned bases and row strides). ``b_kmajor``: B read through a
    descriptor over B^T (a transposed view of B, as ``matmul`` runs one).
    """
    return gv.compile_args(config, dtype, shape, device_desc, b_kmajor)


def compile_args(config: GemmConfig | Mapping[str, Any] | None = None, dtype: torch.dtype = torch.bfloat16,
                 shape: Mapping[str, int] | None = None, device_desc: bool = False,
                 b_kmajor: bool | None = None) -> dict:
    """Keyword arguments for ``workbench.asm.compile.cross_compile`` that build
    the kernel ``matmul`` launches for ``config`` (``fn`` included)::

        cross_compile(targets="sm90", cache_dir=d, **compile_args(cfg))

    ``shape`` (M, N, K) only decides which sizes count as multiples of 16.
    ``device_desc``: the variant that encodes its descriptors in the kernel
    (row-major operands and C, as ``matmul`` allocates it).
    ``b_kmajor``: the variant reading B^T (N, K) (a transposed view of B, or the
    copy ``transpose_b`` makes); None: as ``matmul`` runs row-major operands
    (fp32 persistent configs copy B K-major unless ``transpose_b=False``).
    ``fma`` configs: the FMA kernel for these strides (``device_desc`` does not apply).
    With no config, the cold rule's choice for ``shape``.
    """
    from kernels.gemm.cold import heuristic

    mnk = _mnk(shape) if shape else (8192, 8192, 8192)
    cfg = _as_config(config) or heuristic(*mnk, dtype, b_kmajor=bool(b_kmajor))
    mod, vcfg = variants.of(cfg)
    if mod is gv:
        return gv.compile_args(vcfg, dtype, mnk if shape else None, device_desc)
    if mod is variants.fma:
        return variants.fma.compile_args(vcfg, dtype, mnk, bool(b_kmajor))
    if mod is variants.splitk:
        return variants.splitk.compile_args(vcfg, dtype, device_desc, bool(b_kmajor))
    if mod is variants.library:
        raise ValueError("gemm: the library variant (cuBLAS) has no Triton kernel to compile")
    return variants.persistent.compile_args(vcfg, dtype, mnk, device_desc, b_kmajor)
