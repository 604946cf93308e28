"""The method registry: one entry per federated method, the one table of what each method is.

An entry names the method (the run config's ``method`` value), the model families it runs on,
how its tiers differ (depth, or width of the full model), which variants it trains, what its
clients do, and the factory that builds its server strategy: a function of the method's own
module in ``strategies/`` (``build``), named by a dotted path (``"module:function"``) that only
the ServerApp resolves (:func:`server.app.build_strategy`), so a ClientApp reads the registry
without importing any strategy.  A method missing here fails at start (:func:`lookup`), naming
the ``method`` key, the registered choices and the closest one.

Adding a method: its module in ``strategies/`` (math as pure functions, a thin strategy), its
settings group (:mod:`experiment.method_settings`), its factory ``build`` in that module, and one
:class:`MethodEntry` below (``docs/ADDING_A_METHOD.md``).
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Literal, Protocol

from flwr.app import ConfigRecord

from experiment import method_checks
from experiment.method_settings import (
    CodistGroup,
    DepthFLGroup,
    FlexiFedGroup,
    HeteroFLGroup,
    InclusiveFLGroup,
    PFedKnowGroup,
    ServerAdamGroup,
    ServerTrainingGroup,
    SettingsGroup,
)
from experiment.protocol import DEPTHFL_ROUND_KD_WEIGHT, get_float
from models import cnn
from models.architectures import RESNET_BLOCKS, VGG_CONFIGS
from models.catalog import VariantCatalog
from models.codist import FAMILY as CODIST_MODEL
from models.exits import ExitFamily, exits_logits_and_loss
from models.family import CNNFamily, ModelFamily, TransformerFamily
from models.training import LossFn

#: Model families by what the ``model`` key names: a transformer encoder cut by depth (or width),
#: one of HeteroFL's width-scaled CNNs, an architecture family (FlexiFed's VGGs / ResNets) or the
#: co-distillation CNN pair.
FamilyKind = Literal["transformer", "cnn", "architectures", "codist"]
#: What a method's clients do: train their variant on labeled data, or pFedKnow's unlabeled round
#: (pseudo-labels, pruning, sparse upload).
ClientRole = Literal["supervised", "unlabeled-pruning"]
#: Which variants of the catalog a method trains: all tiers', or one for every node.
Trains = Literal["all", "largest", "smallest"]
#: How a node gets its variant: the largest that fits its memory budget, or the largest of the
#: catalog whatever the budget (AllLarge, the upper bound that ignores memory).
Assign = Literal["choice", "largest"]

if TYPE_CHECKING:
    from experiment.config import RunConfig

#: Architecture families (``model`` value) and their members.
ARCH_FAMILIES: Mapping[str, tuple[str, ...]] = {"vgg": tuple(VGG_CONFIGS), "resnet": tuple(RESNET_BLOCKS)}


class UnknownMethod(ValueError):
    """The run config names a method the registry does not hold."""


class FamilyMismatch(ValueError):
    """A method's model hook got a family it cannot build its models from (its check should have said so)."""


class MethodModels(ModelFamily, Protocol):
    """A method's own model family over the run's (``MethodEntry.family_hook``): it makes the catalog too."""

    def catalog(
        self, tiers: Sequence[tuple[str, int]], *, batch_size: int, optimizer: str, seq_len: int, image_size: int
    ) -> VariantCatalog:
        """The variants of ``tiers`` (``(name, depth)``, weakest first) with their memory estimates."""
        ...


#: ``(run config, the train message's config) -> the loss`` a method's clients train on, where it is
#: not the mean cross-entropy (``MethodEntry.local_loss``).
LocalLoss = Callable[["RunConfig", ConfigRecord], LossFn]


