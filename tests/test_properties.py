"""Property-based tests (hypothesis) of aggregation, validation and configuration."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from experiment.config import ConfigError, RunConfig
from strategies.inclusivefl import InclusiveFL
from strategies.streaming import StreamingMean
from strategies.validation import ReplyRejected, validate_train_reply
from tests.toy import constant_state, reply, sent, toy_catalog

DEPTHS = {"weak": 1, "medium": 2, "strong": 3}
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

finite = st.floats(-10, 10, allow_nan=False, allow_infinity=False, width=32)
weights = st.integers(1, 50)


@FAST
@given(st.lists(st.tuples(arrays(np.float32, (3,), elements=finite), weights), min_size=1, max_size=6), st.randoms())
def test_streaming_mean_is_order_invariant(items: list[tuple[np.ndarray, int]], rnd: Any) -> None:
    a, b = StreamingMean(), StreamingMean()
    for x, w in items:
        a.add({"x": torch.from_numpy(x)}, w)
    shuffled = list(items)
    rnd.shuffle(shuffled)
    for x, w in shuffled:
        b.add({"x": torch.from_numpy(x)}, w)
    torch.testing.assert_close(a.mean()["x"], b.mean()["x"], atol=1e-5, rtol=1e-5)


@FAST
@given(st.lists(st.tuples(arrays(np.float32, (3,), elements=finite), weights), min_size=1, max_size=6))
def test_take_mean_divides_the_sums_in_place(items: list[tuple[np.ndarray, int]]) -> None:
    acc = StreamingMean()
    for x, w in items:
        acc.add({"x": torch.from_numpy(x), "n": torch.tensor([w])}, w)
    expected, storage = acc.mean(), acc.sums["x"].data_ptr()
    taken = acc.take_mean()
    assert torch.equal(taken["x"], expected["x"]) and torch.equal(taken["n"], expected["n"])
    assert taken["x"].data_ptr() == storage, "a float sum is divided in place"
    assert taken["n"].is_floating_point(), "an integer sum is divided into a new float tensor"
    assert acc.sums == {} and acc.count == 0


def _client_arrays(state: dict[str, torch.Tensor], shift: np.ndarray) -> dict[str, np.ndarray]:
    return {k: (v.numpy() + shift).astype(np.float32) for k, v in state.items()}


def _aggregate(replies_spec: list[tuple[str, np.ndarray, int]], order: list[int] | None = None) -> InclusiveFL:
    cat = toy_catalog(DEPTHS)
    s = InclusiveFL(catalog=cat, beta=0.3)
    s.set_state(constant_state(cat, 0.25))
    built = [
        reply(sent(s, 100 + i, v), _client_arrays(s.state[v], shift), num_examples=n)
        for i, (v, shift, n) in enumerate(replies_spec)
    ]
    if order is not None:
        built = [built[i] for i in order]
    s.aggregate_train(1, built)
    return s


reply_specs = st.lists(
    st.tuples(st.sampled_from(list(DEPTHS)), arrays(np.float32, (2,), elements=finite), weights),
    min_size=1,
    max_size=5,
)


@FAST
@given(reply_specs, st.randoms())
def test_aggregation_is_invariant_to_reply_order(specs: list[tuple[str, np.ndarray, int]], rnd: Any) -> None:
    order = list(range(len(specs)))
    rnd.shuffle(order)
    a, b = _aggregate(specs), _aggregate(specs, order)
    for v, params in a.state.items():
        for k, t in params.items():
            torch.testing.assert_close(t, b.state[v][k], atol=1e-5, rtol=1e-5)


@FAST
@given(reply_specs)
def test_a_reply_of_weight_two_equals_two_identical_replies(specs: list[tuple[str, np.ndarray, int]]) -> None:
    doubled = [(v, x, 2 * n) for v, x, n in specs]
    twice = [(v, x, n) for v, x, n in specs for _ in range(2)]
    a, b = _aggregate(doubled), _aggregate(twice)
    # examples weigh clients within a tier; tiers weigh shared layers by their client counts,
    # which double on both sides alike, so the whole state must agree
    for v, params in a.state.items():
        for k, t in params.items():
            torch.testing.assert_close(t, b.state[v][k], atol=1e-5, rtol=1e-5)


@FAST
@given(reply_specs)
def test_group_without_replies_is_unchanged(specs: list[tuple[str, np.ndarray, int]]) -> None:
    specs = [(v, x, n) for v, x, n in specs if v != "medium"]
    s = _aggregate(specs)
    before = constant_state(toy_catalog(DEPTHS), 0.25)["medium"]
    assert s.adam["medium"].step == 0
    # medium's isolated layer and head are its own: nobody else may touch them
    for k in ("bert.encoder.layer.1.w", "classifier.weight"):
        assert torch.equal(s.state["medium"][k], before[k])


# ------------------------------------------------------------------ fuzzing the validator
names = st.sampled_from(
    ["bert.embeddings.e", "bert.encoder.layer.0.w", "bert.encoder.layer.1.w", "classifier.weight", "x", ""]
)
bad_arrays = st.one_of(
    arrays(st.sampled_from([np.float32, np.float64, np.int64, np.float16]), st.sampled_from([(2,), (3,), (2, 1), ()])),
    arrays(np.float32, (2,), elements=st.floats(allow_nan=True, allow_infinity=True, width=32)),
)
metric_values = st.one_of(
    st.integers(-(10**13), 10**13), st.floats(allow_nan=True, allow_infinity=True), st.lists(st.integers(), max_size=2)
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(names, bad_arrays, max_size=5),
    st.dictionaries(st.sampled_from(["num-examples", "train-loss", "zzz"]), metric_values, max_size=3),
    st.dictionaries(
        st.sampled_from(["variant", "server-round", "junk"]),
        st.one_of(st.sampled_from(["medium", "weak", ""]), st.integers(-2, 3), st.booleans()),
        max_size=3,
    ),
    st.booleans(),
)
def test_fuzzed_replies_never_escape_and_never_touch_state(
    arr: dict[str, np.ndarray], metrics: dict[str, Any], cfg: dict[str, Any], drop_records: bool
) -> None:
    cat = toy_catalog(DEPTHS)
    s = InclusiveFL(catalog=cat, beta=0.2)
    s.set_state(constant_state(cat, 0.5))
    expected = cat.get("medium").layout.by_name()
    content = RecordDict()
    if not drop_records:
        content["arrays"] = ArrayRecord({k: Array(v) for k, v in arr.items()})
        try:
            content["metrics"] = MetricRecord(metrics)
        except (TypeError, ValueError):
            content["metrics"] = MetricRecord({})
        try:
            content["config"] = ConfigRecord(cfg)
        except (TypeError, ValueError):
            content["config"] = ConfigRecord({})
    try:
        validate_train_reply(content, expected=expected, variant="medium", server_round=1, max_examples=10**6)
        accepted = True
    except ReplyRejected:
        accepted = False
    msg = reply(sent(s, 7, "medium"), ArrayRecord())
    msg.content = content
    s.aggregate_train(1, [msg])
    report = s.report(1)
    if not accepted:
        assert len(report.rejected) == 1
        for v, params in constant_state(cat, 0.5).items():
            for k, t in params.items():
                assert torch.equal(s.state[v][k], t)


# ------------------------------------------------------------------ fuzzing the run config
BASE = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["tool"]["flwr"]["app"][
    "config"
]
INVALID: dict[str, st.SearchStrategy[Any]] = {
    "num-server-rounds": st.integers(max_value=0),
    "beta": st.one_of(st.floats(max_value=-1e-9), st.floats(min_value=1.0001, allow_infinity=False)),
    "fraction-train": st.one_of(st.floats(max_value=0.0, allow_infinity=False), st.floats(min_value=1.0001)),
    "server-lr": st.floats(max_value=0.0, allow_infinity=False),
    "batch-size": st.integers(max_value=0),
    "method": st.text(min_size=1).filter(
        lambda m: m not in {"inclusivefl", "all-large", "all-small", "exclusive", "local"}
    ),
    "optimizer": st.text().filter(lambda m: m not in {"adamw", "sgd"}),
    "tier-layers": st.sampled_from(["6:4:2", "2:2:6", "0:2:4", "2:4", "a:b:c", ""]),
    "tier-memory-mb": st.sampled_from(["-5:10:20", "1:2", "x:y:z", "0:0:0"]),
}


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(INVALID)).flatmap(lambda k: st.tuples(st.just(k), INVALID[k])))
def test_every_invalid_config_value_fails_naming_the_key(item: tuple[str, Any]) -> None:
    key, value = item
    with pytest.raises(ConfigError) as err:
        RunConfig.from_flower({**BASE, key: value})
    assert key in str(err.value), str(err.value)
