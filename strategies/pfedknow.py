r"""pFedKnow: labels-at-server semi-supervised FL with pruned, personalized clients (seed 002).

Setting (Section 3): the server holds a small labeled set ``D_s`` and a large pretrained
model ``w_p``; clients (IoT devices) hold unlabeled data only.  Every client ``k`` has a
personalized lightweight model ``w_s^k``, kept here per client (keyed by the node's stable
key) and sent back on its next turn.

Initialization (Section 3.1): the teacher ``w_p`` is trained on ``D_s`` (and the
``pfedknow-teacher-public-size`` training examples only it sees, a stand-in for public
pretraining data) with cross entropy at the start of the run (once per run, kept in the
checkpoint, so a resumed run does not retrain it) -- for images a CNN ``pfedknow-teacher-scale``
times wider than the lightweight one, from a random initialization (no hub is reachable to ship a
pretrained VGG-19); for text the full-depth transformer (MiniLM-L6: all 6 layers) from the
pretrained weights the repo ships, so training fine-tunes a pretrained model (paper: a large BERT).  Then the
lightweight ``w_s'`` (images: the ``conv`` CNN; text: the bottom ``tier-layers`` pretrained layers, a
shallower student) is trained on ``D_s`` with ``CE(f(x; w_s'), y) + KL(p_p || p_s')``
(:func:`train_on_labeled`).  Both use Adam at ``pfedknow-init-lr``.

Round ``t`` (clients: :mod:`client.pfedknow`): client ``k`` receives ``w_s^k`` (first time
``w_s'``) as a sparse payload (:mod:`models.sparse`) with the round's pruning ratio, keeps the
pseudo-labels whose uncertainty is ``<= delta`` (images: evidential; text: ``1 - max softmax``),
prunes progressively (images: network slimming; text: unstructured magnitude pruning of the
transformer's weight matrices; :mod:`models.pruning`), fine-tunes, and uploads only the
surviving weights and the mask.  A transformer's frozen word embeddings are sent down (the
client's model needs them) but never up: uploads carry the trainable tensors only.

Server update (Section 3.3) for every upload ``k`` (the "leader", the others "helpers"):

.. math::

    \beta_j^k &= \cos(\theta_k, \theta_j) \,/\, \sum_{i \ne k} \cos(\theta_k, \theta_i) \\
    \mathcal{L}_s^k &= \mathrm{CE}(z_k, y) + \mathrm{KL}\big(\sigma(\textstyle\sum_j \beta_j^k z_j / T)
        \,\|\, \sigma(z_k / T)\big) + \mathrm{KL}\big(\sigma(z_p / T) \,\|\, \sigma(z_k / T)\big)

with ``theta`` the 0/1 masks of surviving weights, ``z`` logits on ``D_s`` batches (helpers and
teacher frozen, computed once per round: every leader is distilled from the uploads as they
came, "in parallel"), ``sigma`` the softmax.  ``w_s^k`` starts from the upload ``w_c^k`` and
keeps its mask (masked weights are re-zeroed after every Adam step).

Ablations (Section 4.4, Table 3), all :class:`~strategies.pfedknow_modes.PFedKnowMode` values of
:data:`strategies.pfedknow_modes.MODES`:

* ``pfedknow-as1`` (Semi-FedAvg): no pruning, no pretrained model; example-weighted FedAvg of
  the dense uploads, then CE fine-tuning on ``D_s``; one global model for everyone.
* ``pfedknow-as2``: pruning kept, no collaborative distillation and no pretrained model; the
  uploads (pruned weights filled with 0) are averaged; client ``k`` receives the average
  restricted to its own mask.
* ``pfedknow-as3``: no pretrained model (no teacher at initialization, no ``KL(z_p || z_k)``).
* ``pfedknow-as4``: no pruning (ratio 0, dense uploads).
* ``semifl``: SemiFL-style pseudo-label FedAvg: clients keep pseudo-labels with confidence
  ``max softmax >= semifl-confidence``; FedAvg then CE fine-tuning on ``D_s``.

Text (:func:`text_mode`): every mode keeps its aggregation and teacher use, with the
``softmax`` uncertainty and ``magnitude`` pruning.

Metric: every node evaluates the model it would receive (its personalized one) on its local
test split; ``fed-accuracy-mean`` is the unweighted mean over clients.  Communication: per
round and per client the bytes down and up (``bytes-up:<key>``, serialized ``ArrayRecord``
bytes as the base counts them); ``bytes-up-dense`` is what the dense lightweight model's
tensors would have taken (one array per tensor, as every dense method uploads) and
``upload-saving = 1 - up / dense``; ``payload-saving`` is the same without container overhead
(values and mask codes vs ``4 x`` parameters).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Mapping, Sequence, Set
from dataclasses import dataclass
from functools import partial
from logging import INFO
from typing import TYPE_CHECKING, Any, Unpack

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, MessageType, MetricRecord, RecordDict
from flwr.app.typing import ConfigRecordValues
from flwr.common import log
from torch import Tensor, nn

from experiment.config import ConfigError
from experiment.method_settings import PFedKnowGroup
from experiment.protocol import (
    ARRAYS,
    KEPT_WEIGHTS,
    METRICS,
    PRUNE_RATIO,
    PSEUDO_KEPT,
    TRAIN_LOSS,
    PruningInstruction,
    record_of,
    validate_echo,
)
from models.batches import Batch, batch_size_of, take_rows
from models.catalog import VariantCatalog
from models.family import CNNFamily, TransformerFamily
from models.pruning import kept_fraction, progressive_ratio
from models.sparse import SparsePayloadError, encode_payload, from_wire, payload_nbytes, to_wire
from models.transformer import build_model, full_config
from strategies.base import HeterogeneousStrategy, StrategyStateError
from strategies.distillation import collaborative_distill, index_batches, logits_on, train_on_labeled
from strategies.options import StrategyOptions
from strategies.pfedknow_modes import MODES, PFedKnowMode, PFedKnowSettings, labeled_set, settings_from, text_mode
from strategies.records import record_nbytes, to_record
from strategies.replies import Accepted, Evaluated, Sent
from strategies.round_sums import MedianNotSupported
from strategies.validation import ReplyRejected, validate_num_examples

if TYPE_CHECKING:
    from experiment.config import RunConfig
    from experiment.registry import MethodEntry

Params = dict[str, Tensor]
Masks = dict[str, Tensor]


# --- pure math ----------------------------------------------------------------------------------


def mask_vector(masks: Mapping[str, Tensor], names: Sequence[str]) -> Tensor:
    """The 0/1 vector ``theta`` of a model's masks: every tensor in ``names`` flattened, concatenated."""
    return torch.cat([masks[n].reshape(-1).to(torch.float64) for n in names])


