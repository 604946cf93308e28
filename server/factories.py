"""Strategy factories: what the registry's entries name (:mod:`experiment.registry`).

Each factory builds one method's server strategy from the validated run config, its registry
entry and the options every strategy takes (:func:`strategy_options`), with the signature
``(RunConfig, MethodEntry, Mapping[str, Any]) -> HeterogeneousStrategy``.  Only the ServerApp
imports this module (:func:`server.app.build_strategy`); a factory branches on the entry's facts
and the model family, never on a method name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from experiment.config import ConfigError, RunConfig
from experiment.lists import split_list
from experiment.method_settings import (
    CodistGroup,
    FlexiFedGroup,
    HeteroFLGroup,
    InclusiveFLGroup,
    PFedKnowGroup,
    ServerAdamGroup,
    ServerTrainingGroup,
)
from experiment.registry import MethodEntry
from models.codist import unlabeled_image_crops, unlabeled_images
from models.data import load_splits, read_guardian_headlines, server_labeled_set, text_inputs
from models.family import ArchitectureFamily, CNNFamily, TransformerFamily
from models.images import image_tensors, mixed_domains
from models.transformer import build_model, full_config, load_tokenizer, resolve_source
from strategies.base import HeterogeneousStrategy
from strategies.baselines import LocalTraining
from strategies.codistill import Batch, CoDistillation, DistillConfig, parse_mode
from strategies.fedadam import FedAdamConfig
from strategies.flexifed import FlexiFed
from strategies.heterofl import HeteroFL, WidthRules
from strategies.inclusivefl import InclusiveFL
from strategies.pfedknow import PFedKnow
from strategies.pfedknow_modes import MODES as PFEDKNOW_MODES
from strategies.pfedknow_modes import PFedKnowSettings, text_mode


def fedadam(cfg: RunConfig) -> FedAdamConfig:
    """The server optimizer's settings: ``server-lr``, ``server-beta1``, ``server-beta2``, ``server-tau``."""
    adam = cfg.settings_of(ServerAdamGroup)
    return FedAdamConfig(eta=adam.server_lr, beta_1=adam.server_beta1, beta_2=adam.server_beta2, tau=adam.server_tau)


def fedadam_per_tier(cfg: RunConfig) -> dict[str, FedAdamConfig]:
    """One server optimizer per tier (pool): ``tier-server-lr``'s eta, else ``server-lr``'s."""
    base, per_pool = fedadam(cfg), cfg.settings_of(CodistGroup).tier_server_lr
    if not per_pool:
        return dict.fromkeys(cfg.tier_names, base)
    rates = [float(x) for x in split_list(per_pool, "tier-server-lr")]
    return {t: dataclasses.replace(base, eta=eta) for t, eta in zip(cfg.tier_names, rates, strict=True)}


def strategy_options(cfg: RunConfig, entry: MethodEntry) -> dict[str, Any]:
    """The keyword options of :class:`~strategies.base.HeterogeneousStrategy` every factory passes on."""
    return {
        "catalog": cfg.training_catalog,
        "fraction_train": cfg.fraction_train,
        "fraction_evaluate": cfg.fraction_evaluate,
        "min_train_nodes": cfg.min_train_nodes,
        "min_evaluate_nodes": 1,
        "min_available_nodes": cfg.min_available_nodes,
        "assign": entry.assign,
        "seed": cfg.seed,
        "clip_update_norm": cfg.clip_bounds,
        "robust_aggregation": cfg.robust_aggregation,
    }


def inclusivefl(cfg: RunConfig, entry: MethodEntry, common: Mapping[str, Any]) -> HeterogeneousStrategy:
    """InclusiveFL with ``beta`` and ``inclusivefl-server-adam`` from the run config."""
    own = cfg.settings_of(InclusiveFLGroup)
    return InclusiveFL(beta=own.beta, adam=fedadam(cfg), server_adam=own.inclusivefl_server_adam, **common)


def one_variant(cfg: RunConfig, entry: MethodEntry, common: Mapping[str, Any]) -> HeterogeneousStrategy:
    """AllLarge / AllSmall / ExclusiveFL: FedAdam on the one variant the entry trains.

    Depth tiers: InclusiveFL's server step with one tier and no momentum distillation
    (``beta = 0``), InclusiveFL's baselines; width tiers (the CNNs): HeteroFL's server on the one width.
    """
    if cfg.uses_width:
        return heterofl(cfg, entry, common)
    return InclusiveFL(beta=0.0, adam=fedadam(cfg), server_adam="per-tier", **common)


def local(cfg: RunConfig, entry: MethodEntry, common: Mapping[str, Any]) -> HeterogeneousStrategy:
    """Every node trains its own model; nothing is aggregated."""
    return LocalTraining(**common)


def heterofl(cfg: RunConfig, entry: MethodEntry, common: Mapping[str, Any]) -> HeterogeneousStrategy:
    """HeteroFL (``mode = "static"``) or FedRolex (``"rolling"`` windows) over the family's width rules."""
    return HeteroFL(
        rules=WidthRules(axes=cfg.family().width_rules(cfg.catalog)),
        full=cfg.catalog.largest,
        rolling=entry.mode == "rolling",
        server_optimizer=cfg.settings_of(HeteroFLGroup).heterofl_server_optimizer,
        adam=fedadam(cfg),
        **common,
    )


