r"""Multi-exit models' training math for DepthFL: mutual self-distillation among a model's exits.

Kim, Kim and Hwang, "DepthFL: Depthwise Federated Learning for Heterogeneous Clients", ICLR 2023
(Section 3.2), in the form of Flower's ``depthfl`` baseline.  A depth-``k`` model has an exit
(classifier) after each of its ``k`` blocks, with logits ``z_1 .. z_k``.  Its local loss is

.. math::

    L = \sum_{i=1}^{k} \Big[ \mathrm{CE}(z_i, y)
        + \frac{w}{k - 1} \sum_{j \ne i} T^2\,
          \mathrm{KL}\big(\mathrm{softmax}(\bar z_j / T) \,\|\, \mathrm{softmax}(z_i / T)\big) \Big]

where ``\bar z_j`` is ``z_j`` detached (each exit learns from the others, none is pulled towards
a student), ``T`` the temperature and ``w`` the distillation weight (the server's ramp,
:func:`strategies.depthfl.kd_weight`).  A depth-1 model has no other exit: ``L = CE(z_1, y)``.
The KL is averaged over the batch (``reduction = "batchmean"``, the baseline's ``sum(1).sum() /
batch``); the baseline adds ``1e-7`` to the teacher's probabilities before its logarithm, this
module takes the log-softmax instead (the same value up to that epsilon, without its bias).

Prediction is the ensemble of the exits: the mean of their logits (:func:`ensemble_logits`, the
baseline's ``test``).  A DepthFL client's reported ``train-loss`` is ``L`` above: a sum over its
exits, so it grows with depth and is not a cross-entropy comparable with other methods'.

Models
------
:class:`ExitConvNet` is HeteroFL's conv net (:class:`models.cnn.ConvNet`) at full width cut to its
first ``k`` blocks, with exit ``i`` (global average pool, then one linear layer) after block ``i``;
its tensors keep the conv net's names (``blocks.<i>.*``) beside ``exits.<i>.*``, so a depth-``k``
model's state is a prefix of the depth-``L`` one (:func:`exit_conv_catalog`).  Its ``forward``
returns the ensemble's logits, so evaluation and HeteroFL's sBN statistics work unchanged;
:meth:`ExitConvNet.exit_logits` returns every exit's.

:class:`ExitPreResNet` is HeteroFL's pre-activation ResNet-18 (:class:`models.cnn.PreResNet`) at
full width cut to its first ``k`` stages, with exit ``s`` after stage ``s``: the full model's head
form, ``z_s = W_s mean_hw(relu(BN_s(h_s))) + b_s`` (DepthFL's ResNet has a classifier after each
stage); at the deepest stage it is the full model's head.  Tensors keep the ResNet's names
(``stem.weight``, ``stages.<s>.<b>.*``) beside ``exits.<s>.{norm,linear}.*``.

:class:`ExitBert` is the BERT encoder of :mod:`models.transformer` cut to ``k`` layers, with exit
``l`` (the spec's pooling of layer ``l``'s token states, a pooler ``tanh(W_p . + b_p)``, dropout and
a classifier) after layer ``l``.  Encoder tensors keep the classifier's names
(``bert.embeddings.*``, ``bert.encoder.layer.<i>.*``), exits are ``exits.<i>.{pooler.dense,
classifier}.*``; :func:`exit_bert_initial_state` starts every exit's pooler from the checkpoint's
pooler and seeds the classifiers (:func:`exit_bert_catalog` for the depth variants).

:class:`ExitFamily` puts either behind :class:`models.family.ModelFamily`: the multi-exit depth
variants of a conv net or a transformer, with the wrapped family's data and evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from datasets import Dataset
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import BertConfig, BertModel

from models import transformer
from models.catalog import Layout, Role, Variant, VariantCatalog, meta_layout
from models.cnn import CONV, PRERESNET18, PRERESNET18_BLOCKS, ConvBlock, PreActBlock, estimate_memory, static_bn
from models.exit_heads import ExitHeadKind, conv_exit
from models.family import CNNFamily, TransformerFamily
from models.training import EvaluationTally, batch_to, model_device
from models.transformer import TransformerSpec, build_model, layer_of, masked_mean, variant_config


class ExitsError(ValueError):
    """A multi-exit model's outputs or settings are unusable (no exits, mismatched shapes, bad weights)."""


