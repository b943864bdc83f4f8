"""The torch reference: dequantize to fp32 (or fp64), one matmul per expert, weighted sum."""
from __future__ import annotations

import torch

from .quant import dequantize_mxfp4

__all__ = ["reference", "reference_rows"]


def reference_rows(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, topk_ids: torch.Tensor,
                   topk_weights: torch.Tensor, *, a_scale: torch.Tensor | None = None,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The weighted rows before the sum over slots: [M, top_k, H] in `dtype`,
    row [t, k] = topk_weights[t, k] * (a[t * top_k + k] @ W[topk_ids[t, k]].T)."""
    M, top_k = topk_ids.shape
    x = dequantize_mxfp4(a, a_scale, dtype) if a_scale is not None else a.to(dtype)
    W = dequantize_mxfp4(w, w_scale, dtype)                     # [E, H, I]
    ids = topk_ids.reshape(-1).long()
    y = torch.zeros((M * top_k, W.shape[1]), dtype=dtype, device=a.device)
    for e in torch.unique(ids).tolist():
        sel = (ids == e).nonzero().squeeze(1)
        y[sel] = x[sel] @ W[e].T
    y = y * topk_weights.reshape(-1, 1).to(dtype)
    return y.reshape(M, top_k, -1)


def reference(a: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, *, a_scale: torch.Tensor | None = None,
              dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """out[t] = sum_k topk_weights[t, k] * (a[t * top_k + k] @ W[topk_ids[t, k]].T), in `dtype`.

    a: bf16 [M * top_k, I], or packed MXFP4 uint8 [M * top_k, I / 2] with a_scale.
    w / w_scale: MXFP4 [E, H, I / 2] / [E, H, I / 32]. Returns [M, H] in `dtype`.
    """
    return reference_rows(a, w, w_scale, topk_ids, topk_weights, a_scale=a_scale, dtype=dtype).sum(1)
