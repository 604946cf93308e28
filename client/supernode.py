"""``python -m client.supernode``: Flower's ``flower-supernode`` with its idle waits shortened.

Flower 1.39's SuperNode (``flwr.supernode.start_client_internal``) runs one loop: pull a message
from the SuperLink; if there is none, ``time.sleep(3)``; if there is one, wait for its reply in
steps of ``time.sleep(0.5)`` and push it.  A round of train + evaluate therefore waits up to
3 s before a node picks up each of its two messages and up to 0.5 s before it returns each
reply (measured on the loopback cluster: see docs/DEPLOYING.md, "Round time").  Those waits are
hard-coded; this entry point runs Flower's own ``flower-supernode`` unchanged except that

* every sleep of that module lasts at most ``HETFL_SUPERNODE_IDLE_S`` seconds (default
  :data:`IDLE_S`; ``3`` restores Flower's idle loop), and
* the SuperNode's pulls of a message's objects from the SuperLink retry with the ClientApps'
  short backoff (:func:`client.warm.quick_pull_retries`, ``HETFL_PULL_BACKOFF_S``), and
* an ``INTERNAL`` error of the SuperLink is retried, as Flower retries ``UNAVAILABLE``, for up
  to :data:`TRANSIENT_PATIENCE_S` since the SuperNode's last successful call
  (:class:`TransientErrorRetry`).  Flower 1.39's SuperLink answers ``INTERNAL`` for any
  unexpected exception inside a request, and on a loaded host that includes SQLite's
  ``database is locked`` once a write waited past its 5 s busy timeout; Flower's SuperNode
  gives up at the first one and exits, so one slow moment of the SuperLink's disk removed a
  node from every later round (the chaos suite on CI, 2026-11-27: a ``PullMessages`` of node
  ``weak-0`` got it, the node exited, the run waited for it until its timeout).

The price is requests: an idle SuperNode asks the SuperLink for a message every
``HETFL_SUPERNODE_IDLE_S`` seconds instead of every 3 s (a device operator with many nodes per
SuperLink raises it; docs/DEPLOYING.md, "A million devices").  Nothing in the installed Flower
package is edited: the module's ``time`` and ``pull_objects`` names are rebound in this
process only.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from client.warm import pull_backoff, quick_pull_retries
from experiment.retry import PUSH_RETRY_WAITS_S, retry_until
from experiment.switches import env_positive

IDLE_ENV = "HETFL_SUPERNODE_IDLE_S"
#: How long an ``INTERNAL`` error of the SuperLink is retried since the last successful call, seconds.
TRANSIENT_PATIENCE_S = 300.0
#: Longest idle sleep of the SuperNode's loop, seconds (Flower's: 3 s; 0.5 s while awaiting a reply).
IDLE_S = 0.2


def idle_seconds() -> float:
    """``$HETFL_SUPERNODE_IDLE_S`` or :data:`IDLE_S` (``ValueError`` naming the variable if not a number > 0)."""
    return env_positive(IDLE_ENV, IDLE_S, float, "seconds, a number > 0 (Flower's own wait is 3)")


class CappedSleepTime(ModuleType):
    """The ``time`` module, except that ``sleep(s)`` sleeps ``min(s, cap)`` seconds."""

    def __init__(self, cap: float) -> None:
        super().__init__("time")
        self.cap = cap

    def sleep(self, seconds: float) -> None:
        """``time.sleep(min(seconds, cap))``."""
        time.sleep(min(seconds, self.cap))

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def shorten_waits(idle: float, backoff: tuple[float, float]) -> None:
    """Cap the SuperNode loop's sleeps at ``idle`` s; object pulls retry after ``backoff`` (initial, cap)."""
    import flwr.supernode.start_client_internal as supernode

    vars(supernode)["time"] = CappedSleepTime(idle)  # the module-level name its loop sleeps through
    quick_pull_retries(*backoff, module=supernode)
    log_pull_times(supernode)


def log_pull_times(module: Any) -> None:
    """Log how many objects each of ``module.pull_objects``'s calls fetched, and in how many seconds.

    The SuperNode pulls a message's objects (one gRPC call per array, record and the message
    itself) from the SuperLink after it has created the ClientApp's task, so this is the part of
    a message's start-up spent on the link (``[client.supernode] pulled N objects ... in S s``).
    """
    from logging import INFO

    from flwr.common import log

    pull = module.pull_objects

    @functools.wraps(pull)
    def pull_objects(object_ids: list[str], pull_object_fn: Any, **kwargs: Any) -> dict[str, bytes]:
        started = time.perf_counter()
        out: dict[str, bytes] = pull(object_ids, pull_object_fn, **kwargs)
        size = sum(len(v) for v in out.values())
        seconds = time.perf_counter() - started
        log(INFO, "[client.supernode] pulled %d objects (%.2f MB) in %.2f s", len(out), size / 1e6, seconds)
        return out

    module.pull_objects = pull_objects


