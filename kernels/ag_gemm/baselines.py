"""Library baselines for all-gather + GEMM (GPU, under torchrun).

* ``nccl_cublas``: ``all_gather_into_tensor`` then ``torch.matmul``. NCCL writes the
  shards rank-major along dim 0; for the K-gathered convention the shards are
  column blocks of A, so they are re-laid out (``gathered_a``) before the GEMM
  (concatenating the flat buffer as if it were (M, K) mixes rows of different
  ranks: the mistake in the seed's review thread).
* ``ours_sequential``: our all-gather, then our GEMM (``variant="sequential"``).
* ``torch_fused``: ``torch.ops.symm_mem.fused_all_gather_matmul`` (PyTorch async-TP),
  both conventions (its ``gather_dim``).
* ``gemm_alone``: cuBLAS on the already gathered A: the floor any fusion can reach.
"""
from __future__ import annotations

import torch


def gathered_a(flat: torch.Tensor, world_size: int, gather_dim: int) -> torch.Tensor:
    """A from ``all_gather_into_tensor``'s output (W*S_M, S_K), rank-major rows."""
    if gather_dim == 0:
        return flat
    S_M = flat.shape[0] // world_size
    return flat.view(world_size, S_M, -1).permute(1, 0, 2).reshape(S_M, -1)


class NcclCublas:
    """NCCL all-gather + cuBLAS, buffers allocated once (as a tuned user loop would)."""

    def __init__(self, a_shard: torch.Tensor, world_size: int, gather_dim: int, group=None):
        self.W, self.gather_dim, self.group = world_size, gather_dim, group
        self.flat = torch.empty((world_size * a_shard.shape[0], a_shard.shape[1]), dtype=a_shard.dtype,
                                device=a_shard.device)

    def __call__(self, a_shard, b, bias=None, out=None):
        import torch.distributed as dist

        dist.all_gather_into_tensor(self.flat, a_shard.contiguous(), group=self.group)
        A = gathered_a(self.flat, self.W, self.gather_dim)
        return torch.addmm(bias.to(A.dtype), A, b, out=out) if bias is not None else torch.matmul(A, b, out=out)


def torch_fused_available() -> bool:
    return hasattr(torch.ops, "symm_mem") and hasattr(torch.ops.symm_mem, "fused_all_gather_matmul")


class TorchFused:
    """``torch.ops.symm_mem.fused_all_gather_matmul`` (the gathered A is not returned)."""

    def __init__(self, group_name: str, gather_dim: int):
        import torch.distributed._symmetric_memory as symm_mem

        symm_mem.enable_symm_mem_for_group(group_name)
        self.group_name, self.gather_dim = group_name, gather_dim

    def __call__(self, a_shard, b, bias=None):
        _, (c,) = torch.ops.symm_mem.fused_all_gather_matmul(a_shard, [b], self.gather_dim, self.group_name,
                                                             return_A=False)
        return c + bias if bias is not None else c


def gemm_alone(A: torch.Tensor, b: torch.Tensor, bias=None) -> torch.Tensor:
    return torch.addmm(bias, A, b) if bias is not None else torch.matmul(A, b)
