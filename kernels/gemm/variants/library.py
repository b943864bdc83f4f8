"""Variant ``library``: the vendor library (cuBLAS through ``torch.matmul``), a candidate like
any other, so that where none of our kernels is faster a tuned table runs the library
rather than a slower kernel. It is never the cold rule's pick, and the tables and reports
name it ("cublas") wherever it runs."""
from __future__ import annotations

import dataclasses

import torch

from kernels.gemm.plan import Call, GemmPlan

NAME = "library"


@dataclasses.dataclass(frozen=True)
class Config:
    """No knobs: the library chooses its own kernel."""

    def label(self) -> str:
        return "cublas"

    def validate(self) -> "Config":
        return self


def usable(call: Call, cfg: Config) -> None:
    if not call.on_gpu:
        raise ValueError("gemm: the library variant (cuBLAS) runs on a CUDA GPU; in the interpreter use a Triton "
                         "config")


def plan(call: Call, cfg: Config, explicit: bool) -> GemmPlan:
    usable(call, cfg)
    return GemmPlan("library", call.M, call.N, call.K, cfg)


def launch(p: GemmPlan, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    torch.mm(a, b, out=out)
