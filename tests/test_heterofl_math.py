"""Exact-value tests of the HeteroFL / FedRolex math on tiny tensors."""

from __future__ import annotations

import pytest
import torch

from strategies.heterofl import (
    CoverageMean,
    WidthRules,
    coverage_aggregate,
    extract_submodel,
    extract_with_indices,
    group_index_sets,
    rolling_offset,
    submodel_shapes,
    width_indices,
)
from strategies.streaming import StreamingMean

Params = dict[str, torch.Tensor]


def t(*rows: object) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)


def idx(*xs: int) -> torch.Tensor:
    return torch.tensor(xs, dtype=torch.int64)


def mlp() -> Params:
    """fc1: 3 inputs -> 4 hidden, fc2: 4 hidden -> 2 classes, all values distinct."""
    return {
        "fc1.weight": torch.arange(12, dtype=torch.float32).view(4, 3),
        "fc1.bias": t(100, 101, 102, 103),
        "fc2.weight": torch.arange(200, 208, dtype=torch.float32).view(2, 4),
        "fc2.bias": t(300, 301),
    }


RULES = WidthRules(
    {
        "fc1.weight": ("fc1.out", None),
        "fc1.bias": ("fc1.out",),
        "fc2.weight": (None, "fc1.out"),
        "fc2.bias": (None,),
    }
)


def assert_params_equal(got: Params, want: Params) -> None:
    assert got.keys() == want.keys()
    for k in want:
        assert got[k].shape == want[k].shape, k
        assert torch.equal(got[k], want[k]), (k, got[k], want[k])


# --- index sets ---------------------------------------------------------------------------


def test_leading_slice_and_ceil_rounding() -> None:
    assert torch.equal(width_indices(4, 0.5), idx(0, 1))
    assert torch.equal(width_indices(10, 0.25), idx(0, 1, 2))  # ceil(2.5) = 3
    assert torch.equal(width_indices(3, 0.5), idx(0, 1))  # ceil(1.5) = 2
    assert torch.equal(width_indices(5, 1.0), idx(0, 1, 2, 3, 4))
    assert torch.equal(width_indices(7, 0.01), idx(0))  # at least one unit
    assert width_indices(100, 0.07).numel() == 7  # 0.07 * 100 == 7.000000000000001 in floats
    assert width_indices(768, 456 / 768).numel() == 456
    assert width_indices(4, 0.5).dtype == torch.int64


def test_rolling_window_wraps_around() -> None:
    assert torch.equal(width_indices(5, 0.6, offset=1), idx(1, 2, 3))
    assert torch.equal(width_indices(5, 0.6, offset=4), idx(4, 0, 1))
    assert torch.equal(width_indices(5, 0.6, offset=7), idx(2, 3, 4))  # offset taken mod 5
    assert torch.equal(width_indices(4, 1.0, offset=2), idx(2, 3, 0, 1))


def test_keep_returns_every_index() -> None:
    assert torch.equal(width_indices(3, 0.5, keep=True), idx(0, 1, 2))
    assert torch.equal(width_indices(3, 0.5, offset=2, keep=True), idx(0, 1, 2))


@pytest.mark.parametrize("rate", [0.0, -0.5, 1.5])
def test_rate_outside_unit_interval_is_rejected(rate: float) -> None:
    with pytest.raises(ValueError, match="rate"):
        width_indices(4, rate)