def helper_weights(masks: Mapping[str, Mapping[str, Tensor]], leader: str) -> dict[str, float]:
    r"""Normalized mask-cosine weights of the helpers of ``leader`` (eq. 3.6).

    ``beta_j = cos(theta_k, theta_j) / sum_{i != k} cos(theta_k, theta_i)`` over every ``j != k``
    in ``masks`` (the leader itself is excluded).  Masks are 0/1, so every cosine is ``>= 0``;
    when all are 0 (disjoint masks) the helpers are weighted uniformly.  No helpers: ``{}``.

    Parameters
    ----------
    masks : Mapping[str, Mapping[str, Tensor]]
        Per client its masks (the same tensor names for every client).
    leader : str
        The client whose personalized model is being distilled.

    """
    if leader not in masks:
        raise KeyError(f"leader {leader!r} has no masks")
    names = sorted(masks[leader])
    theta_k = mask_vector(masks[leader], names)
    cos: dict[str, float] = {}
    for j, m in masks.items():
        if j == leader:
            continue
        theta_j = mask_vector(m, names)
        denom = float(theta_k.norm() * theta_j.norm())
        cos[j] = float(theta_k @ theta_j) / denom if denom > 0 else 0.0
    total = sum(cos.values())
    if not cos:
        return {}
    if total <= 0.0:
        return dict.fromkeys(cos, 1.0 / len(cos))
    return {j: c / total for j, c in cos.items()}


