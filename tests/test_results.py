"""Results writer on fixed fake rounds: jsonl, summary.csv, plot."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from server.results import ResultsWriter, majority_rate, verdict
from strategies.replies import RoundReport


def test_writer_outputs(tmp_path: Path) -> None:
    w = ResultsWriter(
        tmp_path / "run",
        method="inclusivefl",
        tiers=["weak", "strong"],
        config={"beta": 0.2},
        held_out=("validation", 1084, 0.58),
    )
    w.write_round(0, {"weak": {"accuracy": 0.5, "loss": 0.7}, "strong": {"accuracy": 0.55, "loss": 0.69}}, None)
    for rnd, (wa, sa) in enumerate(((0.6, 0.7), (0.58, 0.8)), start=1):
        rep = RoundReport(rnd)
        rep.add("weak", "bytes-down", 100)
        rep.add("weak", "bytes-up", 40)
        rep.add("strong", "bytes-down", 300)
        rep.rejected.append("node 3 (weak): NaN")
        w.write_round(rnd, {"weak": {"accuracy": wa, "loss": 0.6}, "strong": {"accuracy": sa, "loss": 0.5}}, rep)
    w.finish()
    rows = [json.loads(x) for x in (tmp_path / "run" / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert rows[2]["global-accuracy"] == 0.8  # the strongest tier's model
    assert rows[1]["tiers"]["weak"]["bytes-down"] == 100 and rows[1]["rejected"] == ["node 3 (weak): NaN"]
    summary = {r["tier"]: r for r in csv.DictReader((tmp_path / "run" / "summary.csv").open())}
    assert float(summary["weak"]["final-local-accuracy"]) == 0.58
    assert float(summary["weak"]["best-local-accuracy"]) == 0.6 and summary["weak"]["best-round"] == "1"
    assert summary["weak"]["bytes-down"] == "200" and summary["strong"]["bytes-down"] == "600"
    assert (tmp_path / "run" / "accuracy.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "run" / "config.json").read_text()) == {"beta": 0.2}
    assert summary["weak"]["held-out"] == "validation" and summary["weak"]["held-out-size"] == "1084"
    assert float(summary["weak"]["majority-rate"]) == 0.58
    assert summary["weak"]["verdict"] == "majority class" and summary["strong"]["verdict"] == "learns"


def test_majority_rate_and_verdict_on_exact_numbers() -> None:
    assert majority_rate([1, 0, 1, 1]) == 0.75
    assert majority_rate([]) == 0.0
    assert verdict(0.666, 0.566) == "learns"
    assert verdict(0.65, 0.566) == "weak"
    assert verdict(0.57, 0.566) == "majority class"
    assert verdict(None, 0.5) == "-"
