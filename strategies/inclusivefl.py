"""InclusiveFL: depth-heterogeneous FL with layer-wise aggregation and momentum distillation.

Liu et al., "No One Left Behind: Inclusive Federated Learning over Heterogeneous
Devices", KDD 2022 (Algorithm 1).  Tier ``j`` trains the bottom ``L_j`` encoder layers
plus its own head; ``w^j = theta^j o f^j`` with the shared module ``theta^j`` =
embeddings + layers ``1 .. L_j - 1`` and the isolated module ``f^j`` = layer ``L_j`` +
head.  One round, tiers in increasing depth:

1. ``g^j`` = example-weighted mean client update of tier ``j``.
2. Momentum distillation (``k`` = next larger tier):
   ``g^{j,L_j} <- beta * m_{t-1}^k + (1 - beta) * g^{j,L_j}``.
3. ``w_{t+1}^j = FedAdam_j(w_t^j, g^j)`` -- one FedAdam state per tier.
4. For tiers with a smaller neighbour (``L^-`` its depth):
   ``m_t^j = 1 / (L_j - L^- + 1) * sum_{l=L^-}^{L_j} g^{j,l}``;  ``m_0 = 0``, and a tier
   without clients keeps ``m_{t-1}^j``.
5. Heterogeneous aggregation of shared tensors only: every shared tensor is the
   ``n_j``-weighted mean (``n_j`` = sampled clients of tier ``j`` this round) over the
   tiers that hold it in their shared module, and is copied back to all of them.
   Isolated layers and heads stay per tier.

``beta = 0`` is "InclusiveFL w/o MD".  The math is the pure functions below; the
:class:`InclusiveFL` strategy only wires them to Flower.

Diagnosis variant (``server_adam = "shared"``, not the paper's): steps 3 and 5 swap for the
shared tensors -- their updates are averaged over the tiers first (``n_j``-weighted, as in
step 5) and one FedAdam state takes one step on that mean
(:func:`shared_adam_round`); isolated layers and heads keep per-tier FedAdam.  With
per-tier FedAdam every tier's step is normalized to about ``eta`` per coordinate however
weak its signal, so the count-weighted mean of the steps follows the majority tier; the
variant weights the *updates* instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from logging import INFO
from typing import TYPE_CHECKING, Any, Unpack

import torch
from flwr.common import log
from torch import Tensor

from experiment.method_settings import InclusiveFLGroup, ServerAdamGroup
from models.catalog import VariantCatalog
from strategies.base import HeterogeneousStrategy
from strategies.fedadam import FedAdamConfig, FedAdamState, fedadam_step, group_states_from_dict, group_states_to_dict
from strategies.options import StrategyOptions
from strategies.round_sums import GroupMeans, GroupMeansResult

if TYPE_CHECKING:
    from experiment.config import RunConfig
    from experiment.registry import MethodEntry

_LAYER = re.compile(r"^(.*\.layer\.)(\d+)\.(.+)$")

Params = dict[str, Tensor]
Momentum = dict[str, Tensor]


def split_layer_key(name: str) -> tuple[int, str] | None:
    """``"bert.encoder.layer.3.x.weight"`` -> ``(4, "x.weight")`` (1-based layer)."""
    m = _LAYER.match(name)
    if m is None:
        return None
    return int(m.group(2)) + 1, m.group(3)


def blend_last_layer(delta: Mapping[str, Tensor], momentum: Momentum | None, depth: int, beta: float) -> Params:
    """Inject the larger tier's momentum into the update of encoder layer ``depth``.

    ``g^{j,L_j} <- beta * m^k + (1 - beta) * g^{j,L_j}``; other keys unchanged.  With
    no momentum yet (``m_0 = 0``) the layer's update is scaled by ``1 - beta``.
    """
    out = dict(delta)
    if beta == 0.0:
        return out
    for name, d in delta.items():
        parts = split_layer_key(name)
        if parts is None or parts[0] != depth:
            continue
        m = momentum.get(parts[1]) if momentum else None
        out[name] = (1.0 - beta) * d if m is None else beta * m + (1.0 - beta) * d
    return out


def layer_momentum(delta: Mapping[str, Tensor], low: int, high: int) -> Momentum:
    """Mean per-layer update over encoder layers ``low .. high`` (1-based, inclusive).

    ``m = 1 / (high - low + 1) * sum_{l=low}^{high} g^l``, keyed by the in-layer
    parameter suffix; layers have identical shapes, so this is element-wise.
    """
    sums: dict[str, Tensor] = {}
    counts: dict[str, int] = {}
    for name, d in delta.items():
        parts = split_layer_key(name)
        if parts is None or not low <= parts[0] <= high:
            continue
        _, suffix = parts
        sums[suffix] = d.clone() if suffix not in sums else sums[suffix] + d
        counts[suffix] = counts.get(suffix, 0) + 1
    span = high - low + 1
    for suffix, c in counts.items():
        if c != span:
            raise ValueError(f"momentum over layers {low}..{high}: {suffix} present in {c} layers")
    return {s: t / span for s, t in sums.items()}


def heterogeneous_average(
    states: Mapping[str, Mapping[str, Tensor]],
    shared: Mapping[str, set[str]],
    counts: Mapping[str, int],
) -> dict[str, Params]:
    """Layer-wise aggregation of shared tensors across tiers.

    For every tensor name ``p`` in some tier's shared set,
    ``theta^p = sum_{j: p in shared_j} n_j theta_j^p / sum_{j: p in shared_j} n_j``, written
    back to every tier that shares ``p``.  Tiers with ``n_j = 0`` carry no weight; a
    tensor none of whose holders trained keeps its values.  Non-shared tensors are
    returned untouched.
    """
    out = {v: dict(p) for v, p in states.items()}
    names = sorted(set().union(*shared.values())) if shared else []
    for name in names:
        holders = [v for v in states if name in shared.get(v, set())]
        weighted = [(v, counts.get(v, 0)) for v in holders if counts.get(v, 0) > 0]
        total = sum(n for _, n in weighted)
        if total == 0:
            continue
        avg = _weighted_sum(states, name, weighted, total)
        for v in holders:
            out[v][name] = avg
    return out


def _weighted_sum(
    states: Mapping[str, Mapping[str, Tensor]], name: str, weighted: Sequence[tuple[str, int]], total: int
) -> Tensor:
    """``sum_j (n_j / total) * theta_j^name``, left to right, into one new tensor.

    A single holder with ``n_1 = total`` (every homogeneous round) is its own tensor, no copy
    (``1.0 * x == x`` exactly; nothing writes state tensors in place).  Python's ``sum`` would
    start from ``0``, which only turns an exact ``-0.0`` into ``+0.0``: the values are the same.
    """
    (first, n), *rest = weighted
    x = states[first][name]
    if not rest and n == total:
        return x
    avg = torch.mul(x, n / total)
    for v, n in rest:
        avg.add_(torch.mul(states[v][name], n / total))
    return avg


def inclusivefl_round(
    *,
    states: Mapping[str, Params],
    deltas: Mapping[str, Params],
    counts: Mapping[str, int],
    depths: Sequence[tuple[str, int]],
    shared: Mapping[str, set[str]],
    momenta: Mapping[str, Momentum],
    adam: Mapping[str, FedAdamState],
    adam_cfg: FedAdamConfig,
    beta: float,
) -> tuple[dict[str, Params], dict[str, Momentum]]:
    """One server round of InclusiveFL (steps 2-5 of the module docstring).

    Parameters
    ----------
    states : Mapping[str, Params]
        Per-tier parameters ``w_t^j``.
    deltas : Mapping[str, Params]
        Per-tier mean client update ``g^j`` (tiers without clients absent).
    counts : Mapping[str, int]
        Sampled clients ``n_j`` per tier.
    depths : Sequence[tuple[str, int]]
        ``(tier, L_j)`` in increasing depth.
    shared : Mapping[str, set[str]]
        Per tier, the names of its shared-module tensors.
    momenta : Mapping[str, Momentum]
        ``m_{t-1}^j`` per tier (missing = 0).
    adam : Mapping[str, FedAdamState]
        FedAdam state per tier (updated in place).
    adam_cfg : FedAdamConfig
        FedAdam hyper-parameters shared by the tiers.
    beta : float
        Momentum-distillation factor.

    Returns
    -------
    tuple
        New per-tier parameters and ``m_t`` per tier.

    """
    blended, new_momenta = distilled_updates(deltas, counts, depths, momenta, beta)
    new_states = {v: dict(p) for v, p in states.items()}
    for tier, g in blended.items():
        new_states[tier] = fedadam_step(states[tier], g, adam[tier], adam_cfg)
    return heterogeneous_average(new_states, shared, counts), new_momenta


def distilled_updates(
    deltas: Mapping[str, Params],
    counts: Mapping[str, int],
    depths: Sequence[tuple[str, int]],
    momenta: Mapping[str, Momentum],
    beta: float,
) -> tuple[dict[str, Params], dict[str, Momentum]]:
    r"""Every trained tier's update after momentum distillation, and the new momenta ``m_t``.

    For tier ``j`` (in increasing depth) with ``n_j > 0``: ``g^j`` is its mean client update with
    its top layer blended with the next deeper tier's previous momentum (:func:`blend_last_layer`,
    ``beta``); ``m_t^j`` is :func:`layer_momentum` of that blended update over the layers it has
    beyond the next shallower tier.  Untrained tiers are absent from the updates and keep
    ``m_{t-1}^j``.  Shared by :func:`inclusivefl_round` and :func:`shared_adam_round`, which differ
    only in how the blended updates are applied.
    """
    blended: dict[str, Params] = {}
    new_momenta = dict(momenta)
    for i, (tier, depth) in enumerate(depths):
        if tier not in deltas or counts.get(tier, 0) == 0:
            continue
        g = dict(deltas[tier])
        if i + 1 < len(depths):
            g = blend_last_layer(g, momenta.get(depths[i + 1][0]), depth, beta)
        blended[tier] = g
        if i > 0:
            new_momenta[tier] = layer_momentum(g, depths[i - 1][1], depth)
    return blended, new_momenta


#: FedAdam state key of the shared tensors in :func:`shared_adam_round`.
SHARED_ADAM = "__shared__"
SERVER_ADAM_MODES = ("per-tier", "shared")


def shared_adam_round(
    *,
    states: Mapping[str, Params],
    deltas: Mapping[str, Params],
    counts: Mapping[str, int],
    depths: Sequence[tuple[str, int]],
    shared: Mapping[str, set[str]],
    momenta: Mapping[str, Momentum],
    adam: Mapping[str, FedAdamState],
    adam_cfg: FedAdamConfig,
    beta: float,
) -> tuple[dict[str, Params], dict[str, Momentum]]:
    r"""One round of the shared-FedAdam variant (diagnosis; not the paper's Algorithm 1).

    Momentum distillation and the momenta are those of :func:`inclusivefl_round`.  Then, for
    every shared tensor ``p`` with holders ``H_p`` (tiers whose shared module holds it),

    .. math:: \bar g^p = \frac{\sum_{j \in H_p} n_j g^{j,p}}{\sum_{j \in H_p} n_j}, \qquad
              \theta^p_{t+1} = \mathrm{FedAdam}_{shared}(\theta^p_t, \bar g^p),

    one step of the state ``adam[SHARED_ADAM]`` for all shared tensors, written to every holder;
    every other tensor takes its tier's own FedAdam step on ``g^j`` (``adam[tier]``).  The
    holders' copies of ``theta^p`` are equal (the previous round wrote the same tensor to all).
    With one tier the result is :func:`inclusivefl_round`'s up to which state holds the moments.
    The shared state has one step counter: it advances every round that updates any shared tensor,
    so a tensor whose holders were all unsampled that round keeps its moments while its bias
    correction moves on.
    """
    blended, new_momenta = distilled_updates(deltas, counts, depths, momenta, beta)
    new_states = {v: dict(p) for v, p in states.items()}
    for tier, g in blended.items():
        own = {k: d for k, d in g.items() if k not in shared.get(tier, set())}
        if own:
            new_states[tier] = fedadam_step(states[tier], own, adam[tier], adam_cfg)
    mean_update: Params = {}
    source: dict[str, str] = {}
    for name in sorted(set().union(*shared.values())) if shared else []:
        weighted = [(v, counts[v]) for v in blended if name in shared.get(v, set()) and name in blended[v]]
        total = sum(n for _, n in weighted)
        if total == 0:
            continue
        mean_update[name] = _weighted_sum(blended, name, weighted, total)
        source[name] = weighted[0][0]
    if mean_update:
        params = {name: states[source[name]][name] for name in mean_update}
        stepped = fedadam_step(params, mean_update, adam[SHARED_ADAM], adam_cfg)
        for name, value in stepped.items():
            for v in new_states:
                if name in shared.get(v, set()):
                    new_states[v][name] = value
    return new_states, new_momenta


class InclusiveFL(HeterogeneousStrategy[GroupMeansResult]):
    """InclusiveFL on Flower (and, with one variant, the FedAdam baselines).

    With a one-variant catalog this is plain FedAdam on that variant, which is how
    the AllLarge / AllSmall / ExclusiveFL baselines run (see ``server/app.py``).

    Parameters
    ----------
    catalog : VariantCatalog
        Depth variants, smallest first.
    beta : float
        Momentum-distillation factor (0 = InclusiveFL w/o MD).
    adam : FedAdamConfig
        Server optimizer hyper-parameters (one state per tier).
    server_adam : {"per-tier", "shared"}
        ``"per-tier"``: the paper's FedAdam per tier, then layer-wise averaging;
        ``"shared"``: the diagnosis variant :func:`shared_adam_round`.
    **options
        :class:`~strategies.base.StrategyOptions`, passed to :class:`~strategies.base.HeterogeneousStrategy`.

    """

    def __init__(
        self,
        *,
        catalog: VariantCatalog,
        beta: float = 0.2,
        adam: FedAdamConfig | None = None,
        server_adam: str = "per-tier",
        **options: Unpack[StrategyOptions],
    ) -> None:
        if not 0.0 <= beta <= 1.0:
            raise ValueError(f"beta must be in [0, 1], got {beta}")
        if server_adam not in SERVER_ADAM_MODES:
            raise ValueError(f"server_adam must be one of {SERVER_ADAM_MODES}, got {server_adam!r}")
        super().__init__(catalog=catalog, **options)
        self.beta = beta
        self.adam_cfg = adam or FedAdamConfig()
        self.server_adam = server_adam
        self.adam = {v.name: FedAdamState() for v in catalog}
        if server_adam == "shared":
            self.adam[SHARED_ADAM] = FedAdamState()
        self.momenta: dict[str, Momentum] = {}
        self.depths = [(v.name, v.depth) for v in catalog]
        self.shared = tier_shared_names(catalog)

    def new_round_sums(self) -> GroupMeans:
        """Each tier's example-weighted mean client weights."""
        return GroupMeans()

    def apply_round(
        self, server_round: int, means: Mapping[str, Mapping[str, Tensor]], counts: Mapping[str, int]
    ) -> None:
        """Turn mean client weights into updates (in place: the means are the round's); :func:`inclusivefl_round`."""
        deltas = {v: {k: t.sub_(self.state[v][k]) for k, t in m.items()} for v, m in means.items()}
        round_fn = shared_adam_round if self.server_adam == "shared" else inclusivefl_round
        with torch.no_grad():
            self.state, self.momenta = round_fn(
                states=self.state,
                deltas=deltas,
                counts=counts,
                depths=self.depths,
                shared=self.shared,
                momenta=self.momenta,
                adam=self.adam,
                adam_cfg=self.adam_cfg,
                beta=self.beta,
            )
        log(INFO, "InclusiveFL round %d: clients per tier %s", server_round, dict(counts))

    def method_state(self) -> dict[str, Any]:
        """Per tier its FedAdam state and its last momentum ``m_t^j``."""
        return {"adam": group_states_to_dict(self.adam), "momenta": dict(self.momenta)}

    def load_method_state(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`method_state` (one FedAdam state per catalog tier required)."""
        adam = group_states_from_dict(data.get("adam"), self.adam, "tiers")
        momenta = data.get("momenta", {})
        unknown = sorted(set(momenta) - set(self.adam))
        if unknown:
            raise ValueError(f"checkpoint has momenta of unknown tiers {unknown}")
        self.adam = adam
        self.momenta = {v: dict(m) for v, m in momenta.items()}


def tier_shared_names(catalog: VariantCatalog) -> dict[str, set[str]]:
    """Trainable shared-module tensor names per variant (from the layouts' roles).

    Frozen tensors are identical in every tier and never change, so they are left
    out of the heterogeneous average.
    """
    return {v.name: {p.name for p in v.layout if p.role == "shared" and p.trainable} for v in catalog}


def build(cfg: RunConfig, entry: MethodEntry, options: Mapping[str, Any]) -> InclusiveFL:
    """InclusiveFL from the run config: ``beta``, ``inclusivefl-server-adam`` and the server FedAdam.

    A registry factory (:class:`experiment.registry.MethodEntry` ``strategy``):
    ``(RunConfig, MethodEntry, options) -> strategy``.
    """
    own = cfg.settings_of(InclusiveFLGroup)
    adam = FedAdamConfig.from_settings(cfg.settings_of(ServerAdamGroup))
    return InclusiveFL(beta=own.beta, adam=adam, server_adam=own.inclusivefl_server_adam, **options)