def ensemble_logits(logits: Sequence[Tensor]) -> Tensor:
    """The mean of the exits' logits, ``(1/k) sum_i z_i`` (the model's prediction).

    Raises
    ------
    ExitsError
        When ``logits`` is empty or the exits' shapes differ.

    """
    check_exits(logits)
    return torch.stack(list(logits)).mean(dim=0)


def check_exits(logits: Sequence[Tensor]) -> None:
    """Raise :class:`ExitsError` when there is no exit or the exits' logits differ in shape."""
    if not logits:
        raise ExitsError("a multi-exit model needs at least one exit")
    shapes = {tuple(z.shape) for z in logits}
    if len(shapes) != 1:
        raise ExitsError(f"every exit must give logits of one shape, got {sorted(shapes)}")


def mutual_distillation(logits: Sequence[Tensor], *, temperature: float = 1.0) -> Tensor:
    r"""``sum_i 1/(k-1) sum_{j != i} T^2 KL(softmax(z_j/T) || softmax(z_i/T))``, teachers detached.

    0 for a single exit.  Gradients reach each ``z_i`` only through its own KL terms as student.
    """
    if temperature <= 0:
        raise ExitsError(f"temperature must be > 0, got {temperature}")
    k = len(logits)
    if k < 2:
        return logits[0].new_zeros(()) if logits else torch.zeros(())
    students = [F.log_softmax(z / temperature, dim=-1) for z in logits]
    teachers = [s.detach() for s in students]
    total = logits[0].new_zeros(())
    for i, student in enumerate(students):
        for j, teacher in enumerate(teachers):
            if j != i:
                kl = F.kl_div(student, teacher, log_target=True, reduction="batchmean")
                total = total + kl * temperature**2 / (k - 1)
    return total


def self_distillation_loss(
    logits: Sequence[Tensor], labels: Tensor, *, weight: float, temperature: float = 1.0
) -> Tensor:
    r"""DepthFL's local loss ``sum_i CE(z_i, y) + w * mutual_distillation(z)`` (module docstring).

    Parameters
    ----------
    logits : sequence of Tensor
        ``z_1 .. z_k``, each ``(batch, classes)``, shallowest exit first.
    labels : Tensor
        ``(batch,)`` class indices.
    weight : float
        ``w >= 0``, the distillation weight of this round (0: the exits train independently,
        DepthFL without self-distillation).
    temperature : float
        ``T > 0``.

    Raises
    ------
    ExitsError
        No exits, exits of different shapes, ``w < 0`` or ``T <= 0``.

    """
    check_exits(logits)
    if weight < 0:
        raise ExitsError(f"the distillation weight must be >= 0, got {weight}")
    loss = sum((F.cross_entropy(z, labels) for z in logits), start=logits[0].new_zeros(()))
    if weight > 0:
        loss = loss + weight * mutual_distillation(logits, temperature=temperature)
    return loss


