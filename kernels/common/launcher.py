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
pick. Launch hooks (profilers set ``triton.knobs.runtime.launch_enter_hook``)
and the interpreter take Triton's own path every time.
"""
from __future__ import annotations

import inspect
from typing import Any, Sequence

import triton
from triton.runtime.driver import driver

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

    def __call__(self, *args) -> None:
        if len(args) != len(self._slots):
            raise TypeError(f"{_name(self.fn)}: {len(self._slots)} run-time arguments expected, got {len(args)}")
        ck = self.compiled
        if ck is None or _hooked():
            ck = self.fn[self.grid](*args, **self.kwargs)
            if ck is not None and hasattr(ck, "run") and not interpreter.active():
                self.compiled = ck
            return
        values = self._template.copy()
        for i, a in zip(self._slots, args):
            values[i] = a
        rt = triton.knobs.runtime   # the (empty) hook chains, passed on as Triton's own launches do
        ck.run(*self.grid, _current_stream(), ck.function, ck.packed_metadata, None, rt.launch_enter_hook,
               rt.launch_exit_hook, *values)


def _current_stream():
    """The current CUDA stream of the current device, as Triton's launcher takes it."""
    active = driver.active
    return active.get_current_stream(active.get_current_device())


def _name(fn) -> str:
    return getattr(getattr(fn, "fn", fn), "__name__", repr(fn))


def _hooked() -> bool:
    """Whether a launch hook is set (Triton 3.6 keeps them in HookChains, empty by default)."""
    rt = triton.knobs.runtime
    return any(h is not None and getattr(h, "calls", True) for h in (rt.launch_enter_hook, rt.launch_exit_hook))
