"""Sweep protocol (``workbench sweep experiments/ag_gemm.yaml``) for all_gather_matmul.

A point's shape is the gathered problem ``{M, N, K, gather_dim}`` (``gather_dim``
0: M/W rows per rank; 1: K/W columns per rank). Under torchrun each rank runs its
own call on a `SymmetricHeap`; without a process group (CPU) every rank of a
simulated world runs in this process (interpreter: tiny shapes only) and ``run``
returns every rank's C stacked.
"""
from __future__ import annotations

from typing import Any

import torch

from kernels.ag_gemm.config import AgGemmConfig
from kernels.ag_gemm.launch import all_gather_matmul, recover as _recover
from kernels.ag_gemm.metrics import flops as _flops, gathered_bytes, gemm_bytes
from kernels.ag_gemm.reference import reference as _reference

PARAMS = {"variant": "fused", "fetchers": 16, "block_m": 128, "block_n": 256, "block_k": 64, "k_per_flag": 8,
          "layout": "k", "num_stages": 3, "num_warps": 8, "num_sms": None, "group_m": 8, "tma": True, "bias": False}
WORLD_SIZES = (2, 3, 4, 8)
SIM_WORLD = 2
_HEAP: dict[str, Any] = {}


class Inputs:
    def __init__(self, shape, dtype, seed, W, shards, b, bias, heaps, world=None):
        self.shape, self.dtype, self.seed, self.world_size = shape, dtype, seed, W
        self.shards, self.b, self.bias, self.heaps, self.world = shards, b, bias, heaps, world
        M, N = int(shape["M"]), int(shape["N"])
        self.outs = [torch.empty((M, N), dtype=dtype, device=b.device) for _ in shards]  # C, poisoned by poison()


