"""The warm SuperExec (client/warm.py): launch requests, project-module hygiene, the zygote's forks.

The whole path through Flower (SuperNode -> warm SuperExec -> forked ClientApp -> reply) runs in
the deployment suite (tests/test_deployment.py asserts one zygote served each SuperNode).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from client.warm import (
    PRELOAD_PATIENCE_S,
    PROJECT_PACKAGES,
    PULL_BACKOFF_ENV,
    PULL_BACKOFF_S,
    ZYGOTE_START_LIMIT,
    ChildSpec,
    WarmExecutor,
    enabled,
    forget_project_modules,
    launch_route,
    parent_alive,
    preload_modules,
    pull_backoff,
    quick_pull_retries,
    run_supervised,
    serves_clientapps,
    shim_dir,
)

SPEC = ChildSpec(
    runtime_api_address="127.0.0.1:9094", token="tok-1", insecure=True, root_certificates_path=None,
    runtime_dependency_install=False, parent_pid=123, suppress_output=False,
)  # fmt: skip


def test_launch_request_round_trips() -> None:
    assert ChildSpec.from_line(SPEC.to_line()) == SPEC


@pytest.mark.parametrize(
    ("line", "names"),
    [
        (b"[1, 2]\n", "JSON object"),
        (b'{"token": "x"}\n', "lacks"),
        (SPEC.to_line().replace(b'"tok-1"', b'""'), "'token'"),
        (SPEC.to_line().replace(b'"127.0.0.1:9094"', b"7"), "'runtime_api_address'"),
    ],
)
def test_malformed_launch_requests_are_refused_naming_the_field(line: bytes, names: str) -> None:
    with pytest.raises(ValueError, match=names):
        ChildSpec.from_line(line)


def test_only_project_modules_are_forgotten() -> None:
    modules: dict[str, object] = {m: object() for m in ("client", "client.app", "models.cnn", "torch", "torchvision")}
    dropped = forget_project_modules(modules)
    assert sorted(dropped) == ["client", "client.app", "models.cnn"]
    assert sorted(modules) == ["torch", "torchvision"]
    assert {"client", "models", "server", "strategies"} <= PROJECT_PACKAGES


def test_switches(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HETFL_WARM_EXECUTOR", raising=False)
    assert enabled()
    monkeypatch.setenv("HETFL_WARM_EXECUTOR", "0")
    assert not enabled()
    monkeypatch.setenv("HETFL_WARM_PRELOAD", "torch, numpy,")
    assert preload_modules() == ("torch", "numpy")
    shim = shim_dir(tmp_path) / "flower-superexec"
    assert os.access(shim, os.X_OK)
    assert "-m client.warm" in shim.read_text()


ZYGOTE = textwrap.dedent(
    """
    import os, sys, random
    import client.warm as w

    def child(spec):
        out = os.path.join(os.environ["OUT"], spec.token)
        with open(out, "w") as f:
            f.write(f"{os.getppid()} {sys.modules.get('client.app') is None} {random.random()}")
        return 0

    w._run_child = child
    sys.exit(w.zygote())
    """
)


def test_zygote_forks_one_child_per_request_skips_malformed_and_exits_on_eof(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "HETFL_WARM_PRELOAD": "json", "HETFL_RESIDENT_CLIENTAPP": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert proc.stdin is not None
    for token in ("a", "b"):
        proc.stdin.write(ChildSpec(**{**SPEC.__dict__, "token": token}).to_line())
    proc.stdin.write(b"not json\n")
    proc.stdin.write(ChildSpec(**{**SPEC.__dict__, "token": "c"}).to_line())
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    deadline = time.time() + 30
    while len(list(tmp_path.iterdir())) < 3 and time.time() < deadline:
        time.sleep(0.1)
    lines = {p.name: p.read_text().split() for p in tmp_path.iterdir()}
    assert sorted(lines) == ["a", "b", "c"]
    # every child is the zygote's own fork, and sees no project module left over from the preload
    assert {parent for parent, _, _ in lines.values()} == {str(proc.pid)}
    assert all(fresh == "True" for _, fresh, _ in lines.values())
    # children reseed: no two draw the same first random number
    assert len({draw for _, _, draw in lines.values()}) == 3
    assert proc.stderr is not None
    assert b"malformed launch request" in proc.stderr.read()


def test_supernode_superexecs_start_the_zygote_eagerly_superlink_ones_do_not() -> None:
    assert serves_clientapps(["--insecure", "--runtime-api-address", "h:9094"])  # standalone (process isolation)
    assert not serves_clientapps(["--parent-pid", str(os.getpid())])  # parent is pytest, not a SuperNode
    assert serves_clientapps(["--parent-pid", "not-a-pid"])


def test_executor_reports_ready_only_after_the_preload_and_stops_the_zygote(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETFL_WARM_PRELOAD", "json")
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    executor = WarmExecutor(eager=True)
    zygote = executor._zygote
    assert zygote is not None
    deadline = time.time() + 60
    while not executor._zygote_ready():
        assert time.time() < deadline, "the zygote never reported ready"
        time.sleep(0.05)
    executor.close()
    assert zygote.wait(timeout=10) == 0  # EOF on its pipe ends it
    assert not executor._zygote_ready()


def test_pull_backoff_default_env_and_bad_values(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(PULL_BACKOFF_ENV, raising=False)
    assert pull_backoff() == PULL_BACKOFF_S
    monkeypatch.setenv(PULL_BACKOFF_ENV, "1,10")
    assert pull_backoff() == (1.0, 10.0)
    for bad in ("0.1", "a,b", "0,1", "2,1"):
        monkeypatch.setenv(PULL_BACKOFF_ENV, bad)
        with pytest.raises(ValueError, match=PULL_BACKOFF_ENV):
            pull_backoff()


def test_message_pulls_retry_with_the_short_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """Flower's own ``pull_and_inflate_object_from_tree`` (what ``run_clientapp`` calls) gets the backoff.

    Every object of a real message content (a ``RecordDict`` with an array) is "not there yet"
    for its first two pulls, as when the SuperNode is still receiving it; it still inflates
    intact, through the wrapper.
    """
    import torch
    from flwr.app import ArrayRecord, RecordDict
    from flwr.supercore.inflatable import inflatable_utils
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree

    seen: list[dict[str, object]] = []
    real = inflatable_utils.pull_objects

    def spy(object_ids: list[str], pull_object_fn: object, **kwargs: object) -> dict[str, bytes]:
        seen.append(kwargs)
        return real(object_ids, pull_object_fn, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(inflatable_utils, "pull_objects", spy)
    quick_pull_retries(0.001, 0.004)
    quick_pull_retries(0.001, 0.004)  # idempotent: one wrapper, not two

    content = RecordDict({"arrays": ArrayRecord({"w": torch.arange(6.0).reshape(2, 3)})})
    objects = get_all_nested_objects(content)
    tries: dict[str, int] = {}

    def pull_object(object_id: str) -> bytes:
        tries[object_id] = tries.get(object_id, 0) + 1
        if tries[object_id] <= 2:
            raise inflatable_utils.ObjectUnavailableError(object_id)
        return objects[object_id].deflate()

    got = inflatable_utils.pull_and_inflate_object_from_tree(
        get_object_tree(content), pull_object, lambda _: None, return_type=RecordDict
    )
    assert len(seen) == 1, "the wrapper did not go through the (spied) original exactly once"
    assert seen[0]["initial_backoff"] == 0.001 and seen[0]["backoff_cap"] == 0.004
    assert seen[0]["max_tries_per_object"] is None
    assert set(tries) == set(objects) and all(n == 3 for n in tries.values())
    w = got["arrays"]["w"].numpy()  # type: ignore[union-attr]
    assert w.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


# --------------------------------------------------------------------------- the resident worker

RESIDENT_ZYGOTE = textwrap.dedent(
    """
    import os, sys, time
    import client.warm as w

    def record(token, kind):
        with open(os.path.join(os.environ["OUT"], token), "w") as f:
            f.write(f"{kind} {os.getpid()}")

    def serve(first, tasks_fd, done_fd):
        with os.fdopen(tasks_fd, "rb") as tasks:
            for line in iter(tasks.readline, b""):
                token = w.ChildSpec.from_line(line).token
                if token.startswith("die"):
                    record(token, "resident")
                    os._exit(3)
                if token.startswith("slow"):
                    time.sleep(2.0)
                record(token, "resident")
                os.write(done_fd, b"done\\n")
        return 0

    def one_shot(spec):
        record(spec.token, "one-shot")
        return 0

    w._serve_resident = serve
    w._run_child = one_shot
    sys.exit(w.zygote())
    """
)


def _wait_for(path: Path, seconds: float = 30.0) -> list[str]:
    deadline = time.time() + seconds
    while not path.exists() and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(0.05)
    return path.read_text().split()


def test_the_resident_worker_takes_tasks_while_idle_one_shots_cover_it_while_busy_and_a_dead_one_is_replaced(
    tmp_path: Path,
) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "HETFL_WARM_PRELOAD": "json", "HETFL_RESIDENT_CLIENTAPP": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", RESIDENT_ZYGOTE], stdin=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert proc.stdin is not None

    def send(token: str) -> None:
        assert proc.stdin is not None
        proc.stdin.write(ChildSpec(**{**SPEC.__dict__, "token": token}).to_line())
        proc.stdin.flush()

    send("slow-a")  # forks the resident worker, which sleeps on it
    time.sleep(0.5)
    send("b")  # the worker is busy: a one-shot fork
    kind_a, worker = _wait_for(tmp_path / "slow-a")
    kind_b, one_shot = _wait_for(tmp_path / "b")
    assert (kind_a, kind_b) == ("resident", "one-shot") and worker != one_shot
    time.sleep(0.3)
    send("c")  # idle again: the same worker
    assert _wait_for(tmp_path / "c") == ["resident", worker]
    send("die")  # the worker dies on it
    assert _wait_for(tmp_path / "die") == ["resident", worker]
    time.sleep(0.3)
    send("d")  # a new worker
    kind_d, new_worker = _wait_for(tmp_path / "d")
    assert kind_d == "resident" and new_worker != worker
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    assert proc.stderr is not None
    assert b"resident worker" in proc.stderr.read()


def test_with_the_resident_worker_off_every_task_is_a_one_shot(tmp_path: Path) -> None:
    env = {**os.environ, "OUT": str(tmp_path), "HETFL_WARM_PRELOAD": "json", "HETFL_RESIDENT_CLIENTAPP": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-c", RESIDENT_ZYGOTE], stdin=subprocess.PIPE, env=env,
        cwd=Path(__file__).resolve().parent.parent,
    )  # fmt: skip
    assert proc.stdin is not None
    for token in ("a", "b"):
        proc.stdin.write(ChildSpec(**{**SPEC.__dict__, "token": token}).to_line())
        proc.stdin.flush()
        assert _wait_for(tmp_path / token)[0] == "one-shot"
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0


SERVE = textwrap.dedent(
    """
    import json, os, sys
    import client.warm as w
    import flwr.supernode.runtime.run_clientapp as flower
    from flwr.supercore.exit.exit_handler import add_exit_handler

    calls = []

    def run_clientapp(**kwargs):
        token = kwargs["token"]
        add_exit_handler(lambda: calls.append(("pushed", token)))  # Flower pushes the task's status here
        calls.append(("ran", token, kwargs["parent_pid"], os.environ.get("HETFL_TASK_STARTED") is not None))
        if token == "raises":
            raise RuntimeError("outside the ClientApp")
        flower.flwr_exit(0 if token != "fails" else 110)
        calls.append(("not reached", token))

    flower.run_clientapp = run_clientapp
    tasks_r, tasks_w = os.pipe()
    done_r, done_w = os.pipe()
    first = w.ChildSpec.from_line(sys.argv[1].encode())
    for token in ("t1", "fails", "raises", "t4"):
        os.write(tasks_w, w.ChildSpec(**{**first.__dict__, "token": token}).to_line())
    os.close(tasks_w)
    code = w._serve_resident(first, tasks_r, done_w)
    os.close(done_w)
    done = os.read(done_r, 4096).count(b"done")
    print(json.dumps({"code": code, "done": done, "calls": calls, "env": os.environ.get("HETFL_TASK_STARTED")}))
    """
)


def test_the_resident_worker_runs_each_task_through_flower_to_its_exit_handlers_and_carries_on() -> None:
    import json

    out = subprocess.run(
        [sys.executable, "-c", SERVE, SPEC.to_line().decode().strip()], capture_output=True, check=True,
        cwd=Path(__file__).resolve().parent.parent, timeout=120,
    )  # fmt: skip
    result = json.loads(out.stdout.decode().strip().splitlines()[-1])
    assert result["code"] == 0 and result["done"] == 4 and result["env"] is None
    calls = [tuple(c) for c in result["calls"]]
    # each task ran, its exit handlers ran (the status push), Flower's exit did not end the worker;
    # the parent-process monitor is asked for once, by the first task
    assert calls == [
        ("ran", "t1", SPEC.parent_pid, True), ("pushed", "t1"),
        ("ran", "fails", None, True), ("pushed", "fails"),
        ("ran", "raises", None, True), ("pushed", "raises"),
        ("ran", "t4", None, True), ("pushed", "t4"),
    ]  # fmt: skip
    assert b"task 2 ended (code 110)" in out.stderr + out.stdout
    assert b"task 3 ended (code 1)" in out.stderr + out.stdout


def test_a_task_queues_for_a_preloading_zygote_within_the_patience_else_goes_cold() -> None:
    assert launch_route(alive=True, ready=True, preloading_s=500.0) == "fork"
    assert launch_route(alive=True, ready=False, preloading_s=0.0) == "queue"
    assert launch_route(alive=True, ready=False, preloading_s=PRELOAD_PATIENCE_S - 0.1) == "queue"
    assert launch_route(alive=True, ready=False, preloading_s=PRELOAD_PATIENCE_S) == "cold"
    assert launch_route(alive=False, ready=False, preloading_s=0.0) == "cold"
    assert launch_route(alive=False, ready=True, preloading_s=0.0) == "cold"
    # a preload slower than Flower's 30-s claim window queues the re-offered task again, not cold
    assert launch_route(alive=True, ready=False, preloading_s=181.0) == "queue"


def test_zygotes_that_die_unready_are_restarted_up_to_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETFL_WARM_PRELOAD", "torch")  # seconds of preload: killed at once, never ready
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    executor = WarmExecutor(eager=True)
    started = 1
    try:
        for _ in range(ZYGOTE_START_LIMIT):
            zygote = executor._zygote
            assert zygote is not None
            zygote.kill()
            zygote.wait(timeout=10)
            executor._restart_if_gone()
            started += executor._zygote is not zygote and executor._zygote is not None
        assert started == ZYGOTE_START_LIMIT  # the first and one restart; the second unready death ends it
        assert executor._zygote is None
        executor._restart_if_gone()
        assert executor._zygote is None  # stays cold
    finally:
        executor.close()


def test_a_failed_superexec_loop_runs_again_with_doubling_pauses_while_its_parent_lives() -> None:
    """Flower's loop ends at a SuperLink's first 500 (not retried); a SuperLink never restarts it."""
    calls: list[int] = []
    pauses: list[float] = []

    def loop() -> None:
        calls.append(1)
        if len(calls) <= 3:
            raise RuntimeError("HTTP 500 Internal server error.")

    run_supervised(loop, lambda: True, pauses=(1.0, 3.0), sleep=pauses.append)
    assert len(calls) == 4 and pauses == [1.0, 2.0, 3.0]


def test_a_failed_superexec_loop_is_raised_once_its_parent_is_gone() -> None:
    def loop() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_supervised(loop, lambda: False, sleep=lambda _: None)
    exits = []

    def exiting() -> None:
        exits.append(1)
        raise SystemExit(3)  # Flower's own exits (bad configuration, parent gone) are not caught

    with pytest.raises(SystemExit):
        run_supervised(exiting, lambda: True, sleep=lambda _: None)
    assert exits == [1]


def test_parent_alive_reads_the_parent_pid_flag() -> None:
    assert parent_alive(["--insecure"])  # a standalone SuperExec has no parent to outlive
    assert parent_alive(["--parent-pid", str(os.getpid()), "--insecure"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    assert not parent_alive(["--parent-pid", str(gone.pid)])
