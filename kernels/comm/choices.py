"""The multi-GPU families' variant choice in the selection layer's tuning tables.

All-gather + GEMM (family ``ag_gemm``) and GEMM + all-scatter (``gemm_scatter``) choose a variant
per problem (world size, shape, dtype; the gather dim for ``ag_gemm``): one of our fused kernels,
our sequential path, NCCL + cuBLAS, or PyTorch's fused op. The measured choices live in the same
per-device JSON tables as every other family's (``kernels.common.tables``: the user's under
``$WORKBENCH_TUNING_DIR`` over the ones shipped in ``kernels/common/tables/<GPU>/<family>.json``),
one entry per measured problem, keyed ``world_size=2,gather_dim=0,M=...,N=...,K=...,dtype=bf16``,
with how it was measured. ``experiments/run_ag_gemm.py`` and ``experiments/run_gemm_scatter.py``
write them (``OUT/tables/``) from the fit half of their shape set.

A problem rarely has its own entry. Then the family's decision function asks this GPU's choice
model (``kernels.comm.choice_model``: every candidate's time predicted on the shape, fitted on
the runs' measurements), and only without one for the world size takes the entry of the nearest
measured problem (log M, N, K) of the same world size (and gather dim, dtype). It runs on rank 0
only and its result is shared (``kernels.comm.decide``), so ranks that read different tables (a
user's table on one node) still run the same variant.
"""
from __future__ import annotations

import datetime as _dt
import math
from pathlib import Path
from typing import Any, Callable, Mapping

from kernels.common import tables as _tables

DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32"}
MAX_FIELDS = 16


def dtype_name(dtype) -> str:
    """'bf16' for torch.bfloat16 (also given as its string), as the GEMM tables name dtypes."""
    return DTYPE_NAMES.get(str(dtype), str(dtype).replace("torch.", ""))


def key(problem: Mapping[str, Any]) -> str:
    """A problem's key in a table: ``name=value`` in the given order."""
    return ",".join(f"{k}={v}" for k, v in problem.items())


def parse_key(text: str) -> dict[str, Any]:
    """The fields of a key (integers where they are digits); ValueError if it is not one."""
    parts = text.split(",")
    if not 0 < len(parts) <= MAX_FIELDS:
        raise ValueError(f"not a problem key: {text[:80]!r}")
    out: dict[str, Any] = {}
    for part in parts:
        name, sep, value = part.partition("=")
        if not sep or not name:
            raise ValueError(f"not a problem key: {text[:80]!r}")
        out[name] = int(value) if value.isdigit() else value
    return out


def current_device() -> dict[str, str] | None:
    """{'name', 'capability'} of the current CUDA device (None without one)."""
    import torch

    if not torch.cuda.is_available():
        return None
    from kernels.common.select import device_of

    return device_of(torch.cuda.current_device())


def measured(family: str, device: Mapping[str, str] | None, tables: _tables.Tables | None = None) -> list[dict]:
    """Every usable entry of this device's tables for ``family`` as {fields..., 'entry', 'where'}:
    the user's first; an entry whose key does not parse is skipped and said once."""
    if device is None:
        return []
    from kernels.common import select

    tables = tables or select.TABLES
    out, seen = [], set()
    for where, k, entry in tables.all_entries(device, family):
        if k in seen:
            continue
        seen.add(k)
        try:
            fields = parse_key(k)
        except ValueError as exc:
            _tables.warn_once(where, f"{family} key", f"{family} table ({where}): {exc}; the entry is ignored")
            continue
        out.append({**fields, "entry": entry, "where": where})
    return out


def usable(family: str, make: Callable[[Mapping[str, Any]], Any], dtype=None,
           **match) -> tuple[list[dict], str]:
    """This GPU's entries of ``family`` whose fields equal ``match`` (a field given as None
    matches any) and, when ``dtype`` is given, of that dtype, as {fields..., 'config':
    make(entry's config)}; and where they come from ('' when none). An entry whose config
    ``make`` refuses (ValueError, TypeError, KeyError) is ignored and said once."""
    device = current_device()
    want = {k: v for k, v in match.items() if v is not None}
    rows = []
    for e in measured(family, device):
        if any(e.get(k) != v for k, v in want.items()):
            continue
        if dtype is not None and e.get("dtype", dtype_name(dtype)) != dtype_name(dtype):
            continue
        try:
            rows.append({**{k: v for k, v in e.items() if k not in ("entry", "where")},
                         "config": make(e["entry"]["config"])})
        except (KeyError, TypeError, ValueError) as exc:
            _tables.warn_once(e["where"], f"{family} entry", f"{family} tuning table ({e['where']}): an entry "
                                                             f"names a config that cannot run ({exc}); it is ignored")
    return rows, (f"tuning table ({device['name']})" if rows else "")


def nearest(entries: list[dict], M: int, N: int, K: int, **match) -> dict | None:
    """The entry nearest in log2 M, N, K among those whose fields equal ``match``."""
    same = [e for e in entries if all(e.get(k) == v for k, v in match.items())]
    if not same:
        return None
    return min(same, key=lambda e: sum(abs(math.log2(max(1, e[d])) - math.log2(max(1, v)))
                                       for d, v in (("M", M), ("N", N), ("K", K))))


def table_entry(method: str, config: Mapping[str, Any], ms: float, how: str, by: str,
                provenance: Mapping[str, Any] | None = None) -> dict:
    """A table entry for a measured choice: the method's name, its variant and config, its time."""
    prov = dict(provenance or {})
    return {"candidate": method, "variant": str(config.get("variant", method)), "config": dict(config),
            "us": round(1000.0 * float(ms), 3), "how": how, "by": by,
            "date": prov.get("date") or _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "git": prov.get("git"), "torch": prov.get("torch")}


def write(root: Path, device: Mapping[str, str], family: str, entries: Mapping[str, dict],
          triton_version: str | None = None) -> Path:
    """Merge ``entries`` into ``root/<device>/<family>.json`` (the layout the selection layer
    reads: copy it into ``kernels/common/tables/`` to ship it, or point
    ``$WORKBENCH_TUNING_DIR`` at ``root``)."""
    path = _tables.table_path(root, device, family)
    _tables.write_entries(path, _tables.header(device, family, triton_version), entries)
    return path


def device_of_rows(rows) -> dict[str, str] | None:
    """{'name', 'capability'} from a benchmark table's provenance columns (None when absent)."""
    if rows is None or not len(rows) or "device_name" not in rows:
        return None
    name = rows["device_name"].dropna()
    cap = rows["device_capability"].dropna() if "device_capability" in rows else []
    if not len(name):
        return None
    return {"name": str(name.iloc[0]), "capability": str(cap.iloc[0]) if len(cap) else "unknown"}
