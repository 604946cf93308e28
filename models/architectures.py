"""Architecture families for FlexiFed: CIFAR-style VGG-11/13/16/19 and ResNet-20/32/44/56.

FlexiFed (Wang et al., "FlexiFed: Personalized Federated Learning for Edge Clients with
Heterogeneous Model Architectures", WWW 2023) lets clients train *different* architectures of
one family and aggregates their *common base layers*.  Every model here is a plain torch
``nn.Module`` that also lists its parameterized layers in forward order (:meth:`LayeredNet.layers`),
each with a :class:`LayerSignature` and the state-dict names it owns (:class:`ArchLayer`).
Two architectures share layer ``l`` only when their signatures agree on every layer
``0 .. l`` -- common layers are found by signature, never by parameter name.

Signature
---------
``LayerSignature(kind, shapes, ops)``:

* ``kind`` -- what the layer computes, with its hyper-parameters: ``"conv3x3-s1+bn"``
  (3x3 conv, stride 1, padding 1, no bias, then batch norm), ``"conv3x3-s2+bn"``, or
  ``"classifier"`` (the final ``nn.Linear``);
* ``shapes`` -- the shapes of the layer's state-dict tensors, in the order of
  :attr:`ArchLayer.names`;
* ``ops`` -- the non-parameterized operations applied between the previous parameterized
  layer's output and this layer's input, in order: ``"relu"``, ``"maxpool2"``,
  ``"add"`` (residual sum with an identity shortcut), ``"add-pad"`` (residual sum with the
  option-A downsampling shortcut), ``"avgpool"``, ``"flatten"``.  The first layer has ``()``.

Batch norm
----------
Every conv is followed by HeteroFL-style *static* batch norm (``models.cnn.static_bn``:
``track_running_stats=False``): batch statistics in training and evaluation, and the state
dict holds only the affine ``weight`` and ``bias``, which belong to the layer of their conv.
So there are no buffers: every state-dict tensor is a trainable float32 parameter, the layout
equals the state dict, and nothing that depends on one client's data distribution (running
means) is averaged across architectures.  Evaluate with batches (not single images) or take an
sBN copy with ``models.cnn.recompute_bn_statistics``.  Convs have no bias (the norm's ``bias``
plays its role).

VGG (Simonyan & Zisserman, CIFAR variant)
-----------------------------------------
``cfg`` lists (:data:`VGG_CONFIGS`): an int ``c`` is ``conv3x3(pad 1) -> BN -> ReLU`` with
``k(c) = max(1, ceil(width * c))`` channels, ``"M"`` is ``MaxPool2d(2, ceil_mode=True)``.  The
ceiling mode lets all five pools run at any input size: ``32 -> 16 -> 8 -> 4 -> 2 -> 1`` and
(Fashion-MNIST) ``28 -> 14 -> 7 -> 4 -> 2 -> 1``; no pool is skipped, so the signatures do not
depend on the image size.  The head is small: global average pooling (a no-op at ``1 x 1``,
kept so that other sizes work) then one ``Linear(k(512), num_classes)`` -- the CIFAR VGG head,
not ImageNet's three 4096-wide layers.

ResNet (He et al., 2016, Sec. 4.2: ``6n + 2`` layers)
-----------------------------------------------------
A stem ``conv3x3 -> BN -> ReLU`` with ``k(16)`` channels, three stages of ``n`` basic blocks
with ``k(16), k(32), k(64)`` channels (``n = 3, 5, 7, 9`` for ResNet-20/32/44/56), a block being
``y = relu(BN(conv(relu(BN(conv(x))))) + s(x))``, stride 2 in the first block of stages 2 and 3,
then global average pooling and ``Linear(k(64), num_classes)``.  Shortcuts are option A
(parameter-free): identity, or at a stage change ``s(x) = pad_c(x[:, :, ::2, ::2])`` with the
missing ``c_out - c_in`` channels appended as zeros.  Option A keeps every parameterized layer a
conv (``6n + 2`` layers = stem + ``6n`` convs + classifier) and matches the paper's 0.27M
parameters of ResNet-20.

With per-conv layers, ResNet-20 and ResNet-32 share 7 layers: the stem and the 6 convs of
stage 1's first 3 blocks; layer 8 is the stride-2 conv ``k(16) -> k(32)`` in ResNet-20 but a
stride-1 ``k(16) -> k(16)`` conv in ResNet-32.  In general ResNet-``(6n+2)`` and
ResNet-``(6m+2)``, ``n < m``, share ``1 + 2n`` layers.  VGG-11 and VGG-13 share 1 layer, VGG-16
and VGG-19 share 7 (``64, 64, M, 128, 128, M, 256, 256, 256``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.catalog import CatalogError, Layout, MemoryEstimate, ParamSpec, Role, Variant, VariantCatalog
from models.cnn import ACT_FLOATS_PER_CONV_OUTPUT, static_bn

VggConfig = tuple[int | str, ...]

#: CIFAR VGG configurations (``"M"`` = 2x2 max-pool).
VGG_CONFIGS: dict[str, VggConfig] = {
    "vgg11": (64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg13": (64, 64, "M", 128, 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"),
    "vgg16": (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"),
    "vgg19": (64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"),
}
#: Basic blocks per stage ``n`` of ResNet-``(6n+2)``.
RESNET_BLOCKS: dict[str, int] = {"resnet20": 3, "resnet32": 5, "resnet44": 7, "resnet56": 9}
#: Stage widths of the CIFAR ResNets before the width multiplier.
RESNET_WIDTHS: tuple[int, int, int] = (16, 32, 64)
ARCHITECTURES: tuple[str, ...] = (*VGG_CONFIGS, *RESNET_BLOCKS)

CLASSIFIER = "classifier"
OPTIMIZER_MOMENTS: dict[str, int] = {"adamw": 2, "sgd": 1}


class ArchitectureError(ValueError):
    """Raised for an unknown architecture name or invalid construction arguments."""


@dataclass(frozen=True)
class LayerSignature:
    """What must match for two architectures to share a layer.

    Attributes
    ----------
    kind : str
        The layer's computation, e.g. ``"conv3x3-s1+bn"`` or ``"classifier"``.
    shapes : tuple[tuple[int, ...], ...]
        Shapes of the layer's tensors, in the order of :attr:`ArchLayer.names`.
    ops : tuple[str, ...]
        Non-parameterized operations since the previous parameterized layer.

    """

    kind: str
    shapes: tuple[tuple[int, ...], ...]
    ops: tuple[str, ...] = ()

    @property
    def is_classifier(self) -> bool:
        """Whether this is a classifier (fully connected head) layer."""
        return self.kind == CLASSIFIER


@dataclass(frozen=True)
class ArchLayer:
    """One parameterized layer of an architecture: its signature and state-dict names."""

    signature: LayerSignature
    names: tuple[str, ...]

    def __post_init__(self) -> None:
        if len(self.names) != len(self.signature.shapes):
            raise ArchitectureError(f"layer has {len(self.names)} names but {len(self.signature.shapes)} shapes")


def scaled_channels(channels: int, width: float) -> int:
    """``k(c) = max(1, ceil(width * c))`` (``width * c`` rounded to 9 decimals first)."""
    if not width > 0:
        raise ArchitectureError(f"width must be positive, got {width}")
    return max(1, math.ceil(round(width * channels, 9)))


# --- building blocks --------------------------------------------------------------------------


class ConvBN(nn.Module):
    """``conv3x3(stride, pad 1, no bias) -> static BN``; names ``conv.weight``, ``norm.{weight,bias}``."""

    def __init__(self, in_channels: int, out_channels: int, *, stride: int = 1) -> None:
        super().__init__()
        self.stride = stride
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False)
        self.norm = static_bn(out_channels)

    @property
    def kind(self) -> str:
        """Signature kind: ``"conv3x3-s<stride>+bn"``."""
        return f"conv3x3-s{self.stride}+bn"

    def forward(self, x: Tensor) -> Tensor:
        """``BN(conv(x))`` (no activation)."""
        return self.norm(self.conv(x))


def _layer(prefix: str, module: nn.Module, kind: str, ops: Sequence[str]) -> ArchLayer:
    """:class:`ArchLayer` of ``module`` whose state-dict names get ``prefix``."""
    items = list(module.state_dict().items())
    names = tuple(f"{prefix}.{k}" for k, _ in items)
    shapes = tuple(tuple(t.shape) for _, t in items)
    return ArchLayer(LayerSignature(kind, shapes, tuple(ops)), names)


class LayeredNet(nn.Module):
    """A model that lists its parameterized layers (subclasses implement :meth:`layers`)."""

    arch: str

    def layers(self) -> tuple[ArchLayer, ...]:
        """Parameterized layers in forward order."""
        raise NotImplementedError


class VGG(LayeredNet):
    """CIFAR VGG from a ``cfg`` list (see the module docstring).

    State-dict names: ``features.<i>.conv.weight``, ``features.<i>.norm.{weight,bias}`` for the
    ``i``-th conv (0-based, pools not counted), ``classifier.{weight,bias}``.
    """

    def __init__(self, cfg: VggConfig, *, width: float, in_channels: int, num_classes: int, arch: str = "vgg") -> None:
        super().__init__()
        self.arch = arch
        convs: list[ConvBN] = []
        self.pool_after: list[bool] = []
        c_in = in_channels
        for item in cfg:
            if item == "M":
                if not convs or self.pool_after[-1]:
                    raise ArchitectureError(f"'M' must follow a conv in {cfg}")
                self.pool_after[-1] = True
            elif isinstance(item, int):
                c_out = scaled_channels(item, width)
                convs.append(ConvBN(c_in, c_out))
                self.pool_after.append(False)
                c_in = c_out
            else:
                raise ArchitectureError(f"bad VGG cfg entry {item!r}")
        if not convs:
            raise ArchitectureError("a VGG needs at least one conv")
        self.features = nn.ModuleList(convs)
        self.classifier = nn.Linear(c_in, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape ``(batch, num_classes)``."""
        for block, pool in zip(self.features, self.pool_after, strict=True):
            x = F.relu(block(x))
            if pool:
                x = F.max_pool2d(x, 2, ceil_mode=True)
        return self.classifier(F.adaptive_avg_pool2d(x, 1).flatten(1))

    def layers(self) -> tuple[ArchLayer, ...]:
        """Each conv (with its norm), then the classifier."""
        out: list[ArchLayer] = []
        ops: tuple[str, ...] = ()
        for i, (block, pool) in enumerate(zip(self.features, self.pool_after, strict=True)):
            if not isinstance(block, ConvBN):
                raise ArchitectureError(f"features.{i} is a {type(block).__name__}, not a ConvBN block")
            out.append(_layer(f"features.{i}", block, block.kind, ops))
            ops = ("relu", "maxpool2") if pool else ("relu",)
        out.append(_layer(CLASSIFIER, self.classifier, CLASSIFIER, (*ops, "avgpool", "flatten")))
        return tuple(out)


