"""A bound on the bytes the ServerApp pulls for one reply, enforced while it pulls (issue 22, item 5).

A reply reaches the ServerApp as a tree of objects that its node pushed to the SuperLink; Flower
1.39's deployment grid (``HttpGrid.pull_messages``) pulls every object of a reply into memory
before anything can look at it, and nothing in Flower bounds their number (each object is at
most one gRPC message, 2 GiB, on the node's link; Flower's own nodes cut arrays into 5 MiB
chunks).  A node could make the ServerApp hold gigabytes.

:class:`BoundedPulls` wraps the grid's runtime client and counts, for each reply, the bytes of
every object ``PullObject`` returns while that reply is pulled.  Once a reply passes ``bound``
bytes, its next ``PullObject`` raises Flower's ``ObjectPullError`` instead of returning: Flower's
grid stops pulling that reply's objects and hands the strategy an error reply
(``MESSAGE_UNAVAILABLE``) whose reason ends with ours, which the strategy lists under
``rejected`` with the node's id (:func:`stopped_reason`): the node sent it, unlike a failure.
What the ServerApp held for it is dropped; the bytes pulled before the stop are at most
``bound`` plus the objects in flight (Flower pulls a reply's objects on
``min(cores, FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS = 2)`` threads: ``bound + 2 x`` the largest
object, 5 MiB for Flower's own nodes and at most one gRPC message, 2 GiB, for a node that builds
its own objects).  The objects stay on the SuperLink until the run ends: the SuperLink's memory
is not bounded by this.

Which reply a pull is for: a ``PullObject`` request names only an object, and objects are
content-addressed, so two replies can hold the same one (two nodes' equal arrays or records).
Counting an object to every reply that holds it let a stopped reply stop an honest one that
shared an object with it (found in the chaos suite's hostile case).  Flower 1.39's
``HttpGrid.pull_messages`` pulls the replies of one ``PullMessages`` answer one after another,
reading ``PullObject`` from the runtime client once per reply, in the answer's order, and using
what it read for all of that reply's objects; :class:`BoundedPulls` hands it a
:class:`ReplyPull` for the next reply at each read, so each byte is counted to the reply it was
pulled for, including pulls still in flight after their reply was stopped.  A pull that does not
fit this (an object outside that reply's tree, or a read with no reply left) is refused with an
``ObjectPullError`` saying so, never counted to a guess.

The bound (:func:`reply_bound`): twice the largest payload any variant's train reply can have
(:func:`strategies.validation.max_payload_bytes` of its trainable tensors) plus 1 MiB for the
records, metrics and object headers: 2.4 MB for the tiny model, 89.8 MB for MiniLM-L6.  An
honest reply is at most half of it; validation then requires the exact bytes of the layout sent.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Any

from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
from flwr.supercore.inflatable.inflatable_utils import ObjectPullError

from models.catalog import VariantCatalog
from strategies.runtime_client import ClientWrapper, wrap_runtime_client
from strategies.validation import max_payload_bytes

#: Bytes a reply may hold besides its arrays' payload (records, metrics, object headers).
REPLY_SLACK_BYTES = 1 << 20
#: How the reason of a stopped pull begins (the strategy's ``rejected`` entry ends with it).
STOPPED = "reply passed the ServerApp's bound"


def reply_bound(catalog: VariantCatalog) -> int:
    """Bytes one reply may bring into the ServerApp: ``2 x`` the largest trainable payload ``+`` 1 MiB.

    A train reply carries a variant's trainable tensors (frozen ones never go up); the factor
    2 leaves room for encodings of them (pFedKnow's values and masks) and nothing else.
    """
    largest = max(max_payload_bytes({n: s for n, s in v.layout.by_name().items() if s.trainable}) for v in catalog)
    return 2 * largest + REPLY_SLACK_BYTES


def stopped_reason(error_reason: str) -> str | None:
    """The part of an error reply's reason that says its pull was stopped at the bound, else ``None``.

    Flower wraps it (``Reply message objects are unavailable ... Failed to pull object ...: <ours>``).
    """
    at = error_reason.find(STOPPED)
    return None if at < 0 else error_reason[at:]


class ReplyPull:
    """``PullObject`` for the objects of one reply, counting their bytes and cut at ``bound``.

    Parameters
    ----------
    reply_id : str
        The reply's message id.
    object_ids : frozenset[str]
        Every object of the reply's tree (a pull for another one is refused).
    pull : Callable
        The runtime client's ``PullObject``.
    bound : int
        Bytes the reply may bring in; past it every further pull raises ``ObjectPullError``.
    stopped : dict[str, int]
        Shared with :class:`BoundedPulls`: ``reply id -> bytes pulled`` when it was first stopped.

    """

    def __init__(
        self, reply_id: str, object_ids: frozenset[str], pull: Callable[[Any], Any], bound: int, stopped: dict[str, int]
    ) -> None:
        self.reply_id = reply_id
        self.object_ids = object_ids
        self.pull = pull
        self.bound = bound
        self.stopped = stopped
        self.pulled = 0
        self._lock = threading.Lock()

    def __call__(self, request: Any) -> Any:
        """Pull one object of this reply; ``ObjectPullError`` once the reply has passed the bound."""
        if request.object_id not in self.object_ids:
            raise ObjectPullError(
                request.object_id,
                f"the ServerApp's pull bound was asked for an object outside reply {self.reply_id}'s tree "
                "(Flower's HttpGrid.pull_messages no longer pulls one reply per PullObject read)",
            )
        with self._lock:
            if self.pulled > self.bound:
                raise self._stopped(request.object_id)
        response = self.pull(request)
        with self._lock:
            self.pulled += len(response.object_content)
            if self.pulled > self.bound:
                self.stopped.setdefault(self.reply_id, self.pulled)
                raise self._stopped(request.object_id)
        return response

    def _stopped(self, object_id: str) -> ObjectPullError:
        return ObjectPullError(
            object_id, f"{STOPPED} of {self.bound} bytes per reply ({self.pulled} bytes pulled); not read further"
        )


class BoundedPulls(ClientWrapper):
    """Flower's runtime client with each reply's pulled bytes counted and cut at ``bound``.

    ``PullObject`` is read once per reply of the last ``PullMessages`` answer, in its order
    (module docstring); each read is that reply's :class:`ReplyPull`.  Every attribute but
    ``PullMessages`` and ``PullObject`` is the wrapped client's.
    """

    def __init__(self, client: Any, bound: int) -> None:
        super().__init__(client)
        self.bound = bound
        self._lock = threading.Lock()
        self._next: deque[ReplyPull] = deque()  # the last answer's replies not yet pulled
        self.stopped: dict[str, int] = {}  # reply id -> bytes pulled for it when it was first stopped

    def PullMessages(self, request: Any) -> Any:
        """Pull the replies' headers; prepare one :class:`ReplyPull` per reply, in the answer's order."""
        response = self.client.PullMessages(request)
        pulls = deque(
            ReplyPull(
                proto.metadata.message_id,
                frozenset(node.object_id for node in iterate_object_tree(tree)),
                self.client.PullObject,
                self.bound,
                self.stopped,
            )
            for proto, tree in zip(response.messages_list, response.message_object_trees, strict=True)
        )
        with self._lock:
            self._next = pulls
        return response

    @property
    def PullObject(self) -> Callable[[Any], Any]:
        """The next reply's :class:`ReplyPull` (Flower reads this once per reply it pulls)."""
        with self._lock:
            if self._next:
                return self._next.popleft()
        return _unattributed_pull


def _unattributed_pull(request: Any) -> Any:
    """A ``PullObject`` read with no reply of the last ``PullMessages`` left to count it to: refused."""
    raise ObjectPullError(
        request.object_id,
        "the ServerApp's pull bound has no reply to count this object to "
        "(Flower's HttpGrid.pull_messages no longer reads PullObject once per reply)",
    )


def bound_pulls(grid: Any, bound: int) -> bool:
    """Wrap the runtime client of Flower's deployment grid in :class:`BoundedPulls` (again if it reconnected).

    A grid without one (the simulation's in-memory grid) is left alone: ``False``
    (:func:`strategies.runtime_client.wrap_runtime_client`).
    """
    return wrap_runtime_client(grid, BoundedPulls, lambda client: BoundedPulls(client, bound))
