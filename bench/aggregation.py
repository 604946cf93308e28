"""Server aggregation time of every strategy's ``aggregate_train`` against two references.

One synthetic round: ``R`` replies, real Flower ``Message`` objects whose content is what a
ClientApp sends (``arrays``: an ``ArrayRecord`` of the variant's trainable tensors, ``metrics``:
``num-examples``, ``config``: variant and round), answering real instruction messages the
strategy "sent" (registered as in :meth:`HeterogeneousStrategy.configure_train`).  Timed with
:func:`time.perf_counter`, variants interleaved (one run of each per repeat), best of
``--repeats`` after ``--warmup`` untimed runs:

``<method>``
    ``strategy.aggregate_train(1, replies)`` of the strategy ``server.app.build_strategy``
    makes for ``RunConfig(model=..., method=...)`` — validation, record -> tensor
    conversion, streaming sums, the method's math and the composite record for the next
    round, all of it.
``bare-sum``
    The floor over the *same bytes*: per reply and tensor, a zero-copy ``torch`` view of the
    ``Array``'s payload bytes is folded into a per-variant accumulator with
    ``acc.add_(x, alpha=w)``; then one division per accumulator.  No validation, no output
    record.
``flower-fedavg``
    Flower's own ``flwr.serverapp.strategy.FedAvg.aggregate_train`` (homogeneous scenario
    only: it cannot aggregate mixed variants).

Scenarios: ``mixed`` (replies cycle through the method's tiers, as in a heterogeneous round)
and ``homogeneous`` (every reply is the largest variant; Flower's FedAvg runs on exactly those
replies).  To bound the benchmark's own memory, replies reuse ``--distinct`` payload records
per variant (each decoded afresh by every method, so no method gets them cached).

Run ``python -m bench.aggregation --help``; ``--smoke`` is the tiny configuration the test
suite runs.
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAvg
from flwr.supercore.task_identity import TaskIdentity
from torch import Tensor

from bench.common import write_report
from bench.heterofl_aggregation import Timing
from experiment import registry
from experiment.config import RunConfig
from server.app import build_strategy
from strategies.base import HeterogeneousStrategy
from strategies.profiles import NodeProfile
from strategies.replies import Sent
from strategies.validation import _header_bytes, _npy_header

_MB = 1024 * 1024
_GB = 1024**3

#: ``name -> (RunConfig keys)``: the models of issue 8 (MiniLM-L6, 22.7M, and a VGG) and tiny ones.
MODELS: dict[str, dict[str, Any]] = {
    "minilm-l6": {"model": "minilm-l6"},
    "vgg": {"model": "vgg", "tiers": "vgg11:vgg13:vgg16", "arch-width": 1.0, "tier-memory-mb": "auto"},
    "tiny": {"model": "tiny"},
    "vgg-tiny": {"model": "vgg", "tiers": "vgg11:vgg13:vgg16", "arch-width": 0.0625, "tier-memory-mb": "auto"},
}
#: Methods per model family (FedAvg baseline = ``all-large``: the repository's homogeneous strategy).
TRANSFORMER_METHODS = ("inclusivefl", "heterofl", "flexifed-max", "all-large")
VGG_METHODS = ("flexifed-max", "flexifed-clustered")
BARE = "bare-sum"
FLOWER = "flower-fedavg"


def methods_for(model: str) -> tuple[str, ...]:
    """The strategies that apply to ``model``."""
    return VGG_METHODS if MODELS[model]["model"] == "vgg" else TRANSFORMER_METHODS


def quiet_flower() -> None:
    """Flower's per-round INFO lines would dominate the output."""
    logging.getLogger("flwr").setLevel(logging.WARNING)


def set_task_identity() -> None:
    """Let ``Message`` be built outside a running ServerApp (as Flower's own strategy tests do)."""
    for attr in ("run_id", "node_id", "task_id"):
        try:
            getattr(TaskIdentity, attr)
        except RuntimeError:
            setattr(TaskIdentity, attr, 1)


def _set_message_id(msg: Message, message_id: str) -> None:
    # ``Grid.push_messages`` fills the id in place; do the same here.
    msg.metadata.__dict__["_message_id"] = message_id


