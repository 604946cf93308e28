"""Each method's settings group: the run-config keys only some methods read, one pydantic model each.

A registry entry names the groups its method reads (``MethodEntry.settings``); the run
configuration (:class:`experiment.config.RunConfig`) is the generic keys plus every group, so
the keys stay flat ``--run-config`` pairs, as Flower requires, and every key is validated
before round 1 whatever the method.  A strategy factory reads its group as one typed object,
``cfg.settings_of(CodistGroup).codist_alpha``.

Which methods read a key is derived from the registry: the entries whose ``settings`` hold the
key's group, narrowed by the field's ``modes`` (only entries of these modes) or ``but`` (not
these) in its ``json_schema_extra`` (:func:`readers`).  ``docs/CONFIG_KEYS.md`` shows them.

Adding a method: its group here (its keys' defaults also go to ``pyproject.toml``, which Flower
requires), its entry in :mod:`experiment.registry` naming the group, and :class:`AllGroups`
gains it as a base.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.config import JsonDict, JsonValue

#: The ``json_schema_extra`` entries of a group field: only the entries of these modes read it /
#: every entry of the group but these modes; a string field's accepted values.
MODES_EXTRA, BUT_EXTRA, ALLOWED_EXTRA = "modes", "but", "allowed"

#: pFedKnow's modes (the registry's ``mode``, here equal to the method name) by what they use;
#: ``tests/test_config_keys.py`` checks them against :data:`strategies.pfedknow_modes.MODES`.
PFEDKNOW_PRUNING = ("pfedknow", "pfedknow-as2", "pfedknow-as3")
PFEDKNOW_TEACHER = ("pfedknow", "pfedknow-as4")
#: Modes whose server distills (collaborative distillation) or distills at initialization (teacher).
PFEDKNOW_TEMPERATURE = ("pfedknow", "pfedknow-as3", "pfedknow-as4")
#: The one mode that trains nothing on the server each round (zero-filled averaging).
PFEDKNOW_NO_SERVER_TRAINING = ("pfedknow-as2",)
#: The one mode that filters pseudo-labels by confidence (``semifl-confidence``, not ``pfedknow-delta``).
SEMIFL = ("semifl",)
#: Co-distillation's modes that distill on the server, and its baseline that does not.
CODIST_DISTILLING = ("merged", "periodic")
NO_DISTILLATION = ("fedavg",)


def kebab(name: str) -> str:
    """A field name as its run-config key: ``num_server_rounds`` -> ``num-server-rounds``."""
    return name.replace("_", "-")


def _readers(*, modes: Iterable[str] = (), but: Iterable[str] = (), allowed: str = "") -> JsonDict:
    """A group field's ``json_schema_extra``: which of the group's entries read it, its accepted values."""
    extra: JsonDict = {}
    if modes:
        only: list[JsonValue] = list(modes)
        extra[MODES_EXTRA] = only
    if but:
        excluded: list[JsonValue] = list(but)
        extra[BUT_EXTRA] = excluded
    if allowed:
        extra[ALLOWED_EXTRA] = allowed
    return extra


def reads(mode: str, extra: object) -> bool:
    """Whether an entry of ``mode`` whose settings hold a field reads it (the field's ``modes`` / ``but``)."""
    if not isinstance(extra, dict):
        return True
    only, excluded = extra.get(MODES_EXTRA), extra.get(BUT_EXTRA)
    return (not isinstance(only, list) or mode in only) and (not isinstance(excluded, list) or mode not in excluded)


class SettingsGroup(BaseModel):
    """Base of every settings group and of RunConfig: flat kebab-case keys, frozen, unknown keys refused."""

    model_config = ConfigDict(alias_generator=kebab, populate_by_name=True, extra="forbid", frozen=True)


GroupT = TypeVar("GroupT", bound=SettingsGroup)


class InclusiveFLGroup(SettingsGroup):
    """InclusiveFL's own keys (Liu et al., KDD 2022): momentum distillation and the order of its server step."""

    beta: float = Field(
        0.2,
        ge=0.0,
        le=1.0,
        description="InclusiveFL's momentum distillation: a tier's top-layer update becomes beta x the next "
        "deeper tier's layer momentum + (1 - beta) x its own (0 = InclusiveFL without momentum distillation).",
    )
    inclusivefl_server_adam: Literal["per-tier", "shared"] = Field(
        "per-tier",
        description="InclusiveFL's server step: 'per-tier' FedAdam then layer averaging (the paper), or "
        "'shared': the shared layers' updates averaged over the tiers first, then one FedAdam step (a diagnosis "
        "variant).",
    )


class ServerAdamGroup(SettingsGroup):
    """The server optimizer FedAdam (Reddi et al., ICLR 2021), of the methods that step their server models with it."""

    server_lr: float = Field(
        1e-3,
        gt=0,
        description="Server FedAdam learning rate eta (co-distillation: of every pool unless tier-server-lr; "
        "HeteroFL / FedRolex: only with heterofl-server-optimizer = 'fedadam').",
    )
    server_beta1: float = Field(
        0.9,
        ge=0.0,
        lt=1.0,
        description="Server FedAdam's first-moment decay beta1 (where server-lr applies).",
    )
    server_beta2: float = Field(
        0.99,
        ge=0.0,
        lt=1.0,
        description="Server FedAdam's second-moment decay beta2 (where server-lr applies).",
    )
    server_tau: float = Field(
        1e-5,
        gt=0,
        description="Server FedAdam's adaptivity tau, added to the root of the second moment (where server-lr "
        "applies).",
    )


class HeteroFLGroup(SettingsGroup):
    """HeteroFL's / FedRolex's server rule (also the one-variant baselines' on a CNN)."""

    heterofl_server_optimizer: Literal["average", "fedadam"] = Field(
        "average",
        description="HeteroFL / FedRolex server rule: 'average' (the original coverage averaging) or 'fedadam' "
        "(the averaged update applied by FedAdam, as the InclusiveFL paper runs its baselines). all-large, "
        "all-small and exclusive use it on a CNN (HeteroFL's server on one width).",
    )


class FlexiFedGroup(SettingsGroup):
    """FlexiFed's layer sharing (Wang et al., WWW 2023)."""

    flexifed_uniform: bool = Field(
        False,
        description="FlexiFed weights every client's layers equally (the paper's 1 / |U|) instead of by its "
        "example count.",
        json_schema_extra=_readers(but=("standalone",)),
    )
    flexifed_share_classifier: bool = Field(
        False,
        description="FlexiFed averages classifier layers with equal signatures across architectures (by "
        "default only identical architectures share a classifier).",
        json_schema_extra=_readers(modes=("basic", "clustered", "max")),
    )


class CodistGroup(SettingsGroup):
    """Federated co-distillation's pools and their server distillation (seed 003)."""

    codist_alpha: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description="MergedCodist's mix of each pool's FedAvg update g and distillation update d: "
        "alpha g + (1 - alpha) d norm(g) / norm(d) (1 = plain FedAvg).",
        json_schema_extra=_readers(modes=("merged",)),
    )
    codist_merge_start: int = Field(
        1,
        ge=1,
        description="MergedCodist's first distilling round: earlier rounds apply the FedAvg update alone "
        "(alpha = 1, no distillation); 1 = every round (the paper's Algorithm 2).",
        json_schema_extra=_readers(modes=("merged",)),
    )
    codist_moment_reset: int = Field(
        0,
        ge=0,
        description="Reset every pool's FedAdam moments after every codist-moment-reset-th round (0 = never); "
        "a control, not in the paper: PeriodicCodist's reset after each distillation, without the distillation.",
        json_schema_extra=_readers(modes=("merged", "fedavg")),
    )
    codist_server_lr_decay: bool = Field(
        True,
        description="Decay every pool's FedAdam eta linearly to 0 over the rounds (the paper's schedule, "
        "Appendix C.3); false = a constant eta, a diagnosis, not in the paper (the distillation's learning "
        "rate decays either way).",
    )
    codist_period: int = Field(
        5,
        ge=1,
        description="PeriodicCodist distills every pool from the others every codist-period rounds.",
        json_schema_extra=_readers(modes=("periodic",)),
    )
    codist_membership: Literal["instead", "also"] = Field(
        "also",
        description="Which pools a node trains: 'also' = every pool up to the largest its memory fits (the "
        "paper's nested pools), 'instead' = only that largest one.",
    )
    tier_server_lr: str = Field(
        "",
        description="Co-distillation's FedAdam eta per pool, e.g. '0.03:0.01'; '' = server-lr for every pool.",
        json_schema_extra=_readers(allowed="'' or positive numbers, one per tier"),
    )
    distill_lambda: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="Co-distillation's student regularization: each pool's distillation target mixes the "
        "teachers' distribution with weight 1 - lambda and the student's own at the start with lambda.",
        json_schema_extra=_readers(but=NO_DISTILLATION),
    )
    distill_data: Literal["out-of-domain", "crops", "headlines", "in-domain"] = Field(
        "out-of-domain",
        description="Co-distillation's unlabeled server data: 'out-of-domain' = 'crops' (scikit-image photo "
        "crops) for images or 'headlines' (Guardian headlines) for text; 'in-domain' = training inputs without "
        "their labels.",
        json_schema_extra=_readers(but=NO_DISTILLATION),
    )
    distill_size: int = Field(
        2000,
        ge=1,
        description="Examples in co-distillation's unlabeled distillation set.",
        json_schema_extra=_readers(but=NO_DISTILLATION),
    )


