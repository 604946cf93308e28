"""FlexiFed: trie, plans, streaming aggregation with exact numbers, and the Flower strategy glue."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch
from torch import Tensor

from models.architectures import ArchLayer, LayerSignature, architecture_catalog, architecture_layers
from models.catalog import Layout, MemoryEstimate, ParamSpec, Variant, VariantCatalog
from strategies.flexifed import (
    LOCAL,
    FlexiFed,
    FlexiFedError,
    architecture_plan,
    client_plan,
    common_layer_trie,
    common_prefix_length,
    flexifed_round,
    trie_path,
)
from tests.toy import reply, sent

# --- a tiny family ------------------------------------------------------------------------------
# Every layer has a weight (2,) and a bias (1,).  Trie:
#   root - s0 {a,b,c,d,e} - s1 {a,b,d,e} - s2 {a,e} - cls {a,e}
#                                       - s3 {b} - cls {b}
#                                       - s5 {d} - cls {d}
#                        - s4 {c} - cls {c}
# "e" is "a" under another name (identical signatures); "d" and "e" never have clients.

SHAPES = ((2,), (1,))


def sig(kind: str, ops: tuple[str, ...] = ("relu",)) -> LayerSignature:
    return LayerSignature(kind, SHAPES, ops)


S0, S1, S2, S3, S4, S5 = (sig(f"conv{i}", () if i == 0 else ("relu",)) for i in range(6))
CLS = sig("classifier", ("avgpool",))
SIGS: dict[str, list[LayerSignature]] = {
    "a": [S0, S1, S2, CLS],
    "b": [S0, S1, S3, CLS],
    "c": [S0, S4, CLS],
    "d": [S0, S1, S5, CLS],
    "e": [S0, S1, S2, CLS],
}


def layers_of(arch: str, sigs: Sequence[LayerSignature]) -> list[ArchLayer]:
    # the same names in every architecture: aggregation must go by position, not by name
    return [ArchLayer(s, (f"l{i}.w", f"l{i}.b")) for i, s in enumerate(sigs)]


LAYERS = {a: layers_of(a, s) for a, s in SIGS.items()}


def weights(arch: str, v: float) -> dict[str, Tensor]:
    """A client's weights: every layer ``w = [v, -v]``, ``b = [2 v]``."""
    out: dict[str, Tensor] = {}
    for layer in LAYERS[arch]:
        out[layer.names[0]] = torch.tensor([v, -v])
        out[layer.names[1]] = torch.tensor([2 * v])
    return out


def state(arch: str, value: float = -1.0) -> dict[str, Tensor]:
    """A server model in the same pattern (initial value ``-1``)."""
    return weights(arch, value)


# clients: (id, architecture, value, examples)
CLIENTS = [("u1", "a", 1.0, 1), ("u2", "a", 5.0, 3), ("u3", "b", 10.0, 2), ("u4", "c", 20.0, 4)]
ARCH_OF = {c: a for c, a, _, _ in CLIENTS}
# example-weighted means of the client values
ALL = (1 * 1 + 3 * 5 + 2 * 10 + 4 * 20) / 10  # 11.6
AB = (1 * 1 + 3 * 5 + 2 * 10) / 6  # 6.0
A = (1 * 1 + 3 * 5) / 4  # 4.0
B, C = 10.0, 20.0


Client = tuple[str, str, float, int]


def run(
    mode: str, *, uniform: bool = False, share_classifier: bool = False, clients: Sequence[Client] = CLIENTS
) -> tuple[dict[str, dict[str, Tensor]], dict[str, dict[str, Tensor]]]:
    states = {a: state(a, -1.0) for a in SIGS}
    replies = [(c, a, weights(a, v), n) for c, a, v, n in clients]
    return flexifed_round(states, LAYERS, replies, mode=mode, uniform=uniform, share_classifier=share_classifier)


def values(model: Mapping[str, Tensor], arch: str) -> list[object]:
    """Per layer the value ``v`` of ``w = [v, -v], b = [2 v]`` (checks all three numbers)."""
    out: list[object] = []
    for layer in LAYERS[arch]:
        w, b = model[layer.names[0]], model[layer.names[1]]
        v = float(w[0])
        torch.testing.assert_close(w, torch.tensor([v, -v]))
        torch.testing.assert_close(b, torch.tensor([2 * v]))
        out.append(pytest.approx(v))
    return out


# --- trie and prefixes --------------------------------------------------------------------------


def test_common_prefix_length() -> None:
    assert common_prefix_length(SIGS["a"], SIGS["b"]) == 2
    assert common_prefix_length(SIGS["a"], SIGS["c"]) == 1
    assert common_prefix_length(SIGS["a"], SIGS["e"]) == 4
    assert common_prefix_length(SIGS["a"], SIGS["a"][:2]) == 2
    assert common_prefix_length([], SIGS["a"]) == 0
    other_ops = [LayerSignature("conv0", SHAPES, ("maxpool2",)), *SIGS["a"][1:]]
    assert common_prefix_length(SIGS["a"], other_ops) == 0  # ops are part of the signature


