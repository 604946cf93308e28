"""Server memory while aggregating ``R`` replies: peak resident growth, 10 vs 100 replies.

Every measurement runs in a fresh subprocess (``--child``): it builds the strategy of
``server.app.build_strategy`` with its initial state and a small pool of reply payload records
(:func:`bench.aggregation.build_round`, ``lazy=True``), then samples its anonymous resident
memory (``models.memory_probe.PeakSampler``, every millisecond) while
``strategy.aggregate_train`` consumes a *generator* that builds the ``R`` reply messages one at
a time over the pool's records.  The generator holds nothing, so what grows is the strategy's
own state: accumulators, temporaries, the next round's record.  ``growth = peak(R=100) /
peak(R=10)`` of the increase over the baseline taken just before the call; the target
(streaming aggregation) is ``< 1.2``.  ``--held`` hands the strategy a *list* of the messages
instead (built before the baseline: the caller's, as Flower's ``send_and_receive`` returns a
list), the path where finiteness is checked on the sums (``defers_finiteness``).

Run ``python -m bench.server_memory --help``; ``--smoke`` is the test suite's tiny run.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import run_child, write_report

ROOT = Path(__file__).resolve().parent.parent


def child(model: str, method: str, replies: int, scenario: str, held: bool = False) -> dict[str, Any]:
    """One measurement in this (fresh) process."""
    import gc

    from bench.aggregation import build_round, iter_replies, quiet_flower
    from models.memory_probe import PeakSampler, anon_rss_mb

    quiet_flower()
    round_ = build_round(model, method, replies, scenario=scenario, lazy=True)
    messages = list(iter_replies(round_)) if held else iter_replies(round_)
    gc.collect()
    baseline = anon_rss_mb()
    with PeakSampler() as sampler:
        round_.strategy.aggregate_train(1, messages)
    rejected = round_.strategy.report(1).rejected
    if rejected:
        raise RuntimeError(f"replies rejected: {rejected[:2]}")
    model_mb = sum(t.numel() * t.element_size() for p in round_.initial.values() for t in p.values()) / 2**20
    return {
        "model": model,
        "method": method,
        "replies": replies,
        "scenario": scenario,
        "held": held,
        "baseline_mb": baseline,
        "peak_mb": sampler.peak,
        "growth_mb": sampler.peak - baseline,
        "server_state_mb": model_mb,
    }


def measure(model: str, method: str, replies: int, scenario: str, held: bool = False) -> dict[str, Any]:
    """Run :func:`child` in a fresh interpreter and return its numbers."""
    args = ["--models", model, "--methods", method, "--replies", str(replies), "--scenario", scenario]
    what = f"child ({model} {method} R={replies})"
    return run_child("bench.server_memory", [*args, "--held"] if held else args, what)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line of :func:`main`."""
    p = argparse.ArgumentParser(prog="python -m bench.server_memory", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--models", default="minilm-l6")
    p.add_argument("--methods", default="inclusivefl,heterofl,flexifed-max,all-large")
    p.add_argument("--replies", default="10,100", help="exactly two R values: small,large")
    p.add_argument("--scenario", default="mixed", choices=("mixed", "homogeneous"))
    p.add_argument("--held", action="store_true", help="replies as a list (Flower's), not a generator")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="tiny model, 2 vs 6 replies, one method")
    a = p.parse_args(argv)
    if a.smoke:
        a.models, a.methods, a.replies = "tiny", "inclusivefl", "2,6"
    return a


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure every (model, method) at both R values; print and return the growth ratios."""
    a = parse_args(argv)
    if a.child:
        print(json.dumps(child(a.models, a.methods, int(a.replies), a.scenario, a.held)))
        return {}
    small, large = (int(x) for x in a.replies.split(","))
    rows = []
    given = "a list (held)" if a.held else "a generator (streamed)"
    print(f"# fresh subprocess per measurement; {os.cpu_count()} CPUs; scenario {a.scenario}; replies as {given}")
    print(f"{'model':<11}{'method':<14}{'state MB':>9}{f'+MB R={small}':>11}{f'+MB R={large}':>12}{'growth':>8}")
    for model in a.models.split(","):
        for method in a.methods.split(","):
            lo = measure(model, method, small, a.scenario, a.held)
            hi = measure(model, method, large, a.scenario, a.held)
            growth = hi["growth_mb"] / lo["growth_mb"] if lo["growth_mb"] > 0 else float("nan")
            rows.append({"small": lo, "large": hi, "growth": growth})
            print(
                f"{model:<11}{method:<14}{lo['server_state_mb']:>9.1f}{lo['growth_mb']:>11.1f}"
                f"{hi['growth_mb']:>12.1f}{growth:>8.2f}",
                flush=True,
            )
    report = {"replies": [small, large], "scenario": a.scenario, "held": a.held, "rows": rows}
    write_report(a.json, report)
    return report


if __name__ == "__main__":
    main()
