"""kernels.moe's Gluon kernel (grouped_gemm_ws): sm_90 cross-compilation (CPU), host-side checks (CPU),
and GPU correctness (marked gpu; every GPU case runs in ONE child process with a
timeout, because a warp-specialised kernel with a synchronisation bug hangs
instead of failing).

Nothing here runs a kernel in Triton's interpreter: conftest sets
TRITON_INTERPRET=1 on CPU machines, and an interpreted launch patches Triton
globally, which would break the Gluon compiles below. Gluon functions are never
interpreted, so cross-compiling them in-process works under TRITON_INTERPRET=1.
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

import ws_checks  # tests/ws_checks.py (pytest puts tests/ on the path)
from kernels.common import interpreter
from kernels.moe import config as mconfig, gluon as mgluon, launch as mlaunch, metrics as mmetrics
from kernels.moe.config import GroupedWsConfig
from kernels.moe.reference import reference, tolerance
from workbench.asm.resources import smem_per_block

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------ cross-compiled for sm_90 (CPU)
XC_CONFIGS = {
    "ws-128x128x64-s5": GroupedWsConfig(),
    "ws-128x128x64-s4": GroupedWsConfig(num_stages=4),
    "ws-64x256x32-s6": GroupedWsConfig(block_m=64, block_n=256, block_k=32, num_stages=6),
    "coop-128x256x64-s3": GroupedWsConfig(cooperative=True, block_n=256, num_stages=3),
}
XC_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
XC_OPS = {"fwd": False, "dgrad": True}  # dgrad: trans_w=True, w stored [G, N, K]
XC_CASES = [(c, d, o) for c in XC_CONFIGS for d in XC_DTYPES for o in XC_OPS]
# The largest G: the sizes vectors are longest (MAX_GROUPS / 32 registers per lane) in the 40-register producer.
XC_MAX_G = ("ws-128x128x64-s5", "bf16", "dgrad")


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(config, dtype, op) -> the cross-compiled cache entry (G = 32), plus
    'max-G' -> XC_MAX_G compiled for G = MAX_GROUPS (in a child process: see
    ws_checks.compile_ws)."""
    import dataclasses

    def case(cname, dname, op, d, **kw):
        return {"module": "moe", "config": dataclasses.asdict(XC_CONFIGS[cname]), "dtype": str(XC_DTYPES[dname])[6:],
                "dir": str(tmp_path_factory.mktemp(d)), "kwargs": {"trans_w": XC_OPS[op], **kw}}

    cases = [case(c, d, o, f"xc{i}", G=32, shape=[2880, 5760]) for i, (c, d, o) in enumerate(XC_CASES)]
    cases.append(case(*XC_MAX_G, "xcmax", G=mconfig.WS_MAX_GROUPS, sizes_dtype="int64"))
    entries = ws_checks.compile_ws(cases, ROOT)
    return {**dict(zip(XC_CASES, entries)), "max-G": entries[-1]}


@pytest.mark.parametrize("cname,dname,op", XC_CASES)
def test_sm90_uses_wgmma_and_tma(compiled, cname, dname, op):
    e, cfg = compiled[cname, dname, op], XC_CONFIGS[cname]
    # One warpgroup issues m64nBLOCK_Nk16 wgmma (HGMMA in SASS; fp16 inputs go unnamed there).
    hgmma = ws_checks.mnemonics(e, "sass", "matrix")
    expect = {"bf16": f"HGMMA.64x{cfg.block_n}x16.F32.BF16:", "fp16": f"HGMMA.64x{cfg.block_n}x16.F32:"}[dname]
    assert expect in hgmma, hgmma
    kind = {"bf16": "bf16", "fp16": "f16"}[dname]
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.block_n}k16.f32.{kind}.{kind}:" in ws_checks.mnemonics(e, "ptx", "matrix")
    # x through a 2-D descriptor, w through a 3-D one ([G, K, N] / [G, N, K]), out
    # through the 4-D row-window descriptor.
    sass = e.text("sass")
    assert "UTMALDG.2D" in sass and "UTMALDG.3D" in sass and "UTMASTG.4D" in sass
    assert "UTMASTG.2D" not in sass and "STG.E" not in sass  # no register stores to global
    ttgir = e.text("ttgir")
    if XC_OPS[op]:
        # dgrad: the [BN, BK] (K-major) box reaches wgmma through the transposed shared view.
        assert "ttg.memdesc_trans" in ttgir and "transposed = true" in ttgir
    else:
        assert "ttg.memdesc_trans" not in ttgir


@pytest.mark.parametrize("key", XC_CASES + ["max-G"], ids=str)
def test_sm90_no_spills(compiled, key):
    ws_checks.assert_no_spills(compiled[key])


@pytest.mark.parametrize("cname,dname,op", XC_CASES)
def test_sm90_warp_specialised(compiled, cname, dname, op):
    e = compiled[cname, dname, op]
    ws_checks.assert_warp_specialised(e, XC_CONFIGS[cname], mconfig)
    # The group-size prefix sums and the tile -> group lookups stay inside a warp:
    # lane shuffles for the scans, redux.sync for the reductions (and no scratch
    # shared memory for them: see test_sm90_shared_memory_fits).
    ptx = e.text("ptx")
    assert "shfl.sync.up" in ptx and "redux.sync" in ptx


@pytest.mark.parametrize("cname,dname,op", XC_CASES)
def test_sm90_shared_memory_fits(compiled, cname, dname, op):
    ws_checks.assert_smem_fits(compiled[cname, dname, op], XC_CONFIGS[cname], mconfig, smem_per_block(90))


