"""kernels.common.launcher.PlannedLaunch: the first call compiles through Triton
(without launching), every call hands the arguments in declaration order straight
to the compiled kernel's launcher; kernels that need global scratch get a buffer
of the launcher's own per (device, stream)."""
from __future__ import annotations

import pytest
import torch

from kernels.common import launcher as L


class _Compiled:
    function, packed_metadata = "fn-handle", "packed"

    def __init__(self, run=None):
        self.calls = []
        self.run = run if run is not None else self._run

    def _run(self, *args):
        self.calls.append(args)

    def launch_metadata(self, grid, stream, *args):
        return ("meta", grid, stream)


class _Jit:
    """A stand-in for a @triton.jit function: fn.fn is the Python function."""

    def __init__(self, fn, compiled=None):
        self.fn = fn
        self.launched = []   # launches through Triton's entry point
        self.compiles = []   # compile-only trips (warmup=True)
        self.compiled = compiled if compiled is not None else _Compiled()

    def run(self, *args, grid, warmup, **kwargs):
        assert warmup
        self.compiles.append((grid, args, kwargs))
        return self.compiled

    def __getitem__(self, grid):
        def go(*args, **kwargs):
            self.launched.append((grid, args, kwargs))
            return self.compiled
        return go


class _ScratchLauncher:
    """Triton 3.6's CudaLauncher as PlannedLaunch sees it: attributes and the inner launch."""
    num_ctas, launch_cooperative_grid, launch_pdl = 1, False, False
    global_scratch_size, global_scratch_align = 384, 128
    profile_scratch_size, profile_scratch_align = 0, 1

    def __init__(self):
        self.launches = []

    def launch(self, *args):
        self.launches.append(args)

    def __call__(self, *args):   # Triton's own path: would ask the (unset) allocator
        raise AssertionError("PlannedLaunch must not go through CudaLauncher.__call__")


def _kernel(x_ptr, n, desc, BLOCK: "tl.constexpr", EVEN: "tl.constexpr" = True, scale=2.0):  # noqa: F821
    pass


@pytest.fixture
def compiled_path(monkeypatch):
    """Pretend to be on a GPU: no interpreter, device 0, stream 77."""
    monkeypatch.setattr(L.interpreter, "active", lambda: False)
    monkeypatch.setattr(L, "_current_device_stream", lambda: (0, 77))


def test_first_call_compiles_through_triton_then_straight_to_the_launcher(compiled_path):
    jit = _Jit(_kernel)
    launch = L.PlannedLaunch(jit, (5,), {"BLOCK": 64}, {"num_warps": 4})
    launch("x", 10, "d", 1.5)
    assert jit.compiles == [((5, 1, 1), ("x", 10, "d", 1.5), {"BLOCK": 64, "num_warps": 4})]
    launch("y", 11, None, 3.0)
    assert len(jit.compiles) == 1 and not jit.launched   # no second trip through Triton's binder
    first, call = jit.compiled.calls
    # grid, stream, function, metadata, no launch metadata, no hooks, then every parameter in
    # order (constexprs and defaults included)
    assert call[:9] == (5, 1, 1, 77, "fn-handle", "packed", None, None, None)
    assert first[9:] == ("x", 10, "d", 64, True, 1.5)
    assert call[9:] == ("y", 11, None, 64, True, 3.0)
    assert not launch.scratch


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
    assert len(jit.launched) == 1 and len(jit.compiled.calls) == 1
    monkeypatch.setattr(L.interpreter, "active", lambda: True)
    jit2 = _Jit(_kernel)
    launch2 = L.PlannedLaunch(jit2, (2,), {"BLOCK": 16})
    launch2("x", 1, "d", 1.0)
    launch2("x", 1, "d", 1.0)
    assert len(jit2.launched) == 2 and not jit2.compiles   # interpreted: never kept


# ------------------------------------------------------------------ global scratch
@pytest.fixture
def fake_scratch(compiled_path, monkeypatch):
    """The CUDA launcher class replaced by the fake; scratch buffers are CPU tensors
    (their addresses are all the launcher passes on); a fresh pool."""
    monkeypatch.setattr(L, "CudaLauncher", _ScratchLauncher)
    monkeypatch.setattr(L, "_SCRATCH", {})
    monkeypatch.setattr(L, "_SCRATCH_RETIRED", [])
    real_empty = torch.empty
    monkeypatch.setattr(L.torch, "empty", lambda n, dtype, device: real_empty(n, dtype=dtype))


