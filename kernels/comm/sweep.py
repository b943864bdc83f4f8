"""The ``workbench sweep`` protocol of the all-gather (experiments/all_gather*.yaml)."""
from __future__ import annotations

import math
from typing import Any

import torch

from kernels.comm.launch import all_gather, out_buffer
from workbench.dtypes import element_size

PARAMS = {"variant": "triton", "num_sms": None, "block_m": None, "block_n": None, "num_warps": None,
          "hints": True}
WORLD_SIZES = (2, 3, 4, 8)
SIM_WORLD = 4  # ranks of the simulated world when no process group exists (CPU)
_HEAP: dict[str, Any] = {}


class Inputs:
    """One point's inputs: this rank's shard and heap (GPU), or every rank's (simulated)."""

    def __init__(self, shape: dict, dtype: torch.dtype, seed: int, world_size: int, xs: list, heaps: list,
                 world=None):
        self.shape, self.dtype, self.seed, self.world_size = shape, dtype, seed, world_size
        self.xs, self.heaps, self.world = xs, heaps, world
        self.checked: set = set()  # configurations whose status word was read once already

    @property
    def x(self) -> torch.Tensor:
        return self.xs[0] if self.world is None else self.xs


def shard(M: int, N: int, dtype: torch.dtype, seed: int, rank: int, device="cpu") -> torch.Tensor:
    """Rank `rank`'s random (M, N) shard: the same on any machine for the same seed."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        t = torch.randn((M, N), generator=g, dtype=torch.float32).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, (M, N), generator=g, dtype=torch.int64).to(dtype)
    return t.to(device)


def _world_size(shape: dict) -> int:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_world_size()
    return int(shape.get("world", SIM_WORLD))


def process_heap(nbytes: int):
    """This process's `SymmetricHeap`, grown (collectively) when too small, emptied otherwise."""
    from workbench.dist import SymmetricHeap

    heap = _HEAP.get("heap")
    if heap is None or heap.nbytes < nbytes:
        _HEAP.clear()
        heap = _HEAP["heap"] = SymmetricHeap(nbytes)
    else:
        heap.reset()
    return heap


def make_inputs(shape: dict, dtype: torch.dtype, device: str, seed: int) -> Inputs:
    M, N = int(shape["M"]), int(shape["N"])
    W = _world_size(shape)
    need = W * M * N * element_size(dtype) + (1 << 20)
    import torch.distributed as dist

    if dist.is_initialized() and device == "cuda":
        heap = process_heap(need)
        out_buffer(heap, (W * M, N), dtype)
        return Inputs(shape, dtype, seed, W, [shard(M, N, dtype, seed, heap.rank, heap.device)], [heap])
    from workbench.dist import SimulatedWorld

    world = SimulatedWorld(W, heap_bytes=need + (1 << 16))
    for h in world.heaps:
        out_buffer(h, (W * M, N), dtype)
    return Inputs(shape, dtype, seed, W, [shard(M, N, dtype, seed, r) for r in range(W)], world.heaps, world)


def run(inputs: Inputs, variant: str = "triton", num_sms=None, block_m=None, block_n=None, num_warps=None,
        hints: bool = True) -> torch.Tensor:
    """All-gather of the point; simulated: every rank's output stacked (W, W*M, N)."""
    block = (block_m, block_n) if block_m and block_n else None
    kw = dict(variant=variant, num_sms=num_sms, block=block, hints=hints, num_warps=num_warps)
    # Read the wait-status word (a host sync) on a configuration's first, checked call
    # only: inside timing loops it would time the sync, as experiments/run_all_gather.py avoids.
    key = tuple(sorted(kw.items(), key=lambda kv: kv[0]))
    kw["check"] = key not in inputs.checked
    inputs.checked.add(key)
    if inputs.world is None:
        return all_gather(inputs.xs[0], inputs.heaps[0], **kw)
    return torch.stack(inputs.world.run(lambda h: all_gather(inputs.xs[h.rank], h, **kw).clone()))


def reference(inputs: Inputs) -> torch.Tensor:
    M, N = int(inputs.shape["M"]), int(inputs.shape["N"])
    full = torch.cat([shard(M, N, inputs.dtype, inputs.seed, r) for r in range(inputs.world_size)])
    if inputs.world is None:
        return full.to(inputs.xs[0].device)
    return full.expand(inputs.world_size, *full.shape).clone()


def poison(inputs: Inputs) -> None:
    """Fill every heap output buffer with 0xFF bytes (NaN for floats) before the checked run."""
    for h in inputs.heaps:
        for name, t in h._named.items():
            if name.startswith("all_gather.out"):
                t.view(torch.uint8).fill_(0xFF)


def recover(inputs: Inputs) -> None:
    """After a point failed on some rank (every rank calls this, together): zero the
    flags and running totals, so the next call's waits count from zero everywhere."""
    for h in inputs.heaps:
        h.resync_flags()


def check(out: torch.Tensor, ref: torch.Tensor, dtype) -> tuple[bool, float, str]:
    """Bit-for-bit equality (an all-gather moves bits; it computes nothing)."""
    if tuple(out.shape) != tuple(ref.shape):
        return False, math.nan, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    a = out.contiguous().view(torch.uint8)
    b = ref.to(out.device).contiguous().view(torch.uint8)
    bad = int((a != b).sum())
    return bad == 0, 0.0 if bad == 0 else math.nan, "" if bad == 0 else f"{bad} bytes differ from the concatenation"


def flops(shape: dict) -> int:
    return 0


def bytes_moved(shape: dict, dtype: torch.dtype) -> int:
    """Bytes each rank sends to peers: (W-1) * shard, so GB/s over the time is nccl-tests' busBW."""
    W = _world_size(shape)
    return (W - 1) * int(shape["M"]) * int(shape["N"]) * element_size(dtype)


def tolerance(dtype) -> float:
    return 0.0


baselines = {"nccl": lambda inputs: run(inputs, variant="nccl")}
