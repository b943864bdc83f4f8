"""Resource use of a compiled kernel, read from its cache artefacts.

``resources(stages, metadata)`` returns a flat dict of what the artefacts
state, plus a ``problems`` list naming what could not be read (it never
raises for a missing tool or a bad file).

Keys, when known (absent otherwise):

common
    ``backend`` ('cuda' / 'hip'), ``arch`` ('sm_90', 'gfx942'), ``name``,
    ``num_warps``, ``warp_size``, ``threads_per_block``, ``shared_bytes``
    (Triton's shared memory / LDS per block, from the metadata),
    ``registers`` (per thread: NVIDIA registers, AMD arch VGPRs),
    ``occupancy`` (fraction of the hardware's maximum resident warps/waves),
    ``occupancy_limiter``, ``problems``.
NVIDIA (``cuobjdump -res-usage`` of the cubin)
    ``stack_bytes``, ``local_bytes`` (per thread; for Triton kernels this is
    spill space), ``static_shared_bytes`` (the cubin's own, including the
    1 KB the driver reserves on sm_80+), ``constant_bytes``;
    ``spill_stores`` / ``spill_loads`` (STL / LDL instructions) when a
    'sass' text is among the stages; ``blocks_per_sm`` and ``warps_per_sm``
    computed from registers, shared memory and num_warps.
AMD (the .amdgcn text: kernel-info comments and .amdgpu_metadata)
    ``vgprs``, ``agprs``, ``sgprs``, ``total_vgprs``, ``sgpr_spills``,
    ``vgpr_spills``, ``scratch_bytes``, ``lds_static_bytes``,
    ``waves_per_simd_compiler`` (the compiler's '; Occupancy:'),
    ``waves_per_simd`` (that, further limited by Triton's LDS use on CDNA).
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

from workbench.asm import isa as _isa
from workbench.asm import reading, tools

__all__ = ["resources", "nvidia_occupancy", "amd_kernel_info", "NV_LIMITS", "smem_per_block"]

# Per-SM limits by compute capability (CUDA occupancy rules).
NV_LIMITS = {
    80: dict(regs=65536, smem_sm=167936, smem_block=166912, warps=64, blocks=32),
    86: dict(regs=65536, smem_sm=102400, smem_block=101376, warps=48, blocks=16),
    89: dict(regs=65536, smem_sm=102400, smem_block=101376, warps=48, blocks=24),
    90: dict(regs=65536, smem_sm=233472, smem_block=232448, warps=64, blocks=32),
    100: dict(regs=65536, smem_sm=233472, smem_block=232448, warps=64, blocks=32),
}
_NV_REG_UNIT = 256  # registers are allocated per warp in units of 256
_NV_MAX_REGS = 255
_NV_SMEM_UNIT = 128
_NV_SMEM_RESERVED = 1024  # per block, sm_80 and later

# AMD CDNA: LDS bytes per CU, SIMDs per CU, max waves per SIMD.
_AMD_CDNA = {
    "gfx90a": (65536, 4, 8),
    "gfx940": (65536, 4, 8),
    "gfx941": (65536, 4, 8),
    "gfx942": (65536, 4, 8),
    "gfx950": (163840, 4, 8),
}


def _target(metadata: dict, stages: dict) -> tuple[str | None, object]:
    t = metadata.get("target")
    backend = arch = None
    if isinstance(t, dict):
        backend, arch = t.get("backend"), t.get("arch")
    elif isinstance(t, (list, tuple)) and len(t) >= 2:
        backend, arch = t[0], t[1]
    elif isinstance(t, str):
        # 'cuda:90', 'hip:gfx942'
        if ":" in t:
            backend, arch = t.split(":", 1)
    backend = backend or metadata.get("backend_name")
    if arch is None and metadata.get("arch") is not None:
        arch = metadata["arch"]
    if backend is None:
        if "cubin" in stages or "ptx" in stages:
            backend = "cuda"
        elif "amdgcn" in stages or "hsaco" in stages:
            backend = "hip"
    return backend, arch


def _cc(arch) -> int | None:
    """Compute capability as an int (90) from 90, '90', 'sm90', 'sm_90a'."""
    if isinstance(arch, int):
        return arch
    if isinstance(arch, str):
        m = re.search(r"(\d+)", arch)
        if m:
            return int(m.group(1))
    return None


def smem_per_block(arch=90) -> int:
    """Bytes of shared memory one block may use on an NVIDIA architecture
    (90, 'sm90', 'sm_90a' -> 232448, i.e. 227 KB); the limit a kernel's
    config must fit, from the same table as the occupancy rules (`NV_LIMITS`).
    """
    # 'gfx90a' holds digits too: without this it would read as sm_90
    cc = None if isinstance(arch, str) and arch.strip().lower().startswith("gfx") else _cc(arch)
    if cc not in NV_LIMITS:
        raise ValueError(f"no shared-memory limit known for {arch!r} (NVIDIA only; "
                         f"known: {', '.join(f'sm{c}' for c in NV_LIMITS)})")
    return NV_LIMITS[cc]["smem_block"]


def nvidia_occupancy(registers: int, shared_bytes: int, num_warps: int, cc: int = 90) -> dict:
    """Resident blocks and warps per SM for a kernel on compute capability ``cc``.

    Registers are rounded up per warp to 256, shared memory per block to 128
    bytes plus the 1 KB the driver reserves.  Returns ``blocks_per_sm``,
    ``warps_per_sm``, ``occupancy`` (warps / max warps) and
    ``occupancy_limiter`` ('registers', 'shared', 'warps' or 'blocks'; ties
    joined with '+').
    """
    lim = NV_LIMITS[cc]
    if num_warps <= 0:
        raise ValueError(f"num_warps must be positive, got {num_warps}")
    limits = {}
    if registers > _NV_MAX_REGS:
        limits["registers"] = 0
    elif registers > 0:
        per_warp = math.ceil(registers * 32 / _NV_REG_UNIT) * _NV_REG_UNIT
        limits["registers"] = (lim["regs"] // per_warp) // num_warps
    smem = math.ceil(max(shared_bytes, 0) / _NV_SMEM_UNIT) * _NV_SMEM_UNIT
    if smem > lim["smem_block"]:
        limits["shared"] = 0
    else:
        limits["shared"] = lim["smem_sm"] // (smem + _NV_SMEM_RESERVED)
    limits["warps"] = lim["warps"] // num_warps
    limits["blocks"] = lim["blocks"]
    blocks = min(limits.values())
    limiter = "+".join(k for k, v in limits.items() if v == blocks)
    warps = blocks * num_warps
    return {
        "blocks_per_sm": blocks,
        "warps_per_sm": warps,
        "occupancy": warps / lim["warps"],
        "occupancy_limiter": limiter,
    }


_AMD_COMMENTS = {
    "TotalNumSgprs": "sgprs",
    "NumSgprs": "sgprs",
    "NumVgprs": "vgprs",
    "NumAgprs": "agprs",
    "TotalNumVgprs": "total_vgprs",
    "ScratchSize": "scratch_bytes",
    "Occupancy": "waves_per_simd_compiler",
    "LDSByteSize": "lds_static_bytes",
}
_AMD_COMMENT_RE = re.compile(r"^\s*;\s*(" + "|".join(_AMD_COMMENTS) + r")\s*:\s*(\d+)", re.M)
_AMD_YAML = {
    ".sgpr_count": "sgprs",
    ".vgpr_count": "vgprs",
    ".agpr_count": "agprs",
    ".sgpr_spill_count": "sgpr_spills",
    ".vgpr_spill_count": "vgpr_spills",
    ".private_segment_fixed_size": "scratch_bytes",
    ".group_segment_fixed_size": "lds_static_bytes",
    ".wavefront_size": "wavefront_size",
}
_AMD_YAML_RE = re.compile(
    r"^[ \t-]*(" + "|".join(re.escape(k) for k in _AMD_YAML) + r"):\s*(\d+)\s*$", re.M
)


def amd_kernel_info(text: str) -> dict:
    """Register, spill, scratch, LDS and occupancy figures stated in an .amdgcn text.

    The '.amdgpu_metadata' YAML wins over the '; Kernel info' comments where
    both state a figure; for a text with several kernels the first one's
    figures are kept.
    """
    out: dict = {}
    for m in _AMD_COMMENT_RE.finditer(text):
        out.setdefault(_AMD_COMMENTS[m.group(1)], int(m.group(2)))
    seen: set = set()
    for m in _AMD_YAML_RE.finditer(text):
        key = _AMD_YAML[m.group(1)]
        if key not in seen:
            out[key] = int(m.group(2))
            seen.add(key)
    return out


def _read_text(path, what: str, problems: list, bounds: dict) -> str | None:
    """The file's text within `bounds` (reading caps and root); None, with a problem noted, if refused."""
    try:
        return reading.read_text(path, bounds["limit"], bounds["root"])
    except OSError as e:
        problems.append(f"cannot read the {what} {path}: {e if isinstance(e, reading.Refused) else e.strerror or e}")
        return None