class ServerTrainingGroup(SettingsGroup):
    """The server-side training: co-distillation's distillation of a pool; pFedKnow's distillation and fine-tuning."""

    distill_steps: int = Field(
        32,
        ge=0,
        description="Adam steps of each server-side training: co-distillation's distillation of a pool (every "
        "round: merged; every codist-period rounds: periodic); pFedKnow's per-round collaborative distillation "
        "of every upload, or its fine-tuning of the averaged model on the labeled set.",
        json_schema_extra=_readers(but=(*NO_DISTILLATION, *PFEDKNOW_NO_SERVER_TRAINING)),
    )
    distill_temperature: float = Field(
        1.0,
        gt=0.0,
        description="Softmax temperature of the server's distillation losses (pFedKnow: also of the initial "
        "model's distillation from the teacher).",
        json_schema_extra=_readers(but=NO_DISTILLATION, modes=(*CODIST_DISTILLING, *PFEDKNOW_TEMPERATURE)),
    )
    distill_lr: float = Field(
        1e-3,
        ge=0.0,
        description="Adam learning rate of the server-side training that distill-steps counts.",
        json_schema_extra=_readers(but=(*NO_DISTILLATION, *PFEDKNOW_NO_SERVER_TRAINING)),
    )
    distill_batch_size: int = Field(
        64,
        ge=1,
        description="Batch size of the server's training: co-distillation's unlabeled batches; pFedKnow's "
        "labeled-set batches, also when it trains the teacher and the initial model.",
        json_schema_extra=_readers(but=NO_DISTILLATION),
    )


