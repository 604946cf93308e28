"""Pushing an object again when the SuperLink answered that it did not store it.

A ``PushObject`` that Flower 1.39's SuperLink could not store (``store_object`` caught an
exception: on a loaded host, SQLite's ``database is locked`` once a write waited past its busy
timeout) is answered ``stored=False``; Flower's pushing sides give up at the first one (the
ServerApp's run ends, a SuperNode drops its reply).  A failed store leaves the object pending in
its push session (the claim of the pending object is rolled back with the failed write), so the
same request can succeed a moment later.  Both pushing sides of this project retry it on the
waits of :data:`PUSH_RETRY_WAITS_S` -- the ServerApp's runtime client
(:class:`strategies.runtime_client.RetriedPushes`) and the SuperNode
(:func:`client.supernode.retry_unstored_pushes`) -- and give Flower the last answer.  A push
that stays unstored (an expired or replaced session) fails as before, about 15 s later.
:mod:`server.superlink` removes the common cause on the SuperLinks this project starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from logging import WARNING

#: Seconds waited before each further attempt of an unstored push (4 retries, 15 s in all).
PUSH_RETRY_WAITS_S = (1.0, 2.0, 4.0, 8.0)


def retry_until(
    attempt: Callable[[], bool],
    what: str,
    waits: Sequence[float] = PUSH_RETRY_WAITS_S,
    sleep: Callable[[float], None] = time.sleep,
) -> bool:
    """Call ``attempt`` until it answers ``True``, waiting ``waits[i]`` before attempt ``i + 2``.

    At most ``len(waits) + 1`` attempts; the last answer is returned.  Each retry is logged
    with ``what`` (the object pushed).
    """
    from flwr.common import log

    for tries, wait in enumerate(waits, start=1):
        if attempt():
            return True
        log(WARNING, "%s was not stored by the SuperLink (attempt %d): pushing it again in %.0f s", what, tries, wait)
        sleep(wait)
    return attempt()
