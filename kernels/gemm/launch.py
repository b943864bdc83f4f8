"""The public launchers of the GEMM family: ``matmul`` (and ``matmul_ws`` for the
Gluon kernel alone).

A call is validated, then planned once per call signature: shapes, strides,
dtype, device, 16-byte alignment of each pointer and the explicit config
decide the config, the kernel, its grid and constants, and the stream-K
workspace. Plans live in a bounded LRU (``PLAN_CACHE_SIZE``); a repeated call
is a dictionary lookup, the output's allocation and a launch. Nothing
synchronizes the host.

The TMA descriptors of the Triton kernels are encoded either on the host (a
``TensorDescriptor`` per operand and call, which Triton 3.6's launcher turns
into a ``CUtensorMap`` each time: about 2 + 2 us of host time per descriptor)
or, with ``DEVICE_DESCRIPTORS``, by the kernel itself (``tl.make_tensor_descriptor``
into a global scratch buffer that ``kernels.common.launcher`` keeps per stream),
so the launch passes pointers and integers only. Device descriptors cost the
kernel a few microseconds, so a plan takes them only for short kernels in eager
calls, where the host is what a call waits for, and only where they are legal
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

import dataclasses
from typing import Any, Mapping

import torch
import triton

from kernels.common import cuda_context, interpreter
from kernels.common.launcher import PlannedLaunch
from kernels.common.plans import PLAN_CACHE_SIZE, PlanCache, capturing, config_key, tensor_signature  # noqa: F401
from kernels.common.plans import capability as _capability, sm_count as _sm_count
from kernels.gemm import gluon
from kernels.gemm.config import (
    DEVICE_DESC_MAX_US, DTYPES, MAXNREG, WS_DTYPES, GemmConfig, StreamKPlan, WsConfig, _as_config,
    _refuse_ws_on_gpu, bound_us, fma_split, heuristic, last_round, num_warps, split_pieces, stream_k_plan,
    tail_slices, tail_stages, validate_config, validate_ws, ws_device_desc_fits,
)
from kernels.gemm.metrics import _mnk
from kernels.gemm.triton import (
    _gemm_fma_kernel, _gemm_ptr_kernel, _gemm_splitk_kernel, _gemm_tma_dev_kernel, _gemm_tma_kernel,
)
from workbench.dtypes import triton_type

try:  # triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

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
_I32 = 2**31
_SK_WORKSPACE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_RETIRED: list = []  # outgrown workspaces: a captured CUDA graph may still use them


def workspace(device: torch.device, elems: int, counters: int):
    """fp32 partial slots and arrival counters (stream-K and split-K), zeroed once
    and reused: the kernels reset every counter they complete. One pair per device
    and stream, so calls on two streams never share counters; an outgrown pair is
    kept alive (a CUDA graph captured with it still points there). Call it ahead
    of a graph capture with the largest sizes, so the capture allocates nothing."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    ws, cnt = _SK_WORKSPACE.get(key, (None, None))
    if ws is None or ws.numel() < elems or cnt.numel() < counters:
        if ws is not None:
            _RETIRED.append((ws, cnt))
        ws = torch.empty(max(elems, ws.numel() if ws is not None else 0), dtype=torch.float32, device=device)
        cnt = torch.zeros(max(counters, cnt.numel() if cnt is not None else 0), dtype=torch.int32, device=device)
        _SK_WORKSPACE[key] = (ws, cnt)
    return ws, cnt


def _stream_k_workspace(device: torch.device, programs: int, tile_elems: int, sk_tiles: int):
    """fp32 partial slots (2 per program) and per-tile arrival counters."""
    return workspace(device, programs * 2 * tile_elems, sk_tiles)



# --------------------------------------------------------------------------
# Checks and device facts (once per plan)
# --------------------------------------------------------------------------
def _tma_ok(t: torch.Tensor) -> bool:
    es = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * es) % 16 == 0
            and t.shape[0] > 0 and t.shape[1] > 0)


def _kmajor_ok(b: torch.Tensor) -> bool:
    """B (K, N) stored K-major (a transposed view of a row-major (N, K) tensor,
    as ``x @ w.t()`` passes an nn.Linear weight) with B^T's rows TMA-addressable."""
    return b.stride(0) == 1 and b.stride(1) != 1 and _tma_ok(b.t())


