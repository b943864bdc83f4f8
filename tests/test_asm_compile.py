"""Cross-compilation for targets that are not present (no GPU here)."""
import pytest
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from workbench.asm.cache import CacheError, list_entries
from workbench.asm.compile import TARGETS, cross_compile, warp_size


@triton.jit
def _axpy(x_ptr, y_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    tl.store(y_ptr + offs, alpha * tl.load(x_ptr + offs, mask=m) + tl.load(y_ptr + offs, mask=m), mask=m)


@gluon.jit
def _gluon_copy(x_ptr, y_ptr, n, BLOCK: gl.constexpr, SPT: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout(size_per_thread=[SPT], threads_per_warp=[32], warps_per_cta=[4], order=[0])
    offs = gl.program_id(0) * BLOCK + gl.arange(0, BLOCK, layout=layout)
    m = offs < n
    gl.store(y_ptr + offs, gl.load(x_ptr + offs, mask=m), mask=m)


SIG = {"x_ptr": "*fp32", "y_ptr": "*fp32", "n": "i32", "alpha": "fp32"}


def test_warp_size():
    names = ("sm90", "SM_90", "gfx90a", "gfx942", "gfx950", "gfx1100")
    assert [warp_size(t) for t in names] == [32, 32, 64, 64, 64, 32]  # CDNA: wave64, RDNA: wave32
    assert all(warp_size(t) in (32, 64) for t in TARGETS)
    with pytest.raises(CacheError, match="unknown target 'sm75'"):
        warp_size("sm75")


def test_five_targets(tmp_path):
    targets = ["sm90", "sm100", "gfx942", "gfx950", "gfx1100"]
    entries = cross_compile(_axpy, targets, signature=SIG, constexprs={"BLOCK": 512},
                            divisible=["x_ptr", "y_ptr", "n"], cache_dir=tmp_path)
    assert [e.arch for e in entries] == targets
    assert all(e.ok for e in entries)
    assert {e.hash for e in list_entries(tmp_path)} == {e.hash for e in entries}
    for e in entries:
        final = e.mix()
        stores = final[(final["space"] == "global") & (final["kind"] == "store")]
        # 512 fp32 over 4 warps: 4 per thread on wave32 (128-bit), 2 on wave64 (64-bit).
        assert stores["width_bits"].max() == (64 if e.arch in ("gfx942", "gfx950") else 128), (e.arch, final)
    assert entries[-1].metadata["target"]["warp_size"] == 32  # RDNA runs wave32


def test_gluon_layout_sets_vector_width(tmp_path):
    widths = {}
    for spt in (1, 2, 4, 8):
        (e,) = cross_compile(_gluon_copy, "sm90", signature={"x_ptr": "*fp16", "y_ptr": "*fp16", "n": "i32"},
                             constexprs={"BLOCK": 128 * spt, "SPT": spt}, divisible=[0, 1, 2], num_warps=4,
                             cache_dir=tmp_path)
        m = e.mix()
        widths[spt] = int(m[(m["space"] == "global") & (m["kind"] == "store")]["width_bits"].max())
        assert "source" in e.stages and "ttir" not in e.stages  # Gluon starts at its own IR
    assert widths == {1: 16, 2: 32, 4: 64, 8: 128}


def test_options_reach_the_compiler(tmp_path):
    (e,) = cross_compile(_axpy, ["gfx942"], signature=SIG, constexprs={"BLOCK": 256}, num_warps=2, num_stages=1,
                         cache_dir=tmp_path)
    assert (e.num_warps, e.num_stages) == (2, 1)


@pytest.mark.parametrize("kwargs, message", [
    ({"signature": {"x_ptr": "*fp32"}}, "give a type for y_ptr"),
    ({"signature": dict(SIG, bogus="i32")}, "no parameter"),
    ({"signature": SIG, "divisible": ["nope"]}, "no parameter 'nope'"),
])
def test_bad_calls(tmp_path, kwargs, message):
    with pytest.raises(CacheError, match=message):
        cross_compile(_axpy, ["sm90"], constexprs={"BLOCK": 64}, cache_dir=tmp_path, **kwargs)


def test_compile_error_names_the_kernel(tmp_path):
    with pytest.raises(CacheError, match="compiling _axpy for sm90 failed"):
        cross_compile(_axpy, ["sm90"], signature=SIG, constexprs={"BLOCK": 3}, cache_dir=tmp_path)  # not a power of 2


def test_tensordesc_layouts_that_triton_would_eval_are_refused(tmp_path):
    from workbench.asm.compile import _check_type

    good = ("tensordesc<bf16[128, 64],NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2, "
            "transposed=False, fp4_padded=False, cga_layout=[])>")
    _check_type("a_desc", good)
    _check_type("x_ptr", "*fp16")
    _check_type("d", "tensordesc<fp16[64, 64]>")  # Triton (not Gluon) descriptor: no layout
    canary = tmp_path / "canary"
    for layout in (f"__import__('os').system('touch {canary}')", "NVMMASharedLayout(rank=__import__('os'))",
                   "NVMMASharedLayout.__init__", "(lambda: 1)()", "NVMMASharedLayout(*[1])", "open('x')"):
        with pytest.raises(CacheError, match="literal arguments"):
            _check_type("a_desc", f"tensordesc<bf16[128, 64],{layout}>")
    assert not canary.exists()
