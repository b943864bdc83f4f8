"""Persistent GEMM in Triton: ``C = A @ B`` with fp32 accumulation.

A is (M, K), B is (K, N), C is (M, N); bf16 and fp16 inputs (fp32 is accepted
too, through the tensor cores' tf32 mode on a GPU). Any M, N, K works, not only
multiples of the tile.

Two persistent kernels share one tile schedule:

* ``_gemm_tma_kernel`` (Hopper, sm_90): A, B and C travel through host-built
  TMA tensor descriptors (``triton.tools.tensor_descriptor.TensorDescriptor``),
  or, in ``_gemm_tma_dev_kernel`` (the same main loop; chosen per plan with
  ``kernels.gemm.launch.DEVICE_DESCRIPTORS``), through descriptors each program
  encodes itself, which saves the host their per-call encoding;
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
see ``stream_k_plan``), tail_split (TMA path: the last, partial round's tiles
run as 2 or 4 column slices, one per program, nothing to add up; ``tail_slices``;
4 by default on the 128x128 and 128x256 tiles), extra_n (TMA path: tiles
block_n + extra_n wide, a second MMA per K-step on the same A tile, for widths
between the powers of two such as 144 or 288; measured slower than the power-of-two
tiles on 15 of 17 probed shapes, results/gemm_zoo/gaps/wide.csv: explicit configs only)
and warp_specialize (Triton's automatic Hopper warp specialisation of the tile
loop: it compiles, 12 warps with setmaxnreg, but hung on an H200 with Triton
3.6, so ``matmul`` refuses it on a GPU unless WORKBENCH_ALLOW_WS=1).

Split-K kernel (``_gemm_splitk_kernel``, ``GemmConfig.split_k`` = pieces): one
program per output tile and piece of K, not persistent; pieces of a tile meet
in an fp32 workspace (the last to arrive adds them up and stores C). With
``swap_ab`` it computes the tile as C^T = B^T A^T, so a short M (1-64 rows)
becomes the MMA's narrow N side instead of a 64-row tile padded with zeros:
the small-M (decode) path, bound by reading B once.

fp32 at small M (``GemmConfig.fma``, ``_gemm_fma_kernel``): true fp32 on the
FMA units, no tensor cores, K split over programs as above. Up to 8 rows of A,
one outer product per row of B, read with 128-bit loads along N; more rows (or
a K-major B) through ``tl.dot`` in ieee precision, which Triton builds from FMAs
on tiles staged in shared memory. The heuristic takes it for fp32 with M <= 64
(``cold.FMA_MAX_M``; a stated rule, not yet measured: ``config.fma_config``).

Unaligned rows (``GemmConfig.pad``): TMA needs 16-byte aligned row strides (K
and N multiples of 8 in bf16); an operand without them is copied into a fresh
aligned buffer at each call, and the TMA kernels run on the copy, instead of
the pointer kernel (5-10x slower on such shapes on an H200).

Config heuristic (``heuristic``): a cost model over the named configurations
of ``config.candidates`` (persistent 128x256 / 64x128 tiles, the Gluon
ping-pong kernel, the swapped split-K kernel for M <= 64, a narrow-N tile for
N <= 64), each with five constants (``cold.COST``) fitted by
``experiments/fit_gemm_heuristic.py`` on the "fit" half of the shape zoo
(``experiments/gemm_shapes.yaml``); it returns the candidate with the least
modelled time (``cold.estimate_us``: rounds of programs over the SMs, one
program's compute or loads per round, the whole kernel's streaming bandwidth,
fixed costs, split-K partials and padding copies). Results on both halves of
the zoo: ``results/gemm_zoo/``.

Warp-specialised Gluon kernel: ``GemmConfig.gluon`` = "pingpong" or "coop" runs
``kernels.gemm.gluon`` (sm_90, bf16/fp16, TMA-aligned operands); the heuristic
chooses ping-pong where the model says so. Its descriptors come from the host
(Gluon's ``TensorDescriptor``), or, in ``_gemm_ws_dev_kernel`` (chosen per plan
with ``kernels.gemm.launch.GLUON_DEVICE_DESCRIPTORS``; off by default), from
its partitions, each encoding the ones it issues TMA copies with.

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
from kernels.gemm.cold import heuristic
from kernels.gemm.config import GemmConfig, WsConfig
from kernels.gemm.launch import matmul, matmul_ws
from kernels.gemm.metrics import bytes_moved, flops
from kernels.gemm.reference import reference

__all__ = ["GemmConfig", "WsConfig", "bytes_moved", "cublas", "flops", "heuristic", "matmul", "matmul_ws",
           "reference"]
