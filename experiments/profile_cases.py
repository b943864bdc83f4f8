"""Profile one kernel of this project per case with Nsight Compute (`workbench profile run`), on a GPU node.

    python experiments/profile_cases.py --out results/profiles/isa_hints hint0 hint1
    python experiments/profile_cases.py --out results/profiles/gemm_tiling gemm gluon
    python experiments/profile_cases.py --out results/profiles/moe_mxfp4 mxfp4
    python experiments/profile_cases.py --out results/profiles/moe_mxfp4 mxfp4_m4 mxfp4_m12 mxfp4_m64 mxfp4_m256
    python experiments/profile_cases.py --out results/profiles/moe_mxfp4 mxfp4_tiles2_m4 mxfp4_tiles2_m64
    python experiments/profile_cases.py --out DIR --csv            # every case, with ncu's own CSV of each

Each case is one command (printed before it runs), e.g. for ``hint1``:

    workbench profile run experiments/profile_cases.py:hint1 --kernel remote_store_kernel --out DIR --name hint1

which writes DIR/hint1.ncu-rep (source counters, warp-state sampling, memory tables; line info and the
source embedded; clocks left alone), DIR/hint1.json (the summary: the Triton cache entry, the command,
ncu's version, the GPU, the commit) and DIR/hint1.triton-cache/ (the run's Triton cache).

Cases (each function launches its kernel twice on random data; the first launch is profiled):
``gemm`` (the persistent TMA GEMM), ``gluon`` (the warp-specialised Gluon GEMM), ``put`` (a copy
through nested inlined helpers: put -> remote_store -> translate), ``put_noline`` (the same compiled
with TRITON_DISABLE_LINE_INFO=1), ``hint0`` / ``hint1`` (the ISA-hints pair: ``remote_store_kernel``
without / with the alignment hint), ``mxfp4`` (the MXFP4 MoE down-projection at KIMI-K2.5's shapes,
M = 12, the plain layout: the committed report), ``mxfp4_m4`` / ``_m12`` / ``_m64`` / ``_m256`` (the same
layer as users run it: prepared weights, level 2, the launcher's default config, the routing prepared
in the call), ``mxfp4_tiles2_m4`` / ``_m64`` (the same with two column tiles per program,
``N_TILES=2``), ``torch_mm`` (``torch.mm``: a cuBLAS kernel with no Triton source).
"""
import argparse
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def gemm():
    from kernels.gemm import GemmConfig, matmul

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    cfg = GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, tma=True)
    for _ in range(2):
        matmul(a, b, cfg)


def gluon():
    from kernels.gemm.launch import matmul_ws

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        matmul_ws(a, b)


def _two_heaps(n, dtype=torch.float16):
    """One buffer holding two 'heaps' of n elements: rank 0's first, rank 1's after it."""
    buf = torch.randn(2 * n + 4096, device="cuda").to(dtype)
    bases = torch.tensor([buf.data_ptr(), buf.data_ptr() + (n + 4096) * buf.element_size()], device="cuda",
                         dtype=torch.int64)
    return buf, bases


def put():
    from kernels.comm.remote import put_kernel

    n = 1 << 24
    buf, bases = _two_heaps(n)
    src = torch.randn(n, device="cuda").to(torch.float16)
    for _ in range(2):
        put_kernel[(132,)](src, buf, n, bases, 0, 1, BLOCK=2048, HINT=True)


put_noline = put  # the same program; the run sets TRITON_DISABLE_LINE_INFO=1


