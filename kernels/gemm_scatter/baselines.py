"""The baselines a user would otherwise run: a GEMM, then an all-gather of the
column blocks, then the blocks put in their columns.

An all-gather (``torch.distributed.all_gather_into_tensor`` or
``kernels.comm.all_gather``) concatenates the ranks' (M, N / W) blocks along
rows, rank-major: (W * M, N / W). C wants them side by side along columns, so
the gathered tensor is permuted: ``(W, M, n) -> (M, W, n) -> (M, W * n)``
(``column_blocks``); one copy kernel, which the baselines pay.
"""
from __future__ import annotations

import contextlib

import torch


def column_blocks(gathered: torch.Tensor, world_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """C (M, W * n) from rank-major gathered blocks (W * M, n): rank r's block in columns r*n:(r+1)*n."""
    rows, n = gathered.shape
    if rows % world_size:
        raise ValueError(f"column_blocks: {rows} gathered rows are not world_size={world_size} blocks")
    M = rows // world_size
    blocks = gathered.view(world_size, M, n).permute(1, 0, 2)
    if out is None:
        return blocks.reshape(M, world_size * n)
    out.view(M, world_size, n).copy_(blocks)
    return out


def gemm_then_all_gather(a: torch.Tensor, b_local: torch.Tensor, heap, *, gemm: str = "cublas",
                         gather: str = "nccl", out: torch.Tensor | None = None) -> torch.Tensor:
    """C on every rank the unfused way: GEMM of the local block, all-gather, permute.

    ``gemm``: "cublas" (``torch.matmul``) or "triton" (``kernels.gemm.matmul``);
    ``gather``: "nccl" (``all_gather_into_tensor``, needs torch.distributed) or
    "triton" (``kernels.comm.all_gather`` over ``heap``).
    """
    from kernels.comm import all_gather

    if gemm == "cublas":
        c_local = torch.matmul(a, b_local)
    elif gemm == "triton":
        from kernels.gemm import matmul

        # a simulated world's ranks are threads of one interpreter: they take turns
        with heap.world._lock if heap.simulated else contextlib.nullcontext():
            c_local = matmul(a, b_local)
    else:
        raise ValueError(f"gemm_then_all_gather: gemm must be 'cublas' or 'triton', got {gemm!r}")
    W = heap.world_size
    if gather == "nccl":
        gathered = all_gather(c_local, heap, variant="nccl")
    elif gather == "triton":
        gathered = all_gather(c_local, heap, variant="triton")
    else:
        raise ValueError(f"gemm_then_all_gather: gather must be 'nccl' or 'triton', got {gather!r}")
    return column_blocks(gathered, W, out)


def gemm_alone(a: torch.Tensor, b_local: torch.Tensor, *, gemm: str = "cublas") -> torch.Tensor:
    """The floor: this rank's GEMM with no communication at all."""
    if gemm == "cublas":
        return torch.matmul(a, b_local)
    from kernels.gemm import matmul

    return matmul(a, b_local)
