"""Per-device tuning tables: plain JSON files of measured choices, one per (device, family).

A table names the GPU model, its compute capability and the Triton version it was measured
with, and maps problem keys (a family's canonical string of shape, dtype and layout) to the
candidate that won there, with how it was measured::

    {"format": "kernel-workbench tuning table", "version": 1,
     "device": "NVIDIA H200", "capability": "9.0", "triton": "3.6.0", "family": "gemm",
     "entries": {"M=4096,N=4096,K=4096,dtype=bf16,...": {
         "candidate": "t128x256", "variant": "persistent", "config": {...},
         "us": 123.4, "cold": "gl_pp", "cold_us": 131.0, "timed": 9,
         "how": "eager, L2 flushed, median", "date": "...", "git": "...", "torch": "...",
         "by": "workbench tune"}}}

Where tables live: shipped with the package under ``kernels/common/tables/<device>/<family>.json``,
and a user's own under ``$WORKBENCH_TUNING_DIR`` (default ``$XDG_CACHE_HOME/kernel-workbench/tuning``,
else ``~/.cache/kernel-workbench/tuning``), same layout; a user's entry wins over a shipped one.

A table file is untrusted input: it is read bounded (``MAX_TABLE_BYTES``), parsed as JSON
only, and a file that is corrupt, truncated, too large, or made for another device or Triton
version is ignored with one warning (per file and reason) naming it and what to do. Entries
are checked for shape here; whether an entry's config can run is the selection layer's
question (``kernels.common.select``). Writes merge one entry into the file under an exclusive
lock and replace the file atomically, so several processes tuning at once lose no entry and
no reader sees a torn file; a directory that cannot be written is said once, and the entry
is kept for this process.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Any, Iterator, Mapping

FORMAT = "kernel-workbench tuning table"
VERSION = 1
MAX_TABLE_BYTES = 4 << 20     # a table of 10,000 entries is about 5 MB less than this; bigger is not ours
MAX_ENTRIES = 20000
MAX_KEY_CHARS = 512
SHIPPED_ROOT = Path(__file__).resolve().parent / "tables"
ENTRY_FIELDS = ("candidate", "variant", "config")


class TuningTableWarning(UserWarning):
    """A table file was ignored (or could not be written); the message says which and why."""


_said: set[tuple[str, str]] = set()
_lock = threading.Lock()


def warn_once(path: Path | str, reason: str, message: str) -> None:
    """One warning per (file, reason) for the life of the process."""
    key = (str(path), reason)
    with _lock:
        if key in _said:
            return
        _said.add(key)
    warnings.warn(message, TuningTableWarning, stacklevel=3)


# --------------------------------------------------------------------------
# Devices and places
# --------------------------------------------------------------------------
def device_slug(name: str) -> str:
    """A file-system name for a device model: 'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug[:80] or "unknown"


def user_root() -> Path:
    """Where this user's tables are written (``$WORKBENCH_TUNING_DIR`` wins)."""
    explicit = os.environ.get("WORKBENCH_TUNING_DIR", "").strip()
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kernel-workbench" / "tuning"


def table_path(root: Path, device: Mapping[str, str], family: str) -> Path:
    return Path(root) / device_slug(device["name"]) / f"{family}.json"


def header(device: Mapping[str, str], family: str, triton_version: str | None = None) -> dict:
    if triton_version is None:
        import triton

        triton_version = triton.__version__
    return {"format": FORMAT, "version": VERSION, "device": str(device["name"]),
            "capability": str(device["capability"]), "triton": str(triton_version), "family": family}


# --------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------
def read(path: Path, expect: Mapping[str, str] | None = None) -> dict[str, dict]:
    """The entries of one table file ({} when absent or ignored). ``expect``: the header a
    usable table must carry (device, capability, triton, family); a mismatch is ignored with
    one warning. Malformed entries are dropped, each file's drops said once."""
    path = Path(path)
    try:
        if not path.is_file():
            return {}
        with open(path, "rb") as fh:
            raw = fh.read(MAX_TABLE_BYTES + 1)
    except OSError as exc:
        warn_once(path, "unreadable", f"tuning table {path}: cannot be read ({exc}); ignored")
        return {}
    if len(raw) > MAX_TABLE_BYTES:
        warn_once(path, "size", f"tuning table {path}: larger than {MAX_TABLE_BYTES} bytes, not a table this "
                                f"project writes; ignored (delete it, or re-run `workbench tune`)")
        return {}
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:   # RecursionError: nested too deeply
        warn_once(path, "json", f"tuning table {path}: not valid JSON ({exc}), perhaps truncated; ignored "
                                f"(delete it, or re-run `workbench tune`)")
        return {}
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or not isinstance(doc.get("entries"), dict):
        warn_once(path, "format", f"tuning table {path}: not a '{FORMAT}' (no format field or no entries); ignored")
        return {}
    if doc.get("version") != VERSION:
        warn_once(path, "version", f"tuning table {path}: format version {doc.get('version')!r}, this code reads "
                                   f"{VERSION}; ignored (re-run `workbench tune`)")
        return {}
    for field, want in (expect or {}).items():
        if str(doc.get(field)) != str(want):
            warn_once(path, f"{field}", f"tuning table {path}: made for {field} {doc.get(field)!r}, this process "
                                        f"has {want!r}; ignored (tables are per device model, compute capability "
                                        f"and Triton version: `workbench tune` makes one for this one)")
            return {}
    entries = doc["entries"]
    good = {k: v for k, v in list(entries.items())[:MAX_ENTRIES] if _entry_ok(k, v)}
    dropped = len(entries) - len(good)
    if dropped:
        warn_once(path, "entries", f"tuning table {path}: {dropped} malformed or excess entr"
                                   f"{'y' if dropped == 1 else 'ies'} ignored (each needs a key of at most "
                                   f"{MAX_KEY_CHARS} characters and {', '.join(ENTRY_FIELDS)})")
    return good


