"""A suite's parts: named groups of its rows, each run in one call (``--part NAME``).

A suite whose rows together exceed a cpu preset's 2-hour budget declares ``[parts.<name>]`` tables
(``rows``: the labels of one or two claims' rows; ``notes``: the claims and the part's wall time),
and that preset sets ``in-parts = true`` (:mod:`deploy.experiments`).
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass


class SuiteError(ValueError):
    """A suite file is malformed (the message names the file and the key)."""


@dataclass(frozen=True)
class Part:
    """A named group of a suite's rows, run in one call (``--part NAME``).

    Parameters
    ----------
    name : str
        The part's name (the key of ``[parts.<name>]``).
    rows : tuple[str, ...]
        Labels of the suite's rows it runs (parts may share rows: a row already finished under
        the same results folder is skipped, so each row runs once).
    notes : str
        Which claims the part measures and its wall time on the cpu preset.

    """

    name: str
    rows: tuple[str, ...]
    notes: str = ""


def parse_parts(raw_parts: object, where: str, labels: Sequence[str], controls: Set[str]) -> dict[str, Part]:
    """``[parts.<name>]`` tables (``rows``: labels of the suite's runs; ``notes``) as :class:`Part`.

    ``labels`` are the suite's row labels in order, ``controls`` those of its control rows.

    Raises
    ------
    SuiteError
        On a malformed part, a label that is no row of the suite, or a row that is not a control
        and belongs to no part (it could then only run by ``--only``).

    """
    if not isinstance(raw_parts, dict):
        raise SuiteError(f"{where}.parts: expected [parts.<name>] tables, got {raw_parts!r}")
    parts: dict[str, Part] = {}
    for pname, raw in raw_parts.items():
        at = f"{where} parts.{pname}"
        if not isinstance(raw, dict):
            raise SuiteError(f"{at}: expected a table with 'rows' and 'notes'")
        extra = sorted(set(raw) - {"rows", "notes"})
        if extra:
            raise SuiteError(f"{at}: unknown keys {extra} (expected ['notes', 'rows'])")
        rows = raw.get("rows")
        if not isinstance(rows, list) or not rows or not all(isinstance(r, str) for r in rows):
            raise SuiteError(f"{at}.rows: expected a non-empty list of run labels, got {rows!r}")
        missing = [r for r in rows if r not in labels]
        if missing:
            raise SuiteError(f"{at}.rows: {missing} are not labels of this suite's runs ({labels})")
        parts[pname] = Part(pname, tuple(rows), str(raw.get("notes", "")))
    if parts:
        covered = {label for part in parts.values() for label in part.rows}
        orphans = [label for label in labels if label not in controls and label not in covered]
        if orphans:
            raise SuiteError(
                f"{where}.parts: rows {orphans} belong to no part; add them to one (or mark them control = true)"
            )
    return parts
