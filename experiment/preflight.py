"""Which variant each tier's nodes will train, decided before anything starts (issue 23).

A node takes the largest variant of the catalog the server offers whose estimated training
memory fits its budget with the runtime overhead (:func:`models.catalog.choose_variant`); in
simulation a tier's nodes all have the tier's emulated budget (``tier-memory-mb``), so the
whole run's assignment is known from the run config and the node count alone.  That is what
lets a launcher refuse, before a SuperLink or Ray starts, a run in which no node can train, and
warn about one in which a tier's variant trains on no node (the run would look heterogeneous
and not be).  The ServerApp sees the same facts later, node by node, in the handshake.

The checks that need no node count -- the model and the data resolve (:func:`check_model`,
:func:`check_dataset`), keys that change nothing (:func:`no_effect_warnings`) -- run in the
launcher's pre-flight (:mod:`deploy.preflight`) and again at the ServerApp's start
(:func:`start_checks`), for ``flwr run`` users.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import try_to_load_from_cache

from experiment.config import KEY_METHODS, ConfigError, RunConfig
from experiment.registry import ARCH_FAMILIES
from models import cnn
from models.catalog import choose_variant, tier_counts
from models.codist import FAMILY as CODIST_MODEL
from models.data import EMBEDDED_PREFIX, EMBEDDED_SETS
from models.transformer import EMBEDDED_MODEL, TINY_MODEL


class NothingCanTrain(ConfigError):
    """No node of the run fits any variant the method trains; names the keys that fix it."""


@dataclass(frozen=True)
class TierAssignment:
    """What one tier's nodes will do.

    Attributes
    ----------
    tier : str
        The tier.
    nodes : int
        How many nodes the tier has.
    budget_mb : float
        Each node's memory budget (MiB).
    variant : str or None
        The variant they take; ``None``: they decline.
    reason : str
        :func:`~models.catalog.choose_variant`'s reason.

    """

    tier: str
    nodes: int
    budget_mb: float
    variant: str | None
    reason: str


def simulated_tier_nodes(cfg: RunConfig, num_nodes: int) -> dict[str, int]:
    """Nodes per tier of a simulation with ``num_nodes`` virtual clients (``tier-proportions``)."""
    return dict(zip(cfg.tier_names, tier_counts(num_nodes, cfg.proportions), strict=True))


def plan_tiers(cfg: RunConfig, nodes_per_tier: Mapping[str, int]) -> list[TierAssignment]:
    """Each tier's variant, as its nodes will choose it from the method's training catalog.

    Nodes take the largest variant whatever their budget when the method assigns ``largest``
    (AllLarge).
    """
    catalog = cfg.training_catalog
    estimates = {v.name: float(v.memory.total_mb) for v in catalog}
    budgets = cfg.memory_budgets
    plan = []
    for tier, nodes in nodes_per_tier.items():
        if tier not in budgets:
            raise ConfigError(f"node tier {tier!r} is not one of the run's tiers {list(budgets)} (run config 'tiers')")
        budget = budgets[tier]
        if cfg.entry.assign == "largest":
            variant: str | None = catalog.largest.name
            reason = "every node trains the largest variant (memory ignored)"
        else:
            variant, reason = choose_variant(estimates, budget, cfg.runtime_overhead_mb)
        plan.append(TierAssignment(tier, nodes, budget, variant, reason))
    return plan


def check_plan(cfg: RunConfig, plan: list[TierAssignment]) -> list[str]:
    """Raise :class:`NothingCanTrain` when no node can train; return warnings about the rest.

    Warnings: a tier with no node (too few nodes for its proportion); for a method that trains
    every tier's variant (``trains = "all"``), a tier whose nodes decline and a variant no
    tier's nodes train -- then that part of the model never learns and the run is less
    heterogeneous than its tiers say.  Methods that train one variant (ExclusiveFL, AllSmall)
    leave the nodes that do not fit it out by design.
    """
    training = [a for a in plan if a.nodes > 0 and a.variant is not None]
    if not training:
        declined = "; ".join(f"tier {a.tier} ({a.nodes} nodes): {a.reason}" for a in plan if a.nodes > 0)
        raise NothingCanTrain(
            f"no node can train: {declined}; give the tiers budgets their variants fit (run config "
            "'tier-memory-mb', e.g. 'auto' in simulation, or a lower 'runtime-overhead-mb') or a smaller 'model'"
        )
    proportion = dict(zip(cfg.tier_names, cfg.proportions, strict=True))
    warnings = [
        f"tier {a.tier!r} has no node ({sum(b.nodes for b in plan)} nodes split {cfg.tier_proportions}): "
        "add nodes or change 'tier-proportions'"
        for a in plan
        if a.nodes == 0 and proportion.get(a.tier, 1.0) > 0  # a proportion of 0 leaves a tier out on purpose
    ]
    if cfg.entry.trains != "all":
        return warnings
    for a in plan:
        if a.nodes > 0 and a.variant is None:
            warnings.append(f"tier {a.tier!r} ({a.nodes} nodes) trains nothing: {a.reason}")
    chosen = {a.variant for a in training}
    by_tier = {a.tier: a for a in plan}
    for variant in cfg.training_catalog.names():
        own_tier = by_tier.get(variant)
        if variant in chosen or (own_tier is not None and own_tier.nodes == 0):  # no node of its tier: said above
            continue
        takers = ", ".join(f"{a.tier} -> {a.variant}" for a in training)
        warnings.append(
            f"variant {variant!r} trains on no node ({takers}): its tier's budget fits another variant; "
            "give each tier its own variant with tier-memory-mb='auto' (simulation) or other budgets"
        )
    return warnings


def _owners(key: str) -> tuple[str, ...] | None:
    """The methods that read ``key``, as its field in :class:`~experiment.config.RunConfig` declares them.

    ``None``: every method reads it (or it is no run-config key).
    """
    return KEY_METHODS.get(key)


def no_effect_warnings(cfg: RunConfig, overridden: Iterable[str]) -> list[str]:
    """Warnings for keys the user set that change nothing in this configuration.

    ``local-epochs`` while ``local-steps`` > 0 (steps win); ``dirichlet-alpha`` without the
    Dirichlet partitioner; ``client-test-fraction`` with ``client-test-split = "held-out"``; a key
    that the method does not read (``beta``, ``codist-*``, ``pfedknow-*``, ...: the methods each
    key's field declares, :data:`experiment.config.KEY_METHODS`).
    """
    out = []
    keys = set(overridden)
    epochs_unused = "local-epochs" in keys and cfg.local_steps > 0
    if epochs_unused:
        out.append(
            f"'local-epochs' has no effect: local-steps = {cfg.local_steps} sets the local training "
            "(set local-steps=0 to train local-epochs epochs)"
        )
    if "dirichlet-alpha" in keys and cfg.partitioner != "dirichlet":
        out.append(
            f"'dirichlet-alpha' has no effect with partitioner = {cfg.partitioner!r} (set partitioner='dirichlet')"
        )
    if "client-test-fraction" in keys and cfg.client_test_split == "held-out":
        out.append(
            "'client-test-fraction' has no effect with client-test-split = 'held-out': each client tests on its "
            "label-matched share of the held-out split and trains on its whole partition "
            "(set client-test-split='partition' to hold out a fraction of each partition)"
        )
    for key in sorted(keys - ({"local-epochs"} if epochs_unused else set())):  # said once is enough
        owners = _owners(key)
        if owners is not None and cfg.method not in owners:
            out.append(f"{key!r} has no effect with method = {cfg.method!r}: only {', '.join(sorted(owners))} read it")
    return out


#: File endings that make a ``dataset`` value a path (a missing one is an error, never a hub id).
_PATH_SUFFIXES = (".csv", ".json", ".jsonl", ".parquet", ".txt", ".tsv", ".arrow", ".bz2", ".gz")


class PreflightError(ConfigError):
    """The run cannot do what was asked; ``str(exc)`` names the key and the fix."""


def shipped_models() -> list[str]:
    """``model`` values that need no download: the embedded transformers and every image family."""
    return [EMBEDDED_MODEL, TINY_MODEL, *cnn.MODEL_NAMES, *ARCH_FAMILIES, CODIST_MODEL]


def _in_hub_cache(repo_id: str, filename: str, repo_type: str = "model") -> bool:
    try:
        found = try_to_load_from_cache(repo_id, filename, repo_type=repo_type)
    except Exception:  # an id the hub client rejects (e.g. a path with spaces) is not cached
        return False
    return isinstance(found, str)


def check_model(cfg: RunConfig, cwd: Path) -> str | None:
    """Raise for a ``model`` that is a typo of a shipped one; return a warning for one to be downloaded."""
    shipped = shipped_models()
    model = cfg.model
    if model in shipped or (cwd / model).expanduser().is_dir() or Path(model).expanduser().is_dir():
        return None
    if _in_hub_cache(model, "config.json"):
        return None
    close = difflib.get_close_matches(model, shipped, n=1, cutoff=0.6)
    if close or "/" not in model:
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise PreflightError(
            f"run config 'model': {model!r} is not a shipped model ({', '.join(shipped)}), a local folder "
            f"or a Hugging Face hub id ('org/name'); {hint}"
            "a hub id is fetched from the hub at start"
        )
    return f"model {model!r} is not in the local Hugging Face cache: every process will fetch it from the hub"


def check_dataset(cfg: RunConfig, cwd: Path) -> str | None:
    """Raise for a ``dataset`` that looks like a path and does not exist; warn for one to be downloaded."""
    name = cfg.dataset
    if name.startswith(EMBEDDED_PREFIX):
        if name[len(EMBEDDED_PREFIX) :] not in EMBEDDED_SETS:
            shipped = [EMBEDDED_PREFIX + s for s in EMBEDDED_SETS]
            close = difflib.get_close_matches(name, shipped, n=1, cutoff=0.6)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise PreflightError(f"run config 'dataset': {name!r} is not shipped{hint}; shipped: {shipped}")
        return None
    path = Path(name).expanduser()
    if path.exists() or (cwd / path).exists():
        return None
    looks_like_path = name.startswith((".", "/", "~")) or name.lower().endswith(_PATH_SUFFIXES) or name.count("/") > 1
    if looks_like_path:
        raise PreflightError(
            f"run config 'dataset': no file or folder {name!r} (relative paths are read from {cwd}); "
            "a Hugging Face hub dataset is given by its id 'org/name'"
        )
    if _in_hub_cache(name, "README.md", repo_type="dataset"):
        return None
    return f"dataset {name!r} is neither shipped nor local: it is fetched from the Hugging Face hub at start"


def changed_keys(cfg: RunConfig) -> list[str]:
    """The run-config keys whose value differs from its declared default (what a user set).

    The ServerApp sees Flower's merged run config, not the user's overrides: a key set to its
    default is indistinguishable from one left alone, and changes nothing either way.
    """
    fields = type(cfg).model_fields
    return [
        info.alias or name.replace("_", "-")
        for name, info in fields.items()
        if not info.is_required() and getattr(cfg, name) != info.get_default(call_default_factory=True)
    ]


def start_checks(cfg: RunConfig, cwd: Path) -> tuple[list[str], list[str]]:
    """The ServerApp's pre-flight: raise for a model or data that cannot resolve; return notes and warnings.

    The same checks and messages as the launcher's (:func:`check_model`, :func:`check_dataset`,
    :func:`no_effect_warnings` over :func:`changed_keys`), so that a ``flwr run`` user meets a
    typo of a model as the key and the closest shipped name, not as a hub connection error.
    Notes: a model or dataset to be fetched from the hub; warnings: keys that change nothing.
    """
    notes = [n for n in (check_model(cfg, cwd), check_dataset(cfg, cwd)) if n is not None]
    return notes, no_effect_warnings(cfg, changed_keys(cfg))
