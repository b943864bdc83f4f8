"""kernels.gemm.gluon (via matmul_ws): sm_90 cross-compilation (CPU), host-side checks (CPU), and
GPU correctness (marked gpu; run in a child process with a timeout, because a
warp-specialised kernel with a synchronisation bug hangs instead of failing)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import ws_checks  # tests/ws_checks.py (pytest puts tests/ on the path)
from kernels import gemm
from kernels.gemm import config as gconfig, gluon as ggluon, launch as glaunch, sweep as gsweep
from kernels.gemm import WsConfig
from workbench.asm.resources import smem_per_block

ROOT = Path(__file__).resolve().parents[1]

# ------------------------------------------------ cross-compiled for sm_90 (CPU)
XC_CONFIGS = {
    "128x128x64-s4": WsConfig(),
    "64x256x64-s4": WsConfig(block_m=64, block_n=256, num_stages=4),
    "128x128x32-s8-r224/56": WsConfig(block_k=32, num_stages=8, consumer_regs=224, producer_regs=56),
    "coop-128x256x64-s3": WsConfig(cooperative=True, block_n=256, num_stages=3),
    "coop-256x128x32-s6": WsConfig(cooperative=True, block_m=256, block_k=32, num_stages=6),
}
XC_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
XC_CASES = [(c, d) for c in XC_CONFIGS for d in XC_DTYPES]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """(config name, dtype name) -> the cross-compiled cache entry (compiled in a child
    process: see ws_checks.compile_ws)."""
    import dataclasses

    cases = [{"module": "gemm", "config": dataclasses.asdict(XC_CONFIGS[c]), "dtype": str(XC_DTYPES[d])[6:],
              "dir": str(tmp_path_factory.mktemp(f"xc{i}")), "kwargs": {"shape": [4096, 4096, 4096]}}
             for i, (c, d) in enumerate(XC_CASES)]
    return dict(zip(XC_CASES, ws_checks.compile_ws(cases, ROOT)))


@pytest.mark.parametrize("cname,dname", XC_CASES)
def test_sm90_uses_wgmma(compiled, cname, dname):
    e, cfg = compiled[cname, dname], XC_CONFIGS[cname]
    # One warpgroup per consumer issues m64nBLOCK_Nk16 wgmma (HGMMA in SASS, where
    # fp16 inputs are the default and go unnamed: HGMMA.64x128x16.F32).
    hgmma = ws_checks.mnemonics(e, "sass", "matrix")
    expect = {"bf16": f"HGMMA.64x{cfg.block_n}x16.F32.BF16:", "fp16": f"HGMMA.64x{cfg.block_n}x16.F32:"}[dname]
    assert expect in hgmma, hgmma
    ptx_kind = {"bf16": "bf16", "fp16": "f16"}[dname]
    assert f"wgmma.mma_async.sync.aligned.m64n{cfg.block_n}k16.f32.{ptx_kind}.{ptx_kind}:" in ws_checks.mnemonics(e, "ptx", "matrix")
    # Operands arrive and C leaves through the TMA engine.
    sass = e.text("sass")
    assert "UTMALDG.2D" in sass and "UTMASTG.2D" in sass


@pytest.mark.parametrize("cname,dname", XC_CASES)
def test_sm90_no_spills(compiled, cname, dname):
    ws_checks.assert_no_spills(compiled[cname, dname])


@pytest.mark.parametrize("cname,dname", XC_CASES)
def test_sm90_warp_specialised(compiled, cname, dname):
    ws_checks.assert_warp_specialised(compiled[cname, dname], XC_CONFIGS[cname], gconfig)


@pytest.mark.parametrize("cname,dname", XC_CASES)
def test_sm90_shared_memory_fits(compiled, cname, dname):
    ws_checks.assert_smem_fits(compiled[cname, dname], XC_CONFIGS[cname], gconfig, smem_per_block(90))


def test_compile_args_surface():
    args = glaunch.compile_args_ws(dtype=torch.float16)
    assert args["fn"] is ggluon._gemm_ws_kernel
    assert args["num_warps"] == 4 and args["options"] == {"maxnreg": 168}
    assert glaunch.compile_args_ws(WsConfig(cooperative=True, block_n=256, num_stages=3))["num_warps"] == 8
    # Gluon descriptors carry their shared-memory layout in the signature.
    assert args["signature"]["a_desc"].startswith("tensordesc<fp16[128, 64],NVMMASharedLayout(")
    assert args["signature"]["c_desc"].startswith("tensordesc<fp16[128, 128],")
    assert args["constexprs"] == {"NUM_STAGES": 4, "COOPERATIVE": False, "CONSUMER_REGS": 232, "PRODUCER_REGS": 40,
                                  "B_KMAJOR": False}
    with pytest.raises(ValueError, match="float16"):
        glaunch.compile_args_ws(dtype=torch.float32)


# ------------------------------- B K-major (x @ w.t()), cross-compiled for sm_90 (CPU)
def test_sm90_b_kmajor_reads_b_transposed_in_shared_memory(tmp_path):
    """With B_KMAJOR the B boxes are (BLOCK_N, BLOCK_K) tiles of B^T and wgmma reads them
    K-major (PTX imm-trans-b 0); row-major B is the transposed case (1). Both descriptor
    variants, both schedules; same shared memory as the row-major kernel."""
    import dataclasses
    import re

    cfgs = [WsConfig(num_stages=5), WsConfig(cooperative=True, block_n=256, block_k=32, num_stages=6)]
    cases = [{"module": "gemm", "config": dataclasses.asdict(cfg), "dtype": "bfloat16",
              "dir": str(tmp_path / f"km{i}{dd:d}{km:d}"),
              "kwargs": {"shape": [4096, 4096, 4096], "device_desc": dd, "b_kmajor": km}}
             for i, cfg in enumerate(cfgs) for dd in (False, True) for km in (False, True)]
    entries = ws_checks.compile_ws(cases, ROOT)
    trans_b = re.compile(r"wgmma\.mma_async[^;]*,\s*[01],\s*[01],\s*[01],\s*([01]);")
    for case, e in zip(cases, entries):
        flags = set(trans_b.findall(e.text("ptx")))
        assert flags == ({"0"} if case["kwargs"]["b_kmajor"] else {"1"}), (case["dir"], flags)
    for row, km in zip(entries[::2], entries[1::2]):
        assert row.metadata["shared"] == km.metadata["shared"]


# ------------------------- device descriptors, cross-compiled for sm_90 (CPU)
# name -> (config, dtype name); each compiled with host and with device descriptors. The
# heuristic's two Gluon configs (kernels.gemm.config._GLUON_PINGPONG / _GLUON_COOP) first.
XC_DD_CASES = {
    "pingpong-s5-bf16": (WsConfig(num_stages=5), "bf16"),
    "coop-128x256x32-s6-bf16": (WsConfig(cooperative=True, block_n=256, block_k=32, num_stages=6), "bf16"),
    "pingpong-64x256-fp16": (WsConfig(block_m=64, block_n=256, num_stages=4), "fp16"),
    "coop-256x128x32-fp16": (WsConfig(cooperative=True, block_m=256, block_k=32, num_stages=6), "fp16"),
}


@pytest.fixture(scope="module")
def compiled_dd(tmp_path_factory):
    """name -> (device-descriptor entry, host-descriptor entry), compiled in a child process."""
    import dataclasses

    cases = []
    for i, (cfg, dname) in enumerate(XC_DD_CASES.values()):
        for dd in (True, False):
            cases.append({"module": "gemm", "config": dataclasses.asdict(cfg),
                          "dtype": str(XC_DTYPES[dname])[6:], "dir": str(tmp_path_factory.mktemp(f"xcdd{i}{dd:d}")),
                          "kwargs": {"shape": [4096, 4096, 4096], "device_desc": dd}})
    entries = ws_checks.compile_ws(cases, ROOT)
    return {name: (entries[2 * i], entries[2 * i + 1]) for i, name in enumerate(XC_DD_CASES)}


@pytest.mark.parametrize("name", list(XC_DD_CASES))
def test_sm90_device_descriptors(compiled_dd, name):
    """The device-descriptor kernel compiles for sm_90; each partition builds the
    descriptors it issues TMA copies with (ping-pong: consumer 0 = default region and
    consumer 1 C's, the producer A's and B's; cooperative: the consumer C's, the producer
    A's and B's) in the global scratch, with the tensormap fences; the main loops hold
    the host variant's HGMMA / UTMALDG / UTMASTG."""
    dev, host = compiled_dd[name]
    cfg = XC_DD_CASES[name][0]
    assert dev.name == "_gemm_ws_dev_kernel" and host.name == "_gemm_ws_kernel"
    if cfg.cooperative:
        ws_checks.assert_device_variant(dev, host, 3, loads_per_region=[0, 2], stores_per_region=[1, 0])
    else:
        ws_checks.assert_device_variant(dev, host, 4, loads_per_region=[0, 0, 2], stores_per_region=[1, 1, 0])


