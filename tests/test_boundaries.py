"""The packages' import boundaries (issue 20): the two apps meet only in messages.

``client/`` imports no strategy; ``models/`` imports no app and nothing above it; ``strategies/``
imports no app; ``experiment/`` (registry, protocol) imports neither app nor a strategy.  And the
record names of a message are written once, in :mod:`experiment.protocol`, not as bare strings.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: package -> top-level packages it must not import.
FORBIDDEN: dict[str, frozenset[str]] = {
    "client": frozenset({"server", "strategies", "deploy", "bench"}),
    "models": frozenset({"client", "server", "strategies", "experiment", "deploy", "bench"}),
    "strategies": frozenset({"client", "server", "deploy", "bench"}),
    "experiment": frozenset({"client", "server", "strategies", "deploy", "bench"}),
}

#: Imports allowed across a boundary (file, module), each with the reason; none left.
ALLOWED: frozenset[tuple[str, str]] = frozenset()

RECORD_NAMES = frozenset({"arrays", "config", "metrics", "profile", "catalog"})


def imports_of(path: Path) -> Iterator[str]:
    """Every module an ``import`` / ``from ... import`` of ``path`` names (absolute imports only)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            yield node.module


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_stay_inside_its_boundary(package: str) -> None:
    crossings = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for module in imports_of(path):
            if module.split(".")[0] in FORBIDDEN[package] and (rel, module) not in ALLOWED:
                crossings.append(f"{rel} imports {module}")
    assert not crossings, "\n".join(crossings)


def test_the_allowed_crossings_still_exist() -> None:
    """An allowance nobody needs any more is dropped (the boundary tightens as stages land)."""
    for rel, module in ALLOWED:
        assert module in set(imports_of(ROOT / rel)), f"{rel} no longer imports {module}: drop it from ALLOWED"


@pytest.mark.parametrize("package", ["client", "strategies"])
def test_record_names_are_not_written_as_bare_strings(package: str) -> None:
    """Record names come from :mod:`experiment.protocol`; a typo there is then one place to fix."""
    found = []
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Subscript)
                and isinstance(node.slice, ast.Constant)
                and node.slice.value in RECORD_NAMES
            ):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno} [{node.slice.value!r}]")
    assert not found, "\n".join(found)
