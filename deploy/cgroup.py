"""A memory-limited cgroup for one SuperNode on a host without containers.

``MemoryCgroup(limit_mb)`` creates a child cgroup (v2 ``memory.max`` or v1
``memory.limit_in_bytes``), and :meth:`MemoryCgroup.enter` (used as ``preexec_fn``) moves a
starting process into it, so the SuperNode and every ClientApp process it spawns share
the limit -- as under ``docker run --memory``.  The ClientApp reads the limit of its own
cgroup (:func:`client.profile.cgroup_memory_limit_mb`) and sizes its variant to it.
Needs write access to the cgroup hierarchy (root).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")


class CgroupError(RuntimeError):
    """No writable memory cgroup hierarchy."""


@dataclass
class MemoryCgroup:
    """A child memory cgroup with a hard limit of ``limit_mb`` MiB."""

    limit_mb: float
    name: str = field(default_factory=lambda: f"hetfl-{uuid.uuid4().hex[:8]}")
    root: Path = ROOT
    path: Path | None = None
    version: int = 0

    def create(self) -> MemoryCgroup:
        """Create the cgroup and set its limit (swap limited too where the kernel accounts it)."""
        limit = str(int(self.limit_mb * 1024 * 1024))
        if (self.root / "cgroup.controllers").exists():
            base = self.root
            if "memory" not in (base / "cgroup.subtree_control").read_text().split():
                raise CgroupError(f"the memory controller is not enabled in {base}/cgroup.subtree_control")
            self.version, files = 2, {"memory.max": limit, "memory.swap.max": "0"}
        elif (self.root / "memory" / "memory.limit_in_bytes").exists():
            base = self.root / "memory"
            self.version, files = 1, {"memory.limit_in_bytes": limit, "memory.memsw.limit_in_bytes": limit}
        else:
            raise CgroupError(f"no cgroup memory controller under {self.root}")
        path = base / self.name
        try:
            path.mkdir()
        except OSError as exc:
            raise CgroupError(f"cannot create {path}: {exc}") from exc
        self.path = path
        for fname, value in files.items():
            try:
                (path / fname).write_text(value)
            except OSError:
                if fname in ("memory.swap.max", "memory.memsw.limit_in_bytes"):
                    continue  # swap accounting off: RAM limit alone
                self.remove()
                raise
        return self

    def enter(self) -> None:
        """Move the calling process into the cgroup (for ``subprocess.Popen(preexec_fn=...)``)."""
        (self._folder() / "cgroup.procs").write_text(str(os.getpid()))

    def _folder(self) -> Path:
        if self.path is None:
            raise CgroupError("the cgroup was not created yet (use it as a context manager or call create())")
        return self.path

    def _read(self, name: str) -> str:
        return (self._folder() / name).read_text()

    def pids(self) -> list[int]:
        """Processes in the cgroup now."""
        return [int(x) for x in self._read("cgroup.procs").split()]

    def peak_mb(self) -> float:
        """Peak memory charged to the cgroup (RSS and page cache), MiB."""
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        return int(self._read(name)) / (1024 * 1024)

    def oom_kills(self) -> int:
        """Processes the kernel killed for exceeding the limit."""
        text = self._read("memory.events" if self.version == 2 else "memory.oom_control")
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def remove(self, timeout: float = 10.0) -> None:
        """Remove the cgroup once its processes are gone."""
        if self.path is None:
            return
        deadline = time.time() + timeout
        while True:
            try:
                self.path.rmdir()
                break
            except OSError:
                if time.time() > deadline:
                    break
                time.sleep(0.2)
        self.path = None

    def __enter__(self) -> MemoryCgroup:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.remove()