def exits_logits_and_loss(
    model: nn.Module, batch: dict[str, Tensor], *, weight: float, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """``(ensemble logits, self_distillation_loss)`` of one batch: the local loss of a multi-exit model.

    Raises
    ------
    ExitsError
        When ``model`` has no exits (no ``exit_logits``).

    """
    if not isinstance(model, EXIT_MODELS):
        raise ExitsError(f"self-distillation among exits needs a multi-exit model, got {type(model).__name__}")
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    exits = model.exit_logits(**inputs)
    loss = self_distillation_loss(exits, batch["labels"], weight=weight, temperature=temperature)
    return ensemble_logits(exits), loss


@dataclass(frozen=True)
class ExitsEvaluation:
    """A multi-exit model over a test set: the ensemble's loss and accuracy, and each exit's accuracy alone."""

    loss: float
    accuracy: float
    examples: int
    exit_accuracies: tuple[float, ...]

    def metrics(self) -> dict[str, float]:
        """``loss``, ``accuracy`` (the ensemble: the model's prediction) and ``exit-<i>-accuracy``, ``i`` from 1."""
        out = {"loss": self.loss, "accuracy": self.accuracy}
        out.update({f"exit-{i}-accuracy": a for i, a in enumerate(self.exit_accuracies, start=1)})
        return out


@torch.no_grad()
def evaluate_exits(model: ExitModel, loader: DataLoader) -> ExitsEvaluation:
    """One pass over ``loader``: the ensemble's mean cross-entropy and accuracy, and every exit's accuracy.

    The ensemble is the model's own prediction (:func:`ensemble_logits`), so ``loss`` and
    ``accuracy`` equal :func:`models.training.evaluate_classifier`'s; exit ``i``'s accuracy is
    that of ``argmax z_i`` alone (DepthFL, Kim et al. 2023, Table 2 reports each classifier and
    the ensemble).
    """
    model.eval()
    device = model_device(model)
    tally = EvaluationTally()
    exit_correct = [0] * len(model.exits)
    for batch in loader:
        batch = batch_to(batch, device)
        labels = batch["labels"]
        exits = model.exit_logits(**{k: v for k, v in batch.items() if k != "labels"})
        logits = ensemble_logits(exits)
        tally.add(logits, labels, F.cross_entropy(logits, labels))
        for i, z in enumerate(exits):
            exit_correct[i] += int((z.argmax(-1) == labels).sum())
    loss, accuracy, count = tally.result()
    if count == 0:
        return ExitsEvaluation(loss, accuracy, 0, tuple(float("nan") for _ in exit_correct))
    return ExitsEvaluation(loss, accuracy, count, tuple(c / count for c in exit_correct))


class ExitConvNet(nn.Module):
    """The first ``depth`` blocks of HeteroFL's conv net at full width, with an exit after each.

    Block ``i`` is :class:`models.cnn.ConvBlock` from ``c_{i-1}`` to ``c_i = base[i]`` channels
    with a 2x2 max-pool unless it is the *full* model's last block (so every depth has the full
    model's shapes); exit ``i`` is ``z_i = W_i mean_hw(h_i) + b_i`` on block ``i``'s output.

    State-dict names: ``blocks.<i>.conv.{weight,bias}``, ``blocks.<i>.norm.{weight,bias}``
    (as :class:`~models.cnn.ConvNet`) and ``exits.<i>.{weight,bias}``.  With ``exit_head =
    "bottleneck"`` exit ``i`` reads block ``i`` through bottleneck layers first
    (:mod:`models.exit_heads`, DepthFL's shallow classifiers; names ``exits.<i>.steps.*``,
    ``exits.<i>.linear.*``).
    """

    def __init__(
        self,
        depth: int,
        *,
        in_channels: int,
        num_classes: int,
        base: Sequence[int],
        exit_head: ExitHeadKind = "linear",
    ) -> None:
        super().__init__()
        self.base = tuple(int(d) for d in base)
        if not 1 <= depth <= len(self.base):
            raise ExitsError(f"depth must be in 1 .. {len(self.base)} (the conv net's blocks), got {depth}")
        self.depth = depth
        ins = (in_channels, *self.base[:-1])
        last = len(self.base) - 1
        self.blocks = nn.ModuleList(ConvBlock(ins[i], self.base[i], 1.0, pool=i < last) for i in range(depth))
        self.exits = nn.ModuleList(
            conv_exit(exit_head, i, base=self.base, num_classes=num_classes) for i in range(depth)
        )

    def exit_logits(self, x: Tensor) -> list[Tensor]:
        """``[z_1, .., z_depth]``, each ``(batch, num_classes)``, shallowest first."""
        out = []
        for block, head in zip(self.blocks, self.exits, strict=True):
            x = block(x)
            out.append(head(x))
        return out

    def forward(self, x: Tensor) -> Tensor:
        """The ensemble's logits (:func:`ensemble_logits` of :meth:`exit_logits`)."""
        return ensemble_logits(self.exit_logits(x))


def exit_conv_place(name: str) -> tuple[int | None, Role]:
    """``(layer, role)`` of an :class:`ExitConvNet` tensor: block ``i`` shared, exit ``i`` a head, both layer ``i``."""
    part, index, *_ = name.split(".")
    if part not in ("blocks", "exits") or not index.isdigit():
        raise ExitsError(f"{name!r} is not a tensor of a multi-exit conv net")
    return int(index), "shared" if part == "blocks" else "head"


def exit_cnn(
    model_name: str,
    depth: int,
    *,
    in_channels: int,
    num_classes: int,
    base: Sequence[int],
    exit_head: ExitHeadKind = "linear",
) -> ExitConvNet | ExitPreResNet:
    """The multi-exit ``model_name`` (``"conv"``: :class:`ExitConvNet`; ``"preresnet18"``: :class:`ExitPreResNet`).

    ``exit_head`` is the conv net's (:mod:`models.exit_heads`); the ResNet's exits have the
    ResNet's head form only.
    """
    if model_name == CONV:
        return ExitConvNet(depth, in_channels=in_channels, num_classes=num_classes, base=base, exit_head=exit_head)
    if model_name != PRERESNET18:
        raise ExitsError(f"multi-exit models cut the {CONV!r} or {PRERESNET18!r} CNN, not {model_name!r}")
    if exit_head != "linear":
        raise ExitsError(f"exit head {exit_head!r} is the {CONV!r} net's; the ResNet's exits have its head form")
    return ExitPreResNet(depth, in_channels=in_channels, num_classes=num_classes, base=base)


def exit_cnn_place(model_name: str) -> Callable[[str], tuple[int | None, Role]]:
    """The ``(layer, role)`` rule of ``model_name``'s multi-exit tensors."""
    return exit_conv_place if model_name == CONV else exit_preresnet_place


def exit_conv_outputs(model_name: str, depth: int) -> int:
    """How many of :func:`models.cnn.conv_output_shapes` a depth-``depth`` multi-exit model computes.

    The conv net: one per block.  The ResNet: the stem, then per stage ``s < depth`` two per block
    and the projection of its first block for ``s >= 1``.
    """
    if model_name == CONV:
        return depth
    return 1 + sum(2 * n + (1 if s > 0 else 0) for s, n in enumerate(PRERESNET18_BLOCKS[:depth]))


def exit_conv_layout(
    depth: int,
    *,
    in_channels: int,
    num_classes: int,
    base: Sequence[int],
    model_name: str = CONV,
    exit_head: ExitHeadKind = "linear",
) -> Layout:
    """The parameter layout of the multi-exit ``model_name`` at ``depth`` (built on the meta device)."""
    return meta_layout(
        lambda: exit_cnn(
            model_name, depth, in_channels=in_channels, num_classes=num_classes, base=base, exit_head=exit_head
        ),
        exit_cnn_place(model_name),
    )


def exit_conv_catalog(
    depths: Sequence[tuple[str, int]],
    *,
    in_channels: int,
    num_classes: int,
    image_size: int,
    batch_size: int,
    base: Sequence[int],
    optimizer: str = "sgd",
    model_name: str = CONV,
    exit_head: ExitHeadKind = "linear",
) -> VariantCatalog:
    """Catalog of depth variants of the multi-exit ``model_name``, one per ``(name, depth)``, shallowest first.

    Each variant's memory is :func:`models.cnn.estimate_memory` on its own layout and the conv
    outputs its depth computes (:func:`exit_conv_outputs`); ``extra = {"exits": depth}``.  With
    bottleneck exits the layout (weights, gradients, optimizer state) holds their tensors; their
    activations, each at most its block's and at half its resolution or less, are not counted.

    Raises
    ------
    ExitsError
        When the depths are not strictly increasing in ``1 .. len(base)`` (blocks, or stages).

    """
    values = [d for _, d in depths]
    if not values or values != sorted(set(values)) or values[0] < 1 or values[-1] > len(base):
        raise ExitsError(f"depths must be strictly increasing in 1 .. {len(base)}, got {values}")
    variants = []
    for name, depth in depths:
        layout = exit_conv_layout(
            depth,
            in_channels=in_channels,
            num_classes=num_classes,
            base=base,
            model_name=model_name,
            exit_head=exit_head,
        )
        memory = estimate_memory(
            model_name,
            1.0,
            layout,
            image_size=image_size,
            batch_size=batch_size,
            optimizer=optimizer,
            base=base,
            blocks=exit_conv_outputs(model_name, depth),
        )
        variants.append(Variant(name=name, depth=depth, layout=layout, memory=memory, extra={"exits": depth}))
    return VariantCatalog(family=f"exits:{model_name}", variants=tuple(variants))


class ExitPreResNet(nn.Module):
    """The first ``depth`` stages of HeteroFL's pre-activation ResNet-18 at full width, an exit after each.

    Stage ``s`` is :class:`models.cnn.PreResNet`'s (its blocks, strides and projections from the
    full model's widths ``base``); exit ``s`` is ``z_s = W_s mean_hw(relu(BN_s(h_s))) + b_s`` on
    stage ``s``'s output ``h_s`` (static batch norm, as the ResNet's).

    State-dict names: ``stem.weight``, ``stages.<s>.<b>.*`` (as :class:`~models.cnn.PreResNet`)
    and ``exits.<s>.norm.{weight,bias}``, ``exits.<s>.linear.{weight,bias}``.
    """

    def __init__(self, depth: int, *, in_channels: int, num_classes: int, base: Sequence[int]) -> None:
        super().__init__()
        self.base = tuple(int(d) for d in base)
        if len(self.base) != len(PRERESNET18_BLOCKS):
            raise ExitsError(f"{PRERESNET18!r} has {len(PRERESNET18_BLOCKS)} stages; got {len(self.base)} widths")
        if not 1 <= depth <= len(self.base):
            raise ExitsError(f"depth must be in 1 .. {len(self.base)} (the ResNet's stages), got {depth}")
        self.depth = depth
        self.stem = nn.Conv2d(in_channels, self.base[0], kernel_size=3, stride=1, padding=1, bias=False)
        stages = []
        for s, n in enumerate(PRERESNET18_BLOCKS[:depth]):
            blocks = []
            for b in range(n):
                first = s > 0 and b == 0
                c_in = self.base[s - 1] if first else self.base[s]
                blocks.append(PreActBlock(c_in, self.base[s], 2 if first else 1, 1.0, projection=first))
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.ModuleList(stages)
        self.exits = nn.ModuleList(_StageExit(self.base[s], num_classes) for s in range(depth))

    def exit_logits(self, x: Tensor) -> list[Tensor]:
        """``[z_1, .., z_depth]``, each ``(batch, num_classes)``, shallowest first."""
        x = self.stem(x)
        out = []
        for stage, head in zip(self.stages, self.exits, strict=True):
            x = stage(x)
            out.append(head(x))
        return out

    def forward(self, x: Tensor) -> Tensor:
        """The ensemble's logits (:func:`ensemble_logits` of :meth:`exit_logits`)."""
        return ensemble_logits(self.exit_logits(x))


class _StageExit(nn.Module):
    """``W mean_hw(relu(BN(h))) + b``: the ResNet's head form, after one stage."""

    def __init__(self, channels: int, num_classes: int) -> None:
        super().__init__()
        self.norm = static_bn(channels)
        self.linear = nn.Linear(channels, num_classes)

    def forward(self, h: Tensor) -> Tensor:
        return self.linear(F.adaptive_avg_pool2d(F.relu(self.norm(h)), 1).flatten(1))


def exit_preresnet_place(name: str) -> tuple[int | None, Role]:
    """``(layer, role)`` of an :class:`ExitPreResNet` tensor: the stem is layer 0, stage and exit ``s`` layer ``s``."""
    part, *rest = name.split(".")
    if part == "stem":
        return 0, "shared"
    if part in ("stages", "exits") and rest and rest[0].isdigit():
        return int(rest[0]), "shared" if part == "stages" else "head"
    raise ExitsError(f"{name!r} is not a tensor of a multi-exit ResNet")


class ExitPooler(nn.Module):
    """BERT's pooler layer, ``tanh(W_p x + b_p)`` (state names ``dense.{weight,bias}``)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden, hidden)

    def forward(self, x: Tensor) -> Tensor:
        """The pooled representation."""
        return torch.tanh(self.dense(x))


class ExitHead(nn.Module):
    """One transformer exit: ``W_c dropout(tanh(W_p x + b_p)) + b_c`` on a pooled layer state ``x``."""

    def __init__(self, config: BertConfig, num_labels: int) -> None:
        super().__init__()
        self.pooler = ExitPooler(config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)
        self.classifier = nn.Linear(config.hidden_size, num_labels)

    def forward(self, pooled: Tensor) -> Tensor:
        """The exit's logits."""
        return self.classifier(self.dropout(self.pooler(pooled)))


class ExitBert(nn.Module):
    """The first ``depth`` layers of the spec's BERT encoder with an exit after each.

    Exit ``l`` reads layer ``l``'s token states pooled as the spec says (``"mean"``: the
    attention-masked mean, :func:`models.transformer.masked_mean`; ``"cls"``: the first token).
    The word embeddings are frozen where the spec freezes them.
    """

    def __init__(self, spec: TransformerSpec, depth: int) -> None:
        super().__init__()
        config = variant_config(spec, depth)
        self.pooling = spec.pooling
        self.bert = BertModel(config, add_pooling_layer=False)
        self.exits = nn.ModuleList(ExitHead(config, spec.num_labels) for _ in range(depth))
        for layer in self.exits.modules():  # BERT's initialization of its own pooler and classifier
            if isinstance(layer, nn.Linear):
                nn.init.normal_(layer.weight, std=config.initializer_range)
                nn.init.zeros_(layer.bias)
        if spec.freeze_word_embeddings:
            self.bert.embeddings.word_embeddings.weight.requires_grad_(False)

    def exit_logits(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> list[Tensor]:
        """``[z_1, .., z_depth]``, each ``(batch, num_labels)``, shallowest first."""
        out = self.bert(
            input_ids=input_ids,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            output_hidden_states=True,
        )
        states = out.hidden_states[1:]  # [0] is the embedding output
        return [head(self._pool(h, attention_mask)) for h, head in zip(states, self.exits, strict=True)]

    def _pool(self, hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
        return masked_mean(hidden, attention_mask) if self.pooling == "mean" else hidden[:, 0]

    def forward(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
    ) -> Tensor:
        """The ensemble's logits (:func:`ensemble_logits` of :meth:`exit_logits`)."""
        return ensemble_logits(self.exit_logits(input_ids, attention_mask, token_type_ids))


def exit_bert_place(name: str) -> tuple[int | None, Role]:
    """``(layer, role)`` of an :class:`ExitBert` tensor.

    Embeddings are layer 0, encoder layer ``i`` is ``i + 1`` (shared), exit ``i`` follows layer
    ``i + 1`` (a head).
    """
    if name.startswith("exits."):
        index = name.split(".")[1]
        if index.isdigit():
            return int(index) + 1, "head"
    layer = layer_of(name)
    if layer is None:
        raise ExitsError(f"{name!r} is not a tensor of a multi-exit transformer")
    return layer, "shared"


def exit_bert_layout(spec: TransformerSpec, depth: int) -> Layout:
    """The parameter layout of :class:`ExitBert` at ``depth`` (meta device; frozen word embeddings not trainable)."""
    return meta_layout(
        lambda: ExitBert(spec, depth),
        exit_bert_place,
        parameters_only=True,
        trainable=lambda name: not (spec.freeze_word_embeddings and name == transformer.WORD_EMBEDDINGS),
    )


def exit_bert_initial_state(spec: TransformerSpec, depth: int, *, seed: int) -> dict[str, Tensor]:
    """Initial weights of the depth-``depth`` :class:`ExitBert`.

    Embeddings and encoder layers ``1 .. depth``: the checkpoint's (random with ``seed`` for
    ``tiny``, as :func:`models.transformer.initial_states`); every exit's pooler: the
    checkpoint's pooler; every exit's classifier: seeded (``torch.manual_seed(seed)`` before the
    model is built).
    """
    torch.manual_seed(seed)
    state = {k: v.detach().clone() for k, v in ExitBert(spec, depth).named_parameters()}
    pretrained = dict(build_model(spec, depth, pretrained=True).named_parameters())
    for name in state:
        if name.startswith("bert."):
            state[name] = pretrained[name].detach().clone()
        elif ".pooler.dense." in name:
            state[name] = pretrained["bert.pooler.dense." + name.rpartition(".")[2]].detach().clone()
    return state


def exit_bert_catalog(
    spec: TransformerSpec, tiers: Sequence[tuple[str, int]], *, batch_size: int, seq_len: int, optimizer: str
) -> VariantCatalog:
    """Catalog of :class:`ExitBert` depth variants, one per ``(tier name, layers)``, shallowest first.

    Memory: :func:`models.transformer.estimate_memory` on the variant's own layout (its exits'
    parameters included; their activations, ``depth`` pooled vectors, are within its workspace).
    """
    depths = [d for _, d in tiers]
    if not depths or depths != sorted(set(depths)):
        raise ExitsError(f"tier depths must be strictly increasing, got {depths}")
    variants = []
    for name, depth in tiers:
        layout = exit_bert_layout(spec, depth)
        memory = transformer.estimate_memory(
            variant_config(spec, depth), layout, batch_size=batch_size, seq_len=seq_len, optimizer=optimizer
        )
        variants.append(Variant(name=name, depth=depth, layout=layout, memory=memory, extra={"exits": depth}))
    return VariantCatalog(family=f"exits:{spec.source}", variants=tuple(variants))


#: The multi-exit models (each has ``exit_logits`` and ``exits``); ``isinstance(m, EXIT_MODELS)``.
EXIT_MODELS = (ExitConvNet, ExitPreResNet, ExitBert)
ExitModel = ExitConvNet | ExitPreResNet | ExitBert


@dataclass(frozen=True)
class ExitFamily:
    """Multi-exit depth variants of HeteroFL's conv net or a BERT encoder (DepthFL's models).

    Variants are built at their ``depth`` (:class:`ExitConvNet`, :class:`ExitBert`); data,
    batches and evaluation (sBN for the conv net) are the wrapped family's.

    Attributes
    ----------
    inner : CNNFamily or TransformerFamily
        The family cut by depth (a conv net: ``name = "conv"``).
    exit_head : {"linear", "bottleneck"}
        The conv net's exits (:mod:`models.exit_heads`); the ResNet's and the transformer's have
        their own form.

    """

    inner: CNNFamily | TransformerFamily
    exit_head: ExitHeadKind = "linear"

    def __post_init__(self) -> None:
        if isinstance(self.inner, CNNFamily) and self.inner.name not in (CONV, PRERESNET18):
            raise ExitsError(
                f"multi-exit models cut the {CONV!r} or {PRERESNET18!r} CNN or a transformer, not {self.inner.name!r}"
            )
        if self.exit_head != "linear" and not (isinstance(self.inner, CNNFamily) and self.inner.name == CONV):
            raise ExitsError(
                f"exit head {self.exit_head!r} is the {CONV!r} net's; other models' exits have their own form"
            )

    @property
    def data_kind(self) -> str:
        """The wrapped family's input kind."""
        return self.inner.data_kind

    def build(self, variant: Variant) -> nn.Module:
        """The variant's model at its ``depth`` (random initialization)."""
        return self.at_depth(variant.depth)

    def at_depth(self, depth: int) -> nn.Module:
        """The multi-exit model with ``depth`` blocks (layers) and as many exits."""
        inner = self.inner
        if isinstance(inner, CNNFamily):
            channels, classes = inner.in_channels, inner.num_classes
            return exit_cnn(
                inner.name, depth, in_channels=channels, num_classes=classes, base=inner.base, exit_head=self.exit_head
            )
        return ExitBert(inner.spec, depth)

    def initial_states(self, catalog: VariantCatalog, *, seed: int) -> dict[str, dict[str, Tensor]]:
        """One deepest model's weights (seeded; the transformer's from its checkpoint), each variant its prefix."""
        depth = catalog.largest.depth
        if isinstance(self.inner, TransformerFamily):
            full = exit_bert_initial_state(self.inner.spec, depth, seed=seed)
        else:
            torch.manual_seed(seed)
            full = {k: v.detach().clone() for k, v in self.at_depth(depth).state_dict().items()}
        return {v.name: {n: full[n] for n in v.layout.names()} for v in catalog}

    def width_rules(self, catalog: VariantCatalog) -> dict[str, tuple[str | None, ...]]:
        """Multi-exit variants differ in depth, never in width."""
        raise ExitsError("multi-exit depth variants have no width groups")

    def loader(
        self, ds: Dataset, *, batch_size: int, shuffle: bool, seed: int = 0, domain: str = "plain"
    ) -> DataLoader:
        """The wrapped family's batches."""
        return self.inner.loader(ds, batch_size=batch_size, shuffle=shuffle, seed=seed, domain=domain)

    @property
    def uses_statistics(self) -> bool:
        """Whether evaluation re-estimates normalization statistics (the conv net's sBN)."""
        return self.inner.uses_statistics

    def for_evaluation(self, model: nn.Module, stats: DataLoader | None) -> nn.Module:
        """The wrapped family's evaluation model (sBN statistics for the conv net)."""
        return self.inner.for_evaluation(model, stats)

    def catalog(
        self, tiers: Sequence[tuple[str, int]], *, batch_size: int, optimizer: str, seq_len: int, image_size: int
    ) -> VariantCatalog:
        """The depth variants of ``tiers`` (``(name, depth)``, shallowest first) with memory estimates."""
        inner = self.inner
        if isinstance(inner, TransformerFamily):
            return exit_bert_catalog(inner.spec, tiers, batch_size=batch_size, seq_len=seq_len, optimizer=optimizer)
        return exit_conv_catalog(
            tiers,
            in_channels=inner.in_channels,
            num_classes=inner.num_classes,
            image_size=image_size,
            batch_size=batch_size,
            base=inner.base,
            optimizer=optimizer,
            model_name=inner.name,
            exit_head=self.exit_head,
        )
