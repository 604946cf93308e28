"""Faults on a real deployment (issue 22): lossy and slow links, for the chaos suite.

Every fault is a real packet or stream fault between a SuperNode and the SuperLink, never a
sleep in the project's code:

* **Packet loss** (:func:`loss_ruleset`, :func:`set_loss`): an nftables table inside a
  SuperNode's network namespace drops ``percent`` % of the packets on its link to the
  SuperLink, each way (``numgen random mod 100 < percent drop`` in the input and output
  hooks, on every interface but ``lo``: the SuperNode's own loopback to its ClientApps is the
  device's inside, not its network).  This kernel has no ``netem`` (``tc qdisc ... netem`` is
  refused), but nftables' random drops work inside a namespace.
* **Delay** (:class:`DelayRelay`, ``python -m deploy.chaos relay``): a userspace TCP relay
  between a SuperNode and the SuperLink that holds each chunk read from either side for
  ``delay ± jitter`` ms (uniform) before passing it on, keeping the byte order (a chunk is never
  sent before the one read ahead of it).  Its settings are read from a JSON file whenever it
  changes, so one cluster can run a clean and a faulty run back to back.

:class:`ChaosCluster` starts a SuperLink and ``nodes`` SuperNodes, each in its own network
namespace (:class:`deploy.netns.HostNetwork`), each SuperNode dialing the SuperLink through its
own relay.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from deploy.cluster import (
    Cluster,
    Ports,
    node_config_for,
    submit_run,
    superlink_command,
    supernode_command,
    supernode_names,
    wait_port,
    write_connection,
)
from deploy.deadline import CaseCost, case_estimate_s
from deploy.flower import ROOT
from deploy.netns import HostNetwork
from deploy.processes import children, cmdline
from experiment.outputs import ROUNDS_FILE

#: The nftables table the chaos rules live in (one per namespace).
TABLE = "hetfl_chaos"
#: Largest chunk the relay reads at once.
CHUNK = 65536


#: How a SuperLink's SuperExec shows in its command line: Flower's, or the warm one (``client.warm``).
SUPEREXEC_COMMANDS = ("flower-superexec", "client.warm")


class ChaosError(RuntimeError):
    """A fault cannot be set up here (a tool missing, a rule refused)."""


def loss_ruleset(percent: int, table: str = TABLE) -> str:
    """The ``nft -f`` script that drops ``percent`` % of non-loopback packets each way.

    Replaces the table if it exists (``percent`` 0 leaves an empty table: no drops).
    """
    if not 0 <= percent <= 100:
        raise ValueError(f"loss percent {percent}: expected 0..100")
    lines = [
        f"table inet {table}",  # declare first, so that the delete below never fails
        f"delete table inet {table}",
        f"table inet {table} {{",
    ]
    for chain, hook, iface in (("inbound", "input", "iifname"), ("outbound", "output", "oifname")):
        lines.append(f"  chain {chain} {{")
        lines.append(f"    type filter hook {hook} priority 0; policy accept;")
        if percent == 100:  # numgen's value must stay below its modulus
            lines.append(f'    {iface} != "lo" counter drop')
        elif percent:
            lines.append(f'    {iface} != "lo" numgen random mod 100 < {percent} counter drop')
        lines.append("  }")
    lines.append("}")
    return "\n".join(lines) + "\n"


def set_loss(prefix: Sequence[str], percent: int) -> None:
    """Apply :func:`loss_ruleset` in the namespace ``prefix`` runs in (``ip netns exec NS``)."""
    proc = subprocess.run(
        [*prefix, "nft", "-f", "-"], input=loss_ruleset(percent), capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise ChaosError(f"nft refused the loss rules: {proc.stderr.strip() or proc.returncode}")


def dropped_packets(prefix: Sequence[str]) -> int:
    """Packets the loss rules of the namespace ``prefix`` runs in have dropped so far (both ways)."""
    proc = subprocess.run([*prefix, "nft", "list", "table", "inet", TABLE], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return 0
    return sum(int(word) for line in proc.stdout.splitlines() for word in _after(line, "packets"))


def _after(line: str, key: str) -> list[str]:
    words = line.split()
    return [words[i + 1] for i, w in enumerate(words[:-1]) if w == key and words[i + 1].isdigit()]


@dataclass(frozen=True)
class Delay:
    """A relay's setting: each chunk held ``ms ± jitter_ms`` (uniform), in each direction."""

    ms: float = 0.0
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.ms < 0 or self.jitter_ms < 0 or self.jitter_ms > self.ms:
            raise ValueError(f"delay {self.ms} ms ± {self.jitter_ms} ms: expected 0 <= jitter <= delay")

    def draw(self, rng: random.Random) -> float:
        """One chunk's hold in seconds."""
        return max(0.0, self.ms + rng.uniform(-self.jitter_ms, self.jitter_ms)) / 1000.0

    def write(self, path: Path) -> None:
        """Store it where a running relay reads it (atomically)."""
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self)))
        tmp.replace(path)