@pytest.mark.parametrize("name", list(XC_DD_CASES))
def test_sm90_device_descriptors_resources(compiled_dd, name):
    """No spills, the same partitions and registers as the host variant, and shared
    memory within the model plus WS_DEVICE_DESC_SMEM (the descriptors' staging)."""
    dev, host = compiled_dd[name]
    cfg = XC_DD_CASES[name][0]
    ws_checks.assert_no_spills(dev)
    ws_checks.assert_warp_specialised(dev, cfg, gconfig)
    shared, host_shared = dev.resources()["shared_bytes"], host.resources()["shared_bytes"]
    assert host_shared < shared <= gconfig.ws_smem_bytes(cfg) + gconfig.WS_DEVICE_DESC_SMEM
    assert shared <= smem_per_block(90) and gconfig.ws_device_desc_fits(cfg)


def test_compile_args_device_descriptors():
    args = glaunch.compile_args_ws(dtype=torch.float16, shape=(4096, 4104, 4096), device_desc=True)
    assert args["fn"] is ggluon._gemm_ws_dev_kernel
    assert list(args["signature"]) == ["a_ptr", "b_ptr", "c_ptr", "M", "N", "K", "stride_am", "stride_bk",
                                       "stride_cm", "group_m"]
    assert args["signature"]["a_ptr"] == "*fp16" and args["signature"]["M"] == "i32"
    assert args["constexprs"] == {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "NUM_STAGES": 4,
                                  "COOPERATIVE": False, "CONSUMER_REGS": 232, "PRODUCER_REGS": 40, "B_KMAJOR": False}
    # N = 4104 is not a multiple of 16: neither it nor the strides that equal it count as such.
    assert sorted(args["divisible"]) == sorted(["a_ptr", "b_ptr", "c_ptr", "K", "stride_am"])
    assert args["num_warps"] == 4 and args["options"] == {"maxnreg": 168}
    via_matmul = glaunch.compile_args(dict(gluon="coop", block_n=256, num_stages=3), device_desc=True)
    assert via_matmul["fn"] is ggluon._gemm_ws_dev_kernel and via_matmul["constexprs"]["COOPERATIVE"]