def device_desc_ok(t: torch.Tensor | None, rows: int = 0, cols: int = 0, row_stride: int = 0,
                   elem_bytes: int = 2) -> bool:
    """Whether the kernel may encode a TMA descriptor of ``t`` itself: a 16-byte
    aligned base, unit inner stride, a positive row stride that is a multiple of
    16 bytes, sizes that fit the descriptor's 32-bit shape. ``t`` None: a
    contiguous tensor the call allocates, (rows, cols) with ``row_stride``."""
    if t is not None:
        if t.dim() != 2 or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        (rows, cols), row_stride, elem_bytes = t.shape, t.stride(0), t.element_size()
    return (0 < rows < _I32 and 0 < cols < _I32 and 0 < row_stride < _I32
            and (row_stride * elem_bytes) % 16 == 0)


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
@dataclasses.dataclass(frozen=True)
class _GemmPlan:
    """Everything ``matmul`` decides for one call signature."""

    kind: str  # "empty" (nothing to compute), "zero" (K == 0), "tma", "ptr", "splitk", "fma" or "gluon"
    M: int
    N: int
    K: int
    config: Any = None  # the GemmConfig (or, kind "gluon", the WsConfig) it runs
    launch: PlannedLaunch | None = None  # the kernel, grid, constexprs and options
    args: tuple = ()  # run-time scalars after the tensors
    sk_tiles: int = 0  # tiles with arrival counters (stream-K tail, split-K, fma); 0: none
    programs: int = 1
    blocks: tuple = ()  # the descriptors' boxes (A, B, C), or their layouts too (Gluon)
    pad_a: int = 0  # > 0: copy A into a buffer of this many columns first (TMA needs aligned rows)
    pad_b: int = 0  # the same for B
    b_kmajor: bool = False  # B's descriptor is over B^T (N, K): a K-major B (or the copy trans_b makes)
    trans_b: bool = False  # copy a row-major B K-major first (fp32: tf32 wgmma reads B only K-major)
    device_desc: bool = False  # kinds "tma"/"splitk"/"gluon": the kernel encodes its TMA descriptors itself


_PLANS = PlanCache()


