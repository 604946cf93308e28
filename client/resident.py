"""A resident ClientApp worker: one process runs a SuperNode's ClientApp messages, run after run.

Flower starts (or, with :mod:`client.warm`, forks) a new ClientApp process for every message,
so the work a handler does before its first step -- importing the project from the FAB,
loading and tokenizing the node's partition, building the variant catalog and the model
skeleton -- is done again for every ``train`` and ``evaluate`` message, twice a round (issue 21
measured 1.9-3.6 s of handler and 4.5-8.8 s from fork to handler on the loopback cluster,
against 0.1 s in a Ray simulation, whose actors live for the run).  Flower has no long-lived
ClientApp (flwr issue #3670).

The warm SuperExec's zygote forks one *resident worker* at the first ClientApp task and hands
it every later task while it is idle; a task that arrives while the worker is busy gets a
one-shot fork as before.  The worker runs Flower's own ``run_clientapp`` for each task (pull the
message, install the FAB, load the ClientApp, run it, push the reply and the task's status),
with two names of that module rebound in this process only:

* ``flwr_exit``, which ends a task, runs the task's exit handlers (push the task output, stop
  its heartbeat, close its client) and returns to the worker's loop instead of exiting the
  process (Flower's version also starts a force-exit timer, which would kill the worker);
* ``get_load_client_app_fn``, whose loader first asks :class:`RunScope` whether the task
  belongs to the run and FAB the worker's project modules were imported for.  When the run id
  or the FAB hash changes, the project's modules are dropped from ``sys.modules`` (with every
  cache they hold: the run config, the partition, the loaders, the catalog) and the previous
  FAB's directory leaves ``sys.path``, so the new run imports its own code and builds its own
  caches.  Within a run the caches are keyed by what they depend on (``client.app``'s
  ``lru_cache`` keys: the run config's items, the data spec, the partition id).

So what survives across the messages of a run is exactly what a Ray simulation actor keeps; it
never survives a change of run, run config (a new run), data (read again by a new run) or code
(a new FAB hash).  The worker exits when the zygote closes its task pipe (the SuperExec ended)
or when the SuperExec's process dies (Flower's parent-process monitor, started once); if it dies
itself (killed, out of memory), the zygote forks a new one for the next task.  Its resident set
between messages is logged after every task (``[client.resident] ... rss N MB``).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, MutableSequence
from dataclasses import dataclass, field
from typing import Any, NoReturn

from experiment.switches import env_switch

#: Environment variable a resident worker sets when it takes a task: ``time.monotonic()`` then.
#: The ClientApp reports its start-up against it (a resident process's age says nothing).
TASK_STARTED_ENV = "HETFL_TASK_STARTED"
ENABLE_ENV = "HETFL_RESIDENT_CLIENTAPP"


def enabled() -> bool:
    """Whether the warm zygote keeps a resident worker (``HETFL_RESIDENT_CLIENTAPP`` not ``0``/off)."""
    return env_switch(ENABLE_ENV)


def task_started() -> float | None:
    """``time.monotonic()`` when this process's resident worker took its current task, else ``None``."""
    raw = os.environ.get(TASK_STARTED_ENV)
    try:
        return float(raw) if raw else None
    except ValueError:
        return None


@dataclass
class RunScope:
    """Which run and FAB this process's project modules belong to.

    :meth:`enter` is called before a task's ClientApp is loaded.  The first task sets the scope;
    a task of the same run and FAB keeps it (modules and caches reused); any other run id or FAB
    hash drops the project's modules (``forget``) and the previous FAB directory from
    ``path`` and returns the dropped module names.
    """

    forget: Callable[[dict[str, Any]], list[str]]
    run_id: int | None = None
    fab_hash: str | None = None
    project_dir: str | None = None
    changes: int = 0

    def enter(
        self,
        run_id: int,
        fab_hash: str,
        project_dir: str,
        *,
        modules: dict[str, Any],
        path: MutableSequence[str],
    ) -> list[str]:
        """Scope the next task to ``(run_id, fab_hash)``; return the project modules dropped."""
        if self.run_id is None:
            self.run_id, self.fab_hash, self.project_dir = run_id, fab_hash, project_dir
            return []
        if (self.run_id, self.fab_hash) == (run_id, fab_hash):
            return []
        dropped = self.forget(modules)
        if self.project_dir is not None:
            while self.project_dir in path:
                path.remove(self.project_dir)
        self.run_id, self.fab_hash, self.project_dir = run_id, fab_hash, project_dir
        self.changes += 1
        return dropped


