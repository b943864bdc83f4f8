"""Checks shared by the tests of the warp-specialised Gluon kernels
(tests/test_gemm_ws.py, tests/test_grouped_gemm_ws.py): what a cross-compiled
sm_90 entry must show, read through workbench.asm."""
import re

SETMAXNREG = r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32\s+(\d+)"


def mnemonics(entry, stage: str, category: str) -> str:
    mix = entry.mix(stage)
    return " ".join(mix.loc[mix["category"] == category, "mnemonics"])


def assert_no_spills(entry) -> None:
    r = entry.resources()
    assert not r["problems"], r["problems"]
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0  # STL / LDL in SASS
    assert r.get("local_bytes", 0) == 0 and r.get("stack_bytes", 0) == 0
    assert ".local" not in entry.text("ptx")


def assert_warp_specialised(entry, cfg, ws) -> None:
    """Partitions with the warps and registers ``cfg`` asks for, setmaxnreg really
    moving registers, and the launch shape ``ws`` (kernels.gemm.config or
    kernels.moe.config, which shares its limits) promises: 12 warps, 384 threads, ws.MAXNREG registers."""
    ttgir = entry.text("ttgir")
    assert "ttg.warp_specialize" in ttgir
    if cfg.cooperative:
        # Default partition: the 8-warp consumer; one worker: the 1-warp producer.
        assert f"requestedRegisters = array<i32: {cfg.producer_regs}>" in ttgir
        assert re.search(r"partition0\(.*\) num_warps\(1\)", ttgir) and "partition1(" not in ttgir
    else:
        # Default partition: consumer 0 (the kernel's 4 warps); workers: consumer 1
        # (4 warps) and the producer (1 warp), with the registers they ask for.
        assert f"requestedRegisters = array<i32: {cfg.consumer_regs}, {cfg.producer_regs}>" in ttgir
        assert re.search(r"partition0\(.*\) num_warps\(4\)", ttgir)
        assert re.search(r"partition1\(.*\) num_warps\(1\)", ttgir)
    # The consumers get consumer_regs_of(cfg) (the default partition the leftover),
    # the producer drops to producer_regs.
    ptx_regs = {int(n) for n in re.findall(SETMAXNREG, entry.text("ptx"))}
    assert {ws.consumer_regs_of(cfg), ws.default_partition_regs(cfg), cfg.producer_regs} <= ptx_regs
    assert "USETMAXREG" in entry.text("sass")
    r = entry.resources()
    assert r["num_warps"] == ws.TOTAL_WARPS == 12 and r["threads_per_block"] == 384
    assert r["registers"] == ws.MAXNREG == 168  # the launch limit that 384 threads allow


def assert_smem_fits(entry, cfg, ws, limit: int) -> None:
    """Within sm_90's limit, and ws.smem_bytes's model holds (Triton adds at most WS_EXTRA_SMEM)."""
    shared = entry.resources()["shared_bytes"]
    assert shared <= limit
    estimate = ws.smem_bytes(cfg)
    assert estimate - ws.WS_EXTRA_SMEM <= shared <= estimate


_CHILD = """
import json, sys
sys.path.insert(0, {root!r})
import torch
from workbench.asm.compile import cross_compile
from kernels.gemm import launch as glaunch
from kernels.moe import launch as mlaunch
for case in json.loads(sys.argv[1]):
    kw = {{k: getattr(torch, v) if k.endswith("dtype") else v for k, v in case.get("kwargs", {{}}).items()}}
    args = {{"gemm": glaunch, "moe": mlaunch}}[case["module"]].compile_args_ws(
        case["config"], getattr(torch, case["dtype"]), **kw)
    cross_compile(targets="sm90", cache_dir=case["dir"], **args)
"""


def compile_ws(cases: list[dict], root) -> list:
    """Cross-compile Gluon kernels for sm_90 in a child process with the interpreter
    off (an interpreted run earlier in this process leaves Triton's language patched,
    and Gluon compiles then fail), one cache dir per case; the entries, in order.
    Each case: {"module": "gemm"|"moe", "config": dict, "dtype": "bfloat16", "dir": str,
    "kwargs": {more keyword arguments of compile_args_ws; "*dtype" values by torch name}}."""
    import json
    import os
    import subprocess
    import sys

    from workbench.asm.cache import list_entries

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    r = subprocess.run([sys.executable, "-c", _CHILD.format(root=str(root)), json.dumps(cases)],
                       capture_output=True, text=True, env=env, cwd=root, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    out = []
    for case in cases:
        (entry,) = [e for e in list_entries(case["dir"]) if not e.problems]
        out.append(entry)
    return out