def test_common_layer_trie() -> None:
    root = common_layer_trie(SIGS)
    assert root.architectures == set(SIGS) and list(root.children) == [S0]
    n0 = root.children[S0]
    assert n0.depth == 1 and n0.architectures == {"a", "b", "c", "d", "e"}
    assert set(n0.children) == {S1, S4}
    n1 = n0.children[S1]
    assert n1.architectures == {"a", "b", "d", "e"} and set(n1.children) == {S2, S3, S5}
    assert n1.children[S2].children[CLS].architectures == {"a", "e"}
    path = trie_path(root, SIGS["b"])
    assert [n.depth for n in path] == [1, 2, 3, 4]
    assert [n.architectures for n in path] == [{"a", "b", "c", "d", "e"}, {"a", "b", "d", "e"}, {"b"}, {"b"}]
    with pytest.raises(FlexiFedError):
        trie_path(root, [S4])


# --- plans --------------------------------------------------------------------------------------

U = frozenset({"u1", "u2", "u3", "u4"})
UAB = frozenset({"u1", "u2", "u3"})
UA = frozenset({"u1", "u2"})


def plan(mode: str, share_classifier: bool = False) -> dict[str, tuple[frozenset[str], ...]]:
    return client_plan(SIGS, ARCH_OF, mode=mode, share_classifier=share_classifier)


def test_basic_plan_averages_the_prefix_common_to_all() -> None:
    p = plan("basic")
    assert p["u1"] == (U, {"u1"}, {"u1"}, {"u1"})
    assert p["u3"] == (U, {"u3"}, {"u3"}, {"u3"})
    assert p["u4"] == (U, {"u4"}, {"u4"})


def test_clustered_plan_adds_identical_architectures() -> None:
    p = plan("clustered")
    assert p["u1"] == p["u2"] == (U, UA, UA, UA)
    assert p["u3"] == (U, {"u3"}, {"u3"}, {"u3"})
    assert p["u4"] == (U, {"u4"}, {"u4"})


def test_max_plan_follows_the_trie() -> None:
    p = plan("max")
    assert p["u1"] == p["u2"] == (U, UAB, UA, UA)
    assert p["u3"] == (U, UAB, {"u3"}, {"u3"})
    assert p["u4"] == (U, {"u4"}, {"u4"})


def test_clustered_fl_and_standalone_plans() -> None:
    p = plan("clustered-fl")
    assert p["u1"] == (UA,) * 4 and p["u3"] == ({"u3"},) * 4 and p["u4"] == ({"u4"},) * 3
    p = plan("standalone")
    assert p["u2"] == ({"u2"},) * 4


def test_shared_classifier_joins_every_equal_classifier() -> None:
    assert plan("max", share_classifier=True)["u3"] == (U, UAB, {"u3"}, U)
    assert plan("basic", share_classifier=True)["u1"] == (U, {"u1"}, {"u1"}, U)
    # the baselines never cross architectures
    assert plan("clustered-fl", share_classifier=True)["u3"][-1] == {"u3"}


def test_basic_prefix_depends_on_who_participates() -> None:
    p = client_plan(SIGS, {"u1": "a", "u3": "b"}, mode="basic")
    both = frozenset({"u1", "u3"})
    assert p["u1"] == (both, both, {"u1"}, {"u1"})
    # one architecture only: everything is common, classifier included (identical architectures)
    p = client_plan(SIGS, {"u1": "a", "u2": "a"}, mode="basic")
    assert p["u1"] == (UA,) * 4


def test_classifier_on_a_common_trie_node_stays_within_identical_architectures() -> None:
    sigs = {"x": [S0, CLS], "y": [S0, CLS, S1]}  # same classifier node, different architectures
    p = client_plan(sigs, {"ux": "x", "uy": "y"}, mode="max")
    assert p["ux"] == ({"ux", "uy"}, {"ux"})
    assert p["uy"] == ({"ux", "uy"}, {"uy"}, {"uy"})
    p = client_plan(sigs, {"ux": "x", "uy": "y"}, mode="max", share_classifier=True)
    assert p["ux"] == ({"ux", "uy"}, {"ux", "uy"})