def test_a_kernel_with_global_scratch_gets_the_pools_buffer(fake_scratch):
    run = _ScratchLauncher()
    jit = _Jit(_kernel, _Compiled(run))
    launch = L.PlannedLaunch(jit, (3, 2), {"BLOCK": 64})
    launch("x", 10, None, 1.5)
    launch("y", 11, None, 2.5)
    assert launch.scratch and not jit.launched and len(jit.compiles) == 1
    (buf, size, base), = L._SCRATCH.values()
    assert list(L._SCRATCH) == [(0, 77)] and size >= 6 * 384 and base % 128 == 0
    assert base + 6 * 384 <= buf.data_ptr() + buf.numel()
    first, second = run.launches
    # grid, stream, function, cooperative, pdl, global scratch, profile scratch, packed metadata,
    # launch metadata, enter hook, exit hook, then the parameters
    assert second[:13] == (3, 2, 1, 77, "fn-handle", False, False, base, None, "packed", None, None, None)
    assert second[13:] == ("y", 11, None, 64, True, 2.5)
    assert first[7] == base    # the same buffer every call


def test_scratch_pool_is_per_stream_grows_and_never_frees(fake_scratch, monkeypatch):
    a = L.scratch(0, 7, 1000)
    assert L.scratch(0, 7, 500) == a          # smaller asks reuse the buffer
    b = L.scratch(0, 8, 1000)                  # another stream: another buffer
    c = L.scratch(1, 7, 1000)                  # another device: another buffer
    assert len({a, b, c}) == 3
    old = L._SCRATCH[(0, 7)][0]
    d = L.scratch(0, 7, 64 * 1024)            # grown: a new buffer, the old one kept alive
    assert L._SCRATCH[(0, 7)][1] >= 64 * 1024 and L._SCRATCH_RETIRED == [old]
    assert L.scratch(0, 7, 1000) == d         # never shrinks
    assert L.scratch(0, 7, 10, align=1024) % 1024 == 0


def test_scratch_launch_passes_launch_metadata_and_hooks_when_hooked(fake_scratch):
    import triton

    run = _ScratchLauncher()
    jit = _Jit(_kernel, _Compiled(run))
    launch = L.PlannedLaunch(jit, (4,), {"BLOCK": 8})
    hook = lambda *a: None  # noqa: E731
    triton.knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch("x", 1, None, 1.0)
    finally:
        triton.knobs.runtime.launch_enter_hook.remove(hook)
    (call,) = run.launches
    assert call[10] == ("meta", (4, 1, 1), 77) and call[11] is triton.knobs.runtime.launch_enter_hook
    assert not jit.launched   # Triton's path would ask its allocator


def test_scratch_on_another_launcher_is_refused(fake_scratch, monkeypatch):
    class Other(_ScratchLauncher):
        pass

    monkeypatch.setattr(L, "CudaLauncher", type("Cuda", (), {}))
    launch = L.PlannedLaunch(_Jit(_kernel, _Compiled(Other())), (1,), {"BLOCK": 8})
    with pytest.raises(RuntimeError, match="global scratch"):
        launch("x", 1, None, 1.0)


class _Heap:
    """A GPU heap as launch_planned sees it: not simulated, a dict per cache name, its own launch."""
    simulated = False

    def __init__(self):
        self.caches, self.own = {}, []

    def cache(self, name):
        return self.caches.setdefault(name, {})

    def launch(self, kernel, grid, *args, **kwargs):
        self.own.append((kernel, grid, args, kwargs))


def test_launch_planned_keeps_one_planned_launch_per_plan_slot(compiled_path):
    """A repeated call with the same store and slot reuses its PlannedLaunch (one compile);
    another slot (what the caller's plan key leaves open, e.g. an output's alignment) makes
    a new one; a simulated heap takes its own launch and stores nothing."""
    jit, heap = _Jit(_kernel), _Heap()
    x, store = torch.zeros(64, dtype=torch.float16), {}
    L.launch_planned(heap, store, ("main", 0), jit, (4,), x, 32, None, 1.5, BLOCK=64, num_warps=4)
    L.launch_planned(heap, store, ("main", 0), jit, (4,), x, 32, None, 2.5, BLOCK=64, num_warps=4)
    assert list(store) == [("main", 0)] and len(jit.compiles) == 1 and len(jit.compiled.calls) == 2
    L.launch_planned(heap, store, ("main", 2), jit, (4,), x[1:], 32, None, 1.5, BLOCK=64, num_warps=4)
    assert len(store) == 2 and len(jit.compiles) == 2
    heap.simulated = True
    L.launch_planned(heap, store, ("sim", 0), jit, (4,), x, 32, None, 1.5, BLOCK=64)
    assert len(heap.own) == 1 and len(store) == 2


def test_config_key_keeps_dataclasses_sorts_dicts_and_marks_the_unhashable():
    from kernels.common.plans import config_key
    from kernels.gemm.config import GemmConfig

    cfg = GemmConfig(block_n=128)
    assert config_key(None) is None and config_key(cfg) is cfg
    assert config_key({"b": 2, "a": 1}) == (("a", 1), ("b", 2)) == config_key({"a": 1, "b": 2})
    odd = {"a": [1]}
    assert config_key(odd) == ("unhashable", id(odd))
