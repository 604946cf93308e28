"""Server side of scale: the strategy's round time and memory with N registered clients, 20 per round.

Without Ray: a fake ``Grid`` lists ``N`` connected node ids and answers the handshake's
``query`` messages with a profile (every node picks the largest variant); each round runs the
strategy's own ``configure_train`` (sampling 20 of the ``N`` nodes, building their messages)
and ``aggregate_train`` on 20 real reply messages over the tiny model.  A fresh subprocess per
``N`` measures the wall time of every round and the peak anonymous RSS growth over the
baseline taken after the strategy and its state are built.  Round 1 includes the handshake
(one query per node, answered at once here); later rounds are the steady state whose cost
should not depend on ``N``.  (The Ray simulation of the same setup is ``bench.simulation
scale``, which needs the simulation lock.)

Run ``python -m bench.scale_server --help``; ``--smoke`` runs 50 vs 100 clients, 5 per round.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from bench.common import run_child, write_report

ROOT = Path(__file__).resolve().parent.parent


class FakeGrid:
    """``N`` connected nodes; answers ``query`` messages with a profile choosing ``variant``."""

    def __init__(self, nodes: int, variant: str) -> None:
        self.nodes, self.variant, self._next = nodes, variant, 0

    def get_node_ids(self) -> Iterable[int]:
        """Every node is online."""
        return range(1, self.nodes + 1)

    def send_and_receive(self, messages: Iterable[Any], *, timeout: float | None = None) -> list[Any]:
        """One profile reply per query message."""
        from flwr.app import Message, RecordDict

        from bench.aggregation import _set_message_id
        from experiment.protocol import PROFILE, ProfileReply

        replies = []
        for msg in messages:
            self._next += 1
            _set_message_id(msg, f"q-{self._next}")
            node = msg.metadata.dst_node_id
            profile = ProfileReply(
                tier=self.variant,
                memory_mb=1e6,
                memory_source="bench",
                num_examples=1000,
                labeled=True,
                variant=self.variant,
                reason="",
                node_key=f"partition-{node}",
            )
            replies.append(Message(RecordDict({PROFILE: profile.to_record()}), reply_to=msg))
        return replies


def child(clients: int, per_round: int, rounds: int, model: str) -> dict[str, Any]:
    """Run ``rounds`` server rounds with ``clients`` registered nodes in this fresh process."""
    import gc

    from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

    from bench.aggregation import _payload_pool, _set_message_id, quiet_flower, run_config, set_task_identity
    from models.memory_probe import PeakSampler, anon_rss_mb
    from server.app import build_strategy

    quiet_flower()
    set_task_identity()
    cfg = run_config(model, "all-large").model_copy(
        update={"fraction_train": per_round / clients, "min_train_nodes": per_round}
    )
    strategy = build_strategy(cfg)
    arrays = strategy.set_state(strategy.initial_state(cfg.family().initial_states(cfg.catalog, seed=0)))
    variant = strategy.catalog.largest.name
    # two distinct replies per round, new ones each round: the same weights in a later round are a
    # replay, which the server rejects (strategies/replay.py), as it would a real node's
    pools = [_payload_pool(strategy, [variant], 2, r)[variant] for r in range(rounds)]
    grid = FakeGrid(clients, variant)
    gc.collect()
    baseline = anon_rss_mb()
    times, configure, sampled = [], [], []
    with PeakSampler() as sampler:
        for r in range(1, rounds + 1):
            start = time.perf_counter()
            msgs = list(strategy.configure_train(r, arrays, ConfigRecord({}), grid))  # type: ignore[arg-type]
            configure.append(time.perf_counter() - start)
            for i, m in enumerate(msgs):
                _set_message_id(m, f"t-{r}-{i}")
            replies = (
                Message(
                    RecordDict(
                        {
                            "arrays": pools[r - 1][i % 2],
                            "metrics": MetricRecord({"num-examples": 500}),
                            "config": ConfigRecord({"variant": variant, "server-round": r}),
                        }
                    ),
                    reply_to=m,
                )
                for i, m in enumerate(msgs)
            )
            new, _ = strategy.aggregate_train(r, replies)
            if new is None or strategy.report(r).rejected:
                raise RuntimeError(f"round {r}: the benchmark's replies were rejected: {strategy.report(r).rejected}")
            arrays = new
            times.append(time.perf_counter() - start)
            sampled.append(len(msgs))
    return {
        "clients": clients,
        "per_round": sampled,
        "round_s": times,
        "configure_train_s": configure,
        "peak_growth_mb": sampler.peak - baseline,
        "baseline_mb": baseline,
    }


def measure(clients: int, per_round: int, rounds: int, model: str) -> dict[str, Any]:
    """:func:`child` in a fresh interpreter."""
    return run_child(
        "bench.scale_server",
        [str(clients), "--per-round", str(per_round), "--rounds", str(rounds), "--model", model],
        f"N={clients}",
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line of :func:`main`."""
    p = argparse.ArgumentParser(prog="python -m bench.scale_server", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--clients-list", default="100,1000")
    p.add_argument("--per-round", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default="tiny")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="50 vs 100 clients, 5 per round, 2 rounds")
    a = p.parse_args(argv)
    if a.smoke:
        a.clients_list, a.per_round, a.rounds = "50,100", 5, 2
    return a


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure every client count; print round times and memory."""
    a = parse_args(argv)
    if a.child is not None:
        print(json.dumps(child(a.child, a.per_round, a.rounds, a.model)))
        return {}
    rows = []
    print(f"model {a.model}, {a.per_round} clients per round, {a.rounds} rounds, fresh subprocess per N")
    print(f"{'clients':>8}{'sampled':>9}{'round 1 s':>11}{'peak RSS+ MB':>14}  later rounds s (configure_train s)")
    for n in (int(x) for x in a.clients_list.split(",")):
        r = measure(n, a.per_round, a.rounds, a.model)
        rows.append(r)
        later = ", ".join(
            f"{t:.3f} ({c:.3f})" for t, c in zip(r["round_s"][1:], r["configure_train_s"][1:], strict=True)
        )
        print(f"{n:>8}{r['per_round'][-1]:>9}{r['round_s'][0]:>11.3f}{r['peak_growth_mb']:>14.1f}  {later}", flush=True)
    report = {"per_round": a.per_round, "rounds": a.rounds, "model": a.model, "rows": rows}
    write_report(a.json, report)
    return report


if __name__ == "__main__":
    main()
