"""CoDistillation strategy glue driven by mock Flower replies: merged, periodic, fedavg, membership."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from flwr.app import ConfigRecord, MessageType
from flwr.supercore.task_identity import TaskIdentity
from torch import Tensor, nn

from experiment.config import RunConfig
from models.codist import CodistFamily, CodistSize, codist_catalog
from server.app import build_strategy
from strategies.codistill import (
    CodistConfigError,
    CoDistillation,
    DistillConfig,
    global_norm,
    linear_decay,
    merged_update,
    norm_ratio,
)
from strategies.fedadam import FedAdamConfig, FedAdamState, fedadam_step
from strategies.profiles import NodeProfile
from tests.toy import reply, sent, trained

POOLS = (("small", CodistSize((2, 2, 2), (3, 3))), ("large", CodistSize((3, 3, 3), (4, 4))))
CATALOG = codist_catalog(POOLS, in_channels=1, num_classes=3, image_size=8, batch_size=4)
FAMILY = CodistFamily(in_channels=1, num_classes=3, image_size=8)
ADAM = FedAdamConfig(eta=0.1, beta_1=0.9, beta_2=0.999, tau=1e-5)
DISTILL = DistillConfig(steps=3, temperature=2.0, lam=0.1, lr=0.01, batch_size=8)
ROUNDS = 4
State = dict[str, dict[str, Tensor]]


def build_model(pool: str) -> nn.Module:
    return FAMILY.build(CATALOG.get(pool))


def make(mode: str, **kw: Any) -> CoDistillation:
    kw = {"adam": ADAM, "distill": DISTILL, **kw}
    s = CoDistillation(
        catalog=CATALOG,
        num_rounds=ROUNDS,
        build_model=build_model,
        distill_data=torch.randn(24, 1, 8, 8, generator=torch.Generator().manual_seed(0)),
        mode=mode,  # type: ignore[arg-type]
        **kw,
    )
    s.set_state(FAMILY.initial_states(CATALOG, seed=0))
    return s


# per pool: (node, weight shift, examples)
CLIENTS = {"small": [(1, 0.02, 10), (2, -0.01, 30)], "large": [(3, 0.03, 20)]}


def run_round(
    s: CoDistillation,
    server_round: int,
    clients: Mapping[str, list[tuple[int, float, int]]] = CLIENTS,
    flower_round: int | None = None,
) -> None:
    """One round of replies (``flower_round``: Flower's number after a resume, else ``server_round``)."""
    replies = [
        reply(
            sent(s, node, pool),
            trained(s.state[pool], shift + 0.001 * server_round),
            num_examples=n,
            server_round=server_round,
        )
        for pool, rows in clients.items()
        for node, shift, n in rows
    ]
    s.aggregate_train(server_round if flower_round is None else flower_round, replies)
    assert s.report(server_round).rejected == []


def mean_update(
    state: Mapping[str, Tensor], rows: list[tuple[int, float, int]], server_round: int
) -> dict[str, Tensor]:
    """``g = sum_k n_k (theta + c_k) / sum_k n_k - theta``."""
    total = sum(n for _, _, n in rows)
    return {
        k: sum(n * (t + shift + 0.001 * server_round) for _, shift, n in rows) / total - t  # type: ignore[misc]
        for k, t in state.items()
    }


def copy_state(state: State) -> State:
    return {p: {k: t.clone() for k, t in params.items()} for p, params in state.items()}


def assert_states_equal(a: State, b: State) -> None:
    assert a.keys() == b.keys()
    for p in a:
        for k in a[p]:
            torch.testing.assert_close(a[p][k], b[p][k], rtol=1e-5, atol=1e-7)


def test_merged_with_alpha_one_is_plain_fedadam_per_pool() -> None:
    merged, fedavg = make("merged", alpha=1.0), make("fedavg")
    manual = copy_state(merged.state)
    adam = {p: FedAdamState() for p in manual}
    for r in (1, 2):
        run_round(merged, r)
        run_round(fedavg, r)
        for pool, rows in CLIENTS.items():
            cfg = dataclasses.replace(ADAM, eta=linear_decay(ADAM.eta, r, ROUNDS))
            manual[pool] = fedadam_step(manual[pool], mean_update(manual[pool], rows, r), adam[pool], cfg)
        for pool in CLIENTS:
            assert all(torch.equal(merged.state[pool][k], fedavg.state[pool][k]) for k in fedavg.state[pool])
        assert_states_equal(merged.state, manual)
        report = merged.report(r).groups
        assert report["small"]["distill-seconds"] > 0 and report["large"]["distill-seconds"] > 0  # it did distill
        assert report["small"]["server-lr"] == pytest.approx(linear_decay(0.1, r, ROUNDS))
        assert fedavg.report(r).groups["small"]["distill-seconds"] == 0.0
    assert merged.adam["small"].step == 2


def test_constant_server_lr_steps_every_round_with_the_undecayed_eta() -> None:
    """``server_lr_decay=False`` (run-config ``codist-server-lr-decay = false``): FedAdam's ``eta`` is
    0.1 in every round (decayed: 0.1, 0.075, 0.05, 0.025 over ``T = 4``), the models those steps give."""
    s, decayed = make("fedavg", server_lr_decay=False), make("fedavg")
    manual = copy_state(s.state)
    adam = {p: FedAdamState() for p in manual}
    for r in range(1, ROUNDS + 1):
        run_round(s, r)
        run_round(decayed, r)
        for pool, rows in CLIENTS.items():
            manual[pool] = fedadam_step(manual[pool], mean_update(manual[pool], rows, r), adam[pool], ADAM)
            assert s.server_adam_config(pool, r).eta == 0.1
            assert s.report(r).groups[pool]["server-lr"] == 0.1
        assert decayed.report(r).groups["small"]["server-lr"] == pytest.approx((0.1, 0.075, 0.05, 0.025)[r - 1])
        for pool in manual:  # the steps themselves, to float32 rounding of the two mean paths
            for k in manual[pool]:
                torch.testing.assert_close(s.state[pool][k], manual[pool][k], rtol=1e-4, atol=1e-6)


def test_run_config_codist_server_lr_decay_reaches_the_strategy() -> None:
    pools = {"model": "codist-cnn", "tiers": "small:large", "tier-proportions": "1:1", "tier-memory-mb": "auto"}
    for method in ("codist-periodic", "codist-fedavg", "codist-merged"):
        for decays in (False, True):
            cfg = RunConfig.from_flower(
                {**pools, "method": method, "codist-server-lr-decay": decays, "distill-size": 8}
            )
            strategy = build_strategy(cfg)
            assert isinstance(strategy, CoDistillation) and strategy.server_lr_decay is decays
    default = RunConfig.from_flower({**pools, "method": "codist-periodic", "distill-size": 8})
    assert default.codist_server_lr_decay is True  # the paper's schedule unless asked


def test_per_pool_server_lr_steps_each_pool_with_its_own_eta() -> None:
    etas = {"small": 0.1, "large": 0.01}
    s = make("fedavg", adam={p: dataclasses.replace(ADAM, eta=e) for p, e in etas.items()})
    manual = copy_state(s.state)
    adam = {p: FedAdamState() for p in manual}
    for r in (1, 2):
        run_round(s, r)
        for pool, rows in CLIENTS.items():
            cfg = dataclasses.replace(ADAM, eta=linear_decay(etas[pool], r, ROUNDS))
            manual[pool] = fedadam_step(manual[pool], mean_update(manual[pool], rows, r), adam[pool], cfg)
            assert s.report(r).groups[pool]["server-lr"] == pytest.approx(cfg.eta)
        assert_states_equal(s.state, manual)
    # the large pool's smaller eta moved it less than the shared eta would have
    shared = make("fedavg")
    start = copy_state(shared.state)
    for r in (1, 2):
        run_round(shared, r)
    moved = {
        name: sum(float((st["large"][k] - start["large"][k]).norm()) for k in start["large"])
        for name, st in (("per-pool", s.state), ("shared", shared.state))
    }
    assert moved["per-pool"] < 0.5 * moved["shared"]


def test_merged_applies_the_rescaled_distillation_gradient() -> None:
    s, twin = make("merged", alpha=0.25), make("merged", alpha=0.25)
    start = copy_state(s.state)
    run_round(s, 1)
    # the same students, distilled from the same round-start copies with the same batches
    students = twin.codistill(1, start, ["small", "large"])
    cfg = dataclasses.replace(ADAM, eta=linear_decay(ADAM.eta, 1, ROUNDS))
    want = {}
    for pool, rows in CLIENTS.items():
        g = mean_update(start[pool], rows, 1)
        delta = {k: students[pool][k] - start[pool][k] for k in g}  # theta_student - theta (update direction)
        want[pool] = fedadam_step(start[pool], merged_update(g, delta, 0.25), FedAdamState(), cfg)
    assert_states_equal(s.state, want)
    fedavg = make("fedavg")
    run_round(fedavg, 1)
    assert not torch.allclose(s.state["large"]["out.weight"], fedavg.state["large"]["out.weight"])
    assert s.report(1).groups["large"]["distill-loss"] >= 0.0


def test_merged_before_merge_start_is_fedavg_then_merges() -> None:
    """Rounds before ``merge_start`` apply ``g`` alone (bit for bit FedAvg, no distillation);
    from it on, eq. 2 with this round's students, and ``merge-norm-ratio`` = ``||delta|| / ||g||``."""
    s, fedavg, twin = make("merged", alpha=0.25, merge_start=3), make("fedavg"), make("merged", alpha=0.25)
    for r in (1, 2):
        run_round(s, r)
        run_round(fedavg, r)
        assert_states_equal(s.state, fedavg.state)
        for pool in CLIENTS:
            assert all(torch.equal(s.state[pool][k], fedavg.state[pool][k]) for k in fedavg.state[pool])
            assert s.report(r).groups[pool]["distill-seconds"] == 0.0
            assert "merge-norm-ratio" not in s.report(r).groups[pool]
    start = copy_state(s.state)
    # the checkpoint round trip copies the moment dicts; fedadam_step never writes old moments in place
    adam = {p: FedAdamState.from_dict(st.to_dict()) for p, st in s.adam.items()}
    run_round(s, 3)
    students = twin.codistill(3, start, ["small", "large"])
    cfg = dataclasses.replace(ADAM, eta=linear_decay(ADAM.eta, 3, ROUNDS))
    for pool, rows in CLIENTS.items():
        g = mean_update(start[pool], rows, 3)
        delta = {k: students[pool][k] - start[pool][k] for k in g}
        want = fedadam_step(start[pool], merged_update(g, delta, 0.25), adam[pool], cfg)
        assert_states_equal({pool: s.state[pool]}, {pool: want})
        assert s.report(3).groups[pool]["merge-norm-ratio"] == pytest.approx(
            global_norm(delta) / global_norm(g), rel=1e-4
        )  # g: the float32 mean, up to rounding
        assert s.report(3).groups[pool]["distill-seconds"] > 0.0


def test_moment_reset_resets_fedadam_every_r_rounds_without_distilling() -> None:
    """``moment_reset = 2``: after rounds 2 and 4 every pool's FedAdam state is empty, the models are
    FedAvg's (MergedCodist at alpha = 1: its distillation runs but weighs nothing), and round 3 steps
    from fresh moments: bit for bit a FedAvg twin whose states were reset by hand."""
    for mode in ("fedavg", "merged"):
        s = make(mode, moment_reset=2, **({"alpha": 1.0} if mode == "merged" else {}))
        twin = make("fedavg")
        for r in range(1, ROUNDS + 1):
            run_round(s, r)
            run_round(twin, r)
            if r % 2 == 0:
                assert all(st.step == 0 and not st.m and not st.v for st in s.adam.values())
                for st in twin.adam.values():
                    st.reset()
            else:
                assert all(st.step == 1 for st in s.adam.values())
            assert_states_equal(s.state, twin.state)
    plain = make("fedavg")
    for r in (1, 2, 3):
        run_round(plain, r)
    assert all(st.step == 3 for st in plain.adam.values())  # 0 = never


def test_merged_with_moment_reset_still_merges() -> None:
    """MergedCodist with resets distills every round as Algorithm 2; only the optimizer state differs."""
    s, twin = make("merged", alpha=0.25, moment_reset=1), make("merged", alpha=0.25)
    run_round(s, 1)
    run_round(twin, 1)
    assert_states_equal(s.state, twin.state)  # round 1: identical update, reset only after it
    assert s.report(1).groups["large"]["distill-seconds"] > 0.0
    assert s.adam["large"].step == 0 and twin.adam["large"].step == 1


def test_norm_ratio_on_exact_numbers() -> None:
    g = {"a": torch.tensor([3.0, 4.0]), "b": torch.tensor([0.0])}  # ||g|| = 5
    delta = {"a": torch.tensor([0.0, 6.0]), "b": torch.tensor([8.0]), "extra": torch.tensor([99.0])}  # 10 on g's keys
    assert norm_ratio(delta, g) == 2.0
    assert norm_ratio({k: torch.zeros_like(t) for k, t in g.items()}, g) == 0.0
    assert norm_ratio(delta, {k: torch.zeros_like(t) for k, t in g.items()}) == float("inf")


def test_periodic_distills_every_p_rounds_replaces_models_and_resets_moments() -> None:
    s, fedavg = make("periodic", period=2), make("fedavg")
    run_round(s, 1)
    run_round(fedavg, 1)
    assert_states_equal(s.state, fedavg.state)  # round 1: FedAvg only
    assert s.adam["small"].step == 1 and s.report(1).groups["small"]["distill-seconds"] == 0.0

    run_round(s, 2)
    run_round(fedavg, 2)
    after_fedavg = copy_state(fedavg.state)  # what both models were before co-distillation
    twin = make("periodic", period=2)
    students = twin.codistill(2, after_fedavg, ["small", "large"])
    assert_states_equal(s.state, students)  # both replaced by their students
    for pool in ("small", "large"):
        assert not torch.allclose(s.state[pool]["out.weight"], after_fedavg[pool]["out.weight"])
        assert s.report(2).groups[pool]["distill-seconds"] > 0
        assert s.adam[pool].step == 0 and not s.adam[pool].m and not s.adam[pool].v  # moments reset

    run_round(s, 3)  # FedAdam restarts from fresh moments
    fresh = {}
    for pool, rows in CLIENTS.items():
        cfg = dataclasses.replace(ADAM, eta=linear_decay(ADAM.eta, 3, ROUNDS))
        fresh[pool] = fedadam_step(students[pool], mean_update(students[pool], rows, 3), FedAdamState(), cfg)
    assert_states_equal(s.state, fresh)
    assert s.adam["large"].step == 1 and s.report(3).groups["large"]["distill-seconds"] == 0.0


def test_pool_without_replies_is_not_updated_but_still_teaches() -> None:
    s = make("merged", alpha=0.5)
    before = copy_state(s.state)
    run_round(s, 1, {"small": CLIENTS["small"]})
    assert all(torch.equal(s.state["large"][k], v) for k, v in before["large"].items())
    assert s.adam["large"].step == 0 and s.adam["small"].step == 1
    groups = s.report(1).groups
    assert groups["small"]["distill-seconds"] > 0 and groups["large"]["distill-seconds"] == 0.0


def profile(node: int, variant: str) -> NodeProfile:
    return NodeProfile(node, "tier", 100.0, 10, True, variant, "")


def test_also_membership_sends_high_capacity_nodes_every_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # Messages need a run and a node outside a ServerApp
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    s = make("merged", membership="also")
    s.profiles = {1: profile(1, "small"), 2: profile(2, "large")}
    assert s.node_variants(1) == ["small"] and s.node_variants(2) == ["small", "large"]
    msgs = s._messages([1, 2], 1, ConfigRecord(), MessageType.TRAIN)
    pairs = sorted((m.node_id, m.variant) for m in msgs.values())
    assert pairs == [(1, "small"), (2, "large"), (2, "small")]
    for m in msgs.values():
        assert m.message.content["config"]["variant"] == m.variant  # type: ignore[index]
        assert set(m.message.content["arrays"].keys()) == set(CATALOG.get(m.variant).layout.names())  # type: ignore[union-attr]
    assert s.profiles[2].variant == "large"  # profile restored
    evals = s._messages([1, 2], 1, ConfigRecord(), MessageType.EVALUATE)
    assert sorted((m.node_id, m.variant) for m in evals.values()) == [(1, "small"), (2, "large")]
    instead = make("merged")
    instead.profiles = dict(s.profiles)
    assert sorted(m.variant for m in instead._messages([1, 2], 1, ConfigRecord(), MessageType.TRAIN).values()) == [
        "large",
        "small",
    ]


def test_configuration_errors() -> None:
    with pytest.raises(CodistConfigError, match="mode"):
        make("bogus")
    with pytest.raises(CodistConfigError, match="build_model and distill_data"):
        CoDistillation(catalog=CATALOG, num_rounds=2, mode="merged")
    one = codist_catalog((("small", "small"),), in_channels=1, num_classes=3, image_size=8, batch_size=4)
    with pytest.raises(CodistConfigError, match="two pools"):
        CoDistillation(catalog=one, num_rounds=2, build_model=build_model, distill_data=torch.zeros(1, 1, 8, 8))
    CoDistillation(catalog=one, num_rounds=2, mode="fedavg")  # the baseline needs neither
    with pytest.raises(CodistConfigError, match="lack pools"):
        make("merged", adam={"small": ADAM})
    with pytest.raises(CodistConfigError, match="alpha"):
        make("merged", alpha=2.0)
    with pytest.raises(CodistConfigError, match="codist-merge-start"):
        make("merged", merge_start=ROUNDS + 1)
    with pytest.raises(CodistConfigError, match="codist-merge-start"):
        make("periodic", merge_start=0)
    make("periodic", merge_start=ROUNDS + 1)  # only MergedCodist reads it
    with pytest.raises(CodistConfigError, match="codist-moment-reset"):
        make("periodic", moment_reset=2)
    with pytest.raises(CodistConfigError, match="codist-moment-reset"):
        make("merged", moment_reset=-1)
    per_pool = make("merged", distill={"small": DISTILL, "large": dataclasses.replace(DISTILL, lr=0.0)})
    run_round(per_pool, 1)
    assert per_pool.report(1).groups["large"]["distill-lr"] == 0.0


def test_checkpoint_round_trip_keeps_per_pool_fedadam() -> None:
    s = make("fedavg")
    run_round(s, 1)
    data = s.checkpoint_state()
    resumed = make("fedavg")
    resumed.load_checkpoint_state(data, 1)
    assert resumed.adam["small"].step == 1
    assert all(torch.equal(resumed.adam["large"].m[k], v) for k, v in s.adam["large"].m.items())
    run_round(s, 2)
    resumed._sent_train.clear()
    run_round(resumed, 2, flower_round=1)  # Flower's round 1 of the resumed run is round 2
    assert_states_equal(resumed.state, s.state)
    with pytest.raises(ValueError, match="pools"):
        resumed.load_method_state({"adam": {"small": s.adam["small"].to_dict()}})
