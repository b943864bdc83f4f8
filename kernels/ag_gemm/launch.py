"""``all_gather_matmul``: validate -> plan (cached per call signature) -> launch.

Variants (``AgGemmConfig.variant``; ``config=None`` lets ``auto_config`` pick: rank 0 runs it
once per new problem and every rank runs what it chose, ``kernels.comm.decide``):

``"fused"``        one persistent launch: ``fetchers`` programs pull the peers'
                   shards into a local staging buffer and set a flag per
                   (row tile, k-group); the other programs compute as flags arrive.
``"copy_engine"``  no SM fetches: a small publish kernel, then ``cudaMemcpyAsync``
                   chunks from every peer's shard into the staging buffer on a side
                   stream, each followed by a stream-ordered copy that sets the
                   chunk's flags; every SM but a few runs the GEMM, spinning on those flags.
``"chunked"``      no SM fetches and no flags: the publish kernel, then copy-engine
                   copies on a side stream and cuBLAS as they land (an event each):
                   gathered along M, each peer's whole shard, cuBLAS on our shard at
                   once and on each peer's as it lands (PyTorch async-TP's schedule);
                   gathered along K (``k_schedule="rows"``), row chunks of every
                   peer's shard into the gathered A, cuBLAS on each chunk's rows over
                   the whole K; or (``"sum"``) our shard's product at once and each
                   peer's added as its shard lands, summed in fp32.
``"pipelined"``    no SM fetches: the publish kernel, then ``cudaMemcpyAsync`` pulls
                   of each peer's shard in row chunks, each followed by ONE signal,
                   queued in arrival order; every SM but a few runs the GEMM, taking tiles in
                   that order (our own rows first) and waiting once per (tile, peer
                   shard) on its chunk's signal. (``kernels.ag_gemm.copies``)
``"sequential"``   our all-gather (``kernels.comm.all_gather``), then our GEMM
                   (``kernels.gemm.matmul``): the fallback where fusing loses.
``"nccl"``         NCCL's all-gather (``torch.distributed``), then cuBLAS
                   (``torch.matmul``): the fallback where the libraries beat both.
``"torch"``        PyTorch's ``fused_all_gather_matmul`` (async-TP, symmetric memory):
                   the fallback where PyTorch's own fused op is the fastest (a user
                   picks the faster; the choice offers it too). In a simulated world
                   our all-gather and ``torch.matmul`` stand in for it.

A repeated call is a dict lookup and the launches: no host synchronization and
no heuristic work. Failures on the device (a peer that never published, a tile
that never arrived) are written to a status word by the bounded waits and
surface without a sync: at the start of a later call on this heap (once a copy
of the status made after the failing call has landed: ``StatusWatch``, at most
one copy per millisecond of calls), or at ``check(heap)``, which synchronizes.
Under CUDA-graph capture nothing is copied: call ``check(heap)`` after replaying. In a
simulated world (CPU) the status is read right after each call. Each failure is reported
once, on every rank (a rank that arrives after its peers gave up on the call raises too), and
the call after it works: no recovery step (``kernels.comm.waits`` says how).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch
import triton

from kernels.ag_gemm import copies
from kernels.ag_gemm.config import FALLBACKS, AgGemmConfig, as_config, auto_config, validate
from kernels.ag_gemm.triton import TRACE_COLS, _ag_gemm_kernel
from kernels.comm.clock import timeout_us as _timeout_us
from kernels.comm.decide import shared_choice
from kernels.comm.waits import AFTER, ST_ABANDON, ST_CALL, StatusWatch, WaitTimeout, abandoned_text, waited_s
from kernels.common.launcher import launch_planned

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GATHER_DIMS = (0, 1)
MAX_PLANS = 64           # launch plans kept per heap (the cache is cleared past this)
MAX_EVENTS = {"gpu": 512, "sim": 64}


class AgGemmTimeout(WaitTimeout):
    """A bounded wait of all_gather_matmul gave up: names the rank and the tile."""


@dataclasses.dataclass
class Plan:
    cfg: AgGemmConfig
    gather_dim: int
    S_M: int
    S_K: int
    N: int
    out_shape: tuple
    world: int = 1
    MT: int = 0
    KG: int = 0
    NCH: int = 0              # pipelined: row chunks per shard (one signal each)
    grid: int = 0
    kw: dict = dataclasses.field(default_factory=dict)
    gemm_kw: dict = dataclasses.field(default_factory=dict)  # copy-engine variants: the GEMM launch's (no fetchers)
    pub: Any = None
    stg: Any = None
    flags: Any = None
    trace: Any = None
    nextval: Any = None       # the values the copy-engine variants' signals take (a device tensor)
    chunks: list = dataclasses.field(default_factory=list)
    side: Any = None          # kernels.comm.streams.SideStream (GPU)
    events: list = dataclasses.field(default_factory=list)  # chunked: one per copied shard, or row chunk (K, rows)
    rows: list = dataclasses.field(default_factory=list)    # chunked along K, rows: C's row chunks
    acc: Any = None           # chunked along K, sum: the fp32 sum of the per-shard products
    nccl: Any = None          # variant nccl: baselines.NcclCublas (its buffer for NCCL's output)
    auto: bool = False
    choices: dict | None = None  # config=None: rank 0's choice per mode ({'eager': cfg, 'graph': cfg})
    resident: bool = False    # the shard lies in the heap: peers read it in place (no publish copy)
    pub_off16: int = 0        # and its heap offset / 16 (the plan's key holds the offset)
    launches: dict = dataclasses.field(default_factory=dict)  # PlannedLaunch per (phase, C's alignment, C's row stride)
    # config=None, an eager call's plan whose graph-replay plan runs another method: that one, to
    # run once at the first eager call (a capture then meets no first call of anything)
    graph_twin: Any = None


# --------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------
def _validate(a, b, heap, gather_dim, bias):
    who = "all_gather_matmul"
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor):
        raise ValueError(f"{who}: a_shard and b must be torch tensors")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"{who}: a_shard and b must be 2-D, got {tuple(a.shape)} and {tuple(b.shape)}")
    if gather_dim not in GATHER_DIMS:
        raise ValueError(f"{who}: gather_dim must be 1 (each rank holds A[:, k-slice], gathered along K) or 0 "
                         f"(each rank holds M/W rows, gathered along M), got {gather_dim!r}")
    if a.dtype != b.dtype or a.dtype not in DTYPES:
        raise ValueError(f"{who}: a_shard and b must share a dtype in {[str(d) for d in DTYPES]}, got {a.dtype} "
                         f"and {b.dtype}")
    if a.numel() == 0 or b.numel() == 0:
        raise ValueError(f"{who}: empty operands ({tuple(a.shape)}, {tuple(b.shape)})")
    if a.stride(1) != 1 or a.stride(0) != a.shape[1]:
        raise ValueError(f"{who}: a_shard must be row-major contiguous (strides {a.stride()}); "
                         "pass a_shard.contiguous()")
    W = heap.world_size
    K = a.shape[1] * W if gather_dim == 1 else a.shape[1]
    if b.shape[0] != K:
        conv = f"W * a_shard.shape[1] = {W} * {a.shape[1]}" if gather_dim == 1 else f"a_shard.shape[1] = {a.shape[1]}"
        raise ValueError(f"{who}: b must be (K, N) with K = {conv} = {K} for gather_dim={gather_dim}, got "
                         f"{tuple(b.shape)}")
    for name, t in (("a_shard", a), ("b", b)) + ((("bias", bias),) if bias is not None else ()):
        if t.device.type != heap.device.type or (t.device.type == "cuda" and t.device != heap.device):
            raise ValueError(f"{who}: {name} is on {t.device} but rank {heap.rank}'s heap is on {heap.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or bias.dim() != 1 or bias.shape[0] != b.shape[1]:
            raise ValueError(f"{who}: bias must be a 1-D tensor of N = {b.shape[1]} elements, got "
                             f"{tuple(getattr(bias, 'shape', ()))}")
        if bias.dtype not in (a.dtype, torch.float32) or bias.stride(0) != 1:
            raise ValueError(f"{who}: bias must be contiguous {a.dtype} or float32, got {bias.dtype}")


# --------------------------------------------------------------------------
# Per-heap state: status word, its host copy, the plans
# --------------------------------------------------------------------------
def _shared(heap) -> dict:
    cache = heap.cache("ag_gemm")
    s = cache.get("_shared")
    if s is None:
        watch = StatusWatch.of(heap, "ag_gemm", report=lambda words, peer: _raise(words, peer, heap))
        s = cache["_shared"] = {
            "watch": watch, "status": watch.status, "plans": {},
            "sig": heap.flags("ag_gemm.sig", 3 * heap.world_size),  # ready[W], done[W], where[W]
            # epoch, publishers arrived, programs finished, trace tick, fetchers finished, tiles claimed
            "state": heap.flags("ag_gemm.state", 8),
        }
    return s


def describe_status(values, plan: Plan | None, rank: int, world: int) -> str:
    """The error text for this rank's own give-up in status words (``kernels.comm.waits``:
    count, flag id, seen, expected, microseconds waited, call tag)."""
    values = [int(v) for v in values]
    count, fid, seen, expected = values[:4]
    call = values[ST_CALL]
    waited = waited_s(values)
    if fid < 0 and -fid <= world:
        what = (f"rank {-fid - 1} never published its shard (ready flag from rank {-fid - 1})")
    elif fid < 0 and -fid <= 2 * world:
        peer = -fid - 1 - world
        what = f"rank {peer} never finished reading our shard (done flag from rank {peer})"
    elif fid < 0:
        peer = -fid - 1 - 2 * world
        return (f"rank {rank}: all_gather_matmul: rank {peer}'s a_shard lies at heap offset {seen * 16}, ours at "
                f"{expected * 16}: a shard in the heap must be allocated by the same heap calls on every rank "
                f"(the peers read it at our offset), or pass one outside the heap.")
    elif plan is not None and copies.describe_chunk(plan, fid):
        what = copies.describe_chunk(plan, fid)
    elif plan is not None and plan.MT and plan.KG:
        src, rest = divmod(fid, plan.MT * plan.KG)
        mt, g = divmod(rest, plan.KG)
        c = plan.cfg
        r0, k0 = mt * c.block_m, g * c.k_per_flag * c.block_k
        r1, k1 = min(plan.S_M, r0 + c.block_m) - 1, min(plan.S_K, k0 + c.k_per_flag * c.block_k) - 1
        what = (f"tile (row tile {mt}, k-group {g}) of rank {src}'s shard never arrived: rows {r0}...{r1}, "
                f"columns {k0}...{k1}"
                f" of its {plan.S_M}x{plan.S_K} shard (staging flag {fid}); rank {src} never sent it, or our "
                f"fetchers never fetched it")
    else:
        what = f"staging flag {fid} never set"
    return (f"rank {rank}: all_gather_matmul: call tag {call} gave up after waiting {waited:.3f} s "
            f"({count} bounded wait(s) so far): {what} (saw {seen}, expected >= {expected}); that call's C is "
            f"not valid. {AFTER}")


def _raise(values, peer, heap):
    if peer is not None:   # a peer gave up on the call (this rank was late, or another one was)
        raise AgGemmTimeout(abandoned_text(heap.rank, "all_gather_matmul", peer, int(values[ST_ABANDON + peer])))
    plan = heap.cache("ag_gemm").get("_shared", {}).get("last_plan")
    raise AgGemmTimeout(describe_status(values, plan, heap.rank, heap.world_size))


def _after_call(s, heap, plan) -> None:
    s["last_plan"] = plan
    s["watch"].arm()
    if heap.simulated:  # the status words are host memory: report at once
        s["watch"].poll()


def check(heap) -> None:
    """Synchronize and raise `AgGemmTimeout` if a call on this heap failed since the last report
    (``WaitTimeout`` for the all-gather our sequential variant runs)."""
    from kernels.comm import check_all_gather

    _shared(heap)["watch"].check()
    check_all_gather(heap)


def recover(heap) -> None:
    """Zero the flags, the epoch and the status words on every rank (collective). A timeout
    does not need it (the flags stay in step: ``kernels.comm.waits``); ranks whose calls went
    out of step (one skipped a call, or launched another configuration) do."""
    s = _shared(heap)
    heap.resync_flags()  # ready/done flags and the epoch live in the heap's flag area
    for plan in s["plans"].values():
        if plan.flags is not None:
            plan.flags.zero_()
    s["watch"].reset()
    if heap.device.type == "cuda":
        torch.cuda.synchronize(heap.device)


# --------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------
def _device_sms(heap) -> int:
    if heap.device.type == "cuda":
        return torch.cuda.get_device_properties(heap.device).multi_processor_count
    return 4


def _clock(heap) -> str:
    if heap.simulated or heap.device.type != "cuda":
        return "counter"
    return "memtime" if torch.version.hip else "globaltimer"


def serving(heap) -> str:
    """'graph' while the current stream captures a CUDA graph, else 'eager': the choice differs
    (PyTorch's fused op costs 0.3-0.8 ms of host time per eager call, nothing in a replay).
    A host-side query of the capture state: no synchronization."""
    if heap.simulated or heap.device.type != "cuda":
        return "eager"
    return "graph" if torch.cuda.is_current_stream_capturing() else "eager"


MODES = ("eager", "graph")


def _auto(heap, M, N, K, W, gather_dim, sms, dtype) -> dict:
    """Rank 0's choice for the problem in each mode: both decided and shared at once, on the
    first call (which comes before any capture: a broadcast cannot run inside one)."""
    return shared_choice(heap, "ag_gemm", (M, N, K, W, gather_dim, str(dtype)),
                         lambda: {m: auto_config(M, N, K, W, gather_dim, sms, heap.simulated, dtype, mode=m)
                                  for m in MODES})


def _make_plan(a, b, heap, gather_dim, bias, config, trace, mode="eager") -> Plan:
    _validate(a, b, heap, gather_dim, bias)
    W = heap.world_size
    S_M, S_K = a.shape
    N = b.shape[1]
    M = S_M * W if gather_dim == 0 else S_M
    K = S_K * W if gather_dim == 1 else S_K
    cfg = as_config(config)
    auto = cfg is None
    sms = _device_sms(heap)
    if auto:   # rank 0's choice, shared once per problem: every rank runs the same variant
        both = _auto(heap, M, N, K, W, gather_dim, sms, a.dtype)
        cfg = both[mode]
    validate(cfg, W, a.element_size())
    if trace and cfg.variant == "chunked":
        raise ValueError("all_gather_matmul: trace=True records the programs of our kernels; variant 'chunked' "
                         "runs cuBLAS (use torch.profiler for it), or pass trace=False")
    plan = Plan(cfg, gather_dim, S_M, S_K, N, (M, N), world=W, auto=auto, choices=both if auto else None)
    if cfg.variant == "nccl" and not heap.simulated:  # the libraries, as the baseline calls them
        from kernels.ag_gemm.baselines import NcclCublas

        plan.nccl = NcclCublas(a, W, gather_dim, group=heap.group)
    if cfg.variant == "torch" and not heap.simulated:
        plan.nccl = _torch_fused(heap, gather_dim)
    if cfg.variant in FALLBACKS:
        return plan
    plan.MT = triton.cdiv(S_M, cfg.block_m)
    plan.KG = triton.cdiv(triton.cdiv(S_K, cfg.block_k), cfg.k_per_flag)
    plan.NCH = triton.cdiv(plan.MT, copies.chunk_tiles(plan)) if cfg.variant == "pipelined" else 0
    dev = heap.device
    offset = resident_offset(a, heap)
    plan.resident, plan.pub_off16 = offset is not None, (offset or 0) // 16
    # a shard in the heap is read in place by the peers; any other is copied into `pub` first
    plan.pub = a if plan.resident else heap.named(f"ag_gemm.pub.{S_M}x{S_K}.{a.dtype}", (S_M, S_K), a.dtype)
    # one staging buffer per shard shape, shared by the plans (calls are stream-ordered and
    # each plan's own flags say what this call staged)
    stg_key = ("stg", S_M, S_K, a.dtype)
    shared = _shared(heap)
    if stg_key not in shared:
        shared[stg_key] = torch.zeros((W, S_M, S_K), dtype=a.dtype, device=dev)
    plan.stg = shared[stg_key]
    plan.flags = torch.zeros(copies.n_flags(plan), dtype=torch.int32, device=dev)  # + "all staged"
    total = cfg.num_sms or (sms if not heap.simulated else 4 + cfg.fetchers)
    if cfg.variant == "fused":
        fetchers = min(cfg.fetchers, total - 1)
        plan.grid = total
        publishers = total if cfg.publish_all else fetchers
    else:  # the copy-engine variants: the publish kernel's programs (its FETCHERS) all publish
        fetchers = publishers = min(total if cfg.publish_all else copies.CE_PUBLISHERS, max(1, plan.MT * plan.KG))
        plan.grid = total
        copies.plan_copies(plan, heap, shared)
    clock = _clock(heap)
    max_ev = MAX_EVENTS["sim" if heap.simulated else "gpu"]
    plan.trace = (torch.zeros((plan.grid, max_ev, TRACE_COLS), dtype=torch.int64, device=dev) if trace
                  else torch.zeros(1, dtype=torch.int64, device=dev))
    vec = 16 // a.element_size()
    tma = cfg.tma and tma_allowed(a, b, cfg, gather_dim, heap)
    plan.kw = dict(constexprs(cfg, W, gather_dim, a.element_size(), fetchers, has_bias=bias is not None,
                              trace=trace, clock=clock, max_events=max_ev, even_k=S_K % cfg.block_k == 0,
                              aligned_m=S_M % vec == 0, aligned_n=N % vec == 0 and b.stride(1) == 1, tma=tma,
                              proxy_fence=tma and clock == "globaltimer",
                              claim=cfg.claim_tiles, resident=plan.resident,
                              end_wait=plan.resident and not heap.simulated, publishers=publishers,
                              # the interpreter runs programs one after another: a fetcher that joined
                              # the GEMM would wait for tiles the next fetcher has not staged yet
                              join=not heap.simulated or W == 1,
                              chunk_tiles=copies.chunk_tiles(plan) if cfg.variant == "pipelined" else 0,
                              publish_gathered=copies.publish_gathered(plan)),
                   num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    plan.gemm_kw = dict(plan.kw, FETCHERS=0)
    return plan


def tma_allowed(a, b, cfg: AgGemmConfig, gather_dim: int, heap) -> bool:
    """Whether the GEMM programs may read the local shard, the staging buffer and B through
    TMA descriptors: 16-bit operands (fp32 would run tf32 wgmma, which reads B only K-major),
    rows of 16-byte multiples on 16-byte aligned bases (the shard's, the staged blocks' and
    B's, B with unit column stride), on an NVIDIA GPU or the interpreter, and edges TMA's zero
    fill makes exact: no K tile may straddle two shards (S_K a multiple of BLOCK_K), except
    gathered along M with k-contiguous staging, where A's columns past S_K and B's rows past K
    are both read as zeros."""
    S_M, S_K = a.shape
    if a.element_size() != 2 or torch.version.hip or not (heap.simulated or heap.device.type == "cuda"):
        return False
    vec = 16 // a.element_size()
    if S_K % vec or (cfg.layout == "m" and S_M % vec) or a.data_ptr() % 16:
        return False
    if b.stride(1) != 1 or b.stride(0) % vec or b.data_ptr() % 16:
        return False
    return S_K % cfg.block_k == 0 or (gather_dim == 0 and cfg.layout == "k")


def constexprs(cfg: AgGemmConfig, world_size: int, gather_dim: int, esize: int, fetchers: int, *, has_bias: bool,
               trace: bool, clock: str, max_events: int, even_k: bool, aligned_m: bool, aligned_n: bool,
               tma: bool = False, proxy_fence: bool = False, claim: bool = False, join: bool = False,
               resident: bool = False, end_wait: bool = False, publishers: int | None = None,
               chunk_tiles: int = 0, publish_gathered: bool = False) -> dict:
    """The kernel's constexprs for a configuration (the phase flags are added per launch)."""
    return dict(TMA=tma, PROXY_FENCE=proxy_fence, CLAIM=claim, JOIN=claim and join, WORLD=world_size,
                GATHER_K=gather_dim == 1, M_CONTIG=cfg.layout == "m", BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m, K_PER_FLAG=cfg.k_per_flag,
                FETCH_K=fetch_k(cfg), FETCHERS=fetchers, HAS_BIAS=has_bias, SKIP_RANK=cfg.skip_rank, ESIZE=esize,
                EVEN_K=even_k, ALIGNED_M=aligned_m, ALIGNED_N=aligned_n, STAGED_FLAG=bool(cfg.staged_flag),
                TRACE=bool(trace), CLOCK=clock, MAX_EVENTS=max_events, FETCH_BY_K=cfg.fetch_order == "k",
                WAIT_GROWTH=cfg.wait_growth, RESIDENT=resident, END_WAIT=end_wait,
                PUBLISHERS=publishers or fetchers, CHUNK_TILES=chunk_tiles, SET_NEXT=chunk_tiles > 0,
                PUBLISH_GATHERED=publish_gathered)


def fetch_k(cfg: AgGemmConfig, widest: int = 256) -> int:
    """Columns a fetcher copies per step: BLOCK_K doubled while it still divides a k-group
    and stays within `widest` (a 128 x 256 bf16 step keeps 64 KiB in flight per program)."""
    fk = cfg.block_k
    while fk * 2 <= widest and (cfg.k_per_flag * cfg.block_k) % (fk * 2) == 0:
        fk *= 2
    return fk


def _key(a, b, bias, heap, gather_dim, config, trace):
    cfg = config if config is None or isinstance(config, AgGemmConfig) else tuple(sorted(dict(config).items()))
    return (tuple(a.shape), a.stride(), a.dtype, tuple(b.shape), b.stride(), b.dtype, a.device,
            None if bias is None else (bias.shape[0], bias.dtype, bias.data_ptr() % 16),
            a.data_ptr() % 16, b.data_ptr() % 16, gather_dim, cfg, bool(trace), resident_offset(a, heap))


def resident_offset(a, heap) -> int | None:
    """The heap offset of a shard that lies wholly in the heap, 16-byte aligned (peers then
    read it in place), else None (it is copied into the heap at every call)."""
    off = a.data_ptr() - heap.buffer.data_ptr()
    end = off + a.numel() * a.element_size()
    if off < 0 or off % 16 or end > heap.nbytes or off >= 16 << 31 or not a.is_contiguous():
        return None  # (the offset travels to the peers as an int32 count of 16 bytes)
    return off


def get_plan(a_shard, b, heap, *, gather_dim=1, bias=None, config=None, trace=False, mode=None) -> Plan:
    """The cached launch plan of a call (made on first use). With ``config=None`` the plan is the
    one for ``mode`` (default: what the call serves, ``serving``), since eager calls and graph
    replays may run different variants."""
    s = _shared(heap)
    mode = (mode or serving(heap)) if config is None else None
    key = _key(a_shard, b, bias, heap, gather_dim, config, trace) + (mode,)
    plan = s["plans"].get(key)
    if plan is None:
        if len(s["plans"]) >= MAX_PLANS:
            s["plans"].clear()
        plan = s["plans"][key] = _reuse(s, key, mode) or _make_plan(a_shard, b, heap, gather_dim, bias, config,
                                                                    trace, mode or "eager")
        if mode == "eager" and not heap.simulated:   # the graph's plan too, now: a capture then allocates nothing
            twin = get_plan(a_shard, b, heap, gather_dim=gather_dim, bias=bias, config=None, trace=trace, mode="graph")
            plan.graph_twin = twin if twin is not plan else None
    return plan


def _reuse(s, key, mode) -> Plan | None:
    """The other mode's plan of the same call where the shared choice for this mode is the same
    config (one plan, one set of buffers; nothing is asked of any rank)."""
    if mode is None:
        return None
    other = s["plans"].get(key[:-1] + ("graph" if mode == "eager" else "eager",))
    if other is None or not other.auto or other.choices is None:
        return None
    return other if other.choices.get(mode) == other.cfg else None


def prepare(a_shard, b, heap, *, gather_dim=1, bias=None, config=None, trace=False) -> Plan:
    """Make a call's plan and compile its kernels without launching them (GPU).

    A first call compiles on every rank; a rank still compiling keeps its peers'
    bounded waits spinning. Benchmarks call this on every rank, meet at a barrier,
    then time: no wait ever has to cover a compile. With ``config=None`` the plans of eager
    calls and of graph replays both (each may run another variant), so that a capture after it
    finds its plan made; the one for what the call serves now is returned.
    """
    for mode in (MODES if config is None else (None,)):
        _prepare_one(a_shard, b, heap, gather_dim, bias, config, trace, mode)
    return get_plan(a_shard, b, heap, gather_dim=gather_dim, bias=bias, config=config, trace=trace)


def _prepare_one(a_shard, b, heap, gather_dim, bias, config, trace, mode) -> Plan:
    plan = get_plan(a_shard, b, heap, gather_dim=gather_dim, bias=bias, config=config, trace=trace, mode=mode)
    if heap.simulated or plan.cfg.variant in FALLBACKS:
        return plan
    c = torch.empty(plan.out_shape, dtype=a_shard.dtype, device=a_shard.device)
    s = _shared(heap)
    wait_us = _timeout_us(None)
    args = _args(a_shard, b, heap, plan, bias, c, s, wait_us)
    if plan.cfg.variant == "fused":
        _ag_gemm_kernel.warmup(*args, grid=(plan.grid,), PUBLISH=True, FETCH=True, COMPUTE=True, WAIT_READY=False,
                               **plan.kw)
        return plan
    copies.warmup(heap, plan, s, args, wait_us)   # the copy-engine variants: publish, then each one's own
    return plan


# --------------------------------------------------------------------------
# The launcher
# --------------------------------------------------------------------------
def all_gather_matmul(a_shard: torch.Tensor, b: torch.Tensor, heap, *, gather_dim: int = 1,
                      bias: torch.Tensor | None = None, config: AgGemmConfig | dict | None = None,
                      trace: bool = False, out: torch.Tensor | None = None, timeout_s: float | None = None):
    """C = all_gather(A) @ B (+ bias) on every rank, the gather hidden behind the GEMM.

    gather_dim=1 (iris' convention): each rank holds ``a_shard = A[:, r*K/W:(r+1)*K/W]``
        of shape (M, K/W); ``b`` is (K, N); C is (M, N).
    gather_dim=0 (sequence parallel, Megatron / PyTorch async-TP): each rank holds rows
        ``A[r*M/W:(r+1)*M/W]`` of shape (M/W, K); C is (M, N), rank r's rows first
        computed first.
    ``heap``: a `workbench.dist.SymmetricHeap` (GPU) or `SimHeap` (simulated world).
    ``bias``: optional (N,) added to every row. ``config``: `AgGemmConfig` or a dict
    of its fields (default: ``auto_config``). ``trace=True`` returns ``(C, raw)``
    with per-program events (see ``kernels.ag_gemm.trace.frame``). ``out``: an (M, N)
    tensor of the inputs' dtype, row-major, to receive C (default: a new one).

    Every rank must make the same calls in the same order. Timeouts surface at the
    next call or ``check(heap)`` (module docstring). ``a_shard`` is read on the current
    stream, like any torch op: overwrite or free it afterwards as usual (it is copied into
    the heap, and peers read that copy, which the next call rewrites only once every peer
    has said it is done with it). A shard that already lies in the heap (allocated with
    ``heap.alloc`` by the same calls on every rank, so at the same offset; a producer writes
    it there with ``out=``) is read by the peers in place: no copy, and the fetch starts at
    once. The call then ends on the stream only when every peer has read it.

    ``timeout_s``: how long any wait for a peer may last, in seconds of the GPU's clock
    (default ``$WORKBENCH_WAIT_TIMEOUT_S``, else 60; ``kernels.comm.clock``); the error then
    says how long it waited, which rank and which tile or chunk.
    """
    wait_us = _timeout_us(timeout_s)
    s = _shared(heap)
    s["watch"].poll()   # an earlier call's timeout, if the device has reported one by now
    plan = get_plan(a_shard, b, heap, gather_dim=gather_dim, bias=bias, config=config, trace=trace)
    if out is not None and (tuple(out.shape) != plan.out_shape or out.dtype != a_shard.dtype
                            or out.device != a_shard.device or out.stride(1) != 1):
        raise ValueError(f"all_gather_matmul: out must be a {plan.out_shape} {a_shard.dtype} tensor on "
                         f"{a_shard.device} with unit column stride, got {tuple(out.shape)} {out.dtype}")
    if plan.graph_twin is not None:
        # The first eager call of a problem whose graph replays run another method: run that one
        # once too, now. A user warms up eagerly before capturing; without this the capture would
        # be the graph method's first call (its compile, our all-gather's shared choice, PyTorch's
        # symmetric-memory rendezvous: host work a capture cannot hold). Every rank does it here.
        twin, plan.graph_twin = plan.graph_twin, None
        _run(twin, a_shard, b, heap, bias, None, trace, s, wait_us)
    return _run(plan, a_shard, b, heap, bias, out, trace, s, wait_us)


def _run(plan, a_shard, b, heap, bias, out, trace, s, wait_us):
    """One call of ``plan`` (all_gather_matmul's body once its plan is known)."""
    if plan.cfg.variant in FALLBACKS:
        unfused = _sequential if plan.cfg.variant == "sequential" else _nccl
        c = unfused(a_shard, b, heap, plan, bias, out, wait_us / 1e6)
        return (c, None) if trace else c
    c = out if out is not None else torch.empty(plan.out_shape, dtype=a_shard.dtype, device=a_shard.device)
    if trace:
        plan.trace.zero_()
    args = _args(a_shard, b, heap, plan, bias, c, s, wait_us)
    if plan.cfg.variant == "fused":
        _fused(heap, plan, c, args)
    elif plan.cfg.variant == "chunked":
        copies.run_chunked(a_shard, b, heap, plan, bias, c, s, args)
    else:
        copies.run_flagged(heap, plan, c, s, args)
    _after_call(s, heap, plan)
    return (c, plan.trace) if trace else c


def _args(a, b, heap, plan, bias, c, s, wait_us):
    return (a, plan.pub, plan.stg, b, bias if bias is not None else c, c, heap.heap_bases, s["sig"], plan.flags,
            s["state"], s["status"], plan.trace, plan.S_M, plan.S_K, plan.N, b.stride(0), b.stride(1), c.stride(0),
            heap.rank, wait_us, plan.pub_off16)


def _fused(heap, plan, c, args):
    cs = (c.data_ptr() % 16, c.stride(0))  # C (given or fresh) is the one argument the plan's key leaves open
    if not heap.simulated or heap.world_size == 1:  # one launch (a world of one never waits on a peer)
        launch_planned(heap, plan.launches, ("fused", cs), _ag_gemm_kernel, (plan.grid,), *args, PUBLISH=True,
                       FETCH=True, COMPUTE=True, WAIT_READY=False, **plan.kw)
        return
    # Simulated world: ranks take turns, so no rank may spin on a peer inside a launch
    # while the peer waits for its turn: publish, meet, then fetch + compute.
    heap.barrier()
    launch_planned(heap, plan.launches, ("publish", cs), _ag_gemm_kernel, (plan.kw["PUBLISHERS"],), *args,
                   PUBLISH=True, FETCH=False, COMPUTE=False, WAIT_READY=False, **plan.kw)
    heap.barrier()
    launch_planned(heap, plan.launches, ("fetch", cs), _ag_gemm_kernel, (plan.grid,), *args, PUBLISH=False,
                   FETCH=True, COMPUTE=True, WAIT_READY=False, **plan.kw)
    if plan.resident:  # the GPU's END_WAIT: the peers have read our shard before the call returns
        heap.barrier()


def _gather_ours(a, heap, plan, timeout_s):
    """A, gathered by our all-gather (in the heap: call ``_read_gathered(heap)`` once it has been read)."""
    from kernels.ag_gemm.baselines import gathered_a
    from kernels.comm import all_gather

    gathered = all_gather(a, heap, variant="triton" if heap.simulated else "auto", check=False, timeout_s=timeout_s)
    return gathered_a(gathered, heap.world_size, plan.gather_dim)  # gather_dim 1: rank-major rows -> column blocks


def _sequential(a, b, heap, plan, bias, out, timeout_s):
    """Our all-gather, then our GEMM (and the bias as a separate add)."""
    from kernels.gemm import matmul

    A = _gather_ours(a, heap, plan, timeout_s)
    if heap.simulated:
        with heap.world._lock:  # the interpreter runs one rank's kernels at a time
            c = matmul(A, b, out=out)
    else:
        c = matmul(A, b, out=out)
    if bias is not None:
        c += bias.to(c.dtype)
    _read_gathered(heap, timeout_s)
    return c


def _read_gathered(heap, timeout_s):
    """Peers may refill the gathered A (our heap buffer) only after we read it: a bounded barrier
    that ends the all-gather's call (one bound for both: ``kernels.comm.barrier``)."""
    from kernels.comm.barrier import barrier
    from kernels.comm.launch import within_last_call

    barrier(heap, timeout_s=timeout_s, within=within_last_call(heap))


def _torch_fused(heap, gather_dim):
    """PyTorch's fused op on the heap's process group, called as ``NcclCublas`` is."""
    from kernels.ag_gemm.baselines import TorchFused, torch_fused_available
    import torch.distributed as tdist

    if not torch_fused_available():
        raise ValueError("all_gather_matmul: variant 'torch' needs torch.ops.symm_mem.fused_all_gather_matmul "
                         f"(PyTorch 2.5 or later), missing in torch {torch.__version__}; pick another variant")
    group = getattr(heap, "group", None) or tdist.group.WORLD
    fused = TorchFused(group.group_name, gather_dim)

    def call(a, b, bias=None, out=None):
        c = fused(a, b, bias)
        return out.copy_(c) if out is not None else c
    return call


def _nccl(a, b, heap, plan, bias, out, timeout_s):
    """NCCL's all-gather, then cuBLAS, or PyTorch's fused op (the libraries, for the problems
    where they are fastest)."""
    if not heap.simulated:
        return plan.nccl(a, b, bias, out)
    A = _gather_ours(a, heap, plan, timeout_s)  # no process group in a simulated world: ours stands in for NCCL's
    c = torch.matmul(A, b, out=out) if bias is None else torch.addmm(bias.to(A.dtype), A, b, out=out)
    _read_gathered(heap, timeout_s)
    return c