def _hint(on):
    from kernels.comm.remote import remote_store_kernel

    n = 1 << 24
    buf, bases = _two_heaps(n)
    for _ in range(2):
        remote_store_kernel[(n // 2048,)](bases, buf, n, rank=0, peer=1, BLOCK=2048, HINT=on)


def hint0():
    _hint(False)


def hint1():
    _hint(True)


def mxfp4():
    from kernels.moe_mxfp4 import moe_mxfp4_down, prepare_routing, quantize_mxfp4

    E, H, I, top, M = 385, 7168, 512, 9, 12
    g = torch.Generator(device="cuda").manual_seed(M)
    w, w_scale = quantize_mxfp4(torch.randn(E, H, I, device="cuda", generator=g) * 0.02)
    a = torch.randn(M * top, I, device="cuda", generator=g).bfloat16()
    ids = torch.rand(M, E, device="cuda", generator=g).topk(top, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(M, top, device="cuda", generator=g), -1)
    for _ in range(2):
        moe_mxfp4_down(a, w, w_scale, prepare_routing(ids, wts, E, 16))


KIMI_K25 = dict(E=385, H=7168, I=512, top_k=9)      # the down-projection's layer


def _mxfp4_prepared(M: int, n_tiles: int = 1, *, layer: dict = KIMI_K25, device: str = "cuda"):
    """KIMI-K2.5's down-projection at M tokens as users run it: weights prepared once (level 2), the
    router's (ids, weights) handed to the call (the routing kernel runs in it; only the down kernel
    is profiled), the launcher's config, with n_tiles column tiles per program where asked. Returns
    the last output (the CPU test runs a small layer in the interpreter)."""
    from kernels.moe_mxfp4 import default_config, moe_mxfp4_down, prepare_weights, quantize_mxfp4

    E, H, I, top = layer["E"], layer["H"], layer["I"], layer["top_k"]
    g = torch.Generator(device=device).manual_seed(M)
    weights = prepare_weights(*quantize_mxfp4(torch.randn(E, H, I, device=device, generator=g) * 0.02))
    a = torch.randn(M * top, I, device=device, generator=g).bfloat16()
    ids = torch.rand(M, E, device=device, generator=g).topk(top, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(M, top, device=device, generator=g), -1)
    cfg = None
    if n_tiles > 1:      # the default config for this M (its BLOCK_M is the routing's), n_tiles wide
        cfg = default_config(M, top, E, I, prepacked=weights.level).replace(N_TILES=n_tiles)
    for _ in range(2):
        out = moe_mxfp4_down(a, weights, (ids, wts), config=cfg)
    return out


def mxfp4_m4():
    _mxfp4_prepared(4)


def mxfp4_m12():
    _mxfp4_prepared(12)


def mxfp4_m64():
    _mxfp4_prepared(64)


def mxfp4_m256():
    _mxfp4_prepared(256)


def mxfp4_tiles2_m4():
    _mxfp4_prepared(4, n_tiles=2)


def mxfp4_tiles2_m64():
    _mxfp4_prepared(64, n_tiles=2)


def torch_mm():
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        torch.mm(a, a)


# case -> (the kernel's name regex, extra environment)
CASES = {
    "gemm": ("_gemm_tma", {}),
    "gluon": ("_gemm_ws", {}),
    "put": ("put_kernel", {}),
    "put_noline": ("put_kernel", {"TRITON_DISABLE_LINE_INFO": "1"}),
    "hint0": ("remote_store_kernel", {}),
    "hint1": ("remote_store_kernel", {}),
    "mxfp4": ("_moe_mxfp4_down_kernel", {}),
    **{f"mxfp4_m{m}": ("_moe_mxfp4_down_kernel", {}) for m in (4, 12, 64, 256)},
    **{f"mxfp4_tiles2_m{m}": ("_moe_mxfp4_down_kernel", {}) for m in (4, 64)},
    "torch_mm": ("nvjet|gemm|cutlass|sm90", {}),
}


def command(case: str, out: str, csv: bool = False) -> list[str]:
    kernel, _ = CASES[case]
    cmd = [sys.executable, "-m", "workbench.cli", "profile", "run", f"experiments/profile_cases.py:{case}",
           "--kernel", kernel, "--out", out, "--name", case]
    return cmd + (["--csv"] if csv else [])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("cases", nargs="*", metavar="CASE", help=f"default: all of {', '.join(CASES)}")
    p.add_argument("--out", required=True, help="where the reports go")
    p.add_argument("--csv", action="store_true", help="also write ncu's own per-instruction CSV of each report")
    args = p.parse_args(argv)
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        p.error(f"unknown case(s) {unknown}; choose from {', '.join(CASES)}")
    failed = []
    out = str(Path(args.out).resolve())  # the runs start in the repository
    for case in args.cases or list(CASES):
        cmd = command(case, out, args.csv)
        env = {k: v for k, v in os.environ.items() if k != "TRITON_DISABLE_LINE_INFO"}
        env.update(CASES[case][1])
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        shown = " ".join(f"{k}={v}" for k, v in CASES[case][1].items())
        print(f"$ {shown + ' ' if shown else ''}{shlex.join(['workbench', *cmd[3:]])}", flush=True)
        if subprocess.run(cmd, cwd=REPO, env=env).returncode != 0:
            failed.append(case)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
