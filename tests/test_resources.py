"""Tools (cuobjdump / nvdisasm) and resource use read from compiled artefacts."""
from __future__ import annotations

import importlib.util
import json
import os
import stat
from pathlib import Path

import pytest

from workbench.asm import resources as res_mod
from workbench.asm import tools
from workbench.asm.resources import amd_kernel_info, nvidia_occupancy, resources

FIX = Path(__file__).parent / "fixtures" / "isa"


def _hide_cuda_tools(monkeypatch, tmp_path):
    """No triton wheel, nothing on PATH, no overrides: no cuobjdump anywhere."""
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a, **k: None if name == "triton" else real(name, *a, **k)
    )
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    monkeypatch.setenv("PATH", str(empty))
    for var in ("TRITON_CUOBJDUMP_PATH", "TRITON_NVDISASM_PATH", "CUDA_HOME", "CUDA_PATH"):
        monkeypatch.delenv(var, raising=False)


def _have_cuobjdump() -> bool:
    try:
        tools.find_tool("cuobjdump")
    except tools.ToolMissing:
        return False
    return True


needs_cuobjdump = pytest.mark.skipif(not _have_cuobjdump(), reason="cuobjdump not found (pip install triton==3.6.0)")


# --------------------------------------------------------------------------
# tools


@needs_cuobjdump
def test_find_tool_in_triton_wheel(monkeypatch):
    monkeypatch.delenv("TRITON_CUOBJDUMP_PATH", raising=False)
    spec = importlib.util.find_spec("triton")
    path = Path(tools.find_tool("cuobjdump"))
    assert path.name == "cuobjdump" and os.access(path, os.X_OK)
    assert Path(spec.origin).parent in path.parents
    assert Path(tools.find_tool("nvdisasm")).name == "nvdisasm"


def test_tool_missing_says_where_and_what(monkeypatch, tmp_path):
    _hide_cuda_tools(monkeypatch, tmp_path)
    with pytest.raises(tools.ToolMissing) as e:
        tools.find_tool("cuobjdump")
    msg = str(e.value)
    assert "cuobjdump" in msg
    assert "pip install triton==3.6.0" in msg
    assert "PATH" in msg and "TRITON_CUOBJDUMP_PATH" in msg
    assert "triton package (not installed)" in msg
    assert isinstance(e.value, RuntimeError)


