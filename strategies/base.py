"""Heterogeneous strategy base on Flower's ``Strategy``: one group per model variant.

Flower's own ``Strategy.start`` drives the rounds.  This base adds what every
heterogeneous method needs and leaves only the aggregation math to subclasses:

* **handshake** -- every node not seen before gets a ``query`` message carrying the
  published catalog (variant names and estimated training memory) and answers with
  its :class:`NodeProfile` (tier, memory budget, examples, chosen variant or the
  reason it declined);
* **per-node messages** -- ``configure_train`` slices the server state into each
  node's variant and sends one ``Message`` per node;
* **validation** -- ``aggregate_train`` checks every reply against the layout it was
  sent (keys, shapes, dtype, finite values, example count, variant, round); a bad
  reply is logged and dropped before its mean reaches the model (finiteness is checked
  once on the round's sums where the replies are held, and reply by reply only when a
  sum is not finite: :meth:`HeterogeneousStrategy.defers_finiteness`);
* **streaming** -- per-group :class:`~strategies.streaming.StreamingMean`, so
  memory is ``O(groups x model)``, independent of the number of replies;
* **failures** -- error replies (a ClientApp exception, or a dead node whose error
  the SuperLink sends with ``src_node_id = 1``) are mapped back to the node through
  ``reply_to_message_id`` and reported per round, and so is every node whose reply did
  not come within the round timeout;
* **prompt replies** -- :meth:`HeterogeneousStrategy.start` runs Flower's loop on a
  :class:`PromptGrid`, which polls for replies every 0.2 s (Flower's deployment grid
  sleeps 3 s between polls);
* **robust options** (opt-in, :mod:`strategies.robust`) -- per-group update-norm
  clipping before folding, and a coordinate-wise median per group instead of the mean;
* **checkpoints** -- :meth:`HeterogeneousStrategy.checkpoint_state` /
  :meth:`HeterogeneousStrategy.load_checkpoint_state` hold the complete server state
  (subclasses add their method state through ``method_state`` / ``load_method_state``);
  a resumed strategy offsets Flower's round numbers by the checkpoint's round.

Server state is held as ``{variant: {param: Tensor}}`` and exposed to Flower's loop as
one composite ``ArrayRecord`` keyed ``"<variant>/<param>"``; that record and the per-node
payloads reuse the serialized ``Array`` of every tensor that did not change
(:class:`ArrayCache`), so a round serializes only what it updated, once.
"""

from __future__ import annotations

import math
import os
import random
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from logging import INFO, WARNING
from typing import Any, ClassVar, TypedDict

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.common import log
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy
from torch import Tensor

from experiment.protocol import (
    ARRAYS,
    CONFIG,
    CatalogOffer,
    instruction_config,
    record_of,
    scalar_metrics,
)
from models.catalog import VariantCatalog
from strategies.grid import HeldArrays, HeldArraysGrid, PromptGrid
from strategies.handshake import check_someone_can_train, query_profiles, unchosen_variant_warnings
from strategies.profiles import NodeProfile
from strategies.pull_bound import reply_bound
from strategies.records import ArrayCache, State, compose, decompose, record_nbytes, to_record
from strategies.replay import ReplayGuard
from strategies.replies import (
    Accepted,
    RoundReport,
    Sent,
    by_message_id,
    evaluation_means,
    match_reply,
    report_missing,
    variant_counts,
)
from strategies.robust import MedianBuffer, clip_update
from strategies.streaming import StreamingMean
from strategies.validation import (
    ReplyRejected,
    non_finite_reason,
    validate_evaluate_reply,
    validate_examples_claim,
    validate_train_reply,
)


class StrategyStateError(RuntimeError):
    """The strategy was asked for something its state cannot give (a programming error, not bad input)."""


class StrategyOptions(TypedDict, total=False):
    """The options of :class:`HeterogeneousStrategy` a method's strategy passes on unchanged.

    A method's ``__init__`` takes its own parameters and ``**options: Unpack[StrategyOptions]``
    (typed keyword options, not an untyped catch-all); each key is the base parameter of the same name.
    """

    fraction_train: float
    fraction_evaluate: float
    min_train_nodes: int
    min_evaluate_nodes: int
    min_available_nodes: int
    assign: str
    max_examples: int
    query_timeout: float
    seed: int
    clip_update_norm: Mapping[str, float] | None
    robust_aggregation: str