def _plan(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, config,
          device_descriptors: bool = False, gluon_device_descriptors: bool = False,
          capture: bool = False) -> _GemmPlan:
    _check_operands(a, b)
    M, K = a.shape
    N = b.shape[1]
    device_descriptors, gluon_device_descriptors = _descriptors_on_device(
        M, N, K, a.element_size(), capture, device_descriptors, gluon_device_descriptors)
    if out is not None:
        prepare_output(out, M, N, K, a)   # raises on a wrong out; nothing written
    if M == 0 or N == 0:
        return _GemmPlan("empty", M, N, K)
    if K == 0:
        return _GemmPlan("zero", M, N, K)
    on_gpu = a.device.type == "cuda"
    dev_index = _device_index(a) if on_gpu else 0
    hopper = on_gpu and _capability(dev_index)[0] >= 9
    sm90 = on_gpu and _capability(dev_index)[0] == 9
    sms = _sm_count(dev_index) if on_gpu else 4
    # A fresh C is contiguous: its rows are aligned when N's are; a given one is judged by itself.
    b_km = not _tma_ok(b) and _kmajor_ok(b)
    a_ok, b_ok = _tma_ok(a), _tma_ok(b) or b_km
    c_ok = _tma_ok(out) if out is not None else (N * a.element_size()) % 16 == 0
    have_desc = TensorDescriptor is not None
    aligned = have_desc and a_ok and b_ok and c_ok
    cfg = _as_config(config)
    if cfg is None:
        cfg = heuristic(M, N, K, a.dtype, sms, hopper=hopper, gluon=aligned and sm90, tma=aligned, c_aligned=c_ok,
                        b_kmajor=b.stride(0) == 1 and b.stride(1) != 1)
    validate_config(cfg)
    if cfg.fma:
        if a.dtype != torch.float32:
            raise ValueError(f"gemm: fma=True is the fp32 kernel (FMA units, fp32 products); {a.dtype} runs on the "
                             f"tensor cores: leave fma=False")
        return _fma_plan(M, N, K, cfg, sms)
    if cfg.gluon:
        if not (sm90 and aligned and a.dtype in WS_DTYPES):
            raise ValueError(f"gemm: gluon={cfg.gluon!r} runs the Gluon kernel (kernels.gemm.gluon), which needs "
                             f"bf16/fp16 operands on an sm_90 GPU with 16-byte aligned rows (K, N multiples of 8); "
                             f"got {a.dtype} on {a.device}. Use gluon=None (the Triton kernel) here")
        wcfg = cfg.ws_config()
        return _ws_plan(M, N, K, wcfg, sms, a.dtype, gluon_device_descriptors and _ws_device_desc_ok(a, b, out, wcfg),
                        (a.stride(0), b.stride(1) if b_km else b.stride(0), out.stride(0) if out is not None else N),
                        b_kmajor=b_km)
    if cfg.warp_specialize and on_gpu:
        _refuse_ws_on_gpu()
    tma_wanted = hopper if cfg.tma is None else cfg.tma
    if cfg.tma and on_gpu and not hopper:
        raise ValueError("gemm: tma=True needs an sm_90+ GPU (Hopper)")
    # cfg.pad: operands TMA cannot address are copied into aligned buffers at each call.
    pads = {}
    if cfg.pad and tma_wanted and have_desc:
        pads = dict(pad_a=0 if a_ok else _aligned_cols(K, a), pad_b=0 if b_ok else _aligned_cols(N, b))
    es = a.element_size()
    # fp32 on the persistent TMA kernel: a row-major B is copied K-major once per call
    # (tf32 wgmma reads B only K-major; Triton would re-lay every B tile through
    # registers and serialise the pipeline: 0.16-0.35x cuBLAS on an H200).
    trans = (cfg.transpose_b if cfg.transpose_b is not None else a.dtype == torch.float32)
    trans_b = bool(trans and tma_wanted and have_desc and cfg.split_k is None and not b_km
                   and not pads.get("pad_b") and (K * es) % 16 == 0)
    b_km = b_km or trans_b
    ops_ok = have_desc and (a_ok or bool(pads.get("pad_a"))) and (b_ok or bool(pads.get("pad_b")))
    # Device descriptors: legal for A and B as given, or for the aligned copies that pads make.
    pad_a, pad_b = pads.get("pad_a", 0), pads.get("pad_b", 0)
    a_dev = device_desc_ok(None, M, K, pad_a, es) if pad_a else device_desc_ok(a)
    if trans_b or pad_b:
        b_dev = device_desc_ok(None, N, K, K, es) if trans_b else device_desc_ok(None, K, N, pad_b, es)
    else:
        b_dev = device_desc_ok(b.t() if b_km else b)
    dev_ops = device_descriptors and a_dev and b_dev
    if cfg.split_k is not None:  # C leaves through plain stores
        if cfg.tma and not ops_ok:
            raise ValueError("gemm: tma=True needs unit stride in the last dimension and 16-byte aligned "
                             "rows and base pointers (K and N multiples of 8 for 16-bit types), or pad=True")
        use = bool(tma_wanted and ops_ok)
        return _splitk_plan(M, N, K, cfg, use, pads, use and dev_ops, use and b_km)
    tma_ok = ops_ok and (c_ok or not cfg.tma_store)
    if cfg.tma and not tma_ok:
        raise ValueError("gemm: tma=True needs unit stride in the last dimension and 16-byte aligned "
                         "rows and base pointers (K and N multiples of 8 for 16-bit types)")
    use_tma = bool(tma_wanted and tma_ok)
    if not use_tma:
        pads, b_km, trans_b = {}, False, False

    if cfg.extra_n and not use_tma:
        raise ValueError("gemm: extra_n needs the TMA path (sm_90+ or the interpreter, 16-byte aligned rows); "
                         "use extra_n=0 for these operands")
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n + cfg.extra_n)
    if cfg.stream_k and not use_tma and config is None:  # the heuristic's choice, on unaligned operands
        cfg = dataclasses.replace(cfg, stream_k=False)
    if cfg.stream_k and not use_tma:
        raise ValueError("gemm: stream_k=True needs the TMA path (sm_90+, 16-byte aligned rows); "
                         "use stream_k=False for these operands")
    if cfg.tail_split != 1 and not use_tma:
        if config is not None:
            raise ValueError("gemm: tail_split needs the TMA path (sm_90+, 16-byte aligned rows); "
                             "use tail_split=1 for these operands")
        cfg = dataclasses.replace(cfg, tail_split=1)
    programs = max(1, cfg.num_sms or sms) if cfg.stream_k else max(1, min(cfg.num_sms or sms, tiles))
    slices = tail_slices(tiles, max(1, cfg.num_sms or sms), cfg.tail_split) if cfg.tail_split != 1 else 1
    if slices > 1:   # every SM: the slices of the last round outnumber its tiles
        programs = max(1, cfg.num_sms or sms)
    if not use_tma:
        launch = PlannedLaunch(_gemm_ptr_kernel, (programs,),
                               dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FLATTEN=cfg.flatten),
                               dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        return _GemmPlan("ptr", M, N, K, cfg, launch, (programs, cfg.group_m), programs=programs)
    sk = stream_k_plan(tiles, programs, triton.cdiv(K, cfg.block_k)) if cfg.stream_k else None
    if slices > 1:
        sk = StreamKPlan(tiles - last_round(tiles, programs), 0, 1, 0)
    elif sk is None or sk.sk_programs == 0:
        sk = StreamKPlan(tiles, 0, 1, 0)
        programs = min(programs, tiles)
    stride_cm = out.stride(0) if out is not None else N
    dev = dev_ops and (not cfg.tma_store or device_desc_ok(out, M, N, stride_cm, es))
    launch = PlannedLaunch(_gemm_tma_dev_kernel if dev else _gemm_tma_kernel, (programs,),
                           dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TMA_STORE=cfg.tma_store,
                                EPILOGUE_SPLIT=cfg.epilogue_split, FLATTEN=cfg.flatten,
                                WARP_SPECIALIZE=cfg.warp_specialize, STREAM_K=sk.sk_programs > 0, B_KMAJOR=b_km,
                                TAIL_SPLIT=slices, TAIL_STAGES=tail_stages(cfg, slices), EXTRA_N=cfg.extra_n),
                           dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    args = (M, N, K, programs, cfg.group_m, sk.dp_tiles, sk.sk_programs, sk.sk_iters_per, sk.sk_extra)
    if dev:   # the row strides of A, B (as launched: padded copies have pad_* columns) and C
        args = (pads.get("pad_a") or a.stride(0), _b_row_stride(b, K, pads, b_km, trans_b), stride_cm) + args
    b2_n = cfg.extra_n or cfg.block_n // slices   # the second B descriptor's box: extra columns or a slice
    blocks = ([cfg.block_m, cfg.block_k], [cfg.block_n, cfg.block_k] if b_km else [cfg.block_k, cfg.block_n],
              [cfg.block_m, cfg.block_n // cfg.epilogue_split] if cfg.tma_store else None,
              ([b2_n, cfg.block_k] if b_km else [cfg.block_k, b2_n]) if slices > 1 or cfg.extra_n else None)
    return _GemmPlan("tma", M, N, K, cfg, launch, args, tiles - sk.dp_tiles if sk.sk_programs else 0, programs,
                     blocks, **pads, b_kmajor=b_km, trans_b=trans_b, device_desc=dev)


def _b_row_stride(b: torch.Tensor, K: int, pads: dict, b_km: bool, trans_b: bool) -> int:
    """The row stride of the matrix B's descriptor is over: B^T's (K-major B, or the
    contiguous copy trans_b makes), the padded copy's, or B's own."""
    if trans_b:
        return K
    return b.stride(1) if b_km else (pads.get("pad_b") or b.stride(0))


def _aligned_cols(cols: int, t: torch.Tensor) -> int:
    """Columns of a buffer whose rows start 16-byte aligned and hold ``cols`` elements."""
    per16 = 16 // t.element_size()
    return -(-cols // per16) * per16


def _padded(t: torch.Tensor, cols: int) -> torch.Tensor:
    """``t`` copied into the first columns of a fresh (rows, cols) buffer: same
    shape, row stride ``cols`` (16-byte aligned), so TMA can address it."""
    view = torch.empty((t.shape[0], cols), dtype=t.dtype, device=t.device)[:, :t.shape[1]]
    return view.copy_(t)


def _splitk_plan(M: int, N: int, K: int, cfg: GemmConfig, tma_ok: bool, pads: dict,
                 device_desc: bool = False, b_kmajor: bool = False) -> _GemmPlan:
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    pieces, per = split_pieces(triton.cdiv(K, cfg.block_k), cfg.split_k)
    launch = PlannedLaunch(_gemm_splitk_kernel, (tiles, pieces),
                           dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                USE_TMA=bool(tma_ok), SWAP_AB=cfg.swap_ab, DEVICE_DESC=bool(device_desc),
                                B_KMAJOR=bool(b_kmajor), GROUP_M=cfg.group_m),
                           dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    b_block = [cfg.block_n, cfg.block_k] if b_kmajor else [cfg.block_k, cfg.block_n]
    blocks = ([cfg.block_m, cfg.block_k], b_block) if tma_ok and not device_desc else ()
    return _GemmPlan("splitk", M, N, K, cfg, launch, (pieces, per), tiles if pieces > 1 else 0, pieces, blocks,
                     **(pads if tma_ok else {}), b_kmajor=bool(b_kmajor), device_desc=bool(device_desc))


def _fma_plan(M: int, N: int, K: int, cfg: GemmConfig, sms: int) -> _GemmPlan:
    """``_gemm_fma_kernel``: grid (M blocks x N blocks, K pieces); split_k None takes
    ``fma_split``'s pieces for ``sms`` SMs. Pointer loads: any strides, nothing copied."""
    m_blocks, tiles_n = triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n)
    k_steps = triton.cdiv(K, cfg.block_k)
    split = cfg.split_k if cfg.split_k is not None else fma_split(m_blocks * tiles_n, k_steps,
                                                                  m_blocks * cfg.block_m, K, sms)
    pieces, per = split_pieces(k_steps, split)
    launch = PlannedLaunch(_gemm_fma_kernel, (m_blocks * tiles_n, pieces),
                           dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k),
                           dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return _GemmPlan("fma", M, N, K, cfg, launch, (pieces, per), m_blocks * tiles_n if pieces > 1 else 0, pieces)


def plan_for(a: torch.Tensor, b: torch.Tensor, config=None, out: torch.Tensor | None = None) -> _GemmPlan:
    """The plan ``matmul(a, b, config, out)`` runs (made once per call signature,
    ``DEVICE_DESCRIPTORS`` / ``GLUON_DEVICE_DESCRIPTORS`` / ``DEVICE_DESC_MAX_US``
    setting and whether a CUDA graph is being captured: see ``_descriptors_on_device``)."""
    dd, gdd = DEVICE_DESCRIPTORS, GLUON_DEVICE_DESCRIPTORS
    try:
        cap = capturing(a)
        key = (tensor_signature(a), tensor_signature(b), None if out is None else tensor_signature(out),
               config_key(config), dd, gdd, cap, DEVICE_DESC_MAX_US)
    except AttributeError:   # not tensors: planning says what is wrong (and raises)
        return _plan(a, b, out, config, dd, gdd)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.put(key, _plan(a, b, out, config, dd, gdd, cap))
    return plan


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
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` with the persistent Triton kernel, or with the warp-specialised
    Gluon kernel (``kernels.gemm.gluon``) when the config says ``gluon``.

    a: (M, K), b: (K, N), same dtype (bf16, fp16 or fp32) and device; any
    strides. ``config`` picks the knobs (``GemmConfig`` or a dict of its fields;
    ``None`` runs ``heuristic``). ``out`` (M, N), if given, receives C.
    Everything but the launch is decided once per call signature (``plan_for``).
    """
    p = plan_for(a, b, config, out)
    if out is None:
        out = torch.empty((p.M, p.N), dtype=a.dtype, device=a.device)
    if p.pad_a:
        a = _padded(a, p.pad_a)
    if p.pad_b:
        b = _padded(b, p.pad_b)
    if p.trans_b:
        b = b.t().contiguous().t()   # same (K, N) matrix, now K-major
    if p.kind == "tma":
        if p.sk_tiles:
            cfg = p.config
            ws, cnt = _stream_k_workspace(out.device, p.programs, cfg.block_m * cfg.block_n, p.sk_tiles)
        else:
            ws, cnt = out, out  # never touched
        if p.device_desc:   # the kernel encodes its descriptors (strides are in the plan)
            p.launch(a, b, out, *p.args, ws, cnt)
        else:
            ab, bb, cb, tb = p.blocks
            c_desc = TensorDescriptor.from_tensor(out, cb) if cb else None
            b_view = b.t() if p.b_kmajor else b
            p.launch(TensorDescriptor.from_tensor(a, ab), TensorDescriptor.from_tensor(b_view, bb), c_desc, out,
                     out.stride(0), *p.args, ws, cnt, TensorDescriptor.from_tensor(b_view, tb) if tb else None)
    elif p.kind in ("splitk", "fma"):
        _launch_splitk(p, a, b, out)
    elif p.kind == "ptr":
        p.launch(a, b, out, p.M, p.N, p.K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                 out.stride(0), out.stride(1), *p.args)
    elif p.kind == "gluon":
        _launch_ws(p, a, b, out)
    elif p.kind == "zero":
        out.zero_()
    return out


def _launch_splitk(p: _GemmPlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    cfg = p.config
    if p.sk_tiles:   # p.programs: the K pieces per tile
        ws, cnt = workspace(out.device, p.sk_tiles * p.programs * cfg.block_m * cfg.block_n, p.sk_tiles)
    else:
        ws, cnt = out, out  # never touched
    if p.kind == "fma":
        p.launch(a, b, out, ws, cnt, p.M, p.N, p.K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                 out.stride(0), out.stride(1), *p.args)
        return
    if p.blocks:
        a_desc = TensorDescriptor.from_tensor(a, p.blocks[0])
        b_desc = TensorDescriptor.from_tensor(b.t() if p.b_kmajor else b, p.blocks[1])
    else:
        a_desc = b_desc = None
    p.launch(a_desc, b_desc, a, b, out, ws, cnt, p.M, p.N, p.K, a.stride(0), a.stride(1),
             b.stride(0), b.stride(1), out.stride(0), out.stride(1), *p.args)


# --------------------------------------------------------------------------
# The Gluon kernel alone
# --------------------------------------------------------------------------
def check_alignment(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """ValueError unless the TMA engine can address A (M, K), B (K, N) and C (M, N)
    packed row-major: 16-byte row strides, so K and N multiples of 8 (16-bit)."""
    per16 = 16 // dtype.itemsize
    if K % per16 or N % per16:
        raise ValueError(f"gemm_ws: K={K} and N={N} must be multiples of {per16} for {dtype} (TMA needs "
                         f"16-byte aligned row strides); {_FALLBACK}, which handles any shape")


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



def grid_size(M: int, N: int, config: WsConfig, num_sms: int) -> int:
    """CTAs launched: one per SM (or ``config.num_sms``), never more than tiles."""
    tiles = -(-M // config.block_m) * -(-N // config.block_n)
    return max(1, min(config.num_sms or num_sms, tiles))



def _ws_device_desc_ok(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, cfg: WsConfig) -> bool:
    """Whether the Gluon kernel may encode its descriptors itself: the Triton kernels'
    rule (``device_desc_ok``) for A, B and C (a fresh C: contiguous (M, N)), and the
    config's shared memory with the descriptors' staging on top."""
    M, N = a.shape[0], b.shape[1]
    b_ok = device_desc_ok(b.t()) if _kmajor_ok(b) and not _tma_ok(b) else device_desc_ok(b)
    return (device_desc_ok(a) and b_ok
            and device_desc_ok(out, M, N, N, a.element_size()) and ws_device_desc_fits(cfg, a.element_size()))


def _ws_plan(M: int, N: int, K: int, cfg: WsConfig, sms: int, dtype: torch.dtype, device_desc: bool = False,
             row_strides: tuple[int, int, int] = (), b_kmajor: bool = False) -> _GemmPlan:
    """The Gluon kernel's plan: host descriptors (their boxes and layouts kept), or with
    ``device_desc`` the variant that encodes them itself from the row strides of A, B
    and C (``row_strides``, which the plan's key fixes). ``b_kmajor``: B's descriptor
    is over B^T (N, K) (B's row stride in ``row_strides`` is then B^T's)."""
    grid = grid_size(M, N, cfg, sms)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    constexprs = dict(NUM_STAGES=cfg.num_stages, COOPERATIVE=cfg.cooperative, CONSUMER_REGS=cfg.consumer_regs,
                      PRODUCER_REGS=cfg.producer_regs, B_KMAJOR=bool(b_kmajor))
    options = dict(num_warps=num_warps(cfg), maxnreg=MAXNREG)
    if device_desc:
        launch = PlannedLaunch(gluon._gemm_ws_dev_kernel, (grid,), dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **constexprs),
                               options)
        return _GemmPlan("gluon", M, N, K, cfg, launch, (M, N, K, *row_strides, cfg.group_m), 0, grid,
                         b_kmajor=bool(b_kmajor), device_desc=True)
    launch = PlannedLaunch(gluon._gemm_ws_kernel, (grid,), constexprs, options)
    # Boxes with their shared-memory layouts, made once (building a layout costs more than the launch).
    b_box = [bn, bk] if b_kmajor else [bk, bn]
    blocks = tuple((blk, gluon.layout(dtype, blk)) for blk in ([bm, bk], b_box, [bm, bn]))
    return _GemmPlan("gluon", M, N, K, cfg, launch, (cfg.group_m,), 0, grid, blocks, b_kmajor=bool(b_kmajor))


def _launch_ws(p: _GemmPlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    cuda_context.ensure_current(a.device)   # autograd's backward thread may have no current context
    if p.device_desc:   # pointers, sizes, row strides (the kernel encodes its descriptors)
        p.launch(a, b, out, *p.args)
        return
    (ab, al), (bb, bl), (cb, cl) = p.blocks
    D = gluon.TensorDescriptor
    p.launch(D.from_tensor(a, ab, al), D.from_tensor(b.t() if p.b_kmajor else b, bb, bl), D.from_tensor(out, cb, cl),
             *p.args)


_WS_PLANS = PlanCache()


def _plan_ws(a, b, out, config, gluon_device_descriptors: bool = False) -> _GemmPlan:
    cfg = validate_ws(config)
    _check_ws_operands(a, b)
    M, K = a.shape
    N = b.shape[1]
    check_alignment(M, N, K, a.dtype)
    if out is not None:
        prepare_output(out, M, N, K, a, who="gemm_ws")
    if M == 0 or N == 0:
        return _GemmPlan("empty", M, N, K)
    if K == 0:
        return _GemmPlan("zero", M, N, K)
    if not all(_tma_ok(t) for t in (a, b) + (() if out is None else (out,))):
        raise ValueError("gemm_ws: a, b and out need unit column stride, 16-byte aligned base pointers and "
                         f"row strides (TMA); {_FALLBACK}, which takes any strides")
    return _ws_plan(M, N, K, cfg, _sm_count(_device_index(a)), a.dtype,
                    gluon_device_descriptors and _ws_device_desc_ok(a, b, out, cfg),
                    (a.stride(0), b.stride(0), out.stride(0) if out is not None else N))


def plan_for_ws(a: torch.Tensor, b: torch.Tensor, config=None, out: torch.Tensor | None = None) -> _GemmPlan:
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
        _launch_ws(p, a, b, out)
    elif p.kind == "zero":
        out.zero_()
    return out


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
    cfg = validate_ws(config)
    if dtype not in WS_DTYPES:
        raise ValueError(f"gemm_ws: dtype {dtype} is not supported; use torch.bfloat16 or torch.float16")
    M, N, K = 8192, 8192, 8192
    if shape is not None:
        M, N, K = (shape["M"], shape["N"], shape["K"]) if isinstance(shape, Mapping) else shape
        check_alignment(M, N, K, dtype)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    constexprs = {"NUM_STAGES": cfg.num_stages, "COOPERATIVE": cfg.cooperative, "CONSUMER_REGS": cfg.consumer_regs,
                  "PRODUCER_REGS": cfg.producer_regs, "B_KMAJOR": bool(b_kmajor)}
    out = {"fn": gluon._gemm_ws_kernel, "num_warps": num_warps(cfg), "options": {"maxnreg": MAXNREG}}
    if device_desc:
        t = triton_type(dtype)
        sig = {"a_ptr": f"*{t}", "b_ptr": f"*{t}", "c_ptr": f"*{t}", "M": "i32", "N": "i32", "K": "i32",
               "stride_am": "i32", "stride_bk": "i32", "stride_cm": "i32", "group_m": "i32"}
        divisible = ["a_ptr", "b_ptr", "c_ptr"] + [name for name, v in (("N", N), ("K", K), ("stride_am", K),
                                                                       ("stride_bk", K if b_kmajor else N),
                                                                       ("stride_cm", N))
                                                   if v % 16 == 0]
        return {**out, "fn": gluon._gemm_ws_dev_kernel, "signature": sig,
                "constexprs": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **constexprs}, "divisible": divisible}
    sig = {"a_desc": gluon.desc_type(dtype, [bm, bk]),
           "b_desc": gluon.desc_type(dtype, [bn, bk] if b_kmajor else [bk, bn]),
           "c_desc": gluon.desc_type(dtype, [bm, bn]), "group_m": "i32"}
    return {**out, "signature": sig, "constexprs": constexprs}




def compile_args(config: GemmConfig | Mapping[str, Any] | None = None, dtype: torch.dtype = torch.bfloat16,
                 shape: Mapping[str, int] | None = None, device_desc: bool = False,
                 b_kmajor: bool | None = None) -> dict:
    """Keyword arguments for ``workbench.asm.compile.cross_compile`` that build
    the TMA kernel ``matmul`` launches for ``config`` (``fn`` included)::

        cross_compile(targets="sm90", cache_dir=d, **compile_args(cfg))

    ``shape`` (M, N, K) only decides which sizes count as multiples of 16.
    ``device_desc``: the variant that encodes its descriptors in the kernel
    (row-major operands and C, as ``matmul`` allocates it).
    ``b_kmajor``: the variant reading B^T (N, K) (a transposed view of B, or the
    copy ``transpose_b`` makes); None: as ``matmul`` runs row-major operands
    (fp32 persistent configs copy B K-major unless ``transpose_b=False``).
    ``fma`` configs: the FMA kernel for these strides (``device_desc`` does not apply).
    """
    cfg = _as_config(config) or heuristic(*(_mnk(shape) if shape else (8192, 8192, 8192)), dtype,
                                          b_kmajor=bool(b_kmajor))
    validate_config(cfg)
    if cfg.gluon:
        return compile_args_ws(cfg.ws_config(), dtype, _mnk(shape) if shape else None, device_desc)
    if cfg.fma:
        return _compile_args_fma(cfg, dtype, _mnk(shape) if shape else (8192, 8192, 8192), bool(b_kmajor))
    if cfg.split_k is not None:
        return _compile_args_splitk(cfg, dtype, device_desc, bool(b_kmajor))
    if b_kmajor is None:
        b_kmajor = cfg.transpose_b if cfg.transpose_b is not None else dtype == torch.float32
    t = triton_type(dtype)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    b_box = f"[{bn}, {bk}]" if b_kmajor else f"[{bk}, {bn}]"
    sig = {"a_desc": f"tensordesc<{t}[{bm}, {bk}]>", "b_desc": f"tensordesc<{t}{b_box}>",
           "c_ptr": f"*{t}", "stride_cm": "i32", "M": "i32", "N": "i32", "K": "i32",
           "num_sms": "i32", "group_m": "i32", "dp_tiles": "i32", "sk_programs": "i32",
           "sk_iters_per": "i32", "sk_extra": "i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    ts = cfg.tail_split   # compiled as the plan runs it when the shape leaves a partial round
    constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "TMA_STORE": cfg.tma_store,
                  "EPILOGUE_SPLIT": cfg.epilogue_split, "FLATTEN": cfg.flatten,
                  "WARP_SPECIALIZE": cfg.warp_specialize, "STREAM_K": bool(cfg.stream_k), "B_KMAJOR": bool(b_kmajor),
                  "TAIL_SPLIT": ts, "TAIL_STAGES": tail_stages(cfg, ts), "EXTRA_N": cfg.extra_n}
    if ts > 1 or cfg.extra_n:
        b2_n = cfg.extra_n or bn // ts
        sig["b2_desc"] = f"tensordesc<{t}[{b2_n}, {bk}]>" if b_kmajor else f"tensordesc<{t}[{bk}, {b2_n}]>"
    else:
        constexprs["b2_desc"] = None
    if cfg.tma_store:
        sig["c_desc"] = f"tensordesc<{t}[{bm}, {bn // cfg.epilogue_split}]>"
    else:
        constexprs["c_desc"] = None
    M, N, K = _mnk(shape) if shape else (8192, 8192, 8192)
    divisible = ["c_ptr"] + [name for name, v in (("stride_cm", N), ("M", M), ("N", N), ("K", K)) if v % 16 == 0]
    fn = _gemm_tma_kernel
    if device_desc:
        fn = _gemm_tma_dev_kernel
        constexprs.pop("c_desc", None)
        constexprs.pop("b2_desc", None)
        sig.pop("b2_desc", None)
        sig = {"a_ptr": f"*{t}", "b_ptr": f"*{t}", "c_ptr": f"*{t}", "stride_am": "i32", "stride_bk": "i32",
               **{k: v for k, v in sig.items() if k not in ("a_desc", "b_desc", "c_desc", "c_ptr")}}
        divisible += ["a_ptr", "b_ptr"] + [name for name, v in (("stride_am", K), ("stride_bk", N)) if v % 16 == 0]
    return {"fn": fn, "signature": sig, "constexprs": constexprs, "divisible": divisible,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}



def _compile_args_splitk(cfg: GemmConfig, dtype: torch.dtype, device_desc: bool = False,
                         b_kmajor: bool = False) -> dict:
    """The split-K kernel on the TMA path (row-major operands, or B K-major; C stride a multiple of 16)."""
    t = triton_type(dtype)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    b_box = f"[{bn}, {bk}]" if b_kmajor else f"[{bk}, {bn}]"
    sig = {"a_desc": f"tensordesc<{t}[{bm}, {bk}]>", "b_desc": f"tensordesc<{t}{b_box}>",
           "a_ptr": f"*{t}", "b_ptr": f"*{t}", "c_ptr": f"*{t}", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
           "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_bk": "i32", "stride_cm": "i32",
           "split_k": "i32", "steps_per_split": "i32"}
    constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "USE_TMA": True, "SWAP_AB": cfg.swap_ab,
                  "stride_ak": 1, "stride_cn": 1, "B_KMAJOR": b_kmajor, "GROUP_M": cfg.group_m,
                  **({"stride_bk": 1} if b_kmajor else {"stride_bn": 1})}
    b_row = "stride_bn" if b_kmajor else "stride_bk"   # B's row stride (of B^T when K-major)
    if b_kmajor:
        sig = {("stride_bn" if k == "stride_bk" else k): v for k, v in sig.items()}
    if device_desc:
        del sig["a_desc"], sig["b_desc"]
        constexprs.update(a_desc=None, b_desc=None, DEVICE_DESC=True)
    return {"fn": _gemm_splitk_kernel, "signature": sig, "constexprs": constexprs,
            "divisible": ["a_ptr", "b_ptr", "c_ptr", "ws_ptr", "stride_am", b_row, "stride_cm"],
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}


def _compile_args_fma(cfg: GemmConfig, dtype: torch.dtype, mnk: tuple[int, int, int], b_kmajor: bool) -> dict:
    """``_gemm_fma_kernel`` as ``matmul`` launches it on contiguous A and C and a row-major B
    (or, ``b_kmajor``, a transposed view): unit strides are constants (Triton specialises
    integers equal to 1), and the sizes and row strides that are multiples of 16 are marked
    divisible, which is what lets it load 4 adjacent elements at once."""
    if dtype != torch.float32:
        raise ValueError(f"gemm: fma=True is the fp32 kernel; got {dtype}")
    M, N, K = mnk
    sig = {"a_ptr": "*fp32", "b_ptr": "*fp32", "c_ptr": "*fp32", "ws_ptr": "*fp32", "cnt_ptr": "*i32",
           "M": "i32", "N": "i32", "K": "i32", "stride_am": "i32", "stride_bk": "i32", "stride_bn": "i32",
           "stride_cm": "i32", "split_k": "i32", "steps_per_split": "i32"}
    b_unit, b_row, b_row_len = ("stride_bk", "stride_bn", K) if b_kmajor else ("stride_bn", "stride_bk", N)
    del sig[b_unit]
    constexprs = {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                  "stride_ak": 1, "stride_cn": 1, b_unit: 1}
    if M == 1:
        constexprs["M"] = 1
        del sig["M"]
    divisible = ["a_ptr", "b_ptr", "c_ptr", "ws_ptr"] + [
        name for name, v in (("M", M), ("N", N), ("K", K), ("stride_am", K), (b_row, b_row_len), ("stride_cm", N))
        if v % 16 == 0 and name in sig]
    return {"fn": _gemm_fma_kernel, "signature": sig, "constexprs": constexprs, "divisible": divisible,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
