"""``python -m server.superlink``: Flower's ``flower-superlink`` with SQLite's busy timeout raised.

Flower 1.39's SuperLink keeps its state and every message's objects in one SQLite database
(``--database``; ``:flwr-in-memory:`` otherwise) and opens each connection with
``PRAGMA busy_timeout = 5000`` (``flwr.supercore.constant.SQLITE_PRAGMAS``): a write that waits
more than 5 s for another connection's write lock fails with ``database is locked``.  On a loaded
host -- ten SuperNodes polling, a ServerApp pushing a round's models, 2 cores -- a write can wait
that long, and the failure does not stay inside the SuperLink: ``store_object`` answers a
``PushObject`` with ``stored=False``, so

* a SuperNode's reply is dropped (Flower's SuperNode logs ``Failed to send message`` and moves on;
  the round waits for that node until its timeout: the chaos suite on CI, 2026-11-27, round 6's
  ``evaluate failed: no reply within the round timeout``), and
* the ServerApp's push of a round's messages raises ``ObjectPushError`` and the run ends with
  exit code 201 (the chaos suite's hostile case under load, same day: ``database is locked`` on
  ``DELETE FROM object_push_session_pending``).

This entry point runs Flower's own ``flower-superlink`` unchanged except that every SQLite
connection it opens waits up to :func:`busy_timeout_ms` (``HETFL_SQLITE_BUSY_TIMEOUT_MS``,
default :data:`BUSY_TIMEOUT_MS`) for a lock: a slow moment of the host costs the round time,
never a reply or the run.  Nothing in the installed Flower package is edited: the pragma list
``flwr.supercore.sql_mixin`` reads at each new connection is rebound in this process only.
The pushing sides retry an unstored object as well (:mod:`experiment.retry`), for SuperLinks
started otherwise (the official ``flwr/superlink`` image of ``docker/compose.yaml``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from experiment.switches import env_positive

BUSY_ENV = "HETFL_SQLITE_BUSY_TIMEOUT_MS"
#: How long a SuperLink connection waits for SQLite's write lock, milliseconds (Flower's: 5000).
BUSY_TIMEOUT_MS = 60_000


def busy_timeout_ms() -> int:
    """``$HETFL_SQLITE_BUSY_TIMEOUT_MS`` or :data:`BUSY_TIMEOUT_MS` (``ValueError`` naming it unless an int > 0)."""
    return env_positive(BUSY_ENV, BUSY_TIMEOUT_MS, int, "milliseconds, an integer > 0 (Flower's own is 5000)")


def with_busy_timeout(pragmas: Sequence[tuple[str, str]], milliseconds: int) -> tuple[tuple[str, str], ...]:
    """``pragmas`` (``(name, value)`` pairs, in order) with ``busy_timeout`` set to ``milliseconds``.

    The busy timeout stays first when it was (SQLite applies it to the pragmas after it, such
    as ``journal_mode = WAL``, which takes a lock); it is put first when it was missing.
    """
    out = [(name, str(milliseconds) if name == "busy_timeout" else value) for name, value in pragmas]
    if not any(name == "busy_timeout" for name, _ in pragmas):
        out.insert(0, ("busy_timeout", str(milliseconds)))
    return tuple(out)


def raise_busy_timeout(milliseconds: int) -> None:
    """Make every SQLite connection Flower's SQL state opens from now on wait ``milliseconds`` for a lock."""
    import flwr.supercore.sql_mixin as sql_mixin

    vars(sql_mixin)["SQLITE_PRAGMAS"] = with_busy_timeout(sql_mixin.SQLITE_PRAGMAS, milliseconds)


def main(argv: list[str] | None = None) -> int:
    """``python -m server.superlink [flower-superlink args]``."""
    from flwr.superlink.cli import flower_superlink

    raise_busy_timeout(busy_timeout_ms())
    sys.argv = ["flower-superlink", *(sys.argv[1:] if argv is None else argv)]
    flower_superlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
