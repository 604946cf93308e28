"""One simulation at a time per machine: an exclusive, re-entrant ``flock``.

``flwr run`` in simulation auto-starts a local SuperLink on fixed ports, and
:func:`deploy.launch.run_simulation` stops the SuperLinks that appeared while its run went on.
Two simulations on one machine therefore break each other ("Connection to the SuperLink is
unavailable", or one run's SuperLink stopped by the other).  Every simulation this project
starts holds :data:`SIMULATION_LOCK` for its whole run, so a second one waits, says so, and
starts when the first has finished.

The lock is ``flock(2)`` on a file, the same lock ``flock(1)`` takes, so shell jobs can join in
(``flock /tmp/hetfl-sim.lock CMD`` keeps simulations out while ``CMD`` runs; do not start a
simulation *inside* such a ``CMD``: it would wait for the shell's lock).  Within one process it
is re-entrant for the thread that holds it: an outer caller (the experiment runner, a
benchmark timing two halves back to back) can hold it across several simulations.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

#: The machine-wide simulation lock (``$HETFL_SIM_LOCK`` overrides it).
SIMULATION_LOCK = Path(os.environ.get("HETFL_SIM_LOCK") or Path(tempfile.gettempdir()) / "hetfl-sim.lock")

# lock files this process holds: resolved path -> id of the thread holding it
_held: dict[Path, int] = {}
_held_guard = threading.Lock()


def holder(path: Path) -> str:
    """Who holds ``path``, as its last holder wrote it (``pid N: what``); ``""`` if unknown."""
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _say_waiting(path: Path) -> None:
    who = holder(path)
    print(f"waiting for {path} (another simulation on this machine{': ' + who if who else ''})", file=sys.stderr)


@contextlib.contextmanager
def file_lock(
    path: Path | None, *, what: str = "", on_wait: Callable[[Path], None] | None = _say_waiting
) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``path`` for the ``with`` block; nothing when ``path`` is None.

    Parameters
    ----------
    path
        The lock file (created if missing).
    what
        Written into the file with this process's id while held, so a waiter can name the holder.
    on_wait
        Called once with ``path`` when the lock is busy, before blocking until it is free.

    Re-entrant for the thread that holds it (a nested ``with`` returns at once); another thread
    of the same process waits like another process would.

    """
    if path is None:
        yield
        return
    key = path.resolve()
    me = threading.get_ident()
    with _held_guard:
        nested = _held.get(key) == me
    if nested:  # the outermost ``with`` of this thread releases it
        yield
        return
    with path.open("a+") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait(path)
            fcntl.flock(f, fcntl.LOCK_EX)
        with _held_guard:
            _held[key] = me
        try:
            f.truncate(0)
            f.write(f"pid {os.getpid()}" + (f": {what}" if what else "") + "\n")
            f.flush()
            yield
        finally:
            with _held_guard:
                del _held[key]
            fcntl.flock(f, fcntl.LOCK_UN)
