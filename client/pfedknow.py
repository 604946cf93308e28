r"""pFedKnow's client round (seed 002, Section 3.2) on an unlabeled IoT device.

The server sends the client's personalized model ``w_s^k`` as a sparse payload
(:mod:`models.sparse`) and, in the message config, this round's channel pruning ratio
``prune-ratio``, the threshold ``delta``, the ``uncertainty`` kind and the slimming weight
``l1``.  The client

1. pseudo-labels its local images with ``w_s^k``: ``y_hat = argmax z``, kept when the
   uncertainty (evidential ``C / sum(ReLU(z) + 1)``, or ``1 - max softmax``) is ``<= delta``;
2. prunes by network slimming to ``prune-ratio`` of the channels (never reviving a removed one);
3. fine-tunes the pruned model on the kept pseudo-labels with ``CE + l1 sum |gamma|``, removed
   weights held at 0;
4. uploads only the surviving weights and the mask (the smaller of bitmask and index code).

Labels are never read: the local training split is turned into an input tensor with its label
column dropped before anything else (:func:`unlabeled_inputs`).
"""

from __future__ import annotations

from functools import lru_cache
from logging import INFO

import numpy as np
import torch
import torch.nn.functional as F
from datasets import Dataset
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common import log
from torch import Tensor, nn

from models.data import DataSpec, load_partition
from models.images import MEAN, STD
from models.pruning import (
    apply_masks,
    bn_l1_penalty,
    channel_masks_to_tensor_masks,
    channel_ratio,
    channels_from_tensor_masks,
    convnet_channel_groups,
    kept_fraction,
    select_pseudo_labels,
    slimming_channel_masks,
)
from models.sparse import from_wire, to_wire
from models.training import TrainSettings, make_optimizer


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


@lru_cache(maxsize=4)
def local_unlabeled(spec: DataSpec, partition_id: int, num_partitions: int) -> Tensor:
    """This node's local training images, without labels (cached per process)."""
    train, _ = load_partition(spec, partition_id, num_partitions)
    return unlabeled_inputs(train)


@torch.no_grad()
def pseudo_label(
    model: nn.Module, x: Tensor, *, delta: float, uncertainty: str, batch_size: int = 256
) -> tuple[Tensor, Tensor]:
    """``(kept inputs, their pseudo-labels)`` from ``model``'s logits (eval mode)."""
    model.eval()
    keep_all, labels_all = [], []
    for lo in range(0, x.shape[0], batch_size):
        keep, labels = select_pseudo_labels(model(x[lo : lo + batch_size]), delta, uncertainty)
        keep_all.append(keep)
        labels_all.append(labels)
    if not keep_all:
        return x[:0], torch.zeros(0, dtype=torch.long)
    keep = torch.cat(keep_all)
    return x[keep], torch.cat(labels_all)[keep]


def fine_tune(
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    masks: dict[str, Tensor],
    *,
    settings: TrainSettings,
    batch_size: int,
    l1: float,
    seed: int,
) -> float:
    """``local-steps`` optimizer steps of ``CE + l1 sum |gamma|`` on ``(x, y)``, masks held; mean loss."""
    if x.shape[0] == 0 or settings.local_steps == 0:
        return 0.0
    groups = convnet_channel_groups(masks)
    model.train()
    opt = make_optimizer(model, settings.optimizer, lr=settings.lr, weight_decay=settings.weight_decay)
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for _ in range(settings.local_steps):
        idx = torch.randint(0, x.shape[0], (min(batch_size, x.shape[0]),), generator=gen)
        loss = F.cross_entropy(model(x[idx]), y[idx])
        if l1 > 0:
            loss = loss + bn_l1_penalty(model, groups, l1)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        apply_masks(model, masks)
        total += float(loss.detach())
    return total / settings.local_steps


def pfedknow_round(
    model: nn.Module,
    payload: dict[str, np.ndarray],
    shapes: dict[str, tuple[int, ...]],
    x: Tensor,
    config: ConfigRecord,
    *,
    settings: TrainSettings,
    batch_size: int,
    seed: int,
) -> tuple[dict[str, np.ndarray], dict[str, float]]:
    """One client round on unlabeled ``x``: decode, pseudo-label, prune, fine-tune, encode.

    Returns the sparse upload payload and metrics (``pseudo-kept``, ``prune-ratio``,
    ``kept-weights``, ``train-loss``).
    """
    params, masks = from_wire(payload, shapes)
    model.load_state_dict(params, strict=False)
    xs, ys = pseudo_label(model, x, delta=float(config["delta"]), uncertainty=str(config["uncertainty"]))  # type: ignore[arg-type]
    ratio = float(config["prune-ratio"])  # type: ignore[arg-type]
    groups = convnet_channel_groups(shapes)
    channels = channels_from_tensor_masks(masks, groups)
    if ratio > 0:
        scales = {g.scale: params[g.scale] for g in groups}
        channels = slimming_channel_masks(scales, groups, ratio, channels)
        new = channel_masks_to_tensor_masks(channels, groups, shapes)
        masks = {k: masks[k] & new[k] for k in masks}
    apply_masks(model, masks)
    loss = fine_tune(
        model,
        xs,
        ys,
        masks,
        settings=settings,
        batch_size=batch_size,
        l1=float(config["l1"]),  # type: ignore[arg-type]
        seed=seed,
    )
    state = model.state_dict()
    upload = to_wire({k: state[k].detach() for k in shapes}, masks)
    metrics = {
        "pseudo-kept": float(xs.shape[0]),
        "prune-ratio": channel_ratio(channels),
        "kept-weights": kept_fraction(masks),
        "train-loss": loss,
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
) -> Message:
    """The ClientApp's ``train`` for pFedKnow and its ablations: the reply with the sparse upload."""
    torch.manual_seed(seed)
    x = local_unlabeled(spec, *partition)
    if x.shape[0] == 0:
        raise ValueError("this node has no local training images")
    arrays = msg.content["arrays"]
    cfg = msg.content["config"]
    assert isinstance(arrays, ArrayRecord) and isinstance(cfg, ConfigRecord)
    payload = {k: np.asarray(a.numpy()) for k, a in arrays.items()}
    upload, metrics = pfedknow_round(
        model, payload, shapes, x, cfg, settings=settings, batch_size=batch_size, seed=seed
    )
    content = RecordDict(
        {
            "arrays": ArrayRecord({k: Array(v) for k, v in upload.items()}),
            "metrics": MetricRecord({"num-examples": int(x.shape[0]), **metrics}),
            "config": ConfigRecord({"variant": cfg["variant"], "server-round": cfg["server-round"]}),
        }
    )
    log(
        INFO,
        "pFedKnow: %d/%d pseudo-labels kept, %.0f%% channels pruned, %.0f%% weights kept",
        int(metrics["pseudo-kept"]),
        x.shape[0],
        100 * metrics["prune-ratio"],
        100 * metrics["kept-weights"],
    )
    return Message(content, reply_to=msg)
