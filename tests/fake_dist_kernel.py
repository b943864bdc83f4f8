"""A tiny multi-rank kernel module for the sweep's world path (tests/test_sweep_dist.py).

It implements the sweep's kernel-module protocol with torch.distributed
itself: ``run`` all-gathers each rank's shard (gloo on CPU), so a point is
only right when every rank of the world took part. Some modes misbehave on
rank 1, on purpose:

``raise``  raises after the collective (the point fails, the world goes on)
``hang2``  sleeps for an hour after the collective, in a world of 2 ranks (the
           point timeout kills the world while rank 0 waits for it)
``die3``   exits the process before the collective, in a world of 3 ranks (the world fails)
"""
import os
import time

import torch
import torch.distributed as tdist

from workbench.dtypes import element_size

PARAMS = {"mode": "ok", "tag": 0}
WORLD_SIZES = (2, 3)


def _rank() -> int:
    return tdist.get_rank() if tdist.is_initialized() else 0


def _world() -> int:
    return tdist.get_world_size() if tdist.is_initialized() else 1


def _shard(n: int, dtype, seed: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1009 + rank)
    return torch.randn(n, generator=g).to(dtype)


def make_inputs(shape, dtype, device, seed):
    W, n = _world(), int(shape["n"])
    return {"x": _shard(n, dtype, seed, _rank()), "out": torch.empty(W * n, dtype=dtype), "seed": seed, "n": n,
            "world": W, "dtype": dtype}


def poison(inputs):
    inputs["out"].fill_(float("nan"))


def run(inputs, mode="ok", tag=0):
    rank, W = _rank(), inputs["world"]
    if mode == "die3" and rank == 1 and W == 3:
        os._exit(7)
    out = inputs["out"]
    if W > 1:
        tdist.all_gather(list(out.chunk(W)), inputs["x"])
    else:
        out.copy_(inputs["x"])
    if mode == "raise" and rank == 1:
        raise RuntimeError("rank 1 exploded on purpose")
    if mode == "hang2" and rank == 1 and W == 2:
        time.sleep(3600)
    return out


def reference(inputs):
    return torch.cat([_shard(inputs["n"], inputs["dtype"], inputs["seed"], r) for r in range(inputs["world"])]).double()


def flops(shape):
    return 0


def bytes_moved(shape, dtype):
    return (_world() - 1) * int(shape["n"]) * element_size(dtype)


def tolerance(dtype):
    return 0.0


def label(params):
    return f"{params.get('mode')} t{params.get('tag')}"


baselines = {"gloo": lambda inputs: run(inputs)}
