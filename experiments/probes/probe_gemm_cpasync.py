"""Probe: a persistent GEMM whose operands are loaded with pointer loads (cp.async, 16-byte vectors)
instead of TMA, on shapes whose rows are 16-byte but not 128-byte multiples.

``probe_gemm_pitch.py`` found our TMA kernels 1.2-1.9x slower on such rows than on the same
problem with 128-byte rows: ncu counts 3.6x the L2 requests (902 M against 252 M at 9688 x 13224 x
12120, L2 94% busy), a misaligned box row being cut into several requests. Pointer loads of 16
bytes per thread coalesce per 128-byte line, so a misaligned row segment costs two requests.
Triton can only vectorize them if it knows the rows are 16-byte aligned: the row strides, N and
K reach the kernel divided by 8 (``ALIGN``) and are multiplied back inside it.

    python experiments/probes/probe_gemm_cpasync.py --out results/gemm_selection/h200_pitch
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

SHAPES = [(9688, 13224, 12120), (11753, 3144, 16216), (7065, 616, 14808), (7140, 1368, 11384),
          (1539, 2824, 4224), (8192, 8192, 8192)]
# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages, A's cache modifier): ".ca" keeps A's lines in L1, where
# the line a misaligned row segment shares with the next K-step's may still be found
CONFIGS = [(128, 256, 64, 8, 3, ""), (128, 256, 64, 8, 4, ""), (128, 128, 64, 8, 4, ""),
           (128, 256, 64, 8, 3, ".ca"), (128, 128, 64, 8, 4, ".ca"), (128, 128, 128, 8, 3, ""),
           (128, 128, 128, 8, 3, ".ca"), (128, 256, 128, 8, 2, ".ca")]


@triton.jit
def _cpasync_gemm(a_ptr, b_ptr, c_ptr, M, N_q, K_q, sam_q, sbk_q, scm_q, num_sms,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                  STAGES: tl.constexpr, ALIGN: tl.constexpr, CACHE_A: tl.constexpr = ""):
    N = N_q * ALIGN
    K = K_q * ALIGN
    stride_am = sam_q * ALIGN
    stride_bk = sbk_q * ALIGN
    stride_cm = scm_q * ALIGN
    num_pid_m = tl.cdiv(M, BM)
    num_pid_n = tl.cdiv(N, BN)
    tiles = num_pid_m * num_pid_n
    k_full = K // BK
    for tile_id in tl.range(tl.program_id(0), tiles, num_sms, flatten=False):
        group = tile_id // (GROUP_M * num_pid_n)
        first_m = group * GROUP_M
        size_m = tl.minimum(num_pid_m - first_m, GROUP_M)
        pid_m = first_m + (tile_id % size_m)
        pid_n = (tile_id % (GROUP_M * num_pid_n)) // size_m
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        row_ok = rows < M
        col_ok = cols < N
        a_ptrs = a_ptr + rows[:, None] * stride_am + ks[None, :]
        b_ptrs = b_ptr + ks[:, None] * stride_bk + cols[None, :]
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for kk in tl.range(0, k_full, num_stages=STAGES):
            a = tl.load(a_ptrs, mask=row_ok[:, None], other=0.0, cache_modifier=CACHE_A)
            b = tl.load(b_ptrs, mask=col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BK
            b_ptrs += BK * stride_bk
        if k_full * BK < K:
            k_in = (k_full * BK + ks) < K
            a = tl.load(a_ptrs, mask=row_ok[:, None] & k_in[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_in[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(a, b, acc)
        c_ptrs = c_ptr + rows[:, None] * stride_cm + cols[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def run(a, b, c, cfg, sms):
    BM, BN, BK, W, S, CA = cfg
    M, K = a.shape
    N = b.shape[1]
    assert K % 8 == 0 and N % 8 == 0 and a.stride(0) % 8 == 0 and b.stride(0) % 8 == 0 and c.stride(0) % 8 == 0
    tiles = triton.cdiv(M, BM) * triton.cdiv(N, BN)
    _cpasync_gemm[(min(sms, tiles),)](a, b, c, M, N // 8, K // 8, a.stride(0) // 8, b.stride(0) // 8,
                                      c.stride(0) // 8, sms, BM=BM, BN=BN, BK=BK, GROUP_M=8, STAGES=S, ALIGN=8,
                                      CACHE_A=CA, num_warps=W)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default="", help="MxNxK,... (default: the built-in list)")
    args = ap.parse_args(argv)

    import pandas as pd
    import torch

    from experiments.probes.probe_gemm_pitch import padded_view
    from experiments.run_ag_gemm import parse_shapes
    from kernels.gemm import launch as glaunch, select as gselect
    from workbench import bench, provenance

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for M, N, K in parse_shapes(args.shapes) if args.shapes else SHAPES:
        g = torch.Generator(device="cuda").manual_seed(M ^ N ^ K)
        a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        b = torch.randn(K, N, device="cuda", generator=g).bfloat16()
        ref = a.float() @ b.float()
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        for layout, (x, y) in {"contiguous": (a, b), "pitch128": (padded_view(a), padded_view(b))}.items():
            call = glaunch._call(x, y, None, M, N, K, True, True)
            cands = gselect.candidates(call)
            fns = {"cublas": lambda: torch.mm(x, y, out=c)}
            if "t128x256" in cands:
                fns["t128x256"] = lambda cfg=cands["t128x256"].config: glaunch.matmul(x, y, cfg, out=c)
            for cfg in CONFIGS:
                fns["cp%dx%dx%d_w%d_s%d%s" % cfg] = lambda cfg=cfg: run(x, y, c, cfg, sms)
            for n, fn in fns.items():
                c.fill_(float("nan"))
                try:
                    fn()
                except Exception as exc:   # a config that does not compile here: say so, go on
                    print(f"{M}x{N}x{K} {layout} {n}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
                    continue
                err = float((c.float() - ref).norm() / ref.norm())
                us = bench.measure(fn, mode="graph", rep_ms=60).median_ms * 1e3
                rows.append(dict(M=M, N=N, K=K, layout=layout, candidate=n, median_us=us,
                                 tflops=2 * M * N * K / us / 1e6, rel_err=err))
                print(f"{M}x{N}x{K} {layout:10s} {n:22s} {us:9.1f} us {2 * M * N * K / us / 1e6:6.0f} TF "
                      f"err {err:.1e}", flush=True)
        del a, b, ref, c
        torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    for k, v in provenance.flat(provenance.collect()).items():
        df[k] = v
    df.to_csv(args.out / "cpasync.csv", index=False)
    piv = df.pivot_table(index=["M", "N", "K", "candidate"], columns="layout", values="median_us")
    (args.out / "cpasync_summary.txt").write_text(piv.round(1).to_string() + "\n")
    print(piv.round(1).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
