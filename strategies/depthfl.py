r"""DepthFL's server math: depth-prefix sub-models and per-tensor means over their holders.

Kim, Kim and Hwang, "DepthFL: Depthwise Federated Learning for Heterogeneous Clients", ICLR 2023
(Section 3), in the form of Flower's ``depthfl`` baseline.  The global model has ``L`` blocks with
an exit (classifier) after each; a client of depth ``k`` holds blocks ``1..k`` and exits ``1..k``
(:func:`prefix`), trains them with mutual self-distillation among its exits
(:func:`models.exits.self_distillation_loss`) and returns them.  With ``H(p)`` the replies that
hold tensor ``p`` and ``n_i`` their weights:

.. math::

    w_p \leftarrow \frac{\sum_{i \in H(p)} n_i\, w_{i,p}}{\sum_{i \in H(p)} n_i}
    \quad \text{if } H(p) \neq \emptyset, \qquad w_p \leftarrow w_p \text{ otherwise}

(:func:`holder_mean`): a deep block is averaged over the few clients that reach it, a shallow
one over all.  The weights are the clients' example counts (``uniform``: 1 each, the baseline's
count weights).  The distillation weight of round ``t`` ramps up as
``w_t = w exp(-5 (1 - min(t, R) / R)^2)`` (:func:`kd_weight`, the baseline's ``sigmoid_rampup``;
``R = 0``: ``w`` from the start) and is sent to the clients, so they need no schedule.

Decisions where the paper leaves room: the server rule is FedAvg's (the paper pairs DepthFL with
FedDyn, which is not implemented here); exits are one pooled linear layer on the CNN and a pooler
plus classifier on the transformer, without the paper's extra bottleneck layers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from torch import Tensor

from strategies.streaming import StreamingMean


class DepthFLError(ValueError):
    """A DepthFL setting or sub-model is inconsistent with the global model."""


def kd_weight(server_round: int, weight: float, rampup_rounds: int) -> float:
    r"""The distillation weight of round ``t``: ``w exp(-5 (1 - min(t, R)/R)^2)``, ``w`` when ``R = 0``.

    ``t`` is clipped to ``[0, R]`` (the baseline's ``sigmoid_rampup(t, R)``), so the weight
    rises from ``w e^{-5}`` at ``t = 0`` to ``w`` at ``t >= R``.

    Raises
    ------
    DepthFLError
        When ``w < 0`` or ``R < 0``.

    """
    if weight < 0 or rampup_rounds < 0:
        raise DepthFLError(f"kd weight and ramp-up rounds must be >= 0, got {weight} and {rampup_rounds}")
    if rampup_rounds == 0:
        return weight
    phase = 1.0 - min(max(server_round, 0), rampup_rounds) / rampup_rounds
    return weight * math.exp(-5.0 * phase * phase)


def prefix(global_state: Mapping[str, Tensor], names: Iterable[str]) -> dict[str, Tensor]:
    """The sub-model a client of some depth holds: the global tensors its layout names.

    Raises
    ------
    DepthFLError
        When the layout names a tensor the global model lacks.

    """
    names = list(names)
    missing = [n for n in names if n not in global_state]
    if missing:
        raise DepthFLError(f"the sub-model names tensors the global model lacks: {missing[:5]}")
    return {n: global_state[n] for n in names}


def holder_mean(previous: Mapping[str, Tensor], sums: StreamingMean) -> dict[str, Tensor]:
    """Each tensor's weighted mean over the replies that held it; the previous value where none did.

    ``sums`` holds ``S_p = sum_{i in H(p)} n_i w_{i,p}`` and ``W_p = sum_{i in H(p)} n_i`` per
    tensor (a :class:`~strategies.streaming.StreamingMean` over every reply, whatever its depth:
    its sums are per key, so one accumulator is exact).

    Raises
    ------
    DepthFLError
        When a reply held a tensor the global model lacks.

    """
    unknown = sorted(set(sums.sums) - set(previous))
    if unknown:
        raise DepthFLError(f"replies hold tensors the global model lacks: {unknown[:5]}")
    means = sums.mean()
    return {name: means.get(name, value) for name, value in previous.items()}
