"""Claims: paired per-seed differences, their standard error and verdict, on exact numbers."""

from __future__ import annotations

import math

import pytest

from deploy.claims import (
    Claim,
    ClaimError,
    PairedDifference,
    claim_statistic,
    claims_markdown,
    paired_difference,
    parse_claims,
    rounds_to_target,
    verdict,
)
from deploy.experiments import SuiteError, parse_suite
from deploy.reports import RunResult


def run(label: str, seed: int, curve: dict[int, float], tier: str = "strong") -> RunResult:
    return RunResult(label=label, seed=seed, curves={tier: curve})


CLAIM = Claim(label="C1", text="InclusiveFL beats ExclusiveFL", a="incl", b="excl", tier="strong")


def test_paired_difference_mean_and_se_exact() -> None:
    # finals: incl 0.80, 0.70, 0.90; excl 0.70, 0.68, 0.81 -> d = 0.10, 0.02, 0.09
    results = [
        run("incl", 1, {0: 0.5, 5: 0.80}), run("excl", 1, {0: 0.5, 5: 0.70}),
        run("incl", 2, {0: 0.5, 5: 0.70}), run("excl", 2, {0: 0.5, 5: 0.68}),
        run("incl", 3, {0: 0.5, 5: 0.90}), run("excl", 3, {0: 0.5, 5: 0.81}),
        run("incl", 4, {0: 0.5, 5: 0.90}),  # no partner: not paired
    ]  # fmt: skip
    d = paired_difference(results, CLAIM)
    assert d.seeds == (1, 2, 3)
    assert d.differences == pytest.approx((0.10, 0.02, 0.09))
    mean = 0.07
    sd = math.sqrt(((0.03) ** 2 + (0.05) ** 2 + (0.02) ** 2) / 2)  # sqrt(0.0019)
    assert d.mean == pytest.approx(mean)
    assert d.se == pytest.approx(sd / math.sqrt(3))  # 0.025166
    assert verdict(d, "higher") == "held"  # 0.07 >= 2 * 0.0252
    assert verdict(d, "lower") == "not held"


def test_verdict_needs_three_seeds_and_two_standard_errors() -> None:
    assert verdict(PairedDifference((1, 2), (0.5, 0.5), 0.5, 0.0), "higher") == "too few seeds"
    assert verdict(PairedDifference((1, 2, 3), (0.1, 0.0, 0.05), 0.05, 0.0289), "higher") == "not held"
    assert verdict(PairedDifference((1, 2, 3), (-3.0, -2.0, -4.0), -3.0, 0.577), "lower") == "held"
    assert verdict(PairedDifference((1, 2, 3), (0.0, 0.0, 0.0), 0.0, 0.0), "higher") == "not held"


def test_rounds_to_target_and_censoring() -> None:
    assert rounds_to_target({0: 0.5, 1: 0.6, 2: 0.75, 3: 0.74}, 0.7) == 2.0
    assert rounds_to_target({0: 0.5, 1: 0.6}, 0.7) == math.inf
    claim = Claim("C3", "momentum is faster", "m", "plain", "strong", statistic="rounds-to-target",
                  direction="lower", target=0.7)  # fmt: skip
    results = [
        run("m", 1, {0: 0.5, 1: 0.7, 2: 0.8}), run("plain", 1, {0: 0.5, 1: 0.6, 2: 0.7}),
        run("m", 2, {0: 0.5, 1: 0.6, 2: 0.7}), run("plain", 2, {0: 0.5, 1: 0.6, 2: 0.6}),
    ]  # fmt: skip
    d = paired_difference(results, claim)
    assert d.differences == (-1.0,) and d.censored == (2,) and math.isnan(d.se)
    table = claims_markdown([claim], results)
    assert "rounds to 0.7 (a lower)" in table and "left out: seeds 2" in table and "too few seeds" in table


