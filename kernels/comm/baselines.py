"""The library baseline a user would otherwise call: NCCL's all-gather."""
from __future__ import annotations

import torch


def nccl_all_gather(x: torch.Tensor, heap, out: torch.Tensor | None, out_shape) -> torch.Tensor:
    """``torch.distributed.all_gather_into_tensor`` (rank-major rows, like ``all_gather``)."""
    import torch.distributed as dist

    if heap.simulated or not dist.is_initialized():
        raise ValueError("all_gather: variant 'nccl' needs an initialized torch.distributed process group "
                         "(a SymmetricHeap under torchrun); a simulated world has none")
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=heap.group)
    return out
