"""FlexiFed architecture families: shared layers by signature, shapes, catalog."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from models.architectures import (
    ARCHITECTURES,
    ArchitectureError,
    ArchLayer,
    LayerSignature,
    architecture_catalog,
    architecture_layers,
    architecture_layout,
    build_architecture,
    conv_output_shapes,
)
from models.catalog import CatalogError
from strategies.flexifed import common_prefix_length

W = 0.125


def sigs(name: str, in_channels: int = 3, width: float = W) -> list[LayerSignature]:
    layers = architecture_layers(name, width=width, in_channels=in_channels, num_classes=10)
    return [layer.signature for layer in layers]


def shared(a: str, b: str, in_channels: int = 3, width: float = W) -> int:
    return common_prefix_length(sigs(a, in_channels, width), sigs(b, in_channels, width))


@pytest.mark.parametrize("in_channels", [1, 3])
def test_vgg_common_base_layers(in_channels: int) -> None:
    assert shared("vgg11", "vgg13", in_channels) == 1
    assert shared("vgg16", "vgg19", in_channels) == 7  # 64, 64, M, 128, 128, M, 256, 256, 256
    assert shared("vgg13", "vgg16", in_channels) == 6  # 64, 64, M, 128, 128, M, 256, 256
    assert shared("vgg11", "vgg19", in_channels) == 1
    assert shared("vgg16", "vgg16", in_channels) == len(sigs("vgg16", in_channels))


def test_resnet_common_base_layers() -> None:
    # stem + the 2n convs of stage 1 of the shallower net: ResNet-20 and ResNet-32 share 7 layers
    assert shared("resnet20", "resnet32") == 7
    assert shared("resnet32", "resnet44") == 11
    assert shared("resnet44", "resnet56") == 15
    assert shared("resnet20", "resnet56") == 7
    # layer 8 differs: stride-2 16->32 conv in ResNet-20, stride-1 16->16 conv in ResNet-32
    a, b = sigs("resnet20", width=1.0), sigs("resnet32", width=1.0)
    assert (a[7].kind, a[7].shapes[0]) == ("conv3x3-s2+bn", (32, 16, 3, 3))
    assert (b[7].kind, b[7].shapes[0]) == ("conv3x3-s1+bn", (16, 16, 3, 3))
    assert shared("vgg11", "resnet20") == 0


def test_common_layers_are_found_by_signature_not_by_name() -> None:
    l16 = architecture_layers("vgg16", width=W, in_channels=3, num_classes=10)
    l19 = architecture_layers("vgg19", width=W, in_channels=3, num_classes=10)
    # layer 8 has the same tensor names and the same input channels, but VGG-16 max-pools before
    # it and widens to 512 while VGG-19 does not
    assert l16[7].names == l19[7].names == ("features.7.conv.weight", "features.7.norm.weight", "features.7.norm.bias")
    assert l16[7].signature != l19[7].signature
    assert l16[7].signature.ops == ("relu", "maxpool2") and l19[7].signature.ops == ("relu",)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_layers_partition_the_state_dict(name: str) -> None:
    model = build_architecture(name, width=W, in_channels=3, num_classes=10)
    layers = model.layers()
    names = [n for layer in layers for n in layer.names]
    assert sorted(names) == sorted(model.state_dict()) and len(names) == len(set(names))
    sd = model.state_dict()
    for layer in layers:
        assert tuple(tuple(sd[n].shape) for n in layer.names) == layer.signature.shapes
    assert [layer.signature.is_classifier for layer in layers] == [False] * (len(layers) - 1) + [True]
    assert layers[0].signature.ops == ()
    expected = {"vgg11": 9, "vgg13": 11, "vgg16": 14, "vgg19": 17}.get(name) or int(name.removeprefix("resnet"))
    assert len(layers) == expected  # VGG: convs + 1 head; ResNet: 6n + 2


def test_batch_norm_is_part_of_its_conv_layer_and_has_no_buffers() -> None:
    model = build_architecture("resnet20", width=W, in_channels=3, num_classes=10)
    assert list(model.buffers()) == []
    stem: ArchLayer = model.layers()[0]
    assert stem.names == ("stem.conv.weight", "stem.norm.weight", "stem.norm.bias")


@pytest.mark.parametrize("name", ARCHITECTURES)
@pytest.mark.parametrize(("channels", "size"), [(1, 28), (3, 32)])
def test_forward_shapes(name: str, channels: int, size: int) -> None:
    model = build_architecture(name, width=W, in_channels=channels, num_classes=7)
    out = model(torch.randn(2, channels, size, size))
    assert out.shape == (2, 7)
    assert bool(torch.isfinite(out).all())


def test_vgg_pools_reach_one_pixel_at_28_and_32() -> None:
    kw: dict[str, Any] = {"width": W, "in_channels": 1, "num_classes": 10}
    assert [h for _, h, _ in conv_output_shapes("vgg11", image_size=28, **kw)] == [28, 14, 7, 7, 4, 4, 2, 2]
    assert [h for _, h, _ in conv_output_shapes("vgg11", image_size=32, **kw)] == [32, 16, 8, 8, 4, 4, 2, 2]
    # signatures do not depend on the image size (no pool is skipped)
    a = architecture_layers("vgg19", width=W, in_channels=1, num_classes=10)
    assert a[-1].signature.ops == ("relu", "maxpool2", "avgpool", "flatten")


def test_conv_output_shapes_match_a_real_forward_pass() -> None:
    model = build_architecture("resnet20", width=W, in_channels=3, num_classes=10)
    seen: list[tuple[int, int, int]] = []
    hooks = [
        m.register_forward_hook(lambda _m, _i, o: seen.append(tuple(o.shape[1:])))
        for m in model.modules()
        if isinstance(m, nn.Conv2d)
    ]
    model(torch.randn(1, 3, 28, 28))
    for h in hooks:
        h.remove()
    expected = conv_output_shapes("resnet20", width=W, in_channels=3, num_classes=10, image_size=28)
    assert seen == expected
    assert {h for _, h, _ in expected} == {28, 14, 7}


def test_resnet20_has_the_papers_parameter_count() -> None:
    layout = architecture_layout("resnet20", width=1.0, in_channels=3, num_classes=10)
    assert layout.num_params() == 269_722  # He et al.: 0.27M


def test_catalog_matches_the_built_models() -> None:
    cat = architecture_catalog(
        ["vgg16", "resnet20", "vgg11", "resnet32"],
        width=W,
        in_channels=1,
        num_classes=10,
        image_size=28,
        batch_size=8,
        optimizer="adamw",
    )
    totals = [v.memory.total for v in cat]
    assert totals == sorted(totals)
    assert set(cat.names()) == {"vgg16", "resnet20", "vgg11", "resnet32"}
    for v in cat:
        model = build_architecture(v.name, width=W, in_channels=1, num_classes=10)
        layers = model.layers()
        assert v.layout.num_params() == sum(p.numel() for p in model.parameters())
        assert v.layout.names() == list(model.state_dict())
        assert v.depth == len(layers)
        assert v.extra["arch"] == v.name
        by_name = v.layout.by_name()
        for index, layer in enumerate(layers, start=1):
            for n in layer.names:
                assert by_name[n].layer == index
                assert by_name[n].role == ("head" if layer.signature.is_classifier else "shared")
        p = v.layout.num_params()
        convs = conv_output_shapes(v.name, width=W, in_channels=1, num_classes=10, image_size=28)
        elements = sum(c * h * w for c, h, w in convs)
        assert (v.memory.parameters, v.memory.gradients, v.memory.optimizer) == (4 * p, 4 * p, 8 * p)
        assert v.memory.activations == 4 * 8 * 4 * elements


def test_bad_arguments_raise_typed_errors() -> None:
    with pytest.raises(ArchitectureError):
        build_architecture("vgg12", width=W, in_channels=3, num_classes=10)
    with pytest.raises(ArchitectureError):
        build_architecture("vgg11", width=0.0, in_channels=3, num_classes=10)
    kw: dict[str, Any] = {"width": W, "in_channels": 3, "num_classes": 10, "image_size": 32, "batch_size": 4}
    with pytest.raises(CatalogError):
        architecture_catalog(["vgg11", "vgg11"], **kw)
    with pytest.raises(ArchitectureError):
        architecture_catalog(["vgg11"], optimizer="lbfgs", **kw)
