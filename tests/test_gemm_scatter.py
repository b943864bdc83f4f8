"""Fused GEMM + all-scatter: the kernel in a simulated world (CPU, interpreter),
its launch plan, tile rule and baselines' layout, the cross-compiled stores
(sm_90, gfx942), and on a multi-GPU node the whole check against cuBLAS + NCCL.

The simulated world runs every rank in this process on host heaps; the
interpreter dereferences the peer addresses, so the pointer translation,
the column offsets and the flag protocol run for real at tiny shapes.
"""
import json
import re
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import gemm_scatter as gs
from kernels.comm.waits import WaitTimeout
from kernels.gemm_scatter import config as gscfg, launch as gslaunch, metrics as gsmetrics
from workbench import dist

REPO = Path(__file__).resolve().parents[1]
SMALL = gs.ScatterConfig(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)
TOL = {torch.float16: (2e-2, 2e-2), torch.bfloat16: (8e-2, 5e-2), torch.float32: (1e-4, 1e-4)}


def _operands(W, M, K, n, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(M, K, generator=gen).to(dtype)
    bs = [torch.randn(K, n, generator=gen).to(dtype) for _ in range(W)]
    return a, bs


def _scatter(world, a, bs, **kw):
    """Every rank's C (copied), each written into a heap buffer poisoned with NaN bytes."""
    M, N = a.shape[0], world.world_size * bs[0].shape[1]
    outs = world.alloc((M, N), a.dtype)
    for o in outs:
        o.view(torch.uint8).fill_(0xFF)  # NaN in every float format
    return world.run(lambda h: gs.gemm_all_scatter(a, bs[h.rank], h, out=outs[h.rank], **kw).clone())


def _assert_full_product(outs, a, bs):
    ref = gs.reference(a, bs)
    atol, rtol = TOL[a.dtype]
    for r, c in enumerate(outs):
        assert c.shape == ref.shape, (r, c.shape)
        assert not torch.isnan(c).any(), f"rank {r}: {int(torch.isnan(c).sum())} elements never written"
        torch.testing.assert_close(c.float(), ref, atol=atol, rtol=rtol, msg=lambda m: f"rank {r}: {m}")


# M=1; M not a multiple of BLOCK_M; N / W not a multiple of BLOCK_N (24 and 20 against 16),
# with (24: 48-byte rows, hint in force) and without (20 fp16: 40-byte rows) 16-byte alignment.
SHAPES = [(1, 24, 24, torch.float16), (21, 40, 20, torch.float16), (19, 32, 24, torch.bfloat16),
          (7, 24, 16, torch.float32)]


@pytest.mark.parametrize("world_size", [2, 3, 4, 8])
@pytest.mark.parametrize("M,K,n,dtype", SHAPES, ids=lambda v: str(v).replace("torch.", ""))
def test_every_rank_holds_the_full_product(world_size, M, K, n, dtype):
    a, bs = _operands(world_size, M, K, n, dtype, seed=world_size * 100 + M)
    world = dist.SimulatedWorld(world_size, heap_bytes=1 << 16)
    _assert_full_product(_scatter(world, a, bs, config=SMALL), a, bs)


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("hints", [True, False])
@pytest.mark.parametrize("from_registers", [True, False])
def test_hints_and_epilogue_variants(world_size, hints, from_registers):
    a, bs = _operands(world_size, 13, 32, 24, torch.float16, seed=5)
    world = dist.SimulatedWorld(world_size, heap_bytes=1 << 16)
    cfg = gscfg.ScatterConfig(block_m=16, block_n=16, block_k=16, num_warps=2,
                              num_stages=2, from_registers=from_registers, num_sms=3)
    _assert_full_product(_scatter(world, a, bs, config=cfg, hints=hints), a, bs)
    plan = gslaunch.plan_for(a, bs[0], world.heaps[0], cfg, hints=hints)
    assert plan.hints is hints  # 24 fp16 columns per rank: 48-byte rows, the hint holds


def test_hint_dropped_where_rows_are_not_16_byte_aligned():
    world = dist.SimulatedWorld(2, heap_bytes=1 << 16)
    a, bs = _operands(2, 4, 16, 20, torch.float16, seed=1)
    assert gslaunch.plan_for(a, bs[0], world.heaps[0], SMALL, hints=True).hints is False


def test_repeated_calls_default_buffer_and_flag_totals():
    """Fresh inputs every call, the default heap buffer, two grids in turn: the
    running flag totals carry over between calls with different grids."""
    world = dist.SimulatedWorld(3, heap_bytes=1 << 16)
    for i, sms in enumerate((1, 4, 2)):
        a, bs = _operands(3, 9, 16, 16, torch.float16, seed=20 + i)
        cfg = gscfg.ScatterConfig(block_m=16, block_n=16, block_k=16, num_warps=2, num_stages=2, num_sms=sms)

        def body(h, a=a, bs=bs, cfg=cfg):
            c = gs.gemm_all_scatter(a, bs[h.rank], h, config=cfg).clone()
            h.barrier()  # nobody refills C while a peer still reads it
            return c

        _assert_full_product(world.run(body), a, bs)
    assert len(gslaunch._plans(world.heaps[0])) == 3


def test_rank_that_never_signals_is_named():
    """Only rank 0 runs: its bounded wait gives up without a host sync in the call;
    the next call names the silent rank (before it launches), once: the call after it runs
    (and fails again, rank 1 being still absent, reported by check_gemm_all_scatter, once)."""
    world = dist.SimulatedWorld(2, heap_bytes=1 << 16)
    a, bs = _operands(2, 4, 16, 16, torch.float16, seed=3)
    call = lambda h: gs.gemm_all_scatter(a, bs[h.rank], h, config=SMALL, timeout_s=0.05)  # noqa: E731
    world.run(call, ranks=[0])
    with pytest.raises(dist.RankError) as info:
        world.run(call, ranks=[0])
    err = info.value.__cause__
    assert isinstance(err, WaitTimeout) and "rank 0" in str(err) and "tiles from rank 1" in str(err)
    world.run(call, ranks=[0])
    with pytest.raises(WaitTimeout, match="tiles from rank 1"):
        gs.check_gemm_all_scatter(world.heaps[0])
    gs.check_gemm_all_scatter(world.heaps[0])
    # rank 1 never called, but rank 0 told it that it gave up on those calls (the newest reported)
    with pytest.raises(WaitTimeout, match="rank 0 gave up on the call with tag"):
        gs.check_gemm_all_scatter(world.heaps[1])


def test_check_true_raises_at_once():
    world = dist.SimulatedWorld(3, heap_bytes=1 << 16)
    a, bs = _operands(3, 4, 16, 16, torch.float16, seed=4)
    with pytest.raises(dist.RankError) as info:
        world.run(lambda h: gs.gemm_all_scatter(a, bs[h.rank], h, config=SMALL, timeout_s=0.05, check=True),
                  ranks=[0, 1])
    assert isinstance(info.value.__cause__, WaitTimeout) and "tiles from rank 2" in str(info.value.__cause__)


def test_plan_is_cached_per_signature_and_bounded():
    world = dist.SimulatedWorld(2, heap_bytes=1 << 16)
    h = world.heaps[0]
    a, bs = _operands(2, 8, 16, 16, torch.float16, seed=6)
    p1 = gslaunch.plan_for(a, bs[0], h, SMALL)
    assert gslaunch.plan_for(a.clone(), bs[0].clone(), h, SMALL) is p1  # same signature, other tensors
    assert gslaunch.plan_for(a, bs[0], h, dict(SMALL.as_params())) is not p1  # dict config: its own key
    odd = torch.empty(8 * 16 + 1, dtype=torch.float16)[1:].view(8, 16).copy_(a)  # 2-byte aligned view
    assert gslaunch.plan_for(odd, bs[0], h, SMALL) is not p1
    assert gslaunch.plan_for(a, bs[0], h, SMALL, hints=False) is not p1
    plans = gslaunch._plans(h)
    plans.clear()
    plans.size = 3
    for m in range(1, 8):
        gslaunch.plan_for(a[:m], bs[0], h, SMALL)
    assert len(plans) == 3
    h.reset()
    assert not h.cache("gemm_scatter")  # plans hold heap tensors: a reset drops them


@pytest.mark.parametrize("bad,match", [
    (dict(a=torch.randn(4)), "need a \\(M, K\\)"),
    (dict(b=torch.randn(12, 8)), "inner dimensions differ"),
    (dict(a=torch.randn(0, 16)), "empty operand"),
    (dict(b=torch.randn(16, 8).double()), "share a dtype"),
    (dict(a=torch.randn(4, 16).int(), b=torch.randn(16, 8).int()), "share a dtype"),
    (dict(config=dict(block_q=4)), "unknown config field"),
    (dict(config=dict(block_m=48)), "power of two"),
    (dict(config=dict(num_sms=0)), "num_sms"),
    (dict(config=dict(block_m=256, block_n=256, block_k=128, num_stages=8)), "shared memory"),
    (dict(config=dict(tma_loads=True, block_k=32)), "tma_loads=True needs"),
    (dict(out=torch.empty(4, 8)), "out must be"),
    (dict(scope="cta"), "scope"),
    (dict(config=42), "ScatterConfig or a dict"),
])
def test_clear_errors(bad, match):
    world = dist.SimulatedWorld(2, heap_bytes=1 << 14)
    kw = dict(a=torch.randn(4, 16), b=torch.randn(16, 8))
    kw.update(bad)
    a, b = kw.pop("a"), kw.pop("b")
    with pytest.raises(ValueError, match=match):
        gs.gemm_all_scatter(a, b, world.heaps[0], **kw)


def test_out_must_live_in_the_heap():
    world = dist.SimulatedWorld(2, heap_bytes=1 << 14)
    with pytest.raises(ValueError, match="not in rank 0's heap"):
        gs.gemm_all_scatter(torch.randn(4, 16), torch.randn(16, 8), world.heaps[0], out=torch.empty(4, 16))


# --------------------------------------------------------------------------
# Baselines: the all-gather's rank-major blocks put in their columns
# --------------------------------------------------------------------------
@pytest.mark.parametrize("W,M,n", [(2, 3, 5), (3, 1, 8), (4, 6, 2)])
def test_column_blocks_layout(W, M, n):
    gen = torch.Generator().manual_seed(W * M * n)
    blocks = [torch.randn(M, n, generator=gen) for _ in range(W)]
    gathered = torch.cat(blocks, dim=0)  # what all_gather_into_tensor gives: rank-major rows
    want = torch.cat(blocks, dim=1)  # C: rank r's block in columns r*n:(r+1)*n
    assert torch.equal(gs.column_blocks(gathered, W), want)
    out = torch.full((M, W * n), float("nan"))
    assert gs.column_blocks(gathered, W, out) is out and torch.equal(out, want)
    with pytest.raises(ValueError, match="not world_size"):
        gs.column_blocks(torch.randn(W * M + 1, n), W)


@pytest.mark.parametrize("gemm", ["cublas", "triton"])
def test_gemm_then_our_all_gather_baseline(gemm):
    W = 3
    a, bs = _operands(W, 5, 24, 16, torch.float16, seed=8)
    world = dist.SimulatedWorld(W, heap_bytes=1 << 16)
    outs = world.run(lambda h: gs.gemm_then_all_gather(a.float() if gemm == "cublas" else a,
                                                       bs[h.rank].float() if gemm == "cublas" else bs[h.rank],
                                                       h, gemm=gemm, gather="triton").clone())
    ref = gs.reference(a, bs)
    for c in outs:
        torch.testing.assert_close(c.float(), ref, atol=2e-2, rtol=2e-2)
    with pytest.raises(ValueError, match="needs an initialized torch.distributed"):
        gs.gemm_then_all_gather(a.float(), bs[0].float(), world.heaps[0], gather="nccl")


# --------------------------------------------------------------------------
# The tile rule and the roofline counts
# --------------------------------------------------------------------------
def test_tile_rule_follows_tiles_per_sm():
    K = 14336
    # decode sizes: 128x256 tiles would leave most of 132 SMs idle; smaller ones fill them
    small = gs.pick_tile(1, 2048, K, 132)
    assert gscfg.tiles_of(1, 2048, *small) > gscfg.tiles_of(1, 2048, 128, 256)
    # many rounds of tiles: the biggest tile (the best reuse) wins
    assert gs.pick_tile(16384, 8192, K, 132) == (128, 256)
    for M in (1, 64, 256, 1024, 8192):
        cfg = gs.heuristic(M, 2048, K, torch.bfloat16, 132, tma=False)
        gscfg.validate(cfg)
        assert not cfg.split_kernel
        est = gscfg.tile_estimate(M, 2048, K, (cfg.block_m, cfg.block_n), 132)
        assert est == min(gscfg.tile_estimate(M, 2048, K, t, 132) for t in gscfg.CANDIDATES)
    assert gs.heuristic(64, 2048, K, torch.float32).block_k == 32  # fp32: half the K-step


def test_small_m_takes_the_gemm_familys_split_tiles():
    """M <= SMALL_M with TMA-addressable 16-bit operands: the GEMM family's cost-model choice
    (split K pieces, swapped operands), run by the small-M kernel; above it, or without TMA,
    the persistent kernel's tile rule."""
    from kernels.gemm.cold import heuristic as gemm_heuristic
    from kernels.gemm.config import SMALL_M

    for M, n, K in ((1, 2048, 14336), (16, 4096, 4096), (SMALL_M, 2048, 14336)):
        cfg, g = gs.heuristic(M, n, K, torch.bfloat16, 132), gemm_heuristic(M, n, K, torch.bfloat16, 132)
        gscfg.validate(cfg)
        assert cfg.split_kernel and (cfg.block_m, cfg.block_n, cfg.block_k, cfg.split_k, cfg.swap_ab) == \
            (g.block_m, g.block_n, g.block_k, g.split_k, g.swap_ab)
    assert not gs.heuristic(1, 2048, 14336, torch.float32, 132).split_kernel


def test_long_reductions_above_small_m_take_split_tiles_where_the_rule_scores_them_cheaper():
    """Above SMALL_M (up to MID_M) and from SPLIT_MIN_K on, SPLIT_TILE in K pieces where the
    tile rule's model scores it under the persistent tile; shorter K, fp32, unaligned rows
    (no TMA) and problems whose tiles already fill the SMs keep the persistent kernel."""
    from kernels.gemm.config import SMALL_M

    split = gs.heuristic(2 * SMALL_M, 4096, 14336, torch.bfloat16, 132)
    gscfg.validate(split)
    est, pieces = gscfg.split_estimate(2 * SMALL_M, 4096, 14336, 132)
    bm, bn = gscfg.pick_tile(2 * SMALL_M, 4096, 14336, 132)
    assert est < gscfg.tile_estimate(2 * SMALL_M, 4096, 14336, (bm, bn), 132)
    assert split.split_kernel and not split.swap_ab and split.split_k == pieces > 1
    assert (split.block_m, split.block_n, split.block_k, split.num_warps, split.num_stages) == gscfg.SPLIT_TILE
    for args in ((2 * SMALL_M, 4096, gscfg.SPLIT_MIN_K // 2, torch.bfloat16, 132),
                 (2 * SMALL_M, 4096, 14336, torch.float32, 132),
                 (8192, 8192, 14336, torch.bfloat16, 132)):
        assert not gs.heuristic(*args).split_kernel, args
    assert not gs.heuristic(2 * SMALL_M, 4096, 14336, torch.bfloat16, 132, tma=False).split_kernel


SPLIT_CASES = [  # (world, M, K, n, dtype, split_k, swap_ab): K / BLOCK_K not a multiple of the split,
    (2, 1, 72, 24, torch.float16, 3, True),      # n not a multiple of BLOCK_N, M of BLOCK_M
    (3, 5, 40, 20, torch.bfloat16, 2, False),    # 40-byte rows: no hint
    (2, 19, 24, 24, torch.float32, 1, True),
    (4, 3, 56, 16, torch.bfloat16, 4, True),
]


@pytest.mark.parametrize("W,M,K,n,dtype,split_k,swap_ab", SPLIT_CASES,
                         ids=[f"w{c[0]}-{c[1]}x{c[2]}x{c[3]}-split{c[5]}{'-swap' if c[6] else ''}" for c in SPLIT_CASES])
def test_small_m_kernel_full_product(W, M, K, n, dtype, split_k, swap_ab):
    """The small-M kernel: pieces meet in the workspace, the last one scatters; two calls
    (the tile counters reset, the flag totals grow), C poisoned before each."""
    world = dist.SimulatedWorld(W, heap_bytes=1 << 16)
    cfg = gs.ScatterConfig(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=2, split_k=split_k,
                           swap_ab=swap_ab)
    for call in range(2):
        a, bs = _operands(W, M, K, n, dtype, seed=900 + 10 * W + call)
        _assert_full_product(_scatter(world, a, bs, config=cfg), a, bs)
    plan = gslaunch.plan_for(a, bs[0], world.heaps[0], cfg)
    assert plan.split[0] == ((-(-M // 16)) * (-(-n // 16)), min(split_k, -(-K // 16)))


def test_metrics_and_bottleneck():
    shape = {"M": 1024, "N": 4096, "K": 14336, "world_size": 2}
    assert gs.flops(shape) == 2 * 1024 * 4096 * 14336
    assert gsmetrics.flops_per_gpu(shape) == gs.flops(shape) / 2
    assert gsmetrics.link_bytes_per_gpu(shape) == 1024 * 2048 * 2
    ceil = {"tflops": 680.0, "hbm_gbps": 4276.0, "link_gbps": 396.0}
    b = gs.bounds_us(shape, ceil)
    assert b["mma"] == pytest.approx(gsmetrics.flops_per_gpu(shape) / 680e6)
    assert gs.bottleneck(shape, ceil) == "mma"
    assert gs.bottleneck({"M": 1, "N": 4096, "K": 14336, "world_size": 2}, ceil) == "hbm"  # reading B
    assert gsmetrics.bounds_us({"M": 4, "N": 8, "K": 8}, {"tflops": 1.0, "hbm_gbps": 1.0})["nvlink"] == 0.0


# --------------------------------------------------------------------------
# Assembly (no GPU): the scatter's stores with and without the hint
# --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def isa_entries(tmp_path_factory):
    """{(target, hints): Entry}: both targets in one compilation run per hint setting."""
    cache = tmp_path_factory.mktemp("gemm_scatter_isa")
    out = {}
    for hints in (False, True):
        for target, e in zip(ISA_TARGETS, gslaunch.compile_kernel(hints, target=ISA_TARGETS, cache_dir=cache)):
            out[(target, hints)] = e
    return out


ISA_TARGETS = ["sm90", "gfx942"]


@pytest.mark.parametrize("target,isa,wide,narrow", [("sm90", "sass", "STG.E.128", "STG.E.U16"),
                                                    ("sm90", "ptx", "st.global.v4.b32", "st.global.b16"),
                                                    ("gfx942", "amdgcn", "global_store_dwordx4",
                                                     "global_store_short")])
def test_hints_give_128_bit_scatter_stores(isa_entries, target, isa, wide, narrow):
    from kernels.comm.isa_hints import store_table

    tables = {h: store_table(isa_entries[(target, h)], isa) for h in (False, True)}
    # the 32-bit store is the flag total (one per program), the rest is the scatter of fp16 tiles
    scatter = {h: t[t.width_bits != 32] for h, t in tables.items()}
    assert set(scatter[True].mnemonic) == {wide}, tables[True]
    assert set(scatter[False].mnemonic) == {narrow}, tables[False]
    assert scatter[True].bytes_per_thread.sum() == scatter[False].bytes_per_thread.sum()
    assert scatter[False]["count"].sum() == 8 * scatter[True]["count"].sum()


# --------------------------------------------------------------------------
# GPU: the fused kernel against cuBLAS + NCCL at world size 2
# --------------------------------------------------------------------------
@pytest.mark.multigpu
def test_matches_cublas_nccl_on_two_gpus(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs, found {torch.cuda.device_count()}")
    import pandas as pd

    env = dict(os.environ, **dist.MULTICAST_OFF)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
           str(REPO / "experiments" / "run_gemm_scatter.py"), "--check-only", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    checks = pd.read_csv(tmp_path / "checks_w2.csv")
    assert len(checks) and checks["ok"].astype(bool).all(), checks[~checks["ok"].astype(bool)].to_string()
    assert {"fused", "senders", "sequential", "nccl", "cublas+nccl", "triton+all_gather"} <= set(checks["variant"])
    ours = checks[checks["variant"].isin(["fused", "senders", "sequential", "nccl"])]
    assert ours["repeat_identical"].astype(bool).all() and ours["graph_identical"].astype(bool).all()


# --------------------------------------------------------------------------
# The GPU script's plan and tables (no GPU needed)
# --------------------------------------------------------------------------
def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_gemm_scatter", REPO / "experiments" / "run_gemm_scatter.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("world_size", [1, 2, 4, 8])
def test_spec_has_every_study_and_1000_scatter_points(world_size):
    r = _script()
    plan = r.load_plan(world_size=world_size)
    studies = {p["study"] for p in plan["points"]}
    assert studies == {"m_sweep", "shapes", "weak", "hints", "overlap", "scatter", "tiles", "group", "deep"}
    assert sum(p["study"] == "scatter" for p in plan["points"]) >= 1000
    assert sorted({p["M"] for p in plan["points"] if p["study"] == "m_sweep"}) == [2 ** i for i in range(11)]
    seed = {(p["N"], p["K"]) for p in plan["points"] if p["study"] == "shapes"}
    assert seed == {(4096, 4096), (4096, 14336), (8192, 4096), (8192, 28672)}
    assert {p["N"] for p in plan["points"] if p["study"] == "weak"} == {world_size * 2048, world_size * 4096}
    assert {p["hints"] for p in plan["points"] if p["study"] == "hints"} == {True, False}
    assert {p["config"]["from_registers"] for p in plan["points"] if p["study"] == "overlap"} == {True, False}
    assert set(plan["modes"]) == {"eager", "graph"}
    for p in plan["points"]:
        if p["config"]:
            gscfg.as_config(p["config"])  # every field is a ScatterConfig field


def test_script_summary_ratios():
    import pandas as pd

    r = _script()
    rows = []
    for timing in ("eager", "graph"):
        for v, ms in (("cublas+nccl", 2.0), ("triton+all_gather", 1.6), ("cublas_alone", 0.9), ("triton_alone", 1.0)):
            rows.append(dict(study="baseline", variant=v, ms=ms, status="ok", world_size=2, M=256, N=4096, K=4096,
                             timing=timing))
        rows.append(dict(study="shapes", variant="fused", ms=1.0, status="ok", world_size=2, M=256, N=4096, K=4096,
                         timing=timing, config="a"))
        rows.append(dict(study="scatter", variant="fused", ms=0.95, status="ok", world_size=2, M=256, N=4096,
                         K=4096, timing=timing, config="b"))
    s = r.summarize(pd.DataFrame(rows)).set_index("timing")
    assert s.loc["graph", "speedup_vs_cublas_nccl"] == pytest.approx(2.0)
    assert s.loc["graph", "vs_gemm_alone"] == pytest.approx(1.0 / 0.9)
    assert s.loc["eager", "best_config"] == "b" and s.loc["eager", "best_fused_ms"] == pytest.approx(0.95)


def test_sweep_protocol_on_cpu():
    from kernels.gemm_scatter import sweep as gssweep

    shape = {"M": 5, "N": 48, "K": 32, "world": 3}
    inp = gssweep.make_inputs(shape, torch.float16, "cpu", seed=5)
    gssweep.poison(inp)
    params = dict(block_m=16, block_n=16, block_k=16, num_warps=2, num_stages=2)
    out = gssweep.run(inp, **params)
    ref = gssweep.reference(inp)
    assert out.shape == ref.shape == (3, 5, 48) and not torch.isnan(out).any()
    assert float((out.float() - ref).norm() / ref.norm()) < gssweep.tolerance(torch.float16)
    gssweep.poison(inp)
    assert torch.isnan(inp.heaps[1]._named[next(k for k in inp.heaps[1]._named if k.startswith("gemm_scatter"))]).all()
    base = gssweep.baselines["triton+all_gather"](inp)
    assert float((base.float() - ref).norm() / ref.norm()) < gssweep.tolerance(torch.float16)
    assert gssweep.flops(shape) == 2 * 5 * 48 * 32
    assert gssweep.bytes_moved(shape, torch.float16) == (5 * 32 + 32 * 16 + 5 * 48) * 2
    assert set(gssweep.PARAMS) >= {"block_m", "num_stages", "from_registers", "hints"}
    assert gssweep.label(dict(params, hints=False)).endswith("nohint")


def test_workbench_sweep_spec_loads():
    from workbench import sweep

    pts = sweep.expand(sweep.load_spec(REPO / "experiments" / "gemm_scatter_sweep.yaml", quick=True))
    assert pts and {p.world_size for p in pts} == {2}
    assert {dict(p.params)["hints"] for p in pts if p.baseline is None} == {True, False}


def test_tma_descriptors_reused_for_the_same_memory():
    world = dist.SimulatedWorld(2, heap_bytes=1 << 14)
    a, bs = _operands(2, 8, 16, 16, torch.float16, seed=2)
    p = gslaunch.plan_for(a, bs[0], world.heaps[0], SMALL)
    d1 = p.descriptor("a", a, [16, 16])
    assert p.descriptor("a", a, [16, 16]) is d1
    assert p.descriptor("a", a.clone(), [16, 16]) is not d1  # other memory: a new descriptor


DRY_SPEC = """
dtype: float16
seed: 1
modes: [eager, graph]
baselines: [cublas+nccl, triton+all_gather, cublas_alone, triton_alone]
check_shapes: [[1, 32, 16], [5, 48, 24]]
shape_sets:
  small: {M: [1, 5], NK: [[32, 16]]}
  weak: {M: [3], n_local_K: [[16, 16]]}
studies:
  - {study: m_sweep, shapes: small, configs: [null], baselines: true}
  - {study: weak, shapes: weak, configs: [null], baselines: true}
  - study: hints
    shapes: small
    grid: {hints: [true, false]}
    fixed: {block_m: 16, block_n: 16, block_k: 16, num_warps: 2, num_stages: 2}
  - study: scatter
    shapes: small
    grid: {block_mn: [[16, 16], [16, 32], [16, 48]], num_stages: [2]}
    fixed: {block_k: 16, num_warps: 2}
"""


def _run_in_world_of_one(r, args, tmp_path):
    """The script's Runner on a one-rank gloo group and a simulated heap: (runner, check rows)."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        run = r.Runner(args, heap=dist.SimulatedWorld(1, heap_bytes=1 << 20).heaps[0])
        return run, run.run()
    finally:
        tdist.destroy_process_group()


def test_gpu_script_runs_end_to_end_in_a_simulated_world(tmp_path):
    """Every code path of experiments/run_gemm_scatter.py (checks, baselines, studies, an
    invalid config, a failing baseline, tables) on a one-rank gloo group and a simulated heap."""
    import argparse

    import pandas as pd

    r = _script()
    spec = tmp_path / "spec.yaml"
    spec.write_text(DRY_SPEC)
    args = argparse.Namespace(spec=str(spec), quick=False, studies="", check_only=False, skip_checks=False,
                              budget_s=300, heap_mib=1)
    run, checks = _run_in_world_of_one(r, args, tmp_path)
    c = pd.DataFrame(checks)
    assert c[c.variant != "cublas+nccl"]["ok"].all(), c.to_string()
    assert not c[c.variant == "cublas+nccl"]["ok"].any()  # no NCCL in a simulated world: recorded, not fatal
    times, written = r.write_tables(run.rows, checks, tmp_path / "out", 1, {"git_sha": "x"}, run.skipped)
    assert {"checks_w1.csv", "times_w1.csv", "summary_w1.csv", "info_w1.csv"} <= set(written)
    fused = times[times.variant == "fused"]
    assert set(fused.status) == {"ok", "invalid"} and set(fused.timing) == {"eager", "graph"}
    assert (fused[fused.status == "invalid"].num_stages.isna()).all()  # refused before planning
    assert set(times[times.variant == "cublas+nccl"].status) == {"error"}
    assert set(times[times.variant == "triton+all_gather"].status) == {"ok"}
    assert set(fused[fused.study == "hints"].hints_in_force) == {True, False}
    s = pd.read_csv(tmp_path / "out" / "summary_w1.csv")
    assert len(s) == 6 and (s.fused_ms > 0).all()  # 3 shapes x 2 timing modes
    r.report(times, checks, 1, run.skipped)


def test_script_started_plainly_launches_each_world_and_fails_with_it(tmp_path, monkeypatch):
    """`python experiments/run_gemm_scatter.py --world-sizes 2 ...` (no torchrun; what notebooks/06 runs): one
    world per size through dist.launch_rows, the flags passed on (the budget, the out folder made absolute,
    the command line for the tables' provenance); a failed or hung world exits 1, as does a machine with
    too few GPUs for every size asked."""
    r = _script()
    calls = []

    def fake_launch_rows(script, W, args, timeout_s, echo=False):
        calls.append((W, list(args), timeout_s))
        return [], ("dist.launch(run_gemm_scatter.py): rank 0 exited with code 1" if W == 1 else "")

    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.setattr(dist, "launch_rows", fake_launch_rows)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.chdir(tmp_path)
    assert r.main(["--world-sizes", "2", "--out", "rel", "--quick", "--budget-s", "180", "--timeout", "270"]) == 0
    (W, args, timeout_s), = calls
    assert W == 2 and timeout_s == 270 and {"--worker", "--quick"} <= set(args)
    assert args[args.index("--out") + 1] == str(tmp_path / "rel")
    assert args[args.index("--budget-s") + 1] == "180.0" and "--world-sizes 2" in args[args.index("--command") + 1]
    assert r.main(["--world-sizes", "1,2", "--out", "x"]) == 1  # world 1 failed
    assert r.main(["--world-sizes", "4", "--out", "x"]) == 1  # nothing could run



def test_quick_spec_is_within_the_full_spec():
    r = _script()

    def key(p):
        return p["study"], p["M"], p["N"], p["K"], json.dumps(p["config"], sort_keys=True), p["hints"]

    for W in (1, 2, 4):
        quick = r.load_plan(world_size=W, quick=True)["points"]
        full = {key(p) for p in r.load_plan(world_size=W)["points"]}
        assert quick and {key(p) for p in quick} <= full
        assert {p["study"] for p in quick} == {p["study"] for p in r.load_plan(world_size=W)["points"]}


# --------------------------------------------------------------------------
# Variant "senders": GEMM programs store locally, senders push finished row bands
# --------------------------------------------------------------------------
def _senders(num_sms=5, senders=2, **kw):
    return gs.ScatterConfig(block_m=16, block_n=16, block_k=16, num_warps=2, num_stages=2, num_sms=num_sms,
                            group_m=2, variant="senders", senders=senders, **kw)


SENDER_CASES = [(2, 1, 24, 24, torch.float16), (3, 37, 40, 20, torch.bfloat16), (4, 70, 32, 24, torch.float16),
                (2, 130, 16, 40, torch.float32)]


@pytest.mark.parametrize("W,M,K,n,dtype", SENDER_CASES, ids=lambda v: str(v).replace("torch.", ""))
def test_senders_variant_holds_the_full_product(W, M, K, n, dtype):
    """Odd shapes (M = 1, M not a multiple of the tile or of the band, N / W not a multiple of
    BLOCK_N and 40-byte rows without the hint), C poisoned, two calls: every band is complete
    on every rank, and each band's counter (the GEMM programs' signal to the senders) is back
    at 0 after the call, every tile counted once and sent once."""
    world = dist.SimulatedWorld(W, heap_bytes=1 << 17)
    cfg = _senders()
    for call in range(2):
        a, bs = _operands(W, M, K, n, dtype, seed=700 + 10 * W + call)
        _assert_full_product(_scatter(world, a, bs, config=cfg), a, bs)
        for h in world.heaps:
            p = gslaunch.plan_for(a, bs[h.rank], h, cfg)
            bands = -(-(-(-M // 16)) // 2)
            assert p.bands.tolist() == [0] * bands and p.grid == p.num_gemm + p.meta["SENDERS"]
            assert p.meta["SENDERS"] == min(2, bands)


def test_senders_wait_for_their_band_and_say_which():
    """A band whose tiles are never all counted (its counter set back on purpose): its sender
    gives up after the bound, the error names the rank, the row band and how long it waited,
    and no row of that band reaches the peer, which learns that rank 0 gave up on the call
    (its own waits passed: without that it would return an incomplete C as if right)."""
    world = dist.SimulatedWorld(2, heap_bytes=1 << 17)
    a, bs = _operands(2, 40, 16, 16, torch.float16, seed=9)   # 3 row tiles: bands of 2 and 1
    cfg = _senders()
    outs = world.alloc((40, 32), torch.float16)
    for o in outs:
        o.view(torch.uint8).fill_(0xFF)
    p = gslaunch.plan_for(a, bs[0], world.heaps[0], cfg, out=outs[0])
    p.bands[1] = -5   # rank 0's band 1 will never be complete
    def body(h):
        try:
            gs.gemm_all_scatter(a, bs[h.rank], h, config=cfg, out=outs[h.rank], timeout_s=0.1, check=True)
        except WaitTimeout as exc:
            return str(exc)
        return ""

    errs = world.run(body, ranks=[0, 1])
    assert errs[0].startswith("rank 0") and "row band 1 of our own GEMM" in errs[0] and "after waiting" in errs[0]
    assert errs[1].startswith("rank 1") and "rank 0 gave up on the call" in errs[1], errs[1]
    assert torch.isnan(outs[1][32:, :16]).all() and not torch.isnan(outs[1][:32, :16]).any()


def test_senders_kernel_in_sm90_ptx(tmp_path):
    """Cross-compiled for sm_90: the GEMM programs' local stores and the senders' remote ones
    are 128-bit with the hint; each tile's count is a gpu-scope release after a barrier, the
    senders' waits gpu-scope acquires bounded by %globaltimer, the completion a system-scope
    release."""
    e = gslaunch.compile_kernel(True, target="sm90", cache_dir=tmp_path, senders=4)
    ptx = e.text("ptx")
    assert re.search(r"atom\.global\.gpu\.release\.add", ptx) and re.search(r"(ld|atom)\.global\.gpu\.acquire", ptx)
    assert re.search(r"atom\.global\.sys\.release\.add", ptx) and "%globaltimer" in ptx
    assert "st.global.v4.b32" in ptx and "st.global.b16" not in ptx


def test_unfused_variants_through_the_launcher():
    """"nccl" and "sequential" (our all-gather stands in for NCCL's in a simulated world): the
    column blocks put in place in the launcher's C, poisoned first, over two calls."""
    for variant in ("nccl", "sequential"):
        world = dist.SimulatedWorld(3, heap_bytes=1 << 17)
        cfg = gs.ScatterConfig(block_m=16, block_n=16, block_k=16, num_warps=2, num_stages=2, variant=variant)
        for call in range(2):
            a, bs = _operands(3, 11, 24, 16, torch.float16, seed=40 + call)
            _assert_full_product(_scatter(world, a, bs, config=cfg), a, bs)


def test_variant_choice_is_rank_zeros_on_every_rank(monkeypatch):
    """Ranks whose own decision functions disagree (rank 1's picks "senders", the others "fused";
    as if rank 1 read another table): every rank runs rank 0's choice, decided once for the
    problem (by rank 0 alone), and C is right everywhere."""
    import threading

    calls = []

    def local_choice(M, n_local, K, W, dtype, sms, tma=True, mode="eager"):
        me = threading.current_thread().name
        calls.append(me)
        variant = "senders" if me == "sim-rank1" else "fused"
        return gs.ScatterConfig(block_m=16, block_n=16, block_k=16, num_warps=2, num_stages=2, num_sms=5,
                                variant=variant, senders=2)

    monkeypatch.setattr(gslaunch, "auto_config", local_choice)
    for W in (2, 3, 4):
        calls.clear()
        world = dist.SimulatedWorld(W, heap_bytes=1 << 17)
        a, bs = _operands(W, 21, 16, 24, torch.float16, seed=W)
        for _ in range(2):
            _assert_full_product(_scatter(world, a, bs), a, bs)
        assert calls == ["sim-rank0"] * 2   # once per problem (for eager calls and graph replays), by rank 0
        assert {gslaunch.plan_for(a, bs[h.rank], h).config.variant for h in world.heaps} == {"fused"}


def test_variant_table_round_trip(tmp_path, monkeypatch):
    """The measured table (written by the GPU script) gives the variant of the nearest measured
    problem of that world size, with this problem's tiles; no table: the tile rule, fused."""
    monkeypatch.setattr(gscfg, "_TABLE", {})
    monkeypatch.setattr(gscfg, "AUTO_TABLE_PATH", tmp_path / "none.json")
    assert gs.auto_config(4096, 2048, 4096, 2).variant == "fused"
    assert "no measured table" in gscfg.auto_source(2)
    table = tmp_path / "auto_table.json"
    table.write_text(json.dumps({"entries": [
        {"world_size": 2, "M": 4096, "N": 4096, "K": 4096, "config": {"variant": "senders", "senders": 12}},
        {"world_size": 2, "M": 64, "N": 4096, "K": 4096, "config": {"variant": "nccl"}}]}))
    monkeypatch.setattr(gscfg, "_TABLE", {})
    monkeypatch.setattr(gscfg, "AUTO_TABLE_PATH", table)
    big = gs.auto_config(8192, 2048, 4096, 2)
    assert big.variant == "senders" and big.senders == 12
    assert (big.block_m, big.block_n) == gs.pick_tile(8192, 2048, 4096)
    assert gs.auto_config(48, 2048, 4096, 2).variant == "nccl"
    assert gs.auto_config(8192, 2048, 4096, 4).variant == "fused"   # no entry of world size 4
    table.write_text('{"entries": [{"world_size": 2}]}')
    monkeypatch.setattr(gscfg, "_TABLE", {})
    with pytest.raises(ValueError, match="not a variant table"):
        gs.auto_config(8192, 2048, 4096, 2)


def test_overlap_study_end_to_end_in_a_simulated_world(tmp_path, monkeypatch):
    """--shape-set llm-reduced on a one-rank gloo group and a simulated heap, the LLM layers swapped
    for tiny ones: every variant checked (C poisoned) and timed in rotating passes beside cuBLAS +
    NCCL, cuBLAS alone and the all-gather alone, per shape and mode; the tables (summary with comm
    hidden, the variant choice fitted on the fit half and scored on the held-out half) written, and
    the fitted table is one kernels/gemm_scatter/config.py loads."""
    import argparse

    import pandas as pd

    r = _script()
    import overlap   # experiments/ is on sys.path once the script is loaded

    monkeypatch.setitem(overlap.LAYERS, "tiny.a", (32, 16))
    monkeypatch.setitem(overlap.LAYERS, "tiny.b", (48, 24))
    monkeypatch.setitem(overlap.REDUCED, "gemm_scatter", (("tiny.a", "tiny.b"), (3,)))
    monkeypatch.setattr(r.Runner, "time_point", lambda self, fn, mode, flop, passes=1: dist.time_collective(
        fn, warmup=1, iters=2))   # the interpreter: as few calls as a pass can have
    args = argparse.Namespace(spec=str(r.SPEC), quick=False, studies="", check_only=False, skip_checks=False,
                              budget_s=300, heap_mib=1, shape_set="llm-reduced")
    run, checks = _run_in_world_of_one(r, args, tmp_path)
    c = pd.DataFrame(checks)
    assert c["ok"].all() and set(c["variant"]) == {"fused", "senders", "sequential", "auto", "cublas+nccl"}
    out = tmp_path / "out"
    times, written = r.write_tables(run.rows, checks, out, 1, {"git_sha": "x"}, run.skipped)
    assert {"summary_w1.csv", "held_out_w1.csv", "variant_choice_w1.csv", "auto_table.json"} <= set(written)
    ok = times[times.status == "ok"]
    assert set(ok.variant) == set(r.OVERLAP_OURS + r.OVERLAP_LIBRARY) and set(ok.timing) == {"eager", "graph"}
    assert (ok.passes == r.PASSES).all() and set(ok.split) == {"fit", "held_out"}
    s = pd.read_csv(out / "summary_w1.csv")
    assert len(s) == 4 and "fused_comm_hidden" in s and "senders_vs_max_alone" in s
    held = pd.read_csv(out / "held_out_w1.csv")
    assert len(held) == 2 and set(held.chosen) <= set(r.CHOICES) and (held.regret >= 1 - 1e-9).all()
    entries = gscfg.load_table(out / "auto_table.json")
    assert len(entries) == 1 and {e["config"].variant for e in entries} <= {"fused", "senders", "sequential", "nccl"}
    r.report(times, checks, 1, run.skipped)


def test_llm_shape_set_split_is_a_fixed_checkerboard():
    """Fit and held-out halves: fixed by (layer index + M index) parity, so every layer and every M
    of the set appear in both halves; no held-out problem is a fitted one (two models' layers of one
    shape count once); the reduced set keeps within its FLOP bound and holds M = 1 ... 16384."""
    _script()   # puts experiments/ on the path
    import overlap

    for W in (2, 4):
        full = overlap.shapes("gemm_scatter", W, "llm")
        fit = {(x["M"], x["N"], x["K"]) for x in full if x["split"] == "fit"}
        held = {(x["M"], x["N"], x["K"]) for x in full if x["split"] == "held_out"}
        assert fit and held and not fit & held and len(fit | held) == len(full)
        assert {x["layer"] for x in full if x["split"] == "fit"} == {x["layer"] for x in full if x["split"] == "held_out"}
        assert {x["M"] for x in full if x["split"] == "fit"} == {x["M"] for x in full if x["split"] == "held_out"}
        red = overlap.shapes("gemm_scatter", W, "llm-reduced")
        assert {x["M"] for x in red} >= {1, 16384} and all(
            2 * x["M"] * (x["N"] // W) * x["K"] <= overlap.REDUCED_FLOP for x in red)
        assert {x["split"] for x in red} == {"fit", "held_out"}
    ag = overlap.shapes("ag_gemm", 2, "llm-reduced")
    assert all(x["N"] * 2 in [n for n, _ in overlap.LAYERS.values()] for x in ag)   # each rank's column shard
    assert {x["split"] for x in ag} == {"fit", "held_out"} and len(ag) >= 12
    with pytest.raises(ValueError, match="shape set"):
        overlap.shapes("ag_gemm", 2, "seed")


def test_variant_choice_through_the_tuning_tables(isolated_tables, monkeypatch):
    """A GPU's tuning table (family gemm_scatter) serves the choice before the results table."""
    from kernels.comm import choices
    from kernels.common import tables

    h200 = {"name": "NVIDIA H200", "capability": "9.0"}
    monkeypatch.setattr(choices, "current_device", lambda: h200)
    monkeypatch.setattr(gscfg, "_TABLE", {})
    monkeypatch.setattr(gscfg, "AUTO_TABLE_PATH", isolated_tables / "none.json")
    entries = {choices.key({"world_size": 2, "M": M, "N": 4096, "K": 4096, "dtype": "bf16"}):
               choices.table_entry(name, cfg, 0.1, "eager", "test")
               for M, name, cfg in ((64, "cublas+nccl", {"variant": "nccl"}),
                                    (4096, "senders", {"variant": "senders", "senders": 12}))}
    choices.write(tables.user_root(), h200, "gemm_scatter", entries, "3.6.0")
    assert gscfg.auto_source(2) == "tuning table (NVIDIA H200)"
    assert gs.auto_config(48, 2048, 4096, 2).variant == "nccl"
    big = gs.auto_config(8192, 2048, 4096, 2)
    assert big.variant == "senders" and big.senders == 12
    assert gs.auto_config(8192, 2048, 4096, 4).variant == "fused"   # no entry of world size 4: the tile rule
