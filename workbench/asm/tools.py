"""Finding and running CUDA's binary tools (cuobjdump, nvdisasm) offline.

The Triton wheel ships both under ``triton/backends/nvidia/bin``; this module
finds that folder with ``importlib.util.find_spec`` (without importing
triton), else looks on ``PATH`` and under ``$CUDA_HOME/bin``.  An explicit
``$TRITON_CUOBJDUMP_PATH`` / ``$TRITON_NVDISASM_PATH`` (the variables Triton
itself reads) wins over both.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

__all__ = [
    "ToolMissing",
    "ToolFailed",
    "find_tool",
    "run_tool",
    "sass_from_cubin",
    "sass_with_lines",
    "cubin_resource_usage",
    "parse_resource_usage",
]

TIMEOUT_S = 120


class ToolMissing(RuntimeError):
    """A CUDA binary tool (cuobjdump, nvdisasm) could not be found."""


class ToolFailed(RuntimeError):
    """A CUDA binary tool ran and failed (bad input file, most often)."""


def _env_var(name: str) -> str:
    return f"TRITON_{name.upper()}_PATH"


def _triton_bin() -> Path | None:
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    roots = list(spec.submodule_search_locations or [])
    if not roots and spec.origin:
        roots = [str(Path(spec.origin).parent)]
    for root in roots:
        d = Path(root) / "backends" / "nvidia" / "bin"
        if d.is_dir():
            return d
    return None


def _executable(p: Path) -> bool:
    return p.is_file() and os.access(p, os.X_OK)


def find_tool(name: str) -> str:
    """The path of CUDA tool ``name`` ('cuobjdump', 'nvdisasm', 'ptxas' ...).

    Looks at ``$TRITON_<NAME>_PATH``, then the Triton wheel's
    ``backends/nvidia/bin``, then ``PATH``, then ``$CUDA_HOME/bin``; raises
    ToolMissing saying where it looked and what to do.
    """
    looked: list[str] = []
    var = _env_var(name)
    override = os.environ.get(var)
    if override:
        p = Path(override)
        if _executable(p):
            return str(p)
        raise ToolMissing(
            f"{name}: ${var} is set to {override!r}, which is not an executable file; "
            f"point it at {name} or unset it"
        )
    looked.append(f"${var} (unset)")

    tb = _triton_bin()
    if tb is not None:
        p = tb / name
        if _executable(p):
            return str(p)
        looked.append(str(p))
    else:
        looked.append("the triton package (not installed)")

    hit = shutil.which(name)
    if hit:
        return hit
    looked.append("PATH")

    for var_home in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var_home)
        if home:
            p = Path(home) / "bin" / name
            if _executable(p):
                return str(p)
            looked.append(str(p))

    raise ToolMissing(
        f"{name} not found; looked in: {', '.join(looked)}. "
        f"Install the Triton wheel that ships it (pip install triton==3.6.0), "
        f"put CUDA's bin folder on PATH, or set ${var} to its path."
    )


def run_tool(name: str, args: list[str], timeout: float = TIMEOUT_S) -> str:
    """Run CUDA tool ``name`` with ``args``; its stdout, or ToolFailed with its stderr."""
    exe = find_tool(name)
    try:
        proc = subprocess.run(
            [exe, *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise ToolFailed(f"{name} {' '.join(args)} took longer than {timeout:.0f} s") from e
    except OSError as e:
        raise ToolFailed(f"could not run {exe}: {e}") from e
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip()
        raise ToolFailed(f"{name} {' '.join(args)} failed (exit {proc.returncode}): {msg}")
    return proc.stdout


def _check_cubin(cubin: Path) -> Path:
    cubin = Path(cubin)
    if not cubin.is_file():
        raise FileNotFoundError(f"cubin {cubin} does not exist")
    with cubin.open("rb") as f:
        head = f.read(4)
    if head != b"\x7fELF":
        raise ToolFailed(
            f"{cubin} is not a cubin (no ELF header; {cubin.stat().st_size} bytes): "
            "it may be truncated or corrupt; recompile the kernel or clear that cache entry"
        )
    return cubin


def sass_from_cubin(cubin: Path) -> str:
    """SASS text of a cubin (``cuobjdump -sass``, falling back to ``nvdisasm``)."""
    cubin = _check_cubin(cubin)
    try:
        text = run_tool("cuobjdump", ["-sass", str(cubin)])
    except ToolFailed as e:
        first = str(e)
        try:
            text = run_tool("nvdisasm", [str(cubin)])
        except ToolMissing:
            raise ToolFailed(
                f"cannot disassemble {cubin}: {first}; it may be truncated or corrupt"
            ) from e
        except ToolFailed as e2:
            raise ToolFailed(
                f"cannot disassemble {cubin}: {first}; nvdisasm: {e2}; "
                "the file may be truncated or corrupt"
            ) from e2
    if not text.strip():
        raise ToolFailed(f"cuobjdump -sass printed nothing for {cubin}; is it a CUDA cubin?")
    return text


def sass_with_lines(cubin: Path) -> str:
    """``nvdisasm -gi -c``: the cubin's code with its line table (``//## File "...", line N``) inline."""
    return run_tool("nvdisasm", ["-gi", "-c", str(_check_cubin(cubin))])


_FUNC = re.compile(r"^\s*Function\s+(\S+)\s*:\s*$")
_FIELD = re.compile(r"([A-Z]+)(?:\[(\d+)\])?:(\d+)")
_FIELD_NAMES = {
    "REG": "registers",
    "STACK": "stack",
    "SHARED": "shared",
    "LOCAL": "local",
    "TEXTURE": "texture",
    "SURFACE": "surface",
    "SAMPLER": "sampler",
    "GLOBAL": "global",
}


def parse_resource_usage(text: str) -> dict:
    """Parse ``cuobjdump -res-usage`` output.

    The first kernel's numbers are at the top level (``registers``, ``stack``,
    ``shared``, ``local``, ``constant`` (bank 0 bytes), ``constant_banks``,
    ``texture``, ``surface``, ``sampler``, ``function``); every kernel is also
    under ``functions`` by name.
    """
    functions: dict[str, dict] = {}
    current: str | None = None
    common: dict = {}
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            current = m.group(1)
            functions[current] = {}
            continue
        if line.strip() == "Common:":
            current = None
            continue
        fields = _FIELD.findall(line)
        if not fields:
            continue
        target = functions[current] if current is not None else common
        for key, bank, val in fields:
            if key == "CONSTANT":
                target.setdefault("constant_banks", {})[int(bank or 0)] = int(val)
            else:
                target[_FIELD_NAMES.get(key, key.lower())] = int(val)
    for d in functions.values():
        d["constant"] = d.get("constant_banks", {}).get(0, 0)
    out: dict = {}
    if functions:
        name, first = next(iter(functions.items()))
        out.update(first)
        out["function"] = name
    if "global" in common:
        out["global"] = common["global"]
    out["functions"] = functions
    return out


def cubin_resource_usage(cubin: Path) -> dict:
    """Resource usage of a cubin's kernel(s): registers, stack, shared, local, constant ...

    See parse_resource_usage() for the keys. Raises ToolMissing / ToolFailed.
    """
    cubin = _check_cubin(cubin)
    text = run_tool("cuobjdump", ["-res-usage", str(cubin)])
    out = parse_resource_usage(text)
    if not out.get("functions"):
        raise ToolFailed(f"cuobjdump -res-usage found no kernel in {cubin}")
    return out
