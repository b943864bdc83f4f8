"""FLOP and byte counts of the fused GEMM + all-scatter, and its roofline bounds.

Per GPU: the GEMM of its column block (``2 * M * (N / W) * K`` FLOPs), reading
A and B_local once and receiving all of C into its HBM (``M * N`` elements);
on the links it sends its block of C to each of the other ``W - 1`` ranks.
"""
from __future__ import annotations

from typing import Mapping


def _shape(shape: Mapping[str, int]) -> tuple[int, int, int, int]:
    W = int(shape.get("world_size", 1))
    return int(shape["M"]), int(shape["N"]), int(shape["K"]), W


def flops(shape: Mapping[str, int]) -> int:
    """The whole product's FLOPs, 2 * M * N * K (the seed's TFLOP/s counts N globally)."""
    M, N, K, _ = _shape(shape)
    return 2 * M * N * K


def flops_per_gpu(shape: Mapping[str, int]) -> float:
    M, N, K, W = _shape(shape)
    return 2 * M * (N / W) * K


def hbm_bytes_per_gpu(shape: Mapping[str, int], esize: int = 2) -> float:
    """A and B_local read once, all of C written (the local block and the W - 1 received ones)."""
    M, N, K, W = _shape(shape)
    return (M * K + K * N / W + M * N) * esize


def link_bytes_per_gpu(shape: Mapping[str, int], esize: int = 2) -> float:
    """Bytes each GPU sends over NVLink: its (M, N / W) block to each of the W - 1 peers."""
    M, N, K, W = _shape(shape)
    return (W - 1) * M * (N / W) * esize


def bounds_us(shape: Mapping[str, int], ceilings: Mapping[str, float], esize: int = 2) -> dict[str, float]:
    """Lower bounds on one call's time (us) from each ceiling: ``mma`` (``tflops``),
    ``hbm`` (``hbm_gbps``), ``nvlink`` (``link_gbps``, per GPU outbound)."""
    out = {"mma": flops_per_gpu(shape) / (ceilings["tflops"] * 1e6),
           "hbm": hbm_bytes_per_gpu(shape, esize) / (ceilings["hbm_gbps"] * 1e3)}
    link = ceilings.get("link_gbps")
    out["nvlink"] = link_bytes_per_gpu(shape, esize) / (link * 1e3) if link else 0.0
    return out


def bottleneck(shape: Mapping[str, int], ceilings: Mapping[str, float], esize: int = 2) -> str:
    """The ceiling that bounds this shape hardest: "mma", "hbm" or "nvlink"."""
    b = bounds_us(shape, ceilings, esize)
    return max(b, key=b.get)
