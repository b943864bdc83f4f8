"""What every GEMM variant's plan builder shares: the plan record, the facts of one call
signature (``Call``), operand checks for TMA, aligned copies, and the fp32 workspace.

A variant (``kernels.gemm.variants``) turns a ``Call`` and its config into a ``GemmPlan``
once per call signature; ``kernels.gemm.launch.matmul`` then hands each call's tensors to
the variant's ``launch``.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kernels.common.launcher import PlannedLaunch

try:  # triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover
    TensorDescriptor = None

_I32 = 2**31


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """Everything ``matmul`` decides for one call signature."""

    kind: str  # "empty", "zero", or the kernel: "tma", "ptr", "splitk", "fma", "gluon", "library"
    M: int
    N: int
    K: int
    config: Any = None  # the variant's config it runs (a GemmConfig for the Triton kernels, a WsConfig for Gluon)
    launch: PlannedLaunch | None = None  # the kernel, grid, constexprs and options
    args: tuple = ()  # run-time scalars after the tensors
    sk_tiles: int = 0  # tiles with arrival counters (stream-K tail, split-K, fma); 0: none
    programs: int = 1
    blocks: tuple = ()  # the descriptors' boxes (A, B, C), or their layouts too (Gluon)
    pad_a: int = 0  # > 0: copy A into a buffer of this many columns first (TMA needs aligned rows)
    pad_b: int = 0  # the same for B
    b_kmajor: bool = False  # B's descriptor is over B^T (N, K): a K-major B (or the copy trans_b makes)
    trans_b: bool = False  # copy a row-major B K-major first (fp32: tf32 wgmma reads B only K-major)
    device_desc: bool = False  # kinds "tma"/"splitk"/"gluon": the kernel encodes its TMA descriptors itself
    choice: Any = None  # kernels.common.select.Choice: which candidate runs and why (no explicit config)


@dataclasses.dataclass(frozen=True)
class Call:
    """The facts of one call signature a plan is made from (the tensors only for their
    strides, alignment and device; a plan never keeps them)."""

    a: torch.Tensor
    b: torch.Tensor
    out: torch.Tensor | None
    M: int
    N: int
    K: int
    on_gpu: bool
    hopper: bool  # sm_90 or newer (TMA)
    sm90: bool  # exactly sm_90 (the Gluon kernel's wgmma and setmaxnreg)
    sms: int
    a_ok: bool  # A's rows TMA-addressable as given
    b_ok: bool  # B's rows TMA-addressable as given, row-major or K-major
    b_km: bool  # B is read K-major as given (a transposed view)
    c_ok: bool  # C's rows TMA-addressable (a fresh C: when N's rows are)
    device_descriptors: bool  # the Triton kernels may encode their own descriptors (short, eager)
    gluon_device_descriptors: bool  # the same for the Gluon kernel

    @property
    def dtype(self) -> torch.dtype:
        return self.a.dtype

    @property
    def es(self) -> int:
        return self.a.element_size()

    @property
    def aligned(self) -> bool:
        """Every operand as given TMA-addressable (the Gluon kernel's condition)."""
        return TensorDescriptor is not None and self.a_ok and self.b_ok and self.c_ok

    @property
    def b_kmajor_layout(self) -> bool:
        """B is a transposed view, K contiguous (the layout the fp32 rule looks at)."""
        return self.b.stride(0) == 1 and self.b.stride(1) != 1

    @property
    def stride_cm(self) -> int:
        return self.out.stride(0) if self.out is not None else self.N


# --------------------------------------------------------------------------
# Operand checks
# --------------------------------------------------------------------------
def tma_ok(t: torch.Tensor) -> bool:
    es = t.element_size()
    return (t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * es) % 16 == 0
            and t.shape[0] > 0 and t.shape[1] > 0)


def kmajor_ok(b: torch.Tensor) -> bool:
    """B (K, N) stored K-major (a transposed view of a row-major (N, K) tensor,
    as ``x @ w.t()`` passes an nn.Linear weight) with B^T's rows TMA-addressable."""
    return b.stride(0) == 1 and b.stride(1) != 1 and tma_ok(b.t())


def device_desc_ok(t: torch.Tensor | None, rows: int = 0, cols: int = 0, row_stride: int = 0,
                   elem_bytes: int = 2) -> bool:
    """Whether the kernel may encode a TMA descriptor of ``t`` itself: a 16-byte
    aligned base, unit inner stride, a positive row stride that is a multiple of
    16 bytes, sizes that fit the descriptor's 32-bit shape. ``t`` None: a
    contiguous tensor the call allocates, (rows, cols) with ``row_stride``."""
    if t is not None:
        if t.dim() != 2 or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        (rows, cols), row_stride, elem_bytes = t.shape, t.stride(0), t.element_size()
    return (0 < rows < _I32 and 0 < cols < _I32 and 0 < row_stride < _I32
            and (row_stride * elem_bytes) % 16 == 0)


