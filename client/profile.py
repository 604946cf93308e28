"""Device profile of a client: tier, memory budget and where they came from.

Precedence (first that applies):

1. ``node_config`` key ``memory-mb`` (a real deployment:
   ``flower-supernode --node-config "tier='weak' memory-mb=900 ..."``);
2. ``node_config`` key ``tier`` without ``memory-mb``: the budget is the cgroup
   memory limit of the container the client runs in (``memory.max`` for cgroup v2,
   ``memory.limit_in_bytes`` for v1), or the tier's ``tier-memory-mb`` default when
   the process is not memory-limited;
3. neither key (Flower simulation, whose node config holds only ``partition-id``
   and ``num-partitions``): the emulated tier derived from ``partition-id`` and the
   run config's ``tier-proportions`` (fixed per client for the whole run, seeded),
   with that tier's ``tier-memory-mb`` budget.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from models.catalog import tier_counts

_CGROUP_FILES = (
    Path("/sys/fs/cgroup/memory.max"),
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),
)
#: cgroup v1 reports "no limit" as a huge number (PAGE_COUNTER_MAX pages).
_NO_LIMIT_BYTES = 1 << 60


@dataclass(frozen=True)
class DeviceProfile:
    """What a client knows about its device."""

    tier: str
    memory_mb: float
    source: str
    labeled: bool = True


def own_cgroup_limit_files(
    proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")
) -> list[Path]:
    """Limit files of this process's own memory cgroup and its ancestors, innermost first.

    In a container the cgroup namespace makes the process's cgroup the mount root, so this
    is just :data:`_CGROUP_FILES`; a process put into a child cgroup on a host (a SuperNode
    started under ``deploy.cgroup``) finds its limit here, not at the root.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    files: list[Path] = []
    for line in lines:
        hier, _, rest = line.partition(":")
        controllers, _, rel = rest.partition(":")
        if not rel.startswith("/"):
            continue
        if hier == "0" and controllers == "":  # cgroup v2
            base, name = root, "memory.max"
        elif "memory" in controllers.split(","):  # cgroup v1
            base, name = root / "memory", "memory.limit_in_bytes"
        else:
            continue
        parts = [x for x in rel.split("/") if x]
        files += [base.joinpath(*parts[:k]) / name for k in range(len(parts), 0, -1)]
    return files


def cgroup_memory_limit_mb(files: Sequence[Path] | None = None) -> float | None:
    """The memory limit in MiB of this process's cgroup, or ``None`` when unlimited or unknown.

    Without ``files``: the tightest limit among the process's own cgroup, its ancestors
    (:func:`own_cgroup_limit_files`) and the mount root (a container's own cgroup).
    """
    if files is None:
        limits = [
            x for f in [*own_cgroup_limit_files(), *_CGROUP_FILES] if (x := cgroup_memory_limit_mb([f])) is not None
        ]
        return min(limits) if limits else None
    for f in files:
        try:
            raw = f.read_text().strip()
        except OSError:
            continue
        if raw == "max":
            return None
        try:
            limit = int(raw)
        except ValueError:
            continue
        return None if limit >= _NO_LIMIT_BYTES else limit / (1024 * 1024)
    return None


def tier_for_partition(
    partition_id: int, num_partitions: int, tiers: Sequence[str], proportions: Sequence[float], seed: int
) -> str:
    """Emulated tier of a simulated client.

    Tier counts follow ``proportions`` by largest remainder over ``num_partitions``
    clients (:func:`models.catalog.tier_counts`); the assignment of tiers to partition ids is
    a seeded permutation, so it is the same in every process and fixed for the whole run.
    """
    if not 0 <= partition_id < num_partitions:
        raise ValueError(f"partition-id {partition_id} out of range 0..{num_partitions - 1}")
    counts = tier_counts(num_partitions, proportions)
    labels = [t for t, c in zip(tiers, counts, strict=True) for _ in range(c)]
    order = np.random.default_rng(seed).permutation(num_partitions)
    return labels[int(order[partition_id])]


class NodeConfigError(ValueError):
    """A node config value is missing or not of its kind; ``str(exc)`` names the key."""


def node_config_number(node_config: Mapping[str, object], key: str) -> float:
    """``node_config[key]`` as a number: Flower parses ``--node-config 'k=v'`` to an int, float or string."""
    value = node_config.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise NodeConfigError(f"node config {key!r} must be a number, got {value!r}")
    try:
        return float(value)
    except ValueError:
        raise NodeConfigError(f"node config {key!r} must be a number, got {value!r}") from None


def node_config_int(node_config: Mapping[str, object], key: str) -> int:
    """``node_config[key]`` as a whole number (``partition-id``, ``num-partitions``)."""
    number = node_config_number(node_config, key)
    if number != int(number):
        raise NodeConfigError(f"node config {key!r} must be a whole number, got {node_config.get(key)!r}")
    return int(number)


def device_profile(
    node_config: Mapping[str, object],
    *,
    tiers: Sequence[str],
    proportions: Sequence[float],
    budgets: Mapping[str, float],
    seed: int,
    cgroup_limit_mb: float | None,
) -> DeviceProfile:
    """Resolve the profile from node config, cgroup limit or the simulation defaults."""
    labeled = str(node_config.get("labeled", "true")).lower() not in ("false", "0", "no")
    tier = node_config.get("tier")
    mem = node_config.get("memory-mb")
    if mem is not None:
        try:
            budget = node_config_number(node_config, "memory-mb")
        except NodeConfigError:
            raise ValueError(f"node-config memory-mb must be a number, got {mem!r}") from None
        if budget <= 0:
            raise ValueError(f"node-config memory-mb must be positive, got {mem!r}")
        return DeviceProfile(str(tier) if tier is not None else "custom", budget, "node-config", labeled)
    if tier is not None:
        if cgroup_limit_mb is not None:
            return DeviceProfile(str(tier), cgroup_limit_mb, "cgroup", labeled)
        if str(tier) not in budgets:
            raise ValueError(f"node-config tier {tier!r} is not one of {list(budgets)} and no memory-mb is given")
        return DeviceProfile(str(tier), budgets[str(tier)], "node-config tier default", labeled)
    pid = node_config.get("partition-id")
    num = node_config.get("num-partitions")
    if pid is None or num is None:
        raise ValueError("node config has neither tier/memory-mb nor partition-id/num-partitions")
    t = tier_for_partition(
        node_config_int(node_config, "partition-id"),
        node_config_int(node_config, "num-partitions"),
        tiers,
        proportions,
        seed,
    )
    return DeviceProfile(t, budgets[t], "simulation", labeled)
