"""Baselines: Local keeps one model per node; one-variant InclusiveFL is plain FedAdam."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from experiment.config import RunConfig
from server.app import build_strategy
from strategies.baselines import LocalTraining
from strategies.fedadam import FedAdamConfig, FedAdamState, fedadam_step
from strategies.grid import PromptGrid
from strategies.inclusivefl import InclusiveFL
from tests.flower_runs import tiny_budgets
from tests.handlers import LoopGrid, task_identity
from tests.toy import constant_state, reply, sent, toy_catalog, trained

__all__ = ["task_identity"]  # a fixture

DEPTHS = {"weak": 1, "strong": 3}


def test_local_training_keeps_each_nodes_own_model_and_averages_nothing() -> None:
    cat = toy_catalog(DEPTHS)
    s = LocalTraining(catalog=cat)
    s.set_state(constant_state(cat, 0.0))
    r1 = [
        reply(sent(s, 1, "weak"), trained(s.state["weak"], 1.0)),
        reply(sent(s, 2, "weak"), trained(s.state["weak"], 3.0)),
        reply(sent(s, 3, "strong"), trained(s.state["strong"], 5.0)),
    ]
    s.aggregate_train(1, r1)
    assert torch.equal(s.variant_payload(1, "weak")["classifier.weight"], torch.full((2,), 1.0))
    assert torch.equal(s.variant_payload(2, "weak")["classifier.weight"], torch.full((2,), 3.0))
    assert torch.equal(s.variant_payload(3, "strong")["bert.encoder.layer.2.w"], torch.full((2,), 5.0))
    # the per-variant global state is untouched, a new node starts from it
    assert torch.equal(s.variant_payload(9, "weak")["classifier.weight"], torch.zeros(2))
    # round 2 continues from each node's own model
    s.aggregate_train(2, [reply(sent(s, 1, "weak"), trained(s.variant_payload(1, "weak"), 1.0), server_round=2)])
    assert torch.equal(s.variant_payload(1, "weak")["classifier.weight"], torch.full((2,), 2.0))
    models = s.models_for_evaluation()
    assert len(models["weak"]) == 2 and len(models["strong"]) == 1


def test_one_variant_inclusivefl_is_fedadam_on_the_weighted_mean() -> None:
    cat = toy_catalog({"strong": 3})
    cfg = FedAdamConfig(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)
    s = InclusiveFL(catalog=cat, beta=0.5, adam=cfg)
    s.set_state(constant_state(cat, 1.0))
    start = {k: v.clone() for k, v in s.state["strong"].items()}
    s.aggregate_train(
        1,
        [
            reply(sent(s, 1, "strong"), trained(start, 0.3), num_examples=1),
            reply(sent(s, 2, "strong"), trained(start, 0.6), num_examples=2),
        ],
    )
    mean_delta = {k: torch.full((2,), 0.5) for k in start}  # (0.3 * 1 + 0.6 * 2) / 3
    expected = fedadam_step(start, mean_delta, FedAdamState(), cfg)
    for k, v in expected.items():
        assert torch.allclose(s.state["strong"][k], v, atol=1e-6), k


@pytest.mark.parametrize(
    ("method", "expected_clients"),
    [
        ("all-large", {"strong": 6}),  # memory ignored: everyone trains the largest
        ("exclusive", {"strong": 2}),  # only the nodes that fit the largest take part
        ("all-small", {"weak": 6}),  # everyone fits the smallest
    ],
)
def test_baselines_assign_variants_as_the_paper_defines(
    task_identity: None, method: str, expected_clients: dict[str, int]
) -> None:
    """The server's offer and the real ClientApp's answers (in-process, 6 nodes at 1:1:1 of the tiny budgets).

    ``local`` (every tier its own variant) runs as a Ray simulation in tests/test_simulation.py.
    """
    run = {"model": "tiny", "method": method, "tier-memory-mb": tiny_budgets()}
    strategy = build_strategy(RunConfig.model_validate(run))
    grid = PromptGrid(LoopGrid(run, nodes=6), poll_interval=0.0)  # type: ignore[arg-type]
    nodes = strategy.eligible_nodes(grid)
    chosen = Counter(strategy.profiles[n].variant for n in nodes)
    assert dict(chosen) == expected_clients
