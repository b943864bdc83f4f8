"""The MXFP4 down-projection from the router's ids in one launch (``_moe_mxfp4_down_routed_kernel``):
its first programs make the routing and zero the output, the others wait for them and run the tiles.

CPU (Triton's interpreter, where the first program makes every routing part): the same bits as the
two launches (routing kernel, then the plain kernel) for the plain and prepacked layouts, several row
tiles, a token sent to one expert twice, ids out of range, int64 ids and bf16 weights, repeated calls
(the counters count on across calls); the output zeroed in the launch from poisoned memory; one launch
per call; the cases that keep the two launches; the rule that picks the form; a workspace per stream.
Cross-compiled for sm_90: the kernel takes its ticket with a 64-bit atomic, calls the routing, keeps wgmma. GPU (`gpu`):
the three models' shapes against the two launches and the fp32 reference, no host synchronization,
many calls in a row, and captured in a CUDA graph.
"""
from __future__ import annotations

import pytest
import torch

from kernels.common import launcher
from kernels.moe_mxfp4 import MoeMxfp4Config, moe_mxfp4_down, prepare_weights, quantize_mxfp4
from kernels.moe_mxfp4 import launch as ml
from kernels.moe_mxfp4 import plan as mplan
from kernels.moe_mxfp4 import triton as mtriton
from kernels.moe_mxfp4 import triton_routing
from kernels.moe_mxfp4.routing import prepare_routing

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"


def _layer(seed, E=6, H=64, I=128, level=2):
    g = torch.Generator().manual_seed(seed)
    w, ws = quantize_mxfp4(torch.randn(E, H, I, generator=g) * 0.05)
    return prepare_weights(w.to(DEV), ws.to(DEV), level), g


def _routing(M, E, top_k, g, ids_dtype=torch.int32, wts_dtype=torch.float32):
    ids = torch.rand(M, E, generator=g).topk(top_k, dim=1).indices.to(ids_dtype)
    wts = torch.softmax(torch.randn(M, top_k, generator=g), -1).to(wts_dtype)
    return ids.to(DEV), wts.to(DEV)


def _two_launches(a, weights, ids, wts, E, bm, config=None):
    return moe_mxfp4_down(a, weights, prepare_routing(ids, wts, E, bm), config=config)


def _count_launches(monkeypatch, calls: list) -> None:
    """Every planned launch from here on appends its kernel to calls."""
    real_call = launcher.PlannedLaunch.__call__

    def counting(self, *args):
        calls.append(self.fn)
        return real_call(self, *args)

    monkeypatch.setattr(launcher.PlannedLaunch, "__call__", counting)


@pytest.fixture(autouse=True)
def _fresh_plans():
    ml.clear_plans()
    yield
    ml.clear_plans()


@pytest.mark.parametrize("level,M,case", [(2, 5, "random"), (0, 5, "random"), (2, 1, "random"), (2, 40, "random"),
                                          (2, 7, "duplicates"), (2, 6, "out_of_range"), (3, 9, "int64_bf16")])
def test_one_launch_equals_the_two_launches(level, M, case):
    E, top_k = 6, 3
    weights, g = _layer(level + M, level=level)
    ids, wts = _routing(M, E, top_k, g, *((torch.int64, torch.bfloat16) if case == "int64_bf16" else ()))
    if case == "duplicates":          # a token sent to one expert twice, and one sent three times
        ids[0, 1] = ids[0, 0]
        ids[2] = ids[2, 0]
    if case == "out_of_range":        # in no expert's rows, as the routing kernel leaves them
        ids[1, 0], ids[3, 2] = -1, E + 3
    a = torch.randn(M * top_k, 128, generator=g).bfloat16().to(DEV)
    want = _two_launches(a, weights, ids, wts, E, 16)
    for _ in range(3):                # the counters count on across calls: every call still right
        assert torch.equal(moe_mxfp4_down(a, weights, (ids, wts)), want)
    assert len(ml._ROUTED) == 1 and isinstance(ml._ROUTED.values()[0], mplan.RoutedPlan)


def test_one_launch_with_a_config_of_another_row_tile():
    E, top_k, M = 6, 2, 33
    weights, g = _layer(3)
    ids, wts = _routing(M, E, top_k, g)
    a = torch.randn(M * top_k, 128, generator=g).bfloat16().to(DEV)
    cfg = MoeMxfp4Config(BLOCK_M=32, BLOCK_N=64, BLOCK_K=128, num_warps=4, PREPACK=2, EXPAND="ptx")
    want = _two_launches(a, weights, ids, wts, E, 32, cfg)
    assert torch.equal(moe_mxfp4_down(a, weights, (ids, wts), config=cfg), want)
    assert ml._ROUTED.values()[0].config.BLOCK_M == 32


