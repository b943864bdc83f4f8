"""The torch references of the MoE family: per-group matmuls in higher precision."""
from __future__ import annotations

import contextlib

import torch


def _host_sizes(group_sizes: torch.Tensor) -> list[int]:
    # The reference loops over groups on the host: it reads the sizes (a sync). Not a launch path.
    return [int(s) for s in group_sizes.detach().cpu().tolist()]


@contextlib.contextmanager
def _exact(device: torch.device):
    """tf32 off for CUDA matmuls inside (the fp32 reference must be fp32)."""
    if device.type != "cuda":
        yield
        return
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def reference(x: torch.Tensor, w: torch.Tensor, group_sizes: torch.Tensor, *, trans_w: bool = False,
              dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """Per-group torch matmuls ``x[rows_g] @ w[g]`` (``w[g].T`` with trans_w) in `dtype`
    (fp64 by default; fp32 on CUDA, tf32 off, is fine too)."""
    M = x.shape[0]
    N = w.shape[1] if trans_w else w.shape[2]
    out = torch.zeros((M, N), dtype=dtype, device=x.device)
    start = 0
    with _exact(x.device):
        for g, m in enumerate(_host_sizes(group_sizes)):
            if m:
                wg = w[g].to(dtype)
                out[start:start + m] = x[start:start + m].to(dtype) @ (wg.T if trans_w else wg)
            start += m
    return out


def reference_wgrad(x: torch.Tensor, dy: torch.Tensor, group_sizes: torch.Tensor, *,
                    dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """dw[g] = x_g.T @ dy_g per group in `dtype`; zeros for empty groups."""
    sizes = _host_sizes(group_sizes)
    out = torch.zeros((len(sizes), x.shape[1], dy.shape[1]), dtype=dtype, device=x.device)
    start = 0
    with _exact(x.device):
        for g, m in enumerate(sizes):
            if m:
                out[g] = x[start:start + m].to(dtype).T @ dy[start:start + m].to(dtype)
            start += m
    return out


def tolerance(dtype: torch.dtype) -> float:
    """Largest accepted ||out - ref|| / ||ref|| of a grouped product (fp32 accumulation,
    output rounded to dtype) against ``reference``."""
    return {torch.bfloat16: 1.5e-2, torch.float16: 2e-3}.get(dtype, 1e-4)
