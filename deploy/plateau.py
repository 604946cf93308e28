r"""The plateau rule of the validation presets: how many rounds a cpu preset needs.

Issue 19 asks each cpu preset to run enough rounds that its compared rows reach a plateau on
validation data before the last round. The suites fix the rule in their ``cpu-validation``
preset's notes before its runs (``inclusivefl-proportions``, ``pfedknow-table3``); this module
evaluates it on the finished validation runs, so the verdict is a command, not hand arithmetic.

For a run's metric curve :math:`c_r` (one tier, round :math:`r`), a window of :math:`w` rounds and
the validation run's tail rounds :math:`[a, b]`:

.. math::
    m_R = \frac{1}{w} \sum_{r = R - w + 1}^{R} c_r, \qquad
    m_\text{tail} = \frac{1}{b - a + 1} \sum_{r = a}^{b} c_r, \qquad
    \text{settled}(R) \iff |m_R - m_\text{tail}| \le \tau

``R`` rounds stand for the run when ``settled(R)``; a preset's rounds are the first candidate
``R`` at which every compared run is settled (:func:`first_settled`), and ``None`` (no candidate
stands: use the validation run's length, or report the claim as measured before its plateau)
otherwise.

Usage::

    python -m deploy.plateau DIR --tier T [--metric M] --window W --candidates FIRST:LAST:STEP
                             --tail A:B [--tolerance 0.01] [--only LABEL ...]

``DIR`` is a runner ``--out`` folder (``results/experiments/SUITE-PRESET`` or its archive
``docs/runs/SUITE-PRESET``); every finished run in ``DIR/runs`` (each one with ``--only``'s
labels) is judged.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

from deploy.reports import curves_parser, finished_curves, points_table

_Run = TypeVar("_Run", bound=Hashable)
"""Whatever names a run in :func:`first_settled`'s curves (a row name, or a (label, seed) key)."""


class PlateauError(ValueError):
    """A curve lacks a round the rule reads, or the rule's rounds are malformed."""


def window_mean(curve: Mapping[int, float], first: int, last: int) -> float:
    """Mean of ``curve[r]`` for ``r = first .. last`` (inclusive).

    Raises
    ------
    PlateauError
        If ``first > last`` or a round in the window was not measured.

    """
    if first > last:
        raise PlateauError(f"empty window: rounds {first}..{last}")
    missing = [r for r in range(first, last + 1) if r not in curve]
    if missing:
        raise PlateauError(
            f"rounds {missing} were not measured (the curve has {min(curve, default=0)}..{max(curve, default=0)})"
        )
    return math.fsum(curve[r] for r in range(first, last + 1)) / (last - first + 1)


def settled_gap(curve: Mapping[int, float], rounds: int, *, window: int, tail: tuple[int, int]) -> float:
    r""":math:`m_R - m_\text{tail}` for ``R = rounds`` (negative: the curve still rises after ``R``).

    Raises
    ------
    PlateauError
        If a round of either window was not measured (:func:`window_mean`).

    """
    return window_mean(curve, rounds - window + 1, rounds) - window_mean(curve, *tail)


def first_settled(
    curves: Mapping[_Run, Mapping[int, float]],
    candidates: Sequence[int],
    *,
    window: int,
    tail: tuple[int, int],
    tolerance: float,
) -> int | None:
    """The first ``R`` of ``candidates`` at which every curve is settled (``|gap| <= tolerance``), else None.

    ``curves`` maps a run's name to its curve. A slack of ``1e-12`` absorbs the rounding of the
    means, so a gap of exactly ``tolerance`` counts as settled.

    Raises
    ------
    PlateauError
        If a curve lacks a round the rule reads (:func:`window_mean`).

    """
    for rounds in candidates:
        if all(abs(settled_gap(c, rounds, window=window, tail=tail)) <= tolerance + 1e-12 for c in curves.values()):
            return rounds
    return None


def _span(text: str, parts: int) -> tuple[int, ...]:
    values = tuple(int(v) for v in text.split(":"))
    if len(values) != parts:
        raise argparse.ArgumentTypeError(f"{text!r}: expected {parts} integers separated by ':'")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: print each run's gap per candidate and the rule's verdict."""
    parser = curves_parser(__doc__, verb="judged")
    parser.add_argument("--window", type=int, required=True, help="rounds averaged up to each candidate R")
    parser.add_argument("--candidates", type=lambda t: _span(t, 3), required=True, help="FIRST:LAST:STEP")
    parser.add_argument("--tail", type=lambda t: _span(t, 2), required=True, help="A:B, the tail rounds")
    parser.add_argument("--tolerance", type=float, default=0.01, help="largest |m_R - m_tail| (0.01 = 1 point)")
    args = parser.parse_args(argv)
    first, last, step = args.candidates
    if step <= 0 or first > last or first < args.window:
        parser.error(f"--candidates {first}:{last}:{step}: need STEP >= 1 and WINDOW <= FIRST <= LAST")
    candidates = list(range(first, last + 1, step))
    curves = finished_curves(args.out, tier=args.tier, metric=args.metric, only=args.only)
    if not curves:
        print(f"no finished run in {args.out / 'runs'} measured {args.metric!r} on tier {args.tier!r}")
        return 1
    tail = (args.tail[0], args.tail[1])
    try:
        rows = {k: [settled_gap(c, r, window=args.window, tail=tail) for r in candidates] for k, c in curves.items()}
        found = first_settled(curves, candidates, window=args.window, tail=tail, tolerance=args.tolerance)
    except PlateauError as exc:
        print(f"cannot judge: {exc}")
        return 1
    print(f"m_R - m_tail in points ({args.metric}, tier {args.tier}, window {args.window}, tail {tail[0]}-{tail[1]})")
    print(points_table([f"R = {r}" for r in candidates], rows, fmt="{:+.2f}"))
    verdict = f"R = {found}" if found is not None else "none: no candidate stands for every run"
    print(f"first candidate where every run is within the tolerance ({100 * args.tolerance:g} points): {verdict}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
