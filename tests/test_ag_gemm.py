"""Fused all-gather + GEMM (kernels.ag_gemm): simulated worlds of 2, 3, 4 and 8 ranks
on the CPU (interpreter), the flag protocol in cross-compiled sm_90 PTX, the
trace-off build, and on a multi-GPU node the seed shapes against the reference.

Odd shapes throughout: shards whose rows are not a multiple of BLOCK_M and
whose K/W is not a multiple of BLOCK_K; random inputs; C and the staging
buffer poisoned with NaN before every checked call.
"""
import ast
import itertools
import json
import re
from pathlib import Path

import pytest
import torch
import triton

from kernels.ag_gemm import AgGemmConfig, AgGemmTimeout, all_gather_matmul
from kernels.ag_gemm import config as agc
from kernels.ag_gemm.launch import get_plan
from kernels.ag_gemm.reference import reference, tolerance
from kernels.ag_gemm.trace import frame
from workbench import dist

REPO = Path(__file__).resolve().parents[1]
SIM = AgGemmConfig(block_m=16, block_n=16, block_k=16, group_m=2, num_stages=1, num_warps=1, fetchers=2,
                   k_per_flag=1, num_sms=5, ce_chunks=2)
# (rows, cols) of each rank's shard: gather_dim=1 -> (M, K/W), gather_dim=0 -> (M/W, K)
SHARD = {1: (19, 13), 0: (7, 37)}
N = 21


