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
    assert args["constexprs"] == {"NUM_STAGES": 4, "COOPERATIVE": False, "CONSUMER_REGS": 232, "PRODUCER_REGS": 40}
    with pytest.raises(ValueError, match="float16"):
        glaunch.compile_args_ws(dtype=torch.float32)


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
