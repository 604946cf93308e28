"""The SuperLink's SQLite busy timeout (server/superlink.py) and the retried unstored pushes (experiment/retry.py)."""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import flwr.supercore.sql_mixin as sql_mixin
import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, Message, Metadata, RecordDict
from flwr.app.message import make_message
from flwr.proto.message_pb2 import PushObjectResponse
from flwr.proto.runtime_pb2 import PushAppMessagesResponse
from flwr.supercore.constant import SQLITE_PRAGMAS
from flwr.supercore.inflatable.inflatable_utils import ObjectPushError
from flwr.supercore.object_store.sql_object_store import SqlObjectStore
from sqlalchemy import text
from sqlalchemy.exc import OperationalError

from client.supernode import RetriedPush, retry_unstored_pushes
from deploy.cluster import superlink_command
from experiment.retry import PUSH_RETRY_WAITS_S, retry_until
from server.superlink import BUSY_ENV, BUSY_TIMEOUT_MS, busy_timeout_ms, raise_busy_timeout, with_busy_timeout
from strategies.grid import PromptGrid
from strategies.pull_bound import BoundedPulls, bound_pulls
from strategies.runtime_client import RetriedPushes, has_wrapper, retry_pushes
from tests.test_pull_bound import flower_grid


def test_the_busy_timeout_is_replaced_in_place_and_added_first_when_missing() -> None:
    assert SQLITE_PRAGMAS[0] == ("busy_timeout", "5000")  # Flower 1.39's, which server.superlink raises
    raised = with_busy_timeout(SQLITE_PRAGMAS, 60_000)
    assert raised == (("busy_timeout", "60000"), *SQLITE_PRAGMAS[1:])
    assert with_busy_timeout((("journal_mode", "WAL"),), 7) == (("busy_timeout", "7"), ("journal_mode", "WAL"))


def test_the_busy_timeout_comes_from_the_environment_or_is_refused_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(BUSY_ENV, raising=False)
    assert busy_timeout_ms() == BUSY_TIMEOUT_MS == 60_000
    monkeypatch.setenv(BUSY_ENV, " 120000 ")
    assert busy_timeout_ms() == 120_000
    for bad in ("0", "-5", "1.5", "soon"):
        monkeypatch.setenv(BUSY_ENV, bad)
        with pytest.raises(ValueError, match=BUSY_ENV):
            busy_timeout_ms()


def _write_while_locked(database: Path, hold_s: float, busy_ms: int) -> float:
    """A write of Flower's SQL object store while another connection holds the write lock for ``hold_s``.

    The store's connections must wait ``busy_ms`` for a lock (checked before the lock is taken).
    """
    store = SqlObjectStore(str(database))
    store.initialize()
    with store.session() as session:
        assert session.execute(text("PRAGMA busy_timeout")).scalar() == busy_ms
    holder = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
    holder.execute("BEGIN IMMEDIATE")  # the write lock, as a long write of another request holds it
    release = threading.Timer(hold_s, lambda: holder.execute("COMMIT"))
    release.start()
    started = time.monotonic()
    try:
        store.clear()  # a write: waits for the lock at most the busy timeout
        return time.monotonic() - started
    finally:
        release.join()
        holder.close()


def test_a_flower_sql_store_waits_for_a_held_lock_only_within_its_busy_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failure of a loaded SuperLink and its fix, on Flower's own SQL store and SQLite file."""
    monkeypatch.setattr(sql_mixin, "SQLITE_PRAGMAS", with_busy_timeout(SQLITE_PRAGMAS, 200))
    with pytest.raises(OperationalError, match="database is locked"):
        _write_while_locked(tmp_path / "short.db", hold_s=1.0, busy_ms=200)
    monkeypatch.setattr(sql_mixin, "SQLITE_PRAGMAS", SQLITE_PRAGMAS)
    raise_busy_timeout(5_000)  # what python -m server.superlink does before Flower's SuperLink starts
    waited = _write_while_locked(tmp_path / "long.db", hold_s=1.0, busy_ms=5_000)
    assert 0.9 <= waited < 5.0, waited


def test_the_launchers_start_the_superlink_through_server_superlink() -> None:
    cmd = superlink_command(fleet_address="127.0.0.1:1", host="127.0.0.1", port=2, database=None)
    assert cmd[1:3] == ["-m", "server.superlink"] and "--insecure" in cmd


def test_retry_until_waits_between_attempts_and_answers_the_last_one() -> None:
    answers, slept = iter([False, False, True]), list[float]()
    assert retry_until(lambda: next(answers), "x", (1.0, 2.0, 4.0), slept.append) is True
    assert slept == [1.0, 2.0]
    slept.clear()
    calls: list[int] = []

    def fails() -> bool:
        calls.append(1)
        return False

    assert retry_until(fails, "x", (1.0, 2.0), slept.append) is False
    assert len(calls) == 3 and slept == [1.0, 2.0]
    assert sum(PUSH_RETRY_WAITS_S) == 15.0


