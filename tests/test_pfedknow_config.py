"""pFedKnow's run-config keys and methods: validation names the key; the server builds the strategy."""

from __future__ import annotations

import dataclasses
import tomllib
from pathlib import Path

import pytest
import torch

from experiment.config import ConfigError, RunConfig
from experiment.registry import names
from models.data import (
    DataError,
    DataSpec,
    load_partition,
    load_splits,
    server_labeled_set,
    server_public_set,
    server_test_set,
)
from server.app import build_strategy
from strategies.pfedknow import PFedKnow
from strategies.pfedknow_modes import MODES
from strategies.pfedknow_modes import labeled_set as pfedknow_labeled_set

#: pFedKnow, its ablations and the SemiFL-style baseline: the methods whose clients are unlabeled
PFEDKNOW_METHODS = names(client="unlabeled-pruning")

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
    with pytest.raises(DataError, match="'pfedknow-labeled-size'"):
        pfedknow_labeled_set(RunConfig.from_flower({**BASE, "pfedknow-labeled-size": 10_000_000}))


def test_labeled_set_comes_from_training_data_no_client_holds() -> None:
    cfg = RunConfig.from_flower(BASE)
    assert cfg.data_spec().server_labeled_size == 50
    other = RunConfig.from_flower(
        {**BASE, "method": "heterofl", "model": "cnn", "tiers": "weak,medium,strong", "tier-proportions": "1,1,1"}
    )
    assert other.data_spec().server_labeled_size == 0  # only pFedKnow's runs carve a labeled set
    spec = DataSpec(server_labeled_size=50, seed=3)
    labeled = set(server_labeled_set(spec)["text"])
    assert len(labeled) >= 49  # a few snippets repeat in the source
    assert not labeled & set(server_test_set(spec)["text"])
    assert labeled <= set(load_splits(dataclasses.replace(spec, server_labeled_size=0))[0]["text"])
    for pid in range(3):
        train, test = load_partition(spec, pid, 3)
        assert not labeled & (set(train["text"]) | set(test["text"]))
    with pytest.raises(DataError, match="size 0"):
        server_labeled_set(DataSpec())


def test_teacher_public_set_is_training_data_only_the_teacher_sees() -> None:
    """``pfedknow-teacher-public-size``: carved after D_s, disjoint from it, the clients and the held-out split."""
    cfg = RunConfig.from_flower({**BASE, "pfedknow-teacher-public-size": 30})
    spec = cfg.data_spec()
    assert spec.server_public_size == 30 and RunConfig.from_flower(BASE).data_spec().server_public_size == 0
    assert RunConfig.from_flower(
        {**BASE, "method": "pfedknow-as1", "pfedknow-teacher-public-size": 30}
    ).data_spec() == dataclasses.replace(spec, server_public_size=30)  # the ablations' clients hold the same data
    text = dataclasses.replace(DataSpec(), server_labeled_size=50, server_public_size=30, seed=3)
    labeled, public = set(server_labeled_set(text)["text"]), set(server_public_set(text)["text"])
    assert len(server_public_set(text)) == 30 and not labeled & public
    assert labeled == set(server_labeled_set(dataclasses.replace(text, server_public_size=0))["text"])  # D_s unchanged
    assert not public & set(server_test_set(text)["text"])
    train = load_splits(text)[0]
    assert len(train) == len(load_splits(dataclasses.replace(text, server_public_size=0))[0]) - 30
    assert not public & set(train["text"])
    assert len(server_public_set(dataclasses.replace(text, server_public_size=0))) == 0
    with pytest.raises(DataError, match="'pfedknow-teacher-public-size'"):
        server_public_set(dataclasses.replace(text, server_public_size=10_000_000))
    s = build_strategy(cfg)
    assert isinstance(s, PFedKnow)
    teacher_x, labeled_x = s.teacher_x, s.labeled_x
    assert isinstance(teacher_x, torch.Tensor) and isinstance(labeled_x, torch.Tensor)  # images
    assert labeled_x.shape[0] == 50 and teacher_x.shape[0] == 80
    assert torch.equal(teacher_x[:50], labeled_x)  # D_s, then the public examples
    with pytest.raises(ConfigError, match="'pfedknow-teacher-public-size'"):
        RunConfig.from_flower({**BASE, "pfedknow-teacher-public-size": -1})


@pytest.mark.parametrize("path", sorted(Path("deploy/configs").glob("pfedknow-*.toml")), ids=lambda p: p.name)
def test_shipped_run_configs_validate(path: Path) -> None:
    with path.open("rb") as f:
        cfg = RunConfig.from_flower(tomllib.load(f))
    assert cfg.method in PFEDKNOW_METHODS
    want = "embedded:rotten_tomatoes" if path.name == "pfedknow-text.toml" else "embedded:fashion_mnist"
    assert cfg.dataset == want
    assert cfg.client_test_split == "held-out"  # personalized models tested on held-out data, never training images
