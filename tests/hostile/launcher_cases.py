"""Hostile launcher arguments: each call must raise a ValueError that names the launcher.

    python tests/hostile/launcher_cases.py        # one JSON line per case

Runs on CPU in Triton's interpreter (one process: importing torch once keeps
the corpus fast); tests/test_hostile.py checks every line.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from kernels.gemm import matmul, matmul_ws  # noqa: E402
from kernels.moe import grouped_gemm, grouped_gemm_wgrad  # noqa: E402

_gen = torch.Generator().manual_seed(19)


def rnd(*shape, dtype=torch.float16):
    return torch.randn(*shape, generator=_gen).to(dtype)


A, B = rnd(16, 32), rnd(32, 24)
X, W, SIZES = rnd(16, 32), rnd(2, 32, 24), torch.tensor([8, 8])

# name -> (call, text the ValueError must hold)
CASES = {
    "gemm int32": (lambda: matmul(A.int(), B.int()), "dtype torch.int32"),
    "gemm float64": (lambda: matmul(A.double(), B.double()), "dtype torch.float64"),
    "gemm bool": (lambda: matmul(A.bool(), B.bool()), "dtype torch.bool"),
    "gemm complex": (lambda: matmul(A.to(torch.complex64), B.to(torch.complex64)), "complex64"),
    "gemm mixed dtypes": (lambda: matmul(A, B.float()), "share a dtype"),
    "gemm 1-D": (lambda: matmul(A[0], B), "2-D"),
    "gemm 3-D": (lambda: matmul(A[None], B), "2-D"),
    "gemm 0-D": (lambda: matmul(torch.tensor(1.0), B), "2-D"),
    "gemm inner mismatch": (lambda: matmul(A, rnd(31, 24)), "inner dimensions"),
    "gemm meta device": (lambda: matmul(A.to("meta"), B.to("meta")), "meta"),
    "gemm two devices": (lambda: matmul(A.to("meta"), B), "one device"),
    "gemm 2**31 rows on meta": (lambda: matmul(torch.empty(2**31, 1, dtype=torch.float16, device="meta"),
                                               torch.empty(1, 2**31, dtype=torch.float16, device="meta")), "meta"),
    "gemm list": (lambda: matmul([[1.0]], [[1.0]]), "torch tensors"),
    "gemm None": (lambda: matmul(None, B), "torch tensors"),
    "gemm numpy": (lambda: matmul(A.numpy(), B.numpy()), "torch tensors"),
    "gemm text": (lambda: matmul("a", "b"), "torch tensors"),
    "gemm unknown config field": (lambda: matmul(A, B, config={"blok_m": 64}), "unknown config field"),
    "gemm config 2**40 tile": (lambda: matmul(A, B, config={"block_m": 2**40}), "power of two from 16 to 1024"),
    "gemm config 10**10 tile": (lambda: matmul(A, B, config={"block_m": 10**10}), "power of two"),
    "gemm config negative tile": (lambda: matmul(A, B, config={"block_m": -64}), "power of two"),
    "gemm config text tile": (lambda: matmul(A, B, config={"block_m": "64"}), "power of two"),
    "gemm config nan tile": (lambda: matmul(A, B, config={"block_m": float("nan")}), "power of two"),
    "gemm config 10**6 stages": (lambda: matmul(A, B, config={"num_stages": 10**6}), "num_stages"),
    "gemm config 10**9 SMs": (lambda: matmul(A, B, config={"num_sms": 10**9}), "num_sms"),
    "gemm config list": (lambda: matmul(A, B, config=[64]), "config must be"),
    "gemm config code": (lambda: matmul(A, B, config="__import__('os').system('touch canary')"), "config must be"),
    "gemm config gluon": (lambda: matmul(A, B, config={"gluon": True}), "gluon"),
    "gemm out shape": (lambda: matmul(A, B, out=rnd(16, 25)), "out must be"),
    "gemm out dtype": (lambda: matmul(A, B, out=rnd(16, 24, dtype=torch.float32)), "out must be"),
    "gemm out list": (lambda: matmul(A, B, out=[0]), "out must be a torch tensor"),
    "gemm out meta": (lambda: matmul(A, B, out=rnd(16, 24).to("meta")), "out must be"),
    "gemm_ws in the interpreter": (lambda: matmul_ws(A, B), "interpreter"),
    "grouped sizes float": (lambda: grouped_gemm(X, W, torch.tensor([8.0, 8.0])), "int32 or int64"),
    "grouped sizes negative": (lambda: grouped_gemm(X, W, torch.tensor([24, -8])), ">= 0"),
    "grouped sizes count": (lambda: grouped_gemm(X, W, torch.tensor([8, 4, 4])), "3 entries"),
    "grouped sizes 2-D": (lambda: grouped_gemm(X, W, torch.tensor([[8, 8]])), "1-D"),
    "grouped sizes list": (lambda: grouped_gemm(X, W, [8, 8]), "torch.Tensor"),
    "grouped w 2-D": (lambda: grouped_gemm(X, rnd(32, 24), SIZES), "3-D"),
    "grouped int32": (lambda: grouped_gemm(X.int(), W.int(), SIZES), "dtype"),
    "grouped wgrad rows": (lambda: grouped_gemm_wgrad(X, rnd(15, 24), SIZES), "rows"),
    "grouped wgrad negative": (lambda: grouped_gemm_wgrad(X, rnd(16, 24), torch.tensor([24, -8])), ">= 0"),
}


def main() -> None:
    for name, (call, expect) in CASES.items():
        t0 = time.perf_counter()
        try:
            call()
            kind, message = None, "no error"
        except Exception as exc:  # the record says what was raised; the test judges it
            kind, message = type(exc).__name__, str(exc)
        print(json.dumps({"name": name, "raised": kind, "message": message[:500], "expect": expect,
                          "seconds": round(time.perf_counter() - t0, 3)}), flush=True)
    print(json.dumps({"total": len(CASES)}))  # the run got to the end


if __name__ == "__main__":
    main()
