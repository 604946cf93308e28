"""Pre-flight: check a run's whole configuration before any SuperLink, SuperNode or Ray starts (issue 23).

What Flower and the apps would find only after start-up (a SuperLink, the FAB install, Ray and
the ServerApp take half a minute or more), found here in seconds, with the key and the fix:

1. the override keys are declared in ``pyproject.toml`` (Flower rejects others with "Invalid
   run configuration" and no key; here: the key and the closest declared one);
2. the merged run config validates (:meth:`experiment.config.RunConfig.from_flower`: values,
   method/model/data compatibility, a registered method with "did you mean");
3. the model resolves: shipped, a local folder, or a hub id in the local cache -- else a hub id
   it would fetch (a warning) or a typo of a shipped name (an error);
4. the data resolves: shipped (``embedded:``), a local path, or a hub id (a path that does not
   exist is an error, not a hub id); then a Dirichlet partitioning every client would draw is
   drawn (flwr-datasets gives up on one it cannot draw);
5. the tiers: the variant each tier's nodes will take (:mod:`experiment.preflight`): an error
   when no node can train, warnings when a tier or a variant trains nowhere.

Checks 2-3, the data's resolution and the keys without effect live in :mod:`experiment.preflight`,
where the ServerApp runs them too (for ``flwr run`` users, who start without this launcher).
Nothing here imports the ClientApp or the ServerApp.
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click
import datasets
from flwr.common.config import parse_config_args

from experiment.config import RunConfig
from experiment.preflight import (
    PreflightError,
    TierAssignment,
    check_dataset,
    check_model,
    check_plan,
    no_effect_warnings,
    plan_tiers,
    simulated_tier_nodes,
)
from models.data import DataError, check_held_out_shares, check_partitioning

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Preflight:
    """What pre-flight found: the validated config, each tier's plan, and warnings."""

    config: RunConfig
    tiers: list[TierAssignment]
    warnings: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: The warnings about the tier plan (a tier that trains nothing, a variant no node trains).
    plan_warnings: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """A few console lines: the tiers' variants, then notes and warnings."""
        cfg = self.config
        plan = (
            ", ".join(f"{a.tier} x{a.nodes} ({a.budget_mb:.0f} MiB) -> {a.variant or 'declines'}" for a in self.tiers)
            or "checked at start (the model is not local)"
        )
        out = [f"pre-flight: {cfg.method} on {cfg.model}, {cfg.dataset}; tiers: {plan}"]
        out += [f"pre-flight note: {n}" for n in self.notes]
        out += [f"pre-flight WARNING: {w}" for w in self.warnings]
        return out


def declared_defaults(root: Path = ROOT) -> dict[str, Any]:
    """The run-config keys ``pyproject.toml`` declares, with their defaults (``[tool.flwr.app.config]``)."""
    with (root / "pyproject.toml").open("rb") as f:
        table: dict[str, Any] = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    return table


def parse_overrides(text: str) -> dict[str, Any]:
    """``k=v k2='s'`` as ``flwr run --run-config`` parses it (TOML values)."""
    try:
        return dict(parse_config_args([text]) if text.strip() else {})
    except click.ClickException as exc:
        raise PreflightError(f"--run-config {text!r}: {exc.message}") from None


def check_keys(overrides: Mapping[str, object], declared: Mapping[str, object]) -> None:
    """Raise :class:`PreflightError` for a key ``pyproject.toml`` does not declare, with the closest ones."""
    unknown = [k for k in overrides if k not in declared]
    if not unknown:
        return
    parts = []
    for key in unknown:
        close = difflib.get_close_matches(key, list(declared), n=2, cutoff=0.6)
        hint = f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""
        parts.append(f"run config {key!r} is not a key of this app{hint}")
    raise PreflightError("; ".join(parts) + "; the keys are [tool.flwr.app.config] in pyproject.toml")


def preflight(
    run_config: str,
    *,
    nodes_per_tier: Mapping[str, int] | None = None,
    num_nodes: int | None = None,
    cwd: Path = ROOT,
    root: Path = ROOT,
) -> Preflight:
    """Check a run before it starts; raise :class:`PreflightError` (or :class:`ConfigError`) naming the fix.

    Parameters
    ----------
    run_config : str
        The ``--run-config`` overrides (``k=v`` pairs), as the launcher passes them to Flower.
    nodes_per_tier : Mapping[str, int], optional
        A deployment's nodes per tier (loopback: its ``--tiers``).
    num_nodes : int, optional
        A simulation's virtual clients: tiers follow ``tier-proportions`` and the partitioning
        into ``num_nodes`` parts is drawn here.
    cwd, root : Path
        Where relative paths are read from (Flower runs the apps in the project folder), and the
        project folder holding ``pyproject.toml``.

    """
    datasets.disable_progress_bars()  # pre-flight prints its own few lines
    declared = declared_defaults(root)
    overrides = parse_overrides(run_config)
    check_keys(overrides, declared)
    cfg = RunConfig.from_flower({**declared, **overrides})
    ignored = no_effect_warnings(cfg, overrides)
    model_note, data_note = check_model(cfg, cwd), check_dataset(cfg, cwd)
    notes = [n for n in (model_note, data_note) if n is not None]
    if model_note is not None:  # its catalog needs the hub's config: the tiers are checked at start
        return Preflight(cfg, [], ignored, notes)
    try:
        cfg.catalog  # noqa: B018  (builds every variant's layout and memory estimate)
    except (OSError, ValueError) as exc:
        raise PreflightError(f"run config 'model': {cfg.model!r} does not build: {exc}") from exc
    if nodes_per_tier is None:
        nodes_per_tier = simulated_tier_nodes(cfg, num_nodes) if num_nodes else dict.fromkeys(cfg.tier_names, 1)
    plan = plan_tiers(cfg, nodes_per_tier)
    plan_warnings = check_plan(cfg, plan)
    warnings = ignored + plan_warnings
    if num_nodes and data_note is None:
        try:
            if cfg.partitioner == "dirichlet":  # an IID split always draws
                check_partitioning(cfg.data_spec(), num_nodes)
            check_held_out_shares(cfg.data_spec(), num_nodes)  # nothing to check for 'partition'
        except DataError as exc:
            raise PreflightError(str(exc)) from None
    return Preflight(cfg, plan, warnings, notes, plan_warnings)
