"""Wrappers around the ServerApp's runtime client (Flower 1.39's ``HttpGrid._client``).

The deployment grid talks to the SuperLink's runtime API through one client object
(``PushMessages``, ``PushObject``, ``PullMessages``, ``PullObject``, ...).  The project wraps it
for two guarantees: the bytes pulled per reply are bounded (:class:`strategies.pull_bound.BoundedPulls`)
and an object the SuperLink did not store is pushed again (:class:`RetriedPushes`,
:mod:`experiment.retry`).  Each wrapper is a :class:`ClientWrapper`; :func:`wrap_runtime_client`
puts one around the grid's client unless one of its kind is already in the chain, so the
wrappers compose in either order and are put back when the grid reconnects (a new client).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from experiment.retry import PUSH_RETRY_WAITS_S, retry_until


class ClientWrapper:
    """A runtime client that forwards every attribute it does not define to ``client``."""

    def __init__(self, client: Any) -> None:
        self.client = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)


def has_wrapper(client: Any, kind: type[ClientWrapper]) -> bool:
    """Whether ``client`` or a client it wraps (through :class:`ClientWrapper` s) is a ``kind``."""
    while isinstance(client, ClientWrapper):
        if isinstance(client, kind):
            return True
        client = client.client
    return False


def wrap_runtime_client(grid: Any, kind: type[ClientWrapper], make: Callable[[Any], ClientWrapper]) -> bool:
    """Put ``make(client)`` around the runtime client of Flower's deployment grid unless a ``kind`` is there.

    Flower 1.39's ``HttpGrid`` keeps its client in ``_client`` behind the ``_runtime_client``
    property (which connects on first use); a grid without one (the simulation's in-memory grid,
    whose replies come from the same process's Ray actors) is left alone: ``False``.
    """
    if not hasattr(type(grid), "_runtime_client"):
        return False
    client = grid._runtime_client
    if not has_wrapper(client, kind):
        grid._client = make(client)
    return True


class RetriedPushes(ClientWrapper):
    """Flower's runtime client with a ``PushObject`` answered ``stored=False`` sent again.

    Parameters
    ----------
    client : Any
        The runtime client (or another wrapper of it).
    waits : Sequence[float]
        Seconds before each further attempt (:data:`experiment.retry.PUSH_RETRY_WAITS_S`).
    sleep : Callable[[float], None]
        How to wait (``time.sleep``; tests pass a recorder).

    """

    def __init__(
        self, client: Any, waits: Sequence[float] = PUSH_RETRY_WAITS_S, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        super().__init__(client)
        self.waits = tuple(waits)
        self.sleep = sleep

    def PushObject(self, request: Any) -> Any:
        """The SuperLink's answer to ``request``: the first ``stored`` one, else the last one."""
        answers: list[Any] = []

        def attempt() -> bool:
            answers.append(self.client.PushObject(request))
            return bool(answers[-1].stored)

        retry_until(attempt, f"the ServerApp's object {request.object_id}", self.waits, self.sleep)
        return answers[-1]


def retry_pushes(grid: Any) -> bool:
    """Wrap the deployment grid's runtime client in :class:`RetriedPushes` (again if it reconnected)."""
    return wrap_runtime_client(grid, RetriedPushes, RetriedPushes)
