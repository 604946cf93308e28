"""pFedKnow's run-config keys and methods: validation names the key; the server builds the strategy."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import torch

from server.app import build_strategy, pfedknow_labeled_set
from server.config import PFEDKNOW_METHODS, ConfigError, RunConfig
from strategies.pfedknow import MODES, PFedKnow

BASE = {
    "method": "pfedknow",
    "model": "conv",
    "cnn-widths": "4:8",
    "tiers": "iot",
    "tier-proportions": "1",
    "tier-memory-mb": "auto",
    "dataset": "embedded:fashion_mnist",
    "num-labels": 10,
    "server-test-size": 100,
    "pfedknow-labeled-size": 50,
}


def test_every_method_has_a_mode() -> None:
    assert set(PFEDKNOW_METHODS) == set(MODES)
    for method in PFEDKNOW_METHODS:
        assert RunConfig.from_flower({**BASE, "method": method}).method == method


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ({"model": "preresnet18"}, "'model'"),
        ({"tiers": "a:b", "tier-proportions": "1:1"}, "'tiers'"),
        ({"server-test-size": 0}, "'server-test-size'"),
        ({"pfedknow-delta": 0.0}, "'pfedknow-delta'"),
        ({"pfedknow-prune-ratio": 1.0}, "'pfedknow-prune-ratio'"),
        ({"pfedknow-prune-rounds": 0}, "'pfedknow-prune-rounds'"),
        ({"pfedknow-teacher-scale": 0.5}, "'pfedknow-teacher-scale'"),
        ({"semifl-confidence": 1.0}, "'semifl-confidence'"),
    ],
)
def test_invalid_settings_name_the_key(override: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        RunConfig.from_flower({**BASE, **override})


def test_server_builds_pfedknow_with_a_disjoint_labeled_set() -> None:
    cfg = RunConfig.from_flower(BASE)
    s = build_strategy(cfg)
    assert isinstance(s, PFedKnow) and s.mode == MODES["pfedknow"]
    x, y = pfedknow_labeled_set(cfg)
    assert isinstance(x, torch.Tensor) and isinstance(s.labeled_x, torch.Tensor)
    assert x.shape == (50, 1, 28, 28) and y.shape == (50,)
    assert torch.equal(s.labeled_x, x)
    teacher, light = s.build_teacher(), s.build_model()
    assert sum(p.numel() for p in teacher.parameters()) > 3 * sum(p.numel() for p in light.parameters())
    semifl = build_strategy(RunConfig.from_flower({**BASE, "method": "semifl"}))
    assert isinstance(semifl, PFedKnow) and semifl.delta == pytest.approx(0.05)  # 1 - confidence
    with pytest.raises(ConfigError, match="'pfedknow-labeled-size'"):
        pfedknow_labeled_set(RunConfig.from_flower({**BASE, "server-test-size": 10_000}))


@pytest.mark.parametrize("path", sorted(Path("deploy/configs").glob("pfedknow-*.toml")), ids=lambda p: p.name)
def test_shipped_run_configs_validate(path: Path) -> None:
    with path.open("rb") as f:
        cfg = RunConfig.from_flower(tomllib.load(f))
    assert cfg.method in PFEDKNOW_METHODS
    want = "embedded:rotten_tomatoes" if path.name == "pfedknow-text.toml" else "embedded:fashion_mnist"
    assert cfg.dataset == want
