r"""A strategy's state as Flower records: per-variant tensors <-> ``ArrayRecord``, serialized once.

The server keeps ``{variant: {param: Tensor}}`` (:data:`State`); Flower carries ``ArrayRecord``\ s.
:func:`compose` / :func:`decompose` map one to the other (keys ``"<variant>/<param>"``),
:func:`to_record` makes a node's payload, and :class:`ArrayCache` serializes each tensor once
while it is unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import Tensor

SEP = "/"
State = dict[str, dict[str, Tensor]]


class ArrayCache:
    """Serialized ``Array`` of each tensor, reused while the tensor is unchanged.

    Serializing (``np.save``) is the server's largest fixed cost per round: the composite
    record of every variant, frozen tensors included, and one payload record per sampled
    node.  Most of those tensors did not change since they were last serialized (frozen
    embeddings, tiers without replies, the same variant sent to many nodes), so an entry is
    kept per tensor *object* and reused while it is the same object with the same version
    counter (``Tensor._version``, which every in-place write bumps).  A tensor without a
    version counter (an inference-mode tensor) is always serialized afresh.  The entry holds
    a reference to its tensor, so an object id is never reused while cached.  Writes that
    bypass the counter (``Tensor.data = ...``, writes through a NumPy view) are not seen;
    the strategies make none to their state.
    """

    def __init__(self) -> None:
        self._entries: dict[int, tuple[Tensor, int, Array]] = {}

    def array(self, t: Tensor) -> Array:
        """The ``Array`` of ``t``: cached while ``t`` is unchanged, else serialized (and cached)."""
        try:
            version = t._version
        except RuntimeError:  # inference tensors track no version: never cached
            return Array(t.detach().cpu().numpy())
        hit = self._entries.get(id(t))
        if hit is not None and hit[0] is t and hit[1] == version:
            return hit[2]
        arr = Array(t.detach().cpu().numpy())
        self._entries[id(t)] = (t, version, arr)
        return arr

    def retain(self, tensors: Iterable[Tensor]) -> None:
        """Drop every entry but those of ``tensors`` (bounds the cache to the current state)."""
        keep = {id(t) for t in tensors}
        self._entries = {k: e for k, e in self._entries.items() if k in keep}

    def __len__(self) -> int:
        return len(self._entries)


def compose(state: Mapping[str, Mapping[str, Tensor]], cache: ArrayCache | None = None) -> ArrayRecord:
    """Composite record ``{"<variant>/<param>": Array}`` of a per-variant state.

    With ``cache``, unchanged tensors reuse their serialized ``Array`` (:class:`ArrayCache`).
    """
    rec = ArrayRecord()
    for variant, params in state.items():
        for name, t in params.items():
            rec[f"{variant}{SEP}{name}"] = cache.array(t) if cache is not None else Array(t.detach().cpu().numpy())
    return rec


def decompose(record: ArrayRecord) -> State:
    """Inverse of :func:`compose`."""
    out: State = {}
    for key, arr in record.items():
        variant, _, name = key.partition(SEP)
        out.setdefault(variant, {})[name] = torch.from_numpy(np.array(arr.numpy()))
    return out


def to_record(params: Mapping[str, Tensor], cache: ArrayCache | None = None) -> ArrayRecord:
    """ArrayRecord of a flat ``{name: tensor}`` mapping, order preserved (``cache``: see :func:`compose`)."""
    rec = ArrayRecord()
    for name, t in params.items():
        rec[name] = cache.array(t) if cache is not None else Array(t.detach().cpu().numpy())
    return rec


def record_nbytes(record: ArrayRecord) -> int:
    """Serialized payload bytes of an ArrayRecord (what crosses the wire)."""
    return sum(len(arr.data) for arr in record.values())