# ---------------------------------------------------------- host logic (CPU)
def _ws_operands(M=256, N=192, K=96, dtype=torch.bfloat16):
    return torch.randn(M, K).to(dtype), torch.randn(K, N).to(dtype)


def test_device_descriptors_are_the_measured_default():
    """Both kernels build their descriptors in the kernel by default (measured: results/launch_cost/descriptors/)."""
    assert glaunch.GLUON_DEVICE_DESCRIPTORS is True
    assert glaunch.DEVICE_DESCRIPTORS is True


def test_gluon_device_descriptor_legality(monkeypatch):
    """The Triton kernels' rule (device_desc_ok) for A, B and C, and the config's shared
    memory with the descriptors' staging on top."""
    ok = glaunch._ws_device_desc_ok
    a, b = _ws_operands()
    cfg = WsConfig()
    assert ok(a, b, None, cfg)
    assert ok(a, b, torch.empty(256, 200, dtype=a.dtype)[:, :192], cfg)    # C with padded rows (400 B)
    assert not ok(a, b, torch.empty(256, 196, dtype=a.dtype)[:, :192], cfg)  # C rows 392 B: not 16-byte aligned
    assert not ok(torch.randn(1, 96).to(a.dtype).expand(256, 96), b, None, cfg)  # A broadcast: row stride 0
    assert not ok(a, torch.randn(96 * 192 + 1).to(b.dtype)[1:].view(96, 192), None, cfg)  # B's base off 16 B
    assert not ok(a.t().contiguous().t(), b, None, cfg)                      # A column-major
    # A config whose device variant would not fit sm_90's shared memory keeps host descriptors.
    need = gconfig.ws_smem_bytes(cfg) + gconfig.WS_DEVICE_DESC_SMEM
    monkeypatch.setattr(gconfig, "SMEM_LIMIT_SM90", need - 1)
    assert not ok(a, b, None, cfg) and not gconfig.ws_device_desc_fits(cfg)
    monkeypatch.setattr(gconfig, "SMEM_LIMIT_SM90", need)
    assert ok(a, b, None, cfg)


