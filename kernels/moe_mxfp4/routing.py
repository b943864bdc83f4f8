"""Routing preparation for the down-projection: one kernel launch (three at many pairs), planned once,
no host sync.

From the router's ``topk_ids`` / ``topk_weights`` ([M, top_k]) to the layout the
kernel reads: the M * top_k (token, slot) pairs sorted by expert, each expert's
run padded to a multiple of the row tile BM, so that every BM-row block belongs
to one expert. A pair is named by its flat index ``p = token * top_k + slot``
(the row of the activations it multiplies); padding rows hold ``M * top_k``.

Every output has a size known on the host from (M, top_k, E, BM) alone, an
upper bound on the padded length, so nothing is read back (no ``.item()``,
no ``.cpu()``) and the whole preparation can be captured in a CUDA graph:

* ``sorted_ids`` int32 [max_rows]: pair indices, expert by expert, ascending
  within an expert (a stable sort, so the order is the same run to run);
* ``sorted_weights`` fp32 [max_rows]: each pair's routing weight, 0 on padding;
* ``expert_ids`` int32 [max_rows // BM]: the expert of each row block, -1 for
  blocks past the end;
* ``num_rows`` int32 [1]: the padded rows actually used (the kernel's early exit);
* ``counts`` int32 [E]: pairs per expert (the baselines' group sizes).

max_rows = M * top_k + min(E, M * top_k) * (BM - 1), rounded up to BM: each
expert that has pairs wastes at most BM - 1 rows.

How: on a GPU (and in Triton's interpreter) one Triton kernel writes all of it
(``triton_routing._prepare_routing_kernel``), or from ``CHUNKED_MIN_PAIRS`` pairs three
(per-chunk counts, offsets, each chunk sorted and scattered: the same rows); what depends
only on the call's signature (shapes, strides, dtypes, device, E, BM: the grid, the tile
sizes, the compiled kernels) is decided once and kept in a plan, so a repeated call is a
lookup, one allocation (the outputs are views of one buffer, fresh every call:
a Routing stays valid while later calls make theirs) and the launches. CPU tensors
outside the interpreter take the same layout from torch ops (``torch_routing``,
also the tests' second reference beside the host loops of ``reference_routing``).

``prepare_routing_and_output`` also allocates the down-projection's output [M, H] bf16 with those buffers
and has the same launch zero it (the atomic epilogue adds into it), which is how ``moe_mxfp4_down`` takes
the router's ids: a call makes two launches and one allocation, not three and two.

Expert ids must lie in [0, E); like any torch indexing, this is not checked on
the device (that would need a sync): the kernel leaves a pair with another id
out of every expert, and ``prepare_routing(..., check=True)`` reads the ids back
and raises a ValueError, for debugging.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kernels.common import interpreter
from kernels.common.launcher import PlannedLaunch
from kernels.common.plans import PlanCache, sm_count, tensor_signature

from . import triton_routing

__all__ = ["Routing", "max_rows", "prepare_routing", "prepare_routing_and_output", "reference_routing",
           "routing_plan_info", "routing_signature", "torch_routing"]


@dataclass(frozen=True)
class Routing:
    sorted_ids: torch.Tensor
    sorted_weights: torch.Tensor
    expert_ids: torch.Tensor
    num_rows: torch.Tensor
    counts: torch.Tensor
    num_pairs: int           # M * top_k
    top_k: int
    num_experts: int
    block_m: int
    # routing_signature(self), when the maker knows it already (prepare_routing: once per plan, since
    # its outputs are views of one buffer at fixed offsets); None: made by whoever needs it
    sig: tuple | None = field(default=None, compare=False, repr=False)

    @property
    def max_blocks(self) -> int:
        return self.expert_ids.shape[0]


def routing_signature(r: Routing) -> tuple:
    """What a down-projection's plan depends on of a routing: its tensors' signatures (shape,
    strides, dtype, device, 16-byte alignment) and sizes. Part of the launcher's plan key."""
    if r.sig is not None:
        return r.sig
    return (tensor_signature(r.sorted_ids), tensor_signature(r.sorted_weights), tensor_signature(r.expert_ids),
            tensor_signature(r.num_rows), r.num_pairs, r.top_k, r.num_experts, r.block_m, r.max_blocks)


