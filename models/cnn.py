"""Convolutional families cut by width, as in HeteroFL (Diao et al., ICLR 2021), in plain torch.

Two families, both built at a width rate ``r`` in ``(0, 1]``: every hidden channel count ``d``
of the full model becomes ``k(d, r) = min(d, max(1, ceil(r * d)))`` (:func:`scaled_width`, the
same rounding as ``strategies.heterofl.width_indices``), while the network input channels and
the class count are never reduced.

* ``"conv"`` (:class:`ConvNet`, HeteroFL's ``Conv``): ``n = len(base)`` blocks
  ``conv3x3 -> Scaler -> BN -> ReLU -> MaxPool2d(2)`` with ``k(base[i], r)`` channels; the last
  block has no max-pool and is followed by global average pooling and a linear classifier.
* ``"preresnet18"`` (:class:`PreResNet`, HeteroFL's ``resnet18``): a bias-free 3x3 stem conv,
  ``len(base)`` stages of two pre-activation basic blocks
  ``x -> BN -> ReLU -> (conv3x3 -> BN -> ReLU -> conv3x3) + shortcut`` with ``k(base[s], r)``
  channels, stride 2 in the first block of every stage but the first, a 1x1 projection shortcut
  where the (full-model) shape changes, then ``BN -> ReLU -> global average pool -> linear``.

``base`` defaults to HeteroFL's ``(64, 128, 256, 512)`` (:data:`HETEROFL_BASE`);
:data:`CPU_BASE` ``(16, 32, 64, 128)`` is a 4x narrower option that trains on a few CPU cores.

Static batch norm
-----------------
HeteroFL's normalization does not track running statistics during training
(``BatchNorm2d(c, momentum=None, track_running_stats=False)``, :func:`static_bn`): batch
statistics are used in train *and* eval mode, and the state dict holds only the affine
``weight`` and ``bias``, so nothing that depends on one client's data distribution (running
means of a sub-model at a given width) is averaged by the server.  For evaluation, HeteroFL's
"sBN" queries statistics on training data first: :func:`recompute_bn_statistics` returns an
evaluation copy whose norms track the cumulative average of the batch statistics of the given
batches (``momentum=None``: the plain mean over batches).

The scaler
----------
:class:`Scaler` divides its input by ``r`` in training mode and is the identity in eval mode,
placed where HeteroFL places it: right after every conv of :class:`ConvNet` (before its norm)
and in front of every norm of :class:`PreResNet` (whose norm inputs are conv outputs or
residual sums of conv outputs).  Static BN normalizes the scale away up to ``eps``; the scaler
keeps a sub-model's activations on the full model's scale for what is not normalized.

Width groups
------------
:func:`width_rules` maps every state-dict tensor to one width-group name per axis (``None``
for axes never reduced), the mapping that ``strategies.heterofl.WidthRules(axes=...)`` takes;
``extract_submodel(full_state, WidthRules(axes=width_rules(name, full)), r)`` then has exactly
the shapes of the model built at rate ``r``.  A residual addition ``out + shortcut`` forces
the block's output channels and its shortcut's output channels (or, without a projection, its
input channels) to be one group: a stage's residual stream is one group ``stages.<s>.res``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Iterable, Mapping, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.catalog import CatalogError, Layout, MemoryEstimate, Role, Variant, VariantCatalog, meta_layout
from models.training import model_device

Groups = tuple[str | None, ...]
AxisGroups = dict[str, Groups]

CONV = "conv"
PRERESNET18 = "preresnet18"
MODEL_NAMES = (CONV, PRERESNET18)

#: HeteroFL's hidden sizes for both ``Conv`` and ``resnet18``.
HETEROFL_BASE: tuple[int, ...] = (64, 128, 256, 512)
#: A 4x narrower base for training on a few CPU cores.
CPU_BASE: tuple[int, ...] = (16, 32, 64, 128)
#: Basic blocks per stage of PreResNet-18.
PRERESNET18_BLOCKS: tuple[int, ...] = (2, 2, 2, 2)

#: Floats per element of a conv output that training holds (saved for backward, or alive
#: at once in the forward pass).  Per conv output element the forward pass materializes the
#: conv output, the scaler output (saved by the norm), the norm output and the ReLU output
#: (saved by the next conv or max-pool, whose int64 indices add half a float at a quarter of
#: the size).  Counting all four bounds what autograd saves -- counted with
#: ``saved_tensors_hooks`` at 28x28x1 and 32x32x3, batch 4: 1.8-1.9 floats per conv output
#: element for PreResNet-18 and 2.7-3.1 for the conv net (whose count includes the saved input
#: image), see tests/test_cnn.py -- and leaves room for the short-lived ones.  A documented
#: estimate, not a fit to measured peak memory.
ACT_FLOATS_PER_CONV_OUTPUT = 4.0

# ``rate * full`` is rounded to this many decimals before ``ceil``, as in strategies.heterofl.
_RATE_DECIMALS = 9
_BATCH_INPUT_KEYS = ("img", "image", "pixel_values", "x", "input")


# --- widths -----------------------------------------------------------------------------------


def _check_rate(rate: float) -> None:
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"rate must be in (0, 1], got {rate}")


def scaled_width(full: int, rate: float) -> int:
    """Channels kept at width rate ``r``: ``k = min(d, max(1, ceil(r * d)))``.

    ``r * d`` is rounded to 9 decimals before the ceiling, exactly as
    ``strategies.heterofl.width_indices`` does, so a model built at rate ``r`` has the shapes of
    the extracted sub-model.
    """
    if full < 1:
        raise ValueError(f"full width must be >= 1, got {full}")
    _check_rate(rate)
    return min(full, max(1, math.ceil(round(rate * full, _RATE_DECIMALS))))


def scaled_widths(base: Sequence[int], rate: float) -> tuple[int, ...]:
    """:func:`scaled_width` of every entry of ``base``."""
    if not base:
        raise ValueError("base needs at least one width")
    return tuple(scaled_width(int(d), rate) for d in base)


# --- building blocks --------------------------------------------------------------------------


class Scaler(nn.Module):
    """HeteroFL's scaler: ``x / r`` in training mode, ``x`` in eval mode.

    Parameters
    ----------
    rate : float
        Width rate ``r`` in ``(0, 1]`` of the model the scaler belongs to (a plain attribute,
        not part of the state dict).

    """

    def __init__(self, rate: float) -> None:
        super().__init__()
        _check_rate(rate)
        self.rate = float(rate)

    def forward(self, x: Tensor) -> Tensor:
        """``x / rate`` while training, ``x`` otherwise."""
        return x / self.rate if self.training else x

    def extra_repr(self) -> str:
        """``rate=r`` in the module's repr."""
        return f"rate={self.rate}"


