"""Reply bookkeeping and handshake conclusions on exact numbers (strategies/replies.py, strategies/handshake.py)."""

from __future__ import annotations

from unittest.mock import Mock

import pytest
from flwr.app import Message

from strategies.handshake import NothingToTrain, check_someone_can_train, unchosen_variant_warnings
from strategies.profiles import NodeProfile
from strategies.replies import RoundReport, Sent, evaluation_means, match_reply, report_missing
from tests.toy import error_reply, reply


def sent_to(node: int, variant: str) -> Sent:
    msg = Mock(spec=Message)
    msg.metadata = Mock(message_id=f"to-{node}", dst_node_id=node)
    return Sent(msg, node, variant, 0)


def profile(node: int, variant: str | None, tier: str = "weak", reason: str = "") -> NodeProfile:
    return NodeProfile(node, tier, 100.0, 10, True, variant, reason)


def test_evaluation_means_weight_each_reply_by_its_examples() -> None:
    # small: (10 x 0.5 + 30 x 0.1) / 40 = 0.2 loss, (10 x 0.6 + 30 x 0.8) / 40 = 0.75 accuracy
    means = evaluation_means([("small", 10, 0.5, 0.6), ("large", 5, 2.0, 0.4), ("small", 30, 0.1, 0.8)])
    assert means == {
        "small": ((10 * 0.5 + 30 * 0.1) / (10 + 30), (10 * 0.6 + 30 * 0.8) / (10 + 30)),  # summed in reply order
        "large": (2.0, 0.4),
    }
    assert means["small"] == pytest.approx((0.2, 0.75))
    assert evaluation_means([]) == {}


def test_match_reply_accepts_the_addressed_node_and_reports_the_rest() -> None:
    report = RoundReport(1)
    rec = sent_to(3, "small")
    table = {rec.message.metadata.message_id: rec}
    assert match_reply(reply(rec, {}), table, report, "train") is rec
    assert match_reply(reply(rec, {}, src_node_id=4), table, report, "train") is None
    assert match_reply(reply(rec, {}, reply_to="elsewhere"), table, report, "train") is None
    assert match_reply(error_reply(rec, reason="boom"), table, report, "train") is None
    assert report.rejected == [
        "train reply for node 3 came from node 4",
        "train reply from node 3 answers no message of this round",
    ]
    assert report.failed == ["node 3 (small) train failed: code 5: boom"]
    report_missing(table, [], report, "evaluate")
    assert report.failed[-1] == "node 3 (small) evaluate failed: no reply within the round timeout"


def test_a_run_stops_only_when_every_connected_node_answered_and_declined() -> None:
    check_someone_can_train(1, [profile(1, None, reason="fits no variant"), None])  # node 2 may still answer
    check_someone_can_train(1, [profile(1, None, reason="fits no variant"), profile(2, "small")])
    with pytest.raises(NothingToTrain, match=r"all 2 connected nodes declined \(2 x tier weak: no local data"):
        check_someone_can_train(1, [profile(1, None, reason="no local data"), profile(2, None, reason="no local data")])


def test_a_variant_no_node_chose_is_warned_of_once() -> None:
    chose = [profile(1, "small"), profile(2, "small"), profile(3, None)]
    first = unchosen_variant_warnings(["small", "large"], chose, [])
    assert first == [
        "variant 'large' trains on no node: the 3 nodes so far chose (declined: 1, small: 2); "
        "in simulation tier-memory-mb='auto' gives each tier its own variant"
    ]
    assert unchosen_variant_warnings(["small", "large"], chose, first) == []
    assert unchosen_variant_warnings(["small"], chose, []) == []  # one variant: nothing to spread over
