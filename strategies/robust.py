r"""Robust aggregation options against poisoned updates: update-norm clipping, coordinate-wise median.

Both act *within a group* (the replies of one variant), before the method's own math.

**Update-norm clipping** (as in Sun et al., "Can You Really Backdoor Federated Learning?",
2019).  With ``w`` the weights a node was sent and ``x`` the weights it returned, the update
``Delta = x - w`` is scaled to L2 norm at most ``c`` (the norm over all returned tensors
together)::

    x' = w + Delta * min(1, c / ||Delta||_2)

It is a per-reply operation, so it streams: memory stays ``O(model)`` per group.

**Coordinate-wise median** (Yin et al., "Byzantine-Robust Distributed Learning: Towards
Optimal Statistical Rates", ICML 2018).  For ``n`` replies of a group and every element ``e``,
with ``x_(1),e <= ... <= x_(n),e`` the sorted values::

    med_e = x_((n+1)/2),e                          n odd
    med_e = (x_(n/2),e + x_(n/2+1),e) / 2          n even

It ignores example counts and tolerates fewer than ``n / 2`` arbitrary replies per element.
It **cannot stream**: every reply of the group must be held until the round ends, i.e.
``O(clients x model)`` server memory instead of ``O(groups x model)``; hence it is opt-in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def update_norm(tensors: Mapping[str, Tensor], reference: Mapping[str, Tensor]) -> float:
    """``||x - w||_2`` over all tensors of ``tensors`` (computed in float64).

    Raises
    ------
    KeyError
        If ``reference`` lacks a name of ``tensors``.

    """
    total = 0.0
    for name, x in tensors.items():
        d = x.detach().to(torch.float64) - reference[name].detach().to(torch.float64)
        total += float((d * d).sum())
    return math.sqrt(total)


def clip_update(
    tensors: Mapping[str, Tensor], reference: Mapping[str, Tensor], max_norm: float
) -> tuple[dict[str, Tensor], float]:
    """Clip the update ``x - w`` to L2 norm ``max_norm``; return ``(x', ||x - w||_2)``.

    ``x' = w + (x - w) * min(1, max_norm / ||x - w||_2)``.  Tensors are returned unchanged
    (same objects) when the norm is within the bound.

    Parameters
    ----------
    tensors : Mapping[str, Tensor]
        The reply's weights ``x``.
    reference : Mapping[str, Tensor]
        The weights ``w`` the node was sent (at least the names of ``tensors``).
    max_norm : float
        ``c > 0``.

    """
    if not (math.isfinite(max_norm) and max_norm > 0):
        raise ValueError(f"max_norm must be positive and finite, got {max_norm}")
    norm = update_norm(tensors, reference)
    if norm <= max_norm:
        return dict(tensors), norm
    scale = max_norm / norm
    out = {name: (w := reference[name]) + (x - w) * scale for name, x in tensors.items()}
    return {k: v.to(tensors[k].dtype) for k, v in out.items()}, norm


def coordinate_median(replies: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Element-wise median over ``replies`` for every name (mean of the two middle values for even ``n``).

    Raises
    ------
    ValueError
        For no replies, or replies with different names or shapes.

    """
    if not replies:
        raise ValueError("median of no replies")
    names = set(replies[0])
    if any(set(r) != names for r in replies[1:]):
        raise ValueError("median over replies with different tensor names")
    n = len(replies)
    out: dict[str, Tensor] = {}
    for name in replies[0]:
        shape = replies[0][name].shape
        if any(r[name].shape != shape for r in replies):
            raise ValueError(f"{name}: replies have different shapes")
        ordered = torch.stack([r[name] for r in replies]).sort(dim=0).values
        mid = n // 2
        out[name] = ordered[mid].clone() if n % 2 else (ordered[mid - 1] + ordered[mid]) / 2
    return out


class MedianBuffer:
    """Holds one group's replies until the round ends (``O(replies x model)`` memory).

    ``add`` keeps the tensors and sums the weights; ``result`` is
    ``(coordinate_median(replies), total weight, number of replies)``.
    """

    def __init__(self) -> None:
        self.replies: list[dict[str, Tensor]] = []
        self.total_weight = 0.0

    def add(self, tensors: Mapping[str, Tensor], weight: float) -> None:
        """Keep one reply (``weight > 0``, its example count)."""
        if not weight > 0:
            raise ValueError(f"weight must be positive, got {weight}")
        self.replies.append(dict(tensors))
        self.total_weight += weight

    def result(self) -> tuple[dict[str, Tensor], float, int]:
        """The group's coordinate-wise median, total weight and reply count."""
        return coordinate_median(self.replies), self.total_weight, len(self.replies)
