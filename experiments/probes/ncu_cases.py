"""Small programs that launch one kernel of this project each, for Nsight Compute to profile.

    ncu --section SourceCounters --section WarpStateStats --import-source yes \
        -k regex:_gemm_tma --launch-count 1 -o gemm python3 experiments/probes/ncu_cases.py gemm

Cases: ``gemm`` (the persistent TMA GEMM), ``gluon`` (the warp-specialised Gluon GEMM),
``put`` (a copy through nested inlined helpers: put -> remote_store -> translate),
``hint0`` / ``hint1`` (the ISA-hints pair: ``remote_store_kernel`` without / with the
alignment hint), ``mxfp4`` (the MXFP4 MoE down-projection at KIMI-K2.5's shapes, M = 12),
``torch`` (``torch.mm``: a library kernel with no Triton source). Every case launches its
kernel twice (the first compiles) on random data.
"""
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402


def _gemm():
    from kernels.gemm import GemmConfig, matmul

    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    cfg = GemmConfig(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8, tma=True)
    for _ in range(2):
        matmul(a, b, cfg)


def _gluon():
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


def _put():
    from kernels.comm.remote import put_kernel

    n = 1 << 24
    buf, bases = _two_heaps(n)
    src = torch.randn(n, device="cuda").to(torch.float16)
    for _ in range(2):
        put_kernel[(132,)](src, buf, n, bases, 0, 1, BLOCK=2048, HINT=True)


def _hint(on):
    from kernels.comm.remote import remote_store_kernel

    n = 1 << 24
    buf, bases = _two_heaps(n)
    for _ in range(2):
        remote_store_kernel[(n // 2048,)](bases, buf, n, rank=0, peer=1, BLOCK=2048, HINT=on)


def _mxfp4():
    from kernels.moe_mxfp4 import moe_mxfp4_down, prepare_routing, quantize_mxfp4

    E, H, I, top, M = 385, 7168, 512, 9, 12
    g = torch.Generator(device="cuda").manual_seed(M)
    w, w_scale = quantize_mxfp4(torch.randn(E, H, I, device="cuda", generator=g) * 0.02)
    a = torch.randn(M * top, I, device="cuda", generator=g).bfloat16()
    ids = torch.rand(M, E, device="cuda", generator=g).topk(top, dim=1).indices.to(torch.int32)
    wts = torch.softmax(torch.randn(M, top, device="cuda", generator=g), -1)
    for _ in range(2):
        moe_mxfp4_down(a, w, w_scale, prepare_routing(ids, wts, E, 16))


def _torch():
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        torch.mm(a, a)


CASES = {"gemm": _gemm, "gluon": _gluon, "put": _put, "hint0": lambda: _hint(False), "hint1": lambda: _hint(True),
         "mxfp4": _mxfp4, "torch": _torch}

if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in CASES:
        sys.exit(f"usage: ncu_cases.py {{{','.join(CASES)}}}")
    CASES[sys.argv[1]]()
    torch.cuda.synchronize()
