"""The GEMM family's kernel variants, one module each: its config (its own knobs only), a
plan builder (``plan(call, config, explicit)``), ``launch(plan, a, b, out)`` and ``usable``.
Selection (``kernels.gemm.select``) chooses among (variant, config) pairs; ``matmul`` plans
and launches through the variant a plan names. A new variant is one new module here.

``GemmConfig`` (``kernels.gemm.config``) stays the flat spelling of the Triton kernels'
knobs that users and sweep specs write; ``of`` turns it (or a variant's own config) into
(variant module, that variant's config).
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kernels.gemm.config import GemmConfig, validate_config
from kernels.gemm.plan import GemmPlan, padded
from kernels.gemm.variants import fma, gluon, library, persistent, splitk

VARIANTS = {m.NAME: m for m in (persistent, splitk, fma, gluon, library)}
KINDS = {"tma": persistent, "ptr": persistent, "splitk": splitk, "fma": fma, "gluon": gluon, "library": library}


def _fields(cls, cfg: GemmConfig) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cls)}


def of(config: Any):
    """(variant module, its config) for a ``GemmConfig`` or a variant's own config, validated."""
    for mod in VARIANTS.values():
        if type(config) is mod.Config:
            return mod, config.validate()
    if not isinstance(config, GemmConfig):
        raise ValueError(f"gemm: config must be a GemmConfig, a dict of its fields or a variant's config "
                         f"({', '.join(f'{m.__name__}.Config' for m in VARIANTS.values())}), got "
                         f"{type(config).__name__}")
    validate_config(config)
    if config.fma:
        return fma, fma.Config(**_fields(fma.Config, config))
    if config.gluon:
        return gluon, config.ws_config()
    if config.split_k is not None:
        return splitk, splitk.Config(**_fields(splitk.Config, config))
    return persistent, persistent.Config(**_fields(persistent.Config, config))


def from_dict(variant: str, knobs: dict):
    """A variant's config from its name and a dict of its knobs (a table entry), validated;
    ValueError naming what is wrong."""
    mod = VARIANTS.get(variant)
    if mod is None:
        raise ValueError(f"unknown gemm variant {variant!r} (known: {', '.join(VARIANTS)})")
    known = {f.name for f in dataclasses.fields(mod.Config)}
    unknown = sorted(set(knobs) - known)
    if unknown:
        raise ValueError(f"gemm variant {variant!r} has no knob(s) {unknown}; known: {sorted(known)}")
    return mod, mod.Config(**knobs).validate()


def execute(p: GemmPlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """Run a plan on one call's tensors: the aligned copies and the K-major copy of B it asks
    for, then its variant's launch. Plans of kind "empty" and "zero" are the caller's."""
    if p.pad_a:
        a = padded(a, p.pad_a)
    if p.pad_b:
        b = padded(b, p.pad_b)
    if p.trans_b:
        b = b.t().contiguous().t()   # same (K, N) matrix, now K-major
    KINDS[p.kind].launch(p, a, b, out)
