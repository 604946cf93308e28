"""Run configuration: pyproject defaults, fast failures naming the key."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from deploy.cluster import shared_core_threads
from deploy.overrides import config_file_overrides, merge_overrides
from experiment.config import ConfigError, RunConfig
from models.catalog import choose_variant
from server.app import build_strategy
from strategies.codistill import CoDistillation
from strategies.flexifed import FlexiFed
from strategies.inclusivefl import InclusiveFL

ROOT = Path(__file__).resolve().parent.parent


def pyproject_config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def test_pyproject_defaults_equal_model_defaults() -> None:
    cfg = pyproject_config()
    assert RunConfig.from_flower(cfg).model_dump(by_alias=True) == RunConfig().model_dump(by_alias=True)
    assert set(cfg) == set(RunConfig().model_dump(by_alias=True))


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("method", "fedsomething"),
        ("beta", 1.5),
        ("fraction-train", 0.0),
        ("tier-layers", "4:2:6"),
        ("tier-layers", "2:4"),
        ("tier-proportions", "1:x:1"),
        ("tier-memory-mb", "-1:2:3"),
        ("tiers", "weak:weak:strong"),
        ("optimizer", "lbfgs"),
        ("partitioner", "shards"),
        ("num-server-rounds", 0),
        ("max-seq-len", 4),
        ("server-tau", 0),
        ("client-threads", -1),
        ("server-threads", -2),
    ],
)
def test_invalid_value_fails_naming_the_key(key: str, value: object) -> None:
    cfg = {**pyproject_config(), key: value}
    with pytest.raises(ConfigError) as err:
        RunConfig.from_flower(cfg)
    msg = str(err.value)
    assert "run config" in msg
    named = key in msg or (key == "tier-layers" and "tier-layers" in msg)
    assert named, msg


def test_unknown_key_rejected() -> None:
    with pytest.raises(ConfigError, match="'num-rounds'"):
        RunConfig.from_flower({**pyproject_config(), "num-rounds": 3})


def test_client_threads_applied_by_every_handler_config() -> None:
    import torch

    from client.app import run_config
    from models.training import use_threads

    before = torch.get_num_threads()
    try:
        ctx = SimpleNamespace(run_config={**pyproject_config(), "client-threads": 1}, node_config={})
        assert run_config(ctx).client_threads == 1  # type: ignore[arg-type]
        assert torch.get_num_threads() == 1
        ctx.run_config["client-threads"] = 0  # 0 leaves the count alone
        run_config(ctx)  # type: ignore[arg-type]
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="threads"):
            use_threads(-1)
    finally:
        torch.set_num_threads(before)


def test_training_catalog_per_method() -> None:
    for method, names in (
        ("inclusivefl", ["weak", "medium", "strong"]),
        ("local", ["weak", "medium", "strong"]),
        ("all-large", ["strong"]),
        ("exclusive", ["strong"]),
        ("all-small", ["weak"]),
    ):
        assert RunConfig(model="tiny", method=method).training_catalog.names() == names  # type: ignore[arg-type]


def test_cnn_models_run_width_methods_only() -> None:
    with pytest.raises(ConfigError, match=r"'method'.*depth-cut"):
        RunConfig.from_flower({**pyproject_config(), "model": "conv", "method": "inclusivefl"})
    cfg = RunConfig.from_flower({**pyproject_config(), "model": "conv", "method": "all-small", "num-labels": 10})
    assert cfg.uses_width and cfg.width_rates == [0.25, 0.5, 1.0]
    assert cfg.training_catalog.names() == ["weak"] and cfg.catalog.largest.extra["rate"] == 1.0
    with pytest.raises(ConfigError, match="cnn-widths"):
        RunConfig.from_flower({**pyproject_config(), "model": "conv", "method": "heterofl", "cnn-widths": "8:0"})


@pytest.mark.parametrize("model", ["conv", "preresnet18", "tiny"])
def test_auto_memory_budgets_give_every_tier_its_own_variant(model: str) -> None:
    method = "inclusivefl" if model == "tiny" else "heterofl"
    cfg = RunConfig.model_validate({"model": model, "method": method, "tier-memory-mb": "auto"})
    estimates = {v.name: v.memory.total_mb for v in cfg.catalog}
    for tier, budget in cfg.memory_budgets.items():
        chosen, _ = choose_variant(estimates, budget, cfg.runtime_overhead_mb)
        assert chosen == tier, (tier, budget, estimates)


@pytest.mark.parametrize("path", sorted((ROOT / "deploy" / "configs").glob("*.toml")), ids=lambda p: p.stem)
def test_shipped_run_configs_are_valid(path: Path) -> None:
    pairs = config_file_overrides(path)
    values = {k: tomllib.loads(f"v = {v}")["v"] for k, v in re.findall(r"(\S+?)=('[^']*'|\S+)", pairs)}
    assert values == tomllib.loads(path.read_text())
    cfg = RunConfig.from_flower({**pyproject_config(), **values})
    assert len(cfg.training_catalog) >= 1


def test_launcher_overrides_later_values_win() -> None:
    assert merge_overrides("a='x y' b=2", "b=3 c=true") == "a='x y' b=3 c=true"


def test_flexifed_methods_need_architectures_or_depth_tiers() -> None:
    base = {**pyproject_config(), "num-labels": 10}
    with pytest.raises(ConfigError, match=r"'method'.*'vgg', 'resnet'"):
        RunConfig.from_flower({**base, "model": "conv", "method": "flexifed-max"})
    text = build_strategy(RunConfig.from_flower({**base, "model": "tiny", "method": "flexifed-max"}))
    assert isinstance(text, FlexiFed) and text.catalog.names() == ["weak", "medium", "strong"]
    with pytest.raises(ConfigError, match=r"'tiers'.*resnet20"):
        RunConfig.from_flower({**base, "model": "vgg", "method": "flexifed-max", "tiers": "vgg11:resnet20"})
    with pytest.raises(ConfigError, match=r"'method'.*'heterofl'"):
        RunConfig.from_flower({**base, "model": "resnet", "method": "heterofl", "tiers": "resnet20:resnet32"})
    cfg = RunConfig.from_flower(
        {
            **base,
            "model": "resnet",
            "method": "clustered-fl",
            "tiers": "resnet56:resnet20",
            "tier-proportions": "1:1",
            "tier-memory-mb": "auto",
        }
    )
    assert cfg.catalog.names() == ["resnet20", "resnet56"]  # smallest estimate first, whatever the tier order
    strategy = build_strategy(cfg)
    assert isinstance(strategy, FlexiFed) and strategy.mode == "clustered-fl"


def test_codist_methods_and_model_go_together() -> None:
    base = {**pyproject_config(), "num-labels": 10, "dataset": "embedded:fashion_mnist"}
    with pytest.raises(ConfigError, match=r"'method'.*needs a co-distillation method"):
        RunConfig.from_flower({**base, "model": "codist-cnn", "method": "heterofl", "tiers": "small:large"})
    with pytest.raises(ConfigError, match=r"'method'.*pools are model sizes"):
        RunConfig.from_flower({**base, "model": "conv", "method": "codist-merged"})
    with pytest.raises(ConfigError, match=r"'tiers'.*pools"):
        RunConfig.from_flower({**base, "model": "codist-cnn", "method": "codist-merged", "tiers": "weak:medium:strong"})
    cfg = RunConfig.from_flower(
        {
            **base,
            "model": "codist-cnn",
            "method": "codist-periodic",
            "tiers": "small:large",
            "tier-proportions": "1:1",
            "tier-memory-mb": "auto",
            "distill-size": 64,
        }
    )
    assert [v.layout.num_params() for v in cfg.catalog] == [124_074, 492_874]  # 1x28x28 input, 10 classes
    strategy = build_strategy(cfg)
    assert isinstance(strategy, CoDistillation) and strategy.mode == "periodic"
    assert {p: c.eta for p, c in strategy.adam_cfg.items()} == {"small": cfg.server_lr, "large": cfg.server_lr}


def test_tier_server_lr_sets_each_pools_eta_and_fails_naming_the_key() -> None:
    base = {
        **pyproject_config(),
        "num-labels": 10,
        "dataset": "embedded:fashion_mnist",
        "model": "codist-cnn",
        "method": "codist-fedavg",
        "tiers": "small:large",
        "tier-proportions": "1:1",
        "tier-memory-mb": "auto",
        "server-lr": 0.05,
    }
    cfg = RunConfig.from_flower({**base, "tier-server-lr": "0.03:0.003"})
    strategy = build_strategy(cfg)
    assert isinstance(strategy, CoDistillation)
    assert {p: c.eta for p, c in strategy.adam_cfg.items()} == {"small": 0.03, "large": 0.003}
    assert {c.beta_2 for c in strategy.adam_cfg.values()} == {cfg.server_beta2}  # only eta differs
    for value, match in (
        ("0.03", "has 1 entries but 'tiers' has 2"),
        ("0.03:0", "finite and > 0"),
        ("0.03:nan", "finite and > 0"),
        ("0.03:fast", "'fast' is not a number"),
    ):
        with pytest.raises(ConfigError, match=rf"'tier-server-lr'.*{match}"):
            RunConfig.from_flower({**base, "tier-server-lr": value})
    with pytest.raises(ConfigError, match=r"'tier-server-lr'.*only co-distillation.*'heterofl' takes 'server-lr'"):
        RunConfig.from_flower({**pyproject_config(), "method": "heterofl", "tier-server-lr": "0.1:0.1:0.1"})


def test_inclusivefl_server_adam_reaches_the_strategy_and_only_inclusivefl() -> None:
    base = {**pyproject_config(), "model": "tiny", "method": "inclusivefl"}
    for value in ("per-tier", "shared"):
        strategy = build_strategy(RunConfig.from_flower({**base, "inclusivefl-server-adam": value}))
        assert isinstance(strategy, InclusiveFL) and strategy.server_adam == value
    with pytest.raises(ConfigError, match=r"'inclusivefl-server-adam'.*'per-tier'"):
        RunConfig.from_flower({**base, "method": "exclusive", "inclusivefl-server-adam": "shared"})


def test_loopback_nodes_sharing_cores_get_a_share_of_threads_each() -> None:
    assert shared_core_threads(3, cores=2) == 1
    assert shared_core_threads(3, cores=16) == 5
    assert shared_core_threads(1, cores=8) == 8
    assert shared_core_threads(0, cores=4) == 4
    # the launcher's default comes first, so a run config's own client-threads wins
    assert merge_overrides("client-threads=1", "client-threads=4") == "client-threads=4"
