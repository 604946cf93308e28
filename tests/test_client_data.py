"""The ClientApp's local data: each split prepared only when a handler needs it.

In a deployment every message runs in a new ClientApp process, so whatever a handler prepares
and does not use is paid again for every message of every round.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest

import client.app as app
from models.data import load_partition
from models.family import TransformerFamily

TEXT = {"model": "tiny", "method": "inclusivefl", "client-test-fraction": 0.2, "batch-size": 8}


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[int, bool]]]:
    """``(examples, shuffle)`` of every loader the family builds during the test (caches cleared)."""
    app._partition.cache_clear()
    app._loader.cache_clear()
    calls: list[tuple[int, bool]] = []
    real = TransformerFamily.loader

    def spy(self: TransformerFamily, ds: Any, **kwargs: Any) -> Any:
        calls.append((len(ds), bool(kwargs["shuffle"])))
        return real(self, ds, **kwargs)

    monkeypatch.setattr(TransformerFamily, "loader", spy)
    yield calls
    app._partition.cache_clear()
    app._loader.cache_clear()


def node(pid: int = 1, num: int = 6) -> tuple[Any, Any]:
    ctx = SimpleNamespace(run_config=TEXT, node_config={"partition-id": pid, "num-partitions": num})
    return ctx, app.run_config(ctx)  # type: ignore[arg-type]


def test_query_counts_training_examples_without_building_a_loader(built: list[tuple[int, bool]]) -> None:
    ctx, cfg = node()
    train, _ = load_partition(cfg.data_spec(), 1, 6)
    assert app.num_train_examples(ctx, cfg) == len(train) > 0
    assert built == []


def test_each_split_is_built_once_and_only_when_asked(built: list[tuple[int, bool]]) -> None:
    ctx, cfg = node()
    train, test = load_partition(cfg.data_spec(), 1, 6)
    loader = app.test_loader(ctx, cfg)
    assert built == [(len(test), False)]  # evaluate of a text model: the test split only
    assert sum(len(b["labels"]) for b in loader) == len(test)
    assert app.train_loader(ctx, cfg) is app.train_loader(ctx, cfg)
    assert built == [(len(test), False), (len(train), True)]
