"""Validation of client replies against the layout the server sent.

Every reply is checked completely *before* it touches an aggregate (finiteness aside, where
the caller checks its round-local sums instead and goes back to the replies when one is not
finite: ``check_finite``); a failed check raises :class:`ReplyRejected` with the reason, the
strategy logs it and drops the reply, so a malformed or malicious reply can never corrupt the
global model.
"""

from __future__ import annotations

import functools
import io
import math
import warnings
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import ArrayRecord, MetricRecord, RecordDict
from torch import Tensor

from experiment.protocol import (
    ARRAYS,
    METRICS,
    ReplyRejected,
    record_of,
    validate_echo,
    validate_evaluate_metrics,
    validate_examples_claim,
    validate_num_examples,
)
from models.catalog import ParamSpec

__all__ = [
    "ReplyRejected",
    "all_finite",
    "decode_array",
    "max_payload_bytes",
    "non_finite_reason",
    "validate_arrays",
    "validate_evaluate_reply",
    "validate_examples_claim",
    "validate_num_examples",
    "validate_train_reply",
]

# decode_array's tensors are views of the reply's immutable payload bytes, never written to
# (see its docstring).  Torch warns about wrapping a non-writable array once per process:
# spend that one warning here, silenced, instead of in the first round's log.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    torch.from_numpy(np.frombuffer(b"\0\0\0\0", dtype=np.float32))


def validate_arrays(
    arrays: ArrayRecord, expected: Mapping[str, ParamSpec], *, check_finite: bool = True
) -> dict[str, Tensor]:
    """Check keys, shapes, dtypes and finiteness; return the tensors (read-only views, see :func:`decode_array`).

    Parameters
    ----------
    arrays : ArrayRecord
        What the client sent.
    expected : Mapping[str, ParamSpec]
        Exactly the tensors the reply must contain.
    check_finite : bool
        Reject a tensor holding NaN or Inf (:func:`non_finite_reason`).  ``False`` leaves that
        one check to a caller that checks its sums instead and re-checks the replies it
        still holds when a sum is not finite (``HeterogeneousStrategy.aggregate_train``).

    """
    payload = sum(len(a.data) for a in arrays.values())
    bound = max_payload_bytes(expected)
    if payload > bound:
        raise ReplyRejected(f"payload of {payload} bytes exceeds the {bound} bytes the layout sent can take")
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
        out[name] = decode_array(name, arr.data, spec)
    if check_finite:
        reason = non_finite_reason(out)
        if reason is not None:
            raise ReplyRejected(reason)
    return out


#: Bytes an ``.npy`` header may take per tensor (NumPy pads it to a multiple of 64; 128 for
#: these shapes, more only for shapes with very many dimensions).
NPY_HEADER_BYTES = 4096


def max_payload_bytes(expected: Mapping[str, ParamSpec]) -> int:
    """The largest payload a reply with the tensors ``expected`` can have: data + a header each.

    A reply with more bytes is rejected before any tensor is read (an oversized payload); the
    per-tensor checks then require the exact data bytes.
    """
    return sum(spec.numel * np.dtype(spec.dtype).itemsize + NPY_HEADER_BYTES for spec in expected.values())


def non_finite_reason(tensors: Mapping[str, Tensor]) -> str | None:
    """``"<name>: contains NaN or Inf"`` for the first tensor that does, else ``None``."""
    for name, t in tensors.items():
        if not all_finite(t):
            return f"{name}: contains NaN or Inf"
    return None