def max_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on the padded rows (a multiple of block_m)."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return max(block_m, -(-bound // block_m) * block_m)


def _validate(topk_ids, topk_weights, num_experts, block_m):
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"prepare_routing: topk_ids must be a 2-D [M, top_k] tensor, got "
                         f"{getattr(topk_ids, 'shape', type(topk_ids).__name__)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"prepare_routing: topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"prepare_routing: topk_weights must be a tensor shaped like topk_ids "
                         f"{tuple(topk_ids.shape)}, got {getattr(topk_weights, 'shape', None)}")
    if not topk_weights.is_floating_point():
        raise ValueError(f"prepare_routing: topk_weights must be floating point, got {topk_weights.dtype}")
    if topk_weights.device != topk_ids.device:
        raise ValueError("prepare_routing: topk_ids and topk_weights must be on one device")
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"prepare_routing: num_experts must be a positive int, got {num_experts!r}")
    if block_m not in (16, 32, 64, 128):
        raise ValueError(f"prepare_routing: block_m must be 16, 32, 64 or 128, got {block_m!r}")


@dataclass
class _RoutingPlan:
    """What one call signature of ``prepare_routing`` needs: sizes, the output buffer's layout
    (int32 elements, split into sorted ids, weights, expert ids, a pad, counts, a pad, the row
    count, a pad: each output starts 16-byte aligned) and the planned launch (None: the torch path)."""
    n: int
    top_k: int
    E: int
    BM: int
    rows: int
    blocks: int
    sizes: list[int]
    total: int
    device: torch.device
    launch: PlannedLaunch | None
    out_shape: tuple[int, int] | None = None   # the down-projection's output zeroed by the launch, [M, H] bf16
    zero_chunk: int = 0                         # int32 words of it each program zeroes
    sig: tuple | None = None                    # routing_signature of this plan's Routing, after its first call
    strides: tuple = ()                         # topk_ids' and topk_weights' (the key fixes them)
    chunked: tuple | None = None                # many pairs: the three launches (counts, offsets, scatter)
    chunks: int = 0                             # ... over this many chunks, with 2 * chunks * NB scratch words


_PLANS = PlanCache()
# From this many pairs the routing takes three launches over chunks of pairs (triton_routing's
# chunked kernels) instead of one whose programs each read every pair: the same rows. On one H200
# (results/moe_mxfp4/routing_chunked/) the three launches take 100-230 us from 8192 pairs up, the one
# launch 29-934 us, growing with the pairs: ahead from 36,864 pairs (KIMI-K2.5 M = 4096: 203 against
# 239 us; M = 16384: 230 against 934), behind at 32,768 (gpt-oss-120b M = 8192: 123 against 108).
CHUNKED_MIN_PAIRS = 36864


