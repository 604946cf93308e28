"""Call the ClientApp's handlers in-process with real Flower messages (no SuperNode)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

import client.app as app

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
