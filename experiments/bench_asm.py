"""Benchmark the inspector on the CPU machine.

    .venv/bin/python experiments/bench_asm.py [--entries 2000] [--out results/asm_bench/bench.csv]

1. listing + classifying: a cache of N entries (copies of real cross-compiled
   entries: the remote-store fixtures plus a bf16 GEMM for sm90 and gfx942),
   then `list_entries` and `mix()` of every entry's final assembly;
2. cross-compiling one kernel (a bf16 GEMM) for sm90, gfx942 and gfx950 into
   an empty cache, in a process that has imported triton (import time shown apart).
Goals (issue 2): (1) under 2 s for 2,000 entries; (2) under 5 s.
"""
import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd

ROOT = Path(__file__).resolve().parents[1]
GEMM = '''
import triton, triton.language as tl
@triton.jit
def gemm_{tag}(a_ptr, b_ptr, c_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM); rn = pid_n * BN + tl.arange(0, BN); rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + rm[:, None] * K + (k + rk)[None, :])
        b = tl.load(b_ptr + (k + rk)[:, None] * N + rn[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))
'''


def gemm_kernel(workdir: Path, tag: str):
    mod = workdir / f"bench_gemm_{tag}.py"
    mod.write_text(GEMM.format(tag=tag))
    sys.path.insert(0, str(workdir))
    return getattr(__import__(mod.stem), f"gemm_{tag}")


def compile_gemm(fn, targets, cache):
    from workbench.asm.compile import cross_compile

    sig = {"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "M": "i32", "N": "i32", "K": "i32"}
    return cross_compile(fn, targets, signature=sig, constexprs={"BM": 128, "BN": 128, "BK": 64},
                         divisible=[0, 1, 2, 3, 4, 5], num_warps=8, cache_dir=cache)


def build_cache(n: int, workdir: Path) -> Path:
    seed = workdir / "seed"
    shutil.copytree(ROOT / "tests/fixtures/cache", seed)
    compile_gemm(gemm_kernel(workdir, "seed"), ["sm90", "gfx942"], seed)
    sources = sorted(p for p in seed.iterdir() if p.is_dir())
    cache = workdir / "cache"
    cache.mkdir()
    for i in range(n):
        shutil.copytree(sources[i % len(sources)], cache / f"{i:06d}{sources[i % len(sources)].name[6:]}")
    return cache


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=2000)
    ap.add_argument("--out", default=str(ROOT / "results/asm_bench/bench.csv"))
    args = ap.parse_args()
    t0 = time.perf_counter()
    import triton  # noqa: F401  (import cost reported apart)

    t_import = time.perf_counter() - t0
    from workbench.asm.cache import list_entries

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        cache = build_cache(args.entries, work)
        for rep in range(3):
            t0 = time.perf_counter()
            entries = list_entries(cache)
            t_ls = time.perf_counter() - t0
            n_instr = sum(int(e.mix()["count"].sum()) for e in entries)
            t_all = time.perf_counter() - t0
            rows.append({"bench": "ls+mix", "entries": len(entries), "rep": rep, "ls_s": t_ls, "total_s": t_all,
                         "instructions": n_instr, "goal_s": 2.0})
        for rep in range(3):
            fn = gemm_kernel(work, f"r{rep}")  # a new kernel each time: no cache hit
            t0 = time.perf_counter()
            made = compile_gemm(fn, ["sm90", "gfx942", "gfx950"], work / f"xc{rep}")
            rows.append({"bench": "cross_compile_3_targets", "entries": len(made), "rep": rep,
                         "total_s": time.perf_counter() - t0, "import_triton_s": t_import, "goal_s": 5.0})
    df = pd.DataFrame(rows)
    df["machine"] = f"{platform.node()} {platform.processor() or platform.machine()} ({subprocess.getoutput('nproc')} cores)"
    df["python"] = platform.python_version()
    df["triton"] = triton.__version__
    df["timestamp"] = pd.Timestamp.now(tz="UTC").isoformat()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    summary = df.groupby("bench")["total_s"].agg(["median", "min", "max"])
    print(summary.to_string())
    print(f"import triton: {t_import:.2f} s (not counted)")


if __name__ == "__main__":
    main()
