"""All-gather over a symmetric heap: every rank pushes its shard to every rank.

``all_gather(x, heap)`` returns ``out`` of shape ``(world * x.shape[0], *x.shape[1:])``
with rank r's ``x`` in rows ``r * M : (r + 1) * M`` on every rank (what
``torch.distributed.all_gather_into_tensor`` gives), bit for bit.

Variants (``variant=``):

``"triton"``  persistent, tiled: each program walks tiles ``pid, pid + grid, ...``
              of ``x`` (``BLOCK_M x BLOCK_N``), loads a tile once and stores it
              into every rank's ``out`` at ``dst + kernels.remote.peer_delta(...)``
              (pointer arithmetic; with ``hints`` the distance is asserted
              16-byte aligned, so the stores stay 16 bytes wide).
``"gluon"``   the same walk written in Gluon over a flat 1-D index of the tile
              (row/column by div/mod) with an explicit ``gl.BlockedLayout``
              of ``VEC`` elements per thread (16 bytes), the local heap base
              loaded once before the loop, and destinations staggered
              ``(rank + i) % world`` so ranks do not all write rank 0 first.
``"copy_engine"`` no SMs: one ``cudaMemcpyAsync`` into each peer's heap (in
              turn, on a side stream), then a device barrier (``heap.barrier()``).
``"nccl"``    ``torch.distributed.all_gather_into_tensor`` (the baseline).
``"auto"``    the faster of the above for the message size, from the H200
              measurements in ``AUTO_TABLE``.

Completion: after its last tile every program adds 1 to its slot in every
rank's flag array (data stores, CTA barrier, release atomic at system scope);
program 0 of each rank then waits (acquire, bounded) until every slot reached
the running total of grids launched so far, a total it keeps on the device
(so a CUDA graph of calls replays correctly). A peer that never arrives makes
the wait give up and the host raise `kernels.remote.WaitTimeout` naming the rank. In a simulated world
the wait is a second launch after ``heap.barrier()`` (ranks take turns in the
interpreter, so no rank may spin inside a kernel while another waits to run).

``out`` lives in the heap and is reused by the next call with the same shape:
copy it, or ``heap.barrier()`` after reading, before gathering into it again.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.remote import check_status, peer_delta, signal, wait_all, wait_all_kernel
from workbench.dtypes import element_size, triton_type

try:  # Gluon ships with Triton >= 3.4
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    GLUON_AVAILABLE = True
except ImportError:  # pragma: no cover
    GLUON_AVAILABLE = False

VARIANTS = ("triton", "gluon", "copy_engine", "nccl", "auto")
DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64)
DEFAULT_MAX_SPINS = 1 << 26  # polls before a wait gives up (bounded; the poll rate was not measured)
TILE_ELEMS = {"triton": 8192, "gluon": 8192}  # elements per tile when `block` is not given
NUM_WARPS = 8

# variant="auto": (world_size, largest bytes per rank, variant, num_sms); first match wins; world size 0
# matches any. From results/all_gather/summary.csv (4 H200s, NVLink, eager calls, the slower of the
# median call and the loop average): SM kernels up to 32 MiB at world 2 and 8 MiB at world 4 (at 32 MiB
# per rank the copy engines tie with them at world 4); copy engines above, where they reach 96-98% of
# the peer copy bandwidth against 89-91% for SM stores. NCCL was never the fastest from 2 to 512 MiB.
# World sizes other than 2 and 4 were not measured: they take the world-4 rule.
AUTO_TABLE: list[tuple[int, int, str, int | None]] = [
    (2, 64 << 20, "triton", None),
    (2, 1 << 62, "copy_engine", None),
    (0, 16 << 20, "triton", None),
    (0, 1 << 62, "copy_engine", None),
]


# ==========================================================================
# Kernels
# ==========================================================================
# Integers that vary between calls of one configuration stay unspecialized (no recompiles).
_RUNTIME_INTS = ["rank", "max_spins"]


@triton.jit(do_not_specialize=_RUNTIME_INTS)
def _all_gather_kernel(x_ptr, out_ptr, heap_bases, flags_ptr, status_ptr, total_ptr, M, N, rank, max_spins,
                       WORLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VEC: tl.constexpr,
                       ESIZE: tl.constexpr, HINTS: tl.constexpr, EVEN_N: tl.constexpr, WAIT: tl.constexpr,
                       SCOPE: tl.constexpr):
    pid = tl.program_id(0)
    grid = tl.num_programs(0)
    tiles_n = (N + BLOCK_N - 1) // BLOCK_N
    num_tiles = ((M + BLOCK_M - 1) // BLOCK_M) * tiles_n
    rm = tl.arange(0, BLOCK_M)
    rn = tl.arange(0, BLOCK_N)
    for tile in range(pid, num_tiles, grid):
        rows = (tile // tiles_n) * BLOCK_M + rm
        cols = (tile % tiles_n) * BLOCK_N + rn
        mask = rows[:, None] < M
        if not EVEN_N:
            mask = mask & (cols[None, :] < N)
        r64 = rows.to(tl.int64)
        tile_vals = tl.load(x_ptr + r64[:, None] * N + cols[None, :], mask=mask)
        dst = out_ptr + (rank * M + r64)[:, None] * N + cols[None, :]
        for i in tl.static_range(WORLD):
            peer = (rank + i) % WORLD
            # dst on `peer`: with HINTS the distance is known 16-byte aligned, so the
            # stores keep the load's 128-bit width; without, they fall to scalars.
            delta = peer_delta(rank, peer, heap_bases, ESIZE, VEC if HINTS else 0)
            tl.store(dst + delta, tile_vals, mask=mask)
    for i in tl.static_range(WORLD):
        signal(flags_ptr + rank, 1, rank, (rank + i) % WORLD, heap_bases, "add", SCOPE)
    if WAIT:
        if pid == 0:
            wait_all(flags_ptr, total_ptr, grid, max_spins, status_ptr, WORLD, SCOPE)


if GLUON_AVAILABLE:

    @gluon.jit(do_not_specialize=_RUNTIME_INTS)
    def _all_gather_gluon_kernel(x_ptr, out_ptr, heap_bases, flags_ptr, status_ptr, total_ptr, M, N, rank,
                                 max_spins, WORLD: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                                 VEC: gl.constexpr, ESIZE: gl.constexpr, HINTS: gl.constexpr, EVEN_N: gl.constexpr,
                                 NUM_WARPS: gl.constexpr, WAIT: gl.constexpr, SCOPE: gl.constexpr):
        # VEC contiguous elements per thread: 16 bytes -> one 128-bit load/store each.
        layout: gl.constexpr = gl.BlockedLayout([VEC], [32], [NUM_WARPS], [0])
        pid = gl.program_id(0)
        grid = gl.num_programs(0)
        local_base = gl.load(heap_bases + rank)  # hoisted: one load for the whole kernel
        tiles_n = (N + BLOCK_N - 1) // BLOCK_N
        num_tiles = ((M + BLOCK_M - 1) // BLOCK_M) * tiles_n
        flat = gl.arange(0, BLOCK_M * BLOCK_N, layout=layout)
        fr = flat // BLOCK_N
        fc = flat % BLOCK_N
        for tile in range(pid, num_tiles, grid):
            rows = ((tile // tiles_n) * BLOCK_M + fr).to(gl.int64)
            cols = (tile % tiles_n) * BLOCK_N + fc
            mask = rows < M
            if not EVEN_N:
                mask = mask & (cols < N)
            vals = gl.load(x_ptr + rows * N + cols, mask=mask)
            dst = out_ptr + (rank * M + rows) * N + cols
            offset = dst.to(gl.int64, bitcast=True) - local_base
            for i in gl.static_range(WORLD):
                peer = (rank + i) % WORLD  # staggered: rank r writes r, r+1, ... first
                ptr = (gl.load(heap_bases + peer) + offset).to(out_ptr.dtype, bitcast=True)
                if HINTS:  # the integer round trip forgot alignment (bytes) and contiguity (elements)
                    ptr = gl.max_contiguous(gl.multiple_of(ptr, VEC * ESIZE), VEC)
                gl.store(ptr, vals, mask=mask)
        # completion: every thread's stores, a CTA barrier, then one release per rank
        gl.thread_barrier()
        for i in gl.static_range(WORLD):
            peer = (rank + i) % WORLD
            flag = (gl.load(heap_bases + peer) + ((flags_ptr + rank).to(gl.int64, bitcast=True) - local_base)
                    ).to(flags_ptr.dtype, bitcast=True)
            gl.atomic_add(flag, 1, sem="release", scope=SCOPE)
        if WAIT:
            if pid == 0:
                expected = gl.load(total_ptr) + grid  # running total, kept on the device
                for src in gl.static_range(WORLD):
                    seen = gl.atomic_add(flags_ptr + src, 0, sem="acquire", scope=SCOPE)
                    spins = 0
                    while (seen < expected) & (spins < max_spins):
                        seen = gl.atomic_add(flags_ptr + src, 0, sem="acquire", scope=SCOPE)
                        spins += 1
                    if seen < expected:
                        gl.atomic_add(status_ptr, 1)
                        gl.atomic_xchg(status_ptr + 1, src)
                        gl.atomic_xchg(status_ptr + 2, seen)
                        gl.atomic_xchg(status_ptr + 3, expected)
                gl.store(total_ptr, expected)
                gl.thread_barrier()


# ==========================================================================
# Launcher
# ==========================================================================
def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _vec(n_cols: int, esize: int) -> int:
    """Elements per 16-byte vector that divide every row (1 if rows are odd)."""
    v = max(1, 16 // esize)
    while v > 1 and n_cols % v:
        v //= 2
    return v


def pick_config(M: int, N: int, esize: int, variant: str, block=None, num_sms=None, world_size=1,
                device_sms: int | None = None, num_warps: int | None = None) -> dict:
    """Tile, vector width, warps and grid for one call (all knobs resolved)."""
    vec = _vec(N, esize)
    if block is not None:
        try:
            block_m, block_n = (int(b) for b in block)
        except (TypeError, ValueError):
            raise ValueError(f"block must be (BLOCK_M, BLOCK_N), got {block!r}") from None
        for name, b in (("BLOCK_M", block_m), ("BLOCK_N", block_n)):
            if b < 1 or b & (b - 1):
                raise ValueError(f"{name} must be a power of two, got {b}")
    else:
        tile = TILE_ELEMS.get(variant, 8192)
        block_n = min(_pow2_floor(tile), triton.next_power_of_2(N))
        if N % block_n and N > block_n:  # prefer a width that divides N (no column mask)
            b = block_n
            while b > vec and N % b:
                b //= 2
            if N % b == 0 and b * 4 >= block_n:
                block_n = b
        block_m = max(1, min(triton.next_power_of_2(M), tile // block_n))
    vec = min(vec, block_n)
    tile_elems = block_m * block_n
    if num_warps is None:
        num_warps = _pow2_floor(max(1, min(NUM_WARPS, tile_elems // (32 * vec))))
    elif num_warps not in (1, 2, 4, 8, 16, 32):
        raise ValueError(f"num_warps must be a power of two from 1 to 32, got {num_warps!r}")
    tiles = -(-M // block_m) * -(-N // block_n)
    sms = num_sms if num_sms is not None else (device_sms or 4)
    if not isinstance(sms, int) or sms < 1:
        raise ValueError(f"num_sms must be a positive integer, got {num_sms!r}")
    grid = min(sms, tiles)
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "VEC": vec, "EVEN_N": N % block_n == 0,
            "num_warps": num_warps, "grid": grid, "tiles": tiles}


def _validate(x: torch.Tensor, heap, variant: str):
    if variant not in VARIANTS:
        raise ValueError(f"all_gather: unknown variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    if not isinstance(x, torch.Tensor):
        raise ValueError(f"all_gather: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 1 or x.numel() == 0:
        raise ValueError(f"all_gather: x must have at least one dimension and one element, got shape "
                         f"{tuple(x.shape)}")
    if x.dtype not in DTYPES:
        raise ValueError(f"all_gather: dtype {x.dtype} is not supported (supported: "
                         f"{', '.join(str(d).replace('torch.', '') for d in DTYPES)})")
    if not x.is_contiguous():
        raise ValueError(f"all_gather: x (shape {tuple(x.shape)}, strides {x.stride()}) must be contiguous; "
                         "pass x.contiguous()")
    if x.device.type != heap.device.type or (x.device.type == "cuda" and x.device != heap.device):
        raise ValueError(f"all_gather: x is on {x.device} but the heap of rank {heap.rank} is on {heap.device}")
    if x.numel() * heap.world_size >= 2 ** 62:
        raise ValueError("all_gather: message too large")


def auto_choice(world_size: int, nbytes: int) -> tuple[str, int | None]:
    """(variant, num_sms) that ``variant="auto"`` uses for ``nbytes`` per rank."""
    for ws, limit, variant, sms in AUTO_TABLE:
        if ws in (0, world_size) and nbytes <= limit:
            return variant, sms
    return "triton", None


def _device_sms(heap) -> int | None:
    if heap.device.type == "cuda":
        return torch.cuda.get_device_properties(heap.device).multi_processor_count
    return None


def all_gather(x: torch.Tensor, heap, *, variant: str = "triton", num_sms: int | None = None, block=None,
               hints: bool = True, num_warps: int | None = None, out: torch.Tensor | None = None, check: bool = True,
               max_spins: int = DEFAULT_MAX_SPINS, scope: str = "sys") -> torch.Tensor:
    """Gather every rank's ``x`` into ``out`` (rank-major along dim 0) on every rank.

    ``heap``: a `workbench.dist.SymmetricHeap` (GPU) or a `SimHeap` of a
    `SimulatedWorld` (CPU, interpreter). ``num_sms``: persistent programs
    (default: all SMs; 4 in a simulated world). ``block``: ``(BLOCK_M,
    BLOCK_N)`` powers of two (default ~8192 elements, as wide as N allows).
    ``hints``: re-state alignment on translated pointers (16-byte stores).
    ``num_warps``: warps per program (default: 8, fewer for small tiles).
    ``out``: a heap tensor to fill (default: a heap buffer reused per shape).
    ``check``: read the status word after the call (synchronizes) and raise
    `WaitTimeout` if a peer never signalled; pass False in timing loops (and
    under CUDA graph capture) and call ``check_status(heap.status(), rank)``
    afterwards. The flag totals live on the device, so a captured graph of
    calls replays correctly.
    """
    _validate(x, heap, variant)
    W = heap.world_size
    if variant == "auto":
        nbytes = x.numel() * x.element_size()
        variant, auto_sms = ("triton", None) if heap.simulated else auto_choice(W, nbytes)
        num_sms = num_sms if num_sms is not None else auto_sms
    if variant == "nccl":
        return _nccl(x, heap, out, (W * x.shape[0], *x.shape[1:]))
    blk = tuple(block) if isinstance(block, (list, tuple)) else block
    key = (variant, tuple(x.shape), x.dtype, num_sms, blk, bool(hints), num_warps, scope,
           None if out is None else (out.data_ptr(), tuple(out.shape), out.dtype))
    cache = heap.cache("all_gather")
    plan = cache.get(key)
    if plan is None:
        plan = cache[key] = _plan(x, heap, variant, num_sms, block, hints, num_warps, out, scope)
    if variant == "copy_engine":
        return _copy_engine(x, heap, plan)
    kernel, grid, out, flags, total, kw = plan
    status = heap.status()
    heap.launch(kernel, (grid,), x, out, heap.heap_bases, flags, status, total, x.shape[0], x.numel() // x.shape[0],
                heap.rank, max_spins, **kw)
    if heap.simulated:  # ranks take turns in the interpreter: wait in a launch of its own
        heap.barrier()
        heap.launch(wait_all_kernel, (1,), flags, total, grid, max_spins, status, WORLD=W, SCOPE=scope)
    if check:
        check_status(status, heap.rank, "all_gather flags", names=lambda i: f"signals from rank {i}")
    return out


def _plan(x, heap, variant, num_sms, block, hints, num_warps, out, scope):
    """Everything a call needs that depends only on its configuration (cached per heap)."""
    W = heap.world_size
    M = x.shape[0]
    N = x.numel() // M
    out_shape = (W * M, *x.shape[1:])
    if variant == "gluon" and not GLUON_AVAILABLE:
        raise ValueError("all_gather: variant 'gluon' needs triton.experimental.gluon (Triton >= 3.4)")
    if scope not in ("sys", "gpu"):
        raise ValueError(f"all_gather: scope must be 'sys' (peers on other GPUs) or 'gpu', got {scope!r}")
    if out is None:
        out = out_buffer(heap, out_shape, x.dtype)
    elif tuple(out.shape) != out_shape or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"all_gather: out must be a contiguous {out_shape} {x.dtype} heap tensor, got "
                         f"{tuple(out.shape)} {out.dtype}")
    else:
        heap.offset_of(out)  # raises unless out lives in the heap
    if variant == "copy_engine":
        rows = slice(heap.rank * M, (heap.rank + 1) * M)
        targets = [heap.peer_view(out, (heap.rank + i) % W)[rows] for i in range(1, W)]
        streams = [torch.cuda.Stream(heap.device)] if heap.device.type == "cuda" else []
        return out, out[rows], targets, streams
    cfg = pick_config(M, N, x.element_size(), variant, block, num_sms, W, _device_sms(heap) or 4, num_warps)
    kw = dict(WORLD=W, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], VEC=cfg["VEC"], ESIZE=x.element_size(),
              HINTS=bool(hints) and cfg["VEC"] > 1, EVEN_N=cfg["EVEN_N"], WAIT=not heap.simulated, SCOPE=scope,
              num_warps=cfg["num_warps"])
    if variant == "gluon":
        kw["NUM_WARPS"] = cfg["num_warps"]
    kernel = _all_gather_gluon_kernel if variant == "gluon" else _all_gather_kernel
    return kernel, cfg["grid"], out, heap.flags("all_gather", W), heap.flags("all_gather.total", 1), kw


def _copy_engine(x, heap, plan):
    """Copy engines instead of SMs: one cudaMemcpyAsync into each peer's heap, one after
    another on a side stream (measured on H200s: copies to several peers issued on
    streams of their own share the engines badly, 230 GB/s against 390 in turn), the
    local copy meanwhile on the caller's stream, then a device barrier."""
    out, local, targets, streams = plan
    if streams:
        cur = torch.cuda.current_stream(heap.device)
        side = streams[0]
        side.wait_stream(cur)
        with torch.cuda.stream(side):
            for t in targets:
                t.copy_(x)
        local.copy_(x)
        cur.wait_stream(side)
        if not torch.cuda.is_current_stream_capturing():
            x.record_stream(side)  # x may be freed by the caller before the copies ran
    else:
        for t in targets:
            t.copy_(x)
        local.copy_(x)
    heap.barrier()  # every peer's copies into our `out` are complete after this
    return out


