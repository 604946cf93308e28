"""Shared settings for the multi-process tests (simulation and loopback deployment)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from itertools import pairwise
from pathlib import Path
from typing import Any

import torch

from experiment.config import RunConfig
from server.checkpoint import list_checkpoints, read_checkpoint

#: Final weights of a resumed run vs an uninterrupted one.  Client training is a pure function of
#: (weights, seed, partition, round) (``client.app.train_seed``), the server state is restored bit
#: for bit, and held replies are folded in node-key order (``strategies.replies.in_node_order``), so
#: a resumed simulation matches exactly (``tests/test_resume.py`` asserts 0).  The tolerance stays
#: for the chaos suite's SuperLink restart, last measured (1.6e-6) when replies were folded in
#: arrival order (float32 sums ``a + w b`` vs ``b + w a`` round differently, e.g. under FMA).
RESUMED_ATOL, RESUMED_RTOL = 1e-5, 1e-4

#: Tiny model, short rounds: enough to exercise every tier and every message type.
TINY = (
    "model='tiny' server-test-size=100 local-steps=2 eval-batch-size=32 client-test-fraction=0.2 fraction-evaluate=1.0"
)


def tiny_budgets(config: Mapping[str, object] | None = None, *, overhead: float = 450.0) -> str:
    """``tier-memory-mb`` that makes each tier pick its own tiny variant by memory."""
    cat = RunConfig.model_validate({"model": "tiny", **(config or {})}).catalog
    est = [v.memory.total_mb for v in cat]
    budgets = [overhead + (a + b) / 2 for a, b in pairwise(est)] + [overhead + est[-1] + 100]
    return ":".join(f"{b:.1f}" for b in budgets)


def tiny_trainable_bytes(config: Mapping[str, object] | None = None) -> dict[str, tuple[int, int]]:
    """Per tiny variant: payload bytes of its trainable tensors and their count."""
    return {
        v.name: (v.layout.nbytes(trainable_only=True), len(v.layout.trainable_names()))
        for v in RunConfig.model_validate({"model": "tiny", **(config or {})}).catalog
    }


def tiny_depths() -> dict[str, int]:
    """Encoder layers of each tiny tier variant."""
    return dict(RunConfig(model="tiny").tier_depths)


def read_rounds(folder: Path) -> list[dict[str, Any]]:
    """Rows of ``rounds.jsonl``."""
    return [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines() if line.strip()]


def node_ids(log: str) -> list[int]:
    """Every ``SuperNode ID: N`` a SuperNode logged, in order."""
    return [int(x) for x in re.findall(r"SuperNode ID: (\d+)", log)]


def final_strategy_state(folder: Path, rounds: int) -> dict[str, Any]:
    """The strategy state in the newest checkpoint of the run in ``folder`` (which must be round ``rounds``'s)."""
    last, path = list_checkpoints(folder / "checkpoints")[-1]
    if last != rounds:
        raise AssertionError(f"{folder}: newest checkpoint is round {last}, expected {rounds}")
    state: dict[str, Any] = read_checkpoint(path).payload["strategy"]
    return state


def models_by_key(strategy_state: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """Per-variant models, plus every per-node model under its node's stable key (node ids change per run)."""
    out = {f"variant {v}": p for v, p in strategy_state["state"].items()}
    for node, params in strategy_state["method"].get("node-states", {}).items():
        out[strategy_state["nodes"][node]] = params
    return out


def assert_same_models(reference: Mapping[str, Any], other: Mapping[str, Any]) -> float:
    """Assert two strategy states hold the same models (:data:`RESUMED_ATOL`); the largest difference.

    Every model is compared under its stable key (:func:`models_by_key`); the key sets must match.
    """
    ref, res = models_by_key(reference), models_by_key(other)
    assert ref.keys() == res.keys(), (sorted(ref), sorted(res))
    worst = 0.0
    for key, params in ref.items():
        for name, t in params.items():
            torch.testing.assert_close(
                res[key][name], t, atol=RESUMED_ATOL, rtol=RESUMED_RTOL, msg=f"{key} {name} differs"
            )
            worst = max(worst, float((res[key][name] - t).abs().max()))
    return worst