@pytest.mark.parametrize("cfg", [WsConfig(), WsConfig(cooperative=True, block_n=256, num_stages=3)],
                         ids=lambda c: c.label())
def test_gluon_device_descriptor_plans(monkeypatch, cfg):
    """matmul_ws's plans (CPU tensors, device checks faked): the switch picks the kernel,
    it is part of the plan key, and the launch passes what the kernel takes."""
    from triton.runtime.jit import mangle_type

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(glaunch, "_check_ws_operands", lambda a, b: None)
    monkeypatch.setattr(glaunch, "_device_index", lambda t: 0)
    monkeypatch.setattr(glaunch, "_sm_count", lambda index: 132)
    monkeypatch.setattr(glaunch, "_WS_PLANS", glaunch.PlanCache())
    a, b = _ws_operands(dtype=torch.float16)
    out = torch.empty(256, 200, dtype=a.dtype)[:, :192]
    monkeypatch.setattr(glaunch, "GLUON_DEVICE_DESCRIPTORS", False)
    host = glaunch.plan_for_ws(a, b, cfg, out)
    assert (host.kind, host.device_desc, host.launch.fn) == ("gluon", False, ggluon._gemm_ws_kernel)
    assert len(host.blocks) == 3 and host.args == (cfg.group_m,)
    monkeypatch.setattr(glaunch, "GLUON_DEVICE_DESCRIPTORS", True)
    dev = glaunch.plan_for_ws(a, b, cfg, out)
    assert (dev.kind, dev.device_desc, dev.launch.fn) == ("gluon", True, ggluon._gemm_ws_dev_kernel)
    assert dev.blocks == () and dev.args == (256, 192, 96, 96, 192, 200, cfg.group_m)
    assert len(glaunch._WS_PLANS) == 2 and glaunch.plan_for_ws(a, b, cfg, out) is dev
    assert dev.launch.grid == host.launch.grid and dev.programs == host.programs
    assert {k: dev.launch.kwargs[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")} == \
        {"BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}
    # What the launch passes (a, b, out, *args) is what compile_args_ws describes, in order.
    sig = glaunch.compile_args_ws(cfg, torch.float16, device_desc=True)["signature"]
    assert len(dev.launch._slots) == 3 + len(dev.args)
    assert [mangle_type(x) for x in (a, b, out, *dev.args)] == list(sig.values())
    # Illegal for the device variant (C's rows not 16-byte aligned would also stop the host
    # one, so take a broadcast A): host descriptors even with the switch on.
    a_bc = torch.randn(1, 96).half().expand(256, 96)
    p = glaunch.plan_for_ws(a_bc, b, cfg)
    assert not p.device_desc and p.launch.fn is ggluon._gemm_ws_kernel


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
    (dict(block_m=64, block_n=256, num_stages=5), "shared memory"),
    (dict(bogus=1), "unknown config field"),
    (dict(cooperative=True, block_m=64), "block_m=64 must be 128 or 256"),
    (dict(cooperative=True, block_m=256, block_n=256), "256x256 fp32 accumulator needs 256 registers"),
    (dict(cooperative=True, block_n=256, num_stages=4), "shared memory"),
    (dict(cooperative=1), "cooperative=1 must be True or False"),
])
def test_bad_config(cfg, match):
    with pytest.raises(ValueError, match=match):
        gconfig.validate_ws(cfg)
    with pytest.raises(ValueError, match=match):
        glaunch.compile_args_ws(cfg)


