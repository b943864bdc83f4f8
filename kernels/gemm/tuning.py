"""``workbench tune gemm``: the GEMM family's shapes for the command line and one shape tuned at a
time (kernels.gemm.select chooses; this module builds a shape's operands and asks it to tune)."""
from __future__ import annotations

from typing import Any, Mapping

import torch

from kernels.common import select as common
from kernels.gemm import launch
from kernels.gemm.select import _DT, Family, cold, problem, tuner

NAME = "gemm"


DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
          "float32": torch.float32, "fp32": torch.float32}
LAYOUTS = ("row", "t")
MAX_DIM = 1 << 20


def shape_of(row: Mapping[str, Any]) -> dict:
    """A shape spec row checked: M, N, K (1 .. 2^20), dtype (bfloat16/float16/float32, default
    bfloat16), b (``row``, or ``t``: B a transposed view, as ``x @ w.t()``; default row).
    Other fields (source, split, ...) are kept as they are."""
    out = dict(row)
    for k in ("M", "N", "K"):
        v = row.get(k)
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_DIM:
            raise ValueError(f"gemm shape {dict(row)}: {k} must be an integer from 1 to {MAX_DIM}, got {v!r}")
    dtype = str(row.get("dtype", "bfloat16"))
    if dtype not in DTYPES:
        raise ValueError(f"gemm shape {dict(row)}: dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    layout = str(row.get("b", "row"))
    if layout not in LAYOUTS:
        raise ValueError(f"gemm shape {dict(row)}: b must be 'row' or 't' (B a transposed view), got {layout!r}")
    out.update(dtype=dtype, b=layout)
    return out


def key_of(shape: Mapping[str, Any]) -> str:
    """The table key ``tune_shape`` writes for this shape (fresh contiguous operands)."""
    dtype = DTYPES[shape["dtype"]]
    es = torch.empty((), dtype=dtype).element_size()
    M, N, K, layout = shape["M"], shape["N"], shape["K"], shape["b"]
    a_ok, c_ok = (K * es) % 16 == 0, (N * es) % 16 == 0
    b_ok = (K * es) % 16 == 0 if layout == "t" else (N * es) % 16 == 0
    return common.problem_key({"dtype": _DT[dtype], "M": M, "N": N, "K": K, "b": layout,
                               "tma": f"{int(a_ok)}{int(b_ok)}{int(c_ok)}"})


def operands(shape: Mapping[str, Any], device: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh random A (M, K) and B (K, N) for a shape (B a transposed view for ``b: t``)."""
    dtype = DTYPES[shape["dtype"]]
    M, N, K = shape["M"], shape["N"], shape["K"]
    g = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(M, K, device=device, generator=g).to(dtype)
    if shape["b"] == "t":
        return a, torch.randn(N, K, device=device, generator=g).to(dtype).t()
    return a, torch.randn(K, N, device=device, generator=g).to(dtype)


def tune_shape(shape: Mapping[str, Any], *, budget: float | None = None, progress=None, timer=None,
               seed: int = 0) -> tuple[str, dict, Any]:
    """Tune one shape on this process's device (the interpreter without a GPU): (table key,
    entry, ``kernels.common.tune.Result``)."""
    from kernels.common import interpreter

    device = "cpu" if interpreter.active() or not torch.cuda.is_available() else "cuda"
    a, b = operands(shape, device, seed)
    M, K = a.shape
    N = b.shape[1]
    dd, gdd = launch._descriptors_on_device(M, N, K, a.element_size(), False, launch.DEVICE_DESCRIPTORS,
                                            launch.GLUON_DEVICE_DESCRIPTORS)
    call = launch._call(a, b, None, M, N, K, dd, gdd)
    start = cold(call)
    result = tuner(call, budget, timer, progress, count_first_runs=False)(start)
    entry = common.record(Family(call), result, start, by="workbench tune")
    return common.problem_key(problem(call)), entry, result
