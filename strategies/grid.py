"""The grid a strategy's rounds run on: Flower's, polled for replies more promptly.

Flower 1.39's deployment grid (``HttpGrid.send_and_receive``) sleeps 3 s between pulls of the
replies; :class:`PromptGrid` wraps any grid and polls every ``poll_interval`` seconds instead
(``HETFL_REPLY_POLL_S``, :meth:`strategies.base.HeterogeneousStrategy.start`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from flwr.app import Message
from flwr.serverapp import Grid


class PromptGrid(Grid):
    """A ``Grid`` whose ``send_and_receive`` polls for replies every ``poll_interval`` seconds.

    Flower 1.39's deployment grid (``HttpGrid.send_and_receive``) sleeps 3 s between pulls,
    so each message round trip waits 1.5 s on average after its last reply arrived.  Every
    other call goes to the wrapped grid unchanged; the semantics are Flower's (replies that
    arrive after ``timeout`` are not collected, ``timeout=None`` waits for all).
    """

    def __init__(self, grid: Grid, poll_interval: float = 0.2) -> None:
        self.grid = grid
        self.poll_interval = poll_interval

    def set_run(self, run: Any) -> None:  # noqa: D102
        self.grid.set_run(run)

    @property
    def run(self) -> Any:  # noqa: D102
        return self.grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:  # noqa: D102
        return self.grid.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:  # noqa: D102
        return self.grid.get_node_ids()

    def get_nodes(self) -> Iterable[Any]:  # noqa: D102
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:  # noqa: D102
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:  # noqa: D102
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages``; pull their replies every ``poll_interval`` s until all came or ``timeout``."""
        pending = set(self.grid.push_messages(messages))
        end = time.time() + (timeout if timeout is not None else 0.0)
        replies: list[Message] = []
        while pending:
            got = list(self.grid.pull_messages(pending))
            replies += got
            pending -= {m.metadata.reply_to_message_id for m in got}
            if not pending or (timeout is not None and time.time() >= end):
                break
            time.sleep(self.poll_interval)
        return replies