@dataclass(frozen=True)
class MethodEntry:
    """What one method is.

    Attributes
    ----------
    name : str
        The run config's ``method`` value.
    summary : str
        One line: what it does and where it comes from.
    strategy : str
        ``"module:function"`` of the factory ``(RunConfig, MethodEntry, options) ->
        HeterogeneousStrategy`` in the method's strategy module (resolved by the ServerApp only).
    families : frozenset of FamilyKind
        Model families it runs on.
    mode : str
        The strategy module's mode for this entry (e.g. FlexiFed's ``"max"``, co-distillation's
        ``"merged"``, pFedKnow's ablation name); ``""`` where the module has one behaviour.
    width_tiers : bool
        Tiers are width-scaled copies of the full model on every family (HeteroFL, FedRolex); on
        a CNN every method's tiers are widths.
    trains : Trains
        Variants it trains (AllLarge / ExclusiveFL: the largest; AllSmall: the smallest).
    assign : Assign
        How a node gets its variant.
    client : ClientRole
        What its ClientApp does in a train message.
    per_node_models : bool
        It keeps one model per node or per client group.
    median : bool
        Its aggregation has a coordinate-wise median variant (``robust-aggregation = 'median'``):
        not for per-node models (every reply is its own model) nor pFedKnow (sparse uploads,
        masks kept per client); equals its strategy class's ``supports_median``.
    needs_family : str
        For a method tied to a model family of its own (FlexiFed's architectures, co-distillation's
        pools): the error when ``model`` names another family, a template with ``{method}`` and
        ``{model}``; ``""`` = the model family's own message (what it runs instead).
    settings : tuple of SettingsGroup subclasses
        The settings groups the method reads (:mod:`experiment.method_settings`); their keys are
        listed as read by it, and its factory reads each as one object (``cfg.settings_of``).
    check : callable, optional
        The method's own configuration check (:mod:`experiment.method_checks`), run after the
        checks every method shares; raises ``ValueError`` naming the key and the fix.
    family_hook : callable, optional
        For a method with models of its own (DepthFL's exits): ``(run's family, run config) -> the
        method's`` (:class:`MethodModels`), which builds the variants and makes the catalog from
        ``tier-layers``; the run config gives the method's model settings.
    local_loss : callable, optional
        What the clients of a ``supervised`` method minimize when it is not the cross-entropy
        (:data:`LocalLoss`; DepthFL: its exits' self-distillation with the round's weight).

    """

    name: str
    summary: str
    strategy: str
    families: frozenset[FamilyKind]
    mode: str = ""
    width_tiers: bool = False
    trains: Trains = "all"
    assign: Assign = "choice"
    client: ClientRole = "supervised"
    per_node_models: bool = False
    median: bool = True
    needs_family: str = ""
    settings: tuple[type[SettingsGroup], ...] = ()
    check: Callable[[RunConfig], None] | None = None
    family_hook: Callable[[ModelFamily, RunConfig], MethodModels] | None = None
    local_loss: LocalLoss | None = None


_TEXT_OR_CNN: frozenset[FamilyKind] = frozenset({"transformer", "cnn"})
_FLEXIFED: frozenset[FamilyKind] = frozenset({"transformer", "architectures"})
_CODIST: frozenset[FamilyKind] = frozenset({"transformer", "codist"})


_NEEDS_ARCHITECTURES = (
    "run config 'method': {method!r} needs model 'vgg', 'resnet' (architectures as tiers) "
    "or a transformer (depth tiers)"
)
_NEEDS_POOLS = (
    f"run config 'method': {{method!r}} pools are model sizes: model {CODIST_MODEL!r} (images) "
    "or a transformer at tier depths (text), not {model!r}"
)


def _flexifed(name: str, mode: str, summary: str) -> MethodEntry:
    return MethodEntry(
        name,
        summary,
        "strategies.flexifed:build",
        _FLEXIFED,
        mode=mode,
        per_node_models=True,
        median=False,
        needs_family=_NEEDS_ARCHITECTURES,
        settings=(FlexiFedGroup,),
    )


def _codist(name: str, mode: str, summary: str) -> MethodEntry:
    distills = mode != "fedavg"  # the FedAvg baseline has no server distillation
    check = method_checks.server_distillation if distills else None
    return MethodEntry(
        name,
        summary,
        "strategies.codistill:build",
        _CODIST,
        mode=mode,
        needs_family=_NEEDS_POOLS,
        settings=(CodistGroup, ServerTrainingGroup, ServerAdamGroup),
        check=check,
    )