def release_times(read_at: Sequence[float], holds: Sequence[float]) -> list[float]:
    """When each chunk is passed on: ``max(previous release, read time + hold)``, never out of order."""
    out: list[float] = []
    last = float("-inf")
    for t, hold in zip(read_at, holds, strict=True):
        last = max(last, t + hold)
        out.append(last)
    return out


class DelayRelay:
    """Relay TCP connections from ``listen`` to ``target``, delaying every chunk each way."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], settings: Path, seed: int = 0) -> None:
        self.listen = listen
        self.target = target
        self.settings = settings
        self.rng = random.Random(seed)
        self._delay = Delay()
        self._mtime = 0.0

    def delay(self) -> Delay:
        """The current setting (the settings file re-read when it changed; kept if it is unreadable)."""
        try:
            mtime = self.settings.stat().st_mtime
            if mtime != self._mtime:
                self._delay = Delay(**json.loads(self.settings.read_text()))
                self._mtime = mtime
        except (OSError, ValueError, TypeError):
            pass
        return self._delay

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - loop.time()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()
            with contextlib.suppress(OSError):
                writer.write_eof()

        sender = asyncio.create_task(send())
        last = float("-inf")
        try:
            while data := await reader.read(CHUNK):
                last = max(last, loop.time() + self.delay().draw(self.rng))
                queue.put_nowait((last, data))
        except (ConnectionError, OSError):
            pass
        queue.put_nowait((last, b""))
        with contextlib.suppress(ConnectionError, OSError):
            await sender

    async def _serve(self, client_reader: asyncio.StreamReader, client_writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            client_writer.close()
            return
        await asyncio.gather(self._pipe(client_reader, up_writer), self._pipe(up_reader, client_writer))
        for w in (client_writer, up_writer):
            w.close()

    async def run(self) -> None:
        """Serve until cancelled."""
        server = await asyncio.start_server(self._serve, *self.listen)
        print(
            f"[deploy.chaos] relay {self.listen[0]}:{self.listen[1]} -> {self.target[0]}:{self.target[1]}", flush=True
        )
        async with server:
            await server.serve_forever()


#: What ``flwr run --stream`` prints when the run's ServerApp died of an exception.
SERVERAPP_FAILED = "An unhandled exception occurred in the ServerApp"


def read_rows(folder: Path) -> list[dict[str, Any]]:
    """The rows of ``folder``'s ``rounds.jsonl`` so far (none before it exists)."""
    path = folder / ROUNDS_FILE
    lines = [line for line in (path.read_text() if path.exists() else "").splitlines() if line.strip()]
    rows = []
    for i, line in enumerate(lines):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            if i < len(lines) - 1:  # only the last line may be in the middle of being written
                raise
    return rows


@dataclass
class RunResult:
    """One run on a :class:`ChaosCluster`: its ``rounds.jsonl`` rows and wall time."""

    name: str
    rows: list[dict[str, Any]]
    seconds: float

    def round_seconds(self, first: int = 1) -> list[float]:
        """Server-side seconds of rounds ``first``..N."""
        return [float(r["seconds"]) for r in self.rows if r["round"] >= first]


