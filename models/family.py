"""Model families behind one interface, so the Flower apps never branch on the model kind.

A :class:`ModelFamily` knows how to build a catalog variant, the initial full-model weights,
the width groups of its tensors (for HeteroFL / FedRolex), how to turn a dataset into batches,
and what to do to a trained model before evaluation.  Two families:

* :class:`TransformerFamily` -- BERT-style text classifiers (:mod:`models.transformer`), cut by
  depth (InclusiveFL and its baselines) or by width (HeteroFL, FedRolex); batches are tokenized
  text; evaluation uses the model as trained.
* :class:`CNNFamily` -- HeteroFL's conv net and PreResNet-18 (:mod:`models.cnn`), cut by width;
  batches are ``{"x": images, "labels": labels}``; evaluation first recomputes the static
  batch-norm statistics on training data (HeteroFL's sBN, :func:`models.cnn.recompute_bn_statistics`).
* :class:`ArchitectureFamily` -- FlexiFed's different architectures of one family (CIFAR VGG-11/13/
  16/19, ResNet-20/32/44/56, :mod:`models.architectures`), one variant per architecture; image
  batches and sBN evaluation as for the CNNs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Protocol

import torch
from datasets import Dataset
from torch import Tensor, nn
from torch.utils.data import DataLoader

from models.architectures import CLASSIFIER, ArchLayer, LayerSignature, architecture_layers, build_architecture
from models.catalog import Variant, VariantCatalog
from models.cnn import build_cnn, recompute_bn_statistics, width_rules
from models.data import text_loader
from models.images import image_loader
from models.transformer import (
    TransformerSpec,
    bert_width_rules,
    build_variant_model,
    initial_states,
    load_tokenizer,
)

AxisGroups = dict[str, tuple[str | None, ...]]


class ModelFamily(Hashable, Protocol):
    """What the client and server apps need from a model family (hashable: loaders are cached by it)."""

    @property
    def data_kind(self) -> str:
        """``"text"`` or ``"image"``: the kind of input column the family reads."""
        ...

    def build(self, variant: Variant) -> nn.Module:
        """A model of ``variant`` (weights are loaded from a server message afterwards)."""
        ...

    def initial_states(self, catalog: VariantCatalog, *, seed: int) -> dict[str, dict[str, Tensor]]:
        """Initial weights of every full-width variant of ``catalog``, keyed by variant name."""
        ...

    def width_rules(self, catalog: VariantCatalog) -> AxisGroups:
        """Width group per axis of every tensor of ``catalog.largest``."""
        ...

    def loader(
        self, ds: Dataset, *, batch_size: int, shuffle: bool, seed: int = 0, domain: str = "plain"
    ) -> DataLoader:
        """Batches of ``ds`` as keyword arguments of the model plus ``labels`` (inputs seen in ``domain``)."""
        ...

    @property
    def uses_statistics(self) -> bool:
        """Whether :meth:`for_evaluation` needs training batches (data-dependent normalization)."""
        ...

    def for_evaluation(self, model: nn.Module, stats: DataLoader | None) -> nn.Module:
        """The model to evaluate (``stats``: training batches, where the family needs them)."""
        ...


@dataclass(frozen=True)
class TransformerFamily:
    """BERT-style text classifiers (depth or width variants)."""

    spec: TransformerSpec
    max_seq_len: int = 48
    data_kind: str = "text"

    def build(self, variant: Variant) -> nn.Module:
        """The variant's randomly initialised model (word embeddings frozen per the spec)."""
        return build_variant_model(self.spec, variant)

    def initial_states(self, catalog: VariantCatalog, *, seed: int) -> dict[str, dict[str, Tensor]]:
        """Pretrained prefix of every depth variant (see :func:`models.transformer.initial_states`)."""
        return initial_states(self.spec, catalog, seed=seed)

    def width_rules(self, catalog: VariantCatalog) -> AxisGroups:
        """:func:`models.transformer.bert_width_rules` of the largest variant."""
        return bert_width_rules(catalog.largest.layout.names())

    def loader(
        self, ds: Dataset, *, batch_size: int, shuffle: bool, seed: int = 0, domain: str = "plain"
    ) -> DataLoader:
        """Tokenized batches, padded per batch, truncated at ``max_seq_len`` (text has one domain)."""
        if domain != "plain":
            raise ValueError(f"text data has no input domain {domain!r} (domains are for images)")
        tok = load_tokenizer(self.spec.source)
        return text_loader(ds, tok, batch_size=batch_size, max_length=self.max_seq_len, shuffle=shuffle, seed=seed)

    @property
    def uses_statistics(self) -> bool:
        """No: layer norm has no data statistics."""
        return False

    def for_evaluation(self, model: nn.Module, stats: DataLoader | None) -> nn.Module:
        """The model itself (layer norm has no data statistics)."""
        return model

    def layers(self, catalog: VariantCatalog) -> dict[str, tuple[ArchLayer, ...]]:
        """FlexiFed's view of depth variants: embeddings, encoder layers ``1 .. k``, then the head.

        Each layer owns its *trainable* tensors (frozen word embeddings are never exchanged);
        signatures are ``("embeddings" | "encoder" | "classifier", shapes)``.  Encoder layers of
        one model have equal signatures, so depth variants share the prefix of the shallower
        one and Max-Common averages layer ``l`` over every client with at least ``l`` layers
        (InclusiveFL's layer-wise aggregation without momentum distillation); the pooler and
        classifier form the head, shared only between identical depths.
        """
        out = {}
        for v in catalog:
            by_layer: dict[int | None, list[tuple[str, tuple[int, ...]]]] = {}
            for p in v.layout:
                if p.trainable:
                    by_layer.setdefault(p.layer, []).append((p.name, p.shape))
            order = [*sorted(k for k in by_layer if k is not None), None]
            layers = []
            for k in order:
                kind = CLASSIFIER if k is None else "embeddings" if k == 0 else "encoder"
                entries = by_layer.get(k, [])
                if entries:
                    shapes = tuple(shape for _, shape in entries)
                    layers.append(ArchLayer(LayerSignature(kind, shapes), tuple(name for name, _ in entries)))
            out[v.name] = tuple(layers)
        return out


