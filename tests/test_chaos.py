"""The chaos suite (issue 22; ``make test-chaos``): faults on a real deployment of 10 SuperNodes.

A SuperLink and 10 SuperNodes, each in its own network namespace, each SuperNode's gRPC stream
through its own delaying relay (:class:`deploy.chaos.ChaosCluster`), the tiny model.  Every case
is bounded in time and asserts what the system did.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from deploy.chaos import ChaosCluster, Delay
from deploy.netns import namespaces_available
from tests.flower_runs import TINY, tiny_budgets

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

NODES = 10
ROUNDS = 3
#: Where the cases leave their measured figures (docs/DEPLOYING.md, "Failure modes").
FIGURES = Path(__file__).resolve().parent.parent / "results" / "chaos"


def _cluster(tmp_path: Path) -> ChaosCluster:
    reason = namespaces_available(("ip", "nft"))
    if reason is not None:
        pytest.fail(f"the chaos suite needs network namespaces and nftables: {reason} (`make chaos-tools` as root)")
    return ChaosCluster(tmp_path, nodes=NODES)


def _config() -> str:
    return f"{TINY} tier-memory-mb='{tiny_budgets()}' round-timeout=180.0"


def _rounds_once(rows: list[dict], rounds: int) -> None:
    assert [r["round"] for r in rows] == list(range(rounds + 1)), [r["round"] for r in rows]


@pytest.mark.timeout(1500)
def test_lossy_slow_links_every_round_completes_once(tmp_path: Path) -> None:
    """5 % loss each way and 100 ± 30 ms each way on every SuperNode's link, against the clean run."""
    with _cluster(tmp_path) as chaos:
        clean = chaos.run("clean", _config(), ROUNDS)
        chaos.set_faults(loss_percent=5, delay=Delay(100, 30))
        faulty = chaos.run("faulty", _config(), ROUNDS)
        dropped = chaos.dropped()
    for result in (clean, faulty):
        _rounds_once(result.rows, ROUNDS)
        trained = sum(t["clients"] for t in result.rows[-1]["tiers"].values())
        assert trained + len(result.rows[-1]["failed"]) == NODES, result.rows[-1]
    assert dropped > 0  # the rules really dropped packets during the faulty run
    # rounds 2.. of each: the clean run's round 1 also pays the nodes' first imports and model
    clean_s, faulty_s = statistics.median(clean.round_seconds(2)), statistics.median(faulty.round_seconds(2))
    figures = {
        "nodes": NODES, "rounds": ROUNDS, "loss-percent-each-way": 5, "delay-ms-each-way": "100 ± 30",
        "clean-round-seconds": clean.round_seconds(), "faulty-round-seconds": faulty.round_seconds(),
        "median-inflation-rounds-2-on": faulty_s / clean_s, "wall-seconds": [clean.seconds, faulty.seconds],
        "dropped-packets": dropped,
        "failed-replies": [len(r["failed"]) for r in faulty.rows[1:]],
    }  # fmt: skip
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / "lossy-links.json").write_text(json.dumps(figures, indent=1))
    print("lossy, slow links:", figures)
