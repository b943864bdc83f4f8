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
