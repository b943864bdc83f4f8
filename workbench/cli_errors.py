"""How a `workbench` sub-command ends on an error: one line that says what to do, exit status 2.

A known error (the sub-command's own kinds) prints its message; anything else
prints its type too; the traceback only with WORKBENCH_DEBUG=1.
"""
from __future__ import annotations

import os
import sys


def run_command(func, args, known: tuple[type[BaseException], ...]) -> int:
    """``func(args)`` as a command's exit status (0 when it returns None)."""
    try:
        return func(args) or 0
    except known as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:   # `... | head`: the reader left, nothing is wrong
        return 0
    except Exception as exc:  # keep tracebacks away from users unless asked
        if os.environ.get("WORKBENCH_DEBUG", "0").lower() in ("1", "true", "yes", "on"):
            raise
        print(f"error: {type(exc).__name__}: {exc} (set WORKBENCH_DEBUG=1 for the traceback)", file=sys.stderr)
        return 2