def _quad(x: int) -> int:
    return -(-x // 4) * 4


def _make_plan(topk_ids, topk_weights, num_experts: int, block_m: int, out_cols: int = 0) -> _RoutingPlan:
    M, top_k = topk_ids.shape
    n, E, BM = M * top_k, num_experts, block_m
    rows = max_rows(n, E, BM)
    blocks = rows // BM
    sizes = [rows, rows, blocks, _quad(blocks) - blocks, E, _quad(E) - E, 1, 3]
    if out_cols:   # the output, bf16 pairs as int32 words, last: 16-byte aligned like the others
        sizes.append(_quad(-(-M * out_cols // 2)))
    launch = chunked = None
    chunks = 0
    dev = topk_ids.device
    if dev.type == "cuda" or interpreter.active():
        if interpreter.active():
            interpreter.patch()
        if n >= CHUNKED_MIN_PAIRS:
            CH, NB, chunks = triton_routing.chunked_constexprs(n, E)
            sizes.insert(8, 2 * chunks * NB)     # the counts (then bases) and the in-chunk starts
            chunked = (PlannedLaunch.of(triton_routing._route_chunk_counts_kernel, (chunks,),
                                        dict(TOP_K=top_k, NB=NB, CH=CH, num_warps=4)),
                       PlannedLaunch.of(triton_routing._route_chunk_offsets_kernel, (1,),
                                        dict(BM=BM, NB=NB, G=8, FILL=1024, num_warps=4)),
                       PlannedLaunch.of(triton_routing._route_chunk_scatter_kernel, (chunks,),
                                        dict(TOP_K=top_k, NB=NB, CH=CH, FILL=1024, ZERO=bool(out_cols), num_warps=4)))
        else:
            sms = sm_count(dev.index if dev.index is not None else torch.cuda.current_device()) \
                if dev.type == "cuda" else 132
            grid, cx = triton_routing.routing_constexprs(n, E, top_k, BM, sms=sms)
            launch = PlannedLaunch.of(triton_routing._prepare_routing_kernel, grid, dict(cx, ZERO=bool(out_cols)))
    out_shape = (M, out_cols) if out_cols else None
    programs = chunks if chunked else (launch.grid[0] if launch is not None else 0)
    chunk = _quad(-(-sizes[-1] // programs)) if out_cols and programs else 0
    return _RoutingPlan(n, top_k, E, BM, rows, blocks, sizes, sum(sizes), dev, launch, out_shape, chunk,
                        strides=(*topk_ids.stride(), *topk_weights.stride()), chunked=chunked, chunks=chunks)


def prepare_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, block_m: int, *,
                    check: bool = False) -> Routing:
    """Sort the (token, slot) pairs by expert and pad each expert to block_m rows: one kernel
    launch on a GPU (planned once per call signature: shapes, strides, dtypes, device, E, BM), no
    host synchronization (``check=True`` reads the ids back, once per call, to check their range).
    CPU tensors outside Triton's interpreter: ``torch_routing``."""
    return _prepare(topk_ids, topk_weights, num_experts, block_m, check, 0)[0]


def prepare_routing_and_output(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, block_m: int,
                               out_cols: int) -> tuple[Routing, torch.Tensor]:
    """``prepare_routing``, and the down-projection's output [M, out_cols] bf16, zeroed for its atomics
    by the same launch (allocated with the routing's buffers): a call saves an allocation and a launch."""
    if not isinstance(out_cols, int) or out_cols < 1:
        raise ValueError(f"prepare_routing_and_output: out_cols must be a positive int, got {out_cols!r}")
    return _prepare(topk_ids, topk_weights, num_experts, block_m, False, out_cols)


def _prepare(topk_ids, topk_weights, num_experts, block_m, check, out_cols) -> tuple[Routing, torch.Tensor | None]:
    try:
        key = (tensor_signature(topk_ids), tensor_signature(topk_weights), num_experts, block_m, out_cols)
    except AttributeError:                  # not tensors: let validation say what is wrong
        _validate(topk_ids, topk_weights, num_experts, block_m)
        raise
    plan = _PLANS.get(key)
    if plan is None:
        _validate(topk_ids, topk_weights, num_experts, block_m)
        plan = _PLANS.put(key, _make_plan(topk_ids, topk_weights, num_experts, block_m, out_cols))
    if check:
        _check_ids(topk_ids, num_experts)
    if plan.launch is None and plan.chunked is None:
        out = torch.zeros((topk_ids.shape[0], out_cols), dtype=torch.bfloat16, device=plan.device) if out_cols \
            else None
        return torch_routing(topk_ids, topk_weights, num_experts, block_m), out
    # one allocation, its views in one call (each slice of a tensor costs about as much host time)
    sorted_ids, weights_i32, expert_ids, _, counts, _, num_rows, _, *rest = torch.empty(
        plan.total, dtype=torch.int32, device=plan.device).split_with_sizes(plan.sizes)
    sorted_weights = weights_i32.view(torch.float32)
    words = rest[1:] if plan.chunked else rest
    zero = words[0] if words else sorted_ids          # not written without an output to zero
    zero_words = plan.sizes[-1] if words else 0
    if plan.chunked:
        base, local = rest[0].chunk(2)
        count, offsets, scatter = plan.chunked
        count(topk_ids, base, local, plan.n, plan.E, *plan.strides[:2])
        offsets(base, local, sorted_ids, sorted_weights, expert_ids, num_rows, counts, plan.n, plan.E, plan.rows,
                plan.blocks, plan.chunks)
        scatter(topk_ids, topk_weights, base, sorted_ids, sorted_weights, plan.n, plan.E, *plan.strides, zero,
                zero_words, plan.zero_chunk)
    else:
        plan.launch(topk_ids, topk_weights, sorted_ids, sorted_weights, expert_ids, num_rows, counts,
                    plan.n, plan.E, plan.rows, plan.blocks, *plan.strides, zero, zero_words, plan.zero_chunk)
    routing = Routing(sorted_ids, sorted_weights, expert_ids, num_rows, counts, plan.n, plan.top_k, plan.E, plan.BM,
                      plan.sig)
    if plan.sig is None:          # the same for every call of the plan: made once (host time per call)
        plan.sig = routing_signature(routing)
    if not words:
        return routing, None
    M, H = plan.out_shape
    return routing, zero.view(torch.bfloat16)[:M * H].view(M, H)


def routing_plan_info() -> dict:
    """How many routing plans are cached, and the bound."""
    return {"plans": len(_PLANS), "max": _PLANS.size}


def _check_ids(topk_ids, num_experts):
    flat = topk_ids.reshape(-1)
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"prepare_routing: topk_ids must lie in [0, {num_experts}), got "
                         f"[{int(flat.min())}, {int(flat.max())}]")


def torch_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, block_m: int, *,
                  check: bool = False) -> Routing:
    """The same layout from torch ops (no sync either, about 15 launches on a GPU): the CPU path,
    and a reference for the kernel."""
    _validate(topk_ids, topk_weights, num_experts, block_m)
    if check:
        _check_ids(topk_ids, num_experts)
    dev = topk_ids.device
    M, top_k = topk_ids.shape
    n = M * top_k
    E, BM = num_experts, block_m
    rows = max_rows(n, E, BM)
    flat = topk_ids.reshape(-1).to(torch.int64)
    # scatter_add, not bincount: bincount's output size depends on the data (a sync on CUDA).
    counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + BM - 1) // BM * BM
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.sort(flat, stable=True).indices                     # pairs, expert by expert
    sorted_experts = flat[order]
    first_of_expert = torch.cumsum(counts, 0) - counts
    rank = torch.arange(n, device=dev) - first_of_expert[sorted_experts]
    dest = padded_start[sorted_experts] + rank
    sorted_ids = torch.full((rows,), n, dtype=torch.int32, device=dev)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    sorted_weights = torch.zeros(rows, dtype=torch.float32, device=dev)
    sorted_weights.scatter_(0, dest, topk_weights.reshape(-1).to(torch.float32)[order])
    block_starts = torch.arange(0, rows, BM, device=dev)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True)
    expert_ids = torch.where(expert_ids < E, expert_ids, -1).to(torch.int32)
    num_rows = padded_end[-1:].to(torch.int32)
    return Routing(sorted_ids, sorted_weights, expert_ids, num_rows, counts.to(torch.int32), n, top_k, E, BM)


def reference_routing(topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                      block_m: int) -> Routing:
    """The same layout built with Python loops on the host (for tests)."""
    _validate(topk_ids, topk_weights, num_experts, block_m)
    M, top_k = topk_ids.shape
    n = M * top_k
    E, BM = num_experts, block_m
    rows = max_rows(n, E, BM)
    ids = topk_ids.reshape(-1).tolist()
    wts = topk_weights.reshape(-1).to(torch.float32).tolist()
    sorted_ids, sorted_w, experts = [], [], []
    counts = [0] * E
    for e in range(E):
        pairs = [p for p in range(n) if ids[p] == e]
        counts[e] = len(pairs)
        pad = -len(pairs) % BM
        sorted_ids += pairs + [n] * pad
        sorted_w += [wts[p] for p in pairs] + [0.0] * pad
        experts += [e] * ((len(pairs) + pad) // BM)
    used = len(sorted_ids)
    sorted_ids += [n] * (rows - used)
    sorted_w += [0.0] * (rows - used)
    experts += [-1] * (rows // BM - len(experts))
    t = lambda v, dt: torch.tensor(v, dtype=dt)
    return Routing(t(sorted_ids, torch.int32), t(sorted_w, torch.float32), t(experts, torch.int32),
                   t([used], torch.int32), t(counts, torch.int32), n, top_k, E, BM)
