"""DepthFL's strategy on exact numbers: prefixes sent, holder means folded, the round's distillation weight."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from experiment.config import ConfigError, RunConfig
from experiment.protocol import DEPTHFL_ROUND_KD_WEIGHT
from models.catalog import Layout, MemoryEstimate, ParamSpec, Variant, VariantCatalog
from models.exits import ExitFamily
from server.app import CentralEvaluator, build_strategy
from strategies.depthfl import DepthFL
from tests.toy import reply, sent


def exit_layout(depth: int) -> Layout:
    """``depth`` one-tensor blocks (shared) and as many exits (heads), layer ``i`` each."""
    blocks = [ParamSpec(f"blocks.{i}.w", (2,), "float32", i, "shared") for i in range(depth)]
    exits = [ParamSpec(f"exits.{i}.w", (2,), "float32", i, "head") for i in range(depth)]
    return Layout(tuple(blocks + exits))


CATALOG = VariantCatalog(
    "toy-exits",
    tuple(Variant(n, d, exit_layout(d), MemoryEstimate(d, 0, 0, 0)) for n, d in (("weak", 1), ("strong", 2))),
)


def strategy(*, kd_weight: float = 1.0, kd_rampup_rounds: int = 0, uniform: bool = False) -> DepthFL:
    s = DepthFL(catalog=CATALOG, kd_weight=kd_weight, kd_rampup_rounds=kd_rampup_rounds, uniform=uniform)
    init = {v.name: {p.name: torch.zeros(2) for p in v.layout} for v in CATALOG}
    s.set_state(s.initial_state(init))
    return s


def arrays(**values: list[float]) -> dict[str, np.ndarray]:
    return {k.replace("_", "."): np.asarray(v, dtype=np.float32) for k, v in values.items()}


WEAK = arrays(blocks_0_w=[2.0, 4.0], exits_0_w=[1.0, 1.0])
STRONG = arrays(blocks_0_w=[6.0, 8.0], blocks_1_w=[3.0, 3.0], exits_0_w=[5.0, 5.0], exits_1_w=[7.0, 7.0])


def test_one_deepest_model_is_kept_and_each_depth_is_sent_its_prefix() -> None:
    s = strategy()
    assert set(s.state) == {DepthFL.GLOBAL}
    assert list(s.variant_payload(1, "weak")) == ["blocks.0.w", "exits.0.w"]
    assert set(s.variant_payload(1, "strong")) == {"blocks.0.w", "blocks.1.w", "exits.0.w", "exits.1.w"}


def test_each_tensor_is_the_example_weighted_mean_over_the_replies_that_held_it() -> None:
    s = strategy()
    s.aggregate_train(
        1, [reply(sent(s, 1, "weak"), WEAK, num_examples=1), reply(sent(s, 2, "strong"), STRONG, num_examples=3)]
    )
    g = s.state[DepthFL.GLOBAL]
    torch.testing.assert_close(g["blocks.0.w"], torch.tensor([5.0, 7.0]))  # (1 x (2, 4) + 3 x (6, 8)) / 4
    torch.testing.assert_close(g["exits.0.w"], torch.tensor([4.0, 4.0]))  # (1 x 1 + 3 x 5) / 4
    torch.testing.assert_close(g["blocks.1.w"], torch.tensor([3.0, 3.0]))  # the strong reply alone
    torch.testing.assert_close(g["exits.1.w"], torch.tensor([7.0, 7.0]))


def test_uniform_weights_count_each_holder_once() -> None:
    s = strategy(uniform=True)
    s.aggregate_train(
        1, [reply(sent(s, 1, "weak"), WEAK, num_examples=1), reply(sent(s, 2, "strong"), STRONG, num_examples=3)]
    )
    torch.testing.assert_close(s.state[DepthFL.GLOBAL]["blocks.0.w"], torch.tensor([4.0, 6.0]))


def test_a_tensor_no_reply_held_keeps_its_value() -> None:
    s = strategy()
    s.aggregate_train(1, [reply(sent(s, 1, "weak"), WEAK, num_examples=2)])
    g = s.state[DepthFL.GLOBAL]
    torch.testing.assert_close(g["blocks.0.w"], torch.tensor([2.0, 4.0]))
    torch.testing.assert_close(g["blocks.1.w"], torch.zeros(2))
    torch.testing.assert_close(g["exits.1.w"], torch.zeros(2))


def test_a_train_message_carries_the_rounds_distillation_weight_and_an_evaluation_none() -> None:
    s = strategy(kd_weight=2.0, kd_rampup_rounds=10)
    _, train_keys = s.encode_payload(1, "weak", "train", 5)
    assert train_keys[DEPTHFL_ROUND_KD_WEIGHT] == pytest.approx(2.0 * math.exp(-5 * 0.6**2))  # 4 rounds of 10 ramped
    assert s.encode_payload(1, "weak", "train", 1)[1][DEPTHFL_ROUND_KD_WEIGHT] == pytest.approx(2.0 * math.exp(-5))
    assert s.encode_payload(1, "weak", "evaluate", 5)[1] == {}


def test_every_depth_is_evaluated_as_its_prefix_of_the_global_model() -> None:
    models = strategy().models_for_evaluation()
    assert {v: list(ms[0]) for v, ms in models.items()} == {
        "weak": ["blocks.0.w", "exits.0.w"],
        "strong": ["blocks.0.w", "blocks.1.w", "exits.0.w", "exits.1.w"],
    }


def test_a_negative_distillation_weight_is_refused_before_round_1() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        DepthFL(catalog=CATALOG, kd_weight=-1.0)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"model": "preresnet18", "tier-layers": "1:2:5"}, r"in 1 \.\. 4 \(the model's stages\)"),
        ({"model": "conv", "cnn-widths": "4:8:16:32", "tier-layers": "1:2:5"}, r"strictly increasing in 1 \.\. 4"),
        ({"model": "tiny", "tier-layers": "2:4:7"}, r"strictly increasing in 1 \.\. 6"),
        ({"model": "conv", "tier-layers": "1:2"}, "'tier-layers' has 2 entries but 'tiers' has 3"),
        (
            {"model": "preresnet18", "tier-layers": "1:2:4", "depthfl-exit-head": "bottleneck"},
            "'depthfl-exit-head': bottleneck exits are the 'conv' net's",
        ),
        ({"model": "tiny", "depthfl-exit-head": "bottleneck"}, "'depthfl-exit-head': bottleneck exits"),
    ],
)
def test_a_depth_the_model_does_not_have_fails_before_round_1_naming_the_key(
    config: dict[str, object], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig.from_flower({**config, "method": "depthfl"})


def test_the_factory_builds_depthfl_with_its_settings_over_the_exit_models() -> None:
    cfg = RunConfig.model_validate(
        {"model": "conv", "cnn-widths": "4:8", "tier-layers": "1:2", "tiers": "weak:strong", "tier-proportions": "1:1",
         "tier-memory-mb": "auto", "num-labels": 10, "method": "depthfl", "depthfl-kd-weight": 0.5,
         "depthfl-uniform": True}
    )  # fmt: skip
    s = build_strategy(cfg)
    assert isinstance(s, DepthFL) and (s.kd_weight, s.uniform) == (0.5, True)
    assert isinstance(cfg.family(), ExitFamily)
    assert [v.layout.names()[-1] for v in s.catalog] == ["exits.0.bias", "exits.1.bias"]


def test_the_exit_head_setting_reaches_the_conv_nets_exits_and_their_layout() -> None:
    cfg = RunConfig.model_validate(
        {"model": "conv", "cnn-widths": "4:8", "tier-layers": "1:2", "tiers": "weak:strong", "tier-proportions": "1:1",
         "tier-memory-mb": "auto", "num-labels": 10, "method": "depthfl", "depthfl-exit-head": "bottleneck"}
    )  # fmt: skip
    family = cfg.family()
    assert isinstance(family, ExitFamily) and family.exit_head == "bottleneck"
    weak, strong = build_strategy(cfg).catalog
    assert weak.layout.names()[-2:] == ["exits.0.linear.weight", "exits.0.linear.bias"]
    assert "exits.0.steps.0.op.0.weight" in weak.layout.names()
    assert set(weak.layout.names()) <= set(strong.layout.names())


def test_the_central_evaluation_reports_each_exits_accuracy_beside_the_ensembles() -> None:
    cfg = RunConfig.model_validate(
        {"model": "conv", "cnn-widths": "4:8", "tier-layers": "1:2", "tiers": "weak:strong", "tier-proportions": "1:1",
         "tier-memory-mb": "auto", "num-labels": 10, "method": "depthfl", "dataset": "embedded:fashion_mnist",
         "image-channels": 1, "image-size": 28, "server-test-size": 200}
    )  # fmt: skip
    states = cfg.family().initial_states(cfg.catalog, seed=0)
    out = CentralEvaluator(cfg)({"weak": [states["weak"]], "strong": [states["strong"]]})
    assert set(out["weak"]) == {"loss", "accuracy", "exit-1-accuracy"}
    assert set(out["strong"]) == {"loss", "accuracy", "exit-1-accuracy", "exit-2-accuracy"}
    assert all(0.0 <= v <= 1.0 for m in out.values() for k, v in m.items() if k != "loss")
