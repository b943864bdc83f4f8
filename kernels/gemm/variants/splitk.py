"""Variant ``splitk``: ``_gemm_splitk_kernel``, one program per output tile and piece of K
(not persistent); the pieces of a tile meet in an fp32 workspace and the last to arrive
stores C. With ``swap_ab`` it computes C^T = B^T A^T, so a short M (1-64 rows) is the MMA's
narrow N side: the small-M (decode) path, bound by reading B once.
"""
from __future__ import annotations

import dataclasses

import torch
import triton

from kernels.common.launcher import PlannedLaunch
from kernels.gemm import config as gconfig
from kernels.gemm.config import FlatKnobs, split_pieces
from kernels.gemm.plan import (Call, GemmPlan, TensorDescriptor, operand_pads, operands_device_desc_ok,
                               workspace)
from kernels.gemm.triton import _gemm_splitk_kernel
from workbench.dtypes import triton_type

NAME = "splitk"


@dataclasses.dataclass(frozen=True)
class Config(FlatKnobs):
    """The split-K kernel's knobs: the tile, ``split_k`` pieces of K (1: none), ``swap_ab``,
    ``pad`` (aligned copies of operands TMA cannot address) and ``tma`` (None: when allowed)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1
    swap_ab: bool = False
    pad: bool = False
    tma: bool | None = None

    FLAT = {"tma_store": False}   # what the flat GemmConfig of this variant sets besides its knobs


def usable(call: Call, cfg: Config) -> None:
    plan(call, cfg, explicit=True)


def plan(call: Call, cfg: Config, explicit: bool) -> GemmPlan:
    """C leaves through plain stores; A and B through TMA (or the aligned copies ``pad``
    makes) where allowed, else pointer loads."""
    tma_wanted = call.hopper if cfg.tma is None else cfg.tma
    if cfg.tma and call.on_gpu and not call.hopper:
        raise ValueError("gemm: tma=True needs an sm_90+ GPU (Hopper)")
    pads = operand_pads(call, cfg.pad, tma_wanted)
    ops_ok = TensorDescriptor is not None and (call.a_ok or bool(pads.get("pad_a"))) and \
        (call.b_ok or bool(pads.get("pad_b")))
    if cfg.tma and not ops_ok:
        raise ValueError("gemm: tma=True needs unit stride in the last dimension and 16-byte aligned "
                         "rows and base pointers (K and N multiples of 8 for 16-bit types), or pad=True")
    use = bool(tma_wanted and ops_ok)
    dev = use and call.device_descriptors and operands_device_desc_ok(call, pads, False)
    b_kmajor = use and call.b_km
    M, N, K = call.M, call.N, call.K
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    pieces, per = split_pieces(triton.cdiv(K, cfg.block_k), cfg.split_k)
    least = gconfig.SPLIT_ATOMIC_MIN_PIECES
    atomic = least is not None and pieces >= least
    launch = PlannedLaunch(_gemm_splitk_kernel, (tiles, pieces),
                           dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
                                USE_TMA=bool(use), SWAP_AB=cfg.swap_ab, DEVICE_DESC=bool(dev),
                                B_KMAJOR=bool(b_kmajor), GROUP_M=cfg.group_m, ATOMIC_SPLIT=atomic,
                                THREADS=32 * cfg.num_warps),
                           dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    b_block = [cfg.block_n, cfg.block_k] if b_kmajor else [cfg.block_k, cfg.block_n]
    blocks = ([cfg.block_m, cfg.block_k], b_block) if use and not dev else ()
    return GemmPlan("splitk", M, N, K, cfg, launch, (pieces, per), tiles if pieces > 1 else 0, pieces, blocks,
                    **(pads if use else {}), b_kmajor=bool(b_kmajor), device_desc=bool(dev))


def launch(p: GemmPlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    cfg = p.config
    if p.sk_tiles and p.launch.kwargs["ATOMIC_SPLIT"]:   # one sum per tile, kept at zero between calls
        ws, cnt = workspace(out.device, p.sk_tiles * cfg.block_m * cfg.block_n, p.sk_tiles, zeroed=True)
    elif p.sk_tiles:   # p.programs: the K pieces per tile
        ws, cnt = workspace(out.device, p.sk_tiles * p.programs * cfg.block_m * cfg.block_n, p.sk_tiles)
    else:
        ws, cnt = out, out  # never touched
    if p.blocks:
        a_desc = TensorDescriptor.from_tensor(a, p.blocks[0])
        b_desc = TensorDescriptor.from_tensor(b.t() if p.b_kmajor else b, p.blocks[1])
    else:
        a_desc = b_desc = None
    p.launch(a_desc, b_desc, a, b, out, ws, cnt, p.M, p.N, p.K, a.stride(0), a.stride(1),
             b.stride(0), b.stride(1), out.stride(0), out.stride(1), *p.args)


def compile_args(cfg, dtype: torch.dtype, device_desc: bool = False, b_kmajor: bool = False) -> dict:
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