def test_tool_found_on_path(monkeypatch, tmp_path):
    _hide_cuda_tools(monkeypatch, tmp_path)
    fake = tmp_path / "empty-bin" / "cuobjdump"
    fake.write_text("#!/bin/sh\necho fake\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    assert tools.find_tool("cuobjdump") == str(fake)


def test_env_override(monkeypatch, tmp_path):
    fake = tmp_path / "my-cuobjdump"
    fake.write_text("#!/bin/sh\necho fake\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("TRITON_CUOBJDUMP_PATH", str(fake))
    assert tools.find_tool("cuobjdump") == str(fake)
    monkeypatch.setenv("TRITON_CUOBJDUMP_PATH", str(tmp_path / "nope"))
    with pytest.raises(tools.ToolMissing, match="TRITON_CUOBJDUMP_PATH"):
        tools.find_tool("cuobjdump")


def test_sass_from_cubin_missing_tool(monkeypatch, tmp_path):
    cubin = tmp_path / "k.cubin"
    cubin.write_bytes(b"\x7fELF" + bytes(60))
    _hide_cuda_tools(monkeypatch, tmp_path)
    with pytest.raises(tools.ToolMissing, match="cuobjdump"):
        tools.sass_from_cubin(cubin)


def test_sass_from_cubin_not_elf(tmp_path):
    bad = tmp_path / "garbage.cubin"
    bad.write_bytes(b"this is not a cubin at all" * 10)
    with pytest.raises(tools.ToolFailed) as e:
        tools.sass_from_cubin(bad)
    assert str(bad) in str(e.value) and "corrupt" in str(e.value)
    with pytest.raises(tools.ToolFailed, match="garbage.cubin"):
        tools.cubin_resource_usage(bad)


def test_sass_from_cubin_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothere.cubin"):
        tools.sass_from_cubin(tmp_path / "nothere.cubin")


@needs_cuobjdump
def test_sass_from_truncated_cubin(tmp_path, sm90_cubins):
    whole = sm90_cubins["hint"].read_bytes()
    cut = tmp_path / "cut.cubin"
    cut.write_bytes(whole[: len(whole) // 3])
    with pytest.raises(tools.ToolFailed) as e:
        tools.sass_from_cubin(cut)
    assert str(cut) in str(e.value)
    with pytest.raises(tools.ToolFailed, match="cut.cubin"):
        tools.cubin_resource_usage(cut)


def test_parse_resource_usage_fixture():
    ru = tools.parse_resource_usage((FIX / "gemm_bf16_sm90.resusage.txt").read_text())
    assert ru["function"] == "gemm"
    assert (ru["registers"], ru["stack"], ru["shared"], ru["local"], ru["constant"]) == (114, 0, 1024, 0, 592)
    assert ru["global"] == 0
    assert list(ru["functions"]) == ["gemm"]


def test_parse_resource_usage_two_functions():
    text = (
        "Resource usage:\n Common:\n  GLOBAL:16 CONSTANT[3]:8\n"
        " Function a:\n  REG:40 STACK:16 SHARED:0 LOCAL:24 CONSTANT[0]:400 CONSTANT[2]:12 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
        " Function b:\n  REG:8 STACK:0 SHARED:0 LOCAL:0 CONSTANT[0]:360 TEXTURE:0 SURFACE:0 SAMPLER:0\n"
    )
    ru = tools.parse_resource_usage(text)
    assert (ru["function"], ru["registers"], ru["stack"], ru["local"]) == ("a", 40, 16, 24)
    assert ru["constant_banks"] == {0: 400, 2: 12}
    assert ru["functions"]["b"]["registers"] == 8
    assert ru["global"] == 16


# --------------------------------------------------------------------------
# live cubins (cross-compiled for sm_90, no GPU)


@pytest.fixture(scope="module")
def sm90_cubins(tmp_path_factory, isa_fixture_kernels):
    mod = isa_fixture_kernels
    out = {}
    d = tmp_path_factory.mktemp("cubins")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_CACHE_DIR", str(d / "cache"))
        for tag, hint in (("nohint", False), ("hint", True)):
            k = mod.compile_remote_store(mod.TARGETS["sm90"], hint)
            p = d / f"remote_store_{tag}.cubin"
            p.write_bytes(k.asm["cubin"])
            out[tag] = p
            out[tag + "_md"] = json.loads(mod.metadata_json(k))
    return out


@needs_cuobjdump
def test_live_sass_and_res_usage(sm90_cubins):
    from workbench.asm.isa import mix

    sass = tools.sass_from_cubin(sm90_cubins["hint"])
    assert "Function : remote_store" in sass
    df = mix(sass, "sass")
    st = df[(df.space == "global") & (df.kind == "store")]
    assert st[["width_bits", "count"]].values.tolist() == [[128, 2]]
    ru = tools.cubin_resource_usage(sm90_cubins["hint"])
    assert ru["function"] == "remote_store"
    assert (ru["registers"], ru["local"], ru["stack"]) == (18, 0, 0)
    assert tools.cubin_resource_usage(sm90_cubins["nohint"])["registers"] == 30


@needs_cuobjdump
def test_resources_nvidia_live(sm90_cubins, tmp_path):
    md = sm90_cubins["nohint_md"]
    sass = tmp_path / "k.sass"
    sass.write_text(tools.sass_from_cubin(sm90_cubins["nohint"]))
    r = resources({"cubin": sm90_cubins["nohint"], "sass": sass}, md)
    assert r["problems"] == []
    assert (r["backend"], r["arch"], r["name"]) == ("cuda", "sm_90", "remote_store")
    assert (r["registers"], r["local_bytes"], r["stack_bytes"]) == (30, 0, 0)
    assert (r["spill_stores"], r["spill_loads"]) == (0, 0)
    assert (r["num_warps"], r["threads_per_block"], r["shared_bytes"]) == (4, 128, 4096)
    # 30 regs -> 1024 a warp -> 64 warps; 4 warps a block -> 16 blocks, as many as the warp limit.
    assert (r["blocks_per_sm"], r["warps_per_sm"], r["occupancy"]) == (16, 64, 1.0)
    assert r["occupancy_limiter"] == "registers+warps"


# --------------------------------------------------------------------------
# resources() from fixtures, tools simulated


def _gemm_sm90_md() -> dict:
    return json.loads((FIX / "gemm_bf16_sm90.json").read_text())


def test_resources_nvidia_from_res_usage(monkeypatch, tmp_path):
    cubin = tmp_path / "gemm.cubin"
    cubin.write_bytes(b"\x7fELF" + bytes(60))  # only the header is looked at
    outputs = {"-res-usage": (FIX / "gemm_bf16_sm90.resusage.txt").read_text(),
               "-sass": (FIX / "gemm_bf16_sm90.sass").read_text()}
    calls = []

    def fake_run(name, args, timeout=0, **kw):
        calls.append((name, args))
        return outputs[args[0]]

    monkeypatch.setattr(tools, "run_tool", fake_run)
    r = resources({"cubin": cubin, "ptx": FIX / "gemm_bf16_sm90.ptx"}, _gemm_sm90_md())
    assert [c[1][0] for c in calls] == ["-res-usage", "-sass"] and all(c[0] == "cuobjdump" for c in calls)
    assert (r["spill_stores"], r["spill_loads"]) == (0, 0)  # the GEMM keeps everything in registers
    assert r["problems"] == []
    assert (r["registers"], r["static_shared_bytes"], r["constant_bytes"]) == (114, 1024, 592)
    assert (r["num_warps"], r["shared_bytes"], r["num_stages"]) == (8, 65536, 2)
    # 114 regs -> 3648 -> 3840 a warp -> 17 warps -> 2 blocks of 8 warps;
    # smem 65536 + 1024 reserved -> 3 blocks; so registers limit: 16 warps of 64.
    assert (r["blocks_per_sm"], r["warps_per_sm"]) == (2, 16)
    assert r["occupancy"] == 0.25 and r["occupancy_limiter"] == "registers"


def test_resources_nvidia_tool_missing_is_a_problem(monkeypatch, tmp_path):
    cubin = tmp_path / "gemm.cubin"
    cubin.write_bytes(b"\x7fELF" + bytes(60))
    _hide_cuda_tools(monkeypatch, tmp_path)
    r = resources({"cubin": cubin}, _gemm_sm90_md())
    assert "registers" not in r
    assert len(r["problems"]) == 1
    assert "cuobjdump" in r["problems"][0] and "pip install triton==3.6.0" in r["problems"][0]
    assert r["shared_bytes"] == 65536 and "occupancy" not in r


def test_resources_nvidia_corrupt_cubin_is_a_problem(tmp_path):
    bad = tmp_path / "bad.cubin"
    bad.write_bytes(b"garbage")
    r = resources({"cubin": bad}, _gemm_sm90_md())
    assert any("bad.cubin" in p for p in r["problems"])


def test_resources_nvidia_no_cubin():
    r = resources({"ptx": FIX / "gemm_bf16_sm90.ptx"}, _gemm_sm90_md())
    assert any("no cubin" in p for p in r["problems"])
    assert r["backend"] == "cuda" and r["arch"] == "sm_90"


def test_resources_metadata_from_json_stage(monkeypatch, tmp_path):
    monkeypatch.setattr(tools, "run_tool", lambda *a, **k: (FIX / "gemm_bf16_sm90.resusage.txt").read_text())
    cubin = tmp_path / "gemm.cubin"
    cubin.write_bytes(b"\x7fELF" + bytes(60))
    r = resources({"cubin": cubin, "json": FIX / "gemm_bf16_sm90.json"}, {})
    assert (r["name"], r["registers"], r["warps_per_sm"]) == ("gemm", 114, 16)


def test_resources_bad_json_and_unknown_backend(tmp_path):
    bad = tmp_path / "k.json"
    bad.write_text("{not json")
    r = resources({"json": bad}, {})
    assert any("bad metadata JSON" in p for p in r["problems"])
    assert any("unknown backend" in p for p in r["problems"])


def test_resources_amd_gemm():
    md = json.loads((FIX / "gemm_bf16_gfx942.json").read_text())
    r = resources({"amdgcn": FIX / "gemm_bf16_gfx942.amdgcn"}, md)
    assert r["problems"] == []
    assert (r["backend"], r["arch"], r["warp_size"], r["threads_per_block"]) == ("hip", "gfx942", 64, 512)
    assert (r["vgprs"], r["agprs"], r["sgprs"], r["total_vgprs"]) == (111, 0, 26, 111)
    assert r["registers"] == 111
    assert (r["sgpr_spills"], r["vgpr_spills"], r["scratch_bytes"]) == (0, 0, 0)
    assert r["waves_per_simd_compiler"] == 4
    # 32 KB LDS a block -> 2 blocks a CU -> 16 waves over 4 SIMDs = 4 a SIMD.
    assert r["waves_per_simd_lds_limit"] == 4.0
    assert r["waves_per_simd"] == 4 and r["occupancy"] == 0.5
    assert r["occupancy_limiter"] == "registers"


def test_resources_amd_lds_limits(tmp_path):
    md = json.loads((FIX / "gemm_bf16_gfx942.json").read_text())
    md["shared"] = 65536  # one block a CU -> 8 waves / 4 SIMDs = 2
    r = resources({"amdgcn": FIX / "gemm_bf16_gfx942.amdgcn"}, md)
    assert (r["waves_per_simd"], r["occupancy_limiter"], r["occupancy"]) == (2, "lds", 0.25)
    md["shared"] = 65537
    r = resources({"amdgcn": FIX / "gemm_bf16_gfx942.amdgcn"}, md)
    assert r["waves_per_simd"] == 0 and any("LDS" in p for p in r["problems"])


def test_resources_amd_small_kernels():
    r = resources(
        {"amdgcn": FIX / "remote_store_hint_gfx942.amdgcn"},
        {"target": {"backend": "hip", "arch": "gfx942", "warp_size": 64}, "num_warps": 4, "shared": 0},
    )
    assert r["problems"] == []
    assert (r["vgprs"], r["sgprs"], r["waves_per_simd"], r["occupancy"]) == (7, 19, 8, 1.0)
    assert r["occupancy_limiter"] is None
    r = resources(
        {"amdgcn": FIX / "remote_store_nohint_gfx1100.amdgcn"},
        {"target": ["hip", "gfx1100", 32], "num_warps": 4, "shared": 4096},
    )
    assert (r["vgprs"], r["sgprs"], r["waves_per_simd"], r["occupancy"]) == (20, 18, 16, 1.0)
    assert "agprs" not in r


def test_resources_amd_missing_text():
    r = resources({"hsaco": Path("/nonexistent/k.hsaco")}, {"target": {"backend": "hip", "arch": "gfx942"}})
    assert any(".amdgcn" in p for p in r["problems"])
    r = resources({"amdgcn": Path("/nonexistent/k.amdgcn")}, {"target": {"backend": "hip", "arch": "gfx942"}})
    assert any("/nonexistent/k.amdgcn" in p for p in r["problems"])


def test_amd_kernel_info_yaml_wins_and_spills():
    text = "\n".join(
        [
            "; NumVgprs: 40",
            "; NumAgprs: 8",
            "; ScratchSize: 16",
            "; Occupancy: 6",
            "; LDSByteSize: 512 bytes/workgroup (compile time only)",
            "amdhsa.kernels:",
            "  - .agpr_count:     4",
            "    .private_segment_fixed_size: 32",
            "    .sgpr_spill_count: 3",
            "    .vgpr_count:     41",
            "    .vgpr_spill_count: 5",
        ]
    )
    info = amd_kernel_info(text)
    assert info == {
        "vgprs": 41,
        "agprs": 4,
        "scratch_bytes": 32,
        "waves_per_simd_compiler": 6,
        "lds_static_bytes": 512,
        "sgpr_spills": 3,
        "vgpr_spills": 5,
    }


# --------------------------------------------------------------------------
# occupancy arithmetic (sm_90 limits)


@pytest.mark.parametrize(
    "regs,smem,warps,blocks,limiter",
    [
        (24, 0, 4, 16, "warps"),  # 768 a warp -> 85 warps -> 21 blocks; warp limit 16
        (32, 0, 4, 16, "registers+warps"),  # 1024 a warp -> 64 warps: both give 16
        (128, 0, 4, 4, "registers"),  # 4096 a warp -> 16 warps -> 4 blocks
        (255, 0, 8, 1, "registers"),  # 8160 -> 8192 a warp -> 8 warps -> 1 block
        (40, 0, 1, 32, "blocks"),  # 1280 a warp -> 51 warps; block limit 32
        (32, 102400, 4, 2, "shared"),  # 100 KB + 1 KB reserved -> 2 blocks
        (32, 232448, 4, 1, "shared"),  # 227 KB: fits once
        (32, 232449, 4, 0, "shared"),  # over 227 KB: cannot launch
        (256, 0, 4, 0, "registers"),  # over 255 registers
        (72, 50000, 4, 4, "shared"),  # 2304 a warp -> 28 warps -> 7 blocks; smem 50048+1024 -> 4
    ],
)
def test_nvidia_occupancy(regs, smem, warps, blocks, limiter):
    occ = nvidia_occupancy(regs, smem, warps, 90)
    assert occ["blocks_per_sm"] == blocks
    assert occ["warps_per_sm"] == blocks * warps
    assert occ["occupancy"] == blocks * warps / 64
    assert occ["occupancy_limiter"] == limiter


def test_smem_per_block():
    from workbench.asm.resources import smem_per_block

    assert smem_per_block(90) == smem_per_block("sm90") == smem_per_block("sm_90a") == 232448  # 227 KB
    assert smem_per_block(80) == 166912 and smem_per_block("sm100") == 232448
    # one byte more than the limit cannot launch: the same table as the occupancy rules
    assert nvidia_occupancy(32, smem_per_block(90) + 1, 4, 90)["blocks_per_sm"] == 0
    for arch in ("gfx90a", "gfx942", 75, "sm75"):  # 'gfx90a' must not read as sm_90
        with pytest.raises(ValueError, match="no shared-memory limit known"):
            smem_per_block(arch)


def test_nvidia_occupancy_unknown_arch_is_a_problem(monkeypatch, tmp_path):
    monkeypatch.setattr(tools, "run_tool", lambda *a, **k: (FIX / "gemm_bf16_sm90.resusage.txt").read_text())
    cubin = tmp_path / "gemm.cubin"
    cubin.write_bytes(b"\x7fELF" + bytes(60))
    md = _gemm_sm90_md()
    md["target"] = {"backend": "cuda", "arch": 75, "warp_size": 32}
    r = resources({"cubin": cubin}, md)
    assert r["registers"] == 114 and "occupancy" not in r
    assert any("sm_75" in p for p in r["problems"])
    assert set(res_mod.NV_LIMITS) >= {80, 90, 100}
