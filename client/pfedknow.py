r"""pFedKnow's client round (seed 002, Section 3.2) on an unlabeled IoT device.

The server sends the client's personalized model ``w_s^k`` as a sparse payload
(:mod:`models.sparse`) and, in the message config, this round's pruning ratio ``prune-ratio``,
the ``pruning`` kind, the threshold ``delta``, the ``uncertainty`` kind and the slimming weight
``l1``.  The client

1. pseudo-labels its local data with ``w_s^k``: ``y_hat = argmax z``, kept when the
   uncertainty (images: evidential ``C / sum(ReLU(z) + 1)``; text: ``1 - max softmax``) is
   ``<= delta``;
2. prunes to ``prune-ratio`` (never reviving a removed weight, :func:`prune_masks`): images by
   network slimming (share of channels), text by unstructured magnitude pruning of every
   encoder / pooler weight matrix (share of each matrix, :func:`models.pruning.transformer_prunable`);
3. fine-tunes the pruned model on the kept pseudo-labels with ``CE`` (``+ l1 sum |gamma|`` for
   slimming), removed weights held at 0 after every step;
4. uploads only the surviving weights of its trainable tensors and the mask (the smaller of
   bitmask and index code); frozen tensors (a transformer's word embeddings) are not uploaded.

Labels are never read: the local training split loses its label column before anything else
(:func:`unlabeled_inputs`, :func:`unlabeled_texts`); text is then tokenized into keyword inputs.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache
from logging import INFO

import numpy as np
import torch
import torch.nn.functional as F
from datasets import Dataset
from flwr.app import Array, ArrayRecord, ConfigRecord, Message
from flwr.common import log
from torch import Tensor, nn

from experiment.protocol import (
    ARRAYS,
    CONFIG,
    KEPT_WEIGHTS,
    NUM_EXAMPLES,
    PRUNE_RATIO,
    PSEUDO_KEPT,
    TRAIN_LOSS,
    Instruction,
    PruningInstruction,
    record_of,
    train_reply,
)
from models.batches import Batch, batch_size_of, model_logits, take_rows
from models.data import DataSpec, load_partition, text_inputs
from models.family import ModelFamily, TransformerFamily
from models.images import MEAN, STD
from models.pruning import (
    Masks,
    apply_masks,
    bn_l1_penalty,
    channel_masks_to_tensor_masks,
    channel_ratio,
    channels_from_tensor_masks,
    convnet_channel_groups,
    kept_fraction,
    magnitude_masks,
    pruned_fraction,
    select_pseudo_labels,
    slimming_channel_masks,
    transformer_prunable,
)
from models.sparse import from_wire, to_wire
from models.training import TrainSettings, make_optimizer
from models.transformer import load_tokenizer


def unlabeled_inputs(ds: Dataset) -> Tensor:
    """Images of ``ds`` as normalized ``float32 (N, C, H, W)``; the label column is dropped unread."""
    label_free = ds.remove_columns([c for c in ds.column_names if c != "image"])
    if len(label_free) == 0:
        return torch.zeros(0, 1, 1, 1)
    images = label_free.with_format("numpy")[0 : len(label_free)]["image"]
    x = torch.from_numpy(np.ascontiguousarray(images)).to(torch.float32)
    if x.ndim == 3:
        x = x.unsqueeze(1)
    elif x.ndim == 4:
        x = x.permute(0, 3, 1, 2).contiguous()
    return (x / 255.0 - MEAN) / STD


def unlabeled_texts(ds: Dataset) -> list[str]:
    """Texts of ``ds``; every other column (the label included) is dropped unread."""
    label_free = ds.remove_columns([c for c in ds.column_names if c != "text"])
    return [str(t) for t in label_free["text"]] if len(label_free) else []


@lru_cache(maxsize=4)
def local_unlabeled(spec: DataSpec, partition_id: int, num_partitions: int, family: ModelFamily | None = None) -> Batch:
    """This node's local training inputs, without labels (cached per process).

    Images: a normalized tensor (:func:`unlabeled_inputs`).  Text (``spec.kind == "text"``):
    keyword inputs ``input_ids`` / ``attention_mask`` ``(N, L)``, tokenized with the transformer
    ``family``'s tokenizer and truncated at its ``max_seq_len``.
    """
    train, _ = load_partition(spec, partition_id, num_partitions)
    if spec.kind != "text":
        return unlabeled_inputs(train)
    if not isinstance(family, TransformerFamily):
        raise TypeError(f"text data needs the transformer family to tokenize, got {type(family).__name__}")
    texts = unlabeled_texts(train)
    if not texts:
        return {"input_ids": torch.zeros(0, 1, dtype=torch.long), "attention_mask": torch.zeros(0, 1, dtype=torch.long)}
    tokenizer = load_tokenizer(family.spec.source)
    return text_inputs(texts, tokenizer, max_length=family.max_seq_len)


@torch.no_grad()
def pseudo_label(
    model: nn.Module, x: Batch, *, delta: float, uncertainty: str, batch_size: int = 256
) -> tuple[Batch, Tensor]:
    """``(kept inputs, their pseudo-labels)`` from ``model``'s logits (eval mode)."""
    model.eval()
    n = batch_size_of(x)
    keep_all, labels_all = [], []
    for lo in range(0, n, batch_size):
        z = model_logits(model, take_rows(x, torch.arange(lo, min(lo + batch_size, n))))
        keep, labels = select_pseudo_labels(z, delta, uncertainty)
        keep_all.append(keep)
        labels_all.append(labels)
    if not keep_all:
        return take_rows(x, torch.zeros(0, dtype=torch.long)), torch.zeros(0, dtype=torch.long)
    keep = torch.cat(keep_all)
    return take_rows(x, keep.nonzero().reshape(-1)), torch.cat(labels_all)[keep]