def _pfedknow(name: str, summary: str) -> MethodEntry:
    return MethodEntry(
        name,
        summary,
        "strategies.pfedknow:build",
        _TEXT_OR_CNN,
        mode=name,
        client="unlabeled-pruning",
        median=False,
        settings=(PFedKnowGroup, ServerTrainingGroup),
        check=method_checks.pfedknow,
    )


def _exit_models(family: ModelFamily, cfg: RunConfig) -> MethodModels:
    """DepthFL's models: the run's conv net or transformer cut into depths, an exit after each block.

    The conv net's exits are ``depthfl-exit-head``'s (:mod:`models.exit_heads`).
    """
    if not isinstance(family, CNNFamily | TransformerFamily):
        raise FamilyMismatch(f"DepthFL cuts a conv net or a transformer, not {type(family).__name__}")
    return ExitFamily(family, exit_head=cfg.settings_of(DepthFLGroup).depthfl_exit_head)


def _depthfl_loss(cfg: RunConfig, config: ConfigRecord) -> LossFn:
    """The exits' mutual self-distillation at the round's weight ``w_t`` (from the server), ``depthfl-temperature``."""
    temperature = cfg.settings_of(DepthFLGroup).depthfl_temperature
    return partial(exits_logits_and_loss, weight=get_float(config, DEPTHFL_ROUND_KD_WEIGHT), temperature=temperature)


_ENTRIES: tuple[MethodEntry, ...] = (
    MethodEntry(
        "inclusivefl",
        "InclusiveFL (Liu et al., KDD 2022): depth tiers, layer-wise aggregation, momentum distillation",
        "strategies.inclusivefl:build",
        frozenset({"transformer"}),
        settings=(InclusiveFLGroup, ServerAdamGroup),
    ),
    MethodEntry(
        "all-large",
        "AllLarge: every node trains the largest model, memory ignored (InclusiveFL's upper bound)",
        "strategies.baselines:build_one_variant",
        _TEXT_OR_CNN,
        trains="largest",
        assign="largest",
        settings=(ServerAdamGroup, HeteroFLGroup),
    ),
    MethodEntry(
        "all-small",
        "AllSmall: every node trains the smallest model (InclusiveFL's baseline)",
        "strategies.baselines:build_one_variant",
        _TEXT_OR_CNN,
        trains="smallest",
        settings=(ServerAdamGroup, HeteroFLGroup),
    ),
    MethodEntry(
        "exclusive",
        "ExclusiveFL: only the nodes that fit the largest model train it (InclusiveFL's baseline)",
        "strategies.baselines:build_one_variant",
        _TEXT_OR_CNN,
        trains="largest",
        settings=(ServerAdamGroup, HeteroFLGroup),
    ),
    MethodEntry(
        "local",
        "Local: every node trains its own tier model alone, no aggregation (cross-silo baseline)",
        "strategies.baselines:build_local",
        frozenset({"transformer"}),
        per_node_models=True,
        median=False,
    ),
    MethodEntry(
        "heterofl",
        "HeteroFL (Diao et al., ICLR 2021): width-scaled sub-models, element-wise coverage averaging",
        "strategies.heterofl:build",
        _TEXT_OR_CNN,
        mode="static",
        width_tiers=True,
        settings=(HeteroFLGroup, ServerAdamGroup),
    ),
    MethodEntry(
        "fedrolex",
        "FedRolex (Alam et al., NeurIPS 2022): HeteroFL with rolling sub-model windows",
        "strategies.heterofl:build",
        _TEXT_OR_CNN,
        mode="rolling",
        width_tiers=True,
        settings=(HeteroFLGroup, ServerAdamGroup),
    ),
    _flexifed("flexifed-basic", "basic", "FlexiFed Basic-Common (Wang et al., WWW 2022): the common prefix of all"),
    _flexifed("flexifed-clustered", "clustered", "FlexiFed Clustered-Common: common prefixes within clusters"),
    _flexifed("flexifed-max", "max", "FlexiFed Max-Common: the largest common prefix of every pair"),
    _flexifed("clustered-fl", "clustered-fl", "Clustered-FL: FedAvg within each architecture (FlexiFed's baseline)"),
    _flexifed("standalone", "standalone", "Standalone: every node trains alone (FlexiFed's baseline)"),
    _codist("codist-merged", "merged", "MergedCodist (federated co-distillation): server distillation every round"),
    _codist("codist-periodic", "periodic", "PeriodicCodist: server co-distillation every codist-period rounds"),
    _codist("codist-fedavg", "fedavg", "FedAvg per model-size pool (the co-distillation baseline)"),
    _pfedknow("pfedknow", "pFedKnow (seed 002): unlabeled clients, pruning, knowledge distillation"),
    _pfedknow("pfedknow-as1", "pFedKnow ablation AS-1: Semi-FedAvg (no pruning, no pretrained model)"),
    _pfedknow("pfedknow-as2", "pFedKnow ablation AS-2: pruning, no distillation, zero-filled averaging"),
    _pfedknow("pfedknow-as3", "pFedKnow ablation AS-3: no pretrained model (no teacher)"),
    _pfedknow("pfedknow-as4", "pFedKnow ablation AS-4: no pruning (dense uploads)"),
    _pfedknow("semifl", "SemiFL-style baseline: pseudo-labels kept at semifl-confidence, FedAvg, fine-tuning"),
    MethodEntry(
        "depthfl",
        "DepthFL (Kim et al., ICLR 2023): depth sub-models with an exit per block, self-distillation among them",
        "strategies.depthfl:build",
        _TEXT_OR_CNN,
        settings=(DepthFLGroup,),
        check=method_checks.depthfl,
        family_hook=_exit_models,
        local_loss=_depthfl_loss,
    ),
)

