"""The grid a strategy's rounds run on: Flower's, polled for replies more promptly, resending lost arrays.

Flower 1.39's deployment grid (``HttpGrid.send_and_receive``) sleeps 3 s between pulls of the
replies; :class:`PromptGrid` wraps any grid and polls every ``poll_interval`` seconds instead
(``HETFL_REPLY_POLL_S``, :meth:`strategies.base.HeterogeneousStrategy.start`), bounds the bytes
it pulls per reply (:mod:`strategies.pull_bound`) and pushes again an object the SuperLink did not
store (:mod:`strategies.runtime_client`).
:class:`HeldArraysGrid` adds the server's side of :mod:`experiment.held`: arrays a node holds are
left out of its messages (:class:`HeldArrays`), and a node that lost them gets its message again
whole in the same round.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from logging import WARNING
from typing import Any

from flwr.app import Array, ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.common import log
from flwr.serverapp import Grid

from experiment.held import (
    BUNDLE,
    BUNDLE_ARRAY,
    CACHE,
    HELD,
    HELD_MISSING_CODE,
    HOLDS,
    MIN_HELD_BYTES,
    ORDER,
    array_digest,
    bundle_arrays,
    digest_record,
    pop_bundle,
    pop_digests,
    pop_order,
    split_held,
)
from experiment.protocol import ARRAYS
from experiment.switches import env_switch
from strategies.pull_bound import bound_pulls
from strategies.runtime_client import retry_pushes


class PromptGrid(Grid):
    """A ``Grid`` whose ``send_and_receive`` polls for replies every ``poll_interval`` seconds.

    Flower 1.39's deployment grid (``HttpGrid.send_and_receive``) sleeps 3 s between pulls,
    so each message round trip waits 1.5 s on average after its last reply arrived.  Every
    other call goes to the wrapped grid unchanged; the semantics are Flower's (replies that
    arrive after ``timeout`` are not collected, ``timeout=None`` waits for all).
    """

    def __init__(self, grid: Grid, poll_interval: float = 0.2, reply_bound: int | None = None) -> None:
        self.grid = grid
        self.poll_interval = poll_interval
        self.reply_bound = reply_bound

    def set_run(self, run: Any) -> None:  # noqa: D102
        self.grid.set_run(run)

    @property
    def run(self) -> Any:  # noqa: D102
        return self.grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:  # noqa: D102
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return self.grid.get_node_ids()

    def get_nodes(self) -> Iterable[Any]:  # noqa: D102
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """The wrapped grid's push, an object the SuperLink did not store pushed again (:mod:`experiment.retry`)."""
        retry_pushes(self.grid)
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """The wrapped grid's replies, each pulled within ``reply_bound`` bytes (:mod:`strategies.pull_bound`)."""
        if self.reply_bound is not None:
            bound_pulls(self.grid, self.reply_bound)
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages``; pull their replies every ``poll_interval`` s until all came or ``timeout``."""
        pending = set(self.push_messages(messages))
        end = time.time() + (timeout if timeout is not None else 0.0)
        replies: list[Message] = []
        while pending:
            got = list(self.pull_messages(pending))
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            if not pending or (timeout is not None and time.time() >= end):
                break
            time.sleep(self.poll_interval)
        return replies


#: ``0`` / ``off`` sends each array as its own object again (and the nodes answer in kind).
BUNDLE_ENV = "HETFL_BUNDLE_ARRAYS"


def bundling_enabled() -> bool:
    """Whether messages' arrays are bundled (``HETFL_BUNDLE_ARRAYS`` not ``0``/``false``/``off``/``no``)."""
    return env_switch(BUNDLE_ENV)


