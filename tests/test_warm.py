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
    PROJECT_PACKAGES,
    ChildSpec,
    WarmExecutor,
    enabled,
    forget_project_modules,
    preload_modules,
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
    env = {**os.environ, "OUT": str(tmp_path), "HETFL_WARM_PRELOAD": "json"}
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