def out_buffer(heap, out_shape, dtype) -> torch.Tensor:
    """The heap buffer `all_gather` fills when no `out` is given (one per shape and dtype)."""
    return heap.named(f"all_gather.out.{tuple(out_shape)}.{dtype}", tuple(out_shape), dtype)


def _nccl(x, heap, out, out_shape):
    import torch.distributed as dist

    if heap.simulated or not dist.is_initialized():
        raise ValueError("all_gather: variant 'nccl' needs an initialized torch.distributed process group "
                         "(a SymmetricHeap under torchrun); a simulated world has none")
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=heap.group)
    return out


def bus_bandwidth_gbps(bytes_per_rank: int, world_size: int, ms: float) -> tuple[float, float]:
    """(algBW, busBW) in GB/s as nccl-tests defines them for all-gather.

    algBW = total gathered bytes / time; busBW = algBW * (n - 1) / n.
    """
    total = bytes_per_rank * world_size
    alg = total / (ms * 1e-3) / 1e9
    return alg, alg * (world_size - 1) / world_size


# ==========================================================================
# Assembly: the kernels cross-compiled without a GPU
# ==========================================================================
def compile_kernel(variant: str, hints: bool, *, target: str = "sm90", dtype: torch.dtype = torch.float16,
                   world_size: int = 4, N: int = 8192, block=None, cache_dir, wait: bool = True):
    """Cross-compile the `variant` kernel ("triton"/"gluon") for `target` into `cache_dir`.

    Returns the `workbench.asm.cache.Entry`; diff two of them (hints off/on)
    with `workbench.asm.diff.diff_entries`. N (row length) fixes the vector
    width and whether a column mask is needed, as at run time.
    """
    from workbench.asm.compile import cross_compile

    if variant not in ("triton", "gluon"):
        raise ValueError(f"compile_kernel: variant must be 'triton' or 'gluon', got {variant!r}")
    esize = element_size(dtype)
    cfg = pick_config(1 << 20, N, esize, variant, block, 132, world_size, 132)
    kernel = _all_gather_gluon_kernel if variant == "gluon" else _all_gather_kernel
    ty = triton_type(dtype)
    signature = {"x_ptr": f"*{ty}", "out_ptr": f"*{ty}", "heap_bases": "*i64", "flags_ptr": "*i32",
                 "status_ptr": "*i32", "total_ptr": "*i32", "M": "i32", "N": "i32", "rank": "i32",
                 "max_spins": "i32"}
    constexprs = {"WORLD": world_size, "BLOCK_M": cfg["BLOCK_M"], "BLOCK_N": cfg["BLOCK_N"], "VEC": cfg["VEC"],
                  "ESIZE": esize,
                  "HINTS": bool(hints) and cfg["VEC"] > 1, "EVEN_N": cfg["EVEN_N"], "WAIT": wait, "SCOPE": "sys"}
    if variant == "gluon":
        constexprs["NUM_WARPS"] = cfg["num_warps"]
    divisible = ["x_ptr", "out_ptr", "heap_bases", "flags_ptr", "status_ptr", "total_ptr"] + (
        ["N"] if N % 16 == 0 else [])
    (entry,) = cross_compile(kernel, [target], signature=signature, constexprs=constexprs, divisible=divisible,
                             num_warps=cfg["num_warps"], cache_dir=cache_dir)
    return entry


