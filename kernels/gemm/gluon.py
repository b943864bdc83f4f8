"""Gluon kernel of the warp-specialised GEMM (see ``kernels.gemm`` for the design:
a 1-warp TMA producer, ping-pong or cooperative wgmma consumers, an mbarrier ring).

A is (M, K), B is (K, N), C is (M, N), all row-major; bf16 or fp16 in and out,
fp32 accumulation. Any M; K and N must be multiples of 8 (the TMA engine needs
16-byte row strides). Anything else, and anything that is not a CUDA tensor on
an sm_90 GPU (or runs under TRITON_INTERPRET=1: Gluon has no interpreter), is
refused with a pointer to ``kernels.gemm.matmul``.

Why: ``kernels.gemm`` runs the mainloop and the epilogue in the same warps, so
the tensor cores idle while a tile's C is converted and stored. Here, as in
CUTLASS's ``KernelTmaWarpSpecializedPingpong``, every CTA runs three
partitions (``gl.warp_specialize``):

* consumer 0 (the default partition, ``num_warps=4`` = one warpgroup) and
  consumer 1 (a 4-warp worker): each owns a ``BLOCK_M x BLOCK_N`` fp32
  accumulator in registers and runs wgmma on alternate tiles of the CTA
  (consumer 0: the CTA's tiles 0, 2, 4, ...; consumer 1: 1, 3, 5, ...). While
  one runs its mainloop the other converts and stores its previous tile
  (registers -> smem -> TMA store), so the tensor cores need not wait for an
  epilogue;
* the producer (a 1-warp worker, few registers): walks the CTA's tiles in
  order and issues TMA loads of A and B into a ``NUM_STAGES``-deep ring.

Synchronisation (mbarriers, count 1 each; one thread of a warpgroup arrives,
after Triton's partition-wide ``bar.sync``):

* ``ready[s]``: the producer arms it with the stage's byte count (``expect``);
  the TMA engine completes it when both boxes have landed.
* ``empty[s]``: the consumer arrives once the wgmma that read stage s is done
  (``warpgroup_mma_wait`` keeps one wgmma in flight), and the producer may
  refill it. Stages are filled in the CTA's tile order, so the consumer of the
  CTA's tile ``i`` starts at ring position ``i * k_steps``.
* ``order[c]`` (CUTLASS's math-warpgroup order barrier): consumer c starts a
  mainloop only after the other consumer has issued all of its previous one.
  This makes the two mainloops alternate, and it is also what keeps the shared
  ring correct: mbarrier waits test a phase *parity*, so a consumer must never
  wait on a stage two fills ahead of the barrier. Without the order barrier,
  consumer 1 would start waiting on tile 1's stages while tile 0's fills of
  the same stages are still pending (whenever ``k_steps >= NUM_STAGES``) and
  would take tile 0's data for its own. So there is no "unordered" knob.

``WsConfig(cooperative=True)`` is the other CUTLASS schedule
(``KernelTmaWarpSpecializedCooperative``): one consumer of 8 warps (two
warpgroups, rows 0-63 and 64-127 of a 128x256 tile, or 256x128), i.e. the tile
of ``kernels.gemm``'s best config, plus the same 1-warp producer. Its epilogue
is not hidden behind another mainloop, but the producer keeps loading the next
tile's stages meanwhile, and the bigger tile needs fewer bytes per flop from L2
than ping-pong's 128x128 (85 vs 64 flop/byte): without TMA multicast (CUTLASS
pairs ping-pong 128x128 with 2x1 clusters) the ring may be L2-bound.

Persistent schedule: ``min(num_sms, tiles)`` CTAs; CTA p visits tiles
``p, p + grid, p + 2*grid, ...``, mapped to (row, column) blocks in GROUP_M-row
bands as in ``kernels.gemm.triton._tile_coords`` (an L2 swizzle).

Registers: 12 warps in both modes (2 consumer warpgroups + the producer's
warpgroup, 1 warp used) = 384 threads, so the launch limit is
``maxnreg = 65536 / 384 -> 168`` per thread; ``setmaxnreg`` then moves
registers from the producer warpgroup to the consumers (default 40 / 232 / 232,
as CUTLASS). The default partition gets what the workers leave
(``default_partition_regs``). Every consumer thread holds 128 fp32 accumulator
registers (128x128 or 64x256 per warpgroup; 128x256 or 256x128 per 8 warps).

Shared memory: ``NUM_STAGES * (BM*BK + BK*BN) * 2`` bytes for the ring, one
``BM*BN*2``-byte C staging buffer per consumer, the mbarriers and Triton's
warp-specialisation state (``smem_bytes``); ping-pong 128x128x64 with 4 stages:
128 KB + 64 KB; cooperative 128x256x64 with 3 stages: 144 KB + 64 KB. Configs
over sm_90's 227 KB per block are refused.

Descriptors. ``_gemm_ws_kernel`` takes three host descriptors (Gluon's
``TensorDescriptor``: the launcher encodes a ``CUtensorMap`` per descriptor and
call). ``_gemm_ws_dev_kernel`` takes pointers and row strides instead and
encodes them on the device (``tma.make_tensor_descriptor``, once per program):
each partition encodes the descriptors it issues TMA copies with, into slots
of its own in the global scratch (the producer A's and B's, each consumer
C's), so the warps that use a descriptor are the ones that copied it out with
the tensormap release fence and acquired it (``fence.proxy.tensormap`` is a
per-thread ordering, and the scratch slot holds the previous launch's
descriptor until then); Triton's own warp specialisation places the ones it
makes the same way. 4 descriptors per program in ping-pong, 3 in cooperative
(512 / 384 bytes of scratch), staged in 144-224 bytes of shared memory; the
ring, the boxes, their layouts and the schedule are the host variant's, and
so is the main loop (same wgmma and TMA instructions).
"""
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from workbench.dtypes import triton_type

