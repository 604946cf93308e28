"""A time budget for a long suite: a case that would end past the deadline is skipped, saying why.

CI has 90 minutes for all its suites (``.ci/run``).  On a slow machine the chaos suite, last in
line, may not fit in what is left; a run past the limit would not land at all.  ``.ci/run``
therefore exports :data:`DEADLINE_ENV` (a Unix time), and each chaos case first estimates its own
duration from the pace measured on its cluster (:func:`case_estimate_s`).  A case that would end
after the deadline is skipped with a reason that names the estimate, the pace and the seconds
left (:func:`skip_reason`); the cases before it ran in full.  Without the variable nothing is
skipped.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

#: The Unix time by which a suite's cases should have ended (set by ``.ci/run``).
DEADLINE_ENV = "HETFL_CI_DEADLINE"
#: Safety factor on the measured pace: a case's rounds are rarely all at the median.
PACE_MARGIN = 1.25


class DeadlineError(ValueError):
    """:data:`DEADLINE_ENV` is set to something that is not a finite Unix time."""


@dataclass(frozen=True)
class CaseCost:
    """What a case costs: the server rounds it runs, and seconds beyond them (timeouts it waits out, restarts)."""

    rounds: int
    extra_s: float = 0.0

    def __post_init__(self) -> None:
        if self.rounds < 0 or not math.isfinite(self.extra_s) or self.extra_s < 0:
            raise ValueError(f"a case cost needs rounds >= 0 and finite extra_s >= 0, got {self}")


def read_deadline(environ: Mapping[str, str] = os.environ) -> float | None:
    """The deadline (Unix seconds) from :data:`DEADLINE_ENV`; ``None`` when unset or empty."""
    raw = environ.get(DEADLINE_ENV, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise DeadlineError(f"{DEADLINE_ENV}={raw!r}: expected a Unix time in seconds (e.g. $(date +%s) + 1800)")
    return value


def case_estimate_s(cost: CaseCost, round_s: float) -> float:
    """Estimated seconds of a case: ``rounds * round_s * PACE_MARGIN + extra_s``."""
    if not math.isfinite(round_s) or round_s <= 0:
        raise ValueError(f"round_s must be a positive number of seconds, got {round_s}")
    return cost.rounds * round_s * PACE_MARGIN + cost.extra_s


def skip_reason(*, now: float, deadline: float | None, estimate_s: float, round_s: float) -> str | None:
    """Why a case estimated at ``estimate_s`` must not start at ``now``; ``None`` if it fits.

    It fits when ``now + estimate_s <= deadline`` (always, without a deadline).
    """
    if deadline is None or now + estimate_s <= deadline:
        return None
    left = max(0.0, deadline - now)
    return (
        f"not started: about {estimate_s:.0f} s needed at the {round_s:.0f} s per round measured here, "
        f"{left:.0f} s left before {DEADLINE_ENV} (CI's 90 minutes; a slower machine than the suite's budget)"
    )
