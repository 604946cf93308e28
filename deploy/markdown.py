"""Markdown tables for the reports and commands of :mod:`deploy` (no other dependency).

:mod:`deploy.claims`, :mod:`deploy.reports` (which imports :mod:`deploy.claims`), :mod:`deploy.curves`,
:mod:`deploy.plateau` and ``bench.cut_probe`` all print tables through :func:`markdown_rows`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def markdown_rows(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table: the header row, its ``---`` separator, then one line per row (no final newline).

    Every row must have as many cells as the header.
    """

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    lines = [line(header), line(["---"] * len(header))]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells, the header {len(header)}")
        lines.append(line(row))
    return "\n".join(lines)
