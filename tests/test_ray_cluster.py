"""Ray simulation beyond one machine (issue 21 item 8): ``RAY_ADDRESS`` reaches ``flwr-simulation``.

The multi-node test starts a Ray head and a worker node on this machine (each its own
``ray start`` with one CPU), runs the app through :func:`deploy.launch.run_simulation` with
``ray_address`` set, and watches Flower's virtual-client actors while it runs: each actor
process is mapped to the node whose ``ray start`` owns it, and both nodes must have hosted
one that trained (used CPU), while the run completes every round with every client.
"""

from __future__ import annotations

import socket
import threading
from pathlib import Path

import pytest

from deploy.launch import run_simulation
from deploy.processes import cpu_seconds
from deploy.ray_cluster import (
    ForeignSuperLinkError,
    LocalRayCluster,
    RayAddressError,
    check_no_foreign_superlink,
    check_ray_address,
    client_actor_pids,
    parse_ray_address,
)
from tests.flower_runs import TINY, read_rounds


def test_ray_addresses_parse_or_name_the_expected_form() -> None:
    assert parse_ray_address("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert parse_ray_address(" head.local:6390 ") == ("head.local", 6390)
    for bad in ("auto", "ray://head:10001", "head", ":6379", "head:0", "head:99999", "head:port"):
        with pytest.raises(RayAddressError, match="HOST:PORT"):
            parse_ray_address(bad)


def _listening() -> tuple[socket.socket, int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock, sock.getsockname()[1]


def test_a_ray_address_where_nothing_answers_is_refused_with_the_command_that_starts_a_head() -> None:
    sock, port = _listening()
    assert check_ray_address(f"127.0.0.1:{port}") == f"127.0.0.1:{port}"
    sock.close()
    with pytest.raises(RayAddressError, match=f"ray start --head --port {port}"):
        check_ray_address(f"127.0.0.1:{port}")


def test_a_local_superlink_this_run_did_not_start_is_refused_not_reused() -> None:
    sock, port = _listening()
    with pytest.raises(ForeignSuperLinkError, match="FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"):
        check_no_foreign_superlink(port)
    sock.close()
    check_no_foreign_superlink(port)


def test_run_simulation_refuses_an_unreachable_ray_address_before_starting_anything(tmp_path: Path) -> None:
    sock, port = _listening()
    sock.close()
    with pytest.raises(RayAddressError):
        run_simulation(
            supernodes=2, run_config=TINY, results_dir=tmp_path, run_name="never", ray_address=f"127.0.0.1:{port}",
            echo=False, lock=None,
        )  # fmt: skip
    assert not (tmp_path / "never").exists()


class ActorWatch(threading.Thread):
    """Per Ray node of ``cluster``: the virtual-client actor processes seen and their CPU seconds."""

    def __init__(self, cluster: LocalRayCluster) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.cpu: dict[int, float] = {}
        self.node: dict[int, str] = {}
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.5):
            for pid in client_actor_pids():
                name = self.node.get(pid) or self.cluster.node_of(pid)
                if name is None:  # an actor of another Ray instance on this machine
                    continue
                self.node[pid] = name
                self.cpu[pid] = max(self.cpu.get(pid, 0.0), cpu_seconds(pid))

    def per_node(self) -> dict[str, tuple[int, float]]:
        out: dict[str, tuple[int, float]] = {}
        for pid, name in self.node.items():
            actors, cpu = out.get(name, (0, 0.0))
            out[name] = (actors + 1, cpu + self.cpu.get(pid, 0.0))
        return out


@pytest.mark.slow
@pytest.mark.deploy
@pytest.mark.timeout(900)
def test_a_simulation_spreads_its_virtual_clients_over_two_ray_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # as under `make`, which exports it: "0" would make `ray start --address` refuse a worker node
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    with LocalRayCluster(cpus=(1, 1), port=6390) as cluster:
        watch = ActorWatch(cluster)
        watch.start()
        try:
            outcome = run_simulation(
                supernodes=4, run_config=f"{TINY} num-server-rounds=2", results_dir=tmp_path, run_name="ray2",
                flwr_home=tmp_path / "flwr-home", echo=False, cpus_per_client=1.0, ray_address=cluster.address,
            )  # fmt: skip
        finally:
            watch.done.set()
            watch.join()
    assert outcome.ok, outcome.log[-4000:]
    per_node = watch.per_node()
    print("virtual-client actors per Ray node (count, CPU s):", per_node)
    # Flower placed one actor per node (1 CPU each, 1 CPU per client), and both trained
    assert set(per_node) == {"head", "worker-1"}, per_node
    assert all(actors == 1 and cpu > 1.0 for actors, cpu in per_node.values()), per_node
    rows = read_rounds(tmp_path / "ray2")
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(r["failed"] == [] and r["rejected"] == [] for r in rows[1:]), rows