def flexifed(cfg: RunConfig, entry: MethodEntry, common: Mapping[str, Any]) -> HeterogeneousStrategy:
    """FlexiFed in the entry's mode over the family's layer signatures."""
    family = cfg.family()
    if not isinstance(family, ArchitectureFamily | TransformerFamily):
        raise ConfigError(f"run config 'model': {entry.name!r} needs an architecture family or a transformer")
    own = cfg.settings_of(FlexiFedGroup)
    return FlexiFed(
        signatures=family.layers(cfg.catalog),
        mode=entry.mode,
        uniform=own.flexifed_uniform,
        share_classifier=own.flexifed_share_classifier,
        **common,
    )


def codistillation(cfg: RunConfig, entry: MethodEntry, common: Mapping[str, Any]) -> HeterogeneousStrategy:
    """Co-distillation in the entry's mode (merged, periodic, per-pool FedAvg)."""
    family = cfg.family()
    own, server = cfg.settings_of(CodistGroup), cfg.settings_of(ServerTrainingGroup)
    return CoDistillation(
        num_rounds=cfg.num_server_rounds,
        build_model=lambda pool: family.build(cfg.catalog.get(pool)),
        distill_data=distillation_inputs(cfg),
        mode=parse_mode(entry.mode),
        alpha=own.codist_alpha,
        period=own.codist_period,
        adam=fedadam_per_tier(cfg),
        distill=DistillConfig(
            steps=server.distill_steps,
            temperature=server.distill_temperature,
            lam=own.distill_lambda,
            lr=server.distill_lr,
            batch_size=server.distill_batch_size,
        ),
        membership=own.codist_membership,
        device=cfg.torch_device(),
        **common,
    )


def pfedknow_labeled_set(cfg: RunConfig) -> tuple[Batch, Tensor]:
    """The pFedKnow server's labeled set ``D_s``: ``pfedknow-labeled-size`` training examples.

    Carved out of the training split before the clients' partitions
    (:func:`models.data.server_labeled_set`): no client holds them and they are never test or
    validation examples.  Images: a normalized tensor; text: keyword inputs tokenized like the
    clients' (truncated at ``max-seq-len``).
    """
    labeled = server_labeled_set(cfg.data_spec())
    if cfg.image_data:
        return image_tensors(labeled)
    tokenizer = load_tokenizer(resolve_source(cfg.model))
    x = text_inputs([str(t) for t in labeled["text"]], tokenizer, max_length=cfg.max_seq_len)
    return x, torch.as_tensor(labeled["label"], dtype=torch.long)


def pfedknow_settings(cfg: RunConfig) -> PFedKnowSettings:
    """The strategy's settings from the run config.

    The pseudo-label threshold ``delta``: ``pfedknow-delta``, or ``1 - semifl-confidence`` for the
    SemiFL-style baseline, the one mode whose image filter is the max-softmax confidence
    (``uncertainty = "softmax"``) instead of pFedKnow's evidential uncertainty.
    """
    confidence_filter = PFEDKNOW_MODES[cfg.entry.mode].uncertainty == "softmax"
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


def pfedknow(cfg: RunConfig, entry: MethodEntry, common: Mapping[str, Any]) -> PFedKnow:
    """Build pFedKnow or an ablation.

    Images: the lightweight ``conv`` CNN under a ``pfedknow-teacher-scale`` wider teacher
    (random initialization).  Text: a ``tier-layers``-deep student under the full-depth
    transformer with its pretrained weights (:func:`models.transformer.build_model`), the mode's
    text version (:func:`strategies.pfedknow_modes.text_mode`).
    """
    family = cfg.family()
    mode = PFEDKNOW_MODES[entry.mode]
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
        labeled=pfedknow_labeled_set(cfg),
        settings=pfedknow_settings(cfg),
        **common,
    )


def distillation_inputs(cfg: RunConfig) -> Batch:
    """The server's unlabeled distillation set (``distill-size`` examples).

    Images: photo crops (``crops``, out-of-domain) or training images without labels
    (``in-domain``).  Text: Guardian headlines (``headlines``, out-of-domain) or training
    texts without labels (``in-domain``), tokenized for the transformer pools.
    ``out-of-domain`` (the default) picks crops or headlines by the model's data kind.  With
    several input domains (``tier-domains``) the images are split into equal shares, one per
    domain (:func:`models.images.mixed_domains`), like the paper's mixed distillation data.
    """
    own = cfg.settings_of(CodistGroup)
    source = own.distill_data
    if source == "out-of-domain":
        source = "crops" if cfg.image_data else "headlines"
    if cfg.image_data:
        if source == "crops":
            x = unlabeled_image_crops(own.distill_size, cfg.image_size, cfg.image_channels, seed=cfg.seed)
        else:
            train, _ = load_splits(cfg.data_spec())
            x = unlabeled_images(train, own.distill_size, seed=cfg.seed)
        return mixed_domains(x, cfg.domains)
    if source == "headlines":
        texts = read_guardian_headlines()
    else:
        train, _ = load_splits(cfg.data_spec())
        texts = [str(t) for t in train["text"]]
    gen = torch.Generator().manual_seed(cfg.seed)
    keep = torch.randperm(len(texts), generator=gen)[: own.distill_size].tolist()
    tokenizer = load_tokenizer(resolve_source(cfg.model))
    return text_inputs([texts[i] for i in keep], tokenizer, max_length=cfg.max_seq_len)
