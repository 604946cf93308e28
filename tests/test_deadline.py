"""The CI deadline of the chaos suite (deploy/deadline.py): exact estimates and verdicts."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.chaos import ChaosCluster, RunResult
from deploy.deadline import (
    DEADLINE_ENV,
    PACE_MARGIN,
    CaseCost,
    DeadlineError,
    case_estimate_s,
    read_deadline,
    skip_reason,
)


def test_the_estimate_is_rounds_times_the_pace_with_its_margin_plus_the_extra() -> None:
    assert PACE_MARGIN == 1.25
    assert case_estimate_s(CaseCost(rounds=10, extra_s=60.0), 60.0) == 10 * 60.0 * 1.25 + 60.0 == 810.0
    assert case_estimate_s(CaseCost(rounds=0, extra_s=5.0), 30.0) == 5.0
    with pytest.raises(ValueError, match="round_s"):
        case_estimate_s(CaseCost(rounds=3), 0.0)
    with pytest.raises(ValueError, match="rounds >= 0"):
        CaseCost(rounds=-1)


def test_a_case_fits_up_to_the_deadline_exactly_and_is_skipped_after_it_naming_the_figures() -> None:
    assert skip_reason(now=1000.0, deadline=None, estimate_s=1e9, round_s=60.0) is None
    assert skip_reason(now=1000.0, deadline=1810.0, estimate_s=810.0, round_s=60.0) is None
    reason = skip_reason(now=1000.0, deadline=1809.0, estimate_s=810.0, round_s=60.0)
    assert reason is not None
    assert "about 810 s needed at the 60 s per round" in reason and "809 s left" in reason and DEADLINE_ENV in reason
    past = skip_reason(now=2000.0, deadline=1809.0, estimate_s=1.0, round_s=60.0)
    assert past is not None and "0 s left" in past


def test_a_chaos_cluster_prices_a_case_at_its_slowest_pace_with_the_preload_and_an_unshared_reference(
    tmp_path: Path,
) -> None:
    cluster = ChaosCluster(tmp_path, nodes=2)  # not started: no process, no namespace
    cost = CaseCost(rounds=3, extra_s=120.0)
    # nothing has run here: the default pace, the first run's preload, the reference's 3 rounds
    assert cluster.case_estimate(cost, default_round_s=60.0, first_run_s=300.0, reference=("clean", 3)) == (
        6 * 60.0 * 1.25 + 120.0 + 300.0,
        60.0,
    )
    cluster.paces.extend([40.0, 50.0, 30.0])
    cluster.finished["clean"] = (("cfg", 3, tmp_path), RunResult("clean", [], 1.0))
    assert cluster.case_estimate(cost, default_round_s=60.0, first_run_s=300.0, reference=("clean", 3)) == (
        3 * 50.0 * 1.25 + 120.0,
        50.0,
    )


def test_the_deadline_is_read_from_the_environment_and_a_bad_value_names_the_variable() -> None:
    assert read_deadline({}) is None
    assert read_deadline({DEADLINE_ENV: " "}) is None
    assert read_deadline({DEADLINE_ENV: "1764644400"}) == 1764644400.0
    for bad in ("soon", "inf", "nan"):
        with pytest.raises(DeadlineError, match=DEADLINE_ENV):
            read_deadline({DEADLINE_ENV: bad})
