"""Variant ``gluon``: the warp-specialised Gluon kernel (``kernels.gemm.gluon``), ping-pong or
cooperative, configured by ``kernels.gemm.config.WsConfig``. sm_90 only, bf16/fp16, operands
and C with 16-byte aligned rows. Descriptors come from the host (three Gluon
``TensorDescriptor`` per call) or, in ``_gemm_ws_dev_kernel``, from its partitions.
"""
from __future__ import annotations

import torch

from kernels.common import cuda_context
from kernels.common.launcher import PlannedLaunch
from kernels.gemm import gluon as gl_kernels
from kernels.gemm.config import MAXNREG, WS_DTYPES, WsConfig, num_warps, validate_ws, ws_device_desc_fits
from kernels.gemm.plan import Call, GemmPlan, device_desc_ok, kmajor_ok, tma_ok
from workbench.dtypes import triton_type

NAME = "gluon"
Config = WsConfig
FALLBACK = "use kernels.gemm.matmul instead"


def usable(call: Call, cfg: WsConfig) -> None:
    """ValueError unless this call can run the Gluon kernel."""
    if not (call.sm90 and call.aligned and call.dtype in WS_DTYPES):
        raise ValueError(f"gemm: the Gluon kernel (kernels.gemm.gluon) needs bf16/fp16 operands on an sm_90 GPU "
                         f"with 16-byte aligned rows (K, N multiples of 8); got {call.dtype} on {call.a.device}. "
                         f"Use a Triton config (gluon=None) here")
    validate_ws(cfg)


def plan(call: Call, cfg: WsConfig, explicit: bool) -> GemmPlan:
    usable(call, cfg)
    dev = call.gluon_device_descriptors and ws_device_desc_ok(call.a, call.b, call.out, cfg)
    b = call.b
    return ws_plan(call.M, call.N, call.K, cfg, call.sms, call.dtype, dev,
                   (call.a.stride(0), b.stride(1) if call.b_km else b.stride(0), call.stride_cm), b_kmajor=call.b_km)


def grid_size(M: int, N: int, config: WsConfig, num_sms: int) -> int:
    """CTAs launched: one per SM (or ``config.num_sms``), never more than tiles."""
    tiles = -(-M // config.block_m) * -(-N // config.block_n)
    return max(1, min(config.num_sms or num_sms, tiles))


def ws_device_desc_ok(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, cfg: WsConfig) -> bool:
    """Whether the Gluon kernel may encode its descriptors itself: the Triton kernels'
    rule (``device_desc_ok``) for A, B and C (a fresh C: contiguous (M, N)), and the
    config's shared memory with the descriptors' staging on top."""
    M, N = a.shape[0], b.shape[1]
    b_ok = device_desc_ok(b.t()) if kmajor_ok(b) and not tma_ok(b) else device_desc_ok(b)
    return (device_desc_ok(a) and b_ok
            and device_desc_ok(out, M, N, N, a.element_size()) and ws_device_desc_fits(cfg, a.element_size()))


def ws_plan(M: int, N: int, K: int, cfg: WsConfig, sms: int, dtype: torch.dtype, device_desc: bool = False,
            row_strides: tuple[int, int, int] = (), b_kmajor: bool = False) -> GemmPlan:
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
        launch = PlannedLaunch(gl_kernels._gemm_ws_dev_kernel, (grid,),
                               dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, **constexprs), options)
        return GemmPlan("gluon", M, N, K, cfg, launch, (M, N, K, *row_strides, cfg.group_m), 0, grid,
                        b_kmajor=bool(b_kmajor), device_desc=True)
    launch = PlannedLaunch(gl_kernels._gemm_ws_kernel, (grid,), constexprs, options)
    # Boxes with their shared-memory layouts, made once (building a layout costs more than the launch).
    b_box = [bn, bk] if b_kmajor else [bk, bn]
    blocks = tuple((blk, gl_kernels.layout(dtype, blk)) for blk in ([bm, bk], b_box, [bm, bn]))
    return GemmPlan("gluon", M, N, K, cfg, launch, (cfg.group_m,), 0, grid, blocks, b_kmajor=bool(b_kmajor))


def launch(p: GemmPlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    cuda_context.ensure_current(a.device)   # autograd's backward thread may have no current context
    if p.device_desc:   # pointers, sizes, row strides (the kernel encodes its descriptors)
        p.launch(a, b, out, *p.args)
        return
    (ab, al), (bb, bl), (cb, cl) = p.blocks
    D = gl_kernels.TensorDescriptor
    p.launch(D.from_tensor(a, ab, al), D.from_tensor(b.t() if p.b_kmajor else b, bb, bl), D.from_tensor(out, cb, cl),
             *p.args)


def check_alignment(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """ValueError unless the TMA engine can address A (M, K), B (K, N) and C (M, N)
    packed row-major: 16-byte row strides, so K and N multiples of 8 (16-bit)."""
    per16 = 16 // dtype.itemsize
    if K % per16 or N % per16:
        raise ValueError(f"gemm_ws: K={K} and N={N} must be multiples of {per16} for {dtype} (TMA needs "
                         f"16-byte aligned row strides); {FALLBACK}, which handles any shape")


def compile_args(config=None, dtype: torch.dtype = torch.bfloat16, shape=None, device_desc: bool = False,
                 b_kmajor: bool = False) -> dict:
    """Keyword arguments for ``workbench.asm.compile.cross_compile`` that build the Gluon
    kernel for ``config`` (see ``kernels.gemm.launch.compile_args_ws``)."""
    from typing import Mapping

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
    out = {"fn": gl_kernels._gemm_ws_kernel, "num_warps": num_warps(cfg), "options": {"maxnreg": MAXNREG}}
    if device_desc:
        t = triton_type(dtype)
        sig = {"a_ptr": f"*{t}", "b_ptr": f"*{t}", "c_ptr": f"*{t}", "M": "i32", "N": "i32", "K": "i32",
               "stride_am": "i32", "stride_bk": "i32", "stride_cm": "i32", "group_m": "i32"}
        divisible = ["a_ptr", "b_ptr", "c_ptr"] + [name for name, v in (("N", N), ("K", K), ("stride_am", K),
                                                                       ("stride_bk", K if b_kmajor else N),
                                                                       ("stride_cm", N))
                                                   if v % 16 == 0]
        return {**out, "fn": gl_kernels._gemm_ws_dev_kernel, "signature": sig,
                "constexprs": {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **constexprs}, "divisible": divisible}
    sig = {"a_desc": gl_kernels.desc_type(dtype, [bm, bk]),
           "b_desc": gl_kernels.desc_type(dtype, [bn, bk] if b_kmajor else [bk, bn]),
           "c_desc": gl_kernels.desc_type(dtype, [bm, bn]), "group_m": "i32"}
    return {**out, "signature": sig, "constexprs": constexprs}
