"""The round sums every method folds its replies into (strategies/round_sums.py), on exact numbers."""

from __future__ import annotations

from collections.abc import Mapping

import pytest
import torch
from flwr.app import Metadata, MetricRecord, RecordDict
from flwr.app.message import make_message
from torch import Tensor

from strategies.replies import Accepted, Sent
from strategies.round_sums import GroupMeans, MedianNotSupported, NodeModels, by_replies


def accepted(node: int, variant: str, value: float, examples: int) -> tuple[Accepted, dict[str, Tensor]]:
    """An accepted reply of ``node`` with one tensor ``w = [value, 2 value]`` and ``examples``."""
    meta = Metadata(
        run_id=1, message_id="", src_node_id=0, dst_node_id=node, reply_to_message_id="",
        group_id="", created_at=0.0, ttl=60.0, message_type="train",
    )  # fmt: skip
    sent = Sent(make_message(metadata=meta, content=RecordDict()), node, variant, 0)
    tensors = {"w": torch.tensor([value, 2 * value])}
    return Accepted(sent, tensors, examples, MetricRecord(), 0), tensors


def test_group_means_are_example_weighted_per_variant_and_a_median_weighs_its_group() -> None:
    sums = GroupMeans()
    for node, variant, value, n in [(1, "weak", 1.0, 1), (2, "weak", 4.0, 3), (3, "strong", 2.0, 5)]:
        sums.add(*accepted(node, variant, value, n))
    sums.add_group("strong", {"w": torch.tensor([8.0, 16.0])}, 15.0, 3)  # a median standing for 3 replies
    assert sums.rebuildable and sums.is_finite()
    means = sums.result()
    assert torch.equal(means["weak"]["w"], torch.tensor([3.25, 6.5]))  # (1 x 1 + 3 x 4) / 4
    assert torch.equal(means["strong"]["w"], torch.tensor([6.5, 13.0]))  # (5 x 2 + 15 x 8) / 20


def test_group_means_into_one_group_weighted_by_reply_count() -> None:
    sums = GroupMeans(group_of=lambda variant: "global", weight=by_replies)
    sums.add(*accepted(1, "d1", 1.0, 100))
    sums.add(*accepted(2, "d2", 4.0, 1))
    sums.add_group("d3", {"w": torch.tensor([10.0, 20.0])}, 7.0, 2)  # counts as 2 replies
    means = sums.result()
    assert list(means) == ["global"]
    assert torch.equal(means["global"]["w"], torch.tensor([6.25, 12.5]))  # (1 + 4 + 2 x 10) / 4


def test_a_non_finite_sum_is_seen() -> None:
    sums = GroupMeans()
    sums.add(*accepted(1, "weak", float("inf"), 1))
    assert not sums.is_finite()


def test_node_models_keep_each_reply_and_are_not_rebuildable() -> None:
    kept: dict[int, Mapping[str, Tensor]] = {}
    sums = NodeModels(lambda sent, tensors: kept.__setitem__(sent.node_id, tensors))
    sums.add(*accepted(7, "weak", 3.0, 2))
    assert not sums.rebuildable and sums.is_finite()
    assert torch.equal(kept[7]["w"], torch.tensor([3.0, 6.0]))
    with pytest.raises(MedianNotSupported):
        sums.add_group("weak", {"w": torch.tensor([1.0, 2.0])}, 1.0, 1)