def test_rolling_offset_moves_one_index_per_round() -> None:
    assert [rolling_offset(r, 4) for r in range(1, 10)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    with pytest.raises(ValueError, match="server_round"):
        rolling_offset(0, 4)
    with pytest.raises(ValueError, match="full_dim"):
        rolling_offset(1, 0)


# --- rules and extraction -----------------------------------------------------------------


def test_chain_rules_fix_the_input_and_class_axes() -> None:
    rules = WidthRules.chain(mlp(), ["fc1", "fc2"])
    assert dict(rules.axes) == dict(RULES.axes)
    assert rules.groups == ("fc1.out",)
    assert rules.group_sizes(mlp()) == {"fc1.out": 4}


def test_chain_rules_of_a_conv_net_reduce_out_and_in_channels() -> None:
    full = {
        "conv1.weight": torch.zeros(4, 1, 3, 3),
        "conv1.bias": torch.zeros(4),
        "conv2.weight": torch.zeros(6, 4, 3, 3),
        "conv2.bias": torch.zeros(6),
        "fc.weight": torch.zeros(10, 6),
        "fc.bias": torch.zeros(10),
    }
    rules = WidthRules.chain(full, ["conv1", "conv2", "fc"])
    assert rules.axes["conv2.weight"] == ("conv2.out", "conv1.out", None, None)
    assert rules.axes["conv1.weight"] == ("conv1.out", None, None, None)
    assert rules.axes["fc.weight"] == (None, "conv2.out")
    sub = extract_submodel(full, rules, 0.5)
    assert {k: tuple(v.shape) for k, v in sub.items()} == {
        "conv1.weight": (2, 1, 3, 3),
        "conv1.bias": (2,),
        "conv2.weight": (3, 2, 3, 3),
        "conv2.bias": (3,),
        "fc.weight": (10, 3),
        "fc.bias": (10,),
    }
    assert submodel_shapes(rules, full, group_index_sets(rules, full, 0.5)) == {
        k: tuple(v.shape) for k, v in sub.items()
    }


def test_rules_must_match_the_model() -> None:
    full = mlp()
    with pytest.raises(ValueError, match="no rule for"):
        WidthRules({k: v for k, v in RULES.axes.items() if k != "fc2.bias"}).group_sizes(full)
    with pytest.raises(ValueError, match="axis groups"):
        WidthRules({**RULES.axes, "fc2.bias": ()}).group_sizes(full)
    with pytest.raises(ValueError, match="has size 4 and 2"):
        WidthRules({**RULES.axes, "fc2.bias": ("fc1.out",)}).group_sizes(full)
    with pytest.raises(ValueError, match="belongs to 0"):
        WidthRules.chain(full, ["fc1"])


def test_extract_half_width_mlp() -> None:
    full = mlp()
    sub = extract_submodel(full, RULES, 0.5)
    assert_params_equal(
        sub,
        {
            "fc1.weight": t([0, 1, 2], [3, 4, 5]),  # 2 of 4 hidden units, all 3 inputs
            "fc1.bias": t(100, 101),
            "fc2.weight": t([200, 201], [204, 205]),  # both classes kept
            "fc2.bias": t(300, 301),
        },
    )
    assert all(v.is_contiguous() for v in sub.values())
    sub["fc2.bias"].add_(1.0)  # copies, not views
    sub["fc1.weight"].add_(1.0)
    assert_params_equal(full, mlp())


def test_extract_full_rate_is_the_full_model() -> None:
    assert_params_equal(extract_submodel(mlp(), RULES, 1.0), mlp())


def test_extract_fedrolex_window_takes_the_rolled_units() -> None:
    sub = extract_submodel(mlp(), RULES, 0.5, offset=3)  # hidden units 3, 0
    assert_params_equal(
        sub,
        {
            "fc1.weight": t([9, 10, 11], [0, 1, 2]),
            "fc1.bias": t(103, 100),
            "fc2.weight": t([203, 200], [207, 204]),
            "fc2.bias": t(300, 301),
        },
    )
    assert_params_equal(extract_with_indices(mlp(), RULES, {"fc1.out": idx(3, 0)}), sub)


# --- coverage aggregation -----------------------------------------------------------------


def full_reply() -> Params:
    return {
        "fc1.weight": torch.ones(4, 3),
        "fc1.bias": t(1, 2, 3, 4),
        "fc2.weight": torch.full((2, 4), 2.0),
        "fc2.bias": t(1, 1),
    }


def half_reply() -> Params:
    return {
        "fc1.weight": torch.full((2, 3), 5.0),
        "fc1.bias": t(10, 20),
        "fc2.weight": t([6, 7], [8, 9]),
        "fc2.bias": t(5, 9),
    }


def test_coverage_mean_of_full_and_half_client() -> None:
    # weights 1 (rate 1.0) and 3 (rate 0.5); covered by both: (x_full + 3 x_half) / 4
    out = coverage_aggregate(mlp(), RULES, [(full_reply(), 1.0, 0, 1.0), (half_reply(), 0.5, 0, 3.0)])
    assert_params_equal(
        out,
        {
            "fc1.weight": t([4, 4, 4], [4, 4, 4], [1, 1, 1], [1, 1, 1]),  # rows 2, 3: full client only
            "fc1.bias": t(7.75, 15.5, 3, 4),
            "fc2.weight": t([5, 5.75, 2, 2], [6.5, 7.25, 2, 2]),
            "fc2.bias": t(4, 7),
        },
    )


def test_uncovered_elements_keep_their_value() -> None:
    full = mlp()
    out = coverage_aggregate(full, RULES, [(half_reply(), 0.5, 0, 1.0), (half_reply(), 0.5, 0, 2.0)])
    assert_params_equal(
        out,
        {
            "fc1.weight": t([5, 5, 5], [5, 5, 5], [6, 7, 8], [9, 10, 11]),
            "fc1.bias": t(10, 20, 102, 103),
            "fc2.weight": t([6, 7, 202, 203], [8, 9, 206, 207]),
            "fc2.bias": t(5, 9),
        },
    )
    assert_params_equal(full, mlp())  # inputs untouched


def test_no_replies_returns_the_previous_model() -> None:
    assert_params_equal(coverage_aggregate(mlp(), RULES, []), mlp())


def test_weight_two_equals_two_identical_replies() -> None:
    once = coverage_aggregate(mlp(), RULES, [(full_reply(), 1.0, 0, 1.0), (half_reply(), 0.5, 0, 2.0)])
    twice = coverage_aggregate(
        mlp(), RULES, [(full_reply(), 1.0, 0, 1.0), (half_reply(), 0.5, 0, 1.0), (half_reply(), 0.5, 0, 1.0)]
    )
    assert_params_equal(once, twice)


def test_reply_order_does_not_matter() -> None:
    replies = [(full_reply(), 1.0, 0, 1.0), (half_reply(), 0.5, 0, 3.0), (half_reply(), 0.5, 3, 2.0)]
    forward = coverage_aggregate(mlp(), RULES, replies)
    backward = coverage_aggregate(mlp(), RULES, replies[::-1])
    assert_params_equal(forward, backward)


def test_fedrolex_offsets_place_values_at_rolled_positions() -> None:
    # offset 3: sub-model unit 0 is hidden unit 3, unit 1 is hidden unit 0; units 1, 2 uncovered
    out = coverage_aggregate(mlp(), RULES, [(half_reply(), 0.5, 3, 1.0)])
    assert_params_equal(
        out,
        {
            "fc1.weight": t([5, 5, 5], [3, 4, 5], [6, 7, 8], [5, 5, 5]),
            "fc1.bias": t(20, 101, 102, 10),
            "fc2.weight": t([7, 201, 202, 6], [9, 205, 206, 8]),
            "fc2.bias": t(5, 9),
        },
    )
    # two half clients in consecutive rounds' windows (offsets 0 and 1) overlap on unit 1
    a = {k: torch.full_like(v, 1.0) for k, v in half_reply().items()}
    b = {k: torch.full_like(v, 4.0) for k, v in half_reply().items()}
    out = coverage_aggregate(mlp(), RULES, [(a, 0.5, rolling_offset(1, 4), 1.0), (b, 0.5, rolling_offset(2, 4), 2.0)])
    assert torch.equal(out["fc1.bias"], t(1, 3, 4, 103))
    assert torch.equal(out["fc2.weight"], t([1, 3, 4, 203], [1, 3, 4, 207]))


def test_full_rate_only_is_the_plain_weighted_mean() -> None:
    gen = torch.Generator().manual_seed(0)
    replies = [({k: torch.randn(v.shape, generator=gen) for k, v in mlp().items()}, w) for w in (1.0, 2.0, 5.0)]
    plain = StreamingMean()
    for params, w in replies:
        plain.add(params, w)
    out = coverage_aggregate(mlp(), RULES, [(p, 1.0, 0, w) for p, w in replies])
    want = plain.mean()
    assert out.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(out[k], want[k], rtol=1e-6, atol=1e-6)


def test_coverage_mean_streams_with_explicit_index_sets() -> None:
    acc = CoverageMean(mlp(), RULES)
    acc.add(half_reply(), {"fc1.out": idx(2, 3)}, 1.0)
    acc.add({"fc1.bias": t(7, 7)}, {"fc1.out": idx(3, 1)}, 1.0)  # partial reply: only fc1.bias
    assert acc.count == 2
    assert torch.equal(acc.coverage("fc1.bias"), t(0, 1, 1, 2))
    out = acc.result(mlp())
    assert torch.equal(out["fc1.bias"], t(100, 7, 10, 13.5))
    assert torch.equal(out["fc1.weight"], t([0, 1, 2], [3, 4, 5], [5, 5, 5], [5, 5, 5]))
    assert torch.equal(out["fc2.bias"], t(5, 9))


def test_bad_replies_are_rejected_before_anything_is_added() -> None:
    acc = CoverageMean(mlp(), RULES)
    good = {"fc1.out": idx(0, 1)}
    with pytest.raises(ValueError, match="weight"):
        acc.add(half_reply(), good, 0.0)
    with pytest.raises(ValueError, match="not in the model"):
        acc.add({**half_reply(), "fc3.bias": t(1)}, good, 1.0)
    with pytest.raises(ValueError, match="no index set"):
        acc.add(half_reply(), {}, 1.0)
    with pytest.raises(ValueError, match="repeated"):
        acc.add(half_reply(), {"fc1.out": idx(1, 1)}, 1.0)
    with pytest.raises(ValueError, match="within"):
        acc.add(half_reply(), {"fc1.out": idx(0, 4)}, 1.0)
    bad_shape = {**half_reply(), "fc2.weight": torch.zeros(2, 3)}
    with pytest.raises(ValueError, match=r"fc2.weight: shape \(2, 3\), expected \(2, 2\)"):
        acc.add(bad_shape, good, 1.0)
    assert acc.count == 0
    assert all(torch.equal(acc.coverage(n), torch.zeros_like(acc.coverage(n))) for n in acc.shapes)
    assert all(torch.equal(s, torch.zeros_like(s)) for s in acc.sums.values())


def test_integer_tensors_are_rejected() -> None:
    with pytest.raises(ValueError, match="floating-point"):
        CoverageMean({"n": torch.tensor(3)}, WidthRules({"n": ()}))