try:  # the host-side descriptor that carries a shared-memory layout (Gluon)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def layout(dtype: torch.dtype, block: list[int]):
    """The swizzled shared-memory layout a TMA box of this shape lands in (any rank)."""
    return gl.NVMMASharedLayout.get_default_for(block, _gl_dtype(dtype))


def descriptor(t: torch.Tensor, block: list[int]):
    """A host TMA descriptor of ``t`` with the layout the kernels expect."""
    return TensorDescriptor.from_tensor(t, block, layout(t.dtype, block))


def desc_type(dtype: torch.dtype, block: list[int]) -> str:
    """The cross-compiler's type string of such a descriptor: Gluon descriptors carry
    their shared-memory layout in the type, after the block shape (any rank)."""
    return f"tensordesc<{triton_type(dtype)}[{', '.join(map(str, block))}],{layout(dtype, block)!r}>"


# --------------------------------------------------------------------------
# Gluon kernel
# --------------------------------------------------------------------------
@gluon.constexpr_function
def _acc_layout(block_n, bitwidth, num_warps):
    # Warps stacked along M (a warpgroup issues m64 wgmma; 8 warps: two warpgroups
    # on rows 0-63 / 64-127), the whole BLOCK_N (<= 256) in one instruction.
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, block_n, 256 // bitwidth])


@gluon.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, group_m):
    """Tile index -> (row block, column block) in bands of group_m rows (the
    walk of kernels.gemm.triton._tile_coords; a Gluon copy, since a Gluon kernel cannot
    call that @triton.jit helper: under TRITON_INTERPRET=1 it is an interpreter
    function, which Gluon's compiler refuses)."""
    band_id = tile_id // (group_m * num_pid_n)
    first_m = band_id * group_m
    rows_in_band = gl.minimum(num_pid_m - first_m, group_m)
    inside = tile_id - band_id * (group_m * num_pid_n)
    return first_m + inside % rows_in_band, inside // rows_in_band


