"""A SuperNode killed mid-round: the round completes without it, the failure names its real node id,
the next round runs without it, and the restarted SuperNode rejoins (under a new node id)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from deploy.cluster import (
    Cluster,
    Ports,
    node_config_for,
    submit_run,
    superlink_command,
    supernode_command,
    wait_port,
    wait_rounds,
    write_connection,
)
from tests.flower_runs import TINY, node_ids, read_rounds, tiny_budgets

PORTS = Ports(fleet=19492, control=19493, supernode=19494)
TIERS = ["weak", "medium", "strong"]


def clientapp_pids(group: int) -> list[int]:
    """ClientApp processes in process group ``group`` (the SuperNode's session): fresh
    ``flwr-clientapp`` processes, or children the warm SuperExec forked (named ``flwr-clientapp``)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            head, tail = stat.read_text().rsplit(")", 1)
            fields = tail.split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[2]) == group and (b"flwr-clientapp" in cmdline or head.endswith("(flwr-clientapp")):
            pids.append(int(stat.parent.name))
    return pids


@pytest.mark.slow
@pytest.mark.deploy
@pytest.mark.timeout(1200)
def test_killed_supernode_is_reported_skipped_and_rejoins(tmp_path: Path) -> None:
    home = tmp_path / "flwr-home"
    write_connection(home, "loopback", PORTS)
    results = tmp_path / "results"
    cfg = f"{TINY} num-server-rounds=3 min-available-nodes=2 tier-memory-mb='{tiny_budgets()}'"
    with Cluster(home, tmp_path / "logs") as cluster:
        cluster.start("superlink", superlink_command(
            fleet_address=f"127.0.0.1:{PORTS.fleet}", host="127.0.0.1", port=PORTS.control, database=home / "state.db",
        ))  # fmt: skip
        wait_port(PORTS.fleet)
        wait_port(PORTS.control)
        for i, tier in enumerate(TIERS):
            cluster.start(f"supernode-{tier}", supernode_command(
                superlink=f"127.0.0.1:{PORTS.fleet}", node_config=node_config_for(i, TIERS), port=PORTS.supernode + i,
            ))  # fmt: skip
        for tier in TIERS:
            cluster.wait_log(f"supernode-{tier}", r"SuperNode ID: \d+", 60)
        killed = node_ids(cluster.log("supernode-weak"))[-1]
        run = submit_run(cluster, "loopback", run_config=cfg, results_dir=results, run_name="kill")

        # mid-round: the weak node has just received round 1's train message (its own log says so;
        # the run's streamed log comes seconds later, by when a node with short idle waits may have
        # answered already), and a ClientApp is processing it
        cluster.wait_log("supernode-weak", r"Receiving: train message", 240)
        weak = cluster.procs["supernode-weak"].pid
        deadline = time.time() + 60
        while not clientapp_pids(weak):
            assert time.time() < deadline, "the weak SuperNode never started a ClientApp for round 1\n" + cluster.logs()
            time.sleep(0.05)
        cluster.kill("supernode-weak")
        killed_at = time.time()

        # round 2 is sent to the two live nodes only; then the node comes back
        wait_rounds(results / "kill", 1, 300, alive=cluster.procs["superlink"])
        round1_done = time.time() - killed_at
        cluster.wait_log("run", r"(?s)configure_train: 3 nodes.*configure_train: 2 nodes sampled", 120)
        size = len(cluster.log("supernode-weak"))
        cluster.restart("supernode-weak")
        cluster.wait_log("supernode-weak", r"SuperNode ID: \d+", 60, after=size)
        rejoined = node_ids(cluster.log("supernode-weak"))[-1]
        wait_rounds(results / "kill", 3, 600, alive=cluster.procs["superlink"])
        run.wait(timeout=120)

    rows = read_rounds(results / "kill")
    assert [r["round"] for r in rows] == [0, 1, 2, 3], cluster.logs()
    r1, r2 = rows[1], rows[2]
    # round 1 completed with the two remaining replies, and names the dead node by its real id
    assert "weak" not in r1["tiers"] or r1["tiers"]["weak"].get("clients", 0) == 0, r1
    assert r1["tiers"]["medium"]["clients"] == 1 and r1["tiers"]["strong"]["clients"] == 1, r1
    assert any(f"node {killed} (weak) train failed" in f for f in r1["failed"]), (killed, r1["failed"])
    # round 2 ran without it: nothing sent to it, so nothing failed
    assert r2["tiers"].get("weak", {}).get("clients", 0) == 0, r2
    assert r2["failed"] == [] and r2["tiers"]["medium"]["clients"] == 1, r2
    # the restarted node rejoined under a new id and trained again
    assert rejoined != killed
    assert rows[3]["tiers"]["weak"]["clients"] == 1, rows[3]
    assert rows[3]["failed"] == [], rows[3]
    print(f"round 1 finished {round1_done:.0f}s after the SIGKILL (it took {r1['seconds']:.0f}s in all)")
