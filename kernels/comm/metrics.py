"""Counts for the all-gather benchmarks: bytes on the links and nccl-tests' bandwidths."""
from __future__ import annotations

import torch

from workbench.dtypes import element_size


def bus_bandwidth_gbps(bytes_per_rank: int, world_size: int, ms: float) -> tuple[float, float]:
    """(algBW, busBW) in GB/s as nccl-tests defines them for all-gather.

    algBW = total gathered bytes / time; busBW = algBW * (n - 1) / n.
    """
    total = bytes_per_rank * world_size
    alg = total / (ms * 1e-3) / 1e9
    return alg, alg * (world_size - 1) / world_size

