"""A bound on the bytes the ServerApp pulls for one reply, enforced while it pulls (issue 22, item 5).

A reply reaches the ServerApp as a tree of objects that its node pushed to the SuperLink; Flower
1.39's deployment grid (``HttpGrid.pull_messages``) pulls every object of a reply into memory
before anything can look at it, and nothing in Flower bounds their number (each object is at
most one gRPC message, 2 GiB, on the node's link; Flower's own nodes cut arrays into 5 MiB
chunks).  A node could make the ServerApp hold gigabytes.

:class:`BoundedPulls` wraps the grid's runtime client: it learns each reply's object tree from
``PullMessages`` and counts the bytes of every object ``PullObject`` returns against each reply
that holds it.  Once a reply passes ``bound`` bytes, ``PullObject`` raises Flower's
``ObjectPullError`` instead of returning: Flower's grid stops pulling that reply's objects and
hands the strategy an error reply (``MESSAGE_UNAVAILABLE``) whose reason ends with ours, which
the strategy lists under ``rejected`` with the node's id (:func:`stopped_reason`): the node sent
it, unlike a failure.  What the ServerApp held for it is dropped; the bytes pulled before the
stop are at most ``bound`` plus the objects in flight (Flower pulls a reply's objects on
``min(cores, FLWR_PRIVATE_MAX_CONCURRENT_OBJ_PULLS = 2)`` threads: ``bound + 2 x`` the largest
object, 5 MiB for Flower's own nodes and at most one gRPC message, 2 GiB, for a node that builds
its own objects).  The objects stay on the SuperLink
until the run ends: the SuperLink's memory is not bounded by this.

The bound (:func:`reply_bound`): twice the largest payload any variant's train reply can have
(:func:`strategies.validation.max_payload_bytes` of its trainable tensors) plus 1 MiB for the
records, metrics and object headers: 2.4 MB for the tiny model, 89.8 MB for MiniLM-L6.  An
honest reply is at most half of it; validation then requires the exact bytes of the layout sent.
"""

from __future__ import annotations

import threading
from typing import Any

from flwr.supercore.inflatable.inflatable_object import iterate_object_tree
from flwr.supercore.inflatable.inflatable_utils import ObjectPullError

from models.catalog import VariantCatalog
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


class BoundedPulls:
    """Flower's runtime client with each reply's pulled bytes counted and cut at ``bound``.

    Every attribute but ``PullMessages`` and ``PullObject`` is the wrapped client's.
    """

    def __init__(self, client: Any, bound: int) -> None:
        self.client = client
        self.bound = bound
        self._lock = threading.Lock()
        self._owners: dict[str, list[str]] = {}  # object id -> ids of the replies holding it
        self._pulled: dict[str, int] = {}  # reply id -> bytes pulled for it
        self.stopped: dict[str, int] = {}  # reply id -> bytes pulled when it was first stopped

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def PullMessages(self, request: Any) -> Any:
        """Pull the replies' headers; remember which objects each reply holds."""
        response = self.client.PullMessages(request)
        owners: dict[str, list[str]] = {}
        for proto, tree in zip(response.messages_list, response.message_object_trees, strict=True):
            reply = proto.metadata.message_id
            for node in iterate_object_tree(tree):
                owners.setdefault(node.object_id, []).append(reply)
        with self._lock:
            self._owners = owners
            self._pulled = {reply: 0 for replies in owners.values() for reply in replies}
        return response

    def PullObject(self, request: Any) -> Any:
        """Pull one object; ``ObjectPullError`` once a reply holding it passes the bound."""
        response = self.client.PullObject(request)
        size = len(response.object_content)
        with self._lock:
            over = []
            for reply in self._owners.get(request.object_id, []):
                self._pulled[reply] += size
                if self._pulled[reply] > self.bound:
                    over.append((reply, self._pulled[reply]))
            for reply, pulled in over:
                self.stopped.setdefault(reply, pulled)
        if over:
            reply, pulled = over[0]
            raise ObjectPullError(
                request.object_id,
                f"{STOPPED} of {self.bound} bytes per reply ({pulled} bytes pulled); not read further",
            )
        return response


def bound_pulls(grid: Any, bound: int) -> bool:
    """Wrap the runtime client of Flower's deployment grid in :class:`BoundedPulls` (again if it reconnected).

    Flower 1.39's ``HttpGrid`` keeps its client in ``_client`` behind the ``_runtime_client``
    property (which connects on first use); a grid without one (the simulation's in-memory
    grid, whose replies come from the same process's Ray actors) is left alone: ``False``.
    """
    if not hasattr(type(grid), "_runtime_client"):
        return False
    client = grid._runtime_client
    if not isinstance(client, BoundedPulls):
        grid._client = BoundedPulls(client, bound)
    return True