def decode_array(name: str, data: bytes, spec: ParamSpec) -> Tensor:
    """The tensor of a NumPy-serialized ``Array`` payload (``np.save`` format), without a copy.

    ``Array.numpy()`` (``np.load`` on a ``BytesIO``) copies the payload twice, in 256 KiB
    chunks; here the header is parsed (cached per distinct header), checked against ``spec``
    (a payload that contradicts the record's header is rejected) and the tensor is a view of
    the reply's own payload bytes.  **Read-only by contract**: the bytes belong to the reply
    (an immutable ``bytes`` object), so strategies read reply tensors (``add_`` them into
    sums, keep or copy them) and never modify them in place -- nothing in ``strategies/``
    does.  The view keeps the payload alive as long as the tensor is referenced.

    Raises
    ------
    ReplyRejected
        When the payload does not decode or decodes to another dtype or shape.

    """
    try:
        offset, shape, fortran, dtype = _npy_header(_header_bytes(data))
        count = math.prod(shape)
        nd = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    except Exception as exc:  # corrupt payload bytes
        raise ReplyRejected(f"{name}: payload does not decode ({exc})") from exc
    if tuple(shape) != spec.shape or dtype != np.dtype(spec.dtype) or dtype.hasobject:
        raise ReplyRejected(f"{name}: payload decodes to {dtype}{tuple(shape)}, header lied")
    if offset + nd.nbytes != len(data):
        raise ReplyRejected(f"{name}: payload has {len(data) - offset} data bytes, its header says {nd.nbytes}")
    nd = nd.reshape(shape, order="F" if fortran else "C")
    if fortran:
        return torch.from_numpy(np.ascontiguousarray(nd))  # the only copy, for Fortran-ordered payloads
    return torch.from_numpy(nd)  # zero-copy over the payload bytes: read-only by contract


def _header_bytes(data: bytes) -> bytes:
    """Magic, version, length and header dict of an ``.npy`` payload (the bytes before the data)."""
    if len(data) < 10 or data[:6] != b"\x93NUMPY":
        raise ValueError("not an .npy payload")
    if data[6] == 1:
        return data[: 10 + int.from_bytes(data[8:10], "little")]
    if len(data) < 12:
        raise ValueError("truncated .npy header")
    return data[: 12 + int.from_bytes(data[8:12], "little")]


@functools.lru_cache(maxsize=4096)
def _npy_header(header: bytes) -> tuple[int, tuple[int, ...], bool, np.dtype]:
    """``(data offset, shape, fortran order, dtype)`` of an ``.npy`` header, parsed by NumPy.

    Cached: the replies of a round carry the same few hundred headers over and over, and
    NumPy's parser (``ast.literal_eval``) costs about as much as copying a small tensor.
    """
    buf = io.BytesIO(header)
    version = np.lib.format.read_magic(buf)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(buf)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(buf)
    if buf.tell() != len(header):
        raise ValueError("malformed .npy header")
    return len(header), tuple(shape), bool(fortran), dtype


def all_finite(t: Tensor) -> bool:
    """Whether every element is finite (no NaN, no +-Inf), in one pass without temporaries.

    ``torch.isfinite(t).all()`` is a composite of several full-size temporaries on the CPU
    (about 20x slower than one reduction); the minimum and maximum are NaN when any element is
    NaN, and +-Inf when any element is infinite.
    """
    if t.numel() == 0 or not t.is_floating_point():
        return True
    lo, hi = torch.aminmax(t)
    return math.isfinite(float(lo)) and math.isfinite(float(hi))


def validate_train_reply(
    content: RecordDict,
    *,
    expected: Mapping[str, ParamSpec],
    variant: str,
    server_round: int,
    max_examples: int,
    check_finite: bool = True,
) -> tuple[dict[str, Tensor], int, MetricRecord]:
    """Validate a whole training reply; return ``(tensors, num_examples, metrics)``.

    The protocol part (echo, example count) is :mod:`experiment.protocol`'s; ``check_finite``
    as in :func:`validate_arrays`.
    """
    validate_echo(content, variant=variant, server_round=server_round)
    metrics = record_of(content, METRICS, MetricRecord, error=ReplyRejected)
    n = validate_num_examples(metrics, max_examples=max_examples)
    arrays = record_of(content, ARRAYS, ArrayRecord, error=ReplyRejected)
    return validate_arrays(arrays, expected, check_finite=check_finite), n, metrics


def validate_evaluate_reply(
    content: RecordDict, *, variant: str, server_round: int, max_examples: int
) -> tuple[int, float, float]:
    """Validate an evaluation reply; return ``(num_examples, loss, accuracy)``."""
    validate_echo(content, variant=variant, server_round=server_round)
    metrics = record_of(content, METRICS, MetricRecord, error=ReplyRejected)
    return validate_evaluate_metrics(metrics, max_examples=max_examples)