def weighted_average(models: Sequence[Mapping[str, Tensor]], weights: Sequence[float]) -> Params:
    r"""``sum_j n_j w_j / sum_j n_j`` per tensor (pruned weights count as 0: AS-2's zero filling)."""
    if not models or len(models) != len(weights):
        raise ValueError("need one weight per model and at least one model")
    total = float(sum(weights))
    if not total > 0:
        raise ValueError("weights must have a positive sum")
    return {
        k: sum((w * m[k] for m, w in zip(models, weights, strict=True)), torch.zeros_like(models[0][k])) / total
        for k in models[0]
    }


def personalization_split(accuracies: Mapping[str, float], personalized: Set[str]) -> dict[str, float]:
    r"""Mean accuracy of the clients evaluated on their own model and of those still on ``w_s'``.

    pFedKnow's federated metric averages every client's accuracy on its own test data, but a
    client no round has sampled yet is evaluated on the server's initial model ``w_s'`` (seed 002,
    Algorithm 1: ``w_s^k`` exists only after client ``k``'s first upload).  With partial
    participation the mean therefore mixes two populations; this splits it:
    ``fed-accuracy-personalized = mean_{k in P} acc_k`` and ``fed-accuracy-initial =
    mean_{k not in P} acc_k`` (each only when its set is non-empty), plus their sizes.

    Parameters
    ----------
    accuracies : Mapping[str, float]
        Per client (stable key) its accuracy this round.
    personalized : Set[str]
        Keys of the clients that hold a personalized model.

    Returns
    -------
    dict[str, float]
        ``fed-accuracy-personalized`` / ``fed-accuracy-initial`` (means) and
        ``clients-personalized`` / ``clients-initial`` (counts, as floats).

    """
    own = [a for k, a in accuracies.items() if k in personalized]
    initial = [a for k, a in accuracies.items() if k not in personalized]
    out = {"clients-personalized": float(len(own)), "clients-initial": float(len(initial))}
    if own:
        out["fed-accuracy-personalized"] = sum(own) / len(own)
    if initial:
        out["fed-accuracy-initial"] = sum(initial) / len(initial)
    return out


@dataclass
class Upload:
    """One validated client upload."""

    key: str
    node_id: int
    params: Params
    masks: Masks
    num_examples: int


class KeptUploads:
    """pFedKnow's round sums (:class:`~strategies.round_sums.RoundSums`): every accepted upload with its masks.

    Not rebuildable (each upload is checked finite on its own); no median (its options forbid it).
    """

    rebuildable = False

    def __init__(self, node_key: Callable[[int], str]) -> None:
        self.node_key = node_key
        self.uploads: list[Upload] = []

    def add(self, entry: Accepted, tensors: Mapping[str, Tensor]) -> None:
        """Keep the upload; a reply decoded without its masks is a programming error."""
        if entry.masks is None:
            raise StrategyStateError(f"node {entry.sent.node_id}'s upload was not decoded with its masks")
        key = self.node_key(entry.sent.node_id)
        self.uploads.append(Upload(key, entry.sent.node_id, dict(tensors), dict(entry.masks), entry.num_examples))

    def add_group(self, variant: str, tensors: Mapping[str, Tensor], num_examples: float, replies: int) -> None:  # noqa: D102
        raise MedianNotSupported("pFedKnow keeps every upload with its mask; it has no group median")

    def is_finite(self) -> bool:
        """True: every kept upload was checked finite on its own."""
        return True

    def result(self) -> list[Upload]:  # noqa: D102
        return self.uploads


# --- Flower glue --------------------------------------------------------------------------------


