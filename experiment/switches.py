"""On/off switches read from the environment (the project's ``HETFL_*`` feature variables)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

NumberT = TypeVar("NumberT", int, float)

#: Values that turn a switch off (case and surrounding spaces ignored).
OFF_VALUES = frozenset({"0", "false", "off", "no"})


def env_switch(name: str) -> bool:
    """Whether ``$name`` leaves its feature on: unset or any value but :data:`OFF_VALUES`."""
    return os.environ.get(name, "1").strip().lower() not in OFF_VALUES


def env_positive(name: str, default: NumberT, parse: Callable[[str], NumberT], expected: str) -> NumberT:
    """``$name`` parsed by ``parse`` if set and > 0, ``default`` if unset or blank.

    Raises
    ------
    ValueError
        Naming the variable, its value and ``expected`` (what it should be) otherwise.

    """
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected {expected}") from None
    if not value > 0:
        raise ValueError(f"{name}={raw!r}: expected {expected}")
    return value
