"""The ``workbench sweep`` protocol of the GEMM family (experiments/gemm_tiling.yaml):
inputs, a run, its reference, counts, tolerance, constraint names, warm-up."""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import triton

from kernels.gemm.baselines import cublas
from kernels.gemm.config import PARAMS, SMEM_LIMIT_SM90, GemmConfig, smem_bytes
from kernels.gemm.launch import matmul
from kernels.gemm.metrics import _mnk, bytes_moved, flops, tolerance  # noqa: F401  (the protocol's names)
from kernels.gemm.reference import reference  # noqa: F401
from workbench.dtypes import element_size

@dataclasses.dataclass
class GemmInputs:
    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor


def make_inputs(shape: Mapping[str, int], dtype: torch.dtype, device, seed: int) -> GemmInputs:
    """Random normal operands scaled so C has entries of order 1."""
    M, N, K = _mnk(shape)
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(int(seed))
    std = max(K, 1) ** -0.25  # entries of A and B: N(0, K^-1/2), so C has entries of order 1
    a = (torch.randn((M, K), generator=g, device=device) * std).to(dtype)
    b = (torch.randn((K, N), generator=g, device=device) * std).to(dtype)
    out = torch.empty((M, N), dtype=dtype, device=device)
    return GemmInputs(a, b, out)


def poison(inputs: GemmInputs) -> None:
    inputs.out.fill_(float("nan"))


def run(inputs: GemmInputs, **params) -> torch.Tensor:
    return matmul(inputs.a, inputs.b, params or None, out=inputs.out)


def _consumer_warps(cfg: GemmConfig) -> int:
    """Warps holding one tile's accumulator (Gluon: 4 in ping-pong, 8 in coop)."""
    if cfg.gluon:
        return 8 if cfg.gluon == "coop" else 4
    return cfg.num_warps


def derived(shape: Mapping[str, int], dtype: torch.dtype, params: Mapping[str, Any]) -> dict:
    """Extra names for sweep constraint expressions."""
    cfg = GemmConfig(**{k: v for k, v in params.items() if k in PARAMS})
    es = element_size(dtype)
    M, N, K = _mnk(shape)
    return {
        "elem_bytes": es,
        "smem_bytes": smem_bytes(cfg, es),
        "acc_regs": cfg.block_m * (cfg.block_n + cfg.extra_n) // (_consumer_warps(cfg) * 32),
        "tiles": triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n + cfg.extra_n),
        "SMEM_LIMIT": SMEM_LIMIT_SM90,
    }


def _tiny(x: int) -> int:
    # Same specialisation class (==1, %16, %8) as x, at a small size.
    if x == 1:
        return 1
    if x % 16 == 0:
        return 256
    if x % 8 == 0:
        return 264
    return 257


def warmup(shape: Mapping[str, int], dtype: torch.dtype, device, **params) -> None:
    """Compile the kernel ``run`` would launch for this shape, on tiny operands."""
    M, N, K = _mnk(shape)
    a = torch.randn((_tiny(M), _tiny(K)), device=device).to(dtype)
    b = torch.randn((_tiny(K), _tiny(N)), device=device).to(dtype)
    matmul(a, b, params or None)


def label(params: Mapping[str, Any]) -> str:
    return GemmConfig(**{k: v for k, v in params.items() if k in PARAMS}).label()


baselines = {"cublas": lambda inputs: cublas(inputs.a, inputs.b, out=inputs.out)}


# --------------------------------------------------------------------------
# Cross-compilation (no GPU needed): arguments for workbench.asm.compile
# --------------------------------------------------------------------------
