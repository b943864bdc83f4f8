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


