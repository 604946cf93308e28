"""Call the ClientApp's handlers in-process with real Flower messages (no SuperNode)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import client.app as app
from experiment.protocol import ARRAYS
from strategies.records import record_nbytes

#: tiny text model, 3 local steps (every tier trains the largest variant)
TEXT = {"model": "tiny", "method": "all-large", "client-test-fraction": 0.2, "batch-size": 8, "local-steps": 3}
#: HeteroFL's conv net at small widths on Fashion-MNIST (static batch norm: sBN at evaluation)
IMAGES = {
    "model": "conv", "method": "heterofl", "dataset": "embedded:fashion_mnist", "num-labels": 10,
    "cnn-widths": "8:16:32:64", "optimizer": "sgd", "lr": 0.05, "batch-size": 16, "local-steps": 3,
    "tier-memory-mb": "auto", "client-test-fraction": 0.2, "eval-batch-size": 256,
}  # fmt: skip


@pytest.fixture
def task_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    """Messages need a run, node and task outside a SuperNode."""
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)


def context(run_config: Mapping[str, object], pid: int = 1, num: int = 30) -> Context:
    return Context(
        run_id=1,
        node_id=7,
        node_config={"partition-id": pid, "num-partitions": num},
        state=RecordDict(),
        run_config=dict(run_config),  # type: ignore[arg-type]
    )


def call(kind: str, run_config: Mapping[str, object], seed: int = 0) -> RecordDict:
    """Send the largest variant's initial weights (``seed``) to the ``kind`` handler; return its reply."""
    ctx = context(run_config)
    cfg = app.run_config(ctx)
    variant = cfg.catalog.largest
    state = cfg.family().initial_states(cfg.catalog, seed=seed)[variant.name]
    msg = Message(
        RecordDict(
            {"arrays": ArrayRecord(state), "config": ConfigRecord({"variant": variant.name, "server-round": 1})}
        ),
        dst_node_id=7,
        message_type=kind,
    )
    handler = app.train if kind == "train" else app.evaluate
    return handler(msg, ctx).content


def arrays(reply: RecordDict) -> dict[str, np.ndarray]:
    return {k: a.numpy() for k, a in reply["arrays"].items()}  # type: ignore[union-attr]


def metric(reply: RecordDict, key: str) -> float:
    """One number of a reply's ``metrics`` record."""
    value = reply["metrics"][key]  # type: ignore[index]
    assert isinstance(value, int | float), (key, value)
    return float(value)


def delivered(msg: Message) -> Message:
    """What a node receives: a copy of ``msg`` (what the ClientApp changes never reaches the sender's message)."""
    content = RecordDict()
    for key, record in msg.content.items():
        if isinstance(record, ArrayRecord):
            content[key] = ArrayRecord(dict(record.items()))
        elif isinstance(record, ConfigRecord):
            content[key] = ConfigRecord(dict(record.items()))
        else:
            raise TypeError(f"unexpected record {key!r}: {type(record).__name__}")
    got = Message(content, dst_node_id=msg.metadata.dst_node_id, message_type=msg.metadata.message_type)
    got.metadata.__dict__["_message_id"] = msg.metadata.message_id
    return got


class LoopGrid:
    """Nodes ``1..n`` served by the real ClientApp (mods included) in-process; counts array bytes pushed."""

    def __init__(self, run_config: Mapping[str, object], nodes: int) -> None:
        self.run_config, self.nodes = dict(run_config), nodes
        self.replies: dict[str, Message] = {}
        self.pushed_bytes: list[int] = []
        self.pushed_names: list[list[str]] = []  # array names of each train / evaluate message pushed
        self.reply_names: list[list[str]] = []  # array names of each train reply as the node sent it

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.nodes + 1))

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        ids = []
        for msg in messages:
            msg_id = msg.object_id
            msg.metadata.__dict__["_message_id"] = msg_id  # what pushing a message sets
            arrays = msg.content.get(ARRAYS)
            if msg.metadata.message_type in ("train", "evaluate"):  # not the strategy's profile queries
                self.pushed_bytes.append(record_nbytes(arrays) if isinstance(arrays, ArrayRecord) else 0)
                self.pushed_names.append(list(arrays) if isinstance(arrays, ArrayRecord) else [])
            ctx = context(self.run_config, pid=msg.metadata.dst_node_id - 1, num=self.nodes)
            self.replies[msg_id] = app.app(delivered(msg), ctx)
            sent = self.replies[msg_id].content.get(ARRAYS) if not self.replies[msg_id].has_error() else None
            if msg.metadata.message_type == "train" and isinstance(sent, ArrayRecord):
                self.reply_names.append(list(sent))
            ids.append(msg_id)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]