@gluon.jit
def _grid_sizes(a_desc, b_desc, B_KMAJOR: gl.constexpr):
    """(row blocks, column blocks, K-steps per tile), from the descriptors' shapes
    (B_KMAJOR: B's descriptor is over B^T, (N, K))."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0 if B_KMAJOR else 1]
    M = a_desc.shape[0]
    K = a_desc.shape[1]
    N = b_desc.shape[0 if B_KMAJOR else 1]
    return (M + BLOCK_M - 1) // BLOCK_M, (N + BLOCK_N - 1) // BLOCK_N, (K + BLOCK_K - 1) // BLOCK_K


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, group_m, NUM_STAGES: gl.constexpr,
              B_KMAJOR: gl.constexpr):
    """Every K-step of every tile of this CTA, in order, into the ring (B_KMAJOR: B's
    tiles are (BLOCK_N, BLOCK_K) boxes of B^T)."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[0 if B_KMAJOR else 1]
    STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    num_pid_m, num_pid_n, k_steps = _grid_sizes(a_desc, b_desc, B_KMAJOR)
    counter = 0  # ring position: stage counter % NUM_STAGES, fill counter // NUM_STAGES
    for tile_id in range(gl.program_id(0), num_pid_m * num_pid_n, gl.num_programs(0)):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, group_m)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for kk in range(k_steps):
            s = counter % NUM_STAGES
            # A fresh mbarrier counts as having completed the phase before phase 0,
            # so the first pass over the ring (parity 1) does not wait.
            mbarrier.wait(empty.index(s), ((counter // NUM_STAGES) & 1) ^ 1)
            # TMA counts whole boxes, zero-filled past the edges: always STAGE_BYTES.
            mbarrier.expect(ready.index(s), STAGE_BYTES)
            tma.async_copy_global_to_shared(a_desc, [off_m, kk * BLOCK_K], ready.index(s), a_bufs.index(s))
            if B_KMAJOR:
                tma.async_copy_global_to_shared(b_desc, [off_n, kk * BLOCK_K], ready.index(s), b_bufs.index(s))
            else:
                tma.async_copy_global_to_shared(b_desc, [kk * BLOCK_K, off_n], ready.index(s), b_bufs.index(s))
            counter += 1


@gluon.jit
def _b_stage(b_bufs, s, B_KMAJOR: gl.constexpr):
    """Stage ``s`` of B as wgmma's (BLOCK_K, BLOCK_N) operand: with B_KMAJOR a transposed
    view of the B^T tile the stage holds."""
    if B_KMAJOR:
        return b_bufs.index(s).permute((1, 0))
    else:
        return b_bufs.index(s)


@gluon.jit
def _mainloop(a_bufs, b_bufs, ready, empty, counter, k_steps, acc_layout: gl.constexpr,
              NUM_STAGES: gl.constexpr, B_KMAJOR: gl.constexpr):
    """One tile's wgmma loop from ring position `counter`. One wgmma stays in
    flight; a stage is freed once the wgmma that read it is done. Returns the
    accumulator with the last wgmma still pending (its stage not yet freed).
    B_KMAJOR: B's stages hold B^T tiles, which wgmma reads through a transposed
    view (16-bit wgmma takes B either way)."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.shape[1 if B_KMAJOR else 2]
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    for kk in range(k_steps):
        s = counter % NUM_STAGES
        mbarrier.wait(ready.index(s), (counter // NUM_STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(s), _b_stage(b_bufs, s, B_KMAJOR), acc, is_async=True)
        # Only the wgmma just issued may still run: the previous one has read
        # its operands, so its stage can be refilled.
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((counter + NUM_STAGES - 1) % NUM_STAGES), pred=kk > 0)
        counter += 1
    return acc


@gluon.jit
def _consumer(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m,
              WHICH: gl.constexpr, NUM_CONSUMERS: gl.constexpr, NUM_STAGES: gl.constexpr, B_KMAJOR: gl.constexpr):
    """The CTA's tiles WHICH, WHICH + NUM_CONSUMERS, ...: mainloop, then epilogue.
    Ping-pong: two of these (one warpgroup each); cooperative: one (8 warps)."""
    num_pid_m, num_pid_n, k_steps = _grid_sizes(a_desc, b_desc, B_KMAJOR)
    _consumer_tiles(c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m, num_pid_m, num_pid_n, k_steps,
                    WHICH, NUM_CONSUMERS, NUM_STAGES, B_KMAJOR)


@gluon.jit
def _consumer_tiles(c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m, num_pid_m, num_pid_n, k_steps,
                    WHICH: gl.constexpr, NUM_CONSUMERS: gl.constexpr, NUM_STAGES: gl.constexpr,
                    B_KMAJOR: gl.constexpr):
    """``_consumer``'s work, given the grid of tiles and the K-steps per tile."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    dtype: gl.constexpr = c_desc.dtype
    acc_layout: gl.constexpr = _acc_layout(BLOCK_N, dtype.primitive_bitwidth, gl.num_warps())
    c_smem = c_bufs.index(WHICH)
    grid = gl.num_programs(0)
    j = 0  # tiles this consumer has done
    for tile_id in range(gl.program_id(0) + WHICH * grid, num_pid_m * num_pid_n, NUM_CONSUMERS * grid):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, group_m)
        start = (NUM_CONSUMERS * j + WHICH) * k_steps  # stages the producer filled before this tile
        if NUM_CONSUMERS == 2:
            # Wait for the other consumer to have issued its previous mainloop
            # (consumer 0's first wait, parity 1 of a fresh barrier, passes at once).
            mbarrier.wait(order.index(WHICH), (j & 1) ^ (1 - WHICH))
        acc = _mainloop(a_bufs, b_bufs, ready, empty, start, k_steps, acc_layout, NUM_STAGES, B_KMAJOR)
        if NUM_CONSUMERS == 2:
            mbarrier.arrive(order.index(1 - WHICH))  # all our wgmma issued: the other may start
        acc = warpgroup_mma_wait(0, deps=(acc,))
        mbarrier.arrive(empty.index((start + k_steps - 1) % NUM_STAGES))
        # Epilogue (ping-pong: overlapped with the other consumer's mainloop;
        # cooperative: with the producer's loads for the next tile). Our previous
        # TMA store from c_smem must have read the buffer before we overwrite it.
        tma.store_wait(0)
        c_smem.store(acc.to(dtype))
        fence_async_shared()  # the generic-proxy writes must be visible to the TMA engine
        tma.async_copy_shared_to_global(c_desc, [pid_m * BLOCK_M, pid_n * BLOCK_N], c_smem)
        j += 1
    tma.store_wait(0)


@gluon.jit
def _shared_state(a_desc, b_desc, c_desc, NUM_STAGES: gl.constexpr, NUM_CONSUMERS: gl.constexpr):
    """The ring (A and B stages), one C staging buffer per consumer, and the
    mbarriers: ready/empty per stage, order[2] for the ping-pong consumers."""
    dtype: gl.constexpr = a_desc.dtype
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + a_desc.block_type.shape, a_desc.layout)
    b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES] + b_desc.block_type.shape, b_desc.layout)
    c_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS] + c_desc.block_type.shape, c_desc.layout)
    ready, empty, order = _barriers(NUM_STAGES)
    return a_bufs, b_bufs, c_bufs, ready, empty, order


