"""Warp-specialised, persistent Hopper GEMM in Gluon: ``C = A @ B`` (ping-pong or cooperative).

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
bands as in ``kernels.gemm._tile_coords`` (an L2 swizzle).

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
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Mapping

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

from kernels import cuda_context, interpreter
from kernels.gemm import prepare_output
from workbench.asm.resources import smem_per_block
from workbench.dtypes import triton_type

try:  # the host-side descriptor that carries a shared-memory layout (Gluon)
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

DTYPES = (torch.bfloat16, torch.float16)
SMEM_LIMIT_SM90 = smem_per_block(90)  # bytes of shared memory one block may use on sm_90
REGS_PER_SM = 65536
TOTAL_WARPS = 12  # both modes: 2 consumer warpgroups + the producer's warpgroup (1 warp used, 4 allocated)
MAXNREG = (REGS_PER_SM // (TOTAL_WARPS * 32)) // 8 * 8  # 168: registers per thread at launch
# Triton 3.6 keeps the worker partitions' state (and alignment padding) in shared
# memory too: 168 bytes in every config cross-compiled for sm_90.
WS_EXTRA_SMEM = 256
_FALLBACK = "use kernels.gemm.matmul instead"


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
    walk of kernels.gemm._tile_coords; a Gluon copy, since a Gluon kernel cannot
    call that @triton.jit helper: under TRITON_INTERPRET=1 it is an interpreter
    function, which Gluon's compiler refuses)."""
    band_id = tile_id // (group_m * num_pid_n)
    first_m = band_id * group_m
    rows_in_band = gl.minimum(num_pid_m - first_m, group_m)
    inside = tile_id - band_id * (group_m * num_pid_n)
    return first_m + inside % rows_in_band, inside // rows_in_band


