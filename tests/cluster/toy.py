"""A toy Triton kernel for the cluster tests: y = a * x + b, one BLOCK of elements per program.

It implements the sweep protocol (``workbench.sweep``) in a few lines, so that a
sweep of ~40 points runs in Triton's interpreter in seconds. ``$CLUSTER_TOY_SLEEP_S``
makes every point take at least that long (a test that cancels a job mid-run
needs the job to still be running); ``$CLUSTER_TOY_CRASH=N,BLOCK`` makes the point
of that size and block kill its process.
"""
import os
import time

import torch
import triton
import triton.language as tl

from kernels.common import interpreter
from workbench.dtypes import element_size

interpreter.patch()

PARAMS = {"BLOCK": 64, "num_warps": 4}
A = 2.0


@triton.jit
def _axpb_kernel(x_ptr, y_ptr, n, a, b, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    tl.store(y_ptr + offs, (x * a + b).to(y_ptr.dtype.element_ty), mask=mask)


def make_inputs(shape, dtype, device, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape["n"], generator=g).to(dtype).to(device)
    return {"x": x, "y": torch.empty_like(x), "b": 0.5}


def poison(inputs):
    inputs["y"].fill_(float("nan"))
    delay = float(os.environ.get("CLUSTER_TOY_SLEEP_S") or 0)
    if delay > 0:
        time.sleep(delay)


def run(inputs, BLOCK=64, num_warps=4):
    x, y = inputs["x"], inputs["y"]
    if os.environ.get("CLUSTER_TOY_CRASH") == f"{x.numel()},{BLOCK}":
        os.abort()  # a point that kills its process (as a sticky GPU fault can)
    _axpb_kernel[(triton.cdiv(x.numel(), BLOCK),)](x, y, x.numel(), A, inputs["b"], BLOCK=BLOCK, num_warps=num_warps)
    return y


def reference(inputs):
    return inputs["x"].double() * A + inputs["b"]


def flops(shape):
    return 2 * shape["n"]


def bytes_moved(shape, dtype):
    return 2 * shape["n"] * element_size(dtype)


def tolerance(dtype):
    return 1e-2 if dtype in (torch.float16, torch.bfloat16) else 1e-5


def label(params):
    return f"B{params['BLOCK']} w{params['num_warps']}"


baselines = {"torch": lambda inputs: torch.add(inputs["x"] * A, inputs["b"], out=inputs["y"])}