def test_good_configs_validate():
    for cfg in [WsConfig(), WsConfig(num_stages=5), WsConfig(block_m=64, block_n=256),
                WsConfig(block_m=64, block_n=128, num_stages=6), WsConfig(consumer_regs=240, producer_regs=24),
                WsConfig(cooperative=True, block_n=256, num_stages=3), WsConfig(cooperative=True, block_m=256, num_stages=3),
                WsConfig(cooperative=True, block_n=256, block_k=32, num_stages=6)]:
        assert gconfig.validate_ws(cfg) is cfg
    assert gconfig.validate_ws({"num_stages": 3}) == WsConfig(num_stages=3)
    assert gconfig.validate_ws(None) == WsConfig()


@pytest.mark.parametrize("M,N,K", [(128, 100, 64), (128, 128, 100), (64, 4, 4)])
def test_alignment_error_points_to_fallback(M, N, K):
    with pytest.raises(ValueError, match=r"multiples of 8.*kernels\.gemm\.matmul"):
        glaunch.check_alignment(M, N, K, torch.bfloat16)
    with pytest.raises(ValueError, match=r"kernels\.gemm\.matmul"):
        glaunch.compile_args_ws(shape=(M, N, K))
    glaunch.check_alignment(130, 264, 96)  # ragged M is fine


def test_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    a = torch.randn(64, 64).to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"interpreter.*kernels\.gemm\.matmul"):
        gemm.matmul_ws(a, a)


def test_cpu_tensors_are_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    a = torch.randn(64, 64).to(torch.float16)
    with pytest.raises(ValueError, match=r"sm_90.*kernels\.gemm\.matmul"):
        gemm.matmul_ws(a, a)


@pytest.mark.parametrize("a,b,match", [
    (torch.randn(8, 16), torch.randn(16, 8), r"bfloat16 or both float16.*kernels\.gemm\.matmul"),
    (torch.randn(8, 16, dtype=torch.float16), torch.randn(16, 8, dtype=torch.bfloat16), "both float16"),
    (torch.randn(8, 16, dtype=torch.float16), torch.randn(8, 16, dtype=torch.float16), r"need a \(M, K\)"),
    (torch.randn(8, dtype=torch.float16), torch.randn(8, 16, dtype=torch.float16), r"need a \(M, K\)"),
])
def test_bad_operands(monkeypatch, a, b, match):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match=match):
        gemm.matmul_ws(a, b)


def test_counts_and_labels():
    assert gemm.flops({"M": 2, "N": 3, "K": 4}) == 48
    assert gconfig.ws_smem_bytes(WsConfig()) == 4 * 32768 + 65536 + 80 + gconfig.WS_EXTRA_SMEM
    assert glaunch.grid_size(8192, 8192, WsConfig(), 132) == 132
    assert glaunch.grid_size(130, 264, WsConfig(), 132) == 6
    assert glaunch.grid_size(8192, 8192, WsConfig(num_sms=7), 132) == 7
    assert gconfig.default_partition_regs(WsConfig()) == 232
    assert gconfig.consumer_regs_of(WsConfig(cooperative=True, producer_regs=24)) == 240
    assert gconfig.ws_smem_bytes(WsConfig(cooperative=True, block_n=256, num_stages=3)) == \
        3 * 49152 + 65536 + 64 + gconfig.WS_EXTRA_SMEM
    assert WsConfig().label() == "ws 128x128x64 s4 g8"
    assert WsConfig(cooperative=True, block_n=256, num_stages=3).label() == "coop 128x256x64 s3 g8"
    assert "r240/24" in WsConfig(consumer_regs=240, producer_regs=24).label()
    assert gsweep.tolerance(torch.bfloat16) > gsweep.tolerance(torch.float16)


