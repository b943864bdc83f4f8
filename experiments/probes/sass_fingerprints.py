"""Probe: SHA-1 of the cross-compiled sm_90 SASS of every kernel family's main configurations.

No GPU needed. Run it at two commits and compare the output to show that a change left
the compiled kernels alone (a module move, a launcher change):

    python experiments/probes/sass_fingerprints.py > after.json
    git stash; python experiments/probes/sass_fingerprints.py > before.json; git stash pop
    diff before.json after.json && echo identical

For a kernel that did change, ``workbench asm diff`` of the two entries shows how.
"""
from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

GEMM_CONFIGS = {
    "heuristic-4096": None,
    "gluon-pingpong": dict(block_n=128, num_stages=5, gluon="pingpong"),
    "stream-k": dict(stream_k=True, tma_store=True, epilogue_split=2, num_stages=3),
    "64x128-s6-plain-stores": dict(block_m=64, block_n=128, num_warps=4, num_stages=6, tma_store=False),
}

# The grouped GEMM's Gluon kernel (host descriptors), fwd and dgrad.
GROUPED_WS_CONFIGS = {
    "pingpong": None,
    "coop": dict(cooperative=True, block_n=256, num_stages=3),
}


def _sha(entry) -> str:
    return hashlib.sha1(entry.text("sass").encode()).hexdigest()


def fingerprints() -> dict[str, str]:
    from kernels.comm import launch as comm_launch
    from kernels.gemm import launch as gemm_launch
    from kernels.moe import launch as moe_launch
    from workbench.asm.compile import cross_compile

    out = {}
    shape = {"M": 4096, "N": 4096, "K": 4096}
    for name, cfg in GEMM_CONFIGS.items():
        args = gemm_launch.compile_args(cfg, shape=shape)
        out[f"gemm {name}"] = _sha(cross_compile(targets="sm90", cache_dir=tempfile.mkdtemp(), **args)[0])
    args = gemm_launch.compile_args_ws(dict(cooperative=True, block_n=256, num_stages=3))
    out["gemm gluon-coop"] = _sha(cross_compile(targets="sm90", cache_dir=tempfile.mkdtemp(), **args)[0])
    for name, cfg in GROUPED_WS_CONFIGS.items():
        for op in ("fwd", "dgrad"):
            args = moe_launch.compile_args_ws(cfg, trans_w=op == "dgrad")
            out[f"grouped gluon-{name} {op}"] = _sha(cross_compile(targets="sm90", cache_dir=tempfile.mkdtemp(),
                                                                   **args)[0])
    for variant in ("triton", "gluon"):
        e = comm_launch.compile_kernel(variant, True, world_size=2, N=1024, cache_dir=tempfile.mkdtemp())
        out[f"all_gather {variant}"] = _sha(e)
    return out


if __name__ == "__main__":
    print(json.dumps(fingerprints(), indent=1))
