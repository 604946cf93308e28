"""Shared settings for the multi-process tests (simulation and loopback deployment)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from itertools import pairwise
from pathlib import Path
from typing import Any

from experiment.config import RunConfig

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
