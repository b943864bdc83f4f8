"""Fused GEMM + all-scatter (seed 002, iris example 23 ``gemm_all_scatter``).

Every rank holds A (M, K) and its column block ``b_local`` = B[:, r*n:(r+1)*n]
(n = N / W); ``gemm_all_scatter(a, b_local, heap)`` leaves the whole
C = A @ B (M, N) on every rank. One persistent Triton kernel per rank: each
program walks output tiles of ``A @ b_local`` (``kernels.gemm``'s grouped tile
order), and its epilogue stores the finished tile from the accumulator
registers into every rank's C at this rank's column offset, destinations
staggered ``(rank + i) % W``, through a pointer translated onto the peer's heap
(``kernels.comm.remote``) with the 16-byte alignment re-stated (``hints``): the
seed's ``hint=(1, BLOCK_N)``, which turns 16-bit scalar stores into 128-bit
ones (SASS ``STG.E.128``, gfx942 ``global_store_dwordx4``).

Small M (up to ``kernels.gemm``'s SMALL_M): a second kernel cuts each tile's K
range into pieces (``split_k``) computed with swapped operands (``swap_ab``), the
GEMM family's split-K pieces; the pieces meet in an fp32 workspace and the one
that completes a tile scatters it. The heuristic takes the GEMM family's choice
of tile, pieces and swap there, and runs the same kernel (64x128 tiles, no swap)
for long reductions with few tiles up to MID_M rows (``config.heuristic``).

Completion: after its last tile each program adds 1 to its rank's slot in
every rank's flag array (stores, CTA barrier, release atomic at system scope);
program 0 then waits (acquire, bounded) until every slot reached the running
total of programs launched so far, kept on the device so CUDA-graph replays
stay right. C is complete on every rank when the kernel ends on the stream. A
peer that never signals surfaces as ``WaitTimeout`` naming the rank at the next
call or at ``check_gemm_all_scatter(heap)``, without a host sync per call.

The seed's two overlap optimizations are switches of ``ScatterConfig``:
``from_registers`` (scatter from the accumulator, vs store C locally and copy
it to the peers, the seed's first version) and ``num_stages`` (the pipeline
depth). A and B come through TMA descriptors on sm_90 (``tma_loads``). A
Hopper TMA-store epilogue is not built: it would need a descriptor per peer's
C (built on the host from the peer mappings) and a staging buffer in shared
memory taken from the pipeline; the stores from registers are what the seed
measured, and what the hints study is about.

Variants (``ScatterConfig.variant``): ``"fused"`` (the above), ``"senders"``
(the GEMM programs store each tile into this rank's own C only and count it per
row band; a few sending programs push each band to the peers once its tiles are
all in, while the GEMM goes on with later bands: the sends leave the GEMM's SMs
and overlap its later waves), and the unfused ``"nccl"`` (cuBLAS, NCCL's
all-gather, the permute) and ``"sequential"`` (our GEMM and all-gather). With
``config=None``, ``config.auto_config`` decides (a measured table, else the tile
rule with the fused kernel), on rank 0, shared with every rank
(``kernels.comm.decide``). After a timeout, ``recover(heap)`` on every rank.

Parts: ``triton`` (the kernel), ``config`` (``ScatterConfig``, the tile rule),
``launch`` (``gemm_all_scatter``, plans cached per call signature),
``reference``, ``baselines`` (GEMM then all-gather then permute; GEMM alone),
``metrics`` (FLOPs, bytes, roofline bounds).
"""
from kernels.gemm_scatter.baselines import column_blocks, gemm_alone, gemm_then_all_gather
from kernels.gemm_scatter.config import ScatterConfig, auto_config, heuristic, pick_tile
from kernels.gemm_scatter.launch import check_gemm_all_scatter, gemm_all_scatter, out_buffer, recover
from kernels.gemm_scatter.metrics import bottleneck, bounds_us, flops
from kernels.gemm_scatter.reference import reference

__all__ = ["ScatterConfig", "auto_config", "bottleneck", "bounds_us", "check_gemm_all_scatter", "column_blocks",
           "flops", "gemm_all_scatter", "gemm_alone", "gemm_then_all_gather", "heuristic", "out_buffer", "pick_tile",
           "recover", "reference"]
