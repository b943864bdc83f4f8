"""Routing preparation of the MXFP4 down-projection (kernels.moe_mxfp4.routing): one Triton launch,
planned once per call signature, against two references: the torch ops it replaced
(``torch_routing``) and the host loops of ``reference_routing``; every output field equal.

CPU: the kernel in Triton's interpreter on random routings (int32 and int64 ids, fp32 and bf16
weights, strided views, several row tiles) and adversarial ones (every token to one expert, most
experts empty, M = 1, M = 0, a token sent to one expert several times, ids out of range), several
chunks per program, and the launcher taking the router's (topk_ids, topk_weights) itself. GPU
(`gpu`): the study's sizes (KIMI-K2.5 up to M = 16384, gpt-oss up to M = 8192), no host
synchronization, captured in a CUDA graph with the down-projection.
"""
from __future__ import annotations

import pytest
import torch

from kernels.common import launcher
from kernels.moe_mxfp4 import moe_mxfp4_down, prepare_weights, quantize_mxfp4
from kernels.moe_mxfp4 import routing as mr
from kernels.moe_mxfp4 import triton_routing
from kernels.moe_mxfp4.routing import max_rows, prepare_routing, reference_routing, torch_routing

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"
FIELDS = ("sorted_ids", "sorted_weights", "expert_ids", "num_rows", "counts")


def _same(got, ids, wts, E, BM, *, host_reference: bool = True):
    """Every field of ``got`` equal to torch_routing's and (small cases) reference_routing's."""
    refs = [torch_routing(ids, wts, E, BM)]
    if host_reference:
        refs.append(reference_routing(ids.cpu(), wts.cpu(), E, BM))
    for ref in refs:
        for f in FIELDS:
            a, b = getattr(got, f).cpu(), getattr(ref, f).cpu()
            assert a.dtype == b.dtype and torch.equal(a, b), (f, a, b)
        assert (got.num_pairs, got.top_k, got.num_experts, got.block_m) == \
            (ref.num_pairs, ref.top_k, ref.num_experts, ref.block_m)
    assert got.sorted_ids.shape[0] == max_rows(ids.numel(), E, BM)


def _random(M, E, top_k, seed, device=DEV):
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(M, E, generator=g).topk(top_k, dim=1).indices
    wts = torch.softmax(torch.randn(M, top_k, generator=g), -1)
    return ids.to(device), wts.to(device)


@pytest.mark.parametrize("M,E,top_k,BM,ids_dtype,wts_dtype", [
    (5, 6, 3, 16, torch.int32, torch.float32),
    (33, 6, 3, 32, torch.int64, torch.float32),
    (64, 32, 4, 16, torch.int32, torch.bfloat16),          # gpt-oss-20b's experts and top-4
    (40, 128, 4, 64, torch.int64, torch.float16),          # gpt-oss-120b's
    (12, 385, 9, 16, torch.int32, torch.float32),          # KIMI-K2.5's: 4 experts per program
    (300, 8, 2, 128, torch.int32, torch.float32),
])
def test_random_routings_match_both_references(M, E, top_k, BM, ids_dtype, wts_dtype):
    ids, wts = _random(M, E, top_k, seed=M + E)
    ids, wts = ids.to(ids_dtype), wts.to(wts_dtype)
    _same(prepare_routing(ids, wts, E, BM), ids, wts, E, BM)