def _dims(shape: dict, W: int) -> tuple[int, int, int, int, int, int]:
    M, N, K, gd = (int(shape[k]) for k in ("M", "N", "K", "gather_dim"))
    if (gd == 0 and M % W) or (gd == 1 and K % W):
        raise ValueError(f"ag_gemm sweep: {'M' if gd == 0 else 'K'} must be a multiple of the world size {W}")
    S_M, S_K = (M // W, K) if gd == 0 else (M, K // W)
    return M, N, K, gd, S_M, S_K


def shard(S_M: int, S_K: int, dtype, seed: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s random shard: the same on any machine for the same seed."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randn((S_M, S_K), generator=g).to(dtype)


def _b_and_bias(K: int, N: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed * 7919 + 17)
    return torch.randn((K, N), generator=g).to(dtype), torch.randn((N,), generator=g).to(dtype)


def _world_size(shape: dict) -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(shape.get("world", SIM_WORLD))


def make_inputs(shape: dict, dtype: torch.dtype, device: str, seed: int) -> Inputs:
    import torch.distributed as dist

    W = _world_size(shape)
    M, N, K, gd, S_M, S_K = _dims(shape, W)
    b, bias = _b_and_bias(K, N, dtype, seed)
    need = (W + 1) * S_M * S_K * dtype.itemsize + (4 << 20)
    if dist.is_initialized() and device == "cuda":
        from workbench.dist import SymmetricHeap

        heap = _HEAP.get("heap")
        if heap is None or heap.nbytes < need:
            _HEAP.clear()
            heap = _HEAP["heap"] = SymmetricHeap(need)
        else:
            heap.reset()
        dev = heap.device
        return Inputs(shape, dtype, seed, W, [shard(S_M, S_K, dtype, seed, heap.rank).to(dev)], b.to(dev),
                      bias.to(dev), [heap])
    from workbench.dist import SimulatedWorld

    world = SimulatedWorld(W, heap_bytes=need)
    return Inputs(shape, dtype, seed, W, [shard(S_M, S_K, dtype, seed, r) for r in range(W)], b, bias,
                  world.heaps, world)


def _config(params: dict) -> AgGemmConfig:
    p = {**PARAMS, **params}
    p.pop("bias")
    return AgGemmConfig(**p)


def run(inputs: Inputs, **params) -> torch.Tensor:
    bias = inputs.bias if params.get("bias") else None
    cfg = _config(params)
    gd = int(inputs.shape["gather_dim"])
    if inputs.world is None:
        return all_gather_matmul(inputs.shards[0], inputs.b, inputs.heaps[0], gather_dim=gd, bias=bias, config=cfg,
                                 out=inputs.outs[0])
    return torch.stack(inputs.world.run(lambda h: all_gather_matmul(
        inputs.shards[h.rank], inputs.b, h, gather_dim=gd, bias=bias, config=cfg, out=inputs.outs[h.rank]).clone()))


def reference(inputs: Inputs) -> torch.Tensor:
    M, N, K, gd, S_M, S_K = _dims(inputs.shape, inputs.world_size)
    shards = [shard(S_M, S_K, inputs.dtype, inputs.seed, r) for r in range(inputs.world_size)]
    ref = _reference(shards, inputs.b.cpu(), gd).float()
    if inputs.world is None:
        return ref.to(inputs.b.device)
    return ref.expand(inputs.world_size, *ref.shape).clone()


def poison(inputs: Inputs) -> None:
    """NaN into C and into the staging buffers of every plan made so far."""
    for o in inputs.outs:
        o.fill_(float("nan"))
    for h in inputs.heaps:
        for plan in h.cache("ag_gemm").get("_shared", {}).get("plans", {}).values():
            if plan.stg is not None:
                plan.stg.fill_(float("nan"))


def recover(inputs: Inputs) -> None:
    for h in inputs.heaps:
        _recover(h)


def flops(shape: dict) -> int:
    return _flops(int(shape["M"]), int(shape["N"]), int(shape["K"]))


def bytes_moved(shape: dict, dtype: torch.dtype) -> int:
    """The GEMM's fewest bytes plus what each rank receives from its peers."""
    M, N, K = (int(shape[k]) for k in ("M", "N", "K"))
    es = dtype.itemsize
    return gemm_bytes(M, N, K, es) + gathered_bytes(M, K, _world_size(shape), es)


def tolerance(dtype: torch.dtype) -> float:
    return {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-3}.get(dtype, 1e-2)


def label(params: dict) -> str:
    p = {**PARAMS, **params}
    tile = f"{p['block_m']}x{p['block_n']}x{p['block_k']}"
    return f"{p['variant']} f{p['fetchers']} {tile} kpf{p['k_per_flag']} {p['layout']}" + ("" if p["tma"] else " ptr")


def _nccl_cublas(inputs: Inputs) -> torch.Tensor:
    from kernels.ag_gemm.baselines import NcclCublas

    if inputs.world is not None:
        raise ValueError("ag_gemm: the NCCL baseline needs a torch.distributed process group (torchrun)")
    return NcclCublas(inputs.shards[0], inputs.world_size, int(inputs.shape["gather_dim"]))(inputs.shards[0], inputs.b)


def _torch_fused(inputs: Inputs) -> torch.Tensor:
    import torch.distributed as dist

    from kernels.ag_gemm.baselines import TorchFused, torch_fused_available

    if inputs.world is not None or not torch_fused_available():
        raise ValueError("ag_gemm: torch.ops.symm_mem.fused_all_gather_matmul needs torchrun on CUDA GPUs")
    return TorchFused(dist.group.WORLD.group_name, int(inputs.shape["gather_dim"]))(inputs.shards[0], inputs.b)


baselines = {"nccl_cublas": _nccl_cublas, "torch_fused": _torch_fused,
             "sequential": lambda inputs: run(inputs, variant="sequential")}
__all__ = ["PARAMS", "WORLD_SIZES", "make_inputs", "run", "reference", "poison", "recover", "flops", "bytes_moved",
           "tolerance", "label", "baselines"]
