"""Runs' per-round values at chosen rounds (deploy.curves) on exact numbers and on run folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy import curves


def write_run(root: Path, label: str, seed: int, curve: dict[int, float], tier: str = "small") -> None:
    folder = root / "runs" / f"{label.lower().replace(' ', '-')}-s{seed}"
    folder.mkdir(parents=True)
    (folder / "experiment.json").write_text(json.dumps({"label": label, "seed": seed}))
    rows = [{"round": r, "tiers": {tier: {"local-accuracy-inverted": v}}} for r, v in curve.items()]
    (folder / "rounds.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_values_at_and_differences_exact() -> None:
    saw = {r: (0.5 if r % 5 == 0 else 0.1) for r in range(0, 11)}  # jumps at each distillation, erased after
    flat = dict.fromkeys(range(0, 11), 0.05)
    assert curves.values_at(saw, [5, 9, 10]) == [0.5, 0.1, 0.5]
    with pytest.raises(
        curves.CurveError, match=r"rounds \[11\] were not measured \(the curve has 11 rounds between 0 and 10\)"
    ):
        curves.values_at(saw, [10, 11])
    runs = {("Periodic", 7): saw, ("FedAvg", 7): flat, ("Periodic", 8): saw}
    with pytest.raises(curves.CurveError, match="seed 8 has no finished run of 'FedAvg'"):
        curves.differences_to(runs, "FedAvg", [5])
    del runs[("Periodic", 8)]
    assert curves.differences_to(runs, "FedAvg", [5, 9]) == {("Periodic", 7): pytest.approx([0.45, 0.05])}


def test_parse_rounds_joins_lists_and_ranges_in_order() -> None:
    assert curves.parse_rounds(["5,9", "10:30:10"]) == [5, 9, 10, 20, 30]
    for bad in ("10:5:1", "5:10:0"):
        with pytest.raises(curves.CurveError, match="need STEP >= 1 and FIRST <= LAST"):
            curves.parse_rounds([bad])
    for bad in ("a,b", "1:2", "1:x:2"):
        with pytest.raises(curves.CurveError, match="expected R"):
            curves.parse_rounds([bad])


def test_command_prints_values_and_same_seed_differences(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_run(tmp_path, "PeriodicCodist", 42, {r: 0.1 + (0.4 if r % 5 == 0 else 0.0) for r in range(0, 11)})
    write_run(tmp_path, "FedAvg per pool", 42, dict.fromkeys(range(0, 11), 0.05))
    metric = ["--metric", "local-accuracy-inverted"]
    argv = [str(tmp_path), "--tier", "small", *metric, "--rounds", "5,9", "--rounds", "10"]
    assert curves.main(argv) == 0
    out = capsys.readouterr().out
    assert "| PeriodicCodist (seed 42) | 50.0 | 10.0 | 50.0 |" in out and "| FedAvg per pool (seed 42) | 5.0 |" in out
    assert curves.main([*argv, "--minus", "FedAvg per pool", "--only", "PeriodicCodist"]) == 0
    out = capsys.readouterr().out
    assert "| PeriodicCodist (seed 42) | +45.0 | +5.0 | +45.0 |" in out and "FedAvg per pool (seed 42) |" not in out
    with pytest.raises(SystemExit):  # nothing left to subtract the reference from
        curves.main([*argv, "--minus", "FedAvg per pool", "--only", "FedAvg per pool"])
    assert "--only names only the --minus row" in capsys.readouterr().err
    assert curves.main([*argv[:-1], "11"]) == 1
    assert "cannot read: rounds [11] were not measured" in capsys.readouterr().out
    assert curves.main([*argv[:2], "large", *argv[3:]]) == 1
    assert "no finished run" in capsys.readouterr().out
