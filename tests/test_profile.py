"""Device profiles: node config, cgroup limit, simulated tiers, and the variant choice."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from client.profile import (
    NodeConfigError,
    cgroup_memory_limit_mb,
    device_profile,
    node_config_int,
    node_config_number,
    tier_for_partition,
)
from models.catalog import choose_variant

TIERS = ["weak", "medium", "strong"]
BUDGETS = {"weak": 700.0, "medium": 850.0, "strong": 1100.0}


def test_tier_proportions_are_exact_and_seeded() -> None:
    tiers = [tier_for_partition(p, 10, TIERS, [1, 2, 7], seed=3) for p in range(10)]
    assert Counter(tiers) == {"weak": 1, "medium": 2, "strong": 7}
    assert tiers == [tier_for_partition(p, 10, TIERS, [1, 2, 7], seed=3) for p in range(10)]
    assert Counter(tier_for_partition(p, 6, TIERS, [1, 1, 1], seed=0) for p in range(6)) == {t: 2 for t in TIERS}
    with pytest.raises(ValueError):
        tier_for_partition(6, 6, TIERS, [1, 1, 1], seed=0)


def test_profile_precedence() -> None:
    kw: dict[str, Any] = {"tiers": TIERS, "proportions": [1, 1, 1], "budgets": BUDGETS, "seed": 0}
    p = device_profile({"tier": "weak", "memory-mb": 512}, cgroup_limit_mb=4000, **kw)
    assert (p.tier, p.memory_mb, p.source) == ("weak", 512.0, "node-config")
    p = device_profile({"tier": "medium", "partition-id": 0, "num-partitions": 3}, cgroup_limit_mb=900, **kw)
    assert (p.memory_mb, p.source) == (900, "cgroup")
    p = device_profile({"tier": "medium"}, cgroup_limit_mb=None, **kw)
    assert (p.memory_mb, p.source) == (850.0, "node-config tier default")
    p = device_profile({"partition-id": 1, "num-partitions": 3}, cgroup_limit_mb=None, **kw)
    assert p.source == "simulation" and p.memory_mb == BUDGETS[p.tier]
    with pytest.raises(ValueError, match="memory-mb"):
        device_profile({"memory-mb": "lots"}, cgroup_limit_mb=None, **kw)
    with pytest.raises(NodeConfigError, match="'partition-id' must be a whole number"):
        device_profile({"partition-id": 1.5, "num-partitions": 3}, cgroup_limit_mb=None, **kw)


def test_node_config_numbers_accept_what_flower_parses_and_name_the_key() -> None:
    assert node_config_int({"partition-id": 3}, "partition-id") == 3
    assert node_config_int({"partition-id": "3"}, "partition-id") == 3
    assert node_config_number({"memory-mb": 512.5}, "memory-mb") == 512.5
    with pytest.raises(NodeConfigError, match="'num-partitions' must be a number, got None"):
        node_config_int({}, "num-partitions")
    with pytest.raises(NodeConfigError, match="'memory-mb' must be a number, got True"):
        node_config_number({"memory-mb": True}, "memory-mb")


def test_cgroup_limit_parsing(tmp_path: Path) -> None:
    f = tmp_path / "memory.max"
    f.write_text("max\n")
    assert cgroup_memory_limit_mb([f]) is None
    f.write_text(str(512 * 1024 * 1024))
    assert cgroup_memory_limit_mb([f]) == 512.0
    f.write_text("9223372036854771712")
    assert cgroup_memory_limit_mb([f]) is None
    assert cgroup_memory_limit_mb([tmp_path / "absent"]) is None


def test_choose_largest_fitting_variant_or_decline() -> None:
    est = {"weak": 200.0, "medium": 350.0, "strong": 480.0}
    assert choose_variant(est, 700, 450)[0] == "weak"
    assert choose_variant(est, 800, 450)[0] == "medium"
    assert choose_variant(est, 930, 450)[0] == "strong"
    chosen, reason = choose_variant(est, 600, 450)
    assert chosen is None and "below the smallest variant 'weak'" in reason
