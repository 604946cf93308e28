"""The per-reply pull bound (strategies/pull_bound.py) through Flower 1.39's own deployment grid.

``HttpGrid.pull_messages`` runs unchanged over a stand-in for its runtime client that serves
real replies' objects (Flower's own deflated objects and trees), so what is checked is what the
ServerApp gets: the small reply whole, the big one as an error reply naming the bound.
"""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, Metadata, RecordDict
from flwr.app.message import make_message, remove_content_from_message
from flwr.common.serde import message_to_proto
from flwr.proto.message_pb2 import PullObjectResponse
from flwr.proto.runtime_pb2 import PullAppMessagesResponse
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree
from flwr.supercore.inflatable.inflatable_utils import ObjectPullError
from flwr.superlink.grid.http_grid import HttpGrid

from strategies.grid import PromptGrid
from strategies.inclusivefl import InclusiveFL
from strategies.pull_bound import REPLY_SLACK_BYTES, STOPPED, BoundedPulls, bound_pulls, reply_bound, stopped_reason
from strategies.validation import NPY_HEADER_BYTES
from tests.toy import constant_state, error_reply, sent, toy_catalog


def reply(nbytes: int, answers: str) -> Message:
    """A real train reply of ``nbytes`` of float32 zeros, answering message ``answers``."""
    meta = Metadata(
        run_id=1, message_id="", src_node_id=7, dst_node_id=0, reply_to_message_id=answers,
        group_id="", created_at=time.time(), ttl=60.0, message_type="train",
    )  # fmt: skip
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.zeros(nbytes // 4, np.float32))})})
    return make_message(metadata=meta, content=content)


class Runtime:
    """Serves ``replies`` as Flower's SuperLink would: headers and trees, then objects by id."""

    def __init__(self, replies: list[Message]) -> None:
        self.contents: dict[str, bytes] = {}
        self.protos, self.trees = [], []
        for msg in replies:
            self.contents |= {oid: obj.deflate() for oid, obj in get_all_nested_objects(msg).items()}
            proto = message_to_proto(remove_content_from_message(msg))
            proto.metadata.message_id = msg.object_id
            self.protos.append(proto)
            self.trees.append(get_object_tree(msg))
        self.pulled: list[str] = []
        self.confirmed: list[str] = []

    def PullMessages(self, request: Any) -> PullAppMessagesResponse:
        return PullAppMessagesResponse(messages_list=self.protos, message_object_trees=self.trees)

    def PullObject(self, request: Any) -> PullObjectResponse:
        self.pulled.append(request.object_id)
        content = self.contents[request.object_id]
        return PullObjectResponse(object_found=True, object_available=True, object_content=content)

    def ConfirmMessageReceived(self, request: Any) -> None:
        self.confirmed.append(request.message_object_id)


def flower_grid(runtime: Any) -> HttpGrid:
    """Flower's deployment grid, connected to ``runtime`` (a stand-in for the SuperLink's runtime API)."""
    grid = HttpGrid(token="test")
    grid._client = runtime  # type: ignore[assignment]  # connected, to the stand-in
    grid._run = SimpleNamespace(run_id=1)  # type: ignore[assignment]
    return grid


def test_a_reply_past_the_bound_becomes_an_error_reply_and_the_small_one_arrives_whole() -> None:
    small, big = reply(1_000, "sent-1"), reply(12 * 2**20, "sent-2")  # 12 MiB: 3 chunks of <= 5 MiB
    runtime = Runtime([small, big])
    flower = flower_grid(runtime)
    grid = PromptGrid(flower, reply_bound=2**20)
    got = {m.metadata.reply_to_message_id: m for m in grid.pull_messages(["sent-1", "sent-2"])}
    assert not got["sent-1"].has_error()
    arrays = got["sent-1"].content["arrays"]
    assert isinstance(arrays, ArrayRecord) and arrays["w"].numpy().nbytes == 1_000
    assert got["sent-2"].has_error() and STOPPED in str(got["sent-2"].error.reason), got["sent-2"].error
    assert runtime.confirmed == [small.object_id]  # the big one is never confirmed as received
    client = flower._client
    assert isinstance(client, BoundedPulls)
    assert list(client.stopped) == [big.object_id]  # (several of its chunks may pass the bound at once)
    assert 2**20 < client.stopped[big.object_id] <= 2**20 + 4 * 5 * 2**20  # bound + objects in flight


def test_replies_within_the_bound_are_untouched_and_the_wrapper_is_installed_once() -> None:
    replies = [reply(4_000, "a"), reply(8_000, "b")]
    flower = flower_grid(Runtime(replies))
    grid = PromptGrid(flower, reply_bound=10**6)
    assert all(not m.has_error() for m in grid.pull_messages(["a", "b"]))
    first = flower._client
    grid.pull_messages(["a", "b"])
    assert flower._client is first and isinstance(first, BoundedPulls) and first.stopped == {}


def test_a_grid_without_a_runtime_client_is_left_alone() -> None:
    assert bound_pulls(SimpleNamespace(), 100) is False


def test_reply_bound_is_twice_the_largest_trainable_payload_plus_the_slack() -> None:
    cat = toy_catalog({"weak": 1, "medium": 2, "strong": 3})
    largest = max(sum(s.numel * 4 + NPY_HEADER_BYTES for s in v.layout if s.trainable) for v in cat)
    assert reply_bound(cat) == 2 * largest + REPLY_SLACK_BYTES


def test_a_reply_stopped_at_the_bound_is_listed_as_rejected_with_its_node() -> None:
    s = InclusiveFL(catalog=toy_catalog({"weak": 1, "medium": 2, "strong": 3}), beta=0.2)
    s.set_state(constant_state(s.catalog, 0.5))
    cause = f"{STOPPED} of 100 bytes per reply (5242980 bytes pulled); not read further"
    flower = f"Reply message objects are unavailable. Failed to pull object with ID 'ab': {cause}"
    s.aggregate_train(1, [error_reply(sent(s, 21, "weak"), code=3, reason=flower)])
    assert s.report(1).rejected == [f"node 21 (weak) {cause}"] and s.report(1).failed == []
    assert stopped_reason(flower) == cause and stopped_reason("node unavailable") is None


def shared_reply(nbytes: int, answers: str) -> Message:
    """:func:`reply` with one more array, ``shared``, equal in every reply: one object two replies hold."""
    msg = reply(nbytes, answers)
    arrays = msg.content["arrays"]
    assert isinstance(arrays, ArrayRecord)
    arrays["shared"] = Array(np.arange(64, dtype=np.float32))
    return make_message(metadata=msg.metadata, content=msg.content)


def test_an_object_a_stopped_reply_shares_does_not_stop_the_honest_reply_that_holds_it_too() -> None:
    # Objects are content-addressed: the honest reply's "shared" array is the same object as the
    # big reply's.  The big reply, pulled first, passes the bound; the honest one must arrive whole.
    big, honest = shared_reply(12 * 2**20, "sent-big"), shared_reply(1_000, "sent-honest")
    runtime = Runtime([big, honest])
    assert set(get_all_nested_objects(big)) & set(get_all_nested_objects(honest))  # they share objects
    flower = flower_grid(runtime)
    grid = PromptGrid(flower, reply_bound=2**20)
    got = {m.metadata.reply_to_message_id: m for m in grid.pull_messages(["sent-big", "sent-honest"])}
    assert got["sent-big"].has_error() and STOPPED in str(got["sent-big"].error.reason)
    assert not got["sent-honest"].has_error(), got["sent-honest"].error
    client = flower._client
    assert isinstance(client, BoundedPulls) and list(client.stopped) == [big.object_id]


def test_a_pull_the_bound_cannot_count_to_a_reply_of_the_last_answer_is_refused() -> None:
    honest = reply(1_000, "sent-1")
    runtime = Runtime([honest])
    client = BoundedPulls(runtime, bound=10**6)
    request = SimpleNamespace(object_id=honest.object_id)
    with pytest.raises(ObjectPullError, match="no reply to count"):
        client.PullObject(request)  # no PullMessages answer yet
    client.PullMessages(None)
    pull = client.PullObject
    with pytest.raises(ObjectPullError, match="outside reply"):
        pull(SimpleNamespace(object_id="not-in-the-tree"))
    assert pull(request).object_found and runtime.pulled == [honest.object_id]
    with pytest.raises(ObjectPullError, match="no reply to count"):
        client.PullObject(request)  # one read per reply of the answer