class PushRuntime:
    """The SuperLink's runtime API for pushes: objects ``unstored`` are answered ``stored=False`` that many times."""

    def __init__(self, unstored: dict[str, int] | None = None) -> None:
        self.unstored = dict(unstored or {})
        self.pushes: list[str] = []
        self.objects: list[str] = []

    def PushMessages(self, request: Any) -> PushAppMessagesResponse:
        ids = [m.metadata.message_id for m in request.messages_list]
        needed = [node.object_id for tree in request.message_object_trees for node in _nodes(tree)]
        self.objects = needed
        return PushAppMessagesResponse(message_ids=ids, objects_to_push=needed, session_id="s")

    def PushObject(self, request: Any) -> PushObjectResponse:
        self.pushes.append(request.object_id)
        if self.unstored.get(request.object_id, 0) > 0:
            self.unstored[request.object_id] -= 1
            return PushObjectResponse(stored=False)
        return PushObjectResponse(stored=True)


def _nodes(tree: Any) -> list[Any]:
    return [tree, *(n for child in tree.children for n in _nodes(child))]


def _message() -> Message:
    """A real train message of the ServerApp to node 5 (fixed creation time: equal calls, equal objects)."""
    meta = Metadata(
        run_id=1, message_id="", src_node_id=0, dst_node_id=5, reply_to_message_id="",
        group_id="1", created_at=1.0, ttl=60.0, message_type="train",
    )  # fmt: skip
    content = RecordDict({"arrays": ArrayRecord({"w": Array(np.arange(6, dtype=np.float32))})})
    return make_message(metadata=meta, content=content)


def test_the_serverapp_pushes_an_unstored_object_again_where_flower_alone_ends_the_run() -> None:
    msg = _message()
    probe = PushRuntime()
    flower_grid(probe).push_messages([_message()])
    first = probe.objects[-1]  # a leaf object (an array chunk) of the message
    with pytest.raises(ObjectPushError):  # Flower's grid: the run would end (exit 201)
        flower_grid(PushRuntime({first: 1})).push_messages([_message()])
    runtime = PushRuntime({first: 1})
    flower = flower_grid(runtime)
    ids = list(PromptGrid(flower).push_messages([msg]))
    assert ids == [msg.object_id]
    assert runtime.pushes.count(first) == 2 and runtime.unstored[first] == 0
    assert isinstance(flower._client, RetriedPushes)


def test_an_object_never_stored_is_answered_as_flower_would_after_the_retries() -> None:
    runtime, slept = PushRuntime({"o": 99}), list[float]()
    client = RetriedPushes(runtime, sleep=slept.append)
    answer = client.PushObject(SimpleNamespace(object_id="o"))
    assert answer.stored is False and runtime.pushes == ["o"] * 5 and slept == list(PUSH_RETRY_WAITS_S)
    assert client.PushMessages == runtime.PushMessages  # everything else is the wrapped client's


def test_the_push_retry_and_the_pull_bound_wrap_the_runtime_client_once_each_in_either_order() -> None:
    for first, second in ((retry_pushes, bound_pulls), (bound_pulls, retry_pushes)):
        raw = PushRuntime()
        grid = flower_grid(raw)
        for step in (first, second, first, second):
            assert (bound_pulls(grid, 100) if step is bound_pulls else retry_pushes(grid)) is True
        client: Any = grid._client
        assert has_wrapper(client, RetriedPushes) and has_wrapper(client, BoundedPulls)
        assert client.client.client is raw  # two wrappers, no more
    assert retry_pushes(SimpleNamespace()) is False  # the simulation's grid is left alone


def test_the_supernode_pushes_an_unstored_reply_object_again_and_fails_as_flower_after_the_retries() -> None:
    calls: list[tuple[int, str, str, bytes]] = []
    slept: list[float] = []

    def push(run_id: int, session_id: str, object_id: str, contents: bytes) -> None:
        calls.append((run_id, session_id, object_id, contents))
        if len(calls) < 3:
            raise ObjectPushError(object_id, run_id, session_id)

    RetriedPush(push, sleep=slept.append)(1, "s", "o", b"x")
    assert calls == [(1, "s", "o", b"x")] * 3 and slept == [1.0, 2.0]

    def never(run_id: int, session_id: str, object_id: str, contents: bytes) -> None:
        raise ObjectPushError(object_id, run_id, session_id)

    with pytest.raises(ObjectPushError, match="'o'"):
        RetriedPush(never, sleep=lambda _s: None)(1, "s", "o", b"x")


def test_the_supernodes_reply_push_gets_the_retried_push_object() -> None:
    seen: dict[str, Any] = {}

    def _push_messages(*, state: Any, object_store: Any, send: Any, push_object: Any) -> None:
        seen.update(state=state, push_object=push_object)

    module = SimpleNamespace(_push_messages=_push_messages)
    retry_unstored_pushes(module)
    raw = object()
    module._push_messages(state="st", object_store=None, send=None, push_object=raw)
    assert seen["state"] == "st" and isinstance(seen["push_object"], RetriedPush) and seen["push_object"].push is raw