# ==========================================================================
# Sweep protocol (workbench/sweep.py)
# ==========================================================================
PARAMS = {"variant": "triton", "num_sms": None, "block_m": None, "block_n": None, "num_warps": None,
          "hints": True}
WORLD_SIZES = (2, 3, 4, 8)
SIM_WORLD = 4  # ranks of the simulated world when no process group exists (CPU)
_HEAP: dict[str, Any] = {}


class Inputs:
    """One point's inputs: this rank's shard and heap (GPU), or every rank's (simulated)."""

    def __init__(self, shape: dict, dtype: torch.dtype, seed: int, world_size: int, xs: list, heaps: list,
                 world=None):
        self.shape, self.dtype, self.seed, self.world_size = shape, dtype, seed, world_size
        self.xs, self.heaps, self.world = xs, heaps, world
        self.checked: set = set()  # configurations whose status word was read once already

    @property
    def x(self) -> torch.Tensor:
        return self.xs[0] if self.world is None else self.xs


def shard(M: int, N: int, dtype: torch.dtype, seed: int, rank: int, device="cpu") -> torch.Tensor:
    """Rank `rank`'s random (M, N) shard: the same on any machine for the same seed."""
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    if dtype.is_floating_point:
        t = torch.randn((M, N), generator=g, dtype=torch.float32).to(dtype)
    else:
        info = torch.iinfo(dtype)
        t = torch.randint(info.min, info.max, (M, N), generator=g, dtype=torch.int64).to(dtype)
    return t.to(device)