def _problem(W, gather_dim, seed, dtype=torch.bfloat16, shard=None, n=N):
    g = torch.Generator().manual_seed(seed)
    S_M, S_K = shard or SHARD[gather_dim]
    K = S_K * W if gather_dim == 1 else S_K
    shards = [torch.randn(S_M, S_K, generator=g).to(dtype) for _ in range(W)]
    b = torch.randn(K, n, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    return shards, b, bias


def _run(world, shards, b, gather_dim, bias, cfg, trace=False):
    """Every rank's C (poisoned before the call, and the staging buffer with it)."""
    M = shards[0].shape[0] * (world.world_size if gather_dim == 0 else 1)
    N = b.shape[1]

    def body(h):
        out = torch.full((M, N), float("nan"), dtype=shards[0].dtype)
        kw = dict(gather_dim=gather_dim, bias=bias, config=cfg, trace=trace)
        plan = get_plan(shards[h.rank], b, h, **kw)
        if plan.stg is not None:
            plan.stg.fill_(float("nan"))
        res = all_gather_matmul(shards[h.rank], b, h, out=out, **kw)
        return (res[0].clone(), res[1].clone() if res[1] is not None else None) if trace else res.clone()

    return world.run(body)


def _assert_close(outs, shards, b, gather_dim, bias):
    ref = reference(shards, b, gather_dim, bias)
    atol, rtol = tolerance(shards[0].dtype, b.shape[0])
    for r, c in enumerate(outs):
        assert c.shape == ref.shape, (r, c.shape, ref.shape)
        assert not torch.isnan(c).any(), f"rank {r}: unwritten (NaN) elements in C"
        torch.testing.assert_close(c.double(), ref, atol=atol, rtol=rtol, msg=lambda m: f"rank {r}: {m}")


CASES = [  # (world, gather_dim, layout, bias, variant); "-poll": no "all staged" flag, every k-group polled
    (2, 1, "k", True, "fused"), (2, 0, "m", False, "fused"), (2, 1, "m", False, "fused-poll"),
    (3, 0, "k", False, "copy_engine-poll"),
    (3, 1, "m", False, "fused"), (3, 0, "k", True, "fused"),
    (4, 1, "k", False, "fused"), (4, 0, "m", True, "fused"),
    (8, 1, "k", True, "fused"), (8, 0, "k", False, "copy_engine"),   # the 8-GPU node's world
    (2, 0, "k", True, "copy_engine"), (3, 1, "k", False, "copy_engine"),
    (2, 1, "k", True, "chunked"), (3, 0, "k", False, "chunked"), (4, 1, "k", False, "chunked"),
    (2, 1, "k", True, "sequential"), (3, 0, "k", False, "sequential"),
    (2, 0, "k", True, "nccl"), (3, 1, "k", False, "nccl"),   # the libraries' path (our all-gather stands in)
    (2, 1, "k", True, "torch"),   # PyTorch's fused op (in a simulated world our all-gather and torch.matmul stand in)
    (2, 0, "k", True, "pipelined"), (3, 1, "k", False, "pipelined"), (4, 0, "k", False, "pipelined-poll"),
    (4, 1, "k", True, "pipelined"),
]


@pytest.mark.parametrize("W,gather_dim,layout,bias,variant", CASES,
                         ids=[f"w{c[0]}-dim{c[1]}-{c[2]}-{'bias' if c[3] else 'nobias'}-{c[4]}" for c in CASES])
def test_equals_reference_in_simulated_world(W, gather_dim, layout, bias, variant):
    """GEMM programs claim their tiles from the counter (claim_tiles; in a simulated world of
    several ranks the fetchers do not join them, see test_single_launch_path_in_a_world_of_one)."""
    world = dist.SimulatedWorld(W, heap_bytes=1 << 18)
    variant, poll = variant.partition("-")[::2]
    cfg = SIM.replace(layout=layout, variant=variant, k_per_flag=1 if W % 2 else 2, staged_flag=not poll)
    for call in range(2):  # a second call with fresh inputs: flags count per call (epochs), the counter resets
        shards, b, bs = _problem(W, gather_dim, seed=100 * W + 10 * gather_dim + call)
        bs = bs if bias else None
        _assert_close(_run(world, shards, b, gather_dim, bs, cfg), shards, b, gather_dim, bs)
    if variant not in agc.FALLBACKS:
        kw = get_plan(shards[0], b, world.heaps[0], gather_dim=gather_dim, bias=bs, config=cfg).kw
        assert kw["CLAIM"] and not kw["JOIN"]


@pytest.mark.parametrize("W,gather_dim,layout", [(2, 0, "k"), (3, 1, "m"), (4, 0, "m")])
def test_fetching_k_group_by_k_group_gives_the_same_c(W, gather_dim, layout):
    """fetch_order="k" (the peers' tiles k-group by k-group across the row tiles) changes only
    the order of the copies: C as with the default order, and equal to the reference."""
    world = dist.SimulatedWorld(W, heap_bytes=1 << 18)
    cfg = SIM.replace(layout=layout, k_per_flag=1, fetchers=3)
    shards, b, bias = _problem(W, gather_dim, seed=70 + W, shard=(37, 56))  # 3 row tiles x 4 k-groups
    by_m = _run(world, shards, b, gather_dim, bias, cfg)
    by_k = _run(world, shards, b, gather_dim, bias, cfg.replace(fetch_order="k"))
    _assert_close(by_k, shards, b, gather_dim, bias)
    assert all(torch.equal(x, y) for x, y in zip(by_m, by_k))
    assert get_plan(shards[0], b, world.heaps[0], gather_dim=gather_dim, bias=bias,
                    config=cfg.replace(fetch_order="k")).kw["FETCH_BY_K"]


@pytest.mark.parametrize("W,gather_dim,layout", [(2, 0, "k"), (3, 1, "m")])
def test_waiting_in_growing_spans_gives_the_same_c(W, gather_dim, layout):
    """GEMM programs that poll (no "all staged" flag) wait on spans of 1, g, g^2, ... k-groups:
    with 7 k-groups per tile, spans of 1 (every group), 2 (1, 2, 4) and 3 (1, 3, then a cut
    span of 3) give the same bits, equal to the reference; a span that skipped a group's
    K steps, or ran one twice, fails it."""
    world = dist.SimulatedWorld(W, heap_bytes=1 << 18)
    cfg = SIM.replace(layout=layout, k_per_flag=1, staged_flag=False)
    shards, b, bias = _problem(W, gather_dim, seed=90 + W, shard=(21, 112))  # 2 row tiles x 7 k-groups
    outs = {g: _run(world, shards, b, gather_dim, bias, cfg.replace(wait_growth=g)) for g in (1, 2, 3)}
    _assert_close(outs[2], shards, b, gather_dim, bias)
    assert all(torch.equal(x, y) for g in (2, 3) for x, y in zip(outs[1], outs[g]))
    assert get_plan(shards[0], b, world.heaps[0], gather_dim=gather_dim, bias=bias,
                    config=cfg.replace(wait_growth=3)).kw["WAIT_GROWTH"] == 3


@pytest.mark.parametrize("gather_dim", [0, 1])
@pytest.mark.parametrize("claim", [True, False])
def test_single_launch_path_in_a_world_of_one(gather_dim, claim):
    """The GPU's single launch (publish, fetch and compute in one grid) runs in the interpreter
    when no peer can keep a program waiting: a world of one rank. Claiming tiles from the
    counter, the fetchers join the GEMM (the interpreter runs program 0, a fetcher, first: it
    takes every tile); with the static schedule they compute nothing."""
    world = dist.SimulatedWorld(1, heap_bytes=1 << 18)
    shards, b, bias = _problem(1, gather_dim, seed=31 + gather_dim)
    cfg = SIM.replace(staged_flag=bool(gather_dim), claim_tiles=claim)
    for _ in range(2):  # the second call finds the tile counter reset
        (c, raw), = _run(world, shards, b, gather_dim, bias, cfg, trace=True)
        _assert_close([c], shards, b, gather_dim, bias)
        kw = get_plan(shards[0], b, world.heaps[0], gather_dim=gather_dim, bias=bias, config=cfg, trace=True).kw
        assert kw["CLAIM"] is claim and kw["JOIN"] is claim
        df = frame(raw, fetchers=cfg.fetchers)
        by_role = df[df["kind"] == "compute"].groupby("role").size().to_dict()
        tiles = triton.cdiv(c.shape[0], cfg.block_m) * triton.cdiv(c.shape[1], cfg.block_n)
        assert sum(by_role.values()) == tiles
        assert by_role.get("fetcher", 0) == (tiles if claim else 0), by_role


def test_trace_on_and_off_give_identical_c_and_events():
    W, gd = 2, 1
    world = dist.SimulatedWorld(W, heap_bytes=1 << 18)
    shards, b, bias = _problem(W, gd, seed=5)
    off = _run(world, shards, b, gd, bias, SIM)
    on = _run(world, shards, b, gd, bias, SIM, trace=True)
    for r in range(W):
        assert torch.equal(off[r], on[r][0]), f"rank {r}: tracing changed C"
    df = frame(on[0][1], rank=0, fetchers=SIM.fetchers)
    assert set(df["kind"]) == {"publish", "fetch", "wait", "compute"}
    assert (df["end"] >= df["start"]).all()
    assert set(df[df["kind"].isin(["publish", "fetch"])]["role"]) == {"fetcher"}
    assert set(df[df["kind"] == "compute"]["role"]) == {"gemm"}
    S_M, S_K = SHARD[gd]
    tiles = -(-S_M // SIM.block_m) * -(-N // SIM.block_n)
    assert (df["kind"] == "compute").sum() == tiles


def test_fetcher_that_never_fetches_names_rank_and_tile():
    """Rank 0's fetchers skip rank 1's shard: its GEMM programs give up and say which tile."""
    W, gd = 2, 1
    world = dist.SimulatedWorld(W, heap_bytes=1 << 18)
    shards, b, _ = _problem(W, gd, seed=9)

    def body(h):
        cfg = SIM.replace(skip_rank=1 if h.rank == 0 else -1)
        return all_gather_matmul(shards[h.rank], b, h, gather_dim=gd, config=cfg, timeout_s=0.05)

    with pytest.raises(dist.RankError) as info:
        world.run(body)
    err = info.value.__cause__
    assert isinstance(err, AgGemmTimeout)
    msg = str(err)
    assert msg.startswith("rank 0:") and "rank 1's shard never arrived" in msg and "row tile" in msg
    assert re.search(r"k-group \d+", msg)


@pytest.mark.parametrize("W,gather_dim,variant", [(2, 1, "fused"), (3, 0, "fused"), (2, 0, "copy_engine")])
def test_every_program_or_only_the_fetchers_publish(W, gather_dim, variant):
    """publish_all (every program of the launch copies a part of our shard into the heap) and
    the fetchers alone give the same bits, equal to the reference; the plan says who publishes."""
    world = dist.SimulatedWorld(W, heap_bytes=1 << 18)
    shards, b, bias = _problem(W, gather_dim, seed=60 + W, shard=(37, 56))
    outs = {}
    for everyone in (True, False):
        cfg = SIM.replace(variant=variant, publish_all=everyone)
        outs[everyone] = _run(world, shards, b, gather_dim, bias, cfg)
        kw = get_plan(shards[0], b, world.heaps[0], gather_dim=gather_dim, bias=bias, config=cfg).kw
        items = triton.cdiv(37, SIM.block_m) * triton.cdiv(56, SIM.block_k)  # k_per_flag 1: one piece per flag
        if variant == "fused":
            assert kw["PUBLISHERS"] == (SIM.num_sms if everyone else kw["FETCHERS"])
        else:   # the publish kernel: as many programs as pieces, at most the SMs (or 16)
            assert kw["PUBLISHERS"] == kw["FETCHERS"] == min(SIM.num_sms if everyone else 16, items)
    _assert_close(outs[True], shards, b, gather_dim, bias)
    assert all(torch.equal(x, y) for x, y in zip(outs[True], outs[False]))


@pytest.mark.parametrize("W,gather_dim,variant", [(2, 0, "fused"), (3, 1, "fused"), (2, 1, "copy_engine"),
                                                   (3, 0, "chunked"), (3, 1, "chunked")])
def test_a_shard_in_the_heap_is_read_in_place(W, gather_dim, variant):
    """A shard allocated in the heap (same calls on every rank, so the same offset) is what
    the peers read: no publish buffer is made, and C has the bits of a call whose shard is
    copied into the heap first. Called twice with new contents in the same place."""
    world = dist.SimulatedWorld(W, heap_bytes=1 << 18)
    cfg = SIM.replace(variant=variant)
    resident = [h.alloc(SHARD[gather_dim], torch.bfloat16) for h in world.heaps]
    for call in range(2):
        shards, b, bias = _problem(W, gather_dim, seed=40 + call)
        copied = _run(world, shards, b, gather_dim, bias, cfg)
        for r in range(W):
            resident[r].copy_(shards[r])
        in_place = _run(world, resident, b, gather_dim, bias, cfg)
        _assert_close(in_place, shards, b, gather_dim, bias)
        assert all(torch.equal(x, y) for x, y in zip(copied, in_place))
    plan = get_plan(resident[0], b, world.heaps[0], gather_dim=gather_dim, bias=bias, config=cfg)
    assert plan.resident and plan.pub is resident[0] and plan.kw["RESIDENT"]
    assert not plan.kw["END_WAIT"]  # the simulated world meets at a barrier instead
    copied_plan = get_plan(shards[0], b, world.heaps[0], gather_dim=gather_dim, bias=bias, config=cfg)
    assert not copied_plan.resident
    # chunked along K: the publish kernel writes our columns of the gathered A, but for a shard
    # in the heap (nothing published), whose columns the copies make
    assert copied_plan.kw["PUBLISH_GATHERED"] == (variant == "chunked" and gather_dim == 1)
    assert not plan.kw["PUBLISH_GATHERED"]


def test_heap_shards_at_different_offsets_are_an_error():
    """Peers address a resident shard by our offset: a rank that allocated its shard out of
    step with the others gets an error naming both offsets, not a wrong C."""
    W, gd = 2, 0
    world = dist.SimulatedWorld(W, heap_bytes=1 << 18)
    shards, b, _ = _problem(W, gd, seed=12)
    world.heaps[1].alloc((64,), torch.uint8)  # rank 1 only: its shard lands 64 bytes further on
    resident = [h.alloc(SHARD[gd], torch.bfloat16) for h in world.heaps]
    for r in range(W):
        resident[r].copy_(shards[r])
    with pytest.raises(dist.RankError) as info:
        world.run(lambda h: all_gather_matmul(resident[h.rank], b, h, gather_dim=gd, config=SIM, timeout_s=0.05))
    msg = str(info.value.__cause__)
    assert isinstance(info.value.__cause__, AgGemmTimeout)
    assert re.search(r"rank \d's a_shard lies at heap offset \d+, ours at \d+", msg), msg
    assert "same heap calls on every rank" in msg


def test_peer_that_never_calls_names_the_rank():
    world = dist.SimulatedWorld(3, heap_bytes=1 << 18)
    shards, b, _ = _problem(3, 0, seed=4)
    with pytest.raises(dist.RankError) as info:
        world.run(lambda h: all_gather_matmul(shards[h.rank], b, h, gather_dim=0, config=SIM, timeout_s=0.05),
                  ranks=[0])
    msg = str(info.value.__cause__)
    assert msg.startswith("rank 0: all_gather_matmul:") and re.search(r"rank [12] never published its shard", msg), msg


def test_plan_is_cached_per_signature():
    world = dist.SimulatedWorld(2, heap_bytes=1 << 18)
    h = world.heaps[0]
    shards, b, _ = _problem(2, 1, seed=1)
    p1 = get_plan(shards[0], b, h, gather_dim=1, config=SIM)
    assert get_plan(shards[0].clone(), b, h, gather_dim=1, config=SIM) is p1
    assert get_plan(shards[0], b, h, gather_dim=1, config=SIM.replace(layout="m")) is not p1
    assert get_plan(shards[0], b, h, gather_dim=1, config=None).cfg.block_m == 16  # simulated auto-config


def test_repeated_call_does_no_planning(monkeypatch):
    """The second call with the same signature neither validates nor runs the auto-config."""
    from kernels.ag_gemm import launch

    world = dist.SimulatedWorld(1, heap_bytes=1 << 18)
    h = world.heaps[0]
    shards, b, _ = _problem(1, 0, seed=8)
    all_gather_matmul(shards[0], b, h, gather_dim=0)
    calls = []
    monkeypatch.setattr(launch, "auto_config", lambda *a, **k: calls.append("auto"))
    monkeypatch.setattr(launch, "_validate", lambda *a, **k: calls.append("validate"))
    c = all_gather_matmul(shards[0], b, h, gather_dim=0)
    assert calls == [] and torch.isfinite(c).all()


def test_launch_slot_covers_what_the_plan_key_leaves_open(monkeypatch):
    """The plan's key fixes every argument Triton specializes on except C (given per call, or
    fresh): its alignment and row stride pick the kept launch. An output given, then not, then
    an output 2 bytes off 16-byte alignment, then one with a wider row stride: four launch slots
    of one plan, each C right."""
    from kernels.ag_gemm import launch

    slots = []
    real = launch.launch_planned
    monkeypatch.setattr(launch, "launch_planned", lambda heap, store, slot, *a, **k: (
        slots.append(slot), real(heap, store, slot, *a, **k)))
    world = dist.SimulatedWorld(1, heap_bytes=1 << 18)
    h = world.heaps[0]
    shards, b, bias = _problem(1, 1, seed=12)
    M = shards[0].shape[0]
    flat = torch.full((M * 2 * N + 8,), float("nan"), dtype=shards[0].dtype)
    outs = [torch.full((M, N), float("nan"), dtype=shards[0].dtype), None, flat[1:1 + M * N].view(M, N),
            flat[8:8 + M * 2 * N].view(M, 2 * N)[:, :N]]
    for out in outs:
        c = all_gather_matmul(shards[0], b, h, gather_dim=1, bias=bias, out=out)
        _assert_close([c], shards, b, 1, bias)
    assert len(set(slots)) == 3, slots   # the fresh C has the first output's alignment and stride
    assert slots[0] == slots[1] and len({slots[1], slots[2], slots[3]}) == 3


@pytest.mark.parametrize("kw,match", [
    (dict(gather_dim=2), "gather_dim must be 1"),
    (dict(b=torch.randn(13, N)), r"b must be \(K, N\) with K = W"),
    (dict(a=torch.randn(13, 19).t()), "row-major"),
    (dict(b=torch.randn(26, N, dtype=torch.float64)), "share a dtype"),
    (dict(bias=torch.randn(N + 1)), "bias must be a 1-D tensor"),
    (dict(config=dict(block_m=24)), "power of two"),
    (dict(config=dict(layout="x")), "layout must be"),
    (dict(config=dict(fetch_order="n")), "fetch_order must be"),
    (dict(config=dict(wait_growth=0)), "wait_growth must be"),
    (dict(config=dict(variant="copy_engine", layout="m")), "layout='k'"),
    (dict(config=dict(variant="chunked", layout="m")), "layout='k'"),
    (dict(config=dict(variant="chunked", k_schedule="fp32")), "k_schedule must be 'rows'"),
    (dict(config=dict(variant="chunked", chunk_growth=0)), "chunk_growth must be a positive integer"),
    (dict(config=dict(variant="chunked"), trace=True), "torch.profiler"),
    (dict(config=dict(fetchers=8, num_sms=8)), "fewer than num_sms"),
    (dict(config=dict(colour=1)), "unknown config field"),
])
def test_clear_errors(kw, match):
    world = dist.SimulatedWorld(2, heap_bytes=1 << 16)
    args = dict(a=torch.randn(19, 13), b=torch.randn(26, N), gather_dim=1)
    args.update(kw)
    a, b = args.pop("a"), args.pop("b")
    with pytest.raises(ValueError, match=match):
        all_gather_matmul(a, b, world.heaps[0], **args)


def test_auto_config_is_an_explicit_placeholder_until_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(agc, "_TABLE", {})
    monkeypatch.setattr(agc, "AUTO_TABLE_PATH", tmp_path / "none.json")
    assert "placeholder" in agc.auto_source()
    assert agc.auto_config(64, 64, 64, 2, 1, 132).variant == "sequential"  # tiny: the fallback
    big = agc.auto_config(4096, 3584, 8192, 2, 0, 132)
    assert big.variant == "fused" and 1 <= big.fetchers < 132
    # a measured table replaces the rule; malformed tables are refused with the file's name
    table = tmp_path / "auto_table.json"
    table.write_text(json.dumps({"entries": [{"world_size": 2, "gather_dim": 0, "M": 4096, "N": 3584, "K": 8192,
                                              "config": {"variant": "copy_engine", "block_n": 256}}]}))
    monkeypatch.setattr(agc, "AUTO_TABLE_PATH", table)
    monkeypatch.setattr(agc, "_TABLE", {})
    assert agc.auto_config(4096, 3584, 8192, 2, 0, 132) == AgGemmConfig(variant="copy_engine", block_n=256)
    assert agc.auto_source().startswith("measured") and agc.auto_source(2).startswith("measured")
    assert "placeholder" in agc.auto_source(4)  # no entry of that world size: its rows must not say measured
    # a fallback entry covers problems up to its size; a larger one takes the nearest fused entry
    entry = {"world_size": 4, "gather_dim": 0, "N": 3584, "K": 8192}
    table.write_text(json.dumps({"entries": [dict(entry, M=1024, config={"variant": "nccl"}),
                                             dict(entry, M=4096, config={"variant": "fused", "fetchers": 32})]}))
    monkeypatch.setattr(agc, "_TABLE", {})
    picks = {M: agc.auto_config(M, 3584, 8192, 4, 0, 132) for M in (512, 1024, 1536, 2048, 8192)}
    assert picks[512].variant == picks[1024].variant == "nccl"
    assert picks[1536] == picks[2048] == picks[8192] == AgGemmConfig(variant="fused", fetchers=32)
    table.write_text('{"entries": [{"world_size": 2}]}')
    with pytest.raises(ValueError, match="auto_table.json: entry 0 is malformed"):
        agc.load_table(table)


def test_nccl_baseline_concatenates_column_blocks_for_k_gather():
    """all_gather_into_tensor gives rank-major rows; the K convention needs column blocks."""
    from kernels.ag_gemm.baselines import gathered_a

    shards = [torch.randn(5, 3) for _ in range(3)]
    flat = torch.cat(shards)  # what all_gather_into_tensor writes
    assert torch.equal(gathered_a(flat, 3, 1), torch.cat(shards, dim=1))
    assert torch.equal(gathered_a(flat, 3, 0), torch.cat(shards, dim=0))
    assert not torch.equal(flat.view(5, 9), torch.cat(shards, dim=1))  # the seed's bug, for the record


# --------------------------------------------------------------------------
# Assembly (cross-compiled, no GPU)
# --------------------------------------------------------------------------
def _release_atomics_follow_barriers(ptx: str) -> int:
    """For each release atomic: a bar.sync lies between it and the last global store before it."""
    lines = ptx.splitlines()
    checked = 0
    for i, line in enumerate(lines):
        if re.search(r"\batom\.global\.(gpu|sys)\.release\.", line):
            for prev in reversed(lines[:i]):
                if "bar.sync" in prev:
                    break
                assert not re.search(r"\bst\.global\b", prev), f"store reaches a release flag without a barrier: " \
                                                               f"{prev.strip()} ... {line.strip()}"
            checked += 1
    return checked


@pytest.fixture(scope="module")
def sm90_default(tmp_path_factory):
    """The default configuration cross-compiled for sm_90 once for the assembly tests."""
    from kernels.ag_gemm.asm import compile_kernel

    return compile_kernel("sm90", cache_dir=tmp_path_factory.mktemp("ag_gemm_sm90"))


def test_flag_protocol_order_in_sm90_ptx(sm90_default):
    ptx = sm90_default.text("ptx")
    assert _release_atomics_follow_barriers(ptx) >= 3  # staging flags (publish, fetch), ready, done
    assert re.search(r"atom\.global\.gpu\.release\.exch", ptx), "staging flags: gpu-scope release"
    assert re.search(r"atom\.global\.sys\.release\.add", ptx), "peer flags: system-scope release"
    # the spins: acquire reads (Triton lowers an acquire atomic_add of 0 to ld.acquire)
    assert re.search(r"(ld|atom)\.global\.sys\.acquire", ptx) and re.search(r"(ld|atom)\.global\.gpu\.acquire", ptx)
    assert re.search(r"ld\.global\.v4\.b32", ptx), "remote tiles load 16 bytes per thread"


def test_resident_shard_protocol_in_sm90_ptx(tmp_path):
    """A shard read in place: its offset reaches the peer before the ready flag (a barrier,
    then the system-scope release), and the last program's wait for the peers' done flags
    is a system-scope acquire."""
    from kernels.ag_gemm.asm import compile_kernel

    ptx = compile_kernel("sm90", cache_dir=tmp_path, resident=True).text("ptx")
    assert _release_atomics_follow_barriers(ptx) >= 3
    assert re.search(r"atom\.global\.sys\.release\.add", ptx) and re.search(r"(ld|atom)\.global\.sys\.acquire", ptx)


def _strip_trace(src: str) -> str:
    """The kernel module's source without any `if TRACE:` block."""
    tree = ast.parse(src)

    class Strip(ast.NodeTransformer):
        def generic_visit(self, node):
            super().generic_visit(node)
            for field in ("body", "orelse"):
                stmts = getattr(node, field, None)
                if isinstance(stmts, list):
                    kept = [s for s in stmts if not (isinstance(s, ast.If) and isinstance(s.test, ast.Name)
                                                     and s.test.id == "TRACE")]
                    if len(kept) != len(stmts):
                        setattr(node, field, kept or ([ast.Pass()] if field == "body" else []))
            return node

    return ast.unparse(Strip().visit(tree))


def test_trace_off_build_has_no_extra_instructions(tmp_path, monkeypatch, sm90_default):
    """TRACE=False compiles to the same sm_90 SASS as the kernel with its trace code deleted."""
    from kernels.ag_gemm.asm import compile_kernel

    src = (REPO / "kernels" / "ag_gemm" / "triton.py").read_text()
    stripped = _strip_trace(src)
    assert "_now(" not in stripped.split("def _ag_gemm_kernel")[1] and "_record(" not in stripped.split(
        "def _ag_gemm_kernel")[1]
    mod = tmp_path / "mods"
    mod.mkdir()
    (mod / "ag_gemm_notrace.py").write_text(stripped)
    monkeypatch.syspath_prepend(str(mod))
    import importlib

    notrace = importlib.import_module("ag_gemm_notrace")
    off = sm90_default
    bare = compile_kernel("sm90", cache_dir=tmp_path / "c", kernel=notrace._ag_gemm_kernel)
    on = compile_kernel("sm90", cache_dir=tmp_path / "c", trace=True)

    def instructions(e):
        out = []
        for line in e.text("sass").splitlines():
            m = re.match(r"\s*/\*[0-9a-f]{4,}\*/\s*(.*?);", line)
            if m:
                out.append(m.group(1))
        return out

    a, b = instructions(off), instructions(bare)
    assert a and a == b, f"{len(a)} vs {len(b)} instructions"
    from workbench.asm.diff import diff_entries  # what `workbench asm diff OFF BARE --stage sass` prints

    d = diff_entries(off, bare, "sass")
    assert (d.mix["count_a"] == d.mix["count_b"]).all(), d.mix
    assert len(instructions(on)) > len(a)
    # the bounded waits read %globaltimer in both builds; the trace adds its own reads
    assert on.text("ptx").count("%globaltimer") > off.text("ptx").count("%globaltimer") > 0


# --------------------------------------------------------------------------
# GPU (2+ GPUs): the seed shapes against the reference, repeated calls identical
# --------------------------------------------------------------------------
def _seed_shape_checks(quick: bool):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs (sm_90: H100 or H200) on one node")
    res = dist.launch(REPO / "experiments" / "run_ag_gemm.py", 2,
                      ["--worker", "--check-only"] + (["--quick"] if quick else []),
                      timeout_s=240 if quick else 900, stage_timeout_s=120)
    checks = [r for r in res.rows if r.get("kind") == "check"]
    assert checks, "no check rows came back"
    bad = [r for r in checks if not r["ok"]]
    assert not bad, bad
    assert {r["variant"] for r in checks} >= {"fused", "copy_engine", "chunked", "pipelined", "sequential",
                                              "fused_resident"}
    base_names = {r["variant"]: r["variant"].split("+")[0].split("_layout")[0] for r in checks}
    ours = [r for r in checks if base_names[r["variant"]] in ("fused", "copy_engine", "chunked", "pipelined",
                                                              "sequential", "auto", "fused_resident")]
    assert ours and all(r["repeat_identical"] for r in ours), ours
    # auto serves graph replays with their own pick (its replay's accuracy is in "ok" above)
    assert all(r.get("graph_identical") for r in ours if r["variant"] != "auto"), \
        [r for r in ours if not r.get("graph_identical") and r["variant"] != "auto"]


@pytest.mark.multigpu
def test_seed_shapes_on_two_gpus():
    """The seed's first two shapes (bias and the m-contiguous layout included), every variant of
    ours and the libraries, both conventions: right, and bit-identical when repeated and replayed."""
    _seed_shape_checks(quick=True)


@pytest.mark.multigpu
@pytest.mark.slow
def test_all_seed_shapes_on_two_gpus():
    _seed_shape_checks(quick=False)


def test_even_k_path_in_simulated_world():
    """Shards whose K/W is a multiple of BLOCK_K take the unmasked loads; rows of whole
    16-byte vectors the re-hinted ones (an edge tile of B's columns and of A's rows stays)."""
    W, gd = 2, 1
    g = torch.Generator().manual_seed(21)
    shards = [torch.randn(24, 32, generator=g).to(torch.float16) for _ in range(W)]
    b = torch.randn(64, 40, generator=g).to(torch.float16)
    world = dist.SimulatedWorld(W, heap_bytes=1 << 18)
    cfg = SIM.replace(layout="m")
    outs = world.run(lambda h: all_gather_matmul(shards[h.rank], b, h, gather_dim=gd, config=cfg).clone())
    kw = get_plan(shards[0], b, world.heaps[0], gather_dim=gd, config=cfg).kw
    assert kw["EVEN_K"] and kw["ALIGNED_M"] and kw["ALIGNED_N"]
    _assert_close(outs, shards, b, gd, None)


TMA_CASES = [  # (world, gather_dim, layout, shard (S_M, S_K), TMA expected)
    (2, 1, "k", (24, 32), True),    # row tiles cross into the next staged block (masked rows)
    (3, 1, "m", (40, 48), True),
    (2, 0, "k", (24, 40), True),    # K edge inside a tile: A's columns and B's rows read as zeros
    (3, 0, "m", (40, 32), True),
    (2, 0, "m", (24, 40), False),   # m-contiguous with a K edge: the next block's rows would be read
    (2, 1, "k", (24, 40), False),   # a K tile would straddle two shards
    (2, 1, "k", (19, 13), False),   # rows of 26 bytes: not TMA-addressable
]


@pytest.mark.parametrize("W,gather_dim,layout,shard,tma", TMA_CASES,
                         ids=[f"w{c[0]}-dim{c[1]}-{c[2]}-{c[3][0]}x{c[3][1]}" for c in TMA_CASES])
def test_tma_loads_in_simulated_world(W, gather_dim, layout, shard, tma):
    """The GEMM programs' TMA loads (descriptors over the staging buffer and B) where the
    launcher allows them, pointer loads where it does not: both equal to the reference, with
    C and the staging buffer poisoned, over two calls (the first polls per k-group, the
    second finds everything staged)."""
    world = dist.SimulatedWorld(W, heap_bytes=1 << 19)
    cfg = SIM.replace(layout=layout, k_per_flag=2)
    for call in range(2):
        shards, b, bias = _problem(W, gather_dim, seed=70 + call, shard=shard, n=40)
        assert get_plan(shards[0], b, world.heaps[0], gather_dim=gather_dim, bias=bias, config=cfg).kw["TMA"] is tma
        _assert_close(_run(world, shards, b, gather_dim, bias, cfg), shards, b, gather_dim, bias)
    assert get_plan(shards[0], b, world.heaps[0], gather_dim=gather_dim, bias=bias,
                    config=cfg.replace(tma=False)).kw["TMA"] is False


def _script():
    import importlib.util

    spec = importlib.util.spec_from_file_location("run_ag_gemm", REPO / "experiments" / "run_ag_gemm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_script_summary_and_auto_table_round_trip(tmp_path):
    """The GPU script's tables from synthetic rows: speedups, the fallback, and a table config.py accepts."""
    import pandas as pd

    s = _script()
    rows = []
    for M, fused_ms in ((1024, 0.5), (4096, 0.3)):  # fused loses at M=1024: the table falls back there
        for v, ms in (("nccl_cublas", 0.4), ("sequential", 0.45), ("fused", fused_ms), ("copy_engine", 0.35 + M / 1e4),
                      ("gemm_alone", 0.25), ("auto", 0.3)):
            cfg = {"variant": v if v in ("fused", "copy_engine", "sequential") else "fused", "fetchers": 8}
            rows.append(dict(kind="bench", rank=0, status="ok", world_size=2, gather_dim=0, M=M, N=3584, K=8192,
                             timing="eager", variant=v, ms=ms, config=json.dumps(cfg), auto_variant="fused",
                             auto_fallback=False, auto_source="placeholder rule (not fitted)"))
    bench = pd.DataFrame(rows)
    summ = s.summarize(bench).set_index("M")
    assert summ.loc[4096, "fused_speedup_vs_nccl_cublas"] == pytest.approx(0.4 / 0.3)
    assert summ.loc[4096, "fused_frac_of_gemm_alone"] == pytest.approx(0.3 / 0.25)
    assert summ.loc[4096, "winner"] == "fused" and summ.loc[1024, "best_fused"] == "copy_engine"
    table = s.fit_auto_table(bench)
    path = tmp_path / "auto_table.json"
    path.write_text(json.dumps(table))
    entries = {e["M"]: e for e in agc.load_table(path)}
    # at M=1024 NCCL + cuBLAS beats every way of ours: the table falls back to the libraries
    assert entries[4096]["config"].variant == "fused" and entries[1024]["config"].variant == "nccl"
    assert [e["fallback"] for e in table["entries"]] == [True, False]
    slow_lib = s.fit_auto_table(bench.assign(ms=bench["ms"].where(bench["variant"] != "nccl_cublas", 9.0)))
    assert [e["config"]["variant"] for e in slow_lib["entries"]] == ["sequential", "fused"]
    # a run at world size 4 adds its entries to the same table; a second run at 2 replaces only 2's
    slow = bench["variant"].isin(["sequential", "nccl_cublas"])
    w4 = s.fit_auto_table(bench.assign(world_size=4, ms=bench["ms"].where(~slow, 9.0)))
    path.write_text(json.dumps(s.merge_auto_table(path, w4)))
    merged = agc.load_table(path)
    assert sorted((e["world_size"], e["M"], e["config"].variant) for e in merged) == [
        (2, 1024, "nccl"), (2, 4096, "fused"), (4, 1024, "copy_engine"), (4, 4096, "fused")]
    path.write_text(json.dumps(s.merge_auto_table(path, table)))
    assert sorted((e["world_size"], e["M"]) for e in agc.load_table(path)) == [(2, 1024), (2, 4096), (4, 1024),
                                                                                (4, 4096)]
    assert s.merge_auto_table(tmp_path / "absent.json", table) == table
    path.write_text('{"entries": 3}')
    with pytest.raises(ValueError, match="auto_table.json: expected"):
        s.merge_auto_table(path, table)


def test_sweep_protocol_on_cpu():
    """kernels.ag_gemm.sweep in a simulated world (what `workbench sweep experiments/ag_gemm.yaml --quick`
    runs on each gloo rank); the spec loads, quick set included."""
    from kernels.ag_gemm import sweep as sw
    from workbench import sweep

    for spec_quick in (False, True):
        assert sweep.load_spec(REPO / "experiments" / "ag_gemm.yaml", quick=spec_quick).module is sw
    shape = {"M": 24, "N": 16, "K": 48, "gather_dim": 1, "world": 3}
    inp = sw.make_inputs(shape, torch.bfloat16, "cpu", seed=3)
    params = dict(block_m=16, block_n=16, block_k=16, num_warps=1, num_stages=1, fetchers=2, num_sms=5, k_per_flag=1)
    sw.run(inp, **params)  # makes the plans, so poison reaches their staging buffers
    sw.poison(inp)
    out = sw.run(inp, **params)
    ref = sw.reference(inp)
    assert out.shape == ref.shape == (3, 24, 16)
    rel = float((out.float() - ref).norm() / ref.norm())
    assert rel < sw.tolerance(torch.bfloat16), rel
    assert sw.flops(shape) == 2 * 24 * 16 * 48 and sw.bytes_moved(shape, torch.bfloat16) > 0
    with pytest.raises(ValueError, match="process group"):
        sw.baselines["nccl_cublas"](inp)


def test_notebook_renders_on_cpu(tmp_path):
    """notebooks/05 under papermill without a GPU: says no GPU results are committed (unless they
    are) and shows the CPU parts: flag-protocol assembly and a simulated-world timeline."""
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "workbench.cli", "report", "--no-progress",
                          str(REPO / "notebooks" / "05_all_gather_gemm.ipynb"), "--out", str(tmp_path),
                          "-p", "isa_layouts", '["k"]'],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    (html,) = tmp_path.glob("05_all_gather_gemm*.html")  # parameters add a suffix to the name
    page = html.read_text()
    assert "atom.global.sys.release" in page and "atom.global.gpu.release" in page and "buffer_wbl2" in page
    if not (REPO / "results" / "ag_gemm" / "bench.csv").exists():
        assert "No GPU results are committed" in page and "Simulated world of 2 ranks" in page


def test_script_started_plainly_launches_the_world_and_fails_with_it(tmp_path, monkeypatch):
    """`python experiments/run_ag_gemm.py --world-sizes 2 ...` (what notebooks/05 runs): the world through
    dist.launch_rows with the quick flag, the budget and the timeout; a world that fails or hangs, or a check
    outside the tolerance, exits 1, the rows written so far in the tables."""
    s = _script()
    calls = []

    def check(ok=True):
        return dict(kind="check", rank=0, world_size=2, variant="fused", M=1024, N=3584, K=8192, gather_dim=0,
                    ok=ok, max_abs_err=0.0, repeat_identical=True, error="")

    def fake_launch_rows(script, W, args, timeout_s):
        calls.append((W, list(args), timeout_s))
        return [check()], ""

    monkeypatch.setattr(dist, "launch_rows", fake_launch_rows)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    argv = ["--world-sizes", "2", "--out", str(tmp_path / "a"), "--quick", "--timeout", "300", "--budget-s", "180"]
    assert s.main(argv) == 0
    (W, args, timeout_s), = calls
    assert W == 2 and timeout_s == 300 and {"--worker", "--quick"} <= set(args)
    assert args[args.index("--budget-s") + 1] == "180.0"
    assert (tmp_path / "a" / "checks.csv").exists()
    monkeypatch.setattr(dist, "launch_rows", lambda *a, **k: ([check()], "dist.launch(...): timed out after 300 s"))
    assert s.main(["--world-sizes", "2", "--out", str(tmp_path / "b")]) == 1
    assert (tmp_path / "b" / "checks.csv").exists()
    monkeypatch.setattr(dist, "launch_rows", lambda *a, **k: ([check(ok=False)], ""))
    assert s.main(["--world-sizes", "2", "--out", str(tmp_path / "c")]) == 1
    # a library's result outside the tolerance (torch's fused op sums bf16 partials when A is gathered
    # along K) is reported, not a failure of ours
    lib = dict(check(ok=False), variant="torch_fused", max_abs_err=3.1, atol=1.4)
    monkeypatch.setattr(dist, "launch_rows", lambda *a, **k: ([check(), lib], ""))
    assert s.main(["--world-sizes", "2", "--out", str(tmp_path / "d")]) == 0



def test_script_held_out_shapes_are_parsed_and_checked(capsys):
    """--shapes scores the auto-config on other problems: 'MxNxK' items, M and K multiples of
    every world size; anything else is refused before a world starts, naming the item."""
    mod = _script()
    assert mod.parse_shapes("2048x3584x8192, 8192X3584x8192") == [(2048, 3584, 8192), (8192, 3584, 8192)]
    for text, world, match in (("2048x35a", "2", "is not MxNxK"), ("2048x3584x8190", "4", "multiples of every"),
                               ("", "2", "no shape given")):
        with pytest.raises(SystemExit):
            mod.main(["--shapes", text or ",", "--world-sizes", world])
        assert match in capsys.readouterr().err


def test_script_fit_leaves_out_resident_shards_and_held_out_runs(tmp_path, capsys):
    """A resident shard is another input contract: however fast, the fit never picks it. A run
    on held-out shapes (--shapes) writes its tables but no auto-config table."""
    import argparse

    import pandas as pd

    s = _script()
    rows = []
    for v, ms in (("nccl_cublas", 0.4), ("sequential", 0.45), ("fused", 0.3), ("fused_resident", 0.1),
                  ("copy_engine_resident", 0.1), ("gemm_alone", 0.25), ("auto", 0.3)):
        rows.append(dict(kind="bench", rank=0, status="ok", world_size=2, gather_dim=1, M=2048, N=3584, K=8192,
                         timing="eager", variant=v, ms=ms, config=json.dumps({"variant": "fused", "fetchers": 16}),
                         auto_variant="fused", auto_fallback=False, auto_source="measured"))
    (entry,) = s.fit_auto_table(pd.DataFrame(rows))["entries"]
    assert entry["ms"] == pytest.approx(0.3)
    out = tmp_path / "heldout"
    s.finish(rows, out, 2, argparse.Namespace(shapes="2048x3584x8192", auto_table=None, budget_s=None))
    assert (out / "summary.csv").is_file() and (out / "bench.csv").is_file()
    assert not (out / "auto_table.json").exists()
    capsys.readouterr()


def test_script_times_a_case_in_rotating_passes(monkeypatch):
    """The bench times a case's methods in passes over all of them with the first method
    rotating (no method always first or last); one that fails is reported and dropped from
    the later passes, the others are still timed; a row's time is the median of its passes."""
    import functools
    import types

    s = _script()
    order, rows = [], []
    ms = {"fused": iter([1.0, 9.0, 2.0, 3.0]), "nccl_cublas": iter([5.0, 4.0, 6.0, 7.0])}

    def fake_time(fn, *, warmup, iters, graph=0):
        name = fn()
        order.append(name)
        if name == "broken" and order.count(name) == 2:  # fails in its second pass
            raise RuntimeError("lost")
        v = next(ms[name]) if name in ms else 1.0
        return {"ms": v, "q25_ms": v, "q75_ms": v, "loop_ms": v, "slowest_rank": 0}

    monkeypatch.setattr(s.dist, "time_collective", fake_time)
    stages = []
    fake = types.SimpleNamespace(args=types.SimpleNamespace(iters=8), heap=None,
                                 ag=types.SimpleNamespace(check=lambda heap: None),
                                 agree_failed=lambda failed: failed, emit=rows.append,
                                 w=types.SimpleNamespace(stage=stages.append))
    fake._time_pass = functools.partial(s.Rank._time_pass, fake)
    names = ["fused", "broken", "nccl_cublas"]
    s.Rank.time_all(fake, {n: (lambda n=n: n) for n in names}, "eager", {"M": 1, "N": 2, "K": 3, "gather_dim": 0},
                    {"fused": {"config": "{}"}})
    assert order == ["fused", "broken", "nccl_cublas",          # pass 1
                     "broken", "nccl_cublas", "fused",          # pass 2: broken fails, is dropped
                     "nccl_cublas", "fused",                    # pass 3
                     "fused", "nccl_cublas"]                    # pass 4
    # each pass of each method was the rank's stage while it ran (a launch timeout names it)
    assert len(stages) == len(order) and stages[0] == "eager 1x2x3 gather_dim=0: pass 1/4 fused"
    assert stages[3] == "eager 1x2x3 gather_dim=0: pass 2/4 broken"
    by = {r["variant"]: r for r in rows}
    assert by["fused"]["ms"] == 2.5 and by["fused"]["passes"] == 4 and by["fused"]["config"] == "{}"
    assert by["nccl_cublas"]["ms"] == 5.5 and by["broken"]["status"] == "error" and "lost" in by["broken"]["error"]


def test_chunked_rounds_c_once_along_k():
    """Gathered along K, the chunked variant computes each row chunk of C over the whole K
    (the chunk's columns from every shard copied into the gathered A first), or with
    k_schedule="sum" sums the shards' products in fp32: either way C is rounded once, as a
    single GEMM rounds: every element within half a bf16 step (plus fp32's error) of the fp64
    product; rounding C after each shard's product, as PyTorch's fused op does, is not (checked
    here too, so the bound can tell them apart). 261 rows in 17 row tiles of 16: as many equal
    chunks of at least 8 tiles as fit (2 of the 4 asked, the last tile short), and growing
    ones (weights 1 and 2)."""
    W, gd = 4, 1
    world = dist.SimulatedWorld(W, heap_bytes=1 << 19)
    shards, b, _ = _problem(W, gd, seed=17, shard=(261, 96), n=48)
    ref = reference(shards, b, gd, None)

    from kernels.ag_gemm.reference import gather

    # fp32's own error on the sum (at most ~K * eps32 of the terms' magnitude), which a C of
    # cancelling terms may show beside the half step of its one rounding
    fp32_err = 96 * W * torch.finfo(torch.float32).eps * (gather(shards, gd).double().abs() @ b.double().abs())

    def steps(c):  # |C - ref|, past fp32's error, in bf16 steps of ref's magnitude
        ulp = torch.finfo(torch.bfloat16).eps * torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30))))
        return (((c.double() - ref).abs() - fp32_err).clamp_min(0) / ulp).max().item()

    rows = {SIM.replace(variant="chunked"): [(0, 128), (128, 261)],   # 17 row tiles: 2 chunks of >= 8
            SIM.replace(variant="chunked", ce_chunks=2, chunk_growth=2): [(0, 96), (96, 261)],
            SIM.replace(variant="chunked", k_schedule="sum"): []}   # per-shard products, summed in fp32
    for cfg, want in rows.items():
        outs = _run(world, shards, b, gd, None, cfg)
        assert get_plan(shards[0], b, world.heaps[0], gather_dim=gd, config=cfg).rows == want
        assert all(steps(c) <= 0.51 for c in outs), (cfg, [steps(c) for c in outs])
    per_shard = torch.zeros(ref.shape, dtype=torch.bfloat16)
    for p, x in enumerate(shards):
        per_shard = (per_shard.float() + x.float() @ b[p * 96:(p + 1) * 96].float()).to(torch.bfloat16)
    assert steps(per_shard) > 0.51