def fine_tune(
    model: nn.Module,
    x: Batch,
    y: Tensor,
    masks: dict[str, Tensor],
    *,
    settings: TrainSettings,
    batch_size: int,
    l1: float,
    seed: int,
) -> float:
    """``local-steps`` optimizer steps of ``CE (+ l1 sum |gamma|)`` on ``(x, y)``, masks held; mean loss.

    The slimming term needs the CNN's channel groups; ``l1 = 0`` (magnitude pruning, no pruning)
    trains any model.
    """
    n = batch_size_of(x)
    if n == 0 or settings.local_steps == 0:
        return 0.0
    groups = convnet_channel_groups(masks) if l1 > 0 else []
    model.train()
    opt = make_optimizer(model, settings.optimizer, lr=settings.lr, weight_decay=settings.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(settings.local_steps):
        idx = torch.randint(0, n, (min(batch_size, n),), generator=gen)
        loss = F.cross_entropy(model_logits(model, take_rows(x, idx)), y[idx])
        if l1 > 0:
            loss = loss + bn_l1_penalty(model, groups, l1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        apply_masks(model, masks)
        total += float(loss.detach())
    return total / settings.local_steps


def prune_masks(
    kind: str, params: Mapping[str, Tensor], masks: Masks, shapes: Mapping[str, tuple[int, ...]], ratio: float
) -> tuple[Masks, float]:
    """``g(w; ratio)``: the masks after this round's pruning, and the share it has removed.

    ``slimming``: network slimming of the CNN's channels (share of channels removed);
    ``magnitude``: per-matrix magnitude pruning of :func:`models.pruning.transformer_prunable`
    (share of those weights removed).  Both start from ``masks`` (nothing revived); a ratio of
    0 prunes nothing more.
    """
    if kind == "slimming":
        groups = convnet_channel_groups(shapes)
        channels = channels_from_tensor_masks(masks, groups)
        if ratio > 0:
            scales = {g.scale: params[g.scale] for g in groups}
            channels = slimming_channel_masks(scales, groups, ratio, channels)
            new = channel_masks_to_tensor_masks(channels, groups, shapes)
            masks = {k: masks[k] & new[k] for k in masks}
        return masks, channel_ratio(channels)
    if kind == "magnitude":
        prunable = transformer_prunable(shapes)
        if not prunable:
            raise ValueError("magnitude pruning found no transformer weight matrices (bert.encoder.*, bert.pooler)")
        if ratio > 0:
            new = magnitude_masks({n: params[n] for n in prunable}, ratio, {n: masks[n] for n in prunable})
            masks = {**masks, **new}
        return masks, pruned_fraction(masks, prunable)
    raise ValueError(f"unknown pruning {kind!r} (expected 'slimming' or 'magnitude')")


def uploaded_names(model: nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> list[str]:
    """Tensors of ``shapes`` the client uploads: all but the model's frozen parameters."""
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    return [n for n in shapes if n not in frozen]


def pfedknow_round(
    model: nn.Module,
    payload: dict[str, np.ndarray],
    shapes: dict[str, tuple[int, ...]],
    x: Batch,
    config: ConfigRecord,
    *,
    settings: TrainSettings,
    batch_size: int,
    seed: int,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """One client round on unlabeled ``x``: decode, pseudo-label, prune, fine-tune, encode.

    ``shapes`` are every tensor the server sends; the upload holds the trainable ones
    (:func:`uploaded_names`).  ``config`` is the train message's ``CONFIG`` record, holding this
    round's :class:`~experiment.protocol.PruningInstruction`.  Returns the sparse upload
    payload and metrics (``pseudo-kept``, ``prune-ratio``: share of channels / prunable weights
    removed, ``kept-weights``: share of the uploaded tensors' weights kept, ``train-loss``).
    """
    instruction = PruningInstruction.from_config(config)
    params, masks = from_wire(payload, shapes)
    model.load_state_dict(params, strict=False)
    xs, ys = pseudo_label(model, x, delta=instruction.delta, uncertainty=instruction.uncertainty)
    masks, removed = prune_masks(instruction.pruning, params, masks, shapes, instruction.prune_ratio)
    apply_masks(model, masks)
    loss = fine_tune(
        model,
        xs,
        ys,
        masks,
        settings=settings,
        batch_size=batch_size,
        l1=instruction.l1,
        seed=seed,
    )
    state = model.state_dict()
    names = uploaded_names(model, shapes)
    upload = to_wire({k: state[k].detach() for k in names}, {k: masks[k] for k in names})
    metrics = {
        PSEUDO_KEPT: float(ys.shape[0]),
        PRUNE_RATIO: removed,
        KEPT_WEIGHTS: kept_fraction({k: masks[k] for k in names}),
        TRAIN_LOSS: loss,
    }
    return upload, metrics


def pfedknow_train(
    msg: Message,
    model: nn.Module,
    shapes: dict[str, tuple[int, ...]],
    spec: DataSpec,
    partition: tuple[int, int],
    *,
    settings: TrainSettings,
    batch_size: int,
    seed: int,
    family: ModelFamily | None = None,
) -> Message:
    """The ClientApp's ``train`` for pFedKnow and its ablations: the reply with the sparse upload.

    ``family`` tokenizes text (a :class:`~models.family.TransformerFamily`); images need none.
    """
    torch.manual_seed(seed)
    x = local_unlabeled(spec, *partition, family)
    n = batch_size_of(x)
    if n == 0:
        raise ValueError(f"this node has no local training {spec.kind}")
    arrays = record_of(msg.content, ARRAYS, ArrayRecord)
    instruction = Instruction.from_content(msg.content)
    config = record_of(msg.content, CONFIG, ConfigRecord)
    payload = {k: np.asarray(a.numpy()) for k, a in arrays.items()}
    upload, metrics = pfedknow_round(
        model, payload, shapes, x, config, settings=settings, batch_size=batch_size, seed=seed
    )
    content = train_reply(
        ArrayRecord({k: Array(v) for k, v in upload.items()}), {NUM_EXAMPLES: n, **metrics}, instruction
    )
    log(
        INFO,
        "pFedKnow: %d/%d pseudo-labels kept, %.0f%% pruned, %.0f%% weights kept",
        int(metrics[PSEUDO_KEPT]),
        n,
        100 * metrics[PRUNE_RATIO],
        100 * metrics[KEPT_WEIGHTS],
    )
    return Message(content, reply_to=msg)
