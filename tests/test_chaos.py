"""The chaos suite (issue 22; ``make test-chaos``): faults on a real deployment of 10 SuperNodes.

A SuperLink and 10 SuperNodes, each in its own network namespace, each SuperNode's gRPC stream
through its own delaying relay (:class:`deploy.chaos.ChaosCluster`), the tiny model.  Every case
is bounded in time and asserts what the system did.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from deploy.chaos import ChaosCluster, Delay
from deploy.netns import namespaces_available
from tests.flower_runs import TINY, node_ids, tiny_budgets

pytestmark = [pytest.mark.chaos, pytest.mark.slow]

NODES = 10
ROUNDS = 3
#: Where the cases leave their measured figures (docs/DEPLOYING.md, "Failure modes").
FIGURES = Path(__file__).resolve().parent.parent / "results" / "chaos"


@pytest.fixture(scope="module")
def chaos(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosCluster]:
    """One 10-node cluster for the module's cases (each sets its own faults first)."""
    reason = namespaces_available(("ip", "nft"))
    if reason is not None:
        pytest.fail(f"the chaos suite needs network namespaces and nftables: {reason} (`make chaos-tools` as root)")
    with ChaosCluster(tmp_path_factory.mktemp("chaos"), nodes=NODES) as cluster:
        yield cluster


def _config(round_timeout: float = 180.0) -> str:
    return f"{TINY} tier-memory-mb='{tiny_budgets()}' round-timeout={round_timeout}"


def _rounds_once(rows: list[dict], rounds: int) -> None:
    assert [r["round"] for r in rows] == list(range(rounds + 1)), [r["round"] for r in rows]


@pytest.mark.timeout(1500)
def test_lossy_slow_links_every_round_completes_once(chaos: ChaosCluster) -> None:
    """5 % loss each way and 100 ± 30 ms each way on every SuperNode's link, against the clean run."""
    chaos.set_faults()
    clean = chaos.run("clean", _config(), ROUNDS)
    chaos.set_faults(loss_percent=5, delay=Delay(100, 30))
    try:
        faulty = chaos.run("faulty", _config(), ROUNDS)
        dropped = chaos.dropped()
    finally:
        chaos.set_faults()
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


@pytest.mark.timeout(1500)
def test_a_flapping_node_holds_no_round_past_the_timeout_and_rejoins(chaos: ChaosCluster) -> None:
    """One SuperNode SIGKILLed while it trains and restarted, three times in one run (round timeout 60 s)."""
    timeout, rounds, cycles = 60.0, 5, 3
    chaos.set_faults()
    cluster = chaos.processes
    name = chaos.names[0]
    ids = node_ids(cluster.log(name))[-1:]
    started = chaos.submit("flap", _config(timeout), rounds)
    for _ in range(cycles):
        cluster.wait_log(name, r"Receiving: train message", 600, after=len(cluster.log(name)))
        cluster.kill(name)
        time.sleep(2.0)
        at = len(cluster.log(name))
        cluster.restart(name)
        ids.append(int(cluster.wait_log(name, r"SuperNode ID: (\d+)", 180, after=at).group(1)))
    rejoined_at = len(cluster.log(name))
    result = chaos.finish("flap", rounds, started, timeout=1200)
    after = cluster.log(name)[rejoined_at:]
    _rounds_once(result.rows, rounds)
    seconds = result.round_seconds()
    # a round waits for its train replies and then its evaluate replies, each at most the timeout
    assert max(seconds) <= 2 * timeout + 30, seconds
    failures = [f for r in result.rows[1:] for f in r["failed"]]
    flapper = [f for f in failures if any(f.startswith(f"node {i} ") for i in ids)]
    assert len(flapper) >= cycles, (ids, failures)  # every kill is reported, with that run's node id
    assert flapper == failures, (ids, failures)  # and nothing else failed
    assert len(set(ids)) == cycles + 1, ids  # it rejoined under a new id each time
    # after its last restart it received work and trained: every node trained in the last round
    assert "Receiving: train message" in after, after[-2000:]
    last = result.rows[-1]
    assert sum(t["clients"] for t in last["tiers"].values()) == NODES and last["failed"] == [], last
    figures = {
        "nodes": NODES, "round-timeout-s": timeout, "kills": cycles, "node-ids": ids,
        "round-seconds": seconds, "failed-per-round": [len(r["failed"]) for r in result.rows[1:]],
        "wall-seconds": result.seconds,
    }  # fmt: skip
    FIGURES.mkdir(parents=True, exist_ok=True)
    (FIGURES / "flapping-node.json").write_text(json.dumps(figures, indent=1))
    print("flapping node:", figures)