class BasicBlock(nn.Module):
    """``relu(BN(conv2(relu(BN(conv1(x))))) + s(x))`` with an option-A shortcut ``s``."""

    def __init__(self, in_channels: int, out_channels: int, *, stride: int) -> None:
        super().__init__()
        self.c1 = ConvBN(in_channels, out_channels, stride=stride)
        self.c2 = ConvBN(out_channels, out_channels)
        self.downsample = stride != 1 or in_channels != out_channels
        self.stride = stride
        self.extra_channels = out_channels - in_channels
        if self.extra_channels < 0:
            raise ArchitectureError("option-A shortcuts cannot reduce channels")

    def shortcut(self, x: Tensor) -> Tensor:
        """Identity, or ``x[:, :, ::s, ::s]`` with ``c_out - c_in`` zero channels appended."""
        if not self.downsample:
            return x
        return F.pad(x[:, :, :: self.stride, :: self.stride], (0, 0, 0, 0, 0, self.extra_channels))

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block."""
        return F.relu(self.c2(F.relu(self.c1(x))) + self.shortcut(x))


class CifarResNet(LayeredNet):
    """ResNet-``(6n+2)`` for CIFAR with option-A shortcuts (see the module docstring).

    State-dict names: ``stem.conv.weight``, ``stem.norm.{weight,bias}``,
    ``stages.<s>.<b>.{c1,c2}.conv.weight``, ``stages.<s>.<b>.{c1,c2}.norm.{weight,bias}``,
    ``classifier.{weight,bias}``.
    """

    def __init__(self, blocks: int, *, width: float, in_channels: int, num_classes: int, arch: str = "resnet") -> None:
        super().__init__()
        if blocks < 1:
            raise ArchitectureError(f"need >= 1 block per stage, got {blocks}")
        self.arch = arch
        widths = [scaled_channels(c, width) for c in RESNET_WIDTHS]
        self.stem = ConvBN(in_channels, widths[0])
        stages = []
        c_in = widths[0]
        for s, c in enumerate(widths):
            stage = []
            for b in range(blocks):
                stage.append(BasicBlock(c_in, c, stride=2 if s > 0 and b == 0 else 1))
                c_in = c
            stages.append(nn.Sequential(*stage))
        self.stages = nn.ModuleList(stages)
        self.classifier = nn.Linear(c_in, num_classes)

    def blocks(self) -> list[tuple[str, BasicBlock]]:
        """``("stages.<s>.<b>", block)`` in forward order."""
        return [
            (f"stages.{s}.{b}", block)
            for s, stage in enumerate(self.stages)
            for b, block in enumerate(stage.children())
            if isinstance(block, BasicBlock)
        ]

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape ``(batch, num_classes)``."""
        x = F.relu(self.stem(x))
        for stage in self.stages:
            x = stage(x)
        return self.classifier(F.adaptive_avg_pool2d(x, 1).flatten(1))

    def layers(self) -> tuple[ArchLayer, ...]:
        """Stem, the two convs of every block, then the classifier."""
        out = [_layer("stem", self.stem, self.stem.kind, ())]
        ops: tuple[str, ...] = ("relu",)
        for prefix, block in self.blocks():
            out.append(_layer(f"{prefix}.c1", block.c1, block.c1.kind, ops))
            out.append(_layer(f"{prefix}.c2", block.c2, block.c2.kind, ("relu",)))
            ops = ("add-pad" if block.downsample else "add", "relu")
        out.append(_layer(CLASSIFIER, self.classifier, CLASSIFIER, (*ops, "avgpool", "flatten")))
        return tuple(out)


