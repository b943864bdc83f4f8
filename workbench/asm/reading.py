"""Bounded reads of the files a Triton cache holds (or names).

A cache is input the inspector does not control: an entry may hold a
multi-gigabyte (sparse) `.ptx`, a FIFO or a device named `NAME.json`, a
symlink to somewhere else on the machine, or IR whose location info points
at `/dev/zero`. Every read goes through `read_bytes` / `read_text`, which
refuse (with `Refused`, an OSError, so callers report it as a problem of
that entry and go on):

- anything but a regular file (FIFOs, sockets, devices): checked on the
  opened descriptor, and the open itself cannot block on a FIFO;
- a path whose real location leaves `root` (the entry directory): a
  symlink out of the cache;
- a file larger than its cap, which is generous for real kernels.

Caps (bytes; measured with tests/hostile/measure_entries.py on the largest
kernels of this repository: llir 1.9 MB, cuobjdump SASS 0.54 MB, ptx
0.17 MB, metadata JSON 1.4 kB):

- stage files (IR, assembly, cubin, hsaco), disassembler output and the
  kernel's Python source: `max_file_bytes()`, 32 MiB by default, or
  `$WORKBENCH_ASM_MAX_FILE_MB`, or the `max_bytes` argument of
  `cache.list_entries` / `cache.read_entry`;
- metadata JSON: `MAX_JSON_BYTES` (1 MiB, at most the stage cap): JSON that
  is mostly brackets unfolds into some 20 bytes of objects per byte read;
- Python source named by the IR: `MAX_SOURCE_BYTES` (4 MiB, at most the
  stage cap), and only `.py` files.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["ENV_MAX_FILE_MB", "MAX_JSON_BYTES", "MAX_SOURCE_BYTES", "Refused", "check_file", "max_file_bytes",
           "kind_of", "read_bytes", "read_text", "inside"]

ENV_MAX_FILE_MB = "WORKBENCH_ASM_MAX_FILE_MB"
DEFAULT_MAX_FILE_BYTES = 32 << 20
MAX_JSON_BYTES = 1 << 20
MAX_SOURCE_BYTES = 4 << 20

_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFSOCK: "a socket", stat.S_IFCHR: "a character device",
          stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory", stat.S_IFLNK: "a symlink"}


class Refused(OSError):
    """A file the inspector will not read; the message says why and what to do."""


def positive_env(name: str, what: str) -> float | None:
    """The number in environment variable `name` (None when unset or empty); a ValueError
    saying what to give when it is not a number > 0."""
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1
    if not value > 0:
        raise ValueError(f"${name}={raw!r}: give {what} > 0, or unset it")
    return value


def max_file_bytes(explicit: int | None = None) -> int:
    """The cap on one stage file: `explicit`, else $WORKBENCH_ASM_MAX_FILE_MB, else 32 MiB."""
    if explicit is not None:
        return int(explicit)
    mb = positive_env(ENV_MAX_FILE_MB, "a size in MB (e.g. 64)")
    return DEFAULT_MAX_FILE_BYTES if mb is None else int(mb * (1 << 20))


def _mb(n: int) -> str:
    return f"{n / (1 << 20):.3g} MB"


def inside(path: str | os.PathLike, root: str | os.PathLike) -> bool:
    """True if `path`, symlinks resolved, lies under `root` (resolved too)."""
    real, top = os.path.realpath(path), os.path.realpath(root)
    return real == top or real.startswith(top.rstrip(os.sep) + os.sep)


def kind_of(mode: int) -> str:
    """'a FIFO', 'a socket', 'a character device'... for a stat mode."""
    return _KINDS.get(stat.S_IFMT(mode), "not a regular file")


_RAISE_CAP = f"if it is a real kernel, set ${ENV_MAX_FILE_MB} higher, else delete the entry"


def check_file(path: str | os.PathLike, limit: int, root: str | os.PathLike | None = None,
               hint: str = _RAISE_CAP) -> os.stat_result:
    """The stat of `path` if it may be read (regular, under `limit` bytes, inside `root`); else Refused.

    `hint`: what to do about a file over the cap.
    """
    path = Path(path)
    if root is not None and not inside(path, root):
        raise Refused(f"{path.name} is a symlink leading out of {Path(root).name} (to {os.path.realpath(path)}): "
                      "not read; delete it")
    st = path.stat()
    _check_stat(path, st, limit, hint)
    return st


def _check_stat(path: Path, st: os.stat_result, limit: int, hint: str = _RAISE_CAP) -> None:
    if not stat.S_ISREG(st.st_mode):
        raise Refused(f"{path.name} is {kind_of(st.st_mode)}, not a regular file: not read; delete it")
    if st.st_size > limit:
        raise Refused(f"{path.name} is {st.st_size:,} bytes, over the {_mb(limit)} read cap: not read; {hint}")


def read_bytes(path: str | os.PathLike, limit: int, root: str | os.PathLike | None = None,
               head: bool = False, hint: str = _RAISE_CAP) -> bytes:
    """At most `limit` bytes of a regular file inside `root`; Refused if it is larger (or not regular).

    `head`: return the first `limit` bytes of a larger file instead of refusing it.
    `hint`: what to do about a file over the cap.
    """
    path = Path(path)
    check_file(path, float("inf") if head else limit, root, hint)  # before open: opening a device can act
    # O_NONBLOCK: a FIFO swapped in after the check must not block the open.
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    with os.fdopen(fd, "rb") as fh:
        _check_stat(path, os.fstat(fd), float("inf") if head else limit, hint)  # the file actually opened
        data = fh.read(limit + (0 if head else 1))
    if len(data) > limit:  # it grew after the check
        raise Refused(f"{path.name} grew past the {_mb(limit)} read cap while being read: not read")
    return data


def read_text(path: str | os.PathLike, limit: int, root: str | os.PathLike | None = None,
              head: bool = False) -> str:
    return read_bytes(path, limit, root, head).decode("utf-8", errors="replace")
