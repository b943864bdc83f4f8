"""The library baselines a user would otherwise call for a grouped GEMM.

* ``grouped_mm``: ``torch._grouped_mm`` (CUTLASS on sm_90); bf16 only, 16-byte
  aligned strides; offsets are cumulative int32 end offsets, computed on the
  device with ``torch.cumsum`` (no sync);
* ``cublas_loop``: one ``torch.mm`` per expert. It needs the sizes on the host
  (a sync, unless the caller passes ``host_sizes``): a baseline, not a product.

Both compute fwd, dgrad or wgrad from ``(op, a, b, group_sizes)``, with the
layer's weight ``w`` of shape ``[G, K, N]``: fwd ``a = x [M, K]``, ``b = w``;
dgrad ``a = dy [M, N]``, ``b = w`` (``dy @ w[g].T``); wgrad ``a = x``,
``b = dy`` -> ``dw [G, K, N]``. What they cannot run raises ``BackendUnavailable``.
"""
from __future__ import annotations

import torch


class BackendUnavailable(RuntimeError):
    """This backend cannot run these inputs (dtype, layout, device, library)."""


def grouped_mm_offsets(group_sizes: torch.Tensor) -> torch.Tensor:
    """Cumulative int32 end offsets, on the sizes' device (no sync)."""
    return torch.cumsum(group_sizes, 0, dtype=torch.int32)


def grouped_mm(op: str, a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor, *, offs=None,
               **_) -> torch.Tensor:
    """``torch._grouped_mm`` for one op (``offs``: precomputed ``grouped_mm_offsets``)."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        raise BackendUnavailable("this torch has no torch._grouped_mm")
    if a.device.type != "cuda":
        raise BackendUnavailable("torch._grouped_mm runs on CUDA only")
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise BackendUnavailable(f"torch._grouped_mm needs bf16 inputs, got {a.dtype}")
    if offs is None:
        offs = grouped_mm_offsets(group_sizes)
    if op == "fwd":
        mat_a, mat_b = a, b
    elif op == "dgrad":
        mat_a, mat_b = a, b.transpose(-2, -1)
    else:
        mat_a, mat_b = a.t(), b          # [K, M] x [M, N] -> [G, K, N], groups along M
    for t in (mat_a, mat_b):
        if any((s * t.element_size()) % 16 for s in t.stride() if s != 1):
            raise BackendUnavailable(f"torch._grouped_mm needs 16-byte aligned strides, got {t.stride()}")
    try:
        return fn(mat_a, mat_b, offs=offs)
    except RuntimeError as exc:
        raise BackendUnavailable(f"torch._grouped_mm failed: {exc}") from exc


def cublas_loop(op: str, a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor, *, host_sizes=None,
                **_) -> torch.Tensor:
    """One ``torch.mm`` per expert (``host_sizes``: the sizes as a list, else read with a sync)."""
    sizes = host_sizes if host_sizes is not None else [int(s) for s in group_sizes.tolist()]
    G = len(sizes)
    M = a.shape[0]
    if op == "fwd":
        out = torch.empty((M, b.shape[2]), device=a.device, dtype=a.dtype)
    elif op == "dgrad":
        out = torch.empty((M, b.shape[1]), device=a.device, dtype=a.dtype)
    else:
        out = torch.empty((G, a.shape[1], b.shape[1]), device=a.device, dtype=a.dtype)
    start = 0
    for g, m in enumerate(sizes):
        end = start + m
        if op == "fwd":
            if m:
                torch.mm(a[start:end], b[g], out=out[start:end])
        elif op == "dgrad":
            if m:
                torch.mm(a[start:end], b[g].t(), out=out[start:end])
        elif m:
            torch.mm(a[start:end].t(), b[start:end], out=out[g])
        else:
            out[g].zero_()
        start = end
    return out
