"""Routing generators: exact sums, reproducible seeds, the shapes of the distributions."""
from __future__ import annotations

import pytest
import torch

from kernels.moe import routing as rt


@pytest.mark.parametrize("kind", rt.ROUTINGS)
@pytest.mark.parametrize("total, G", [(0, 1), (1, 4), (7, 3), (2048 * 16, 16), (4096 * 32, 32), (12345, 256)])
def test_sizes_sum_exactly_and_are_nonnegative(kind, total, G):
    s = rt.make(kind, total, G, seed=5)
    assert s.shape == (G,)
    assert s.dtype == torch.int32
    assert int(s.sum()) == total
    assert int(s.min()) >= 0


@pytest.mark.parametrize("kind", ["mild", "extreme"])
def test_seeds_reproduce_and_differ(kind):
    a = rt.make(kind, 65536, 32, seed=1)
    b = rt.make(kind, 65536, 32, seed=1)
    c = rt.make(kind, 65536, 32, seed=2)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    g1 = torch.Generator().manual_seed(9)
    g2 = torch.Generator().manual_seed(9)
    assert torch.equal(rt.make(kind, 1000, 8, generator=g1), rt.make(kind, 1000, 8, generator=g2))


def test_balanced_is_even():
    s = rt.balanced(1003, 10)
    assert int(s.max()) - int(s.min()) <= 1
    assert s.tolist()[:3] == [101, 101, 101] and s.tolist()[-1] == 100


def test_mild_follows_the_seed_recipe():
    # weights 0.2 + 0.8 U(0,1): every expert gets a share, at most ~5x another's
    total, G = 4096 * 32, 32
    for seed in range(20):
        s = rt.mild(total, G, seed=seed).double()
        assert (s > 0).all()
        body = s[:-1]                    # the last expert also takes the floors' remainder
        assert body.max() / body.min() <= 5.0 + 1e-6
    # the recipe itself: floors of total * d / sum(d), remainder to the last expert
    gen = torch.Generator().manual_seed(3)
    d = 0.2 + 0.8 * torch.rand(G, generator=gen, dtype=torch.float64)
    expect = torch.floor(total * d / d.sum()).long()
    expect[-1] += total - int(expect.sum())
    assert rt.mild(total, G, seed=3).long().tolist() == expect.tolist()


def test_mild_is_unbalanced_on_average():
    spreads = [float(rt.mild(65536, 16, seed=s).double().std()) for s in range(10)]
    assert min(spreads) > 0
    assert sum(spreads) / len(spreads) > 0.1 * 65536 / 16


@pytest.mark.parametrize("G, top_k, expect_k", [(4, None, 1), (16, None, 2), (32, None, 4), (32, 3, 3), (8, 8, 8)])
def test_extreme_only_top_k_get_tokens(G, top_k, expect_k):
    s = rt.extreme(1000 * G + 1, G, top_k=top_k, seed=4)
    nz = s[s > 0]
    assert len(nz) == expect_k
    assert int(nz.max()) - int(nz.min()) <= expect_k   # split evenly, remainder on the last


def test_device_and_dtype_options():
    s = rt.balanced(10, 3, dtype=torch.int64)
    assert s.dtype == torch.int64 and s.device.type == "cpu"


@pytest.mark.parametrize("call, match", [
    (lambda: rt.balanced(-1, 3), "total"),
    (lambda: rt.balanced(10, 0), "G"),
    (lambda: rt.mild(10.5, 3), "total"),
    (lambda: rt.extreme(10, 4, top_k=5), "top_k"),
    (lambda: rt.make("spiky", 10, 4), "unknown kind"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()
