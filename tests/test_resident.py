"""The resident ClientApp worker's scope (client/resident.py): what survives a message, what a new run drops."""

from __future__ import annotations

from typing import Any

import pytest

from client.resident import RunScope, TaskEnded, end_task, scoped_loader_factory, task_started


class Forget:
    """Records the calls :class:`RunScope` makes to drop project modules."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, modules: dict[str, Any]) -> list[str]:
        self.calls += 1
        names = [n for n in modules if n.startswith("client")]
        for n in names:
            del modules[n]
        return names


def test_a_run_keeps_its_modules_a_new_run_a_new_fab_or_a_new_code_drops_them() -> None:
    forget = Forget()
    scope = RunScope(forget=forget)
    modules: dict[str, Any] = {"client.app": 1, "torch": 2}
    path = ["/apps/fab-1", "/venv"]
    assert scope.enter(7, "hash-1", "/apps/fab-1", modules=modules, path=path) == []
    assert scope.enter(7, "hash-1", "/apps/fab-1", modules=modules, path=path) == []  # same run: kept
    assert forget.calls == 0 and "client.app" in modules
    # a new run of the same FAB (a new run config, data read again): dropped, the same dir may return
    assert scope.enter(8, "hash-1", "/apps/fab-1", modules=modules, path=path) == ["client.app"]
    assert modules == {"torch": 2} and path == ["/venv"]
    modules["client.app"] = 3
    path.insert(0, "/apps/fab-1")
    # the same run id with another FAB (changed code): dropped, the old FAB's directory leaves sys.path
    assert scope.enter(8, "hash-2", "/apps/fab-2", modules=modules, path=path) == ["client.app"]
    assert path == ["/venv"] and (scope.run_id, scope.fab_hash, scope.changes) == (8, "hash-2", 2)


def test_the_scoped_loader_scopes_before_flower_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    from flwr.supercore.task_identity import TaskIdentity

    forget = Forget()
    scope = RunScope(forget=lambda modules: [])  # never touch this process's sys.modules
    loads: list[tuple[str, ...]] = []
    notes: list[str] = []

    def factory(default_app_ref: str, app_path: str | None, multi_app: bool) -> Any:
        assert (default_app_ref, app_path, multi_app) == ("", None, True)

        def load(*ids: str) -> str:
            loads.append(ids)
            return "app"

        return load

    get = scoped_loader_factory(scope, factory, notes.append)
    monkeypatch.setattr(TaskIdentity, "_run_id", 5)
    assert get(default_app_ref="", app_path=None, multi_app=True)("flwr/app", "1.0", "h1") == "app"
    monkeypatch.setattr(TaskIdentity, "_run_id", 6)
    assert get(default_app_ref="", app_path=None, multi_app=True)("flwr/app", "1.0", "h1") == "app"
    assert loads == [("flwr/app", "1.0", "h1")] * 2
    assert (scope.run_id, scope.changes) == (6, 1) and scope.project_dir is not None
    assert scope.project_dir.endswith("h1") and forget.calls == 0


def test_end_task_runs_both_phases_of_exit_handlers_and_raises_instead_of_exiting() -> None:
    from flwr.supercore.exit.exit_handler import add_exit_handler

    ran: list[str] = []
    add_exit_handler(lambda: ran.append("late"))
    add_exit_handler(lambda: ran.append("early"), run_before_force_exit=True)
    with pytest.raises(TaskEnded) as ended:
        end_task(110, "message")
    assert ended.value.code == 110 and ran == ["early", "late"]
    with pytest.raises(TaskEnded):
        end_task(0)
    assert ran == ["early", "late"]  # handlers run once: Flower's registry is emptied


def test_task_started(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HETFL_TASK_STARTED", raising=False)
    assert task_started() is None
    monkeypatch.setenv("HETFL_TASK_STARTED", "12.5")
    assert task_started() == 12.5
    monkeypatch.setenv("HETFL_TASK_STARTED", "x")
    assert task_started() is None


def test_the_phase_clock_times_each_wrapped_step_and_resets() -> None:
    import types

    from client.resident import PhaseClock

    module = types.SimpleNamespace(step=lambda x: x + 1, other=lambda: None)
    clock = PhaseClock()
    clock.wrap(module, ("step",))
    assert module.step(1) == 2 and module.step(2) == 3
    taken = clock.take()
    assert list(taken) == ["step"] and taken["step"] >= 0.0
    assert clock.take() == {}
