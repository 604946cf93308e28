"""Typed run configuration built from Flower's flat ``context.run_config``.

Every key of ``[tool.flwr.app.config]`` in ``pyproject.toml`` is a field here or of one of the
methods' settings groups (:mod:`experiment.method_settings`), inherited flat (the kebab-case key is
the alias).  Validation happens once, before round 1: an invalid
value raises :class:`ConfigError` naming the key, the value and what is allowed;
unknown keys are rejected.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from functools import cached_property
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from experiment import registry
from experiment.key_readers import (
    IMAGE_METHODS,
    METHODS_EXTRA,
    WIDTH_TIER_METHODS,
    methods_on,
    methods_where,
    readers,
)
from experiment.lists import split_list
from experiment.method_settings import AllGroups, GroupT, group_of, kebab, reads
from models import cnn
from models.catalog import VariantCatalog
from models.codist import CODIST_SIZES
from models.codist import FAMILY as CODIST_MODEL
from models.data import DataSpec
from models.family import ModelFamily, parse_widths
from models.images import IMAGE_DOMAINS
from models.training import DEVICE_PATTERN, TrainSettings, resolve_device
from models.transformer import (
    EMBEDDED_MODEL,
    TINY_MODEL,
    TransformerSpec,
)

if TYPE_CHECKING:
    from experiment.resolve import Experiment

#: Methods a width-only family (the CNNs) can run: HeteroFL/FedRolex and FedAvg on one width.
CNN_METHODS = registry.names(family="cnn")
#: FlexiFed's methods and baselines, mapped to ``strategies.flexifed`` modes; they need an
#: architecture family (``model = "vgg"`` or ``"resnet"``, tiers naming its architectures).
FLEXIFED_MODES = registry.modes("architectures")
#: Co-distillation methods (``model = "codist-cnn"``, tiers = pools named by model size).
CODIST_MODES = registry.modes("codist")


class ConfigError(ValueError):
    """Invalid run configuration; the message names every offending key."""


class SettingsGroupError(LookupError):
    """Code read a settings group its method's registry entry does not name (a programming error)."""