def _nvidia(stages: dict, md: dict, out: dict, problems: list, cc: int | None, bounds: dict) -> None:
    cubin = stages.get("cubin")
    tool_missing = False
    if cubin is None:
        problems.append("no cubin among the stages: registers, stack and local memory unknown")
    else:
        try:
            ru = tools.cubin_resource_usage(Path(cubin), bounds["deadline"], bounds["limit"])
        except (tools.ToolMissing, tools.ToolFailed, OSError) as e:
            problems.append(f"registers unknown: {e}")
            tool_missing = isinstance(e, tools.ToolMissing)
        else:
            out["registers"] = ru.get("registers")
            for src, dst in (
                ("stack", "stack_bytes"),
                ("local", "local_bytes"),
                ("shared", "static_shared_bytes"),
                ("constant", "constant_bytes"),
            ):
                if src in ru:
                    out[dst] = ru[src]
    if out.get("registers") is None and isinstance(md.get("n_regs"), int):
        out["registers"] = md["n_regs"]
    if isinstance(md.get("n_spills"), int):
        out["spill_bytes"] = md["n_spills"]

    sass_path = stages.get("sass")
    text = None
    if sass_path is not None:
        text = _read_text(sass_path, "SASS text", problems, bounds)
    elif cubin is not None and not tool_missing:  # spills show in the machine code only: local loads/stores in SASS
        try:
            text = tools.sass_from_cubin(Path(cubin), bounds["deadline"], bounds["limit"])
        except (tools.ToolMissing, tools.ToolFailed, OSError) as e:
            problems.append(f"spills unknown: {e}")
    if text is not None:
        groups = _isa.tally(text, "sass")
        out["spill_stores"] = sum(
            sum(c.values()) for k, c in groups.items() if k[:3] == ("memory", "local", "store")
        )
        out["spill_loads"] = sum(
            sum(c.values()) for k, c in groups.items() if k[:3] == ("memory", "local", "load")
        )

    regs = out.get("registers")
    nw = out.get("num_warps")
    if cc is None:
        problems.append("occupancy unknown: no compute capability in the metadata")
    elif cc not in NV_LIMITS:
        problems.append(
            f"occupancy unknown: no limits for sm_{cc} (known: "
            + ", ".join(f"sm_{c}" for c in NV_LIMITS)
            + ")"
        )
    elif regs is None or not nw:
        if regs is not None:
            problems.append("occupancy unknown: num_warps missing from the metadata")
    else:
        occ = nvidia_occupancy(regs, int(out.get("shared_bytes") or 0), nw, cc)
        out.update(occ)
        if occ["blocks_per_sm"] == 0:
            problems.append(
                f"the kernel cannot launch on sm_{cc}: limited by {occ['occupancy_limiter']}"
            )


