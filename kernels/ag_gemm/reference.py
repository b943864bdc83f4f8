"""The torch reference: gather the shards the way each convention means, then one
fp32 (fp64 on CPU) product."""
from __future__ import annotations

import torch


def gather(shards: list[torch.Tensor], gather_dim: int) -> torch.Tensor:
    """A from every rank's shard: rows stacked (gather_dim=0) or column blocks (gather_dim=1)."""
    if gather_dim not in (0, 1):
        raise ValueError(f"gather_dim must be 0 or 1, got {gather_dim!r}")
    return torch.cat(shards, dim=gather_dim)


def reference(shards: list[torch.Tensor], b: torch.Tensor, gather_dim: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """C = gather(shards) @ b (+ bias) in higher precision (fp64 on CPU, fp32 without tf32 on a GPU)."""
    A = gather(shards, gather_dim)
    hi = torch.float64 if A.device.type == "cpu" else torch.float32
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        c = A.to(hi) @ b.to(hi)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    if bias is not None:
        c = c + bias.to(hi)
    return c


def tolerance(dtype: torch.dtype, K: int) -> tuple[float, float]:
    """(atol, rtol) for C of inputs drawn from N(0, 1): errors grow like sqrt(K) * eps."""
    eps = {torch.bfloat16: 2 ** -8, torch.float16: 2 ** -11, torch.float32: 2 ** -10}[dtype]  # fp32: tf32 on GPUs
    return 4 * eps * K ** 0.5, 2 * eps
