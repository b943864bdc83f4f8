"""What a user without the fused MXFP4 kernel runs, over the same routing.

1. ``dequant_grouped_gemm``: dequantize the MXFP4 weights to bf16 (all experts:
   which ones are routed to is only known on the GPU), gather the activation
   rows in expert order, our bf16 grouped GEMM (``kernels.moe``), then
   weight each row and sum a token's top_k rows;
2. ``dequant_grouped_mm``: the same with ``torch._grouped_mm`` (CUTLASS on sm_90);
3. ``bf16_grouped_gemm`` / ``bf16_grouped_mm``: bf16 weights kept in memory (no
   dequantization), our grouped GEMM or ``torch._grouped_mm``: the unquantized speed, at four
   times the weight bytes.

4. ``gpt_oss_reference``: the gpt-oss reference implementation's own MoE down-projection (the
   ``gpt-oss`` package's Triton path, ``triton_kernels.matmul_ogs`` with MXFP4 weights in its
   Hopper layout), where that package and ``triton_kernels`` import; else the reason.

``SortedRows`` (made once per routing, outside the timed region, like the
kernel's ``prepare_routing``) holds the expert order of the pairs without
padding, its inverse and the rows per expert.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.moe import grouped_gemm

from .launch import dequantize_weights_bf16
from .quant import dequantize_mxfp4

__all__ = ["SortedRows", "bf16_grouped_gemm", "bf16_grouped_mm", "combine", "dequant_grouped_gemm",
           "dequant_grouped_mm", "gpt_oss_reference", "grouped_gemm_rows", "grouped_mm_rows", "sorted_rows"]


@dataclass(frozen=True)
class SortedRows:
    order: torch.Tensor      # pair indices, expert by expert (stable)
    inverse: torch.Tensor    # position of each pair in `order`
    counts: torch.Tensor     # int32 rows per expert
    offsets: torch.Tensor    # int32 cumulative ends (torch._grouped_mm's offs)
    top_k: int


def sorted_rows(topk_ids: torch.Tensor, num_experts: int) -> SortedRows:
    flat = topk_ids.reshape(-1).long()
    order = torch.sort(flat, stable=True).indices
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    return SortedRows(order, inverse, counts.to(torch.int32), torch.cumsum(counts, 0).to(torch.int32),
                      topk_ids.shape[1])


def combine(y_sorted: torch.Tensor, rows: SortedRows, topk_weights: torch.Tensor) -> torch.Tensor:
    """[pairs, H] rows in expert order -> out [M, H]: weight each pair's row, sum a token's top_k (bf16 bmm,
    fp32 accumulation)."""
    M = topk_weights.shape[0]
    y = y_sorted.index_select(0, rows.inverse).view(M, rows.top_k, -1)
    return torch.bmm(topk_weights.to(y.dtype).unsqueeze(1), y).squeeze(1)


def grouped_gemm_rows(a: torch.Tensor, w_bf16: torch.Tensor, rows: SortedRows) -> torch.Tensor:
    """a [pairs, I] gathered in expert order times w_bf16[e].T ([E, H, I]): our grouped GEMM."""
    return grouped_gemm(a.index_select(0, rows.order), w_bf16, rows.counts, trans_w=True)


def grouped_mm_rows(a: torch.Tensor, w_bf16: torch.Tensor, rows: SortedRows) -> torch.Tensor:
    """The same product with torch._grouped_mm (bf16, CUDA only)."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None or a.device.type != "cuda":
        raise RuntimeError("torch._grouped_mm needs a CUDA build of torch that has it")
    return fn(a.index_select(0, rows.order), w_bf16.transpose(-2, -1), offs=rows.offsets)


def dequant_grouped_gemm(a, w, w_scale, rows: SortedRows, topk_weights, *, w_bf16_buf=None) -> torch.Tensor:
    wb = dequantize_weights_bf16(w, w_scale, out=w_bf16_buf)
    return combine(grouped_gemm_rows(a, wb, rows), rows, topk_weights)


def dequant_grouped_mm(a, w, w_scale, rows: SortedRows, topk_weights, *, w_bf16_buf=None) -> torch.Tensor:
    wb = dequantize_weights_bf16(w, w_scale, out=w_bf16_buf)
    return combine(grouped_mm_rows(a, wb, rows), rows, topk_weights)


def bf16_grouped_gemm(a, w_bf16, rows: SortedRows, topk_weights) -> torch.Tensor:
    return combine(grouped_gemm_rows(a, w_bf16, rows), rows, topk_weights)


def bf16_grouped_mm(a, w_bf16, rows: SortedRows, topk_weights) -> torch.Tensor:
    return combine(grouped_mm_rows(a, w_bf16, rows), rows, topk_weights)


def gpt_oss_reference(w: torch.Tensor, w_scale: torch.Tensor):
    """(factory, note): the gpt-oss reference MoE's down-projection as a peer, or (None, why not).

    Its Triton path (``gpt_oss.triton.moe``) runs the down-projection as
    ``matmul_ogs(x, w2, b2, rdata, scatter_indx=..., precision_config=..., gammas=rdata.gate_scal)``
    on its own MXFP4 layout (``quantize_mx4`` of the bf16 weights [E, I, H]); x holds the pairs'
    rows in expert order (its ``gather_indx``). ``factory(a, topk_ids, topk_weights)`` routes with
    its ``routing`` on logits whose top-k are these ids (their softmax: these weights), outside the
    timed callable it returns (as ``prepare_routing`` is for ours). Its torch path is no peer: its
    MLPBlock keeps bf16 weights and gathers one [H, I] matrix per token and slot. Its API has moved
    between versions: any failure is returned as the note, never raised."""
    try:
        from gpt_oss.triton import moe as go_moe
        from triton_kernels.matmul_ogs import FlexCtx, PrecisionConfig, matmul_ogs
        from triton_kernels.numerics import InFlexData
        from triton_kernels.routing import routing
    except Exception as exc:      # ImportError, or the package failing on this machine's triton
        return None, f"absent: {type(exc).__name__}: {str(exc)[:200]}"
    try:
        E = w.shape[0]
        w2, w2_mx = go_moe.quantize_mx4(dequantize_mxfp4(w, w_scale, torch.bfloat16).transpose(1, 2).contiguous())
        pc = PrecisionConfig(weight_scale=w2_mx, flex_ctx=FlexCtx(rhs_data=InFlexData()))
    except Exception as exc:
        return None, f"imported, but its weights could not be made: {type(exc).__name__}: {str(exc)[:200]}"

    def factory(a: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        M, k = topk_ids.shape
        logits = torch.full((M, E), -1e4, dtype=torch.float32, device=a.device)
        logits.scatter_(1, topk_ids.long(), topk_weights.float().log())
        rdata, gather_indx, scatter_indx = routing(logits.to(a.dtype), k, simulated_ep=1)
        x = a.index_select(0, gather_indx.src_indx.long())

        def run():
            return matmul_ogs(x, w2, None, rdata, scatter_indx=scatter_indx, precision_config=pc,
                              gammas=rdata.gate_scal)
        return run

    return factory, "imported (gpt_oss.triton.moe, triton_kernels)"