def test_compile_args_surface():
    args = mlaunch.compile_args_ws(dtype=torch.float16, trans_w=True, G=5)
    assert args["fn"] is mgluon._grouped_gemm_ws_kernel
    assert args["num_warps"] == 4 and args["options"] == {"maxnreg": 168}
    sig = args["signature"]
    assert sig["x_desc"].startswith("tensordesc<fp16[128, 64],NVMMASharedLayout(")
    assert sig["w_desc"].startswith("tensordesc<fp16[1, 128, 64],NVMMASharedLayout(") and "rank=3" in sig["w_desc"]
    assert sig["out_desc"].startswith("tensordesc<fp16[1, 1, 128, 128],") and "rank=4" in sig["out_desc"]
    assert sig["sizes_ptr"] == "*i32" and sig["M_total"] == sig["G"] == sig["group_m"] == "i32"
    assert args["constexprs"] == {"NUM_STAGES": 5, "COOPERATIVE": False, "TRANS_W": True, "G_PAD": 32,
                                  "CONSUMER_REGS": 232, "PRODUCER_REGS": 40}
    fwd = mlaunch.compile_args_ws(GroupedWsConfig(cooperative=True, block_n=256, num_stages=3), G=100,
                            sizes_dtype=torch.int64)
    assert fwd["num_warps"] == 8 and fwd["constexprs"]["G_PAD"] == 128 and fwd["signature"]["sizes_ptr"] == "*i64"
    assert fwd["signature"]["w_desc"].startswith("tensordesc<bf16[1, 64, 256],")
    with pytest.raises(ValueError, match=r"float16.*kernels\.moe\.grouped_gemm"):
        mlaunch.compile_args_ws(dtype=torch.float32)
    with pytest.raises(ValueError, match=r"multiples of 8.*kernels\.moe\.grouped_gemm"):
        mlaunch.compile_args_ws(shape=(2880, 100))
    with pytest.raises(ValueError, match=r"G=513.*kernels\.moe\.grouped_gemm"):
        mlaunch.compile_args_ws(G=513)


@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("cfg", [GroupedWsConfig(), GroupedWsConfig(cooperative=True, block_n=256, num_stages=3)],
                         ids=lambda c: c.label())
def test_launch_types_match_compile_args(cfg, trans_w):
    """What the launcher passes is what compile_args describes: the runtime mangles
    the host descriptors (built here on CPU tensors) into the signature types."""
    from triton.runtime.jit import mangle_type

    M, N, K, G = 106, 40, 48, 5
    x = torch.empty(M, K, dtype=torch.float16)
    w = torch.empty((G, N, K) if trans_w else (G, K, N), dtype=torch.float16)
    out = torch.empty(M, N, dtype=torch.float16)
    sizes = torch.zeros(G, dtype=torch.int64)
    descs = mgluon.descriptors(x, w, out, cfg, trans_w)
    sig = mlaunch.compile_args_ws(cfg, torch.float16, trans_w, G=G, sizes_dtype=torch.int64)["signature"]
    got = [mangle_type(a) for a in (*descs, sizes, M, G, cfg.group_m)]
    assert got == [sig[k] for k in ("x_desc", "w_desc", "out_desc", "sizes_ptr", "M_total", "G", "group_m")]
    # The row window: (a, b, r, c) with strides (2**34 - s, s, s, 1); r spans 2**30 rows.
    win = descs[2]
    assert list(win.shape) == [0x7FFF0000, 0x7FFF0000, 1 << 30, N] and list(win.strides) == [2**34 - N, N, N, 1]
    assert list(win.block_shape) == [1, 1, cfg.block_m, cfg.block_n]
    assert list(descs[1].shape) == list(w.shape)


# ------------------------- device descriptors, cross-compiled for sm_90 (CPU)
# name -> (config, dtype name, trans_w); each compiled with host and with device descriptors.
XC_DD_CASES = {
    "ws-s5-bf16-fwd": (GroupedWsConfig(), "bf16", False),
    "ws-s5-fp16-dgrad": (GroupedWsConfig(), "fp16", True),
    "ws-s4-bf16-dgrad": (GroupedWsConfig(num_stages=4), "bf16", True),
    "coop-bf16-fwd": (GroupedWsConfig(cooperative=True, block_n=256, num_stages=3), "bf16", False),
    "coop-bf16-dgrad": (GroupedWsConfig(cooperative=True, block_n=256, num_stages=3), "bf16", True),
}


@pytest.fixture(scope="module")
def compiled_dd(tmp_path_factory):
    """name -> (device-descriptor entry, host-descriptor entry), compiled in a child process (G = 32)."""
    import dataclasses

    cases = []
    for i, (cfg, dname, trans_w) in enumerate(XC_DD_CASES.values()):
        for dd in (True, False):
            cases.append({"module": "moe", "config": dataclasses.asdict(cfg), "dtype": str(XC_DTYPES[dname])[6:],
                          "dir": str(tmp_path_factory.mktemp(f"xcdd{i}{dd:d}")),
                          "kwargs": {"trans_w": trans_w, "G": 32, "shape": [2880, 5760], "device_desc": dd}})
    entries = ws_checks.compile_ws(cases, ROOT)
    return {name: (entries[2 * i], entries[2 * i + 1]) for i, name in enumerate(XC_DD_CASES)}


