"""kernels.moe's launch plans: made once per call signature, never reused where wrong.

The CPU cases run the Triton kernels in Triton's interpreter, in ONE subprocess
(TRITON_INTERPRET=1 must be set before triton is imported, and an interpreted
launch patches Triton globally, which the in-process Gluon cross-compiles of
other test files must not see). Configs force the TMA descriptor path
(``USE_TMA=True``, emulated by the interpreter), so a tensor's 16-byte
alignment decides between two plans (descriptors or pointer loads). Every
output is NaN-poisoned first and compared with the fp64 reference on fresh
random inputs (a seed per session). GPU versions are marked ``gpu``.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SEED = random.SystemRandom().randrange(2**31)

_RUNNER = textwrap.dedent(r'''
    import json, os, sys, traceback
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, sys.argv[1])
    import torch
    from kernels import moe
    from kernels.moe import launch

    torch.manual_seed(int(sys.argv[2]))
    TMA = moe.GroupedConfig(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, num_warps=1, num_stages=1,
                            EPI_SUBTILE=False, FLATTEN=False, USE_TMA=True)
    DT = torch.float16
    SIZES = [5, 0, 11]

    def sizes(v=SIZES):
        return torch.tensor(v, dtype=torch.int32)

    def rel(out, ref):
        out = out.double()
        assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) elements"
        if ref.norm() == 0:                           # every group empty (wgrad): zeros
            assert out.abs().max() == 0, "nonzero output for empty groups"
            return
        err = ((out - ref).norm() / ref.norm()).item()
        assert err < 2e-3, f"relative error {err:.3g}"

    def nan(*shape):
        return torch.full(shape, float("nan"), dtype=DT)

    def offset_by_one(t):
        """Same shape, strides and values as t, one element past a 16-byte boundary."""
        buf = torch.empty(t.numel() + 1, dtype=t.dtype)
        v = buf[1:].view(t.shape)
        v.copy_(t)
        return v

    def fwd(x, w, s, **kw):
        out = moe.grouped_gemm(x, w, s, config=TMA, **kw)
        rel(out, moe.reference(x, w, s, trans_w=kw.get("trans_w", False)))
        return out

    def uses_tma(x, w, s, **kw):
        return launch.plan_for(x, w, s, config=TMA, **kw).meta["USE_TMA"]

    def check_alignment():
        M, K, N = sum(SIZES), 32, 24
        x, w, s = torch.randn(M, K).to(DT), torch.randn(3, K, N).to(DT), sizes()
        fwd(x, w, s)                                  # aligned first: a descriptor plan
        assert uses_tma(x, w, s)
        for x2, w2 in ((offset_by_one(x), w), (x, offset_by_one(w))):
            fwd(x2, w2, s)
            assert not uses_tma(x2, w2, s), "a misaligned operand reused the descriptor plan"
        out = offset_by_one(nan(M, N))
        fwd(x, w, s, out=out)
        assert not uses_tma(x, w, s, out=out)
        dy, xw = torch.randn(M, N).to(DT), torch.randn(M, K).to(DT)
        for a in (xw, offset_by_one(xw)):
            dw = moe.grouped_gemm_wgrad(a, dy, s, config=TMA)
            rel(dw, moe.reference_wgrad(a, dy, s))
        assert launch.plan_for_wgrad(xw, dy, s, config=TMA).meta["USE_TMA"]
        assert not launch.plan_for_wgrad(offset_by_one(xw), dy, s, config=TMA).meta["USE_TMA"]

    def check_transposed_view():
        M = K = N = sum(SIZES)                        # square: a transposed view has the same shape
        x, w, s = torch.randn(M, K).to(DT), torch.randn(3, K, N).to(DT), sizes()
        fwd(x, w, s)
        fwd(x, w, s, trans_w=True)                    # same tensors, the other orientation: its own plan
        for bad, match in ((lambda: moe.grouped_gemm(x.t(), w, s, config=TMA), "row-major"),
                           (lambda: moe.grouped_gemm(x, w.transpose(1, 2), s, config=TMA), "trans_w"),
                           (lambda: moe.grouped_gemm_wgrad(x, x.t(), s, config=TMA), "row-major")):
            try:
                bad()
            except ValueError as exc:
                assert match in str(exc), exc
            else:
                raise AssertionError(f"a transposed view reused a plan ({match})")
        moe.grouped_gemm_wgrad(x, x, s, config=TMA)

    def check_slice_with_offset():
        M, K, N = sum(SIZES), 32, 24
        big = torch.randn(M + 16, K + 16).to(DT)
        w, s = torch.randn(3, K, N).to(DT), sizes()
        fwd(big[:M, :K].contiguous(), w, s)
        aligned = big[8:8 + M, 8:8 + K]               # 16-byte offset, 96-byte rows: descriptors still work
        odd = big[3:3 + M, 1:1 + K]                   # 2-byte offset: pointer loads
        fwd(aligned, w, s)
        fwd(odd, w, s)
        assert uses_tma(aligned, w, s) and not uses_tma(odd, w, s)
        wbig = torch.randn(3, K + 8, N + 8).to(DT)
        fwd(aligned, wbig[:, 4:4 + K, 8:8 + N], s)    # a weight slice: its own strides and offset
        dy = torch.randn(M + 16, N + 16).to(DT)
        for a, b in ((aligned, dy[8:8 + M, 8:8 + N]), (odd, dy[3:3 + M, 1:1 + N])):
            rel(moe.grouped_gemm_wgrad(a, b, s, config=TMA), moe.reference_wgrad(a, b, s))

    def check_out_given_then_not():
        M, K, N = sum(SIZES), 32, 24
        x, w, s = torch.randn(M, K).to(DT), torch.randn(3, K, N).to(DT), sizes()
        out = nan(M, N)
        assert fwd(x, w, s, out=out) is out
        fresh = fwd(x, w, s)
        assert fresh is not out and fresh.data_ptr() != out.data_ptr()
        assert launch.plan_for(x, w, s, config=TMA, out=out) is not launch.plan_for(x, w, s, config=TMA)
        dy = torch.randn(M, N).to(DT)
        dw = nan(3, K, N)
        assert moe.grouped_gemm_wgrad(x, dy, s, config=TMA, out=dw) is dw
        rel(dw, moe.reference_wgrad(x, dy, s))
        rel(moe.grouped_gemm_wgrad(x, dy, s, config=TMA), moe.reference_wgrad(x, dy, s))
        # the default config (pointer loads here) too
        rel(moe.grouped_gemm(x, w, s, out=nan(M, N)), moe.reference(x, w, s))
        rel(moe.grouped_gemm(x, w, s), moe.reference(x, w, s))

    def check_sizes_change():
        M, K, N = sum(SIZES), 32, 24
        x, w, s = torch.randn(M, K).to(DT), torch.randn(3, K, N).to(DT), sizes()
        dy = torch.randn(M, N).to(DT)
        fwd(x, w, s)
        rel(moe.grouped_gemm_wgrad(x, dy, s, config=TMA), moe.reference_wgrad(x, dy, s))
        plans = len(launch._PLANS), len(launch._WGRAD_PLANS)
        for new in ([0, 16, 0], [16, 0, 0], [1, 2, 13], [0, 0, 0]):
            s.copy_(torch.tensor(new))                # same tensor, new values
            rel(moe.grouped_gemm_wgrad(x, dy, s, config=TMA, out=nan(3, K, N)), moe.reference_wgrad(x, dy, s))
            if sum(new) == M:                         # (rows past the sizes' sum are left unwritten)
                fwd(x, w, s, out=nan(M, N))
                fwd(x, w, sizes(new[::-1]))           # another tensor of the same signature
        assert (len(launch._PLANS), len(launch._WGRAD_PLANS)) == plans, "new sizes made new plans"
        strided = torch.tensor([5, 7, 0, 1, 11, 3], dtype=torch.int32)[::2]   # copied on the device
        assert strided.stride(0) == 2
        fwd(x, w, strided)

    def check_cache_bound():
        launch.clear_plans()
        launch._PLANS.size = 3
        try:
            w, K = torch.randn(3, 16, 8).to(DT), 16
            xs = [torch.randn(m, K).to(DT) for m in (16, 17, 18, 19, 20)]
            ss = [torch.tensor([m - 8, 0, 8], dtype=torch.int32) for m in (16, 17, 18, 19, 20)]
            for x, s in zip(xs, ss):
                fwd(x, w, s)
                assert len(launch._PLANS) <= 3
            assert len(launch._PLANS) == 3
            first = launch.plan_for(xs[0], w, ss[0], config=TMA)    # evicted: planned anew
            assert len(launch._PLANS) == 3
            assert launch.plan_for(xs[0], w, ss[0], config=TMA) is first   # now cached
            for x, s in zip(xs, ss):
                fwd(x, w, s)                          # right after eviction and re-planning
        finally:
            launch._PLANS.size = launch.PlanCache().size

    def check_autograd_follows_sizes():
        M, K, N = sum(SIZES), 16, 24
        s = sizes()
        for new in (SIZES, [0, 16, 0]):
            s.copy_(torch.tensor(new))
            x = torch.randn(M, K, dtype=torch.float32, requires_grad=True)
            w = torch.randn(3, K, N, dtype=torch.float32, requires_grad=True)
            y = moe.grouped_linear(x, w, s)
            g = torch.randn_like(y)
            y.backward(g)
            rel(y.detach(), moe.reference(x.detach(), w.detach(), s))
            rel(x.grad, moe.reference(g, w.detach(), s, trans_w=True))
            rel(w.grad, moe.reference_wgrad(x.detach(), g, s))

    def check_planning_reads_nothing_on_the_host():
        M, K, N = sum(SIZES), 32, 24
        x, w, s = torch.randn(M, K).to(DT), torch.randn(3, K, N).to(DT), sizes()
        launch.clear_plans()
        saved = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "cpu", "numpy", "__int__", "__bool__")}
        def refuse(*a, **k):
            raise AssertionError("a launch plan read a tensor on the host")
        try:
            for n in saved:
                setattr(torch.Tensor, n, refuse)
            launch.plan_for(x, w, s, config=TMA)
            launch.plan_for(x, w, s)
            launch.plan_for_wgrad(x, torch.randn(M, N).to(DT), s, config=TMA)
        finally:
            for n, f in saved.items():
                setattr(torch.Tensor, n, f)

    results = {}
    for name, fn in list(globals().items()):
        if name.startswith("check_"):
            try:
                fn()
                results[name[6:]] = "ok"
            except Exception:
                results[name[6:]] = traceback.format_exc()[-2500:]
    print("RESULTS" + json.dumps(results))
''')

CHECKS = ["alignment", "transposed_view", "slice_with_offset", "out_given_then_not", "sizes_change",
          "cache_bound", "autograd_follows_sizes", "planning_reads_nothing_on_the_host"]


@pytest.fixture(scope="module")
def plan_results():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run([sys.executable, "-c", _RUNNER, str(ROOT), str(SEED)], capture_output=True, text=True,
                          env=env, timeout=600)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS")), None)
    if line is None:
        pytest.fail(f"interpreter subprocess failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n"
                    f"{proc.stderr[-5000:]}")
    return json.loads(line[len("RESULTS"):])


@pytest.mark.parametrize("name", CHECKS)
def test_plan_in_the_interpreter(plan_results, name):
    assert set(plan_results) == set(CHECKS)
    assert plan_results[name] == "ok", f"seed {SEED}:\n{plan_results[name]}"


# ---------------------------------------------------------------------------
# No kernel runs: keys and the cache
# ---------------------------------------------------------------------------
def test_plan_cache_is_a_bounded_lru():
    from kernels.gemm.launch import PlanCache

    cache = PlanCache(size=2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1        # "a" is now the most recent
    cache.put("c", 3)
    assert len(cache) == 2 and cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3


def test_non_tensors_get_a_clear_error():
    from kernels.moe import launch

    x, w, s = torch.randn(4, 8), torch.randn(2, 8, 8), torch.tensor([2, 2])
    for args, name in (((x.numpy(), w, s), "x"), ((x, w, [2, 2]), "group_sizes")):
        with pytest.raises(ValueError, match=f"{name} must be a torch.Tensor"):
            launch.grouped_gemm(*args)
    with pytest.raises(ValueError, match="out must be a torch.Tensor"):
        launch.grouped_gemm(x, w, s, out=x.numpy())
    with pytest.raises(ValueError, match="dy must be a torch.Tensor"):
        launch.grouped_gemm_wgrad(x, "dy", s)


# ---------------------------------------------------------------------------
# GPU: the same separation with the default path (the Gluon kernel on sm_90)
# ---------------------------------------------------------------------------
def _rel(out, ref):
    out = out.float()
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) or non-finite elements"
    return ((out - ref).norm() / ref.norm()).item()


@pytest.mark.gpu
def test_gpu_plans_follow_alignment_strides_out_and_sizes():
    from kernels import moe
    from kernels.moe import launch, routing

    dev, dt = "cuda", torch.bfloat16
    G, M, K, N = 8, 8 * 256, 512, 384
    torch.manual_seed(SEED)
    s = routing.mild(M, G, seed=SEED % 1000, device=dev)
    x = torch.randn(M, K, device=dev, dtype=dt)
    w = (torch.randn(G, K, N, device=dev) / K ** 0.5).to(dt)

    def check(x_, w_, out=None, trans_w=False):
        res = moe.grouped_gemm(x_, w_, s, trans_w=trans_w, out=out)
        assert out is None or res is out
        ref = moe.reference(x_, w_, s, trans_w=trans_w, dtype=torch.float32)
        assert _rel(res, ref) < 1.5e-2
        return launch.plan_for(x_, w_, s, trans_w=trans_w, out=out)

    aligned = check(x, w)
    buf = torch.empty(M * K + 1, device=dev, dtype=dt)
    x_off = buf[1:].view(M, K)
    x_off.copy_(x)
    shifted = check(x_off, w)
    assert aligned.label.startswith("gluon") and not shifted.label.startswith("gluon")
    big = torch.randn(M + 8, K + 8, device=dev, dtype=dt)
    check(big[8:, 8:], w)
    check(big[3:3 + M, 1:1 + K], w)
    out = torch.full((M, N), float("nan"), device=dev, dtype=dt)
    check(x, w, out=out)
    check(x, w)
    wsq = (torch.randn(G, K, K, device=dev) / K ** 0.5).to(dt)
    check(x, wsq)
    check(x, wsq, trans_w=True)
    with pytest.raises(ValueError, match="trans_w"):
        moe.grouped_gemm(x, wsq.transpose(1, 2), s)
    n_plans = len(launch._PLANS)
    s.copy_(routing.extreme(M, G, seed=3, device=dev))
    check(x, w)
    assert len(launch._PLANS) == n_plans


@pytest.mark.gpu
def test_gpu_repeated_calls_do_not_synchronize():
    from kernels import moe
    from kernels.moe import routing

    dev, dt = "cuda", torch.bfloat16
    s = routing.mild(4096, 8, seed=3, device=dev)
    x = torch.randn(4096, 512, device=dev, dtype=dt)
    w = torch.randn(8, 512, 256, device=dev, dtype=dt)
    dy = torch.randn(4096, 256, device=dev, dtype=dt)
    calls = [lambda: moe.grouped_gemm(x, w, s), lambda: moe.grouped_gemm(dy, w, s, trans_w=True),
             lambda: moe.grouped_gemm_wgrad(x, dy, s),
             lambda: moe.grouped_gemm(x, w, s, config=moe.GroupedConfig())]
    for c in calls:
        c()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for c in calls:
            c()
    finally:
        torch.cuda.set_sync_debug_mode("default")