def _world_size(shape: dict) -> int:
    import torch.distributed as dist

    if dist.is_initialized():
        return dist.get_world_size()
    return int(shape.get("world", SIM_WORLD))


def process_heap(nbytes: int):
    """This process's `SymmetricHeap`, grown (collectively) when too small, emptied otherwise."""
    from workbench.dist import SymmetricHeap

    heap = _HEAP.get("heap")
    if heap is None or heap.nbytes < nbytes:
        _HEAP.clear()
        heap = _HEAP["heap"] = SymmetricHeap(nbytes)
    else:
        heap.reset()
    return heap


def make_inputs(shape: dict, dtype: torch.dtype, device: str, seed: int) -> Inputs:
    M, N = int(shape["M"]), int(shape["N"])
    W = _world_size(shape)
    need = W * M * N * element_size(dtype) + (1 << 20)
    import torch.distributed as dist

    if dist.is_initialized() and device == "cuda":
        heap = process_heap(need)
        out_buffer(heap, (W * M, N), dtype)
        return Inputs(shape, dtype, seed, W, [shard(M, N, dtype, seed, heap.rank, heap.device)], [heap])
    from workbench.dist import SimulatedWorld

    world = SimulatedWorld(W, heap_bytes=need + (1 << 16))
    for h in world.heaps:
        out_buffer(h, (W * M, N), dtype)
    return Inputs(shape, dtype, seed, W, [shard(M, N, dtype, seed, r) for r in range(W)], world.heaps, world)


