"""Split a loopback deployment round into training and fixed overhead.

Usage::

    python -m deploy.round_timing [--rounds 5] [--modes sim,warm] [--model tiny|minilm] [--out DIR]

Runs the tiny model (2 local steps, federated evaluation on every node; ``--model minilm``: the
project's default MiniLM run, every node evaluating) once per mode, on a
loopback cluster (one SuperLink, weak / medium / strong SuperNodes over gRPC) or, for ``sim``,
as a Ray simulation of the same three clients, and prints, per round, the server-side wall time
of the round (``seconds`` in ``rounds.jsonl``: from ``configure_train`` to the end of
evaluation), the slowest ClientApp's training handler (``train-seconds``: rebuilding the
variant, loading data, local steps), the slowest ClientApp's start-up (``startup-seconds``: age
of its process, or of its task in a resident worker, when the train handler began -- process
start or fork, imports, pulling the message, FAB) and the rest (evaluation messages, polling,
transfers, the server's own work).
With ``sim`` among the modes it also prints each deployment mode's **fixed overhead**: the
median round time of rounds 2..N minus the simulation's (issue 21's measure).  Modes:
:data:`MODES`.  It also times the ClientApp module import alone.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from deploy.cluster import Ports, run_loopback
from deploy.flower import ROOT
from deploy.launch import run_simulation
from deploy.processes import cmdline, memory_mb, pids_with, supernode_roles
from tests.flower_runs import TINY, tiny_budgets  # the tiny run of the deployment tests


def import_seconds(module: str = "client.app", repeats: int = 2) -> float:
    """Best-of wall time of a fresh interpreter importing ``module``."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, check=True)
        best = min(best, time.perf_counter() - t0)
    return best


#: The environment of each mode (what the launcher's processes read).
MODES: dict[str, dict[str, str]] = {
    "sim": {},
    "warm": {"HETFL_WARM_EXECUTOR": "1", "HETFL_RESIDENT_CLIENTAPP": "1"},
    "warm-fork": {"HETFL_WARM_EXECUTOR": "1", "HETFL_RESIDENT_CLIENTAPP": "0"},
    "warm-unbundled": {"HETFL_WARM_EXECUTOR": "1", "HETFL_RESIDENT_CLIENTAPP": "1", "HETFL_BUNDLE_ARRAYS": "0"},
    "warm-pulls8": {
        "HETFL_WARM_EXECUTOR": "1",
        "HETFL_RESIDENT_CLIENTAPP": "1",
        "FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS": "8",
    },
    "warm-idle3": {
        "HETFL_WARM_EXECUTOR": "1",
        "HETFL_RESIDENT_CLIENTAPP": "1",
        "HETFL_SUPERNODE_IDLE_S": "3",
        "HETFL_PULL_BACKOFF_S": "1,10",
    },
    "cold": {"HETFL_WARM_EXECUTOR": "0", "HETFL_RESIDENT_CLIENTAPP": "0"},
    "flower": {
        "HETFL_WARM_EXECUTOR": "0",
        "HETFL_RESIDENT_CLIENTAPP": "0",
        "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": "1.0",
        "HETFL_REPLY_POLL_S": "3",
        "HETFL_SUPERNODE_IDLE_S": "3",
        "HETFL_PULL_BACKOFF_S": "1,10",
    },
}


#: A resident worker's line after each task (client/warm.py): pid, task count, code, seconds, resident set.
RESIDENT_LINE = re.compile(r"\[client\.resident\] (\d+): task (\d+) ended \(code -?\d+\) in [\d.]+ s; rss (\d+) MB")


def resident_rss(log_dir: Path, tiers: Sequence[str] = ("weak", "medium", "strong")) -> dict[str, list[int]]:
    """Per tier, the resident worker's resident set (MB) after each task, from ``supernode-<tier>.log``."""
    out: dict[str, list[int]] = {}
    for tier in tiers:
        log = log_dir / f"supernode-{tier}.log"
        text = log.read_text(errors="replace") if log.exists() else ""
        out[tier] = [int(m.group(3)) for m in RESIDENT_LINE.finditer(text)]
    return out