# --- construction -----------------------------------------------------------------------------


def build_architecture(name: str, *, width: float, in_channels: int, num_classes: int) -> LayeredNet:
    """Build architecture ``name`` (one of :data:`ARCHITECTURES`) at width multiplier ``width``.

    Raises
    ------
    ArchitectureError
        For an unknown name or a non-positive width, channel or class count.

    """
    if in_channels < 1 or num_classes < 1:
        raise ArchitectureError(f"in_channels and num_classes must be >= 1, got {in_channels}, {num_classes}")
    if name in VGG_CONFIGS:
        return VGG(VGG_CONFIGS[name], width=width, in_channels=in_channels, num_classes=num_classes, arch=name)
    if name in RESNET_BLOCKS:
        return CifarResNet(
            RESNET_BLOCKS[name], width=width, in_channels=in_channels, num_classes=num_classes, arch=name
        )
    raise ArchitectureError(f"unknown architecture {name!r}; expected one of {ARCHITECTURES}")


def _meta_model(name: str, *, width: float, in_channels: int, num_classes: int) -> LayeredNet:
    with torch.device("meta"):
        return build_architecture(name, width=width, in_channels=in_channels, num_classes=num_classes)


def architecture_layers(name: str, *, width: float, in_channels: int, num_classes: int) -> tuple[ArchLayer, ...]:
    """:meth:`LayeredNet.layers` of ``name`` (built on the meta device: no memory, no init)."""
    return _meta_model(name, width=width, in_channels=in_channels, num_classes=num_classes).layers()