class ImageBatches:
    """What every image family's data side is: ``{"x", "labels"}`` batches of normalized images."""

    def loader(
        self, ds: Dataset, *, batch_size: int, shuffle: bool, seed: int = 0, domain: str = "plain"
    ) -> DataLoader:
        """``{"x", "labels"}`` batches of normalized images (in ``domain``, see :func:`models.images.shift_images`)."""
        return image_loader(ds, batch_size=batch_size, shuffle=shuffle, seed=seed, domain=domain)


class StaticBatchNorm(ImageBatches):
    """Image families with static batch norm (HeteroFL's sBN): evaluated on re-estimated statistics.

    A family using it declares ``stats_batches``: the training batches that re-estimate the norms.
    """

    stats_batches: int

    @property
    def uses_statistics(self) -> bool:
        """Yes: static batch norm (HeteroFL's sBN) re-estimates its statistics."""
        return True

    def for_evaluation(self, model: nn.Module, stats: DataLoader | None) -> nn.Module:
        """HeteroFL's sBN: norms re-estimated on up to ``stats_batches`` training batches."""
        return static_bn_evaluation(model, stats, self.stats_batches)


@dataclass(frozen=True)
class CNNFamily(StaticBatchNorm):
    """HeteroFL's CNNs (``"conv"``, ``"preresnet18"``) cut by width.

    Attributes
    ----------
    name : str
        ``"conv"`` or ``"preresnet18"``.
    base : tuple[int, ...]
        Hidden channels of the full model (HeteroFL: ``(64, 128, 256, 512)``).
    in_channels : int
        Image channels (1 for Fashion-MNIST, 3 for CIFAR-10/SVHN).
    num_classes : int
    stats_batches : int
        Training batches used to recompute the static batch-norm statistics before evaluation.

    """

    name: str
    base: tuple[int, ...]
    in_channels: int
    num_classes: int
    stats_batches: int = 20
    data_kind: str = "image"

    def at_rate(self, rate: float) -> nn.Module:
        """The model at width rate ``rate`` (random initialization)."""
        return build_cnn(self.name, rate, in_channels=self.in_channels, num_classes=self.num_classes, base=self.base)

    def build(self, variant: Variant) -> nn.Module:
        """The model at the variant's ``extra["rate"]`` (1.0 when absent)."""
        return self.at_rate(float(variant.extra.get("rate", 1.0)))

    def initial_states(self, catalog: VariantCatalog, *, seed: int) -> dict[str, dict[str, Tensor]]:
        """One seeded full model (rate 1) under the name of every rate-1 variant."""
        torch.manual_seed(seed)
        full = {k: v.detach().clone() for k, v in self.at_rate(1.0).state_dict().items()}
        return {v.name: dict(full) for v in catalog if float(v.extra.get("rate", 1.0)) == 1.0}

    def width_rules(self, catalog: VariantCatalog) -> AxisGroups:
        """:func:`models.cnn.width_rules` of the full model (built on the meta device)."""
        with torch.device("meta"):
            full = self.at_rate(1.0)
        return width_rules(self.name, full)


