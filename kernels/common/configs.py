"""Turning what a caller passed as ``config`` into a family's config dataclass, and reading a
family's measured variant table (``{"entries": [...]}``) as the untrusted file it is."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Mapping


def config_of(config: Any, cls: type, who: str):
    """``config`` as a ``cls``: None stays None, an instance is itself, a mapping of its
    fields builds one. Anything else, or an unknown field, is a ValueError that starts
    with ``who`` and lists the known fields."""
    if config is None or isinstance(config, cls):
        return config
    if isinstance(config, Mapping):
        known = sorted(f.name for f in dataclasses.fields(cls))
        unknown = sorted(set(config) - set(known))
        if unknown:
            raise ValueError(f"{who}: unknown config field(s) {unknown}; known: {known}")
        return cls(**config)
    raise ValueError(f"{who}: config must be a {cls.__name__} or a dict of its fields, got {type(config).__name__}")


def table_entries(path: Path, max_bytes: int, what: str, rerun: str) -> list | None:
    """The ``entries`` list of a JSON table at ``path`` (None when absent), read bounded; a file too
    large, not JSON or without an entries list is a ValueError naming it, ``what`` it should be
    and the command (``rerun``) that makes it again."""
    path = Path(path)
    if not path.exists():
        return None
    with open(path, "rb") as fh:
        raw = fh.read(max_bytes + 1)
    if len(raw) > max_bytes:
        raise ValueError(f"{path}: larger than {max_bytes} bytes; not {what}")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"{path}: not valid JSON ({exc}); delete it or re-run {rerun}") from None
    entries = data.get("entries") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected {{'entries': [...]}}; re-run {rerun}")
    return entries
