"""Launch the app: Ray simulation, or a SuperLink + tiered SuperNodes over gRPC.

Usage::

    python -m deploy.launch simulation [--supernodes 6] [--run-config "k=v ..."]
    python -m deploy.launch loopback   [--tiers weak,medium,strong] [--run-config "k=v ..."]
                                       [--tls-dir certs [--auth]]
    python -m deploy.launch print-hosts --superlink HOST [--tiers weak,medium,strong] [--tls [--auth]]

``simulation`` runs ``flwr run . --stream`` on the local (auto-started) simulation
SuperLink and stops that SuperLink afterwards.  ``loopback`` starts one
``flower-superlink`` (Fleet API over gRPC, ``grpc-rere``) and one ``flower-supernode``
per tier on 127.0.0.1, each with ``--node-config "partition-id=i num-partitions=n
tier='…'"``, submits the run with ``flwr run . <connection>`` and shuts everything
down; with ``--tls-dir`` the SuperLink serves TLS with a CA and certificate made there
(:mod:`deploy.certs`), and ``--auth`` adds SuperNode authentication (a key pair per
SuperNode, registered with ``flwr supernode register`` before it connects).
``print-hosts`` prints the commands to run the same on separate machines.  The building
blocks (:class:`Cluster`, :func:`superlink_command`, :func:`supernode_command`) also run
"hosts" in network namespaces (:mod:`deploy.netns`) or under a memory cgroup
(:mod:`deploy.cgroup`); see ``docs/DEPLOYING.md``.

Before anything starts, ``simulation`` and ``loopback`` run the pre-flight checks of
:mod:`deploy.preflight` (keys, values, model, data, partitioning, each tier's variant) and stop
with the key and the fix when the run cannot do what was asked (exit code 2).

Runtime dependency installation and telemetry are disabled for every component.
Both run modes check the run's results folder, because ``flwr run --stream`` exits 0
even when a run fails.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from client.warm import enabled as warm_enabled
from client.warm import shim_dir
from deploy.console import RoundTail, run_warnings, verdict_lines
from deploy.locks import SIMULATION_LOCK, file_lock
from deploy.overrides import config_file_overrides, merge_overrides
from deploy.processes import stop_processes, superlink_pids
from deploy.ray_cluster import ForeignSuperLinkError, RayAddressError, check_no_foreign_superlink, check_ray_address
from experiment.outputs import ROUNDS_FILE, SUMMARY_FILE

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for every Flower process: own FLWR_HOME, no telemetry, no installs."""
    env = dict(os.environ)
    env.update(
        {
            "FLWR_HOME": str(flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "PYTHONUNBUFFERED": "1",
            # the SuperExec that starts every ServerApp / ClientApp process polls for new
            # tasks every second by default; 0.1 s cuts up to ~1 s per message and hop
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1"),
        }
    )
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    if warm_enabled():
        # SuperNodes start `flower-superexec` from PATH: the warm one forks each ClientApp
        # from a process that has imported torch & co. once (client/warm.py)
        env["PATH"] = f"{shim_dir(flwr_home)}{os.pathsep}{env['PATH']}"
    return env


@contextmanager
def flower_home(given: Path | None) -> Iterator[Path]:
    """``given``, or a temporary Flower home that is removed when the run ends (issue 23 item 6).

    A run's Flower home holds only what lives as long as the run: the CLI's connection file, the
    SuperLink's state database, SuperNode keys made for it and the warm SuperExec's shim; the
    run's results and logs go to its results folder.
    """
    if given is not None:
        yield given
        return
    home = Path(tempfile.mkdtemp(prefix="flwr-home-"))
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _run_config_arg(run_config: str, results_dir: Path, run_name: str) -> str:
    return merge_overrides(run_config, f"results-dir='{results_dir}' run-name='{run_name}'")


@dataclass
class RunOutcome:
    """What a launched run produced."""

    returncode: int
    results: Path
    log: str

    @property
    def ok(self) -> bool:
        """The run finished and wrote its summary."""
        return self.returncode == 0 and (self.results / SUMMARY_FILE).exists()

    @property
    def reason(self) -> str | None:
        """Why the run stopped, when the ServerApp raised one of the project's typed errors."""
        return failure_reason(self.log)


#: The project's errors that say what to change (key, value, fix) when they stop a run.
TYPED_ERRORS = (
    "NothingToTrain",
    "ConfigError",
    "PreflightError",
    "DataError",
    "UnknownMethod",
    "FactoryNotFound",
    "CheckpointIncompatible",
)
_TYPED_ERROR = re.compile(rf"\b({'|'.join(TYPED_ERRORS)}): (.+)$")


def failure_reason(output: str) -> str | None:
    """The last ``<TypedError>: message`` line of a run's output (Flower prints the ServerApp's traceback)."""
    found = None
    for line in output.splitlines():
        match = _TYPED_ERROR.search(line.strip())
        if match:
            found = f"{match.group(1)}: {match.group(2)}"
    return found


def check_gpus_per_client(gpus: float) -> None:
    """Fail fast on a GPU share Ray cannot give: negative, or above 0 without a CUDA GPU."""
    if not gpus >= 0:
        raise ValueError(f"gpus per client must be >= 0, got {gpus}")
    if gpus > 0:
        import torch

        if not torch.cuda.is_available():
            raise ValueError(
                f"{gpus:g} GPU per client asked for, but this machine has no CUDA GPU (Ray would never "
                "start a ClientApp); run with 0 GPUs per client and device='cpu' or 'auto'"
            )


def run_simulation(
    *,
    supernodes: int,
    run_config: str,
    results_dir: Path,
    run_name: str,
    flwr_home: Path | None = None,
    cpus_per_client: float = 1.0,
    gpus_per_client: float = 0.0,
    timeout: float = 3600.0,
    echo: bool = True,
    lock: Path | None = SIMULATION_LOCK,
    log_path: Path | None = None,
    ray_address: str | None = None,
) -> RunOutcome:
    """``flwr run . --stream`` in Ray simulation; stop the SuperLink it auto-started.

    ``gpus_per_client`` is Ray's GPU share per virtual client (e.g. 0.25: four ClientApps on
    a GPU at a time; pair it with the run config's ``device``); more than 0 on a machine
    without a CUDA GPU fails here, where Ray would wait forever.  The whole run holds ``lock``
    (:mod:`deploy.locks`): the local simulation SuperLink uses fixed ports, so a second
    simulation on the machine waits for this one to finish.  ``log_path``: a file that gets
    Flower's whole output as it comes (``echo`` shows it on the console too).

    ``ray_address`` (``HOST:PORT`` of a running Ray head; default ``$RAY_ADDRESS``): run the
    virtual clients on that multi-node cluster.  It reaches the ``flwr-simulation`` process
    through the environment of the local SuperLink this call starts
    (:mod:`deploy.ray_cluster`), which is why a local SuperLink this call did not start is
    refused (:class:`~deploy.ray_cluster.ForeignSuperLinkError`) rather than reused.
    """
    check_gpus_per_client(gpus_per_client)
    ray_address = ray_address if ray_address is not None else os.environ.get("RAY_ADDRESS") or None
    if ray_address is not None:
        ray_address = check_ray_address(ray_address)
    resources = f"client-resources-num-cpus={cpus_per_client:g}"
    if gpus_per_client > 0:
        resources += f" client-resources-num-gpus={gpus_per_client:g}"
    with file_lock(lock, what=f"flwr run {run_name}"), flower_home(flwr_home) as home:
        check_no_foreign_superlink()
        env = flower_env(home)
        if ray_address is not None:
            env["RAY_ADDRESS"] = ray_address
        before = superlink_pids(home)
        cmd = [
            str(BIN / "flwr"), "run", str(ROOT), "--stream",
            "--federation-config", f"num-supernodes={supernodes} {resources}",
            "--run-config", _run_config_arg(run_config, results_dir, run_name),
        ]  # fmt: skip
        lines: list[str] = []
        log_file = None
        if log_path is not None:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            log_file = log_path.open("w")
        try:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if proc.stdout is None:  # stdout=PIPE always gives one
                raise RuntimeError("flwr run started without an output pipe")
            start = time.time()
            for line in proc.stdout:
                lines.append(line)
                if echo:
                    sys.stdout.write(line)
                if log_file is not None:
                    log_file.write(line)
                    log_file.flush()
                if time.time() - start > timeout:
                    proc.kill()
                    break
            code = proc.wait()
        finally:
            stop_processes(superlink_pids(home) - before)
            if log_file is not None:
                log_file.close()
    return RunOutcome(code, results_dir / run_name, "".join(lines))


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
    """``flower-superlink`` over gRPC (``grpc-rere``), runtime installs off, optionally TLS + auth."""
    cmd = [
        str(BIN / "flower-superlink"), "--disable-runtime-dependency-installation",
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
    """Write a ``[superlink.<name>]`` connection to ``$FLWR_HOME/config.toml``."""
    home.mkdir(parents=True, exist_ok=True)
    cfg = home / "config.toml"
    text = cfg.read_text() if cfg.exists() else ""
    text += f'\n[superlink.{name}]\naddress = "{host}:{ports.control}"\n'
    text += f'root-certificates = "{root_certificates}"\n' if root_certificates else "insecure = true\n"
    cfg.write_text(text)


def _wait_port(port: int, timeout: float = 60.0, host: str = "127.0.0.1", prefix: Sequence[str] = ()) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if prefix:  # inside another network namespace: probe from there
            probe = f"import socket,sys; sys.exit(socket.socket().connect_ex(({host!r}, {port})))"
            if subprocess.run([*prefix, sys.executable, "-c", probe], capture_output=True, check=False).returncode == 0:
                return
        else:
            with socket.socket() as s:
                if s.connect_ex((host, port)) == 0:
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
                raise TimeoutError(f"{name}: no {pattern!r} after {timeout:.0f}s; log tail:\n{self.log(name)[-2000:]}")
            time.sleep(0.2)

    def logs(self, tail: int = 2000) -> str:
        """The tail of every log, for assertion messages."""
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-tail:]}" for p in sorted(self.log_dir.glob("*.log"))
        )

    def flwr(self, *args: str, prefix: Sequence[str] = (), timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        """Run the ``flwr`` CLI with this cluster's ``FLWR_HOME``."""
        return subprocess.run(
            [*prefix, str(BIN / "flwr"), *args], cwd=ROOT, env=self.env, capture_output=True, text=True,
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
        [str(BIN / "flwr"), "run", str(app), connection, "--stream",
         "--run-config", _run_config_arg(run_config, results_dir, run_name)],
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
        _wait_port(ports.fleet)
        _wait_port(ports.control)
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
                str(BIN / "flwr"), "run", str(ROOT), "loopback", "--stream",
                "--run-config", _run_config_arg(cfg, results_dir, run_name),
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
        f"flower-superlink {sec_link} --disable-runtime-dependency-installation --fleet-api-type grpc-rere "
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


def run_preflight(
    run_config: str, *, supernodes: int | None, tiers: Sequence[str] | None
) -> str | tuple[int, list[str]]:
    """Run :func:`deploy.preflight.preflight` and print its lines.

    Returns the error text when the run cannot start, else its number of rounds and its warnings
    (printed again beside the verdict).

    ``supernodes``: a simulation's virtual clients; ``tiers``: a loopback cluster's node tiers.
    """
    from collections import Counter

    from deploy.preflight import preflight
    from experiment.config import ConfigError

    try:
        found = preflight(
            run_config,
            num_nodes=supernodes if tiers is None else len(tiers),
            nodes_per_tier=dict(Counter(tiers)) if tiers is not None else None,
        )
    except ConfigError as exc:
        return str(exc)
    print("\n".join(found.lines()), flush=True)
    return found.config.num_server_rounds, list(found.warnings)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True, metavar="{simulation,loopback,print-hosts}")
    helps = {
        "simulation": "run the app in Ray simulation (flwr run . --stream) and print the summary",
        "loopback": "run a SuperLink and one SuperNode per tier on 127.0.0.1 over gRPC, then the app on them",
    }
    for name in ("simulation", "loopback"):
        p = sub.add_parser(
            name, help=helps[name], description=helps[name], formatter_class=argparse.ArgumentDefaultsHelpFormatter
        )
        p.add_argument("--config", type=Path, help="a run-config TOML file (e.g. deploy/configs/*.toml)")
        p.add_argument("--run-config", default="", help="extra run-config overrides 'k=v k2=v2' (after --config)")
        p.add_argument("--results-dir", default=str(ROOT / "results"), help="where the run's results folder goes")
        p.add_argument("--run-name", default="", help="the results folder's name; empty: MODE-YYYYMMDD-HHMMSS")
        p.add_argument(
            "--skip-preflight", action="store_true", help="start without the pre-flight checks (deploy/preflight.py)"
        )
        p.add_argument(
            "--verbose", action="store_true", help="show Flower's and Ray's whole output instead of one line per round"
        )
        if name == "simulation":
            p.add_argument("--supernodes", type=int, default=6, help="virtual clients (Ray actors share the cores)")
            p.add_argument("--cpus-per-client", type=float, default=1.0, help="Ray CPU share per client")
            p.add_argument(
                "--gpus-per-client", type=float, default=0.0, help="Ray GPU share per client (with device='cuda')"
            )
            p.add_argument(
                "--ray-address", default=None,
                help="HOST:PORT of a running Ray cluster's head (default: $RAY_ADDRESS; unset: Ray on this machine)",
            )  # fmt: skip
        else:
            p.add_argument("--tiers", default="weak,medium,strong", help="one SuperNode per entry, with that tier")
            p.add_argument("--tls-dir", type=Path, help="serve TLS with the CA/certificate here (made if missing)")
            p.add_argument("--auth", action="store_true", help="SuperNode authentication (needs --tls-dir)")
    hosts_help = "print the commands that run the same deployment on separate machines"
    p = sub.add_parser(
        "print-hosts",
        help=hosts_help,
        description=hosts_help,
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--superlink", required=True, help="the SuperLink's host name or address, as the nodes reach it")
    p.add_argument("--tiers", default="weak,medium,strong", help="one SuperNode command per entry")
    p.add_argument("--tls", action="store_true", help="TLS on the SuperLink (certificates from deploy.certs)")
    p.add_argument("--auth", action="store_true", help="SuperNode authentication (needs --tls)")
    args = parser.parse_args(argv)
    if args.mode == "print-hosts":
        if args.auth and not args.tls:
            parser.error("--auth needs --tls (Flower authenticates SuperNodes only over TLS)")
        print("\n".join(host_commands(args.superlink, args.tiers.split(","), tls=args.tls, auth=args.auth)))
        return 0
    run_name = args.run_name or f"{args.mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    results = Path(args.results_dir).resolve()
    if args.config is not None:
        if not args.config.is_file():
            parser.error(f"--config {args.config}: no such file (the run configs are in deploy/configs/)")
        args.run_config = merge_overrides(config_file_overrides(args.config), args.run_config)
    rounds: int | None = None
    warnings: list[str] = []
    if not args.skip_preflight:
        tiers = args.tiers.split(",") if args.mode == "loopback" else None
        checked = run_preflight(args.run_config, supernodes=getattr(args, "supernodes", None), tiers=tiers)
        if isinstance(checked, str):
            print(f"pre-flight failed, nothing was started: {checked}", file=sys.stderr)
            return 2
        rounds, warnings = checked
    folder = results / run_name
    log_path = folder / "flower.log"
    where = f"Flower's output: {log_path}" if not args.verbose else "Flower's output below"
    if args.mode == "loopback":
        names = ["superlink", *supernode_names(args.tiers.split(","))]
        where += f"; logs of each process in {folder / 'logs'}: {', '.join(f'{n}.log' for n in names)}"
    print(f"running {run_name} ({where})", flush=True)
    started = time.time()
    tail = RoundTail(folder / ROUNDS_FILE, metric="local-accuracy", rounds=rounds, eta=True)
    with contextlib.nullcontext() if args.verbose else tail:
        if args.mode == "simulation":
            try:
                outcome = run_simulation(
                    supernodes=args.supernodes, run_config=args.run_config, results_dir=results,
                    run_name=run_name, cpus_per_client=args.cpus_per_client, gpus_per_client=args.gpus_per_client,
                    echo=args.verbose, log_path=log_path, ray_address=args.ray_address,
                )  # fmt: skip
            except (RayAddressError, ForeignSuperLinkError) as exc:
                print(f"nothing was started: {exc}", file=sys.stderr)
                return 2
        else:
            if args.auth and args.tls_dir is None:
                parser.error("--auth needs --tls-dir (Flower authenticates SuperNodes only over TLS)")
            security = Security.generate(args.tls_dir.resolve(), auth=args.auth) if args.tls_dir else None
            outcome = run_loopback(
                tiers=args.tiers.split(","), run_config=args.run_config, results_dir=results, run_name=run_name,
                security=security, echo=args.verbose,
            )  # fmt: skip
            folder.mkdir(parents=True, exist_ok=True)
            log_path.write_text(outcome.log)
    if not outcome.ok:
        if not args.verbose:
            print("".join(outcome.log.splitlines(keepends=True)[-15:]), file=sys.stderr)
        print(f"run failed: no summary in {outcome.results} (flwr exit code {outcome.returncode})", file=sys.stderr)
        if outcome.reason:
            print(f"because {outcome.reason}", file=sys.stderr)
        print(f"Flower's whole output: {log_path}", file=sys.stderr)
        return 1
    verdict = verdict_lines(
        outcome.results / SUMMARY_FILE,
        wall_seconds=time.time() - started,
        warnings=run_warnings(outcome.results, warnings),
    )
    print("\n".join(verdict))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
