"""The clock that bounds every device-side wait, and how long a wait may last.

A bounded wait (``kernels.comm.waits.wait``) gives up after a TIME, not after
a number of polls: how fast a poll goes depends on the GPU, the scope of the
atomic and the traffic on the link, so a poll count bounds nothing a user can
reason about (``1 << 24`` polls of the fused all-gather + GEMM gave up after
0.9 s on an H200: shorter than ordinary skew between the ranks of a Python
program). The kernels read the GPU's own clock:

* NVIDIA: ``%globaltimer`` (nanoseconds; PTX ``mov.u64 $0, %globaltimer``);
* AMD: ``s_memrealtime``, a constant 100 MHz counter (10 ns per tick; Triton's
  ``memrealtime``, which also knows gfx11/gfx12's spelling);
* Triton's interpreter (CPU, simulated worlds): the host's ``time.monotonic_ns()``.
  A simulated wait therefore also counts seconds, so a test can hold a peer back
  for a time and see the bound hold (the interpreter polls about every 0.1-0.2
  ms, so a wait overshoots its bound by about that).

``device_ns()`` picks the clock when the kernel is compiled, from the target
(``options.arch``: ``sm*`` or ``gfx*``) or, in the interpreter, at run time: the
kernels need no constexpr for it, and a kernel cross-compiled for sm_90 and
gfx942 in one run gets each target's clock. It is a Triton builtin (like
``tl.extra.cuda.globaltimer``) that also accepts being called without a
compiler, which is how the interpreter calls it.

How long: ``timeout_s=`` on a call, else the environment variable
``WORKBENCH_WAIT_TIMEOUT_S`` (as NCCL takes its timeout; parsed once per value),
else ``DEFAULT_TIMEOUT_S`` = 60 s. Why a minute: a wait must outlast ordinary
skew between the ranks of a Python program. A first call compiling on one rank
while its peers already wait costs seconds (cross-compiling the fused
all-gather + GEMM kernel for sm_90 took 1.4 s on a 2-core machine; a cold
start compiles several kernels and creates the CUDA and cuBLAS contexts), a
garbage-collection pause well under a second; the long one is a rank writing a
file between two calls (rank 0 saving a checkpoint of some GB: tens of
seconds). A minute covers those and still reports a dead peer long before
PyTorch's NCCL watchdog (10 minutes by default) would; a program that holds a
rank back longer raises the bound. The kernels take the bound as int32
microseconds: at most ``MAX_TIMEOUT_S`` (about 35 minutes).
"""
from __future__ import annotations

import math
import os
import time

import triton.language as tl

DEFAULT_TIMEOUT_S = 60.0
TIMEOUT_ENV = "WORKBENCH_WAIT_TIMEOUT_S"
MAX_TIMEOUT_S = (2 ** 31 - 1) / 1e6   # int32 microseconds

_ENV_CACHE: dict[str, int] = {}


def device_ns(_semantic=None):
    """Nanoseconds on the device's clock, as a scalar int64 (only differences mean anything).
    Call it from a ``@triton.jit`` or ``@gluon.jit`` function: ``t0 = device_ns()``."""
    if _semantic is None or type(_semantic.builder).__name__ == "InterpreterBuilder":
        import numpy as np
        from triton.runtime.interpreter import TensorHandle

        return tl.core.tensor(TensorHandle(np.array([time.monotonic_ns()], dtype=np.int64), tl.int64), tl.int64)
    arch = str(getattr(_semantic.builder.options, "arch", "") or "")
    if arch.startswith("gfx"):
        from triton.language.extra.hip import memrealtime

        return memrealtime(_semantic=_semantic).__mul__(10, _semantic=_semantic)
    from triton.language.extra.cuda import globaltimer

    return globaltimer(_semantic=_semantic)


# a builtin: the compiler hands it its semantic (tl.core.builtin's wrapper would refuse the interpreter's None)
setattr(device_ns, tl.core.TRITON_BUILTIN, True)


def _check_seconds(value, what: str) -> int:
    try:
        s = float(value)
    except (TypeError, ValueError):
        s = math.nan
    if isinstance(value, bool) or not (0 < s <= MAX_TIMEOUT_S):
        raise ValueError(f"{what} must be a number of seconds above 0 and at most {MAX_TIMEOUT_S:.0f} "
                         f"(the kernels count it in int32 microseconds), got {value!r}")
    return max(1, int(round(s * 1e6)))


def timeout_us(timeout_s=None) -> int:
    """The bound of a call's waits in microseconds (what the kernels take): ``timeout_s`` if
    given, else ``$WORKBENCH_WAIT_TIMEOUT_S``, else ``DEFAULT_TIMEOUT_S``. A bad value is a
    ValueError that says what to pass."""
    if timeout_s is not None:
        return _check_seconds(timeout_s, "timeout_s")
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return int(DEFAULT_TIMEOUT_S * 1e6)
    us = _ENV_CACHE.get(raw)
    if us is None:
        us = _ENV_CACHE[raw] = _check_seconds(raw.strip(), f"${TIMEOUT_ENV}")
    return us
