"""Variant ``fma``: ``_gemm_fma_kernel``, true fp32 on the FMA units (no tensor cores), the
small-M fp32 path: pointer loads of any strides, K split over programs as the split-K kernel
does (``split_k`` None: ``kernels.gemm.config.fma_split`` decides per device)."""
from __future__ import annotations

import dataclasses

import torch
import triton

from kernels.common.launcher import PlannedLaunch
from kernels.gemm.config import FlatKnobs, fma_split, split_pieces
from kernels.gemm.plan import Call, GemmPlan, workspace
from kernels.gemm.triton import _gemm_fma_kernel

NAME = "fma"


@dataclasses.dataclass(frozen=True)
class Config(FlatKnobs):
    """The FMA kernel's knobs: block_m < 16 runs one outer product per row of B (block_k rows
    unrolled per K-step), block_m >= 16 tl.dot in ieee precision."""

    block_m: int = 16
    block_n: int = 64
    block_k: int = 32
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    split_k: int | None = None

    FLAT = {"fma": True, "tma_store": False}   # what the flat GemmConfig of this variant sets besides its knobs


def usable(call: Call, cfg: Config) -> None:
    plan(call, cfg, explicit=True)


def plan(call: Call, cfg: Config, explicit: bool) -> GemmPlan:
    """Grid (M blocks x N blocks, K pieces); nothing copied."""
    if call.dtype != torch.float32:
        raise ValueError(f"gemm: fma=True is the fp32 kernel (FMA units, fp32 products); {call.dtype} runs on the "
                         f"tensor cores: leave fma=False")
    M, N, K = call.M, call.N, call.K
    m_blocks, tiles_n = triton.cdiv(M, cfg.block_m), triton.cdiv(N, cfg.block_n)
    k_steps = triton.cdiv(K, cfg.block_k)
    split = cfg.split_k if cfg.split_k is not None else fma_split(m_blocks * tiles_n, k_steps,
                                                                  m_blocks * cfg.block_m, K, call.sms)
    pieces, per = split_pieces(k_steps, split)
    launch = PlannedLaunch(_gemm_fma_kernel, (m_blocks * tiles_n, pieces),
                           dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k),
                           dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    return GemmPlan("fma", M, N, K, cfg, launch, (pieces, per), m_blocks * tiles_n if pieces > 1 else 0, pieces)


def launch(p: GemmPlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    cfg = p.config
    if p.sk_tiles:   # p.programs: the K pieces per tile
        ws, cnt = workspace(out.device, p.sk_tiles * p.programs * cfg.block_m * cfg.block_n, p.sk_tiles)
    else:
        ws, cnt = out, out  # never touched
    p.launch(a, b, out, ws, cnt, p.M, p.N, p.K, a.stride(0), a.stride(1), b.stride(0), b.stride(1),
             out.stride(0), out.stride(1), *p.args)


def compile_args(cfg, dtype: torch.dtype, mnk: tuple[int, int, int], b_kmajor: bool) -> dict:
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
