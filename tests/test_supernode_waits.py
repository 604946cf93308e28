"""``python -m client.supernode``: Flower's SuperNode with its idle waits shortened (issue 21, items 1 and 5)."""

from __future__ import annotations

import time
from typing import Any

import flwr.supernode.start_client_internal as flower_supernode
import pytest

from client.supernode import IDLE_ENV, IDLE_S, CappedSleepTime, idle_seconds, shorten_waits
from deploy.cluster import supernode_command


def test_idle_seconds_default_value_and_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(IDLE_ENV, raising=False)
    assert idle_seconds() == IDLE_S
    monkeypatch.setenv(IDLE_ENV, "3")
    assert idle_seconds() == 3.0
    for bad in ("soon", "0", "-1"):
        monkeypatch.setenv(IDLE_ENV, bad)
        with pytest.raises(ValueError, match=f"{IDLE_ENV}='{bad}'.*Flower's own wait is 3"):
            idle_seconds()


def test_capped_sleep_caps_and_forwards_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    slept: list[float] = []
    monkeypatch.setattr(time, "sleep", slept.append)
    capped = CappedSleepTime(0.2)
    capped.sleep(3)
    capped.sleep(0.5)
    capped.sleep(0.05)
    assert slept == [0.2, 0.2, 0.05]
    assert capped.time is time.time and capped.monotonic is time.monotonic


def test_shorten_waits_rebinds_only_the_supernode_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(flower_supernode, "time", time)  # restored after the test
    monkeypatch.setattr(flower_supernode, "pull_objects", flower_supernode.pull_objects)
    seen: list[dict[str, Any]] = []

    def spy(object_ids: list[str], pull_object_fn: Any, **kwargs: Any) -> dict[str, bytes]:
        seen.append(kwargs)
        return {}

    monkeypatch.setattr(flower_supernode, "pull_objects", spy)
    shorten_waits(0.1, (0.01, 0.3))
    shorten_waits(0.1, (0.01, 0.3))  # idempotent: one wrapper around Flower's function
    assert isinstance(flower_supernode.time, CappedSleepTime) and flower_supernode.time.cap == 0.1
    assert time.sleep is not flower_supernode.time.sleep  # the global time module is untouched
    flower_supernode.pull_objects(["a"], lambda _: b"")
    assert seen == [{"initial_backoff": 0.01, "backoff_cap": 0.3, "max_tries_per_object": None}]


def test_the_launcher_starts_supernodes_through_the_entry_point() -> None:
    cmd = supernode_command(superlink="127.0.0.1:9092", node_config="tier='weak'", port=9094)
    assert cmd[1:3] == ["-m", "client.supernode"]
    assert cmd[3:6] == ["--grpc-rere", "--superlink", "127.0.0.1:9092"]