def test_output_zeroed_in_the_launch_from_poisoned_memory(monkeypatch):
    """The output comes from torch.empty full of NaN bit patterns: the routing programs zero it
    before any tile adds to it (no zeroing op of the call's own)."""
    E, top_k, M = 6, 3, 5
    weights, g = _layer(11)
    ids, wts = _routing(M, E, top_k, g)
    a = torch.randn(M * top_k, 128, generator=g).bfloat16().to(DEV)
    want = _two_launches(a, weights, ids, wts, E, 16)
    moe_mxfp4_down(a, weights, (ids, wts))            # planned (the workspace made)
    real_empty = torch.empty

    def poisoned(*args, **kw):
        return real_empty(*args, **kw).fill_(float("nan"))

    monkeypatch.setattr(mplan.torch, "empty", poisoned)
    monkeypatch.setattr(mplan.torch, "zeros", lambda *a, **k: pytest.fail("a zeroing op ran"))
    got = moe_mxfp4_down(a, weights, (ids, wts))
    monkeypatch.undo()
    assert not got.isnan().any() and torch.equal(got, want)


def test_one_launch_per_call(monkeypatch):
    E, top_k, M = 6, 3, 4
    weights, g = _layer(5)
    ids, wts = _routing(M, E, top_k, g)
    a = torch.randn(M * top_k, 128, generator=g).bfloat16().to(DEV)
    moe_mxfp4_down(a, weights, (ids, wts))
    calls = []
    _count_launches(monkeypatch, calls)
    for _ in range(3):
        moe_mxfp4_down(a, weights, (ids, wts))
    assert calls == [mtriton._moe_mxfp4_down_routed_kernel] * 3


@pytest.mark.parametrize("why", ["strided ids", "out given", "deterministic", "switched off"])
def test_the_two_launches_stay_where_the_one_cannot_serve(monkeypatch, why):
    E, top_k, M = 6, 3, 5
    weights, g = _layer(8)
    ids, wts = _routing(M, E, top_k, g)
    a = torch.randn(M * top_k, 128, generator=g).bfloat16().to(DEV)
    kw = {}
    if why == "strided ids":
        ids = torch.stack([ids, ids], -1)[..., 0]
        assert not ids.is_contiguous()
    elif why == "out given":
        kw = dict(out=torch.empty(M, 64, dtype=torch.bfloat16, device=DEV))
    elif why == "deterministic":
        kw = dict(deterministic=True)
    else:
        monkeypatch.setattr(ml, "ROUTE_IN_KERNEL", False)
    calls = []
    _count_launches(monkeypatch, calls)
    moe_mxfp4_down(a, weights, (ids, wts), **kw)
    assert mtriton._moe_mxfp4_down_routed_kernel not in calls
    assert triton_routing._prepare_routing_kernel in calls


def test_the_rule_takes_one_launch_where_the_gpu_would_wait_for_the_host():
    """one_launch_us: the bytes bound or the FLOPs, times 1 + 2 / K steps; monotone in M; the first
    probe run's picks (KIMI-K2.5 one launch up to M = 8, gpt-oss-120b up to 16, gpt-oss-20b up to 128)."""
    kimi, oss120, oss20 = (385, 7168, 512, 9), (128, 2880, 2880, 4), (32, 2880, 2880, 4)

    def est(M, shape):
        E, H, I, k = shape
        return ml.one_launch_us(M, k, E, H, I)

    for shape in (kimi, oss120, oss20):
        ts = [est(M, shape) for M in (1, 2, 4, 8, 16, 64, 256, 1024)]
        assert ts == sorted(ts) and ts[0] > 0
    limit = ml.ROUTE_IN_KERNEL_MAX_US
    assert est(8, kimi) <= limit < est(16, kimi)
    assert est(16, oss120) <= limit < est(48, oss120)
    assert est(128, oss20) <= limit < est(512, oss20)


def test_a_workspace_per_stream():
    E, top_k, M = 6, 3, 5
    weights, g = _layer(2)
    ids, wts = _routing(M, E, top_k, g)
    a = torch.randn(M * top_k, 128, generator=g).bfloat16().to(DEV)
    moe_mxfp4_down(a, weights, (ids, wts))
    rp = ml._ROUTED.values()[0]
    first = rp._workspace(a.device, 111)
    assert rp._workspace(a.device, 111)[0] is first[0]
    second = rp._workspace(a.device, 222)
    assert second[0].data_ptr() != first[0].data_ptr() and second[4].tolist() == [0, 0]
    assert [t.shape[0] for t in first] == [rp.max_rows, rp.max_rows, rp.max_blocks, 4, 2]


def test_cross_compiled_for_sm90_takes_a_ticket_and_keeps_wgmma(tmp_path):
    """The one-launch kernel at KIMI-K2.5's M = 16 default: a 64-bit atomic ticket, the routing as a
    call (not inlined), the tiles' wgmma; with its registers capped at the plain kernel's (as the
    launcher caps them) it keeps the plain kernel's programs per SM."""
    from kernels.moe_mxfp4.config import default_config

    cfg = default_config(16, 9, 385, 512, prepacked=2, H=7168, sms=132)
    plain = ml.compile_for_target(cfg, cache_dir=tmp_path / "plain")[0]
    one = ml.compile_for_target(cfg.replace(maxnreg=plain.resources()["registers"]), routed_experts=385, pairs=144,
                                cache_dir=tmp_path / "one")[0]
    sass = one.text("sass")
    assert "ATOMG.E.ADD.64" in sass and "CALL" in sass and "HGMMA" in sass
    assert one.resources()["registers"] <= plain.resources()["registers"]
    assert one.resources()["blocks_per_sm"] == plain.resources()["blocks_per_sm"]


