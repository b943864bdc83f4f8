"""Launch plans, shared by every family's launcher: a bounded LRU keyed by call
signature, the signature of a tensor, a hashable explicit config, and the device
facts a plan reads once (SM count, compute capability).

A plan may depend on exactly what ``tensor_signature`` and ``config_key`` capture:
shapes, strides, dtypes, devices, 16-byte alignment of each pointer and the
explicit config. That is also everything Triton specializes a kernel on, so a
plan may keep its compiled kernel (``kernels.common.launcher.PlannedLaunch``).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any, Mapping

import torch


@functools.lru_cache(maxsize=None)
def sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.lru_cache(maxsize=None)
def capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=None)
def device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


PLAN_CACHE_SIZE = 256  # plans kept per launcher (least recently used dropped)


class PlanCache:
    """A bounded LRU of launch plans keyed by call signature."""

    def __init__(self, size: int = PLAN_CACHE_SIZE):
        self.size = size
        self._plans: collections.OrderedDict = collections.OrderedDict()

    def get(self, key):
        plan = self._plans.get(key)
        if plan is not None:
            self._plans.move_to_end(key)
        return plan

    def put(self, key, plan):
        self._plans[key] = plan
        if len(self._plans) > self.size:
            self._plans.popitem(last=False)
        return plan

    def values(self):
        return list(self._plans.values())

    def __len__(self) -> int:
        return len(self._plans)

    def clear(self) -> None:
        self._plans.clear()


def tensor_signature(t: torch.Tensor) -> tuple:
    """What a plan may depend on: shape, strides, dtype, device and whether the
    base pointer is 16-byte aligned (TMA's and vector loads' condition). The device as its
    index (-1 off the GPU): cheaper than a ``torch.device`` object, and this runs every call."""
    return (t.shape, t.stride(), t.dtype, t.get_device(), t.data_ptr() % 16 == 0)


def capturing(t: torch.Tensor) -> bool:
    """Whether a CUDA graph is being captured on the current stream of ``t``'s device.
    A plan made under capture may encode TMA descriptors on the host: they are
    encoded once, at capture, and baked into the graph, so its replays pay neither
    the host cost nor the in-kernel encoding (part of the plan key)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def config_key(config) -> Any:
    """A hashable form of an explicit config (None, a dataclass, or a dict of fields)."""
    if config is None:   # the common call: no isinstance against an abstract class
        return None
    try:
        if dataclasses.is_dataclass(config):   # the families' own (frozen) configs: themselves, and no
            hash(config)                       # Mapping check (an abstract class's is the slow part)
            return config
        key = tuple(sorted(config.items())) if isinstance(config, Mapping) else config
        hash(key)
        return key
    except TypeError:
        return ("unhashable", id(config))  # planned anew (and validated) on every call
