"""Where a measurement came from: code version, software, device, knobs, time.

``collect()`` never fails. The commit comes from the environment variable
``WORKBENCH_GIT_SHA`` (and ``WORKBENCH_GIT_DIRTY``: 1/0) when it is set, else
from git, else it reads ``unknown``. The variable wins because a copy of the
working tree (the device machine's) may carry a stale ``.git``: on 2026-11-21
the GPU node's copy reported an earlier commit while newer code ran.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

__all__ = ["collect", "flat", "KNOB_PREFIXES", "git_info", "versions", "devices", "slurm"]

KNOB_PREFIXES = ("TRITON_", "NCCL_", "CUDA_", "TORCH_", "NVSHMEM_", "PYTORCH_")
REPO_ROOT = Path(__file__).resolve().parents[1]


def _git(*args: str, cwd: Path) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_info(repo: str | os.PathLike | None = None) -> dict[str, Any]:
    """{'git_sha', 'git_dirty', 'git_source'}; source is 'git', 'env' or 'unknown'."""
    env_sha = os.environ.get("WORKBENCH_GIT_SHA", "").strip()
    if env_sha:
        dirty = os.environ.get("WORKBENCH_GIT_DIRTY", "").strip().lower()
        return {"git_sha": env_sha,
                "git_dirty": True if dirty in ("1", "true", "yes") else False if dirty in ("0", "false", "no")
                else None,
                "git_source": "env"}
    cwd = Path(repo) if repo else REPO_ROOT
    sha = _git("rev-parse", "HEAD", cwd=cwd) if cwd.exists() else None
    if sha:
        status = _git("status", "--porcelain", "--untracked-files=no", cwd=cwd)
        return {"git_sha": sha, "git_dirty": bool(status) if status is not None else None, "git_source": "git"}
    return {"git_sha": "unknown", "git_dirty": None, "git_source": "unknown"}


def versions() -> dict[str, Any]:
    """{'python_version', 'torch_version', 'cuda_version', 'triton_version'} (None: not installed).

    ``cuda_version`` is None on a CPU-only torch; on a ROCm build it reads
    ``'hip X.Y'`` (torch has no CUDA version there, and the HIP one is what
    the numbers depend on).
    """
    out: dict[str, Any] = {"python_version": platform.python_version()}
    try:
        import torch

        out["torch_version"] = torch.__version__
        hip = getattr(torch.version, "hip", None)
        out["cuda_version"] = torch.version.cuda or (f"hip {hip}" if hip else None)
    except ImportError:  # pragma: no cover
        out["torch_version"] = None
        out["cuda_version"] = None
    try:
        import triton

        out["triton_version"] = triton.__version__
    except ImportError:  # pragma: no cover
        out["triton_version"] = None
    return out


def devices() -> dict[str, Any]:
    """{'device_name', 'device_count', 'device_capability', 'sm_count'} of GPU 0 ('cpu', 0 without one).

    A driver error does not raise: it is recorded as ``device_error``.
    """
    out: dict[str, Any] = {"device_name": "cpu", "device_count": 0, "device_capability": None,
                           "sm_count": None}
    try:
        import torch

        if torch.cuda.is_available():
            n = torch.cuda.device_count()
            props = torch.cuda.get_device_properties(0)
            out.update(device_name=props.name, device_count=n,
                       device_capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count)
    except Exception as exc:  # a broken driver must not stop a run from being recorded
        out["device_error"] = f"{type(exc).__name__}: {exc}"
    return out


def slurm() -> dict[str, Any]:
    """Inside a Slurm job: {'slurm_job_id', 'slurm_array_job_id', 'slurm_array_task_id', 'slurm_partition',
    'slurm_node', 'slurm_gpus'} (the GPUs Slurm gave the job, as indices on the node); {} elsewhere."""
    env = os.environ
    if not env.get("SLURM_JOB_ID"):
        return {}
    return {"slurm_job_id": env["SLURM_JOB_ID"], "slurm_array_job_id": env.get("SLURM_ARRAY_JOB_ID"),
            "slurm_array_task_id": env.get("SLURM_ARRAY_TASK_ID"), "slurm_partition": env.get("SLURM_JOB_PARTITION"),
            "slurm_node": env.get("SLURMD_NODENAME"),
            "slurm_gpus": env.get("SLURM_JOB_GPUS") or env.get("SLURM_STEP_GPUS") or env.get("CUDA_VISIBLE_DEVICES")}


def _knobs(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    knobs: dict[str, Any] = {k: v for k, v in sorted(os.environ.items()) if k.startswith(KNOB_PREFIXES)}
    if extra:
        knobs.update({str(k): v for k, v in extra.items()})
    return knobs


def _interpreting() -> bool:
    try:
        from kernels.common.interpreter import active
    except ImportError:  # triton missing: nothing can be interpreted
        return False
    return active()


def collect(world_size: int = 1, knobs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Provenance of a run, as one flat dict (``knobs`` is a nested dict).

    Fields: git_sha, git_dirty, git_source, python/torch/triton/cuda versions,
    device_name, device_count, device_capability, sm_count, world_size,
    interpreter (TRITON_INTERPRET=1), knobs (TRITON_*, NCCL_*, CUDA_*, TORCH_*,
    NVSHMEM_*, PYTORCH_* environment variables plus ``knobs``), timestamp
    (UTC, ISO 8601) and hostname; inside a Slurm job also its job id, array job id and
    index, partition, node and GPUs (``slurm()``).
    """
    info: dict[str, Any] = {}
    info.update(git_info())
    info.update(versions())
    info.update(devices())
    info["world_size"] = int(world_size)
    info["interpreter"] = _interpreting()
    info["knobs"] = _knobs(knobs)
    info["timestamp"] = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
    try:
        info["hostname"] = socket.gethostname()
    except OSError:  # pragma: no cover
        info["hostname"] = "unknown"
    info.update(slurm())
    return info


def flat(info: Mapping[str, Any]) -> dict[str, Any]:
    """``collect()`` output with ``knobs`` as a JSON string (one table cell)."""
    out = dict(info)
    out["knobs"] = json.dumps(out.get("knobs", {}), sort_keys=True, default=str)
    return out


def columns(script: str, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """``prov_*`` columns for a results table: ``collect()`` flattened, plus ``prov_command``, the
    command that remakes it (``python3 <script>`` with argv, the process's own arguments if None)."""
    prov = {f"prov_{k}": v for k, v in flat(collect()).items()}
    prov["prov_command"] = " ".join(["python3", script, *(sys.argv[1:] if argv is None else argv)])
    return prov
