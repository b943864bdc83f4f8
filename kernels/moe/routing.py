"""Token routing patterns for mixture-of-experts benchmarks: group sizes per expert.

Every generator returns an integer tensor ``group_sizes`` of length ``G`` whose
entries are >= 0 and sum exactly to ``total``. Random ones draw from a
``torch.Generator`` (pass one, or a ``seed``), so the same seed gives the same
routing on any machine. Sizes are drawn on the CPU and then moved to
``device``: that is set-up, not the launch path.

* ``balanced``: ``total // G`` each; the remainder goes one token apiece to the
  first experts.
* ``mild``: the seed study's "unbalanced": expert ``e`` gets a weight
  ``d_e = 0.2 + 0.8 * U(0, 1)``; sizes are ``floor(total * d_e / sum(d))`` and
  whatever the floors leave over goes to the last expert.
* ``extreme``: only ``top_k`` experts (chosen at random) get tokens, split
  evenly among them (remainder to the last chosen); all others get none.
"""
from __future__ import annotations

import torch

__all__ = ["ROUTINGS", "balanced", "extreme", "make", "mild"]

ROUTINGS = ("balanced", "mild", "extreme")


def _check(total: int, G: int) -> None:
    if not isinstance(total, int) or isinstance(total, bool) or total < 0:
        raise ValueError(f"routing: total must be a non-negative int, got {total!r}")
    if not isinstance(G, int) or isinstance(G, bool) or G < 1:
        raise ValueError(f"routing: number of experts G must be a positive int, got {G!r}")


def _gen(generator: torch.Generator | None, seed: int | None) -> torch.Generator:
    if generator is not None:
        return generator
    g = torch.Generator()
    g.manual_seed(0 if seed is None else int(seed))
    return g


def _finish(sizes: torch.Tensor, total: int, dtype: torch.dtype, device) -> torch.Tensor:
    assert int(sizes.sum()) == total and int(sizes.min()) >= 0, "routing: internal error"
    return sizes.to(dtype=dtype, device=device)


def balanced(total: int, G: int, *, generator: torch.Generator | None = None, seed: int | None = None,
             dtype: torch.dtype = torch.int32, device: str | torch.device = "cpu") -> torch.Tensor:
    """total // G tokens per expert; the first total % G experts get one more."""
    _check(total, G)
    sizes = torch.full((G,), total // G, dtype=torch.int64)
    sizes[: total % G] += 1
    return _finish(sizes, total, dtype, device)


def mild(total: int, G: int, *, generator: torch.Generator | None = None, seed: int | None = None,
         dtype: torch.dtype = torch.int32, device: str | torch.device = "cpu") -> torch.Tensor:
    """The seed's unbalanced routing: weights 0.2 + 0.8 * U(0, 1), floors, remainder to the last."""
    _check(total, G)
    d = 0.2 + 0.8 * torch.rand(G, generator=_gen(generator, seed), dtype=torch.float64)
    sizes = torch.floor(total * d / d.sum()).to(torch.int64)
    sizes[-1] += total - int(sizes.sum())
    return _finish(sizes, total, dtype, device)


def extreme(total: int, G: int, *, top_k: int | None = None, generator: torch.Generator | None = None,
            seed: int | None = None, dtype: torch.dtype = torch.int32,
            device: str | torch.device = "cpu") -> torch.Tensor:
    """Only top_k random experts get tokens (default max(1, G // 8)); the rest get none."""
    _check(total, G)
    k = max(1, G // 8) if top_k is None else int(top_k)
    if not 1 <= k <= G:
        raise ValueError(f"routing: top_k must be in [1, G={G}], got {top_k!r}")
    chosen = torch.randperm(G, generator=_gen(generator, seed))[:k].sort().values
    sizes = torch.zeros(G, dtype=torch.int64)
    sizes[chosen] = total // k
    sizes[chosen[-1]] += total - (total // k) * k
    return _finish(sizes, total, dtype, device)


def make(kind: str, total: int, G: int, **kwargs) -> torch.Tensor:
    """Dispatch by name: 'balanced', 'mild' (alias 'unbalanced') or 'extreme'."""
    table = {"balanced": balanced, "mild": mild, "unbalanced": mild, "extreme": extreme}
    if kind not in table:
        raise ValueError(f"routing: unknown kind {kind!r}; choose one of {', '.join(ROUTINGS)}")
    return table[kind](total, G, **kwargs)
