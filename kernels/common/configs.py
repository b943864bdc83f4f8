"""Turning what a caller passed as ``config`` into a family's config dataclass."""
from __future__ import annotations

import dataclasses
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