def test_a_seed_where_only_a_fails_counts_against_the_claim() -> None:
    # three seeds where a is faster by 1-2 rounds, and seed 4 where a never reaches the target b
    # reached in round 1: without that seed the claim would hold
    claim = Claim("C3", "momentum is faster", "m", "plain", "strong", statistic="rounds-to-target",
                  direction="lower", target=0.7)  # fmt: skip
    fast = [run("m", s, {0: 0.5, 1: 0.7}) for s in (1, 2, 3)] + [
        run("plain", s, {0: 0.5, 1: 0.6, 3: 0.7}) for s in (1, 2)
    ]
    fast += [run("plain", 3, {0: 0.5, 2: 0.7})]
    assert verdict(paired_difference(fast, claim), "lower") == "held"  # d = -2, -2, -1
    missed = [*fast, run("m", 4, {0: 0.5, 1: 0.6}), run("plain", 4, {0: 0.5, 1: 0.8})]
    d = paired_difference(missed, claim)
    assert d.against == (4,) and d.n == 3 and verdict(d, "lower") == "not held"
    assert "(a target not reached: seeds 4)" in claims_markdown([claim], missed)
    # a diverged run (NaN final) of row a counts against the claim, one of row b is left out
    results = [run("incl", s, {5: 0.9}) for s in (1, 2, 3)] + [run("excl", s, {5: 0.7 + 0.01 * s}) for s in (1, 2, 3)]
    assert verdict(paired_difference(results, CLAIM), "higher") == "held"
    nan_a = [*results, run("incl", 4, {5: math.nan}), run("excl", 4, {5: 0.7})]
    assert (
        paired_difference(nan_a, CLAIM).against == (4,)
        and verdict(paired_difference(nan_a, CLAIM), "higher") == "not held"
    )
    nan_b = [*results, run("incl", 4, {5: 0.9}), run("excl", 4, {5: math.nan})]
    d = paired_difference(nan_b, CLAIM)
    assert d.censored == (4,) and d.n == 3 and verdict(d, "higher") == "held"


def test_best_ignores_nan_rounds_wherever_they_are() -> None:
    best = Claim("C", "t", "a", "b", "strong", statistic="best")
    assert claim_statistic({1: math.nan, 2: 0.6, 3: 0.5}, best) == 0.6
    assert claim_statistic({1: 0.6, 2: math.nan}, best) == 0.6
    assert math.isnan(claim_statistic({1: math.nan}, best))


def test_claims_markdown_exact_row() -> None:
    results = [run("incl", s, {3: 0.6 + 0.1 * s}) for s in (1, 2, 3)] + [run("excl", s, {3: 0.6}) for s in (1, 2, 3)]
    row = claims_markdown([CLAIM], results).splitlines()[2]
    assert row == (
        "| C1: InclusiveFL beats ExclusiveFL | incl − excl | strong, final (a higher) | +0.200 ± 0.058 | 3 | held |"
    )


def test_parse_claims_rejects_malformed_entries() -> None:
    labels = ["incl", "excl"]
    ok = {"label": "C1", "text": "t", "a": "incl", "b": "excl", "tier": "strong"}
    assert parse_claims(None, "suite", labels) == ()
    assert parse_claims([ok], "suite", labels)[0] == Claim("C1", "t", "incl", "excl", "strong")
    for bad, match in (
        ({**ok, "a": "nope"}, "not a run label"),
        ({**ok, "statistic": "median"}, "statistic"),
        ({**ok, "direction": "up"}, "direction"),
        ({**ok, "statistic": "rounds-to-target"}, "target"),
        ({**ok, "statistic": "rounds-to-target", "target": 0.7}, "direction"),
        ({**ok, "colour": "red"}, "unknown keys"),
        ({k: v for k, v in ok.items() if k != "tier"}, "'tier'"),
    ):
        with pytest.raises(ClaimError, match=match):
            parse_claims([bad], "suite", labels)


def test_a_suite_with_a_bad_claim_fails_to_parse() -> None:
    doc = {
        "presets": {"cpu": {"supernodes": 2}},
        "runs": [{"label": "a"}, {"label": "b"}],
        "claims": [{"label": "C1", "text": "t", "a": "a", "b": "c", "tier": "strong"}],
    }
    with pytest.raises(SuiteError, match=r"claims\[0\]\.b"):
        parse_suite("x", doc)


def test_rows_may_compare_different_tiers() -> None:
    claim = Claim("C12", "mix beats smallest", "mix", "small", "a", tier_b="e")
    results = [RunResult("mix", s, {"a": {1: 0.8 + s / 100}, "e": {1: 0.1}}) for s in (1, 2, 3)]
    results += [RunResult("small", s, {"e": {1: 0.7}}) for s in (1, 2, 3)]
    d = paired_difference(results, claim)
    assert d.differences == pytest.approx((0.11, 0.12, 0.13))
    assert "| a − e, final (a higher) |" in claims_markdown([claim], results)
    ok = {"label": "C12", "text": "t", "a": "mix", "b": "small", "tier": "a", "tier-b": "e"}
    assert parse_claims([ok], "suite", ["mix", "small"])[0].b_tier == "e"


