"""Exact-value tests of the InclusiveFL math on tiny tensors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord
from flwr.serverapp.strategy import FedAdam

from strategies.fedadam import FedAdamConfig, FedAdamState, fedadam_step
from strategies.inclusivefl import (
    SHARED_ADAM,
    InclusiveFL,
    blend_last_layer,
    heterogeneous_average,
    inclusivefl_round,
    layer_momentum,
    shared_adam_round,
    split_layer_key,
    tier_shared_names,
)
from tests.toy import constant_state, reply, sent, toy_catalog

DEPTHS = {"a": 2, "b": 3, "c": 4}
L = "bert.encoder.layer.{}.w"  # 0-based HF index


def t(*xs: float) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.float32)


def test_split_layer_key() -> None:
    assert split_layer_key("bert.encoder.layer.3.attention.self.query.weight") == (4, "attention.self.query.weight")
    assert split_layer_key("classifier.weight") is None


def test_shared_sets_follow_the_paper() -> None:
    shared = tier_shared_names(toy_catalog(DEPTHS))
    assert shared["a"] == {"bert.embeddings.e", L.format(0)}
    assert shared["b"] == {"bert.embeddings.e", L.format(0), L.format(1)}
    assert shared["c"] == {"bert.embeddings.e", L.format(0), L.format(1), L.format(2)}


def test_heterogeneous_average_weights_by_sampled_clients_per_tier() -> None:
    cat = toy_catalog(DEPTHS)
    states = {v: {k: x.clone() for k, x in p.items()} for v, p in constant_state(cat).items()}
    for v, val in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        for k in states[v]:
            states[v][k] = torch.full((2,), val)
    states["a"][L.format(1)] = torch.full((2,), 10.0)  # a's isolated last layer
    states["b"][L.format(1)] = torch.full((2,), 20.0)
    states["c"][L.format(1)] = torch.full((2,), 30.0)
    out = heterogeneous_average(states, tier_shared_names(cat), {"a": 1, "b": 2, "c": 3})
    # embeddings and layer 1: all tiers, weights 1:2:3
    for v in "abc":
        assert torch.allclose(out[v]["bert.embeddings.e"], torch.full((2,), 14 / 6))
        assert torch.allclose(out[v][L.format(0)], torch.full((2,), 14 / 6))
    # layer 2 is a's isolated layer: averaged over b and c only (2:3), a untouched
    assert torch.equal(out["a"][L.format(1)], torch.full((2,), 10.0))
    assert torch.allclose(out["b"][L.format(1)], torch.full((2,), (2 * 20 + 3 * 30) / 5))
    assert torch.allclose(out["c"][L.format(1)], torch.full((2,), (2 * 20 + 3 * 30) / 5))
    # layer 3: shared by c only, b's isolated layer stays
    assert torch.equal(out["c"][L.format(2)], torch.full((2,), 3.0))
    assert torch.equal(out["b"][L.format(2)], torch.full((2,), 2.0))
    # isolated last layers and heads untouched
    assert torch.equal(out["c"][L.format(3)], torch.full((2,), 3.0))
    for v, val in (("a", 1.0), ("b", 2.0), ("c", 3.0)):
        assert torch.equal(out[v]["classifier.weight"], torch.full((2,), val))


def test_heterogeneous_average_ignores_tiers_without_clients() -> None:
    cat = toy_catalog(DEPTHS)
    states = constant_state(cat)
    states["a"] = {k: torch.full((2,), 5.0) for k in states["a"]}
    out = heterogeneous_average(states, tier_shared_names(cat), {"a": 4, "b": 0, "c": 0})
    # only a trained: its shared layers are copied to b and c
    assert torch.equal(out["c"][L.format(0)], torch.full((2,), 5.0))
    # layer 2 is shared by b and c, neither trained: unchanged
    assert torch.equal(out["c"][L.format(1)], torch.zeros(2))


def test_blend_last_layer_formula_and_range() -> None:
    delta = {L.format(0): t(1, 1), L.format(1): t(2, 4), "classifier.weight": t(7, 7)}
    m = {"w": t(10, 20)}
    out = blend_last_layer(delta, m, depth=2, beta=0.25)
    assert torch.allclose(out[L.format(1)], 0.25 * t(10, 20) + 0.75 * t(2, 4))
    assert torch.equal(out[L.format(0)], t(1, 1))
    assert torch.equal(out["classifier.weight"], t(7, 7))
    # m_0 = 0: the last layer's update shrinks by (1 - beta)
    assert torch.allclose(blend_last_layer(delta, None, depth=2, beta=0.25)[L.format(1)], 0.75 * t(2, 4))
    assert blend_last_layer(delta, m, depth=2, beta=0.0) == delta


def test_layer_momentum_is_the_mean_over_its_layer_range() -> None:
    delta = {L.format(i): t(float(i), 2.0 * i) for i in range(4)}
    delta["classifier.weight"] = t(100, 100)
    m = layer_momentum(delta, 3, 4)  # 1-based layers 3..4 = HF 2..3
    assert set(m) == {"w"}
    assert torch.allclose(m["w"], t(2.5, 5.0))
    with pytest.raises(ValueError):
        layer_momentum({L.format(2): t(1, 1)}, 3, 4)


def _round(beta: float, momenta: dict, counts: dict | None = None):
    cat = toy_catalog(DEPTHS)
    states = constant_state(cat, 1.0)
    deltas = {
        v: {k: torch.full((2,), 0.1 * (i + 1)) + 0.01 * j for j, k in enumerate(states[v])} for i, v in enumerate("abc")
    }
    adam = {v: FedAdamState() for v in "abc"}
    cfg = FedAdamConfig(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)
    out = inclusivefl_round(
        states=states,
        deltas=deltas,
        counts=counts or {"a": 1, "b": 1, "c": 1},
        depths=list(DEPTHS.items()),
        shared=tier_shared_names(cat),
        momenta=momenta,
        adam=adam,
        adam_cfg=cfg,
        beta=beta,
    )
    return cat, states, deltas, adam, cfg, out


def test_beta_zero_equals_per_tier_fedadam_then_layerwise_average() -> None:
    cat, states, deltas, _, cfg, (new, momenta) = _round(0.0, {"b": {"w": t(9, 9)}, "c": {"w": t(9, 9)}})
    expected = {v: fedadam_step(states[v], deltas[v], FedAdamState(), cfg) for v in "abc"}
    expected = heterogeneous_average(expected, tier_shared_names(cat), {"a": 1, "b": 1, "c": 1})
    for v in "abc":
        for k in expected[v]:
            assert torch.equal(new[v][k], expected[v][k])
    # momenta of b (layers 2..3) and c (layers 3..4) from the raw updates
    assert torch.allclose(momenta["b"]["w"], (deltas["b"][L.format(1)] + deltas["b"][L.format(2)]) / 2)
    assert torch.allclose(momenta["c"]["w"], (deltas["c"][L.format(2)] + deltas["c"][L.format(3)]) / 2)
    assert "a" not in momenta


def test_momentum_distillation_uses_previous_momentum_of_next_larger_tier() -> None:
    prev = {"b": {"w": t(1.0, -1.0)}, "c": {"w": t(2.0, 2.0)}}
    cat, states, deltas, _, cfg, (new, momenta) = _round(0.5, prev)
    ga = dict(deltas["a"])
    ga[L.format(1)] = 0.5 * prev["b"]["w"] + 0.5 * deltas["a"][L.format(1)]
    gb = dict(deltas["b"])
    gb[L.format(2)] = 0.5 * prev["c"]["w"] + 0.5 * deltas["b"][L.format(2)]
    exp = {
        "a": fedadam_step(states["a"], ga, FedAdamState(), cfg),
        "b": fedadam_step(states["b"], gb, FedAdamState(), cfg),
        "c": fedadam_step(states["c"], deltas["c"], FedAdamState(), cfg),
    }
    exp = heterogeneous_average(exp, tier_shared_names(cat), {"a": 1, "b": 1, "c": 1})
    for v in "abc":
        for k in exp[v]:
            assert torch.allclose(new[v][k], exp[v][k], atol=0, rtol=0)
    # b's new momentum is built from its *blended* update
    assert torch.allclose(momenta["b"]["w"], (gb[L.format(1)] + gb[L.format(2)]) / 2)


def test_momentum_distillation_changes_only_the_smaller_tiers_isolated_top_layers_within_a_round() -> None:
    """MD blends the top encoder layer of every tier but the strongest, and those layers are isolated.

    So within a round the strongest tier's (the global) model and every shared tensor are the same
    with and without MD; MD reaches the global model only through the next rounds' client updates
    (the diagnosis of C3 in docs/RESULTS.md).
    """
    prev = {"b": {"w": t(1.0, -1.0)}, "c": {"w": t(2.0, 2.0)}}
    *_, (with_md, _) = _round(0.5, prev)
    *_, (without, _) = _round(0.0, prev)
    tops = {"a": L.format(DEPTHS["a"] - 1), "b": L.format(DEPTHS["b"] - 1)}  # the isolated top layers MD blends
    for v in "abc":
        for k in with_md[v]:
            same = torch.equal(with_md[v][k], without[v][k])
            assert same == (tops.get(v) != k), f"tier {v}, {k}: {'same' if same else 'differs'}"


def test_tier_without_clients_keeps_state_adam_and_momentum() -> None:
    prev = {"b": {"w": t(1.0, -1.0)}, "c": {"w": t(2.0, 2.0)}}
    cat = toy_catalog(DEPTHS)
    states = constant_state(cat, 1.0)
    adam = {v: FedAdamState() for v in "abc"}
    deltas = {v: {k: torch.full((2,), 0.5) for k in states[v]} for v in ("a", "c")}
    new, momenta = inclusivefl_round(
        states=states,
        deltas=deltas,
        counts={"a": 1, "b": 0, "c": 1},
        depths=list(DEPTHS.items()),
        shared=tier_shared_names(cat),
        momenta=prev,
        adam=adam,
        adam_cfg=FedAdamConfig(),
        beta=0.2,
    )
    assert adam["b"].step == 0 and not adam["b"].m
    assert momenta["b"] is prev["b"]
    assert torch.equal(new["b"][L.format(2)], torch.ones(2))  # b's isolated layer
    assert torch.equal(new["b"]["classifier.weight"], torch.ones(2))


def test_single_tier_strategy_matches_flower_fedadam() -> None:
    """FedAdam of a homogeneous group equals Flower's FedAdam on the same replies (1e-6)."""
    cat = toy_catalog({"only": 3}, dim=5)
    rng = np.random.default_rng(0)
    init = {p.name: torch.from_numpy(rng.normal(size=p.shape).astype(np.float32)) for p in cat.largest.layout}
    ours = InclusiveFL(catalog=cat, beta=0.2, adam=FedAdamConfig(eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3))
    ours.set_state({"only": init})
    flower = FedAdam(eta=0.05, beta_1=0.9, beta_2=0.99, tau=1e-3)
    flower_arrays = ArrayRecord({k: Array(v.numpy()) for k, v in init.items()})
    for rnd in range(1, 5):
        flower.current_arrays = {k: a.numpy() for k, a in flower_arrays.items()}
        client_weights = []
        for node in (11, 12, 13):
            w = {
                k: (v + rng.normal(scale=0.1, size=v.shape).astype(np.float32)).astype(np.float32)
                for k, v in flower.current_arrays.items()
            }
            client_weights.append((node, w, int(rng.integers(5, 50))))
        replies = [reply(sent(ours, n, "only"), w, num_examples=c, server_round=rnd) for n, w, c in client_weights]
        arrays, _ = ours.aggregate_train(rnd, replies)
        assert arrays is not None
        flower_replies = [
            reply(sent(ours, n, "only"), w, num_examples=c, server_round=rnd) for n, w, c in client_weights
        ]
        new_arrays, _ = flower.aggregate_train(rnd, flower_replies)
        assert new_arrays is not None
        flower_arrays = new_arrays
        for k, a in flower_arrays.items():
            np.testing.assert_allclose(ours.state["only"][k].numpy(), a.numpy(), rtol=0, atol=1e-6)


