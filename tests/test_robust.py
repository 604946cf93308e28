"""Robust options: update-norm clipping and the coordinate-wise median, exact values on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch

from experiment.config import ConfigError, RunConfig
from server.app import build_strategy
from strategies.baselines import LocalTraining
from strategies.fedadam import FedAdamConfig
from strategies.inclusivefl import InclusiveFL
from strategies.profiles import NodeProfile
from strategies.robust import MedianBuffer, clip_update, coordinate_median, update_norm
from strategies.validation import ReplyRejected, validate_examples_claim
from tests.test_pfedknow_config import BASE as PFEDKNOW_BASE
from tests.toy import constant_state, reply, sent, toy_catalog, trained


def test_update_norm_and_clipping_exact() -> None:
    w = {"a": torch.tensor([1.0, 1.0]), "b": torch.tensor([0.0])}
    x = {"a": torch.tensor([4.0, 1.0]), "b": torch.tensor([4.0])}  # Delta = (3, 0 | 4): norm 5
    assert update_norm(x, w) == 5.0
    clipped, norm = clip_update(x, w, 2.5)  # scale 1/2
    assert norm == 5.0
    assert torch.equal(clipped["a"], torch.tensor([2.5, 1.0])) and torch.equal(clipped["b"], torch.tensor([2.0]))
    assert update_norm(clipped, w) == pytest.approx(2.5)
    same, _ = clip_update(x, w, 5.0)  # at the bound: untouched, same objects
    assert same["a"] is x["a"]
    with pytest.raises(ValueError):
        clip_update(x, w, 0.0)
    with pytest.raises(ValueError):
        clip_update(x, w, math.inf)


def test_coordinate_median_exact_odd_and_even() -> None:
    r = [
        {"t": torch.tensor([1.0, 9.0, -2.0])},
        {"t": torch.tensor([3.0, 0.0, 5.0])},
        {"t": torch.tensor([2.0, 1.0, 100.0])},
    ]
    assert torch.equal(coordinate_median(r)["t"], torch.tensor([2.0, 1.0, 5.0]))
    r.append({"t": torch.tensor([10.0, -4.0, 6.0])})  # even: mean of the two middle values
    assert torch.equal(coordinate_median(r)["t"], torch.tensor([2.5, 0.5, 5.5]))
    assert torch.equal(coordinate_median(r[:1])["t"], r[0]["t"])
    with pytest.raises(ValueError):
        coordinate_median([])
    with pytest.raises(ValueError):
        coordinate_median([{"t": torch.zeros(2)}, {"u": torch.zeros(2)}])
    with pytest.raises(ValueError):
        coordinate_median([{"t": torch.zeros(2)}, {"t": torch.zeros(3)}])
    buf = MedianBuffer()
    buf.add({"t": torch.tensor([1.0])}, 3)
    buf.add({"t": torch.tensor([5.0])}, 1)
    med, total, count = buf.result()
    assert torch.equal(med["t"], torch.tensor([3.0])) and total == 4 and count == 2


DEPTHS = {"weak": 1, "strong": 2}
#: The tests check the per-group aggregate handed to the method math (``Recorder.seen``), not FedAdam's output.
ADAM = FedAdamConfig(eta=0.1, beta_1=0.0, beta_2=0.0, tau=1e-3)


class Recorder(InclusiveFL):
    """InclusiveFL that keeps the per-variant means it was given (the aggregate before the method math)."""

    def apply_round(self, server_round, means, counts):  # type: ignore[no-untyped-def]
        self.seen = {v: {k: t.clone() for k, t in m.items()} for v, m in means.items()}
        super().apply_round(server_round, means, counts)


def make(**kw: object) -> Recorder:
    cat = toy_catalog(DEPTHS)
    s = Recorder(catalog=cat, beta=0.0, adam=ADAM, **kw)  # type: ignore[arg-type]
    s.set_state(constant_state(cat, 0.0))
    return s


def test_median_ignores_a_poisoned_reply_where_the_mean_does_not() -> None:
    shifts = (1.0, 2.0, 1000.0)  # the third client is poisoned

    def run(robust: str) -> Recorder:
        s = make(robust_aggregation=robust)
        s.aggregate_train(1, [reply(sent(s, n, "strong"), trained(s.state["strong"], d)) for n, d in enumerate(shifts)])
        return s

    mean, median = run("mean"), run("median")
    assert torch.equal(mean.seen["strong"]["classifier.weight"], torch.full((2,), 1003.0 / 3))
    assert torch.equal(median.seen["strong"]["classifier.weight"], torch.full((2,), 2.0))
    assert median.report(1).groups["strong"]["clients"] == 3  # every reply still counted


def test_clipping_bounds_each_reply_per_tier_before_the_mean() -> None:
    s = make(clip_update_norm={"strong": 2.0, "weak": 0.0})
    strong = s.state["strong"]  # 4 tensors of 2 elements: a shift d has norm d * sqrt(8)
    replies = [
        reply(sent(s, 1, "strong"), trained(strong, 0.5), num_examples=1),  # norm 1.41: kept
        reply(sent(s, 2, "strong"), trained(strong, 10.0), num_examples=1),  # norm 28.3: scaled to 2
        reply(sent(s, 3, "weak"), trained(s.state["weak"], 10.0), num_examples=1),  # weak: not clipped
    ]
    s.aggregate_train(1, replies)
    clipped_shift = 2.0 / math.sqrt(8)
    torch.testing.assert_close(s.seen["strong"]["classifier.weight"], torch.full((2,), (0.5 + clipped_shift) / 2))
    assert torch.equal(s.seen["weak"]["classifier.weight"], torch.full((2,), 10.0))
    group = s.report(1).groups["strong"]
    assert group["clipped"] == 1 and group["max-update-norm"] == pytest.approx(10.0 * math.sqrt(8))


def test_clipping_is_relative_to_the_nodes_own_model() -> None:
    cat = toy_catalog(DEPTHS)
    s = LocalTraining(catalog=cat, clip_update_norm={"weak": 0.3})  # a 0.1 shift of 6 elements: norm 0.245
    s.set_state(constant_state(cat, 0.0))
    s.aggregate_train(1, [reply(sent(s, 1, "weak"), trained(s.state["weak"], 0.1))])
    # round 2: 0.2 is 0.49 away from the initial model but 0.245 from what node 1 was sent: not clipped
    s.aggregate_train(2, [reply(sent(s, 1, "weak"), trained(s.variant_payload(1, "weak"), 0.1), server_round=2)])
    torch.testing.assert_close(s.variant_payload(1, "weak")["classifier.weight"], torch.full((2,), 0.2))


def test_heterofl_median_folds_each_width_group_once() -> None:
    cfg = RunConfig(model="tiny", method="heterofl", tier_widths="0.25:0.5:1", robust_aggregation="median")  # type: ignore[arg-type]
    s = build_strategy(cfg)
    full = cfg.family().initial_states(cfg.catalog, seed=0)["strong"]
    s.set_state({"global": full})
    q = "bert.encoder.layer.0.attention.self.query.weight"
    replies = []
    for node, shift, n in ((1, 1.0, 10), (2, 3.0, 10), (3, 500.0, 10)):  # three weak clients, one poisoned
        payload = {k: t for k, t in s.variant_payload(node, "weak").items() if "word_embeddings" not in k}
        replies.append(reply(sent(s, node, "weak"), trained(payload, shift), num_examples=n))
    s.aggregate_train(1, replies)
    torch.testing.assert_close(s.state["global"][q][:8, :8], full[q][:8, :8] + 3.0)  # median of 1, 3, 500
    torch.testing.assert_close(s.state["global"][q][8:, 8:], full[q][8:, 8:])  # uncovered


def test_median_is_refused_where_it_is_undefined() -> None:
    with pytest.raises(ValueError, match="median"):
        LocalTraining(catalog=toy_catalog(DEPTHS), robust_aggregation="median")
    with pytest.raises(ValueError):
        InclusiveFL(catalog=toy_catalog(DEPTHS), robust_aggregation="trimmed")
    with pytest.raises(ValueError):
        InclusiveFL(catalog=toy_catalog(DEPTHS), clip_update_norm={"weak": -1.0})
    for method in ("local", "flexifed-max"):
        model = {"model": "vgg", "tiers": "vgg11:vgg13"} if method != "local" else {}
        with pytest.raises(ConfigError, match="robust-aggregation"):
            RunConfig.from_flower(
                {"method": method, "robust-aggregation": "median", "tier-proportions": "1:1", **model}
            )


def test_median_is_refused_for_pfedknow_before_its_strategy_is_built() -> None:
    with pytest.raises(ConfigError, match=r"'median' is not defined for method 'pfedknow' \(its own aggregation\)"):
        RunConfig.from_flower({**PFEDKNOW_BASE, "robust-aggregation": "median"})


def test_clip_config_one_value_or_one_per_tier() -> None:
    assert RunConfig.from_flower({"clip-update-norm": 5}).clip_bounds == {"weak": 5.0, "medium": 5.0, "strong": 5.0}
    assert RunConfig.from_flower({"clip-update-norm": "1:0:3.5"}).clip_bounds == {
        "weak": 1.0,
        "medium": 0.0,
        "strong": 3.5,
    }
    for bad in ("1:2", "-1", "x", "inf"):
        with pytest.raises(ConfigError, match="clip-update-norm"):
            RunConfig.from_flower({"clip-update-norm": bad})


def test_reply_claiming_more_examples_than_its_handshake_is_rejected() -> None:
    validate_examples_claim(10, 10)
    validate_examples_claim(10**6, 0)  # unknown: not checked
    with pytest.raises(ReplyRejected, match="exceeds"):
        validate_examples_claim(11, 10)
    s = make()
    s.profiles[1] = NodeProfile(1, "strong", 100.0, 20, True, "strong", "")
    before = {k: t.clone() for k, t in s.state["strong"].items()}
    s.aggregate_train(1, [reply(sent(s, 1, "strong"), trained(s.state["strong"], 1.0), num_examples=20_000)])
    assert len(s.report(1).rejected) == 1 and "handshake" in s.report(1).rejected[0]
    assert all(torch.equal(t, s.state["strong"][k]) for k, t in before.items())
