"""``flwr run --run-config`` strings: ``k='v' k2=2`` pairs, from files and dicts, merged.

``flwr run`` parses one ``--run-config`` string as a TOML document (a repeated key is an
error) and takes either a TOML file or pairs, not both; the launcher and the experiment runner
build, read and merge such strings here.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from pathlib import Path


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        if "'" in value:
            raise ValueError(f"run-config string values may not contain a single quote: {value!r}")
        return f"'{value}'"
    raise ValueError(f"unsupported run-config value {value!r} (strings, numbers and booleans only)")


def config_file_overrides(path: Path) -> str:
    """A run-config TOML file (flat ``key = value`` lines) as ``k='v' k2=2`` overrides.

    ``flwr run`` takes either one TOML file or ``k=v`` pairs, not both; the launcher adds its
    own pairs (results folder, run name), so files are turned into pairs here.
    """
    with path.open("rb") as f:
        table = tomllib.load(f)
    nested = [k for k, v in table.items() if isinstance(v, dict)]
    if nested:
        raise ValueError(f"{path}: expected flat 'key = value' lines, got tables {nested}")
    return run_config_pairs(table)


def run_config_pairs(values: Mapping[str, object]) -> str:
    """``{key: value}`` as ``k='v' k2=2`` (the ``--run-config`` form; strings, numbers, booleans)."""
    return " ".join(f"{k}={_toml_value(v)}" for k, v in values.items())


#: ``key=value`` pairs as ``flwr run --run-config`` reads them (quoted values may hold spaces).
_PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")


def parse_pairs(text: str) -> dict[str, str]:
    """The ``key -> raw value`` pairs of a ``k=v`` run-config string (a later repeat of a key wins)."""
    return dict(_PAIR.findall(text))


def merge_overrides(*overrides: str) -> str:
    """Join ``k=v`` override strings; a later value of a key replaces an earlier one.

    (``flwr run`` parses one ``--run-config`` string as a TOML document, where a repeated
    key is an error.)
    """
    merged: dict[str, str] = {}
    for text in overrides:
        for key, value in _PAIR.findall(text):
            merged.pop(key, None)
            merged[key] = value
    return " ".join(f"{k}={v}" for k, v in merged.items())
