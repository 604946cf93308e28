"""Every kind of bad reply is rejected and leaves the global state bit-identical."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord

from strategies.inclusivefl import InclusiveFL
from strategies.round_sums import GroupMeans
from tests.toy import constant_state, error_reply, reply, sent, toy_catalog, trained

DEPTHS = {"weak": 1, "medium": 2, "strong": 3}


def make_strategy() -> InclusiveFL:
    cat = toy_catalog(DEPTHS)
    s = InclusiveFL(catalog=cat, beta=0.2)
    state = constant_state(cat, 0.5)
    s.set_state(state)
    return s


def good_replies(s: InclusiveFL) -> list:
    out = []
    for i, (node, variant) in enumerate(((11, "weak"), (12, "medium"), (13, "strong"), (14, "strong"))):
        out.append(reply(sent(s, node, variant), trained(s.state[variant], 0.1 * (i + 1)), num_examples=10 + i))
    return out


def arrays_of(s: InclusiveFL, variant: str) -> dict[str, np.ndarray]:
    return trained(s.state[variant], 1.0)


def _missing_key(s):
    a = arrays_of(s, "medium")
    a.pop("classifier.weight")
    return reply(sent(s, 21, "medium"), a)


def _extra_key(s):
    a = arrays_of(s, "medium")
    a["bert.encoder.layer.7.w"] = np.ones(2, np.float32)
    return reply(sent(s, 21, "medium"), a)


def _wrong_shape(s):
    a = arrays_of(s, "medium")
    a["bert.embeddings.e"] = np.ones(3, np.float32)
    return reply(sent(s, 21, "medium"), a)


def _wrong_dtype(s):
    a = arrays_of(s, "medium")
    a["bert.embeddings.e"] = np.ones(2, np.float64)
    return reply(sent(s, 21, "medium"), a)


def _nan(s):
    a = arrays_of(s, "medium")
    a["bert.encoder.layer.0.w"] = np.array([np.nan, 1.0], np.float32)
    return reply(sent(s, 21, "medium"), a)


def _inf(s):
    a = arrays_of(s, "strong")
    a["classifier.weight"] = np.array([np.inf, 1.0], np.float32)
    return reply(sent(s, 21, "strong"), a)


def _header_lies(s):
    a = ArrayRecord({k: Array(v) for k, v in arrays_of(s, "weak").items()})
    good = a["bert.embeddings.e"]
    a["bert.embeddings.e"] = Array(dtype="float32", shape=(2,), stype=good.stype, data=np.ones(3, np.float32).tobytes())
    return reply(sent(s, 21, "weak"), a)


def _oversized(s):
    # the right keys, one tensor ~1 MB instead of 8 bytes: refused before any tensor is read
    a = arrays_of(s, "weak")
    a["bert.embeddings.e"] = np.ones(2**18, np.float32)
    return reply(sent(s, 21, "weak"), a)


def _examples(value):
    return lambda s: reply(sent(s, 21, "weak"), arrays_of(s, "weak"), num_examples=value)


def _wrong_variant(s):
    # node was sent "weak" but answers with a full "medium" model
    return reply(sent(s, 21, "weak"), arrays_of(s, "medium"), variant="medium")


def _weak_arrays_for_medium(s):
    return reply(sent(s, 21, "medium"), arrays_of(s, "weak"))


def _wrong_round(s):
    return reply(sent(s, 21, "weak"), arrays_of(s, "weak"), server_round=7)


def _impostor(s):
    return reply(sent(s, 21, "weak"), arrays_of(s, "weak"), src_node_id=99)


def _unknown_message(s):
    # the reply answers a message id this round never sent
    return reply(sent(s, 21, "weak"), arrays_of(s, "weak"), reply_to="never-sent")


def _error(s):
    return error_reply(sent(s, 21, "strong"))


BAD: dict[str, Callable] = {
    "missing key": _missing_key,
    "extra key": _extra_key,
    "wrong shape": _wrong_shape,
    "wrong dtype": _wrong_dtype,
    "NaN": _nan,
    "Inf": _inf,
    "payload contradicts header": _header_lies,
    "oversized payload": _oversized,
    "zero examples": _examples(0),
    "negative examples": _examples(-5),
    "fractional examples": _examples(2.5),
    "absurd examples": _examples(10**12),
    "variant not sent": _wrong_variant,
    "arrays of another variant": _weak_arrays_for_medium,
    "wrong round": _wrong_round,
    "reply from another node": _impostor,
    "reply to unknown message": _unknown_message,
    "error reply": _error,
}


def run_round(bad: Callable | None, *, held: bool = True) -> tuple[InclusiveFL, dict]:
    """One round with ``bad``'s reply third; ``held=False`` streams the replies from a generator."""
    torch.manual_seed(0)
    s = make_strategy()
    replies = good_replies(s)
    if bad is not None:
        replies.insert(2, bad(s))
    s.aggregate_train(1, replies if held else (r for r in replies))
    return s, s.report(1).__dict__