class ChaosCluster:
    """A SuperLink and ``nodes`` SuperNodes, each in its own network namespace, each behind a relay.

    The SuperLink runs in the server namespace (:class:`deploy.netns.HostNetwork`); SuperNode
    ``i`` runs in namespace ``i`` and dials ``10.231.i.1:RELAY_PORT``, where a
    :class:`DelayRelay` (in the server namespace) passes its gRPC stream on to the SuperLink's
    Fleet API.  :meth:`set_faults` sets every link's loss (nftables, in the node's namespace)
    and delay (the relays' shared settings file) between runs.  Tiers repeat ``tiers`` in order.
    """

    def __init__(
        self,
        root: Path,
        *,
        nodes: int = 10,
        tiers: Sequence[str] = ("weak", "medium", "strong"),
        ports: Ports | None = None,
        relay_port: int = 19790,
    ) -> None:
        self.root = root
        self.tiers = [tiers[i % len(tiers)] for i in range(nodes)]
        self.names = supernode_names(self.tiers)
        self.ports = ports or Ports(fleet=19792, control=19793, supernode=19794)
        self.relay_port = relay_port
        self.home = root / "flwr-home"
        self.settings = root / "delay.json"
        self.net = HostNetwork(nodes=nodes)
        self.cluster: Cluster | None = None
        #: Runs finished on this cluster: name -> ((run config, rounds, app), result).
        self.finished: dict[str, tuple[tuple[str, int, Path], RunResult]] = {}
        self._run_log_at = 0  # where the latest submission's CLI output begins in the "run" log
        #: The latest run submitted whose last round was not yet seen (:meth:`health`).
        self.unfinished: str | None = None
        #: Median seconds of rounds 2.. of each run finished on this cluster (:meth:`round_pace`).
        self.paces: list[float] = []

    @property
    def server(self) -> list[str]:
        """Command prefix of the SuperLink's namespace."""
        return self.net.prefix(self.net.server)

    def node(self, i: int) -> list[str]:
        """Command prefix of SuperNode ``i``'s namespace."""
        return self.net.prefix(self.net.node(i))

    def start(self, supernode_timeout: float = 300.0) -> ChaosCluster:
        """Namespaces, SuperLink, relays, SuperNodes; returns once every SuperNode has registered."""
        if shutil.which("nft") is None:
            raise ChaosError("the 'nft' tool (nftables) is not installed: `apt-get install nftables`")
        self.root.mkdir(parents=True, exist_ok=True)
        self.paces.clear()  # a new cluster's first run pays every node's preload again
        Delay().write(self.settings)
        write_connection(self.home, "chaos", self.ports)  # the CLI runs in the SuperLink's namespace
        self.net.create()
        try:
            self.cluster = Cluster(self.home, self.root / "logs")
            self.cluster.start("superlink", superlink_command(
                fleet_address=f"127.0.0.1:{self.ports.fleet}", host="127.0.0.1", port=self.ports.control,
                database=self.home / "state.db",
            ), prefix=self.server)  # fmt: skip
            wait_port(self.ports.fleet, prefix=self.server)
            wait_port(self.ports.control, prefix=self.server)
            for i in range(self.net.nodes):
                self.cluster.start(f"relay-{i}", [
                    sys.executable, "-m", "deploy.chaos", "relay", "--listen",
                    f"{self.net.server_address(i)}:{self.relay_port}", "--to", f"127.0.0.1:{self.ports.fleet}",
                    "--settings", str(self.settings), "--seed", str(i),
                ], prefix=self.server)  # fmt: skip
            for i in range(self.net.nodes):
                self.cluster.wait_log(f"relay-{i}", r"relay .* -> ", 60)
                set_loss(self.node(i), 0)
                self.cluster.start(self.names[i], supernode_command(
                    superlink=f"{self.net.server_address(i)}:{self.relay_port}",
                    node_config=node_config_for(i, self.tiers), port=self.ports.supernode,
                ), prefix=self.node(i))  # fmt: skip
            for name in self.names:
                self.cluster.wait_log(name, r"SuperNode ID: \d+", supernode_timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def set_faults(self, *, loss_percent: int = 0, delay: Delay | None = None) -> None:
        """Every link's loss and delay from now on (0 and no delay: clean)."""
        for i in range(self.net.nodes):
            set_loss(self.node(i), loss_percent)
        (delay or Delay()).write(self.settings)

    def dropped(self) -> int:
        """Packets the loss rules dropped so far, all nodes, both ways."""
        return sum(dropped_packets(self.node(i)) for i in range(self.net.nodes))

    @property
    def processes(self) -> Cluster:
        """The cluster's processes (:class:`deploy.cluster.Cluster`); :class:`ChaosError` if not started."""
        if self.cluster is None:
            raise ChaosError("the cluster is not started")
        return self.cluster

    def submit(self, name: str, run_config: str, rounds: int, app: Path = ROOT) -> float:
        """Submit a run of ``rounds`` rounds of ``app`` in the background; returns when (``time.monotonic``)."""
        cfg = f"min-available-nodes={self.net.nodes} num-server-rounds={rounds} {run_config}"
        self._run_log_at = len(self.processes.log("run"))
        self.unfinished = name
        submit_run(
            self.processes, "chaos", run_config=cfg, results_dir=self.root / "results", run_name=name,
            prefix=self.server, app=app,
        )  # fmt: skip
        return time.monotonic()

    def finish(self, name: str, rounds: int, started: float, timeout: float = 900.0) -> RunResult:
        """Wait for round ``rounds`` of the run ``name`` submitted at ``started``; its rows and wall time."""
        folder = self.root / "results" / name
        procs, deadline = self.processes.procs, time.monotonic() + timeout
        while len(read_rows(folder)) <= rounds:  # row 0 is the initial evaluation
            output = self.run_output()
            failed = procs["run"].poll() not in (None, 0)
            # the ServerApp's own failure ends the run at once (`flwr run --stream` may go on for minutes)
            if SERVERAPP_FAILED in output or (failed and not (folder / ROUNDS_FILE).exists()):
                raise ChaosError(f"run {name!r} failed (`flwr run` exit {procs['run'].returncode}):\n{output[-3000:]}")
            if procs["superlink"].poll() is not None:
                raise ChaosError(f"the SuperLink exited ({procs['superlink'].returncode}) during run {name!r}")
            exited = [f"{n} ({procs[n].returncode})" for n in self.names if procs[n].poll() is not None]
            if exited:  # the run waits for every node: it would stall to its timeout
                raise ChaosError(f"SuperNodes exited during run {name!r}: {exited}\n{self.stall()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"run {name!r}: round {rounds} not written after {timeout:.0f} s\n{self.stall()}")
            time.sleep(0.5)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.processes.procs["run"].wait(timeout=120)
        self.unfinished = None
        result = RunResult(name, read_rows(folder), time.monotonic() - started)
        later = result.round_seconds(2)  # round 1 also pays a run's first imports
        if later:
            self.paces.append(statistics.median(later))
        return result

    def round_pace(self, default: float) -> float:
        """Seconds per round on this cluster: the slowest finished run's median (rounds 2..), else ``default``.

        The slowest, so that a case is never priced at the pace of a lighter run (one without
        client-side evaluation); :meth:`start` clears them (a rebuilt cluster preloads again).
        """
        return max(self.paces) if self.paces else default

    def case_estimate(
        self, cost: CaseCost, *, default_round_s: float, first_run_s: float, reference: tuple[str, int] | None = None
    ) -> tuple[float, float]:
        """A case's estimated seconds on this cluster, and the pace (s per round) it assumed.

        :func:`deploy.deadline.case_estimate_s` at :meth:`round_pace`, plus ``first_run_s`` while
        no run has finished here (the nodes' preload), plus the rounds of ``reference``
        (``(name, rounds)``: a run the case shares with another case) if that has not run yet.
        """
        rounds = cost.rounds + (reference[1] if reference is not None and reference[0] not in self.finished else 0)
        pace = self.round_pace(default_round_s)
        estimate = case_estimate_s(CaseCost(rounds=rounds, extra_s=cost.extra_s), pace)
        return estimate + (0.0 if self.paces else first_run_s), pace

    def stall(self) -> str:
        """What a timeout reports: the rounds written so far, the ServerApp's last lines, every log's errors."""
        rows = {p.parent.name: len(read_rows(p.parent)) for p in (self.root / "results").glob(f"*/{ROUNDS_FILE}")}
        tail = "\n".join(self.run_output().splitlines()[-25:])
        return f"rows per run: {rows}\nServerApp (last 25 lines):\n{tail}\n{self.processes.errors()}"

    def run_output(self) -> str:
        """What ``flwr run --stream`` printed for the latest submission: the ServerApp's log."""
        return self.processes.log("run")[self._run_log_at :]

    def run(self, name: str, run_config: str, rounds: int, timeout: float = 900.0, app: Path = ROOT) -> RunResult:
        """Submit a run of ``rounds`` rounds of ``app`` and wait for its last round."""
        result = self.finish(name, rounds, self.submit(name, run_config, rounds, app), timeout)
        self.finished[name] = ((run_config, rounds, app), result)
        return result

    def run_once(self, name: str, run_config: str, rounds: int) -> RunResult:
        """:meth:`run`, unless a run ``name`` with these settings already finished on this cluster (its result).

        Cases that compare against the same clean run share it (each is minutes of the suite's budget).
        """
        hit = self.finished.get(name)
        if hit is not None and hit[0] == (run_config, rounds, ROOT):
            return hit[1]
        return self.run(name, run_config, rounds)

    def wait_checkpoint(self, name: str, server_round: int, timeout: float = 600.0) -> Path:
        """Wait until the run ``name`` has checkpointed round ``server_round``; the checkpoint's path."""
        path = self.root / "results" / name / "checkpoints" / f"round-{server_round:06d}.ckpt"
        deadline = time.monotonic() + timeout
        while not path.exists():
            if self.processes.procs["superlink"].poll() is not None:
                raise ChaosError(f"the SuperLink exited before run {name!r} checkpointed round {server_round}")
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"run {name!r}: no checkpoint of round {server_round} after {timeout:.0f} s\n{self.stall()}"
                )
            time.sleep(0.05)
        return path

    def restart_superlink(self, down_seconds: float = 3.0) -> None:
        """SIGKILL the SuperLink with the ServerApp it runs, and start it again on its database.

        The process group goes (a crash of the server host's Flower processes); after
        ``down_seconds`` the SuperLink is started with the same command (the same ``--database``),
        and this returns once its Fleet and Control APIs listen again.
        """
        cluster = self.processes
        cluster.kill("superlink")
        time.sleep(down_seconds)
        cluster.restart("superlink")
        wait_port(self.ports.fleet, prefix=self.server)
        wait_port(self.ports.control, prefix=self.server)

    def health(self) -> list[str]:
        """What would keep a submitted run from running; empty when nothing does.

        An exited SuperLink or SuperNode, a SuperLink without its SuperExec (the child that
        launches every ServerApp: Flower starts it once and never again), and a run submitted
        and not seen to its end (a case that failed mid-run leaves its ServerApp holding the nodes).
        """
        procs = self.processes.procs
        problems = [f"{name} exited ({procs[name].returncode})" for name in ("superlink", *self.names)
                    if procs[name].poll() is not None]  # fmt: skip
        superlink = procs["superlink"]
        superexecs = [c for c in children(superlink.pid) if any(m in cmdline(c) for m in SUPEREXEC_COMMANDS)]
        if superlink.poll() is None and not superexecs:
            problems.append("the SuperLink's SuperExec, which launches the ServerApps, is gone")
        if self.unfinished is not None:
            problems.append(f"run {self.unfinished!r} was submitted and not seen to its end")
        return problems

    def recover(self) -> list[str]:
        """Rebuild the cluster on a fresh database if :meth:`health` finds a problem; the problems found.

        One case that breaks the cluster then fails alone instead of every case after it.
        """
        problems = self.health()
        if problems:
            self.stop()
            for path in self.home.glob("state.db*"):
                path.unlink()
            self.unfinished = None
            self.start()
        return problems

    def stop(self) -> None:
        """Stop every process, remove the namespaces."""
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
        self.net.remove()

    def __enter__(self) -> ChaosCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _address(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    return host, int(port)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m deploy.chaos relay --listen H:P --to H:P --settings FILE [--seed N]``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    relay = sub.add_parser("relay", help="a TCP relay that delays every chunk (settings: a JSON file)")
    relay.add_argument("--listen", required=True, help="HOST:PORT to accept connections on")
    relay.add_argument("--to", required=True, help="HOST:PORT to relay them to")
    relay.add_argument(
        "--settings", type=Path, required=True, help='JSON {"ms": 100, "jitter_ms": 30}, re-read on change'
    )
    relay.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    started = time.monotonic()
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(DelayRelay(_address(args.listen), _address(args.to), args.settings, args.seed).run())
    print(f"[deploy.chaos] relay stopped after {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