def architecture_layout(name: str, *, width: float, in_channels: int, num_classes: int) -> Layout:
    """Layout of ``name``: ``layer`` = 1-based layer index, role ``"head"`` for the classifier.

    Every other tensor is ``"shared"`` (a candidate for common-layer aggregation); all are
    trainable float32 (static batch norm has no buffers).
    """
    params: list[ParamSpec] = []
    for index, layer in enumerate(
        architecture_layers(name, width=width, in_channels=in_channels, num_classes=num_classes), start=1
    ):
        role: Role = "head" if layer.signature.is_classifier else "shared"
        for pname, shape in zip(layer.names, layer.signature.shapes, strict=True):
            params.append(ParamSpec(pname, shape, "float32", index, role))
    return Layout(tuple(params))


def conv_output_shapes(
    name: str, *, width: float, in_channels: int, num_classes: int, image_size: int
) -> list[tuple[int, int, int]]:
    """``(channels, height, width)`` of every conv output for one square image, in forward order.

    Found by a forward pass on the meta device with hooks on every ``nn.Conv2d`` (exact for any
    image size; nothing is allocated).
    """
    model = _meta_model(name, width=width, in_channels=in_channels, num_classes=num_classes)
    shapes: list[tuple[int, int, int]] = []

    def hook(_module: nn.Module, _inputs: object, output: Tensor) -> None:
        shapes.append((int(output.shape[1]), int(output.shape[2]), int(output.shape[3])))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, nn.Conv2d)]
    with torch.no_grad():
        model(torch.empty(1, in_channels, image_size, image_size, device="meta"))
    for h in handles:
        h.remove()
    return shapes


