"""A strided 2-D copy made by the copy engine: ``cuMemcpy2DAsync``.

``Tensor.copy_`` into a column block of a wider matrix (a row pitch that differs from the
source's) runs an elementwise kernel on the SMs; only a dense copy becomes
``cudaMemcpyAsync``. The CUDA driver's 2-D copy moves such a block with the copy engine,
leaving every SM to the GEMM it overlaps with, and is captured into CUDA graphs like any
stream-ordered copy. PyTorch does not expose it, so it is called here through the
driver library, as ``kernels.common.cuda_context`` calls the driver for TMA's context.

A ``Copy2D`` is built once per plan (its descriptor holds the two addresses), and each
call is one driver call. Off CUDA it is ``dst.copy_(src)``.
"""
from __future__ import annotations

import ctypes

import torch

from kernels.common.cuda_context import ensure_current, libcuda

CU_MEMORYTYPE_DEVICE = 2


class _Memcpy2D(ctypes.Structure):
    """The driver's ``CUDA_MEMCPY2D`` (cuda.h), field for field."""

    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
                ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


_COPY = None


def _driver_copy():
    """The driver's ``cuMemcpy2DAsync_v2``, its argument types declared once."""
    global _COPY

    if _COPY is None:
        fn = libcuda().cuMemcpy2DAsync_v2
        fn.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
        _COPY = fn
    return _COPY


def _rows(t: torch.Tensor, name: str) -> int:
    """The row pitch in bytes of a 2-D view with unit column stride."""
    if t.dim() != 2 or t.stride(1) != 1 or (t.shape[0] > 1 and t.stride(0) < t.shape[1]):
        raise ValueError(f"Copy2D: {name} must be a 2-D view with unit column stride and rows that do not overlap, "
                         f"got shape {tuple(t.shape)} strides {t.stride()}")
    return max(t.stride(0), t.shape[1]) * t.element_size()


class Copy2D:
    """``dst.copy_(src)`` for two (rows, cols) views of one dtype with unit column stride and
    any row pitch, queued on a CUDA stream by the copy engine (``__call__(stream)``)."""

    def __init__(self, dst: torch.Tensor, src: torch.Tensor):
        if dst.shape != src.shape or dst.dtype != src.dtype:
            raise ValueError(f"Copy2D: dst {tuple(dst.shape)} {dst.dtype} and src {tuple(src.shape)} {src.dtype} "
                             "must have one shape and dtype")
        self.dst, self.src = dst, src
        self.desc = None
        src_pitch, dst_pitch = _rows(src, "src"), _rows(dst, "dst")
        if dst.device.type != "cuda":
            return
        d = _Memcpy2D()
        d.srcMemoryType = d.dstMemoryType = CU_MEMORYTYPE_DEVICE
        d.srcDevice, d.srcPitch = src.data_ptr(), src_pitch
        d.dstDevice, d.dstPitch = dst.data_ptr(), dst_pitch
        d.WidthInBytes, d.Height = dst.shape[1] * dst.element_size(), dst.shape[0]
        self.desc = d
        ensure_current(dst.device)
        self._fn = _driver_copy()

    def __call__(self, stream: torch.cuda.Stream | None = None) -> None:
        if self.desc is None:
            self.dst.copy_(self.src)
            return
        if self.desc.Height == 0 or self.desc.WidthInBytes == 0:
            return
        handle = (stream or torch.cuda.current_stream(self.dst.device)).cuda_stream
        err = self._fn(ctypes.byref(self.desc), ctypes.c_void_p(handle))
        if err != 0:
            raise RuntimeError(f"Copy2D: cuMemcpy2DAsync failed with CUDA driver error {err} copying "
                               f"{tuple(self.src.shape)} {self.src.dtype}; check that both tensors are on "
                               f"{self.dst.device} or on a peer it can access")
