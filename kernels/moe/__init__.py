"""Grouped GEMM for mixture-of-experts layers: forward, dgrad and wgrad.

A token batch ``x`` of shape ``[sum(group_sizes), K]`` is split along its rows
into ``G`` consecutive groups (one per expert); group ``g`` is multiplied by
its own weight ``w[g]``:

* forward  ``out[rows_g] = x[rows_g] @ w[g]``           (``w`` is ``[G, K, N]``)
* dgrad    ``dx[rows_g]  = dy[rows_g] @ w[g].T``         (``trans_w=True``)
* wgrad    ``dw[g]       = x[rows_g].T @ dy[rows_g]``    (variable-K GEMM)

The group sizes never leave the GPU. Each persistent program loads the (at
most a few hundred) sizes once, builds their prefix sums in registers and
finds the group of every tile it owns by comparing the tile index with the
cumulative tile counts: no ``.item()``, ``.tolist()`` or ``.cpu()`` anywhere
in the launch path, so a launch never waits for the GPU and can be captured in
a CUDA graph.

Tile order. Tiles are numbered expert by expert; within an expert they are
grouped ``GROUP_M`` row blocks at a time (the usual L2 swizzle). Programs take
tiles round-robin, so the wave of tiles in flight at any moment covers one
expert (two at a boundary) and every SM streams the same ``w[g]`` through L2.
An output width that leaves a narrow last column strip (N = 2880 in 256-wide
tiles: 11.25 tiles) gets that strip in tiles of its own width (``tail_width``),
numbered after the full tiles, instead of mostly-padding 256-wide ones
(Triton kernel only).

Two kernels:

* the Triton kernels (``kernels.moe.triton``: fwd/dgrad and wgrad). On Hopper
  (sm_90) the operands arrive through TMA: host-side tensor descriptors (or the
  same ones encoded in the kernel, ``kernels.moe.launch.DEVICE_DESCRIPTORS``), with
  "row-window" descriptors for the row-split operands so that a tile never
  reads or writes past its group's last row (the hardware clips and
  zero-fills; see ``kernels.moe.triton.row_window``). Elsewhere (older GPUs,
  strides that are not 16-byte aligned, the interpreter by default) masked
  pointer loads do the same job; the interpreter also emulates the descriptor
  path when a config asks for it (``USE_TMA=True``), which is how the CPU
  tests cover it. wgrad numbers its tiles over the experts that have rows only,
  in one flat loop over (tile, row step) pairs per program, so the next tile's
  loads are in flight while a tile is stored; experts with no rows get their
  dw tiles stored as zeros without loading anything.
* the warp-specialised Gluon kernel (``kernels.moe.gluon``, fwd and dgrad,
  sm_90 only): the producer / consumer design of ``kernels.gemm.gluon`` with
  the grouped tile schedule. ``grouped_gemm`` hands it its default path for
  bf16/fp16 operands with 16-byte aligned rows on sm_90 (1-5% ahead of the
  Triton kernel on every seed layer in results/grouped_gemm run 12);
  ``grouped_gemm_ws`` runs it alone. With
  ``kernels.moe.launch.GLUON_DEVICE_DESCRIPTORS`` (off by default) it runs as
  ``_grouped_gemm_ws_dev_kernel``: the producer encodes x's and w's
  descriptors, each consumer out's row window, so no host descriptor is built.

  What Gluon (Triton 3.6) took and refused, found while writing it: accepted,
  a rank-3 NVMMA ring ([NUM_STAGES, 1, BK, BN]) filled by 3-D TMA loads,
  viewed as [BK, BN] with ``.index(s).reshape(...)`` (and ``.permute([1, 0])``
  for dgrad: wgmma takes the transposed NVMMA layout as B); a rank-4 C buffer
  [1, 1, BM, BN] written through its ``reshape([BM, BN])`` view (stmatrix) and
  stored with a 4-D TMA store; ``gl.associative_scan`` and ``gl.reduce`` on a
  1-D BlockedLayout whose warps are broadcast (shuffles and redux.sync, no
  shared memory). Refused: ``gl.associative_scan`` on a SliceLayout vector
  ("TODO: unsupported scan layout"); ``gl.sum`` / ``gl.max`` / ``gl.min`` under
  TRITON_INTERPRET=1 ("Unsupported function referenced: InterpretedFunction":
  they are Triton @jit functions), hence the kernel's own combine functions.
  It refuses, with a ValueError pointing to ``grouped_gemm``: CPU tensors, GPUs
  other than sm_90, Triton's interpreter (Gluon has none), fp32, K or N not
  multiples of 8 (16-byte TMA row strides), more than ``WS_MAX_GROUPS`` groups,
  strides the TMA engine cannot take.

Every launcher plans once per call signature (``kernels.moe.launch``): a
repeated call is a dictionary lookup, the descriptors and a launch, with no
host synchronization.

The family's parts: ``triton`` (the Triton kernels), ``gluon`` (the Gluon
kernel), ``config`` (``GroupedConfig``, ``GroupedWsConfig``, validation, the
config tables, ``tail_width``), ``launch`` (``grouped_gemm``,
``grouped_gemm_wgrad``, ``grouped_gemm_ws``, ``grouped_linear``: plans cached
per call signature; cross-compilation helpers), ``reference``, ``baselines``
(``torch._grouped_mm``, a per-expert cuBLAS loop), ``metrics`` (FLOPs, bytes),
``routing`` (token routings for benchmarks), ``select`` (the family in the
selection layer: problem keys, candidates, the cold rule, tune-on-miss and
``workbench tune grouped``), ``autotune`` (picks among ours and the baselines
per layer; its choices live in a tuning table beside the family's) and
``sweep`` (the ``workbench sweep`` protocol).

Without a config, ``grouped_gemm`` and ``grouped_gemm_wgrad`` run what the
selection layer names for the call: a tuning table's entry for this GPU (which
may be ``torch._grouped_mm`` where none of ours was faster), a tuning run on the
call's own tensors with ``tune=True`` or ``WORKBENCH_TUNE=1``, else the cold rule
(the default path described above).
"""
from kernels.moe.autotune import GroupedGemmAutotuner, autotuned
from kernels.moe.baselines import cublas_loop, grouped_mm
from kernels.moe.config import GroupedConfig, GroupedWsConfig, pick_config, tail_width
from kernels.moe.launch import GroupedGemmFunction, grouped_gemm, grouped_gemm_wgrad, grouped_gemm_ws, grouped_linear
from kernels.moe.metrics import bytes_moved, flops
from kernels.moe.reference import reference, reference_wgrad
from kernels.moe.routing import ROUTINGS, balanced, extreme, mild

__all__ = ["GroupedConfig", "GroupedGemmAutotuner", "GroupedGemmFunction", "GroupedWsConfig", "ROUTINGS",
           "autotuned", "balanced", "bytes_moved", "cublas_loop", "extreme", "flops", "grouped_gemm",
           "grouped_gemm_wgrad", "grouped_gemm_ws", "grouped_linear", "grouped_mm", "mild", "pick_config",
           "reference", "reference_wgrad", "tail_width"]
