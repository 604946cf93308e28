"""A run whose every node declines stops in round 1 naming the nodes' reasons and the keys (issue 23 item 2)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import pytest
from flwr.app import ConfigRecord, Message

import client.app as app
from deploy.flower import failure_reason
from experiment.config import RunConfig
from server.app import build_strategy
from strategies.base import HeterogeneousStrategy
from strategies.handshake import NothingToTrain, nothing_to_train_message
from tests.handlers import context, task_identity  # noqa: F401  (fixture)


class QueryGrid:
    """Nodes ``1..n`` answered by the real ClientApp ``query`` handler in-process (node ``i``: partition ``i - 1``)."""

    def __init__(self, run_config: Mapping[str, object], nodes: int) -> None:
        self.run_config = dict(run_config)
        self.nodes = nodes

    def get_node_ids(self) -> list[int]:
        return list(range(1, self.nodes + 1))

    def send_and_receive(self, messages: Iterable[Message], timeout: float | None = None) -> list[Message]:
        replies = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id  # what pushing a message sets
            ctx = context(self.run_config, pid=msg.metadata.dst_node_id - 1, num=self.nodes)
            replies.append(app.query(msg, ctx))
        return replies


def _first_round(run_config: Mapping[str, object], nodes: int = 3) -> list[Message]:
    return _round_one(run_config, nodes)[1]


def _round_one(run_config: Mapping[str, object], nodes: int = 3) -> tuple[HeterogeneousStrategy, list[Message]]:
    cfg = RunConfig.model_validate(run_config)
    strategy = build_strategy(cfg)
    init = cfg.family().initial_states(cfg.catalog, seed=0)
    arrays = strategy.set_state({v.name: init[v.name] for v in cfg.training_catalog})
    grid = QueryGrid(run_config, nodes)
    return strategy, list(strategy.configure_train(1, arrays, ConfigRecord(), grid))  # type: ignore[arg-type]


@pytest.mark.usefixtures("task_identity")
def test_budgets_no_variant_fits_stop_round_one_naming_the_keys() -> None:
    with pytest.raises(NothingToTrain) as err:
        _first_round({"model": "tiny", "tier-memory-mb": "100:120:140"})
    msg = str(err.value)
    assert msg.startswith("nothing to train in round 1: all 3 connected nodes declined (1 x tier ")
    assert "1 x tier weak: memory budget 100 MiB is below" in msg
    assert "'tier-memory-mb'" in msg and "'runtime-overhead-mb'" in msg and "'memory-mb'" in msg


@pytest.mark.usefixtures("task_identity")
def test_budgets_that_fit_train_every_node() -> None:
    strategy, sent = _round_one({"model": "tiny", "tier-memory-mb": "auto"})
    assert sorted(m.metadata.dst_node_id for m in sent) == [1, 2, 3]
    assert strategy.plan_warnings == []


@pytest.mark.usefixtures("task_identity")
def test_a_variant_no_node_chose_is_warned_about_for_the_verdict() -> None:
    """``model='tiny'`` with the default budgets: every node fits the strong variant, weak and medium never train."""
    strategy, sent = _round_one({"model": "tiny"})
    assert len(sent) == 3
    assert [w.split(":")[0] for w in strategy.plan_warnings] == [
        "variant 'weak' trains on no node",
        "variant 'medium' trains on no node",
    ]
    assert "the 3 nodes so far chose (strong: 3)" in strategy.plan_warnings[0]


def test_message_groups_equal_reasons_and_names_data_keys() -> None:
    msg = nothing_to_train_message(4, [("iot", "no local data: empty"), ("iot", "no local data: empty")])
    assert msg == (
        "nothing to train in round 4: all 2 connected nodes declined (2 x tier iot: no local data: empty); "
        "check the data keys the reason names ('dataset', 'partitioner', 'dirichlet-alpha')"
    )


def test_the_launcher_finds_the_typed_error_in_flowers_traceback() -> None:
    log = (
        "INFO :      configure_train: 0 nodes sampled\n"
        "ERROR :     ServerApp raised an exception\n"
        "Traceback (most recent call last):\n"
        '  File "strategies/handshake.py", line 60, in check_someone_can_train\n'
        "strategies.handshake.NothingToTrain: nothing to train in round 1: all 3 connected nodes declined (...)\n"
    )
    assert failure_reason(log) == "NothingToTrain: nothing to train in round 1: all 3 connected nodes declined (...)"
    assert failure_reason("experiment.config.ConfigError: run config 'method': 'x' is not") == (
        "ConfigError: run config 'method': 'x' is not"
    )
    assert failure_reason("all went well") is None
