"""The ``workbench sweep`` protocol of the fused GEMM + all-scatter.

Shapes are global: ``{M, N, K}`` (C is M x N; each rank computes N / W
columns), plus ``world`` for the simulated world's size on a machine without
a process group. Under ``torch.distributed`` (a sweep world) every rank makes
its own operands on a symmetric heap; without one, all ranks run in a
``SimulatedWorld`` in this process (interpreter) and ``run`` returns every
rank's C stacked (W, M, N). The one-command GPU study is
``experiments/run_gemm_scatter.py``; this module lets a YAML sweep time the
kernel too.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from kernels.gemm_scatter.baselines import gemm_then_all_gather
from kernels.gemm_scatter.config import PARAMS as _CONFIG_PARAMS, ScatterConfig
from kernels.gemm_scatter.launch import gemm_all_scatter, out_buffer
from kernels.gemm_scatter.metrics import flops as _flops, hbm_bytes_per_gpu
from kernels.gemm_scatter.reference import reference as _reference
from workbench.dtypes import element_size

PARAMS = {**_CONFIG_PARAMS, "hints": True}
WORLD_SIZES = (2, 3, 4, 8)
SIM_WORLD = 2  # ranks of the simulated world when no process group exists (CPU)


class Inputs:
    """One point's operands: A, this rank's (GPU) or every rank's (simulated) block of B, and heaps."""

    def __init__(self, shape, dtype, seed, world_size, a, bs, heaps, world=None):
        self.shape, self.dtype, self.seed, self.world_size = shape, dtype, seed, world_size
        self.a, self.bs, self.heaps, self.world = a, bs, heaps, world
        self.checked: set = set()


def operands(M: int, N: int, K: int, W: int, dtype: torch.dtype, seed: int):
    """A and every rank's (K, N / W) block of B, the same on any machine for the same seed
    (scaled so C ~ N(0, 1))."""
    g = torch.Generator().manual_seed(seed * 7919 + M * 31 + N * 17 + K)
    a = torch.randn((M, K), generator=g).to(dtype)
    bs = [(torch.randn((K, N // W), generator=g) / math.sqrt(K)).to(dtype) for _ in range(W)]
    return a, bs


def _world_size(shape: Mapping[str, Any]) -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_initialized() else int(shape.get("world", SIM_WORLD))


def _mnk(shape) -> tuple[int, int, int]:
    return int(shape["M"]), int(shape["N"]), int(shape["K"])


def make_inputs(shape: Mapping[str, Any], dtype: torch.dtype, device: str, seed: int) -> Inputs:
    import torch.distributed as dist

    M, N, K = _mnk(shape)
    W = _world_size(shape)
    if N % W:
        raise ValueError(f"gemm_scatter sweep: N={N} is not a multiple of the world size {W}")
    a, bs = operands(M, N, K, W, dtype, seed)
    need = 3 * M * N * element_size(dtype) + (1 << 20)  # C, the all-gather baseline's buffer, slack
    if dist.is_initialized() and device == "cuda":
        from kernels.comm.sweep import process_heap

        heap = process_heap(need)
        out_buffer(heap, M, N, dtype)
        r = heap.rank
        return Inputs(shape, dtype, seed, W, a.to(heap.device), [bs[r].to(heap.device)], [heap])
    from workbench.dist import SimulatedWorld

    world = SimulatedWorld(W, heap_bytes=need + (1 << 16))
    for h in world.heaps:
        out_buffer(h, M, N, dtype)
    return Inputs(shape, dtype, seed, W, a, bs, world.heaps, world)


def run(inputs: Inputs, hints: bool = True, **config) -> torch.Tensor:
    """The fused call of the point; simulated: every rank's C stacked (W, M, N)."""
    cfg = ScatterConfig(**config) if config else None
    # Read the wait-status word (a host sync) on a configuration's first, checked call only.
    key = (hints, tuple(sorted(config.items())))
    check = key not in inputs.checked
    inputs.checked.add(key)
    if inputs.world is None:
        return gemm_all_scatter(inputs.a, inputs.bs[0], inputs.heaps[0], config=cfg, hints=hints, check=check)
    return torch.stack(inputs.world.run(
        lambda h: gemm_all_scatter(inputs.a, inputs.bs[h.rank], h, config=cfg, hints=hints, check=check).clone()))


def reference(inputs: Inputs) -> torch.Tensor:
    M, N, K = _mnk(inputs.shape)
    a, bs = operands(M, N, K, inputs.world_size, inputs.dtype, inputs.seed)
    full = _reference(a, bs)
    if inputs.world is None:
        return full.to(inputs.a.device)
    return full.expand(inputs.world_size, *full.shape).clone()


def poison(inputs: Inputs) -> None:
    """Fill every rank's C with 0xFF bytes (NaN) before the checked run."""
    for h in inputs.heaps:
        for name, t in h._named.items():
            if name.startswith("gemm_scatter.out"):
                t.view(torch.uint8).fill_(0xFF)


def recover(inputs: Inputs) -> None:
    """After a point failed on some rank (every rank calls this, together): zero the flags (and
    the senders' band counters: ``launch.recover``)."""
    from kernels.gemm_scatter.launch import recover as _recover

    for h in inputs.heaps:
        _recover(h)


def flops(shape: Mapping[str, Any]) -> int:
    return _flops(shape)


def bytes_moved(shape: Mapping[str, Any], dtype: torch.dtype) -> int:
    """Per GPU: A and B_local read once, all of C written once."""
    M, N, K = _mnk(shape)
    return int(hbm_bytes_per_gpu({"M": M, "N": N, "K": K, "world_size": _world_size(shape)}, element_size(dtype)))


def tolerance(dtype: torch.dtype) -> float:
    return {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-3}[dtype]


def label(params: Mapping[str, Any]) -> str:
    cfg = ScatterConfig(**{k: v for k, v in params.items() if k in _CONFIG_PARAMS})
    return cfg.label() + ("" if params.get("hints", True) else " nohint")


def _baseline(inputs: Inputs, gemm: str, gather: str) -> torch.Tensor:
    if inputs.world is None:
        return gemm_then_all_gather(inputs.a, inputs.bs[0], inputs.heaps[0], gemm=gemm, gather=gather)
    return torch.stack(inputs.world.run(
        lambda h: gemm_then_all_gather(inputs.a, inputs.bs[h.rank], h, gemm=gemm, gather=gather).clone()))


baselines = {
    "cublas+nccl": lambda inputs: _baseline(inputs, "cublas", "nccl"),
    "triton+all_gather": lambda inputs: _baseline(inputs, "triton", "triton"),
}
