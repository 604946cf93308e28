"""Helpers shared by the benchmark scripts: fresh-interpreter measurements and JSON reports."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_child(module: str, args: list[str], what: str) -> dict[str, Any]:
    """Run ``python -m module --child ARGS`` in a fresh interpreter; return its last stdout line as JSON.

    A fresh process per measurement keeps one measurement's allocations (peak RSS, caches) out
    of the next.  Raises ``RuntimeError`` naming ``what`` with the child's stderr tail on failure.
    """
    out = subprocess.run(
        [sys.executable, "-m", module, "--child", *args], cwd=ROOT, capture_output=True, text=True, check=False
    )
    if out.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{out.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def write_report(path: Path | None, report: object) -> None:
    """Write ``report`` as indented JSON to ``path`` (parents created); nothing when ``path`` is None."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")


def add_run_options(parser: argparse.ArgumentParser, smoke: str) -> None:
    """Options every single-process benchmark shares: ``--threads``, ``--json``, ``--smoke`` (help: ``smoke``)."""
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = one per core)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    parser.add_argument("--smoke", action="store_true", help=smoke)