@gluon.jit
def _barriers(NUM_STAGES: gl.constexpr):
    """The mbarriers of ``_shared_state``, initialised: ready/empty per stage, order[2]."""
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    return ready, empty, order


@gluon.jit
def _gemm_ws_kernel(a_desc, b_desc, c_desc, group_m, NUM_STAGES: gl.constexpr, COOPERATIVE: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, B_KMAJOR: gl.constexpr = False):
    NUM_CONSUMERS: gl.constexpr = 1 if COOPERATIVE else 2
    a_bufs, b_bufs, c_bufs, ready, empty, order = _shared_state(a_desc, b_desc, c_desc, NUM_STAGES, NUM_CONSUMERS)

    if COOPERATIVE:
        # Default partition (this kernel's 8 warps): the one consumer. Worker: the
        # producer (1 warp, PRODUCER_REGS); the consumer gets the rest.
        gl.warp_specialize([
            (_consumer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m,
                         0, NUM_CONSUMERS, NUM_STAGES, B_KMAJOR)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, group_m, NUM_STAGES, B_KMAJOR)),
        ], [1], [PRODUCER_REGS])
    else:
        # Default partition (this kernel's 4 warps): consumer 0. Workers: consumer 1
        # (4 warps, CONSUMER_REGS) and the producer (1 warp, PRODUCER_REGS).
        gl.warp_specialize([
            (_consumer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m,
                         0, NUM_CONSUMERS, NUM_STAGES, B_KMAJOR)),
            (_consumer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m,
                         1, NUM_CONSUMERS, NUM_STAGES, B_KMAJOR)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, group_m, NUM_STAGES, B_KMAJOR)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------
# The same kernel with device descriptors
# --------------------------------------------------------------------------
@gluon.constexpr_function
def _smem_layout(block, dtype):
    # The layout ``layout`` gives a host descriptor of this box (so both variants
    # stage their tiles identically).
    return gl.NVMMASharedLayout.get_default_for(block, dtype)