@pytest.mark.parametrize("held", [True, False], ids=["held", "streamed"])
@pytest.mark.parametrize("kind", list(BAD))
def test_bad_reply_is_rejected_and_state_unchanged(kind: str, held: bool) -> None:
    clean, _ = run_round(None)
    dirty, report = run_round(BAD[kind], held=held)
    assert len(report["rejected"]) + len(report["failed"]) == 1, report
    assert dirty.report(1).groups == clean.report(1).groups, "the bad reply was counted"
    for variant, params in clean.state.items():
        for name, t in params.items():
            assert torch.equal(t, dirty.state[variant][name]), (kind, variant, name)
    for variant in clean.adam:
        assert clean.adam[variant].step == dirty.adam[variant].step


def test_dead_node_error_from_superlink_is_reported_with_real_node_id() -> None:
    s = make_strategy()
    rec = sent(s, 4242, "strong")
    s.aggregate_train(1, [error_reply(rec, code=5, reason="heartbeat", src_node_id=1)])
    failed = s.report(1).failed
    assert len(failed) == 1 and "node 4242" in failed[0] and "code 5" in failed[0]


def test_round_without_replies_keeps_state() -> None:
    s = make_strategy()
    before = {v: {k: t.clone() for k, t in p.items()} for v, p in s.state.items()}
    s.aggregate_train(1, [])
    for v, p in before.items():
        for k, t in p.items():
            assert torch.equal(t, s.state[v][k])


def test_non_finite_reason_is_the_same_held_or_streamed() -> None:
    """Held replies are checked through their sums, streamed ones one by one: same verdict."""
    reasons = [run_round(_nan, held=held)[1]["rejected"] for held in (True, False)]
    assert reasons[0] == reasons[1] == ["node 21 (medium): bert.encoder.layer.0.w: contains NaN or Inf"]


def test_finiteness_is_deferred_only_where_the_sums_can_be_rebuilt() -> None:
    s = make_strategy()
    replies = good_replies(s)
    assert s.defers_finiteness(replies)
    assert not s.defers_finiteness(iter(replies))  # a stream is never held: check each reply
    clipped = InclusiveFL(catalog=toy_catalog(DEPTHS), beta=0.2, clip_update_norm={"strong": 1.0})
    assert not clipped.defers_finiteness(replies)

    class KeptElsewhere(GroupMeans):  # a fold that also writes outside the sums: declared, never guessed
        rebuildable = False

    class OwnSums(InclusiveFL):  # folds into sums of its own, which a failed check could not rebuild
        def new_round_sums(self) -> KeptElsewhere:
            return KeptElsewhere()

    assert not OwnSums(catalog=toy_catalog(DEPTHS), beta=0.2).defers_finiteness(replies)


def test_finite_replies_whose_sum_overflows_discard_the_round() -> None:
    s = make_strategy()
    before = {v: {k: t.clone() for k, t in p.items()} for v, p in s.state.items()}
    huge = {k: np.full(v.shape, 3e38, np.float32) for k, v in s.state["strong"].items()}
    replies = [reply(sent(s, node, "strong"), huge) for node in (31, 32)]
    s.aggregate_train(1, replies)
    assert s.report(1).rejected == ["the weighted sums overflow float32 (every reply finite); the round is discarded"]
    for v, p in before.items():
        for k, t in p.items():
            assert torch.equal(t, s.state[v][k]), (v, k)


def test_oversized_payload_names_its_bytes_and_the_bound() -> None:
    _, report = run_round(_oversized)
    (reason,) = report["rejected"]
    assert "payload of" in reason and "exceeds the" in reason, reason


def test_a_replayed_reply_is_rejected_in_a_later_round_and_leaves_the_state_unchanged() -> None:
    """Node 21 sends in round 2 the weights node 11 had sent in round 1, echoing round 2."""
    s = make_strategy()
    first = trained(s.state["weak"], 0.1)
    s.aggregate_train(1, [reply(sent(s, 11, "weak"), first, num_examples=10)])
    clean = make_strategy()
    clean.set_state(s.state)
    replayed = reply(sent(s, 21, "weak"), first, num_examples=10, server_round=2)
    honest = [reply(sent(x, 12, "medium"), trained(x.state["medium"], 0.3), server_round=2) for x in (s, clean)]
    s.aggregate_train(2, [honest[0], replayed])
    clean.aggregate_train(2, [honest[1]])
    (reason,) = s.report(2).rejected
    assert "node 21 (weak): replays the weights of a reply accepted in round 1" in reason, reason
    for variant, params in clean.state.items():
        for name, t in params.items():
            assert torch.equal(t, s.state[variant][name]), (variant, name)


def test_the_same_weights_from_two_nodes_in_one_round_are_not_a_replay() -> None:
    s = make_strategy()
    same = trained(s.state["weak"], 0.1)
    s.aggregate_train(1, [reply(sent(s, 11, "weak"), same), reply(sent(s, 12, "weak"), same)])
    assert s.report(1).rejected == []
