"""Benchmark of HeteroFL's coverage-weighted mean against a dense weighted sum over the same bytes.

Three aggregations of one synthetic round are timed with :func:`time.perf_counter` (one warm-up
run, then ``--repeats`` timed runs; best and median are reported):

``heterofl``
    Exactly what :class:`strategies.heterofl.HeteroFL` does in a round: a fresh
    :class:`~strategies.heterofl.CoverageMean` over the full model, one
    :meth:`~strategies.heterofl.CoverageMean.add` per reply with the index sets rebuilt by
    :func:`~strategies.heterofl.group_index_sets` from the reply's rate, then
    :meth:`~strategies.heterofl.CoverageMean.result`.
``dense-same-bytes``
    The cost floor of reading every reply byte once: per reply, ``acc[name].add_(x, alpha=w)``
    into a preallocated accumulator of the *sub-model's own shape* (one accumulator set per
    distinct rate), then one in-place division per accumulator.  Touches as many reply bytes as
    ``heterofl`` but does no scatter and no full-model pass.
``fedavg-full``
    Reference: dense FedAvg of ``N`` full-size replies (every client at rate 1).

The replies are sub-models cut with :func:`~strategies.heterofl.extract_with_indices` from a
randomly initialised full model at rates cycling through ``--rates``, plus Gaussian noise;
weights are random example counts.  For ``minilm-l6`` the frozen word-embedding matrix is not
part of a reply (as in the real system, ``freeze_word_embeddings=True``) unless
``--upload-frozen`` is given.

Run ``python -m bench.heterofl_aggregation --help`` for the options; see ``bench/README.md``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import json
import os
import platform
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor

from models.cnn import CONV, HETEROFL_BASE, PRERESNET18, build_cnn, width_rules
from strategies.heterofl import CoverageMean, WidthRules, extract_with_indices, group_index_sets

Params = dict[str, Tensor]
T = TypeVar("T")

MINILM = "minilm-l6"
TINY_BERT = "tiny"
MODELS = (PRERESNET18, CONV, MINILM, TINY_BERT)
METHODS = ("heterofl", "dense-same-bytes", "fedavg-full")
_GB = 1e9
_MB = 1e6


# --- workload ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class BenchConfig:
    """What to benchmark.

    Attributes
    ----------
    model : str
        ``"preresnet18"``, ``"conv"`` (CNNs of ``models.cnn``, 3 input channels, 10 classes),
        ``"minilm-l6"`` or ``"tiny"`` (BERT classifiers of ``models.transformer``, 2 labels).
    clients : int
        Number of replies ``N``.
    rates : tuple[float, ...]
        Width rates; client ``i`` has rate ``rates[i % len(rates)]``.
    repeats : int
        Timed runs per method (after ``warmup`` untimed runs).
    warmup : int
        Untimed runs per method before the timed ones (at least 1).
    base : tuple[int, ...] or None
        Hidden widths of a CNN (default HeteroFL's ``(64, 128, 256, 512)``, the real model).
    seed : int
        Seed of the random model, noise and weights.
    noise : float
        Standard deviation of the noise added to every reply.
    upload_frozen : bool
        Transformers only: include the frozen word embeddings in the replies.
    measure_memory : bool
        Sample the process' resident memory during one extra, untimed run of each method.

    """

    model: str = PRERESNET18
    clients: int = 10
    rates: tuple[float, ...] = (0.25, 0.5, 1.0)
    repeats: int = 5
    warmup: int = 1
    base: tuple[int, ...] | None = None
    seed: int = 0
    noise: float = 0.01
    upload_frozen: bool = False
    measure_memory: bool = True

    def __post_init__(self) -> None:
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.clients < 1 or self.repeats < 1 or self.warmup < 1:
            raise ValueError("clients, repeats and warmup must be >= 1")
        if not self.rates or not all(0.0 < r <= 1.0 for r in self.rates):
            raise ValueError(f"rates must be non-empty and in (0, 1], got {self.rates}")


@dataclass(frozen=True)
class ClientReply:
    """One client's upload: its sub-model, width rate and aggregation weight."""

    params: Params
    rate: float
    weight: float


@dataclass
class Workload:
    """The full model, its width rules and the replies of one round."""

    model: str
    full: Params
    rules: WidthRules
    replies: list[ClientReply]
    full_replies: list[ClientReply]
    frozen: tuple[str, ...] = ()


def build_full_model(cfg: BenchConfig) -> tuple[Params, WidthRules, tuple[str, ...]]:
    """Random full model, its :class:`WidthRules` and the names clients never upload.

    Parameters
    ----------
    cfg : BenchConfig
        The benchmark configuration (``model``, ``base`` and ``seed`` are used).

    Returns
    -------
    tuple[dict[str, Tensor], WidthRules, tuple[str, ...]]
        The full state (detached copies), the rules over all of its tensors, and the frozen
        tensor names (word embeddings of a transformer unless ``upload_frozen``).

    """
    torch.manual_seed(cfg.seed)
    if cfg.model in (PRERESNET18, CONV):
        net = build_cnn(cfg.model, 1.0, in_channels=3, num_classes=10, base=cfg.base or HETEROFL_BASE)
        full = {k: v.detach().clone() for k, v in net.state_dict().items()}
        return full, WidthRules(axes=width_rules(cfg.model, net)), ()
    # Imported here: transformers is slow to import and not needed for the CNNs.
    from transformers import AutoModelForSequenceClassification

    from models.transformer import WORD_EMBEDDINGS, TransformerSpec, bert_width_rules, width_config

    spec = TransformerSpec(source=cfg.model, num_labels=2)
    model = AutoModelForSequenceClassification.from_config(width_config(spec, 1.0))
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    frozen = () if cfg.upload_frozen or not spec.freeze_word_embeddings else (WORD_EMBEDDINGS,)
    return full, WidthRules(axes=bert_width_rules(list(full))), frozen


def build_workload(cfg: BenchConfig) -> Workload:
    """Full model, rules, ``N`` noisy sub-model replies and ``N`` noisy full-size replies."""
    full, rules, frozen = build_full_model(cfg)
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    index_cache = {r: group_index_sets(rules, full, r) for r in set(cfg.rates)}

    def noisy(params: Mapping[str, Tensor]) -> Params:
        return {
            k: v + cfg.noise * torch.randn(v.shape, generator=gen, dtype=v.dtype)
            for k, v in params.items()
            if k not in frozen
        }

    replies, full_replies = [], []
    for i in range(cfg.clients):
        rate = cfg.rates[i % len(cfg.rates)]
        weight = float(torch.randint(100, 600, (1,), generator=gen))
        replies.append(ClientReply(noisy(extract_with_indices(full, rules, index_cache[rate])), rate, weight))
        full_replies.append(ClientReply(noisy(full), 1.0, weight))
    return Workload(cfg.model, full, rules, replies, full_replies, frozen)


def nbytes(params: Mapping[str, Tensor]) -> int:
    """Bytes of the tensor data of ``params``."""
    return sum(t.numel() * t.element_size() for t in params.values())


# --- the three aggregations -------------------------------------------------------------------


def heterofl_aggregate(work: Workload, phases: dict[str, float] | None = None) -> Params:
    """HeteroFL's server rule as the strategy runs it (fresh accumulator, add per reply, result).

    Parameters
    ----------
    work : Workload
        Full model, rules and replies.
    phases : dict[str, float], optional
        If given, receives the seconds spent in ``"init"`` (accumulator allocation),
        ``"index_sets"`` (:func:`group_index_sets` per reply), ``"add"`` and ``"result"``.

    Returns
    -------
    dict[str, Tensor]
        The aggregated full model.

    """
    t0 = time.perf_counter()
    acc = CoverageMean(work.full, work.rules)
    t1 = time.perf_counter()
    t_index = t_add = 0.0
    for reply in work.replies:
        ta = time.perf_counter()
        index_sets = group_index_sets(work.rules, work.full, reply.rate, 0)
        tb = time.perf_counter()
        acc.add(reply.params, index_sets, reply.weight)
        tc = time.perf_counter()
        t_index += tb - ta
        t_add += tc - tb
    t2 = time.perf_counter()
    out = acc.result(work.full)
    t3 = time.perf_counter()
    if phases is not None:
        phases.update(init=t1 - t0, index_sets=t_index, add=t_add, result=t3 - t2)
    return out


def heterofl_state_bytes(work: Workload) -> int:
    """Bytes :class:`CoverageMean` holds at its peak: the sums ``S`` after every reply, plus one coverage tensor.

    Sums exist only for tensors some reply carries (frozen tensors cost nothing) and the
    coverage ``W`` is built one tensor at a time in ``result``, so this is at most one model
    plus its largest tensor, whatever the number of replies.
    """
    acc = CoverageMean(work.full, work.rules)
    for r in work.replies:
        acc.add(r.params, group_index_sets(work.rules, work.full, r.rate, 0), r.weight)
    largest = max((t.numel() * t.element_size() for t in acc.sums.values()), default=0)
    return nbytes(acc.sums) + largest


@dataclass
class DenseState:
    """Preallocated accumulators of the dense baselines: one set per distinct rate."""

    sums: dict[float, Params]
    totals: dict[float, float] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Bytes of all accumulators."""
        return sum(nbytes(p) for p in self.sums.values())


def dense_state(replies: Sequence[ClientReply]) -> DenseState:
    """Zeroed accumulators shaped like the first reply of every distinct rate."""
    sums: dict[float, Params] = {}
    for reply in replies:
        if reply.rate not in sums:
            sums[reply.rate] = {k: torch.zeros_like(v) for k, v in reply.params.items()}
    return DenseState(sums)


def dense_weighted_mean(replies: Sequence[ClientReply], state: DenseState) -> dict[float, Params]:
    """``sum_i w_i x_i / sum_i w_i`` per rate, in place in ``state`` (no scatter, no full-model pass).

    Every reply byte is read once (``add_`` with ``alpha = w``), then every accumulator is
    divided by its rate's total weight.
    """
    for reply in replies:
        acc = state.sums[reply.rate]
        for name, x in reply.params.items():
            acc[name].add_(x, alpha=reply.weight)
        state.totals[reply.rate] = state.totals.get(reply.rate, 0.0) + reply.weight
    for rate, acc in state.sums.items():
        for t in acc.values():
            t.div_(state.totals[rate])
    return state.sums


# --- measurement ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """Seconds of the timed runs of one method."""

    times: tuple[float, ...]

    @property
    def best(self) -> float:
        """Fastest run."""
        return min(self.times)

    @property
    def median(self) -> float:
        """Median run."""
        return statistics.median(self.times)


def time_runs(prepare: Callable[[], T], run: Callable[[T], object], repeats: int, warmup: int = 1) -> Timing:
    """``warmup`` untimed runs, then ``repeats`` runs of ``run(prepare())`` timing ``run`` only.

    ``prepare`` (e.g. allocating accumulators) and garbage collection happen outside the
    timed region; the result of a run is dropped before the next one.
    """
    for _ in range(warmup):
        run(prepare())
    times = []
    for _ in range(repeats):
        arg = prepare()
        gc.collect()
        start = time.perf_counter()
        result = run(arg)
        times.append(time.perf_counter() - start)
        del result, arg
    return Timing(tuple(times))


def _rss_bytes() -> int | None:
    """Resident set size of this process in bytes (``None`` without ``/proc``)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _load_average() -> float | None:
    """1-minute load average of the machine (other processes distort the timings)."""
    try:
        return os.getloadavg()[0]
    except (OSError, AttributeError):
        return None


def _malloc_trim() -> None:
    """Give freed heap memory back to the OS (glibc only) so RSS growth reflects new allocations."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def peak_rss_growth(fn: Callable[[], object], interval_s: float = 2e-4) -> int | None:
    """Peak growth of resident memory while ``fn()`` runs and its result is alive (Linux only).

    A background thread samples ``/proc/self/statm`` (torch releases the GIL in its kernels).
    Memory the allocator reuses without growing RSS is not seen, so this is a lower bound on
    the extra memory; ``None`` where ``/proc`` is unavailable.
    """
    gc.collect()
    _malloc_trim()
    base = _rss_bytes()
    if base is None:
        return None
    peak = base
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _rss_bytes() or 0)
            time.sleep(interval_s)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        result = fn()
        peak = max(peak, _rss_bytes() or 0)
    finally:
        stop.set()
        thread.join()
    del result
    return peak - base


# --- the benchmark ----------------------------------------------------------------------------


@dataclass
class BenchRun:
    """A finished benchmark: the JSON-able report plus the tensors, for checks."""

    report: dict[str, Any]
    workload: Workload
    heterofl_result: Params


def run_benchmark(cfg: BenchConfig) -> BenchRun:
    """Build the workload, time the three methods and assemble the report.

    Parameters
    ----------
    cfg : BenchConfig
        What to run.

    Returns
    -------
    BenchRun
        ``report`` has keys ``config``, ``machine``, ``model``, ``methods`` (per method:
        ``best_s``, ``median_s``, ``times_s``, ``reply_bytes``, ``gbps``, ``state_bytes``,
        ``peak_rss_growth_bytes``), ``heterofl_phases_s``, ``ratio_heterofl_over_dense``
        and ``ratio_heterofl_over_dense_median``.

    """
    load_start = _load_average()
    work = build_workload(cfg)
    model_bytes = nbytes(work.full)
    reply_bytes = sum(nbytes(r.params) for r in work.replies)
    full_reply_bytes = sum(nbytes(r.params) for r in work.full_replies)

    def no_prep() -> None:
        return None

    phase_runs: list[dict[str, float]] = []

    def run_heterofl(_: None) -> Params:
        phases: dict[str, float] = {}
        out = heterofl_aggregate(work, phases)
        phase_runs.append(phases)
        return out

    timings = {
        "heterofl": time_runs(no_prep, run_heterofl, cfg.repeats, cfg.warmup),
        "dense-same-bytes": time_runs(
            lambda: dense_state(work.replies), lambda s: dense_weighted_mean(work.replies, s), cfg.repeats, cfg.warmup
        ),
        "fedavg-full": time_runs(
            lambda: dense_state(work.full_replies),
            lambda s: dense_weighted_mean(work.full_replies, s),
            cfg.repeats,
            cfg.warmup,
        ),
    }
    timed_phases = phase_runs[cfg.warmup :]  # drop the warm-up runs
    phases = {k: statistics.median(p[k] for p in timed_phases) for k in timed_phases[0]}
    state_bytes = {
        "heterofl": heterofl_state_bytes(work),
        "dense-same-bytes": dense_state(work.replies).nbytes,
        "fedavg-full": dense_state(work.full_replies).nbytes,
    }
    peaks: dict[str, int | None] = dict.fromkeys(METHODS)
    if cfg.measure_memory:
        peaks["heterofl"] = peak_rss_growth(lambda: heterofl_aggregate(work))
        peaks["dense-same-bytes"] = peak_rss_growth(
            lambda: dense_weighted_mean(work.replies, dense_state(work.replies))
        )
        peaks["fedavg-full"] = peak_rss_growth(
            lambda: dense_weighted_mean(work.full_replies, dense_state(work.full_replies))
        )
    method_bytes = {"heterofl": reply_bytes, "dense-same-bytes": reply_bytes, "fedavg-full": full_reply_bytes}
    methods = {
        name: {
            "best_s": t.best,
            "median_s": t.median,
            "times_s": list(t.times),
            "reply_bytes": method_bytes[name],
            "gbps": method_bytes[name] / t.best / _GB,
            "state_bytes": state_bytes[name],
            "state_over_model": state_bytes[name] / model_bytes,
            "peak_rss_growth_bytes": peaks[name],
        }
        for name, t in timings.items()
    }
    report: dict[str, Any] = {
        "config": {
            "model": cfg.model,
            "clients": cfg.clients,
            "rates": list(cfg.rates),
            "repeats": cfg.repeats,
            "warmup": cfg.warmup,
            "base": list(cfg.base) if cfg.base else None,
            "seed": cfg.seed,
            "upload_frozen": cfg.upload_frozen,
        },
        "machine": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "load_average_1m": [load_start, _load_average()],
        },
        "model": {
            "tensors": len(work.full),
            "params": sum(t.numel() for t in work.full.values()),
            "bytes": model_bytes,
            "frozen_not_uploaded": list(work.frozen),
            "reply_tensors": len(work.replies[0].params),
        },
        "methods": methods,
        "heterofl_phases_s": phases,
        "ratio_heterofl_over_dense": timings["heterofl"].best / timings["dense-same-bytes"].best,
        "ratio_heterofl_over_dense_median": timings["heterofl"].median / timings["dense-same-bytes"].median,
    }
    return BenchRun(report, work, heterofl_aggregate(work))


def _fmt_load(loads: Sequence[float | None]) -> str:
    return " -> ".join("n/a" if x is None else f"{x:.2f}" for x in loads)


def format_table(report: Mapping[str, Any]) -> str:
    """Human-readable table of a :func:`run_benchmark` report."""
    cfg, model = report["config"], report["model"]
    lines = [
        f"model {cfg['model']}: {model['params'] / 1e6:.2f}M params, {model['bytes'] / _MB:.1f} MB; "
        f"{cfg['clients']} clients at rates {cfg['rates']}; best / median of {cfg['repeats']} "
        f"(torch {report['machine']['torch']}, {report['machine']['torch_threads']} threads, "
        f"load average {_fmt_load(report['machine']['load_average_1m'])})",
        f"{'method':<18}{'best s':>9}{'median s':>10}{'reply MB':>10}{'GB/s':>8}{'x dense':>9}"
        f"{'state MB':>10}{'state/model':>12}{'peak RSS+ MB':>14}",
    ]
    dense = report["methods"]["dense-same-bytes"]["best_s"]
    for name, m in report["methods"].items():
        peak = m["peak_rss_growth_bytes"]
        peak_s = "n/a" if peak is None else f"{peak / _MB:.1f}"
        lines.append(
            f"{name:<18}{m['best_s']:>9.4f}{m['median_s']:>10.4f}{m['reply_bytes'] / _MB:>10.1f}{m['gbps']:>8.2f}"
            f"{m['best_s'] / dense:>9.2f}{m['state_bytes'] / _MB:>10.1f}{m['state_over_model']:>12.2f}{peak_s:>14}"
        )
    ph = report["heterofl_phases_s"]
    lines.append(
        "heterofl phases (median s): "
        + ", ".join(f"{k} {v:.4f}" for k, v in ph.items())
        + f"; ratio heterofl / dense-same-bytes = {report['ratio_heterofl_over_dense']:.2f}x (best), "
        f"{report['ratio_heterofl_over_dense_median']:.2f}x (median)"
    )
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> tuple[BenchConfig, Path | None]:
    """Command line -> (:class:`BenchConfig`, JSON output path or ``None``)."""
    p = argparse.ArgumentParser(prog="python -m bench.heterofl_aggregation", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--model", choices=MODELS, default=PRERESNET18)
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--rates", default="0.25,0.5,1.0", help="comma-separated width rates in (0, 1]")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs per method before the timed ones")
    p.add_argument("--base", default=None, help="CNN hidden widths, e.g. 16,32,64,128 (default 64,128,256,512)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--noise", type=float, default=0.01)
    p.add_argument("--upload-frozen", action="store_true", help="transformers: replies include word embeddings")
    p.add_argument("--no-memory", action="store_true", help="skip the resident-memory sampling runs")
    p.add_argument("--json", type=Path, default=None, help="write the report here")
    a = p.parse_args(argv)
    cfg = BenchConfig(
        model=a.model,
        clients=a.clients,
        rates=tuple(float(r) for r in a.rates.split(",")),
        repeats=a.repeats,
        warmup=a.warmup,
        base=tuple(int(d) for d in a.base.split(",")) if a.base else None,
        seed=a.seed,
        noise=a.noise,
        upload_frozen=a.upload_frozen,
        measure_memory=not a.no_memory,
    )
    return cfg, a.json


def main(argv: Sequence[str] | None = None) -> BenchRun:
    """Run the benchmark from command-line arguments, print the table, write JSON if asked."""
    cfg, json_path = parse_args(argv)
    result = run_benchmark(cfg)
    print(format_table(result.report))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result.report, indent=2) + "\n")
    sys.stdout.flush()
    return result


if __name__ == "__main__":
    main()
