r"""Runs' per-round values at chosen rounds: how a metric moves inside a run, as a table.

The suites' reports give each run's final and best values (:mod:`deploy.reports`); a diagnosis
sometimes needs the curve itself at chosen rounds, e.g. PeriodicCodist's other-domain accuracy
right after each distillation (rounds :math:`t` with :math:`t \bmod p = 0`) against the round
before the next one (:math:`t + p - 1`), or a row's difference to a reference row of the same seed.
For a run's curve :math:`c_r` and the rounds :math:`r_1, \dots, r_k` the table holds
:math:`100\,c_{r_i}` (points) and, with ``--minus LABEL``, :math:`100\,(c_{r_i} - c'_{r_i})` where
:math:`c'` is the same seed's curve of the row ``LABEL``.

Usage::

    python -m deploy.curves DIR --tier T [--metric M] --rounds R[,R...] | --rounds FIRST:LAST:STEP
                            [--minus LABEL] [--only LABEL ...]

``DIR`` is a runner ``--out`` folder or its archive ``docs/runs/SUITE-PRESET``; ``--rounds``
takes a comma-separated list or a ``FIRST:LAST:STEP`` range (repeatable, joined in order).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from deploy.reports import RunKey, curves_parser, finished_curves, points_table


class CurveError(ValueError):
    """A curve lacks a requested round, or a requested reference row is missing."""


def values_at(curve: Mapping[int, float], rounds: Sequence[int]) -> list[float]:
    """``[curve[r] for r in rounds]``.

    Raises
    ------
    CurveError
        If a requested round was not measured, naming the rounds the curve has.

    """
    missing = [r for r in rounds if r not in curve]
    if missing:
        span = f"{len(curve)} rounds between {min(curve)} and {max(curve)}" if curve else "no round"
        raise CurveError(f"rounds {missing} were not measured (the curve has {span})")
    return [curve[r] for r in rounds]


def differences_to(
    curves: Mapping[RunKey, Mapping[int, float]], reference: str, rounds: Sequence[int]
) -> dict[RunKey, list[float]]:
    """Each run's values minus those of the same seed's run of row ``reference``, at ``rounds``.

    ``curves`` maps a run's (label, seed) (:func:`deploy.reports.finished_curves`) to its curve; the
    reference row's own runs are left out of the result.

    Raises
    ------
    CurveError
        If a seed has no run of ``reference``, or a round is missing (:func:`values_at`).

    """
    out: dict[RunKey, list[float]] = {}
    for (label, seed), curve in curves.items():
        if label == reference:
            continue
        base = curves.get((reference, seed))
        if base is None:
            raise CurveError(f"seed {seed} has no finished run of {reference!r} to subtract")
        pairs = zip(values_at(curve, rounds), values_at(base, rounds), strict=True)
        out[(label, seed)] = [a - b for a, b in pairs]
    return out


def parse_rounds(texts: Sequence[str]) -> list[int]:
    """``["5,9", "10:30:10"]`` -> ``[5, 9, 10, 20, 30]``: lists and ``FIRST:LAST:STEP`` ranges, in order.

    Raises
    ------
    CurveError
        For an empty or malformed item, a step below 1, or ``FIRST > LAST``.

    """
    rounds: list[int] = []
    for text in texts:
        try:
            values = [int(v) for v in text.split(":" if ":" in text else ",")]
        except ValueError:
            raise CurveError(f"--rounds {text!r}: expected R[,R...] or FIRST:LAST:STEP of integers") from None
        if ":" not in text:
            rounds.extend(values)
            continue
        if len(values) != 3:
            raise CurveError(f"--rounds {text!r}: expected R[,R...] or FIRST:LAST:STEP of integers")
        first, last, step = values
        if step < 1 or first > last:
            raise CurveError(f"--rounds {text!r}: need STEP >= 1 and FIRST <= LAST")
        rounds.extend(range(first, last + 1, step))
    if not rounds:
        raise CurveError("--rounds names no round")
    return rounds


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point: print each run's values (or differences) at the rounds, in points."""
    parser = curves_parser(__doc__, verb="read")
    parser.add_argument("--rounds", action="append", required=True, help="R[,R...] or FIRST:LAST:STEP (repeatable)")
    parser.add_argument("--minus", default="", help="subtract the same seed's run of this row label")
    args = parser.parse_args(argv)
    if args.minus and args.only and set(args.only) <= {args.minus}:
        parser.error(f"--only names only the --minus row {args.minus!r}: nothing is left to subtract it from")
    only = [*args.only, args.minus] if args.only and args.minus else args.only
    try:
        rounds = parse_rounds(args.rounds)
        curves = finished_curves(args.out, tier=args.tier, metric=args.metric, only=only)
        if not curves:
            print(f"no finished run in {args.out / 'runs'} measured {args.metric!r} on tier {args.tier!r}")
            return 1
        if args.minus:
            rows = differences_to(curves, args.minus, rounds)
            what, fmt = f"minus {args.minus} (same seed)", "{:+.1f}"
        else:
            rows = {key: values_at(curve, rounds) for key, curve in curves.items()}
            what, fmt = "", "{:.1f}"
    except CurveError as exc:
        print(f"cannot read: {exc}")
        return 1
    print(f"{args.metric} in points, tier {args.tier}{', ' + what if what else ''}")
    print(points_table([f"r{r}" for r in rounds], rows, fmt=fmt))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
