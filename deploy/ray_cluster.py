"""Ray simulation on a multi-node Ray cluster: how the address reaches Flower, and a local cluster.

How Flower 1.39 picks its Ray cluster
-------------------------------------
The simulation backend (``flwr/server/superlink/fleet/vce/backend/raybackend.py``,
``RayBackend.init_ray``) calls ``ray.init(runtime_env={"env_vars": {"PYTHONPATH": ...}},
**init_args)``, where ``init_args`` are only the federation config's ``init-args`` (``num-cpus``,
``num-gpus``, ``logging-level``, ``log-to-driver``): no address.  So an existing cluster is
reached only through ``RAY_ADDRESS`` in the environment of the ``flwr-simulation`` process, and
that process is a child of the SuperExec of the *local SuperLink*, which ``flwr run`` starts
detached (``flwr/cli/local_superlink.py``) the first time and reuses afterwards.  Hence:

* ``RAY_ADDRESS`` must be set when that SuperLink starts; set in the shell of a later
  ``flwr run`` that finds one already running, it never reaches the simulation, which then
  starts a private one-machine Ray instead.  :func:`deploy.launch.run_simulation` therefore
  refuses to run in a local SuperLink it did not start (:class:`ForeignSuperLinkError`).
* ``init-args`` ``num-cpus`` / ``num-gpus`` must stay unset (Ray refuses them with an address).
* Flower's actor pool sizes itself from every node's resources (``client-resources``), so the
  virtual clients spread over all nodes; each node must have the project importable at the
  same path as the head (``pip install -e .`` of the same checkout): Flower forwards only the
  head's ``sys.path`` as ``PYTHONPATH``, not the app's files.

:class:`LocalRayCluster` starts a head and worker nodes on this machine (``ray start --block``,
one process per node, each with its own CPU resources), as the multi-node test and
``docs/DEPLOYING.md`` use.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deploy.processes import parent_pid, pids_with

BIN = Path(sys.executable).parent
#: Object store per node (bytes): Ray's default takes 30 % of the RAM in /dev/shm per node.
OBJECT_STORE_BYTES = 200 * 1024 * 1024
#: The title Ray gives the process of Flower's virtual-client actor.
CLIENT_ACTOR_TITLE = "ray::ClientAppActor"


class RayAddressError(ValueError):
    """A ``RAY_ADDRESS`` that is malformed or where no Ray cluster answers."""


class ForeignSuperLinkError(RuntimeError):
    """A local simulation SuperLink this run did not start already holds Flower's local port."""


def parse_ray_address(address: str) -> tuple[str, int]:
    """``HOST:PORT`` of a Ray head's GCS; :class:`RayAddressError` naming the expected form otherwise."""
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or "/" in host or not port.isdigit() or not 0 < int(port) < 65536:
        raise RayAddressError(
            f"ray address {address!r}: expected HOST:PORT of a running Ray head's GCS, as `ray start --head "
            f"--port 6379` prints it (e.g. 10.0.0.5:6379); 'auto' and ray:// client addresses are not supported"
        )
    return host, int(port)