def test_reference_is_fp32():
    a = torch.randn(5, 8).to(torch.bfloat16)
    b = torch.randn(8, 3).to(torch.bfloat16)
    r = gemm.reference(a, b)
    assert r.dtype == torch.float32 and torch.allclose(r, a.float() @ b.float())


# ----------------------------------------------------------------------- GPU
# (M, N, K, dtype, config fields): ragged M and N, K shorter than the ring, K
# not a multiple of BLOCK_K, odd and even tile counts per CTA (num_sms small),
# every tile shape the validator accepts.
GPU_CASES = [
    (130, 264, 96, "bfloat16", {}),
    (130, 264, 96, "float16", {}),
    (1000, 1000, 1000, "bfloat16", {}),
    (1000, 1000, 1000, "float16", dict(block_m=64, block_n=256)),
    (4096, 4096, 4096, "bfloat16", {}),
    (4096, 4096, 4096, "float16", {}),
    (4096, 4096, 4096, "bfloat16", dict(block_m=64, block_n=256)),
    (1, 8, 8, "bfloat16", {}),
    (777, 520, 4104, "bfloat16", dict(num_sms=3, group_m=3)),
    (777, 520, 4104, "float16", dict(num_sms=4, num_stages=2)),
    (512, 4096, 7168, "bfloat16", dict(num_stages=5)),
    (300, 1032, 520, "float16", dict(block_m=64, block_n=128, num_stages=6, block_k=32)),
    (2048, 2048, 2048, "bfloat16", dict(consumer_regs=240, producer_regs=24)),
    (130, 264, 96, "bfloat16", dict(cooperative=True, block_n=256, num_stages=3)),
    (4096, 4096, 4096, "bfloat16", dict(cooperative=True, block_n=256, num_stages=3)),
    (1000, 1000, 1000, "float16", dict(cooperative=True, block_m=256, num_stages=3)),
    (777, 520, 4104, "bfloat16", dict(cooperative=True, block_n=256, block_k=32, num_stages=6, num_sms=5)),
]

_GPU_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, {root!r})
    from kernels import gemm
    from kernels.gemm import sweep as gsweep
    out = {{}}
    for i, (M, N, K, dt, cfg) in enumerate(json.loads(sys.argv[1])):
        name = f"{{M}}x{{N}}x{{K}}-{{dt}}-{{cfg}}"
        dtype = getattr(torch, dt)
        g = torch.Generator(device="cuda").manual_seed(1234 + i)  # fresh inputs per case
        a = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        b = torch.randn(K, N, device="cuda", generator=g).to(dtype)
        c = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)  # poisoned
        try:
            gemm.matmul_ws(a, b, config=cfg or None, out=c)
            torch.cuda.synchronize()
            ref = gemm.reference(a, b)
            err = float((c.float() - ref).norm() / ref.norm())
            out[name] = {{"finite": bool(torch.isfinite(c).all()), "err": err, "tol": gsweep.tolerance(dtype)}}
        except Exception as exc:
            out[name] = {{"error": f"{{type(exc).__name__}}: {{exc}}"}}
        print(json.dumps({{name: out[name]}}), file=sys.stderr, flush=True)
    print(json.dumps(out))