def array_view(arr: Array) -> Tensor:
    """Zero-copy read-only tensor over a NumPy-serialized ``Array``'s payload bytes."""
    # the header parser the strategies use (cached per distinct header), so the floor pays no more
    offset, shape, fortran, dtype = _npy_header(_header_bytes(arr.data))
    nd = np.frombuffer(arr.data, dtype=dtype, count=int(np.prod(shape)), offset=offset)
    nd = nd.reshape(shape, order="F" if fortran else "C")
    return torch.from_numpy(nd) if nd.flags.writeable else _readonly_tensor(nd)


def _readonly_tensor(nd: np.ndarray) -> Tensor:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # never written: only read by add_
        return torch.from_numpy(nd)


@dataclass
class Round:
    """A strategy ready to aggregate, and the replies of one round."""

    method: str
    cfg: RunConfig
    strategy: HeterogeneousStrategy
    initial: dict[str, dict[str, Tensor]]
    replies: list[Message]
    variants: list[str]
    weights: list[float]
    flower_replies: list[Message] = field(default_factory=list)

    @property
    def reply_bytes(self) -> int:
        """Payload bytes of all replies (what every method reads)."""
        return sum(len(a.data) for m in self.replies for a in _arrays(m).values())

    def reset(self) -> None:
        """Put the server state back to round 0 (every timed run aggregates the same round)."""
        self.strategy.set_state({k: dict(v) for k, v in self.initial.items()})
        self.strategy.reports.clear()


def _arrays(msg: Message) -> ArrayRecord:
    rec = msg.content["arrays"]
    if not isinstance(rec, ArrayRecord):
        raise TypeError(f"the message's 'arrays' is a {type(rec).__name__}, not an ArrayRecord")
    return rec


def run_config(model: str, method: str) -> RunConfig:
    """The run configuration of ``method`` on ``model`` (tier memory: every tier fits its variant)."""
    extra = {"tier-widths": "0.25:0.5:1"} if model == "tiny" and registry.lookup(method).width_tiers else {}
    return RunConfig.model_validate({**MODELS[model], **extra, "method": method})


def build_round(
    model: str,
    method: str,
    replies: int,
    *,
    scenario: str = "mixed",
    distinct: int = 2,
    seed: int = 0,
    lazy: bool = False,
) -> Round:
    """Strategy of ``method`` with its initial state, ``replies`` sent messages and their replies.

    With ``lazy=True`` the replies list stays empty; :func:`iter_replies` makes them one at a time.
    """
    set_task_identity()
    cfg = run_config(model, method)
    strategy = build_strategy(cfg)
    initial = strategy.initial_state(cfg.family().initial_states(cfg.catalog, seed=seed))
    strategy.set_state(initial)
    names = strategy.catalog.names()
    largest = strategy.catalog.largest.name
    rng = np.random.default_rng(seed)
    variants = [largest if scenario == "homogeneous" else names[i % len(names)] for i in range(replies)]
    weights = [float(x) for x in rng.integers(100, 600, size=replies)]
    strategy.current_round = 1
    round_ = Round(method, cfg, strategy, initial, [], variants, weights)
    pool = _payload_pool(strategy, sorted(set(variants)), distinct, seed)
    round_.__dict__["_pool"] = pool
    sent: dict[str, Sent] = {}
    for i, variant in enumerate(variants):
        node = 1000 + i
        strategy.profiles[node] = NodeProfile(node, variant, 1e6, 10_000, True, variant, "")
        msg = Message(
            RecordDict({"config": ConfigRecord({"variant": variant})}), dst_node_id=node, message_type=MessageType.TRAIN
        )
        _set_message_id(msg, f"msg-{i}")
        sent[str(id(msg))] = Sent(msg, node, variant, 0)
    strategy._sent_train = sent
    round_.__dict__["_sent"] = list(sent.values())
    if not lazy:
        round_.replies = list(iter_replies(round_))
        if scenario == "homogeneous":
            round_.flower_replies = [
                Message(RecordDict({"arrays": _arrays(m), "metrics": m.content["metrics"]}), reply_to=s.message)
                for m, s in zip(round_.replies, round_.__dict__["_sent"], strict=True)
            ]
    return round_


