"""torch dtypes as the rest of the workbench needs them: bytes per element and
Triton's type names (``'fp16'``; ``'*fp16'`` for a pointer in a signature).

One table here instead of one per kernel module, so a dtype added for one
study is known to every cross-compilation. torch is imported only when a
function is called (``workbench.dist`` imports this before anything else).
"""
from __future__ import annotations

from typing import Any

__all__ = ["element_size", "triton_type", "triton_pointer"]

# torch dtype name -> Triton type name (as in a cross-compile signature); the
# same names Triton gives them (triton._utils.type_canonicalisation_dict)
_TRITON_NAMES = {
    "float16": "fp16", "bfloat16": "bf16", "float32": "fp32", "float64": "fp64",
    "float8_e4m3fn": "fp8e4nv", "float8_e5m2": "fp8e5",  # NVIDIA fp8
    "float8_e4m3fnuz": "fp8e4b8", "float8_e5m2fnuz": "fp8e5b16",  # AMD CDNA3 fp8
    "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64",
    "uint8": "u8", "uint16": "u16", "uint32": "u32", "uint64": "u64",
    "bool": "u1",
}


def _torch_name(dtype: Any) -> str:
    import torch

    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"expected a torch.dtype such as torch.float16, got {dtype!r}")
    return str(dtype).removeprefix("torch.")


def element_size(dtype: Any) -> int:
    """Bytes per element of a torch dtype (torch.float16 -> 2), without allocating a tensor."""
    _torch_name(dtype)
    return dtype.itemsize


def triton_type(dtype: Any) -> str:
    """Triton's name for a torch dtype: torch.bfloat16 -> 'bf16', torch.int32 -> 'i32'."""
    name = _torch_name(dtype)
    if name not in _TRITON_NAMES:
        raise ValueError(f"{dtype}: no Triton type known for it here (known: "
                         f"{', '.join('torch.' + n for n in _TRITON_NAMES)}); add it to workbench.dtypes")
    return _TRITON_NAMES[name]


def triton_pointer(dtype: Any) -> str:
    """The signature type of a pointer to ``dtype`` elements: torch.float16 -> '*fp16'."""
    return "*" + triton_type(dtype)
