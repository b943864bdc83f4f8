"""FLOP and byte counts of a GEMM, for the benchmarks and the roofline."""
from __future__ import annotations

from typing import Mapping

import torch

from workbench.dtypes import element_size


def _mnk(shape: Mapping[str, int]) -> tuple[int, int, int]:
    return int(shape["M"]), int(shape["N"]), int(shape["K"])


def flops(shape: Mapping[str, int]) -> int:
    M, N, K = _mnk(shape)
    return 2 * M * N * K


def bytes_moved(shape: Mapping[str, int], dtype: torch.dtype = torch.bfloat16) -> int:
    M, N, K = _mnk(shape)
    es = element_size(dtype)
    return (M * K + K * N + M * N) * es




def tolerance(dtype: torch.dtype) -> float:
    """Largest accepted ||C - ref|| / ||ref|| (C rounded to dtype; tf32 for fp32)."""
    return {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-3}[dtype]
