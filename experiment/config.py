"""Typed run configuration built from Flower's flat ``context.run_config``.

Every key of ``[tool.flwr.app.config]`` in ``pyproject.toml`` is a field here (the
kebab-case key is the alias).  Validation happens once, before round 1: an invalid
value raises :class:`ConfigError` naming the key, the value and what is allowed;
unknown keys are rejected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cached_property
from itertools import pairwise
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from experiment import registry
from models import cnn
from models.architectures import architecture_catalog
from models.catalog import VariantCatalog
from models.codist import CODIST_SIZES, CodistFamily, codist_catalog
from models.codist import FAMILY as CODIST_MODEL
from models.data import DataSpec
from models.family import ArchitectureFamily, CNNFamily, ModelFamily, TransformerFamily, parse_widths
from models.images import IMAGE_DOMAINS
from models.training import DEVICE_PATTERN, TrainSettings, resolve_device
from models.transformer import TransformerSpec, depth_catalog, full_config, matched_width_rates, width_catalog

#: Methods whose tiers are width variants of the full model instead of depth variants.
WIDTH_METHODS = registry.names(width_tiers=True)
#: pFedKnow (seed 002), its ablations AS-1..AS-4 and the SemiFL-style baseline: one tier, the model
#: ``"conv"`` (images: network slimming) or a transformer (text: magnitude pruning, a student of
#: ``tier-layers`` layers under the full-depth teacher).
PFEDKNOW_METHODS = registry.names(client="unlabeled-pruning")
#: Methods a width-only family (the CNNs) can run: HeteroFL/FedRolex and FedAvg on one width.
CNN_METHODS = registry.names(family="cnn")
#: FlexiFed's methods and baselines, mapped to ``strategies.flexifed`` modes; they need an
#: architecture family (``model = "vgg"`` or ``"resnet"``, tiers naming its architectures).
FLEXIFED_MODES = registry.modes("architectures")
#: Co-distillation methods (``model = "codist-cnn"``, tiers = pools named by model size).
CODIST_MODES = registry.modes("codist")
#: Architecture families and their members.
ARCH_FAMILIES = registry.ARCH_FAMILIES


class ConfigError(ValueError):
    """Invalid run configuration; the message names every offending key."""


def _kebab(name: str) -> str:
    return name.replace("_", "-")


def split_list(value: str, what: str) -> list[str]:
    """Split ``"a:b:c"`` (or comma-separated) into stripped, non-empty items."""
    sep = ":" if ":" in value else ","
    items = [x.strip() for x in value.split(sep)]
    if not items or any(not x for x in items):
        raise ValueError(f"{what} must be a ':'-separated list, got {value!r}")
    return items


class RunConfig(BaseModel):
    """All experiment knobs (see the comments in pyproject.toml for each key)."""

    model_config = ConfigDict(alias_generator=_kebab, populate_by_name=True, extra="forbid", frozen=True)

    method: str = "inclusivefl"
    num_server_rounds: int = Field(7, ge=1)
    seed: int = 42
    # model and tiers
    model: str = "minilm-l6"
    cnn_widths: str = "32:64:128:256"
    arch_width: float = Field(0.25, gt=0.0, le=4.0)
    codist_alpha: float = Field(0.5, ge=0.0, le=1.0)
    codist_period: int = Field(5, ge=1)
    codist_membership: Literal["instead", "also"] = "also"
    distill_steps: int = Field(32, ge=0)
    distill_temperature: float = Field(1.0, gt=0.0)
    distill_lambda: float = Field(0.1, ge=0.0, le=1.0)
    distill_lr: float = Field(1e-3, ge=0.0)
    distill_batch_size: int = Field(64, ge=1)
    #: out-of-domain = photo crops for images, Guardian headlines for text
    distill_data: Literal["out-of-domain", "crops", "headlines", "in-domain"] = "out-of-domain"
    distill_size: int = Field(2000, ge=1)
    flexifed_uniform: bool = False
    flexifed_share_classifier: bool = False
    image_channels: int = Field(1, ge=1)
    image_size: int = Field(28, ge=4)
    tiers: str = "weak:medium:strong"
    tier_layers: str = "2:4:6"
    tier_proportions: str = "1:1:1"
    tier_memory_mb: str = "700:850:1100"
    tier_widths: str = "auto"
    #: per tier, the input domain of its clients' images ("plain" / "inverted"); "" = all plain
    tier_domains: str = ""
    heterofl_server_optimizer: Literal["average", "fedadam"] = "average"
    runtime_overhead_mb: float = Field(450.0, ge=0)
    freeze_word_embeddings: bool = True
    #: transformer pooler input: "mean" token state (how all-MiniLM-L6-v2 was trained) or "cls" (BERT's)
    pooling: Literal["mean", "cls"] = "mean"
    # InclusiveFL and the server optimizer (FedAdam)
    beta: float = Field(0.2, ge=0.0, le=1.0)
    #: InclusiveFL's server optimizer: "per-tier" FedAdam then layer averaging (the paper), or
    #: "shared": average the shared layers' updates first, one FedAdam step (a diagnosis variant)
    inclusivefl_server_adam: Literal["per-tier", "shared"] = "per-tier"
    server_lr: float = Field(1e-3, gt=0)
    #: co-distillation: one FedAdam eta per pool ("" = server-lr for every pool)
    tier_server_lr: str = ""
    server_beta1: float = Field(0.9, ge=0.0, lt=1.0)
    server_beta2: float = Field(0.99, ge=0.0, lt=1.0)
    server_tau: float = Field(1e-5, gt=0)
    # sampling and timing
    fraction_train: float = Field(1.0, gt=0.0, le=1.0)
    fraction_evaluate: float = Field(0.5, ge=0.0, le=1.0)
    min_available_nodes: int = Field(1, ge=1)
    min_train_nodes: int = Field(1, ge=1)
    round_timeout: float = Field(3600.0, gt=0)
    # local training
    optimizer: Literal["adamw", "sgd"] = "adamw"
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    local_steps: int = Field(15, ge=0)
    local_epochs: int = Field(1, ge=1)
    batch_size: int = Field(16, ge=1)
    max_seq_len: int = Field(48, ge=8, le=512)
    eval_batch_size: int = Field(64, ge=1)
    # where ClientApps train / evaluate and the ServerApp evaluates and distills:
    # "cpu", "auto" (a CUDA GPU when there is one), "cuda" or "cuda:N"
    device: str = "cpu"
    # torch intra-op threads per process (0 = torch's default: one per core)
    client_threads: int = Field(0, ge=0)
    server_threads: int = Field(0, ge=0)
    # data
    dataset: str = "embedded:rotten_tomatoes"
    text_column: str = "text"
    image_column: str = "image"
    label_column: str = "label"
    num_labels: int = Field(2, ge=2)
    partitioner: Literal["iid", "dirichlet"] = "iid"
    dirichlet_alpha: float = Field(0.5, gt=0)
    client_test_fraction: float = Field(0.2, gt=0.0, lt=1.0)
    server_test_size: int = Field(0, ge=0)
    #: what the server evaluates and the run reports: "test" (reported numbers) or "validation" (a fixed
    #: validation-fraction of the training split, clients never see it; choose settings here)
    eval_split: Literal["test", "validation"] = "test"
    validation_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    # results
    results_dir: str = "results"
    run_name: str = ""
    # reliability: checkpoints, resume, robust aggregation
    checkpoint_dir: str = ""
    checkpoint_keep: int = Field(2, ge=0)
    resume: bool = False
    clip_update_norm: str = "0"
    robust_aggregation: Literal["mean", "median"] = "mean"
    # pFedKnow: uncertainty threshold, target pruning ratio (channels for conv, weight matrices'
    # weights for transformers) reached after prune-rounds rounds, slimming L1 on BN scales (conv),
    # server labeled-set size (held out of the test split after the server's evaluation examples),
    # teacher width factor (conv; a transformer's teacher is its full depth), the teacher's / the
    # student's init steps and their Adam lr; server distillation uses distill-steps / distill-lr /
    # distill-batch-size / distill-temperature
    pfedknow_delta: float = Field(0.7, gt=0.0, le=1.0)
    pfedknow_prune_ratio: float = Field(0.2, ge=0.0, lt=1.0)
    pfedknow_prune_rounds: int = Field(3, ge=1)
    pfedknow_l1: float = Field(1e-4, ge=0.0)
    pfedknow_labeled_size: int = Field(1000, ge=1)
    pfedknow_teacher_scale: float = Field(2.0, ge=1.0)
    pfedknow_teacher_steps: int = Field(300, ge=0)
    pfedknow_init_steps: int = Field(200, ge=0)
    pfedknow_init_lr: float = Field(1e-3, gt=0.0)
    semifl_confidence: float = Field(0.95, gt=0.0, lt=1.0)

    @field_validator("tiers")
    @classmethod
    def _tiers(cls, v: str) -> str:
        names = split_list(v, "tiers")
        if len(set(names)) != len(names):
            raise ValueError(f"tier names must be unique, got {names}")
        bad = [n for n in names if "/" in n]
        if bad:
            raise ValueError(f"tier names may not contain '/': {bad}")
        return v

    @field_validator("tier_layers")
    @classmethod
    def _layers(cls, v: str) -> str:
        depths = [int(x) for x in split_list(v, "tier-layers")]
        if any(d < 1 for d in depths) or depths != sorted(set(depths)):
            raise ValueError(f"tier-layers must be strictly increasing positive integers, got {v!r}")
        return v

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        if not DEVICE_PATTERN.fullmatch(v):
            raise ValueError(f"expected 'cpu', 'auto', 'cuda' or 'cuda:N', got {v!r}")
        return v

    @field_validator("tier_widths")
    @classmethod
    def _widths(cls, v: str) -> str:
        if v == "auto":
            return v
        rates = [float(x) for x in split_list(v, "tier-widths")]
        if any(not 0.0 < r <= 1.0 for r in rates) or rates != sorted(set(rates)) or rates[-1] != 1.0:
            raise ValueError(f"tier-widths must be 'auto' or increasing rates in (0, 1] ending at 1, got {v!r}")
        return v

    @field_validator("cnn_widths")
    @classmethod
    def _cnn_widths(cls, v: str) -> str:
        parse_widths(v)
        return v

    @field_validator("clip_update_norm", mode="before")
    @classmethod
    def _clip_number(cls, v: object) -> object:
        return str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v

    @field_validator("clip_update_norm")
    @classmethod
    def _clip(cls, v: str) -> str:
        bounds = [float(x) for x in split_list(v, "clip-update-norm")]
        if any(not (math.isfinite(c) and c >= 0) for c in bounds):
            raise ValueError(f"clip-update-norm must be finite numbers >= 0 (0 = off), got {v!r}")
        return v

    @field_validator("tier_proportions", "tier_memory_mb")
    @classmethod
    def _positive_numbers(cls, v: str, info: ValidationInfo) -> str:
        if v == "auto" and info.field_name == "tier_memory_mb":
            return v
        values = [float(x) for x in split_list(v, "value")]
        if any(x < 0 for x in values) or sum(values) <= 0:
            raise ValueError(f"expected non-negative numbers with a positive sum, got {v!r}")
        return v

    @field_validator("method")
    @classmethod
    def _registered(cls, v: str) -> str:
        """A method the registry holds (:func:`experiment.registry.lookup`)."""
        if v not in registry.METHODS:
            raise ValueError(registry.unknown_method_message(v, key=False))
        return v

    @property
    def entry(self) -> registry.MethodEntry:
        """The registry entry of ``method``."""
        return registry.lookup(self.method)

    @model_validator(mode="after")
    def _consistent(self) -> RunConfig:
        if self.inclusivefl_server_adam == "shared" and self.method != "inclusivefl":
            raise ValueError(
                f"run config 'inclusivefl-server-adam': 'shared' changes InclusiveFL's server step only; "
                f"method {self.method!r} does not use it (set it to 'per-tier' or method = 'inclusivefl')"
            )
        if self.is_architectures:
            if self.method not in FLEXIFED_MODES:
                raise ValueError(
                    f"run config 'method': {self.method!r} does not apply to architecture family {self.model!r}; "
                    f"use one of {tuple(FLEXIFED_MODES)}"
                )
            unknown = [t for t in self.tier_names if t not in ARCH_FAMILIES[self.model]]
            if unknown:
                raise ValueError(
                    f"run config 'tiers': {unknown} are not {self.model!r} architectures {ARCH_FAMILIES[self.model]}"
                )
        elif self.method in FLEXIFED_MODES and (self.is_cnn or self.is_codist):
            raise ValueError(
                f"run config 'method': {self.method!r} needs model 'vgg', 'resnet' (architectures as tiers) "
                "or a transformer (depth tiers)"
            )
        if self.is_codist and self.method not in CODIST_MODES:
            raise ValueError(
                f"run config 'method': model {CODIST_MODEL!r} needs a co-distillation method {tuple(CODIST_MODES)}, "
                f"got {self.method!r}"
            )
        if self.method in CODIST_MODES and (self.is_cnn or self.is_architectures):
            raise ValueError(
                f"run config 'method': {self.method!r} pools are model sizes: model {CODIST_MODEL!r} "
                f"(images) or a transformer at tier depths (text), not {self.model!r}"
            )
        if self.method in CODIST_MODES and self.method != "codist-fedavg":
            text_only, image_only = ("headlines",), ("crops",)
            if self.distill_data in (image_only if not self.image_data else text_only):
                kind = "image" if self.image_data else "text"
                raise ValueError(
                    f"run config 'distill-data': {self.distill_data!r} does not fit {kind} models; use "
                    f"{'crops' if self.image_data else 'headlines'!r} (out-of-domain) or 'in-domain'"
                )
        if self.is_codist:
            unknown = [t for t in self.tier_names if t not in CODIST_SIZES]
            if unknown:
                raise ValueError(f"run config 'tiers': pools {unknown} are not model sizes {tuple(CODIST_SIZES)}")
        if self.method in PFEDKNOW_METHODS:
            if self.image_data and self.model != cnn.CONV:
                raise ValueError(
                    f"run config 'model': {self.method!r} prunes HeteroFL's 'conv' CNN (network slimming) or a "
                    f"transformer (magnitude pruning, e.g. 'minilm-l6' or 'tiny'); got {self.model!r}"
                )
            if self.device != "cpu":
                raise ValueError(
                    f"run config 'device': {self.method!r} trains, prunes and distills on the CPU only; "
                    f"use 'cpu', got {self.device!r}"
                )
            if len(self.tier_names) != 1:
                raise ValueError(
                    f"run config 'tiers': {self.method!r} trains one lightweight model; give one tier, "
                    f"got {self.tier_names}"
                )
            if not self.image_data:
                self._check_pfedknow_student()
        if self.is_cnn and self.method not in CNN_METHODS:
            raise ValueError(
                f"run config 'method': {self.method!r} needs a depth-cut model; "
                f"model {self.model!r} supports {CNN_METHODS}"
            )
        if self.robust_aggregation == "median" and self.entry.per_node_models:
            raise ValueError(
                f"run config 'robust-aggregation': 'median' is not defined for method {self.method!r} "
                "(its per-node models need every reply); use 'mean'"
            )
        if self.resume and not (self.run_name or self.checkpoint_dir):
            raise ValueError(
                "run config 'resume': needs 'run-name' or 'checkpoint-dir' to know which run's checkpoints to resume"
            )
        if self.resume and self.checkpoint_keep == 0:
            raise ValueError("run config 'resume': needs checkpoints, but 'checkpoint-keep' is 0 (off)")
        n = len(self.tier_names)
        if self.tier_domains:
            domains = split_list(self.tier_domains, "tier-domains")
            if not self.image_data:
                raise ValueError("run config 'tier-domains': input domains apply to image models only")
            if len(domains) != n:
                raise ValueError(f"run config 'tier-domains' has {len(domains)} entries but 'tiers' has {n}")
            unknown = sorted(set(domains) - set(IMAGE_DOMAINS))
            if unknown:
                raise ValueError(f"run config 'tier-domains': {unknown} are not image domains {IMAGE_DOMAINS}")
        if self.tier_server_lr:
            self._check_tier_server_lr(n)
        clip = split_list(self.clip_update_norm, "clip-update-norm")
        if len(clip) not in (1, n):
            raise ValueError(f"run config 'clip-update-norm' has {len(clip)} entries; give one or one per tier ({n})")
        widths = () if self.tier_widths == "auto" else (("tier-widths", self.tier_widths),)
        for key, items in (
            *widths,
            *(() if self.image_data else (("tier-layers", self.tier_layers),)),
            ("tier-proportions", self.tier_proportions),
            *(() if self.tier_memory_mb == "auto" else (("tier-memory-mb", self.tier_memory_mb),)),
        ):
            if len(split_list(items, key)) != n:
                raise ValueError(f"run config '{key}' has {len(split_list(items, key))} entries but 'tiers' has {n}")
        return self

    def _check_pfedknow_student(self) -> None:
        """A transformer pFedKnow run: one ``tier-layers`` entry, shallower than the full-depth teacher."""
        depths = split_list(self.tier_layers, "tier-layers")
        if len(depths) != 1:
            raise ValueError(
                f"run config 'tier-layers': {self.method!r} trains one lightweight student; give one depth, "
                f"got {self.tier_layers!r}"
            )
        try:
            full = full_config(self.model, self.num_labels).num_hidden_layers
        except (OSError, ValueError) as exc:
            raise ValueError(f"run config 'model': cannot read {self.model!r}'s configuration ({exc})") from None
        if not int(depths[0]) < full:
            raise ValueError(
                f"run config 'tier-layers': pFedKnow's student must be shallower than the teacher (the full "
                f"{full}-layer {self.model!r}); got {depths[0]}"
            )

    # ----------------------------------------------------------------- views
    @classmethod
    def from_flower(cls, run_config: Mapping[str, Any]) -> RunConfig:
        """Validate Flower's run config; raise :class:`ConfigError` naming the keys."""
        try:
            return cls.model_validate(dict(run_config))
        except ValidationError as exc:
            lines = []
            for err in exc.errors():
                value = err.get("input")
                if not err["loc"]:  # a cross-field check names its keys itself
                    lines.append(str(err["msg"]).removeprefix("Value error, "))
                    continue
                key = ".".join(str(x) for x in err["loc"])
                msg = str(err["msg"]).removeprefix("Value error, ")
                shown = "" if isinstance(value, dict) or repr(value) in msg else f" (got {value!r})"
                lines.append(f"run config '{key}': {msg}{shown}")
            raise ConfigError("; ".join(lines)) from None

    @property
    def tier_names(self) -> list[str]:
        """Tier names, weakest first."""
        return split_list(self.tiers, "tiers")

    @property
    def tier_depths(self) -> list[tuple[str, int]]:
        """``(tier, layers)`` pairs."""
        return list(zip(self.tier_names, [int(x) for x in split_list(self.tier_layers, "tier-layers")], strict=True))

    def tier_domain(self, tier: str) -> str:
        """Input domain of ``tier``'s clients (``plain`` when ``tier-domains`` is not set)."""
        if not self.tier_domains:
            return "plain"
        return dict(zip(self.tier_names, split_list(self.tier_domains, "tier-domains"), strict=True)).get(tier, "plain")

    @property
    def domains(self) -> list[str]:
        """The distinct input domains of the run, in tier order (``["plain"]`` when not set)."""
        return list(dict.fromkeys(self.tier_domain(t) for t in self.tier_names))

    @property
    def proportions(self) -> list[float]:
        """Tier proportions for emulated devices."""
        return [float(x) for x in split_list(self.tier_proportions, "tier-proportions")]

    @property
    def memory_budgets(self) -> dict[str, float]:
        """Emulated memory budget (MiB) per tier.

        ``"auto"``: tier ``i`` gets ``overhead + (e_i + e_{i+1}) / 2`` and the strongest
        ``overhead + 1.25 e_n``, with ``e_i`` the estimate of the catalog's ``i``-th variant, so
        every emulated tier fits exactly its own variant.
        """
        if self.tier_memory_mb == "auto":
            est = [v.memory.total_mb for v in self.catalog]
            tops = [(a + b) / 2 for a, b in pairwise(est)] + [1.25 * est[-1]]
            values = [self.runtime_overhead_mb + t for t in tops]
            return dict(zip(self.catalog.names(), values, strict=True))
        values = [float(x) for x in split_list(self.tier_memory_mb, "tier-memory-mb")]
        return dict(zip(self.tier_names, values, strict=True))

    @property
    def family_kind(self) -> registry.FamilyKind:
        """The family ``model`` names (:func:`experiment.registry.family_kind`)."""
        return registry.family_kind(self.model)

    @property
    def is_cnn(self) -> bool:
        """Whether ``model`` names one of HeteroFL's CNNs (``conv``, ``preresnet18``)."""
        return self.family_kind == "cnn"

    @property
    def is_architectures(self) -> bool:
        """Whether ``model`` names an architecture family (FlexiFed: ``vgg``, ``resnet``)."""
        return self.family_kind == "architectures"

    @property
    def is_codist(self) -> bool:
        """Whether ``model`` is the co-distillation CNN pair (pools of model sizes)."""
        return self.family_kind == "codist"

    @property
    def image_data(self) -> bool:
        """Whether the model reads images (CNNs, architecture families, the co-distillation CNNs)."""
        return self.family_kind != "transformer"

    @property
    def uses_width(self) -> bool:
        """Whether tiers are width variants (HeteroFL/FedRolex, or any method on a CNN)."""
        return self.entry.width_tiers or self.is_cnn

    def family(self) -> ModelFamily:
        """The model family the apps build variants from."""
        if self.is_codist:
            return CodistFamily(
                in_channels=self.image_channels, num_classes=self.num_labels, image_size=self.image_size
            )
        if self.is_architectures:
            return ArchitectureFamily(
                width=self.arch_width, in_channels=self.image_channels, num_classes=self.num_labels
            )
        if self.is_cnn:
            return CNNFamily(
                name=self.model,
                base=parse_widths(self.cnn_widths),
                in_channels=self.image_channels,
                num_classes=self.num_labels,
            )
        return TransformerFamily(self.transformer_spec(), max_seq_len=self.max_seq_len)

    def transformer_spec(self) -> TransformerSpec:
        """Model family settings."""
        return TransformerSpec(
            source=self.model,
            num_labels=self.num_labels,
            freeze_word_embeddings=self.freeze_word_embeddings,
            pooling=self.pooling,
        )

    def data_spec(self) -> DataSpec:
        """Data settings."""
        return DataSpec(
            dataset=self.dataset,
            kind="image" if self.image_data else "text",
            text_column=self.text_column,
            image_column=self.image_column,
            label_column=self.label_column,
            partitioner=self.partitioner,
            dirichlet_alpha=self.dirichlet_alpha,
            client_test_fraction=self.client_test_fraction,
            server_test_size=self.server_test_size,
            eval_split=self.eval_split,
            validation_fraction=self.validation_fraction,
            server_labeled_size=self.pfedknow_labeled_size if self.method in PFEDKNOW_METHODS else 0,
            seed=self.seed,
        )

    def train_settings(self) -> TrainSettings:
        """Local-training settings."""
        return TrainSettings(
            optimizer=self.optimizer,
            lr=self.lr,
            weight_decay=self.weight_decay,
            local_steps=self.local_steps,
            local_epochs=self.local_epochs,
        )

    @property
    def clip_bounds(self) -> dict[str, float]:
        """Update-norm bound per tier (0 = not clipped): one value for all tiers, or one per tier."""
        bounds = [float(x) for x in split_list(self.clip_update_norm, "clip-update-norm")]
        if len(bounds) == 1:
            bounds = bounds * len(self.tier_names)
        return dict(zip(self.tier_names, bounds, strict=True))

    def _check_tier_server_lr(self, n: int) -> None:
        key = "run config 'tier-server-lr'"
        if self.method not in CODIST_MODES:
            raise ValueError(
                f"{key}: only co-distillation methods {tuple(CODIST_MODES)} keep one server optimizer per pool; "
                f"method {self.method!r} takes 'server-lr'"
            )
        rates = split_list(self.tier_server_lr, "tier-server-lr")
        if len(rates) != n:
            raise ValueError(f"{key} has {len(rates)} entries but 'tiers' has {n}")
        for r in rates:
            try:
                value = float(r)
            except ValueError:
                raise ValueError(f"{key}: {r!r} is not a number") from None
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"{key}: learning rates must be finite and > 0, got {r!r}")

    def torch_device(self) -> torch.device:
        """The torch device ``device`` names on this machine (fails naming the key if it lacks that GPU)."""
        try:
            return resolve_device(self.device)
        except ValueError as exc:
            raise ConfigError(f"run config 'device': {exc}") from None

    @property
    def width_rates(self) -> list[float]:
        """Width rate per tier: explicit, or "auto".

        "auto" matches the transformer's depth variants' parameter counts, and for a CNN halves
        the rate per tier below the strongest (HeteroFL's levels: ..., 0.25, 0.5, 1).
        """
        if self.tier_widths == "auto" and self.is_cnn:
            n = len(self.tier_names)
            return [0.5 ** (n - 1 - i) for i in range(n)]
        if self.tier_widths == "auto":
            return matched_width_rates(self.transformer_spec(), [d for _, d in self.tier_depths])
        return [float(x) for x in split_list(self.tier_widths, "tier-widths")]

    @cached_property
    def catalog(self) -> VariantCatalog:
        """Every tier's variant: pools, architectures, width variants (HeteroFL/FedRolex, CNNs) or depth variants."""
        if self.is_codist:
            return codist_catalog(
                [(t, t) for t in self.tier_names],
                in_channels=self.image_channels,
                num_classes=self.num_labels,
                image_size=self.image_size,
                batch_size=self.batch_size,
                optimizer=self.optimizer,
            )
        if self.is_architectures:
            return architecture_catalog(
                self.tier_names,
                width=self.arch_width,
                in_channels=self.image_channels,
                num_classes=self.num_labels,
                image_size=self.image_size,
                batch_size=self.batch_size,
                optimizer=self.optimizer,
            )
        if self.is_cnn:
            try:
                return cnn.width_catalog(
                    self.model,
                    list(zip(self.tier_names, self.width_rates, strict=True)),
                    in_channels=self.image_channels,
                    num_classes=self.num_labels,
                    image_size=self.image_size,
                    batch_size=self.batch_size,
                    base=parse_widths(self.cnn_widths),
                    optimizer=self.optimizer,
                )
            except ValueError as exc:
                raise ConfigError(f"run config 'tier-widths': {exc}") from None
        if self.entry.width_tiers:
            try:
                return width_catalog(
                    self.transformer_spec(),
                    list(zip(self.tier_names, self.width_rates, strict=True)),
                    batch_size=self.batch_size,
                    seq_len=self.max_seq_len,
                    optimizer=self.optimizer,
                )
            except ValueError as exc:
                raise ConfigError(f"run config 'tier-widths': {exc}") from None
        return depth_catalog(
            self.transformer_spec(),
            self.tier_depths,
            batch_size=self.batch_size,
            seq_len=self.max_seq_len,
            optimizer=self.optimizer,
        )

    @cached_property
    def training_catalog(self) -> VariantCatalog:
        """Variants the method trains: one for AllLarge/ExclusiveFL/AllSmall, else all."""
        full = self.catalog
        if self.entry.trains == "largest":
            return VariantCatalog(full.family, (full.largest,))
        if self.entry.trains == "smallest":
            return VariantCatalog(full.family, (full.smallest,))
        return full
