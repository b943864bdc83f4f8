"""Device ceilings (measured once, cached) and the roofline model.

Ceilings are measured, not copied from a datasheet:

* ``copy_gbps``: a large device-to-device copy, counting bytes read plus bytes
  written (the memory roof);
* ``bf16_tflops`` / ``fp16_tflops``: cuBLAS (``torch.matmul``) on a large square
  product of random data (the compute roof a kernel can be held to);
* ``peer_gbps``: a copy from GPU 0 to GPU 1 (bytes moved once), with two GPUs+.

``measure_ceilings()`` writes them, with the date and provenance, to the user
cache (``$WORKBENCH_CACHE`` or ``~/.cache/kernel-workbench/ceilings/``) and, if
asked, to ``results/ceilings/`` (committed, so machines without the GPU can
draw the same roofline). ``ceilings()`` finds them again by device name and
adds the datasheet numbers for comparison.
"""
from __future__ import annotations

import datetime as _dt
import json
import warnings
import math
import os
import re
from pathlib import Path
from typing import Any, Mapping

__all__ = ["DATASHEETS", "measure_copy", "measure_ceilings", "load_ceilings", "ceilings", "save_ceilings",
           "arithmetic_intensity", "ridge_point", "attainable_tflops", "bound", "figure", "device_slug"]

REPO_ROOT = Path(__file__).resolve().parents[1]
COMMITTED_DIR = REPO_ROOT / "results" / "ceilings"

# Vendor datasheet numbers (dense, no sparsity); leads, not measurements.
DATASHEETS: dict[str, dict[str, Any]] = {
    "NVIDIA H200": {"hbm_gbps": 4800.0, "bf16_tflops": 989.0, "fp16_tflops": 989.0,
                    "source": "NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, ~989 TFLOP/s dense BF16/FP16"},
    "NVIDIA H100 80GB HBM3": {"hbm_gbps": 3350.0, "bf16_tflops": 989.0, "fp16_tflops": 989.0,
                              "source": "NVIDIA H100 SXM datasheet: 3.35 TB/s HBM3, ~989 TFLOP/s dense BF16/FP16"},
}


def device_slug(name: str) -> str:
    """'NVIDIA H200' -> 'nvidia-h200' (file name of the cached ceilings)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def user_cache_dir() -> Path:
    base = os.environ.get("WORKBENCH_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "kernel-workbench"
    return root / "ceilings"


def _current_device_name() -> str | None:
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_name(torch.cuda.current_device())
    except Exception:  # pragma: no cover
        pass
    return None


# --------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------
def measure_copy(nbytes: int, *, device="cuda", warmup_ms: float = 50, rep_ms: float = 300, generator=None):
    """(timing, GB/s) of ``dst.copy_(src)`` over ``nbytes`` of fp32 on ``device``, bytes read plus
    bytes written counted: the memory roof (``copy_gbps``) and the studies' HBM bound."""
    import torch

    from . import bench

    n = nbytes // 4
    src = torch.randn(n, device=device, generator=generator)
    dst = torch.empty_like(src)
    t = bench.measure(lambda: dst.copy_(src), warmup_ms=warmup_ms, rep_ms=rep_ms, flush_l2=False)
    return t, t.gbps(2 * n * 4)


