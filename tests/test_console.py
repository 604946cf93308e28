"""The launcher's console (deploy/console.py): round lines with an ETA and the final verdict."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from deploy import launch
from deploy.console import eta_seconds, format_round, run_warnings, traffic, verdict_lines

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


def test_round_line_names_the_bytes_the_round_moved() -> None:
    row = {**ROW, "tiers": {"weak": {"local-accuracy": 0.61, "bytes-down": 2_000_000, "bytes-up": 1_000_000},
                            "strong": {"bytes-down": 10_500_000, "bytes-up": 4_000_000}}}  # fmt: skip
    assert traffic(row) == "12.5 MB down, 5.0 MB up"
    assert format_round(row, "local-accuracy", 10) == "    round 2/10 (30.0 s): weak 0.610; 12.5 MB down, 5.0 MB up"
    assert traffic(ROW) is None


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


def test_verdict_repeats_the_warnings_once_each(tmp_path: Path) -> None:
    (tmp_path / "warnings.txt").write_text("variant 'medium' trains nowhere\nrun warning\n")
    found = run_warnings(tmp_path, ["variant 'medium' trains nowhere", "pre-flight only"])
    assert found == ["variant 'medium' trains nowhere", "pre-flight only", "run warning"]
    assert run_warnings(tmp_path / "missing", ["a"]) == ["a"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_smoke_run_console_stays_short_and_leaves_no_flower_home(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The README's one-minute smoke run, as a user starts it: few console lines, every tier trains.

    Issue 23: a default console under 40 lines for ``make demo`` (7 rounds); the smoke run's 3
    rounds get a tighter budget. Its temporary Flower home is gone afterwards.
    """
    temp = tmp_path / "tmp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    config = launch.ROOT / "deploy" / "configs" / "smoke.toml"
    code = launch.main(
        ["simulation", "--config", str(config), "--supernodes", "3", "--results-dir", str(tmp_path / "results"),
         "--run-name", "smoke"]
    )  # fmt: skip
    out = capsys.readouterr()
    assert code == 0, out.out + out.err
    lines = out.out.splitlines()
    assert len(lines) <= 16, out.out
    assert re.search(r"weak x1 \(\d+ MiB\) -> weak, medium x1 \(\d+ MiB\) -> medium, strong x1", lines[0]), lines[0]
    assert sum(line.startswith("    round ") for line in lines) == 4  # rounds 0-3
    assert any(line.startswith("results: ") for line in lines)
    assert list(temp.iterdir()) == []
    assert (tmp_path / "results" / "smoke" / "flower.log").stat().st_size > 0