def static_bn(channels: int) -> nn.BatchNorm2d:
    """HeteroFL's static batch norm: batch statistics always, no running statistics kept."""
    return nn.BatchNorm2d(channels, momentum=None, track_running_stats=False)


class ConvBlock(nn.Module):
    """``conv3x3(pad 1) -> Scaler -> BN -> ReLU -> MaxPool2d(2)`` (pool optional)."""

    def __init__(self, in_channels: int, out_channels: int, rate: float, *, pool: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=1, padding=1)
        self.scaler = Scaler(rate)
        self.norm = static_bn(out_channels)
        self.pool: nn.Module = nn.MaxPool2d(2) if pool else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block."""
        return self.pool(F.relu(self.norm(self.scaler(self.conv(x)))))


class ConvNet(nn.Module):
    """HeteroFL's ``Conv`` model at width rate ``rate``.

    Block ``i`` maps ``c_{i-1} -> c_i = k(base[i], r)`` channels (``c_{-1} = in_channels``) at
    spatial size ``h_i = floor(h_{i-1} / 2)`` (``h_0`` = the image size); blocks ``0 .. n - 2``
    end with a 2x2 max-pool, the last with global average pooling, then
    ``logits = W c + b`` with ``W`` of shape ``(num_classes, c_{n-1})``.

    State-dict names: ``blocks.<i>.conv.{weight,bias}``, ``blocks.<i>.norm.{weight,bias}``,
    ``classifier.{weight,bias}``.
    """

    def __init__(
        self, rate: float = 1.0, *, in_channels: int, num_classes: int, base: Sequence[int] = HETEROFL_BASE
    ) -> None:
        super().__init__()
        self.rate = float(rate)
        self.base = tuple(int(d) for d in base)
        self.widths = scaled_widths(self.base, rate)
        ins = (in_channels, *self.widths[:-1])
        last = len(self.widths) - 1
        pairs = zip(ins, self.widths, strict=True)
        self.blocks = nn.ModuleList(ConvBlock(ci, co, rate, pool=i < last) for i, (ci, co) in enumerate(pairs))
        self.classifier = nn.Linear(self.widths[-1], num_classes)

    def conv_blocks(self) -> list[ConvBlock]:
        """The blocks in forward order."""
        return [b for b in self.blocks if isinstance(b, ConvBlock)]

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape ``(batch, num_classes)``."""
        for block in self.blocks:
            x = block(x)
        return self.classifier(F.adaptive_avg_pool2d(x, 1).flatten(1))


