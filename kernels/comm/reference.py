"""The reference of an all-gather: the shards concatenated in rank order."""
from __future__ import annotations

import torch


def reference(shards: list[torch.Tensor]) -> torch.Tensor:
    """What every rank must hold: ``torch.cat(shards)`` (rank-major along dim 0)."""
    return torch.cat(list(shards))
