"""FLOP and byte counts of an all-gather + GEMM (the benchmarks' denominators)."""
from __future__ import annotations


def flops(M: int, N: int, K: int) -> int:
    """C (M x N) = A (M x K) @ B (K x N): 2*M*N*K on every rank."""
    return 2 * M * N * K


def gathered_bytes(M: int, K: int, world_size: int, esize: int) -> int:
    """Bytes each rank receives from its peers: (W-1)/W of A."""
    return (world_size - 1) * M * K * esize // world_size


def gemm_bytes(M: int, N: int, K: int, esize: int) -> int:
    """The fewest bytes the GEMM moves: A and B read once, C written once."""
    return (M * K + K * N + M * N) * esize


def tflops(M: int, N: int, K: int, ms: float) -> float:
    return flops(M, N, K) / (ms * 1e-3) / 1e12
