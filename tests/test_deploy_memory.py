"""Per-tier memory: SuperNodes in memory-limited cgroups size their variant to the limit.

Each SuperNode (and every ClientApp process it starts) runs in its own cgroup with a hard
memory limit, as under ``docker run --memory`` / compose ``mem_limit``; its node config
names a tier but no ``memory-mb``, so the ClientApp reads its budget from the cgroup.  The
small limit fits only the weak variant, the large one the strong variant.  While the round
runs, the peak RSS of every process in each cgroup is sampled; it and the cgroup's own
peak stay under the limit, and the kernel killed nothing.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from deploy.cgroup import CgroupError, MemoryCgroup
from deploy.cluster import (
    Cluster,
    Ports,
    submit_run,
    superlink_command,
    supernode_command,
    wait_port,
    wait_rounds,
    write_connection,
)
from experiment.config import RunConfig
from models.catalog import choose_variant
from tests.flower_runs import TINY, read_rounds

PORTS = Ports(fleet=19592, control=19593, supernode=19594)
#: What the ClientApp assumes its runtime (interpreter, torch, Flower, data) takes; measured
#: peak of SuperNode + SuperExec + ClientApp for the tiny model here is well below it.
OVERHEAD_MB = 1200.0


class PeakSampler(threading.Thread):
    """Largest VmHWM (peak RSS) of any process in the cgroups, and the largest RSS sum per cgroup."""

    def __init__(self, groups: dict[str, MemoryCgroup]) -> None:
        super().__init__(daemon=True)
        self.groups = groups
        self.peak_rss = dict.fromkeys(groups, 0.0)
        self.peak_sum = dict.fromkeys(groups, 0.0)
        self.done = threading.Event()

    @staticmethod
    def _status_mb(pid: int, key: str) -> float:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024
        except OSError:
            pass
        return 0.0

    def run(self) -> None:
        while not self.done.wait(0.1):
            for name, cg in self.groups.items():
                try:
                    pids = cg.pids()
                except OSError:
                    continue
                self.peak_rss[name] = max([self.peak_rss[name], *(self._status_mb(p, "VmHWM") for p in pids)])
                self.peak_sum[name] = max(self.peak_sum[name], sum(self._status_mb(p, "VmRSS") for p in pids))


@pytest.mark.slow
@pytest.mark.deploy
@pytest.mark.timeout(600)
def test_supernodes_in_memory_cgroups_pick_the_variant_that_fits(tmp_path: Path) -> None:
    catalog = RunConfig(model="tiny").catalog
    est = {v.name: v.memory.total_mb for v in catalog}
    limits = {
        "weak": OVERHEAD_MB + (est["weak"] + est["medium"]) / 2,  # room for the weak variant only
        "strong": OVERHEAD_MB + est["strong"] + 100,
    }
    expected = {t: choose_variant(est, mb, OVERHEAD_MB)[0] for t, mb in limits.items()}
    assert expected == {"weak": "weak", "strong": "strong"}
    groups: dict[str, MemoryCgroup] = {}
    try:
        for tier, mb in limits.items():
            groups[tier] = MemoryCgroup(mb).create()
    except (CgroupError, OSError) as exc:
        for cg in groups.values():
            cg.remove()
        pytest.skip(f"cannot create a memory-limited cgroup here: {exc}")

    home = tmp_path / "flwr-home"
    write_connection(home, "loopback", PORTS)
    results = tmp_path / "results"
    sampler = PeakSampler(groups)
    try:
        with Cluster(home, tmp_path / "logs") as cluster:
            cluster.start("superlink", superlink_command(
                fleet_address=f"127.0.0.1:{PORTS.fleet}", host="127.0.0.1", port=PORTS.control,
                database=home / "state.db",
            ))  # fmt: skip
            wait_port(PORTS.fleet)
            wait_port(PORTS.control)
            for i, (tier, cg) in enumerate(groups.items()):
                cluster.start(f"supernode-{tier}", supernode_command(
                    superlink=f"127.0.0.1:{PORTS.fleet}", port=PORTS.supernode + i,
                    node_config=f"partition-id={i} num-partitions=2 tier='{tier}'",  # no memory-mb: the cgroup
                ), preexec=cg.enter)  # fmt: skip
            sampler.start()
            cfg = f"{TINY} num-server-rounds=1 min-available-nodes=2 runtime-overhead-mb={OVERHEAD_MB}"
            run = submit_run(cluster, "loopback", run_config=cfg, results_dir=results, run_name="memory")
            wait_rounds(results / "memory", 1, 400, alive=cluster.procs["superlink"])
            run.wait(timeout=120)
            logs = cluster.logs()
            node_logs = {t: cluster.log(f"supernode-{t}") for t in groups}
        sampler.done.set()
        sampler.join()
        peaks = {t: cg.peak_mb() for t, cg in groups.items()}
        kills = {t: cg.oom_kills() for t, cg in groups.items()}
    finally:
        sampler.done.set()
        for cg in groups.values():
            cg.remove()

    rows = read_rounds(results / "memory")
    assert [r["round"] for r in rows] == [0, 1], logs
    for tier, limit in limits.items():
        # the ClientApp read the cgroup limit as its budget ...
        assert f"(cgroup, {limit:.0f} MiB)" in node_logs[tier], node_logs[tier][-3000:]
        # ... chose the variant that fits it and trained it
        assert rows[1]["tiers"][expected[tier]]["clients"] == 1, rows[1]
        # and stayed under the limit: nothing OOM-killed, peaks below the limit
        assert kills[tier] == 0, kills
        assert 0 < sampler.peak_rss[tier] < limit, (tier, sampler.peak_rss, limit)
        # (the sum of the processes' RSS is printed, not asserted: it counts pages the SuperNode and
        # its ClientApp share -- torch's libraries -- twice; the cgroup's own peak below is exact)
        assert peaks[tier] <= limit, (tier, peaks, limit)
    assert rows[1]["failed"] == [] and rows[1]["rejected"] == [], rows[1]
    print(
        "limits MiB", {t: round(v) for t, v in limits.items()},
        "peak RSS of one process", {t: round(v) for t, v in sampler.peak_rss.items()},
        "peak RSS sum", {t: round(v) for t, v in sampler.peak_sum.items()},
        "cgroup peak (RSS + cache)", {t: round(v) for t, v in peaks.items()},
    )  # fmt: skip
