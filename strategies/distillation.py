r"""Server-side training loops shared by the methods that train on the server.

Co-distillation (seed 003, Appendix C.4) distills the pools' models into each other on unlabeled
data (:func:`distill` with :func:`distillation_target` / :func:`distillation_loss`); pFedKnow
(seed 002, Algorithm 1) trains its teacher and initial model on the server's labeled set
``D_s`` (:func:`train_on_labeled`) and distills each client's personalized model from its
helpers' and the teacher's frozen logits (:func:`logits_on`, :func:`collaborative_distill` with
:func:`collaborative_loss`).  Both draw
their batches in seeded epochs (:func:`sample_batches`, :func:`index_batches`).

The math is pure functions tested on exact numbers (``tests/test_codist_math.py``); the loops
change no model they are given except where a docstring says "in place".
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import overload

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.batches import Batch, batch_size_of, model_logits, take_rows
from models.pruning import apply_masks
from models.training import batch_to, model_device

Params = dict[str, Tensor]


class DistillationConfigError(ValueError):
    """A distillation setting is out of range (a temperature, a regularization weight, a step count)."""


class DistillationError(RuntimeError):
    """Distillation could not run (e.g. the batches ran out before ``steps``)."""


# --- pure math ---------------------------------------------------------------------------------


def tempered_softmax(z: Tensor, temperature: float) -> Tensor:
    """``softmax(z / T)`` over the last axis."""
    if not temperature > 0.0:
        raise DistillationConfigError(f"temperature must be > 0, got {temperature}")
    return torch.softmax(z / temperature, dim=-1)


def distillation_target(
    z_teacher: Tensor | Sequence[Tensor], z_student_start: Tensor, temperature: float, lam: float
) -> Tensor:
    r"""Target distribution of one student (Appendix C.4).

    ``q = (1 - lam) * softmax(z_teacher / T) + lam * softmax(z_student_start / T)``; with several
    teachers, ``softmax(z_teacher / T)`` is replaced by the mean of their tempered softmaxes.
    ``lam = 0`` is the teacher's distribution, ``lam = 1`` the student's own at the start.

    Parameters
    ----------
    z_teacher : Tensor or Sequence[Tensor]
        Teacher logits ``(batch, classes)`` (one tensor per teacher).
    z_student_start : Tensor
        Logits of the student's start-of-distillation copy, ``(batch, classes)``.
    temperature : float
        ``T > 0``.
    lam : float
        Student regularization in ``[0, 1]``.

    """
    if not 0.0 <= lam <= 1.0:
        raise DistillationConfigError(f"lam must be in [0, 1], got {lam}")
    teachers = [z_teacher] if isinstance(z_teacher, Tensor) else list(z_teacher)
    if not teachers:
        raise DistillationConfigError("distillation needs at least one teacher")
    p_teacher = torch.stack([tempered_softmax(z, temperature) for z in teachers]).mean(dim=0)
    return (1.0 - lam) * p_teacher + lam * tempered_softmax(z_student_start, temperature)


def distillation_loss(z_student: Tensor, target: Tensor, temperature: float) -> Tensor:
    r"""``KL(target || softmax(z_student / T))``, averaged over the batch.

    ``L = (1 / B) sum_b sum_c q_bc (log q_bc - log softmax(z_b / T)_c)`` with ``0 log 0 = 0``.
    No ``T^2`` factor (the paper states none; Adam is invariant to a constant loss scale).
    """
    log_p = torch.log_softmax(z_student / temperature, dim=-1)
    return F.kl_div(log_p, target, reduction="batchmean")


def collaborative_loss(
    z_leader: Tensor,
    labels: Tensor,
    helper_logits: Sequence[Tensor],
    betas: Sequence[float],
    teacher_logits: Tensor | None,
    temperature: float = 1.0,
) -> tuple[Tensor, dict[str, float]]:
    r"""The collaborative distillation loss of pFedKnow's server (eq. 3.7) on one labeled batch.

    ``L = CE(z_k, y) + KL(softmax(sum_j beta_j z_j / T) || softmax(z_k / T))``
    ``+ KL(softmax(z_p / T) || softmax(z_k / T))``, KL averaged over the batch
    (:func:`distillation_loss`).  The helper term is omitted
    without helpers, the teacher term without ``teacher_logits``.

    Returns
    -------
    tuple[Tensor, dict[str, float]]
        The loss (differentiable in ``z_leader``) and its terms ``ce``, ``kl-helpers``,
        ``kl-teacher`` (0.0 when omitted).

    """
    if len(helper_logits) != len(betas):
        raise ValueError(f"{len(helper_logits)} helper logits but {len(betas)} weights")
    ce = F.cross_entropy(z_leader, labels)
    terms = {"ce": float(ce.detach()), "kl-helpers": 0.0, "kl-teacher": 0.0}
    loss = ce
    if helper_logits:
        z_avg = sum((b * z for b, z in zip(betas, helper_logits, strict=True)), torch.zeros_like(z_leader))
        kl_h = distillation_loss(z_leader, tempered_softmax(z_avg, temperature), temperature)
        terms["kl-helpers"] = float(kl_h.detach())
        loss = loss + kl_h
    if teacher_logits is not None:
        kl_p = distillation_loss(z_leader, tempered_softmax(teacher_logits, temperature), temperature)
        terms["kl-teacher"] = float(kl_p.detach())
        loss = loss + kl_p
    return loss, terms


# --- loops -------------------------------------------------------------------------------------


@dataclass
class Distilled:
    """Result of :func:`distill`: the student's new state and the loss of every step."""

    state: Params
    losses: list[float] = field(default_factory=list)


