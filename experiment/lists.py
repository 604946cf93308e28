"""The run config's list values: ``"a:b:c"`` (or comma-separated) strings, one item per tier."""

from __future__ import annotations


def split_list(value: str, what: str) -> list[str]:
    """Split ``"a:b:c"`` (or comma-separated) into stripped, non-empty items; ``ValueError`` naming ``what``."""
    sep = ":" if ":" in value else ","
    items = [x.strip() for x in value.split(sep)]
    if not items or any(not x for x in items):
        raise ValueError(f"{what} must be a ':'-separated list, got {value!r}")
    return items