@pytest.mark.parametrize("case", ["all_to_one", "empty_experts", "M1", "M0", "duplicates", "strided"])
def test_adversarial_routings_match_both_references(case):
    g = torch.Generator().manual_seed(3)
    E, BM = 16, 16
    if case == "all_to_one":          # 250 tokens x top-2, every pair to expert 5: 32 blocks of it
        ids = torch.full((250, 2), 5, dtype=torch.int32)
    elif case == "empty_experts":     # 2 of 64 experts used, one of them the last
        E = 64
        ids = torch.tensor([0, 63])[torch.randint(0, 2, (40, 1), generator=g)].repeat(1, 2)
        ids[:, 1] = 63 - ids[:, 0]
    elif case == "M1":
        ids = torch.tensor([[7, 2, 11, 3]])
    elif case == "M0":
        ids = torch.zeros(0, 4, dtype=torch.int64)
    elif case == "duplicates":        # a token sent to the same expert twice (or three times)
        ids = torch.randint(0, 4, (30, 3), generator=g)
        ids[0] = 2
        ids[1, :2] = 1
    else:                             # views with strides, as a router's slice of a wider tensor gives
        wide = torch.randint(0, E, (20, 8), generator=g)
        ids = wide[:, 1::2]
    wts = torch.rand(*ids.shape, generator=g) + 0.1
    if case == "strided":
        wts = torch.rand(ids.shape[1], ids.shape[0], generator=g).T
    ids, wts = ids.to(DEV), wts.to(DEV)
    got = prepare_routing(ids, wts, E, BM)
    _same(got, ids, wts, E, BM)
    if case == "all_to_one":
        assert got.counts[5] == 500 and set(got.expert_ids.tolist()) == {5, -1}
    if case == "M0":
        assert int(got.num_rows) == 0 and (got.expert_ids == -1).all() and (got.sorted_ids == 0).all()


