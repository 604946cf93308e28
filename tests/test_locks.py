"""The machine-wide simulation lock: exclusive across processes and threads, re-entrant per thread."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest

import deploy.launch as launch
from deploy.locks import SIMULATION_LOCK, file_lock, holder
from deploy.processes import superlink_pids

HOLD = """
import fcntl, sys
f = open(sys.argv[1], "a")
fcntl.flock(f, fcntl.LOCK_EX)
print("locked", flush=True)
sys.stdin.readline()
"""

PROBE = """
import fcntl, sys
f = open(sys.argv[1], "a")
try:
    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("free")
except BlockingIOError:
    print("held")
"""


def probe(path: Path) -> str:
    """Whether another process could take ``path`` right now."""
    return subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True).stdout.strip()


def in_thread(path: Path) -> tuple[threading.Thread, threading.Event, threading.Event]:
    """Take ``path`` in a new thread; events: it reported waiting, it acquired (it releases at once)."""
    waiting, acquired = threading.Event(), threading.Event()

    def take() -> None:
        with file_lock(path, on_wait=lambda _: waiting.set()):
            acquired.set()

    t = threading.Thread(target=take, daemon=True)
    t.start()
    return t, waiting, acquired


def test_held_while_inside_and_free_after(tmp_path: Path) -> None:
    lock = tmp_path / "sim.lock"
    with file_lock(lock, what="unit test"):
        assert probe(lock) == "held"
        assert holder(lock).endswith(": unit test")
    assert probe(lock) == "free"


def test_none_is_no_lock(tmp_path: Path) -> None:
    with file_lock(None):
        pass


def test_reentrant_in_the_holding_thread(tmp_path: Path) -> None:
    lock = tmp_path / "sim.lock"
    done = threading.Event()

    def nested() -> None:
        with file_lock(lock), file_lock(lock), file_lock(tmp_path / "." / "sim.lock"):
            assert probe(lock) == "held"
        done.set()

    t = threading.Thread(target=nested, daemon=True)
    t.start()
    t.join(timeout=30)
    assert done.is_set(), "a nested file_lock on the same file waited for itself"
    assert probe(lock) == "free"


def test_another_process_makes_us_wait_and_says_so(tmp_path: Path) -> None:
    lock = tmp_path / "sim.lock"
    other = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert other.stdout is not None and other.stdin is not None
    try:
        assert other.stdout.readline().strip() == "locked"
        t, waiting, acquired = in_thread(lock)
        assert waiting.wait(timeout=30), "no wait reported while another process held the lock"
        assert not acquired.is_set()
        other.stdin.write("\n")
        other.stdin.flush()
        assert acquired.wait(timeout=30), "never acquired after the other process released"
        t.join(timeout=30)
    finally:
        other.kill()
        other.wait()


def test_another_thread_waits_for_the_holder(tmp_path: Path) -> None:
    lock = tmp_path / "sim.lock"
    with file_lock(lock):
        t, waiting, acquired = in_thread(lock)
        assert waiting.wait(timeout=30), "a second thread was let in (re-entrancy is per thread)"
        assert not acquired.is_set()
    assert acquired.wait(timeout=30)
    t.join(timeout=30)


def test_waiting_message_names_the_holder(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lock = tmp_path / "sim.lock"
    lock.write_text("pid 1234: flwr run demo\n")
    from deploy.locks import _say_waiting

    _say_waiting(lock)
    err = capsys.readouterr().err
    assert str(lock) in err and "pid 1234: flwr run demo" in err


def test_run_simulation_holds_the_lock_for_the_whole_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # a stand-in `flwr` that reports, from its own process, whether the lock is held
    lock = tmp_path / "sim.lock"
    fake = tmp_path / "bin" / "python"  # run as `python -m deploy.flwr_cli`
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\n{PROBE}".replace("sys.argv[1]", repr(str(lock))))
    fake.chmod(0o755)
    monkeypatch.setattr(launch, "BIN", fake.parent)
    monkeypatch.setattr(launch, "superlink_pids", lambda home: set())  # stop no real SuperLink from this test
    outcome = launch.run_simulation(
        supernodes=1, run_config="", results_dir=tmp_path, run_name="probe", flwr_home=tmp_path / "home",
        echo=False, lock=lock,
    )  # fmt: skip
    assert outcome.log.strip() == "held"
    assert probe(lock) == "free"


def test_default_lock_is_the_machine_wide_one() -> None:
    import inspect

    assert inspect.signature(launch.run_simulation).parameters["lock"].default == SIMULATION_LOCK


def test_a_simulation_stops_only_the_superlinks_of_its_own_flower_home(tmp_path: Path) -> None:
    """A loopback cluster's SuperLink (or another run's) started meanwhile is not stopped (found 2026-11-26:
    a simulation ending beside ``deploy.round_timing`` killed the cluster's SuperLink)."""
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)", "flower-superlink", "--database"]
    procs = [subprocess.Popen([*sleeper, str(home / "local-superlink" / "state.db")]) for home in (ours, theirs)]
    try:
        assert superlink_pids(ours) == {procs[0].pid}
        assert superlink_pids(theirs) == {procs[1].pid}
    finally:
        for p in procs:
            p.kill()
            p.wait()
