"""Multi-host on one machine: SuperLink and SuperNodes in separate network namespaces.

The test builds the "hosts" itself (:class:`deploy.netns.HostNetwork`): one namespace for
the SuperLink, one per SuperNode, each SuperNode linked to the SuperLink by its own veth
pair.  The SuperNodes dial the SuperLink's veth address; the gRPC connections cross the
namespace boundary (checked with ``ss`` inside the SuperLink's namespace), and one round of
the tiny model completes.
"""

from __future__ import annotations

import subprocess
import sys
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
from deploy.netns import HostNetwork, NamespaceError, namespaces_available
from tests.flower_runs import TINY, read_rounds, tiny_budgets, tiny_depths

PORTS = Ports(fleet=19292, control=19293, supernode=19294)
TIERS = ["weak", "strong"]


def peers(net: HostNetwork, port: int) -> set[str]:
    """Remote addresses of established TCP connections to ``port`` in the SuperLink's namespace."""
    out = subprocess.run(
        [*net.prefix(net.server), "ss", "-tnH", "state", "established", f"( sport = :{port} )"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    hosts = {line.split()[-1].rsplit(":", 1)[0] for line in out.splitlines() if line.strip()}
    return {h.strip("[]").removeprefix("::ffff:") for h in hosts}  # IPv4 on a dual-stack socket


@pytest.mark.slow
@pytest.mark.deploy
@pytest.mark.timeout(600)
def test_supernodes_in_other_namespaces_train_over_grpc(tmp_path: Path) -> None:
    reason = namespaces_available(("ip", "ss"))
    if reason is not None:
        pytest.skip(reason)
    home = tmp_path / "flwr-home"
    write_connection(home, "netns", PORTS)  # the CLI runs inside the SuperLink's namespace
    results = tmp_path / "results"
    try:
        net = HostNetwork(nodes=len(TIERS)).create()
    except NamespaceError as exc:
        pytest.skip(f"cannot create network namespaces here: {exc}")
    try:
        with Cluster(home, tmp_path / "logs") as cluster:
            server = net.prefix(net.server)
            cluster.start("superlink", superlink_command(
                fleet_address=f"0.0.0.0:{PORTS.fleet}", host="127.0.0.1", port=PORTS.control,
                database=home / "state.db",
            ), prefix=server)  # fmt: skip
            wait_port(PORTS.fleet, prefix=server)
            wait_port(PORTS.control, prefix=server)
            # the SuperLink is not reachable on a node's own loopback: the namespaces are real hosts
            probe = f"import socket,sys; sys.exit(socket.socket().connect_ex(('127.0.0.1', {PORTS.fleet})))"
            assert subprocess.run([*net.prefix(net.node(0)), sys.executable, "-c", probe], check=False).returncode != 0
            for i, tier in enumerate(TIERS):
                cluster.start(f"supernode-{tier}", supernode_command(
                    superlink=f"{net.server_address(i)}:{PORTS.fleet}", node_config=node_config_for(i, TIERS),
                    port=PORTS.supernode + i,
                ), prefix=net.prefix(net.node(i)))  # fmt: skip
            for tier in TIERS:
                cluster.wait_log(f"supernode-{tier}", r"SuperNode ID: \d+", 90)
            connected = peers(net, PORTS.fleet)
            cfg = f"{TINY} num-server-rounds=1 min-available-nodes=2 tier-memory-mb='{tiny_budgets()}'"
            run = submit_run(cluster, "netns", run_config=cfg, results_dir=results, run_name="netns", prefix=server)
            wait_rounds(results / "netns", 1, 400, alive=cluster.procs["superlink"])
            run.wait(timeout=120)
            logs = cluster.logs()
    finally:
        net.remove()
    assert connected == {net.node_address(i) for i in range(len(TIERS))}, connected
    rows = read_rounds(results / "netns")
    assert [r["round"] for r in rows] == [0, 1], logs
    depths = tiny_depths()
    for tier in TIERS:
        assert rows[1]["tiers"][tier]["clients"] == 1, rows[1]
        assert rows[1]["tiers"][tier]["layers"] == depths[tier], rows[1]
    assert rows[1]["failed"] == [] and rows[1]["rejected"] == [], rows[1]


def _members(namespace: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False)
    return out.stdout.split()


@pytest.mark.deploy
@pytest.mark.timeout(60)
def test_removing_the_namespaces_kills_what_still_runs_inside() -> None:
    """A process left in a namespace (a stuck ServerApp) does not outlive the network it ran in."""
    reason = namespaces_available(("ip",))
    if reason is not None:
        pytest.fail(f"this test needs network namespaces: {reason}")
    net = HostNetwork(nodes=1).create()
    try:
        proc = subprocess.Popen([*net.prefix(net.server), sys.executable, "-c", "import time; time.sleep(60)"])
        deadline = time.monotonic() + 10
        while not _members(net.server):
            assert time.monotonic() < deadline, "the process never appeared in its namespace"
            time.sleep(0.1)
    finally:
        net.remove()
    assert proc.wait(timeout=10) == -9  # SIGKILLed by remove()
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False).stdout
    assert net.server not in listed