def port_open(host: str, port: int, timeout: float = 2.0) -> bool:
    """Whether a TCP connect to ``host:port`` succeeds within ``timeout`` seconds."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def check_ray_address(address: str) -> str:
    """The address, normalised, if a Ray head answers there; :class:`RayAddressError` with the fix if not."""
    host, port = parse_ray_address(address)
    if not port_open(host, port):
        raise RayAddressError(
            f"ray address {host}:{port}: nothing answers there; start the head first "
            f"(`ray start --head --port {port}`) and each worker with `ray start --address {host}:{port}`"
        )
    return f"{host}:{port}"


def local_superlink_port() -> int:
    """The port ``flwr run`` probes for its local simulation SuperLink (Flower 1.39's env override or 39091)."""
    from flwr.cli.constant import LOCAL_SUPERLINK_HTTP_API_PORT

    return int(LOCAL_SUPERLINK_HTTP_API_PORT)


def check_no_foreign_superlink(port: int | None = None) -> None:
    """:class:`ForeignSuperLinkError` if a local SuperLink already answers on Flower's local port.

    ``flwr run`` would submit to it, and the simulation would run with that SuperLink's
    environment (``RAY_ADDRESS``, ``FLWR_HOME``, the warm SuperExec) instead of this run's.
    """
    port = local_superlink_port() if port is None else port
    if port_open("127.0.0.1", port, timeout=0.5):
        raise ForeignSuperLinkError(
            f"a local simulation SuperLink started outside this run already serves 127.0.0.1:{port}; the "
            "simulation would run inside it with its environment, not this run's (RAY_ADDRESS, FLWR_HOME). "
            "Stop it (`pkill -f 'flower-superlink.*--simulation'`) or give this run other ports "
            "(FLWR_LOCAL_SUPERLINK_HTTP_API_PORT and FLWR_LOCAL_CONTROL_API_PORT)"
        )


@dataclass
class RayNode:
    """One ``ray start --block`` process: a Ray node and the processes it owns."""

    name: str
    cpus: int
    proc: subprocess.Popen[str]
    output: list[str] = field(default_factory=list)


class LocalRayCluster:
    """A head and worker Ray nodes on this machine, each a ``ray start --block`` process.

    ``cpus``: the CPU resources of the head, then of each worker (a node's own share: Flower
    places ``floor(cpus / client-resources-num-cpus)`` virtual-client actors on it).  Used as a
    context manager; leaving it stops every node (their processes end with the ``--block`` one).
    """

    def __init__(self, cpus: Sequence[int] = (1, 1), *, port: int = 6390, start_timeout: float = 90.0) -> None:
        if not cpus or any(c < 1 for c in cpus):
            raise ValueError(f"cpus {list(cpus)}: one CPU count >= 1 per node, the head's first")
        self.cpus = list(cpus)
        self.port = port
        self.start_timeout = start_timeout
        self.temp_dir = Path(tempfile.mkdtemp(prefix="hetfl-ray-"))
        self.nodes: list[RayNode] = []

    @property
    def address(self) -> str:
        """The head's GCS address, the value of ``RAY_ADDRESS``."""
        return f"127.0.0.1:{self.port}"

    def _start(self, name: str, cpus: int, role_args: list[str]) -> RayNode:
        cmd = [
            str(BIN / "ray"), "start", "--block", *role_args, f"--num-cpus={cpus}", "--num-gpus=0",
            f"--object-store-memory={OBJECT_STORE_BYTES}", "--disable-usage-stats",
        ]  # fmt: skip
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        # "0" (the Makefile exports it) makes `ray start --address` refuse worker nodes even on
        # Linux (ray_constants.ENABLE_RAY_CLUSTER); unset, Ray enables them everywhere but Windows/macOS
        env.pop("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", None)
        proc = subprocess.Popen(
            cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        node = RayNode(name, cpus, proc)
        self.nodes.append(node)  # stopped with the others even if it never reports started
        started = threading.Event()

        def pump() -> None:
            if proc.stdout is None:
                return
            for line in proc.stdout:
                node.output.append(line)
                if "Ray runtime started" in line:
                    started.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + self.start_timeout
        while not started.wait(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"ray node {name} did not start:\n{''.join(node.output[-30:])}")
        return node

    def start(self) -> LocalRayCluster:
        """Start the head, then each worker joined to it; return ``self``."""
        if port_open("127.0.0.1", self.port, timeout=0.5):
            raise RuntimeError(f"port {self.port} is taken: another Ray head (or service) runs there")
        head_args = [
            "--head", f"--port={self.port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
            f"--temp-dir={self.temp_dir}",
        ]  # fmt: skip
        try:
            self._start("head", self.cpus[0], head_args)
            for i, cpus in enumerate(self.cpus[1:], start=1):
                self._start(f"worker-{i}", cpus, [f"--address={self.address}", "--node-ip-address=127.0.0.1"])
        except BaseException:
            self.stop()  # the nodes that did start
            raise
        return self

    def node_of(self, pid: int) -> str | None:
        """The node (``head``, ``worker-1``, ...) whose ``ray start`` process is an ancestor of ``pid``."""
        owners = {n.proc.pid: n.name for n in self.nodes}
        seen = set()
        while pid > 1 and pid not in seen:
            if pid in owners:
                return owners[pid]
            seen.add(pid)
            pid = parent_pid(pid)
        return None

    def stop(self) -> None:
        """SIGTERM each node's process group, SIGKILL what is left after 20 s; remove the temp dir."""
        for node in reversed(self.nodes):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for node in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            with contextlib.suppress(ProcessLookupError):
                os.killpg(node.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.proc.wait(timeout=10)
        self.nodes.clear()
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def __enter__(self) -> LocalRayCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def client_actor_pids() -> list[int]:
    """Processes whose title is Flower's virtual-client actor (``ray::ClientAppActor...``)."""
    return pids_with(CLIENT_ACTOR_TITLE, prefix=True)
