"""The torch reference of the GEMM family (fp32, tf32 off)."""
from __future__ import annotations

import torch


def reference(a, b: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 torch product of the same operands (tf32 off).

    ``reference(a, b)``, or ``reference(inputs)`` with a ``GemmInputs`` (the
    sweep protocol's form).
    """
    if b is None:
        a, b = a.a, a.b
    if a.device.type == "cuda":
        prev = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = False
        try:
            return a.float() @ b.float()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = prev
    return a.float() @ b.float()

