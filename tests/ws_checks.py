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


# --------------------------------------------------- device-descriptor variants
_SASS_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def main_loops(entry, keys=("HGMMA", "UTMALDG", "UTMASTG")) -> list[dict]:
    """The innermost SASS loops (a backward branch and its target) that hold one of
    ``keys``, in address order: for each, how many of each key it holds and its
    length in instructions."""
    insns = []
    for m in _SASS_INSN.finditer(entry.text("sass")):
        addr, op = int(m.group(1), 16), m.group(2)
        target = re.search(r"0x([0-9a-f]+)", m.group(3)) if op.startswith("BRA") else None
        insns.append((addr, op.split(".")[0], int(target.group(1), 16) if target else None))
    back = [(t, a) for a, _, t in insns if t is not None and t <= a]
    loops = set()
    for addr, op, _ in insns:
        around = [(t, a) for t, a in back if t <= addr <= a]
        if op in keys and around:
            loops.add(min(around, key=lambda span: span[1] - span[0]))
    out = []
    for lo, hi in sorted(loops):
        body = [op for a, op, _ in insns if lo <= a <= hi]
        out.append({"length": len(body), **{k: body.count(k) for k in keys}})
    return out


def regions(entry) -> list[str]:
    """The TTGIR of a warp-specialised kernel cut at its regions: [before the
    ``ttg.warp_specialize`` op, the default region, partition0, partition1, ...]."""
    ttgir = entry.text("ttgir")
    head, _, rest = ttgir.partition("ttg.warp_specialize(")
    parts = re.split(r"\n\s*partition\d+\(", rest)
    return [head] + parts


def descriptor_facts(entry) -> dict:
    """What a kernel that builds its TMA descriptors shows: global scratch per program,
    descriptors created (TTGIR), release copies and acquire fences (PTX), descriptor
    cache invalidations (SASS), per region the descriptors created and acquired."""
    ptx, sass = entry.text("ptx"), entry.text("sass")
    per_region = [(r.count("ttng.tensormap_create"), r.count("ttng.tensormap_fenceproxy_acquire"),
                   r.count("ttng.async_tma_copy_global_to_local"), r.count("ttng.async_tma_copy_local_to_global"))
                  for r in regions(entry)]
    return {"scratch": entry.metadata.get("global_scratch_size") or 0,
            "created": entry.text("ttgir").count("ttng.tensormap_create"),
            "release": ptx.count("tensormap.cp_fenceproxy.global.shared::cta.tensormap::generic.release.gpu"),
            "acquire": ptx.count("fence.proxy.tensormap::generic.acquire.gpu"),
            "utmacctl": sass.count("UTMACCTL"),
            "per_region": per_region}


def assert_device_variant(dev, host, descriptors: int, loads_per_region, stores_per_region) -> None:
    """``dev`` (device descriptors) against ``host`` (the same config with host ones):
    ``descriptors`` CUtensorMaps of 128 bytes per program in the global scratch, each
    copied out with the tensormap release fence and acquired, by the region that issues
    the TMA copies with it (``loads_per_region`` / ``stores_per_region``: the descriptors
    each region [default, partition0, ...] makes for loads / for stores); the host
    variant builds none; the same HGMMA / UTMALDG / UTMASTG in every main loop."""
    d, h = descriptor_facts(dev), descriptor_facts(host)
    assert h["scratch"] == h["created"] == h["release"] == h["acquire"] == h["utmacctl"] == 0, h
    assert d["scratch"] == 128 * descriptors, d
    assert d["created"] == d["release"] == d["acquire"] == descriptors, d
    assert d["utmacctl"] >= descriptors, d      # the acquire: the descriptor cache line invalidated
    regions_made = [(made, acquired) for made, acquired, _, _ in d["per_region"][1:]]
    want = [(lo + st, lo + st) for lo, st in zip(loads_per_region, stores_per_region)]
    assert regions_made == want, (regions_made, want)
    assert d["per_region"][0][:2] == (0, 0), d   # nothing built before the partitions split
    for (_, _, loads, stores), lo, st in zip(d["per_region"][1:], loads_per_region, stores_per_region):
        assert (loads > 0) == (lo > 0) and (stores > 0) == (st > 0), d["per_region"]
    dl, hl = main_loops(dev), main_loops(host)
    strip = [[{k: v for k, v in loop.items() if k != "length"} for loop in loops] for loops in (dl, hl)]
    assert strip[0] == strip[1] and dl, (dl, hl)
    for key in ("HGMMA", "UTMALDG", "UTMASTG"):
        assert dev.text("sass").count(key) == host.text("sass").count(key), key
