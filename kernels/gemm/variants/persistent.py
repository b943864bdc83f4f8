"""Variant ``persistent``: ``_gemm_tma_kernel`` (Hopper: TMA descriptors, wgmma, optional
stream-K tail, tail slices, wider tiles), or its pointer twin ``_gemm_ptr_kernel`` where TMA
cannot run (``tma=False``, the interpreter without ``tma=True``, pre-Hopper GPUs, operands TMA
cannot address and ``pad`` off). One program per SM walks the output tiles in GROUP_M bands.
"""
from __future__ import annotations

import dataclasses

import torch
import triton

from kernels.common.launcher import PlannedLaunch
from kernels.gemm.config import (FlatKnobs, GemmConfig, StreamKPlan, _refuse_ws_on_gpu, last_round, stream_k_plan,
                                 tail_slices, tail_stages)
from kernels.gemm.plan import (Call, GemmPlan, TensorDescriptor, b_row_stride, device_desc_ok, operand_pads,
                               operands_device_desc_ok, workspace)
from kernels.gemm.triton import _gemm_ptr_kernel, _gemm_tma_dev_kernel, _gemm_tma_kernel
from workbench.dtypes import triton_type

NAME = "persistent"


@dataclasses.dataclass(frozen=True)
class Config(FlatKnobs):
    """The persistent kernel's knobs (``kernels.gemm.config.GemmConfig`` documents each)."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    num_sms: int | None = None
    tma: bool | None = None
    warp_specialize: bool = False
    tma_store: bool = True
    epilogue_split: int = 1
    flatten: bool = True
    stream_k: bool = False
    tail_split: int = 1
    extra_n: int = 0
    pad: bool = False
    transpose_b: bool | None = None

    FLAT = {}   # what the flat GemmConfig of this variant sets besides its knobs


def usable(call: Call, cfg: Config) -> None:
    """ValueError when this call cannot run ``cfg`` (the plan builder's own refusals)."""
    plan(call, cfg, explicit=True)


def plan(call: Call, cfg: Config, explicit: bool) -> GemmPlan:
    """The plan for ``cfg`` on ``call``: TMA where the device, the operands (or their aligned
    copies, ``pad``) and the config allow, else the pointer kernel. ``explicit``: the caller
    named the config, so a knob the operands cannot honour is an error rather than dropped."""
    M, N, K, es = call.M, call.N, call.K, call.es
    if cfg.warp_specialize and call.on_gpu:
        _refuse_ws_on_gpu()
    tma_wanted = call.hopper if cfg.tma is None else cfg.tma
    if cfg.tma and call.on_gpu and not call.hopper:
        raise ValueError("gemm: tma=True needs an sm_90+ GPU (Hopper)")
    pads = operand_pads(call, cfg.pad, tma_wanted)
    have_desc = TensorDescriptor is not None
    # fp32 on the persistent TMA kernel: a row-major B is copied K-major once per call
    # (tf32 wgmma reads B only K-major; Triton would re-lay every B tile through
    # registers and serialise the pipeline: 0.16-0.35x cuBLAS on an H200).
    trans = cfg.transpose_b if cfg.transpose_b is not None else call.dtype == torch.float32
    trans_b = bool(trans and tma_wanted and have_desc and not call.b_km and not pads.get("pad_b")
                   and (K * es) % 16 == 0)
    b_km = call.b_km or trans_b
    ops_ok = have_desc and (call.a_ok or bool(pads.get("pad_a"))) and (call.b_ok or bool(pads.get("pad_b")))
    dev_ops = call.device_descriptors and operands_device_desc_ok(call, pads, trans_b)
    tma_ok = ops_ok and (call.c_ok or not cfg.tma_store)
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
    if cfg.stream_k and not use_tma and not explicit:  # a selected config, on unaligned operands
        cfg = dataclasses.replace(cfg, stream_k=False)
    if cfg.stream_k and not use_tma:
        raise ValueError("gemm: stream_k=True needs the TMA path (sm_90+, 16-byte aligned rows); "
                         "use stream_k=False for these operands")
    if cfg.tail_split != 1 and not use_tma:
        if explicit:
            raise ValueError("gemm: tail_split needs the TMA path (sm_90+, 16-byte aligned rows); "
                             "use tail_split=1 for these operands")
        cfg = dataclasses.replace(cfg, tail_split=1)
    sms = max(1, cfg.num_sms or call.sms)
    programs = sms if cfg.stream_k else max(1, min(sms, tiles))
    slices = tail_slices(tiles, sms, cfg.tail_split) if cfg.tail_split != 1 else 1
    if slices > 1:   # every SM: the slices of the last round outnumber its tiles
        programs = sms
    if not use_tma:
        return _pointer_plan(M, N, K, cfg, programs)
    sk = stream_k_plan(tiles, programs, triton.cdiv(K, cfg.block_k)) if cfg.stream_k else None
    if slices > 1:
        sk = StreamKPlan(tiles - last_round(tiles, programs), 0, 1, 0)
    elif sk is None or sk.sk_programs == 0:
        sk = StreamKPlan(tiles, 0, 1, 0)
        programs = min(programs, tiles)
    stride_cm = call.stride_cm
    dev = dev_ops and (not cfg.tma_store or device_desc_ok(call.out, M, N, stride_cm, es))
    launch = PlannedLaunch(_gemm_tma_dev_kernel if dev else _gemm_tma_kernel, (programs,),
                           dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TMA_STORE=cfg.tma_store,
                                EPILOGUE_SPLIT=cfg.epilogue_split, FLATTEN=cfg.flatten,
                                WARP_SPECIALIZE=cfg.warp_specialize, STREAM_K=sk.sk_programs > 0, B_KMAJOR=b_km,
                                TAIL_SPLIT=slices, TAIL_STAGES=tail_stages(cfg, slices), EXTRA_N=cfg.extra_n),
                           dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    args = (M, N, K, programs, cfg.group_m, sk.dp_tiles, sk.sk_programs, sk.sk_iters_per, sk.sk_extra)
    if dev:   # the row strides of A, B (as launched: padded copies have pad_* columns) and C
        args = (pads.get("pad_a") or call.a.stride(0), b_row_stride(call.b, K, pads, b_km, trans_b), stride_cm) + args
    b2_n = cfg.extra_n or cfg.block_n // slices   # the second B descriptor's box: extra columns or a slice
    blocks = ([cfg.block_m, cfg.block_k], [cfg.block_n, cfg.block_k] if b_km else [cfg.block_k, cfg.block_n],
              [cfg.block_m, cfg.block_n // cfg.epilogue_split] if cfg.tma_store else None,
              ([b2_n, cfg.block_k] if b_km else [cfg.block_k, b2_n]) if slices > 1 or cfg.extra_n else None)
    return GemmPlan("tma", M, N, K, cfg, launch, args, tiles - sk.dp_tiles if sk.sk_programs else 0, programs,
                    blocks, **pads, b_kmajor=b_km, trans_b=trans_b, device_desc=dev)


def _pointer_plan(M: int, N: int, K: int, cfg: Config, programs: int) -> GemmPlan:
    launch = PlannedLaunch(_gemm_ptr_kernel, (programs,),
                           dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FLATTEN=cfg.flatten),
                           dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return GemmPlan("ptr", M, N, K, cfg, launch, (programs, cfg.group_m), programs=programs)


def launch(p: GemmPlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """Run a plan of kind "tma" or "ptr" (operands already padded / transposed as it asks)."""
    if p.kind == "ptr":
        p.launch(a, b, out, p.M, p.N, p.K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                 out.stride(0), out.stride(1), *p.args)
        return
    if p.sk_tiles:
        cfg = p.config
        ws, cnt = workspace(out.device, p.programs * 2 * cfg.block_m * cfg.block_n, p.sk_tiles)
    else:
        ws, cnt = out, out  # never touched
    if p.device_desc:   # the kernel encodes its descriptors (strides are in the plan)
        p.launch(a, b, out, *p.args, ws, cnt)
        return
    ab, bb, cb, tb = p.blocks
    c_desc = TensorDescriptor.from_tensor(out, cb) if cb else None
    b_view = b.t() if p.b_kmajor else b
    p.launch(TensorDescriptor.from_tensor(a, ab), TensorDescriptor.from_tensor(b_view, bb), c_desc, out,
             out.stride(0), *p.args, ws, cnt, TensorDescriptor.from_tensor(b_view, tb) if tb else None)


# --------------------------------------------------------------------------
# Cross-compilation (no GPU needed): arguments for workbench.asm.compile
# --------------------------------------------------------------------------
def compile_args(cfg: GemmConfig, dtype: torch.dtype, mnk: tuple[int, int, int], device_desc: bool,
                 b_kmajor: bool | None) -> dict:
    """The TMA kernel ``matmul`` launches for ``cfg`` (see ``kernels.gemm.launch.compile_args``)."""
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
    M, N, K = mnk
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