def distill(
    student: nn.Module,
    teacher: nn.Module | Sequence[nn.Module],
    batches: Iterable[Batch],
    *,
    steps: int,
    temperature: float,
    lam: float,
    lr: float,
    device: torch.device | str | None = None,
) -> Distilled:
    r"""Distill ``teacher`` into a copy of ``student`` for ``steps`` Adam steps.

    Per step, on the next batch ``x``: ``q`` = :func:`distillation_target` of the teachers'
    logits and the logits of a frozen copy of the student as given (``z_i^0``), then one Adam
    step (default betas, a fresh optimizer) on :func:`distillation_loss`.  ``student`` and the
    teachers are not modified (teachers run in eval mode, their mode is restored).

    Parameters
    ----------
    student : nn.Module
        Start of distillation, ``theta_i^t``.
    teacher : nn.Module or Sequence[nn.Module]
        The other pools' models.
    batches : Iterable[Tensor or Mapping[str, Tensor]]
        Unlabeled inputs (image tensors, or keyword inputs of a text model, see
        :func:`model_logits`); the first ``steps`` batches are used.
    steps : int
        Number of Adam steps ``s`` (0 returns the student's state unchanged).
    temperature, lam, lr : float
        ``T``, student regularization, Adam learning rate.
    device : torch.device or str, optional
        Where to compute (default: the student's device); the returned state is on the
        student's original device.

    Returns
    -------
    Distilled
        ``theta_i^student`` (every state-dict tensor, detached) and the per-step losses.

    Raises
    ------
    DistillationError
        When ``batches`` yields fewer than ``steps`` batches.

    """
    if steps < 0:
        raise DistillationConfigError(f"steps must be >= 0, got {steps}")
    home = model_device(student)
    dev = torch.device(device) if device is not None else home
    work = copy.deepcopy(student).to(dev).train()
    if steps == 0:
        return Distilled({k: v.detach().clone().to(home) for k, v in work.state_dict().items()})
    start = copy.deepcopy(student).to(dev).eval()
    teachers = [teacher] if isinstance(teacher, nn.Module) else list(teacher)
    modes = [t.training for t in teachers]
    for t in teachers:
        t.to(dev).eval()
    opt = torch.optim.Adam(work.parameters(), lr=lr)
    losses: list[float] = []
    it = iter(batches)
    try:
        for step in range(steps):
            try:
                x = next(it)
            except StopIteration:
                raise DistillationError(f"distillation batches ran out after {step} of {steps} steps") from None
            x = batch_to(x, dev)
            with torch.no_grad():
                target = distillation_target(
                    [model_logits(t, x) for t in teachers], model_logits(start, x), temperature, lam
                )
            loss = distillation_loss(model_logits(work, x), target, temperature)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    finally:
        for t, mode in zip(teachers, modes, strict=True):
            t.train(mode)
    return Distilled({k: v.detach().clone().to(home) for k, v in work.state_dict().items()}, losses)