def static_bn_evaluation(model: nn.Module, stats: DataLoader | None, max_batches: int) -> nn.Module:
    """An sBN copy of ``model`` whose norms average the statistics of up to ``max_batches`` batches.

    The copy is laid out for inference (:func:`channels_last_for_inference`).
    """
    if stats is None:
        raise ValueError("evaluating a model with static batch norm needs training batches for its statistics")
    batches = [b for _, b in zip(range(max_batches), stats, strict=False)]
    return channels_last_for_inference(recompute_bn_statistics(model, batches, input_key="x"))


def channels_last_for_inference(model: nn.Module) -> nn.Module:
    """``model`` with its 4-D tensors (conv kernels) in channels-last memory format, converted in place.

    The math is unchanged: a convolution computes the same sums over ``(C_in, k_h, k_w)`` in either
    layout, and a conv whose kernel is channels-last produces channels-last activations from
    ordinary ``NCHW`` inputs, so the whole forward pass runs on oneDNN's channels-last kernels.
    They add in another order, so logits agree with the default layout to float rounding
    (``|d logit| <= 2e-5`` on the VGGs, no prediction changed: ``python -m bench.evaluation``),
    and CPU inference of the conv nets is faster (same benchmark).  Only evaluation copies are
    converted: training keeps the default layout, so a run's trained weights are unchanged.
    """
    return with_memory_format(model, torch.channels_last)


def with_memory_format(model: nn.Module, memory_format: torch.memory_format) -> nn.Module:
    """``model`` with its 4-D parameters and buffers in ``memory_format``, converted in place.

    (``nn.Module.to(memory_format=...)``, a keyword the typed overloads of ``to`` omit.)
    """
    to: Callable[..., nn.Module] = model.to
    return to(memory_format=memory_format)


@dataclass(frozen=True)
class ArchitectureFamily(StaticBatchNorm):
    """FlexiFed's architectures (VGG / ResNet) at one width multiplier; variant = architecture.

    Attributes
    ----------
    width : float
        Channel multiplier of every architecture (1.0 = the CIFAR definitions).
    in_channels, num_classes : int
    stats_batches : int
        Training batches used to recompute the static batch-norm statistics before evaluation.

    """

    width: float
    in_channels: int
    num_classes: int
    stats_batches: int = 20
    data_kind: str = "image"

    def build(self, variant: Variant) -> nn.Module:
        """The architecture named by ``variant.extra["arch"]``."""
        return build_architecture(
            str(variant.extra["arch"]), width=self.width, in_channels=self.in_channels, num_classes=self.num_classes
        )

    def layers(self, catalog: VariantCatalog) -> dict[str, tuple[ArchLayer, ...]]:
        """Per variant, its parameterized layers (signatures and tensor names) in forward order."""
        return {
            v.name: architecture_layers(
                str(v.extra["arch"]), width=self.width, in_channels=self.in_channels, num_classes=self.num_classes
            )
            for v in catalog
        }

    def initial_states(self, catalog: VariantCatalog, *, seed: int) -> dict[str, dict[str, Tensor]]:
        """Every architecture initialised with ``seed`` (independently; common layers meet after round 1)."""
        return seeded_states(self.build, catalog, seed=seed)

    def width_rules(self, catalog: VariantCatalog) -> AxisGroups:
        """Architectures are not cut by width."""
        raise ValueError("FlexiFed architectures have no width variants")


def seeded_states(
    build: Callable[[Variant], nn.Module], catalog: VariantCatalog, *, seed: int
) -> dict[str, dict[str, Tensor]]:
    """Each variant's freshly built model with the torch seed reset to ``seed`` before it (no weights shared)."""
    out = {}
    for v in catalog:
        torch.manual_seed(seed)
        out[v.name] = {k: t.detach().clone() for k, t in build(v).state_dict().items()}
    return out


def parse_widths(value: str) -> tuple[int, ...]:
    """``"16:32:64:128"`` -> ``(16, 32, 64, 128)``."""
    sep = ":" if ":" in value else ","
    widths = tuple(int(x) for x in value.split(sep))
    if not widths or min(widths) < 1:
        raise ValueError(f"expected positive channel counts, got {value!r}")
    return widths