class PFedKnow(HeterogeneousStrategy[list[Upload]]):
    """pFedKnow and its ablations on Flower (one lightweight variant; see the module docstring).

    Parameters
    ----------
    catalog : VariantCatalog
        Exactly one variant: the lightweight model.
    mode : PFedKnowMode
        pFedKnow (``MODES["pfedknow"]``) or an ablation.
    build_model : Callable[[], nn.Module]
        A fresh lightweight model (state-dict keys = the variant's layout names).
    build_teacher : Callable[[], nn.Module]
        A fresh large model, trained on ``D_s`` at initialization (images: randomly initialized;
        text: the pretrained full-depth transformer, fine-tuned).
    labeled : tuple[Batch, Tensor]
        The server's labeled set ``D_s``: inputs (an image tensor ``(N, ...)`` or text keyword
        inputs, each ``(N, L)``) and labels ``(N,)``.
    teacher_labeled : tuple[Batch, Tensor] or None
        What the teacher is trained on, as ``labeled``: ``D_s`` (``None``) or ``D_s`` with the public set.
    settings : PFedKnowSettings
        Pruning schedule, uncertainty threshold, distillation and initialization settings.
    seed : int
        Seed of sampling and of the server's labeled batches.
    **options
        :class:`~strategies.base.StrategyOptions`, passed to :class:`~strategies.base.HeterogeneousStrategy`.

    """

    supports_median = False

    def __init__(
        self,
        *,
        catalog: VariantCatalog,
        mode: PFedKnowMode,
        build_model: Callable[[], nn.Module],
        build_teacher: Callable[[], nn.Module],
        labeled: tuple[Batch, Tensor],
        teacher_labeled: tuple[Batch, Tensor] | None = None,
        settings: PFedKnowSettings | None = None,
        **options: Unpack[StrategyOptions],
    ) -> None:
        if len(catalog) != 1:
            raise ValueError(f"pFedKnow trains one lightweight model, the catalog has {catalog.names()}")
        st = settings if settings is not None else PFedKnowSettings()
        x, y = labeled
        n = batch_size_of(x)
        if n == 0 or n != y.shape[0]:
            raise ValueError(f"labeled set needs matching, non-empty inputs and labels, got {n}/{y.shape[0]}")
        super().__init__(catalog=catalog, **options)
        if self.clip_bounds:
            raise ValueError(
                "pFedKnow's uploads are sparse with per-client masks: clipping their update would revive pruned "
                "weights; leave clip-update-norm at 0"
            )
        seed = options.get("seed", 0)
        self.variant = catalog.largest.name
        self.mode = mode
        self.build_model = build_model
        self.build_teacher = build_teacher
        self.labeled_x, self.labeled_y = x, y
        self.teacher_x, self.teacher_y = teacher_labeled if teacher_labeled is not None else labeled
        self.target_ratio = st.target_ratio if mode.prune else 0.0
        self.ramp_rounds = st.ramp_rounds
        self.delta = st.delta
        self.l1 = st.l1 if mode.prune and mode.pruning == "slimming" else 0.0
        self.distill_steps = st.distill_steps
        self.distill_lr = st.distill_lr
        self.distill_batch_size = st.distill_batch_size
        self.temperature = st.temperature
        self.teacher_steps = st.teacher_steps
        self.init_steps = st.init_steps
        self.init_lr = st.init_lr
        self.seed = seed
        #: every tensor a client receives (frozen ones included) and the trainable ones it uploads
        self.shapes = {p.name: tuple(p.shape) for p in catalog.largest.layout}
        self.upload_shapes = {p.name: tuple(p.shape) for p in catalog.largest.layout if p.trainable}
        self.initialized = False
        self.teacher_state: Params | None = None
        self.personal: dict[str, Params] = {}
        self.masks: dict[str, Masks] = {}

    # ---------------------------------------------------------------- models
    def _model(self, params: Mapping[str, Tensor]) -> nn.Module:
        model = self.build_model()
        model.load_state_dict(dict(params), strict=False)
        return model

    def teacher(self) -> nn.Module | None:
        """The trained teacher (``None`` without one)."""
        if not self.mode.teacher or self.teacher_state is None:
            return None
        model = self.build_teacher()
        model.load_state_dict(self.teacher_state)
        return model.eval()

    def initialize(self, server_round: int) -> None:
        """Train the teacher on ``D_s`` (with a teacher), then ``w_s'`` with CE (+ KD); report both."""
        group = self.report(server_round).group(self.variant)
        t0 = time.perf_counter()
        teacher = None
        if self.mode.teacher:
            teacher = self.build_teacher()
            losses = train_on_labeled(
                teacher,
                self.teacher_x,
                self.teacher_y,
                steps=self.teacher_steps,
                lr=self.init_lr,
                batch_size=self.distill_batch_size,
                seed=self.seed + 17,
            )
            self.teacher_state = {k: v.detach().clone() for k, v in teacher.state_dict().items()}
            if losses:
                group["teacher-loss"] = losses[-1]
        student = self._model(self.state[self.variant])
        losses = train_on_labeled(
            student,
            self.labeled_x,
            self.labeled_y,
            steps=self.init_steps,
            lr=self.init_lr,
            batch_size=self.distill_batch_size,
            seed=self.seed + 29,
            teacher=teacher,
            temperature=self.temperature,
        )
        if losses:
            group["init-loss"] = losses[-1]
        group["init-seconds"] = time.perf_counter() - t0
        trained = {k: v.detach().clone() for k, v in student.state_dict().items()}
        self.state = {self.variant: {k: trained[k] for k in self.state[self.variant]}}
        self.initialized = True
        log(
            INFO,
            "pFedKnow: initialized w_s' on %d labeled examples (teacher: %s)",
            self.labeled_y.shape[0],
            bool(teacher),
        )

    # ------------------------------------------------------- per-client state
    def node_key(self, node_id: int) -> str:
        """The node's stable key (per-client state survives restarts under it)."""
        prof = self.profiles.get(node_id)
        return prof.stable_key if prof is not None else f"node-{node_id}"

    def full_masks(self) -> Masks:
        """Every weight kept (every tensor a client receives)."""
        return {n: torch.ones(s, dtype=torch.bool) for n, s in self.shapes.items()}

    def client_masks(self, key: str) -> Masks:
        """The client's current masks (all ones before its first upload or without pruning)."""
        return self.masks.get(key) or self.full_masks()

    def client_model(self, key: str) -> Params:
        """The model client ``key`` receives (its personalized ``w_s^k``)."""
        glob = self.state[self.variant]
        if self.mode.aggregation == "collaborative":
            return self.personal.get(key, glob)
        if self.mode.aggregation == "zero-average" and key in self.masks:
            m = self.masks[key]
            return {n: t * m[n].to(t.dtype) if n in m else t for n, t in glob.items()}
        return glob

    def variant_payload(self, node_id: int, variant: str) -> dict[str, Tensor]:
        """The node's personalized model (dense; training messages re-encode it sparse)."""
        return self.client_model(self.node_key(node_id))

    def with_frozen(self, uploaded: Mapping[str, Tensor]) -> Params:
        """A client's upload completed with the tensors clients never upload (frozen, from the global model)."""
        return {**self.state[self.variant], **uploaded}

    def prune_ratio(self, server_round: int) -> float:
        """This round's pruning ratio (0 without pruning)."""
        if self.target_ratio == 0.0:
            return 0.0
        return progressive_ratio(server_round, self.target_ratio, self.ramp_rounds)

    # ------------------------------------------------------------------ train
    def prepare_round(self, server_round: int) -> None:
        """Before round 1: train the teacher and ``w_s'`` on ``D_s``; every round: report its pruning ratio."""
        if not self.initialized:
            self.initialize(server_round)
            self._compose_state()
        self.report(server_round).group(self.variant)[PRUNE_RATIO] = self.prune_ratio(server_round)

    def pruning_instruction(self, server_round: int) -> PruningInstruction:
        """What a training message tells the client: ratio, threshold, uncertainty, pruning, L1."""
        return PruningInstruction(
            self.prune_ratio(server_round), self.delta, self.mode.uncertainty, self.mode.pruning, self.l1
        )

    def encode_payload(
        self, node_id: int, variant: str, kind: str, server_round: int
    ) -> tuple[ArrayRecord, dict[str, ConfigRecordValues]]:
        """A training message carries the client's model sparse (values and mask) and the pruning instruction."""
        if kind != MessageType.TRAIN:
            return super().encode_payload(node_id, variant, kind, server_round)
        payload = to_wire(self.variant_payload(node_id, variant), self.client_masks(self.node_key(node_id)))
        record = ArrayRecord({k: Array(v) for k, v in payload.items()})
        return record, self.pruning_instruction(server_round).to_config()

    def summarize_messages(self, server_round: int, kind: str, sent: Mapping[str, Sent]) -> None:
        """Per client the bytes of its training message (``bytes-down:<key>``)."""
        if kind == MessageType.TRAIN:
            group = self.report(server_round).group(self.variant)
            for rec in sent.values():
                group[f"bytes-down:{self.node_key(rec.node_id)}"] = float(rec.nbytes)

    def decode_reply(self, sent: Sent, content: RecordDict, server_round: int, *, check_finite: bool) -> Accepted:
        """A sparse upload: the surviving trainable weights and their masks, which revive no pruned weight.

        The sparse decoder checks every value's finiteness itself (:func:`models.sparse.from_wire`).
        """
        validate_echo(content, variant=sent.variant, server_round=server_round)
        metrics = record_of(content, METRICS, MetricRecord, error=ReplyRejected)
        n = validate_num_examples(metrics, max_examples=self.max_examples)
        self.check_examples_claim(sent, n)
        arrays = record_of(content, ARRAYS, ArrayRecord, error=ReplyRejected)
        try:
            payload = {k: np.asarray(a.numpy()) for k, a in arrays.items()}
        except Exception as exc:  # corrupt bytes
            raise ReplyRejected(f"payload does not decode ({exc})") from exc
        try:
            params, masks = from_wire(payload, self.upload_shapes)
        except SparsePayloadError as exc:
            raise ReplyRejected(f"sparse payload: {exc}") from exc
        sent_masks = self.client_masks(self.node_key(sent.node_id))
        revived = [k for k, m in masks.items() if bool((m & ~sent_masks[k]).any())]
        if revived:
            raise ReplyRejected(f"mask revives weights pruned before in {revived[:3]}")
        return Accepted(sent, params, n, metrics, record_nbytes(arrays), masks=masks)

    def new_round_sums(self) -> KeptUploads:
        """The round's uploads, each kept with its mask (the server step needs every one, :meth:`apply_round`)."""
        return KeptUploads(self.node_key)

    def apply_round(self, server_round: int, uploads: list[Upload], counts: Mapping[str, int]) -> None:
        """Report what the uploads would have cost dense, then distill every leader (or average, for the ablations)."""
        group = self.report(server_round).group(self.variant)
        for up in uploads:
            group["bytes-up-dense"] = group.get("bytes-up-dense", 0.0) + record_nbytes(to_record(up.params))
            group["payload-bytes-up"] = group.get("payload-bytes-up", 0.0) + payload_nbytes(
                encode_payload(up.params, up.masks)
            )
            group["payload-bytes-up-dense"] = group.get("payload-bytes-up-dense", 0.0) + 4 * sum(
                t.numel() for t in up.params.values()
            )
        if group.get("bytes-up-dense", 0.0) > 0:
            group["upload-saving"] = 1.0 - group["bytes-up"] / group["bytes-up-dense"]
            group["payload-saving"] = 1.0 - group["payload-bytes-up"] / group["payload-bytes-up-dense"]
        t0 = time.perf_counter()
        if uploads:
            self.server_update(server_round, uploads)
        group["server-seconds"] = time.perf_counter() - t0

    def summarize_replies(self, server_round: int, accepted: Sequence[Accepted]) -> MetricRecord:
        """Per client its bytes up; unweighted means over clients of kept weights, pseudo-labels, loss."""
        group = self.report(server_round).group(self.variant)
        client_stats: dict[str, list[float]] = {}
        for entry in accepted:
            group[f"bytes-up:{self.node_key(entry.sent.node_id)}"] = float(entry.nbytes)
            if entry.masks is not None:
                client_stats.setdefault(KEPT_WEIGHTS, []).append(kept_fraction(entry.masks))
            for k in (PSEUDO_KEPT, TRAIN_LOSS):
                v = entry.metrics.get(k)
                if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                    client_stats.setdefault(k, []).append(float(v))
        for k, vals in client_stats.items():
            group[k] = sum(vals) / len(vals)
        out = MetricRecord()
        for k in ("upload-saving", KEPT_WEIGHTS, PSEUDO_KEPT):
            if k in group:
                out[f"{self.variant}/{k}"] = group[k]
        log(
            INFO,
            "pFedKnow round %d: %d uploads, upload saving %.3f",
            server_round,
            len(accepted),
            group.get("upload-saving", float("nan")),
        )
        return out

    def labeled_batches(self, server_round: int) -> list[tuple[Batch, Tensor]]:
        """This round's ``D_s`` batches (seeded by the round; the same for every leader)."""
        idx = index_batches(
            self.labeled_y.shape[0],
            steps=self.distill_steps,
            batch_size=self.distill_batch_size,
            seed=self.seed * 1_000_003 + server_round,
        )
        return [(take_rows(self.labeled_x, i), self.labeled_y[i]) for i in idx]

    def server_update(self, server_round: int, uploads: Sequence[Upload]) -> None:
        """The method's server step over this round's validated uploads."""
        group = self.report(server_round).group(self.variant)
        if self.mode.aggregation == "collaborative":
            batches = self.labeled_batches(server_round)
            xs = [xb for xb, _ in batches]
            logits = {u.key: logits_on(self._model(self.with_frozen(u.params)), xs) for u in uploads}
            teacher = self.teacher()
            teacher_logits = logits_on(teacher, xs) if teacher is not None else None
            all_masks = {u.key: u.masks for u in uploads}
            last: list[dict[str, float]] = []
            for u in uploads:
                betas = helper_weights(all_masks, u.key)
                leader = self._model(self.with_frozen(u.params))
                steps = collaborative_distill(
                    leader,
                    u.masks,
                    batches,
                    [logits[j] for j in betas],
                    list(betas.values()),
                    teacher_logits,
                    lr=self.distill_lr,
                    temperature=self.temperature,
                )
                state = leader.state_dict()
                self.personal[u.key] = {k: state[k].detach().clone() for k in self.state[self.variant]}
                self.masks[u.key] = u.masks
                if steps:
                    last.append(steps[-1])
            for term in ("loss", "ce", "kl-helpers", "kl-teacher"):
                if last:
                    group[f"distill-{term}"] = sum(s[term] for s in last) / len(last)
            return
        weights = [float(u.num_examples) for u in uploads]
        avg = weighted_average([u.params for u in uploads], weights)
        glob = {**self.state[self.variant], **avg}
        if self.mode.aggregation == "fedavg":
            model = self._model(glob)
            losses = train_on_labeled(
                model,
                self.labeled_x,
                self.labeled_y,
                steps=self.distill_steps,
                lr=self.distill_lr,
                batch_size=self.distill_batch_size,
                seed=self.seed * 1_000_003 + server_round,
            )
            if losses:
                group["finetune-loss"] = losses[-1]
            state = model.state_dict()
            glob = {k: state[k].detach().clone() for k in glob}
        else:  # zero-average: every uploader keeps its own mask
            for u in uploads:
                self.masks[u.key] = u.masks
        self.state = {self.variant: glob}

    # --------------------------------------------------------------- evaluate
    def summarize_evaluation(self, server_round: int, results: Sequence[Evaluated], out: MetricRecord) -> None:
        """Per client its accuracy, ``fed-accuracy-mean`` over clients (unweighted), split by personalization."""
        group = self.report(server_round).group(self.variant)
        by_key: dict[str, float] = {}
        for e in results:
            key = self.node_key(e.sent.node_id)
            by_key[key] = e.accuracy
            group[f"fed-accuracy:{key}"] = e.accuracy
        if results:
            group["fed-accuracy-mean"] = sum(e.accuracy for e in results) / len(results)
            out[f"{self.variant}/fed-accuracy-mean"] = group["fed-accuracy-mean"]
        if self.mode.aggregation != "fedavg":
            for name, value in personalization_split(by_key, self.personalized_keys()).items():
                group[name] = value

    def personalized_keys(self) -> set[str]:
        """Clients whose evaluated model is their own (they uploaded at least once), not ``w_s'``."""
        if self.mode.aggregation == "collaborative":
            return set(self.personal)
        if self.mode.aggregation == "zero-average":
            return set(self.masks)
        return set()

    def models_for_evaluation(self) -> dict[str, list[Mapping[str, Tensor]]]:
        """Every client's personalized model (the global one before any client trained)."""
        keys = sorted(set(self.personal) | set(self.masks))
        models: list[Mapping[str, Tensor]] = (
            [self.client_model(k) for k in keys] if self.mode.aggregation != "fedavg" else []
        )
        return {self.variant: models or [self.state[self.variant]]}

    # ------------------------------------------------------------ checkpoints
    def method_state(self) -> dict[str, Any]:
        """Initialization flag, the teacher, and per client (stable key) its model and masks."""
        return {
            "initialized": self.initialized,
            "teacher": dict(self.teacher_state) if self.teacher_state is not None else {},
            "personal": {k: dict(p) for k, p in self.personal.items()},
            "masks": {k: dict(m) for k, m in self.masks.items()},
        }

    def load_method_state(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`method_state` (tensor names must match the lightweight layout)."""
        personal, masks = data.get("personal", {}), data.get("masks", {})
        for what, table, shapes in (("personal models", personal, self.shapes), ("masks", masks, self.upload_shapes)):
            for key, params in table.items():
                if set(params) != set(shapes) and not set(shapes) <= set(params):
                    raise ValueError(f"checkpoint's {what} of {key!r} do not match the lightweight layout")
        self.initialized = bool(data.get("initialized", False))
        teacher = data.get("teacher") or None
        self.teacher_state = {k: v.clone() for k, v in teacher.items()} if teacher else None
        self.personal = {str(k): dict(p) for k, p in personal.items()}
        self.masks = {str(k): {n: m.bool() for n, m in ms.items()} for k, ms in masks.items()}

    def summary(self) -> None:
        """Log the mode, then the base summary."""
        log(INFO, "\t├──> pFedKnow %s, target ratio %.2f over %d rounds, delta %.3g, |D_s| = %d, teacher's set %d",
            self.mode, self.target_ratio, self.ramp_rounds, self.delta, self.labeled_y.shape[0],
            self.teacher_y.shape[0])  # fmt: skip
        super().summary()


def build(cfg: RunConfig, entry: MethodEntry, options: Mapping[str, Any]) -> PFedKnow:
    """The pFedKnow strategy or an ablation (``entry.mode``) from the run config (a registry factory).

    Images: the lightweight ``conv`` CNN under a ``pfedknow-teacher-scale`` wider teacher
    (random initialization).  Text: a ``tier-layers``-deep student under the full-depth
    transformer with its pretrained weights (:func:`models.transformer.build_model`), the mode's
    text version (:func:`strategies.pfedknow_modes.text_mode`).

    Raises
    ------
    ConfigError
        When ``model`` names a family pFedKnow has no teacher for.

    """
    family = cfg.family()
    mode = MODES[entry.mode]
    build_teacher: Callable[[], nn.Module]
    if isinstance(family, CNNFamily):
        scale = cfg.settings_of(PFedKnowGroup).pfedknow_teacher_scale
        teacher = dataclasses.replace(family, base=tuple(max(1, round(w * scale)) for w in family.base))
        build_teacher = partial(teacher.at_rate, 1.0)
    elif isinstance(family, TransformerFamily):
        spec = family.spec
        depth = full_config(spec.source, spec.num_labels).num_hidden_layers
        build_teacher = partial(build_model, spec, depth, pretrained=True)
        mode = text_mode(mode)
    else:
        raise ConfigError(f"run config 'model': pFedKnow has no teacher for {cfg.model!r}")
    return PFedKnow(
        mode=mode,
        build_model=partial(family.build, cfg.catalog.largest),
        build_teacher=build_teacher,
        labeled=labeled_set(cfg),
        teacher_labeled=labeled_set(cfg, public=True) if cfg.data_spec().server_public_size else None,
        settings=settings_from(cfg),
        **options,
    )
