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
count weights).  The distillation weight of round ``t`` (1-based) ramps up as
``w_t = w exp(-5 (1 - min(t - 1, R) / R)^2)`` (:func:`round_kd_weight` of ``t - 1``, the baseline's
``sigmoid_rampup(curr_round - 1, R)``: ``w e^{-5}`` in round 1, ``w`` from round ``R + 1``; ``R = 0``:
``w`` from the start) and is sent to the clients, so they need no schedule.

Decisions where the paper leaves room: the server rule is FedAvg's (the paper pairs DepthFL with
FedDyn, which is not implemented here); exits are one pooled linear layer on the CNN and a pooler
plus classifier on the transformer, without the paper's extra bottleneck layers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any, Unpack

from flwr.app import ArrayRecord
from flwr.app.typing import ConfigRecordValues
from torch import Tensor

from experiment.method_settings import DepthFLGroup
from experiment.protocol import DEPTHFL_ROUND_KD_WEIGHT
from models.catalog import VariantCatalog
from strategies.base import HeterogeneousStrategy
from strategies.options import StrategyOptions
from strategies.records import State
from strategies.round_sums import GroupMeans, GroupMeansResult, by_examples, by_replies

if TYPE_CHECKING:
    from experiment.config import RunConfig
    from experiment.registry import MethodEntry


class DepthFLError(ValueError):
    """A DepthFL setting or sub-model is inconsistent with the global model."""


def round_kd_weight(step: int, weight: float, rampup_rounds: int) -> float:
    r"""The distillation weight after ``s`` rounds: ``w exp(-5 (1 - min(s, R)/R)^2)``, ``w`` when ``R = 0``.

    ``s`` is clipped to ``[0, R]`` (the baseline's ``sigmoid_rampup(s, R)``), so the weight rises
    from ``w e^{-5}`` at ``s = 0`` (round 1) to ``w`` at ``s >= R``.

    Raises
    ------
    DepthFLError
        When ``w < 0`` or ``R < 0``.

    """
    if weight < 0 or rampup_rounds < 0:
        raise DepthFLError(f"kd weight and ramp-up rounds must be >= 0, got {weight} and {rampup_rounds}")
    if rampup_rounds == 0:
        return weight
    phase = 1.0 - min(max(step, 0), rampup_rounds) / rampup_rounds
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


def holder_mean(previous: Mapping[str, Tensor], means: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Each tensor's weighted mean over the replies that held it; the previous value where none did.

    ``means[p] = sum_{i in H(p)} n_i w_{i,p} / sum_{i in H(p)} n_i`` for every tensor some reply
    held (a :class:`~strategies.streaming.StreamingMean` over every reply, whatever its depth:
    its sums are per key, so one accumulator is exact).

    Raises
    ------
    DepthFLError
        When a reply held a tensor the global model lacks.

    """
    unknown = sorted(set(means) - set(previous))
    if unknown:
        raise DepthFLError(f"replies hold tensors the global model lacks: {unknown[:5]}")
    return {name: means.get(name, value) for name, value in previous.items()}


class DepthFL(HeterogeneousStrategy[GroupMeansResult]):
    """DepthFL's server: one deepest model; each depth gets its prefix; holder means (module docstring).

    Parameters
    ----------
    kd_weight, kd_rampup_rounds : float, int
        ``w`` and ``R`` of :func:`round_kd_weight`; each train message carries ``w_t``
        (:data:`experiment.protocol.DEPTHFL_ROUND_KD_WEIGHT`).
    uniform : bool
        Weight every holder 1 (Flower's baseline) instead of by its examples.
    catalog, **options
        The variants (depths, shallowest first) and the options every strategy shares.

    """

    GLOBAL = "global"

    def __init__(
        self,
        *,
        catalog: VariantCatalog,
        kd_weight: float = 1.0,
        kd_rampup_rounds: int = 0,
        uniform: bool = False,
        **options: Unpack[StrategyOptions],
    ) -> None:
        super().__init__(catalog=catalog, **options)
        round_kd_weight(0, kd_weight, kd_rampup_rounds)  # the settings' checks, before round 1
        self.kd_weight = kd_weight
        self.kd_rampup_rounds = kd_rampup_rounds
        self.uniform = uniform
        self.full = catalog.largest

    def initial_state(self, init: Mapping[str, Mapping[str, Tensor]]) -> State:
        """One deepest model (:data:`GLOBAL`): every depth is its prefix."""
        return {self.GLOBAL: dict(init[self.full.name])}

    def check_state(self, state: State) -> None:
        """Require exactly the deepest variant's tensors under :data:`GLOBAL`."""
        if set(state) != {self.GLOBAL} or set(state[self.GLOBAL]) != set(self.full.layout.names()):
            raise ValueError(f"DepthFL keeps one model of {self.full.name!r}'s layout under {self.GLOBAL!r}")

    def variant_payload(self, node_id: int, variant: str) -> dict[str, Tensor]:
        """The global model's prefix of ``variant``'s depth (:func:`prefix`)."""
        return prefix(self.state[self.GLOBAL], self.catalog.get(variant).layout.names())

    def encode_payload(
        self, node_id: int, variant: str, kind: str, server_round: int
    ) -> tuple[ArrayRecord, dict[str, ConfigRecordValues]]:
        """The dense prefix, and with a train message the round's distillation weight ``w_t`` (module docstring)."""
        record, _ = super().encode_payload(node_id, variant, kind, server_round)
        if kind != "train":
            return record, {}
        w_t = round_kd_weight(server_round - 1, self.kd_weight, self.kd_rampup_rounds)
        return record, {DEPTHFL_ROUND_KD_WEIGHT: w_t}

    def new_round_sums(self) -> GroupMeans:
        """One per-tensor sum over every reply, whatever its depth (:data:`GLOBAL`).

        Weighted by examples, or one per reply with ``uniform``; a depth's median stands for its replies.
        """
        return GroupMeans(group_of=lambda variant: self.GLOBAL, weight=by_replies if self.uniform else by_examples)

    def apply_round(
        self, server_round: int, means: Mapping[str, Mapping[str, Tensor]], counts: Mapping[str, int]
    ) -> None:
        """The holder means (:func:`holder_mean`); tensors no reply held keep their values."""
        held = means.get(self.GLOBAL)
        if held:
            self.state[self.GLOBAL] = holder_mean(self.state[self.GLOBAL], held)

    def models_for_evaluation(self) -> dict[str, list[Mapping[str, Tensor]]]:
        """Each depth's prefix of the global model (its prediction: the ensemble of its exits)."""
        return {v.name: [self.variant_payload(0, v.name)] for v in self.catalog}


def build(cfg: RunConfig, entry: MethodEntry, options: Mapping[str, Any]) -> DepthFL:
    """DepthFL from the run config's ``depthfl-*`` keys (a registry factory)."""
    own = cfg.settings_of(DepthFLGroup)
    return DepthFL(
        kd_weight=own.depthfl_kd_weight,
        kd_rampup_rounds=own.depthfl_kd_rampup_rounds,
        uniform=own.depthfl_uniform,
        **options,
    )