@pytest.mark.parametrize("name", list(XC_DD_CASES))
def test_sm90_device_descriptors(compiled_dd, name):
    """The device-descriptor kernel compiles for sm_90; the producer builds x's (2-D) and
    w's (3-D) descriptors, each consumer out's row window (4-D), in the global scratch
    with the tensormap fences; the main loops hold the host variant's HGMMA / UTMALDG /
    UTMASTG; the same TMA instructions (x 2-D, w 3-D, out 4-D stores, no plain stores)."""
    dev, host = compiled_dd[name]
    cfg = XC_DD_CASES[name][0]
    assert dev.name == "_grouped_gemm_ws_dev_kernel" and host.name == "_grouped_gemm_ws_kernel"
    if cfg.cooperative:
        ws_checks.assert_device_variant(dev, host, 3, loads_per_region=[0, 2], stores_per_region=[1, 0])
    else:
        ws_checks.assert_device_variant(dev, host, 4, loads_per_region=[0, 0, 2], stores_per_region=[1, 1, 0])
    sass = dev.text("sass")
    assert "UTMALDG.2D" in sass and "UTMALDG.3D" in sass and "UTMASTG.4D" in sass
    assert "UTMASTG.2D" not in sass and "STG.E" not in sass
    # The row window's strides: 2**34 - s computed on the device (64-bit), as row_window does on the host.
    assert "tensormap.replace.tile.global_stride" in dev.text("ptx")


@pytest.mark.parametrize("name", list(XC_DD_CASES))
def test_sm90_device_descriptors_resources(compiled_dd, name):
    dev, host = compiled_dd[name]
    cfg = XC_DD_CASES[name][0]
    ws_checks.assert_no_spills(dev)
    ws_checks.assert_warp_specialised(dev, cfg, mconfig)
    shared, host_shared = dev.resources()["shared_bytes"], host.resources()["shared_bytes"]
    assert host_shared < shared <= mconfig.smem_bytes(cfg) + mconfig.WS_DEVICE_DESC_SMEM <= smem_per_block(90)


def test_compile_args_device_descriptors():
    args = mlaunch.compile_args_ws(dtype=torch.float16, trans_w=True, G=5, shape=(2880, 5760), device_desc=True,
                                   sizes_dtype=torch.int64)
    assert args["fn"] is mgluon._grouped_gemm_ws_dev_kernel
    assert list(args["signature"]) == ["x_ptr", "w_ptr", "out_ptr", "sizes_ptr", "M_total", "N", "K", "G",
                                       "stride_xm", "stride_wg", "stride_w1", "stride_om", "group_m"]
    assert args["signature"]["sizes_ptr"] == "*i64" and args["signature"]["x_ptr"] == "*fp16"
    assert args["constexprs"] == {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "NUM_STAGES": 5,
                                  "COOPERATIVE": False, "TRANS_W": True, "G_PAD": 32, "CONSUMER_REGS": 232,
                                  "PRODUCER_REGS": 40}
    assert set(args["divisible"]) == {"x_ptr", "w_ptr", "out_ptr", "sizes_ptr", "N", "K", "stride_xm", "stride_wg",
                                      "stride_w1", "stride_om"}
    assert args["num_warps"] == 4 and args["options"] == {"maxnreg": 168}
    # N = 40, K = 48 (the odd CPU shapes): K is a multiple of 16, N is not.
    odd = mlaunch.compile_args_ws(shape=(40, 48), device_desc=True)
    assert "K" in odd["divisible"] and "N" not in odd["divisible"] and "stride_om" not in odd["divisible"]


# ---------------------------------------------------------- host logic (CPU)
@pytest.mark.parametrize("cfg,match", [
    (dict(block_m=256), "block_m=256 must be 64 or 128"),
    (dict(block_n=96), "block_n=96 must be"),
    (dict(block_k=128), "block_k=128 must be 32 or 64"),
    (dict(block_n=256), "128x256 fp32 accumulator needs 256 registers"),
    (dict(num_stages=1), "num_stages=1"),
    (dict(group_m=0), "group_m=0"),
    (dict(num_sms=0), "num_sms=0"),
    (dict(consumer_regs=230), "consumer_regs=230 must be a multiple of 8"),
    (dict(producer_regs=16), r"producer_regs=16 must be a multiple of 8 in \[24, 256\]"),
    (dict(consumer_regs=248), "exceeds"),
    (dict(num_stages=6), "shared memory"),
    (dict(bogus=1), "unknown config field"),
    (dict(cooperative=True, block_m=64), "block_m=64 must be 128 or 256"),
    (dict(cooperative=True, block_n=256, num_stages=4), "shared memory"),
    (dict(cooperative=1), "cooperative=1 must be True or False"),
])
def test_bad_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        mconfig.validate_ws(cfg)
    with pytest.raises(ValueError, match=match):
        mlaunch.compile_args_ws(cfg)


def test_good_configs_validate():
    for cfg in [GroupedWsConfig(), GroupedWsConfig(num_stages=4), GroupedWsConfig(block_m=64, block_n=256, num_stages=4),
                GroupedWsConfig(cooperative=True, block_n=256, num_stages=3),
                GroupedWsConfig(cooperative=True, block_m=256, num_stages=3)]:
        assert mconfig.validate_ws(cfg) is cfg
    assert mconfig.validate_ws({"num_stages": 3}) == GroupedWsConfig(num_stages=3)
    assert mconfig.validate_ws(None) == GroupedWsConfig()


