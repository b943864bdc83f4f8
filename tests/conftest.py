"""Shared pytest setup: GPU markers skip cleanly, with a reason, without GPUs."""
import pytest


def _cuda_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config, items):
    n = _cuda_count()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run it through `device` on an H200")
    skip_multi = pytest.mark.skip(reason=f"needs 2+ CUDA GPUs, found {n}; run on nvidia-h200-x2/x4")
    for item in items:
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and n < 1:
            item.add_marker(skip_gpu)
