"""The processes a run leaves behind: finding a simulation's own SuperLink, stopping processes."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path


def superlink_pids(home: Path) -> set[int]:
    """SuperLinks whose command line names ``home`` (a simulation's own: its state and log live there).

    Only those: a loopback cluster or another simulation running beside this one is not touched.
    """
    out = subprocess.run(["pgrep", "-f", "flower-superlink"], capture_output=True, text=True, check=False)
    pids = set()
    for pid in (int(x) for x in out.stdout.split()):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(home).encode() in cmdline or str(home.resolve()).encode() in cmdline:
            pids.add(pid)
    return pids


def stop_processes(pids: Sequence[int] | set[int], grace: float = 10.0) -> None:
    """SIGTERM ``pids``, then SIGKILL whichever is still alive after ``grace`` seconds."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.time() + grace
    for pid in pids:
        while time.time() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def children(pid: int) -> list[int]:
    """Direct children of ``pid`` (``/proc/PID/task/*/children``; empty if it is gone)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(x) for x in (task / "children").read_text().split()]
        except OSError:
            continue
    return out


def cmdline(pid: int) -> str:
    """``pid``'s command line, arguments joined by spaces ('' if it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def _stat_field(pid: int, field: int) -> int:
    """Field ``field`` (1-based, as in proc(5)) of ``/proc/PID/stat``; 0 if ``pid`` is gone.

    Fields from the third on are read after the last ``)``: the command name may hold spaces.
    """
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[field - 3])
    except (OSError, ValueError, IndexError):
        return 0


def parent_pid(pid: int) -> int:
    """The parent of ``pid`` (0 if it is gone)."""
    return _stat_field(pid, 4)


def start_ticks(pid: int) -> int:
    """When ``pid`` started, in clock ticks after boot (0 if it is gone)."""
    return _stat_field(pid, 22)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (0 if it is gone)."""
    return (_stat_field(pid, 14) + _stat_field(pid, 15)) / os.sysconf("SC_CLK_TCK")


def memory_mb(pid: int) -> tuple[float, float]:
    """``(RSS, PSS)`` of ``pid`` in MiB (``/proc/PID/smaps_rollup``; zeros if it is gone).

    PSS divides each shared page among the processes mapping it, so the PSS of a zygote and
    the worker forked from it add up to what they hold together; their RSS counts torch's
    shared pages in each.
    """
    values = {"Rss": 0.0, "Pss": 0.0}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key, _, rest = line.partition(":")
            if key in values:
                values[key] = int(rest.split()[0]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return values["Rss"], values["Pss"]


def supernode_roles(supernode: int) -> dict[str, int]:
    """The long-lived processes of one SuperNode: ``supernode``, ``superexec``, ``zygote``, ``worker``.

    The warm SuperExec (:mod:`client.warm`) is the SuperNode's child, the zygote its child
    started with ``--zygote``, the resident worker the zygote's oldest living child (one-shot
    forks, younger, are not long-lived).  A role whose process is not there is left out.
    """
    roles = {"supernode": supernode}
    for child in children(supernode):
        if "client.warm" in cmdline(child) or "superexec" in cmdline(child):
            roles["superexec"] = child
            for grandchild in children(child):
                if "--zygote" in cmdline(grandchild):
                    roles["zygote"] = grandchild
                    forks = sorted(children(grandchild), key=start_ticks)
                    if forks:
                        roles["worker"] = forks[0]
    return roles


def pids_with(text: str, *, prefix: bool = False) -> list[int]:
    """Processes whose command line contains ``text`` (starts with it if ``prefix``)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            line = cmdline(int(entry.name))
            if (line.startswith(text) if prefix else text in line) and int(entry.name) != os.getpid():
                found.append(int(entry.name))
    return found