def test_a_claim_on_another_metric_pairs_that_metric() -> None:
    # C9's shape: the small model on the other pool's domain (local-accuracy-inverted), while the
    # suite's metric (the mean over domains) says the opposite; d = 0.05, 0.03, 0.04 -> 0.04 +/- 0.00577
    def two(label: str, seed: int, mean: float, inverted: float) -> RunResult:
        return RunResult(label, seed, {"small": {20: mean}},
                         other_curves={"local-accuracy-inverted": {"small": {20: inverted}}})  # fmt: skip

    results = [two("merged", 1, 0.60, 0.15), two("fedavg", 1, 0.70, 0.10),
               two("merged", 2, 0.61, 0.13), two("fedavg", 2, 0.71, 0.10),
               two("merged", 3, 0.62, 0.14), two("fedavg", 3, 0.72, 0.10)]  # fmt: skip
    on_mean = Claim("C9", "transfer", "merged", "fedavg", "small")
    on_domain = Claim("C9", "transfer", "merged", "fedavg", "small", metric="local-accuracy-inverted")
    assert paired_difference(results, on_mean).mean == pytest.approx(-0.10)
    d = paired_difference(results, on_domain)
    assert d.differences == pytest.approx((0.05, 0.03, 0.04))
    assert d.se == pytest.approx(0.01 / math.sqrt(3)) and verdict(d, "higher") == "held"
    assert "small (local-accuracy-inverted)" in claims_markdown([on_domain], results)
    missing = Claim("C9", "transfer", "merged", "fedavg", "small", metric="loss-inverted")
    assert paired_difference(results, missing).n == 0


def test_side_b_may_read_another_metric_of_the_same_or_another_run() -> None:
    # DepthFL's shape: the ensemble (local-accuracy) vs the deepest exit (local-exit-6-accuracy).
    # ensemble 0.79, 0.80, 0.78; exit 6: 0.81, 0.81, 0.80; other method 0.80, 0.80, 0.79
    def depth(seed: int, ensemble: float, exit6: float) -> RunResult:
        curves = {"strong": {20: ensemble}}
        others = {"local-exit-6-accuracy": {"strong": {20: exit6}}, "local-accuracy": curves}
        return RunResult("depthfl", seed, curves, other_curves=others)

    results = [depth(1, 0.79, 0.81), depth(2, 0.80, 0.81), depth(3, 0.78, 0.80)]
    results += [RunResult("incl", s, {"strong": {20: v}}, other_curves={"local-accuracy": {"strong": {20: v}}})
                for s, v in ((1, 0.80), (2, 0.80), (3, 0.79))]  # fmt: skip
    # own deepest exit: ensemble - exit 6 = -0.02, -0.01, -0.02 -> mean -0.016667, SE 0.003333
    own = Claim("E", "the ensemble costs", "depthfl", "depthfl", "strong", direction="lower",
                metric="local-accuracy", metric_b="local-exit-6-accuracy")  # fmt: skip
    d = paired_difference(results, own)
    assert d.differences == pytest.approx((-0.02, -0.01, -0.02))
    assert d.mean == pytest.approx(-0.05 / 3) and d.se == pytest.approx(0.01 / 3)
    assert verdict(d, "lower") == "held"
    assert own.metrics() == ("local-accuracy", "local-exit-6-accuracy")
    # deepest exit vs another method's global model, b on the suite's metric: +0.01, +0.01, +0.01
    deepest = Claim("X", "deepest exit beats", "depthfl", "incl", "strong",
                    metric="local-exit-6-accuracy", metric_b="local-accuracy")  # fmt: skip
    assert paired_difference(results, deepest).differences == pytest.approx((0.01, 0.01, 0.01))
    row = claims_markdown([deepest], results).splitlines()[2]
    assert "| strong (local-exit-6-accuracy − local-accuracy), final (a higher) |" in row
    assert row.endswith("| +0.010 ± 0.000 | 3 | held |")
    # a trend on two metrics (c on a's metric, d on b's): depthfl's (ensemble - exit 6) minus that of
    # a row whose ensemble costs 0.005 on every seed -> -0.015, -0.005, -0.015
    wokd = {"local-accuracy": {"strong": {20: 0.8}}, "local-exit-6-accuracy": {"strong": {20: 0.805}}}
    results += [RunResult("wokd", s, {"strong": {20: 0.8}}, other_curves=wokd) for s in (1, 2, 3)]
    trend = Claim("T", "t", "depthfl", "depthfl", "strong", c="wokd", d="wokd",
                  metric="local-accuracy", metric_b="local-exit-6-accuracy")  # fmt: skip
    assert paired_difference(results, trend).differences == pytest.approx((-0.015, -0.005, -0.015))
    raw = [{"label": "E", "text": "t", "a": "x", "b": "x", "tier": "strong", "metric": "local-accuracy",
            "metric-b": "local-exit-6-accuracy"}]  # fmt: skip
    assert parse_claims(raw, "suite", ["x"])[0].b_metric == "local-exit-6-accuracy"
    with pytest.raises(ClaimError, match=r"claims\[0\]\.b: 'x' compared with itself.*'metric-b'"):
        parse_claims([{k: v for k, v in raw[0].items() if k != "metric-b"}], "suite", ["x"])
    assert Claim("C", "t", "x", "y", "s", metric="m").b_metric == "m"


