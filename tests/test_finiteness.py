"""A NaN reply is rejected the same way whether the strategy checks it alone or through the sums.

Held replies (a list, as Flower's ``send_and_receive`` returns) are checked once through the
round's sums where the strategy can rebuild them (``defers_finiteness``); streamed ones reply by
reply.  Either way the poisoned reply is rejected with the same reason and the model ends
bit-identical to a round without it.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import pytest
import torch
from flwr.app import Array, ArrayRecord, Message

from bench.aggregation import Round, build_round

POISONED = 1  # index of the reply carrying a NaN


def _poison(msg: Message) -> None:
    """Replace the reply's first tensor by one holding a NaN (a new record: the pool is shared)."""
    rec = msg.content["arrays"]
    assert isinstance(rec, ArrayRecord)
    name = next(iter(rec.keys()))
    bad = rec[name].numpy().copy()
    bad.flat[0] = np.nan
    msg.content["arrays"] = ArrayRecord({k: Array(bad) if k == name else a for k, a in rec.items()})


def _round(method: str, *, poison: bool) -> Round:
    r = build_round("tiny", method, 4, scenario="mixed")
    if poison:
        _poison(r.replies[POISONED])
    return r


def _state(r: Round, replies: Iterable[Message]) -> dict[str, dict[str, torch.Tensor]]:
    r.strategy.aggregate_train(1, replies)
    return {v: {k: t.clone() for k, t in p.items()} for v, p in r.strategy.state.items()}


@pytest.mark.parametrize("method", ["inclusivefl", "heterofl", "flexifed-max", "flexifed-basic", "all-large"])
def test_nan_reply_rejected_alike_held_or_streamed(method: str) -> None:
    ref = _round(method, poison=False)
    del ref.replies[POISONED]
    expected = _state(ref, ref.replies)
    assert ref.strategy.report(1).rejected == []
    for held in (True, False):
        r = _round(method, poison=True)
        assert r.strategy.defers_finiteness(r.replies) is (method != "flexifed-basic")
        got = _state(r, r.replies if held else iter(r.replies))
        rejected = r.strategy.report(1).rejected
        node, variant = 1000 + POISONED, r.variants[POISONED]
        assert len(rejected) == 1 and rejected[0].startswith(f"node {node} ({variant}): "), (held, rejected)
        assert rejected[0].endswith("contains NaN or Inf"), rejected
        assert r.strategy.report(1).groups == ref.strategy.report(1).groups, "the rejected reply was counted"
        for v, params in expected.items():
            for k, t in params.items():
                assert torch.equal(got[v][k], t), (method, held, v, k)
