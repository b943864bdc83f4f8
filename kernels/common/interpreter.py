"""Fixes for Triton 3.6's interpreter (TRITON_INTERPRET=1, CPU only).

Compiled code is untouched; `patch()` is idempotent and every kernel module
that may run in the interpreter calls it.

1. The interpreter holds scalars as 1-element arrays and turns them into loop
   bounds with ``int(array)``, which NumPy >= 2.4 refuses for arrays that are
   not 0-d (``range(pid, n, step)`` in a persistent kernel fails):
   ``__index__`` now reads the single element.
2. Its ``tl.dot`` multiplies bf16 operands as raw 16-bit integers: they are
   widened to fp32 first.
3. A ``@triton.jit`` helper called from an interpreted kernel re-patches
   ``triton.language`` with interpreter builtins and never restores them, so
   after one interpreted kernel with helpers, compiling a (Gluon) kernel in
   the same process fails: the helper call now restores what it patched.
4. bf16 atomic adds, which its builder lacks ("Unsupported data type"). The
   interpreter runs one program at a time, so a read-add-round-write per
   element is exact emulation (round to nearest even, as the GPU's
   ``red.add.bf16`` does).
"""
import numpy as np

_PATCHED = False


def active() -> bool:
    """Whether @triton.jit runs in the interpreter, parsed as Triton parses it (1/true/on/yes)."""
    import triton

    return bool(triton.knobs.runtime.interpret)


def patch() -> None:
    global _PATCHED
    if _PATCHED:
        return
    import triton.language as tl
    from triton.runtime import interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patched

    dot = interp.InterpreterBuilder.create_dot

    def widen(h):
        if h.dtype == tl.bfloat16:
            bits = h.data.view(np.uint16).astype(np.uint32) << 16
            return interp.TensorHandle(bits.view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    interp.InterpreterBuilder.create_dot = create_dot

    def device_call(self, *args, **kwargs):
        scope = interp._patch_lang(self.fn)
        try:
            fn = self.rewrite()
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                raise interp.InterpreterError(repr(e)) from e
        finally:
            scope.restore()

    interp.InterpretedFunction.__call__ = device_call
    _patch_bf16_atomics(interp, tl)
    _PATCHED = True


def _patch_bf16_atomics(interp, tl) -> None:
    import ctypes

    import torch
    from triton._C.libtriton import ir

    original = interp.InterpreterBuilder.create_atomic_rmw

    def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
        if val.dtype.scalar != tl.bfloat16 or rmwOp != ir.ATOMIC_OP.FADD:
            return original(self, rmwOp, ptr, val, mask, sem, scope)
        addrs = np.broadcast_to(ptr.data, val.data.shape).reshape(-1)
        bits = val.data.reshape(-1)
        on = np.broadcast_to(mask.data, val.data.shape).reshape(-1)
        old = np.zeros_like(bits)
        for i in np.flatnonzero(on):
            cell = ctypes.c_uint16.from_address(int(addrs[i]))
            old[i] = cell.value
            total = (np.array([old[i]], np.uint32) << 16).view(np.float32) + \
                (np.array([bits[i]], np.uint32) << 16).view(np.float32)
            cell.value = int(torch.from_numpy(total).to(torch.bfloat16).view(torch.int16).item()) & 0xFFFF
        return interp.TensorHandle(old.reshape(val.data.shape), tl.bfloat16)

    interp.InterpreterBuilder.create_atomic_rmw = create_atomic_rmw