def run(inputs: Inputs, variant: str = "triton", num_sms=None, block_m=None, block_n=None, num_warps=None,
        hints: bool = True) -> torch.Tensor:
    """All-gather of the point; simulated: every rank's output stacked (W, W*M, N)."""
    block = (block_m, block_n) if block_m and block_n else None
    kw = dict(variant=variant, num_sms=num_sms, block=block, hints=hints, num_warps=num_warps)
    # Read the wait-status word (a host sync) on a configuration's first, checked call
    # only: inside timing loops it would time the sync, as experiments/run_all_gather.py avoids.
    key = tuple(sorted(kw.items(), key=lambda kv: kv[0]))
    kw["check"] = key not in inputs.checked
    inputs.checked.add(key)
    if inputs.world is None:
        return all_gather(inputs.xs[0], inputs.heaps[0], **kw)
    return torch.stack(inputs.world.run(lambda h: all_gather(inputs.xs[h.rank], h, **kw).clone()))


def reference(inputs: Inputs) -> torch.Tensor:
    M, N = int(inputs.shape["M"]), int(inputs.shape["N"])
    full = torch.cat([shard(M, N, inputs.dtype, inputs.seed, r) for r in range(inputs.world_size)])
    if inputs.world is None:
        return full.to(inputs.xs[0].device)
    return full.expand(inputs.world_size, *full.shape).clone()