def test_counts_and_labels():
    assert mconfig.smem_bytes(GroupedWsConfig()) == 5 * 32768 + 65536 + 96 + mconfig.WS_EXTRA_SMEM
    assert mconfig.smem_bytes(GroupedWsConfig()) <= smem_per_block(90)
    assert [mconfig.g_pad(g) for g in (1, 32, 33, 64, 65, 512)] == [32, 32, 64, 64, 128, 512]
    # Grid: one CTA per SM, never more than the tiles could be ((cdiv(M, BM) + G) row blocks).
    assert mlaunch.grid_size(16384, 5760, 4, GroupedWsConfig(), 132) == 132
    assert mlaunch.grid_size(106, 40, 5, GroupedWsConfig(), 132) == 6
    assert mlaunch.grid_size(16384, 5760, 4, GroupedWsConfig(num_sms=3), 132) == 3
    assert GroupedWsConfig().label() == "ws 128x128x64 s5 g8"
    assert GroupedWsConfig(cooperative=True, block_n=256, num_stages=3).label() == "coop 128x256x64 s3 g8"
    assert mconfig.default_partition_regs(GroupedWsConfig()) == 232
    assert mmetrics.flops(10, 3, 4) == 240
    assert tolerance(torch.bfloat16) > tolerance(torch.float16)


def test_reference_is_fp32():
    x = torch.randn(7, 8).to(torch.bfloat16)
    w = torch.randn(2, 8, 3).to(torch.bfloat16)
    sizes = torch.tensor([3, 4])
    r = reference(x, w, sizes, dtype=torch.float32)
    assert r.dtype == torch.float32
    assert torch.allclose(r[:3], x[:3].float() @ w[0].float()) and torch.allclose(r[3:], x[3:].float() @ w[1].float())
    rt = reference(x, w.transpose(1, 2).contiguous(), sizes, trans_w=True, dtype=torch.float32)
    assert torch.allclose(r, rt)


@pytest.mark.parametrize("N,K", [(100, 64), (128, 100), (4, 4), (2884, 5760)])
def test_alignment_error_points_to_fallback(N, K):
    with pytest.raises(ValueError, match=r"multiples of 8.*kernels\.moe\.grouped_gemm"):
        mconfig.check_alignment(N, K, torch.bfloat16)
    mconfig.check_alignment(2880, 5760)
    mconfig.check_alignment(40, 48, torch.float16)


@pytest.mark.parametrize("G", [0, mconfig.WS_MAX_GROUPS + 1, 4096])
def test_too_many_groups(G):
    with pytest.raises(ValueError, match=r"groups.*kernels\.moe\.grouped_gemm"):
        mconfig.check_groups(G)


def test_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(8, 16).to(torch.bfloat16)
    w = torch.randn(2, 16, 8).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"interpreter.*kernels\.moe\.grouped_gemm"):
        mlaunch.grouped_gemm_ws(x, w, torch.tensor([3, 5]))


def _operands(M=8, K=16, N=8, G=2, dtype=torch.float16, trans_w=False):
    x = torch.randn(M, K).to(dtype)
    w = torch.randn(G, N, K).to(dtype) if trans_w else torch.randn(G, K, N).to(dtype)
    return x, w, torch.full((G,), M // G, dtype=torch.int32)


def test_cpu_tensors_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=r"sm_90.*kernels\.moe\.grouped_gemm"):
        mlaunch.grouped_gemm_ws(*_operands())
    with pytest.raises(ValueError, match=r"sm_90.*kernels\.moe\.grouped_gemm"):
        mlaunch.grouped_gemm_ws(*_operands(dtype=torch.bfloat16, trans_w=True), trans_w=True)


def test_other_gpus_are_refused(monkeypatch):
    """The capability check, fed a fake sm_80 / sm_100 device (no GPU here)."""
    for cap in ((8, 0), (10, 0), (12, 0)):
        monkeypatch.setattr(mlaunch, "_capability", lambda index, cap=cap: cap)
        with pytest.raises(ValueError, match=rf"sm_{cap[0]}{cap[1]}.*kernels\.moe\.grouped_gemm"):
            mlaunch._check_device(torch.device("cuda", 0))
    monkeypatch.setattr(mlaunch, "_capability", lambda index: (9, 0))
    mlaunch._check_device(torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"tensors on cpu.*sm_90"):
        mlaunch._check_device(torch.device("cpu"))


@pytest.mark.parametrize("make,match", [
    (lambda: _operands(dtype=torch.float32), r"bfloat16 or both float16.*kernels\.moe\.grouped_gemm"),
    (lambda: (torch.randn(8, 16, dtype=torch.float16), torch.randn(2, 16, 8, dtype=torch.bfloat16),
              torch.tensor([4, 4])), "both float16"),
    (lambda: (torch.randn(8, 16, dtype=torch.float16), torch.randn(16, 8, dtype=torch.float16),
              torch.tensor([4, 4])), r"need x \[M, K\] and w \[G, K, N\]"),
    (lambda: (*_operands()[:2], torch.tensor([4.0, 4.0])), "int32 or int64"),
    (lambda: (*_operands()[:2], torch.tensor([[4, 4]])), "1-D"),
    (lambda: (*_operands()[:2], [4, 4]), "group_sizes must be a torch.Tensor"),
])
def test_bad_operands(monkeypatch, make, match):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=match):
        mlaunch.grouped_gemm_ws(*make())


