"""deploy.round_timing's pure parts: the fixed overhead's median and the resident workers' memory lines."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy.cluster import node_config_for
from deploy.round_timing import NodeMemory, median_after_first, memory_lines, resident_rss


def test_the_fixed_overhead_takes_the_median_of_rounds_two_on() -> None:
    rows = [{"round": 1, "seconds": 41.7}, {"round": 2, "seconds": 8.4}, {"round": 3, "seconds": 8.7},
            {"round": 4, "seconds": 13.2}, {"round": 5, "seconds": 6.7}]  # fmt: skip
    assert median_after_first(rows) == pytest.approx(8.55)  # round 1 would make it 8.7
    with pytest.raises(ValueError, match="at least 2 rounds"):
        median_after_first(rows[:1])


def test_resident_memory_is_read_per_tier_from_the_supernode_logs(tmp_path: Path) -> None:
    (tmp_path / "supernode-weak.log").write_text(
        "INFO: [client.resident] 22869: task 1 ended (code 0) in 1.81 s; rss 491 MB (pull_task_input 0.06 s)\n"
        "INFO: something else\n"
        "INFO: [client.resident] 22869: task 2 ended (code -9) in 1.58 s; rss 524 MB\n"
    )
    assert resident_rss(tmp_path) == {"weak": [491, 524], "medium": [], "strong": []}


#: A process that starts the next link of a chain shaped like a SuperNode's long-lived processes.
CHAIN = """
import subprocess, sys, time
depth = int(sys.argv[1])
marks = ["client.warm", "--zygote", "worker"]
if depth < 3:
    subprocess.Popen([sys.executable, sys.argv[0], str(depth + 1), marks[depth]])
time.sleep(60)
"""


def test_node_memory_finds_each_long_lived_process_of_a_supernode_by_tier(tmp_path: Path) -> None:
    script = tmp_path / "chain.py"
    script.write_text(CHAIN)
    root = subprocess.Popen(
        [sys.executable, str(script), "0", "client.supernode", "--superlink", "127.0.0.1:19999",
         "--node-config", node_config_for(0, ["weak", "medium", "strong"])],  # the launcher's
        start_new_session=True,
    )  # fmt: skip
    try:
        memory = NodeMemory(19999)
        deadline = time.time() + 30
        while len(memory.samples) < 4 and time.time() < deadline:
            memory.samples.clear()
            memory.sample()
            time.sleep(0.2)
        assert set(memory.samples) == {("weak", r) for r in ("supernode", "superexec", "zygote", "worker")}
        other = NodeMemory(19998)  # another cluster's SuperLink port: none of these
        other.sample()
        assert other.samples == {}
        summary = memory.summary()
        assert all(m["rss"] > 0 and m["pss"] > 0 for m in summary["weak"].values())
        (line,) = memory_lines("warm", summary)
        assert line.startswith("[warm] weak memory MiB (median/max): supernode RSS ")
        assert "worker RSS" in line and "all PSS" in line
    finally:
        os.killpg(root.pid, signal.SIGKILL)
        root.wait()
