"""Baselines of the InclusiveFL paper that are not plain FedAdam on one variant.

AllLarge, AllSmall and ExclusiveFL are :class:`~strategies.inclusivefl.InclusiveFL`
over a one-variant catalog (so FedAdam on that variant; see ``server/app.py``).
``Local`` (cross-silo) needs its own state: each node trains its own model alone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Unpack

from torch import Tensor

from experiment.method_settings import ServerAdamGroup
from models.catalog import VariantCatalog
from strategies import heterofl
from strategies.base import HeterogeneousStrategy, ResultT
from strategies.fedadam import FedAdamConfig
from strategies.inclusivefl import InclusiveFL
from strategies.options import StrategyOptions
from strategies.replies import Sent
from strategies.round_sums import NodeModels

if TYPE_CHECKING:
    from experiment.config import RunConfig
    from experiment.registry import MethodEntry


class PerNodeModels(HeterogeneousStrategy[ResultT]):
    """Base for strategies that keep one model per node (Local, FlexiFed's personal layers).

    ``node_states[i]`` is node ``i``'s own model (its last reply merged over what it was sent)
    and ``node_variant[i]`` its variant.  A node receives its own model while it keeps the
    same variant, else the variant's shared model.  The per-node models are method state in
    checkpoints, follow a node to a new id after a restart, and are evaluated one by one.
    """

    def __init__(self, *, catalog: VariantCatalog, **options: Unpack[StrategyOptions]) -> None:
        super().__init__(catalog=catalog, **options)
        self.node_states: dict[int, dict[str, Tensor]] = {}
        self.node_variant: dict[int, str] = {}

    def variant_payload(self, node_id: int, variant: str) -> dict[str, Tensor]:
        """The node's own model (its variant's shared weights before it first trains)."""
        own = self.node_states.get(node_id)
        return own if own is not None and self.node_variant[node_id] == variant else self.state[variant]

    def keep_node_model(self, sent: Sent, tensors: Mapping[str, Tensor]) -> None:
        """Store the node's returned weights (over what it was sent) as its own model."""
        base = self.variant_payload(sent.node_id, sent.variant)
        self.node_states[sent.node_id] = {**base, **tensors}
        self.node_variant[sent.node_id] = sent.variant

    def method_state(self) -> dict[str, Any]:
        """Every node's own model and its variant, keyed by node id."""
        return {
            "node-states": {n: dict(p) for n, p in self.node_states.items()},
            "node-variant": dict(self.node_variant),
        }

    def load_method_state(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`method_state` (variants must be in the catalog)."""
        states, variants = data.get("node-states", {}), data.get("node-variant", {})
        if set(states) != set(variants) or not set(variants.values()) <= set(self.catalog.names()):
            raise ValueError("checkpoint's per-node models do not match the catalog")
        self.node_states = {int(n): dict(p) for n, p in states.items()}
        self.node_variant = {int(n): str(v) for n, v in variants.items()}

    def rebind_node(self, old_id: int, new_id: int) -> None:
        """The node's own model follows it to its new id."""
        if old_id in self.node_states:
            self.node_states[new_id] = self.node_states.pop(old_id)
            self.node_variant[new_id] = self.node_variant.pop(old_id)

    def models_for_evaluation(self) -> dict[str, list[Mapping[str, Tensor]]]:
        """Every node's own model, grouped by variant (a variant no node has yet: its shared model).

        In the nodes' order (:meth:`~strategies.base.HeterogeneousStrategy.node_order`), whatever
        order their replies came in: each model draws the next static-BN batches of the server's
        evaluation, so the order is part of the result.
        """
        out: dict[str, list[Mapping[str, Tensor]]] = {}
        for node in sorted(self.node_states, key=self.node_order):
            out.setdefault(self.node_variant[node], []).append(self.node_states[node])
        for v, params in self.state.items():
            out.setdefault(v, [params])
        return out


class LocalTraining(PerNodeModels[None]):
    """Local baseline: every node trains its own tier model; nothing is shared.

    The server only relays: node ``i``'s model after round ``t`` is exactly the
    weights it returned (``w_{t+1}^i = w_t^i + g^i``, no averaging, no server
    optimizer), starting from its variant's initial weights.  Memory grows with the
    number of nodes by nature of the method.
    """

    supports_median = False  # nothing is aggregated

    def new_round_sums(self) -> NodeModels:
        """Each reply becomes its node's model as it is folded (:meth:`keep_node_model`)."""
        return NodeModels(self.keep_node_model)

    def apply_round(self, server_round: int, result: None, counts: Mapping[str, int]) -> None:
        """Nothing is aggregated."""


def build_one_variant(
    cfg: RunConfig, entry: MethodEntry, options: Mapping[str, Any]
) -> InclusiveFL | heterofl.HeteroFL:
    """AllLarge / AllSmall / ExclusiveFL: FedAdam on the one variant the entry trains.

    A registry factory (:class:`experiment.registry.MethodEntry` ``strategy``).  Depth tiers:
    InclusiveFL's server step with one tier and no momentum distillation (``beta = 0``),
    InclusiveFL's baselines; width tiers (the CNNs): HeteroFL's server on the one width.
    """
    if cfg.uses_width:
        return heterofl.build(cfg, entry, options)
    adam = FedAdamConfig.from_settings(cfg.settings_of(ServerAdamGroup))
    return InclusiveFL(beta=0.0, adam=adam, server_adam="per-tier", **options)


def build_local(cfg: RunConfig, entry: MethodEntry, options: Mapping[str, Any]) -> LocalTraining:
    """Local: every node trains its own model; nothing is aggregated (a registry factory)."""
    return LocalTraining(**options)