def test_architecture_plan_for_architectures_without_clients() -> None:
    parts = {"a", "b", "c"}
    p = architecture_plan(SIGS, parts, mode="max")
    everyone = frozenset({("a", 0), ("b", 0), ("c", 0)})
    assert p["d"] == (everyone, frozenset({("a", 1), ("b", 1)}), frozenset(), frozenset())
    assert p["e"] == p["a"]  # identical to a: joins a's groups
    p = architecture_plan(SIGS, parts, mode="basic")
    assert p["a"][1] is LOCAL and p["d"][1] == frozenset()  # never LOCAL without clients
    assert architecture_plan(SIGS, parts, mode="clustered-fl")["e"] == tuple(frozenset({("a", i)}) for i in range(4))
    assert architecture_plan(SIGS, (), mode="max")["a"] == (frozenset(),) * 4
    with pytest.raises(FlexiFedError):
        architecture_plan(SIGS, {"zz"}, mode="max")
    with pytest.raises(FlexiFedError):
        architecture_plan(SIGS, parts, mode="fedavg")


# --- exact aggregation --------------------------------------------------------------------------


def test_basic_common_values() -> None:
    states, clients = run("basic")
    assert values(clients["u1"], "a") == [ALL, 1, 1, 1]
    assert values(clients["u2"], "a") == [ALL, 5, 5, 5]
    assert values(clients["u3"], "b") == [ALL, 10, 10, 10]
    assert values(clients["u4"], "c") == [ALL, 20, 20]
    # the architecture models get the common layer; personal layers keep their value
    assert values(states["a"], "a") == [ALL, -1, -1, -1]
    assert values(states["d"], "d") == [ALL, -1, -1, -1]


def test_clustered_common_values() -> None:
    states, clients = run("clustered")
    assert values(states["a"], "a") == [ALL, A, A, A]
    assert values(states["b"], "b") == [ALL, B, B, B]
    assert values(states["c"], "c") == [ALL, C, C]
    assert clients["u1"] is states["a"] and clients["u2"] is states["a"]
    assert values(states["e"], "e") == [ALL, A, A, A]  # identical to "a"
    assert values(states["d"], "d") == [ALL, -1, -1, -1]  # uncovered layers unchanged


def test_max_common_values() -> None:
    states, _ = run("max")
    assert values(states["a"], "a") == [ALL, AB, A, A]
    assert values(states["b"], "b") == [ALL, AB, B, B]
    assert values(states["c"], "c") == [ALL, C, C]
    # "d" has no clients: it receives what its trie nodes got, the rest is unchanged
    assert values(states["d"], "d") == [ALL, AB, -1, -1]


def test_clustered_fl_values() -> None:
    states, _ = run("clustered-fl")
    assert values(states["a"], "a") == [A] * 4
    assert values(states["b"], "b") == [B] * 4
    assert values(states["c"], "c") == [C] * 3
    assert values(states["d"], "d") == [-1] * 4


def test_standalone_values() -> None:
    states, clients = run("standalone")
    assert values(clients["u2"], "a") == [5] * 4
    assert all(values(states[a], a) == [-1] * len(LAYERS[a]) for a in SIGS)


def test_shared_classifier_values() -> None:
    states, _ = run("max", share_classifier=True)
    assert values(states["a"], "a") == [ALL, AB, A, ALL]
    assert values(states["c"], "c") == [ALL, C, ALL]
    assert values(states["d"], "d") == [ALL, AB, -1, ALL]


def test_uniform_weights_reproduce_the_paper() -> None:
    states, _ = run("max", uniform=True)
    assert values(states["a"], "a") == [(1 + 5 + 10 + 20) / 4, (1 + 5 + 10) / 3, 3, 3]
    assert values(states["c"], "c") == [9, 20, 20]


def test_max_ge_clustered_ge_basic_in_sharing() -> None:
    for client in ARCH_OF:
        basic, clustered, maxc = plan("basic")[client], plan("clustered")[client], plan("max")[client]
        assert all(b <= c <= m for b, c, m in zip(basic, clustered, maxc, strict=True))


def test_a_client_replying_twice_is_an_error() -> None:
    with pytest.raises(FlexiFedError):
        run("max", clients=[CLIENTS[0], CLIENTS[0]])


# --- the Flower strategy ------------------------------------------------------------------------


def toy_catalog() -> VariantCatalog:
    variants = []
    for i, (arch, layers) in enumerate(LAYERS.items()):
        params = tuple(
            ParamSpec(n, s, "float32", index, "head" if layer.signature.is_classifier else "shared")
            for index, layer in enumerate(layers, start=1)
            for n, s in zip(layer.names, SHAPES, strict=True)
        )
        variants.append(Variant(arch, len(layers), Layout(params), MemoryEstimate(i + 1, 0, 0, 0)))
    return VariantCatalog("toy-flexifed", tuple(variants))


def strategy(mode: str, **kw: object) -> FlexiFed:
    s = FlexiFed(catalog=toy_catalog(), signatures=LAYERS, mode=mode, **kw)  # type: ignore[arg-type]
    s.set_state({a: state(a, -1.0) for a in SIGS})
    return s