def is_internal_error(err: BaseException) -> bool:
    """Whether ``err`` is a gRPC error with status ``INTERNAL`` (the SuperLink failed inside a request)."""
    import grpc

    code = getattr(err, "code", None)
    return isinstance(err, grpc.RpcError) and callable(code) and code() == grpc.StatusCode.INTERNAL


class TransientErrorRetry:
    """A retry rule: ``INTERNAL`` errors are retried while the errors began at most ``patience_s`` ago.

    ``should_giveup(err)`` answers Flower's rule (``give_up``) for every other error.  For an
    ``INTERNAL`` one it answers "retry" while ``clock() - first <= patience_s``, where ``first``
    is when the current run of errors began (the first error after the last success,
    :meth:`succeeded`), and Flower's answer afterwards: a SuperLink that fails every request
    for that long is broken, not busy, and the SuperNode exits as Flower's does.
    """

    def __init__(
        self, give_up: Callable[[Exception], bool], patience_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.give_up = give_up
        self.patience_s = patience_s
        self.clock = clock
        self.failing_since: float | None = None
        self._lock = threading.Lock()

    def should_giveup(self, err: Exception) -> bool:
        """Flower's ``should_giveup``, except for an ``INTERNAL`` error within the patience."""
        if is_internal_error(err):
            now = self.clock()
            with self._lock:
                if self.failing_since is None:
                    self.failing_since = now
                waited = now - self.failing_since
            if waited <= self.patience_s:
                from logging import WARNING

                from flwr.common import log

                log(WARNING, "[client.supernode] the SuperLink failed a request (INTERNAL, failing for %.0f s "
                    "of at most %.0f s): retrying", waited, self.patience_s)  # fmt: skip
                return False
        return self.give_up(err)

    def succeeded(self, *_: object) -> None:
        """A call went through: the next error begins a new run of errors."""
        with self._lock:
            self.failing_since = None


def retry_transient_errors(module: Any, patience_s: float = TRANSIENT_PATIENCE_S) -> None:
    """Make the SuperNode's Fleet connection (``module``'s retry invoker) retry ``INTERNAL`` errors."""
    make = module._make_fleet_connection_retry_invoker

    @functools.wraps(make)
    def make_fleet_connection_retry_invoker(*args: Any, **kwargs: Any) -> Any:
        invoker = make(*args, **kwargs)
        rule = TransientErrorRetry(invoker.should_giveup or (lambda _err: False), patience_s)
        on_success = invoker.on_success

        def succeeded(state: Any) -> None:
            rule.succeeded()
            if on_success is not None:
                on_success(state)

        invoker.should_giveup, invoker.on_success = rule.should_giveup, succeeded
        return invoker

    vars(module)["_make_fleet_connection_retry_invoker"] = make_fleet_connection_retry_invoker


class RetriedPush:
    """A SuperNode's ``push_object(run_id, session_id, object_id, contents)`` retried while unstored.

    Flower's ``push_object`` raises ``ObjectPushError`` when the SuperLink answers ``stored=False``;
    the push is attempted again on ``waits`` (:func:`experiment.retry.retry_until`) and the
    last error raised if it never was stored.
    """

    def __init__(
        self,
        push: Callable[[int, str, str, bytes], None],
        waits: tuple[float, ...] = PUSH_RETRY_WAITS_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.push = push
        self.waits = waits
        self.sleep = sleep

    def __call__(self, run_id: int, session_id: str, object_id: str, contents: bytes) -> None:
        """Push one object of a reply; ``ObjectPushError`` if no attempt was stored."""
        from flwr.supercore.inflatable.inflatable_utils import ObjectPushError

        errors: list[ObjectPushError] = []

        def attempt() -> bool:
            try:
                self.push(run_id, session_id, object_id, contents)
            except ObjectPushError as err:
                errors.append(err)
                return False
            return True

        if not retry_until(attempt, f"the reply's object {object_id}", self.waits, self.sleep):
            raise errors[-1]


def retry_unstored_pushes(module: Any) -> None:
    """Make ``module._push_messages`` (the SuperNode's reply push) retry an unstored object (:class:`RetriedPush`)."""
    push_messages = module._push_messages

    @functools.wraps(push_messages)
    def _push_messages(*, push_object: Callable[[int, str, str, bytes], None], **kwargs: Any) -> None:
        push_messages(push_object=RetriedPush(push_object), **kwargs)

    vars(module)["_push_messages"] = _push_messages


def main(argv: list[str] | None = None) -> int:
    """``python -m client.supernode [flower-supernode args]``."""
    import flwr.supernode.start_client_internal as supernode
    from flwr.supernode.cli.flower_supernode import flower_supernode

    shorten_waits(idle_seconds(), pull_backoff())
    retry_transient_errors(supernode)
    retry_unstored_pushes(supernode)
    sys.argv = ["flower-supernode", *(sys.argv[1:] if argv is None else argv)]
    flower_supernode()
    return 0


if __name__ == "__main__":
    sys.exit(main())
