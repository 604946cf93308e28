"""A round's held replies are folded in their senders' order, so a seed's run is bit-reproducible.

Float32 sums are not associative: with replies of 1e8, 1 and -1e8 (equal weights) the mean is 0
folded in that order and 1/3 with the last two swapped.  Simulation answers in whatever order the
ClientApps finish; folded as they arrive, two runs of one seed drift apart from the first round
in which the order differs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message

import strategies.base
from experiment.config import RunConfig
from server.app import build_strategy
from strategies.baselines import LocalTraining
from strategies.grid import PromptGrid
from strategies.inclusivefl import InclusiveFL
from strategies.profiles import NodeProfile
from strategies.replies import in_node_order
from tests.flower_runs import tiny_budgets
from tests.handlers import LoopGrid, task_identity  # noqa: F401  (fixture)
from tests.toy import constant_state, error_reply, evaluate_reply, reply, sent, toy_catalog

DEPTHS = {"weak": 1, "medium": 2, "strong": 3}
#: node id -> (node-key, the value of every weight it returns); ids run against the keys' order
NODES = {30: ("partition-0", 1e8), 20: ("partition-1", 1.0), 10: ("partition-2", -1e8)}


def _strategy_and_replies() -> tuple[InclusiveFL, list[Message]]:
    cat = toy_catalog(DEPTHS)
    s = InclusiveFL(catalog=cat, beta=0.2)
    s.set_state(constant_state(cat, 0.5))
    out = []
    for node, (key, value) in NODES.items():
        s.profiles[node] = NodeProfile(node, "strong", 1.0, 10, True, "strong", "", key=key)
        arrays = {k: np.full(tuple(t.shape), value, np.float32) for k, t in s.state["strong"].items()}
        out.append(reply(sent(s, node, "strong"), arrays, num_examples=10))
    return s, out


def _state_after(order: Sequence[int], *, held: bool) -> dict[str, torch.Tensor]:
    s, replies = _strategy_and_replies()
    arriving = [replies[i] for i in order]
    s.aggregate_train(1, arriving if held else (r for r in arriving))
    return {k: t.clone() for k, t in s.state["strong"].items()}


def test_held_replies_give_the_same_model_in_any_arrival_order() -> None:
    orders = [(0, 1, 2), (0, 2, 1), (2, 1, 0), (1, 0, 2)]
    first = _state_after(orders[0], held=True)
    for order in orders[1:]:
        again = _state_after(order, held=True)
        assert all(torch.equal(first[k], again[k]) for k in first), order


def test_the_arrival_order_matters_where_replies_are_folded_as_they_stream() -> None:
    # the check above is not vacuous: a lazy stream is folded as it comes, and these two orders differ
    in_key_order = _state_after((0, 1, 2), held=False)
    swapped = _state_after((0, 2, 1), held=False)
    assert any(not torch.equal(in_key_order[k], swapped[k]) for k in in_key_order)
    # the held replies are folded in node-key order (partition-0, -1, -2), not by node id
    assert all(torch.equal(in_key_order[k], v) for k, v in _state_after((2, 1, 0), held=True).items())


def test_replies_sort_by_sender_place_then_message_id_and_a_stream_passes_through() -> None:
    s, replies = _strategy_and_replies()
    ordered = in_node_order(list(reversed(replies)), s.node_order)
    assert [r.metadata.src_node_id for r in ordered] == [30, 20, 10]
    stream = iter(replies)
    assert in_node_order(stream, s.node_order) is stream
    assert s.node_order(99) == (0, (), 99)  # a node without a profile: among the keyless, by id


def test_kept_node_models_are_evaluated_in_node_key_order_whatever_order_they_were_kept_in() -> None:
    # each model draws the next static-BN batches of the server's evaluation: the order is part of the result
    cat = toy_catalog(DEPTHS)
    s = LocalTraining(catalog=cat)
    s.set_state(constant_state(cat, 0.5))
    for node, (key, _) in NODES.items():
        s.profiles[node] = NodeProfile(node, "strong", 1.0, 10, True, "strong", "", key=key)
    for node in (10, 30, 20):
        s.keep_node_model(sent(s, node, "strong"), {k: torch.full_like(t, node) for k, t in s.state["strong"].items()})
    models = s.models_for_evaluation()["strong"]
    assert [float(next(iter(m.values())).flatten()[0]) for m in models] == [30.0, 20.0, 10.0]


def _evaluate_reply(s: InclusiveFL, node: int, accuracy: float) -> Message:
    rec = sent(s, node, "strong")
    s._sent_eval[rec.message.metadata.message_id] = rec
    return evaluate_reply(rec, accuracy=accuracy, loss=accuracy)


def test_federated_evaluation_means_do_not_depend_on_the_arrival_order() -> None:
    # float64 sums of 0.1, 0.2, 0.3: 0.6000000000000001 one way round, 0.6 the other
    results = []
    for order in ((0, 1, 2), (2, 1, 0)):
        s, _ = _strategy_and_replies()
        replies = [_evaluate_reply(s, node, acc) for node, acc in ((30, 0.1), (20, 0.2), (10, 0.3))]
        out = s.aggregate_evaluate(1, [replies[i] for i in order])
        assert out is not None
        results.append(out["strong/fed-accuracy"])
    assert results[0] == results[1] == (0.1 + 0.2 + 0.3) / 3


def test_keyed_keyless_and_unknown_senders_sort_without_error() -> None:
    s, replies = _strategy_and_replies()
    s.profiles[5] = NodeProfile(5, "strong", 1.0, 10, True, "strong", "")  # no node-key: by id, before keyed ones
    keyless = reply(sent(s, 5, "strong"), {}, num_examples=10)
    superlink_error = error_reply(sent(s, 40, "strong"), src_node_id=1)  # from node 1, which has no profile
    ordered = in_node_order([*replies, keyless, superlink_error], s.node_order)
    assert [r.metadata.src_node_id for r in ordered] == [1, 5, 30, 20, 10]


class ArrivalOrderGrid(LoopGrid):
    """The real ClientApp in-process; replies arrive by node id, ascending or descending."""

    def __init__(self, run_config: dict[str, object], nodes: int, *, descending: bool) -> None:
        super().__init__(run_config, nodes)
        self.descending = descending

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        got = super().pull_messages(message_ids)
        return sorted(got, key=lambda m: m.metadata.src_node_id, reverse=self.descending)


def _two_rounds(*, descending: bool) -> dict[str, torch.Tensor]:
    """Two rounds of ``all-large`` on 4 in-process nodes (one group of 4 replies): the final model."""
    run = {"model": "tiny", "method": "all-large", "tier-memory-mb": tiny_budgets(), "local-steps": 1}
    cfg = RunConfig.model_validate(run)
    strategy = build_strategy(cfg)
    init = cfg.family().initial_states(cfg.catalog, seed=0)
    arrays = strategy.set_state({v.name: init[v.name] for v in cfg.training_catalog})
    grid = PromptGrid(ArrivalOrderGrid(run, nodes=4, descending=descending), poll_interval=0.0)  # type: ignore[arg-type]
    for rnd in (1, 2):
        msgs = list(strategy.configure_train(rnd, arrays, ConfigRecord(), grid))  # type: ignore[arg-type]
        result = strategy.aggregate_train(rnd, list(grid.send_and_receive(msgs)))
        assert result[0] is not None
        arrays = result[0]
    return {k: t.clone() for k, t in strategy.state["strong"].items()}


@pytest.mark.usefixtures("task_identity")
def test_real_clients_replies_in_either_arrival_order_give_a_bit_identical_model(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ascending, descending = _two_rounds(descending=False), _two_rounds(descending=True)
    assert all(torch.equal(ascending[k], descending[k]) for k in ascending)
    # and the arrival order does reach the model where replies are folded as they come
    monkeypatch.setattr(strategies.base, "in_node_order", lambda replies, order: replies)
    unsorted = _two_rounds(descending=True)
    assert any(not torch.equal(ascending[k], unsorted[k]) for k in ascending)