#: Every registered method by name, in registration order.
METHODS: Mapping[str, MethodEntry] = {e.name: e for e in _ENTRIES}


def family_kind(model: str) -> FamilyKind:
    """The family the ``model`` key names (anything that is no CNN, architecture or codist pair: a transformer)."""
    if model in cnn.MODEL_NAMES:
        return "cnn"
    if model in ARCH_FAMILIES:
        return "architectures"
    if model == CODIST_MODEL:
        return "codist"
    return "transformer"


def lookup(name: str) -> MethodEntry:
    """The entry of ``name``.

    Raises
    ------
    UnknownMethod
        Naming the ``method`` key, the registered choices and the closest name.

    """
    entry = METHODS.get(name)
    if entry is None:
        raise UnknownMethod(unknown_method_message(name))
    return entry


def unknown_method_message(name: str, *, key: bool = True) -> str:
    """``run config 'method': 'x' is not a registered method (did you mean 'y'?); choices: ...``.

    ``key = False`` leaves out the ``run config 'method': `` prefix (for a validator whose
    caller names the key).
    """
    close = difflib.get_close_matches(name, list(METHODS), n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    prefix = "run config 'method': " if key else ""
    return f"{prefix}{name!r} is not a registered method{hint}; choices: {', '.join(METHODS)}"


def names(
    *, family: FamilyKind | None = None, client: ClientRole | None = None, width_tiers: bool | None = None
) -> tuple[str, ...]:
    """Registered method names (registration order) with the given facts; no filter = all."""
    return tuple(
        e.name
        for e in _ENTRIES
        if (family is None or family in e.families)
        and (client is None or e.client == client)
        and (width_tiers is None or e.width_tiers == width_tiers)
    )


def modes(family: FamilyKind) -> dict[str, str]:
    """``{method: mode}`` of the methods that run on ``family`` (registration order).

    The views the configuration checks use for the families with their own methods
    (``"architectures"``: FlexiFed's, ``"codist"``: co-distillation's).
    """
    return {e.name: e.mode for e in _ENTRIES if family in e.families}


class FactoryNotFound(LookupError):
    """An entry's ``strategy`` path names no callable."""


def load_factory(entry: MethodEntry) -> Callable[..., object]:
    """Import the callable ``entry.strategy`` names (``"module:function"``); only the ServerApp calls this.

    Raises
    ------
    FactoryNotFound
        When the module or the function does not exist, naming the method and the path.

    """
    module_name, _, attr = entry.strategy.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise FactoryNotFound(f"method {entry.name!r}: strategy factory {entry.strategy!r} not found ({exc})") from exc
    if not callable(factory):
        raise FactoryNotFound(f"method {entry.name!r}: strategy factory {entry.strategy!r} is not callable")
    return factory