class PreActBlock(nn.Module):
    """Pre-activation basic block (HeteroFL's ``resnet.Block``).

    ``a = relu(BN1(S(x)))``, ``y = conv2(relu(BN2(S(conv1(a))))) + P(a)`` with ``S`` the scaler
    and ``P`` the 1x1 projection (``P(a)`` replaced by ``x`` without one).

    Parameters
    ----------
    projection : bool
        Whether the block has a 1x1 shortcut conv.  Decided from the *full* model's widths and
        the stride (never from the reduced widths, which may coincide at a small rate), so that
        every rate has the same tensors.

    """

    def __init__(self, in_channels: int, out_channels: int, stride: int, rate: float, *, projection: bool) -> None:
        super().__init__()
        self.scaler = Scaler(rate)
        self.n1 = static_bn(in_channels)
        self.conv1 = nn.Conv2d(in_channels, out_channels, kernel_size=3, stride=stride, padding=1, bias=False)
        self.n2 = static_bn(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, kernel_size=3, stride=1, padding=1, bias=False)
        self.shortcut: nn.Conv2d | None = (
            nn.Conv2d(in_channels, out_channels, kernel_size=1, stride=stride, bias=False) if projection else None
        )

    def forward(self, x: Tensor) -> Tensor:
        """Apply the block."""
        a = F.relu(self.n1(self.scaler(x)))
        shortcut = self.shortcut(a) if self.shortcut is not None else x
        out = self.conv2(F.relu(self.n2(self.scaler(self.conv1(a)))))
        return out + shortcut


