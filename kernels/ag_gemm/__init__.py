"""Fused all-gather + GEMM (seed 000): fetcher and GEMM programs, a staging buffer, per-tile flags."""
from kernels.ag_gemm.config import AgGemmConfig, auto_config, auto_source
from kernels.ag_gemm.launch import AgGemmTimeout, all_gather_matmul, check, prepare, recover
from kernels.ag_gemm.reference import reference

__all__ = ["AgGemmConfig", "AgGemmTimeout", "all_gather_matmul", "auto_config", "auto_source", "check",
           "prepare", "recover", "reference"]