class PFedKnowGroup(SettingsGroup):
    """pFedKnow (seed 002), its ablations and the SemiFL-style baseline: pseudo-labels, pruning, D_s, the teacher."""

    pfedknow_delta: float = Field(
        0.7,
        gt=0.0,
        le=1.0,
        description="Clients keep the pseudo-labels whose uncertainty is <= delta (images: evidential; text: "
        "1 - max softmax).",
        json_schema_extra=_readers(but=SEMIFL),
    )
    pfedknow_prune_ratio: float = Field(
        0.2,
        ge=0.0,
        lt=1.0,
        description="Target pruning ratio, reached after pfedknow-prune-rounds rounds: the share of channels "
        "(conv: network slimming) or of the weight matrices' weights (transformers: magnitude pruning) removed.",
        json_schema_extra=_readers(modes=PFEDKNOW_PRUNING),
    )
    pfedknow_prune_rounds: int = Field(
        3,
        ge=1,
        description="Rounds over which the pruning ratio ramps up to pfedknow-prune-ratio.",
        json_schema_extra=_readers(modes=PFEDKNOW_PRUNING),
    )
    pfedknow_l1: float = Field(
        1e-4,
        ge=0.0,
        description="Network slimming's L1 weight on the batch-norm scales in client training. Only with "
        "model = 'conv' (magnitude pruning ignores it).",
        json_schema_extra=_readers(modes=PFEDKNOW_PRUNING),
    )
    pfedknow_labeled_size: int = Field(
        1000,
        ge=1,
        description="Labeled training examples the server keeps (D_s), carved out of the training split before "
        "the clients' partitions.",
    )
    pfedknow_teacher_public_size: int = Field(
        0,
        ge=0,
        description="Further labeled training examples only the teacher is trained on, besides D_s: a stand-in "
        "for the paper's teacher pretrained on public data where no pretrained model is installable. Carved out "
        "of the training split after D_s, for every pFedKnow method (the ablations' clients hold the same data). "
        "0 = the teacher learns D_s only.",
    )
    pfedknow_teacher_scale: float = Field(
        2.0,
        ge=1.0,
        description="Width factor of the image teacher over the lightweight conv model. Only with "
        "model = 'conv' (a transformer's teacher is its full depth).",
        json_schema_extra=_readers(modes=PFEDKNOW_TEACHER),
    )
    pfedknow_teacher_steps: int = Field(
        300,
        ge=0,
        description="Adam steps training the teacher on the server's labeled set at the start of the run.",
        json_schema_extra=_readers(modes=PFEDKNOW_TEACHER),
    )
    pfedknow_init_steps: int = Field(
        200,
        ge=0,
        description="Adam steps training the initial lightweight model on the server's labeled set (distilled "
        "from the teacher where there is one).",
    )
    pfedknow_init_lr: float = Field(
        1e-3,
        gt=0.0,
        description="Adam learning rate of the teacher's and the initial lightweight model's training.",
    )
    semifl_confidence: float = Field(
        0.95,
        gt=0.0,
        lt=1.0,
        description="SemiFL's clients keep the pseudo-labels whose max softmax is >= this confidence.",
        json_schema_extra=_readers(modes=SEMIFL),
    )


