"""The public launcher of the fused GEMM + all-scatter: ``gemm_all_scatter``.

validate -> plan (cached per call signature and heap) -> launch. The plan
holds the config, the grid, the constants, C's heap buffer and the flags; a
repeated call is a dictionary lookup, the TMA descriptors (their base pointers
change from call to call), one launch and an asynchronous copy of the status
word (``StatusWatch``). Nothing synchronizes the host in the default path.

With ``config=None`` the variant and its configuration come from
``config.auto_config``, decided by rank 0 and shared with every rank once per
new problem (``kernels.comm.decide``): every rank runs the same variant.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import triton

from kernels.comm.waits import StatusWatch, wait_all_kernel
from kernels.common.launcher import launch_planned
from kernels.common.plans import PlanCache, config_key, tensor_signature
from kernels.common.plans import capability as _capability, sm_count as _sm_count
from kernels.gemm.config import split_pieces
from kernels.gemm.launch import TensorDescriptor, _tma_ok, workspace
from kernels.comm.clock import timeout_us as _timeout_us
from kernels.comm.decide import shared_choice
from kernels.gemm_scatter.config import DTYPES, FALLBACKS, ScatterConfig, as_config, auto_config, validate
from kernels.gemm_scatter.triton import (BAND_FLAG, _gemm_scatter_kernel, _gemm_scatter_send_kernel,
                                         _gemm_scatter_split_kernel)
from workbench.dtypes import triton_type

__all__ = ["gemm_all_scatter", "check_gemm_all_scatter", "out_buffer", "plan_for", "compile_kernel", "recover"]

PLAN_CACHE_SIZE = 256  # plans kept per heap
SIM_SMS = 4  # programs in a simulated world (interpreter)


@dataclasses.dataclass
class _ScatterPlan:
    """Everything ``gemm_all_scatter`` decides for one call signature."""

    config: ScatterConfig
    grid: int  # programs per rank (each signals once; the wait counts them)
    out: torch.Tensor
    flags: torch.Tensor
    total: torch.Tensor
    args: tuple  # run-time scalars after the tensors
    meta: dict  # constexprs and launch options
    hints: bool  # the 16-byte hint is in force (asked for and true for these shapes)
    # the small-M kernel: (tiles, pieces) grid, (pieces, K steps per piece); its fp32 partials and tile
    # counters come from kernels.gemm's workspace (one per device and stream) at each call
    split: tuple = ()
    num_gemm: int = 0  # variant "senders": programs that compute (the rest of the grid sends)
    bands: Any = None  # variant "senders": tiles finished per row band (a local int32 counter per band)
    libs: Any = None   # variants "nccl", "sequential": (C block, gathered blocks) buffers
    launches: dict = dataclasses.field(default_factory=dict)  # the kernel's PlannedLaunch (the key fixes its args)
    # TMA descriptors of the last A and B seen, by data pointer. A descriptor holds its
    # tensor, so a pointer that matches is still that memory (same signature: same view).
    descs: dict = dataclasses.field(default_factory=dict)
    # config=None, an eager call's plan whose graph-replay plan runs another method: that one, to
    # run once at the first eager call (a capture then meets no first call of anything)
    graph_twin: Any = None

    def descriptor(self, which: str, t: torch.Tensor, block) -> Any:
        hit = self.descs.get(which)
        if hit is None or hit[0] != t.data_ptr():
            hit = self.descs[which] = (t.data_ptr(), TensorDescriptor.from_tensor(t, block))
        return hit[1]


def _check(a, b_local, heap) -> None:
    if not isinstance(a, torch.Tensor) or not isinstance(b_local, torch.Tensor):
        raise ValueError("gemm_all_scatter: a and b_local must be torch tensors")
    if a.dim() != 2 or b_local.dim() != 2:
        raise ValueError(f"gemm_all_scatter: need a (M, K) and b_local (K, N / world_size), got "
                         f"a{tuple(a.shape)} and b_local{tuple(b_local.shape)}")
    if a.shape[1] != b_local.shape[0]:
        raise ValueError(f"gemm_all_scatter: inner dimensions differ: a is {tuple(a.shape)}, b_local is "
                         f"{tuple(b_local.shape)} (need a (M, K) and b_local (K, N / world_size))")
    if min(a.shape[0], a.shape[1], b_local.shape[1]) < 1:
        raise ValueError(f"gemm_all_scatter: empty operand: a{tuple(a.shape)}, b_local{tuple(b_local.shape)}")
    if a.dtype != b_local.dtype or a.dtype not in DTYPES:
        raise ValueError(f"gemm_all_scatter: a and b_local must share a dtype among "
                         f"{', '.join(str(d).replace('torch.', '') for d in DTYPES)}; got {a.dtype} and "
                         f"{b_local.dtype}")
    for name, t in (("a", a), ("b_local", b_local)):
        if t.device.type != heap.device.type or (t.device.type == "cuda" and t.device != heap.device):
            raise ValueError(f"gemm_all_scatter: {name} is on {t.device} but the heap of rank {heap.rank} is on "
                             f"{heap.device}; put the operands on the heap's device")


def out_buffer(heap, M: int, N: int, dtype: torch.dtype) -> torch.Tensor:
    """The heap buffer ``gemm_all_scatter`` fills when no ``out`` is given (one per shape and dtype)."""
    return heap.named(f"gemm_scatter.out.{(M, N)}.{dtype}", (M, N), dtype)


MODES = ("eager", "graph")


def serving(a) -> str:
    """'graph' while the current stream captures a CUDA graph, else 'eager' (the choice may
    differ: a library's host cost counts in eager calls only). A host-side query: no sync."""
    return "graph" if a.device.type == "cuda" and torch.cuda.is_current_stream_capturing() else "eager"


def _plan(a, b_local, heap, config, hints, out, scope, mode="eager") -> _ScatterPlan:
    _check(a, b_local, heap)
    if scope not in ("sys", "gpu"):
        raise ValueError(f"gemm_all_scatter: scope must be 'sys' (peers on other GPUs) or 'gpu', got {scope!r}")
    W = heap.world_size
    M, K = a.shape
    n_local = b_local.shape[1]
    N = W * n_local
    esize = a.element_size()
    if out is None:
        out = out_buffer(heap, M, N, a.dtype)
    elif tuple(out.shape) != (M, N) or out.dtype != a.dtype or not out.is_contiguous():
        raise ValueError(f"gemm_all_scatter: out must be a contiguous ({M}, {N}) {a.dtype} heap tensor "
                         f"(N = world_size * b_local.shape[1]), got {tuple(out.shape)} {out.dtype}")
    else:
        heap.offset_of(out)  # raises unless out lives in the heap (peers address it by offset)
    on_gpu = a.device.type == "cuda"
    index = (a.device.index if a.device.index is not None else torch.cuda.current_device()) if on_gpu else None
    sms = _sm_count(index) if on_gpu else SIM_SMS
    hopper = on_gpu and _capability(index)[0] >= 9
    aligned = TensorDescriptor is not None and _tma_ok(a) and _tma_ok(b_local)
    # rank 0's choice for both modes at once, on the first call (before any capture: a
    # broadcast cannot run inside one)
    cfg = as_config(config) or shared_choice(
        heap, "gemm_scatter", (M, n_local, K, W, str(a.dtype)),
        lambda: {m: auto_config(M, n_local, K, W, a.dtype, sms, tma=hopper and aligned, mode=m)
                 for m in MODES})[mode]
    validate(cfg, esize)
    if cfg.variant in FALLBACKS:
        return _ScatterPlan(cfg, 0, out, None, None, (), {}, False, libs=(
            torch.empty((M, n_local), dtype=a.dtype, device=a.device),
            None if heap.simulated else torch.empty((W * M, n_local), dtype=a.dtype, device=a.device)))
    if cfg.tma_loads and not (hopper and aligned):
        raise ValueError("gemm_all_scatter: tma_loads=True needs an sm_90+ GPU and a, b_local with unit column "
                         "stride and 16-byte aligned rows and base (K and N / world_size multiples of 8 for "
                         "16-bit types); use tma_loads=None")
    tma = bool(hopper and aligned) if cfg.tma_loads is None else cfg.tma_loads
    tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(n_local, cfg.block_n)
    # The hint says every row of the scattered tile starts 16-byte aligned: true when C's
    # base, its row length and every rank's column offset (multiples of n_local) are.
    hints_ok = bool(hints) and out.data_ptr() % 16 == 0 and (N * esize) % 16 == 0 and (n_local * esize) % 16 == 0
    meta = dict(WORLD=W, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, TMA_LOADS=tma,
                HINTS=hints_ok, WAIT=not heap.simulated, SCOPE=scope,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    args = (M, n_local, K, a.stride(0), a.stride(1), b_local.stride(0), b_local.stride(1), out.stride(0))
    flags, total = heap.flags("gemm_scatter", W), heap.flags("gemm_scatter.total", 1)
    if cfg.split_kernel:
        pieces, per = split_pieces(triton.cdiv(K, cfg.block_k), cfg.split_k)
        return _ScatterPlan(cfg, tiles * pieces, out, flags, total, args, dict(meta, SWAP_AB=cfg.swap_ab), hints_ok,
                            split=((tiles, pieces), (pieces, per)))
    if cfg.variant == "senders":
        bands = triton.cdiv(triton.cdiv(M, cfg.block_m), cfg.group_m)
        senders = min(cfg.senders, bands, max(1, (cfg.num_sms or sms) - 1))
        num_gemm = max(1, min((cfg.num_sms or sms) - senders, tiles))
        return _ScatterPlan(cfg, num_gemm + senders, out, flags, total, args, dict(meta, SENDERS=senders), hints_ok,
                            num_gemm=num_gemm, bands=torch.zeros(bands, dtype=torch.int32, device=a.device))
    grid = max(1, min(cfg.num_sms or sms, tiles))
    return _ScatterPlan(cfg, grid, out, flags, total, args,
                        dict(meta, FROM_REGISTERS=cfg.from_registers, FLATTEN=cfg.flatten), hints_ok)


def _plans(heap) -> PlanCache:
    cache = heap.cache("gemm_scatter")
    plans = cache.get("plans")
    if plans is None:
        plans = cache["plans"] = PlanCache(PLAN_CACHE_SIZE)
    return plans


def plan_for(a, b_local, heap, config=None, *, hints=True, out=None, scope="sys", mode=None) -> _ScatterPlan:
    """The plan ``gemm_all_scatter`` runs for this call (made once per call signature; with
    ``config=None`` once per mode too, ``serving``: eager calls and graph replays may differ)."""
    try:
        mode = (mode or serving(a)) if config is None else None
        key = (tensor_signature(a), tensor_signature(b_local), config_key(config), bool(hints), scope,
               None if out is None else (out.data_ptr(), tensor_signature(out)), mode)
    except AttributeError:  # not tensors: let the checks say what is wrong
        _check(a, b_local, heap)
        raise
    plans = _plans(heap)
    plan = plans.get(key)
    if plan is None:
        _watch(heap)   # its status words before the plan's flags: the heap's flag area in the same order on every rank
        plan = plans.put(key, _other_mode(plans, key, heap, a, b_local)
                         or _plan(a, b_local, heap, config, hints, out, scope, mode or "eager"))
        if mode == "eager" and a.device.type == "cuda":   # the graph's plan too, now: a capture allocates nothing
            twin = plan_for(a, b_local, heap, None, hints=hints, out=out, scope=scope, mode="graph")
            plan.graph_twin = twin if twin is not plan else None
    return plan


def _other_mode(plans, key, heap, a, b_local) -> _ScatterPlan | None:
    """The other mode's plan of this call where rank 0 chose the same config for both (one plan,
    one set of flags; the choice is already shared, so no rank is asked anything)."""
    if key[-1] is None:
        return None
    other = plans.get(key[:-1] + ("graph" if key[-1] == "eager" else "eager",))
    if other is None:   # (also a call the checks will refuse: no plan was made for it)
        return None
    M, K, n_local = a.shape[0], a.shape[1], b_local.shape[1]
    both = heap.cache("gemm_scatter.decisions").get((M, n_local, K, heap.world_size, str(a.dtype)))
    return other if both and both["eager"] == both["graph"] else None


def _flag_name(i: int) -> str:
    if i >= BAND_FLAG.value:
        return f"row band {i - BAND_FLAG.value} of our own GEMM, which the senders wait for"
    return f"tiles from rank {i}"


def _watch(heap) -> StatusWatch:
    return StatusWatch.of(heap, "gemm_scatter", names=_flag_name)


def gemm_all_scatter(a: torch.Tensor, b_local: torch.Tensor, heap, *,
                     config: ScatterConfig | Mapping[str, Any] | None = None, hints: bool = True,
                     out: torch.Tensor | None = None, check: bool = False, timeout_s: float | None = None,
                     scope: str = "sys") -> torch.Tensor:
    """``C = A @ [B_0 | B_1 | ... | B_{W-1}]`` on every rank, each rank computing its column block.

    a: (M, K), the same on every rank; b_local: (K, N / W), this rank's
    columns of B; both bf16, fp16 or fp32, on the heap's device. Returns C
    (M, N), N = W * b_local.shape[1], a heap tensor (``out`` if given, else a
    heap buffer reused per shape: copy it, or meet the peers after reading
    (``kernels.comm.barrier(heap)``) before the next call fills it again). Every
    rank must make the same calls.

    ``config``: a ``ScatterConfig`` or a dict of its fields (None: ``config.auto_config``, rank 0's).
    ``hints``: state the 16-byte alignment of the translated pointers, so the
    scatter stores are 128 bits wide (used when the shapes make it true).
    A peer that never signals makes the bounded device-side wait give up and
    record it; that surfaces as ``kernels.comm.waits.WaitTimeout`` naming the
    rank at this rank's next call, at ``check_gemm_all_scatter(heap)``, or at
    once with ``check=True`` (which synchronizes), once per failure, on every rank
    (a rank later than the bound finds the call abandoned and raises too); the
    call after it works (``kernels.comm.waits``). ``timeout_s``: how long that
    wait may last, in seconds of the GPU's clock (default
    ``$WORKBENCH_WAIT_TIMEOUT_S``, else 60; ``kernels.comm.clock``).
    """
    wait_us = _timeout_us(timeout_s)
    watch = _watch(heap)
    watch.poll()  # an earlier call's timeout, if the device has reported one by now
    p = plan_for(a, b_local, heap, config, hints=hints, out=out, scope=scope)
    if p.graph_twin is not None:
        # The first eager call of a problem whose graph replays run another method: run that one
        # once too, now (a user warms up eagerly before capturing; the capture must not be the graph
        # method's first call: its compile, its all-gather's shared choice). Every rank does it here.
        twin, p.graph_twin = p.graph_twin, None
        _run(twin, a, b_local, heap, watch, wait_us, scope, check=False)
        from kernels.comm.barrier import barrier

        barrier(heap, timeout_s=wait_us / 1e6)   # both write C: no peer's call writes it before ours is done
    return _run(p, a, b_local, heap, watch, wait_us, scope, check)


def _run(p, a, b_local, heap, watch, wait_us, scope, check):
    """One call of plan ``p`` (gemm_all_scatter's body once its plan is known)."""
    if p.libs is not None:
        return _unfused(a, b_local, heap, p, wait_us / 1e6)
    if p.meta["TMA_LOADS"]:
        cfg = p.config
        a_desc = p.descriptor("a", a, [cfg.block_m, cfg.block_k])
        b_desc = p.descriptor("b", b_local, [cfg.block_k, cfg.block_n])
    else:
        a_desc = b_desc = None
    status = watch.status
    if p.bands is not None:
        launch_planned(heap, p.launches, "senders", _gemm_scatter_send_kernel, (p.grid,), a, b_local, a_desc, b_desc,
                       p.out, heap.heap_bases, p.flags, status, p.total, p.bands, *p.args, heap.rank, wait_us,
                       p.num_gemm, p.config.group_m, **p.meta)
    elif p.split:
        grid, pieces = p.split
        cfg = p.config
        ws, cnt = workspace(a.device, grid[0] * grid[1] * cfg.block_m * cfg.block_n, grid[0])
        launch_planned(heap, p.launches, "split", _gemm_scatter_split_kernel, grid, a, b_local, a_desc, b_desc,
                       p.out, ws, cnt, heap.heap_bases, p.flags, status, p.total, *p.args, heap.rank, wait_us,
                       *pieces, **p.meta)
    else:
        launch_planned(heap, p.launches, "persistent", _gemm_scatter_kernel, (p.grid,), a, b_local, a_desc, b_desc,
                       p.out, heap.heap_bases, p.flags, status, p.total, *p.args, heap.rank, wait_us, p.grid,
                       p.config.group_m, **p.meta)
    if heap.simulated:  # ranks take turns in the interpreter: wait in a launch of its own
        heap.barrier()
        heap.launch(wait_all_kernel, (1,), p.flags, p.total, p.grid, wait_us, status, heap.heap_bases, heap.rank,
                    WORLD=heap.world_size, SCOPE=scope)
    watch.arm()
    if check:
        watch.check()
    return p.out


def _unfused(a, b_local, heap, p, timeout_s):
    """Variants "nccl" (cuBLAS, NCCL's all-gather) and "sequential" (our GEMM, our all-gather),
    each followed by the permute that puts the column blocks in place, into the plan's C. In a
    simulated world (no process group) our all-gather stands in for NCCL's."""
    from kernels.comm import all_gather
    from kernels.gemm_scatter.baselines import column_blocks

    c_local, gathered = p.libs
    if p.config.variant == "nccl":
        torch.mm(a, b_local, out=c_local)
    else:
        from kernels.gemm import matmul

        if heap.simulated:
            with heap.world._lock:   # the interpreter runs one rank's kernels at a time
                matmul(a, b_local, out=c_local)
        else:
            matmul(a, b_local, out=c_local)
    if p.config.variant == "nccl" and not heap.simulated:
        import torch.distributed as tdist

        tdist.all_gather_into_tensor(gathered, c_local, group=heap.group)
    else:
        gathered = all_gather(c_local, heap, variant="triton" if heap.simulated else "auto", timeout_s=timeout_s)
    column_blocks(gathered, heap.world_size, p.out)
    if gathered is not p.libs[1]:
        # our all-gather's buffer (in the heap): peers refill it only after we have read it (a bounded
        # barrier that ends the all-gather's call)
        from kernels.comm.barrier import barrier
        from kernels.comm.launch import within_last_call

        barrier(heap, timeout_s=timeout_s, within=within_last_call(heap))
    return p.out


def recover(heap) -> None:
    """Zero the flags, the running totals, the status words and the senders' band counters on
    every rank (collective). A timeout does not need it (the flags stay in step:
    ``kernels.comm.waits``); ranks whose calls went out of step do."""
    heap.resync_flags()
    for p in _plans(heap).values():
        if p.bands is not None:
            p.bands.zero_()
    _watch(heap).reset()


def check_gemm_all_scatter(heap) -> None:
    """Raise ``WaitTimeout`` (naming this rank and the silent peer) if an earlier
    ``gemm_all_scatter`` on this heap failed since the last report (the all-gather of the
    sequential variant included). Synchronizes with the device."""
    from kernels.comm import check_all_gather

    _watch(heap).check()
    check_all_gather(heap)


# --------------------------------------------------------------------------
# Assembly: the kernel cross-compiled without a GPU
# --------------------------------------------------------------------------
def compile_kernel(hints: bool, *, target="sm90", dtype: torch.dtype = torch.float16, world_size: int = 2,
                   config: ScatterConfig | Mapping[str, Any] | None = None, tma_loads: bool = False, cache_dir,
                   senders: int = 0):
    """Cross-compile the kernel ``gemm_all_scatter`` launches, with the hint on or
    off, for ``target`` ("sm90", "gfx942", ...) into ``cache_dir``; returns the
    ``workbench.asm.cache.Entry`` (diff two with ``workbench.asm.diff``), or a
    list of them when ``target`` is a list (one compilation run for all).

    Shapes are run-time values; the compiler is told what the launcher's plan
    knows for aligned shapes (pointers, N / W and K multiples of 16).
    ``tma_loads=True`` (sm_90 only) builds the Hopper path with descriptor loads.
    ``senders > 0``: the "senders" variant's kernel with that many sending programs.
    """
    from workbench.asm.compile import cross_compile

    cfg = as_config(config) or ScatterConfig(block_m=64, block_n=64, block_k=32, num_warps=4, num_stages=2)
    validate(cfg, torch.empty((), dtype=dtype).element_size())
    targets = [target] if isinstance(target, str) else list(target)
    if tma_loads and not all(t.startswith("sm") for t in targets):
        raise ValueError(f"compile_kernel: tma_loads=True needs NVIDIA sm_90+ targets, got {target!r}")
    ty = triton_type(dtype)
    sig = {"a_ptr": f"*{ty}", "b_ptr": f"*{ty}", "c_ptr": f"*{ty}", "heap_bases": "*i64", "flags_ptr": "*i32",
           "status_ptr": "*i32", "total_ptr": "*i32", "M": "i32", "N_LOCAL": "i32", "K": "i32",
           "stride_am": "i32", "stride_ak": "i32", "stride_bk": "i32", "stride_bn": "i32", "stride_cm": "i32",
           "rank": "i32", "timeout_us": "i32", "num_sms": "i32", "group_m": "i32"}
    constexprs = {"WORLD": world_size, "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
                  "TMA_LOADS": tma_loads, "FROM_REGISTERS": cfg.from_registers, "HINTS": bool(hints),
                  "WAIT": True, "FLATTEN": cfg.flatten, "SCOPE": "sys", "stride_ak": 1, "stride_bn": 1}
    del sig["stride_ak"], sig["stride_bn"]
    if tma_loads:
        sig["a_desc"] = f"tensordesc<{ty}[{cfg.block_m}, {cfg.block_k}]>"
        sig["b_desc"] = f"tensordesc<{ty}[{cfg.block_k}, {cfg.block_n}]>"
    else:
        constexprs.update(a_desc=None, b_desc=None)
    divisible = ["a_ptr", "b_ptr", "c_ptr", "heap_bases", "flags_ptr", "status_ptr", "total_ptr", "N_LOCAL", "K",
                 "stride_am", "stride_bk", "stride_cm"]
    kernel = _gemm_scatter_kernel
    if senders:
        kernel = _gemm_scatter_send_kernel
        for k in ("FROM_REGISTERS", "FLATTEN"):
            del constexprs[k]
        del sig["num_sms"]
        sig.update(band_ptr="*i32", num_gemm="i32")
        constexprs["SENDERS"] = senders
        divisible.append("band_ptr")
    entries = cross_compile(kernel, targets, signature=sig, constexprs=constexprs,
                            divisible=divisible, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                            cache_dir=cache_dir)
    return entries[0] if isinstance(target, str) else entries
