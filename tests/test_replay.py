"""The replay fingerprint and guard (strategies/replay.py) on exact cases."""

from __future__ import annotations

import pytest
import torch

from experiment.protocol import ReplyRejected
from strategies.replay import SAMPLE, ReplayGuard, weights_fingerprint


def test_fingerprint_is_equal_for_equal_weights_and_differs_on_any_sampled_change() -> None:
    w = {"a": torch.arange(10_000, dtype=torch.float32), "b": torch.ones(3, 4)}
    same = {"b": torch.ones(3, 4), "a": torch.arange(10_000, dtype=torch.float32)}  # order does not matter
    assert weights_fingerprint(w) == weights_fingerprint(same)
    step = 10_000 // SAMPLE  # 2: every other element of "a" is sampled
    changed = {"a": w["a"].clone(), "b": w["b"]}
    changed["a"][step * 7] += 1.0
    assert weights_fingerprint(changed) != weights_fingerprint(w)
    small = {"a": w["a"], "b": w["b"].clone()}
    small["b"][2, 3] = 1.0 + 2**-23  # a tensor below SAMPLE elements is hashed whole: one ulp counts
    assert weights_fingerprint(small) != weights_fingerprint(w)


@pytest.mark.parametrize(
    "other",
    [
        {"a": torch.ones(4, 3)},  # same bytes, another shape
        {"a": torch.ones(12, dtype=torch.float64)},  # another dtype
        {"x": torch.ones(12)},  # another name
    ],
)
def test_fingerprint_covers_name_shape_and_dtype(other: dict[str, torch.Tensor]) -> None:
    assert weights_fingerprint({"a": torch.ones(12)}) != weights_fingerprint(other)


def test_fingerprint_of_an_unsampled_element_is_unchanged() -> None:
    """The documented limit: an element between samples does not change the fingerprint."""
    w = {"a": torch.zeros(3 * SAMPLE)}
    altered = {"a": w["a"].clone()}
    altered["a"][1] = 5.0  # the stride is 3: elements 0, 3, 6, ... are sampled
    assert weights_fingerprint(altered) == weights_fingerprint(w)


def test_guard_rejects_a_later_round_only_and_survives_a_checkpoint() -> None:
    guard = ReplayGuard()
    w = {"a": torch.ones(2)}
    fp = weights_fingerprint(w)
    assert guard.check(w, 1) == fp
    guard.accept(fp, 1)
    assert guard.check(w, 1) == fp  # a second node of the same round with the same weights
    guard.accept(fp, 1)
    with pytest.raises(ReplyRejected, match="accepted in round 1"):
        guard.check(w, 2)
    restored = ReplayGuard.from_state(guard.state())
    assert restored.seen == {fp: 1}
    with pytest.raises(ReplyRejected):
        restored.check(w, 5)
