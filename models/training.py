"""Local training and evaluation loops for classifiers of any family (no Flower code).

A batch is a mapping of the model's keyword inputs plus ``labels``; the model returns logits
(a tensor, or a Hugging Face output with ``.logits``); the loss is the mean cross-entropy
``-(1/B) sum_i log softmax(z_i)[y_i]`` (what Hugging Face's sequence classifiers compute for
integer labels and more than one class).  The loops run where the model's parameters are
(:func:`model_device`): a caller moves the model to a GPU (:func:`resolve_device`) and every
batch follows it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader


@dataclass(frozen=True)
class TrainSettings:
    """Local-training knobs.

    Attributes
    ----------
    optimizer : {"adamw", "sgd"}
    lr : float
    weight_decay : float
    local_steps : int
        Optimizer steps per round; when 0, ``local_epochs`` full passes are run.
    local_epochs : int

    """

    optimizer: str = "adamw"
    lr: float = 5e-5
    weight_decay: float = 0.0
    local_steps: int = 10
    local_epochs: int = 1


def use_threads(threads: int) -> int:
    """Set this process's torch intra-op threads to ``threads`` (0 = leave as is); return the count in use.

    A parallel kernel finishes with its slowest thread, so on cores shared with other busy
    processes (a SuperNode, the SuperLink, Ray's daemons) fewer threads than cores can be faster.
    """
    if threads < 0:
        raise ValueError(f"threads must be >= 0, got {threads}")
    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


#: ``device`` values: ``cpu``, ``auto`` (the first CUDA GPU when there is one), ``cuda``, ``cuda:N``
DEVICE_PATTERN = re.compile(r"cpu|auto|cuda(:\d+)?")


def resolve_device(name: str) -> torch.device:
    """The torch device for a ``device`` setting (see :data:`DEVICE_PATTERN`).

    Raises
    ------
    ValueError
        For an unknown name, or a CUDA device this machine does not have.

    """
    if not DEVICE_PATTERN.fullmatch(name):
        raise ValueError(f"device must be 'cpu', 'auto', 'cuda' or 'cuda:N', got {name!r}")
    if name == "cpu":
        return torch.device("cpu")
    available = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if name == "auto":
        return torch.device("cuda" if available else "cpu")
    index = int(name.split(":")[1]) if ":" in name else 0
    if index >= available:
        raise ValueError(f"device {name!r} asked for, but this machine has {available} CUDA device(s)")
    return torch.device(name)


def model_device(model: nn.Module) -> torch.device:
    """Where ``model``'s parameters are (CPU for a model without parameters)."""
    return next((p.device for p in model.parameters()), torch.device("cpu"))


@overload
def batch_to(batch: Tensor, device: torch.device) -> Tensor: ...
@overload
def batch_to(batch: Mapping[str, Tensor], device: torch.device) -> dict[str, Tensor]: ...
def batch_to(batch: Tensor | Mapping[str, Tensor], device: torch.device) -> Tensor | dict[str, Tensor]:
    """A batch (a tensor, or a mapping of tensors) on ``device`` (no copy where it already is)."""
    if isinstance(batch, Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping) and all(isinstance(v, Tensor) for v in batch.values()):
        return {k: v.to(device) for k, v in batch.items()}
    raise TypeError(f"batches must be tensors or mappings of tensors, got {type(batch).__name__}")


def make_optimizer(model: nn.Module, name: str, *, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """AdamW or SGD (momentum 0.9) over the trainable parameters."""
    params = [p for p in model.parameters() if p.requires_grad]
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r} (expected 'adamw' or 'sgd')")


def _batches(loader: DataLoader, settings: TrainSettings) -> Iterator[dict[str, torch.Tensor]]:
    if settings.local_steps > 0:
        done = 0
        while True:
            for batch in loader:
                yield batch
                done += 1
                if done >= settings.local_steps:
                    return
    else:
        for _ in range(settings.local_epochs):
            yield from loader


def logits_and_loss(model: nn.Module, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """``(logits, mean cross-entropy)`` of one batch."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    out = model(**inputs)
    logits = out if isinstance(out, Tensor) else out.logits
    return logits, F.cross_entropy(logits, batch["labels"])


#: ``(model, batch) -> (logits, loss)`` of one batch: what local training minimizes.
LossFn = Callable[[nn.Module, dict[str, Tensor]], tuple[Tensor, Tensor]]


def train_classifier(
    model: nn.Module, loader: DataLoader, settings: TrainSettings, *, loss_fn: LossFn = logits_and_loss
) -> float:
    """Run local training on ``loss_fn`` (default: the mean cross-entropy); return the mean training loss."""
    model.train()
    device = model_device(model)
    opt = make_optimizer(model, settings.optimizer, lr=settings.lr, weight_decay=settings.weight_decay)
    total, n = 0.0, 0
    for batch in _batches(loader, settings):
        _, loss = loss_fn(model, batch_to(batch, device))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        total += float(loss.detach())
        n += 1
    return total / max(n, 1)


@dataclass
class EvaluationTally:
    """Running evaluation sums over batches ``b`` of ``n_b`` examples and mean loss ``l_b``.

    ``loss = sum_b n_b l_b / N`` and ``accuracy = correct / N`` with ``N = sum_b n_b``.
    """

    loss_sum: float = 0.0
    correct: int = 0
    count: int = 0

    def add(self, logits: Tensor, labels: Tensor, loss: Tensor) -> None:
        """Count one batch: its logits, labels and mean loss."""
        n = int(labels.shape[0])
        self.loss_sum += float(loss) * n
        self.correct += int((logits.argmax(-1) == labels).sum())
        self.count += n

    def result(self) -> tuple[float, float, int]:
        """``(mean loss, accuracy, examples)``; NaNs when no example was counted."""
        if self.count == 0:
            return float("nan"), float("nan"), 0
        return self.loss_sum / self.count, self.correct / self.count, self.count


@torch.no_grad()
def evaluate_classifier(model: nn.Module, loader: DataLoader) -> tuple[float, float, int]:
    """Return ``(mean loss, accuracy, examples)`` over ``loader``."""
    model.eval()
    device = model_device(model)
    tally = EvaluationTally()
    for batch in loader:
        batch = batch_to(batch, device)
        logits, loss = logits_and_loss(model, batch)
        tally.add(logits, batch["labels"], loss)
    return tally.result()
