"""Loopback deployment: a real SuperLink and three SuperNodes talking gRPC (grpc-rere)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from deploy.cluster import Ports, run_loopback
from tests.flower_runs import TINY, read_rounds, tiny_budgets, tiny_depths


@pytest.mark.slow
@pytest.mark.deploy
@pytest.mark.timeout(900)
def test_loopback_deployment_one_round_each_node_gets_its_tier(tmp_path: Path) -> None:
    outcome = run_loopback(
        tiers=["weak", "medium", "strong"],
        run_config=f"{TINY} num-server-rounds=1 tier-memory-mb='{tiny_budgets()}'",
        results_dir=tmp_path,
        run_name="loopback",
        ports=Ports(fleet=19092, control=19093, supernode=19094),
        flwr_home=tmp_path / "flwr-home",
        timeout=600,
        echo=False,
    )
    logs = "\n".join(
        p.read_text(errors="replace")[-2000:] for p in sorted((tmp_path / "loopback" / "logs").glob("*.log"))
    )
    assert outcome.ok, outcome.log[-3000:] + logs
    rows = read_rounds(outcome.results)
    assert [r["round"] for r in rows] == [0, 1]
    depths = tiny_depths()
    tiers = rows[1]["tiers"]
    for tier in ("weak", "medium", "strong"):
        # node-config tier 'weak' -> budget from tier-memory-mb -> variant 'weak', etc.
        assert tiers[tier]["clients"] == 1, tiers
        assert tiers[tier]["layers"] == depths[tier], tiers
        # its ClientApps (query, train, evaluate) were forked from one warm SuperExec zygote
        node_log = (tmp_path / "loopback" / "logs" / f"supernode-{tier}.log").read_text(errors="replace")
        assert len(re.findall(r"\[client\.warm\] zygote \d+ ready", node_log)) == 1, node_log[-3000:]
        # and one resident worker ran them in turn (query, train, evaluate: caches kept between them)
        served = re.findall(r"\[client\.resident\] (\d+): task (\d+) ended \(code 0\)", node_log)
        assert len({pid for pid, _ in served}) == 1 and len(served) >= 2, node_log[-3000:]
        assert "trained" in node_log and "evaluated on" in node_log, node_log[-3000:]
        assert tiers[tier]["startup-seconds"] >= 0.0