def estimate_memory(
    name: str,
    layout: Layout,
    *,
    width: float,
    in_channels: int,
    num_classes: int,
    image_size: int,
    batch_size: int,
    optimizer: str,
) -> MemoryEstimate:
    """Training-memory estimate of architecture ``name``.

    ``parameters = gradients = 4 P`` bytes, ``optimizer = 4 m P`` (``m = 2`` moments for AdamW,
    ``1`` for SGD with momentum) and ``activations = 4 * B * a * sum_l C_l H_l W_l`` with the conv
    output sizes of :func:`conv_output_shapes`, ``B`` the batch size and
    ``a = models.cnn.ACT_FLOATS_PER_CONV_OUTPUT`` (4 floats per conv output element: the conv
    output, the norm output, the ReLU output and the pool / residual sum that follows).
    """
    moments = OPTIMIZER_MOMENTS.get(optimizer)
    if moments is None:
        raise ArchitectureError(f"unknown optimizer {optimizer!r}; expected one of {sorted(OPTIMIZER_MOMENTS)}")
    if batch_size < 1 or image_size < 1:
        raise ArchitectureError(f"batch_size and image_size must be >= 1, got {batch_size}, {image_size}")
    p = layout.num_params()
    elements = sum(
        c * h * w
        for c, h, w in conv_output_shapes(
            name, width=width, in_channels=in_channels, num_classes=num_classes, image_size=image_size
        )
    )
    return MemoryEstimate(
        parameters=4 * p,
        gradients=4 * layout.num_params(trainable_only=True),
        optimizer=4 * moments * layout.num_params(trainable_only=True),
        activations=int(4 * batch_size * ACT_FLOATS_PER_CONV_OUTPUT * elements),
    )


def architecture_catalog(
    arch_names: Sequence[str],
    *,
    width: float,
    in_channels: int,
    num_classes: int,
    image_size: int,
    batch_size: int,
    optimizer: str = "sgd",
) -> VariantCatalog:
    """One variant per architecture, ordered by estimated training memory (smallest first).

    Variant ``name`` is the architecture name, ``depth`` its number of parameterized layers,
    the layout that of :func:`architecture_layout`, the estimate that of
    :func:`estimate_memory`, ``extra = {"arch": name, "width": width}``.

    Raises
    ------
    CatalogError
        For an empty or duplicated list of names.
    ArchitectureError
        For an unknown architecture or optimizer.

    """
    if not arch_names:
        raise CatalogError("architecture_catalog needs at least one architecture")
    if len(set(arch_names)) != len(arch_names):
        raise CatalogError(f"duplicate architectures: {list(arch_names)}")
    variants = []
    for name in arch_names:
        layout = architecture_layout(name, width=width, in_channels=in_channels, num_classes=num_classes)
        depth = len({p.layer for p in layout})
        memory = estimate_memory(
            name,
            layout,
            width=width,
            in_channels=in_channels,
            num_classes=num_classes,
            image_size=image_size,
            batch_size=batch_size,
            optimizer=optimizer,
        )
        variants.append(Variant(name, depth, layout, memory, extra={"arch": name, "width": float(width)}))
    variants.sort(key=lambda v: (v.memory.total, v.name))
    return VariantCatalog(family="flexifed", variants=tuple(variants))