""")


def _gpu_name(case) -> str:
    M, N, K, dt, cfg = case
    return f"{M}x{N}x{K}-{dt}-{cfg}"


@pytest.fixture(scope="module")
def gpu_results():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("gemm_ws needs an sm_90 (Hopper) GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        r = subprocess.run([sys.executable, "-c", _GPU_SCRIPT.format(root=str(ROOT)), json.dumps(GPU_CASES)],
                           capture_output=True, text=True, env=env, timeout=300, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        done = (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"the GPU cases did not finish in 300 s (a hang?); finished before it:\n{done[-3000:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=_gpu_name)
def test_gpu_correct(gpu_results, case):
    res = gpu_results[_gpu_name(case)]
    assert "error" not in res, res["error"]
    assert res["finite"], "NaN left in C: some tile was never written"
    assert res["err"] < res["tol"], res


@pytest.mark.gpu
def test_gpu_refuses_unaligned_k():
    a = torch.randn(64, 100, device="cuda").to(torch.bfloat16)
    b = torch.randn(100, 64, device="cuda").to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"kernels\.gemm\.matmul"):
        gemm.matmul_ws(a, b)


# ----------------------------------------------- GPU: device descriptors (Gluon)
# matmul_ws on every GPU_CASES case, then matmul through the plan's Gluon kernel, with
# GLUON_DEVICE_DESCRIPTORS on; in one child process with a timeout (a hang fails, it does
# not stall the run). Each matmul_ws case runs twice on fresh tensors, the first call's
# kept alive: the second call's descriptors land in the same scratch slots, so a
# descriptor left over from the first call would read and write the first call's
# tensors (its C changes, the second C stays NaN).
_GPU_DD_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    sys.path.insert(0, {root!r})
    from kernels import gemm
    from kernels.common import launcher
    from kernels.gemm import launch as glaunch, sweep as gsweep
    from kernels.gemm.config import GemmConfig
    glaunch.GLUON_DEVICE_DESCRIPTORS = True
    glaunch.DEVICE_DESC_MAX_US = float("inf")   # matmul: device descriptors at every size
    cases, matmul_cases = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    out = {{}}

    def operands(M, N, K, dtype, seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        a = torch.randn(M, K, device="cuda", generator=g).to(dtype)
        b = torch.randn(K, N, device="cuda", generator=g).to(dtype)
        return a, b

    def record(name, c, a, b, dtype, plan, **extra):
        ref = a.double() @ b.double()
        out[name] = dict(finite=bool(torch.isfinite(c).all()), err=float((c.double() - ref).norm() / ref.norm()),
                         tol=gsweep.tolerance(dtype), kind=plan.kind, device_desc=plan.device_desc,
                         fn=plan.launch.fn.__name__ if plan.launch else None, **extra)
        print(json.dumps({{name: out[name]}}), file=sys.stderr, flush=True)

    for i, (M, N, K, dt, cfg) in enumerate(cases):
        name = f"ws {{M}}x{{N}}x{{K}}-{{dt}}-{{cfg}}"
        dtype = getattr(torch, dt)
        try:
            a1, b1 = operands(M, N, K, dtype, 4321 + i)
            c1 = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
            gemm.matmul_ws(a1, b1, config=cfg or None, out=c1)
            torch.cuda.synchronize()
            first = c1.clone()
            a2, b2 = operands(M, N, K, dtype, 9876 + i)
            c2 = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
            gemm.matmul_ws(a2, b2, config=cfg or None, out=c2)
            torch.cuda.synchronize()
            record(name, c2, a2, b2, dtype, glaunch.plan_for_ws(a2, b2, cfg or None, c2),
                   first_ok=bool(torch.equal(first, c1)) and bool(torch.isfinite(first).all()))
        except Exception as exc:
            out[name] = {{"error": f"{{type(exc).__name__}}: {{exc}}"[:800]}}

    for M, N, K, cfg in matmul_cases:   # matmul with a Gluon config
        name = f"matmul {{M}}x{{N}}x{{K}}-{{cfg}}"
        try:
            a, b = operands(M, N, K, torch.bfloat16, M + N + K)
            c = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            gemm.matmul(a, b, cfg, out=c)
            torch.cuda.synchronize()
            record(name, c, a, b, torch.bfloat16, glaunch.plan_for(a, b, cfg, c))
        except Exception as exc:
            out[name] = {{"error": f"{{type(exc).__name__}}: {{exc}}"[:800]}}

    # A CUDA graph of matmul (Gluon), captured on a side stream (under capture the plan encodes
    # host descriptors into the graph), replayed after the scratch pool has grown, with new
    # operands copied in; the record is of the eager plan (device descriptors).
    try:
        M, N, K = 1000, 3000, 2000
        cfg = dict(gluon="coop", block_n=256, block_k=32, num_stages=6, num_warps=8)
        a, b = operands(M, N, K, torch.bfloat16, 77)
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            gemm.matmul(a, b, cfg, out=c)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=s):
            gemm.matmul(a, b, cfg, out=c)
        for key in list(launcher._SCRATCH):
            launcher.scratch(*key, 1 << 24)
        a2, b2 = operands(M, N, K, torch.bfloat16, 78)
        a.copy_(a2)
        b.copy_(b2)
        c.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        record("graph replay", c, a, b, torch.bfloat16, glaunch.plan_for(a, b, cfg, c),
               streams=sorted(str(k) for k in launcher._SCRATCH))
    except Exception as exc:
        out["graph replay"] = {{"error": f"{{type(exc).__name__}}: {{exc}}"[:800]}}
    print(json.dumps(out))
""")
# matmul: the goal table's shapes with Gluon configs, and both Gluon schedules on ragged shapes.
GPU_DD_MATMUL = [   # explicit Gluon configs: which kernel a config-less call runs is the tuning tables' choice
    (4096, 4096, 4096, dict(gluon="coop", block_n=256, block_k=64, num_stages=3, num_warps=8)),
    (3072, 3072, 3072, dict(gluon="pingpong", block_n=128, num_stages=4, num_warps=4)),
    (2048, 7168, 2048, dict(gluon="coop", block_n=256, block_k=32, num_stages=6, num_warps=8)),
    (1000, 1000, 1000, dict(gluon="pingpong", block_n=128, num_stages=5, num_warps=4)),
    (777, 520, 4104, dict(gluon="coop", block_n=256, block_k=32, num_stages=6, num_warps=8)),
    (130, 264, 96, dict(gluon="coop", block_m=256, block_n=128, block_k=32, num_stages=6, num_warps=8)),
]


