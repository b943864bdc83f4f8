"""MXFP4 mixture-of-experts down-projection (seed 004's "gemm2") for Hopper."""
from .config import MoeMxfp4Config, block_m_for, config_for_block_m, default_config
from .launch import dequantize_weights_bf16, moe_mxfp4_down
from .quant import (Mxfp4Weights, dequantize_mxfp4, prepack_mxfp4, prepare_weights, quantize_mxfp4,
                    unprepack_mxfp4)
from .reference import reference, reference_rows
from .routing import Routing, prepare_routing

__all__ = ["MoeMxfp4Config", "Mxfp4Weights", "Routing", "block_m_for", "config_for_block_m", "default_config",
           "dequantize_mxfp4", "dequantize_weights_bf16", "moe_mxfp4_down", "prepack_mxfp4", "prepare_routing",
           "prepare_weights", "quantize_mxfp4", "unprepack_mxfp4", "reference", "reference_rows"]