# ------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.parametrize("name,M", [("kimi-k2.5", 4), ("kimi-k2.5", 8), ("gpt-oss-120b", 1), ("gpt-oss-120b", 16),
                                    ("gpt-oss-20b", 16), ("gpt-oss-20b", 128)])
def test_gpu_one_launch_on_the_models(name, M, monkeypatch):
    """The models' shapes (random weights): the one launch against the two launches and the fp32
    reference of the quantizer's decode; no host synchronization once planned; 20 calls in a row
    with fresh routings; captured in a CUDA graph (ROUTE_IN_KERNEL_IN_GRAPHS) and replayed."""
    from kernels.moe_mxfp4.quant import dequantize_mxfp4
    from workbench.bench import capture

    E, H, I, top_k = {"kimi-k2.5": (385, 7168, 512, 9), "gpt-oss-120b": (128, 2880, 2880, 4),
                      "gpt-oss-20b": (32, 2880, 2880, 4)}[name]
    g = torch.Generator(device="cuda").manual_seed(M)
    E_used = min(E, 48)             # random weights for the experts the test routes to, zeros for the rest
    w = torch.zeros(E, H, I // 2, dtype=torch.uint8, device="cuda")
    ws = torch.full((E, H, I // 32), 127, dtype=torch.uint8, device="cuda")
    for e0 in range(0, E_used, 8):
        w[e0:e0 + 8], ws[e0:e0 + 8] = quantize_mxfp4(torch.randn(min(8, E_used - e0), H, I, device="cuda",
                                                                 generator=g) * 0.02)
    weights = prepare_weights(w, ws, 2)

    def draw():
        ids = torch.rand(M, E_used, device="cuda", generator=g).topk(top_k, dim=1).indices.to(torch.int32)
        wts = torch.softmax(torch.randn(M, top_k, device="cuda", generator=g), -1)
        return torch.randn(M * top_k, I, device="cuda", generator=g).bfloat16(), ids, wts

    def reference(a, ids, wts, split=1):
        """(sum, the bound's magnitudes) per expert from the quantizer's own decode, in fp32; with
        SPLIT_K > 1 the magnitudes of the partial rows each program rounds (as the study checks)."""
        flat = ids.reshape(-1).long()
        step = -(-(-(-I // 128)) // split) * 128
        y = torch.zeros(split, M * top_k, H, device="cuda")
        for e in torch.unique(flat).tolist():
            sel = (flat == e).nonzero().squeeze(1)
            we = dequantize_mxfp4(w[e], ws[e])
            for j in range(split):
                y[j, sel] = a[sel, j * step:(j + 1) * step].float() @ we[:, j * step:(j + 1) * step].T
        y = (y * wts.reshape(1, -1, 1)).view(split, M, top_k, H)
        return y.sum((0, 2)), y.abs().sum((0, 2))

    a, ids, wts = draw()
    first = moe_mxfp4_down(a, weights, (ids, wts))      # planned, compiled
    assert isinstance(ml._ROUTED.values()[0], mplan.RoutedPlan), "the rule should pick one launch here"
    split = ml._ROUTED.values()[0].config.SPLIT_K
    torch.cuda.synchronize()
    for _ in range(20):
        a, ids, wts = draw()
        torch.cuda.set_sync_debug_mode("error")
        try:
            got = moe_mxfp4_down(a, weights, (ids, wts))
        finally:
            torch.cuda.set_sync_debug_mode("default")
        ref, mag = reference(a, ids, wts, split)
        assert ((got.float() - ref).abs() <= (top_k + 1 + split) * 2.0 ** -8 * mag + 1e-6).all()
    two = _two_launches(a, weights, ids, wts, E, ml._ROUTED.values()[0].config.BLOCK_M)
    assert ((got.float() - two.float()).abs() <= 2 * (top_k + 1 + split) * 2.0 ** -8 * mag + 1e-6).all()
    assert first.data_ptr() != got.data_ptr()
    monkeypatch.setattr(ml, "ROUTE_IN_KERNEL_IN_GRAPHS", True)
    static = draw()
    replay, out = capture(lambda: moe_mxfp4_down(static[0], weights, (static[1], static[2])))
    for _ in range(3):
        a, ids, wts = draw()
        static[0].copy_(a), static[1].copy_(ids), static[2].copy_(wts)
        replay()
        torch.cuda.synchronize()
        ref, mag = reference(a, ids, wts, split)
        assert ((out.float() - ref).abs() <= (top_k + 1 + split) * 2.0 ** -8 * mag + 1e-6).all()
