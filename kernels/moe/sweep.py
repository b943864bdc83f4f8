"""The ``workbench sweep`` protocol of the MoE family (experiments/grouped_gemm.yaml):
inputs, a run of the Triton kernels at one configuration, its reference,
counts, tolerance, constraint names and the library baselines.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from kernels.moe import routing
from kernels.moe.autotune import autotuned, run_backend
from kernels.moe.baselines import grouped_mm_offsets
from kernels.moe.config import GroupedConfig, default_config, pick_config, smem_bytes
from kernels.moe.launch import grouped_gemm, grouped_gemm_wgrad
from kernels.moe.metrics import bytes_moved as _bytes_moved, flops as _flops
from kernels.moe.reference import reference as _reference, reference_wgrad, tolerance  # noqa: F401
from workbench.asm.resources import smem_per_block
from workbench.dtypes import element_size

# A sweep shape is {B, M, N, K, op, routing} with integer codes, because sweep
# shapes are integers: op 0/1/2 = fwd/dgrad/wgrad, routing 0/1/2 =
# balanced/mild/extreme. B experts, M tokens per expert, (N, K) the layer's.

OP_CODES = {0: "fwd", 1: "dgrad", 2: "wgrad"}
ROUTING_CODES = {0: "balanced", 1: "mild", 2: "extreme"}

# 0 / "auto": take the value from the kernel's config table for that (op, N, K)
PARAMS = {"block_m": 0, "block_n": 0, "block_k": 0, "group_m": 0, "num_warps": 0, "num_stages": 0,
          "epi_subtile": "auto", "flatten": "auto", "use_tma": "auto"}


def _decode(shape: dict) -> tuple[str, str]:
    try:
        return OP_CODES[int(shape.get("op", 0))], ROUTING_CODES[int(shape.get("routing", 0))]
    except KeyError:
        raise ValueError(f"grouped GEMM sweep shape {shape}: op must be 0/1/2 (fwd/dgrad/wgrad) and "
                         f"routing 0/1/2 (balanced/mild/extreme)") from None


def make_inputs(shape: dict, dtype: torch.dtype, device: str, seed: int) -> dict:
    """x [B*M, K], w [B, K, N], dy [B*M, N], routed group sizes (+ offsets, host sizes)."""
    op, kind = _decode(shape)
    B, Mper, N, K = (int(shape[k]) for k in ("B", "M", "N", "K"))
    M = B * Mper
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, device=device, generator=gen).to(dtype)
    w = (torch.randn(B, K, N, device=device, generator=gen) / math.sqrt(K)).to(dtype)
    dy = torch.randn(M, N, device=device, generator=gen).to(dtype)
    sizes = routing.make(kind, M, B, seed=seed, device=device)
    a, b = {"fwd": (x, w), "dgrad": (dy, w), "wgrad": (x, dy)}[op]
    out_shape = {"fwd": (M, N), "dgrad": (M, K), "wgrad": (B, K, N)}[op]
    return {"op": op, "routing": kind, "a": a, "b": b, "sizes": sizes, "offs": grouped_mm_offsets(sizes),
            "host_sizes": [int(v) for v in sizes.tolist()], "N": N, "K": K,
            "out": torch.empty(out_shape, device=device, dtype=dtype)}


def _config(inputs: dict, params: dict) -> GroupedConfig:
    op, N, K = inputs["op"], inputs["N"], inputs["K"]
    call_n, call_k = (K, N) if op == "dgrad" else (N, K)
    cfg = pick_config(op, call_n, call_k, inputs["a"].device)
    over = {}
    for p, field in (("block_m", "BLOCK_M"), ("block_n", "BLOCK_N"), ("block_k", "BLOCK_K"),
                     ("group_m", "GROUP_M"), ("num_warps", "num_warps"), ("num_stages", "num_stages")):
        if params.get(p):
            over[field] = int(params[p])
    for p, field in (("epi_subtile", "EPI_SUBTILE"), ("flatten", "FLATTEN"), ("use_tma", "USE_TMA")):
        v = params.get(p, "auto")
        if v != "auto" and v is not None:
            over[field] = bool(v)
    return dataclasses.replace(cfg, **over) if over else cfg


def run(inputs: dict, **params) -> torch.Tensor:
    """Our kernel at one configuration, writing into inputs['out'] (poisoned before the check)."""
    op, a, b, s = inputs["op"], inputs["a"], inputs["b"], inputs["sizes"]
    cfg = _config(inputs, params)
    if op == "wgrad":
        return grouped_gemm_wgrad(a, b, s, config=cfg, out=inputs["out"])
    return grouped_gemm(a, b, s, trans_w=(op == "dgrad"), config=cfg, out=inputs["out"])


def poison(inputs: dict) -> None:
    inputs["out"].fill_(float("nan"))


def reference(inputs: dict) -> torch.Tensor:
    """Per-group fp32 matmuls on the inputs' device (fp64 on the CPU)."""
    op, a, b, s = inputs["op"], inputs["a"], inputs["b"], inputs["sizes"]
    dt = torch.float32 if a.device.type == "cuda" else torch.float64
    if op == "wgrad":
        return reference_wgrad(a, b, s, dtype=dt)
    return _reference(a, b, s, trans_w=(op == "dgrad"), dtype=dt)


def flops(shape: dict) -> int:
    return _flops(int(shape["B"]) * int(shape["M"]), int(shape["N"]), int(shape["K"]))


def bytes_moved(shape: dict, dtype: torch.dtype) -> int:
    op, _ = _decode(shape)
    B = int(shape["B"])
    return _bytes_moved(op, B * int(shape["M"]), B, int(shape["N"]), int(shape["K"]),
                          elem_bytes=element_size(dtype))


def derived(shape: dict, dtype: torch.dtype, params: dict) -> dict:
    """smem_bytes of a config (operand stages + epilogue staging), for spec constraints."""
    d = default_config("fwd")
    cfg = dataclasses.replace(d, BLOCK_M=params.get("block_m") or d.BLOCK_M, BLOCK_N=params.get("block_n") or d.BLOCK_N,
                              BLOCK_K=params.get("block_k") or d.BLOCK_K,
                              num_stages=params.get("num_stages") or d.num_stages,
                              EPI_SUBTILE=params.get("epi_subtile", "auto") in ("auto", True))
    return {"smem_bytes": smem_bytes(cfg, element_size(dtype)), "SMEM_LIMIT": smem_per_block(90)}


def label(params: dict) -> str:
    parts = [f"{k}={v}" for k, v in params.items() if v not in (0, "auto", None)]
    return ",".join(parts) or "table"


def _baseline(name: str) -> Callable[[dict], torch.Tensor]:
    def call(inputs: dict) -> torch.Tensor:
        return run_backend(name, inputs["op"], inputs["a"], inputs["b"], inputs["sizes"],
                           offs=inputs["offs"], host_sizes=inputs["host_sizes"])
    call.__name__ = f"baseline_{name}"
    return call


def _autotune_baseline(inputs: dict) -> torch.Tensor:
    return autotuned(inputs["op"], inputs["a"], inputs["b"], inputs["sizes"],
                     offs=inputs["offs"], host_sizes=inputs["host_sizes"])


baselines = {"grouped_mm": _baseline("grouped_mm"), "cublas_loop": _baseline("cublas_loop"),
             "autotune": _autotune_baseline}