class PreResNet(nn.Module):
    """Pre-activation ResNet (HeteroFL's ``ResNet``) at width rate ``rate``.

    Stage ``s`` has ``c_s = k(base[s], r)`` channels and ``blocks_per_stage[s]`` blocks; its first
    block has stride ``2`` for ``s >= 1`` (spatial size ``h_s = ceil(h_{s-1} / 2)``) and a 1x1
    projection when ``stride != 1`` or ``base[s-1] != base[s]``.  The head is
    ``logits = W mean_hw(relu(BN(S(x)))) + b``.

    State-dict names: ``stem.weight``, ``stages.<s>.<b>.{n1,n2}.{weight,bias}``,
    ``stages.<s>.<b>.{conv1,conv2,shortcut}.weight``, ``norm.{weight,bias}``,
    ``classifier.{weight,bias}``.
    """

    def __init__(
        self,
        rate: float = 1.0,
        *,
        in_channels: int,
        num_classes: int,
        base: Sequence[int] = HETEROFL_BASE,
        blocks_per_stage: Sequence[int] = PRERESNET18_BLOCKS,
    ) -> None:
        super().__init__()
        if len(blocks_per_stage) != len(base) or min(blocks_per_stage, default=0) < 1:
            raise ValueError(f"need >= 1 block for each of the {len(base)} stages, got {tuple(blocks_per_stage)}")
        self.rate = float(rate)
        self.base = tuple(int(d) for d in base)
        self.blocks_per_stage = tuple(int(n) for n in blocks_per_stage)
        self.widths = scaled_widths(self.base, rate)
        self.stem = nn.Conv2d(in_channels, self.widths[0], kernel_size=3, stride=1, padding=1, bias=False)
        stages = []
        for s, n in enumerate(self.blocks_per_stage):
            blocks = []
            for b in range(n):
                stride = 2 if s > 0 and b == 0 else 1
                full_in = self.base[s - 1] if s > 0 and b == 0 else self.base[s]
                c_in = self.widths[s - 1] if s > 0 and b == 0 else self.widths[s]
                projection = stride != 1 or full_in != self.base[s]
                blocks.append(PreActBlock(c_in, self.widths[s], stride, rate, projection=projection))
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.ModuleList(stages)
        self.scaler = Scaler(rate)
        self.norm = static_bn(self.widths[-1])
        self.classifier = nn.Linear(self.widths[-1], num_classes)

    def residual_blocks(self) -> list[tuple[int, int, PreActBlock]]:
        """``(stage, index in stage, block)`` of every residual block in forward order."""
        return [
            (s, b, block)
            for s, stage in enumerate(self.stages)
            for b, block in enumerate(stage.children())
            if isinstance(block, PreActBlock)
        ]

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape ``(batch, num_classes)``."""
        x = self.stem(x)
        for stage in self.stages:
            x = stage(x)
        x = F.relu(self.norm(self.scaler(x)))
        return self.classifier(F.adaptive_avg_pool2d(x, 1).flatten(1))


def build_cnn(
    model_name: str, rate: float = 1.0, *, in_channels: int, num_classes: int, base: Sequence[int] = HETEROFL_BASE
) -> ConvNet | PreResNet:
    """Build ``"conv"`` or ``"preresnet18"`` at width rate ``rate`` (random initialization)."""
    if model_name == CONV:
        return ConvNet(rate, in_channels=in_channels, num_classes=num_classes, base=base)
    if model_name == PRERESNET18:
        return PreResNet(rate, in_channels=in_channels, num_classes=num_classes, base=base)
    raise ValueError(f"unknown CNN {model_name!r}; expected one of {MODEL_NAMES}")


# --- width groups -----------------------------------------------------------------------------


def _conv_axes(prefix: str, conv: nn.Conv2d, out: str | None, inp: str | None) -> AxisGroups:
    axes: AxisGroups = {f"{prefix}.weight": (out, inp, None, None)}
    if conv.bias is not None:
        axes[f"{prefix}.bias"] = (out,)
    return axes


def _norm_axes(prefix: str, norm: nn.BatchNorm2d, group: str) -> AxisGroups:
    """Affine parameters (and running statistics, where tracked) follow the channel group."""
    axes: AxisGroups = {}
    if norm.affine:
        axes.update({f"{prefix}.weight": (group,), f"{prefix}.bias": (group,)})
    if norm.track_running_stats:
        axes.update({f"{prefix}.running_mean": (group,), f"{prefix}.running_var": (group,)})
        axes[f"{prefix}.num_batches_tracked"] = ()
    return axes


def _linear_axes(prefix: str, linear: nn.Linear, inp: str) -> AxisGroups:
    axes: AxisGroups = {f"{prefix}.weight": (None, inp)}
    if linear.bias is not None:
        axes[f"{prefix}.bias"] = (None,)
    return axes


def conv_width_rules(model: ConvNet) -> AxisGroups:
    """Width groups of :class:`ConvNet`: block ``i``'s output channels are group ``blocks.<i>.out``.

    ``conv_i.weight: (g_i, g_{i-1}, -, -)`` with ``g_{-1} = None`` (the input),
    ``conv_i.bias, norm_i.*: (g_i,)``, ``classifier.weight: (None, g_{n-1})``, bias ``(None,)``.
    """
    axes: AxisGroups = {}
    prev: str | None = None
    for i, block in enumerate(model.conv_blocks()):
        group = f"blocks.{i}.out"
        axes.update(_conv_axes(f"blocks.{i}.conv", block.conv, group, prev))
        axes.update(_norm_axes(f"blocks.{i}.norm", block.norm, group))
        prev = group
    if prev is None:
        raise CatalogError(f"{type(model).__name__} has no conv blocks to cut by width")
    axes.update(_linear_axes("classifier", model.classifier, prev))
    return axes


def preresnet_width_rules(model: PreResNet) -> AxisGroups:
    """Width groups of :class:`PreResNet`.

    Stage ``s``'s residual stream is one group ``R_s = "stages.<s>.res"`` (the stem's output is
    ``R_0``): every block of the stage adds its ``conv2`` output to its shortcut, so ``conv2``'s
    and the projection's output axes, and the next block's input axes, all name ``R_s``.  The
    inner channels of block ``(s, b)`` are ``M = "stages.<s>.<b>.mid"``.  With ``I`` the block's
    input group (``R_{s-1}`` for the first block of a stage ``s >= 1``, else ``R_s``):
    ``n1: (I,)``, ``conv1: (M, I, -, -)``, ``n2: (M,)``, ``conv2: (R_s, M, -, -)``,
    ``shortcut: (R_s, I, -, -)``; the head is ``norm: (R_last,)``,
    ``classifier.weight: (None, R_last)``.
    """
    axes: AxisGroups = dict(_conv_axes("stem", model.stem, "stages.0.res", None))
    prev = "stages.0.res"
    for s, b, block in model.residual_blocks():
        res, p, mid = f"stages.{s}.res", f"stages.{s}.{b}", f"stages.{s}.{b}.mid"
        axes.update(_norm_axes(f"{p}.n1", block.n1, prev))
        axes.update(_conv_axes(f"{p}.conv1", block.conv1, mid, prev))
        axes.update(_norm_axes(f"{p}.n2", block.n2, mid))
        axes.update(_conv_axes(f"{p}.conv2", block.conv2, res, mid))
        if block.shortcut is not None:
            axes.update(_conv_axes(f"{p}.shortcut", block.shortcut, res, prev))
        elif prev != res:
            raise ValueError(f"{p}: identity shortcut between groups {prev!r} and {res!r}")
        prev = res
    axes.update(_norm_axes("norm", model.norm, prev))
    axes.update(_linear_axes("classifier", model.classifier, prev))
    return axes


def width_rules(model_name: str, full_model: nn.Module) -> AxisGroups:
    """Per state-dict tensor of ``full_model``, its width group per axis (``None``: never reduced).

    The result is what ``strategies.heterofl.WidthRules(axes=...)`` accepts (``models/`` may
    depend on no strategy).  The network input and the class count are ``None``.

    Raises
    ------
    ValueError
        For an unknown ``model_name``, a model of another family, or rules whose names differ
        from the model's state dict.

    """
    rules: AxisGroups
    if model_name == CONV and isinstance(full_model, ConvNet):
        rules = conv_width_rules(full_model)
    elif model_name == PRERESNET18 and isinstance(full_model, PreResNet):
        rules = preresnet_width_rules(full_model)
    else:
        raise ValueError(f"no width rules for {model_name!r} and a {type(full_model).__name__}")
    names = set(full_model.state_dict())
    if set(rules) != names:
        raise ValueError(f"width rules do not cover the state dict: {sorted(names ^ set(rules))}")
    return rules


# --- static BN evaluation copy ----------------------------------------------------------------


def _tracking_copy(norm: nn.BatchNorm2d) -> nn.BatchNorm2d:
    """A norm with the same affine parameters that tracks a cumulative average from scratch."""
    ref = norm.weight if norm.affine else None
    new = nn.BatchNorm2d(
        norm.num_features,
        eps=norm.eps,
        momentum=None,
        affine=norm.affine,
        track_running_stats=True,
        device=None if ref is None else ref.device,
        dtype=None if ref is None else ref.dtype,
    )
    if norm.affine:
        with torch.no_grad():
            new.weight.copy_(norm.weight)
            new.bias.copy_(norm.bias)
    return new


def _batch_inputs(batch: object, input_key: str | None) -> Tensor:
    """The model input of one batch: a tensor, ``(x, y, ...)`` or a mapping."""
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, Mapping):
        keys = (input_key,) if input_key is not None else _BATCH_INPUT_KEYS
        for key in keys:
            if key in batch:
                return batch[key]
        raise ValueError(f"batch has none of the input keys {keys}: {sorted(batch)}")
    if isinstance(batch, list | tuple) and batch and isinstance(batch[0], Tensor):
        return batch[0]
    raise TypeError(f"cannot find the model input in a batch of type {type(batch).__name__}")


def recompute_bn_statistics(
    model: nn.Module, loader_or_batches: Iterable[object], *, input_key: str | None = None
) -> nn.Module:
    """HeteroFL's sBN: an evaluation copy of ``model`` with batch-norm statistics from data.

    Every ``BatchNorm2d`` of a deep copy is replaced by one with the same affine parameters that
    tracks running statistics with ``momentum=None``; the copy runs forward (no gradients) over
    every batch with only its norms in training mode, and is returned in eval mode.  After
    ``T`` batches with per-channel batch mean ``mu_t`` and unbiased batch variance ``v_t``:

        ``running_mean = (1 / T) sum_t mu_t``,    ``running_var = (1 / T) sum_t v_t``.

    ``model`` itself is not modified.  Use the training data, as HeteroFL does before testing.

    Notes
    -----
    The scalers stay in eval mode (identity) while the statistics are collected, so the norms
    see the same inputs in collection as in evaluation.  HeteroFL's reference code collects
    them with the whole model in training mode (scalers dividing by ``r``); the two agree at
    ``r = 1`` (its global model), and at ``r < 1`` the reference's statistics would be those of
    ``x / r`` while evaluation feeds ``x``.

    Parameters
    ----------
    model : nn.Module
        A trained model (static or tracking norms; either way the statistics start afresh).
    loader_or_batches : Iterable
        Batches as tensors, ``(inputs, labels, ...)`` sequences or mappings (see ``input_key``).
    input_key : str, optional
        Key of the inputs in mapping batches; by default the first of ``"img"``, ``"image"``,
        ``"pixel_values"``, ``"x"``, ``"input"`` present.

    Raises
    ------
    ValueError
        When there are no batches (the statistics would be the defaults 0 and 1).

    """
    eval_model = copy.deepcopy(model)
    norms: list[nn.BatchNorm2d] = []
    for module in list(eval_model.modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.BatchNorm2d):
                new = _tracking_copy(child)
                setattr(module, child_name, new)
                norms.append(new)
    eval_model.eval()
    for norm in norms:
        norm.train()
    device = model_device(eval_model)
    seen = 0
    with torch.no_grad():
        for batch in loader_or_batches:
            eval_model(_batch_inputs(batch, input_key).to(device))
            seen += 1
    if norms and seen == 0:
        raise ValueError("recompute_bn_statistics needs at least one batch")
    return eval_model.eval()


# --- layouts, memory, catalog -----------------------------------------------------------------


def _num_blocks(model_name: str, base: Sequence[int]) -> int:
    if model_name == CONV:
        return len(base)
    if model_name == PRERESNET18:
        return 2 + sum(PRERESNET18_BLOCKS)
    raise ValueError(f"unknown CNN {model_name!r}; expected one of {MODEL_NAMES}")


def block_index(model_name: str, param_name: str) -> int | None:
    """0-based block of a parameter in forward order; ``None`` for the classifier.

    ``"conv"``: ``blocks.<i>.*`` is block ``i``.  ``"preresnet18"``: the stem is block 0, the
    residual blocks are ``1 .. 8`` in order, the final norm is block 9.
    """
    if param_name.startswith("classifier."):
        return None
    parts = param_name.split(".")
    if model_name == CONV and parts[0] == "blocks":
        return int(parts[1])
    if model_name == PRERESNET18:
        if parts[0] == "stem":
            return 0
        if parts[0] == "stages":
            s, b = int(parts[1]), int(parts[2])
            return 1 + sum(PRERESNET18_BLOCKS[:s]) + b
        if parts[0] == "norm":
            return 1 + sum(PRERESNET18_BLOCKS)
    raise ValueError(f"{param_name!r} is not a parameter of {model_name!r}")


def width_layout(
    model_name: str, rate: float, *, in_channels: int, num_classes: int, base: Sequence[int] = HETEROFL_BASE
) -> Layout:
    """Parameter layout of the rate-``rate`` model (built on the meta device).

    Every tensor is ``"shared"`` (aggregated by coverage across rates) except the classifier,
    ``"head"``; ``layer`` is :func:`block_index`.
    """

    def place(name: str) -> tuple[int | None, Role]:
        layer = block_index(model_name, name)
        return layer, "head" if layer is None else "shared"

    return meta_layout(
        lambda: build_cnn(model_name, rate, in_channels=in_channels, num_classes=num_classes, base=base), place
    )


def conv_output_shapes(
    model_name: str, rate: float, *, image_size: int, base: Sequence[int] = HETEROFL_BASE
) -> list[tuple[int, int, int]]:
    """``(channels, height, width)`` of every conv output for one square image, in forward order.

    ``"conv"``: block ``i`` convolves at ``h_i = floor(h_{i-1} / 2)`` (3x3, padding 1 keeps the
    size; the 2x2 max-pool floors), ``h_0 = image_size``.  ``"preresnet18"``: the stem and stage
    0 at ``h_0``, stage ``s >= 1`` at ``h_s = ceil(h_{s-1} / 2)`` (3x3 stride 2 padding 1 and
    1x1 stride 2 give ``floor((h - 1) / 2) + 1``); per block ``conv1``, ``conv2`` and, in a
    stage's first block for ``s >= 1``, the projection.
    """
    widths = scaled_widths(base, rate)
    shapes: list[tuple[int, int, int]] = []
    h = image_size
    if model_name == CONV:
        for i, c in enumerate(widths):
            h = h if i == 0 else h // 2
            shapes.append((c, h, h))
        return shapes
    if model_name == PRERESNET18:
        shapes.append((widths[0], h, h))
        for s, (c, n) in enumerate(zip(widths, PRERESNET18_BLOCKS, strict=True)):
            h = h if s == 0 else (h + 1) // 2
            for b in range(n):
                shapes += [(c, h, h)] * (3 if s > 0 and b == 0 else 2)
        return shapes
    raise ValueError(f"unknown CNN {model_name!r}; expected one of {MODEL_NAMES}")


def estimate_memory(
    model_name: str,
    rate: float,
    layout: Layout,
    *,
    image_size: int,
    batch_size: int,
    optimizer: str,
    base: Sequence[int] = HETEROFL_BASE,
    blocks: int | None = None,
) -> MemoryEstimate:
    """Training-memory estimate of the rate-``rate`` model (of its first ``blocks`` conv outputs' worth).

    ``parameters = 4 P``, ``gradients = 4 P``, ``optimizer = 4 m P`` (``m = 2`` moments for
    AdamW, ``1`` for SGD with momentum), and
    ``activations = 4 * B * a * sum_l C_l H_l W_l`` bytes with ``C_l H_l W_l`` the conv output
    sizes of :func:`conv_output_shapes` (the first ``blocks`` of them where given: a depth-cut
    model), ``B`` the batch size and ``a`` = :data:`ACT_FLOATS_PER_CONV_OUTPUT`.  Every tensor is
    trainable (static BN has no buffers).
    """
    moments = {"adamw": 2, "sgd": 1}.get(optimizer)
    if moments is None:
        raise ValueError(f"unknown optimizer {optimizer!r} (expected 'adamw' or 'sgd')")
    p_all = layout.num_params()
    p_train = layout.num_params(trainable_only=True)
    shapes = conv_output_shapes(model_name, rate, image_size=image_size, base=base)[:blocks]
    elements = sum(c * h * w for c, h, w in shapes)
    return MemoryEstimate(
        parameters=4 * p_all,
        gradients=4 * p_train,
        optimizer=4 * moments * p_train,
        activations=int(4 * batch_size * ACT_FLOATS_PER_CONV_OUTPUT * elements),
    )


def width_catalog(
    model_name: str,
    rates: Sequence[tuple[str, float]],
    *,
    in_channels: int,
    num_classes: int,
    image_size: int,
    batch_size: int,
    base: Sequence[int] = HETEROFL_BASE,
    optimizer: str = "sgd",
) -> VariantCatalog:
    """Catalog of width variants, one per ``(name, rate)``, smallest first.

    Each variant has the layout of :func:`width_layout`, the estimate of
    :func:`estimate_memory` (``optimizer`` defaults to HeteroFL's SGD with momentum),
    ``depth`` = the number of blocks (``1 + max`` of the layout's layer indices: 4 for
    ``"conv"`` with four widths, 10 for ``"preresnet18"``) and ``extra = {"rate": r}``.

    Raises
    ------
    ValueError
        If the rates are not strictly increasing in ``(0, 1]``.

    """
    values = [r for _, r in rates]
    if not values or values != sorted(values) or len(set(values)) != len(values):
        raise ValueError(f"rates must be strictly increasing, got {values}")
    for r in values:
        _check_rate(r)
    depth = _num_blocks(model_name, base)
    variants = []
    for name, rate in rates:
        layout = width_layout(model_name, rate, in_channels=in_channels, num_classes=num_classes, base=base)
        mem = estimate_memory(
            model_name, rate, layout, image_size=image_size, batch_size=batch_size, optimizer=optimizer, base=base
        )
        variants.append(Variant(name=name, depth=depth, layout=layout, memory=mem, extra={"rate": float(rate)}))
    return VariantCatalog(family=f"cnn:{model_name}", variants=tuple(variants))