class HeldArrays:
    """What each node holds (:mod:`experiment.held`), and the arrays left out of messages in flight.

    Arrays of at least ``min_bytes`` may be kept by a node.  Digests are computed once per
    ``Array`` object (the strategies reuse an unchanged tensor's ``Array``,
    :class:`strategies.records.ArrayCache`, and the same payload goes to every node of a variant).
    With ``bundle`` (default: :func:`bundling_enabled`) the arrays a message still carries travel
    as one (:func:`experiment.held.bundle_arrays`), and the node bundles its reply the same way.
    """

    def __init__(self, min_bytes: int = MIN_HELD_BYTES, *, bundle: bool | None = None) -> None:
        self.min_bytes = min_bytes
        self.bundle = bundling_enabled() if bundle is None else bundle
        self.holds: dict[int, dict[str, str]] = {}
        self._digests: dict[int, tuple[Array, str]] = {}
        self._left_out: dict[int, tuple[ArrayRecord, dict[str, Array]]] = {}
        self._bundles: dict[tuple[tuple[str, int], ...], tuple[list[Array], Array, ConfigRecord]] = {}
        self._unbundled: dict[int, ArrayRecord] = {}  # id of a pushed bundle record -> the record it replaced

    def _digest(self, array: Array) -> str:
        hit = self._digests.get(id(array))
        if hit is not None and hit[0] is array:
            return hit[1]
        if len(self._digests) >= 4096:  # arrays of earlier rounds: forget them
            self._digests = {}
        digest = array_digest(array)
        self._digests[id(array)] = (array, digest)
        return digest

    def keepable(self, arrays: ArrayRecord) -> dict[str, str]:
        """``name -> digest`` of the arrays in ``arrays`` a node may keep (at least ``min_bytes``)."""
        return {n: self._digest(a) for n, a in arrays.items() if len(a.data) >= self.min_bytes}

    def prepare(self, node_id: int, arrays: ArrayRecord) -> dict[str, ConfigRecord]:
        """Leave out of ``arrays`` (in place) what ``node_id`` holds; return the records to add.

        The returned dict has :data:`HELD` (arrays left out) and/or :data:`CACHE` (arrays to keep).
        """
        present = self.keepable(arrays)
        if not present:
            return {}
        held, cache = split_held(present, self.holds.get(node_id, {}))
        order = list(arrays.keys())
        left_out = {n: arrays[n] for n in held}
        for n in held:
            del arrays[n]
        if left_out:
            self._left_out[id(arrays)] = (arrays, left_out)
        records = {HELD: digest_record(held), ORDER: ConfigRecord({"names": order})} if held else {}
        return records | ({CACHE: digest_record(cache)} if cache else {})

    def bundle_message(self, msg: Message) -> None:
        """Make ``msg``'s arrays one bundle (in place, right before it is pushed), if bundling is on.

        What is still sent after :meth:`prepare` travels as one array: two objects, not two per
        array.  A message with an :data:`ARRAYS` record is always bundled (even an empty one) so
        that the node, which answers in kind, bundles its reply.
        """
        arrays = msg.content.get(ARRAYS)
        if not self.bundle or not isinstance(arrays, ArrayRecord) or BUNDLE in msg.content:
            return
        bundle, layout = self._bundle(arrays)
        bundled = ArrayRecord({BUNDLE_ARRAY: bundle})
        self._unbundled[id(bundled)] = arrays
        msg.content[ARRAYS] = bundled
        msg.content[BUNDLE] = layout

    def _arrays_of(self, content: RecordDict) -> object:
        """The :data:`ARRAYS` record of a pushed message's ``content`` as :meth:`prepare` left it."""
        arrays = content.get(ARRAYS)
        return self._unbundled.get(id(arrays), arrays)

    def _bundle(self, arrays: ArrayRecord) -> tuple[Array, ConfigRecord]:
        """:func:`bundle_arrays`, reused for a message with the same ``Array`` objects (nodes of one variant)."""
        parts = list(arrays.items())
        key = tuple((name, id(array)) for name, array in parts)
        hit = self._bundles.get(key)
        if hit is None:
            if len(self._bundles) >= 64:  # bundles of earlier rounds: forget them
                self._bundles = {}
            hit = self._bundles[key] = ([a for _, a in parts], *bundle_arrays(dict(parts)))
        return hit[1], ConfigRecord(dict(hit[2]))

    def received(self, reply: Message) -> None:
        """Record what the reply's node says it holds; unbundle its arrays (both records removed, in place).

        A malformed bundle is logged and left in the reply, whose validation then rejects it.
        """
        if reply.has_error():
            return
        node = reply.metadata.src_node_id
        try:
            pop_bundle(reply.content, ARRAYS)
        except ValueError as exc:
            log(WARNING, "node %d: its reply's arrays do not unbundle: %s", node, exc)
        try:
            holds = pop_digests(reply.content, HOLDS)
        except ValueError as exc:
            log(WARNING, "node %d: ignored its %r record: %s", node, HOLDS, exc)
            return
        if holds:
            self.holds.setdefault(node, {}).update(holds)

    def whole(self, sent: Message) -> Message:
        """``sent`` again with every array it left out, marked for keeping; its node holds nothing now."""
        node = sent.metadata.dst_node_id
        self.holds.pop(node, None)
        content = RecordDict(dict(sent.content.items()))
        original = self._arrays_of(content)
        _, left_out = self._left_out.get(id(original), (None, {}))
        if isinstance(original, ArrayRecord):
            content[ARRAYS] = original
        if BUNDLE in content:
            del content[BUNDLE]
        held, order = pop_digests(content, HELD), pop_order(content)
        arrays = content[ARRAYS]
        if not isinstance(arrays, ArrayRecord):
            raise TypeError(f"message to node {node} has no {ARRAYS!r} ArrayRecord")
        every = dict(arrays.items()) | {name: left_out[name] for name in held}
        whole = ArrayRecord({name: every[name] for name in (order or every)})
        content[ARRAYS] = whole
        cache = self.keepable(whole)
        if cache:
            content[CACHE] = digest_record(cache)
        return Message(content, dst_node_id=node, message_type=sent.metadata.message_type)

    def forget(self, sent: Message) -> None:
        """Drop what was kept to resend ``sent`` (its reply came)."""
        self._left_out.pop(id(self._arrays_of(sent.content)), None)
        self._unbundled.pop(id(sent.content.get(ARRAYS)), None)


