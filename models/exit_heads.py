r"""The exits of DepthFL's multi-exit conv net: one linear layer, or bottleneck layers and a linear layer.

DepthFL (Kim et al., ICLR 2023) puts a classifier after each block of a ResNet-18 and follows
"Be Your Own Teacher" (Zhang et al., ICCV 2019): a shallow classifier reads its block's features
through *bottleneck layers* that bring them to the deepest block's channels before pooling
(Flower's ``depthfl`` baseline: ``scala<i>``, a chain of ``SepConv``).  Two exit heads:

* ``"linear"`` -- :class:`PooledLinear`, ``z_i = W_i mean_hw(h_i) + b_i`` on block ``i``'s
  output (this project's first DepthFL conv net; state names ``exits.<i>.{weight,bias}``);
* ``"bottleneck"`` -- :class:`BottleneckExit`, ``z_i = W_i mean_hw(S_{L-1} o .. o S_{i+1}(h_i)) + b_i``:
  one separable step ``S_j`` per block ``j`` that block ``i``'s model does not reach, from
  ``c_{j-1}`` to ``c_j`` channels, with stride 2 where the conv net pools after block ``j``
  (every block but the last), so exit ``i`` pools ``c_{L-1}`` channels as the deepest exit does.
  The deepest exit has no step.  State names ``exits.<i>.steps.<k>.*`` and
  ``exits.<i>.linear.{weight,bias}``.

A separable step is the baseline's ``SepConv``: depthwise ``3x3`` (the stride), pointwise
``1x1`` to ``c_{j-1}``, norm, ReLU, depthwise ``3x3``, pointwise ``1x1`` to ``c_j``, norm, ReLU,
every convolution without bias; the norms are the conv net's static batch norm (HeteroFL's sBN
re-estimates them for evaluation like the blocks').  The baseline's attention masks before the
bottleneck are not built.  Exit ``i``'s tensors depend on ``i`` and the full model's widths only,
so a depth-``k`` model's exits are those of any deeper model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal, get_args

import torch.nn.functional as F
from torch import Tensor, nn

from models.cnn import static_bn

ExitHeadKind = Literal["linear", "bottleneck"]

#: The exit heads a multi-exit conv net can have.
EXIT_HEADS: tuple[str, ...] = get_args(ExitHeadKind)


class PooledLinear(nn.Linear):
    """``z = W mean_hw(h) + b``: global average pooling, then one linear layer."""

    def forward(self, input: Tensor) -> Tensor:
        """Logits of a ``(batch, channels, h, w)`` feature map."""
        return super().forward(F.adaptive_avg_pool2d(input, 1).flatten(1))


class SeparableStep(nn.Module):
    """Flower's ``SepConv``: two depthwise-separable ``3x3`` convolutions, the first with ``stride``."""

    def __init__(self, in_channels: int, out_channels: int, *, stride: int) -> None:
        super().__init__()
        self.op = nn.Sequential(
            nn.Conv2d(in_channels, in_channels, 3, stride=stride, padding=1, groups=in_channels, bias=False),
            nn.Conv2d(in_channels, in_channels, 1, bias=False),
            static_bn(in_channels),
            nn.ReLU(),
            nn.Conv2d(in_channels, in_channels, 3, stride=1, padding=1, groups=in_channels, bias=False),
            nn.Conv2d(in_channels, out_channels, 1, bias=False),
            static_bn(out_channels),
            nn.ReLU(),
        )

    def forward(self, x: Tensor) -> Tensor:
        """The step's output, ``out_channels`` at ``ceil(h / stride)``."""
        return self.op(x)


class BottleneckExit(nn.Module):
    """Exit ``index`` of a conv net with block widths ``base``: steps to ``base[-1]`` channels, pool, linear."""

    def __init__(self, index: int, *, base: Sequence[int], num_classes: int) -> None:
        super().__init__()
        last = len(base) - 1
        self.steps = nn.Sequential(
            *(SeparableStep(base[j - 1], base[j], stride=2 if j < last else 1) for j in range(index + 1, last + 1))
        )
        self.linear = PooledLinear(base[last], num_classes)

    def forward(self, h: Tensor) -> Tensor:
        """Logits from block ``index``'s output ``h``."""
        return self.linear(self.steps(h))


def conv_exit(head: ExitHeadKind, index: int, *, base: Sequence[int], num_classes: int) -> nn.Module:
    """Exit ``index`` (from 0) of a multi-exit conv net with block widths ``base``, of kind ``head``.

    Raises
    ------
    ValueError
        When ``head`` is not one of :data:`EXIT_HEADS`.

    """
    if head == "linear":
        return PooledLinear(base[index], num_classes)
    if head == "bottleneck":
        return BottleneckExit(index, base=base, num_classes=num_classes)
    raise ValueError(f"exit head must be one of {EXIT_HEADS}, got {head!r}")
