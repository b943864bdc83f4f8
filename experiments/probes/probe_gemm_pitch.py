"""Probe: does the row pitch of A and B decide our large GEMMs' speed?

Large 16-bit shapes whose rows are 16-byte but not 128-byte multiples (K or N not a multiple of 64
elements) ran our kernels at 490-570 TFLOP/s where cuBLAS ran 650-700 (results/gemm_selection/h200/
times_gemm.csv: 9688 x 13224 x 12120, 7429 x 13480 x 13744, 11753 x 3144 x 16216), while shapes
with 128-byte rows ran level with it. Each shape here is timed twice with the same values: as
contiguous tensors, and as views into buffers whose rows are padded to a multiple of 128 bytes
(the same logical problem, only the pitch differs); plus what copying A and B into such buffers
costs. Every candidate of ours named in ``--candidates`` and cuBLAS, CUDA-graph replay with the L2
flushed, each output checked against an fp32 reference.

    python experiments/probes/probe_gemm_pitch.py --out results/gemm_selection/h200_pitch

``--from-times`` reads tuning runs' per-candidate times instead (no GPU): the best of ours over
cuBLAS per 16-bit, 16-byte aligned shape, split by size and by which operands' rows are 128-byte
lines (pitch_split.csv).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

SHAPES = [(9688, 13224, 12120), (7429, 13480, 13744), (11753, 3144, 16216), (6224, 15816, 8792),
          (12950, 9144, 9192), (7140, 1368, 11384), (7065, 616, 14808), (1539, 2824, 4224),
          (15104, 3760, 3128), (8192, 8192, 8192)]
CANDIDATES = ("t128x256", "t128x256sk", "gl_coop", "gl_pp", "t128x128")
PITCH = 64  # elements: 128 bytes of a 16-bit row


def pitch_split(paths):
    """Per size class (M N K >= 2^33 or less) and pitch ('AB': A's and B's rows whole 128-byte lines,
    lower case: not), the best of ours over cuBLAS on the 16-bit, 16-byte aligned shapes of
    ``workbench tune --times`` files: shapes, geomean, least."""
    import pandas as pd

    from experiments.fit_gemm_cold_rule import LIBRARY, geomean, load_times
    from kernels.gemm import tuning as gtuning

    rows = []
    for rec in load_times(paths).values():
        us = rec["us"]
        s = gtuning.shape_of(rec["shape"])
        if LIBRARY not in us or len(us) < 3 or s["dtype"] == "float32":
            continue
        M, N, K = s["M"], s["N"], s["K"]
        if (2 * K) % 16 or (2 * N) % 16:
            continue
        b_row = 2 * (N if s["b"] == "row" else K)   # B's row: N elements, or K when B is a transposed view
        pitch = ("A" if (2 * K) % 128 == 0 else "a") + ("B" if b_row % 128 == 0 else "b")
        ours = min(v for c, v in us.items() if c != LIBRARY)
        rows.append({"large": M * N * K >= 2 ** 33, "pitch": pitch, "ratio": us[LIBRARY] / ours})
    g = pd.DataFrame(rows).groupby(["large", "pitch"]).ratio
    return pd.DataFrame({"shapes": g.size(), "ours_vs_cublas_geomean": g.agg(geomean), "least": g.min()}).reset_index()


def padded_view(t, pitch: int = PITCH):
    """``t`` (2-D, contiguous) copied into a buffer whose rows are a multiple of ``pitch`` elements, as a view."""
    import torch

    rows, cols = t.shape
    buf = torch.empty(rows, -(-cols // pitch) * pitch, dtype=t.dtype, device=t.device)
    view = buf[:, :cols]
    view.copy_(t)
    return view


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--candidates", default=",".join(CANDIDATES))
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop starting shapes after this long")
    ap.add_argument("--shapes", default="", help="MxNxK,... (default: the built-in list)")
    ap.add_argument("--per-operand", action="store_true", help="also pad A alone and B alone")
    ap.add_argument("--from-times", type=Path, nargs="+", default=None,
                    help="no GPU: split these times_gemm.csv files' best of ours over cuBLAS by pitch")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.from_times:
        split = pitch_split(args.from_times)
        split.to_csv(args.out / "pitch_split.csv", index=False)
        print(split.round(3).to_string(index=False))
        return 0

    import pandas as pd
    import torch

    from experiments.run_ag_gemm import parse_shapes
    from kernels.gemm import launch as glaunch, select as gselect
    from workbench import bench, provenance

    shapes = parse_shapes(args.shapes) if args.shapes else SHAPES
    names = [n for n in args.candidates.split(",") if n]
    rows, t0 = [], time.time()
    for M, N, K in shapes:
        if time.time() - t0 > args.budget_s:
            print(f"budget spent: {M}x{N}x{K} and later not run", flush=True)
            break
        g = torch.Generator(device="cuda").manual_seed(M ^ N ^ K)
        a = torch.randn(M, K, device="cuda", generator=g).bfloat16()
        b = torch.randn(K, N, device="cuda", generator=g).bfloat16()
        ref = a.float() @ b.float()
        pa, pb = padded_view(a), padded_view(b)
        layouts = {"contiguous": (a, b), "pitch128": (pa, pb)}
        if args.per_operand:   # which operand's pitch matters
            layouts.update({"pitchA": (pa, b), "pitchB": (a, pb)})
        c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        for what, fn in (("copy A", lambda: pa.copy_(a)), ("copy B", lambda: pb.copy_(b))):
            t = bench.measure(fn, mode="graph", rep_ms=50)
            rows.append(dict(M=M, N=N, K=K, layout=what, candidate="copy", median_us=t.median_ms * 1e3))
        for layout, (x, y) in layouts.items():
            call = glaunch._call(x, y, None, M, N, K, True, True)
            cands = gselect.candidates(call)
            fns = {"cublas": lambda: torch.mm(x, y, out=c)}
            for n in names:
                if n in cands:
                    fns[n] = (lambda cfg=cands[n].config: glaunch.matmul(x, y, cfg, out=c))
            for n, fn in fns.items():
                c.fill_(float("nan"))
                fn()
                err = float((c.float() - ref).norm() / ref.norm())
                tm = bench.measure(fn, mode="graph", rep_ms=60)
                us = tm.median_ms * 1e3
                rows.append(dict(M=M, N=N, K=K, layout=layout, candidate=n, median_us=us,
                                 tflops=2 * M * N * K / us / 1e6, rel_err=err))
                print(f"{M}x{N}x{K} {layout:10s} {n:11s} {us:9.1f} us {2 * M * N * K / us / 1e6:6.0f} TF "
                      f"err {err:.1e}", flush=True)
        del a, b, pa, pb, ref, layouts, c
        torch.cuda.empty_cache()
    df = pd.DataFrame(rows)
    for k, v in provenance.flat(provenance.collect()).items():
        df[k] = v
    df.to_csv(args.out / "pitch.csv", index=False)
    piv = df[df.candidate != "copy"].pivot_table(index=["M", "N", "K", "candidate"], columns="layout",
                                                 values="median_us")
    piv["pitch128_speedup"] = piv["contiguous"] / piv["pitch128"]
    (args.out / "pitch_summary.txt").write_text(piv.round(3).to_string() + "\n")
    print(piv.round(3).to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
