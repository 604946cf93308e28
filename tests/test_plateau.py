"""The validation presets' plateau rule (deploy.plateau) on exact numbers and on run folders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy import plateau


def test_window_mean_and_gap_exact() -> None:
    curve = {r: r / 100 for r in range(0, 25)}  # rises one point a round
    assert plateau.window_mean(curve, 5, 8) == pytest.approx(0.065)
    # m_8 over rounds 5..8 = 0.065, tail 21..24 = 0.225: still rising by 16 points
    assert plateau.settled_gap(curve, 8, window=4, tail=(21, 24)) == pytest.approx(-0.16)
    with pytest.raises(plateau.PlateauError, match=r"rounds \[25\] were not measured"):
        plateau.window_mean(curve, 22, 25)
    with pytest.raises(plateau.PlateauError, match="empty window"):
        plateau.window_mean(curve, 9, 8)


def test_first_settled_needs_every_run_at_the_same_candidate() -> None:
    flat = {r: 0.8 for r in range(1, 25)}
    late = {r: (0.7 if r <= 10 else 0.8) for r in range(1, 25)}  # settles from R = 14 (rounds 11..14)
    # dips at 13..16: settled at 12 (9..12 all 0.8) but not at 16; the rule takes the first R for all
    dip = {r: (0.7 if 13 <= r <= 16 else 0.8) for r in range(1, 25)}
    candidates = [8, 12, 16, 20, 24]

    def settle(curves: dict[str, dict[int, float]], candidates: list[int]) -> int | None:
        return plateau.first_settled(curves, candidates, window=4, tail=(21, 24), tolerance=0.01)

    assert settle({"flat": flat}, candidates) == 8
    assert settle({"flat": flat, "late": late}, candidates) == 16
    assert settle({"late": late, "dip": dip}, candidates) == 20
    # a gap of exactly the tolerance counts: rounds 5..8 at 0.79, tail at 0.80
    edge = {r: (0.79 if r <= 8 else 0.8) for r in range(1, 25)}
    assert settle({"edge": edge}, candidates) == 8
    assert settle({"late": late}, [8, 12]) is None


def test_command_judges_the_runs_of_an_out_folder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for label, curve in (("A", {r: 0.8 for r in range(0, 25)}), ("B", {r: min(0.8, r / 20) for r in range(0, 25)})):
        folder = tmp_path / "runs" / f"{label.lower()}-s7"
        folder.mkdir(parents=True)
        (folder / "experiment.json").write_text(json.dumps({"label": label, "seed": 7}))
        rows = [{"round": r, "tiers": {"iot": {"fed-accuracy": v}}} for r, v in curve.items()]
        (folder / "rounds.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    argv = [str(tmp_path), "--tier", "iot", "--metric", "fed-accuracy", "--window", "4"]
    assert plateau.main([*argv, "--candidates", "8:24:4", "--tail", "21:24"]) == 0
    out = capsys.readouterr().out
    # B: rounds 5..8 average 0.325 (-47.5 points); 13..16 = 0.65, 0.70, 0.75, 0.80 -> m_16 = 0.725 (-7.5)
    assert "| B (seed 7) | -47.50 | -27.50 | -7.50 | +0.00 | +0.00 |" in out
    assert "every run is within the tolerance (1 points): R = 20" in out
    assert plateau.main([*argv, "--candidates", "8:24:4", "--tail", "21:24", "--only", "A"]) == 0
    assert "B (seed 7)" not in capsys.readouterr().out
    assert plateau.main([*argv, "--candidates", "8:28:4", "--tail", "21:24"]) == 1
    assert "cannot judge: rounds [25, 26, 27, 28] were not measured" in capsys.readouterr().out
    for bad in ("8:24:0", "24:8:4", "2:24:4"):  # no step, empty, a window reaching before round 0
        with pytest.raises(SystemExit):
            plateau.main([*argv, "--candidates", bad, "--tail", "21:24"])
    assert plateau.main([str(tmp_path), "--tier", "strong", "--window", "4", "--candidates", "8:24:4",
                         "--tail", "21:24"]) == 1  # fmt: skip
