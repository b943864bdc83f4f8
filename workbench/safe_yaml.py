"""Reading YAML that people share (experiment specs, report parameters) within bounds.

``yaml.safe_load`` builds only plain data (no Python objects), but neither the
file nor what it unfolds into is bounded: a spec can be a multi-gigabyte (or
endless: a FIFO, /dev/zero) file, and YAML aliases let a few hundred bytes
stand for billions of values (``a: &a [x, x]``, ``b: &b [*a, *a]``...) that
any later ``repr`` or loop would expand; merge keys (``<<: *a``) are copied
while loading, so a chain of them costs memory quadratic in the file size.
Here the file is read only when it is a regular file of at most
``MAX_FILE_BYTES``, and the document is refused when, aliases and merges
unfolded, it holds more than ``MAX_NODES`` values or ``MAX_CHARS`` characters
of text (a recursive alias exceeds both). That is counted on the parsed node
graph, before any Python value is built from it.
"""
from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

__all__ = ["MAX_CHARS", "MAX_FILE_BYTES", "MAX_NODES", "YamlError", "load_file", "load_text", "read_file"]

MAX_FILE_BYTES = 256 << 10  # 256 KiB: the largest spec in experiments/ is 7 kB; parsing 1 MB takes seconds
MAX_NODES = 200_000  # values (scalars, lists, mappings), aliases unfolded
MAX_CHARS = 4 << 20  # characters of text (keys and values), aliases unfolded


class YamlError(ValueError):
    """A YAML input refused or unreadable; the message names it and says why."""


def read_file(path: str | os.PathLike, max_bytes: int = MAX_FILE_BYTES) -> str:
    """The text of ``path`` if it is a regular file of at most ``max_bytes`` (YamlError otherwise)."""
    path = Path(path)
    try:
        # O_NONBLOCK: opening a FIFO must not wait for a writer; fstat then tells what it is.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise YamlError(f"{path}: cannot open ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as fh:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise YamlError(f"{path}: not a regular file (a device, FIFO or socket); give a YAML file")
        if st.st_size > max_bytes:
            raise YamlError(f"{path}: {st.st_size:,} bytes; at most {max_bytes:,} are read (is it the right file?)")
        data = fh.read(max_bytes + 1)
    if len(data) > max_bytes:  # grew while we read
        raise YamlError(f"{path}: larger than {max_bytes:,} bytes; at most that is read")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise YamlError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def load_text(text: str, where: str = "<text>") -> Any:
    """``yaml.safe_load(text)``, refused when its aliases unfold past the bounds."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)(text)  # libyaml's parser where present: 3x faster
    try:
        node = loader.get_single_node()  # the node graph: aliases are shared nodes, merges not yet copied
        if node is None:
            return None
        check_size(node, where)
        return loader.construct_document(node)
    except yaml.YAMLError as exc:
        if "maximum nesting depth" in str(exc):  # libyaml's own limit
            raise YamlError(f"{where}: nested too deeply") from None
        raise YamlError(f"{where}: not valid YAML: {exc}") from None
    except RecursionError:
        raise YamlError(f"{where}: nested too deeply") from None
    finally:
        loader.dispose()


def load_file(path: str | os.PathLike, max_bytes: int = MAX_FILE_BYTES) -> Any:
    return load_text(read_file(path, max_bytes), str(path))


def check_size(data: Any, where: str = "<text>", max_nodes: int = MAX_NODES, max_chars: int = MAX_CHARS) -> None:
    """YamlError if ``data`` (a YAML node graph, or Python values), shared parts counted
    each time they appear, is too large."""
    import yaml

    nodes, chars = 0, 0
    stack = [data]
    while stack:  # iterative: a deep or recursive document cannot exhaust the C stack
        x = stack.pop()
        nodes += 1
        if isinstance(x, yaml.Node):
            x = x.value  # scalar: text; sequence: nodes; mapping: (key, value) node pairs
        if isinstance(x, (str, bytes)):
            chars += len(x)
        elif isinstance(x, dict):
            stack.extend(x.keys())
            stack.extend(x.values())
        elif isinstance(x, (list, tuple, set)):
            stack.extend(x)
        if nodes > max_nodes or chars > max_chars:
            raise YamlError(f"{where}: too large once its aliases (*name) are unfolded (more than "
                            f"{max_nodes:,} values or {max_chars:,} characters); write the values out, "
                            "or split the document")