def _gpu_dd_names():
    return ([f"ws {_gpu_name(c)}" for c in GPU_CASES] + [f"matmul {M}x{N}x{K}-{cfg}" for M, N, K, cfg in GPU_DD_MATMUL]
            + ["graph replay"])


@pytest.fixture(scope="module")
def gpu_dd_results():
    if torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("the Gluon kernels need an sm_90 (Hopper) GPU")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        r = subprocess.run([sys.executable, "-c", _GPU_DD_SCRIPT.format(root=str(ROOT)), json.dumps(GPU_CASES),
                            json.dumps(GPU_DD_MATMUL)], capture_output=True, text=True, env=env, timeout=400, cwd=ROOT)
    except subprocess.TimeoutExpired as exc:
        done = (exc.stderr or b"").decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        pytest.fail(f"the GPU cases did not finish in 400 s (a hang?); finished before it:\n{done[-3000:]}")
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("name", _gpu_dd_names())
def test_gpu_device_descriptors_correct(gpu_dd_results, name):
    res = gpu_dd_results[name]
    assert "error" not in res, res["error"]
    assert res["finite"], "NaN left in C: some tile was never written"
    assert res["err"] < res["tol"], res
    # matmul_ws and matmul's Gluon configs: the Gluon kernel, with device descriptors
    assert res["kind"] == "gluon" and res["device_desc"] and res["fn"] == "_gemm_ws_dev_kernel", res
    if name.startswith("ws "):
        assert res["first_ok"], "the second call changed the first call's C: a stale descriptor"
