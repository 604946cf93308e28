"""``python -m client.supernode``: Flower's SuperNode with its idle waits shortened (issue 21, items 1 and 5),
its SuperLink's INTERNAL errors retried, and the CLI connection a cluster writes (the chaos suite on CI)."""

from __future__ import annotations

import time
import tomllib
from pathlib import Path
from typing import Any

import flwr.supernode.start_client_internal as flower_supernode
import grpc
import pytest

from client.supernode import (
    IDLE_ENV,
    IDLE_S,
    CappedSleepTime,
    TransientErrorRetry,
    idle_seconds,
    is_internal_error,
    retry_transient_errors,
    shorten_waits,
)
from deploy.cluster import Ports, supernode_command, without_table, write_connection


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


class _StatusError(grpc.RpcError):
    """A gRPC error with a status, as a stub raises it."""

    def __init__(self, status: grpc.StatusCode) -> None:
        super().__init__()
        self.status = status

    def code(self) -> grpc.StatusCode:
        return self.status

    def details(self) -> str:
        return "Internal server error."


def test_internal_errors_are_retried_within_the_patience_and_left_to_flower_after_it() -> None:
    now = [100.0]
    flower_answers: list[grpc.StatusCode] = []

    def give_up(err: Exception) -> bool:
        flower_answers.append(err.code())  # type: ignore[attr-defined]
        return True

    rule = TransientErrorRetry(give_up, patience_s=300.0, clock=lambda: now[0])
    internal = _StatusError(grpc.StatusCode.INTERNAL)
    assert rule.should_giveup(internal) is False and rule.failing_since == 100.0
    now[0] = 400.0  # 300 s into the run of errors: still retried
    assert rule.should_giveup(internal) is False
    now[0] = 400.5  # past it: Flower's answer
    assert rule.should_giveup(internal) is True and flower_answers == [grpc.StatusCode.INTERNAL]
    rule.succeeded()  # a success starts the count again
    assert rule.failing_since is None and rule.should_giveup(internal) is False and rule.failing_since == 400.5
    # every other status is Flower's to answer (here: give up), and never starts the count
    rule.succeeded()
    assert rule.should_giveup(_StatusError(grpc.StatusCode.PERMISSION_DENIED)) is True
    assert rule.failing_since is None and not is_internal_error(ValueError("x"))


def test_the_supernodes_fleet_connection_retries_an_internal_error_and_keeps_flowers_rules(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(flower_supernode, "_make_fleet_connection_retry_invoker",
                        flower_supernode._make_fleet_connection_retry_invoker)  # fmt: skip
    retry_transient_errors(flower_supernode, patience_s=60.0)
    invoker = flower_supernode._make_fleet_connection_retry_invoker()
    invoker.wait_function = lambda _s: None  # no real backoff in a unit test
    replies: list[Any] = [_StatusError(grpc.StatusCode.INTERNAL), _StatusError(grpc.StatusCode.INTERNAL), "message"]

    def pull() -> Any:
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return reply

    assert invoker.invoke(pull) == "message" and replies == []  # the node stays, the call goes through
    with pytest.raises(_StatusError):  # Flower's own rule for the rest: INVALID_ARGUMENT is not retried
        invoker.invoke(lambda: (_ for _ in ()).throw(_StatusError(grpc.StatusCode.INVALID_ARGUMENT)))


def test_writing_a_connection_twice_leaves_one_table_and_valid_toml(tmp_path: Path) -> None:
    home = tmp_path / "flwr-home"
    home.mkdir()
    (home / "config.toml").write_text('[superlink]\ndefault = "local"\n\n[superlink.local]\naddress = ":local:"\n')
    for port in (19793, 29793):  # a cluster started again, the second time on other ports
        write_connection(home, "chaos", Ports(fleet=1, control=port, supernode=2))
    config = tomllib.loads((home / "config.toml").read_text())
    assert config["superlink"]["chaos"] == {"address": "127.0.0.1:29793", "insecure": True}
    assert config["superlink"]["local"] == {"address": ":local:"} and config["superlink"]["default"] == "local"
    assert without_table("[a]\nx = 1\n[b]\ny = 2\n[c]\nz = 3\n", "b") == "[a]\nx = 1\n[c]\nz = 3\n"