@gluon.jit
def _grid_sizes(a_desc, b_desc):
    """(row blocks, column blocks, K-steps per tile), from the descriptors' shapes."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    M = a_desc.shape[0]
    K = a_desc.shape[1]
    N = b_desc.shape[1]
    return (M + BLOCK_M - 1) // BLOCK_M, (N + BLOCK_N - 1) // BLOCK_N, (K + BLOCK_K - 1) // BLOCK_K


@gluon.jit
def _producer(a_desc, b_desc, a_bufs, b_bufs, ready, empty, group_m, NUM_STAGES: gl.constexpr):
    """Every K-step of every tile of this CTA, in order, into the ring."""
    BLOCK_M: gl.constexpr = a_desc.block_type.shape[0]
    BLOCK_K: gl.constexpr = a_desc.block_type.shape[1]
    BLOCK_N: gl.constexpr = b_desc.block_type.shape[1]
    STAGE_BYTES: gl.constexpr = a_desc.block_type.nbytes + b_desc.block_type.nbytes
    num_pid_m, num_pid_n, k_steps = _grid_sizes(a_desc, b_desc)
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
            tma.async_copy_global_to_shared(b_desc, [kk * BLOCK_K, off_n], ready.index(s), b_bufs.index(s))
            counter += 1


@gluon.jit
def _mainloop(a_bufs, b_bufs, ready, empty, counter, k_steps, acc_layout: gl.constexpr,
              NUM_STAGES: gl.constexpr):
    """One tile's wgmma loop from ring position `counter`. One wgmma stays in
    flight; a stage is freed once the wgmma that read it is done. Returns the
    accumulator with the last wgmma still pending (its stage not yet freed)."""
    BLOCK_M: gl.constexpr = a_bufs.shape[1]
    BLOCK_N: gl.constexpr = b_bufs.shape[2]
    acc = gl.zeros((BLOCK_M, BLOCK_N), dtype=gl.float32, layout=acc_layout)
    for kk in range(k_steps):
        s = counter % NUM_STAGES
        mbarrier.wait(ready.index(s), (counter // NUM_STAGES) & 1)
        acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s), acc, is_async=True)
        # Only the wgmma just issued may still run: the previous one has read
        # its operands, so its stage can be refilled.
        acc = warpgroup_mma_wait(1, deps=(acc,))
        mbarrier.arrive(empty.index((counter + NUM_STAGES - 1) % NUM_STAGES), pred=kk > 0)
        counter += 1
    return acc


@gluon.jit
def _consumer(a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m,
              WHICH: gl.constexpr, NUM_CONSUMERS: gl.constexpr, NUM_STAGES: gl.constexpr):
    """The CTA's tiles WHICH, WHICH + NUM_CONSUMERS, ...: mainloop, then epilogue.
    Ping-pong: two of these (one warpgroup each); cooperative: one (8 warps)."""
    BLOCK_M: gl.constexpr = c_desc.block_type.shape[0]
    BLOCK_N: gl.constexpr = c_desc.block_type.shape[1]
    dtype: gl.constexpr = c_desc.dtype
    acc_layout: gl.constexpr = _acc_layout(BLOCK_N, dtype.primitive_bitwidth, gl.num_warps())
    c_smem = c_bufs.index(WHICH)
    num_pid_m, num_pid_n, k_steps = _grid_sizes(a_desc, b_desc)
    grid = gl.num_programs(0)
    j = 0  # tiles this consumer has done
    for tile_id in range(gl.program_id(0) + WHICH * grid, num_pid_m * num_pid_n, NUM_CONSUMERS * grid):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, group_m)
        start = (NUM_CONSUMERS * j + WHICH) * k_steps  # stages the producer filled before this tile
        if NUM_CONSUMERS == 2:
            # Wait for the other consumer to have issued its previous mainloop
            # (consumer 0's first wait, parity 1 of a fresh barrier, passes at once).
            mbarrier.wait(order.index(WHICH), (j & 1) ^ (1 - WHICH))
        acc = _mainloop(a_bufs, b_bufs, ready, empty, start, k_steps, acc_layout, NUM_STAGES)
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
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
    return a_bufs, b_bufs, c_bufs, ready, empty, order


@gluon.jit
def _gemm_ws_kernel(a_desc, b_desc, c_desc, group_m, NUM_STAGES: gl.constexpr, COOPERATIVE: gl.constexpr,
                    CONSUMER_REGS: gl.constexpr, PRODUCER_REGS: gl.constexpr):
    NUM_CONSUMERS: gl.constexpr = 1 if COOPERATIVE else 2
    a_bufs, b_bufs, c_bufs, ready, empty, order = _shared_state(a_desc, b_desc, c_desc, NUM_STAGES, NUM_CONSUMERS)

    if COOPERATIVE:
        # Default partition (this kernel's 8 warps): the one consumer. Worker: the
        # producer (1 warp, PRODUCER_REGS); the consumer gets the rest.
        gl.warp_specialize([
            (_consumer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m,
                         0, NUM_CONSUMERS, NUM_STAGES)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, group_m, NUM_STAGES)),
        ], [1], [PRODUCER_REGS])
    else:
        # Default partition (this kernel's 4 warps): consumer 0. Workers: consumer 1
        # (4 warps, CONSUMER_REGS) and the producer (1 warp, PRODUCER_REGS).
        gl.warp_specialize([
            (_consumer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m,
                         0, NUM_CONSUMERS, NUM_STAGES)),
            (_consumer, (a_desc, b_desc, c_desc, a_bufs, b_bufs, c_bufs, ready, empty, order, group_m,
                         1, NUM_CONSUMERS, NUM_STAGES)),
            (_producer, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, group_m, NUM_STAGES)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class WsConfig:
    """Every knob of the kernel (``num_sms=None``: every SM of the device)."""

    block_m: int = 128  # tile rows. Ping-pong: 64 or 128 (one warpgroup); cooperative: 128 or 256
    block_n: int = 128  # 64, 128 or 256 (one wgmma instruction wide)
    block_k: int = 64  # 32 or 64
    num_stages: int = 4  # depth of the shared-memory ring
    group_m: int = 8  # rows of tiles per L2 band
    num_sms: int | None = None  # CTAs launched (one per SM)
    cooperative: bool = False  # False: ping-pong (2 consumers, alternate tiles); True: 1 consumer of 8 warps
    consumer_regs: int = 232  # per thread, consumer 1's warpgroup (ping-pong only; see consumer_regs_of)
    producer_regs: int = 40  # per thread, the producer's warpgroup

    def label(self) -> str:
        s = f"{'coop' if self.cooperative else 'ws'} {self.block_m}x{self.block_n}x{self.block_k} " \
            f"s{self.num_stages} g{self.group_m}"
        if self.num_sms is not None:
            s += f" sm{self.num_sms}"
        if self.producer_regs != 40 or (self.consumer_regs != 232 and not self.cooperative):
            s += f" r{consumer_regs_of(self)}/{self.producer_regs}"
        return s

    def as_params(self) -> dict:
        return dataclasses.asdict(self)


def _who(cls) -> str:
    """The module name errors start with: gemm_ws, or a subclass's module (grouped_gemm_ws)."""
    return cls.__module__.rsplit(".", 1)[-1]