def measure_ceilings(*, gemm_size: int = 8192, copy_bytes: int = 2 << 30, rep_ms: float = 300,
                     save: bool = True, commit_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Measure this machine's ceilings on the current CUDA device (see module doc)."""
    import torch

    from . import bench, provenance

    if not bench.gpu_timing_available():
        raise RuntimeError("measure_ceilings needs a CUDA GPU (and TRITON_INTERPRET unset)")
    dev = torch.cuda.current_device()
    name = torch.cuda.get_device_name(dev)
    g = torch.Generator(device="cuda").manual_seed(0)

    t_copy, copy_gbps = measure_copy(copy_bytes, warmup_ms=50, rep_ms=rep_ms, generator=g)

    gemm: dict[str, float] = {}
    timings = {"copy": t_copy.as_row()}
    for dtype, key in ((torch.bfloat16, "bf16_tflops"), (torch.float16, "fp16_tflops")):
        a = torch.randn(gemm_size, gemm_size, device="cuda", generator=g).to(dtype)
        b = torch.randn(gemm_size, gemm_size, device="cuda", generator=g).to(dtype)
        c = torch.empty(gemm_size, gemm_size, device="cuda", dtype=dtype)
        t = bench.measure(lambda: torch.matmul(a, b, out=c), warmup_ms=100, rep_ms=rep_ms, flush_l2=True)
        gemm[key] = t.tflops(2 * gemm_size ** 3)
        timings[key] = t.as_row()
        del a, b, c

    peer = None
    if torch.cuda.device_count() > 1:
        n_peer = (1 << 30) // 4
        s = torch.randn(n_peer, device="cuda:0", generator=None)
        d = torch.empty(n_peer, device="cuda:1")
        t_peer = bench.measure(lambda: d.copy_(s), warmup_ms=50, rep_ms=rep_ms, flush_l2=False)
        peer = t_peer.gbps(n_peer * 4)
        timings["peer"] = t_peer.as_row()
        del s, d

    result = {
        "device_name": name,
        "date": _dt.date.today().isoformat(),
        "copy_gbps": copy_gbps,
        "bf16_tflops": gemm["bf16_tflops"],
        "fp16_tflops": gemm["fp16_tflops"],
        "peer_gbps": peer,
        "method": {"copy": f"dst.copy_(src), {copy_bytes} bytes fp32, read+write counted",
                   "gemm": f"torch.matmul {gemm_size}^3 random normal, L2 flushed, median of CUDA events",
                   "peer": "cuda:0 -> cuda:1 copy of 1 GiB, bytes counted once" if peer else None},
        "timings": timings,
        "provenance": provenance.collect(),
    }
    if save:
        save_ceilings(result, commit_dir=commit_dir)
    return result


def save_ceilings(result: Mapping[str, Any], *, commit_dir: str | os.PathLike | None = None) -> list[Path]:
    """Write to the user cache, and to ``commit_dir`` (e.g. results/ceilings) if given.

    The user cache is a convenience (a warning if it cannot be written); the
    committed copy was asked for, so failing to write it is an error.
    """
    name = f"{device_slug(result['device_name'])}.json"
    text = json.dumps(result, indent=1, default=str) + "\n"
    paths = []
    try:
        user = user_cache_dir()
        user.mkdir(parents=True, exist_ok=True)
        (user / name).write_text(text)
        paths.append(user / name)
    except OSError as exc:
        warnings.warn(f"ceilings not cached in {user_cache_dir()}: {exc}", stacklevel=2)
    if commit_dir:
        d = Path(commit_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / name).write_text(text)
        paths.append(d / name)
    return paths


def load_ceilings(device_name: str | None = None, *, measure: bool = False) -> dict[str, Any] | None:
    """Measured ceilings for ``device_name`` (default: this GPU, else the only
    committed file): user cache first, then ``results/ceilings/``; measure them
    when asked and a GPU is here; else None."""
    name = device_name or _current_device_name()
    candidates: list[Path] = []
    if name:
        slug = device_slug(name)
        candidates = [user_cache_dir() / f"{slug}.json", COMMITTED_DIR / f"{slug}.json"]
    elif COMMITTED_DIR.exists():
        candidates = sorted(COMMITTED_DIR.glob("*.json"))[:1]
    for p in candidates:
        try:
            return json.loads(p.read_text())
        except (OSError, ValueError):
            continue
    if measure and name and name == _current_device_name():
        return measure_ceilings()
    return None


def ceilings(device_name: str | None = None, *, measure: bool = False) -> dict[str, Any]:
    """Measured ceilings (if any) and datasheet numbers, in one dict.

    Keys: device_name, measured (dict or None), datasheet (dict or None),
    copy_gbps / bf16_tflops / fp16_tflops (measured, else datasheet),
    source ('measured YYYY-MM-DD' or 'datasheet').
    """
    m = load_ceilings(device_name, measure=measure)
    name = device_name or (m or {}).get("device_name") or _current_device_name() or "unknown"
    sheet = DATASHEETS.get(name)
    out: dict[str, Any] = {"device_name": name, "measured": m, "datasheet": sheet}
    if m:
        out.update(copy_gbps=m["copy_gbps"], bf16_tflops=m["bf16_tflops"], fp16_tflops=m["fp16_tflops"],
                   source=f"measured {m.get('date', '?')}")
    elif sheet:
        out.update(copy_gbps=sheet["hbm_gbps"], bf16_tflops=sheet["bf16_tflops"],
                   fp16_tflops=sheet["fp16_tflops"], source="datasheet")
    else:
        out.update(copy_gbps=None, bf16_tflops=None, fp16_tflops=None, source="none")
    return out


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------
def arithmetic_intensity(flops: float, nbytes: float) -> float:
    """FLOP per byte of device memory traffic."""
    return flops / nbytes if nbytes else math.inf


def ridge_point(peak_tflops: float, bw_gbps: float) -> float:
    """Intensity (FLOP/byte) where the memory roof meets the compute roof."""
    return peak_tflops * 1e12 / (bw_gbps * 1e9)


def attainable_tflops(intensity: float, peak_tflops: float, bw_gbps: float) -> float:
    """The roofline: min(compute roof, intensity x bandwidth)."""
    return min(peak_tflops, intensity * bw_gbps * 1e9 / 1e12)


def bound(intensity: float, peak_tflops: float, bw_gbps: float) -> str:
    return "memory" if intensity < ridge_point(peak_tflops, bw_gbps) else "compute"


def figure(points=None, ceil: Mapping[str, Any] | None = None, *, dtype: str = "bf16", **kwargs):
    """Plotly roofline with measured and datasheet ceilings (see ``workbench.plots.roofline``)."""
    from . import plots

    return plots.roofline(points, ceil if ceil is not None else ceilings(), dtype=dtype, **kwargs)