class HeldArraysGrid(PromptGrid):
    """A grid that resends in full a message whose node lost arrays it had said it holds.

    Pushes pass through (the strategy left the held arrays out when it built the messages,
    :meth:`HeldArrays.prepare`).  Each pulled reply's :data:`HOLDS` record goes to
    :meth:`HeldArrays.received`; a reply with :data:`HELD_MISSING_CODE` is not returned: the
    message is pushed again whole (:meth:`HeldArrays.whole`), and its reply is returned in place
    of the first, as a reply to the first message, so the strategy sees one reply per message.
    """

    def __init__(
        self, grid: Grid, held: HeldArrays, poll_interval: float = 0.2, reply_bound: int | None = None
    ) -> None:
        super().__init__(grid, poll_interval, reply_bound)
        self.held = held
        self._pushed: dict[str, Message] = {}
        self._resent: dict[str, str] = {}  # resent message id -> first message id
        self._alias: dict[str, str] = {}  # first message id -> resent message id

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        """Push ``messages``, each with its arrays bundled (:meth:`HeldArrays.bundle_message`)."""
        batch = list(messages)
        for msg in batch:
            self.held.bundle_message(msg)
        ids = list(super().push_messages(batch))
        self._pushed.update(zip(ids, batch, strict=True))
        return ids

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """:meth:`PromptGrid.send_and_receive`; what was kept for messages never answered is dropped after it."""
        try:
            return super().send_and_receive(messages, timeout=timeout)
        finally:
            for sent in self._pushed.values():
                self.held.forget(sent)
            self._pushed, self._resent, self._alias = {}, {}, {}

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        """Replies to ``message_ids``; a lost held array's message is resent and its reply awaited."""
        out: list[Message] = []
        for reply in super().pull_messages([self._alias.get(i, i) for i in message_ids]):
            got = reply.metadata.reply_to_message_id
            first = self._resent.get(got, got)
            sent = self._pushed.get(first)
            if sent is None:
                out.append(reply)
                continue
            if reply.has_error() and reply.error.code == HELD_MISSING_CODE and got == first:
                log(WARNING, "node %d: %s; sending message %s again whole", sent.metadata.dst_node_id,
                    reply.error.reason, first)  # fmt: skip
                (again,) = super().push_messages([self.held.whole(sent)])
                self._alias[first], self._resent[again] = again, first
                continue
            self.held.received(reply)
            self.held.forget(sent)
            del self._pushed[first]
            if got != first:
                self._alias.pop(first, None)
                self._resent.pop(got, None)
                reply = Message(reply.error if reply.has_error() else reply.content, reply_to=sent)
            out.append(reply)
        return out
