"""Bytes per round per tier for each method: what a client downloads and uploads.

Computed from the strategies themselves, not estimated: for every method the strategy of
``server.app.build_strategy`` is built with its initial state and, per tier (variant), the
training message's payload ``to_record(strategy.variant_payload(node, variant))`` and the
reply's payload (the variant's *trainable* tensors, as ``client/app.py`` uploads them) are
serialized into ``ArrayRecord`` objects and measured with ``strategies.base.record_nbytes``
(the bytes that cross the wire, NumPy headers included) -- the same numbers a run writes as
``bytes-down`` / ``bytes-up`` per client in ``rounds.jsonl``.

Sparse: pFedKnow's upload codec (``models.sparse.to_wire``: surviving values + bitmask or
index list, packed into three arrays) on the same tensors with an element mask keeping a
fraction ``1 - prune`` of each tensor's largest-magnitude weights, against the dense upload.

Run ``python -m bench.communication --help``; ``--smoke`` is the test suite's tiny run.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from flwr.app import Array, ArrayRecord
from torch import Tensor

from bench.aggregation import MODELS, run_config
from bench.common import write_report
from server.app import build_strategy
from strategies.base import HeterogeneousStrategy
from strategies.records import record_nbytes, to_record

_MB = 1024 * 1024
#: method lists per model of :data:`bench.aggregation.MODELS` (plus the CNN of HeteroFL).
CASES: dict[str, tuple[str, ...]] = {
    "minilm-l6": ("inclusivefl", "all-large", "all-small", "heterofl", "fedrolex", "flexifed-max"),
    "vgg": ("flexifed-max",),
    "conv": ("heterofl", "all-small"),
}
EXTRA_MODELS: dict[str, dict[str, Any]] = {"conv": {"model": "conv"}}


def tier_bytes(model: str, method: str) -> list[dict[str, Any]]:
    """Per tier of ``method`` on ``model``: bytes down and up of one client and one round."""
    strategy = _strategy(model, method)
    rows = []
    for variant in strategy.catalog:
        payload = strategy.variant_payload(1, variant.name)
        trainable = {k: t for k, t in payload.items() if variant.layout.by_name()[k].trainable}
        rows.append(
            {
                "model": model,
                "method": method,
                "variant": variant.name,
                "params": variant.layout.num_params(),
                "down_bytes": record_nbytes(to_record(payload)),
                "up_bytes": record_nbytes(to_record(trainable)),
                "up_tensor_bytes": sum(t.numel() * t.element_size() for t in trainable.values()),
            }
        )
    return rows


def _strategy(model: str, method: str) -> HeterogeneousStrategy:
    """The run's strategy with its initial state, at round 1."""
    cfg = run_config(model, method) if model in MODELS else _config(model, method)
    strategy = build_strategy(cfg)
    strategy.set_state(strategy.initial_state(cfg.family().initial_states(cfg.catalog, seed=0)))
    strategy.current_round = 1
    return strategy


def _config(model: str, method: str) -> Any:
    from experiment.config import RunConfig

    return RunConfig.model_validate({**EXTRA_MODELS[model], "method": method})


def magnitude_masks(params: Mapping[str, Tensor], keep: float) -> dict[str, Tensor]:
    """Per tensor, the ``ceil(keep * n)`` largest-magnitude elements (at least one)."""
    masks = {}
    for name, t in params.items():
        k = max(1, round(keep * t.numel()))
        flat = t.detach().abs().flatten()
        mask = torch.zeros(t.numel(), dtype=torch.bool)
        mask[torch.topk(flat, k).indices] = True
        masks[name] = mask.view(t.shape)
    return masks


def sparse_bytes(model: str, method: str, prunes: Sequence[float]) -> list[dict[str, Any]]:
    """PFedKnow's sparse upload of each tier's trainable tensors vs the dense upload (``None`` if absent)."""
    try:
        from models.sparse import to_wire
    except ImportError:
        return []
    strategy = _strategy(model, method)
    rows = []
    for variant in strategy.catalog:
        payload = strategy.variant_payload(1, variant.name)
        params = {k: t.float() for k, t in payload.items() if variant.layout.by_name()[k].trainable}
        dense = record_nbytes(to_record(params))
        for prune in prunes:
            wire = to_wire(params, magnitude_masks(params, 1.0 - prune))
            sparse = record_nbytes(ArrayRecord({k: Array(v) for k, v in wire.items()}))
            rows.append(
                {"model": model, "variant": variant.name, "prune": prune, "dense_bytes": dense, "sparse_bytes": sparse}
            )
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line of :func:`main`."""
    p = argparse.ArgumentParser(prog="python -m bench.communication", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--models", default=",".join(CASES))
    p.add_argument("--prunes", default="0.3,0.5,0.7", help="pFedKnow pruning ratios for the sparse rows")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--smoke", action="store_true", help="the tiny transformer only")
    a = p.parse_args(argv)
    if a.smoke:
        a.models = "tiny"
    return a


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Print the per-tier table (dense) and the sparse-vs-dense table."""
    a = parse_args(argv)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    cases = {**CASES, "tiny": ("inclusivefl", "heterofl", "flexifed-max")}
    rows: list[dict[str, Any]] = []
    print(f"{'model':<11}{'method':<14}{'tier':<9}{'params M':>9}{'down MB':>9}{'up MB':>8}")
    for model in a.models.split(","):
        for method in cases[model]:
            for r in tier_bytes(model, method):
                rows.append(r)
                print(
                    f"{model:<11}{method:<14}{r['variant']:<9}{r['params'] / 1e6:>9.2f}"
                    f"{r['down_bytes'] / _MB:>9.2f}{r['up_bytes'] / _MB:>8.2f}",
                    flush=True,
                )
    sparse: list[dict[str, Any]] = []
    prunes = [float(x) for x in a.prunes.split(",")]
    for model in a.models.split(","):
        if model in ("conv", "tiny"):
            sparse += sparse_bytes(model, "all-small" if model == "conv" else "inclusivefl", prunes)
    if sparse:
        print(f"\n{'model':<11}{'tier':<9}{'prune':>6}{'dense up KB':>12}{'sparse up KB':>13}{'sparse/dense':>13}")
        for r in sparse:
            print(
                f"{r['model']:<11}{r['variant']:<9}{r['prune']:>6.2f}{r['dense_bytes'] / 1024:>12.1f}"
                f"{r['sparse_bytes'] / 1024:>13.1f}{r['sparse_bytes'] / r['dense_bytes']:>13.3f}"
            )
    report = {"dense": rows, "sparse": sparse}
    write_report(a.json, report)
    return report


if __name__ == "__main__":
    main()