@gluon.jit
def _producer_dev(a_ptr, b_ptr, M, N, K, stride_am, stride_bk, a_bufs, b_bufs, ready, empty, group_m,
                  NUM_STAGES: gl.constexpr, B_KMAJOR: gl.constexpr):
    """``_producer``, with the descriptors of A and B encoded by this partition (its
    own slots of the global scratch: the warps that issue the TMA loads are the ones
    that wrote and acquired the descriptors). B_KMAJOR: ``stride_bk`` is B^T's row stride."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    a_desc = tma.make_tensor_descriptor(a_ptr, [M, K], [stride_am, 1], [BLOCK_M, BLOCK_K], a_bufs.layout)
    if B_KMAJOR:
        BLOCK_N: gl.constexpr = b_bufs.shape[1]
        b_desc = tma.make_tensor_descriptor(b_ptr, [N, K], [stride_bk, 1], [BLOCK_N, BLOCK_K], b_bufs.layout)
    else:
        BLOCK_N: gl.constexpr = b_bufs.shape[2]
        b_desc = tma.make_tensor_descriptor(b_ptr, [K, N], [stride_bk, 1], [BLOCK_K, BLOCK_N], b_bufs.layout)
    _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, group_m, NUM_STAGES, B_KMAJOR)


@gluon.jit
def _consumer_dev(c_ptr, M, N, K, stride_cm, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m,
                  WHICH: gl.constexpr, NUM_CONSUMERS: gl.constexpr, NUM_STAGES: gl.constexpr,
                  B_KMAJOR: gl.constexpr):
    """``_consumer``, with C's descriptor encoded by this consumer itself."""
    BLOCK_M: gl.constexpr = c_bufs.shape[1]
    BLOCK_N: gl.constexpr = c_bufs.shape[2]
    BLOCK_K: gl.constexpr = a_bufs.shape[2]
    c_desc = tma.make_tensor_descriptor(c_ptr, [M, N], [stride_cm, 1], [BLOCK_M, BLOCK_N], c_bufs.layout)
    _consumer_tiles(c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m, (M + BLOCK_M - 1) // BLOCK_M,
                    (N + BLOCK_N - 1) // BLOCK_N, (K + BLOCK_K - 1) // BLOCK_K, WHICH, NUM_CONSUMERS, NUM_STAGES,
                    B_KMAJOR)


@gluon.jit(do_not_specialize=["M", "group_m"])
def _gemm_ws_dev_kernel(a_ptr, b_ptr, c_ptr, M, N, K, stride_am, stride_bk, stride_cm, group_m,
                        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
                        NUM_STAGES: gl.constexpr, COOPERATIVE: gl.constexpr,
                        CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr, B_KMAJOR: gl.constexpr = False):
    """``_gemm_ws_kernel`` with device descriptors: A, B and C arrive as pointers and
    row strides (unit inner strides, 16-byte aligned bases and row strides: the plan
    checks), and every partition encodes the descriptors it issues TMA copies with
    (``tma.make_tensor_descriptor``, once per program, 128 bytes of the launcher's
    global scratch each: A and B in the producer, C in each consumer), so the launch
    passes no host descriptor. Same boxes, layouts, ring and schedule."""
    NUM_CONSUMERS: gl.constexpr = 1 if COOPERATIVE else 2
    dtype: gl.constexpr = a_ptr.dtype.element_ty
    a_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_M, BLOCK_K], _smem_layout([BLOCK_M, BLOCK_K], dtype))
    if B_KMAJOR:   # stages of B^T tiles
        b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_N, BLOCK_K],
                                           _smem_layout([BLOCK_N, BLOCK_K], dtype))
    else:
        b_bufs = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, BLOCK_N],
                                           _smem_layout([BLOCK_K, BLOCK_N], dtype))
    c_bufs = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, BLOCK_M, BLOCK_N],
                                       _smem_layout([BLOCK_M, BLOCK_N], dtype))
    ready, empty, order = _barriers(NUM_STAGES)

    if COOPERATIVE:
        gl.warp_specialize([
            (_consumer_dev, (c_ptr, M, N, K, stride_cm, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m,
                             0, NUM_CONSUMERS, NUM_STAGES, B_KMAJOR)),
            (_producer_dev, (a_ptr, b_ptr, M, N, K, stride_am, stride_bk, a_bufs, b_bufs, ready, empty, group_m,
                             NUM_STAGES, B_KMAJOR)),
        ], [1], [PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer_dev, (c_ptr, M, N, K, stride_cm, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m,
                             0, NUM_CONSUMERS, NUM_STAGES, B_KMAJOR)),
            (_consumer_dev, (c_ptr, M, N, K, stride_cm, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m,
                             1, NUM_CONSUMERS, NUM_STAGES, B_KMAJOR)),
            (_producer_dev, (a_ptr, b_ptr, M, N, K, stride_am, stride_bk, a_bufs, b_bufs, ready, empty, group_m,
                             NUM_STAGES, B_KMAJOR)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
