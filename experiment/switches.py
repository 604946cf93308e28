"""On/off switches read from the environment (the project's ``HETFL_*`` feature variables)."""

from __future__ import annotations

import os

#: Values that turn a switch off (case and surrounding spaces ignored).
OFF_VALUES = frozenset({"0", "false", "off", "no"})


def env_switch(name: str) -> bool:
    """Whether ``$name`` leaves its feature on: unset or any value but :data:`OFF_VALUES`."""
    return os.environ.get(name, "1").strip().lower() not in OFF_VALUES
