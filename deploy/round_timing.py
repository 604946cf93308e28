"""Split a loopback deployment round into training and fixed overhead.

Usage::

    python -m deploy.round_timing [--rounds 3] [--before] [--out results/round-timing]

Runs the tiny model on a loopback cluster (one SuperLink, weak / medium / strong
SuperNodes over gRPC) and prints, per round, the server-side wall time of the round
(``seconds`` in ``rounds.jsonl``: from ``configure_train`` to the end of evaluation), the
training time the slowest ClientApp reported (``train-seconds``: rebuilding the variant,
loading data, local steps) and the rest: fixed overhead (a fresh ``flwr-clientapp``
process per message with its imports, SuperNode / SuperExec / grid polling, transfers).
It also times the ClientApp module import alone.  ``--before`` restores Flower's default
poll intervals (SuperExec 1 s, reply polling 3 s) to measure what the launcher's and the
strategy's shorter ones save.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from deploy.launch import ROOT, Ports, run_loopback

#: The tiny run of the deployment tests (tests/flower_runs.py).
TINY = (
    "model='tiny' server-test-size=100 local-steps=2 eval-batch-size=32 client-test-fraction=0.2 fraction-evaluate=1.0"
)


def import_seconds(module: str = "client.app", repeats: int = 2) -> float:
    """Best-of wall time of a fresh interpreter importing ``module``."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", f"import {module}"], cwd=ROOT, check=True)
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", action="store_true", help="Flower's default poll intervals")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--port-base", type=int, default=19392)
    args = parser.parse_args(argv)
    from tests.flower_runs import tiny_budgets

    if args.before:
        os.environ["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = "1.0"
        os.environ["HETFL_REPLY_POLL_S"] = "3"
    out = args.out or Path(tempfile.mkdtemp(prefix="round-timing-"))
    label = "before" if args.before else "after"
    t0 = time.perf_counter()
    outcome = run_loopback(
        tiers=["weak", "medium", "strong"],
        run_config=f"{TINY} num-server-rounds={args.rounds} tier-memory-mb='{tiny_budgets()}'",
        results_dir=out, run_name=label,
        ports=Ports(args.port_base, args.port_base + 1, args.port_base + 2),
        flwr_home=out / f"flwr-home-{label}", echo=False,
    )  # fmt: skip
    total = time.perf_counter() - t0
    if not outcome.ok:
        print(outcome.log[-3000:], file=sys.stderr)
        return 1
    rows = [json.loads(x) for x in (outcome.results / "rounds.jsonl").read_text().splitlines() if x.strip()]
    print(f"[{label}] whole run {total:.1f} s (cluster start, {args.rounds} rounds, shutdown)")
    print(f"{'round':>5} {'seconds':>8} {'train':>7} {'overhead':>9}")
    for r in rows[1:]:
        train = max((t.get("train-seconds", 0.0) for t in r["tiers"].values()), default=0.0)
        print(f"{r['round']:>5} {r['seconds']:>8.1f} {train:>7.2f} {r['seconds'] - train:>9.1f}")
    print(f"fresh interpreter importing client.app: {import_seconds():.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