def _entry_ok(key: Any, entry: Any) -> bool:
    return (isinstance(key, str) and 0 < len(key) <= MAX_KEY_CHARS and isinstance(entry, dict)
            and isinstance(entry.get("candidate"), str) and isinstance(entry.get("variant"), str)
            and isinstance(entry.get("config"), dict))


class Tables:
    """The tables one process consults: a user root over the shipped root, re-read when a
    file changes (size or modification time), plus entries tuned in this process that could
    not be saved."""

    def __init__(self, user: Path | None = None, shipped: Path | None = None):
        self._user = user
        self._shipped = shipped
        self._files: dict[Path, tuple[tuple[int, int], dict]] = {}
        self._unsaved: dict[tuple[str, str, str], dict] = {}

    @property
    def user(self) -> Path:
        return self._user if self._user is not None else user_root()

    @property
    def shipped(self) -> Path:
        return self._shipped if self._shipped is not None else SHIPPED_ROOT

    def _entries(self, path: Path, expect: Mapping[str, str]) -> dict[str, dict]:
        try:
            st = path.stat()
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            return {}
        hit = self._files.get(path)
        if hit is None or hit[0] != stamp:
            hit = self._files[path] = (stamp, read(path, expect))
        return hit[1]

    def lookup(self, device: Mapping[str, str], family: str, key: str) -> tuple[dict | None, str]:
        """(entry, where) for a problem key: this process's unsaved tuning, the user's table,
        then the shipped one; (None, '') when none has it."""
        hit = self._unsaved.get((device_slug(device["name"]), family, key))
        if hit is not None:
            return hit, "tuned in this process (not saved)"
        expect = header(device, family)
        expect = {k: expect[k] for k in ("device", "capability", "triton", "family")}
        for where, root in (("user table", self.user), ("shipped table", self.shipped)):
            path = table_path(root, device, family)
            entry = self._entries(path, expect).get(key)
            if entry is not None:
                return entry, f"{where} {path}"
        return None, ""

    def all_entries(self, device: Mapping[str, str], family: str) -> Iterator[tuple[str, str, dict]]:
        """(where, key, entry) of every usable entry for this device and family, user's first."""
        expect = header(device, family)
        expect = {k: expect[k] for k in ("device", "capability", "triton", "family")}
        for where, root in (("user", self.user), ("shipped", self.shipped)):
            for key, entry in self._entries(table_path(root, device, family), expect).items():
                yield where, key, entry

    def save(self, device: Mapping[str, str], family: str, key: str, entry: dict,
             root: Path | None = None) -> Path | None:
        """Merge one entry into the table under ``root`` (default: the user's); the path, or
        None when it could not be written (said once; the entry then serves this process)."""
        path = table_path(root if root is not None else self.user, device, family)
        try:
            write_entry(path, header(device, family), key, entry)
        except OSError as exc:
            self._unsaved[(device_slug(device["name"]), family, key)] = entry
            warn_once(path, "write", f"tuning result for {family} could not be saved to {path} ({exc}); it is used "
                                     f"in this process only. Set WORKBENCH_TUNING_DIR to a writable directory to "
                                     f"keep tuning results")
            return None
        self._files.pop(path, None)
        return path


# --------------------------------------------------------------------------
# Writing: merge under a lock, replace atomically
# --------------------------------------------------------------------------
@contextlib.contextmanager
def _locked(path: Path):
    """An exclusive advisory lock on ``path``'s sibling ``.lock`` file (fcntl; a no-op
    where fcntl does not exist)."""
    lock_path = path.with_name(path.name + ".lock")
    fh = open(lock_path, "a+b")
    try:
        try:
            import fcntl

            fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        except ImportError:  # pragma: no cover - not POSIX
            pass
        yield
    finally:
        fh.close()   # closing releases the lock


def write_entries(path: Path, head: Mapping[str, Any], entries: Mapping[str, dict]) -> None:
    """Merge ``entries`` into the table at ``path`` (created with ``head`` when absent or
    unusable) under the lock, replacing the file atomically. Raises OSError."""
    for key, entry in entries.items():
        if not _entry_ok(key, entry):
            raise ValueError(f"tuning table entry {key!r} needs {', '.join(ENTRY_FIELDS)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _locked(path):
        expect = {k: head[k] for k in ("device", "capability", "triton", "family")}
        with warnings.catch_warnings():   # an unusable file being replaced is no news
            warnings.simplefilter("ignore", TuningTableWarning)
            current = read(path, expect)
        doc = {**head, "entries": {**current, **entries}}
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
        try:
            os.chmod(tmp, 0o644)   # mkstemp makes it private; a table is read by whoever shares the directory
            with os.fdopen(fd, "w") as fh:
                json.dump(doc, fh, indent=1, sort_keys=True)
                fh.write("\n")
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise


def write_entry(path: Path, head: Mapping[str, Any], key: str, entry: dict) -> None:
    write_entries(path, head, {key: entry})
