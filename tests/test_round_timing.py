"""deploy.round_timing's pure parts: the fixed overhead's median and the resident workers' memory lines."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.round_timing import median_after_first, resident_rss


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
