r"""Pruning and pseudo-label selection of pFedKnow's clients (seed 002, Section 3.2), as pure functions.

Uncertainty (Section 3.2.2) of logits ``z`` over ``C`` classes:

* images, evidential: ``u = C / sum_c (ReLU(z_c) + 1)`` (:func:`evidential_uncertainty`);
* text: ``u = 1 - max_c softmax(z)_c`` (:func:`softmax_uncertainty`).

A sample is pseudo-labelled ``argmax_c z_c`` and kept when ``u <= delta``
(:func:`select_pseudo_labels`).

Compression ``g(w; gamma)`` (Section 3.2.1), progressive over rounds toward a target ratio
(:func:`progressive_ratio`):

* CNNs: network slimming (Liu et al., ICCV 2017).  Fine-tuning adds ``lambda sum |gamma|``
  over the batch-norm scales (:func:`bn_l1_penalty`); the channels whose ``|gamma|`` are the
  smallest over the whole network are removed, ``round(ratio * total channels)`` of them,
  never reviving a removed channel and keeping at least one channel per layer
  (:func:`slimming_channel_masks`).  A removed channel is zeroed in its conv (weights and
  bias), its batch norm (scale and shift) and in the input slice of the layer that consumes
  it (:func:`channel_masks_to_tensor_masks`), so it contributes exactly 0 -- the model keeps
  its dense shapes (the server's mask math needs them) while the upload carries only the
  survivors (:mod:`models.sparse`).
* Transformers: unstructured magnitude pruning (SparseBERT's pruning) of the weight matrices of
  the encoder's linear layers and of the pooler (:func:`transformer_prunable`: not LayerNorm, not
  biases, not the embeddings -- the frozen word embeddings are never uploaded, the position and
  token-type tables are lookups rather than projections -- and not the classifier head), per
  tensor the ``round(ratio * numel)`` smallest ``|w|`` removed, never reviving
  (:func:`magnitude_masks`).  Per tensor rather than global: every projection keeps the same
  share of its weights, so no layer (attention vs. feed-forward weights have different scales)
  is pruned away.  The paper's text model is "compressed four times": target ratio ``0.75``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

Masks = dict[str, Tensor]

#: The clients' compression ``g(w; gamma)``: network slimming (CNNs) or magnitude pruning (transformers).
PRUNING = ("slimming", "magnitude")


# --- uncertainty --------------------------------------------------------------------------------


def evidential_uncertainty(logits: Tensor) -> Tensor:
    r"""Evidential uncertainty ``u = C / sum_c (ReLU(z_c) + 1)`` per row of ``logits`` ``(B, C)``.

    ``u`` lies in ``(0, 1]``; ``u = 1`` when no class has positive evidence.
    """
    if logits.ndim != 2:
        raise ValueError(f"logits must be (batch, classes), got shape {tuple(logits.shape)}")
    c = logits.shape[1]
    return c / (torch.relu(logits) + 1.0).sum(dim=1)


def softmax_uncertainty(logits: Tensor) -> Tensor:
    r"""``u = 1 - max_c softmax(z)_c`` per row of ``logits`` ``(B, C)``, in ``[0, 1 - 1/C]``."""
    if logits.ndim != 2:
        raise ValueError(f"logits must be (batch, classes), got shape {tuple(logits.shape)}")
    return 1.0 - torch.softmax(logits, dim=1).max(dim=1).values


UNCERTAINTY = {"evidential": evidential_uncertainty, "softmax": softmax_uncertainty}


def select_pseudo_labels(logits: Tensor, delta: float, kind: str = "evidential") -> tuple[Tensor, Tensor]:
    """``(keep, labels)``: ``keep = u <= delta`` (bool ``(B,)``) and ``labels = argmax z`` ``(B,)``."""
    if kind not in UNCERTAINTY:
        raise ValueError(f"uncertainty must be one of {tuple(UNCERTAINTY)}, got {kind!r}")
    u = UNCERTAINTY[kind](logits)
    return u <= delta, logits.argmax(dim=1)


# --- schedule -----------------------------------------------------------------------------------


def progressive_ratio(server_round: int, target: float, ramp_rounds: int) -> float:
    r"""Pruning ratio of round ``t``: ``gamma_t = target * min(1, t / R)`` (``R`` = ``ramp_rounds``).

    Linear growth from ``target / R`` in round 1 to ``target`` from round ``R`` on.
    """
    if server_round < 1 or ramp_rounds < 1:
        raise ValueError(f"need round >= 1 and ramp >= 1, got {server_round} and {ramp_rounds}")
    if not 0.0 <= target < 1.0:
        raise ValueError(f"target ratio must be in [0, 1), got {target}")
    return target * min(1.0, server_round / ramp_rounds)


# --- network slimming ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ChannelGroup:
    """One prunable channel dimension of a CNN.

    Attributes
    ----------
    scale : str
        State-dict name of the batch-norm scale ``gamma`` ranking the channels.
    members : tuple[tuple[str, int], ...]
        ``(tensor name, axis)`` of every tensor slice that belongs to a channel (the producing
        conv's output axis, its bias, the norm's scale and shift, the consumer's input axis).

    """

    scale: str
    members: tuple[tuple[str, int], ...]


_CONV_BLOCK = re.compile(r"^blocks\.(\d+)\.norm\.weight$")


def convnet_channel_groups(names: Iterable[str]) -> list[ChannelGroup]:
    """Channel groups of HeteroFL's ``ConvNet`` (:class:`models.cnn.ConvNet`) from its state-dict names.

    Block ``i``'s channels: ``blocks.i.conv.weight`` (axis 0), ``blocks.i.conv.bias``,
    ``blocks.i.norm.{weight,bias}`` and the consumer's input axis 1 (``blocks.{i+1}.conv.weight``,
    or ``classifier.weight`` after the last block).
    """
    names = set(names)
    blocks = sorted(int(m.group(1)) for n in names if (m := _CONV_BLOCK.match(n)))
    if not blocks or blocks != list(range(len(blocks))) or "classifier.weight" not in names:
        raise ValueError("not a ConvNet state dict (blocks.<i>.norm.weight and classifier.weight expected)")
    groups = []
    for i in blocks:
        p = f"blocks.{i}"
        members = [(f"{p}.conv.weight", 0), (f"{p}.norm.weight", 0), (f"{p}.norm.bias", 0)]
        if f"{p}.conv.bias" in names:
            members.append((f"{p}.conv.bias", 0))
        consumer = f"blocks.{i + 1}.conv.weight" if i + 1 < len(blocks) else "classifier.weight"
        members.append((consumer, 1))
        groups.append(ChannelGroup(f"{p}.norm.weight", tuple(members)))
    return groups


def bn_l1_penalty(model: nn.Module, groups: Sequence[ChannelGroup], lam: float) -> Tensor:
    r"""Network slimming's sparsity term ``lambda sum_l sum_c |gamma_{l,c}|`` over the groups' scales."""
    params = dict(model.named_parameters())
    total = sum((params[g.scale].abs().sum() for g in groups), torch.zeros(()))
    return lam * total


def slimming_channel_masks(
    scales: Mapping[str, Tensor],
    groups: Sequence[ChannelGroup],
    ratio: float,
    kept: Mapping[str, Tensor] | None = None,
) -> dict[str, Tensor]:
    r"""Channels to keep after network slimming at channel ratio ``ratio``.

    With ``N`` channels over all groups, the target is ``P = round(ratio * N)`` removed.  Among
    the channels still kept (``kept``, default all), the smallest ``|gamma|`` (global ranking,
    ties by position) are removed until ``P`` are removed in total, skipping any whose removal
    would leave its layer empty.  Already removed channels stay removed (``P`` smaller than
    those removes nothing more).

    Returns
    -------
    dict[str, Tensor]
        ``{scale name: bool (channels,)}``, true = kept.

    """
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    masks = {
        g.scale: (
            kept[g.scale].clone().bool() if kept is not None else torch.ones_like(scales[g.scale], dtype=torch.bool)
        )
        for g in groups
    }
    total = sum(int(m.numel()) for m in masks.values())
    removed = sum(int((~m).sum()) for m in masks.values())
    target = round(ratio * total)
    if target <= removed:
        return masks
    candidates = [
        (float(scales[g.scale][c].abs()), gi, c)
        for gi, g in enumerate(groups)
        for c in range(int(masks[g.scale].numel()))
        if bool(masks[g.scale][c])
    ]
    candidates.sort()
    for _, gi, c in candidates:
        if removed >= target:
            break
        m = masks[groups[gi].scale]
        if int(m.sum()) <= 1:
            continue
        m[c] = False
        removed += 1
    return masks


def channel_masks_to_tensor_masks(
    channel_masks: Mapping[str, Tensor], groups: Sequence[ChannelGroup], shapes: Mapping[str, Sequence[int]]
) -> Masks:
    """Per-tensor bool masks (every tensor of ``shapes``) from per-group channel masks.

    A tensor element is kept unless it lies in a removed channel of some group it belongs to.
    """
    out = {n: torch.ones(tuple(s), dtype=torch.bool) for n, s in shapes.items()}
    for g in groups:
        keep = channel_masks[g.scale]
        for name, axis in g.members:
            view = [1] * len(out[name].shape)
            view[axis] = -1
            out[name] &= keep.reshape(view)
    return out


def channel_ratio(channel_masks: Mapping[str, Tensor]) -> float:
    """Fraction of channels removed."""
    total = sum(int(m.numel()) for m in channel_masks.values())
    return sum(int((~m).sum()) for m in channel_masks.values()) / max(total, 1)


def channels_from_tensor_masks(masks: Mapping[str, Tensor], groups: Sequence[ChannelGroup]) -> dict[str, Tensor]:
    """Channel masks recovered from tensor masks: a channel is kept when its scale ``gamma`` is."""
    return {g.scale: masks[g.scale].clone().bool() for g in groups}


# --- magnitude pruning --------------------------------------------------------------------------


def magnitude_masks(
    params: Mapping[str, Tensor], ratio: float, kept: Mapping[str, Tensor] | None = None, *, min_ndim: int = 2
) -> Masks:
    r"""Unstructured magnitude pruning per tensor (SparseBERT): remove the smallest ``|w|``.

    Every tensor with ``ndim >= min_ndim`` ends with ``round(ratio * numel)`` elements removed
    (ranking the still-kept ones by ``|w|``, ties by position; removed ones stay removed; a
    tensor already past the target is unchanged).  Other tensors are kept whole.
    """
    if not 0.0 <= ratio < 1.0:
        raise ValueError(f"ratio must be in [0, 1), got {ratio}")
    out: Masks = {}
    for name, w in params.items():
        m = kept[name].clone().bool() if kept is not None and name in kept else torch.ones_like(w, dtype=torch.bool)
        if w.ndim >= min_ndim:
            target = round(ratio * w.numel())
            more = target - int((~m).sum())
            if more > 0:
                flat = m.reshape(-1)
                score = w.detach().abs().reshape(-1).to(torch.float64)
                score = torch.where(flat, score, torch.full_like(score, math.inf))
                order = torch.sort(score, stable=True).indices[:more]
                flat[order] = False
                m = flat.reshape(w.shape)
        out[name] = m
    return out


_ENCODER_MATRIX = re.compile(
    r"^bert\.encoder\.layer\.\d+\."
    r"(attention\.self\.(query|key|value)|attention\.output\.dense|intermediate\.dense|output\.dense)\.weight$"
)
_POOLER_MATRIX = "bert.pooler.dense.weight"


def transformer_prunable(names: Iterable[str]) -> list[str]:
    """The weight matrices magnitude pruning acts on, in the order of ``names``.

    Every encoder layer's query, key, value, attention-output, intermediate and output
    projection weights, and the pooler's; never LayerNorm, biases, embeddings or the classifier.
    """
    return [n for n in names if _ENCODER_MATRIX.match(n) or n == _POOLER_MATRIX]


def pruned_fraction(masks: Mapping[str, Tensor], names: Sequence[str]) -> float:
    """Share of the elements of the tensors ``names`` that ``masks`` remove (0 for no tensors)."""
    return 1.0 - kept_fraction({n: masks[n] for n in names}) if names else 0.0


def kept_fraction(masks: Mapping[str, Tensor]) -> float:
    """Share of elements kept over all tensors."""
    total = sum(int(m.numel()) for m in masks.values())
    return sum(int(m.sum()) for m in masks.values()) / max(total, 1)


@torch.no_grad()
def apply_masks(model: nn.Module, masks: Mapping[str, Tensor]) -> None:
    """Zero every parameter element whose mask is false (in place)."""
    for name, p in model.named_parameters():
        m = masks.get(name)
        if m is not None:
            p.mul_(m.to(p.dtype))
