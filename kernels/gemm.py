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
Gluon kernel of ``kernels.gemm_ws`` (``GemmConfig.gluon`` = "pingpong" or
"coop"), except where this kernel's stream-K tail wins (see ``heuristic``).

Counting (``flops``, ``bytes_moved``): 2*M*N*K floating-point operations; the
fewest bytes are each input read once and C written once:
``(M*K + K*N + M*N) * element_size``.

This module also implements the sweep protocol of ``workbench.sweep``
(``make_inputs``, ``run``, ``reference``, ``flops``, ``bytes_moved``,
``tolerance``, ``baselines``, ``PARAMS``, ``poison``, ``derived``, ``warmup``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
from typing import Any, Mapping

import torch
import triton
import triton.language as tl

from kernels import interpreter
from workbench.asm.resources import smem_per_block
from workbench.dtypes import element_size, triton_type

try:  # triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
SMEM_LIMIT_SM90 = smem_per_block(90)  # bytes of shared memory one block may use on sm_90


if interpreter.active():
    interpreter.patch()


# --------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------
@triton.jit
def _tile_coords(tile_id, num_pid_m, num_pid_n, group_m):
    """Tile index -> (row block, column block), walking bands of group_m rows: an
    L2 swizzle (programs that run together share A rows and B columns)."""
    band_id = tile_id // (group_m * num_pid_n)
    first_m = band_id * group_m
    rows_in_band = tl.minimum(num_pid_m - first_m, group_m)
    inside = tile_id - band_id * (group_m * num_pid_n)
    return first_m + inside % rows_in_band, inside // rows_in_band


@triton.jit
def _store_tile(acc, off_m, off_n, c_desc, c_ptr, stride_cm, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                TMA_STORE: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr):
    """C[off_m:, off_n:] = acc: through C's descriptor (whole, or in two column
    halves to halve the staging buffer), or with plain masked stores (the form
    Triton 3.6's Hopper warp specialisation accepts)."""
    if TMA_STORE:
        if EPILOGUE_SPLIT == 2:
            pair = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1))
            left, right = tl.split(pair)
            c_desc.store([off_m, off_n], left.to(c_desc.dtype))
            c_desc.store([off_m, off_n + BLOCK_N // 2], right.to(c_desc.dtype))
        else:
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
    else:
        rows = off_m + tl.arange(0, BLOCK_M)
        cols = off_n + tl.arange(0, BLOCK_N)
        tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=(rows[:, None] < M) & (cols[None, :] < N))


@triton.jit
def _sk_program_of(step, sk_iters_per, sk_extra):
    """The stream-K program whose range holds global tail K-step `step` (the first
    sk_extra programs take sk_iters_per + 1 steps, the rest sk_iters_per)."""
    big = sk_extra * (sk_iters_per + 1)
    return tl.where(step < big, step // (sk_iters_per + 1), sk_extra + (step - big) // sk_iters_per)


@triton.jit(do_not_specialize=["num_sms", "group_m", "dp_tiles", "sk_programs", "sk_iters_per", "sk_extra"])
def _gemm_tma_kernel(a_desc, b_desc, c_desc, c_ptr, stride_cm, M, N, K, num_sms, group_m,
                     dp_tiles, sk_programs, sk_iters_per, sk_extra, ws_ptr, cnt_ptr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     TMA_STORE: tl.constexpr, EPILOGUE_SPLIT: tl.constexpr, FLATTEN: tl.constexpr,
                     WARP_SPECIALIZE: tl.constexpr, STREAM_K: tl.constexpr):
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    k_steps = (K + BLOCK_K - 1) // BLOCK_K
    pid = tl.program_id(0)
    # Data-parallel part: whole tiles 0 .. dp_tiles-1 (every tile without stream-K).
    for tile_id in tl.range(pid, dp_tiles, num_sms, flatten=FLATTEN,
                            warp_specialize=WARP_SPECIALIZE):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, group_m)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_steps):
            a = a_desc.load([off_m, kk * BLOCK_K])
            b = b_desc.load([kk * BLOCK_K, off_n])
            acc = tl.dot(a, b, acc)
        _store_tile(acc, off_m, off_n, c_desc, c_ptr, stride_cm, M, N, BLOCK_M, BLOCK_N, TMA_STORE,
                    EPILOGUE_SPLIT)
    if STREAM_K:
        # Stream-K tail: the last (tiles - dp_tiles) tiles' K-steps, split evenly
        # over programs 0 .. sk_programs-1 (contiguous ranges, the first sk_extra
        # programs one step more), so the last wave leaves no SM idle. A tile
        # split between programs is summed by whichever arrives last: each writes
        # its fp32 partial to its own workspace slot (0: the first tile of its
        # range, 1: the last), then counts itself in the tile's counter; the one
        # that completes the count sums the tile's slots, stores C and resets the
        # counter for the next call. Nobody waits, so it also runs in the interpreter.
        # Split tiles leave through plain stores (C's descriptor box is a whole tile).
        if pid < sk_programs:
            start = pid * sk_iters_per + tl.minimum(pid, sk_extra)
            end = start + sk_iters_per + (pid < sk_extra).to(tl.int32)
            rows_t = tl.arange(0, BLOCK_M)
            cols_t = tl.arange(0, BLOCK_N)
            tile_offs = rows_t[:, None] * BLOCK_N + cols_t[None, :]
            half_cols = tl.arange(0, BLOCK_N // 2)
            it = start
            while it < end:
                t = it // k_steps
                k_lo = it - t * k_steps
                k_hi = tl.minimum(k_steps, k_lo + end - it)
                pid_m, pid_n = _tile_coords(dp_tiles + t, num_pid_m, num_pid_n, group_m)
                off_m = pid_m * BLOCK_M
                off_n = pid_n * BLOCK_N
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for kk in range(k_lo, k_hi):
                    a = a_desc.load([off_m, kk * BLOCK_K])
                    b = b_desc.load([kk * BLOCK_K, off_n])
                    acc = tl.dot(a, b, acc)
                # Programs holding the tile's first and last K-step.
                s_first = t * k_steps
                s_last = s_first + k_steps - 1
                q_first = _sk_program_of(s_first, sk_iters_per, sk_extra)
                q_last = _sk_program_of(s_last, sk_iters_per, sk_extra)
                if q_first == q_last:  # the whole tile is ours
                    _store_tile(acc, off_m, off_n, c_desc, c_ptr, stride_cm, M, N, BLOCK_M, BLOCK_N, TMA_STORE,
                                EPILOGUE_SPLIT)
                else:
                    slot = (t != start // k_steps).to(tl.int32)
                    tl.store(ws_ptr + (pid * 2 + slot).to(tl.int64) * (BLOCK_M * BLOCK_N) + tile_offs, acc)
                    tl.debug_barrier()  # every thread's partial is written before the count
                    arrived = tl.atomic_add(cnt_ptr + t, 1, sem="acq_rel", scope="gpu")
                    if arrived == q_last - q_first:
                        # Sum the slots half a tile at a time (the accumulator is dead by
                        # now): a whole second tile in registers would spill.
                        for h in tl.static_range(2):
                            half_offs = rows_t[:, None] * BLOCK_N + (h * (BLOCK_N // 2) + half_cols)[None, :]
                            part = tl.zeros((BLOCK_M, BLOCK_N // 2), dtype=tl.float32)
                            for q in range(q_first, q_last + 1):
                                q_start = q * sk_iters_per + tl.minimum(q, sk_extra)
                                q_slot = (t != q_start // k_steps).to(tl.int32)
                                part += tl.load(ws_ptr + (q * 2 + q_slot).to(tl.int64) * (BLOCK_M * BLOCK_N)
                                                + half_offs, cache_modifier=".cg")
                            rows = off_m + rows_t
                            cols = off_n + h * (BLOCK_N // 2) + half_cols
                            tl.store(c_ptr + rows[:, None] * stride_cm + cols[None, :],
                                     part.to(c_ptr.dtype.element_ty),
                                     mask=(rows[:, None] < M) & (cols[None, :] < N))
                        tl.store(cnt_ptr + t, 0)
                it += k_hi - k_lo


@triton.jit(do_not_specialize=["num_sms", "group_m"])
def _gemm_ptr_kernel(a_ptr, b_ptr, c_ptr, M, N, K,
                     stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn,
                     num_sms, group_m,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     FLATTEN: tl.constexpr):
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    num_tiles = num_pid_m * num_pid_n
    k_steps = (K + BLOCK_K - 1) // BLOCK_K
    lane_k = tl.arange(0, BLOCK_K)
    for tile_id in tl.range(tl.program_id(0), num_tiles, num_sms, flatten=FLATTEN):
        pid_m, pid_n = _tile_coords(tile_id, num_pid_m, num_pid_n, group_m)
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        # Rows/columns past the edge read row/column 0 (always valid) and are
        # never stored, so the loads need a mask on K only.
        rows_in = tl.where(rows < M, rows, 0)
        cols_in = tl.where(cols < N, cols, 0)
        a_ptrs = a_ptr + rows_in[:, None] * stride_am + lane_k[None, :] * stride_ak
        b_ptrs = b_ptr + lane_k[:, None] * stride_bk + cols_in[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for kk in range(k_steps):
            k_left = K - kk * BLOCK_K
            a = tl.load(a_ptrs, mask=lane_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=lane_k[:, None] < k_left, other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
        c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :] * stride_cn
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rows[:, None] < M) & (cols[None, :] < N))


# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class GemmConfig:
    """Every knob of the kernel. ``None`` means "decide from the device"."""

    block_m: int = 128
    block_n: int = 256
    block_k: int = 64
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3
    num_sms: int | None = None  # programs launched; None = every SM
    tma: bool | None = None  # None = TMA when the device and operands allow it
    warp_specialize: bool = False  # Hopper: needs tma_store=False and flatten=False
    tma_store: bool = True  # TMA path: store C through a descriptor (else plain stores)
    epilogue_split: int = 1  # 1 or 2 (descriptor stores only)
    flatten: bool = True
    stream_k: bool = False  # TMA path: split the last wave's tiles along K over every SM
    # "pingpong" or "coop": run the Gluon warp-specialised kernel (kernels.gemm_ws)
    # with this tile, stages, group and SM count; num_warps and the other
    # Triton-kernel knobs do not apply (4 warps per consumer warpgroup there).
    gluon: str | None = None

    def label(self) -> str:
        if self.gluon:
            return self.ws_config().label().replace("ws ", "gl-pp ").replace("coop ", "gl-coop ")
        s = f"{self.block_m}x{self.block_n}x{self.block_k} w{self.num_warps} s{self.num_stages} g{self.group_m}"
        if self.num_sms is not None:
            s += f" sm{self.num_sms}"
        if self.warp_specialize:
            s += " ws"
        if not self.tma_store:
            s += " st"
        if self.epilogue_split != 1:
            s += f" e{self.epilogue_split}"
        if not self.flatten:
            s += " nf"
        if self.tma is False:
            s += " ptr"
        if self.stream_k:
            s += " sk"
        return s

    def as_params(self) -> dict:
        return dataclasses.asdict(self)

    def ws_config(self):
        """The kernels.gemm_ws configuration of a ``gluon`` config."""
        from kernels import gemm_ws

        return gemm_ws.WsConfig(block_m=self.block_m, block_n=self.block_n, block_k=self.block_k,
                                num_stages=self.num_stages, group_m=self.group_m, num_sms=self.num_sms,
                                cooperative=self.gluon == "coop")


PARAMS = GemmConfig().as_params()  # the names a sweep grid may use, with defaults


def _as_config(config: GemmConfig | Mapping[str, Any] | None) -> GemmConfig | None:
    if config is None or isinstance(config, GemmConfig):
        return config
    if isinstance(config, Mapping):
        unknown = sorted(set(config) - set(PARAMS))
        if unknown:
            raise ValueError(f"gemm: unknown config field(s) {unknown}; known: {sorted(PARAMS)}")
        return GemmConfig(**config)
    raise ValueError(f"gemm: config must be a GemmConfig or a dict, got {type(config).__name__}")


def smem_bytes(config: GemmConfig, elem_bytes: int = 2, tma: bool = True) -> int:
    """Shared memory the config asks for: the pipeline's A and B stages plus,
    on the TMA path, the epilogue's staging buffer for C."""
    c = _as_config(config)
    if c.gluon:   # the Gluon kernel's ring, C buffers, barriers and partition state
        from kernels import gemm_ws

        return gemm_ws.smem_bytes(c.ws_config(), elem_bytes)
    stages = (c.block_m * c.block_k + c.block_k * c.block_n) * elem_bytes * c.num_stages
    epilogue = c.block_m * c.block_n * elem_bytes // c.epilogue_split if tma and c.tma_store else 0
    return stages + epilogue


def _validate_config(c: GemmConfig) -> None:
    for name in ("block_m", "block_n", "block_k"):
        v = getattr(c, name)
        if not isinstance(v, int) or v < 16 or v > 1024 or v & (v - 1):  # bounded: specs set these
            raise ValueError(f"gemm: {name}={v!r} must be a power of two from 16 to 1024")
    if c.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"gemm: num_warps={c.num_warps!r} must be 1, 2, 4, 8 or 16")
    if not isinstance(c.num_stages, int) or not 1 <= c.num_stages <= 32:
        raise ValueError(f"gemm: num_stages={c.num_stages!r} must be an int from 1 to 32")
    if not isinstance(c.group_m, int) or c.group_m < 1:
        raise ValueError(f"gemm: group_m={c.group_m!r} must be an int >= 1")
    if c.num_sms is not None and (not isinstance(c.num_sms, int) or not 1 <= c.num_sms <= 4096):
        raise ValueError(f"gemm: num_sms={c.num_sms!r} must be None or an int from 1 to 4096")
    if c.epilogue_split not in (1, 2):
        raise ValueError(f"gemm: epilogue_split={c.epilogue_split!r} must be 1 or 2")
    if c.stream_k and (c.warp_specialize or c.tma is False):
        raise ValueError("gemm: stream_k=True runs on the TMA path without warp specialisation "
                         "(set tma=None or True and warp_specialize=False)")
    if c.gluon is not None:
        if c.gluon not in GLUON_SCHEDULES:
            raise ValueError(f"gemm: gluon={c.gluon!r} must be None (the Triton kernel) or one of {GLUON_SCHEDULES}")
        if c.stream_k or c.warp_specialize or c.tma is False:
            raise ValueError("gemm: gluon configs run kernels.gemm_ws (TMA, its own warp specialisation, no "
                             "stream-K): leave stream_k, warp_specialize and tma at their defaults")
        from kernels import gemm_ws

        gemm_ws.validate(c.ws_config())
    if c.warp_specialize and (c.tma_store or c.flatten):
        raise ValueError("gemm: warp_specialize=True needs tma_store=False and flatten=False (Triton 3.6's "
                         "Hopper warp specialisation rejects descriptor stores and flattened loops)")


GLUON_SCHEDULES = ("pingpong", "coop")


def _refuse_ws_on_gpu() -> None:
    # Seen on an H200 (2026-11-21, Triton 3.6.0): the warp-specialised
    # persistent kernel compiles (12 warps, setmaxnreg) but never finishes.
    if os.environ.get("WORKBENCH_ALLOW_WS", "0") != "1":
        raise ValueError("gemm: warp_specialize=True hung the GPU with Triton 3.6 on an H200 (the kernel never "
                         "finished); set WORKBENCH_ALLOW_WS=1 to run it anyway (interpreter runs are fine)")


# --------------------------------------------------------------------------
# Heuristic
# --------------------------------------------------------------------------
# (block_m, block_n, block_k, num_warps, num_stages) -> (per-SM rate in
# TFLOP/s, fixed cost per tile in microseconds), fitted by least squares to
# the H200 sweep (results/gemm_tiling/rows.parquet, 2026-11-21): for each tile,
# time = rounds * (2*BM*BN*K / rate + fixed) over the shapes it ran on (35
# shapes; 128x128 with 6 stages: the 8 goal shapes of the stages study; 64x128
# with 6 stages: its 4-stage fit scaled by the 6/4-stage speed-up seen there).
# All store C with plain stores (tma_store=False); what the sweep showed:
# * 128x256x64, 8 warps: the best large-shape tile (two warpgroups, each
#   64x256 through wgmma m64n256k16); 4 stages >= 3; plain stores ~= TMA stores.
# * 128x128x64, 4 warps: 6 stages beat 4 by 5-14% on every goal shape
#   (512x4096x7168: 700 vs 613 TFLOP/s); it wins when 128x256 tiles would
#   leave SMs idle in the last round (M=512 or small N*M).
# * 64x128 / 128x64: for small problems (more tiles to spread); 64x128 also
#   likes deep pipelines (5-6 stages: ~+25% over 4).
# * GROUP_M 8 is as good as any other value within the noise; 256x128 tiles and
#   fewer programs than SMs never won.
_CANDIDATES: dict[tuple[int, int, int, int, int], tuple[float, float]] = {
    (128, 256, 64, 8, 4): (5.54, 2.0),
    (128, 128, 64, 4, 6): (5.20, 0.6),
    (64, 128, 64, 4, 6): (4.40, 0.5),
    (128, 64, 64, 4, 4): (3.42, 0.8),
}


# Stream-K tail (`stream_k_plan`) for big problems: the goal-shape table of
# results/gemm_tiling/variants.csv (H200, 2026-11-21, cuBLAS in the same run)
# measured it +1.5-2% on 8192^3 (15 whole rounds of 128x256 tiles + 68 of 132
# SMs' worth), +0.6-1.1% on 8192x28672x8192 (54 rounds), +0.7% on
# 16384x3584x8192 (13 rounds), and -8% on 4096^3 (3 rounds), -11% on
# 2048x7168x2048 (6 rounds), -20 to -38% when every tile is split (fewer tiles
# than SMs): a split tile costs a pipeline refill, a partial written and read
# back, and staggered K positions across SMs, which only a long run of whole
# rounds pays for. Best there: 3 stages with C through TMA stores in two halves.
SK_MIN_ROUNDS = 12

# Gluon warp-specialised kernels (kernels.gemm_ws): a producer warp feeds the
# consumers through an mbarrier ring, so a tile's epilogue overlaps loads (coop)
# or another tile's mainloop (ping-pong). The goal-shape probe
# (results/gemm_tiling/ws_probe_run9a.csv, H200, cuBLAS in the same run) put them
# ahead of this module's Triton kernel wherever a problem takes several rounds
# of tiles: 4096x14336x4096 0.984 -> 1.002 (ping-pong) / 0.995 (coop),
# 16384x3584x8192 0.982 -> 0.996 (coop), 4096^3 0.992 -> 0.999 (coop),
# 2048x7168x2048 1.034 -> 1.054 (ping-pong); 8192^3 1.034 -> 1.027 (coop; the
# stream-K tail is worth more there). With a round or less of tiles the Triton
# kernel stays ahead (512x4096x7168: 1.002 vs 0.961; 1024x4096x14336: 1.002 vs
# 0.997): a warp-specialised CTA has no second tile to overlap with.
# Which one (goal table run 9b, three repeats): ping-pong (128x128 tiles) where
# Triton's own pick is 128x128, or where 128x128 tiles fill the last round
# (8192x28672x8192: 1.018 vs coop 1.009); the Triton stream-K kernel where it
# applies with a long K (8192^3: 1.030 vs coop 1.019; the split tiles' partial
# sums are paid back over K, while a hidden epilogue is worth less the longer
# the mainloop); else cooperative 128x256 tiles (4096^3, 4096x14336x4096).
GLUON_PP_MIN_FILL = 0.99
GLUON_SK_MIN_K = 8192
_GLUON_PINGPONG = GemmConfig(block_m=128, block_n=128, block_k=64, num_stages=5, group_m=8, num_warps=4,
                             gluon="pingpong")
_GLUON_COOP = GemmConfig(block_m=128, block_n=256, block_k=32, num_stages=6, group_m=8, num_warps=8,
                         gluon="coop")
_STREAM_K_CONFIG = GemmConfig(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, group_m=8,
                              tma_store=True, epilogue_split=2, stream_k=True)


def _estimate_us(M: int, N: int, K: int, num_sms: int, tile, rate: float, fixed_us: float) -> float:
    bm, bn = tile[0], tile[1]
    tiles = math.ceil(M / bm) * math.ceil(N / bn)
    rounds = math.ceil(tiles / num_sms)
    per_tile_us = 2.0 * bm * bn * max(K, 1) / (rate * 1e12) * 1e6 + fixed_us
    return rounds * per_tile_us


def heuristic(M: int, N: int, K: int, dtype: torch.dtype = torch.bfloat16, num_sms: int = 132,
              hopper: bool = True, gluon: bool = True) -> GemmConfig:
    """The config this module runs when none is given (see the module docstring).
    ``gluon=False`` keeps to the Triton kernel (e.g. for operands TMA cannot take)."""
    if not hopper:
        # Pointer path (interpreter, pre-Hopper): modest tiles.
        return GemmConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=3, group_m=8)
    elem = element_size(dtype)
    best, best_t = None, float("inf")
    for key, (rate, fixed) in _CANDIDATES.items():
        bm, bn, bk, w, s = key
        t = _estimate_us(M, N, K, num_sms, key, rate, fixed)
        if t < best_t:
            best, best_t = GemmConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s,
                                      tma_store=False, group_m=8), t
    tiles = math.ceil(M / best.block_m) * math.ceil(N / best.block_n)
    stream_k = best.block_n == 256 and tiles % num_sms and tiles // num_sms >= SK_MIN_ROUNDS
    big_tiles = math.ceil(M / 128) * math.ceil(N / 256)
    if gluon and dtype in (torch.bfloat16, torch.float16) and big_tiles > num_sms and best.block_m == 128:
        pp_tiles = math.ceil(M / 128) * math.ceil(N / 128)
        pp_fill = pp_tiles / (math.ceil(pp_tiles / num_sms) * num_sms)   # last round's share of SMs busy
        if best.block_n == 128 or pp_fill >= GLUON_PP_MIN_FILL:
            return _GLUON_PINGPONG
        if best.block_n == 256 and not (stream_k and K >= GLUON_SK_MIN_K):
            return _GLUON_COOP
    if stream_k:
        best = _STREAM_K_CONFIG
    return _fit_smem(best, elem)


def _fit_smem(cfg: GemmConfig, elem_bytes: int, limit: int = SMEM_LIMIT_SM90) -> GemmConfig:
    """Shrink a config until its shared memory fits (wider types need it):
    split the epilogue, then fewer stages (down to 2), then a smaller BLOCK_K."""
    while smem_bytes(cfg, elem_bytes) > limit:
        if cfg.tma_store and cfg.epilogue_split == 1:
            cfg = dataclasses.replace(cfg, epilogue_split=2)
        elif cfg.num_stages > 2:
            cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
        elif cfg.block_k > 16:
            cfg = dataclasses.replace(cfg, block_k=cfg.block_k // 2)
        else:
            break
    return cfg


# --------------------------------------------------------------------------
# Stream-K tail
# --------------------------------------------------------------------------
SK_MAX_SPLIT = 4  # programs per tail tile at most: a finishing program reads the others' partials
SK_MIN_STEPS = 2  # K-steps per stream-K program at least


@dataclasses.dataclass(frozen=True)
class StreamKPlan:
    """How ``_gemm_tma_kernel`` splits its work: tiles ``0 .. dp_tiles-1`` whole,
    strided over the programs; the rest as ``sk_programs`` contiguous ranges of
    K-steps, ``sk_iters_per`` each plus one for the first ``sk_extra``."""

    dp_tiles: int
    sk_programs: int
    sk_iters_per: int
    sk_extra: int


def stream_k_plan(tiles: int, programs: int, k_steps: int) -> StreamKPlan:
    """A persistent kernel runs ``ceil(tiles / programs)`` rounds of whole tiles,
    so a last round of ``tiles % programs`` tiles leaves the other SMs idle
    (8192^3 in 128x256 tiles on 132 SMs: 15.5 rounds of work take 16). Here the
    whole rounds stay data-parallel and the last round's K-steps are spread over
    up to ``SK_MAX_SPLIT`` programs per tile. Returns a plan with
    ``sk_programs == 0`` when there is nothing to gain (no partial round, or too
    few K-steps to split)."""
    tail = tiles % programs if tiles > programs else tiles
    none = StreamKPlan(tiles, 0, 1, 0)
    if tail == 0:
        return none
    steps = tail * k_steps
    sk_programs = min(programs, tail * SK_MAX_SPLIT, steps // SK_MIN_STEPS)
    if sk_programs <= tail:
        return none
    per, extra = divmod(steps, sk_programs)
    return StreamKPlan(tiles - tail, sk_programs, per, extra)


_SK_WORKSPACE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def _stream_k_workspace(device: torch.device, programs: int, tile_elems: int, sk_tiles: int):
    """fp32 partial slots (2 per program) and per-tile arrival counters, zeroed once
    and reused: the kernel resets every counter it completes. One pair per device
    and stream, so calls on two streams never share counters."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    ws, cnt = _SK_WORKSPACE.get(key, (None, None))
    if ws is None or ws.numel() < programs * 2 * tile_elems or cnt.numel() < sk_tiles:
        ws = torch.empty(max(programs * 2 * tile_elems, ws.numel() if ws is not None else 0),
                         dtype=torch.float32, device=device)
        cnt = torch.zeros(max(sk_tiles, cnt.numel() if cnt is not None else 0), dtype=torch.int32, device=device)
        _SK_WORKSPACE[key] = (ws, cnt)
    return ws, cnt


# --------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------
def _interpreting() -> bool:
    return interpreter.active()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _tma_ok(t: torch.Tensor) -> bool:
    es = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * es) % 16 == 0
            and t.shape[0] > 0 and t.shape[1] > 0)


def _check_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ValueError("gemm: a and b must be torch tensors")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"gemm: a and b must be 2-D, got a{tuple(a.shape)} and b{tuple(b.shape)}")
    if a.shape[1] != b.shape[0]:
        raise ValueError(f"gemm: inner dimensions differ: a is {tuple(a.shape)}, b is {tuple(b.shape)} "
                         f"(need a (M, K) and b (K, N))")
    if a.dtype != b.dtype:
        raise ValueError(f"gemm: a and b must share a dtype, got {a.dtype} and {b.dtype}")
    if a.dtype not in DTYPES:
        raise ValueError(f"gemm: dtype {a.dtype} is not supported; use one of "
                         f"{', '.join(str(d) for d in DTYPES)}")
    if a.device != b.device:
        raise ValueError(f"gemm: a is on {a.device} and b on {b.device}; put both on one device")
    if a.device.type == "cuda":
        return
    if a.device.type == "cpu" and _interpreting():
        return
    raise ValueError(f"gemm: tensors on {a.device} need a CUDA GPU, or TRITON_INTERPRET=1 set before "
                     f"triton is imported to run them in Triton's interpreter")


def prepare_output(out: torch.Tensor | None, M: int, N: int, K: int, like: torch.Tensor, who: str = "gemm"):
    """(C, done) for a product with an (M, N) result and reduction length K, in
    ``like``'s dtype and device: ``out`` checked, or a new tensor; ``done`` when
    nothing is left to compute (C is empty, or K == 0 and C zeroed)."""
    if out is None:
        out = torch.empty((M, N), dtype=like.dtype, device=like.device)
    elif not isinstance(out, torch.Tensor):
        raise ValueError(f"{who}: out must be a torch tensor ({M}, {N}) {like.dtype} on {like.device}, "
                         f"got {type(out).__name__}")
    elif out.shape != (M, N) or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(f"{who}: out must be ({M}, {N}) {like.dtype} on {like.device}, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if M == 0 or N == 0:
        return out, True
    if K == 0:
        return out.zero_(), True
    return out, False


def matmul(a: torch.Tensor, b: torch.Tensor, config: GemmConfig | Mapping[str, Any] | None = None,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` with the persistent Triton kernel, or with the warp-specialised
    Gluon kernel (``kernels.gemm_ws``) when the config says ``gluon``.

    a: (M, K), b: (K, N), same dtype (bf16, fp16 or fp32) and device; any
    strides. ``config`` picks the knobs (``GemmConfig`` or a dict of its fields;
    ``None`` runs ``heuristic``). ``out`` (M, N), if given, receives C.
    """
    _check_operands(a, b)
    M, K = a.shape
    N = b.shape[1]
    out, done = prepare_output(out, M, N, K, a)
    if done:
        return out

    on_gpu = a.device.type == "cuda"
    dev_index = a.device.index if a.device.index is not None else torch.cuda.current_device() if on_gpu else 0
    hopper = on_gpu and _capability(dev_index)[0] >= 9
    sms = _sm_count(dev_index) if on_gpu else 4
    aligned = TensorDescriptor is not None and all(_tma_ok(t) for t in (a, b, out))
    sm90 = on_gpu and _capability(dev_index)[0] == 9
    cfg = _as_config(config)
    if cfg is None:
        cfg = heuristic(M, N, K, a.dtype, sms, hopper=hopper, gluon=aligned and sm90)
    _validate_config(cfg)
    if cfg.gluon:
        from kernels import gemm_ws

        if not (sm90 and aligned and a.dtype in gemm_ws.DTYPES):
            raise ValueError(f"gemm: gluon={cfg.gluon!r} runs kernels.gemm_ws, which needs bf16/fp16 operands on an "
                             f"sm_90 GPU with 16-byte aligned rows (K, N multiples of 8); got {a.dtype} on "
                             f"{a.device}. Use gluon=None (the Triton kernel) here")
        return gemm_ws.matmul_ws(a, b, config=cfg.ws_config(), out=out)
    if cfg.warp_specialize and on_gpu:
        _refuse_ws_on_gpu()

    if cfg.tma is None:
        use_tma = hopper and aligned
    elif cfg.tma:
        if not aligned:
            raise ValueError("gemm: tma=True needs unit stride in the last dimension and 16-byte aligned "
                             "rows and base pointers (K and N multiples of 8 for 16-bit types)")
        if on_gpu and not hopper:
            raise ValueError("gemm: tma=True needs an sm_90+ GPU (Hopper)")
        use_tma = True
    else:
        use_tma = False

    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
    if cfg.stream_k and not use_tma and config is None:  # the heuristic's choice, on unaligned operands
        cfg = dataclasses.replace(cfg, stream_k=False)
    if cfg.stream_k and not use_tma:
        raise ValueError("gemm: stream_k=True needs the TMA path (sm_90+, 16-byte aligned rows); "
                         "use stream_k=False for these operands")
    programs = max(1, cfg.num_sms or sms) if cfg.stream_k else max(1, min(cfg.num_sms or sms, tiles))
    if use_tma:
        plan = stream_k_plan(tiles, programs, triton.cdiv(K, cfg.block_k)) if cfg.stream_k else None
        if plan is None or plan.sk_programs == 0:
            plan = StreamKPlan(tiles, 0, 1, 0)
            programs = min(programs, tiles)
            ws, cnt = out, out  # never touched
        else:
            ws, cnt = _stream_k_workspace(out.device, programs, cfg.block_m * cfg.block_n, tiles - plan.dp_tiles)
        a_desc = TensorDescriptor.from_tensor(a, [cfg.block_m, cfg.block_k])
        b_desc = TensorDescriptor.from_tensor(b, [cfg.block_k, cfg.block_n])
        c_desc = (TensorDescriptor.from_tensor(out, [cfg.block_m, cfg.block_n // cfg.epilogue_split])
                  if cfg.tma_store else None)
        _gemm_tma_kernel[(programs,)](
            a_desc, b_desc, c_desc, out, out.stride(0), M, N, K, programs, cfg.group_m,
            plan.dp_tiles, plan.sk_programs, plan.sk_iters_per, plan.sk_extra, ws, cnt,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TMA_STORE=cfg.tma_store,
            EPILOGUE_SPLIT=cfg.epilogue_split, FLATTEN=cfg.flatten, WARP_SPECIALIZE=cfg.warp_specialize,
            STREAM_K=plan.sk_programs > 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        _gemm_ptr_kernel[(programs,)](
            a, b, out, M, N, K,
            a.stride(0), a.stride(1), b.stride(0), b.stride(1), out.stride(0), out.stride(1),
            programs, cfg.group_m,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, FLATTEN=cfg.flatten,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def reference(a, b: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 torch product of the same operands (tf32 off).

    ``reference(a, b)``, or ``reference(inputs)`` with a ``GemmInputs`` (the
    sweep protocol's form).
    """
    if b is None:
        a, b = a.a, a.b
    if a.device.type == "cuda":
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return a.float() @ b.float()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    return a.float() @ b.float()


def cublas(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The library baseline: ``torch.matmul`` (cuBLAS on a CUDA device)."""
    return torch.matmul(a, b, out=out) if out is not None else torch.matmul(a, b)


# --------------------------------------------------------------------------
# Counting
# --------------------------------------------------------------------------
def _mnk(shape: Mapping[str, int]) -> tuple[int, int, int]:
    return int(shape["M"]), int(shape["N"]), int(shape["K"])


def flops(shape: Mapping[str, int]) -> int:
    M, N, K = _mnk(shape)
    return 2 * M * N * K


def bytes_moved(shape: Mapping[str, int], dtype: torch.dtype = torch.bfloat16) -> int:
    M, N, K = _mnk(shape)
    es = element_size(dtype)
    return (M * K + K * N + M * N) * es


# --------------------------------------------------------------------------
# Sweep protocol (see workbench.sweep)
# --------------------------------------------------------------------------
@dataclasses.dataclass
class GemmInputs:
    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor


def make_inputs(shape: Mapping[str, int], dtype: torch.dtype, device, seed: int) -> GemmInputs:
    """Random normal operands scaled so C has entries of order 1."""
    M, N, K = _mnk(shape)
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(int(seed))
    std = max(K, 1) ** -0.25  # entries of A and B: N(0, K^-1/2), so C has entries of order 1
    a = (torch.randn((M, K), generator=g, device=device) * std).to(dtype)
    b = (torch.randn((K, N), generator=g, device=device) * std).to(dtype)
    out = torch.empty((M, N), dtype=dtype, device=device)
    return GemmInputs(a, b, out)


def poison(inputs: GemmInputs) -> None:
    inputs.out.fill_(float("nan"))


def run(inputs: GemmInputs, **params) -> torch.Tensor:
    return matmul(inputs.a, inputs.b, params or None, out=inputs.out)


def tolerance(dtype: torch.dtype) -> float:
    """Largest accepted ||C - ref|| / ||ref|| (C rounded to dtype; tf32 for fp32)."""
    return {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-3}[dtype]


def _consumer_warps(cfg: GemmConfig) -> int:
    """Warps holding one tile's accumulator (Gluon: 4 in ping-pong, 8 in coop)."""
    if cfg.gluon:
        return 8 if cfg.gluon == "coop" else 4
    return cfg.num_warps


def derived(shape: Mapping[str, int], dtype: torch.dtype, params: Mapping[str, Any]) -> dict:
    """Extra names for sweep constraint expressions."""
    cfg = GemmConfig(**{k: v for k, v in params.items() if k in PARAMS})
    es = element_size(dtype)
    M, N, K = _mnk(shape)
    return {
        "elem_bytes": es,
        "smem_bytes": smem_bytes(cfg, es),
        "acc_regs": cfg.block_m * cfg.block_n // (_consumer_warps(cfg) * 32),
        "tiles": triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),
        "SMEM_LIMIT": SMEM_LIMIT_SM90,
    }


def _tiny(x: int) -> int:
    # Same specialisation class (==1, %16, %8) as x, at a small size.
    if x == 1:
        return 1
    if x % 16 == 0:
        return 256
    if x % 8 == 0:
        return 264
    return 257


def warmup(shape: Mapping[str, int], dtype: torch.dtype, device, **params) -> None:
    """Compile the kernel ``run`` would launch for this shape, on tiny operands."""
    M, N, K = _mnk(shape)
    a = torch.randn((_tiny(M), _tiny(K)), device=device).to(dtype)
    b = torch.randn((_tiny(K), _tiny(N)), device=device).to(dtype)
    matmul(a, b, params or None)


def label(params: Mapping[str, Any]) -> str:
    return GemmConfig(**{k: v for k, v in params.items() if k in PARAMS}).label()


baselines = {"cublas": lambda inputs: cublas(inputs.a, inputs.b, out=inputs.out)}


# --------------------------------------------------------------------------
# Cross-compilation (no GPU needed): arguments for workbench.asm.compile
# --------------------------------------------------------------------------


def compile_args(config: GemmConfig | Mapping[str, Any] | None = None, dtype: torch.dtype = torch.bfloat16,
                 shape: Mapping[str, int] | None = None) -> dict:
    """Keyword arguments for ``workbench.asm.compile.cross_compile`` that build
    the TMA kernel ``matmul`` launches for ``config`` (``fn`` included)::

        cross_compile(targets="sm90", cache_dir=d, **compile_args(cfg))

    ``shape`` (M, N, K) only decides which sizes count as multiples of 16.
    """
    cfg = _as_config(config) or heuristic(*(_mnk(shape) if shape else (8192, 8192, 8192)), dtype)
    _validate_config(cfg)
    if cfg.gluon:
        from kernels import gemm_ws

        return gemm_ws.compile_args(cfg.ws_config(), dtype, _mnk(shape) if shape else None)
    t = triton_type(dtype)
    bm, bn, bk = cfg.block_m, cfg.block_n, cfg.block_k
    sig = {"a_desc": f"tensordesc<{t}[{bm}, {bk}]>", "b_desc": f"tensordesc<{t}[{bk}, {bn}]>",
           "c_ptr": f"*{t}", "stride_cm": "i32", "M": "i32", "N": "i32", "K": "i32",
           "num_sms": "i32", "group_m": "i32", "dp_tiles": "i32", "sk_programs": "i32",
           "sk_iters_per": "i32", "sk_extra": "i32", "ws_ptr": "*fp32", "cnt_ptr": "*i32"}
    constexprs = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "TMA_STORE": cfg.tma_store,
                  "EPILOGUE_SPLIT": cfg.epilogue_split, "FLATTEN": cfg.flatten,
                  "WARP_SPECIALIZE": cfg.warp_specialize, "STREAM_K": cfg.stream_k}
    if cfg.tma_store:
        sig["c_desc"] = f"tensordesc<{t}[{bm}, {bn // cfg.epilogue_split}]>"
    else:
        constexprs["c_desc"] = None
    M, N, K = _mnk(shape) if shape else (8192, 8192, 8192)
    divisible = ["c_ptr"] + [name for name, v in (("stride_cm", N), ("M", M), ("N", N), ("K", K)) if v % 16 == 0]
    return {"fn": _gemm_tma_kernel, "signature": sig, "constexprs": constexprs, "divisible": divisible,
            "num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
