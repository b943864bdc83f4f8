"""kernels.common.memcpy2d: the copy engine's strided 2-D copy (CPU: its fallback, its checks,
and the driver descriptor's layout; the copy itself runs in the GPU tests of all_gather_matmul)."""
import ctypes

import pytest
import torch

from kernels.common.memcpy2d import Copy2D, _Memcpy2D


def test_copies_a_block_into_columns_of_a_wider_matrix():
    g = torch.Generator().manual_seed(3)
    src = torch.randn(5, 7, generator=g).to(torch.bfloat16)
    dst = torch.full((5, 20), float("nan"), dtype=torch.bfloat16)
    Copy2D(dst[:, 7:14], src)()
    assert torch.equal(dst[:, 7:14], src)
    assert dst[:, :7].isnan().all() and dst[:, 14:].isnan().all()   # nothing outside the block written


@pytest.mark.parametrize("dst,src,words", [
    (torch.empty(4, 6), torch.empty(4, 5), "one shape and dtype"),
    (torch.empty(4, 6), torch.empty(4, 6, dtype=torch.float16), "one shape and dtype"),
    (torch.empty(6, 4).t(), torch.empty(4, 6), "unit column stride"),
    (torch.empty(4, 6), torch.empty(6).expand(4, 6), "do not overlap"),
])
def test_mismatched_operands_are_refused(dst, src, words):
    with pytest.raises(ValueError, match=words):
        Copy2D(dst, src)


def test_descriptor_matches_the_drivers_struct():
    """CUDA_MEMCPY2D on a 64-bit host: 16 fields, 128 bytes, the destination's half from byte 56."""
    assert ctypes.sizeof(_Memcpy2D) == 128
    assert _Memcpy2D.dstXInBytes.offset == 56 and _Memcpy2D.WidthInBytes.offset == 112
    assert _Memcpy2D.srcDevice.offset == 32 and _Memcpy2D.dstPitch.offset == 104


@pytest.mark.gpu
def test_gpu_copy_engine_block_copy_eager_and_in_a_graph():
    """On a GPU: a block into columns of a wider matrix and rows of a strided source, by the copy
    engine, on a side stream and captured in a CUDA graph (replayed with new source values); only
    the block is written."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(5)
    src = torch.randn(300, 96, device=dev, generator=g).bfloat16()
    dst = torch.full((300, 400), float("nan"), device=dev, dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    copy = Copy2D(dst[:, 200:296], src[:, :])
    copy(side)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    assert torch.equal(dst[:, 200:296], src)
    assert dst[:, :200].isnan().all() and dst[:, 296:].isnan().all()
    wide = torch.randn(64, 512, device=dev, generator=g).bfloat16()   # rows of a strided source
    Copy2D(dst[:64, :100], wide[:, 7:107])()
    torch.cuda.synchronize()
    assert torch.equal(dst[:64, :100], wide[:, 7:107])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        copy()
    src.copy_(torch.randn(300, 96, device=dev, generator=g).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(dst[:, 200:296], src)