def poison(inputs: Inputs) -> None:
    """Fill every heap output buffer with 0xFF bytes (NaN for floats) before the checked run."""
    for h in inputs.heaps:
        for name, t in h._named.items():
            if name.startswith("all_gather.out"):
                t.view(torch.uint8).fill_(0xFF)


def recover(inputs: Inputs) -> None:
    """After a point failed on some rank (every rank calls this, together): zero the
    flags and running totals, so the next call's waits count from zero everywhere."""
    for h in inputs.heaps:
        h.resync_flags()


def check(out: torch.Tensor, ref: torch.Tensor, dtype) -> tuple[bool, float, str]:
    """Bit-for-bit equality (an all-gather moves bits; it computes nothing)."""
    if tuple(out.shape) != tuple(ref.shape):
        return False, math.nan, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    a = out.contiguous().view(torch.uint8)
    b = ref.to(out.device).contiguous().view(torch.uint8)
    bad = int((a != b).sum())
    return bad == 0, 0.0 if bad == 0 else math.nan, "" if bad == 0 else f"{bad} bytes differ from the concatenation"


def flops(shape: dict) -> int:
    return 0


def bytes_moved(shape: dict, dtype: torch.dtype) -> int:
    """Bytes each rank sends to peers: (W-1) * shard, so GB/s over the time is nccl-tests' busBW."""
    W = _world_size(shape)
    return (W - 1) * int(shape["M"]) * int(shape["N"]) * element_size(dtype)


def tolerance(dtype) -> float:
    return 0.0


baselines = {"nccl": lambda inputs: run(inputs, variant="nccl")}
