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
