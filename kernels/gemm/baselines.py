"""The library baseline a user would otherwise call: cuBLAS through torch."""
from __future__ import annotations

import torch


def cublas(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The library baseline: ``torch.matmul`` (cuBLAS on a CUDA device)."""
    return torch.matmul(a, b, out=out) if out is not None else torch.matmul(a, b)