def _amd(stages: dict, out: dict, problems: list, arch, bounds: dict) -> None:
    path = stages.get("amdgcn")
    if path is None:
        problems.append("no .amdgcn text among the stages: registers and occupancy unknown")
        return
    text = _read_text(path, ".amdgcn text", problems, bounds)
    if text is None:
        return
    info = amd_kernel_info(text)
    if not info:
        problems.append(f"no register or occupancy figures found in {path}")
        return
    info.pop("wavefront_size", None)
    out.update(info)
    if "vgprs" in info:
        out["registers"] = info["vgprs"]
    occ = info.get("waves_per_simd_compiler")
    if occ is None:
        return
    waves = occ
    limiter = None
    cdna = _AMD_CDNA.get(str(arch)) if arch is not None else None
    max_waves = cdna[2] if cdna else (16 if str(arch).startswith(("gfx10", "gfx11", "gfx12")) else None)
    if max_waves and occ < max_waves:
        limiter = "registers"
    lds = out.get("shared_bytes")
    nw = out.get("num_warps")
    if cdna and lds and nw:
        lds_cu, simds, _ = cdna
        if lds > lds_cu:
            problems.append(f"the kernel asks {lds} bytes of LDS; {arch} has {lds_cu} per CU")
            waves, limiter = 0, "lds"
        else:
            by_lds = (lds_cu // lds) * nw / simds
            out["waves_per_simd_lds_limit"] = by_lds
            if by_lds < waves:
                waves, limiter = max(1, int(by_lds)), "lds"
    out["waves_per_simd"] = waves
    if max_waves:
        out["occupancy"] = waves / max_waves
    out["occupancy_limiter"] = limiter


def resources(stages: dict, metadata: dict, *, root=None, max_bytes: int | None = None, deadline=None) -> dict:
    """Resource use of one compiled kernel; see the module docstring for the keys.

    ``stages`` maps stage names ('ptx', 'cubin', 'amdgcn', 'hsaco', 'json',
    'sass' ...) to files; ``metadata`` is the entry's JSON dict (read from
    the 'json' stage when empty). Files are read within ``max_bytes`` each
    (default ``reading.max_file_bytes()``) and, given ``root``, only inside
    it; every tool run shares ``deadline`` (a ``tools.Deadline``).
    """
    problems: list[str] = []
    bounds = {"limit": reading.max_file_bytes(max_bytes), "root": root, "deadline": deadline or tools.Deadline()}
    stages = {k: Path(v) for k, v in (stages or {}).items() if v is not None}
    md = dict(metadata or {})
    if not md and "json" in stages:
        text = _read_text(stages["json"], "metadata", problems,
                          dict(bounds, limit=min(bounds["limit"], reading.MAX_JSON_BYTES)))
        if text is not None:
            try:
                loaded = json.loads(text)
                if not isinstance(loaded, dict):
                    raise ValueError("not a JSON object")
                md = loaded
            except (ValueError, RecursionError) as e:
                problems.append(f"bad metadata JSON {stages['json']}: {e}")
    backend, arch = _target(md, stages)
    out: dict = {"backend": backend}
    if backend == "cuda":
        cc = _cc(arch)
        out["arch"] = f"sm_{cc}" if cc is not None else None
    else:
        cc = None
        out["arch"] = arch
    if md.get("name"):
        out["name"] = md["name"]
    warp_size = md.get("warp_size")
    if warp_size is None and isinstance(md.get("target"), dict):
        warp_size = md["target"].get("warp_size")
    if isinstance(md.get("num_warps"), int):
        out["num_warps"] = md["num_warps"]
    if isinstance(warp_size, int):
        out["warp_size"] = warp_size
    if "num_warps" in out and "warp_size" in out:
        out["threads_per_block"] = out["num_warps"] * out["warp_size"]
    if isinstance(md.get("shared"), int):
        out["shared_bytes"] = md["shared"]
    for k in ("num_stages", "num_ctas"):
        if isinstance(md.get(k), int):
            out[k] = md[k]

    if backend == "cuda":
        _nvidia(stages, md, out, problems, cc, bounds)
    elif backend == "hip":
        _amd(stages, out, problems, arch, bounds)
    else:
        problems.append(
            "unknown backend: no target in the metadata and no cubin/amdgcn among the stages"
        )
    out["problems"] = problems
    return out
