r"""A suite's claims: paired per-seed differences between two of its rows, and their verdicts.

A claim compares row ``a`` with row ``b`` of a suite on one tier and one per-run statistic
(final value, best value, or rounds to a target accuracy).  Both rows run on the same seeds
(the same partitions, client sampling and initial models), so the claim is judged on the
*paired* differences

.. math:: d_s = f(a, s) - f(b, s), \qquad s \in S_a \cap S_b,

their mean :math:`\bar d` and standard error :math:`\mathrm{SE} = s_d / \sqrt{n}` (Bessel-corrected
:math:`s_d`).  A claim that ``a`` is higher is *held* when :math:`n \ge 3` and
:math:`\bar d \ge 2\,\mathrm{SE}` with :math:`\bar d > 0` (for "lower", the mirror image); with
fewer than three common seeds it is *too few seeds*; otherwise *not held*.

A claim about a *trend* -- a gain that shrinks from one setting to another -- names two more rows
``c`` and ``d`` and is judged on the paired difference of differences

.. math:: d_s = \bigl(f(a, s) - f(b, s)\bigr) - \bigl(f(c, s) - f(d, s)\bigr),
          \qquad s \in S_a \cap S_b \cap S_c \cap S_d,

with the same mean, SE and verdict (e.g. co-distillation's gain over FedAvg with a small pool
minus its gain with a large pool, Co-distillation Table 1).

Side ``b`` (and ``d``) may be read on another tier or another per-round metric than side ``a``
(and ``c``): e.g. DepthFL's deepest exit alone (``local-exit-deepest-accuracy``,
:func:`deploy.reports.metric_value`) against another method's global model (``local-accuracy``),
or a row's ensemble against its own deepest exit (``a = b``, two metrics of one run), which is how
a claim's gap is traced to its cause.

The functions are pure so they are tested on exact numbers.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from deploy.markdown import markdown_rows

#: Seeds a verdict needs (the project's standard: a mean over >= 3 seeds).
MIN_SEEDS = 3
#: How many standard errors the paired mean difference must clear.
SE_MULTIPLE = 2.0
DIRECTIONS = ("higher", "lower")
CLAIM_STATISTICS = ("final", "best", "rounds-to-target")

Verdict = Literal["held", "not held", "too few seeds"]


class ClaimError(ValueError):
    """A suite's ``[[claims]]`` entry is malformed (the message names the entry and the key)."""


class _Run(Protocol):
    """What a claim reads of a finished run (:class:`deploy.reports.RunResult`)."""

    @property
    def label(self) -> str: ...

    @property
    def seed(self) -> int: ...

    @property
    def curves(self) -> Mapping[str, Mapping[int, float]]: ...

    def tier_curves(self, metric: str = "") -> Mapping[str, Mapping[int, float]]: ...


