"""The fused kernel cross-compiled without a GPU (sm_90, gfx942, ...), for reading
its remote loads and flag protocol, and for the trace-off check."""
from __future__ import annotations

import torch

from kernels.ag_gemm.config import AgGemmConfig
from kernels.ag_gemm.launch import constexprs as launch_constexprs
from workbench.dtypes import triton_type

SIGNATURE = {"a_ptr": "*{t}", "pub_ptr": "*{t}", "stg_ptr": "*{t}", "b_ptr": "*{t}", "bias_ptr": "*{t}",
             "c_ptr": "*{t}", "heap_bases": "*i64", "sig_ptr": "*i32", "flags_ptr": "*i32", "state_ptr": "*i32",
             "status_ptr": "*i32", "trace_ptr": "*i64", "S_M": "i32", "S_K": "i32", "N": "i32", "stride_bk": "i32",
             "stride_cm": "i32", "rank": "i32", "timeout_us": "i32", "pub_off16": "i32"}
POINTERS = [k for k, v in SIGNATURE.items() if v.startswith("*")]


def constexprs(config: AgGemmConfig, *, world_size: int = 2, gather_dim: int = 1, dtype=torch.bfloat16,
               trace: bool = False, clock: str = "globaltimer", bias: bool = False, phases=(True, True, True),
               wait_ready: bool = False, fetchers: int | None = None, even_k: bool = True,
               tma: bool = False, resident: bool = False, chunk_tiles: int = 0) -> dict:
    """The constexprs of a single-launch (GPU) call: shapes whose rows hold whole 16-byte vectors
    (``tma``: the GEMM programs' TMA loads, as the launcher picks them on NVIDIA GPUs;
    ``resident``: the shard lies in the heap, read by the peers in place; ``chunk_tiles``: the
    pipelined variant's chunk waits and tile order)."""
    publish, fetch, compute = phases
    esize = torch.tensor([], dtype=dtype).element_size()
    kw = launch_constexprs(config, world_size, gather_dim, esize, config.fetchers if fetchers is None else fetchers,
                           has_bias=bias, trace=trace, clock=clock, max_events=512, even_k=even_k, aligned_m=True,
                           aligned_n=True, tma=tma, proxy_fence=tma and clock == "globaltimer",
                           claim=config.claim_tiles, join=True, resident=resident, end_wait=resident,
                           chunk_tiles=chunk_tiles)
    # stride_bn = 1 as at run time (Triton specializes integer arguments equal to 1)
    return dict(kw, stride_bn=1, PUBLISH=publish, FETCH=fetch, COMPUTE=compute, WAIT_READY=wait_ready)


def compile_kernel(target: str = "sm90", *, cache_dir, config: AgGemmConfig | None = None, kernel=None,
                   **kw):
    """Cross-compile the fused kernel for `target`; returns the `workbench.asm.cache.Entry`.

    ``kw`` go to `constexprs` (world_size, gather_dim, dtype, trace, bias, phases, ...).
    The clock follows the target (``%globaltimer`` on NVIDIA, ``s_memtime`` on AMD).
    ``kernel`` swaps in another jitted function of the same signature (the trace-off
    check compiles a copy of the kernel with the trace code deleted).
    """
    from kernels.ag_gemm.triton import _ag_gemm_kernel
    from workbench.asm.compile import cross_compile

    config = config or AgGemmConfig()
    dtype = kw.get("dtype", torch.bfloat16)
    kw.setdefault("clock", "memtime" if target.startswith("gfx") else "globaltimer")
    kw.setdefault("tma", not target.startswith("gfx") and kw.get("dtype", torch.bfloat16).itemsize == 2)
    ty = triton_type(dtype)
    sig = {k: v.format(t=ty) for k, v in SIGNATURE.items()}
    (entry,) = cross_compile(kernel or _ag_gemm_kernel, [target], signature=sig, constexprs=constexprs(config, **kw),
                             divisible=POINTERS + ["S_M", "S_K", "N", "stride_bk", "stride_cm"],
                             num_warps=config.num_warps, num_stages=config.num_stages, cache_dir=cache_dir)
    return entry
