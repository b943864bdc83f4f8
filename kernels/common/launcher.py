"""A planned launch: what every family's launch plan holds for each kernel it runs.

Calling a ``@triton.jit`` (or ``@gluon.jit``) function costs 15-150 us of host
time in Triton 3.6 before the kernel is queued: the arguments are bound to the
signature, every one is classified for specialization (for a Gluon descriptor
that includes printing its shared-memory layout), a cache key is hashed and
looked up. A plan already knows all of that: the call signature it was made
for fixes the specialization. So ``PlannedLaunch`` goes through Triton once
(compiling if needed), keeps the compiled kernel, and from then on hands the
arguments straight to its launcher: a list copy, the current stream, and the
driver call.

What stays exact: a plan is keyed on shapes, strides, dtypes, devices and the
16-byte alignment of every pointer (see ``kernels.gemm.launch.plan_for``), i.e.
on everything Triton specializes on, so the kept kernel is the one Triton would
pick. The first call compiles through Triton's entry point (without launching),
every call launches through the compiled kernel's launcher. Launch hooks
(profilers set ``triton.knobs.runtime.launch_enter_hook``) and the interpreter
take Triton's own path every time.

Global scratch. A kernel that builds TMA descriptors on the device
(``tl.make_tensor_descriptor``) needs ``global_scratch_size`` bytes of global
memory per program. Triton's launcher asks the allocator set with
``triton.set_allocator`` on every launch (a Python callback; without one it
raises). ``PlannedLaunch`` never sets an allocator: it hands such a kernel a
buffer of its own (``scratch``), one per (device, stream), never freed and
only ever grown, so a CUDA graph captured with it never points at freed
memory. Why one buffer per stream is enough: the launches of a stream run in
order, and a kernel is done with its descriptors before the next kernel of the
stream starts writing its own. Launches on two streams get two buffers. What
stays the caller's to order: a graph captured on stream S keeps S's buffer, so
replaying it while another launch that uses S's buffer runs (another stream,
or a second graph captured on S replayed concurrently) lets both write the
same descriptors; graphs meant to replay concurrently are captured on
different streams.
"""
from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch
import triton
from triton.runtime import _allocation
from triton.runtime.driver import driver

try:  # the launcher class whose argument order _launch_with_scratch follows (triton 3.6)
    from triton.backends.nvidia.driver import CudaLauncher
except ImportError:  # pragma: no cover
    CudaLauncher = None

from kernels.common import interpreter


# Keyword arguments of a launch that are compile options, not kernel parameters.
LAUNCH_OPTIONS = frozenset({"num_warps", "num_stages", "num_ctas", "maxnreg", "num_buffers_warp_spec",
                            "num_consumer_groups", "reg_dec_producer", "reg_inc_consumer"})


def _jit_params(fn) -> list[tuple[str, bool, Any]]:
    """(name, is_constexpr, default) of every parameter of a jitted function (compiled or
    interpreted: both keep the Python function as ``fn.fn``)."""
    sig = inspect.signature(getattr(fn, "fn", fn))
    return [(p.name, "constexpr" in str(p.annotation), p.default) for p in sig.parameters.values()]


class PlannedLaunch:
    """One kernel of a plan, with its grid, constexprs and launch options fixed.

    ``launch(*runtime_args)`` takes the kernel's non-constexpr arguments in
    declaration order (tensors, descriptors, scalars; ``None`` for an optional
    operand the kernel treats as absent).
    """

    def __init__(self, fn, grid: Sequence[int], constexprs: dict[str, Any], options: dict[str, Any] | None = None):
        self.fn = fn
        self.grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        self.kwargs = {**constexprs, **(options or {})}
        params = _jit_params(fn)
        unknown = set(constexprs) - {n for n, _, _ in params}
        if unknown:
            raise ValueError(f"{_name(fn)}: no parameter(s) {sorted(unknown)}")
        self._slots = [i for i, (name, is_cx, _) in enumerate(params) if not is_cx and name not in constexprs]
        self._template = [constexprs[name] if name in constexprs else
                          (default if is_cx and default is not inspect.Parameter.empty else None)
                          for name, is_cx, default in params]
        self.compiled = None
        self.scratch = False   # the compiled kernel needs global scratch (device-built TMA descriptors)

    @classmethod
    def of(cls, fn, grid: Sequence[int], kwargs: dict[str, Any]) -> "PlannedLaunch":
        """From a launch's keyword arguments as ``fn[grid](..., **kwargs)`` takes them: the
        constexprs and the launch options (LAUNCH_OPTIONS) together."""
        return cls(fn, grid, {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS},
                   {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS})

    def __call__(self, *args) -> None:
        if len(args) != len(self._slots):
            raise TypeError(f"{_name(self.fn)}: {len(self._slots)} run-time arguments expected, got {len(args)}")
        ck = self.compiled
        if ck is None:
            if interpreter.active():
                self.fn[self.grid](*args, **self.kwargs)
                return
            ck = self._compile(args)
            if ck is None:   # nothing compiled (a cache hook declined): Triton decides, every time
                self.fn[self.grid](*args, **self.kwargs)
                return
        values = self._template.copy()
        for i, a in zip(self._slots, args):
            values[i] = a
        hooked = _hooked()
        if self.scratch:
            self._launch_with_scratch(ck, values, hooked)
        elif hooked:
            self.fn[self.grid](*args, **self.kwargs)
        else:   # no hooks: none to call (Triton would pass its empty hook chains)
            ck.run(*self.grid, _current_stream(), ck.function, ck.packed_metadata, None, None, None, *values)

    def _compile(self, args):
        """The kernel Triton would launch for these arguments, compiled (or found in its
        cache) without launching it; kept, with whether it needs global scratch."""
        ck = self.fn.run(*args, grid=self.grid, warmup=True, **self.kwargs)
        if hasattr(ck, "result"):   # an asynchronous compile
            ck = ck.result()
        if ck is None or not hasattr(ck, "run"):
            return None
        run = ck.run
        need = getattr(run, "global_scratch_size", 0) > 0
        if need and (CudaLauncher is None or not isinstance(run, CudaLauncher)):
            raise RuntimeError(f"{_name(self.fn)}: needs global scratch memory, which PlannedLaunch supplies only "
                               f"through Triton 3.6's CUDA launcher (got {type(run).__name__})")
        self.scratch = need
        self.compiled = ck
        return ck

    def _launch_with_scratch(self, ck, values, hooked: bool) -> None:
        """What ``CudaLauncher.__call__`` does, with the global scratch buffer from
        ``scratch`` instead of Triton's allocator: its inner ``launch`` takes
        (grid x, y, z, stream, function, cooperative, pdl, global scratch, profile
        scratch, packed metadata, launch metadata, enter hook, exit hook, *args)."""
        run = ck.run
        gx, gy, gz = self.grid
        device, stream = _current_device_stream()
        programs = gx * gy * gz * run.num_ctas
        base = scratch(device, stream, programs * run.global_scratch_size, run.global_scratch_align)
        profile = None
        if run.profile_scratch_size > 0:   # profilers' instrumentation: their allocator, as Triton does
            profile = _allocation._profile_allocator.get()(programs * run.profile_scratch_size,
                                                          run.profile_scratch_align, stream)
        if hooked:
            rt = triton.knobs.runtime
            meta, enter, leave = ck.launch_metadata(self.grid, stream, *values), rt.launch_enter_hook, \
                rt.launch_exit_hook
        else:
            meta = enter = leave = None
        run.launch(gx, gy, gz, stream, ck.function, run.launch_cooperative_grid, run.launch_pdl, base, profile,
                   ck.packed_metadata, meta, enter, leave, *values)


