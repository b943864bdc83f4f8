"""Persistent GEMM in Triton: ``C = A @ B`` with fp32 accumulation.

A is (M, K), B is (K, N), C is (M, N); bf16 and fp16 inputs (fp32 is accepted
too, through the tensor cores' tf32 mode on a GPU). Any M, N, K works, not only
multiples of the tile.

Two kernels share one tile schedule:

* ``_gemm_tma_kernel`` (Hopper, sm_90): A, B and C travel through host-built
  TMA tensor descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``);
  the bulk tensor copy engine zero-fills out-of-range reads and clips
  out-of-range writes, so ragged edges need no masks, and ``tl.dot`` lowers to
  ``wgmma`` (``HGMMA`` in SASS). Used when the device is sm_90+ and every row
  stride is 16-byte aligned (K and N multiples of 8 for 16-bit types).
* ``_gemm_ptr_kernel``: masked pointer loads; for the interpreter
  (``TRITON_INTERPRET=1``), older GPUs and unaligned or strided operands.

Both are persistent: ``num_sms`` programs walk the output tiles with stride
``num_sms``; tiles are visited in GROUP_M-row bands (an L2 swizzle: programs
that run together share A rows and B columns). ``num_sms`` and ``group_m`` are
run-time arguments (not specialised), so sweeping them costs no recompiles.

Every knob is a field of ``GemmConfig``: block_m/n/k, group_m, num_warps,
num_stages, num_sms, tma (descriptor loads or pointer loads), tma_store
(C through a descriptor or plain stores), epilogue_split (store C in 1 or 2
column halves, halving the epilogue's shared-memory buffer), flatten (fuse the
tile and K loops so the pipeline runs across tile boundaries), stream_k
(TMA path: the last, partial round of tiles is split along K over every SM,
see ``stream_k_plan``) and warp_specialize (Triton's automatic Hopper warp specialisation of the tile
loop: it compiles, 12 warps with setmaxnreg, but hung on an H200 with Triton
3.6, so ``matmul`` refuses it on a GPU unless WORKBENCH_ALLOW_WS=1).

Config heuristic (``heuristic``), derived from the H200 sweep in
``results/gemm_tiling/`` (``experiments/gemm_tiling.yaml``): the kernel is
persistent, so its time is about ``ceil(tiles / SMs)`` rounds of one tile each.
For every candidate tile in ``_CANDIDATES`` we estimate::

    time = ceil(tiles / num_sms) * (2 * BM * BN * K / per_sm_rate(tile) + fixed(tile))

with ``per_sm_rate`` and ``fixed`` fitted to the sweep by least squares, and
pick the cheapest; big problems (at least ``SK_MIN_ROUNDS`` whole rounds of
128x256 tiles and a partial one) get the stream-K tail. Big tiles (128x256) win on big shapes (more reuse per byte
loaded); 128x128 with a 6-deep pipeline wins when 128x256 tiles would leave
SMs idle in the last round (wave quantisation), e.g. M=512 with a long K. C
leaves through plain stores, which were as fast as TMA stores in the sweep and
need no shared-memory staging buffer. See ``_CANDIDATES`` for the numbers.

Warp-specialised handoff: on sm_90 with bf16/fp16 and TMA-aligned operands,
the heuristic hands problems with more than a round of 128x256 tiles to the
Gluon kernel of ``kernels.gemm.gluon`` (``GemmConfig.gluon`` = "pingpong" or
"coop"), except where this kernel's stream-K tail wins (see ``heuristic``).

Counting (``flops``, ``bytes_moved``): 2*M*N*K floating-point operations; the
fewest bytes are each input read once and C written once:
``(M*K + K*N + M*N) * element_size``.

The family's parts: ``triton`` (the Triton kernels), ``gluon`` (the Gluon
kernel), ``config`` (``GemmConfig``, ``WsConfig``, validation, ``heuristic``,
stream-K plan), ``launch`` (``matmul``, ``matmul_ws``: plans cached per call
signature), ``reference``, ``baselines`` (cuBLAS), ``metrics`` (FLOPs, bytes)
and ``sweep`` (the ``workbench sweep`` protocol).
"""
from kernels.gemm.baselines import cublas
from kernels.gemm.config import GemmConfig, WsConfig, heuristic
from kernels.gemm.launch import matmul, matmul_ws
from kernels.gemm.metrics import bytes_moved, flops
from kernels.gemm.reference import reference

__all__ = ["GemmConfig", "WsConfig", "bytes_moved", "cublas", "flops", "heuristic", "matmul", "matmul_ws",
           "reference"]
