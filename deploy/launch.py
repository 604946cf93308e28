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
blocks (:class:`deploy.cluster.Cluster`, :func:`deploy.cluster.superlink_command`,
:func:`deploy.cluster.supernode_command`) also run
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
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from deploy.cluster import Security, host_commands, run_loopback, supernode_names
from deploy.console import RoundTail, run_warnings, verdict_lines
from deploy.flower import BIN, ROOT, RunOutcome, flower_env, flower_home, flwr_cli, run_config_arg
from deploy.locks import SIMULATION_LOCK, file_lock
from deploy.overrides import config_file_overrides, merge_overrides
from deploy.processes import stop_processes, superlink_pids
from deploy.ray_cluster import ForeignSuperLinkError, RayAddressError, check_no_foreign_superlink, check_ray_address
from experiment.outputs import ROUNDS_FILE, SUMMARY_FILE


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
            *flwr_cli(BIN), "run", str(ROOT), "--stream",
            "--federation-config", f"num-supernodes={supernodes} {resources}",
            "--run-config", run_config_arg(run_config, results_dir, run_name),
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
