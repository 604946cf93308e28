"""Streaming weighted mean: replies are folded in one at a time.

Server memory is ``O(model)`` per group regardless of the number of replies:
for every key ``k`` the accumulator keeps ``S_k = sum_i w_i x_{i,k}`` and
``W_k = sum_i w_i`` over the replies that carried ``k``; the mean is ``S_k / W_k``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from strategies.validation import non_finite_reason


class StreamingMean:
    """Per-key running weighted sum."""

    def __init__(self) -> None:
        self.sums: dict[str, Tensor] = {}
        self.weights: dict[str, float] = {}
        self.count = 0

    def add(self, tensors: Mapping[str, Tensor], weight: float) -> None:
        """Fold ``weight * tensors`` into the sums (the tensors are not kept)."""
        if weight <= 0:
            raise ValueError(f"weight must be positive, got {weight}")
        for key, t in tensors.items():
            acc = self.sums.get(key)
            if acc is None:
                # one pass (a copy, then an in-place multiply, would be two)
                self.sums[key] = torch.mul(t, weight) if t.is_floating_point() else t.clone().mul_(weight)
                self.weights[key] = weight
            else:
                acc.add_(t, alpha=weight)
                self.weights[key] += weight
        self.count += 1

    def mean(self) -> dict[str, Tensor]:
        """``S_k / W_k`` for every key seen (new tensors; the sums stay)."""
        return {k: s / self.weights[k] for k, s in self.sums.items()}

    def take_mean(self) -> dict[str, Tensor]:
        """``S_k / W_k`` for every key seen, divided in place: the sums become the means.

        No new memory for floating-point sums (a fresh full-size result costs its page faults
        on top of the pass); the accumulator is left empty.
        """
        out = {
            k: s.div_(self.weights[k]) if s.is_floating_point() else s / self.weights[k] for k, s in self.sums.items()
        }
        self.sums, self.weights, self.count = {}, {}, 0
        return out

    def is_finite(self) -> bool:
        """Whether no sum holds a NaN or Inf (a reply that did, or a sum that overflowed)."""
        return non_finite_reason(self.sums) is None

    @property
    def total_weight(self) -> float:
        """Largest per-key weight (the weight of full replies)."""
        return max(self.weights.values(), default=0.0)
