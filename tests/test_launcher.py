"""kernels.common.launcher.PlannedLaunch: the first call goes through Triton, later
calls hand the arguments in declaration order straight to the compiled kernel."""
from __future__ import annotations

import pytest

from kernels.common import launcher as L


class _Compiled:
    function, packed_metadata = "fn-handle", "packed"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


class _Jit:
    """A stand-in for a @triton.jit function: fn.fn is the Python function."""

    def __init__(self, fn):
        self.fn = fn
        self.launched = []
        self.compiled = _Compiled()

    def __getitem__(self, grid):
        def go(*args, **kwargs):
            self.launched.append((grid, args, kwargs))
            return self.compiled
        return go


def _kernel(x_ptr, n, desc, BLOCK: "tl.constexpr", EVEN: "tl.constexpr" = True, scale=2.0):  # noqa: F821
    pass


@pytest.fixture
def compiled_path(monkeypatch):
    """Pretend to be on a GPU: no interpreter, stream 77."""
    monkeypatch.setattr(L.interpreter, "active", lambda: False)
    monkeypatch.setattr(L, "_current_stream", lambda: 77)


def test_first_call_through_triton_then_straight_to_the_launcher(compiled_path):
    jit = _Jit(_kernel)
    launch = L.PlannedLaunch(jit, (5,), {"BLOCK": 64}, {"num_warps": 4})
    launch("x", 10, "d", 1.5)
    assert jit.launched == [((5, 1, 1), ("x", 10, "d", 1.5), {"BLOCK": 64, "num_warps": 4})]
    launch("y", 11, None, 3.0)
    assert len(jit.launched) == 1          # no second trip through Triton's binder
    (call,) = jit.compiled.calls
    # grid, stream, function, metadata, no launch metadata, the (empty) hook chains, then every
    # parameter in order (constexprs and defaults included)
    assert call[:7] == (5, 1, 1, 77, "fn-handle", "packed", None)
    assert call[9:] == ("y", 11, None, 64, True, 3.0)


def test_argument_count_and_unknown_constexprs_are_refused(compiled_path):
    with pytest.raises(ValueError, match="no parameter"):
        L.PlannedLaunch(_Jit(_kernel), (1,), {"BLOCKK": 64})
    launch = L.PlannedLaunch(_Jit(_kernel), (1,), {"BLOCK": 64})
    with pytest.raises(TypeError, match="4 run-time arguments"):
        launch("x", 1)


def test_launch_hooks_and_the_interpreter_keep_tritons_path(compiled_path, monkeypatch):
    import triton

    jit = _Jit(_kernel)
    launch = L.PlannedLaunch(jit, (2,), {"BLOCK": 16})
    launch("x", 1, "d", 1.0)
    hook = lambda *a: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch("x", 1, "d", 1.0)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    assert len(jit.launched) == 2 and not jit.compiled.calls
    monkeypatch.setattr(L.interpreter, "active", lambda: True)
    jit2 = _Jit(_kernel)
    launch2 = L.PlannedLaunch(jit2, (2,), {"BLOCK": 16})
    launch2("x", 1, "d", 1.0)
    launch2("x", 1, "d", 1.0)
    assert len(jit2.launched) == 2    # interpreted: never kept