# --------------------------------------------------------------------------
# Launches through a heap (the multi-rank families): one PlannedLaunch per plan and slot
# --------------------------------------------------------------------------
def launch_planned(heap, store: dict, slot, kernel, grid, *args, **kwargs) -> None:
    """``heap.launch(kernel, grid, *args, **kwargs)`` through a ``PlannedLaunch`` kept in
    ``store`` (a dict of the caller's launch plan) under ``slot``. For families whose plan key
    already fixes what Triton specializes the arguments on (shapes, strides, dtypes, pointer
    alignment): ``slot`` names the launch within the plan, with whatever about its arguments
    the plan's key does not fix (an output given per call, say). A repeated call is a
    dictionary lookup and the launch (keying every argument on every call instead cost a
    third of a fused launcher's host time). A simulated heap runs its own launch."""
    if getattr(heap, "simulated", True):
        return heap.launch(kernel, grid, *args, **kwargs)
    launch = store.get(slot)
    if launch is None:
        launch = store[slot] = PlannedLaunch.of(kernel, grid, kwargs)
    launch(*args)


# --------------------------------------------------------------------------
# Global scratch: one never-freed buffer per (device, stream), grown on demand
# --------------------------------------------------------------------------
_SCRATCH: dict[tuple[int, int], tuple[torch.Tensor, int, int]] = {}   # key -> (buffer, usable bytes, base)
_SCRATCH_RETIRED: list[torch.Tensor] = []   # outgrown buffers: a captured CUDA graph may still use them


def scratch(device: int, stream: int, nbytes: int, align: int = 128) -> int:
    """The address of at least ``nbytes`` of global memory, ``align``-aligned, for
    kernels launched on ``stream`` of CUDA device ``device``; the same address
    until a larger size is asked (the buffer grows to the largest size asked, and
    an outgrown one is kept). See the module's docstring for why one buffer per
    stream is safe. Allocating inside a CUDA graph capture is allowed (the buffer
    comes from the graph's pool and is never freed); calling once ahead of the
    capture with the largest size keeps the capture from allocating."""
    key = (device, stream)
    entry = _SCRATCH.get(key)
    if entry is not None and entry[1] >= nbytes and entry[2] % align == 0:
        return entry[2]
    align = max(align, 1)
    size = max(nbytes, entry[1] if entry is not None else 0)
    size = -(-size // 4096) * 4096   # whole pages: fewer regrowths
    buf = torch.empty(size + align, dtype=torch.uint8, device=torch.device("cuda", device))
    base = -(-buf.data_ptr() // align) * align
    if entry is not None:
        _SCRATCH_RETIRED.append(entry[0])
    _SCRATCH[key] = (buf, size, base)
    return base


def _current_device_stream() -> tuple[int, int]:
    """The current CUDA device and its current stream, as Triton's launcher takes them."""
    active = driver.active
    device = active.get_current_device()
    return device, active.get_current_stream(device)


def _current_stream():
    """The current CUDA stream of the current device, as Triton's launcher takes it."""
    return _current_device_stream()[1]


def _name(fn) -> str:
    return getattr(getattr(fn, "fn", fn), "__name__", repr(fn))


def _hooked() -> bool:
    """Whether a launch hook is set (Triton 3.6 keeps them in HookChains, empty by default)."""
    rt = triton.knobs.runtime   # no generator here: this runs on every launch
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return bool((enter is not None and getattr(enter, "calls", True))
                or (leave is not None and getattr(leave, "calls", True)))