def _as_config(config, cls: type | None = None):
    """A ``cls`` (default ``WsConfig``) from None, an instance or a dict of its fields."""
    cls = cls or WsConfig
    if config is None:
        return cls()
    if isinstance(config, cls):
        return config
    if isinstance(config, Mapping):
        known = dataclasses.asdict(cls())
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(f"{_who(cls)}: unknown config field(s) {unknown}; known: {sorted(known)}")
        return cls(**config)
    raise ValueError(f"{_who(cls)}: config must be a {cls.__name__} or a dict, got {type(config).__name__}")


def num_consumers(config: WsConfig) -> int:
    return 1 if config.cooperative else 2


def num_warps(config: WsConfig) -> int:
    """The kernel's num_warps: its default partition (consumer 0) - one or two warpgroups."""
    return 8 if config.cooperative else 4


def smem_bytes(config: WsConfig | Mapping[str, Any] | None = None, elem_bytes: int = 2,
               cls: type | None = None) -> int:
    """Shared memory per CTA (an upper bound): the ring, one C staging buffer per
    consumer, the mbarriers, and what Triton adds for warp specialisation."""
    c = _as_config(config, cls)
    ring = c.num_stages * (c.block_m * c.block_k + c.block_k * c.block_n) * elem_bytes
    staging = num_consumers(c) * c.block_m * c.block_n * elem_bytes
    barriers = 8 * (2 * c.num_stages + 2)
    return ring + staging + barriers + WS_EXTRA_SMEM


def default_partition_regs(config: WsConfig) -> int:
    """Registers per thread the compiler leaves the default partition (consumer 0):
    the 3 warpgroups' ``3 * MAXNREG`` less what the workers asked for."""
    total = TOTAL_WARPS // 4 * MAXNREG
    if config.cooperative:
        return (total - config.producer_regs) // 2 // 8 * 8  # two warpgroups share it
    return total - config.producer_regs - config.consumer_regs


def consumer_regs_of(config: WsConfig) -> int:
    """Registers per thread every consumer thread gets."""
    if config.cooperative:
        return default_partition_regs(config)
    return min(config.consumer_regs, default_partition_regs(config))


def _validate_tile(c: WsConfig) -> None:
    threads = 32 * num_warps(c)
    who = _who(type(c))
    if c.block_m not in ((128, 256) if c.cooperative else (64, 128)):
        raise ValueError(f"{who}: block_m={c.block_m!r} must be " + (
            "128 or 256 (cooperative: 2 warpgroups)" if c.cooperative else "64 or 128 (one warpgroup per consumer)"))
    if c.block_n not in (64, 128, 256):
        raise ValueError(f"{who}: block_n={c.block_n!r} must be 64, 128 or 256 (one wgmma instruction)")
    if c.block_k not in (32, 64):
        raise ValueError(f"{who}: block_k={c.block_k!r} must be 32 or 64 (one 128-byte swizzled row)")
    if c.block_m * c.block_n > 128 * threads:
        raise ValueError(f"{who}: a {c.block_m}x{c.block_n} fp32 accumulator needs "
                         f"{c.block_m * c.block_n // threads} registers per consumer thread; at most 128 fit "
                         + ("(use 128x256 or 256x128)" if c.cooperative else "(use 128x128 or 64x256)"))


