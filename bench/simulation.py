"""Framework overhead and scale of real Ray simulations (``flwr run`` via ``deploy.launch``).

``overhead``
    A simulation of ``--clients`` virtual clients, every one training the same variant
    (``method="all-large"``), ``--rounds`` rounds, no federated evaluation, one client at a time
    (``client-resources-num-cpus=2`` on this 2-core machine, so Ray runs the ClientApps
    serially); the round's wall time comes from the run's ``rounds.jsonl`` (``seconds``, from
    ``configure_train`` to the end of the round: messages, training, aggregation, the server's
    central evaluation).  Against it, in this process right after the simulation and in the
    same hold of the lock, the *same local training as a bare PyTorch loop over the same
    clients*: per client its data partition (the client's own
    loaders), the variant built and loaded with the round's weights, ``train_classifier`` with
    the run's settings -- everything the ClientApp does except Flower.  Flower's share of a
    round after warm-up (rounds >= 2) is ``1 - bare / round``.  ``--threads N`` gives the
    ClientApps and the ServerApp N torch threads (``client-threads`` / ``server-threads``) and the
    bare loop the same N (it reads the same run config).
``scale``
    ``--clients`` virtual clients (e.g. 100 and 1000), 20 sampled per round, 2 rounds, the tiny
    model: the round time of every round and the peak resident memory of the simulation's
    server process (``flwr-simulation``: ServerApp + Ray driver), sampled every 0.2 s.  Round 1
    includes the handshake, which queries every node once; round 2 is the steady state.

Every simulation runs under the machine's simulation lock (:data:`deploy.locks.SIMULATION_LOCK`,
``/tmp/hetfl-sim.lock``: one simulation at a time), which this script takes itself: do not wrap
it in ``flock`` on the same file (the inner ``flock`` would wait for the outer one forever).
Run ``python -m bench.simulation --help``; ``--smoke`` runs only the bare loop part on 2 clients
(no Ray), which is what the test suite covers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bench.common import write_report
from deploy.locks import SIMULATION_LOCK, file_lock

#: Tiny model, a real amount of local training, no federated evaluation, small server test set.
BASE = (
    "model='tiny' method='all-large' server-test-size=100 eval-batch-size=32 client-test-fraction=0.2 "
    "fraction-evaluate=0.0"
)


#: Process kinds of a Ray simulation, by substrings of the command line (first match wins).
KINDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("clientapp", ("ClientAppActor",)),
    ("superlink", ("flower-superlink",)),
    ("serverapp", ("flwr-simulation",)),
    ("flwr-cli", ("deploy.flwr_cli run", "bin/flwr run")),
    ("ray", ("ray::", "/ray/", "raylet", "gcs_server")),
)
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE_MB = os.sysconf("SC_PAGE_SIZE") / 2**20


def _kind(cmd: str) -> str | None:
    if "bench.simulation" in cmd:
        return None
    return next((kind for kind, needles in KINDS if any(n in cmd for n in needles)), None)


def _scan() -> dict[int, tuple[str, float, float]]:
    """``pid -> (kind, CPU seconds so far, resident MB)`` of every simulation process now alive."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                kind = _kind(f.read().replace(b"\0", b" ").decode(errors="replace"))
            if kind is None:
                continue
            with open(f"/proc/{name}/stat") as f:  # fields 14, 15: utime, stime (after the ")")
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{name}/statm") as f:
                rss = int(f.read().split()[1]) * _PAGE_MB
            out[int(name)] = (kind, (int(fields[11]) + int(fields[12])) / _TICK, rss)
        except (OSError, ValueError, IndexError):
            continue
    return out