@dataclass(frozen=True)
class Claim:
    """One claim of a suite: row ``a`` beats row ``b`` on ``tier``'s ``statistic``.

    Parameters
    ----------
    label : str
        The claim's label in ``docs/RESULTS.md`` (``C1`` ...).
    text : str
        The claim in words.
    a, b : str
        Run labels of the suite; the difference is ``a - b``.
    c, d : str
        Two more run labels for a trend claim, whose difference is ``(a - b) - (c - d)``
        (``c`` read on ``tier``, ``d`` on :attr:`b_tier`); both empty = a plain ``a - b`` claim.
    tier : str
        The tier whose curve is compared (InclusiveFL's global model: the strongest tier).
    tier_b : str
        Row ``b``'s tier when it differs (HeteroFL's full model vs FedAvg's smallest one);
        empty = ``tier``.
    statistic : {"final", "best", "rounds-to-target"}
    direction : {"higher", "lower"}
        Which sign of ``a - b`` the paper claims ("lower" for rounds to a target).
    target : float
        The accuracy ``rounds-to-target`` counts the rounds to (unused otherwise).
    paper : str
        The paper's figure for the claim.
    metric : str
        The per-round metric compared when it is not the suite's (e.g. ``local-accuracy-inverted``,
        one input domain's accuracy, for a claim about transfer across domain-shifted pools);
        empty = the suite's metric.
    metric_b : str
        Row ``b``'s (and ``d``'s) metric when it differs from :attr:`metric` (DepthFL's
        ``local-exit-deepest-accuracy`` against its ensemble's ``local-accuracy``); empty = :attr:`metric`.
        To read ``b`` on the suite's metric while ``a`` reads another, name the suite's metric.

    """

    label: str
    text: str
    a: str
    b: str
    tier: str
    statistic: str = "final"
    direction: str = "higher"
    target: float = 0.0
    paper: str = ""
    tier_b: str = ""
    metric: str = ""
    c: str = ""
    d: str = ""
    metric_b: str = ""

    @property
    def b_metric(self) -> str:
        """The metric of row ``b`` (and ``d``) that is compared (empty = the suite's)."""
        return self.metric_b or self.metric

    @property
    def b_tier(self) -> str:
        """The tier of row ``b`` that is compared."""
        return self.tier_b or self.tier

    @property
    def is_trend(self) -> bool:
        """Whether the claim compares two differences, ``(a - b) - (c - d)``."""
        return bool(self.c)

    def rows(self) -> tuple[tuple[str, str, str], ...]:
        """``(run label, tier, metric)`` of the compared rows in the order ``a, b`` or ``a, b, c, d``."""
        a_side, b_side = (self.tier, self.metric), (self.b_tier, self.b_metric)
        plain = ((self.a, *a_side), (self.b, *b_side))
        return (*plain, (self.c, *a_side), (self.d, *b_side)) if self.is_trend else plain

    def metrics(self) -> tuple[str, ...]:
        """The non-suite metrics the claim reads (what a run's reader must keep besides the suite's)."""
        return tuple(dict.fromkeys(m for m in (self.metric, self.b_metric) if m))

    def compared(self) -> str:
        """The compared rows in words: ``a − b`` or ``(a − b) − (c − d)``."""
        return f"({self.a} − {self.b}) − ({self.c} − {self.d})" if self.is_trend else f"{self.a} − {self.b}"


def parse_claims(raw: object, where: str, run_labels: Sequence[str]) -> tuple[Claim, ...]:
    """Build the suite's claims from its ``[[claims]]`` entries (none is fine).

    Raises
    ------
    ClaimError
        On a missing or unknown key, a run label the suite does not have, a row compared with itself
        on the same tier and metric, an unknown statistic or direction, a ``rounds-to-target`` claim
        without a target in ``(0, 1]``, or a trend claim with only one of ``c`` / ``d`` or on
        ``rounds-to-target`` (rounds have no magnitude for a run that misses the target).

    """
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ClaimError(f"{where}: 'claims' must be a list of [[claims]] tables")
    claims = []
    known = {"label", "text", "a", "b", "c", "d", "tier", "tier-b", "statistic", "direction", "target", "paper",
             "metric", "metric-b"}  # fmt: skip
    for i, entry in enumerate(raw):
        at = f"{where} claims[{i}]"
        if not isinstance(entry, dict):
            raise ClaimError(f"{at}: expected a table")
        extra = sorted(set(entry) - known)
        if extra:
            raise ClaimError(f"{at}: unknown keys {extra} (expected {sorted(known)})")
        for key in ("label", "text", "a", "b", "tier"):
            if not isinstance(entry.get(key), str) or not entry[key]:
                raise ClaimError(f"{at}: needs '{key}' (a non-empty string)")
        if ("c" in entry) != ("d" in entry):
            raise ClaimError(f"{at}: a trend claim needs both 'c' and 'd' (its difference is (a - b) - (c - d))")
        for key in ("a", "b", "c", "d"):
            if key not in entry:
                continue
            if entry[key] not in run_labels:
                raise ClaimError(f"{at}.{key}: {entry[key]!r} is not a run label of the suite ({list(run_labels)})")
        claim = Claim(
            label=entry["label"], text=entry["text"], a=entry["a"], b=entry["b"], tier=entry["tier"],
            statistic=str(entry.get("statistic", "final")), direction=str(entry.get("direction", "higher")),
            target=_number(entry.get("target", 0.0), f"{at}.target"), paper=str(entry.get("paper", "")),
            tier_b=str(entry.get("tier-b", "")), metric=str(entry.get("metric", "")),
            c=str(entry.get("c", "")), d=str(entry.get("d", "")), metric_b=str(entry.get("metric-b", "")),
        )  # fmt: skip
        if claim.a == claim.b and (claim.tier, claim.metric) == (claim.b_tier, claim.b_metric):
            raise ClaimError(f"{at}.b: {claim.b!r} compared with itself on one tier and metric is 0 on every seed: "
                             "set 'tier-b' or 'metric-b' to read it on another")  # fmt: skip
        if claim.statistic not in CLAIM_STATISTICS:
            raise ClaimError(f"{at}.statistic: expected one of {CLAIM_STATISTICS}, got {claim.statistic!r}")
        if claim.direction not in DIRECTIONS:
            raise ClaimError(f"{at}.direction: expected one of {DIRECTIONS}, got {claim.direction!r}")
        if claim.statistic == "rounds-to-target" and not 0.0 < claim.target <= 1.0:
            raise ClaimError(f"{at}.target: 'rounds-to-target' needs a target accuracy in (0, 1], got {claim.target}")
        if claim.is_trend and claim.statistic == "rounds-to-target":
            raise ClaimError(f"{at}.statistic: a trend claim (c, d) compares 'final' or 'best' values, not rounds")
        if claim.statistic == "rounds-to-target" and claim.direction != "lower":
            raise ClaimError(f"{at}.direction: 'rounds-to-target' claims a fewer rounds: set direction = \"lower\"")
        claims.append(claim)
    return tuple(claims)


