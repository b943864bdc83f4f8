"""Sizes of the largest real cache entries this repository makes, per stage file.

The inspector's read caps (workbench.asm.reading) are set generously above
these. Cross-compiles the biggest kernels for sm_90 (and the Triton GEMM for
gfx942/gfx950) into a temporary cache and prints the size of every file:

    python tests/hostile/measure_entries.py
"""
from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # kernels must compile, not interpret
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def main() -> None:
    import torch

    from kernels import gemm, gemm_ws, grouped_gemm_ws
    from workbench.asm.compile import cross_compile
    from workbench.asm.tools import sass_from_cubin

    jobs = {
        "gemm_ws coop 128x256x64 s3": ("sm90", gemm_ws.compile_args(gemm_ws.WsConfig(cooperative=True, block_n=256, num_stages=3))),
        "gemm_ws ping-pong 64x256x64 s4": ("sm90", gemm_ws.compile_args(gemm_ws.WsConfig(block_m=64, block_n=256))),
        "grouped_gemm_ws max G": ("sm90", grouped_gemm_ws.compile_args(
            grouped_gemm_ws.GroupedWsConfig(), torch.bfloat16, True, G=grouped_gemm_ws.MAX_GROUPS,
            sizes_dtype=torch.int64)),
        "gemm 128x256x64 sm90": ("sm90", gemm.compile_args(gemm.GemmConfig(block_m=128, block_n=256, block_k=64))),
        "gemm 128x256x64 gfx942": ("gfx942", gemm.compile_args(gemm.GemmConfig(block_m=128, block_n=256, block_k=64))),
        "gemm 128x256x64 gfx950": ("gfx950", gemm.compile_args(gemm.GemmConfig(block_m=128, block_n=256, block_k=64))),
    }
    largest: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (label, (target, args)) in enumerate(jobs.items()):
            try:
                (entry,) = cross_compile(targets=target, cache_dir=Path(tmp) / str(i), **args)
            except Exception as exc:  # report and go on: this is a measurement
                print(f"{label}: {type(exc).__name__}: {exc}"[:300])
                continue
            sizes = {p.name.split(".", 1)[1] if not p.name.startswith("__grp__") else "__grp__":
                     p.stat().st_size for p in entry.path.iterdir()}
            if "cubin" in entry.stages:
                sizes["sass (cuobjdump output)"] = len(sass_from_cubin(entry.stages["cubin"]).encode())
            print(f"{label}: " + ", ".join(f"{k} {v:,}" for k, v in sorted(sizes.items())))
            for k, v in sizes.items():
                largest[k] = max(largest.get(k, 0), v)
    print("largest per file kind: " + ", ".join(f"{k} {v:,}" for k, v in sorted(largest.items())))


if __name__ == "__main__":
    main()