class ProcessSampler:
    r"""Background sampler of the simulation's processes: server peak RSS and CPU time per kind.

    Every ``interval`` seconds it reads ``/proc``: the summed RSS of the ``serverapp`` processes
    (``flwr-simulation``: ServerApp + Ray driver; ``peak`` is its maximum) and each process's
    CPU time (user + system), kept per pid so that a process that exits keeps its last sample.
    With ``rounds`` (a ``rounds.jsonl``), it also notes when each row appeared, and
    :meth:`cpu_between` gives the CPU seconds per kind used between two rows,
    :math:`\sum_{p \in kind} (c_p(t_b) - c_p(t_a))` (a process born after ``t_a`` counts from 0).
    """

    def __init__(self, rounds: Path | None = None, interval: float = 0.25) -> None:
        self.rounds, self.interval, self.peak = rounds, interval, 0.0
        self.samples: list[tuple[float, dict[int, tuple[str, float]]]] = []
        self.row_times: list[float] = []
        self._cpu: dict[int, tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.tick()
            time.sleep(self.interval)
        self.tick()

    def tick(self) -> None:
        """Take one sample."""
        now = time.time()
        procs = _scan()
        self.peak = max(self.peak, sum(rss for kind, _, rss in procs.values() if kind == "serverapp"))
        self._cpu.update({pid: (kind, cpu) for pid, (kind, cpu, _) in procs.items()})
        self.samples.append((now, dict(self._cpu)))
        if self.rounds is not None and self.rounds.exists():
            with self.rounds.open("rb") as f:
                rows = f.read().count(b"\n")
            self.row_times += [now] * (rows - len(self.row_times))

    def cpu_between(self, t_a: float, t_b: float) -> dict[str, float]:
        """CPU seconds per kind used between wall times ``t_a`` and ``t_b`` (nearest samples)."""
        before = next((cpu for t, cpu in reversed(self.samples) if t <= t_a), {})
        after = next((cpu for t, cpu in self.samples if t >= t_b), self.samples[-1][1] if self.samples else {})
        out = {kind: 0.0 for kind, _ in KINDS}
        for pid, (kind, cpu) in after.items():
            out[kind] += cpu - before.get(pid, (kind, 0.0))[1]
        return out

    def __enter__(self) -> ProcessSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def simulate(clients: int, run_config: str, name: str, *, cpus_per_client: float, timeout: float) -> dict[str, Any]:
    """One ``flwr run`` simulation under the simulation lock; its rounds and the server process's peak RSS."""
    from deploy.launch import run_simulation
    from tests.flower_runs import read_rounds

    tmp = Path(tempfile.mkdtemp(prefix="bench-sim-"))
    with file_lock(SIMULATION_LOCK):
        start = time.time()
        with ProcessSampler(tmp / name / "rounds.jsonl") as sampler:
            outcome = run_simulation(
                supernodes=clients,
                run_config=run_config,
                results_dir=tmp,
                run_name=name,
                flwr_home=tmp / "flwr-home",
                cpus_per_client=cpus_per_client,
                timeout=timeout,
                echo=False,
            )
        wall = time.time() - start
    if not outcome.ok:
        raise RuntimeError(f"simulation {name} failed:\n{outcome.log[-3000:]}")
    rows = read_rounds(outcome.results)
    # CPU seconds per process kind from the end of round 1 to the end of the last round
    times = sampler.row_times
    steady = sampler.cpu_between(times[1], times[-1]) if len(times) > 2 else {}
    steady_wall = times[-1] - times[1] if len(times) > 2 else 0.0
    return {
        "clients": clients,
        "wall_s": wall,
        "server_peak_rss_mb": sampler.peak,
        "rounds": rows[1:],
        "cpu_s_after_round_1": steady,
        "wall_s_after_round_1": steady_wall,
    }


def bare_loop(clients: int, run_config: str, rounds: int) -> list[dict[str, float]]:
    """The clients' local training without Flower, client after client, ``rounds`` times.

    Per round: ``build`` (variant rebuilt and loaded with the round's weights, as the ClientApp
    does) and ``train`` (``train_classifier`` on the client's own loader, the run's settings);
    the loaders come from the client's own (cached) ``train_loader``.  Weights are the plain
    mean of the returned models, so later rounds start from trained weights as in the run.
    """
    import torch

    from client.app import run_config as client_run_config
    from client.app import train_loader
    from models.training import train_classifier

    settings = dict(kv.split("=", 1) for kv in _split(run_config))
    ctx = SimpleNamespace(run_config={k: _value(v) for k, v in settings.items()}, node_config={})
    cfg = client_run_config(ctx)  # type: ignore[arg-type]
    variant = cfg.catalog.largest
    family = cfg.family()
    state = family.initial_states(cfg.catalog, seed=cfg.seed)[variant.name]
    out = []
    for r in range(rounds):
        build = train = 0.0
        new: dict[str, torch.Tensor] = {}
        for pid in range(clients):
            ctx.node_config = {"partition-id": pid, "num-partitions": clients}
            torch.manual_seed(cfg.seed + 1000 * r + pid)
            t0 = time.perf_counter()
            loader = train_loader(ctx, cfg)  # type: ignore[arg-type]
            model = family.build(variant)
            model.load_state_dict(state, strict=False)
            t1 = time.perf_counter()
            train_classifier(model, loader, cfg.train_settings())
            t2 = time.perf_counter()
            build, train = build + t1 - t0, train + t2 - t1
            for k, v in model.state_dict().items():
                new[k] = v.detach().clone() / clients if k not in new else new[k] + v.detach() / clients
        state = {k: new.get(k, t) for k, t in state.items()}
        out.append({"round": r + 1, "build_s": build, "train_s": train, "total_s": build + train})
    return out


def _split(run_config: str) -> list[str]:
    import shlex

    return shlex.split(run_config)


def _value(v: str) -> object:
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def overhead(a: argparse.Namespace) -> dict[str, Any]:
    """Flower's share of a round after warm-up."""
    rc = (
        f"{BASE} num-server-rounds={a.rounds} local-steps={a.local_steps} batch-size={a.batch_size} "
        f"min-available-nodes={a.clients} client-threads={a.threads} server-threads={a.threads}"
    )
    # both halves in one lock window, back to back, so no other simulation loads the machine
    # during either (the bare loop needs no lock itself)
    with file_lock(SIMULATION_LOCK):
        load = [os.getloadavg()[0]]
        sim = simulate(a.clients, rc, "overhead", cpus_per_client=2.0, timeout=a.timeout)
        load.append(os.getloadavg()[0])
        bare = bare_loop(a.clients, rc, a.rounds)
        load.append(os.getloadavg()[0])
    sim_rounds = [float(r["seconds"]) for r in sim["rounds"]]
    client_train = [
        sum(float(t.get("train-seconds", 0.0)) * float(t.get("clients", 0.0)) for t in r["tiers"].values())
        for r in sim["rounds"]
    ]
    bare_rounds = [b["total_s"] for b in bare]
    after = slice(1, None)  # rounds >= 2
    sim_ss = statistics.median(sim_rounds[after])
    bare_ss = statistics.median(bare_rounds[after])
    report = {
        "run_config": rc,
        "clients": a.clients,
        "sim_round_s": sim_rounds,
        "client_handler_s": client_train,
        "bare_round_s": bare_rounds,
        "bare_rounds": bare,
        "flower_share_after_warmup": 1.0 - bare_ss / sim_ss,
        "sim_wall_s": sim["wall_s"],
        "load_average_1m": load,
    }
    print(f"run config: {rc}; {a.clients} clients, serial (client-resources-num-cpus=2)")
    # outside s = the round minus the ClientApp train handlers: messages, Ray scheduling, aggregation,
    # the server's evaluation
    print(
        f"{'round':>5}{'sim round s':>13}{'ClientApp train s':>19}{'outside s':>11}{'bare loop s':>13}"
        f"{'flower share':>14}"
    )
    for i, (s, c, b) in enumerate(zip(sim_rounds, client_train, bare_rounds, strict=False)):
        print(f"{i + 1:>5}{s:>13.2f}{c:>19.2f}{s - c:>11.2f}{b:>13.2f}{1 - b / s:>14.1%}")
    print(f"Flower's share after warm-up (median of rounds >= 2): {report['flower_share_after_warmup']:.1%}")
    cpu, wall = sim["cpu_s_after_round_1"], sim["wall_s_after_round_1"]
    if cpu and wall > 0:
        # what each kind of process burnt in rounds >= 2, in cores (CPU seconds / wall seconds)
        report["cores_after_round_1"] = {kind: c / wall for kind, c in cpu.items()}
        total = sum(cpu.values())
        print(
            f"CPU in rounds >= 2 ({wall:.1f} s wall, {os.cpu_count()} cores): "
            + ", ".join(f"{kind} {c:.1f} s ({c / total:.0%})" for kind, c in cpu.items())
        )
    print(f"1-minute load average before / after the simulation / after the bare loop: {load}")
    return report


def scale(a: argparse.Namespace) -> dict[str, Any]:
    """Round time and server memory at each client count, 20 clients per round."""
    results = []
    print(f"{'clients':>8}{'per round':>10}{'round 1 s':>11}{'last round s':>14}{'server peak MB':>16}{'wall s':>8}")
    for n in (int(x) for x in a.clients_list.split(",")):
        rc = (
            f"{BASE} num-server-rounds={a.rounds} local-steps={a.local_steps} batch-size={a.batch_size} "
            f"fraction-train={a.per_round / n} min-train-nodes={a.per_round} min-available-nodes={n}"
        )
        sim = simulate(n, rc, f"scale-{n}", cpus_per_client=1.0, timeout=a.timeout)
        secs = [float(r["seconds"]) for r in sim["rounds"]]
        clients = [sum(int(t.get("clients", 0)) for t in r["tiers"].values()) for r in sim["rounds"]]
        results.append(
            {
                "clients": n,
                "run_config": rc,
                "round_s": secs,
                "trained": clients,
                **{k: sim[k] for k in ("wall_s", "server_peak_rss_mb")},
            }
        )
        print(
            f"{n:>8}{clients[-1]:>10}{secs[0]:>11.2f}{secs[-1]:>14.2f}{sim['server_peak_rss_mb']:>16.0f}{sim['wall_s']:>8.0f}",
            flush=True,
        )
    return {"scale": results}


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line of :func:`main`."""
    p = argparse.ArgumentParser(prog="python -m bench.simulation", description=(__doc__ or "").split("\n")[0])
    p.add_argument("mode", choices=("overhead", "scale"))
    p.add_argument("--clients", type=int, default=4, help="overhead: virtual clients")
    p.add_argument("--clients-list", default="100,1000", help="scale: client counts")
    p.add_argument("--per-round", type=int, default=20, help="scale: clients sampled per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--local-steps", type=int, default=30)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument(
        "--threads", type=int, default=0,
        help="overhead: torch threads of the ClientApps, the ServerApp and the bare loop (0 = torch's default)",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="overhead's bare loop only: 2 clients, 2 rounds, 1 step")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the chosen mode and print its table."""
    a = parse_args(argv)
    if a.smoke:
        rc = f"{BASE} num-server-rounds=2 local-steps=1 batch-size=4"
        rows = bare_loop(2, rc, 2)
        print(json.dumps(rows))
        return {"bare_rounds": rows}
    report = overhead(a) if a.mode == "overhead" else scale(a)
    write_report(a.json, report)
    return report


if __name__ == "__main__":
    main()
