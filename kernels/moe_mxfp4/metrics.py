"""FLOP and byte counts of the MXFP4 down-projection (what the benchmarks divide by)."""
from __future__ import annotations

__all__ = ["flops", "hbm_bytes", "mxfp4_bytes"]


def mxfp4_bytes(rows: int, K: int) -> int:
    """Bytes of `rows` MXFP4 rows of length K: K / 2 packed bytes + K / 32 scale bytes each."""
    return int(rows) * (int(K) // 2 + int(K) // 32)


def flops(M: int, top_k: int, H: int, K: int) -> int:
    """Useful FLOPs: 2 * (M * top_k) * H * K (padding rows not counted)."""
    return 2 * int(M) * int(top_k) * int(H) * int(K)


def hbm_bytes(M: int, top_k: int, H: int, K: int, active_experts: int, *, a_fp4: bool = False) -> int:
    """The fewest bytes a down-projection must move through HBM.

    The weights and scales of the experts actually routed to (each read once), the
    activations (one row per (token, slot) pair: bf16, or MXFP4 for a4w4) and the
    bf16 output [M, H] written once. Routing metadata (a few bytes per pair) is left out.
    """
    pairs = int(M) * int(top_k)
    weights = mxfp4_bytes(int(active_experts) * int(H), K)
    acts = mxfp4_bytes(pairs, K) if a_fp4 else 2 * pairs * int(K)
    return weights + acts + 2 * int(M) * int(H)