# --------------------------------------------------------------------------
# pipelined: copy-engine chunks, one signal each, tiles in arrival order
# --------------------------------------------------------------------------
PIPE = SIM.replace(variant="pipelined", ce_chunks=2, staged_flag=False)   # every remote tile waits on its chunk
PIPE_SHARD = {0: (37, 33), 1: (37, 40)}   # 3 row tiles of 16 (the last one short): 2 chunks of 2 row tiles


def _arrival(plan, rank, W):
    """(peer, chunk) -> its position in the order the copies are queued."""
    from kernels.ag_gemm.copies import copy_order

    return {pc: i for i, pc in enumerate(copy_order(plan, rank, W))}


@pytest.mark.parametrize("W,gather_dim", [(2, 0), (3, 1), (4, 0)])
def test_pipelined_takes_tiles_in_arrival_order_and_waits_on_their_chunks(W, gather_dim):
    """Traced in a simulated world (the counter clock orders every event of a rank): tiles are
    computed in the order their data arrives (gathered along M: our own rows' tiles first, then
    each peer's chunks in the order the copies are queued; along K: row chunk by row chunk),
    every tile waits on exactly the signal of its chunk in each peer's shard (and on no other),
    and after each call every chunk's signal holds the call count. C equals the reference."""
    from kernels.ag_gemm.copies import chunk_tiles

    world = dist.SimulatedWorld(W, heap_bytes=1 << 19)
    for call in range(2):
        shards, b, bias = _problem(W, gather_dim, seed=500 + W + call, shard=PIPE_SHARD[gather_dim], n=40)
        res = _run(world, shards, b, gather_dim, None, PIPE, trace=True)
        _assert_close([c for c, _ in res], shards, b, gather_dim, None)
        for rank in range(W):
            plan = get_plan(shards[rank], b, world.heaps[rank], gather_dim=gather_dim, config=PIPE, trace=True)
            assert plan.NCH == 2 and chunk_tiles(plan) == 2
            assert plan.flags.tolist() == [call + 1 if p != rank else 0 for p in range(W) for _ in range(2)] + [0]
            order = _arrival(plan, rank, W)
            num_n, MT = triton.cdiv(40, PIPE.block_n), plan.MT
            df = frame(res[rank][1], rank=rank).sort_values("start")
            done = df[df["kind"] == "compute"]
            keys = []
            for item in done["item"]:
                lm = item // num_n
                if gather_dim == 0:
                    block, mt = (lm // MT + rank) % W, lm % MT
                    keys.append(-1 if block == rank else order[(block, mt // 2)])
                else:
                    keys.append(max(order[(p, (lm % MT) // 2)] for p in range(W) if p != rank))
            assert keys == sorted(keys), (rank, keys)
            assert len(done) == (W if gather_dim == 0 else 1) * MT * num_n
            waits = sorted(df[df["kind"] == "wait"]["item"].tolist())
            want = []
            for item in done["item"]:
                lm = item // num_n
                mt = lm % MT
                peers = [(lm // MT + rank) % W] if gather_dim == 0 else range(W)
                want += [p * plan.NCH + mt // 2 for p in peers if p != rank]
            assert waits == sorted(want), (rank, waits, sorted(want))


@pytest.mark.parametrize("W,gather_dim,lost", [(2, 0, (1, 1)), (3, 1, (2, 0)), (4, 0, (3, 1))])
def test_pipelined_chunk_that_never_arrives_names_rank_and_chunk(W, gather_dim, lost):
    """Rank 0's copy of one chunk never runs (and so nothing queued after it on the copy
    stream): its GEMM tiles wait for the chunk's signal until the bound, and the error names
    the rank whose chunk it was, the chunk, its rows, and how long the wait lasted."""
    world = dist.SimulatedWorld(W, heap_bytes=1 << 19)
    shards, b, _ = _problem(W, gather_dim, seed=77 + W, shard=PIPE_SHARD[gather_dim], n=40)
    cfg = PIPE.replace(staged_flag=True)
    plan = get_plan(shards[0], b, world.heaps[0], gather_dim=gather_dim, config=cfg)
    peer, chunk = lost
    sig = plan.flags[peer * plan.NCH + chunk:peer * plan.NCH + chunk + 1]
    cut = next(i for i, (_, _, flags, _) in enumerate(plan.chunks) if flags.data_ptr() == sig.data_ptr())
    del plan.chunks[cut:]   # a copy that never completes holds back every later one of its stream
    with pytest.raises(dist.RankError) as info:
        world.run(lambda h: all_gather_matmul(shards[h.rank], b, h, gather_dim=gather_dim, config=cfg,
                                              timeout_s=0.2))
    err = info.value.__cause__
    assert isinstance(err, AgGemmTimeout), err
    msg = str(err)
    r0 = chunk * 2 * cfg.block_m
    assert msg.startswith("rank 0:") and f"chunk {chunk} of rank {peer}'s shard never arrived: rows {r0}..." in msg
    m = re.search(r"after waiting ([0-9.]+) s", msg)
    assert m and float(m.group(1)) >= 0.2, msg


def test_pipelined_copy_order_and_plan():
    """Along M the copies go peer by peer from rank + 1; along K row chunk by row chunk across
    the peers. One signal per (peer, chunk) and the "all staged" one after the last copy; the
    GEMM launch is compiled for chunk waits and the publish kernel leaves the signals' value."""
    from kernels.ag_gemm.copies import copy_order

    world = dist.SimulatedWorld(3, heap_bytes=1 << 19)
    for gd, want in ((0, [(2, 0), (2, 1), (0, 0), (0, 1)]), (1, [(2, 0), (0, 0), (2, 1), (0, 1)])):
        shards, b, _ = _problem(3, gd, seed=3, shard=PIPE_SHARD[gd], n=40)
        plan = get_plan(shards[1], b, world.heaps[1], gather_dim=gd, config=PIPE.replace(staged_flag=True))
        assert copy_order(plan, 1, 3) == want
        assert len(plan.chunks) == 5 and plan.chunks[-1][0] is None and plan.flags.numel() == 3 * 2 + 1
        assert plan.kw["CHUNK_TILES"] == 2 and plan.kw["SET_NEXT"] and plan.gemm_kw["FETCHERS"] == 0
    with pytest.raises(ValueError, match="layout='k'"):
        all_gather_matmul(shards[0], b, world.heaps[0], gather_dim=1, config=PIPE.replace(layout="m"))


def test_pipelined_gemm_launch_in_sm90_ptx(tmp_path):
    """The pipelined variant's GEMM launch (no fetchers, chunk waits) cross-compiled for sm_90:
    chunk signals are polled with gpu-scope acquires, bounded by the GPU's clock, and its TMA
    loads follow a proxy fence."""
    from kernels.ag_gemm.asm import compile_kernel

    from kernels.ag_gemm.config import PIPELINED, SMEM_LIMIT_SM90, pipelined_smem

    entry = compile_kernel("sm90", cache_dir=tmp_path, config=AgGemmConfig(**PIPELINED), chunk_tiles=4,
                           phases=(False, False, True), fetchers=0)
    gemm = entry.text("ptx")
    assert re.search(r"(ld|atom)\.global\.gpu\.acquire", gemm) and "%globaltimer" in gemm
    assert "fence.proxy.async" in gemm
    # Its two pipelined loops fit sm_90's shared memory with the default tile (the 128x256 tile of
    # the other variants asked for 294,968 bytes and failed to launch on an H200), and the count
    # the validation uses is what the compiler allocates, to within its barriers.
    res = entry.resources()
    assert not res["problems"] and res["shared_bytes"] <= SMEM_LIMIT_SM90
    assert 0 <= res["shared_bytes"] - pipelined_smem(AgGemmConfig(**PIPELINED)) <= 1024
    with pytest.raises(ValueError, match="block_n=128"):
        agc.validate(AgGemmConfig(variant="pipelined"), 2)


def test_script_llm_set_fits_on_one_half_and_scores_the_other(tmp_path, capsys):
    """--shape-set llm-reduced's tables from synthetic timings in which pipelined wins from M = 4096
    on and fused below: the choice is fitted on the fit half only (auto_table.json, which
    kernels/ag_gemm/config.py loads), every held-out shape gets the nearest fitted shape's
    method, scored against the best library (NCCL + cuBLAS, PyTorch's fused op) with comm hidden."""
    import pandas as pd

    s = _script()
    import overlap

    rows = []
    for sh in overlap.shapes("ag_gemm", 2, "llm-reduced"):
        M = sh["M"]
        t_gemm, t_comm = M * 1e-4, M * 4e-5
        ms = {"fused": t_gemm + (0.2 if M < 4096 else 0.9) * t_comm,
              "pipelined": t_gemm + (0.5 if M < 4096 else 0.1) * t_comm, "copy_engine": 2 * t_gemm,
              "chunked": 2 * t_gemm, "sequential": t_gemm + 1.1 * t_comm, "nccl_cublas": t_gemm + t_comm,
              "torch_fused": t_gemm + 0.6 * t_comm, "gemm_alone": t_gemm, "nccl_all_gather": t_comm, "auto": 9.0}
        for gd in (0, 1):
            for timing in ("eager", "graph"):
                for v, t in ms.items():
                    cfg = {"variant": v} if v in ("fused", "copy_engine", "chunked", "sequential") else None
                    if v == "pipelined":   # as the script records it: its default tile (agc.PIPELINED)
                        cfg = dict(agc.PIPELINED)
                    rows.append(dict(kind="bench", rank=0, status="ok", world_size=2, gather_dim=gd, M=M, N=sh["N"],
                                     K=sh["K"], timing=timing, variant=v, ms=t, layer=sh["layer"], split=sh["split"],
                                     config=json.dumps(cfg) if cfg else None))
    bench = pd.DataFrame(rows)
    assert s.fit_and_hold_out(bench, tmp_path) == ["auto_table.json", "held_out.csv", "variant_choice.csv",
                                                   "choice_model.json", "choice_scores.csv"]
    scores = pd.read_csv(tmp_path / "choice_scores.csv")   # the choice model beside the nearest entry, held out
    assert set(scores.rule) == {"model", "nearest", "measured"} and set(scores.split) == {"held_out"}
    measured = scores[scores.rule == "measured"]   # the launcher's own pick as timed (9 ms here): scored as it ran
    assert (measured.chosen == "auto").all() and (measured.regret > 5).all()
    assert agc.modelled(3000, 5120, 8192, 2, 0, "eager", model=json.loads((tmp_path / "choice_model.json").read_text()))
    entries = agc.load_table(tmp_path / "auto_table.json")
    fit = bench[(bench.split == "fit") & (bench.variant == "gemm_alone") & (bench.timing == "eager")]
    assert len(entries) == len(fit) and {e["config"].variant for e in entries} == {"fused", "pipelined"}
    held = pd.read_csv(tmp_path / "held_out.csv")
    assert len(held) == len(bench[(bench.split == "held_out") & (bench.variant == "gemm_alone")])   # x 2 timings
    assert (held.chosen == held.M.map(lambda m: "pipelined" if m >= 4096 else "fused")).all()
    assert held.regret.max() == pytest.approx(1.0) and (held.best_library == "torch_fused").all()
    assert held.comm_hidden_chosen.tolist() == pytest.approx([0.8 if m < 4096 else 0.9 for m in held.M])
    choice = pd.read_csv(tmp_path / "variant_choice.csv")
    assert set(choice.split) == {"fit", "held_out"}
    assert "held-out shapes" in capsys.readouterr().out
    summ = s.summarize(bench)
    row = summ[(summ.M == 16384) & (summ.timing == "eager")].iloc[0]
    assert row["pipelined_comm_hidden"] == pytest.approx(0.9) and row["best_fused"] == "pipelined"
    t_gemm, t_comm = 16384 * 1e-4, 16384 * 4e-5
    assert row["best_fused_vs_best_library"] == pytest.approx((t_gemm + 0.6 * t_comm) / (t_gemm + 0.1 * t_comm))


def test_variant_choice_through_the_tuning_tables(isolated_tables, monkeypatch):
    """The fit half's choices as the selection layer's table of this GPU (written by the script's
    fit, as a run writes OUT/tables/): auto_config takes the nearest measured problem of the
    world size and gather dim from it, the libraries' and PyTorch's variants included; an entry
    that cannot run is ignored with a warning; another GPU's table is not read."""
    import warnings

    import pandas as pd

    from kernels.comm import choices
    from kernels.common import tables

    h200 = {"name": "NVIDIA H200", "capability": "9.0"}
    monkeypatch.setattr(choices, "current_device", lambda: h200)
    monkeypatch.setattr(agc, "AUTO_TABLE_PATH", isolated_tables / "none.json")
    monkeypatch.setattr(agc, "_TABLE", {})
    assert "placeholder" in agc.auto_source(2)
    s = _script()
    rows = []
    for M, winner in ((256, "nccl_cublas"), (4096, "torch_fused"), (16384, "pipelined")):
        for v, timing in itertools.product(("fused", "pipelined", "sequential", "nccl_cublas", "torch_fused",
                                             "gemm_alone"), ("eager", "graph")):
            cfg = {"pipelined": {"variant": "pipelined", "block_n": 128}, "fused": {"variant": "fused"},
                   "sequential": {"variant": "sequential"}}.get(v)
            rows.append(dict(kind="bench", rank=0, status="ok", world_size=2, gather_dim=0, M=M, N=5120, K=8192,
                             split="fit", timing=timing, variant=v, ms=0.5 if v == winner else 0.9,
                             config=json.dumps(cfg) if cfg else None, dtype="bfloat16", device_name="NVIDIA H200",
                             device_capability="9.0", triton_version="3.6.0", git_sha="abc", torch_version="2.11",
                             timestamp="2026-11-28T07:00:00+00:00"))
    out = isolated_tables / "run"
    out.mkdir()
    written = s.fit_and_hold_out(pd.DataFrame(rows), out)
    assert "tables/nvidia-h200/ag_gemm.json" in written
    doc = json.loads((out / "tables" / "nvidia-h200" / "ag_gemm.json").read_text())
    entry = doc["entries"]["world_size=2,gather_dim=0,M=4096,N=5120,K=8192,dtype=bf16"]
    assert entry["variant"] == "torch" and entry["us"] == 500.0 and entry["git"] == "abc"
    # the run's table, installed as a user's (or shipped) table of this GPU, serves auto_config
    tables.write_entries(tables.table_path(tables.user_root(), h200, "ag_gemm"), doc,
                         {k: v for k, v in doc["entries"].items()})
    assert agc.auto_source(2) == "tuning table (NVIDIA H200)" and "placeholder" in agc.auto_source(4)
    pick = {M: agc.auto_config(M, 5120, 8192, 2, 0, 132, dtype=torch.bfloat16).variant for M in (200, 3000, 20000)}
    assert pick == {200: "nccl", 3000: "torch", 20000: "pipelined"}
    assert agc.auto_config(3000, 5120, 8192, 2, 1, 132).variant == "fused"   # no gather_dim 1 entry: the rule
    assert agc.auto_config(3000, 5120, 8192, 2, 0, 132, dtype=torch.float16).variant != "torch"  # other dtype
    # a hand-edited entry naming a variant that does not exist is ignored, said once
    bad = dict(entry, config={"variant": "warp-drive"})
    tables.write_entries(tables.table_path(tables.user_root(), h200, "ag_gemm"), doc,
                         {"world_size=2,gather_dim=0,M=4096,N=5120,K=8192,dtype=bf16": bad})
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert agc.auto_config(3000, 5120, 8192, 2, 0, 132).variant in ("nccl", "pipelined")
    assert any("cannot run" in str(x.message) for x in w)
    # an H100 reads its own tables only
    monkeypatch.setattr(choices, "current_device", lambda: {"name": "NVIDIA H100 80GB HBM3", "capability": "9.0"})
    assert "placeholder" in agc.auto_source(2)


def test_polling_gemm_leaves_sms_for_the_copies(monkeypatch):
    """copy_engine / pipelined: the GEMM that polls the copies' signals runs on every SM but
    CE_SPARE_SMS (a copy the driver runs as a kernel needs one); a simulated world keeps its grid."""
    from types import SimpleNamespace

    from kernels.ag_gemm import copies

    grids = []
    monkeypatch.setattr(copies, "launch_planned", lambda heap, store, slot, kernel, grid, *a, **kw: grids.append(grid))
    plan = SimpleNamespace(grid=132, launches={}, gemm_kw={})
    copies._gemm(SimpleNamespace(simulated=False), plan, (), (0, 64))
    copies._gemm(SimpleNamespace(simulated=True), plan, (), (0, 64))
    assert copies.CE_SPARE_SMS >= 1 and grids == [(132 - copies.CE_SPARE_SMS,), (132,)]


@pytest.mark.multigpu
@pytest.mark.parametrize("world_size", [2, 4])
def test_copy_engine_calls_never_starve_their_copies(world_size):
    """copy_engine / pipelined gathered along K, a shard's K not a multiple of BLOCK_K (3424) and one
    that is (3456): 10 back-to-back eager calls and graph replays end within a 4 s bound, right
    (experiments/probes/probe_ce_partial_k.py; before the GEMM left SMs free, most timed out; the
    hang was found at 4 ranks)."""
    import os
    import subprocess
    import sys

    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, found {torch.cuda.device_count()}")
    env = dict(os.environ, **dist.MULTICAST_OFF)
    probe = REPO / "experiments" / "probes" / "probe_ce_partial_k.py"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world_size), str(probe), "3424",
           "3456"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=REPO)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(f"W={world_size} ")]
    assert proc.returncode == 0 and len(lines) == 10, proc.stdout[-4000:] + proc.stderr[-4000:]


def test_script_check_reports_a_timed_out_call_before_making_another():
    """run_ag_gemm.py's check of one of ours: a first call whose wait gave up is reported at once
    (one wait's bound), not after every call the check makes (a bound per wait, times the calls,
    let one hung variant stop a 4-rank run for minutes)."""
    from types import SimpleNamespace

    s = _script()
    calls = []

    def fn():
        calls.append(1)
        return torch.zeros(4, 4)

    def gave_up(heap):
        raise AgGemmTimeout("rank 0: all_gather_matmul: call tag 7 gave up after waiting 60.000 s")

    rank = s.Rank.__new__(s.Rank)
    rank.torch, rank.dtype, rank.accurate, rows = torch, torch.bfloat16, {}, []
    rank.heap = SimpleNamespace(device=torch.device("cpu"))
    rank.ag = SimpleNamespace(check=gave_up, recover=lambda heap: None)
    rank.agree = lambda flag: flag
    rank.emit = rows.append
    assert rank.check("copy_engine", fn, torch.zeros(4, 4), 64, {"M": 4}) is False
    assert len(calls) == 1 and rows[0]["error"].startswith("AgGemmTimeout") and rows[0]["ok"] is False
