"""Validation of client replies against the layout the server sent.

Every reply is checked completely *before* it touches an aggregate; a failed check
raises :class:`ReplyRejected` with the reason, the strategy logs it and drops the
reply, so a malformed or malicious reply can never corrupt the global model.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from torch import Tensor

from models.catalog import ParamSpec


class ReplyRejected(Exception):
    """A client reply failed validation; ``str(exc)`` is the reason."""


def _record(content: RecordDict, key: str, kind: type) -> object:
    if key not in content:
        raise ReplyRejected(f"reply has no {kind.__name__} under {key!r}")
    rec = content[key]
    if not isinstance(rec, kind):
        raise ReplyRejected(f"{key!r} is a {type(rec).__name__}, expected {kind.__name__}")
    return rec


def validate_arrays(arrays: ArrayRecord, expected: Mapping[str, ParamSpec]) -> dict[str, Tensor]:
    """Check keys, shapes, dtypes and finiteness; return the tensors.

    Parameters
    ----------
    arrays : ArrayRecord
        What the client sent.
    expected : Mapping[str, ParamSpec]
        Exactly the tensors the reply must contain.

    """
    got = set(arrays.keys())
    want = set(expected)
    if got != want:
        missing = sorted(want - got)[:3]
        extra = sorted(got - want)[:3]
        raise ReplyRejected(f"keys differ from the layout sent: missing {missing}, unexpected {extra}")
    out: dict[str, Tensor] = {}
    for name, spec in expected.items():
        arr = arrays[name]
        if tuple(arr.shape) != spec.shape:
            raise ReplyRejected(f"{name}: shape {tuple(arr.shape)} != {spec.shape}")
        if arr.dtype != spec.dtype:
            raise ReplyRejected(f"{name}: dtype {arr.dtype} != {spec.dtype}")
        try:
            nd = arr.numpy()
        except Exception as exc:  # corrupt payload bytes
            raise ReplyRejected(f"{name}: payload does not decode ({exc})") from exc
        if nd.shape != spec.shape or nd.dtype != np.dtype(spec.dtype):
            raise ReplyRejected(f"{name}: payload decodes to {nd.dtype}{nd.shape}, header lied")
        t = torch.from_numpy(np.ascontiguousarray(nd))
        if not bool(torch.isfinite(t).all()):
            raise ReplyRejected(f"{name}: contains NaN or Inf")
        out[name] = t
    return out


def validate_num_examples(metrics: MetricRecord, *, key: str, max_examples: int) -> int:
    """Return the example count: an integer in ``1 .. max_examples``."""
    if key not in metrics:
        raise ReplyRejected(f"metrics lack {key!r}")
    raw = metrics[key]
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ReplyRejected(f"{key} is not a number: {raw!r}")
    value = float(raw)
    if not math.isfinite(value) or value != int(value):
        raise ReplyRejected(f"{key} must be a whole number, got {raw!r}")
    if not 1 <= value <= max_examples:
        raise ReplyRejected(f"{key} = {raw!r} outside 1..{max_examples}")
    return int(value)


def validate_examples_claim(num_examples: int, reported: int) -> None:
    """Reject a reply claiming more training examples than its node reported in the handshake.

    A node's weight in every mean is its example count, so inflating it is the cheapest way
    to dominate an aggregate: ``num_examples <= reported`` is required whenever the node
    reported a positive count (``reported = 0`` means unknown and is not checked).
    """
    if reported > 0 and num_examples > reported:
        raise ReplyRejected(f"num-examples = {num_examples} exceeds the {reported} the node reported in the handshake")


def validate_config(content: RecordDict, *, variant: str, server_round: int) -> ConfigRecord:
    """Check the reply echoes the variant and round the server sent."""
    cfg = _record(content, "config", ConfigRecord)
    assert isinstance(cfg, ConfigRecord)
    if cfg.get("variant") != variant:
        raise ReplyRejected(f"reply is for variant {cfg.get('variant')!r}, node was sent {variant!r}")
    if cfg.get("server-round") != server_round:
        raise ReplyRejected(f"reply is for round {cfg.get('server-round')!r}, expected {server_round}")
    return cfg


def validate_train_reply(
    content: RecordDict,
    *,
    expected: Mapping[str, ParamSpec],
    variant: str,
    server_round: int,
    max_examples: int,
) -> tuple[dict[str, Tensor], int, MetricRecord]:
    """Validate a whole training reply; return ``(tensors, num_examples, metrics)``."""
    validate_config(content, variant=variant, server_round=server_round)
    metrics = _record(content, "metrics", MetricRecord)
    assert isinstance(metrics, MetricRecord)
    n = validate_num_examples(metrics, key="num-examples", max_examples=max_examples)
    arrays = _record(content, "arrays", ArrayRecord)
    assert isinstance(arrays, ArrayRecord)
    return validate_arrays(arrays, expected), n, metrics


def validate_evaluate_reply(
    content: RecordDict, *, variant: str, server_round: int, max_examples: int
) -> tuple[int, float, float]:
    """Validate an evaluation reply; return ``(num_examples, loss, accuracy)``."""
    validate_config(content, variant=variant, server_round=server_round)
    metrics = _record(content, "metrics", MetricRecord)
    assert isinstance(metrics, MetricRecord)
    n = validate_num_examples(metrics, key="num-examples", max_examples=max_examples)
    values = []
    for key in ("loss", "accuracy"):
        v = metrics.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ReplyRejected(f"{key} missing or not a finite number: {v!r}")
        values.append(float(v))
    if not 0.0 <= values[1] <= 1.0:
        raise ReplyRejected(f"accuracy {values[1]} outside [0, 1]")
    return n, values[0], values[1]
