"""A Flower deployment as processes: one SuperLink, tiered SuperNodes over gRPC, the run submitted to it.

The building blocks: the commands (:func:`superlink_command`, :func:`supernode_command`), TLS and
SuperNode authentication material (:class:`Security`), a set of started processes
(:class:`Cluster`) and the run submitted to it (:func:`submit_run`, :func:`wait_rounds`).
:func:`run_loopback` runs a whole deployment on 127.0.0.1 (``python -m deploy.launch loopback``);
:func:`host_commands` prints the same for separate machines; the deployment tests run the blocks
in network namespaces (:mod:`deploy.netns`) or under memory cgroups (:mod:`deploy.cgroup`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from deploy.flower import ROOT, RunOutcome, flower_env, flower_home, flwr_cli, run_config_arg
from deploy.ray_cluster import port_open
from experiment.outputs import ROUNDS_FILE

ERROR_LINE = re.compile(r"ERROR|Traceback|UnexpectedError|Exception:")
"""A log line that reports a failure (Flower's level name, Python's traceback, an RPC's exception)."""


@dataclass
class Ports:
    """Loopback ports: Fleet API (gRPC), Control/Runtime API, first SuperNode port."""

    fleet: int = 9092
    control: int = 9093
    supernode: int = 9094


@dataclass(frozen=True)
class Security:
    """TLS files of a SuperLink (see :mod:`deploy.certs`) and whether SuperNodes must authenticate.

    With ``auth`` every SuperNode needs a private key whose public key was registered with
    ``flwr supernode register`` (:func:`register_supernode`) before it connects.
    """

    ca_cert: Path
    server_cert: Path
    server_key: Path
    auth: bool = False

    @classmethod
    def generate(
        cls, folder: Path, hosts: Sequence[str] = ("localhost", "127.0.0.1"), *, auth: bool = False
    ) -> Security:
        """Make a CA and a SuperLink certificate for ``hosts`` in ``folder`` (kept if present)."""
        from deploy.certs import make_server_cert

        if not (folder / "server.pem").exists():
            make_server_cert(folder, list(hosts))
        return cls(folder / "ca.crt", folder / "server.pem", folder / "server.key", auth)


def superlink_command(
    *, fleet_address: str, host: str, port: int, database: Path | None, security: Security | None = None
) -> list[str]:
    """``flower-superlink`` over gRPC (``grpc-rere``), runtime installs off, optionally TLS + auth.

    Run as ``python -m server.superlink`` (Flower's SuperLink with SQLite's busy timeout raised,
    ``HETFL_SQLITE_BUSY_TIMEOUT_MS``).
    """
    cmd = [
        sys.executable, "-m", "server.superlink", "--disable-runtime-dependency-installation",
        "--fleet-api-type", "grpc-rere", "--fleet-api-address", fleet_address, "--host", host, "--port", str(port),
    ]  # fmt: skip
    if database is not None:
        cmd += ["--database", str(database)]
    if security is None:
        return [*cmd, "--insecure"]
    cmd += [
        "--ssl-ca-certfile", str(security.ca_cert),
        "--ssl-certfile", str(security.server_cert),
        "--ssl-keyfile", str(security.server_key),
    ]  # fmt: skip
    return [*cmd, "--enable-supernode-auth"] if security.auth else cmd


def supernode_command(
    *,
    superlink: str,
    node_config: str,
    port: int,
    root_certificates: Path | None = None,
    auth_key: Path | None = None,
    host: str = "127.0.0.1",
    extra: Sequence[str] = (),
) -> list[str]:
    """``flower-supernode`` dialing ``superlink`` (``HOST:PORT`` of the Fleet API).

    Run as ``python -m client.supernode`` (Flower's SuperNode with its idle waits shortened,
    ``HETFL_SUPERNODE_IDLE_S``; ``3`` restores Flower's).
    """
    cmd = [sys.executable, "-m", "client.supernode", "--grpc-rere", "--superlink", superlink]
    cmd += ["--root-certificates", str(root_certificates)] if root_certificates else ["--insecure"]
    if auth_key is not None:
        cmd += ["--auth-supernode-private-key", str(auth_key)]
    return [*cmd, "--node-config", node_config, "--host", host, "--port", str(port), *extra]


def write_connection(
    home: Path, name: str, ports: Ports, *, root_certificates: Path | None = None, host: str = "127.0.0.1"
) -> None:
    """Write a ``[superlink.<name>]`` connection to ``$FLWR_HOME/config.toml``, replacing one of that name.

    Writing it twice (a cluster started again on the same home) leaves one table: a second
    ``[superlink.<name>]`` would make the file invalid TOML, and every ``flwr`` command after it fail.
    """
    home.mkdir(parents=True, exist_ok=True)
    cfg = home / "config.toml"
    text = without_table(cfg.read_text() if cfg.exists() else "", f"superlink.{name}")
    text += f'\n[superlink.{name}]\naddress = "{host}:{ports.control}"\n'
    text += f'root-certificates = "{root_certificates}"\n' if root_certificates else "insecure = true\n"
    cfg.write_text(text)


def without_table(text: str, table: str) -> str:
    """``text`` (TOML) without the table ``[table]``: its header line and every line up to the next header."""
    out: list[str] = []
    inside = False
    for line in text.splitlines(keepends=True):
        stripped = line.strip()
        if stripped.startswith("["):
            inside = stripped == f"[{table}]"
        if not inside:
            out.append(line)
    return "".join(out).rstrip("\n") + ("\n" if out else "")


def wait_port(port: int, timeout: float = 60.0, host: str = "127.0.0.1", prefix: Sequence[str] = ()) -> None:
    """Wait until something listens on ``host:port`` (probed inside ``prefix``'s namespace); else TimeoutError."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if prefix:  # inside another network namespace: probe from there
            probe = f"import socket,sys; sys.exit(socket.socket().connect_ex(({host!r}, {port})))"
            if subprocess.run([*prefix, sys.executable, "-c", probe], capture_output=True, check=False).returncode == 0:
                return
        elif port_open(host, port, timeout=1.0):
            return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout:.0f}s")


class Cluster:
    """Flower processes of one deployment, each in its own session with a log file; all stopped on exit.

    ``start`` takes an optional command ``prefix`` (``ip netns exec NS`` to run on another
    "host") and ``preexec`` (:meth:`deploy.cgroup.MemoryCgroup.enter` for a memory limit).
    """

    def __init__(self, home: Path, log_dir: Path) -> None:
        self.home = home
        self.env = flower_env(home)
        self.log_dir = log_dir
        log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.commands: dict[str, tuple[list[str], Sequence[str], Callable[[], None] | None]] = {}

    def start(
        self,
        name: str,
        cmd: list[str],
        *,
        prefix: Sequence[str] = (),
        preexec: Callable[[], None] | None = None,
    ) -> subprocess.Popen[bytes]:
        """Start ``cmd`` as ``name`` (its log is ``log_dir/name.log``, appended to on restart)."""
        out = (self.log_dir / f"{name}.log").open("ab")
        self.commands[name] = (cmd, prefix, preexec)
        self.procs[name] = subprocess.Popen(
            [*prefix, *cmd], cwd=ROOT, env=self.env, stdout=out, stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=preexec,
        )  # fmt: skip
        out.close()
        return self.procs[name]

    def restart(self, name: str) -> subprocess.Popen[bytes]:
        """Start ``name`` again with the command it was started with."""
        cmd, prefix, preexec = self.commands[name]
        return self.start(name, cmd, prefix=prefix, preexec=preexec)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to ``name`` and every process it started, and reap it."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=15)

    def log(self, name: str) -> str:
        """Everything ``name`` printed so far."""
        path = self.log_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_log(self, name: str, pattern: str, timeout: float, *, after: int = 0) -> re.Match[str]:
        """Wait until ``name``'s log (from character ``after``) matches ``pattern``."""
        deadline = time.time() + timeout
        while True:
            if m := re.search(pattern, self.log(name)[after:]):
                return m
            if time.time() > deadline:
                raise TimeoutError(
                    f"{name}: no {pattern!r} after {timeout:.0f}s; log tail:\n{self.log(name)[-2000:]}\n{self.errors()}"
                )
            time.sleep(0.2)

    def errors(self, limit: int = 12) -> str:
        """The last ``limit`` error lines of each log (for the message of a stalled run's timeout).

        A run that stops making progress often broke elsewhere: the SuperLink logs an unexpected
        exception of one of its RPCs (``[PushMessages][UnexpectedError:...]``), the ServerApp a
        traceback. Those lines, not the waited-for process's tail, say where.
        """
        parts = []
        for path in sorted(self.log_dir.glob("*.log")):
            lines = [line for line in path.read_text(errors="replace").splitlines() if ERROR_LINE.search(line)]
            if lines:
                parts.append(f"--- {path.name}: {len(lines)} error lines, the last {min(limit, len(lines))}\n")
                parts[-1] += "\n".join(lines[-limit:])
        return "\n".join(parts) if parts else "(no error line in any log)"

    def logs(self, tail: int = 2000) -> str:
        """The tail of every log, for assertion messages."""
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in sorted(self.log_dir.glob("*.log"))
        )

    def flwr(self, *args: str, prefix: Sequence[str] = (), timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run the ``flwr`` CLI with this cluster's ``FLWR_HOME``."""
        return subprocess.run(
            [*prefix, *flwr_cli(), *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
            timeout=timeout, check=False,
        )  # fmt: skip

    def stop(self) -> None:
        """SIGTERM every process group, SIGKILL what is left after 15 s."""
        for p in self.procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 15
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for p in self.procs.values():  # children that outlived their leader (ClientApp processes)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def register_supernode(cluster: Cluster, public_key: Path, connection: str, prefix: Sequence[str] = ()) -> int:
    """``flwr supernode register KEY.pub CONNECTION``; returns the node id the SuperLink assigned."""
    proc = cluster.flwr("supernode", "register", str(public_key), connection, "--format", "json", prefix=prefix)
    out = proc.stdout + proc.stderr
    m = re.search(r'"node-id"\s*:\s*"?(\d+)', out) or re.search(r"(?i)node[ -_]?id\D{0,5}(\d+)", out)
    if proc.returncode != 0 or m is None:
        raise RuntimeError(f"registering {public_key} failed (exit {proc.returncode}): {out[-1500:]}")
    return int(m.group(1))


def submit_run(
    cluster: Cluster,
    connection: str,
    *,
    run_config: str,
    results_dir: Path,
    run_name: str,
    prefix: Sequence[str] = (),
    app: Path = ROOT,
) -> subprocess.Popen[bytes]:
    """``flwr run APP CONNECTION --stream`` in the background (APP: this project); its log is ``cluster.log("run")``."""
    return cluster.start(
        "run",
        [*flwr_cli(), "run", str(app), connection, "--stream",
         "--run-config", run_config_arg(run_config, results_dir, run_name)],
        prefix=prefix,
    )  # fmt: skip


def wait_rounds(folder: Path, rounds: int, timeout: float, alive: subprocess.Popen[bytes] | None = None) -> None:
    """Wait until ``folder/rounds.jsonl`` holds rows up to round ``rounds`` (or ``alive`` exits).

    Pass the SuperLink as ``alive``, not the ``flwr run --stream`` CLI: the run lives on the
    SuperLink, and the CLI's log stream can drop (and the CLI exit) while the run goes on.
    """
    deadline = time.time() + timeout
    path = folder / ROUNDS_FILE
    while time.time() < deadline:
        if path.exists():
            done = [line for line in path.read_text().splitlines() if line.strip()]
            if len(done) > rounds:  # row 0 is the initial evaluation
                return
        if alive is not None and alive.poll() is not None:
            raise RuntimeError(f"the run ended (exit {alive.returncode}) before round {rounds}")
        time.sleep(0.5)
    raise TimeoutError(f"round {rounds} not written to {path} after {timeout:.0f}s")


def node_config_for(i: int, tiers: Sequence[str], extra: str = "") -> str:
    """``--node-config`` of loopback SuperNode ``i``: its partition and tier."""
    return f'partition-id={i} num-partitions={len(tiers)} tier="{tiers[i]}" {extra}'.strip()


def supernode_names(tiers: Sequence[str]) -> list[str]:
    """The loopback SuperNodes' process (and log) names: ``supernode-<tier>``, ``-<i>`` added where a tier repeats."""
    return [f"supernode-{t}" if tiers.count(t) == 1 else f"supernode-{t}-{i}" for i, t in enumerate(tiers)]


@contextmanager
def loopback_cluster(
    *,
    tiers: Sequence[str],
    home: Path,
    ports: Ports,
    log_dir: Path,
    node_config_extra: str = "",
    security: Security | None = None,
    connection: str = "loopback",
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """A SuperLink and one SuperNode per tier on 127.0.0.1; all stopped on exit.

    With ``security`` the SuperLink serves TLS; with ``security.auth`` a key pair per SuperNode
    is made in ``home/supernode-keys`` and registered through ``connection`` first.
    """
    with Cluster(home, log_dir) as cluster:
        cluster.start("superlink", superlink_command(
            fleet_address=f"127.0.0.1:{ports.fleet}", host="127.0.0.1", port=ports.control,
            database=home / "state.db", security=security,
        ))  # fmt: skip
        wait_port(ports.fleet)
        wait_port(ports.control)
        keys: list[Path | None] = [None] * len(tiers)
        if security is not None and security.auth:
            from deploy.certs import make_supernode_key

            for i, tier in enumerate(tiers):
                private, public = make_supernode_key(home / "supernode-keys", f"{i}-{tier}")
                register_supernode(cluster, public, connection)
                keys[i] = private
        for i, name in enumerate(supernode_names(tiers)):
            cluster.start(name, supernode_command(
                superlink=f"127.0.0.1:{ports.fleet}", node_config=node_config_for(i, tiers, node_config_extra),
                port=ports.supernode + i, root_certificates=security.ca_cert if security else None, auth_key=keys[i],
            ))  # fmt: skip
        yield cluster.procs


def shared_core_threads(nodes: int, cores: int | None = None) -> int:
    """Torch threads per ClientApp when ``nodes`` SuperNodes share ``cores`` (default: this process's).

    ``max(1, cores // nodes)``: torch's default (one thread per core in every process)
    oversubscribes the cores -- measured on the 2-core machine with 3 tiny-model nodes, a loopback
    round's fixed overhead was +7.7 s with torch's default and +3.4 s / +2.7 s with one thread
    (docs/RESULTS.md, "Deployment round on loopback").
    """
    available = cores if cores is not None else len(os.sched_getaffinity(0))
    return max(1, available // max(1, nodes))


def run_loopback(
    *,
    tiers: Sequence[str],
    run_config: str,
    results_dir: Path,
    run_name: str,
    ports: Ports | None = None,
    flwr_home: Path | None = None,
    timeout: float = 1800.0,
    echo: bool = True,
    security: Security | None = None,
) -> RunOutcome:
    """Start a loopback cluster, run the app on it over gRPC, stop the cluster.

    The SuperNodes share this machine's cores, so unless ``run_config`` sets ``client-threads``
    each ClientApp gets :func:`shared_core_threads` torch threads.
    """
    ports = ports or Ports()
    cfg = f"min-available-nodes={len(tiers)} client-threads={shared_core_threads(len(tiers))} {run_config}"
    log_dir = results_dir / run_name / "logs"
    with flower_home(flwr_home) as home:
        write_connection(home, "loopback", ports, root_certificates=security.ca_cert if security else None)
        with loopback_cluster(tiers=tiers, home=home, ports=ports, log_dir=log_dir, security=security):
            cmd = [
                *flwr_cli(), "run", str(ROOT), "loopback", "--stream",
                "--run-config", run_config_arg(cfg, results_dir, run_name),
            ]  # fmt: skip
            proc = subprocess.run(
                cmd, cwd=ROOT, env=flower_env(home), capture_output=True, text=True, timeout=timeout, check=False
            )
            if echo:
                sys.stdout.write(proc.stdout + proc.stderr)
    return RunOutcome(proc.returncode, results_dir / run_name, proc.stdout + proc.stderr)


def host_commands(superlink: str, tiers: Sequence[str], *, tls: bool = False, auth: bool = False) -> list[str]:
    """Commands to run the cluster on separate hosts (see docs/DEPLOYING.md)."""
    auth = auth and tls
    sec_link = (
        "--ssl-ca-certfile certs/ca.crt --ssl-certfile certs/server.pem --ssl-keyfile certs/server.key"
        + (" --enable-supernode-auth" if auth else "")
        if tls
        else "--insecure"
    )
    lines = ["# on the server:", "export FLWR_TELEMETRY_ENABLED=0 FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1"]
    if tls:
        lines.append(f"python -m deploy.certs superlink --out certs --hosts {superlink}")
    lines.append(
        f"python -m server.superlink {sec_link} --disable-runtime-dependency-installation --fleet-api-type grpc-rere "
        "--fleet-api-address 0.0.0.0:9092 --host 0.0.0.0 --port 9093 --database state.db"
    )
    names = [f"{i}-{t}" for i, t in enumerate(tiers)]
    if auth:
        lines += [
            "# on your workstation (copy certs/ca.crt there): one key pair per device, registered once",
            f"python -m deploy.certs supernode --out certs/supernodes --names {','.join(names)}",
            *(f"flwr supernode register certs/supernodes/{n}.pub cluster" for n in names),
        ]
    for i, tier in enumerate(tiers):
        cfg = node_config_for(i, tiers)
        node_sec = "--root-certificates ca.crt" if tls else "--insecure"
        if auth:
            node_sec += f" --auth-supernode-private-key {names[i]}"
        lines += [
            f"# on edge device {i} ({tier}); add memory-mb=N to override the budget"
            + (f" (copy ca.crt and certs/supernodes/{names[i]} there)" if auth else ""),
            "export FLWR_TELEMETRY_ENABLED=0 FLWR_SUPEREXEC_TASK_POLL_INTERVAL=0.1",
            f"python -m client.supernode {node_sec} --grpc-rere --superlink {superlink}:9092"
            f" --node-config {shlex.quote(cfg)}",
        ]
    conn = f'#   root-certificates = "{ROOT}/certs/ca.crt"' if tls else "#   insecure = true"
    lines += [
        "# on your workstation: add to $FLWR_HOME/config.toml (default ~/.flwr/config.toml)",
        f'#   [superlink.cluster]\n#   address = "{superlink}:9093"\n{conn}',
        f"flwr run . cluster --stream --run-config 'min-available-nodes={len(tiers)}'",
    ]
    return lines
