"""Launch the app: Ray simulation, or a SuperLink + tiered SuperNodes over gRPC.

Usage::

    python -m deploy.launch simulation [--supernodes 6] [--run-config "k=v ..."]
    python -m deploy.launch loopback   [--tiers weak,medium,strong] [--run-config "k=v ..."]
    python -m deploy.launch print-hosts --superlink HOST [--tiers weak,medium,strong]

``simulation`` runs ``flwr run . --stream`` on the local (auto-started) simulation
SuperLink and stops that SuperLink afterwards.  ``loopback`` starts one
``flower-superlink`` (Fleet API over gRPC, ``grpc-rere``) and one ``flower-supernode``
per tier on 127.0.0.1, each with ``--node-config "partition-id=i num-partitions=n
tier='…'"``, submits the run with ``flwr run . <connection>`` and shuts everything
down.  ``print-hosts`` prints the commands to run the same on separate machines.

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
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

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
        }
    )
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    return env


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str):
        if "'" in value:
            raise ValueError(f"run-config string values may not contain a single quote: {value!r}")
        return f"'{value}'"
    raise ValueError(f"unsupported run-config value {value!r} (strings, numbers and booleans only)")


def config_file_overrides(path: Path) -> str:
    """A run-config TOML file (flat ``key = value`` lines) as ``k='v' k2=2`` overrides.

    ``flwr run`` takes either one TOML file or ``k=v`` pairs, not both; the launcher adds its
    own pairs (results folder, run name), so files are turned into pairs here.
    """
    with path.open("rb") as f:
        table = tomllib.load(f)
    nested = [k for k, v in table.items() if isinstance(v, dict)]
    if nested:
        raise ValueError(f"{path}: expected flat 'key = value' lines, got tables {nested}")
    return " ".join(f"{k}={_toml_value(v)}" for k, v in table.items())


#: ``key=value`` pairs as ``flwr run --run-config`` reads them (quoted values may hold spaces).
_PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")


def merge_overrides(*overrides: str) -> str:
    """Join ``k=v`` override strings; a later value of a key replaces an earlier one.

    (``flwr run`` parses one ``--run-config`` string as a TOML document, where a repeated
    key is an error.)
    """
    merged: dict[str, str] = {}
    for text in overrides:
        for key, value in _PAIR.findall(text):
            merged.pop(key, None)
            merged[key] = value
    return " ".join(f"{k}={v}" for k, v in merged.items())


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
        return self.returncode == 0 and (self.results / "summary.csv").exists()


def _superlink_pids() -> set[int]:
    out = subprocess.run(["pgrep", "-f", "flower-superlink"], capture_output=True, text=True, check=False)
    return {int(x) for x in out.stdout.split()}


def _stop(pids: Sequence[int] | set[int], grace: float = 10.0) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + grace
    for pid in pids:
        while time.time() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def run_simulation(
    *,
    supernodes: int,
    run_config: str,
    results_dir: Path,
    run_name: str,
    flwr_home: Path | None = None,
    cpus_per_client: float = 1.0,
    timeout: float = 3600.0,
    echo: bool = True,
) -> RunOutcome:
    """``flwr run . --stream`` in Ray simulation; stop the SuperLink it auto-started."""
    home = flwr_home or Path(tempfile.mkdtemp(prefix="flwr-home-"))
    env = flower_env(home)
    before = _superlink_pids()
    cmd = [
        str(BIN / "flwr"), "run", str(ROOT), "--stream",
        "--federation-config", f"num-supernodes={supernodes} client-resources-num-cpus={cpus_per_client:g}",
        "--run-config", _run_config_arg(run_config, results_dir, run_name),
    ]  # fmt: skip
    lines: list[str] = []
    try:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        start = time.time()
        for line in proc.stdout:
            lines.append(line)
            if echo:
                sys.stdout.write(line)
            if time.time() - start > timeout:
                proc.kill()
                break
        code = proc.wait()
    finally:
        _stop(_superlink_pids() - before)
    return RunOutcome(code, results_dir / run_name, "".join(lines))


@dataclass
class Ports:
    """Loopback ports: Fleet API (gRPC), Control/Runtime API, first SuperNode port."""

    fleet: int = 9092
    control: int = 9093
    supernode: int = 9094


def write_connection(home: Path, name: str, ports: Ports) -> None:
    """Write a ``[superlink.<name>]`` connection to ``$FLWR_HOME/config.toml``."""
    home.mkdir(parents=True, exist_ok=True)
    cfg = home / "config.toml"
    text = cfg.read_text() if cfg.exists() else ""
    text += f'\n[superlink.{name}]\naddress = "127.0.0.1:{ports.control}"\ninsecure = true\n'
    cfg.write_text(text)


def _wait_port(port: int, timeout: float = 60.0) -> None:
    import socket

    deadline = time.time() + timeout
    while time.time() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.3)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout:.0f}s")


@contextmanager
def loopback_cluster(
    *,
    tiers: Sequence[str],
    home: Path,
    ports: Ports,
    log_dir: Path,
    node_config_extra: str = "",
) -> Iterator[dict[str, subprocess.Popen[bytes]]]:
    """A SuperLink and one SuperNode per tier on 127.0.0.1; all stopped on exit."""
    env = flower_env(home)
    log_dir.mkdir(parents=True, exist_ok=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(name: str, cmd: list[str]) -> None:
        out = (log_dir / f"{name}.log").open("wb")
        procs[name] = subprocess.Popen(
            cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )

    try:
        start("superlink", [
            str(BIN / "flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
            "--fleet-api-type", "grpc-rere", "--fleet-api-address", f"127.0.0.1:{ports.fleet}",
            "--host", "127.0.0.1", "--port", str(ports.control),
            "--database", str(home / "state.db"),
        ])  # fmt: skip
        _wait_port(ports.fleet)
        _wait_port(ports.control)
        for i, tier in enumerate(tiers):
            node_cfg = f"partition-id={i} num-partitions={len(tiers)} tier='{tier}' {node_config_extra}".strip()
            start(f"supernode-{tier}", [
                str(BIN / "flower-supernode"), "--insecure", "--grpc-rere",
                "--superlink", f"127.0.0.1:{ports.fleet}", "--node-config", node_cfg,
                "--host", "127.0.0.1", "--port", str(ports.supernode + i),
            ])  # fmt: skip
        yield procs
    finally:
        for p in procs.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


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
) -> RunOutcome:
    """Start a loopback cluster, run the app on it over gRPC, stop the cluster."""
    ports = ports or Ports()
    home = flwr_home or Path(tempfile.mkdtemp(prefix="flwr-home-"))
    write_connection(home, "loopback", ports)
    cfg = f"min-available-nodes={len(tiers)} {run_config}"
    with loopback_cluster(tiers=tiers, home=home, ports=ports, log_dir=results_dir / run_name / "logs"):
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


def host_commands(superlink: str, tiers: Sequence[str]) -> list[str]:
    """Commands to run the cluster on separate hosts (insecure; see README for TLS)."""
    lines = [
        "# on the server:",
        "export FLWR_TELEMETRY_ENABLED=0",
        "flower-superlink --insecure --disable-runtime-dependency-installation --fleet-api-type grpc-rere "
        "--fleet-api-address 0.0.0.0:9092 --host 0.0.0.0 --port 9093",
    ]
    for i, tier in enumerate(tiers):
        cfg = f"partition-id={i} num-partitions={len(tiers)} tier='{tier}'"
        lines += [
            f"# on edge device {i} ({tier}); add memory-mb=N to override the budget:",
            f"flower-supernode --insecure --grpc-rere --superlink {superlink}:9092 --node-config {shlex.quote(cfg)}",
        ]
    lines += [
        "# on your workstation: add to $FLWR_HOME/config.toml",
        f'#   [superlink.cluster]\n#   address = "{superlink}:9093"\n#   insecure = true',
        f"flwr run . cluster --stream --run-config 'min-available-nodes={len(tiers)}'",
    ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="mode", required=True)
    for name in ("simulation", "loopback"):
        p = sub.add_parser(name)
        p.add_argument("--config", type=Path, help="a run-config TOML file (e.g. deploy/configs/*.toml)")
        p.add_argument("--run-config", default="", help="extra run-config overrides 'k=v k2=v2' (after --config)")
        p.add_argument("--results-dir", default=str(ROOT / "results"))
        p.add_argument("--run-name", default="")
        if name == "simulation":
            p.add_argument("--supernodes", type=int, default=6)
            p.add_argument("--cpus-per-client", type=float, default=1.0)
        else:
            p.add_argument("--tiers", default="weak,medium,strong")
    p = sub.add_parser("print-hosts")
    p.add_argument("--superlink", required=True)
    p.add_argument("--tiers", default="weak,medium,strong")
    args = parser.parse_args(argv)
    if args.mode == "print-hosts":
        print("\n".join(host_commands(args.superlink, args.tiers.split(","))))
        return 0
    run_name = args.run_name or f"{args.mode}-{time.strftime('%Y%m%d-%H%M%S')}"
    results = Path(args.results_dir).resolve()
    if args.config is not None:
        args.run_config = merge_overrides(config_file_overrides(args.config), args.run_config)
    if args.mode == "simulation":
        outcome = run_simulation(
            supernodes=args.supernodes, run_config=args.run_config, results_dir=results,
            run_name=run_name, cpus_per_client=args.cpus_per_client,
        )  # fmt: skip
    else:
        outcome = run_loopback(
            tiers=args.tiers.split(","), run_config=args.run_config, results_dir=results, run_name=run_name
        )
    if not outcome.ok:
        print(f"run failed: no summary in {outcome.results} (flwr exit code {outcome.returncode})", file=sys.stderr)
        return 1
    print((outcome.results / "summary.csv").read_text())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