def test_shape_checks_after_the_device(monkeypatch):
    """Shape errors on a (faked) sm_90 device: K mismatch, G mismatch, too many groups, alignment."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(mlaunch, "_check_device", lambda device: None)
    x, w, s = _operands()
    with pytest.raises(ValueError, match="did you mean trans_w=True"):
        mlaunch._check_ws_operands(x, torch.randn(2, 8, 16, dtype=x.dtype), s, False)
    assert mlaunch._check_ws_operands(x, torch.randn(2, 8, 16, dtype=x.dtype), s, True) == (8, 8, 16, 2)
    with pytest.raises(ValueError, match="3 entries but w has G=2"):
        mlaunch._check_ws_operands(x, w, torch.tensor([1, 2, 5]), False)
    G = mconfig.WS_MAX_GROUPS + 1
    with pytest.raises(ValueError, match=rf"G={G} groups.*kernels\.moe\.grouped_gemm"):
        mlaunch._check_ws_operands(x, torch.randn(G, 16, 8, dtype=x.dtype), torch.zeros(G, dtype=torch.int32), False)
    with pytest.raises(ValueError, match=r"K=12 and N=8 must be multiples of 8.*kernels\.moe\.grouped_gemm"):
        mlaunch._check_ws_operands(torch.randn(8, 12, dtype=x.dtype), torch.randn(2, 12, 8, dtype=x.dtype), s, False)
    with pytest.raises(ValueError, match=r"K=16 and N=20"):
        mlaunch._check_ws_operands(x, torch.randn(2, 20, 16, dtype=x.dtype), s, True)
    assert mlaunch._check_ws_operands(torch.randn(0, 16, dtype=x.dtype), w, s, False) == (0, 8, 16, 2)


def test_device_descriptors_are_the_measured_default():
    """Both kernels build their descriptors in the kernel by default (measured: results/launch_cost/descriptors/)."""
    assert mlaunch.GLUON_DEVICE_DESCRIPTORS is True
    assert mlaunch.DEVICE_DESCRIPTORS is True


@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("cfg", [GroupedWsConfig(), GroupedWsConfig(cooperative=True, block_n=256, num_stages=3)],
                         ids=lambda c: c.label())
def test_gluon_device_descriptor_plans(monkeypatch, cfg, trans_w):
    """grouped_gemm_ws's plans (CPU tensors, the device check faked): the switch picks the
    kernel and is part of the plan key; the launch passes what the kernel takes; operands
    the device variant may not take keep host descriptors."""
    from triton.runtime.jit import mangle_type

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(mlaunch, "_check_device", lambda device: None)
    mlaunch.clear_plans()
    M, N, K, G = 106, 40, 48, 5
    x = torch.randn(M, K).half()
    w = torch.randn(*((G, N, K) if trans_w else (G, K, N))).half()
    sizes = torch.tensor([0, 37, 5, 0, 64], dtype=torch.int32)
    out = torch.empty(M, 64).half()[:, :N]   # rows 128 bytes apart
    monkeypatch.setattr(mlaunch, "GLUON_DEVICE_DESCRIPTORS", False)
    host = mlaunch.plan_for_ws(x, w, sizes, trans_w=trans_w, config=cfg, out=out)
    assert host.gluon and not host.device_desc and host.kernel is mgluon._grouped_gemm_ws_kernel
    assert len(host.descs) == 3 and host.args == (M, G, cfg.group_m)
    monkeypatch.setattr(mlaunch, "GLUON_DEVICE_DESCRIPTORS", True)
    dev = mlaunch.plan_for_ws(x, w, sizes, trans_w=trans_w, config=cfg, out=out)
    assert dev.gluon and dev.device_desc and dev.kernel is mgluon._grouped_gemm_ws_dev_kernel
    assert dev.descs == () and dev.grid == host.grid
    assert dev.args == (M, N, K, G, K, w.stride(0), w.stride(1), 64, cfg.group_m)
    assert {k: dev.meta[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "TRANS_W")} == \
        {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "TRANS_W": trans_w}
    assert len(mlaunch._WS_PLANS) == 2
    assert mlaunch.plan_for_ws(x, w, sizes, trans_w=trans_w, config=cfg, out=out) is dev
    # What _launch passes (x, w, out, sizes, *args) is what compile_args_ws describes, in order.
    sig = mlaunch.compile_args_ws(cfg, torch.float16, trans_w, G=G, device_desc=True)["signature"]
    assert len(dev.launcher._slots) == 4 + len(dev.args)
    assert [mangle_type(a) for a in (x, w, out, sizes, *dev.args)] == list(sig.values())
    # One weight for every group (stride 0 over G): host descriptors, as for the Triton kernels.
    w_bc = w[:1].expand(G, *w.shape[1:])
    p = mlaunch.plan_for_ws(x, w_bc, sizes, trans_w=trans_w, config=cfg, out=out)
    assert not p.device_desc and p.kernel is mgluon._grouped_gemm_ws_kernel


def test_gluon_device_descriptors_need_room_in_shared_memory(monkeypatch):
    """A config whose device variant would not fit sm_90's shared memory (the descriptors'
    staging on top of ws_smem_bytes) keeps host descriptors."""
    from kernels.gemm import config as gconfig

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(mlaunch, "_check_device", lambda device: None)
    monkeypatch.setattr(mlaunch, "GLUON_DEVICE_DESCRIPTORS", True)
    mlaunch.clear_plans()
    x, w, sizes = _operands(M=64, K=48, N=40, G=2)
    cfg = GroupedWsConfig()
    assert mlaunch.plan_for_ws(x, w, sizes, config=cfg).device_desc
    mlaunch.clear_plans()
    monkeypatch.setattr(gconfig, "SMEM_LIMIT_SM90", mconfig.smem_bytes(cfg) + gconfig.WS_DEVICE_DESC_SMEM - 1)
    assert not mlaunch.plan_for_ws(x, w, sizes, config=cfg).device_desc
    mlaunch.clear_plans()


# ------------------------------------- the tile schedule, modelled on the host
def _schedule_model(sizes, M_total, N, BM, BN, group_m):
    """A plain-Python transcription of _schedule + _locate (int arithmetic, same
    max/min tricks): tile index -> (group, first row, rows, off_m, off_n)."""
    sizes = [max(int(s), 0) for s in sizes]
    cum, row_ends, tile_ends, acc_t = 0, [], [], 0
    n_tiles = -(-N // BN)
    for s in sizes:
        cum += s
        end = min(cum, M_total)
        rows = end - min(cum - s, M_total)
        acc_t += -(-rows // BM) * n_tiles
        row_ends.append(end)
        tile_ends.append(acc_t)
    total = max(tile_ends)
    tiles = []
    for t in range(total):
        before = [te <= t for te in tile_ends]
        g = sum(before)
        tile0 = max([te for te, b in zip(tile_ends, before) if b], default=0)
        row0 = max([re_ for re_, b in zip(row_ends, before) if b], default=0)
        m_g = min(re_ for re_, b in zip(row_ends, before) if not b) - row0
        local = t - tile0
        num_pid_m = -(-m_g // BM)
        band = local // (group_m * n_tiles)
        first_m = band * group_m
        rows_in_band = min(num_pid_m - first_m, group_m)
        inside = local - band * group_m * n_tiles
        tiles.append((g, row0, m_g, (first_m + inside % rows_in_band) * BM, inside // rows_in_band * BN))
    return tiles


@pytest.mark.parametrize("sizes,M_total", [
    ([0, 37, 5, 0, 64], 106), ([0, 0, 300, 0], 300), ([0, 0, 0], 0), ([50, 60], 80),  # the last group clipped
    ("random64", None), ("random512", None),
])
def test_schedule_covers_every_tile_once(sizes, M_total):
    """Every (group, row block, column block) gets exactly one tile, with the group's
    first row and row count; empty groups get none; groups are clipped at M_total."""
    rng = random.Random(7)
    if isinstance(sizes, str):
        G = int(sizes[6:])
        sizes = [rng.choice([0, 0, rng.randrange(1, 300)]) for _ in range(G)]
        M_total = sum(sizes)
    BM, BN, N = 32, 16, 40
    for group_m in (1, 3, 8):
        tiles = _schedule_model(sizes, M_total, N, BM, BN, group_m)
        want, start = set(), 0
        for g, s in enumerate(sizes):
            rows = max(0, min(start + s, M_total) - min(start, M_total))
            for m in range(0, rows, BM):
                for n in range(0, N, BN):
                    want.add((g, min(start, M_total), rows, m, n))
            start += s
        assert len(tiles) == len(want) and set(tiles) == want


# ----------------------------------------------------------------------- GPU
# name -> (sizes or "randomG" or "randomG-zeros", K, N of the call (N = output width),
# trans_w, dtype, config fields, extra rows past sum(sizes), sizes dtype).
# Seed shapes at reduced token counts: gpt-oss-20B GateUP fwd (N=5760, K=2880), its dgrad
# (out 2880 = 22.5 tiles of 128, K=5760), Down (2880, 2880); DeepSeek-V3 (4096, 7168), (7168, 2048).
_ODD = [0, 37, 5, 0, 64]
GPU_CASES: dict[str, tuple] = {}
for _dt in ("bfloat16", "float16"):
    for _tw in (False, True):
        _op = "dgrad" if _tw else "fwd"
        GPU_CASES[f"odd-{_op}-{_dt}"] = (_ODD, 48, 40, _tw, _dt, {}, 0, "int32")
        GPU_CASES[f"odd-{_op}-{_dt}-coop"] = (_ODD, 48, 40, _tw, _dt, dict(cooperative=True, block_n=256,
                                                                            num_stages=3), 0, "int32")
        GPU_CASES[f"g64-{_op}-{_dt}"] = ("random64-zeros", 264, 136, _tw, _dt, {}, 0, "int64")
        GPU_CASES[f"gptoss-gateup-{_op}-{_dt}"] = ([300, 0, 517, 211], 5760 if _tw else 2880,
                                                   2880 if _tw else 5760, _tw, _dt, {}, 0, "int32")
        GPU_CASES[f"gptoss-down-{_op}-{_dt}"] = ("random32", 2880, 2880, _tw, _dt, dict(num_stages=4), 0, "int32")
for _tw in (False, True):
    _op = "dgrad" if _tw else "fwd"
    GPU_CASES[f"dsv3-gateup-{_op}"] = ("random16", 4096 if _tw else 7168, 7168 if _tw else 4096, _tw,
                                       "bfloat16", {}, 0, "int32")
    GPU_CASES[f"dsv3-down-{_op}"] = ("random16-zeros", 7168 if _tw else 2048, 2048 if _tw else 7168, _tw,
                                     "bfloat16", {}, 0, "int32")
    GPU_CASES[f"gptoss-down-{_op}-coop"] = ("random8", 2880, 2880, _tw, "bfloat16",
                                            dict(cooperative=True, block_n=256, num_stages=3), 0, "int32")
    GPU_CASES[f"gptoss-down-{_op}-coop256x128"] = ("random8", 2880, 2880, _tw, "float16",
                                                   dict(cooperative=True, block_m=256, num_stages=3), 0, "int32")
    GPU_CASES[f"g512-{_op}"] = ("random512-zeros", 64, 72, _tw, "bfloat16", {}, 0, "int32")
    # Few CTAs: many tiles per CTA and per consumer, across group boundaries, odd and even counts.
    GPU_CASES[f"sms3-{_op}"] = ("random12-zeros", 520, 264, _tw, "bfloat16", dict(num_sms=3, group_m=3), 0, "int32")
    GPU_CASES[f"sms4-s2-{_op}"] = ("random12-zeros", 4104, 264, _tw, "float16",
                                   dict(num_sms=4, num_stages=2), 0, "int32")
    GPU_CASES[f"64x256x32-{_op}"] = ("random12-zeros", 520, 264, _tw, "bfloat16",
                                     dict(block_m=64, block_n=256, block_k=32, num_stages=6), 0, "int32")
    # Rows past sum(sizes) must stay untouched (NaN): the row window clips the last group.
    GPU_CASES[f"tail-rows-{_op}"] = ([0, 70, 0, 33], 128, 136, _tw, "bfloat16", {}, 45, "int32")
    GPU_CASES[f"all-empty-{_op}"] = ([0, 0, 0], 64, 64, _tw, "bfloat16", {}, 16, "int32")
    GPU_CASES[f"one-row-{_op}"] = ([0, 1], 8, 8, _tw, "float16", {}, 0, "int32")

_GPU_SCRIPT = textwrap.dedent("""
    import json, random, sys
    import torch
    sys.path.insert(0, {root!r})
    from kernels.moe import launch as mlaunch
    from kernels.moe.reference import reference, tolerance
    seed = int(sys.argv[2])
    mlaunch.GLUON_DEVICE_DESCRIPTORS = len(sys.argv) > 3 and sys.argv[3] == "device"
    out = {{}}
    for i, (name, (sizes, K, N, trans_w, dt, cfg, extra, sdt)) in enumerate(json.loads(sys.argv[1]).items()):
        rng = random.Random(seed + i)  # fresh inputs per case and run
        if isinstance(sizes, str):
            G = int(sizes[6:].split("-")[0])
            zeros = sizes.endswith("-zeros")
            top = 2048 if K * N < 2**22 else 700
            sizes = [0 if zeros and rng.random() < 0.3 else rng.randrange(1, max(2, top // max(1, G // 16)))
                     for _ in range(G)]
        dtype = getattr(torch, dt)
        G, M = len(sizes), sum(sizes) + extra
        g = torch.Generator(device="cuda").manual_seed(seed + i)
        x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        w = (torch.randn(G, *((N, K) if trans_w else (K, N)), device="cuda", generator=g) / K ** 0.5).to(dtype)
        s = torch.tensor(sizes, device="cuda", dtype=getattr(torch, sdt))
        c = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)  # poisoned
        rec = {{"sizes": sizes if G <= 16 else f"{{G}} groups, {{sum(sizes)}} rows"}}
        try:
            mlaunch.grouped_gemm_ws(x, w, s, trans_w=trans_w, config=cfg or None, out=c)
            torch.cuda.synchronize()
            rows = sum(sizes)
            ref = reference(x[:rows], w, s, trans_w=trans_w, dtype=torch.float32)
            got = c[:rows].float()
            rec["finite"] = bool(torch.isfinite(got).all())
            rec["untouched"] = bool(torch.isnan(c[rows:]).all())
            rec["err"] = float((got - ref).norm() / ref.norm().clamp_min(1e-30)) if rows else 0.0
            rec["tol"] = tolerance(dtype)
            rec["device_desc"] = mlaunch.plan_for_ws(x, w, s, trans_w=trans_w, config=cfg or None, out=c).device_desc
        except Exception as exc:
            rec["error"] = f"{{type(exc).__name__}}: {{exc}}"[:800]
        out[name] = rec
        print(json.dumps({{name: rec}}), file=sys.stderr, flush=True)
    print(json.dumps(out))
""")
GPU_SEED = random.SystemRandom().randrange(2**20)


@pytest.fixture(scope="module")
def gpu_results():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("grouped_gemm_ws needs an sm_90 (Hopper) GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        r = subprocess.run([sys.executable, "-c", _GPU_SCRIPT.format(root=str(ROOT)), json.dumps(GPU_CASES),
                            str(GPU_SEED)], capture_output=True, text=True, env=env, timeout=400, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        done = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"the GPU cases did not finish in 400 s (a hang?), seed {GPU_SEED}; finished before it:\n"
                    f"{done[-3000:]}")
    assert r.returncode == 0, f"seed {GPU_SEED}: {r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_correct(gpu_results, name):
    res = gpu_results[name]
    assert "error" not in res, (GPU_SEED, res)
    assert res["finite"], (GPU_SEED, "NaN left in the output: some tile was never written", res)
    assert res["untouched"], (GPU_SEED, "rows past sum(sizes) were written: the row window leaked", res)
    assert res["err"] < res["tol"], (GPU_SEED, res)


@pytest.mark.gpu
def test_gpu_refusals():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("grouped_gemm_ws needs an sm_90 (Hopper) GPU")
    x = torch.randn(64, 100, device="cuda").to(torch.bfloat16)
    w = torch.randn(2, 100, 64, device="cuda").to(torch.bfloat16)
    s = torch.tensor([30, 34], device="cuda")
    with pytest.raises(ValueError, match=r"multiples of 8.*kernels\.moe\.grouped_gemm"):
        mlaunch.grouped_gemm_ws(x, w, s)
    with pytest.raises(ValueError, match=r"bfloat16 or both float16.*kernels\.moe\.grouped_gemm"):
        mlaunch.grouped_gemm_ws(x.float(), w.float(), s)
    with pytest.raises(ValueError, match="one device"):
        mlaunch.grouped_gemm_ws(x, w, s.cpu())


def test_default_path_hands_over_only_on_sm90():
    """grouped_gemm runs the Triton kernel on a CPU (and with a config); its
    per-layer stages for the Gluon kernel come from the H200 probe."""
    x, w, s = torch.randn(8, 16), torch.randn(2, 16, 24), torch.tensor([3, 5])
    assert not mlaunch.can_run(x.bfloat16(), w.bfloat16(), s, None, False)
    if interpreter.active():   # CPU tensors run only there (elsewhere grouped_gemm refuses them)
        assert mlaunch.default_label(x, w, s) == mconfig.pick_config("fwd", 24, 16, x.device).label()
    assert mconfig.pick_ws_config("fwd", 2880, 2880).num_stages == 4
    assert (mconfig.pick_ws_config("dgrad", 2880, 5760) == mconfig.WS_DEFAULT_CONFIG
            and mconfig.WS_DEFAULT_CONFIG.num_stages == 5)


# ----------------------------------------------- GPU: device descriptors (Gluon)
# Every GPU_CASES case again with GLUON_DEVICE_DESCRIPTORS on (other inputs): the kernel's
# partitions encode their descriptors; consecutive cases reuse the same scratch slots, so a
# descriptor left over from the previous case would read and write that case's tensors.
@pytest.fixture(scope="module")
def gpu_dd_results():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("grouped_gemm_ws needs an sm_90 (Hopper) GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        r = subprocess.run([sys.executable, "-c", _GPU_SCRIPT.format(root=str(ROOT)), json.dumps(GPU_CASES),
                            str(GPU_SEED + 1), "device"], capture_output=True, text=True, env=env, timeout=400,
                           cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        done = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"the GPU cases did not finish in 400 s (a hang?), seed {GPU_SEED + 1}; finished before it:\n"
                    f"{done[-3000:]}")
    assert r.returncode == 0, f"seed {GPU_SEED + 1}: {r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_device_descriptors_correct(gpu_dd_results, name):
    res = gpu_dd_results[name]
    assert "error" not in res, (GPU_SEED + 1, res)
    assert res["device_desc"], res
    assert res["finite"], (GPU_SEED + 1, "NaN left in the output: some tile was never written", res)
    assert res["untouched"], (GPU_SEED + 1, "rows past sum(sizes) were written: the row window leaked", res)
    assert res["err"] < res["tol"], (GPU_SEED + 1, res)


# grouped_gemm's default fwd / dgrad path (the Gluon kernel) with device descriptors: right on
# fresh inputs, and a CUDA graph captured on a side stream replays right after the scratch
# pool has grown, with a new routing and new x copied in. In a child process (a hang fails).
_GPU_DD_GRAPH_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, {root!r})
    from kernels import moe
    from kernels.common import launcher
    from kernels.moe import launch as ml, routing as rt
    from kernels.moe.reference import reference, tolerance
    ml.GLUON_DEVICE_DESCRIPTORS = True
    G, M, K, N = 8, 4096, 512, 2880
    sizes = rt.mild(M, G, seed=13, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(5)
    x = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(G, K, N, device="cuda", generator=g) / K ** 0.5).to(torch.bfloat16)
    dy = torch.randn(M, N, device="cuda", generator=g).to(torch.bfloat16)
    ops = {{"fwd": (x, False, N), "dgrad": (dy, True, K)}}
    out = {{}}

    def err(got, a, trans_w):
        ref = reference(a, w, sizes, trans_w=trans_w)
        return float((got.double() - ref).norm() / ref.norm()), bool(torch.isfinite(got).all())

    for op, (a, trans_w, width) in ops.items():
        rec = {{}}
        try:
            p = ml.plan_for(a, w, sizes, trans_w=trans_w)
            rec.update(label=p.label, device_desc=p.device_desc, fn=p.kernel.__name__)
            c = moe.grouped_gemm(a, w, sizes, trans_w=trans_w)
            torch.cuda.synchronize()
            rec["eager_err"], rec["eager_finite"] = err(c, a, trans_w)
            c = torch.full((M, width), float("nan"), device="cuda", dtype=torch.bfloat16)
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                moe.grouped_gemm(a, w, sizes, trans_w=trans_w, out=c)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=s):
                moe.grouped_gemm(a, w, sizes, trans_w=trans_w, out=c)
            for key in list(launcher._SCRATCH):
                launcher.scratch(*key, 1 << 24)
            sizes.copy_(rt.mild(M, G, seed=29 + len(out), device="cuda"))
            a.copy_(torch.randn(a.shape, device="cuda", generator=g).to(a.dtype))
            c.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            rec["graph_err"], rec["graph_finite"] = err(c, a, trans_w)
            rec["tol"] = tolerance(torch.bfloat16)
        except Exception as exc:
            rec["error"] = f"{{type(exc).__name__}}: {{exc}}"[:800]
        out[op] = rec
        print(json.dumps({{op: rec}}), file=sys.stderr, flush=True)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def gpu_dd_graph_results():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernel needs an sm_90 (Hopper) GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        r = subprocess.run([sys.executable, "-c", _GPU_DD_GRAPH_SCRIPT.format(root=str(ROOT))], capture_output=True,
                           text=True, env=env, timeout=300, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        done = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"grouped_gemm with device descriptors did not finish in 300 s (a hang?):\n{done[-3000:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("op", ["fwd", "dgrad"])
def test_gpu_device_descriptors_default_path_and_graph(gpu_dd_graph_results, op):
    res = gpu_dd_graph_results[op]
    assert "error" not in res, res
    assert res["label"].startswith("gluon") and res["device_desc"] and res["fn"] == "_grouped_gemm_ws_dev_kernel"
    assert res["eager_finite"] and res["eager_err"] < res["tol"], res
    assert res["graph_finite"] and res["graph_err"] < res["tol"], res
