"""pFedKnow's method variants, server settings and labeled set (seed 002; the strategy: :mod:`strategies.pfedknow`).

:data:`MODES` maps each registered method name to what it uses: pFedKnow itself, its ablations
AS-1..AS-4 (Section 4.4, Table 3) and SemiFL; :func:`text_mode` is a mode's text version.
:class:`PFedKnowSettings` holds the numbers of the server's schedule, pseudo-label threshold,
distillation and initialization (:func:`settings_from` reads them from the run config);
:func:`labeled_set` is the server's labeled set ``D_s``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
from datasets import concatenate_datasets
from torch import Tensor

from experiment.method_settings import PFedKnowGroup, ServerTrainingGroup
from models.batches import Batch
from models.data import server_labeled_set, server_public_set, text_inputs
from models.images import image_tensors
from models.pruning import PRUNING, UNCERTAINTY
from models.transformer import load_tokenizer, resolve_source

if TYPE_CHECKING:
    from experiment.config import RunConfig


@dataclass(frozen=True)
class PFedKnowMode:
    """What a method variant uses.

    Attributes
    ----------
    prune : bool
        Clients prune progressively and upload sparse.
    teacher : bool
        The pretrained teacher is used (initialization KD and the ``KL(z_p || z_k)`` term).
    aggregation : {"collaborative", "fedavg", "zero-average"}
        Per-leader collaborative distillation (personalized), FedAvg + CE fine-tuning on
        ``D_s`` (one global model), or the zero-filled average restricted to each client's mask.
    uncertainty : {"evidential", "softmax"}
        The clients' pseudo-label filter.
    pruning : {"slimming", "magnitude"}
        How clients prune (when ``prune``): network slimming (CNNs) or unstructured magnitude
        pruning (transformers).

    """

    prune: bool = True
    teacher: bool = True
    aggregation: str = "collaborative"
    uncertainty: str = "evidential"
    pruning: str = "slimming"

    def __post_init__(self) -> None:
        if self.aggregation not in ("collaborative", "fedavg", "zero-average"):
            raise ValueError(f"unknown aggregation {self.aggregation!r}")
        if self.uncertainty not in UNCERTAINTY:
            raise ValueError(f"uncertainty must be one of {tuple(UNCERTAINTY)}, got {self.uncertainty!r}")
        if self.pruning not in PRUNING:
            raise ValueError(f"pruning must be one of {PRUNING}, got {self.pruning!r}")


MODES: dict[str, PFedKnowMode] = {
    "pfedknow": PFedKnowMode(),
    "pfedknow-as1": PFedKnowMode(prune=False, teacher=False, aggregation="fedavg"),
    "pfedknow-as2": PFedKnowMode(prune=True, teacher=False, aggregation="zero-average"),
    "pfedknow-as3": PFedKnowMode(teacher=False),
    "pfedknow-as4": PFedKnowMode(prune=False),
    "semifl": PFedKnowMode(prune=False, teacher=False, aggregation="fedavg", uncertainty="softmax"),
}


def text_mode(mode: PFedKnowMode) -> PFedKnowMode:
    """The text version of a mode: ``1 - max softmax`` uncertainty, magnitude pruning (seed 002, Section 3.2)."""
    return replace(mode, uncertainty="softmax", pruning="magnitude")


@dataclass(frozen=True)
class PFedKnowSettings:
    """The numeric settings of pFedKnow's server (run config keys in parentheses).

    Attributes
    ----------
    target_ratio, ramp_rounds : float, int
        Pruning ratio reached in round ``ramp_rounds`` (``pfedknow-prune-ratio``,
        ``pfedknow-prune-rounds``; :func:`models.pruning.progressive_ratio`): the share of
        channels (slimming) or of the prunable weights (magnitude) removed.
    delta : float
        Uncertainty threshold sent to clients (``pfedknow-delta``; SemiFL: ``1 - semifl-confidence``).
    l1 : float
        Network slimming's L1 weight on batch-norm scales (``pfedknow-l1``; unused by magnitude pruning).
    distill_steps, distill_lr, distill_batch_size, temperature
        Server collaborative distillation (and fine-tuning) Adam steps per leader, learning
        rate, labeled batch size, softmax temperature (``distill-*``).
    teacher_steps, init_steps : int
        Adam steps training the teacher and the initial ``w_s'`` on ``D_s``.
    init_lr : float
        Their Adam learning rate (``pfedknow-init-lr``).

    """

    target_ratio: float = 0.2
    ramp_rounds: int = 3
    delta: float = 0.7
    l1: float = 1e-4
    distill_steps: int = 20
    distill_lr: float = 1e-3
    distill_batch_size: int = 64
    temperature: float = 1.0
    teacher_steps: int = 300
    init_steps: int = 200
    init_lr: float = 1e-3

    def __post_init__(self) -> None:
        if not 0.0 <= self.target_ratio < 1.0:
            raise ValueError(f"target_ratio must be in [0, 1), got {self.target_ratio}")
        if self.ramp_rounds < 1:
            raise ValueError(f"ramp_rounds must be >= 1, got {self.ramp_rounds}")


def settings_from(cfg: RunConfig) -> PFedKnowSettings:
    """The strategy's settings from the run config.

    The pseudo-label threshold ``delta``: ``pfedknow-delta``, or ``1 - semifl-confidence`` for the
    SemiFL-style baseline, the one mode whose image filter is the max-softmax confidence
    (``uncertainty = "softmax"``) instead of pFedKnow's evidential uncertainty.
    """
    confidence_filter = MODES[cfg.entry.mode].uncertainty == "softmax"
    own, server = cfg.settings_of(PFedKnowGroup), cfg.settings_of(ServerTrainingGroup)
    return PFedKnowSettings(
        target_ratio=own.pfedknow_prune_ratio,
        ramp_rounds=own.pfedknow_prune_rounds,
        delta=1.0 - own.semifl_confidence if confidence_filter else own.pfedknow_delta,
        l1=own.pfedknow_l1,
        distill_steps=server.distill_steps,
        distill_lr=server.distill_lr,
        distill_batch_size=server.distill_batch_size,
        temperature=server.distill_temperature,
        teacher_steps=own.pfedknow_teacher_steps,
        init_steps=own.pfedknow_init_steps,
        init_lr=own.pfedknow_init_lr,
    )


def labeled_set(cfg: RunConfig, *, public: bool = False) -> tuple[Batch, Tensor]:
    """The server's labeled set ``D_s`` (``pfedknow-labeled-size`` examples); with ``public``, the teacher's.

    Carved out of the training split before the clients' partitions
    (:func:`models.data.server_labeled_set`): no client holds them and they are never test or
    validation examples.  ``public``: ``D_s`` followed by the ``pfedknow-teacher-public-size``
    examples only the teacher learns from (:func:`models.data.server_public_set`).  Images: a
    normalized tensor; text: keyword inputs tokenized like the clients' (truncated at ``max-seq-len``).
    """
    spec = cfg.data_spec()
    labeled = server_labeled_set(spec)
    if public:
        labeled = concatenate_datasets([labeled, server_public_set(spec)])
    if cfg.image_data:
        return image_tensors(labeled)
    tokenizer = load_tokenizer(resolve_source(cfg.model))
    x = text_inputs([str(t) for t in labeled["text"]], tokenizer, max_length=cfg.max_seq_len)
    return x, torch.as_tensor(labeled["label"], dtype=torch.long)