def test_many_chunks_per_program(monkeypatch):
    """Each program walks the pairs in chunks (CH): with 16-pair chunks and 2 experts per program
    the running row of an expert carries across 38 chunks (and several blocks per expert)."""
    real = triton_routing.routing_constexprs

    def small(n, E, top_k, BM, *, sms=132):
        grid, cx = real(n, E, top_k, BM, sms=sms)
        G = 2
        return (-(-E // G) + 1,), dict(cx, CH=16, G=G)

    monkeypatch.setattr(triton_routing, "routing_constexprs", small)
    monkeypatch.setattr(mr, "_PLANS", mr.PlanCache())
    ids, wts = _random(200, 7, 3, seed=11)
    _same(prepare_routing(ids, wts, 7, 16), ids, wts, 7, 16)


@pytest.fixture
def chunked(monkeypatch):
    """The three-launch routing at every size, in chunks of 64 pairs (many chunks at test sizes)."""
    real = triton_routing.chunked_constexprs
    monkeypatch.setattr(triton_routing, "chunked_constexprs", lambda n, E: (64, real(n, E)[1], -(-n // 64)))
    monkeypatch.setattr(mr, "CHUNKED_MIN_PAIRS", 1)
    monkeypatch.setattr(mr, "_PLANS", mr.PlanCache())


@pytest.mark.parametrize("M,E,top_k,BM,case", [(37, 6, 3, 16, "random"), (300, 32, 4, 64, "random"),
                                              (120, 385, 9, 16, "random"), (90, 8, 2, 128, "all to one"),
                                              (1, 4, 2, 16, "one token"), (70, 7, 3, 32, "out of range"),
                                              (64, 40, 4, 16, "int64 ids, bf16 weights")])
def test_chunked_routing_gives_the_same_rows(M, E, top_k, BM, case, chunked):
    """Many pairs: counts per chunk, offsets, then each chunk sorted and scattered (three launches)
    give every field the one-launch kernel and the references give: the same stable order."""
    ids, wts = _random(M, E, top_k, seed=M + E)
    if case == "all to one":
        ids[:, 0] = 5
    if case == "out of range":
        ids[0, 0], ids[3, 2] = E + 2, -1
    if case.startswith("int64"):
        ids, wts = ids.to(torch.int64), wts.to(torch.bfloat16)
    calls = []
    real_call = launcher.PlannedLaunch.__call__
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(launcher.PlannedLaunch, "__call__", lambda self, *a: (calls.append(self.fn), real_call(self, *a)))
        got = prepare_routing(ids, wts, E, BM)
    assert calls == [triton_routing._route_chunk_counts_kernel, triton_routing._route_chunk_offsets_kernel,
                     triton_routing._route_chunk_scatter_kernel]
    if case == "out of range":
        assert got.counts.sum() == M * top_k - 2 and int((got.sorted_ids < M * top_k).sum()) == M * top_k - 2
        return
    _same(got, ids, wts, E, BM)


def test_chunked_routing_zeroes_poisoned_output(chunked, monkeypatch):
    """prepare_routing_and_output in three launches: the output zeroed by the scatter's programs, a
    share each, from memory full of NaN bit patterns; the rows as without the output."""
    ids, wts = _random(50, 6, 3, seed=4)
    want = prepare_routing(ids, wts, 6, 16)
    real_empty = torch.empty
    monkeypatch.setattr(mr.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(0x7FC07FC0))
    got, out = mr.prepare_routing_and_output(ids, wts, 6, 16, 40)
    monkeypatch.undo()
    assert out.shape == (50, 40) and (out == 0).all() and not out.isnan().any()
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f


def test_out_of_range_ids_are_left_out_and_check_says_so():
    """Like torch indexing, ids are not checked on the device: a pair whose expert is outside [0, E)
    is in no expert's rows (nothing is written out of bounds); check=True reads them back."""
    ids = torch.tensor([[0, 9], [-1, 2], [3, 1]], dtype=torch.int32, device=DEV)
    wts = torch.rand(3, 2, device=DEV)
    got = prepare_routing(ids, wts, 4, 16)
    assert got.counts.tolist() == [1, 1, 1, 1]
    used = got.sorted_ids[got.sorted_ids < 6].tolist()
    assert sorted(used) == [0, 3, 4, 5] and int(got.num_rows) == 64
    with pytest.raises(ValueError, match=r"lie in \[0, 4\), got \[-1, 9\]"):
        prepare_routing(ids, wts, 4, 16, check=True)


def test_planned_once_one_launch_no_torch_ops(monkeypatch):
    """One plan per call signature (shapes, strides, dtypes, device, E, BM), one kernel launch per
    call and none of the torch path's ops; outputs fresh every call (an earlier Routing keeps its
    values when a later call with the same signature runs)."""
    monkeypatch.setattr(mr, "_PLANS", mr.PlanCache())
    calls = []
    real_call = launcher.PlannedLaunch.__call__

    def counting(self, *args):
        calls.append(self.fn)
        return real_call(self, *args)

    monkeypatch.setattr(launcher.PlannedLaunch, "__call__", counting)
    monkeypatch.setattr(mr, "torch_routing", lambda *a, **k: pytest.fail("the torch path ran"))
    ids, wts = _random(9, 6, 3, seed=1)
    first = prepare_routing(ids, wts, 6, 16)
    kept = first.sorted_ids.clone()
    ids2, wts2 = _random(9, 6, 3, seed=2)
    second = prepare_routing(ids2, wts2, 6, 16)
    assert mr.routing_plan_info()["plans"] == 1 and len(calls) == 2
    assert all(fn is triton_routing._prepare_routing_kernel for fn in calls)
    assert torch.equal(first.sorted_ids, kept) and first.sorted_ids.data_ptr() != second.sorted_ids.data_ptr()
    prepare_routing(ids.to(torch.int32), wts, 6, 16)
    prepare_routing(ids, wts, 6, 32)
    assert mr.routing_plan_info()["plans"] == 3


def test_routing_rejects_bad_input_before_planning():
    ids, wts = _random(4, 6, 3, seed=0)
    with pytest.raises(ValueError, match="block_m must be 16, 32, 64 or 128"):
        prepare_routing(ids, wts, 6, 24)
    with pytest.raises(ValueError, match="shaped like"):
        prepare_routing(ids, wts[:, :2], 6, 16)
    with pytest.raises(ValueError, match="2-D"):
        prepare_routing([[1, 2]], wts, 6, 16)
    with pytest.raises(ValueError, match="int32 or int64"):
        prepare_routing(ids.float(), wts, 6, 16)
    with pytest.raises(ValueError, match="num_experts must be a positive int"):
        prepare_routing(ids, wts, 0, 16)


def _small_layer(seed: int, routing_seed: int):
    """(E, H, top_k, prepared weights, ids, wts, a) of a small layer: 6 experts, H 64, I 128, M 5, top-3."""
    g = torch.Generator().manual_seed(seed)
    E, H, I, M, top_k = 6, 64, 128, 5, 3
    w, ws = quantize_mxfp4(torch.randn(E, H, I, generator=g) * 0.05)
    weights = prepare_weights(w.to(DEV), ws.to(DEV), 2)
    ids, wts = _random(M, E, top_k, seed=routing_seed)
    a = torch.randn(M * top_k, I, generator=g).bfloat16().to(DEV)
    return E, H, top_k, weights, ids, wts, a


def test_the_launcher_prepares_the_routers_output_itself():
    """moe_mxfp4_down(a, weights, (topk_ids, topk_weights)): the routing prepared in the call for the
    row tile block_m_for picks (or the config's), the same output as with prepare_routing."""
    E, _, top_k, weights, ids, wts, a = _small_layer(4, 5)
    want = moe_mxfp4_down(a, weights, prepare_routing(ids, wts, E, 16))
    assert torch.equal(moe_mxfp4_down(a, weights, (ids, wts)), want)
    assert torch.equal(moe_mxfp4_down(a, weights, routing=(ids, wts)), want)
    with pytest.raises(ValueError, match=r"or be the router's \(topk_ids, topk_weights\)"):
        moe_mxfp4_down(a, weights, (ids,))


@pytest.mark.parametrize("M,H", [(5, 64), (1, 72), (0, 64), (33, 8)])
def test_routing_and_output_zeroes_poisoned_memory_in_the_same_launch(monkeypatch, M, H):
    """prepare_routing_and_output: the routing prepare_routing gives, and the output [M, H] bf16 zeroed by
    the routing's own launch, from a buffer handed out full of NaN bit patterns (one launch, no torch op)."""
    monkeypatch.setattr(mr, "_PLANS", mr.PlanCache())
    real_empty = torch.empty

    def poisoned(*args, **kw):
        return real_empty(*args, **kw).fill_(0x7FC07FC0)      # two bf16 NaNs per int32 word

    ids, wts = _random(max(M, 1), 6, 3, seed=M)
    ids, wts = ids[:M], wts[:M]
    want = prepare_routing(ids, wts, 6, 16)
    calls = []
    real_call = launcher.PlannedLaunch.__call__
    monkeypatch.setattr(launcher.PlannedLaunch, "__call__", lambda self, *a: (calls.append(1), real_call(self, *a)))
    monkeypatch.setattr(mr.torch, "empty", poisoned)
    monkeypatch.setattr(mr.torch, "zeros", lambda *a, **k: pytest.fail("a zeroing op ran"))
    got, out = mr.prepare_routing_and_output(ids, wts, 6, 16, H)
    monkeypatch.undo()
    assert len(calls) == 1 and out.shape == (M, H) and out.dtype == torch.bfloat16 and out.is_contiguous()
    assert out.data_ptr() % 16 == 0 and (out == 0).all() and not out.isnan().any()
    for f in FIELDS:
        assert torch.equal(getattr(got, f), getattr(want, f)), f
    with pytest.raises(ValueError, match="out_cols must be a positive int"):
        mr.prepare_routing_and_output(ids, wts, 6, 16, 0)


def test_the_launchers_output_is_zeroed_by_the_routing_launch(monkeypatch):
    """moe_mxfp4_down(a, weights, (ids, wts)) with no out: no zeroing op of its own (the routing's launch
    zeroes the output), the same bits as with a prepared routing; with out given, or accumulating, or the
    deterministic epilogue, the call keeps its own handling."""
    from kernels.moe_mxfp4 import launch as ml
    monkeypatch.setattr(ml, "ROUTE_IN_KERNEL", False)      # the two launches (the one: test_moe_mxfp4_one_launch)
    E, H, top_k, weights, ids, wts, a = _small_layer(7, 8)
    M = ids.shape[0]
    want = moe_mxfp4_down(a, weights, prepare_routing(ids, wts, E, 16))
    det = moe_mxfp4_down(a, weights, prepare_routing(ids, wts, E, 16), deterministic=True)
    from kernels.moe_mxfp4 import plan as mplan
    monkeypatch.setattr(mplan.torch, "zeros", lambda *a, **k: pytest.fail("the call zeroed its output itself"))
    assert torch.equal(moe_mxfp4_down(a, weights, (ids, wts)), want)
    monkeypatch.setattr(mplan.torch, "zeros", torch.zeros)
    out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert torch.equal(moe_mxfp4_down(a, weights, (ids, wts), out=out), want) and torch.equal(out, want)
    acc = want.clone()
    moe_mxfp4_down(a, weights, (ids, wts), out=acc, accumulate=True)
    # added slot by slot in bf16: within a rounding step of the running sum per slot
    assert ((acc.float() - 2 * want.float()).abs() <= (2 * top_k + 1) * 2.0 ** -8 * 2 * want.float().abs().max()).all()
    assert torch.equal(moe_mxfp4_down(a, weights, (ids, wts), deterministic=True), det)


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("M,E,top_k,BM", [(1, 128, 4, 16), (200, 128, 4, 16), (8192, 128, 4, 128), (4, 385, 9, 16),
                                          (256, 385, 9, 16), (16384, 385, 9, 128), (48, 32, 4, 32)])
def test_gpu_routing_matches_torch_without_a_sync(M, E, top_k, BM):
    """The study's sizes: every field equal to the torch ops', and no host synchronization
    (torch's sync debug mode raises on any) once planned."""
    ids, wts = _random(M, E, top_k, seed=M, device="cuda")
    prepare_routing(ids, wts, E, BM)                       # plan and compile
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = prepare_routing(ids, wts, E, BM)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    _same(got, ids, wts, E, BM, host_reference=M * top_k <= 2048)


@pytest.mark.gpu
def test_gpu_routing_and_down_projection_in_one_graph():
    """prepare_routing and moe_mxfp4_down captured together (gpt-oss-20b's shape, prepared
    weights); replayed with new router output copied in, equal to an eager call on it."""
    g = torch.Generator(device="cuda").manual_seed(0)
    E, H, I, M, top_k = 32, 2880, 2880, 16, 4
    w, ws = quantize_mxfp4(torch.randn(E, H, I, device="cuda", generator=g) * 0.02)
    weights = prepare_weights(w, ws, 2)
    ids, wts = _random(M, E, top_k, seed=1, device="cuda")
    a = torch.randn(M * top_k, I, device="cuda", generator=g).bfloat16()
    out = torch.empty(M, H, dtype=torch.bfloat16, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        moe_mxfp4_down(a, weights, (ids, wts), out=out)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        moe_mxfp4_down(a, weights, (ids, wts), out=out)
    new_ids, new_wts = _random(M, E, top_k, seed=2, device="cuda")
    ids.copy_(new_ids)
    wts.copy_(new_wts)
    out.fill_(float("nan"))
    graph.replay()
    want = moe_mxfp4_down(a, weights, prepare_routing(new_ids, new_wts, E, 16), config=None)
    torch.cuda.synchronize()
    assert out.isfinite().all()
    # atomics add a token's rows in any order: within the bound of a rounding step per slot
    assert ((out.float() - want.float()).abs() <= (top_k + 1) * 2.0 ** -8 * want.float().abs().max()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("M,E,H,top_k", [(4, 385, 7168, 9), (16384, 385, 7168, 9), (1, 128, 2880, 4)])
def test_gpu_routing_zeroes_the_output_without_a_sync(M, E, H, top_k):
    """The output zeroed by the routing's launch at the study's sizes, from memory left full of NaNs, with no
    host synchronization once planned."""
    ids, wts = _random(M, E, top_k, seed=M, device="cuda")
    mr.prepare_routing_and_output(ids, wts, E, 16, H)            # plan and compile
    junk = torch.full((mr.max_rows(M * top_k, E, 16) * 3 + M * H,), float("nan"), device="cuda")
    del junk                                                   # its memory back to the allocator, NaN-filled
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got, out = mr.prepare_routing_and_output(ids, wts, E, 16, H)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.shape == (M, H) and bool((out == 0).all())
    _same(got, ids, wts, E, 16, host_reference=M * top_k <= 2048)
