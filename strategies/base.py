"""Heterogeneous strategy base on Flower's ``Strategy``: one group per model variant.

Flower's own ``Strategy.start`` drives the rounds.  This base adds what every
heterogeneous method needs and leaves only the aggregation math to subclasses:

* **handshake** (:mod:`strategies.handshake`) -- each new node answers a ``query`` carrying
  the catalog with its :class:`NodeProfile` (tier, memory, examples, variant or why it declined);
* **per-node messages** -- ``configure_train`` sends each sampled node its variant;
* **validation** (:mod:`strategies.validation`, :mod:`strategies.replay`) -- a reply that does
  not fit what was sent (keys, shapes, dtype, finite values, examples, variant, round, a replay)
  is logged and dropped before it reaches the model (:meth:`HeterogeneousStrategy.defers_finiteness`);
* **streaming** -- replies are folded one at a time into the method's round sums
  (:mod:`strategies.round_sums`; per-group means: ``O(groups x model)`` memory);
* **failures** (:mod:`strategies.replies`) -- error replies and nodes silent past the round
  timeout are mapped back to the node and reported per round;
* **prompt replies** -- the loop runs on a :class:`PromptGrid` polling every 0.2 s (Flower's: 3 s);
* **robust options** (:mod:`strategies.robust`) -- opt-in update-norm clipping, per-group median;
* **checkpoints** -- :meth:`HeterogeneousStrategy.checkpoint_state` holds the whole server state.

A method's extension points, each documented with when it runs: ``initial_state``,
``check_state``, ``prepare_round``, ``message_variants``, ``variant_payload``, ``encode_payload``,
``summarize_messages``, ``decode_reply``, ``new_round_sums``, ``apply_round``, ``summarize_replies``,
``summarize_evaluation``,
``models_for_evaluation``, ``method_state`` / ``load_method_state`` / ``rebind_node``.

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
from typing import Any, ClassVar, Generic, TypeVar

import torch
from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.app.typing import ConfigRecordValues
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
from strategies.handshake import (
    check_someone_can_train,
    log_profile,
    query_profiles,
    unchosen_variant_warnings,
    wait_for_nodes,
)
from strategies.options import check_options
from strategies.profiles import NodeProfile
from strategies.pull_bound import reply_bound
from strategies.records import ArrayCache, State, compose, decompose, record_nbytes, to_record
from strategies.replay import ReplayGuard
from strategies.replies import (
    Accepted,
    Evaluated,
    RoundReport,
    Sent,
    by_message_id,
    evaluation_means,
    in_node_order,
    matched_replies,
    variant_counts,
)
from strategies.robust import MedianBuffer, clip_update
from strategies.round_sums import RoundSums
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


#: What a method's :class:`~strategies.round_sums.RoundSums` give its ``apply_round``.
ResultT = TypeVar("ResultT")


class HeterogeneousStrategy(Strategy, Generic[ResultT]):
    """Base for strategies whose nodes train different variants of one family.

    Generic in what the round's sums give the method's math (``ResultT``):
    ``new_round_sums() -> RoundSums[ResultT]`` starts each aggregation and
    ``apply_round(server_round, result: ResultT, counts)`` ends it.

    Parameters
    ----------
    catalog : VariantCatalog
        Variants published to clients, smallest first.  Groups are variants.
    fraction_train, fraction_evaluate, ..., robust_aggregation
        The options every strategy shares, described in :class:`strategies.options.StrategyOptions`.

    """

    #: Whether the method's math accepts one group median instead of the replies (``RoundSums.add_group``).
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
        bounds = check_options(
            type(self).__name__,
            fraction_train=fraction_train,
            fraction_evaluate=fraction_evaluate,
            assign=assign,
            robust_aggregation=robust_aggregation,
            supports_median=self.supports_median,
            clip_update_norm=clip_update_norm,
        )
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
        self.clip_bounds = bounds
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
            log_profile(node, profile)
        for message in unchosen_variant_warnings(self.catalog.names(), self.profiles.values(), self.plan_warnings):
            self.plan_warnings.append(message)
            log(WARNING, "%s", message)

    def eligible_nodes(self, grid: Grid) -> list[int]:
        """Connected nodes that have a variant, after handshaking new ones."""
        all_nodes = wait_for_nodes(grid, self.min_available_nodes)
        self.handshake(grid, all_nodes)
        return sorted(n for n in all_nodes if n in self.profiles and self.profiles[n].variant is not None)

    def _sample(self, nodes: list[int], fraction: float, minimum: int) -> list[int]:
        if not nodes or fraction == 0.0:
            return []
        k = min(len(nodes), max(minimum, math.ceil(fraction * len(nodes))))
        return sorted(self.rng.sample(sorted(nodes, key=self.node_order), k))

    def node_order(self, node_id: int) -> tuple[object, ...]:
        """Where a node stands when a round's sample is drawn and its reply folded (its profile's ``sampling_order``).

        A node without a profile (it never answered the handshake) stands among the keyless nodes, by its id.
        """
        profile = self.profiles.get(node_id)
        return profile.sampling_order if profile is not None else (0, (), node_id)

    # ------------------------------------------------------------------ train
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """One message per sampled node, carrying that node's variant."""
        server_round = self.global_round(server_round)
        self._sync_state(arrays)
        report = self.report(server_round)
        report.started = time.time()
        self.prepare_round(server_round)
        eligible = self.eligible_nodes(grid)
        if not eligible and self.fraction_train > 0:
            check_someone_can_train(server_round, [self.profiles.get(n) for n in grid.get_node_ids()])
        nodes = self._sample(eligible, self.fraction_train, self.min_train_nodes)
        self._sent_train = self._messages(nodes, server_round, config, MessageType.TRAIN)
        log(INFO, "configure_train: %d nodes sampled (%s)", len(nodes), variant_counts(self._sent_train))
        return [s.message for s in self._sent_train.values()]

    def prepare_round(self, server_round: int) -> None:
        """Runs at the start of each round's ``configure_train``, before sampling (default: nothing).

        The state is already synced with Flower's record; a method that changes ``self.state``
        here recomposes it (:meth:`_compose_state`). pFedKnow trains its teacher and ``w_s'``
        on its labeled set before round 1 here.
        """

    def _messages(self, nodes: Iterable[int], server_round: int, config: ConfigRecord, kind: str) -> dict[str, Sent]:
        """Build a ``kind`` message per node and variant of :meth:`message_variants`; count bytes sent."""
        report = self.report(server_round)
        self.current_round = server_round
        out: dict[str, Sent] = {}
        for node in nodes:
            for variant in self.message_variants(node, kind):
                payload, extra = self.encode_payload(node, variant, kind, server_round)
                cfg = instruction_config(config, server_round=server_round, variant=variant)
                for key, value in extra.items():
                    cfg[key] = value
                held = self.held.prepare(node, payload)  # arrays the node holds are left out
                msg = Message(RecordDict({ARRAYS: payload, CONFIG: cfg, **held}), dst_node_id=node, message_type=kind)
                out[str(id(msg))] = Sent(msg, node, variant, record_nbytes(payload))
                report.add(variant, "bytes-down", out[str(id(msg))].nbytes)
        self.summarize_messages(server_round, kind, out)
        return out

    def summarize_messages(self, server_round: int, kind: str, sent: Mapping[str, Sent]) -> None:
        """Add method metrics of the round's built ``kind`` messages to the report (default: nothing).

        Runs once the messages are built, before they are sent; ``Sent.nbytes`` is each message's
        payload without the arrays its node holds. pFedKnow records each client's bytes down.
        """

    def encode_payload(
        self, node_id: int, variant: str, kind: str, server_round: int
    ) -> tuple[ArrayRecord, dict[str, ConfigRecordValues]]:
        """The ``ARRAYS`` record of a ``kind`` message to ``node_id`` and the config keys to add to it.

        Runs while each round's messages are built, once per node and variant. Default: the
        dense :meth:`variant_payload` (its ``Array`` objects cached across messages), no keys;
        pFedKnow sends its training messages sparse, with the round's pruning instruction.
        """
        return to_record(self.variant_payload(node_id, variant), self._arrays), {}

    def message_variants(self, node_id: int, kind: str) -> list[str]:
        """Variants a node gets a ``kind`` message for this round: the one it chose (override for more)."""
        variant = self.profiles[node_id].variant
        if variant is None:
            raise StrategyStateError(f"node {node_id} declined in the handshake and has no variant to be sent")
        return [variant]

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Decode and validate each reply (:meth:`decode_reply`), fold it into the round's sums, apply the method.

        Held replies are folded in their senders' order (:func:`~strategies.replies.in_node_order`):
        the same replies give bit-identical sums whatever order they arrived in.

        The sums are the method's (:meth:`new_round_sums`).  With clipping on, each update is
        clipped before it is folded (``clipped`` counts them); with the median, each group's
        coordinate-wise median is folded once.  Finiteness is checked per reply, or, where
        :meth:`defers_finiteness`, once on the sums, and only when a sum is not finite is every
        held reply checked, the bad ones rejected and new sums folded from the rest. Sums still
        not finite (a float32 overflow of finite replies) are discarded with a logged reason: the
        model stays as if no reply had come.
        """
        server_round = self.global_round(server_round)
        report = self.report(server_round)
        defer = self.defers_finiteness(replies)
        entries = self._accepted_replies(server_round, replies, report, check_finite=not defer)
        sums = self.new_round_sums()
        accepted = self._fold_accepted(entries, sums, report, keep_tensors=defer)
        finite = sums.is_finite()
        if defer and not finite:
            kept = []
            for entry in accepted:
                reason = non_finite_reason(entry.tensors)
                if reason is None:
                    kept.append(entry)
                else:
                    report.reject(f"node {entry.sent.node_id} ({entry.sent.variant}): {reason}")
            del sums
            sums = self.new_round_sums()
            accepted = self._fold_accepted(kept, sums, report, keep_tensors=False)
            finite = sums.is_finite()
        if not finite:
            report.reject("the weighted sums overflow float32 (every reply finite); the round is discarded")
            sums, accepted = self.new_round_sums(), []
        counts = {v.name: 0 for v in self.catalog}
        for entry in accepted:
            variant = entry.sent.variant
            counts[variant] += 1
            report.add(variant, "clients", 1)
            report.add(variant, "examples", entry.num_examples)
            report.add(variant, "bytes-up", entry.nbytes)
        accepted = [replace(entry, tensors={}) for entry in accepted]  # folded: the tensors go
        self.apply_round(server_round, sums.result(), counts)
        del sums  # what the method did not keep goes before the state is serialized
        self._compose_state()
        out = self.summarize_replies(server_round, accepted)
        for variant, c in counts.items():
            out[f"{variant}/clients"] = c
        return self._record, out

    def summarize_replies(self, server_round: int, accepted: Sequence[Accepted]) -> MetricRecord:
        """The round's client metrics, into the report and the record Flower logs; runs after :meth:`apply_round`.

        ``accepted`` are the round's accepted replies (their tensors already dropped). Default:
        every numeric metric but ``num-examples`` (``train-loss``, ``layers``) as an example-weighted
        mean per variant. ``aggregate_train`` adds each variant's reply count (``<variant>/clients``).
        """
        report = self.report(server_round)
        client_metrics: dict[str, StreamingMean] = {}
        for entry in accepted:
            scalars = {k: torch.tensor(v) for k, v in scalar_metrics(entry.metrics).items()}
            if scalars:
                client_metrics.setdefault(entry.sent.variant, StreamingMean()).add(scalars, entry.num_examples)
        out = MetricRecord()
        for variant, acc in client_metrics.items():
            for key, value in acc.mean().items():
                out[f"{variant}/{key}"] = float(value)
                report.group(variant)[key] = float(value)
        return out

    def defers_finiteness(self, replies: Iterable[Message]) -> bool:
        """Whether :meth:`aggregate_train` checks the sums' finiteness instead of every reply's.

        Only for held replies (a ``Sequence``, as Flower's ``send_and_receive`` returns; a lazy
        iterable is checked reply by reply), sums that can be dropped and folded again after a
        failure (``RoundSums.rebuildable``), no clipping (a norm needs finite values) and no median.
        """
        return (
            isinstance(replies, Sequence)
            and self.new_round_sums().rebuildable
            and not self.clip_bounds
            and self.robust_aggregation == "mean"
        )

    def _accepted_replies(
        self, server_round: int, replies: Iterable[Message], report: RoundReport, *, check_finite: bool
    ) -> Iterator[Accepted]:
        """Match and validate the replies one at a time; yield the accepted ones.

        Held replies in their senders' order (:func:`~strategies.replies.in_node_order`), a lazy
        stream as it comes.  The failed and rejected replies are reported in that order, the missing
        ones once the replies are exhausted.  The tensors are views of the reply's payload bytes (no copies).
        """
        ordered = in_node_order(replies, self.node_order)
        for reply, rec in matched_replies(ordered, by_message_id(self._sent_train), report, "train"):
            try:
                entry = self.decode_reply(rec, reply.content, server_round, check_finite=check_finite)
                fingerprint = self.replays.check(entry.tensors, server_round)
            except ReplyRejected as exc:
                report.reject(f"node {rec.node_id} ({rec.variant}): {exc}")
                continue
            self.replays.accept(fingerprint, server_round)
            yield entry

    def decode_reply(self, sent: Sent, content: RecordDict, server_round: int, *, check_finite: bool) -> Accepted:
        """Validate one matched training reply against what was sent; raise :class:`ReplyRejected` if bad.

        Runs for each reply as it is matched, before the replay check and the fold. Default: the
        dense reply of :func:`~strategies.validation.validate_train_reply` (the variant's trainable
        tensors, finite values where ``check_finite``) and an example count within the node's
        profile; pFedKnow decodes its sparse uploads and their masks.
        """
        layout = self.catalog.get(sent.variant).layout.by_name()
        expected = {k: s for k, s in layout.items() if s.trainable}
        tensors, n, metrics = validate_train_reply(
            content,
            expected=expected,
            variant=sent.variant,
            server_round=server_round,
            max_examples=self.max_examples,
            check_finite=check_finite,
        )
        self.check_examples_claim(sent, n)
        return Accepted(sent, tensors, n, metrics, record_nbytes(record_of(content, ARRAYS, ArrayRecord)))

    def check_examples_claim(self, sent: Sent, num_examples: int) -> None:
        """Reject a reply claiming more examples than its node declared in the handshake."""
        profile = self.profiles.get(sent.node_id)
        if profile is not None:
            validate_examples_claim(num_examples, profile.num_examples)

    def _fold_accepted(
        self, entries: Iterable[Accepted], sums: RoundSums[ResultT], report: RoundReport, *, keep_tensors: bool
    ) -> list[Accepted]:
        """Clip, then fold (or buffer for the median) every accepted reply into ``sums``; return the entries.

        The entries keep their tensors only with ``keep_tensors``; otherwise each reply's
        tensors are dropped once folded, so a lazy stream of replies is folded and released one
        reply at a time.  A group's median stands for the whole group (the sums weigh it by the
        group's total examples, or its reply count), so the method's cross-group math is unchanged.
        """
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
                sums.add(entry, tensors)
            del tensors
            kept.append(entry if keep_tensors else replace(entry, tensors={}))
        for variant in sorted(buffers, key=self.catalog.names().index):  # the catalog's order, not the replies'
            median, total, count = buffers[variant].result()
            sums.add_group(variant, median, total, count)
        return kept

    def new_round_sums(self) -> RoundSums[ResultT]:
        """Fresh sums for one aggregation (:mod:`strategies.round_sums`); runs at its start and at every rebuild.

        Each method answers: :class:`~strategies.round_sums.GroupMeans` for per-variant means,
        sums of its own otherwise (coverage, architecture sums, kept uploads, node models).
        """
        raise NotImplementedError

    def apply_round(self, server_round: int, result: ResultT, counts: Mapping[str, int]) -> None:
        """Method math, after every reply is folded: update ``self.state`` from the round's sums.

        ``result`` is :meth:`RoundSums.result <strategies.round_sums.RoundSums.result>` of the
        round's sums (per-variant means: ``means[v]`` is the example-weighted mean of the
        ``counts[v]`` replies of variant ``v``, absent without replies, fresh tensors aliasing no
        reply nor the state that a method may reuse in place).
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
        results: list[Evaluated] = []
        ordered = in_node_order(replies, self.node_order)
        for reply, rec in matched_replies(ordered, by_message_id(self._sent_eval), report, "evaluate"):
            try:
                n, loss, acc = validate_evaluate_reply(
                    reply.content, variant=rec.variant, server_round=server_round, max_examples=self.max_examples
                )
            except ReplyRejected as exc:
                report.reject(f"node {rec.node_id} ({rec.variant}): {exc}", "evaluate")
                continue
            results.append(Evaluated(rec, n, loss, acc))
        out = MetricRecord()
        means = evaluation_means((e.sent.variant, e.num_examples, e.loss, e.accuracy) for e in results)
        for variant, (loss, acc) in means.items():
            out[f"{variant}/fed-loss"], out[f"{variant}/fed-accuracy"] = loss, acc
            report.group(variant).update({"fed-loss": loss, "fed-accuracy": acc})
        self.summarize_evaluation(server_round, results, out)
        return out

    def summarize_evaluation(self, server_round: int, results: Sequence[Evaluated], out: MetricRecord) -> None:
        """Add method metrics of the round's accepted evaluation replies to the report and ``out``.

        Runs at the end of ``aggregate_evaluate``, after the example-weighted ``fed-loss`` and
        ``fed-accuracy`` per variant. Default: nothing; pFedKnow adds its per-client accuracies.
        """

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