class RunConfig(AllGroups):
    """All experiment knobs: one field per run-config key, described where it is defined.

    The generic keys are defined here; the keys only some methods read are the methods' settings
    groups (:mod:`experiment.method_settings`), inherited as flat fields (the keys Flower passes) and
    read by a factory as one object (:meth:`settings_of`).

    Each field's ``description`` says what the key does; its ``json_schema_extra`` names the
    methods that read it (:data:`METHODS_EXTRA`, none = every method) and, for strings with a
    validator, the accepted values (:data:`ALLOWED_EXTRA`).  ``python -m experiment.keys``
    prints the reference (:mod:`experiment.keys`), ``docs/CONFIG_KEYS.md`` holds it.
    """

    method: str = Field(
        "inclusivefl",
        description="The federated method: an entry of experiment/registry.py, which decides the server "
        "strategy, the variants trained and what the clients do.",
        json_schema_extra=readers(allowed=", ".join(registry.METHODS)),
    )
    num_server_rounds: int = Field(7, ge=1, description="Federated rounds the ServerApp runs.")
    seed: int = Field(
        42,
        description="Random seed of the run: data partitions, the server's labeled set, client sampling, "
        "model initialization and local batches.",
    )
    # model and tiers
    model: str = Field(
        EMBEDDED_MODEL,
        description=f"The model family: a transformer encoder cut by depth or width ({EMBEDDED_MODEL!r}: the "
        f"embedded MiniLM-L6 weights, {TINY_MODEL!r}: random initialization for tests, a Hugging Face id or "
        "folder), one of HeteroFL's image CNNs (width tiers), an architecture family (FlexiFed: tiers name its "
        f"architectures) or {CODIST_MODEL!r} (co-distillation pools of model sizes).",
        json_schema_extra=readers(
            allowed=f"a transformer ({EMBEDDED_MODEL!r}, {TINY_MODEL!r}, a Hugging Face id or folder), "
            f"{', '.join(repr(m) for m in (*cnn.MODEL_NAMES, *registry.ARCH_FAMILIES, CODIST_MODEL))}"
        ),
    )
    cnn_widths: str = Field(
        "32:64:128:256",
        description="Hidden channels of the full CNN per stage, ':'-separated (HeteroFL's are 64:128:256:512; "
        "the default halves them for CPUs). Only with model = 'conv' or 'preresnet18'.",
        json_schema_extra=readers(methods_on("cnn"), allowed="positive integers, ':'-separated"),
    )
    arch_width: float = Field(
        0.25,
        gt=0.0,
        le=4.0,
        description="Channel multiplier of FlexiFed's VGG / ResNet architectures (1 = the original widths). "
        "Only with model = 'vgg' or 'resnet'.",
        json_schema_extra=readers(methods_on("architectures")),
    )
    image_channels: int = Field(
        1,
        ge=1,
        description="Input channels of the image models (1 = grayscale, 3 = RGB); checked against the data "
        "before round 1.",
        json_schema_extra=readers(IMAGE_METHODS),
    )
    image_size: int = Field(
        28,
        ge=4,
        description="Side of the square input images in pixels; checked against the data before round 1.",
        json_schema_extra=readers(IMAGE_METHODS),
    )
    tiers: str = Field(
        "weak:medium:strong",
        description="Tier names, weakest first. FlexiFed: the family's architectures (e.g. "
        "'vgg11:vgg13:vgg16:vgg19'); co-distillation on 'codist-cnn': pools by model size ('small:large'); "
        "pFedKnow: exactly one tier.",
        json_schema_extra=readers(allowed="unique names without '/', ':'-separated"),
    )
    tier_layers: str = Field(
        "2:4:6",
        description="Encoder layers of each tier's transformer variant, one per tier (pFedKnow: the student's "
        "depth, below the full model's); width tiers with tier-widths = 'auto' match these depths' sizes. "
        "DepthFL: each tier's depth on the CNNs too (conv: its blocks, preresnet18: its stages; at most "
        "len(cnn-widths)); other image models ignore it.",
        json_schema_extra=readers(allowed="strictly increasing positive integers, ':'-separated"),
    )
    tier_proportions: str = Field(
        "1:1:1",
        description="Share of the simulation's virtual clients in each tier, one number per tier (0 leaves a "
        "tier out).",
        json_schema_extra=readers(allowed="non-negative numbers with a positive sum, ':'-separated"),
    )
    tier_memory_mb: str = Field(
        "700:850:1100",
        description="Emulated memory budget (MiB) of each tier's nodes in simulation: a node trains the largest "
        "variant whose estimate fits it with runtime-overhead-mb. 'auto' gives each tier a budget between its "
        "own variant's estimate and the next one's.",
        json_schema_extra=readers(allowed="'auto' or non-negative numbers with a positive sum, ':'-separated"),
    )
    tier_widths: str = Field(
        "auto",
        description="Width rate of each tier's variant when tiers are widths (HeteroFL / FedRolex, any method on "
        "a CNN): 'auto' matches the depth variants' parameter counts (CNNs: halves the rate per tier below the "
        "strongest, e.g. 0.25:0.5:1).",
        json_schema_extra=readers(WIDTH_TIER_METHODS, allowed="'auto' or increasing rates in (0, 1] ending at 1"),
    )
    tier_domains: str = Field(
        "",
        description="Per tier, the input domain of its clients' images ('inverted': domain-shifted pools); "
        "'' = all plain. Co-distillation splits its distillation images over the domains.",
        json_schema_extra=readers(
            IMAGE_METHODS, allowed=f"'' or one of {', '.join(map(repr, IMAGE_DOMAINS))} per tier, ':'-separated"
        ),
    )
    runtime_overhead_mb: float = Field(
        450.0,
        ge=0,
        description="Memory (MiB) a client process needs besides training (interpreter, torch, Flower), added "
        "to a variant's estimate when a node picks the largest variant that fits its budget.",
    )
    freeze_word_embeddings: bool = Field(
        True,
        description="Freeze the transformer's word embeddings in local training. Only with a transformer model.",
    )
    pooling: Literal["mean", "cls"] = Field(
        "mean",
        description="Transformer pooler input: 'mean' = the attention-masked mean token state (how "
        "all-MiniLM-L6-v2 was trained; its 2-layer cut learns with it) or 'cls' = BERT's first token. Only with "
        "a transformer model.",
    )
    # sampling and timing
    fraction_train: float = Field(
        1.0, gt=0.0, le=1.0, description="Share of the available nodes sampled for training each round."
    )
    fraction_evaluate: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="Share of the available nodes sampled for federated evaluation each round (0 = none).",
    )
    min_available_nodes: int = Field(1, ge=1, description="Nodes that must be connected before a round starts.")
    min_train_nodes: int = Field(1, ge=1, description="Fewest nodes sampled for training in a round.")
    round_timeout: float = Field(
        3600.0,
        gt=0,
        description="Seconds the ServerApp waits for a round's replies; later replies are dropped.",
    )
    # local training
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="Optimizer of the clients' local training.")
    lr: float = Field(1e-4, gt=0, description="Learning rate of the clients' local training.")
    weight_decay: float = Field(0.0, ge=0, description="Weight decay of the clients' local training.")
    local_steps: int = Field(
        15,
        ge=0,
        description="Optimizer steps of local training per round; 0 = local-epochs full passes over the node's "
        "data instead (pFedKnow's clients: no local training).",
    )
    local_epochs: int = Field(
        1,
        ge=1,
        description="Full passes over the node's training data per round. Only with local-steps = 0.",
        json_schema_extra=readers(registry.names(client="supervised")),
    )
    batch_size: int = Field(
        16,
        ge=1,
        description="Batch size of the clients' local training; the variants' memory estimates assume it.",
    )
    max_seq_len: int = Field(
        48,
        ge=8,
        le=512,
        description="Tokens a text input is truncated to; the transformers' memory estimates assume it. Only "
        "with a transformer model.",
    )
    eval_batch_size: int = Field(
        64, ge=1, description="Batch size of evaluation: the clients' local test data and the server's."
    )
    device: str = Field(
        "cpu",
        description="Where ClientApps train and evaluate and the ServerApp evaluates and distills: 'auto' = a "
        "CUDA GPU when the machine has one. In simulation also give Ray a GPU share per client "
        "(python -m deploy.launch simulation --gpus-per-client 0.25).",
        json_schema_extra=readers(allowed="'cpu', 'auto', 'cuda' or 'cuda:N'"),
    )
    client_threads: int = Field(
        0,
        ge=0,
        description="Torch intra-op threads of each ClientApp process (0 = torch's default, one per core); 1 "
        "where training shares its cores with other processes (SuperNode, SuperLink, Ray, other apps).",
    )
    server_threads: int = Field(
        0,
        ge=0,
        description="Torch intra-op threads of the ServerApp process (0 = torch's default, one per core).",
    )
    # data
    dataset: str = Field(
        "embedded:rotten_tomatoes",
        description="The data: 'embedded:rotten_tomatoes' (text), 'embedded:fashion_mnist' (images), a Hugging "
        "Face id (e.g. 'uoft-cs/cifar10' with image-column = 'img') or a local csv / parquet / json path.",
    )
    text_column: str = Field("text", description="Column holding the input text. Only with a transformer model.")
    image_column: str = Field(
        "image",
        description="Column holding the input image. Only with an image model.",
        json_schema_extra=readers(IMAGE_METHODS),
    )
    label_column: str = Field("label", description="Column holding the integer class label.")
    num_labels: int = Field(
        2, ge=2, description="Number of classes (the models' outputs); checked against the data before round 1."
    )
    partitioner: Literal["iid", "dirichlet"] = Field(
        "iid",
        description="How the training split is divided among the clients: 'iid' (uniformly at random) or "
        "'dirichlet' (label skew set by dirichlet-alpha).",
    )
    dirichlet_alpha: float = Field(
        0.5, gt=0, description="Concentration of the Dirichlet partitioner (smaller = more skewed clients)."
    )
    client_test_fraction: float = Field(
        0.2, gt=0.0, lt=1.0, description="Share of each client's partition held out as its local test data."
    )
    client_test_split: Literal["partition", "held-out"] = Field(
        "partition",
        description="Each client's local test data: 'partition' (a client-test-fraction of its training partition) "
        "or 'held-out' (its label-matched share of the held-out split; it trains on its whole partition).",
    )
    server_test_size: int = Field(
        0, ge=0, description="Held-out examples the server tests on (0 = all: 1,912 Rotten Tomatoes snippets)."
    )
    eval_split: Literal["test", "validation"] = Field(
        "test",
        description="What the server evaluates and the run reports: 'test' (the reported numbers) or "
        "'validation' (a fixed validation-fraction of the training split that no client sees; choose settings "
        "on it, with seeds other than the reported ones).",
    )
    validation_fraction: float = Field(
        0.1,
        gt=0.0,
        lt=1.0,
        description="Share of the training split carved out as the validation split (the same carve for every "
        "seed). Only with eval-split = 'validation'.",
    )
    train_size: int = Field(
        0, ge=0, description="Training examples the clients share (0 = all): a seeded subset, for data-scarce regimes."
    )
    # results
    results_dir: str = Field("results", description="Folder that holds every run's results folder.")
    run_name: str = Field(
        "", description="Name of the run's results folder under results-dir; '' = '<method>-<date>-<time>'."
    )
    # reliability: checkpoints, resume, robust aggregation
    checkpoint_dir: str = Field(
        "",
        description="Where a checkpoint (atomic, checksummed) is written after every round; '' = "
        "<results-dir>/<run-name>/checkpoints.",
    )
    checkpoint_keep: int = Field(2, ge=0, description="How many of the latest checkpoints are kept (0 = none).")
    resume: bool = Field(
        False,
        description="Continue from the last good checkpoint; needs run-name or checkpoint-dir and checkpoint-keep > 0.",
    )
    clip_update_norm: str = Field(
        "0",
        description="Clip each reply's update to this L2 norm before it is aggregated, against poisoned updates: "
        "one bound for every tier or one per tier (0 = off).",
        json_schema_extra=readers(
            methods_where(lambda e: e.client != "unlabeled-pruning"),
            allowed="finite numbers >= 0: one, or one per tier",
        ),
    )
    robust_aggregation: Literal["mean", "median"] = Field(
        "mean",
        description="'median': a coordinate-wise median per tier instead of the mean, against poisoned updates; "
        "it holds every reply of a tier in memory (O(clients x model)).",
        json_schema_extra=readers(methods_where(lambda e: e.median)),
    )

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
        """The checks across keys: those every method shares, then the method's own (``entry.check``)."""
        readers = KEY_METHODS["inclusivefl-server-adam"]
        if self.inclusivefl_server_adam == "shared" and self.method not in readers:
            raise ValueError(
                f"run config 'inclusivefl-server-adam': 'shared' changes InclusiveFL's server step only; "
                f"method {self.method!r} does not use it (set it to 'per-tier' or method = {readers[0]!r})"
            )
        mismatch = self._family_mismatch()
        if mismatch:
            raise ValueError(mismatch)
        members = registry.ARCH_FAMILIES.get(self.model, ()) if self.is_architectures else ()
        if unknown := [t for t in self.tier_names if members and t not in members]:
            raise ValueError(f"run config 'tiers': {unknown} are not {self.model!r} architectures {members}")
        if self.entry.check is not None:
            self.entry.check(self)
        if self.is_codist:
            unknown = [t for t in self.tier_names if t not in CODIST_SIZES]
            if unknown:
                raise ValueError(f"run config 'tiers': pools {unknown} are not model sizes {tuple(CODIST_SIZES)}")
        if self.robust_aggregation == "median" and not self.entry.median:
            why = "its per-node models need every reply" if self.entry.per_node_models else "its own aggregation"
            raise ValueError(
                f"run config 'robust-aggregation': 'median' is not defined for method {self.method!r} "
                f"({why}); use 'mean'"
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

    def _family_mismatch(self) -> str:
        """The error when ``model``'s family is not one the method runs on (``""`` when it is).

        An architecture family names the methods it runs; otherwise a method tied to a family of its
        own says what it needs (``entry.needs_family``), and any other method gets what the family runs.
        """
        kind = self.family_kind
        if kind in self.entry.families:
            return ""
        if kind != "architectures" and self.entry.needs_family:
            return self.entry.needs_family.format(method=self.method, model=self.model)
        if kind == "architectures":
            return (
                f"run config 'method': {self.method!r} does not apply to architecture family {self.model!r}; "
                f"use one of {tuple(FLEXIFED_MODES)}"
            )
        if kind == "codist":
            return (
                f"run config 'method': model {CODIST_MODEL!r} needs a co-distillation method {tuple(CODIST_MODES)}, "
                f"got {self.method!r}"
            )
        return (
            f"run config 'method': {self.method!r} needs a depth-cut model; model {self.model!r} supports {CNN_METHODS}"
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

    def settings_of(self, group: type[GroupT]) -> GroupT:
        """One settings group's values as that group's model: ``cfg.settings_of(CodistGroup).codist_alpha``.

        Raises
        ------
        SettingsGroupError
            When the method's registry entry does not name ``group`` (its keys' reader lists would
            then leave the method out: declare the group in the entry's ``settings``).

        """
        if group not in self.entry.settings:
            named = ", ".join(g.__name__ for g in self.entry.settings) or "none"
            raise SettingsGroupError(
                f"method {self.method!r} reads {group.__name__} but its registry entry names it not "
                f"(its settings: {named}); add it to the entry's settings in experiment/registry.py"
            )
        return group.model_validate({name: getattr(self, name) for name in group.model_fields})

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

    @cached_property
    def experiment(self) -> Experiment:
        """What this configuration describes (family, catalogs, data, training, budgets), derived once.

        Each part is derived on first use and kept (:class:`experiment.resolve.Experiment`); the
        properties and methods below that return such a part read it from here.
        """
        from experiment.resolve import Experiment

        return Experiment(self)

    @property
    def memory_budgets(self) -> dict[str, float]:
        """Emulated memory budget (MiB) per tier (``tier-memory-mb``; ``"auto"`` fits each tier its own variant)."""
        return self.experiment.memory_budgets

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
        return self.experiment.family

    def transformer_spec(self) -> TransformerSpec:
        """The transformer family's settings."""
        return self.experiment.transformer_spec

    def data_spec(self) -> DataSpec:
        """Data settings."""
        return self.experiment.data

    def train_settings(self) -> TrainSettings:
        """Local-training settings."""
        return self.experiment.train

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
        """Width rate per tier: explicit, or "auto" (:attr:`experiment.resolve.Experiment.width_rates`)."""
        return self.experiment.width_rates

    @property
    def catalog(self) -> VariantCatalog:
        """Every tier's variant (:attr:`experiment.resolve.Experiment.catalog`)."""
        return self.experiment.catalog

    @property
    def training_catalog(self) -> VariantCatalog:
        """Variants the method trains: one for AllLarge/ExclusiveFL/AllSmall, else all."""
        return self.experiment.training_catalog


def _declared_methods() -> dict[str, tuple[str, ...]]:
    """``{key: methods}`` of the keys not every method reads.

    A generic key names its methods on its field (:data:`METHODS_EXTRA`); a settings group's key is
    read by the registry entries whose ``settings`` hold its group, narrowed by the field's ``modes``
    / ``but`` (:func:`experiment.method_settings.reads`).
    """
    out = {}
    for name, info in RunConfig.model_fields.items():
        key = info.alias or kebab(name)
        extra = info.json_schema_extra
        group = group_of(name)
        if group is not None:
            out[key] = tuple(e.name for e in registry.METHODS.values() if group in e.settings and reads(e.mode, extra))
            continue
        methods = extra.get(METHODS_EXTRA) if isinstance(extra, dict) else None
        if isinstance(methods, list):
            out[key] = tuple(str(m) for m in methods)
    return out


#: Run-config key -> the methods that read it (registration order), for every key that not all
#: methods read; declared on the key's field (``json_schema_extra``).  A key not in here is read by
#: every method.
KEY_METHODS: Mapping[str, tuple[str, ...]] = _declared_methods()