def _payload_pool(
    strategy: HeterogeneousStrategy, variants: Sequence[str], distinct: int, seed: int
) -> dict[str, list[ArrayRecord]]:
    """``distinct`` reply records per variant: the sent weights plus noise, trainable tensors only."""
    gen = torch.Generator().manual_seed(seed)
    pool: dict[str, list[ArrayRecord]] = {}
    for variant in variants:
        layout = strategy.catalog.get(variant).layout.by_name()
        payload = strategy.variant_payload(1, variant)
        recs = []
        for _ in range(distinct):
            rec = ArrayRecord()
            for name, t in payload.items():
                if layout[name].trainable:
                    noisy = (
                        t + 0.01 * torch.randn(t.shape, generator=gen, dtype=t.dtype) if t.is_floating_point() else t
                    )
                    rec[name] = Array(noisy.detach().cpu().numpy())
            recs.append(rec)
        pool[variant] = recs
    return pool


def iter_replies(round_: Round) -> Iterator[Message]:
    """The round's replies, built one at a time (they share the pool's payload records)."""
    pool: dict[str, list[ArrayRecord]] = round_.__dict__["_pool"]
    counter: dict[str, int] = {}
    for s, w in zip(round_.__dict__["_sent"], round_.weights, strict=True):
        k = counter.get(s.variant, 0)
        counter[s.variant] = k + 1
        rec = pool[s.variant][k % len(pool[s.variant])]
        content = RecordDict(
            {
                "arrays": rec,
                "metrics": MetricRecord({"num-examples": int(w), "train-loss": 0.5}),
                "config": ConfigRecord({"variant": s.variant, "server-round": 1}),
            }
        )
        yield Message(content, reply_to=s.message)


def bare_weighted_sum(replies: Sequence[Message], variants: Sequence[str]) -> dict[str, dict[str, Tensor]]:
    """Per variant the example-weighted mean of the replies, read straight from the payload bytes."""
    sums: dict[str, dict[str, Tensor]] = {}
    totals: dict[str, float] = {}
    for msg, variant in zip(replies, variants, strict=True):
        w = float(msg.content["metrics"]["num-examples"])  # type: ignore[index,arg-type]
        acc = sums.get(variant)
        if acc is None:
            sums[variant] = {k: array_view(a).mul(w) for k, a in _arrays(msg).items()}
            totals[variant] = w
            continue
        for k, a in _arrays(msg).items():
            acc[k].add_(array_view(a), alpha=w)
        totals[variant] += w
    for variant, acc in sums.items():
        for t in acc.values():
            t.div_(totals[variant])
    return sums


def flower_fedavg(replies: Sequence[Message]) -> ArrayRecord | None:
    """Flower's built-in FedAvg weighted by ``num-examples``."""
    arrays, _ = FedAvg(weighted_by_key="num-examples").aggregate_train(1, replies)
    return arrays


def time_interleaved(
    runs: Mapping[str, tuple[Callable[[], None], Callable[[], object]]], repeats: int, warmup: int
) -> dict[str, Timing]:
    """``warmup`` untimed rounds, then ``repeats`` rounds; each round runs every variant once, in turn.

    ``runs[name] = (prepare, run)``: ``prepare`` (untimed, e.g. resetting the server state) then
    ``run`` (timed).  Interleaving spreads the machine's load changes over all variants.
    """
    times: dict[str, list[float]] = {k: [] for k in runs}
    for i in range(warmup + repeats):
        for name, (prepare, run) in runs.items():
            prepare()
            gc.collect()
            start = time.perf_counter()
            result = run()
            elapsed = time.perf_counter() - start
            del result
            if i >= warmup:
                times[name].append(elapsed)
    return {k: Timing(tuple(v)) for k, v in times.items()}


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _aggregate_call(r: Round) -> Callable[[], object]:
    return lambda: r.strategy.aggregate_train(1, r.replies)


