"""Run a piece of Python in a child process that may crash or hang (a kernel with
a synchronisation bug never returns), and keep what it reported before that.

The child prints one JSON object per line for each thing it finished; lines
that are not JSON objects are ignored. The parent gets those records, whether
the child hung (killed at the timeout) and, if it failed, the end of its stderr.
TRITON_INTERPRET is removed from the child's environment: the child is there to
run compiled kernels.
"""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys


@dataclasses.dataclass
class ChildResult:
    records: list[dict]
    hung: bool = False
    error: str | None = None   # "child exited N: <stderr tail>", or None


def _text(x) -> str:
    return x.decode(errors="replace") if isinstance(x, bytes) else (x or "")


def run_records(code: str, args: list[str], timeout_s: float, cwd=None) -> ChildResult:
    """``python -c code *args`` with a timeout; the JSON-object lines it printed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = ChildResult(records=[])
    try:
        proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env,
                              timeout=timeout_s, cwd=cwd)
        stdout = proc.stdout
        if proc.returncode != 0:
            res.error = f"child exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
    except subprocess.TimeoutExpired as exc:
        stdout = _text(exc.stdout)
        res.hung = True
    for line in stdout.splitlines():
        if line.startswith("{"):
            try:
                res.records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return res
