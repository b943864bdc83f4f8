"""The program `workbench profile run` starts under ncu: run a script, or call one of its functions.

    python -m workbench.profile.target SCRIPT.py[:FN] [-- ARGS ...]
    python -m workbench.profile.target package.module[:FN] [-- ARGS ...]

With FN, the script (or module) is imported and ``FN()`` called with no
arguments; without, it runs as ``__main__`` with ARGS as its ``sys.argv[1:]``.
The current directory and the repository are on ``sys.path`` (a script of
``experiments/`` imports ``kernels``). At the end the GPU is synchronized, so
every launch the program made has finished before ncu writes its report.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import runpy
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


class TargetError(Exception):
    """The target cannot be found or called; the message says what to give instead."""


def split(spec: str) -> tuple[str, str | None, bool]:
    """'dir/x.py:fn' -> ('dir/x.py', 'fn', True); 'pkg.mod:fn' -> ('pkg.mod', 'fn', False)."""
    where, sep, fn = spec.rpartition(":")
    if not sep or not fn.isidentifier():
        where, fn = spec, None
    is_file = where.endswith(".py") or os.sep in where or "/" in where
    if not where:
        raise TargetError(f"{spec!r}: give SCRIPT.py, SCRIPT.py:FUNCTION or package.module:FUNCTION")
    if is_file and not Path(where).is_file():
        raise TargetError(f"{where}: no such script")
    if not is_file and not all(part.isidentifier() for part in where.split(".")):
        raise TargetError(f"{where!r} is neither a .py file nor a module name")
    return where, fn, is_file


def run(spec: str, args: list[str]) -> None:
    where, fn, is_file = split(spec)
    for p in (str(REPO), os.getcwd()):
        if p not in sys.path:
            sys.path.insert(0, p)
    sys.argv = [where, *args]
    if fn is None:
        if is_file:
            sys.path.insert(0, str(Path(where).resolve().parent))
            runpy.run_path(where, run_name="__main__")
        else:
            runpy.run_module(where, run_name="__main__", alter_sys=True)
    else:
        if is_file:
            path = Path(where).resolve()
            sys.path.insert(0, str(path.parent))
            spec_ = importlib.util.spec_from_file_location(f"_profiled_{path.stem}", path)
            module = importlib.util.module_from_spec(spec_)
            sys.modules[spec_.name] = module
            spec_.loader.exec_module(module)
        else:
            module = importlib.import_module(where)
        func = getattr(module, fn, None)
        if not callable(func):
            names = sorted(n for n in dir(module) if not n.startswith("__") and callable(getattr(module, n)))
            raise TargetError(f"{where} has no function {fn!r} (it has: {', '.join(names[:20])})")
        func()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    spec, rest = argv[0], argv[1:]
    if rest[:1] == ["--"]:
        rest = rest[1:]
    try:
        run(spec, rest)
    except TargetError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