def validate(config: WsConfig | Mapping[str, Any] | None, cls: type | None = None) -> WsConfig:
    """The config (a ``cls``, default ``WsConfig``), or a ValueError naming the knob that cannot work."""
    c = _as_config(config, cls)
    who = _who(type(c))
    if not isinstance(c.cooperative, bool):
        raise ValueError(f"{who}: cooperative={c.cooperative!r} must be True or False")
    _validate_tile(c)
    if not isinstance(c.num_stages, int) or c.num_stages < 2:
        raise ValueError(f"{who}: num_stages={c.num_stages!r} must be an int >= 2")
    if not isinstance(c.group_m, int) or c.group_m < 1:
        raise ValueError(f"{who}: group_m={c.group_m!r} must be an int >= 1")
    if c.num_sms is not None and (not isinstance(c.num_sms, int) or c.num_sms < 1):
        raise ValueError(f"{who}: num_sms={c.num_sms!r} must be None or an int >= 1")
    for name in ("consumer_regs", "producer_regs"):
        r = getattr(c, name)
        if not isinstance(r, int) or r % 8 or not 24 <= r <= 256:
            raise ValueError(f"{who}: {name}={r!r} must be a multiple of 8 in [24, 256] (setmaxnreg)")
    if not c.cooperative and default_partition_regs(c) < c.consumer_regs:
        raise ValueError(f"{who}: producer_regs + 2 * consumer_regs = {c.producer_regs + 2 * c.consumer_regs} "
                         f"exceeds the {TOTAL_WARPS // 4} warpgroups' {TOTAL_WARPS // 4 * MAXNREG} registers "
                         f"per thread (65536 per SM over {TOTAL_WARPS * 32} threads)")
    need = smem_bytes(c)
    if need > SMEM_LIMIT_SM90:
        raise ValueError(f"{who}: {c.label()} needs {need} bytes of shared memory, over sm_90's "
                         f"{SMEM_LIMIT_SM90} per block; use fewer stages or a smaller tile")
    return c


# --------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dtype]


def _tma_ok(t: torch.Tensor) -> bool:
    """Unit inner stride, 16-byte aligned base and outer strides (any rank)."""
    es = t.element_size()
    return (t.stride(-1) == 1 and all((st * es) % 16 == 0 for st in t.stride()[:-1])
            and t.data_ptr() % 16 == 0)


def check_alignment(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16) -> None:
    """ValueError unless the TMA engine can address A (M, K), B (K, N) and C (M, N)
    packed row-major: 16-byte row strides, so K and N multiples of 8 (16-bit)."""
    per16 = 16 // dtype.itemsize
    if K % per16 or N % per16:
        raise ValueError(f"gemm_ws: K={K} and N={N} must be multiples of {per16} for {dtype} (TMA needs "
                         f"16-byte aligned row strides); {_FALLBACK}, which handles any shape")


