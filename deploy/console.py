"""What a person reads while a run goes: one line per round with an ETA, then a verdict (issue 23).

Flower's and Ray's own output (per-client lines, the final-results dump) goes to a log file
under the run's results folder; the console shows the rounds as the ServerApp writes them to
``rounds.jsonl`` (:class:`RoundTail`) and, at the end, each tier's final and best accuracy
beside the majority-class rate of the held-out set, from ``summary.csv`` (:func:`verdict_lines`).
"""

from __future__ import annotations

import csv
import json
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from experiment.outputs import WARNINGS_FILE


def eta_seconds(row: Mapping[str, Any], rounds: int | None) -> float | None:
    """Seconds left after ``row``: the mean round so far times the rounds still to run.

    ``elapsed`` (seconds since the run started, round 0's evaluation included) over ``round``
    rounds gives the mean round; ``None`` before round 1 or without a round count.
    """
    done = int(row.get("round", 0))
    if not rounds or done < 1:
        return None
    elapsed = float(row.get("elapsed", 0.0))
    return max(0.0, elapsed / done * (rounds - done))


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs:02d} s" if minutes else f"{secs} s"


def traffic(row: Mapping[str, Any]) -> str | None:
    """The round's bytes over every tier, ``"12.3 MB down, 4.1 MB up"`` (``None`` when nothing moved)."""
    tiers = row.get("tiers", {}).values()
    down = sum(float(v.get("bytes-down", 0) or 0) for v in tiers)
    up = sum(float(v.get("bytes-up", 0) or 0) for v in tiers)
    if down == 0 and up == 0:
        return None
    return f"{down / 1e6:.1f} MB down, {up / 1e6:.1f} MB up"


def format_round(row: Mapping[str, Any], metric: str, rounds: int | None, *, eta: bool = False) -> str:
    """One progress line for a ``rounds.jsonl`` row.

    Round k/N, its seconds, the metric per tier, the bytes the round sent and received, and (with
    ``eta``) the time left.
    """
    vals = ", ".join(f"{t} {v[metric]:.3f}" for t, v in row.get("tiers", {}).items() if v.get(metric) is not None)
    total = f"/{rounds}" if rounds else ""
    line = f"    round {row.get('round')}{total} ({float(row.get('seconds', 0.0)):.1f} s): {vals or '-'}"
    moved = traffic(row)
    if moved is not None:
        line += f"; {moved}"
    left = eta_seconds(row, rounds) if eta else None
    if left is not None and int(row.get("round", 0)) < (rounds or 0):
        line += f"; about {_duration(left)} left"
    return line


class RoundTail:
    """Print each new line of a run's ``rounds.jsonl`` while the run is going (a polling thread)."""

    def __init__(self, path: Path, *, metric: str, rounds: int | None, poll_s: float = 1.0, eta: bool = False) -> None:
        self.path, self.metric, self.rounds, self.poll_s, self.eta = path, metric, rounds, poll_s, eta
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._printed: set[int] = set()
        self._started = time.time()

    def __enter__(self) -> RoundTail:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._poll()

    def _poll(self) -> None:
        try:
            if self.path.stat().st_mtime < self._started:
                return  # left by an earlier, unfinished run; the new run rewrites it
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return
        for line in lines:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line being written
            r = int(row.get("round", -1))
            if r not in self._printed:
                self._printed.add(r)
                print(format_round(row, self.metric, self.rounds, eta=self.eta), flush=True)

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self._poll()


def _percent(value: str) -> str:
    return f"{float(value):.3f}" if value not in ("", None) else "-"


def run_warnings(folder: Path, earlier: Sequence[str] = ()) -> list[str]:
    """``earlier`` warnings (the pre-flight's) and the run's own (``warnings.txt``), each once, in order."""
    path = folder / WARNINGS_FILE
    found = path.read_text().splitlines() if path.exists() else []
    return list(dict.fromkeys(w for w in (*earlier, *found) if w.strip()))


def verdict_lines(summary: Path, *, wall_seconds: float, warnings: Sequence[str] = ()) -> list[str]:
    """The final verdict from a run's ``summary.csv``: per tier final / best accuracy against the majority class.

    A tier "learns" when its final accuracy is clearly above the majority-class rate of the
    held-out set (``server.results.verdict``); "majority class" marks a model that predicts
    one class. ``warnings`` (what the run could not do as asked) are repeated last.
    """
    with summary.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return [f"no tier results in {summary}"]
    first = rows[0]
    held = f"{first.get('held-out', 'test')} split, {first.get('held-out-size', '?')} examples"
    lines = [
        f"{first.get('method', '?')} after {first.get('rounds', '?')} rounds ({_duration(wall_seconds)}); "
        f"{held}, majority class {_percent(first.get('majority-rate', ''))}:"
    ]
    width = max(len(r["tier"]) for r in rows)
    for r in rows:
        lines.append(
            f"  {r['tier']:<{width}}  final {_percent(r['final-local-accuracy'])}  "
            f"best {_percent(r['best-local-accuracy'])} (round {r.get('best-round') or '-'})  {r.get('verdict', '')}"
        )
    lines.append(f"results: {summary.parent}")
    lines += [f"WARNING: {w}" for w in warnings]
    return lines
