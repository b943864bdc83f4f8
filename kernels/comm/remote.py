"""Device-side peer-memory helpers (the role iris' `translate` plays on AMD).

Every rank allocates its symmetric heap at a different base address; a kernel
holds the table of all ranks' bases (`heap_bases`, int64 per rank). A local
heap pointer becomes a peer's by swapping the base. That arithmetic goes
through integers, which erases what the compiler knew about alignment and
contiguity: re-state it with `tl.multiple_of`/`tl.max_contiguous` (HINT) or
the stores fall back to 16-bit scalars instead of 128-bit vectors.
"""
import triton
import triton.language as tl


@triton.jit
def translate(ptr, from_rank, to_rank, heap_bases, HINT: tl.constexpr = 0):
    """`ptr` (local to `from_rank`) as a pointer into `to_rank`'s heap.

    HINT > 0 re-asserts that runs of HINT elements are contiguous and
    HINT-aligned, so vector loads/stores survive the integer round trip.
    """
    from_base = tl.load(heap_bases + from_rank).to(tl.uint64)
    to_base = tl.load(heap_bases + to_rank).to(tl.uint64)
    offset = ptr.to(tl.uint64, bitcast=True) - from_base
    out = (to_base + offset).to(ptr.dtype, bitcast=True)
    if HINT > 0:
        out = tl.max_contiguous(tl.multiple_of(out, HINT), HINT)
    return out


@triton.jit
def remote_store_kernel(heap_bases, x_ptr, n, rank: tl.constexpr, peer: tl.constexpr,
                        BLOCK: tl.constexpr, HINT: tl.constexpr):
    """Copy a block of the local heap buffer `x_ptr` to the same place on `peer`."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    dst = translate(x_ptr + offs, rank, peer, heap_bases, BLOCK if HINT else 0)
    tl.store(dst, x, mask=mask)


# ---------------------------------------------------------------------------
# Everything below extends the two helpers above (kept at their lines: cache
# fixtures record `remote_store_kernel`'s source location).
#
# Conventions: `rank` is the calling rank, `peer` the other side; a "heap
# address" is a pointer into the caller's own symmetric heap (the same offset
# names the same buffer on every rank). HINT as in `translate` (1-D pointers).
# ---------------------------------------------------------------------------


@triton.jit
def peer_delta(rank, peer, heap_bases, ESIZE: tl.constexpr, HINT: tl.constexpr = 0):
    """Elements from an address in `rank`'s heap to the same offset in `peer`'s.

    ``ptr + peer_delta(...)`` is `ptr` on `peer`. Unlike `translate` this stays
    pointer arithmetic, so what the compiler knows about `ptr` (contiguity,
    alignment, any tile shape) survives; it only needs to know the distance's
    alignment: HINT > 0 asserts it is a multiple of HINT elements (heaps are
    at least 256-byte aligned, so HINT = 16 // ESIZE always holds). Returned
    hints survive inlining because they are set here, on the op that makes
    the value (a hint on a helper's *result* is dropped with the call).
    """
    d = (tl.load(heap_bases + peer) - tl.load(heap_bases + rank)) // ESIZE
    if HINT > 0:
        d = tl.multiple_of(d, HINT)
    return d


@triton.jit
def remote_load(ptr, rank, peer, heap_bases, mask=None, other=None, HINT: tl.constexpr = 0):
    """Load the heap address `ptr` from `peer`'s heap (a read over NVLink)."""
    return tl.load(translate(ptr, rank, peer, heap_bases, HINT), mask=mask, other=other)


@triton.jit
def remote_store(ptr, value, rank, peer, heap_bases, mask=None, HINT: tl.constexpr = 0):
    """Store `value` at the heap address `ptr` in `peer`'s heap (a posted write)."""
    tl.store(translate(ptr, rank, peer, heap_bases, HINT), value, mask=mask)


@triton.jit
def put(src_ptr, dst_ptr, rank, peer, heap_bases, mask=None, HINT: tl.constexpr = 0):
    """Copy local `src_ptr` (any local memory) to heap address `dst_ptr` on `peer`."""
    value = tl.load(src_ptr, mask=mask)
    remote_store(dst_ptr, value, rank, peer, heap_bases, mask, HINT)


@triton.jit
def get(src_ptr, dst_ptr, rank, peer, heap_bases, mask=None, HINT: tl.constexpr = 0):
    """Copy heap address `src_ptr` on `peer` into local `dst_ptr` (any local memory)."""
    value = remote_load(src_ptr, rank, peer, heap_bases, mask, None, HINT)
    tl.store(dst_ptr, value, mask=mask)


@triton.jit
def signal(flag_ptr, value, rank, peer, heap_bases, OP: tl.constexpr = "set", SCOPE: tl.constexpr = "sys"):
    """Publish this program's earlier stores, then set (OP="set") or add to
    (OP="add") the int32 heap flag `flag_ptr` on `peer`; returns the old value.

    Order matters: the data stores of every thread come first, then a CTA
    barrier (so all of them precede the flag in the memory model), then one
    release atomic. SCOPE="sys" when `peer` is another GPU (stores cross
    NVLink); "gpu" only when producer and consumer share a GPU.
    """
    tl.debug_barrier()
    target = translate(flag_ptr, rank, peer, heap_bases)
    if OP == "add":
        old = tl.atomic_add(target, value, sem="release", scope=SCOPE)
    else:
        old = tl.atomic_xchg(target, value, sem="release", scope=SCOPE)
    return old


@triton.jit
def put_kernel(src_ptr, dst_ptr, n, heap_bases, rank, peer, BLOCK: tl.constexpr, HINT: tl.constexpr):
    """Grid-stride copy of `n` local elements to heap address `dst_ptr` on `peer`
    (the SM-driven peer copy used to measure NVLink write bandwidth)."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        put(src_ptr + offs, dst_ptr + offs, rank, peer, heap_bases, offs < n, BLOCK if HINT else 0)


@triton.jit
def get_kernel(src_ptr, dst_ptr, n, heap_bases, rank, peer, BLOCK: tl.constexpr, HINT: tl.constexpr):
    """Grid-stride copy of `n` elements from heap address `src_ptr` on `peer` to local `dst_ptr`."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)
        get(src_ptr + offs, dst_ptr + offs, rank, peer, heap_bases, offs < n, BLOCK if HINT else 0)


@triton.jit
def arrive_kernel(flags_ptr, heap_bases, rank, WORLD: tl.constexpr, SCOPE: tl.constexpr):
    """Add 1 to slot `rank` of the flag array on every rank (self included),
    starting with the next rank so that ranks do not all hit rank 0 first."""
    for i in tl.static_range(WORLD):
        signal(flags_ptr + rank, 1, rank, (rank + i) % WORLD, heap_bases, "add", SCOPE)