@overload
def sample_batches(x: Tensor, *, steps: int, batch_size: int, seed: int) -> Iterator[Tensor]: ...
@overload
def sample_batches(x: Mapping[str, Tensor], *, steps: int, batch_size: int, seed: int) -> Iterator[Batch]: ...
def sample_batches(x: Batch, *, steps: int, batch_size: int, seed: int) -> Iterator[Batch]:
    """``steps`` batches of ``x`` in seeded epochs: a fresh random permutation per pass.

    A batch never spans two passes; ``batch_size`` larger than ``len(x)`` gives batches of
    the whole (shuffled) set.  ``x`` is an image tensor or a mapping of keyword inputs (rows
    padded to a common length); a text batch is trimmed to its longest row's
    ``attention_mask`` (padding beyond it changes no logit of a BERT-style model).
    """
    n = batch_size_of(x)
    if n == 0:
        raise DistillationError("the unlabeled distillation set is empty")
    gen = torch.Generator().manual_seed(seed)
    size = min(batch_size, n)
    done = 0
    while done < steps:
        perm = torch.randperm(n, generator=gen)
        for lo in range(0, n - size + 1, size):
            if done == steps:
                return
            yield take_rows(x, perm[lo : lo + size])
            done += 1


def index_batches(n: int, *, steps: int, batch_size: int, seed: int) -> list[Tensor]:
    """``steps`` index batches into ``n`` examples (seeded epochs, :func:`sample_batches`)."""
    out: list[Tensor] = [
        torch.as_tensor(b) for b in sample_batches(torch.arange(n), steps=steps, batch_size=batch_size, seed=seed)
    ]
    return out


def train_on_labeled(
    model: nn.Module,
    x: Batch,
    y: Tensor,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int,
    teacher: nn.Module | None = None,
    temperature: float = 1.0,
    masks: Mapping[str, Tensor] | None = None,
) -> list[float]:
    r"""Adam on ``CE(f(x; w), y)`` (``+ KL(p_teacher || p_w)`` with a teacher) over ``D_s``, in place.

    Initialization of the teacher (no teacher) and of ``w_s'`` (with the teacher), and the
    server fine-tuning of the FedAvg ablations.  With ``masks``, masked weights are zeroed
    after every step.  Returns the loss of every step.
    """
    if steps == 0:
        return []
    model.train()
    if teacher is not None:
        teacher.eval()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for idx in index_batches(batch_size_of(x), steps=steps, batch_size=batch_size, seed=seed):
        xb, yb = take_rows(x, idx), y[idx]
        z = model_logits(model, xb)
        loss = F.cross_entropy(z, yb)
        if teacher is not None:
            with torch.no_grad():
                target = tempered_softmax(model_logits(teacher, xb), temperature)
            loss = loss + distillation_loss(z, target, temperature)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if masks is not None:
            apply_masks(model, masks)
        losses.append(float(loss.detach()))
    return losses


@torch.no_grad()
def logits_on(model: nn.Module, batches: Sequence[Batch]) -> list[Tensor]:
    """Frozen logits of ``model`` (eval mode) on every batch."""
    model.eval()
    return [model_logits(model, xb) for xb in batches]


def collaborative_distill(
    leader: nn.Module,
    masks: Mapping[str, Tensor],
    batches: Sequence[tuple[Batch, Tensor]],
    helper_logits: Sequence[Sequence[Tensor]],
    betas: Sequence[float],
    teacher_logits: Sequence[Tensor] | None,
    *,
    lr: float,
    temperature: float,
) -> list[dict[str, float]]:
    """One Adam step of :func:`collaborative_loss` per labeled batch on ``leader`` (in place, mask kept).

    ``helper_logits[j][s]`` are helper ``j``'s logits on batch ``s``, ``teacher_logits[s]``
    the teacher's.  Returns every step's loss terms (``loss`` included).
    """
    leader.train()
    apply_masks(leader, masks)
    opt = torch.optim.Adam([p for p in leader.parameters() if p.requires_grad], lr=lr)
    out = []
    for s, (xb, yb) in enumerate(batches):
        loss, terms = collaborative_loss(
            model_logits(leader, xb),
            yb,
            [h[s] for h in helper_logits],
            betas,
            None if teacher_logits is None else teacher_logits[s],
            temperature,
        )
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        apply_masks(leader, masks)
        out.append({**terms, "loss": float(loss.detach())})
    return out