class TaskEnded(Exception):
    """Raised in place of Flower's process exit at the end of one task (carries its exit code)."""

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.code = code


def end_task(code: int, *_: Any, **__: Any) -> NoReturn:
    """``flwr_exit`` for a resident worker: run the task's exit handlers, then raise :class:`TaskEnded`.

    Flower's ``flwr_exit`` runs the same two phases of exit handlers (push the task output,
    stop the heartbeat, close the client), then starts a timer that force-exits the process and
    calls ``sys.exit``; a worker that serves the next task must do neither.
    """
    finish_task()
    raise TaskEnded(code)


def finish_task() -> None:
    """Run and clear the exit handlers the current task registered (both of Flower's phases)."""
    from flwr.supercore.exit.exit_handler import trigger_exit_handlers

    trigger_exit_handlers(run_before_force_exit=True)
    trigger_exit_handlers(run_before_force_exit=False)


def scoped_loader_factory(
    scope: RunScope, factory: Callable[..., Any], log: Callable[[str], None]
) -> Callable[..., Any]:
    """Wrap Flower's ``get_load_client_app_fn`` so that each load is first scoped by ``scope``."""
    from flwr.common.config import get_project_dir
    from flwr.supercore.task_identity import TaskIdentity

    def get_load_client_app_fn(*args: Any, **kwargs: Any) -> Callable[[str, str, str], Any]:
        load = factory(*args, **kwargs)

        def scoped_load(fab_id: str, fab_version: str, fab_hash: str) -> Any:
            project_dir = str(get_project_dir(fab_id, fab_version, fab_hash))
            run_id = int(TaskIdentity.run_id)  # set by pull_task_input before the load
            dropped = scope.enter(run_id, fab_hash, project_dir, modules=sys.modules, path=sys.path)
            if dropped:
                log(f"run {run_id} / FAB {fab_hash[:12]}: new scope, {len(dropped)} project modules and caches dropped")
            return load(fab_id, fab_version, fab_hash)

        return scoped_load

    return get_load_client_app_fn


@dataclass
class PhaseClock:
    """Seconds a task spends in each of Flower's steps (functions of ``run_clientapp``'s module).

    :meth:`wrap` rebinds ``module.<name>`` to a timed call; :meth:`take` returns and resets the
    totals (``{"pull_task_input": 2.1, ...}``).
    """

    seconds: dict[str, float] = field(default_factory=dict)

    def wrap(self, module: Any, names: tuple[str, ...]) -> None:
        """Rebind each ``module.<name>`` to a call that adds its wall time to :attr:`seconds`."""
        for name in names:
            original = getattr(module, name)

            def timed(*args: Any, __name: str = name, __original: Any = original, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return __original(*args, **kwargs)
                finally:
                    self.seconds[__name] = self.seconds.get(__name, 0.0) + time.perf_counter() - start

            setattr(module, name, timed)

    def take(self) -> dict[str, float]:
        """The totals since the last call (then reset)."""
        out, self.seconds = self.seconds, {}
        return out


#: ``run_clientapp``'s steps the worker times: pull the message, install the FAB, run the app, push.
TIMED_STEPS = ("pull_task_input", "install_from_fab", "push_message")


def rss_mb() -> float:
    """This process's resident set (``VmRSS``) in MB; ``0.0`` where ``/proc`` is unavailable."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return 0.0