def aligned_cols(cols: int, t: torch.Tensor) -> int:
    """Columns of a buffer whose rows start 16-byte aligned and hold ``cols`` elements."""
    per16 = 16 // t.element_size()
    return -(-cols // per16) * per16


def padded(t: torch.Tensor, cols: int) -> torch.Tensor:
    """``t`` copied into the first columns of a fresh (rows, cols) buffer: same
    shape, row stride ``cols`` (16-byte aligned), so TMA can address it."""
    view = torch.empty((t.shape[0], cols), dtype=t.dtype, device=t.device)[:, :t.shape[1]]
    return view.copy_(t)


def operand_pads(call: Call, pad: bool, tma_wanted: bool) -> dict:
    """{'pad_a', 'pad_b'}: the aligned copies a config with ``pad`` makes of the operands TMA
    cannot address as given (0: none); {} without ``pad``."""
    if not (pad and tma_wanted and TensorDescriptor is not None):
        return {}
    return dict(pad_a=0 if call.a_ok else aligned_cols(call.K, call.a),
                pad_b=0 if call.b_ok else aligned_cols(call.N, call.b))


def operands_device_desc_ok(call: Call, pads: dict, trans_b: bool) -> bool:
    """Device descriptors are legal for A and B as launched: as given, or the aligned
    copies that ``pads`` / ``trans_b`` make."""
    M, N, K, es = call.M, call.N, call.K, call.es
    pad_a, pad_b = pads.get("pad_a", 0), pads.get("pad_b", 0)
    a_dev = device_desc_ok(None, M, K, pad_a, es) if pad_a else device_desc_ok(call.a)
    if trans_b or pad_b:
        b_dev = device_desc_ok(None, N, K, K, es) if trans_b else device_desc_ok(None, K, N, pad_b, es)
    else:
        b_dev = device_desc_ok(call.b.t() if call.b_km else call.b)
    return a_dev and b_dev


def b_row_stride(b: torch.Tensor, K: int, pads: dict, b_km: bool, trans_b: bool) -> int:
    """The row stride of the matrix B's descriptor is over: B^T's (K-major B, or the
    contiguous copy trans_b makes), the padded copy's, or B's own."""
    if trans_b:
        return K
    return b.stride(1) if b_km else (pads.get("pad_b") or b.stride(0))


# --------------------------------------------------------------------------
# The fp32 workspace of stream-K and split-K
# --------------------------------------------------------------------------
_SK_WORKSPACE: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
_SK_ZEROED: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}   # sums kept at zero between calls
_RETIRED: list = []  # outgrown workspaces: a captured CUDA graph may still use them


def workspace(device: torch.device, elems: int, counters: int, zeroed: bool = False):
    """fp32 partial slots and arrival counters (stream-K and split-K), zeroed once
    and reused: the kernels reset every counter they complete. One pair per device
    and stream, so calls on two streams never share counters; an outgrown pair is
    kept alive (a CUDA graph captured with it still points there). Call it ahead
    of a graph capture with the largest sizes, so the capture allocates nothing.

    ``zeroed``: a pair of its own whose fp32 slots are zero whenever no kernel is
    running, for kernels that add their partials into one sum per tile with atomics
    (the split-K kernel's ``ATOMIC_SPLIT``): the one that completes a tile sets its
    sum back to zero. The other kernels overwrite their slots, so they never share it."""
    if device.type == "cuda":   # Triton's driver call: a fraction of torch.cuda.current_stream's host cost
        from triton.runtime.driver import driver

        index = device.index if device.index is not None else driver.active.get_current_device()
        key = (index, driver.active.get_current_stream(index))
    else:
        key = (-1, 0)
    pairs = _SK_ZEROED if zeroed else _SK_WORKSPACE
    ws, cnt = pairs.get(key, (None, None))
    if ws is None or ws.numel() < elems or cnt.numel() < counters:
        if ws is not None:
            _RETIRED.append((ws, cnt))
        make = torch.zeros if zeroed else torch.empty
        ws = make(max(elems, ws.numel() if ws is not None else 0), dtype=torch.float32, device=device)
        cnt = torch.zeros(max(counters, cnt.numel() if cnt is not None else 0), dtype=torch.int32, device=device)
        pairs[key] = (ws, cnt)
    return ws, cnt
