"""DepthFL in a real `flwr run` (Ray simulation, 6 virtual clients): the tiny transformer and the conv net."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from experiment.config import RunConfig
from tests.flower_runs import TINY, read_rounds
from tests.test_simulation import simulate

#: HeteroFL's conv net, 4x narrower than the default, cut at 1 / 2 / 4 of its 4 blocks.
CNN_DEPTHS = (
    "model='conv' cnn-widths='4:8:16:32' tier-layers='1:2:4' dataset='embedded:fashion_mnist' num-labels=10 "
    "optimizer='sgd' lr=0.05 batch-size=32 tier-memory-mb='auto'"
)


def assert_every_depth_trains_its_exits(folder: Path, cfg: RunConfig) -> None:
    """Two clients per tier, nothing rejected, each uploading exactly its depth's trainable tensors."""
    rows = read_rounds(folder)
    assert [r["round"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["rejected"] == [] and row["failed"] == []
        assert {t: v["clients"] for t, v in row["tiers"].items() if "clients" in v} == dict.fromkeys(cfg.tier_names, 2)
        for tier in cfg.tier_names:
            vals = row["tiers"][tier]
            trained = [p for p in cfg.catalog.get(tier).layout if p.trainable]
            data = sum(4 * math.prod(p.shape) for p in trained)
            assert data + 64 * len(trained) <= vals["bytes-up"] / 2 <= data + 256 * len(trained), tier
            assert vals["layers"] == cfg.catalog.get(tier).depth
            assert 0.0 <= vals["local-accuracy"] <= 1.0 and math.isfinite(vals["local-loss"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_depthfl_on_the_tiny_transformer_trains_every_depth_with_its_exits(tmp_path: Path) -> None:
    config = "method='depthfl' num-server-rounds=2 tier-memory-mb='auto' depthfl-kd-rampup-rounds=2"
    folder = simulate(tmp_path, "depthfl-tiny", f"{TINY} {config}")
    cfg = RunConfig.model_validate({"model": "tiny", "method": "depthfl"})
    assert_every_depth_trains_its_exits(folder, cfg)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_depthfl_on_the_conv_net_trains_every_depth_and_beats_chance(tmp_path: Path) -> None:
    folder = simulate(tmp_path, "depthfl-conv", f"{CNN_DEPTHS} method='depthfl' num-server-rounds=2")
    cfg = RunConfig.model_validate(
        {"model": "conv", "cnn-widths": "4:8:16:32", "tier-layers": "1:2:4", "num-labels": 10, "method": "depthfl"}
    )
    assert_every_depth_trains_its_exits(folder, cfg)
    assert read_rounds(folder)[-1]["tiers"]["strong"]["local-accuracy"] > 0.1  # sBN evaluation beats chance
