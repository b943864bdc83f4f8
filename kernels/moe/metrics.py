"""FLOP and byte counts of a grouped GEMM, for the benchmarks and the roofline."""
from __future__ import annotations


def flops(total_tokens: int, N: int, K: int) -> int:
    """FLOPs of one grouped GEMM (fwd, dgrad or wgrad alike): 2 * M * N * K."""
    return 2 * int(total_tokens) * int(N) * int(K)


def bytes_moved(op: str, total_tokens: int, G: int, N: int, K: int, elem_bytes: int = 2,
                active_groups: int | None = None) -> int:
    """The fewest bytes an op must move: each operand read once, the result written once.

    (N, K) are the layer's: forward reads x [M, K] and w [G, K, N] and writes
    [M, N]; dgrad reads dy [M, N] and w and writes dx [M, K]; wgrad reads x and
    dy and writes dw [G, K, N]. Experts with no tokens need not read their
    weight in fwd/dgrad (pass active_groups to count that).
    """
    M = int(total_tokens)
    gw = G if active_groups is None else active_groups
    if op in ("fwd", "dgrad"):
        return elem_bytes * (M * K + gw * K * N + M * N)
    if op == "wgrad":
        return elem_bytes * (M * K + M * N + G * K * N)
    raise ValueError(f"op must be fwd, dgrad or wgrad, got {op!r}")
