"""Finding and running CUDA's binary tools (cuobjdump, nvdisasm) offline.

The Triton wheel ships both under ``triton/backends/nvidia/bin``; this module
finds that folder with ``importlib.util.find_spec`` (without importing
triton), else looks on ``PATH`` and under ``$CUDA_HOME/bin``.  An explicit
``$TRITON_CUOBJDUMP_PATH`` / ``$TRITON_NVDISASM_PATH`` (the variables Triton
itself reads) wins over both.

A cubin in the cache is untrusted input, and a tool can hang on one (or be a
broken install that never returns): every tool run of one entry shares one
`Deadline` (``$WORKBENCH_ASM_TOOL_TIMEOUT_S``, 20 s by default), the tool runs
in its own process group (killed whole when time is up), and its output goes
to a temporary file: past the stage-file read cap, the tool is killed.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from . import reading

__all__ = [
    "Deadline",
    "ToolMissing",
    "ToolFailed",
    "ToolTimeout",
    "find_tool",
    "run_tool",
    "sass_from_cubin",
    "sass_with_lines",
    "cubin_resource_usage",
    "parse_resource_usage",
]

ENV_TIMEOUT = "WORKBENCH_ASM_TOOL_TIMEOUT_S"
TIMEOUT_S = 20.0  # one entry's tool runs together; the largest real cubin disassembles in well under 1 s


def tool_timeout() -> float:
    """Seconds all tool runs of one entry may take: $WORKBENCH_ASM_TOOL_TIMEOUT_S, else 20."""
    value = reading.positive_env(ENV_TIMEOUT, "a number of seconds")
    return TIMEOUT_S if value is None else value


class Deadline:
    """One time budget shared by several tool runs (those of one cache entry)."""

    def __init__(self, seconds: float | None = None):
        self.seconds = tool_timeout() if seconds is None else float(seconds)
        self.end = time.monotonic() + self.seconds

    def left(self) -> float:
        return max(0.0, self.end - time.monotonic())

    def expired_message(self, what: str) -> str:
        return (f"{what} did not finish within the {self.seconds:g} s allowed for one entry's tools "
                f"(${ENV_TIMEOUT}): the cubin may be damaged, or the tool stuck; re-compile the entry, "
                "check the tool on a healthy cubin, or raise the limit for a very large kernel")


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


class ToolTimeout(ToolFailed):
    """The entry's tool deadline passed; no other tool is tried."""


def run_tool(name: str, args: list[str], timeout: float | None = None, *, deadline: Deadline | None = None,
             max_output: int | None = None) -> str:
    """Run CUDA tool ``name`` with ``args``; its stdout, or ToolFailed with its stderr.

    The run ends at ``deadline`` (else after ``timeout`` s, else the default);
    its output beyond ``max_output`` bytes (default: the stage-file read cap)
    makes it fail.
    """
    exe = find_tool(name)
    deadline = deadline or Deadline(timeout)
    what = f"{name} {' '.join(args)}"
    if deadline.left() <= 0:
        raise ToolTimeout(deadline.expired_message(what))
    limit = reading.max_file_bytes(max_output)
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            # Own session: a stuck tool and anything it started are killed together.
            proc = subprocess.Popen([exe, *args], stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                    start_new_session=True)
        except OSError as e:
            raise ToolFailed(f"could not run {exe}: {e}") from e
        code = _wait(proc, deadline, out, limit, what)
        out_text = _read_capped(out, limit, what)
        err_text = _read_capped(err, 64 << 10, what, clip=True)
    if code != 0:
        msg = (err_text or out_text[:4000]).strip()
        raise ToolFailed(f"{what} failed (exit {code}): {msg}")
    return out_text


def _wait(proc: subprocess.Popen, deadline: Deadline, out, limit: int, what: str) -> int:
    """The tool's exit status; killed (ToolFailed) past the deadline or once its output passes `limit`."""
    pause = 0.002
    while True:
        try:
            return proc.wait(timeout=min(pause, deadline.left()))
        except subprocess.TimeoutExpired:
            pass
        if os.fstat(out.fileno()).st_size > limit:
            _kill_group(proc)
            raise ToolFailed(f"{what} wrote more than {limit:,} bytes (the read cap, ${reading.ENV_MAX_FILE_MB}); "
                             "the cubin may be damaged")
        if deadline.left() <= 0:
            _kill_group(proc)
            raise ToolTimeout(deadline.expired_message(what))
        pause = min(pause * 2, 0.05)  # a healthy run ends in about 0.1 s: look often at first


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()
    proc.wait()


def _read_capped(fh, limit: int, what: str, clip: bool = False) -> str:
    size = os.fstat(fh.fileno()).st_size
    if size > limit and not clip:
        raise ToolFailed(f"{what} wrote more than {limit:,} bytes (the read cap, ${reading.ENV_MAX_FILE_MB}); "
                         "the cubin may be damaged")
    fh.seek(0)
    return fh.read(limit).decode("utf-8", errors="replace")


def _check_cubin(cubin: Path, max_bytes: int | None = None) -> Path:
    """`cubin` if it is a regular file under the read cap that starts like an ELF file."""
    cubin = Path(cubin)
    if not cubin.exists():
        raise FileNotFoundError(f"cubin {cubin} does not exist")
    reading.check_file(cubin, reading.max_file_bytes(max_bytes))  # Refused: a FIFO, device, huge file
    head = reading.read_bytes(cubin, 4, head=True)
    if head != b"\x7fELF":
        raise ToolFailed(
            f"{cubin} is not a cubin (no ELF header; {cubin.stat().st_size} bytes): "
            "it may be truncated or corrupt; recompile the kernel or clear that cache entry"
        )
    return cubin


def sass_from_cubin(cubin: Path, deadline: Deadline | None = None, max_output: int | None = None) -> str:
    """SASS text of a cubin (``cuobjdump -sass``, falling back to ``nvdisasm``).

    Both runs share ``deadline`` (a fresh one if None); past it, ToolTimeout.
    """
    cubin = _check_cubin(cubin, max_output)
    deadline = deadline or Deadline()
    try:
        text = run_tool("cuobjdump", ["-sass", str(cubin)], deadline=deadline, max_output=max_output)
    except ToolTimeout:
        raise
    except ToolFailed as e:
        first = str(e)
        try:
            text = run_tool("nvdisasm", [str(cubin)], deadline=deadline, max_output=max_output)
        except ToolTimeout:
            raise
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


def cubin_resource_usage(cubin: Path, deadline: Deadline | None = None, max_output: int | None = None) -> dict:
    """Resource usage of a cubin's kernel(s): registers, stack, shared, local, constant ...

    See parse_resource_usage() for the keys. Raises ToolMissing / ToolFailed.
    """
    cubin = _check_cubin(cubin, max_output)
    text = run_tool("cuobjdump", ["-res-usage", str(cubin)], deadline=deadline, max_output=max_output)
    out = parse_resource_usage(text)
    if not out.get("functions"):
        raise ToolFailed(f"cuobjdump -res-usage found no kernel in {cubin}")
    return out
