"""The CUDA driver library and its current context, for host code that builds TMA
descriptors (and ``kernels.common.memcpy2d``'s copies).

Building a TMA descriptor (``cuTensorMapEncodeTiled``) needs a current driver
context. Threads that only ever used the runtime API lazily, such as autograd's
backward worker, may have none ("invalid device context"), so every launcher
that builds descriptors calls ``ensure_current`` first.
"""
import ctypes

import torch

_PRIMARY_CTX: dict[int, int] = {}
_LIBCUDA = None


def libcuda():
    """The CUDA driver library (loaded once; OSError where there is none)."""
    global _LIBCUDA

    if _LIBCUDA is None:
        _LIBCUDA = ctypes.CDLL("libcuda.so.1")
    return _LIBCUDA


def ensure_current(device: torch.device) -> None:
    """Make the device's primary CUDA context current on this thread (no-op off CUDA)."""
    if device.type != "cuda":
        return
    idx = device.index if device.index is not None else torch.cuda.current_device()
    try:
        lib = libcuda()
        if idx not in _PRIMARY_CTX:
            dev = ctypes.c_int()
            ctx = ctypes.c_void_p()
            if lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(idx)) != 0 or \
                    lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev) != 0:
                return
            _PRIMARY_CTX[idx] = ctx.value
        cur = ctypes.c_void_p()
        if lib.cuCtxGetCurrent(ctypes.byref(cur)) == 0 and cur.value != _PRIMARY_CTX[idx]:
            lib.cuCtxSetCurrent(ctypes.c_void_p(_PRIMARY_CTX[idx]))
    except OSError:      # no libcuda.so.1 (then there is no TMA to set up either)
        return