def _number(value: Any, at: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ClaimError(f"{at}: expected a number, got {value!r}")
    return float(value)


def rounds_to_target(curve: Mapping[int, float], target: float) -> float:
    r"""First round whose value reaches ``target``; ``inf`` if none does.

    .. math:: r_\tau = \min \{ r : \mathrm{curve}[r] \ge \tau \}

    A run that never reaches the target is censored at :math:`+\infty` (it took more rounds than
    the run had); :func:`paired_difference` counts such a seed against the row that missed it.
    """
    reached = [r for r, v in curve.items() if v >= target]
    return float(min(reached)) if reached else math.inf


def best_value(curve: Mapping[int, float]) -> float:
    """Best value over the measured rounds, ``max_r curve[r]`` over the non-NaN ones (NaN if none)."""
    measured = [v for v in curve.values() if not math.isnan(v)]
    return max(measured) if measured else math.nan


def claim_statistic(curve: Mapping[int, float], claim: Claim) -> float:
    """The per-run number the claim compares (``final``, ``best`` or ``rounds-to-target``)."""
    if claim.statistic == "final":
        return curve[max(curve)]
    if claim.statistic == "best":
        return best_value(curve)
    return rounds_to_target(curve, claim.target)


def unmeasured(value: float, claim: Claim) -> bool:
    """Whether a run's statistic has no magnitude: NaN (diverged) or, for rounds, never reached."""
    return math.isnan(value) or (claim.statistic == "rounds-to-target" and math.isinf(value))


@dataclass(frozen=True)
class PairedDifference:
    """``a - b`` per common seed, with mean and standard error (NaN below two seeds).

    ``censored``: seeds left out because b's statistic (or both rows') has no magnitude (a diverged
    or target-missing b favours a by an unknown amount, so it is dropped, never counted for a);
    ``against``: seeds where only a's has none (a diverged, or never reached the target b reached),
    which count against the claim in :func:`verdict`.
    """

    seeds: tuple[int, ...]
    differences: tuple[float, ...]
    mean: float
    se: float
    censored: tuple[int, ...] = ()
    against: tuple[int, ...] = ()

    @property
    def n(self) -> int:
        """Number of seeds with a finite difference."""
        return len(self.differences)


def paired_difference(results: Sequence[_Run], claim: Claim) -> PairedDifference:
    r"""Per-seed ``claim_statistic(a) - claim_statistic(b)`` over the seeds both rows finished.

    .. math:: \bar d = \frac1n \sum_s d_s, \qquad \mathrm{SE} = \frac{1}{\sqrt n}
              \sqrt{\frac{1}{n-1} \sum_s (d_s - \bar d)^2}

    Seeds where either row lacks the tier's curve are skipped.  A statistic without magnitude
    (:func:`unmeasured`: NaN, or a target never reached) leaves the seed out of the mean: listed
    in ``against`` when only a's is unmeasured, else in ``censored``.  A trend claim
    (:attr:`Claim.is_trend`) takes ``d_s = (a - b) - (c - d)`` over the seeds all four rows
    finished; a seed with any row unmeasured (diverged) is listed in ``against``, since a
    diverged row says nothing about the size of either gain.
    """
    by = {(r.label, r.seed): r for r in results}
    rows = claim.rows()
    common = set.intersection(*({s for (label, s) in by if label == row} for row, _, _ in rows))
    seeds, diffs, censored, against = [], [], [], []
    for seed in sorted(common):
        curves = [by[(row, seed)].tier_curves(metric).get(tier) for row, tier, metric in rows]
        if not all(curves):
            continue
        values = [claim_statistic(curve, claim) for curve in curves if curve]
        missing = [unmeasured(v, claim) for v in values]
        a_alone = missing[0] and not missing[1]  # a plain claim's a missed what b reached
        if any(missing) if claim.is_trend else a_alone:
            against.append(seed)
        elif any(missing):
            censored.append(seed)
        else:
            seeds.append(seed)
            diffs.append(_difference(values))
    n = len(diffs)
    mean = math.fsum(diffs) / n if n else math.nan
    se = math.sqrt(math.fsum((d - mean) ** 2 for d in diffs) / (n - 1)) / math.sqrt(n) if n > 1 else math.nan
    return PairedDifference(tuple(seeds), tuple(diffs), mean, se, tuple(censored), tuple(against))


def _difference(values: Sequence[float]) -> float:
    """``a - b`` of two values, ``(a - b) - (c - d)`` of four (each difference taken first)."""
    if len(values) == 2:
        return values[0] - values[1]
    a, b, c, d = values
    return (a - b) - (c - d)


def verdict(diff: PairedDifference, direction: str) -> Verdict:
    r"""``held`` when :math:`n \ge 3` and the signed mean clears :math:`2\,\mathrm{SE}` in ``direction``.

    Signed mean :math:`m = \bar d` ("higher") or :math:`-\bar d` ("lower"); held iff
    :math:`m > 0` and :math:`m \ge 2\,\mathrm{SE}`.  Any seed in ``against`` (a diverged, or missed
    a target b reached) makes it "not held".
    """
    if diff.against:
        return "not held"
    if diff.n < MIN_SEEDS:
        return "too few seeds"
    signed = diff.mean if direction == "higher" else -diff.mean
    return "held" if signed > 0 and signed >= SE_MULTIPLE * diff.se else "not held"


def claims_markdown(claims: Sequence[Claim], results: Sequence[_Run], *, digits: int = 3) -> str:
    """The report's claims table: claim, compared rows, paired difference ± SE, seeds, verdict."""
    rows = []
    for c in claims:
        d = paired_difference(results, c)
        stat = c.statistic if c.statistic != "rounds-to-target" else f"rounds to {c.target:g}"
        value = "—" if d.n == 0 else (f"{d.mean:+.{digits}f}" + ("" if math.isnan(d.se) else f" ± {d.se:.{digits}f}"))
        missed = "target not reached" if c.statistic == "rounds-to-target" else "diverged"
        if d.against:
            who = "a row" if c.is_trend else "a"
            value += f" ({who} {missed}: seeds {', '.join(map(str, d.against))})"
        if d.censored:
            value += f" (b or both {missed}, left out: seeds {', '.join(map(str, d.censored))})"
        want = "a higher" if c.direction == "higher" else "a lower"
        tier = (c.tier if c.b_tier == c.tier else f"{c.tier} − {c.b_tier}") + _metrics_words(c)
        rows.append(
            [f"{c.label}: {c.text}", c.compared(), f"{tier}, {stat} ({want})", value, str(d.n), verdict(d, c.direction)]
        )
    header = ["claim", "a − b", "tier, statistic", "paired a − b (mean ± SE)", "seeds", "verdict"]
    return markdown_rows(header, rows) + "\n"


def _metrics_words(claim: Claim) -> str:
    """`` (metric)`` when both sides read one non-suite metric, `` (a's − b's)`` when they differ."""
    if claim.b_metric != claim.metric:
        return f" ({claim.metric or 'suite metric'} − {claim.b_metric})"
    return f" ({claim.metric})" if claim.metric else ""