class HeterogeneousStrategy(Strategy):
    """Base for strategies whose nodes train different variants of one family.

    Parameters
    ----------
    catalog : VariantCatalog
        Variants published to clients, smallest first.  Groups are variants.
    fraction_train, fraction_evaluate : float
        Share of eligible nodes sampled per round.
    min_train_nodes, min_evaluate_nodes : int
        Lower bound on the sample size (capped at the eligible nodes).
    min_available_nodes : int
        Wait until this many nodes are connected before a round starts.
    assign : {"choice", "largest"}
        ``choice`` trains each node on the variant it picked by memory;
        ``largest`` ignores memory and gives every answering node the largest
        variant (the AllLarge upper bound).
    max_examples : int
        Upper bound accepted for a reply's ``num-examples``.
    query_timeout : float
        Seconds to wait for handshake replies.
    seed : int
        Seed of node sampling.
    clip_update_norm : Mapping[str, float], optional
        Per variant (group) the bound ``c`` on a reply's update norm ``||x - w||_2``
        (:func:`strategies.robust.clip_update`); a missing variant or ``c = 0`` is not clipped.
    robust_aggregation : {"mean", "median"}
        ``mean`` streams replies into example-weighted means (``O(groups x model)``);
        ``median`` buffers each group's replies and folds their coordinate-wise median
        once, weighted by the group's total examples (``O(clients x model)``, opt-in;
        only for methods with ``supports_median``).

    """

    #: Whether the method's math accepts one group median instead of the replies (see ``fold_group``).
    supports_median: ClassVar[bool] = True

    def __init__(
        self,
        *,
        catalog: VariantCatalog,
        fraction_train: float = 1.0,
        fraction_evaluate: float = 1.0,
        min_train_nodes: int = 1,
        min_evaluate_nodes: int = 1,
        min_available_nodes: int = 1,
        assign: str = "choice",
        max_examples: int = 10_000_000,
        query_timeout: float = 300.0,
        seed: int = 0,
        clip_update_norm: Mapping[str, float] | None = None,
        robust_aggregation: str = "mean",
    ) -> None:
        if not 0.0 < fraction_train <= 1.0:
            raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
        if not 0.0 <= fraction_evaluate <= 1.0:
            raise ValueError(f"fraction_evaluate must be in [0, 1], got {fraction_evaluate}")
        if assign not in ("choice", "largest"):
            raise ValueError(f"assign must be 'choice' or 'largest', got {assign!r}")
        if robust_aggregation not in ("mean", "median"):
            raise ValueError(f"robust_aggregation must be 'mean' or 'median', got {robust_aggregation!r}")
        if robust_aggregation == "median" and not self.supports_median:
            raise ValueError(f"{type(self).__name__} does not support the coordinate-wise median")
        bounds = dict(clip_update_norm or {})
        bad = {k: c for k, c in bounds.items() if not (math.isfinite(c) and c >= 0)}
        if bad:
            raise ValueError(f"clip_update_norm bounds must be finite and >= 0, got {bad}")
        self.catalog = catalog
        #: what each node holds (arrays it already received are left out of its messages)
        self.held = HeldArrays()
        self.fraction_train = fraction_train
        self.fraction_evaluate = fraction_evaluate
        self.min_train_nodes = min_train_nodes
        self.min_evaluate_nodes = min_evaluate_nodes
        self.min_available_nodes = min_available_nodes
        self.assign = assign
        self.max_examples = max_examples
        self.query_timeout = query_timeout
        self.rng = random.Random(seed)
        self.profiles: dict[int, NodeProfile] = {}
        self.state: State = {}
        self.current_round = 0
        self._record: ArrayRecord | None = None
        self._arrays = ArrayCache()
        self._sent_train: dict[str, Sent] = {}
        self._sent_eval: dict[str, Sent] = {}
        self.reports: dict[int, RoundReport] = {}
        self.on_round_end: Callable[[RoundReport], None] | None = None
        self.clip_bounds = {k: c for k, c in bounds.items() if c > 0}
        self.robust_aggregation = robust_aggregation
        self.round_offset = 0
        self._restored_nodes: dict[str, int] = {}
        self.replays = ReplayGuard()  # fingerprints of accepted train replies (strategies.replay)
        #: Warnings about the nodes' choices (a variant no node trains), repeated in the final verdict.
        self.plan_warnings: list[str] = []

    # ------------------------------------------------------------- rounds
    def global_round(self, flower_round: int) -> int:
        """The run's round number of Flower's ``flower_round``.

        A resumed run lets Flower's own loop run the remaining rounds ``1 .. N - k``;
        they are rounds ``k + 1 .. N`` of the run (``k`` = the checkpoint's round,
        :attr:`round_offset`).  Every public hook maps its round through here.
        """
        return flower_round + self.round_offset

    # --------------------------------------------------------- checkpoints
    def checkpoint_state(self) -> dict[str, Any]:
        """The complete server state after the current round (tensors, numbers, strings only).

        ``{"strategy": class name, "state": {variant: {param: Tensor}}, "rng": sampling RNG
        state, "nodes": {node id: stable key}, "method": method_state(), "replays": the
        accepted train replies' fingerprints (:class:`strategies.replay.ReplayGuard`)}``.
        """
        return {
            "strategy": type(self).__name__,
            "state": {v: dict(p) for v, p in self.state.items()},
            "rng": self.rng.getstate(),
            # nodes of an earlier checkpoint that have not come back yet keep their key too
            "nodes": {
                **{n: key for key, n in self._restored_nodes.items()},
                **{n: p.stable_key for n, p in self.profiles.items()},
            },
            "method": self.method_state(),
            "replays": self.replays.state(),
        }

    def load_checkpoint_state(self, data: Mapping[str, Any], server_round: int) -> ArrayRecord:
        """Restore :meth:`checkpoint_state` written after ``server_round``; return the composite record.

        Flower's round ``r`` becomes round ``server_round + r`` (:meth:`global_round`).  Node
        profiles are not restored: every node is queried again, and per-node state is moved to
        the node that reports the same stable key (:meth:`rebind_node`).

        Raises
        ------
        ValueError
            When the data was written by another strategy or does not match the catalog.

        """
        if data.get("strategy") != type(self).__name__:
            raise ValueError(f"checkpoint holds {data.get('strategy')!r} state, this run is {type(self).__name__}")
        state = data.get("state")
        if not isinstance(state, dict):
            raise ValueError("checkpoint has no model state")
        record = self.set_state(state)
        try:
            self.rng.setstate(data["rng"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"checkpoint's sampling RNG state is unusable ({exc})") from exc
        nodes = data.get("nodes", {})
        self._restored_nodes = {str(key): int(node) for node, key in nodes.items()}
        self.load_method_state(data.get("method", {}))
        self.replays = ReplayGuard.from_state(data.get("replays", {}))  # absent in older checkpoints
        self.round_offset = self.current_round = server_round
        self.reports.clear()
        return record

    def method_state(self) -> dict[str, Any]:
        """Method-specific state for checkpoints (override; the base has none)."""
        return {}

    def load_method_state(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`method_state`; raise ``ValueError`` when it does not fit (override)."""

    def rebind_node(self, old_id: int, new_id: int) -> None:
        """Move per-node state of ``old_id`` (before a restart) to ``new_id`` (override)."""

    # ------------------------------------------------------------------ state
    def initial_state(self, init: Mapping[str, Mapping[str, Tensor]]) -> State:
        """The server's state before round 1, from the family's initial models of the whole catalog.

        Runs once, before :meth:`set_state` (the ServerApp's start, the benchmarks); ``init`` maps
        each catalog variant to its initial model (``ModelFamily.initial_states``). The default
        keeps one model per variant the strategy trains; HeteroFL keeps one full model instead.
        """
        return {v.name: dict(init[v.name]) for v in self.catalog}

    def set_state(self, state: State) -> ArrayRecord:
        """Replace the server state; return the composite record Flower sees."""
        self.check_state(state)
        self.state = {k: dict(v) for k, v in state.items()}
        return self._compose_state()

    def _compose_state(self) -> ArrayRecord:
        """Composite record of ``self.state``, reusing the ``Array`` of every unchanged tensor.

        The cache is then cut down to the state's tensors (per-node payloads cached while the
        round's messages were built are dropped here).
        """
        self._record = compose(self.state, self._arrays)
        self._arrays.retain(t for params in self.state.values() for t in params.values())
        return self._record

    def check_state(self, state: State) -> None:
        """Require one entry per catalog variant, each matching its layout's names."""
        missing = [v.name for v in self.catalog if v.name not in state]
        if missing:
            raise ValueError(f"initial state lacks variants {missing}")
        for v in self.catalog:
            if set(state[v.name]) != set(v.layout.names()):
                raise ValueError(f"state of variant {v.name!r} does not match its layout")

    def _sync_state(self, arrays: ArrayRecord) -> None:
        if arrays is not self._record:
            self.state = decompose(arrays)
            self._record = arrays

    def variant_payload(self, node_id: int, variant: str) -> dict[str, Tensor]:
        """Tensors a node of ``variant`` receives (override for per-node models)."""
        return self.state[variant]

    def start(self, grid: Grid, *args: Any, **kwargs: Any) -> Result:
        """Flower's round loop (``Strategy.start``) on a :class:`HeldArraysGrid` around ``grid``.

        ``HETFL_REPLY_POLL_S`` (default 0.2) sets its poll interval; 3 reproduces Flower's own.
        A grid that already is a :class:`PromptGrid` (tests) is used as is; replies are pulled within ``reply_bound``.
        """
        poll = float(os.environ.get("HETFL_REPLY_POLL_S", "0.2"))
        bound = reply_bound(self.catalog)
        wrapped = grid if isinstance(grid, PromptGrid) else HeldArraysGrid(grid, self.held, poll, bound)
        return super().start(wrapped, *args, **kwargs)

    def report(self, server_round: int) -> RoundReport:
        """The report of ``server_round`` (created on first use)."""
        if server_round not in self.reports:
            self.reports[server_round] = RoundReport(server_round)
        return self.reports[server_round]

    # -------------------------------------------------------------- handshake
    def _catalog_offer(self) -> CatalogOffer:
        return CatalogOffer(
            variant_names=tuple(self.catalog.names()),
            variant_memory_mb=tuple(float(v.memory.total_mb) for v in self.catalog),
            ignore_memory=self.assign == "largest",
        )

    def handshake(self, grid: Grid, node_ids: Iterable[int]) -> None:
        """Query every node not seen before for its profile (:mod:`strategies.handshake`)."""
        new = [n for n in node_ids if n not in self.profiles]
        if not new:
            return
        offer = self._catalog_offer()
        for node, profile in query_profiles(grid, new, offer, self.catalog.names(), self.query_timeout):
            if self.assign == "largest":
                profile.variant = self.catalog.largest.name
            self.profiles[node] = profile
            old = self._restored_nodes.pop(profile.stable_key, None)
            if old is not None and old != node:
                log(INFO, "node %s is node %s of the checkpoint (%s)", node, old, profile.stable_key)
                self.rebind_node(old, node)
            if profile.variant is None:
                log(WARNING, "node %s (tier %s) declined: %s", node, profile.tier, profile.reason)
            else:
                log(INFO, "node %s: tier %s, %.0f MiB -> %s", node, profile.tier, profile.memory_mb, profile.variant)
        for message in unchosen_variant_warnings(self.catalog.names(), self.profiles.values(), self.plan_warnings):
            self.plan_warnings.append(message)
            log(WARNING, "%s", message)

    def eligible_nodes(self, grid: Grid) -> list[int]:
        """Connected nodes that have a variant, after handshaking new ones."""
        waited = 0
        while len(all_nodes := list(grid.get_node_ids())) < self.min_available_nodes:
            if waited % 30 == 0:
                log(INFO, "Waiting for nodes: %d connected, %d required", len(all_nodes), self.min_available_nodes)
            time.sleep(1)
            waited += 1
        self.handshake(grid, all_nodes)
        return sorted(n for n in all_nodes if n in self.profiles and self.profiles[n].variant is not None)

    def _sample(self, nodes: list[int], fraction: float, minimum: int) -> list[int]:
        if not nodes or fraction == 0.0:
            return []
        k = min(len(nodes), max(minimum, math.ceil(fraction * len(nodes))))
        ordered = sorted(nodes, key=lambda n: self.profiles[n].sampling_order)  # every eligible node has a profile
        return sorted(self.rng.sample(ordered, k))

    # ------------------------------------------------------------------ train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per sampled node, carrying that node's variant."""
        server_round = self.global_round(server_round)
        self._sync_state(arrays)
        report = self.report(server_round)
        report.started = time.time()
        eligible = self.eligible_nodes(grid)
        if not eligible and self.fraction_train > 0:
            check_someone_can_train(server_round, [self.profiles.get(n) for n in grid.get_node_ids()])
        nodes = self._sample(eligible, self.fraction_train, self.min_train_nodes)
        self._sent_train = self._messages(nodes, server_round, config, MessageType.TRAIN)
        log(INFO, "configure_train: %d nodes sampled (%s)", len(nodes), variant_counts(self._sent_train))
        return [s.message for s in self._sent_train.values()]

    def _messages(self, nodes: Iterable[int], server_round: int, config: ConfigRecord, kind: str) -> dict[str, Sent]:
        """Build a ``kind`` message per node and variant of :meth:`message_variants`; count bytes sent."""
        report = self.report(server_round)
        self.current_round = server_round
        out: dict[str, Sent] = {}
        for node in nodes:
            for variant in self.message_variants(node, kind):
                payload = to_record(self.variant_payload(node, variant), self._arrays)
                cfg = instruction_config(config, server_round=server_round, variant=variant)
                held = self.held.prepare(node, payload)  # arrays the node holds are left out
                msg = Message(RecordDict({ARRAYS: payload, CONFIG: cfg, **held}), dst_node_id=node, message_type=kind)
                out[str(id(msg))] = Sent(msg, node, variant, record_nbytes(payload))
                report.add(variant, "bytes-down", out[str(id(msg))].nbytes)
        return out

    def message_variants(self, node_id: int, kind: str) -> list[str]:
        """Variants a node gets a ``kind`` message for this round: the one it chose (override for more)."""
        variant = self.profiles[node_id].variant
        if variant is None:
            raise StrategyStateError(f"node {node_id} declined in the handshake and has no variant to be sent")
        return [variant]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Validate replies, stream them into per-variant means, apply the method.

        Numeric client metrics other than ``num-examples`` (``train-loss``, ``layers``)
        are reported as example-weighted means per variant.  With clipping on, each reply's
        update is clipped before it is folded (``clipped`` counts them per variant); with
        ``robust_aggregation="median"`` replies are buffered per variant and each group's
        coordinate-wise median is folded once (:meth:`fold_group`).

        Finiteness is checked per reply before it is folded, except where
        :meth:`defers_finiteness`: there the per-variant sums are checked once (a NaN or Inf
        in any reply makes its variant's sum NaN or Inf) and only when one is not finite is
        every held reply checked, the non-finite ones rejected with the same reason and the
        sums rebuilt from the rest -- one pass over the sums instead of one over every reply.
        Either way, sums that are still not finite (finite replies whose weighted sum
        overflows float32) are discarded with a logged reason: the round then leaves the
        model as if no reply had come.
        """
        server_round = self.global_round(server_round)
        report = self.report(server_round)
        defer = self.defers_finiteness(replies)
        entries = self._accepted_replies(server_round, replies, report, check_finite=not defer)
        accepted, means = self._fold_accepted(entries, report, keep_tensors=defer)
        finite = self.folds_finite(means)
        if defer and not finite:
            kept = []
            for entry in accepted:
                reason = non_finite_reason(entry.tensors)
                if reason is None:
                    kept.append(entry)
                else:
                    report.reject(f"node {entry.sent.node_id} ({entry.sent.variant}): {reason}")
            del means
            self.reset_folds()
            accepted, means = self._fold_accepted(kept, report, keep_tensors=False)
            finite = self.folds_finite(means)
        if not finite:
            report.reject("the weighted sums overflow float32 (every reply finite); the round is discarded")
            self.reset_folds()
            accepted, means = [], {}
        counts = {v.name: 0 for v in self.catalog}
        client_metrics: dict[str, StreamingMean] = {}
        for entry in accepted:
            variant, n = entry.sent.variant, entry.num_examples
            counts[variant] += 1
            report.add(variant, "clients", 1)
            report.add(variant, "examples", n)
            report.add(variant, "bytes-up", entry.nbytes)
            scalars = {k: torch.tensor(v) for k, v in scalar_metrics(entry.metrics).items()}
            if scalars:
                client_metrics.setdefault(variant, StreamingMean()).add(scalars, n)
        del accepted
        mean_params = {k: m.take_mean() for k, m in means.items()}  # the round's own tensors
        self.apply_round(server_round, mean_params, counts)
        self._compose_state()
        out = MetricRecord()
        for variant, acc in client_metrics.items():
            for key, value in acc.mean().items():
                out[f"{variant}/{key}"] = float(value)
                report.group(variant)[key] = float(value)
        for variant, c in counts.items():
            out[f"{variant}/clients"] = c
        return self._record, out

    def defers_finiteness(self, replies: Iterable[Message]) -> bool:
        """Whether :meth:`aggregate_train` checks the sums' finiteness instead of every reply's.

        Only when the replies are already held (a ``Sequence``: Flower's ``send_and_receive``
        returns a list), so a failed check can go back to them -- a lazy iterable is checked
        reply by reply and never held -- and only when the sums can be dropped and rebuilt
        after a failure (:meth:`folds_rebuildable`), without clipping (a clipped reply's norm
        needs finite values) or the median.
        """
        return (
            isinstance(replies, Sequence)
            and self.folds_rebuildable()
            and not self.clip_bounds
            and self.robust_aggregation == "mean"
        )

    def folds_rebuildable(self) -> bool:
        """Whether :meth:`fold_reply` writes only sums that :meth:`reset_folds` drops.

        True for the base fold (the round-local ``means``); a subclass that folds into sums of
        its own overrides this, :meth:`folds_finite` and :meth:`reset_folds` together.
        """
        return type(self).fold_reply is HeterogeneousStrategy.fold_reply

    def folds_finite(self, means: Mapping[str, StreamingMean]) -> bool:
        """Whether the round's sums so far hold no NaN or Inf."""
        return all(m.is_finite() for m in means.values())

    def reset_folds(self) -> None:
        """Drop whatever :meth:`fold_reply` folded this round outside ``means`` (nothing here)."""

    def _accepted_replies(
        self, server_round: int, replies: Iterable[Message], report: RoundReport, *, check_finite: bool
    ) -> Iterator[Accepted]:
        """Match and validate the replies one at a time; yield the accepted ones.

        The failed and rejected replies are reported as they come, the missing ones once the
        replies are exhausted.  The tensors are views of the reply's payload bytes (no copies).
        """
        sent = by_message_id(self._sent_train)
        seen: list[tuple[str, int]] = []
        for reply in replies:
            seen.append((reply.metadata.reply_to_message_id, reply.metadata.src_node_id))
            rec = match_reply(reply, sent, report, "train")
            if rec is None:
                continue
            layout = self.catalog.get(rec.variant).layout.by_name()
            expected = {k: s for k, s in layout.items() if s.trainable}
            try:
                tensors, n, metrics = validate_train_reply(
                    reply.content,
                    expected=expected,
                    variant=rec.variant,
                    server_round=server_round,
                    max_examples=self.max_examples,
                    check_finite=check_finite,
                )
                profile = self.profiles.get(rec.node_id)
                if profile is not None:
                    validate_examples_claim(n, profile.num_examples)
                fingerprint = self.replays.check(tensors, server_round)
            except ReplyRejected as exc:
                report.reject(f"node {rec.node_id} ({rec.variant}): {exc}")
                continue
            self.replays.accept(fingerprint, server_round)
            nbytes = record_nbytes(record_of(reply.content, ARRAYS, ArrayRecord))
            yield Accepted(rec, tensors, n, metrics, nbytes)
        report_missing(sent, seen, report, "train")

    def _fold_accepted(
        self, entries: Iterable[Accepted], report: RoundReport, *, keep_tensors: bool
    ) -> tuple[list[Accepted], dict[str, StreamingMean]]:
        """Clip, then fold (or buffer for the median) every accepted reply.

        Returns the entries and the per-variant sums.  The entries keep their tensors only
        with ``keep_tensors``; otherwise each reply's tensors are dropped once folded, so a
        lazy stream of replies is folded and released one reply at a time.
        """
        means: dict[str, StreamingMean] = {}
        buffers: dict[str, MedianBuffer] = {}
        kept: list[Accepted] = []
        for entry in entries:
            rec, tensors, n = entry.sent, entry.tensors, entry.num_examples
            bound = self.clip_bounds.get(rec.variant, 0.0)
            if bound > 0:
                sent_weights = self.variant_payload(rec.node_id, rec.variant)
                tensors, norm = clip_update(tensors, sent_weights, bound)
                report.add(rec.variant, "clipped", float(norm > bound))
                report.group(rec.variant)["max-update-norm"] = max(
                    report.group(rec.variant).get("max-update-norm", 0.0), norm
                )
            if self.robust_aggregation == "median":
                buffers.setdefault(rec.variant, MedianBuffer()).add(tensors, float(n))
            else:
                self.fold_reply(rec, tensors, n, means)
            del tensors
            kept.append(entry if keep_tensors else replace(entry, tensors={}))
        for variant, buf in buffers.items():
            median, total, count = buf.result()
            self.fold_group(variant, median, total, count, means)
        return kept, means

    def fold_reply(
        self, sent: Sent, tensors: Mapping[str, Tensor], num_examples: int, means: dict[str, StreamingMean]
    ) -> None:
        """Fold one validated reply into the group sums (weighted by examples)."""
        means.setdefault(sent.variant, StreamingMean()).add(tensors, float(num_examples))

    def fold_group(
        self,
        variant: str,
        tensors: Mapping[str, Tensor],
        num_examples: float,
        replies: int,
        means: dict[str, StreamingMean],
    ) -> None:
        """Fold one group's robust aggregate (its coordinate-wise median of ``replies`` replies).

        The median stands for the whole group, weighted by the group's total examples, so the
        method's cross-group math (layer-wise or coverage averaging) is unchanged.
        """
        means.setdefault(variant, StreamingMean()).add(tensors, float(num_examples))

    def apply_round(
        self, server_round: int, means: Mapping[str, Mapping[str, Tensor]], counts: Mapping[str, int]
    ) -> None:
        """Method math: update ``self.state`` from per-variant mean client weights.

        ``means[v]`` is the example-weighted mean of the weights returned by the
        ``counts[v]`` clients of variant ``v``; variants without replies are absent.  The
        mean tensors belong to this call (fresh, aliasing neither a reply nor the state): a
        method may reuse them in place.
        """
        raise NotImplementedError

    # --------------------------------------------------------------- evaluate
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Federated evaluation: each sampled node evaluates its own variant."""
        server_round = self.global_round(server_round)
        self._sync_state(arrays)
        self._sent_eval = {}
        if self.fraction_evaluate == 0.0:
            return []
        nodes = self._sample(self.eligible_nodes(grid), self.fraction_evaluate, self.min_evaluate_nodes)
        self._sent_eval = self._messages(nodes, server_round, config, MessageType.EVALUATE)
        return [s.message for s in self._sent_eval.values()]

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        """Example-weighted loss/accuracy per variant (``local inference``)."""
        server_round = self.global_round(server_round)
        report = self.report(server_round)
        sent = by_message_id(self._sent_eval)
        results: list[tuple[str, int, float, float]] = []
        seen: list[tuple[str, int]] = []
        for reply in replies:
            seen.append((reply.metadata.reply_to_message_id, reply.metadata.src_node_id))
            rec = match_reply(reply, sent, report, "evaluate")
            if rec is None:
                continue
            try:
                n, loss, acc = validate_evaluate_reply(
                    reply.content, variant=rec.variant, server_round=server_round, max_examples=self.max_examples
                )
            except ReplyRejected as exc:
                report.reject(f"node {rec.node_id} ({rec.variant}): {exc}", "evaluate")
                continue
            results.append((rec.variant, n, loss, acc))
        report_missing(sent, seen, report, "evaluate")
        out = MetricRecord()
        for variant, (loss, acc) in evaluation_means(results).items():
            out[f"{variant}/fed-loss"], out[f"{variant}/fed-accuracy"] = loss, acc
            report.group(variant).update({"fed-loss": loss, "fed-accuracy": acc})
        return out

    def summary(self) -> None:
        """Log the catalog and sampling settings."""
        log(INFO, "\t├──> %s over %d variants:", type(self).__name__, len(self.catalog))
        for v in self.catalog:
            log(
                INFO,
                "\t│\t├── %s: %d layers, %.1fM params, ~%.0f MiB to train",
                v.name,
                v.depth,
                v.layout.num_params() / 1e6,
                v.memory.total_mb,
            )
        log(INFO, "\t└──> fraction_train %.2f, fraction_evaluate %.2f", self.fraction_train, self.fraction_evaluate)

    def models_for_evaluation(self) -> dict[str, list[Mapping[str, Tensor]]]:
        """Models to evaluate centrally, per variant (one global model per variant here)."""
        return {v: [p] for v, p in self.state.items()}