class NodeMemory(threading.Thread):
    """RSS and PSS (MiB) of each SuperNode's long-lived processes, sampled while a loopback run runs.

    Every ``every`` seconds, for each SuperNode dialing ``127.0.0.1:FLEET_PORT``: its tier (from
    its node config) and its roles (:func:`deploy.processes.supernode_roles`: SuperNode, warm
    SuperExec, zygote, resident worker).  :meth:`summary` gives per tier and role the median
    (what the process holds between rounds, most of a run) and the largest sample.
    """

    def __init__(self, fleet_port: int, every: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.dial = f"--superlink 127.0.0.1:{fleet_port} "
        self.every = every
        self.samples: dict[tuple[str, str], list[tuple[float, float]]] = {}
        self.done = threading.Event()

    def sample(self) -> None:
        """One sample of every role of every SuperNode of this cluster."""
        for pid in pids_with("client.supernode"):
            line = cmdline(pid)
            tier = re.search(r"tier=[\"'](\w+)[\"']", line)
            if self.dial not in line + " " or tier is None:
                continue
            for role, role_pid in supernode_roles(pid).items():
                rss, pss = memory_mb(role_pid)
                if rss > 0:
                    self.samples.setdefault((tier.group(1), role), []).append((rss, pss))

    def run(self) -> None:
        """Sample until :attr:`done` is set."""
        while not self.done.wait(self.every):
            self.sample()

    def summary(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{tier: {role: {rss, rss-max, pss, pss-max}}}``: medians and maxima over the samples (MiB)."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (tier, role), values in sorted(self.samples.items()):
            rss, pss = [v[0] for v in values], [v[1] for v in values]
            out.setdefault(tier, {})[role] = {
                "rss": statistics.median(rss), "rss-max": max(rss), "pss": statistics.median(pss), "pss-max": max(pss)
            }  # fmt: skip
        return out


#: Order of the roles in the printed memory lines.
ROLES = ("supernode", "superexec", "zygote", "worker")


def memory_lines(mode: str, summary: dict[str, dict[str, dict[str, float]]]) -> list[str]:
    """Printable lines of :meth:`NodeMemory.summary`: per tier, each role's median / max RSS and PSS."""
    lines = []
    for tier, roles in summary.items():
        parts = [
            f"{role} RSS {m['rss']:.0f}/{m['rss-max']:.0f} PSS {m['pss']:.0f}/{m['pss-max']:.0f}"
            for role in ROLES if (m := roles.get(role))
        ]  # fmt: skip
        total = sum(m["pss"] for m in roles.values())
        lines.append(f"[{mode}] {tier} memory MiB (median/max): {'; '.join(parts)}; all PSS {total:.0f}")
    return lines


#: ``--model``: the run config of each measured model (the rounds are added).
MODELS: dict[str, str] = {
    "tiny": f"{TINY} tier-memory-mb='{{budgets}}'",  # the deployment tests' run: 2 local steps
    "minilm": "fraction-evaluate=1.0",  # the project's default run (MiniLM-L6, pyproject.toml)
}


def run_mode(
    mode: str, *, rounds: int, out: Path, port_base: int, model: str = "tiny", extra: str = ""
) -> list[dict[str, float]] | None:
    """One run in ``mode``; per round after the first: seconds, slowest training, slowest start-up.

    Modes (:data:`MODES`): ``sim`` (the same run as a Ray simulation with 3 virtual clients: the
    baseline the fixed overhead is measured against), ``warm`` (the launcher's defaults: warm
    SuperExec with a resident ClientApp worker per node (:mod:`client.resident`), short polls,
    SuperNodes through :mod:`client.supernode`), ``warm-fork`` (warm, but a fresh fork of the
    zygote per message, no resident worker), ``warm-unbundled`` (warm, each array its own object:
    ``HETFL_BUNDLE_ARRAYS=0``), ``warm-pulls8`` (warm, 8 concurrent object pulls
    where Flower makes 2: ``FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS``), ``warm-idle3`` (warm,
    but the SuperNode's idle wait and object-pull backoff as Flower's: 3 s, 1-10 s), ``cold`` (a
    fresh ``flwr-clientapp`` process per message, short polls), ``flower`` (cold and every wait
    as Flower's: SuperExec poll 1 s, reply polling 3 s, SuperNode idle 3 s, pull backoff 1-10 s).
    """
    env = MODES[mode]
    saved = {k: os.environ.get(k) for k in {k for m in MODES.values() for k in m}}
    os.environ.update(env)
    base = MODELS[model].replace("{budgets}", tiny_budgets()) if model == "tiny" else MODELS[model]
    run_config = f"{base} num-server-rounds={rounds} {extra}".strip()
    memory: NodeMemory | None = None
    try:
        t0 = time.perf_counter()
        if mode == "sim":
            outcome = run_simulation(
                supernodes=3, run_config=run_config, results_dir=out, run_name=mode,
                flwr_home=out / f"flwr-home-{mode}", echo=False,
            )  # fmt: skip
        else:
            memory = NodeMemory(port_base)
            memory.start()
            try:
                outcome = run_loopback(
                    tiers=["weak", "medium", "strong"], run_config=run_config,
                    results_dir=out, run_name=mode, ports=Ports(port_base, port_base + 1, port_base + 2),
                    flwr_home=out / f"flwr-home-{mode}", echo=False,
                )  # fmt: skip
            finally:
                memory.done.set()
                memory.join()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if not outcome.ok:
        print(outcome.log[-3000:], file=sys.stderr)
        return None
    rows = [json.loads(x) for x in (outcome.results / "rounds.jsonl").read_text().splitlines() if x.strip()]
    print(f"[{mode}] whole run {time.perf_counter() - t0:.1f} s (cluster start, {rounds} rounds, shutdown)")
    if mode != "sim":
        for tier, rss in resident_rss(out / mode / "logs").items():
            if rss:
                print(f"[{mode}] {tier} resident ClientApp worker after each task: {rss} MB (max {max(rss)})")
        summary = memory.summary() if memory is not None else {}
        print("\n".join(memory_lines(mode, summary)))
        (out / f"memory-{mode}.json").write_text(json.dumps(summary, indent=1))
    return [
        {
            "round": r["round"],
            "seconds": r["seconds"],
            "train": max((t.get("train-seconds", 0.0) for t in r["tiers"].values()), default=0.0),
            "startup": max((t.get("startup-seconds", 0.0) for t in r["tiers"].values()), default=0.0),
        }
        for r in rows[1:]
    ]


def median_after_first(rows: Sequence[dict[str, float]]) -> float:
    """Median round time of rounds 2..N (round 1 pays start-up: preloads, first imports, the whole model).

    (Before 2026-11-26 05:10 UTC the printed fixed overhead took the median over rounds 1..N.)
    """
    later = [r["seconds"] for r in rows if r["round"] >= 2]
    if not later:
        raise ValueError("the fixed overhead needs at least 2 rounds (--rounds 2 or more)")
    return statistics.median(later)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--model", choices=sorted(MODELS), default="tiny", help="tiny (default) or minilm")
    parser.add_argument(
        "--client-threads", type=int, default=None,
        help="run config client-threads for every mode (a Ray actor with 1 CPU runs torch on 1 thread; "
        "a ClientApp process on all cores unless this is set)",
    )  # fmt: skip
    parser.add_argument("--modes", default="sim,warm", help=f"comma-separated: {', '.join(MODES)}")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--port-base", type=int, default=19392)
    args = parser.parse_args(argv)
    out = args.out or Path(tempfile.mkdtemp(prefix="round-timing-"))
    results: dict[str, list[dict[str, float]]] = {}
    for mode in args.modes.split(","):
        extra = f"client-threads={args.client_threads}" if args.client_threads is not None else ""
        rows = run_mode(
            mode.strip(), rounds=args.rounds, out=out, port_base=args.port_base, model=args.model, extra=extra
        )
        if rows is None:
            return 1
        results[mode.strip()] = rows
    print(f"{'mode':>6} {'round':>5} {'seconds':>8} {'train':>7} {'start-up':>9} {'other':>7}")
    for mode, rows in results.items():
        for r in rows:
            other = r["seconds"] - r["train"] - r["startup"]
            print(
                f"{mode:>6} {r['round']:>5} {r['seconds']:>8.1f} {r['train']:>7.2f} {r['startup']:>9.2f} {other:>7.1f}"
            )
    if "sim" in results:
        base = median_after_first(results["sim"])
        print(f"fixed overhead per round (median of rounds 2-{args.rounds}, minus the simulation's {base:.1f} s):")
        for mode, rows in results.items():
            if mode != "sim":
                print(f"{mode:>10} {median_after_first(rows) - base:+.1f} s")
    (out / "round-timing.json").write_text(json.dumps(results, indent=1))
    print(f"fresh interpreter importing client.app: {import_seconds():.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
