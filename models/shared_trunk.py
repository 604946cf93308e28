"""Evaluate depth variants that share their trunk in one forward pass of the deepest.

InclusiveFL (Liu et al., KDD 2022, Sec. 3.2) averages every embedding and encoder tensor over
the tiers that hold it and writes the mean back to each, so after every round tier ``j``'s
``L_j``-layer model is

``z_j(x) = head_j(f_{L_j}( ... f_1(E(x))))``

with the *same* embeddings ``E`` and layers ``f_1 .. f_{L_j}`` as the deepest model (only the
pooler and classifier ``head_j`` are its own; at round 0 every tier is a cut of one pretrained
model).  Its last hidden state is then the deepest model's hidden state after layer ``L_j``,
``h^{(j)} = h_{L_j}``: the server's central evaluation of every tier needs one pass through
``L_max`` layers instead of ``sum_j L_j`` (the demo: 6 layers instead of 2 + 4 + 6 = 12).  The
same kernels run on the same inputs, so the logits are the ones each model's own forward pass
gives, bit for bit (``tests/test_shared_trunk.py``).

Nothing is assumed from the method: models share a trunk only when checked -- the same BERT
class and configuration but for the depth, and every embedding and encoder tensor of the
shallower model equal (``torch.equal``) to the deeper model's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader
from transformers import BertForSequenceClassification

from models.training import EvaluationTally, batch_to, model_device
from models.transformer import MeanPooledBertForSequenceClassification

#: Classifiers whose head is known here (:func:`head_logits`); other models never share a trunk
HEADED_CLASSES: tuple[type[BertForSequenceClassification], ...] = (
    MeanPooledBertForSequenceClassification,
    BertForSequenceClassification,
)

#: State-dict prefixes of the trunk: the embeddings and the encoder layers (not the pooler / classifier)
TRUNK_PREFIXES = ("bert.embeddings.", "bert.encoder.layer.")


def depth_of(model: nn.Module) -> int:
    """Encoder layers of a BERT classifier."""
    return int(cast(BertForSequenceClassification, model).config.num_hidden_layers)


def shares_trunk(deep: nn.Module, shallow: nn.Module) -> bool:
    """Whether ``shallow`` is ``deep``'s first layers under its own head.

    True when both are exactly the same class of :data:`HEADED_CLASSES` (no subclass: its head
    could differ), their configurations agree but for ``num_hidden_layers`` (``shallow``'s at
    most ``deep``'s), and every :data:`TRUNK_PREFIXES` tensor of ``shallow`` (parameters and
    buffers) equals ``deep``'s of the same name exactly.
    """
    if type(deep) is not type(shallow) or type(deep) not in HEADED_CLASSES:
        return False
    if depth_of(shallow) > depth_of(deep):
        return False
    deep_cfg = cast(BertForSequenceClassification, deep).config.to_dict()
    shallow_cfg = cast(BertForSequenceClassification, shallow).config.to_dict()
    deep_cfg.pop("num_hidden_layers")
    shallow_cfg.pop("num_hidden_layers")
    if deep_cfg != shallow_cfg:
        return False
    deep_state = deep.state_dict()
    for name, tensor in shallow.state_dict().items():
        if not name.startswith(TRUNK_PREFIXES):
            continue
        other = deep_state.get(name)
        if other is None or other.shape != tensor.shape or not torch.equal(other, tensor):
            return False
    return True


def trunk_groups(models: Mapping[str, nn.Module]) -> list[list[str]]:
    """Partition ``models`` into groups evaluated by one pass: each group's first name is its deepest.

    Models are visited deepest first (ties in the mapping's order); each joins the first group
    whose root it :func:`shares_trunk` with, or starts its own.  A model of another class
    (a subclass included) is a group of one.
    """
    headed = [n for n, m in models.items() if type(m) in HEADED_CLASSES]
    order = sorted(headed, key=lambda n: -depth_of(models[n]))
    groups: list[list[str]] = []
    for name in order:
        for group in groups:
            if shares_trunk(models[group[0]], models[name]):
                group.append(name)
                break
        else:
            groups.append([name])
    groups.extend([n] for n in models if n not in headed)
    return groups


def head_logits(model: nn.Module, hidden: Tensor, attention_mask: Tensor | None) -> Tensor:
    """A classifier's logits from its last hidden state ``hidden`` (``(B, S, H)``).

    Mean pooling: :meth:`~models.transformer.MeanPooledBertForSequenceClassification.logits_from_hidden`;
    BERT's own: ``W_c dropout(tanh(W_p h_{:,0} + b_p)) + b_c``, what
    :class:`~transformers.BertForSequenceClassification` computes from its pooler output.

    Raises
    ------
    TypeError
        For a model outside :data:`HEADED_CLASSES`.
    ValueError
        For a BERT classifier built without a pooler.

    """
    if isinstance(model, MeanPooledBertForSequenceClassification):
        return model.logits_from_hidden(hidden, attention_mask)
    if type(model) is BertForSequenceClassification:
        pooler = model.bert.pooler
        if pooler is None:
            raise ValueError("BERT's classifier reads its pooler; this model was built without one")
        return cast(Tensor, model.classifier(model.dropout(pooler(hidden))))
    raise TypeError(f"no known head for {type(model).__name__}; expected one of {HEADED_CLASSES}")


@torch.no_grad()
def evaluate_shared_trunk(models: Mapping[str, nn.Module], loader: DataLoader) -> dict[str, tuple[float, float, int]]:
    """``(mean loss, accuracy, examples)`` of every model over ``loader``, one trunk pass per batch.

    The deepest model runs its encoder once per batch with every layer's hidden state kept;
    each model's logits are :func:`head_logits` of the hidden state after its own depth.  The
    tallies are those of :func:`models.training.evaluate_classifier`.

    Raises
    ------
    ValueError
        When some model does not share the deepest model's trunk (:func:`shares_trunk`).

    """
    names = sorted(models, key=lambda n: -depth_of(models[n]))
    root = cast(BertForSequenceClassification, models[names[0]])
    for name in names[1:]:
        if not shares_trunk(root, models[name]):
            raise ValueError(f"model {name!r} does not share the trunk of {names[0]!r}: evaluate it on its own")
    for model in models.values():
        model.eval()
    device = model_device(root)
    tallies = {name: EvaluationTally() for name in names}
    for batch in loader:
        batch = batch_to(batch, device)
        inputs = {k: v for k, v in batch.items() if k != "labels"}
        hidden = root.bert(**inputs, output_hidden_states=True).hidden_states
        for name in names:
            logits = head_logits(models[name], hidden[depth_of(models[name])], inputs.get("attention_mask"))
            tallies[name].add(logits, batch["labels"], F.cross_entropy(logits, batch["labels"]))
    return {name: tallies[name].result() for name in names}
