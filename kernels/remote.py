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
