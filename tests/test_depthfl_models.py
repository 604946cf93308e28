"""DepthFL's multi-exit conv net: prefix states, exits, ensemble prediction, sBN and its catalog."""

from __future__ import annotations

import pytest
import torch

from models.cnn import ConvNet, recompute_bn_statistics
from models.exits import (
    ExitConvNet,
    ExitsError,
    ensemble_logits,
    exit_conv_catalog,
    exit_conv_layout,
    exit_conv_place,
)

BASE = (2, 4, 8)


def shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_a_shallower_model_is_a_prefix_of_the_deepest_and_keeps_the_conv_nets_block_names() -> None:
    deepest = shapes(ExitConvNet(3, in_channels=1, num_classes=5, base=BASE))
    for depth in (1, 2):
        sub = shapes(ExitConvNet(depth, in_channels=1, num_classes=5, base=BASE))
        assert all(deepest[k] == s for k, s in sub.items())
        assert {k.split(".")[1] for k in sub} == {str(i) for i in range(depth)}
    conv = {k: s for k, s in shapes(ConvNet(1.0, in_channels=1, num_classes=5, base=BASE)).items() if "blocks" in k}
    assert conv == {k: s for k, s in deepest.items() if k.startswith("blocks.")}
    assert deepest["exits.1.weight"] == (5, 4)


def test_the_prediction_is_the_mean_of_every_exits_logits() -> None:
    torch.manual_seed(0)
    model = ExitConvNet(3, in_channels=1, num_classes=5, base=BASE).eval()
    x = torch.randn(2, 1, 8, 8)
    exits = model.exit_logits(x)
    assert [tuple(z.shape) for z in exits] == [(2, 5)] * 3
    torch.testing.assert_close(model(x), ensemble_logits(exits))


def test_static_batch_norm_statistics_are_recomputed_as_for_the_conv_net() -> None:
    torch.manual_seed(0)
    model = ExitConvNet(2, in_channels=1, num_classes=3, base=BASE)
    batches = [{"x": torch.randn(4, 1, 8, 8)} for _ in range(2)]
    evaluated = recompute_bn_statistics(model, batches, input_key="x")
    assert isinstance(evaluated, ExitConvNet)
    norms = [m for m in evaluated.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 2 and all(n.track_running_stats and n.running_mean is not None for n in norms)
    assert tuple(evaluated(torch.randn(3, 1, 8, 8)).shape) == (3, 3)


def test_the_layout_places_block_i_as_shared_and_exit_i_as_a_head_both_at_layer_i() -> None:
    layout = exit_conv_layout(2, in_channels=1, num_classes=3, base=BASE)
    placed = {p.name: (p.layer, p.role) for p in layout}
    assert placed["blocks.1.conv.weight"] == (1, "shared")
    assert placed["exits.0.bias"] == (0, "head")
    with pytest.raises(ExitsError, match="not a tensor"):
        exit_conv_place("classifier.weight")


def test_the_catalog_estimates_activations_of_a_variants_own_blocks() -> None:
    # base (2, 4, 8), 8x8 images, batch 1: conv outputs 2x8x8, 4x4x4, 8x2x2 -> 128, 64, 32 elements
    catalog = exit_conv_catalog(
        [("weak", 1), ("strong", 3)], in_channels=1, num_classes=3, image_size=8, batch_size=1, base=BASE
    )
    weak, strong = catalog.variants
    assert (weak.depth, strong.depth, weak.extra["exits"]) == (1, 3, 1)
    assert weak.memory.activations == 4 * 4 * 128  # 4 bytes x 4 floats per conv output element
    assert strong.memory.activations == 4 * 4 * (128 + 64 + 32)
    assert weak.memory.parameters == 4 * weak.layout.num_params()


@pytest.mark.parametrize("depths", [[("a", 2), ("b", 1)], [("a", 0)], [("a", 4)], []])
def test_depths_out_of_order_or_range_are_refused(depths: list[tuple[str, int]]) -> None:
    with pytest.raises(ExitsError, match="strictly increasing"):
        exit_conv_catalog(depths, in_channels=1, num_classes=3, image_size=8, batch_size=1, base=BASE)


def test_a_depth_beyond_the_conv_nets_blocks_is_refused() -> None:
    with pytest.raises(ExitsError, match=r"depth must be in 1 \.\. 3"):
        ExitConvNet(4, in_channels=1, num_classes=3, base=BASE)
