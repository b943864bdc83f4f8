"""The warp-specialised MXFP4 down-projection at large M (``kernels/moe_mxfp4/gluon.py``): the FP4
expansion in warps of its own beside the wgmma, persistent, for the plain and level-2 layouts.

CPU: the activations' gather (Triton's interpreter) against torch, padding and routing edge cases
included; the expander of each layout modelled word by word (its inline PTX through the instruction
model, its index arithmetic and its joins and permutes in numpy) against the quantizer's own decode
in the kernel's K order, every scale byte's class (0, 127, 254, 255) and a K tail and row padding
included, and the two layouts bit for bit; the refusal of other layouts; the launcher's rule; the
kernel cross-compiled for sm_90 (wgmma, mbarriers, register reallocation, no spills). GPU (`gpu`):
the three models at two M each as users call ``moe_mxfp4_down`` (the rule sends them to this
kernel) against the fp32 reference, level 2 against level 0 bit for bit, no host synchronization,
captured in a CUDA graph; below the rule's threshold the Triton kernel runs.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kernels.moe_mxfp4 import gluon as ws
from kernels.moe_mxfp4 import launch as ml
from kernels.moe_mxfp4 import moe_mxfp4_down, prepack_mxfp4, prepare_weights, quantize_mxfp4
from kernels.moe_mxfp4.quant import dequantize_mxfp4
from kernels.moe_mxfp4.routing import prepare_routing
from ptx_model import run_ptx

ON_GPU = torch.cuda.is_available()
DEV = "cuda" if ON_GPU else "cpu"     # the gather: Triton's interpreter on a CPU, the kernel on a GPU


def _k_order(x: torch.Tensor) -> torch.Tensor:
    """Columns of x in the kernel's K order (ws.K_ORDER in each run of 8)."""
    *lead, n = x.shape
    return x.reshape(*lead, n // 8, 8)[..., list(ws.K_ORDER)].reshape(*lead, n)


def test_k_order_is_the_swap_of_each_fours_middle_pair():
    assert ws.K_ORDER == (0, 2, 1, 3, 4, 6, 5, 7)
    x = torch.arange(16)
    assert _k_order(x).tolist() == [0, 2, 1, 3, 4, 6, 5, 7, 8, 10, 9, 11, 12, 14, 13, 15]


# --------------------------------------------------------------------------- gather (interpreter)
@pytest.mark.parametrize("M,top_k,E,case", [(37, 3, 5, "random"), (1, 2, 4, "one token"),
                                            (20, 2, 6, "all to one expert"), (16, 4, 8, "empty experts")])
def test_gather_sorted_puts_each_used_row_in_k_order(M, top_k, E, case):
    g = torch.Generator().manual_seed(M * 7 + E)
    if case == "all to one expert":
        ids = torch.full((M, top_k), 3, dtype=torch.int32)
        ids[:, 1] = 1
    elif case == "empty experts":
        ids = torch.randint(0, 2, (M, top_k), generator=g, dtype=torch.int32) * 4   # experts 0 and 4 only
    else:
        ids = torch.rand(M, E, generator=g).topk(top_k, dim=1).indices.to(torch.int32)
    r = prepare_routing(ids.to(DEV), torch.rand(M, top_k, generator=g).to(DEV), E, 16)
    a = torch.randn(M * top_k, 96, generator=g).bfloat16().to(DEV)
    x = ws.gather_sorted(a, r)
    n = int(r.num_rows[0])
    sid = r.sorted_ids[:n].long()
    real = sid < M * top_k
    assert x.shape == (r.sorted_ids.shape[0], 96) and int(real.sum()) == M * top_k
    assert torch.equal(x[:n][real], _k_order(a[sid[real]]))


# --------------------------------------------------------------------------- the expander, modelled
def _weights(H, I, seed):
    """Random MXFP4 weights of one expert with every scale byte's class present."""
    g = torch.Generator().manual_seed(seed)
    w, s = quantize_mxfp4(torch.randn(1, H, I, generator=g) * 0.05)
    w = torch.randint(0, 256, w.shape, generator=g, dtype=torch.uint8)
    s = torch.randint(100, 140, s.shape, generator=g, dtype=torch.uint8)
    s.view(-1)[:4] = torch.tensor([0, 127, 254, 255], dtype=torch.uint8)
    return w, s


def _scale_words(s: np.ndarray, one_mul: bool) -> np.ndarray:
    s = s.astype(np.uint32)
    bits = (s + 126) << 7 if one_mul else np.where(s == 0, 0x40, np.where(s == 255, 0x7FC0, s << 7))
    return (bits | bits << 16).astype(np.uint32)


def _to_bf16(words: np.ndarray) -> torch.Tensor:
    """uint32 words [..., n] of bf16 pairs (low half first) -> bf16 [..., 2n]."""
    t = torch.from_numpy(words.astype(np.int64))
    pairs = torch.stack([t & 0xFFFF, t >> 16], -1).reshape(*words.shape[:-1], -1)
    return pairs.to(torch.int16).view(torch.bfloat16)


def _level0_model(w: torch.Tensor, s: torch.Tensor, one_mul: bool) -> torch.Tensor:
    """_expand over every code word of w [1, H, I/2]: its PTX, then [o0, o1] + [o2, o3] joined."""
    words = w[0].contiguous().numpy().view(np.uint32)                       # [H, I / 8]
    f = _scale_words(np.repeat(s[0].numpy(), 4, axis=1), one_mul)           # a scale per 4 words
    o = run_ptx((ws._EXPAND_ONE_MUL_PTX if one_mul else ws._EXPAND_PTX).value, {"$4": words, "$5": f})
    v = np.stack([np.stack([o["$0"], o["$1"]], -1), np.stack([o["$2"], o["$3"]], -1)], -1)
    return _to_bf16(v.reshape(words.shape[0], -1))


def _level2_model(w: torch.Tensor, s: torch.Tensor, one_mul: bool, BN: int = 128, BK: int = 128) -> torch.Tensor:
    """_l2_tile_ptrs / _l2_load / _l2_expand over every tile and K step of the level-2 layout."""
    H, I = w.shape[1], 2 * w.shape[2]
    wp, sp = prepack_mxfp4(w, s, 2)
    Hp, Ip = wp.shape[1], 2 * wp.shape[2]
    words = wp[0].contiguous().view(-1).numpy().view(np.uint32)
    swords = sp[0].contiguous().view(-1).numpy().view(np.uint32)
    NB, KB = BN // 64, BK // 128
    ix = lambda n, d: np.arange(n).reshape([n if i == d else 1 for i in range(6)])
    nb, kb, r54, r210, c21, jw = (ix(n, d) for d, n in enumerate((NB, KB, 4, 8, 4, 4)))
    n_tiles, steps = -(-H // BN), -(-I // BK)
    out = np.zeros((n_tiles * BN, steps * BK // 2), dtype=np.uint32)
    for tile_n in range(n_tiles):
        row0 = tile_n * BN + nb * 64
        ok = np.broadcast_to(row0 < Hp, (NB, KB, 4, 8, 4, 4))
        for kk in range(steps):
            w_off = row0 * (Ip // 8) + (kk * KB + kb) * 1024 + r54 * 128 + r210 * 16 + c21 * 4 + jw
            s_off = row0 * (Ip // 128) + (kk * KB + kb) * 64 + r54 * 16 + r210 * 2
            take = lambda arr, off, other: np.where(ok, arr[np.where(ok, off, 0)], np.uint32(other))
            h0, h1 = take(words, w_off, 0), take(words, w_off + 512, 0)
            s0 = take(swords, s_off + 0 * jw, 0x7F7F7F7F)
            s1 = take(swords, s_off + 1 + 0 * jw, 0x7F7F7F7F)
            f0, f1 = (_scale_words((x >> (8 * jw).astype(np.uint32)) & 0xFF, one_mul) for x in (s0, s1))
            ptx = (ws._LEVEL2_ONE_MUL_PTX if one_mul else ws._LEVEL2_PTX).value
            o = run_ptx(ptx, {"$8": h0, "$9": h1, "$10": f0, "$11": f1})
            rows_r = np.stack([np.stack([o["$0"], o["$1"]], -1), np.stack([o["$2"], o["$3"]], -1)], -1)
            rows_r8 = np.stack([np.stack([o["$4"], o["$5"]], -1), np.stack([o["$6"], o["$7"]], -1)], -1)
            v = np.stack([rows_r, rows_r8], -1).transpose(0, 2, 8, 3, 1, 5, 7, 4, 6).reshape(BN, BK // 2)
            out[tile_n * BN:(tile_n + 1) * BN, kk * BK // 2:(kk + 1) * BK // 2] = v
    return _to_bf16(out)[:H, :I]


def _same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    nan = want.isnan()
    same = torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16))
    return bool(torch.equal(got.isnan(), nan) and same)


@pytest.mark.parametrize("H,I", [(128, 256), (192, 160)])
@pytest.mark.parametrize("one_mul", [False, True])
def test_expander_models_give_the_decoded_values_in_k_order(H, I, one_mul):
    """Level 0 and level 2, modelled: the quantizer's decode of every weight, in K_ORDER, bit for bit
    (scale bytes 0, 127, 254 and 255 included; with one_mul, bytes up to 128); (192, 160): a second
    row tile past the stored rows and a K step that holds I's tail."""
    w, s = _weights(H, I, seed=H + I)
    if one_mul:
        s = s.clamp(max=128)
    want = _k_order(dequantize_mxfp4(w, s, torch.bfloat16)[0])
    plain = _level0_model(w, s, one_mul)
    assert _same_bits(plain, want)
    assert _same_bits(_level2_model(w, s, one_mul), want)


def test_launch_refuses_other_layouts():
    w, s = _weights(64, 128, seed=1)
    for level in (1, 3):
        with pytest.raises(ValueError, match=r"reads weights of levels \(0, 2\).*level=2"):
            ws.launch(torch.zeros(4, 128), w, s, None, torch.zeros(1, 64), level=level, shape=(64, 128),
                      one_mul=False)


# --------------------------------------------------------------------------- the rule
def test_rule_takes_whole_blocks_of_many_pairs():
    """At least WS_MIN_PAIRS pairs and WS_MIN_PAIRS_PER_EXPERT per expert: on the probe's fit set it
    picks the faster kernel every time (results/moe_mxfp4/ws/)."""
    assert ml.WS_MIN_PAIRS == 4096 and ml.WS_MIN_PAIRS_PER_EXPERT == 64 and ml.WS_BLOCK_M == 128
    picks = {(M, k, E): ml.ws_fits(M, k, E) for M, k, E in
             [(1024, 4, 128), (2048, 4, 128), (4096, 4, 128), (8192, 4, 128),       # gpt-oss-120b
              (2048, 9, 385), (4096, 9, 385), (16384, 9, 385),                        # KIMI-K2.5
              (1024, 4, 32), (4096, 4, 32)]}                                          # gpt-oss-20b
    assert [p for p, v in picks.items() if not v] == [(1024, 4, 128), (2048, 9, 385)]
    assert ml.ws_fits(2048, 8, 256) and not ml.ws_fits(2047, 8, 256)      # 64 pairs per expert
    assert ml.ws_fits(1024, 4, 8) and not ml.ws_fits(1023, 4, 8)          # 4096 pairs


def test_cpu_calls_never_take_it(monkeypatch):
    """Off the GPU (and in the interpreter) the Triton kernels run: the path says it does not apply."""
    w, s = _weights(64, 128, seed=2)
    ids = torch.zeros(4096, 4, dtype=torch.int32)
    assert ml._ws_call(torch.zeros(4096 * 4, 128).bfloat16(), None, w, s, 0, False, None,
                       (ids, torch.rand(4096, 4)), None, False, None, False) is None


def test_small_calls_ask_only_the_size():
    """At small M (eager calls are host-bound there) the path reads the routing's shape and the rule's
    cached answer, and touches nothing else: here an activations object with no attributes at all."""
    import timeit

    w, s = _weights(64, 128, seed=3)
    routing = (torch.zeros(16, 4, dtype=torch.int32), torch.rand(16, 4))
    args = (object(), None, w, s, 2, False, None, routing, None, False, None, False)
    assert ml._ws_call(*args) is None
    assert timeit.timeit(lambda: ml._ws_call(*args), number=2000) / 2000 < 20e-6


# --------------------------------------------------------------------------- cross-compiled
@pytest.mark.parametrize("level,one_mul", [(2, True), (0, False)])
def test_cross_compiled_for_sm90(level, one_mul, tmp_path):
    """The kernel as the launcher runs it: wgmma from shared memory, mbarriers, the partitions'
    registers reallocated, no spills; the expansion's bf16x2 multiplies (one or two per pair)."""
    from workbench.asm.compile import cross_compile

    e = cross_compile(targets="sm90", cache_dir=tmp_path, **ws.compile_args(level=level, one_mul=one_mul,
                                                                            block_k=128, num_stages=3,
                                                                            expand_warps=8, expand_regs=96))[0]
    sass = e.text("sass")
    assert "HGMMA.64x128x16.F32.BF16" in sass and "SYNCS" in sass and "USETMAXREG" in sass
    assert "STL" not in sass and "LDL" not in sass
    hmul = sass.count("HMUL2.BF16_V2")
    assert hmul == (32 if one_mul else 64), hmul     # 64 values per expander thread and step


# --------------------------------------------------------------------------- GPU
def _reference(a, w_bf16, ids, wts):
    """fp32 sum over slots of weight * a_row @ W[e].T, and the sum of magnitudes (the bound's scale)."""
    M, top_k = ids.shape
    flat = ids.reshape(-1).long()
    y = torch.zeros(M * top_k, w_bf16.shape[1], device=a.device)
    for e in torch.unique(flat).tolist():
        sel = (flat == e).nonzero().squeeze(1)
        y[sel] = a[sel].float() @ w_bf16[e].float().T
    y = (y * wts.reshape(-1, 1)).view(M, top_k, -1)
    return y.sum(1), y.abs().sum(1)


@pytest.mark.gpu
@pytest.mark.parametrize("name,M", [("gpt-oss-120b", 4096), ("gpt-oss-120b", 8192), ("kimi-k2.5", 4096),
                                    ("kimi-k2.5", 16384), ("gpt-oss-20b", 4096), ("gpt-oss-20b", 8192)])
def test_gpu_models_take_it_and_match_the_reference(name, M, monkeypatch):
    from workbench.bench import capture

    E, H, I, top_k = {"gpt-oss-120b": (128, 2880, 2880, 4), "kimi-k2.5": (385, 7168, 512, 9),
                      "gpt-oss-20b": (32, 2880, 2880, 4)}[name]
    g = torch.Generator(device="cuda").manual_seed(M + E)
    w, s = quantize_mxfp4(torch.randn(E, H, I, device="cuda", generator=g) * 0.02)
    w2 = prepare_weights(w, s, 2)
    w0 = prepare_weights(w, s, 0)
    ids = torch.rand(M, E, device="cuda", generator=g).topk(top_k, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(M, top_k, device="cuda", generator=g), -1)
    a = torch.randn(M * top_k, I, device="cuda", generator=g).bfloat16()
    ref, mag = _reference(a, dequantize_mxfp4(w, s, torch.bfloat16), ids, wts)
    calls = []
    real = ws.launch
    monkeypatch.setattr(ws, "launch", lambda *x, **k: calls.append(k["level"]) or real(*x, **k))
    out = moe_mxfp4_down(a, w2, (ids, wts))
    assert calls == [2]
    err = (out.float() - ref).abs()
    assert bool(out.isfinite().all()) and bool((err <= (top_k + 1) * 2.0 ** -8 * mag + 1e-6).all()), float(err.max())
    r = prepare_routing(ids, wts, E, ml.WS_BLOCK_M)
    rows = [real(a, x.w, x.w_scale, r, torch.empty(M * top_k, H, dtype=torch.bfloat16, device="cuda"), level=x.level,
                 shape=x.shape, one_mul=x.one_mul, atomic=False) for x in (w2, w0)]
    assert torch.equal(rows[0].view(torch.int16), rows[1].view(torch.int16))     # the layouts: the same bits
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = moe_mxfp4_down(a, w2, (ids, wts))
    finally:
        torch.cuda.set_sync_debug_mode(0)
    replay, held = capture(lambda: moe_mxfp4_down(a, w2, (ids, wts)))
    held.fill_(float("nan"))
    replay()
    for x in (again, held):
        assert bool(((x.float() - ref).abs() <= (top_k + 1) * 2.0 ** -8 * mag + 1e-6).all())


@pytest.mark.gpu
def test_gpu_below_the_rule_the_triton_kernel_runs(monkeypatch):
    E, H, I, top_k, M = 128, 2880, 2880, 4, 1024
    g = torch.Generator(device="cuda").manual_seed(3)
    w, s = quantize_mxfp4(torch.randn(E, H, I, device="cuda", generator=g) * 0.02)
    ids = torch.rand(M, E, device="cuda", generator=g).topk(top_k, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(M, top_k, device="cuda", generator=g), -1)
    calls = []
    monkeypatch.setattr(ws, "launch", lambda *x, **k: calls.append(1))
    moe_mxfp4_down(torch.randn(M * top_k, I, device="cuda", generator=g).bfloat16(), prepare_weights(w, s, 2),
                   (ids, wts))
    assert calls == []
