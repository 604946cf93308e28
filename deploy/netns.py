"""Several "hosts" on one machine: Linux network namespaces joined by veth pairs.

:class:`HostNetwork` makes one namespace for the SuperLink and one per SuperNode; each
SuperNode namespace is wired to the SuperLink namespace by its own veth pair on a
``/30`` subnet of ``10.231.0.0/16`` (``10.231.<i>.1`` on the SuperLink side, ``.2`` on the
node side).  Nothing is routed to the root namespace or beyond: every address used lives
inside namespaces this class made and removes again.  Needs root (``CAP_NET_ADMIN``) and
the ``ip`` tool (iproute2).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field


class NamespaceError(RuntimeError):
    """Network namespaces or veth pairs cannot be created here."""


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise NamespaceError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")


@dataclass
class HostNetwork:
    """A SuperLink namespace and ``nodes`` SuperNode namespaces, each linked by a veth pair."""

    nodes: int
    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    created: list[str] = field(default_factory=list)

    @property
    def server(self) -> str:
        """Namespace of the SuperLink."""
        return f"hetfl-{self.tag}-s"

    def node(self, i: int) -> str:
        """Namespace of SuperNode ``i``."""
        return f"hetfl-{self.tag}-n{i}"

    @staticmethod
    def server_address(i: int) -> str:
        """The SuperLink's address as seen from SuperNode ``i``."""
        return f"10.231.{i}.1"

    @staticmethod
    def node_address(i: int) -> str:
        """SuperNode ``i``'s own address."""
        return f"10.231.{i}.2"

    def prefix(self, namespace: str) -> list[str]:
        """Command prefix that runs a program inside ``namespace``."""
        return ["ip", "netns", "exec", namespace]

    def create(self) -> HostNetwork:
        """Create the namespaces and links (undone by :meth:`remove`, also on failure)."""
        if shutil.which("ip") is None:
            raise NamespaceError("the 'ip' tool (iproute2) is not installed")
        if not 0 < self.nodes < 250:
            raise ValueError("nodes must be in 1..249")
        try:
            for ns in [self.server, *(self.node(i) for i in range(self.nodes))]:
                _ip("netns", "add", ns)
                self.created.append(ns)
                _ip("-n", ns, "link", "set", "lo", "up")
            for i in range(self.nodes):
                a, b = f"h{self.tag}s{i}", f"h{self.tag}n{i}"  # <= 15 characters
                _ip("link", "add", a, "netns", self.server, "type", "veth", "peer", "name", b, "netns", self.node(i))
                _ip("-n", self.server, "addr", "add", f"{self.server_address(i)}/30", "dev", a)
                _ip("-n", self.node(i), "addr", "add", f"{self.node_address(i)}/30", "dev", b)
                _ip("-n", self.server, "link", "set", a, "up")
                _ip("-n", self.node(i), "link", "set", b, "up")
        except Exception:
            self.remove()
            raise
        return self

    def remove(self) -> None:
        """Kill what still runs in every namespace made, then delete them (their veth ends go with them).

        A process left inside (a ServerApp stuck after its SuperLink was killed, found after a
        chaos case's timeout: 700 MB held for an hour) would keep its namespace and memory alive.
        """
        for ns in reversed(self.created):
            kill_members(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.created.clear()

    def __enter__(self) -> HostNetwork:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()


def kill_members(namespace: str) -> list[int]:
    """SIGKILL every process in ``namespace`` (``ip netns pids``); the pids killed."""
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False)
    pids = [int(p) for p in out.stdout.split()]
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


def namespaces_available(commands: Sequence[str] = ("ip",)) -> str | None:
    """``None`` when namespaces can be made here, else the reason they cannot."""
    for c in commands:
        if shutil.which(c) is None:
            return f"'{c}' is not installed"
    try:
        HostNetwork(nodes=1).create().remove()
    except NamespaceError as exc:
        return f"cannot create network namespaces here: {exc}"
    return None