def test_shared_adam_variant_steps_the_count_weighted_mean_update_once() -> None:
    cat = toy_catalog(DEPTHS)
    states = constant_state(cat, 1.0)
    deltas = {
        v: {k: torch.full((2,), 0.1 * (i + 1)) + 0.01 * j for j, k in enumerate(states[v])} for i, v in enumerate("abc")
    }
    counts = {"a": 3, "b": 1, "c": 0}  # c not sampled: its moments and tensors stay
    adam = {v: FedAdamState() for v in (*"abc", SHARED_ADAM)}
    cfg = FedAdamConfig(eta=0.1, beta_1=0.9, beta_2=0.99, tau=1e-3)
    shared = tier_shared_names(cat)
    new, momenta = shared_adam_round(
        states=states, deltas=deltas, counts=counts, depths=list(DEPTHS.items()), shared=shared,
        momenta={}, adam=adam, adam_cfg=cfg, beta=0.0,
    )  # fmt: skip
    # a shared tensor held by a and b: one FedAdam step on (3 g_a + 1 g_b) / 4
    name = L.format(0)
    assert name in shared["a"] and name in shared["b"]
    mean = (3 * deltas["a"][name] + deltas["b"][name]) / 4
    want = fedadam_step({name: states["a"][name]}, {name: mean}, FedAdamState(), cfg)[name]
    for v in "abc":  # written to every holder, c included (it holds the tensor, trained or not)
        assert torch.allclose(new[v][name], want, atol=0, rtol=0)
    # b's isolated last layer and head: b's own FedAdam step on g_b
    iso = L.format(2)
    assert iso not in shared["b"]
    assert torch.equal(new["b"][iso], fedadam_step(states["b"], deltas["b"], FedAdamState(), cfg)[iso])
    assert adam[SHARED_ADAM].step == 1 and adam["a"].step == 1 and adam["c"].step == 0
    assert torch.equal(new["c"]["classifier.weight"], states["c"]["classifier.weight"])
    assert "c" not in momenta


def test_shared_adam_variant_with_one_tier_is_plain_fedadam() -> None:
    cat = toy_catalog({"c": 4})
    states = constant_state(cat, 1.0)
    deltas = {"c": {k: torch.full((2,), 0.05 * (j + 1)) for j, k in enumerate(states["c"])}}
    cfg = FedAdamConfig(eta=0.1, tau=1e-3)
    new, _ = shared_adam_round(
        states=states, deltas=deltas, counts={"c": 2}, depths=[("c", 4)], shared=tier_shared_names(cat),
        momenta={}, adam={"c": FedAdamState(), SHARED_ADAM: FedAdamState()}, adam_cfg=cfg, beta=0.2,
    )  # fmt: skip
    want = fedadam_step(states["c"], deltas["c"], FedAdamState(), cfg)
    for k in want:
        assert torch.allclose(new["c"][k], want[k], atol=0, rtol=0)
