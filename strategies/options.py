"""The options every heterogeneous strategy shares and their checks (:class:`strategies.base.HeterogeneousStrategy`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TypedDict


class StrategyOptions(TypedDict, total=False):
    """The options of :class:`~strategies.base.HeterogeneousStrategy` a method's strategy passes on unchanged.

    A method's ``__init__`` takes its own parameters and ``**options: Unpack[StrategyOptions]``
    (typed keyword options, not an untyped catch-all); each key is the base parameter of the same name.

    Attributes
    ----------
    fraction_train, fraction_evaluate : float
        Share of eligible nodes sampled per round.
    min_train_nodes, min_evaluate_nodes : int
        Lower bound on the sample size (capped at the eligible nodes).
    min_available_nodes : int
        Wait until this many nodes are connected before a round starts.
    assign : {"choice", "largest"}
        ``choice`` trains each node on the variant it picked by memory; ``largest`` ignores
        memory and gives every answering node the largest variant (the AllLarge upper bound).
    max_examples : int
        Upper bound accepted for a reply's ``num-examples``.
    query_timeout : float
        Seconds to wait for handshake replies.
    seed : int
        Seed of node sampling.
    clip_update_norm : Mapping[str, float], optional
        Per variant (group) the bound ``c`` on a reply's update norm ``||x - w||_2``
        (:func:`strategies.robust.clip_update`); a missing variant or ``c = 0`` is not clipped.
    robust_aggregation : {"mean", "median"}
        ``mean`` streams replies into example-weighted means (``O(groups x model)``); ``median``
        buffers each group's replies and folds their coordinate-wise median once, weighted by the
        group's total examples (``O(clients x model)``, opt-in; only for methods with ``supports_median``).

    """

    fraction_train: float
    fraction_evaluate: float
    min_train_nodes: int
    min_evaluate_nodes: int
    min_available_nodes: int
    assign: str
    max_examples: int
    query_timeout: float
    seed: int
    clip_update_norm: Mapping[str, float] | None
    robust_aggregation: str


def check_options(
    strategy: str,
    *,
    fraction_train: float,
    fraction_evaluate: float,
    assign: str,
    robust_aggregation: str,
    supports_median: bool,
    clip_update_norm: Mapping[str, float] | None,
) -> dict[str, float]:
    """Raise ``ValueError`` naming the first option of ``strategy`` out of its range; return the active clip bounds.

    The clip bounds returned are those ``> 0`` (a bound of 0 means "not clipped").
    """
    if not 0.0 < fraction_train <= 1.0:
        raise ValueError(f"fraction_train must be in (0, 1], got {fraction_train}")
    if not 0.0 <= fraction_evaluate <= 1.0:
        raise ValueError(f"fraction_evaluate must be in [0, 1], got {fraction_evaluate}")
    if assign not in ("choice", "largest"):
        raise ValueError(f"assign must be 'choice' or 'largest', got {assign!r}")
    if robust_aggregation not in ("mean", "median"):
        raise ValueError(f"robust_aggregation must be 'mean' or 'median', got {robust_aggregation!r}")
    if robust_aggregation == "median" and not supports_median:
        raise ValueError(f"{strategy} does not support the coordinate-wise median")
    bounds = dict(clip_update_norm or {})
    bad = {k: c for k, c in bounds.items() if not (math.isfinite(c) and c >= 0)}
    if bad:
        raise ValueError(f"clip_update_norm bounds must be finite and >= 0, got {bad}")
    return {k: c for k, c in bounds.items() if c > 0}
