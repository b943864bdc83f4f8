"""Peer memory for multi-rank kernels: a symmetric heap (GPU) and a simulated world (CPU).

``SymmetricHeap(nbytes, group)``
    One buffer per rank from ``torch.distributed._symmetric_memory``, mapped
    into every peer; ``heap_bases`` is the int64 device tensor of the peer
    base addresses (the role of iris' ``heap_bases``), ``alloc(shape, dtype)``
    a bump allocator whose tensors live at the same offset on every rank, so
    the peer address of a local tensor is ``heap_bases[peer] + offset``.

``SimulatedWorld(world_size)``
    All ranks in one process on the CPU: one host buffer per rank, the same
    ``heap_bases`` table (host addresses), and kernels run "on rank r" in
    Triton's interpreter, which dereferences real host addresses, so peer
    pointers work. ``world.run(fn)`` runs ``fn(heap)`` for every rank in a
    thread of its own while kernel launches take turns (one at a time), so
    code written for one rank (launch, ``heap.barrier()``, wait) runs as is.

``workbench.dist`` starts worlds of processes (torchrun) and re-exports these names.
NVLink multicast stays off in this process (``MULTICAST_OFF``): a program using it
can take shared GPUs out of service.
"""
from __future__ import annotations

import os
import threading
import types
from typing import Any, Callable, Sequence

from workbench.dtypes import element_size

MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
os.environ.update(MULTICAST_OFF)  # before any NCCL / symmetric-memory init in this process

__all__ = ["SymmetricHeap", "SimulatedWorld", "SimHeap", "RankError", "interpreted", "MULTICAST_OFF", "FLAG_SLOTS"]


# ==========================================================================
# Heaps
# ==========================================================================
_ALIGN = 256
FLAG_SLOTS = 1024  # int32 flags at the start of every heap
STATUS_WORDS = 8   # int32 status words of the bounded waits (kernels.comm.remote uses the first STATUS_WORDS there)