def bench_case(
    model: str, replies: int, scenario: str, methods: Sequence[str], repeats: int, warmup: int, distinct: int
) -> dict[str, Any]:
    """Time every method and the references on one ``(model, R, scenario)``; ratios within this run."""
    rounds = {m: build_round(model, m, replies, scenario=scenario, distinct=distinct) for m in methods}
    first = rounds[methods[0]]
    runs: dict[str, tuple[Callable[[], None], Callable[[], object]]] = {}
    for m, r in rounds.items():
        runs[m] = (r.reset, _aggregate_call(r))
    runs[BARE] = (lambda: None, lambda: bare_weighted_sum(first.replies, first.variants))
    if scenario == "homogeneous":
        runs[FLOWER] = (lambda: None, lambda: flower_fedavg(first.flower_replies))
    for m, r in rounds.items():
        r.reset()
        r.strategy.aggregate_train(1, r.replies)
        rejected = r.strategy.report(1).rejected
        if rejected:
            raise RuntimeError(f"{m}: replies rejected: {rejected[:2]}")
    timings = time_interleaved(runs, repeats, warmup)
    bare = timings[BARE].best
    flower = timings[FLOWER].best if FLOWER in timings else None
    out: dict[str, Any] = {"model": model, "replies": replies, "scenario": scenario, "methods": {}}
    for name, t in timings.items():
        r = rounds.get(name, first)
        nbytes = r.reply_bytes
        out["methods"][name] = {
            "best_s": t.best,
            "median_s": t.median,
            "times_s": list(t.times),
            "reply_bytes": nbytes,
            "gbps": nbytes / t.best / _GB,
            # same bytes for every method only in the homogeneous scenario; else per method's own replies
            "x_bare": t.best / bare if r is first or scenario == "homogeneous" else None,
            "x_flower": None if flower is None else t.best / flower,
        }
    # in the mixed scenario each method has its own tiers: its own bare sum over its own bytes
    if scenario == "mixed":
        own = {
            m: (r.reset, lambda r=r: bare_weighted_sum(r.replies, r.variants))
            for m, r in rounds.items()
            if r is not first
        }
        if own:
            pairs: dict[str, tuple[Callable[[], None], Callable[[], object]]] = {}
            for m, run in own.items():
                pairs[m] = runs[m]
                pairs[f"{BARE}:{m}"] = run
            t2 = time_interleaved(pairs, repeats, warmup)
            for m in own:
                out["methods"][m]["x_bare"] = t2[m].best / t2[f"{BARE}:{m}"].best
                out["methods"][m]["bare_best_s"] = t2[f"{BARE}:{m}"].best
    for r in rounds.values():
        r.reset()
    return out


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line of :func:`main`."""
    p = argparse.ArgumentParser(prog="python -m bench.aggregation", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--models", default="minilm-l6,vgg", help=f"comma-separated, of {sorted(MODELS)}")
    p.add_argument("--replies", default="10,50,100", help="comma-separated R values")
    p.add_argument("--scenarios", default="homogeneous,mixed")
    p.add_argument("--methods", default=None, help="comma-separated (default: all that apply to the model)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--distinct", type=int, default=2, help="distinct payload records per variant")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: leave torch's default)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny models, R=3, 1 repeat (the test suite's run)")
    a = p.parse_args(argv)
    if a.smoke:
        a.models, a.replies, a.repeats, a.warmup, a.distinct = "tiny,vgg-tiny", "3", 1, 0, 1
    return a


def format_case(case: Mapping[str, Any]) -> str:
    """Table of one case."""
    lines = [
        f"{case['model']}, R={case['replies']}, {case['scenario']}",
        f"  {'method':<20}{'best s':>9}{'median s':>10}{'reply MB':>10}{'GB/s':>7}{'x bare':>8}{'x flower':>9}",
    ]
    for name, m in case["methods"].items():
        xb = "" if m["x_bare"] is None else f"{m['x_bare']:.2f}"
        xf = "" if m["x_flower"] is None else f"{m['x_flower']:.2f}"
        lines.append(
            f"  {name:<20}{m['best_s']:>9.4f}{m['median_s']:>10.4f}{m['reply_bytes'] / _MB:>10.1f}"
            f"{m['gbps']:>7.2f}{xb:>8}{xf:>9}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run every requested case, print tables, return (and optionally write) the report."""
    a = parse_args(argv)
    quiet_flower()
    if a.threads > 0:
        torch.set_num_threads(a.threads)
    report: dict[str, Any] = {
        "machine": {"cpu_count": os.cpu_count(), "torch": torch.__version__, "threads": torch.get_num_threads()},
        "load_average_1m": [_load()],
        "cases": [],
    }
    print(
        f"# torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs, "
        f"load {_load()}; best of {a.repeats} (interleaved), after {a.warmup} warm-up"
    )
    for model in a.models.split(","):
        methods = tuple(a.methods.split(",")) if a.methods else methods_for(model)
        for scenario in a.scenarios.split(","):
            for r in (int(x) for x in a.replies.split(",")):
                case = bench_case(model, r, scenario, methods, a.repeats, a.warmup, a.distinct)
                report["cases"].append(case)
                print(format_case(case), flush=True)
    report["load_average_1m"].append(_load())
    print(f"# load {report['load_average_1m']}")
    write_report(a.json, report)
    sys.stdout.flush()
    return report


if __name__ == "__main__":
    main()
