"""The launcher's console (deploy/console.py): round lines with an ETA and the final verdict."""

from __future__ import annotations

from pathlib import Path

from deploy.console import eta_seconds, format_round, verdict_lines

ROW = {"round": 2, "seconds": 30.0, "elapsed": 80.0, "tiers": {"weak": {"local-accuracy": 0.61}}}


def test_eta_is_the_mean_round_times_the_rounds_left() -> None:
    assert eta_seconds(ROW, 10) == 320.0  # 80 s / 2 rounds * 8 rounds left
    assert eta_seconds({**ROW, "round": 0}, 10) is None
    assert eta_seconds(ROW, None) is None


def test_round_line_with_eta_and_without_after_the_last_round() -> None:
    assert format_round(ROW, "local-accuracy", 10, eta=True) == (
        "    round 2/10 (30.0 s): weak 0.610; about 5 min 20 s left"
    )
    assert format_round({**ROW, "round": 10}, "local-accuracy", 10, eta=True).endswith("weak 0.610")


def test_verdict_names_each_tier_against_the_majority_class(tmp_path: Path) -> None:
    summary = tmp_path / "summary.csv"
    summary.write_text(
        "method,tier,final-local-accuracy,final-fed-accuracy,best-local-accuracy,best-round,rounds,bytes-down,"
        "bytes-up,held-out,held-out-size,majority-rate,verdict\n"
        "inclusivefl,weak,0.566,,0.57,3,7,1,1,test,500,0.566,majority class\n"
        "inclusivefl,strong,0.79,,0.8,6,7,1,1,test,500,0.566,learns\n"
    )
    lines = verdict_lines(summary, wall_seconds=125)
    assert lines[0] == "inclusivefl after 7 rounds (2 min 05 s); test split, 500 examples, majority class 0.566:"
    assert lines[1] == "  weak    final 0.566  best 0.570 (round 3)  majority class"
    assert lines[2] == "  strong  final 0.790  best 0.800 (round 6)  learns"
    assert lines[3] == f"results: {tmp_path}"