def _check_operands(a, b) -> None:
    if interpreter.active():
        raise ValueError("gemm_ws: Gluon kernels do not run in Triton's interpreter (TRITON_INTERPRET=1 is set); "
                         f"{_FALLBACK}")
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ValueError("gemm_ws: a and b must be torch tensors")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm_ws: need a (M, K) and b (K, N), got a{tuple(a.shape)} and b{tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in DTYPES:
        raise ValueError(f"gemm_ws: a and b must both be bfloat16 or both float16, got {a.dtype} and {b.dtype}; "
                         f"{_FALLBACK}")
    if a.device != b.device:
        raise ValueError(f"gemm_ws: a is on {a.device} and b on {b.device}; put both on one device")
    if a.device.type != "cuda":
        raise ValueError(f"gemm_ws: tensors on {a.device}: this kernel needs an sm_90 (Hopper) CUDA GPU; "
                         f"{_FALLBACK}")
    cap = _capability(a.device.index if a.device.index is not None else torch.cuda.current_device())
    if cap[0] != 9:
        raise ValueError(f"gemm_ws: this kernel needs an sm_90 (Hopper) GPU, found sm_{cap[0]}{cap[1]} "
                         f"(wgmma and setmaxnreg as used here are Hopper's); {_FALLBACK}")


def _layout(dtype: torch.dtype, block: list[int]):
    """The swizzled shared-memory layout a TMA box of this shape lands in (any rank)."""
    return gl.NVMMASharedLayout.get_default_for(block, _gl_dtype(dtype))


def _descriptor(t: torch.Tensor, block: list[int]):
    return TensorDescriptor.from_tensor(t, block, _layout(t.dtype, block))


def grid_size(M: int, N: int, config: WsConfig, num_sms: int) -> int:
    """CTAs launched: one per SM (or ``config.num_sms``), never more than tiles."""
    tiles = -(-M // config.block_m) * -(-N // config.block_n)
    return max(1, min(config.num_sms or num_sms, tiles))


def matmul_ws(a: torch.Tensor, b: torch.Tensor, *, config: WsConfig | Mapping[str, Any] | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` with the warp-specialised ping-pong kernel (sm_90 only).

    a: (M, K), b: (K, N), both bf16 or both fp16, with unit column stride and
    16-byte aligned rows (K, N multiples of 8). ``out`` (M, N), if given,
    receives C. Raises ValueError, naming ``kernels.gemm.matmul`` as the
    fallback, for anything this kernel cannot take.
    """
    cfg = validate(config)
    _check_operands(a, b)
    M, K = a.shape
    N = b.shape[1]
    check_alignment(M, N, K, a.dtype)
    out, done = prepare_output(out, M, N, K, a, who="gemm_ws")
    if done:
        return out
    if not all(_tma_ok(t) for t in (a, b, out)):
        raise ValueError("gemm_ws: a, b and out need unit column stride, 16-byte aligned base pointers and "
                         f"row strides (TMA); {_FALLBACK}, which takes any strides")
    cuda_context.ensure_current(a.device)   # autograd's backward thread may have no current context
    a_desc = _descriptor(a, [cfg.block_m, cfg.block_k])
    b_desc = _descriptor(b, [cfg.block_k, cfg.block_n])
    c_desc = _descriptor(out, [cfg.block_m, cfg.block_n])
    grid = grid_size(M, N, cfg, _sm_count(a.device.index if a.device.index is not None else torch.cuda.current_device()))
    _gemm_ws_kernel[(grid,)](a_desc, b_desc, c_desc, cfg.group_m, NUM_STAGES=cfg.num_stages,
                             COOPERATIVE=cfg.cooperative, CONSUMER_REGS=cfg.consumer_regs,
                             PRODUCER_REGS=cfg.producer_regs, num_warps=num_warps(cfg), maxnreg=MAXNREG)
    return out


def reference(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """fp32 torch product of the same operands (tf32 off on CUDA)."""
    if a.device.type == "cuda":
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return a.float() @ b.float()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    return a.float() @ b.float()


def flops(M: int, N: int, K: int) -> int:
    return 2 * M * N * K


def tolerance(dtype: torch.dtype) -> float:
    """Largest accepted ||C - ref|| / ||ref|| (C rounded to dtype), as kernels.gemm."""
    return {torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]


# --------------------------------------------------------------------------
# Cross-compilation (no GPU needed): arguments for workbench.asm.compile
# --------------------------------------------------------------------------
def _desc_type(dtype: torch.dtype, block: list[int]) -> str:
    # Gluon descriptors carry their shared-memory layout in the type, after the
    # block shape (triton.language.str_to_ty evaluates it); any rank.
    return f"tensordesc<{triton_type(dtype)}[{', '.join(map(str, block))}],{_layout(dtype, block)!r}>"


def compile_args(config: WsConfig | Mapping[str, Any] | None = None, dtype: torch.dtype = torch.bfloat16,
                 shape: Mapping[str, int] | tuple[int, int, int] | None = None) -> dict:
    """Keyword arguments for ``workbench.asm.compile.cross_compile`` that build
    the kernel ``matmul_ws`` launches for ``config`` (``fn`` included)::

        cross_compile(targets="sm90", cache_dir=d, **compile_args(cfg, torch.float16))

    The descriptors carry the problem size at run time, so ``shape`` (M, N, K)
    only checks the alignment rule.
    """
    cfg = validate(config)
    if dtype not in DTYPES:
        raise ValueError(f"gemm_ws: dtype {dtype} is not supported; use torch.bfloat16 or torch.float16")
    if shape is not None:
        M, N, K = (shape["M"], shape["N"], shape["K"]) if isinstance(shape, Mapping) else shape
        check_alignment(M, N, K, dtype)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    sig = {"a_desc": _desc_type(dtype, [bm, bk]), "b_desc": _desc_type(dtype, [bk, bn]),
           "c_desc": _desc_type(dtype, [bm, bn]), "group_m": "i32"}
    constexprs = {"NUM_STAGES": cfg.num_stages, "COOPERATIVE": cfg.cooperative, "CONSUMER_REGS": cfg.consumer_regs,
                  "PRODUCER_REGS": cfg.producer_regs}
    return {"fn": _gemm_ws_kernel, "signature": sig, "constexprs": constexprs, "num_warps": num_warps(cfg),
            "options": {"maxnreg": MAXNREG}}