def drive(s: FlexiFed, server_round: int = 1, clients: Sequence[Client] = CLIENTS) -> None:
    msgs = []
    for cid, arch, v, n in clients:
        node = int(cid[1:])
        w = {k: t.numpy() for k, t in weights(arch, v).items()}
        msgs.append(reply(sent(s, node, arch), w, num_examples=n, server_round=server_round))
    s.aggregate_train(server_round, msgs)


def test_strategy_max_common_round() -> None:
    s = strategy("max")
    drive(s)
    report = s.report(1)
    assert report.rejected == [] and report.failed == []
    assert values(s.state["a"], "a") == [ALL, AB, A, A]
    assert values(s.state["b"], "b") == [ALL, AB, B, B]
    assert values(s.state["c"], "c") == [ALL, C, C]
    assert values(s.state["d"], "d") == [ALL, AB, -1, -1]
    assert report.groups["a"]["shared-layers"] == 2 and report.groups["c"]["shared-layers"] == 1
    assert report.groups["a"]["clients"] == 2
    # a node receives only its own architecture's model
    assert set(s.variant_payload(4, "c")) == set(s.catalog.get("c").layout.names())
    # the composite record Flower sees carries the new state
    assert s._record is not None and float(s._record["a/l1.w"].numpy()[0]) == pytest.approx(AB)


def test_strategy_basic_keeps_personal_layers_per_node() -> None:
    s = strategy("basic", uniform=True)
    drive(s)
    u = (1 + 5 + 10 + 20) / 4
    assert values(s.variant_payload(1, "a"), "a") == [u, 1, 1, 1]
    assert values(s.variant_payload(2, "a"), "a") == [u, 5, 5, 5]
    assert values(s.state["a"], "a") == [u, -1, -1, -1]
    evaluated = s.models_for_evaluation()
    assert len(evaluated["a"]) == 2 and len(evaluated["d"]) == 1
    # round 2: only node 3 (b) trains; the common prefix is all of b; node 1 receives layer 0
    drive(s, 2, [("u3", "b", 7.0, 2)])
    assert values(s.variant_payload(3, "b"), "b") == [7, 7, 7, 7]
    assert values(s.variant_payload(1, "a"), "a") == [7, 7, 1, 1]  # b's layers 0-1 pass a's trie nodes
    assert values(s.state["d"], "d") == [7, 7, -1, -1]


def test_strategy_rejected_reply_touches_nothing() -> None:
    s = strategy("clustered-fl")
    bad = {k: t.numpy() for k, t in weights("a", 3.0).items()}
    bad["l0.w"] = bad["l0.w"][:1]
    s.aggregate_train(1, [reply(sent(s, 1, "a"), bad, num_examples=5)])
    assert len(s.report(1).rejected) == 1
    assert all(values(s.state[a], a) == [-1] * len(LAYERS[a]) for a in SIGS)


def test_strategy_rejects_layers_that_do_not_match_the_catalog() -> None:
    bad = dict(LAYERS)
    bad["a"] = LAYERS["a"][:-1]
    with pytest.raises(FlexiFedError):
        FlexiFed(catalog=toy_catalog(), signatures=bad, mode="max")
    with pytest.raises(FlexiFedError):
        FlexiFed(catalog=toy_catalog(), signatures=LAYERS, mode="all")


def test_strategy_on_real_vgg_architectures() -> None:
    kw: dict[str, Any] = {"width": 1 / 16, "in_channels": 1, "num_classes": 10}
    cat = architecture_catalog(["vgg11", "vgg13"], image_size=28, batch_size=4, **kw)
    layers = {name: architecture_layers(name, **kw) for name in cat.names()}
    s = FlexiFed(catalog=cat, signatures=layers, mode="max")
    s.set_state({v.name: {p.name: torch.zeros(p.shape) for p in v.layout} for v in cat})
    msgs = []
    for node, arch, v, n in ((1, "vgg11", 1.0, 1), (2, "vgg13", 4.0, 3)):
        w = {p.name: torch.full(p.shape, v).numpy() for p in cat.get(arch).layout}
        msgs.append(reply(sent(s, node, arch), w, num_examples=n))
    s.aggregate_train(1, msgs)
    first = layers["vgg11"][0].names
    for name in first:  # the one common conv layer: (1 * 1 + 3 * 4) / 4
        assert torch.equal(s.state["vgg11"][name], torch.full_like(s.state["vgg11"][name], 3.25))
        assert torch.equal(s.state["vgg13"][name], s.state["vgg11"][name])
    assert bool((s.state["vgg11"]["features.1.conv.weight"] == 1.0).all())
    assert bool((s.state["vgg13"]["features.1.conv.weight"] == 4.0).all())
    assert bool((s.state["vgg13"]["classifier.weight"] == 4.0).all())