class DepthFLGroup(SettingsGroup):
    """DepthFL's keys (Kim et al., ICLR 2023): the exits' mutual self-distillation and the holder weights."""

    depthfl_kd_weight: float = Field(
        1.0,
        ge=0.0,
        description="DepthFL's weight w of the mutual self-distillation among a client's exits (0 = DepthFL "
        "without self-distillation).",
    )
    depthfl_kd_rampup_rounds: int = Field(
        0,
        ge=0,
        description="DepthFL ramps the distillation weight up over this many rounds, w exp(-5 (1 - t/R)^2) "
        "(0 = w from round 1; Flower's baseline uses 300).",
    )
    depthfl_temperature: float = Field(
        1.0, gt=0.0, description="DepthFL's distillation temperature T (the KL terms are scaled by T^2)."
    )
    depthfl_uniform: bool = Field(
        False,
        description="DepthFL averages each layer over its holders with equal weights (Flower's baseline) instead "
        "of by their example counts.",
    )
    depthfl_exit_head: Literal["linear", "bottleneck"] = Field(
        "linear",
        description="The conv net's exits: 'linear' (global average pooling and one linear layer after each "
        "block) or 'bottleneck' (separable convolutions bring a block's features to the last block's channels "
        "first, as DepthFL's shallow classifiers do; models/exit_heads.py). The ResNet's and the transformer's "
        "exits have their own form.",
    )


#: Every group, in the order the key reference lists them.
GROUPS: tuple[type[SettingsGroup], ...] = (
    CodistGroup,
    ServerTrainingGroup,
    FlexiFedGroup,
    HeteroFLGroup,
    InclusiveFLGroup,
    ServerAdamGroup,
    PFedKnowGroup,
    DepthFLGroup,
)


class AllGroups(
    DepthFLGroup,
    PFedKnowGroup,
    ServerAdamGroup,
    InclusiveFLGroup,
    HeteroFLGroup,
    FlexiFedGroup,
    ServerTrainingGroup,
    CodistGroup,
):
    """Every group's keys in one flat model: what :class:`experiment.config.RunConfig` adds to the generic keys."""


def group_of(field: str) -> type[SettingsGroup] | None:
    """The group that declares ``field`` (a field name), or ``None`` for a generic key."""
    return next((g for g in GROUPS if field in g.model_fields), None)