def test_parse_claims_reads_a_claim_metric() -> None:
    raw = [{"label": "C9", "text": "t", "a": "x", "b": "y", "tier": "small", "metric": "local-accuracy-inverted"}]
    (claim,) = parse_claims(raw, "suite", ["x", "y"])
    assert claim.metric == "local-accuracy-inverted"


def test_a_trend_claim_pairs_the_difference_of_two_gains() -> None:
    # small-pool gain minus large-pool gain: (a - b) - (c - d) per seed
    # seed 1: (0.30 - 0.25) - (0.40 - 0.38) = 0.03; seed 2: 0.05 - 0.01 = 0.04; seed 3: 0.06 - 0.01 = 0.05
    finals = {
        "codist small": (0.30, 0.31, 0.32), "fedavg small": (0.25, 0.26, 0.26),
        "codist large": (0.40, 0.40, 0.41), "fedavg large": (0.38, 0.39, 0.40),
    }  # fmt: skip
    results = [run(label, s, {20: v[s - 1]}, tier="large") for label, v in finals.items() for s in (1, 2, 3)]
    results.append(run("codist small", 4, {20: 0.5}, tier="large"))  # seed 4 lacks three rows: not paired
    trend = Claim("T", "the gain shrinks", "codist small", "fedavg small", "large", c="codist large", d="fedavg large")
    d = paired_difference(results, trend)
    assert d.seeds == (1, 2, 3)
    assert d.differences == pytest.approx((0.03, 0.04, 0.05))
    assert d.mean == pytest.approx(0.04) and d.se == pytest.approx(0.01 / math.sqrt(3))
    assert verdict(d, "higher") == "held"
    row = claims_markdown([trend], results).splitlines()[2]
    assert "| (codist small − fedavg small) − (codist large − fedavg large) | large, final (a higher) |" in row
    assert row.endswith("| +0.040 ± 0.006 | 3 | held |")
    diverged = [*results[:-1], run("fedavg large", 5, {20: math.nan}, tier="large")]
    diverged += [run(label, 5, {20: 0.3}, tier="large") for label in ("codist small", "fedavg small", "codist large")]
    d5 = paired_difference(diverged, trend)
    assert d5.against == (5,) and verdict(d5, "higher") == "not held"
    assert "(a row diverged: seeds 5)" in claims_markdown([trend], diverged)


def test_parse_claims_reads_a_trend_and_rejects_half_of_one() -> None:
    labels = ["a", "b", "c", "d"]
    ok = {"label": "T", "text": "t", "a": "a", "b": "b", "c": "c", "d": "d", "tier": "large"}
    (claim,) = parse_claims([ok], "suite", labels)
    assert claim.is_trend and claim.rows() == (
        ("a", "large", ""),
        ("b", "large", ""),
        ("c", "large", ""),
        ("d", "large", ""),
    )
    for bad, match in (
        ({k: v for k, v in ok.items() if k != "d"}, "both 'c' and 'd'"),
        ({**ok, "c": "nope"}, r"claims\[0\]\.c: 'nope' is not a run label"),
        ({**ok, "statistic": "rounds-to-target", "target": 0.5, "direction": "lower"}, "trend claim"),
    ):
        with pytest.raises(ClaimError, match=match):
            parse_claims([bad], "suite", labels)