class _BumpHeap:
    """Bump allocation over one uint8 buffer; every rank makes the same calls in the same order."""

    buffer: Any
    rank: int
    world_size: int
    heap_bases: Any
    simulated = False

    def _init_alloc(self) -> None:
        """Start empty, then carve the flag area (zeroed; the creator's barrier follows)."""
        import torch

        self._offset = 0
        self._named: dict[str, Any] = {}
        self._totals: dict[str, int] = {}
        self._flag_names: dict[str, Any] = {}
        self._caches: dict[str, dict] = {}
        self._kept: dict[str, dict] = {}
        self._flag_area = self.alloc((FLAG_SLOTS,), torch.int32)
        self._flag_area.zero_()
        self._flag_used = 0

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    @property
    def used(self) -> int:
        return self._offset

    def alloc(self, shape, dtype, *, align: int = _ALIGN):
        """A tensor of ``shape``/``dtype`` in the heap (uninitialized), at the same offset on every rank."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        esize = element_size(dtype)
        n = 1
        for s in shape:
            n *= int(s)
        start = -(-self._offset // align) * align
        end = start + n * esize
        if end > self.nbytes:
            raise MemoryError(
                f"symmetric heap of rank {self.rank} is full: {n * esize} bytes asked at offset {start}, "
                f"{self.nbytes - start} left of {self.nbytes}; make the heap larger or call reset()")
        self._offset = end
        return self.buffer[start:end].view(dtype).view(shape)

    def cache(self, name: str) -> dict:
        """A dict for launch plans and the like, emptied by ``reset()`` (they hold heap tensors)."""
        return self._caches.setdefault(name, {})

    def keep(self, name: str) -> dict:
        """A dict for what lives as long as the flag area (a status watch over flags, say):
        ``reset()`` keeps it, ``resync_flags()`` empties it with the flags."""
        return self._kept.setdefault(name, {})

    def named(self, name: str, shape, dtype, *, zero: bool = False):
        """The heap tensor called ``name``: allocated on first use, the same tensor afterwards."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        t = self._named.get(name)
        if t is None or tuple(t.shape) != shape or t.dtype != dtype:
            t = self.alloc(shape, dtype)
            if zero:
                t.zero_()
            self._named[name] = t
        return t

    def offset_of(self, t) -> int:
        """Byte offset of a heap tensor from this rank's heap base."""
        off = t.data_ptr() - self.buffer.data_ptr()
        if not 0 <= off < self.nbytes:
            raise ValueError(f"tensor at {t.data_ptr():#x} is not in rank {self.rank}'s heap")
        return off

    def advance(self, name: str, amount: int = 1) -> int:
        """Add ``amount`` to the running total called ``name`` and return it.

        Flags only grow: a round in which each of ``g`` programs adds 1 to a
        slot leaves it at the previous total + ``g``, which is what a waiter
        expects. Every rank makes the same calls, so the totals agree.
        """
        self._totals[name] = self._totals.get(name, 0) + int(amount)
        return self._totals[name]

    def flags(self, name: str, n: int):
        """``n`` int32 flags called ``name`` from the heap's flag area.

        The area is zeroed when the heap is made, before its creation barrier,
        so no peer can signal a flag before its owner has cleared it. Flags
        only grow (see ``advance``); they survive ``reset()``.
        """
        t = self._flag_names.get(name)
        if t is None:
            start = -(-self._flag_used // 32) * 32  # 128-byte apart: one cache line per name
            if start + n > FLAG_SLOTS:
                raise MemoryError(f"flag area of the heap is full ({FLAG_SLOTS} slots): cannot add {name!r}[{n}]")
            t = self._flag_area[start:start + n]
            self._flag_names[name] = t
            self._flag_used = start + n
        elif t.numel() != n:
            raise ValueError(f"flags {name!r} already exist with {t.numel()} slots, asked for {n}")
        return t

    def has_flags(self, name: str) -> bool:
        """Whether this rank has made flags ``name`` yet (its first call of a family does)."""
        return name in self._flag_names

    def reset(self) -> None:
        """Forget every allocation but the flag area (collectively: all ranks at the same point)."""
        area, names, used, totals = self._flag_area, self._flag_names, self._flag_used, self._totals
        self._offset = area.numel() * area.element_size()
        self._named = {}
        self._caches = {}
        self._flag_area, self._flag_names, self._flag_used, self._totals = area, names, used, totals

    def status(self):
        """This rank's int32 status words for bounded waits (see kernels.comm.waits.check_status)."""
        raise NotImplementedError


class SymmetricHeap(_BumpHeap):
    """A symmetric heap over PyTorch symmetric memory (CUDA).

    ``heap_bases`` is an int64 CUDA tensor: entry r is where this buffer sits
    in rank r's address space as mapped here, so ``heap_bases[r] + offset``
    is the peer address of a local heap tensor at ``offset``. Creating one is
    collective (every rank of ``group``, same ``nbytes``).
    """

    def __init__(self, nbytes: int, group=None, *, device=None):
        import torch
        import torch.distributed as tdist
        import torch.distributed._symmetric_memory as symm_mem

        os.environ.update(MULTICAST_OFF)
        if not tdist.is_initialized():
            raise RuntimeError("SymmetricHeap needs torch.distributed initialized (run under dist.launch/torchrun)")
        self.group = group or tdist.group.WORLD
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.buffer = symm_mem.empty(int(nbytes), dtype=torch.uint8, device=self.device)
        self.handle = symm_mem.rendezvous(self.buffer, self.group)
        self.rank = int(self.handle.rank)
        self.world_size = int(self.handle.world_size)
        ptrs = [int(p) for p in self.handle.buffer_ptrs]
        # buffer_ptrs name the start of each rank's allocation; our tensor may sit at an offset in it.
        delta = self.buffer.data_ptr() - ptrs[self.rank]
        self.heap_bases = torch.tensor([p + delta for p in ptrs], dtype=torch.int64, device=self.device)
        self.signal_pad_bases = torch.tensor([int(p) for p in self.handle.signal_pad_ptrs], dtype=torch.int64,
                                             device=self.device)
        self._init_alloc()
        self._status = torch.zeros(STATUS_WORDS, dtype=torch.int32, device=self.device)
        torch.cuda.synchronize(self.device)
        self.barrier()

    def peer_view(self, t, peer: int):
        """The tensor at ``t``'s heap offset on ``peer``, as mapped into this process (for checks)."""
        esize = t.element_size()
        off = self.offset_of(t) + (self.buffer.data_ptr() - int(self.handle.buffer_ptrs[self.rank]))
        if off % esize:
            raise ValueError("offset not a multiple of the element size")
        return self.handle.get_buffer(peer, tuple(t.shape), t.dtype, off // esize)

    def barrier(self) -> None:
        """Device-side barrier of all ranks on the current stream (symmetric-memory signal pads)."""
        self.handle.barrier(channel=0)

    def resync_flags(self) -> None:
        """After a failed round (a rank skipped a launch, a wait timed out): zero every
        flag and running total on all ranks, between two host barriers. Collective."""
        import torch
        import torch.distributed as tdist

        torch.cuda.synchronize(self.device)
        tdist.barrier(group=self.group)
        self._flag_area.zero_()
        self._totals = {}
        self._kept = {}
        self._status.zero_()
        torch.cuda.synchronize(self.device)
        tdist.barrier(group=self.group)

    def launch(self, kernel, grid, /, *args, **kwargs):
        return kernel[grid](*args, **kwargs)

    def status(self):
        return self._status

    def __repr__(self) -> str:
        return (f"SymmetricHeap(rank {self.rank}/{self.world_size}, {self.nbytes} bytes, used {self.used}, "
                f"{self.device})")


# ==========================================================================
# The simulated world (CPU, Triton interpreter)
# ==========================================================================
class RankError(RuntimeError):
    """A rank of a simulated world failed; ``rank`` says which."""

    def __init__(self, message: str, rank: int):
        super().__init__(message)
        self.rank = rank


class SimHeap(_BumpHeap):
    """Rank r's heap in a `SimulatedWorld`: a host buffer; same interface as `SymmetricHeap`."""

    simulated = True

    def __init__(self, world: "SimulatedWorld", rank: int, buffer):
        import torch

        self.world = world
        self.rank = rank
        self.world_size = world.world_size
        self.buffer = buffer
        self.heap_bases = world.heap_bases
        self.device = torch.device("cpu")
        self.group = None
        self._init_alloc()
        self._status = torch.zeros(STATUS_WORDS, dtype=torch.int32)

    def barrier(self) -> None:
        self.world._barrier_wait(self.rank)

    def resync_flags(self) -> None:
        """After a failed round: zero this rank's flags, running totals and status words."""
        self._flag_area.zero_()
        self._totals = {}
        self._kept = {}
        self._status.zero_()

    def launch(self, kernel, grid, /, *args, **kwargs):
        """Run ``kernel`` on this rank, in the interpreter, while no other rank runs one."""
        with self.world._lock:
            return interpreted(kernel)[grid](*args, **kwargs)

    def peer_view(self, t, peer: int):
        off = self.offset_of(t)
        buf = self.world.heaps[peer].buffer
        return buf[off:off + t.numel() * t.element_size()].view(t.dtype).view(t.shape)

    def status(self):
        return self._status

    def __repr__(self) -> str:
        return f"SimHeap(rank {self.rank}/{self.world_size}, {self.nbytes} bytes, used {self.used})"


class SimulatedWorld:
    """``world_size`` ranks in this process, one host heap each (see the module docstring).

    ``world.heaps[r]`` (or ``world.heap(r)``) is rank r's heap; ``world.run(fn)``
    runs ``fn(heap)`` for every rank concurrently and returns the results in
    rank order; ``world.alloc`` allocates on every rank at once.
    """

    def __init__(self, world_size: int, heap_bytes: int = 1 << 20, *, barrier_timeout_s: float = 120.0):
        import torch

        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"SimulatedWorld: world_size must be a positive integer, got {world_size!r}")
        if heap_bytes < 2 * FLAG_SLOTS * 4:
            raise ValueError(f"SimulatedWorld: heap_bytes={heap_bytes} is too small: the flag area alone takes "
                             f"{FLAG_SLOTS * 4} bytes; give at least {2 * FLAG_SLOTS * 4}")
        self.world_size = world_size
        self._raw = [torch.zeros(heap_bytes + _ALIGN, dtype=torch.uint8) for _ in range(world_size)]
        bufs = []
        for raw in self._raw:  # 256-byte aligned like the device heap
            skip = (-raw.data_ptr()) % _ALIGN
            bufs.append(raw[skip:skip + heap_bytes])
        self.heap_bases = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
        self.heaps = [SimHeap(self, r, b) for r, b in enumerate(bufs)]
        self._lock = threading.RLock()
        self.barrier_timeout_s = barrier_timeout_s
        self._barrier = threading.Barrier(world_size, timeout=barrier_timeout_s)
        self._arrived: dict[int, int] = {}
        self._arrive_lock = threading.Lock()
        self._decisions: dict = {}
        self._decided = threading.Condition()

    def heap(self, rank: int) -> SimHeap:
        return self.heaps[rank]

    def alloc(self, shape, dtype) -> list:
        return [h.alloc(shape, dtype) for h in self.heaps]

    def _barrier_wait(self, rank: int) -> None:
        with self._arrive_lock:
            self._arrived[rank] = self._arrived.get(rank, 0) + 1
            mine = self._arrived[rank]
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            with self._arrive_lock:
                missing = [r for r in range(self.world_size) if self._arrived.get(r, 0) < mine]
            raise RankError(f"rank {rank}: barrier #{mine} broken: rank(s) {', '.join(map(str, missing))} "
                            f"never arrived (failed or took over {self.barrier_timeout_s:g} s)", rank) from None

    def decide(self, key, rank: int, make: Callable[[], Any]) -> Any:
        """What rank 0 decided under ``key`` (``make()`` run by rank 0; other ranks wait for it,
        at most ``barrier_timeout_s``): the simulated world's broadcast of a decision, which
        ``kernels.comm.decide.shared_choice`` uses."""
        with self._decided:
            if key not in self._decisions:
                if rank == 0:
                    self._decisions[key] = make()
                    self._decided.notify_all()
                elif not self._decided.wait_for(lambda: key in self._decisions, timeout=self.barrier_timeout_s):
                    raise RankError(f"rank {rank}: rank 0 never decided {key!r} within {self.barrier_timeout_s:g} s "
                                    f"(every rank must make the same calls)", rank)
            return self._decisions[key]

    def run(self, fn: Callable[[SimHeap], Any], ranks: Sequence[int] | None = None) -> list:
        """``fn(heap)`` for each rank (all by default), each in its own thread; results in rank order.

        The first rank to raise fails the call with a `RankError` naming it;
        ranks waiting in ``heap.barrier()`` for it are released (with errors
        of their own) instead of hanging.
        """
        ranks = list(range(self.world_size)) if ranks is None else list(ranks)
        self._barrier = threading.Barrier(len(ranks), timeout=self.barrier_timeout_s)
        self._arrived = {}
        results: dict[int, Any] = {}
        errors: dict[int, BaseException] = {}
        order: list[int] = []

        def body(r):
            try:
                results[r] = fn(self.heaps[r])
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors[r] = exc
                order.append(r)
                self._barrier.abort()

        threads = [threading.Thread(target=body, args=(r,), name=f"sim-rank{r}", daemon=True) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            first = next((r for r in order if not isinstance(errors[r], RankError)), order[0])
            exc = errors[first]
            raise RankError(f"rank {first} failed: {type(exc).__name__}: {exc}", first) from exc
        return [results[r] for r in ranks]

    def on_rank(self, which: int, kernel, grid, /, *args, **kwargs):
        """Run one kernel as rank ``which`` (sequential use: no threads)."""
        return self.heaps[which].launch(kernel, grid, *args, **kwargs)

    def __repr__(self) -> str:
        return f"SimulatedWorld({self.world_size} ranks, heaps of {self.heaps[0].nbytes} bytes)"


# --------------------------------------------------------------------------
# Running @triton.jit / @gluon.jit kernels in the interpreter on demand
# --------------------------------------------------------------------------
_INTERPRETED: dict[int, Any] = {}
_GLOBALS: dict[int, dict] = {}
_interp_lock = threading.RLock()


class _GluonOnInterpreter(types.ModuleType):
    """``gl`` for a Gluon kernel run by the Triton interpreter.

    Layouts say how elements map to threads, not what the values are, so the
    interpreter can drop them: ``gl.arange(a, b, layout)`` is ``tl.arange(a, b)``
    and layouts are inert objects; everything else is the ``tl`` function of
    the same name, looked up when called (so the interpreter's patched one).
    """

    class _Layout:
        def __init__(self, *args, **kwargs):
            self.args, self.kwargs = args, kwargs

    def __init__(self):
        super().__init__("gluon_on_interpreter")

    def __getattr__(self, name):
        import triton.language as tl

        if name.endswith("Layout"):
            return _GluonOnInterpreter._Layout
        special = {
            "arange": lambda start, end, layout=None: tl.arange(start, end),
            "full": lambda shape, value, dtype, layout=None: tl.full(shape, value, dtype),
            "thread_barrier": lambda: tl.debug_barrier(),
            "convert_layout": lambda value, layout, assert_trivial=False: value,
            "set_auto_layout": lambda value, layout: value,
        }
        if name in special:
            return special[name]
        value = getattr(tl, name)
        if callable(value) and not isinstance(value, type):
            return lambda *a, **k: getattr(tl, name)(*a, **k)
        return value


def _interpreted_globals(g: dict) -> dict:
    key = id(g)
    if key in _GLOBALS:
        return _GLOBALS[key]
    from triton.experimental.gluon import language as gl_lang
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    new = dict(g)
    _GLOBALS[key] = new  # before recursing: modules may refer to each other
    for name, value in g.items():
        if isinstance(value, JITFunction):
            new[name] = interpreted(value)
        elif value is gl_lang:
            new[name] = _GluonOnInterpreter()
        elif isinstance(value, InterpretedFunction):
            new[name] = value
    return new


def _plain_annotations(ann: dict) -> dict:
    """String annotations (``from __future__ import annotations``) such as
    "gl.constexpr" as the interpreter knows them ("constexpr")."""
    return {k: ("constexpr" if isinstance(v, str) and v.strip().endswith(".constexpr") else v)
            for k, v in ann.items()}


def interpreted(kernel):
    """``kernel`` (``@triton.jit`` or ``@gluon.jit``) as an interpreter function.

    Under ``TRITON_INTERPRET=1`` ``@triton.jit`` already gives one; otherwise
    (the module was imported before the variable was set, or it is a Gluon
    kernel, which the interpreter does not know) the function is re-bound to a
    copy of its module's globals in which jitted helpers are interpreted too
    and ``gl`` maps to ``tl``. Helpers must be referenced by name (``from
    kernels.comm.remote import translate``), not as ``module.attr``.
    """
    from triton.runtime.interpreter import InterpretedFunction

    from kernels.common import interpreter

    interpreter.patch()
    if isinstance(kernel, InterpretedFunction):
        return kernel
    fn = getattr(kernel, "fn", None)
    if fn is None or not callable(fn):
        raise TypeError(f"{kernel!r} is not a @triton.jit or @gluon.jit function")
    with _interp_lock:
        cached = _INTERPRETED.get(id(kernel))
        if cached is not None:
            return cached
        clone = types.FunctionType(fn.__code__, _interpreted_globals(fn.__globals__), fn.__name__,
                                   fn.__defaults__, fn.__closure__)
        for attr in ("__kwdefaults__", "__module__", "__qualname__", "__doc__"):
            setattr(clone, attr, getattr(fn, attr))
        clone.__annotations__ = _plain_annotations(fn.__annotations__)
        out = InterpretedFunction(clone)
        rewritten = out.rewrite()
        rewritten.__annotations__ = _plain_annotations(rewritten.__annotations__)
        _INTERPRETED[id(kernel)] = out
        return out
