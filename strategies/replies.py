"""A round's sent messages, the replies matched back to them, and the round's report.

Every message a strategy sends is remembered as a :class:`Sent` (its node, variant and bytes);
Flower fills the message id in place when it pushes the messages, so replies are matched through
:func:`by_message_id`.  :func:`match_reply` maps a reply back to what was sent or reports why it
cannot: a reply to no message of the round or from another node than the one addressed is
rejected, an error reply is a failure (or, for a reply whose pull was stopped at its size bound,
a rejection: :func:`strategies.pull_bound.stopped_reason`).  :func:`report_missing` reports
every node that was sent a message and not heard from.  :func:`in_node_order` puts a round's
held replies in their senders' order, so that a round's sums are folded in the same order in
every run.  Everything lands in the round's :class:`RoundReport`, which the results writer turns
into result rows.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from logging import WARNING

from flwr.app import Message, MetricRecord
from flwr.common import log
from torch import Tensor

from strategies.pull_bound import stopped_reason


@dataclass
class Sent:
    """A message the strategy sent, remembered to match replies."""

    message: Message
    node_id: int
    variant: str
    nbytes: int


@dataclass
class RoundReport:
    """Per-round bookkeeping exposed to the results writer."""

    server_round: int
    started: float = field(default_factory=time.time)
    groups: dict[str, dict[str, float]] = field(default_factory=dict)
    rejected: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)

    def group(self, variant: str) -> dict[str, float]:
        """Mutable metrics dict of one group."""
        return self.groups.setdefault(variant, {})

    def add(self, variant: str, key: str, value: float) -> None:
        """Accumulate ``value`` under ``key`` for ``variant``."""
        g = self.group(variant)
        g[key] = g.get(key, 0.0) + value

    def reject(self, reason: str, what: str = "train") -> None:
        """Log and record a rejected ``what`` reply (it never reaches the model)."""
        log(WARNING, "rejected %s reply: %s", what, reason)
        self.rejected.append(reason)


@dataclass(frozen=True)
class Accepted:
    """A validated training reply: its node, tensors (payload views), examples, metrics, bytes.

    ``masks`` are the reply's sparsity masks (name -> boolean tensor, ``True`` = weight kept)
    where the method's uploads are sparse (pFedKnow), else ``None``.
    """

    sent: Sent
    tensors: Mapping[str, Tensor]
    num_examples: int
    metrics: MetricRecord
    nbytes: int
    masks: Mapping[str, Tensor] | None = None


@dataclass(frozen=True)
class Evaluated:
    """A validated evaluation reply: what it answers, its examples, loss and accuracy."""

    sent: Sent
    num_examples: int
    loss: float
    accuracy: float


def variant_counts(sent: Mapping[str, Sent]) -> str:
    """``"<variant>: <messages>, ..."`` over the sent messages, sorted by variant (``none`` when empty)."""
    counts: dict[str, int] = {}
    for s in sent.values():
        counts[s.variant] = counts.get(s.variant, 0) + 1
    return ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())) or "none"


def by_message_id(sent: Mapping[str, Sent]) -> dict[str, Sent]:
    """The sent messages keyed by their message id (``push_messages`` fills it in place, after ``configure_*``)."""
    return {s.message.metadata.message_id: s for s in sent.values()}


def match_reply(reply: Message, sent: Mapping[str, Sent], report: RoundReport, what: str) -> Sent | None:
    """What ``reply`` answers, or ``None`` after reporting why it is not used.

    Rejected: a reply to no message in ``sent`` (keyed by message id), one from another node than
    the one addressed, and an error reply whose pull was stopped at its size bound.  Failed: any
    other error reply (a ClientApp exception, a dead node).
    """
    rec = sent.get(reply.metadata.reply_to_message_id)
    if rec is None:
        reason = f"{what} reply from node {reply.metadata.src_node_id} answers no message of this round"
        log(WARNING, "rejected: %s", reason)
        report.rejected.append(reason)
        return None
    if reply.has_error():
        stopped = stopped_reason(str(reply.error.reason))  # pulled past the bound: the node's doing, refused
        failed = f"{what} failed: code {reply.error.code}: {reply.error.reason}"
        reason = f"node {rec.node_id} ({rec.variant}) {stopped or failed}"
        log(WARNING, "%s%s", "rejected: " if stopped else "", reason)
        (report.rejected if stopped else report.failed).append(reason)
        return None
    if reply.metadata.src_node_id != rec.node_id:
        reason = f"{what} reply for node {rec.node_id} came from node {reply.metadata.src_node_id}"
        log(WARNING, "rejected: %s", reason)
        report.rejected.append(reason)
        return None
    return rec


#: A node's place in a round's fold, from its id (:attr:`strategies.profiles.NodeProfile.sampling_order`).
NodeOrder = Callable[[int], tuple[object, ...]]


def in_node_order(replies: Iterable[Message], order: NodeOrder) -> Iterable[Message]:
    """Held replies sorted by their sender's place ``(order(src_node_id), message id)``; a lazy stream as it comes.

    Float sums are not associative: a mean ``sum_i w_i x_i / sum_i w_i`` folded over three or
    more replies in arrival order (whichever ClientApp finished first) changes in its last bits
    from run to run, and local training amplifies the difference over the rounds, so two runs of
    one seed drift apart.  Folded in the senders' order (their ``node-key``, which simulation
    keeps from run to run while it draws new node ids), the same replies give bit-identical sums.
    A lazy iterable is folded as it comes (sorting it would hold every reply at once).
    """
    if not isinstance(replies, Sequence):
        return replies
    return sorted(replies, key=lambda r: (order(r.metadata.src_node_id), r.metadata.reply_to_message_id))


def matched_replies(
    replies: Iterable[Message], sent: Mapping[str, Sent], report: RoundReport, what: str
) -> Iterator[tuple[Message, Sent]]:
    """Each usable reply with what it answers (``sent`` keyed by message id), in the order of ``replies``.

    The unusable ones are reported as they come (:func:`match_reply`), the nodes not heard from
    once ``replies`` is exhausted (:func:`report_missing`).
    """
    seen: list[tuple[str, int]] = []
    for reply in replies:
        seen.append((reply.metadata.reply_to_message_id, reply.metadata.src_node_id))
        rec = match_reply(reply, sent, report, what)
        if rec is not None:
            yield reply, rec
    report_missing(sent, seen, report, what)


def report_missing(sent: Mapping[str, Sent], seen: list[tuple[str, int]], report: RoundReport, what: str) -> None:
    """Report every node that was sent a message and was not heard from (round timeout).

    ``seen`` holds ``(reply_to_message_id, src_node_id)`` of every reply; a node whose
    reply was rejected or failed is already reported and is not reported again here.
    """
    answered = {m for m, _ in seen}
    heard = {n for _, n in seen}
    for message_id, rec in sent.items():
        if message_id not in answered and rec.node_id not in heard:
            reason = f"node {rec.node_id} ({rec.variant}) {what} failed: no reply within the round timeout"
            log(WARNING, "%s", reason)
            report.failed.append(reason)


def evaluation_means(results: Iterable[tuple[str, int, float, float]]) -> dict[str, tuple[float, float]]:
    r"""Example-weighted loss and accuracy per variant over ``(variant, n, loss, accuracy)`` replies.

    .. math:: \bar\ell_v = \frac{\sum_{i \in v} n_i \ell_i}{\sum_{i \in v} n_i}, \qquad
              \bar a_v = \frac{\sum_{i \in v} n_i a_i}{\sum_{i \in v} n_i}

    Variants without a reply are absent.
    """
    sums: dict[str, list[float]] = {}
    for variant, n, loss, acc in results:
        s = sums.setdefault(variant, [0.0, 0.0, 0.0])
        s[0] += n
        s[1] += n * loss
        s[2] += n * acc
    return {variant: (loss_sum / total, acc_sum / total) for variant, (total, loss_sum, acc_sum) in sums.items()}
