"""Names of a run's results files: written by the ServerApp, read by the launcher and the runner.

A run's results folder (``<results-dir>/<run-name>``) holds ``rounds.jsonl`` (a row per round),
``summary.csv`` (a row per tier), ``config.json``, ``accuracy.png`` and, when the run found it
could not do everything asked of it, ``warnings.txt`` (one warning per line) -- see
:mod:`server.results`.
"""

from __future__ import annotations

from typing import Final

ROUNDS_FILE: Final = "rounds.jsonl"
SUMMARY_FILE: Final = "summary.csv"
WARNINGS_FILE: Final = "warnings.txt"
