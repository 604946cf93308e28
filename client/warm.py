"""A SuperExec whose ClientApp processes are forked from a pre-warmed parent.

Flower's SuperExec starts a fresh ``flwr-clientapp`` process for every message a SuperNode
receives (``train``, ``evaluate``, ...).  On a 2-core edge device most of that process's life
is its imports: torch, transformers, datasets and flwr-datasets take ~7-9 s before the
ClientApp runs a single step, and a round pays it twice per node.

``python -m client.warm`` is ``flower-superexec`` (same arguments, same task polling, same
``--parent-pid`` monitoring; Flower's own code does all of it) with one change: ClientApp
tasks are not started with ``subprocess.Popen(["flwr-clientapp", ...])`` but forked from a
*zygote*, a process that has imported the ClientApp's dependencies once.  A forked child
runs Flower's own ``run_clientapp`` (pull the message, install the FAB, load the ClientApp,
run it, push the reply, exit), so per message the process is still new: memory is released
at exit and nothing of one message's state reaches the next; only the third-party modules'
import cost is paid once per SuperExec instead of once per message.

* The zygote (``python -m client.warm --zygote``, a clean single-threaded process) starts
  with a SuperNode's SuperExec (on a SuperLink's, only at a first ClientApp task).  A ClientApp
  task that arrives while it preloads waits in its queue (:func:`launch_route`) for up to
  :data:`PRELOAD_PATIENCE_S`; only a zygote that preloads longer (a hung one), or that died
  twice before it was ready, gets tasks launched cold.  A cold launch beside the preloading
  zygote imports the same libraries a second time: no sooner on a busy CPU, and twice the
  memory, which under a node's memory limit (a cgroup, ``mem_limit``) is an OOM kill.  A task
  that waits past Flower's 30-s claim window (``HEARTBEAT_DEFAULT_INTERVAL``) is handed back
  to pending by Flower and offered again under a new token; it then queues again, and the
  zygote's child for the expired token fails at its first call (Flower refuses the token)
  while the new one runs.  Measured on 10 SuperNodes sharing 2 cores: the zygotes needed 181 s
  to preload, and with a 20-s patience every first task was launched cold six times over (once
  per re-offer, each launch importing everything while the earlier ones still did).  Other
  task types (ServerApp) are launched by Flower's ``SubprocessExecutor`` unchanged.
* It imports :data:`PRELOAD` (``HETFL_WARM_PRELOAD``, comma-separated, default
  ``client.app``) and then forgets the project's own modules
  (:data:`PROJECT_PACKAGES`), so every child imports the project from the FAB it received,
  exactly as ``flwr-clientapp`` would, and only torch & co. are inherited.
* Children reseed Python's and numpy's global generators from the OS (a fresh process would
  have); torch's default generator is in its fresh-process state (the zygote draws nothing).
* When the SuperExec dies its pipe closes and the zygote exits; children watch the
  SuperExec's pid like ``flwr-clientapp`` does.  If the zygote dies, the next task starts a
  new one; if that fails, the task is launched as a plain subprocess.
* A child retries the pulls of its message's objects after 0.02 s, doubling to 0.5 s
  (:func:`quick_pull_retries`; ``HETFL_PULL_BACKOFF_S="INITIAL,CAP"``), where Flower waits
  1 s doubling to 10 s.  The SuperNode stores a message and creates its task *before* it has
  pulled the message's objects from the SuperLink, so the ClientApp launched for it usually
  asks for objects that are not there yet; with Flower's backoff it then sleeps 1 + 2 + 4 + 8 s
  although the objects arrive within a second or two (measured: 15-17 s of a 25-33 s message
  on the loopback cluster).  The overall limit stays Flower's (``PULL_MAX_TIME``, 2 h).
* ``HETFL_WARM_EXECUTOR=0`` turns it off (every task a plain ``flwr-clientapp`` process).
* Flower's task loop is run again when it fails while the SuperExec's parent lives
  (:func:`run_supervised`): Flower's ends at the first error of the API it polls that its
  retry does not cover, and a SuperLink starts its SuperExec once.

Use it where ``flower-superexec`` would be used: ``--isolation process`` with
``python -m client.warm --insecure --runtime-api-address SUPERNODE:9094``, or (what
:mod:`deploy.launch` does) ``--isolation subprocess`` with :func:`shim_dir` first on
``PATH`` so that the SuperNode's own ``flower-superexec`` is this one.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from logging import INFO, WARNING
from pathlib import Path
from typing import IO, Any

from experiment.switches import env_switch

#: Modules the zygote imports before forking (``HETFL_WARM_PRELOAD`` overrides).
PRELOAD = ("client.app",)
#: The project's top-level packages: dropped from the zygote after the preload so that each
#: ClientApp imports them from its own FAB.
PROJECT_PACKAGES = frozenset({"client", "experiment", "models", "server", "strategies", "deploy", "bench", "tests"})
ENABLE_ENV = "HETFL_WARM_EXECUTOR"
PRELOAD_ENV = "HETFL_WARM_PRELOAD"
PULL_BACKOFF_ENV = "HETFL_PULL_BACKOFF_S"
#: A ClientApp's retry delay for message objects its SuperNode has not received yet: first
#: retry after ``[0]`` s, doubling up to ``[1]`` s (Flower's defaults: 1 s and 10 s).
PULL_BACKOFF_S = (0.02, 0.5)
#: How long (s) ClientApp tasks wait for a preloading zygote before they are launched cold: a
#: zygote preloading longer is taken for hung.  Far above Flower's 30-s claim window: a task
#: not claimed in it is offered again and queues again (module docstring).
PRELOAD_PATIENCE_S = 600.0
#: Zygotes that may exit before they are ready; after that every ClientApp task is launched cold.
ZYGOTE_START_LIMIT = 2
#: Pauses (s) before Flower's task loop is run again after a failure: first, doubling up to the cap.
LOOP_RESTART_S = (1.0, 30.0)


@dataclass(frozen=True)
class ChildSpec:
    """What one forked ClientApp needs: the fields of Flower's ``ExecutionSpec`` it reads."""

    runtime_api_address: str
    token: str
    insecure: bool
    root_certificates_path: str | None
    runtime_dependency_install: bool
    parent_pid: int | None
    suppress_output: bool

    def to_line(self) -> bytes:
        """One JSON line (the zygote's wire format)."""
        return (json.dumps(asdict(self)) + "\n").encode()

    @classmethod
    def from_line(cls, line: bytes) -> ChildSpec:
        """Parse :meth:`to_line`'s output; raises ``ValueError`` (naming the field) if malformed."""
        raw = json.loads(line)
        if not isinstance(raw, dict):
            raise ValueError("a launch request must be a JSON object")
        fields = cls.__dataclass_fields__
        missing = sorted(set(fields) - set(raw))
        if missing:
            raise ValueError(f"launch request lacks {', '.join(missing)}")
        if not isinstance(raw["token"], str) or not raw["token"].strip():
            raise ValueError("launch request field 'token' must be a non-empty string")
        if not isinstance(raw["runtime_api_address"], str) or not raw["runtime_api_address"].strip():
            raise ValueError("launch request field 'runtime_api_address' must be a non-empty string")
        return cls(**{k: raw[k] for k in fields})


def enabled() -> bool:
    """Whether ClientApp tasks are forked (``HETFL_WARM_EXECUTOR`` not ``0``/``false``/``off``)."""
    return env_switch(ENABLE_ENV)


def preload_modules() -> tuple[str, ...]:
    """The modules to preload: ``HETFL_WARM_PRELOAD`` (comma-separated) or :data:`PRELOAD`."""
    raw = os.environ.get(PRELOAD_ENV)
    if raw is None:
        return PRELOAD
    return tuple(m.strip() for m in raw.split(",") if m.strip())


def forget_project_modules(modules: dict[str, Any], packages: frozenset[str] = PROJECT_PACKAGES) -> list[str]:
    """Remove the project's own modules from ``modules`` (``sys.modules``); return their names."""
    names = [name for name in modules if name.partition(".")[0] in packages]
    for name in names:
        del modules[name]
    return names


# --------------------------------------------------------------------------- zygote


def pull_backoff() -> tuple[float, float]:
    """``(initial, cap)`` retry delay in seconds: ``$HETFL_PULL_BACKOFF_S`` (``"INITIAL,CAP"``) or the default."""
    raw = os.environ.get(PULL_BACKOFF_ENV, "").strip()
    if not raw:
        return PULL_BACKOFF_S
    try:
        initial, cap = (float(x) for x in raw.split(","))
    except ValueError:
        raise ValueError(f"{PULL_BACKOFF_ENV}={raw!r}: expected two numbers 'INITIAL,CAP' in seconds") from None
    if not 0 < initial <= cap:
        raise ValueError(f"{PULL_BACKOFF_ENV}={raw!r}: need 0 < INITIAL <= CAP")
    return initial, cap


def quick_pull_retries(initial: float, cap: float, module: Any = None) -> None:
    """Make this process's Flower object pulls retry after ``initial`` s, doubling to ``cap`` s.

    Wraps ``module.pull_objects`` (default ``flwr.supercore.inflatable.inflatable_utils``,
    through which ``run_clientapp`` pulls its message; :mod:`client.supernode` passes the
    SuperNode's module, which imported the name) so that every call uses this backoff and no
    per-object try limit; the overall time limit (``max_time``) is the caller's, Flower's 2 h by
    default.  Idempotent.
    """
    if module is None:
        from flwr.supercore.inflatable import inflatable_utils as module

    original = getattr(module.pull_objects, "__wrapped__", module.pull_objects)

    @functools.wraps(original)
    def pull_objects(object_ids: list[str], pull_object_fn: Any, **kwargs: Any) -> dict[str, bytes]:
        kwargs.update(initial_backoff=initial, backoff_cap=cap, max_tries_per_object=None)
        return original(object_ids, pull_object_fn, **kwargs)

    module.pull_objects = pull_objects


def _reap(*_: object) -> None:
    """Collect every finished child (SIGCHLD handler of the zygote)."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _set_process_name(name: bytes) -> None:
    """Name this process (``/proc/PID/comm``, what ``ps``/``top`` show) where Linux allows it."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def _become_child(spec: ChildSpec) -> None:
    """Turn a fresh fork of the zygote into a ClientApp process: signals, stdio, name, generators."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    _set_process_name(b"flwr-clientapp")
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    if spec.suppress_output:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)
    os.close(devnull)
    random.seed()
    import numpy as np

    np.random.seed(int.from_bytes(os.urandom(4), "little"))
    sys.argv = ["flwr-clientapp", "--runtime-api-address", spec.runtime_api_address, "--token", "***"]


def _clientapp_arguments(spec: ChildSpec, parent_pid: int | None) -> dict[str, Any]:
    """The arguments of Flower's ``run_clientapp`` for the task ``spec``."""
    from flwr.supercore.tls import validate_and_resolve_root_certificates

    return {
        "runtime_api_address": spec.runtime_api_address,
        "token": spec.token,
        "insecure": spec.insecure,
        "certificates": validate_and_resolve_root_certificates(spec.root_certificates_path, spec.insecure),
        "parent_pid": parent_pid,
        "runtime_dependency_install": spec.runtime_dependency_install,
    }


def _run_child(spec: ChildSpec) -> int:
    """Body of a forked one-shot child: Flower's ``flwr-clientapp`` for one task; returns its exit code."""
    _become_child(spec)
    from flwr.supernode.runtime.run_clientapp import run_clientapp

    try:
        quick_pull_retries(*pull_backoff())
        run_clientapp(**_clientapp_arguments(spec, spec.parent_pid))
    except SystemExit as exit_:  # flwr_exit ends every task this way
        return exit_.code if isinstance(exit_.code, int) else 1
    except BaseException as exc:
        print(f"[client.warm] ClientApp child failed: {exc!r}", file=sys.stderr, flush=True)
        return 1
    return 0


def _serve_resident(first: ChildSpec, tasks_fd: int, done_fd: int) -> int:
    """Body of the resident worker (:mod:`client.resident`): run each task line read from ``tasks_fd``.

    Writes ``done`` to ``done_fd`` after every task; returns when the zygote closes the pipe.
    """
    _become_child(first)
    from flwr.common import log
    from flwr.supernode.runtime import run_clientapp as flower

    import client.resident as resident

    forget_project_modules(sys.modules)  # the ClientApp imports the project from its FAB

    def note(text: str) -> None:
        log(INFO, "[client.resident] %d: %s", os.getpid(), text)

    scope = resident.RunScope(forget=forget_project_modules)
    flower.flwr_exit = resident.end_task  # Flower's exit would end the worker
    flower.get_load_client_app_fn = resident.scoped_loader_factory(scope, flower.get_load_client_app_fn, note)
    clock = resident.PhaseClock()
    clock.wrap(flower, resident.TIMED_STEPS)
    quick_pull_retries(*pull_backoff())
    monitoring = False
    served = 0
    with os.fdopen(tasks_fd, "rb") as tasks:
        for line in iter(tasks.readline, b""):
            spec = ChildSpec.from_line(line)
            os.environ[resident.TASK_STARTED_ENV] = repr(time.monotonic())
            started = time.perf_counter()
            code = 0
            try:
                # one parent-process monitor for the worker's life: the first task starts it
                flower.run_clientapp(**_clientapp_arguments(spec, None if monitoring else spec.parent_pid))
            except resident.TaskEnded as ended:
                code = ended.code
            except Exception as exc:
                note(f"task failed outside the ClientApp: {exc!r}")
                resident.finish_task()  # its status is still pushed, and nothing of it reaches the next task
                code = 1
            monitoring = True
            served += 1
            os.environ.pop(resident.TASK_STARTED_ENV, None)
            seconds = time.perf_counter() - started
            steps = ", ".join(f"{name} {value:.2f} s" for name, value in clock.take().items())
            note(f"task {served} ended (code {code}) in {seconds:.2f} s; rss {resident.rss_mb():.0f} MB ({steps})")
            os.write(done_fd, b"done\n")
    return 0


@dataclass
class _Worker:
    """The zygote's handle on its resident worker: pid, task pipe, done pipe, tasks not yet done."""

    pid: int
    tasks_fd: int
    done_fd: int
    outstanding: int = 0

    def idle(self) -> bool | None:
        """``True`` idle, ``False`` busy, ``None`` gone (its done pipe closed); never blocks."""
        while True:
            try:
                chunk = os.read(self.done_fd, 4096)
            except BlockingIOError:
                return self.outstanding == 0
            if not chunk:
                return None
            self.outstanding = max(0, self.outstanding - chunk.count(b"done"))

    def send(self, line: bytes) -> bool:
        """Hand the worker a task line; ``False`` if its pipe is closed."""
        try:
            os.write(self.tasks_fd, line)
        except OSError:
            return False
        self.outstanding += 1
        return True

    def close(self) -> None:
        for fd in (self.tasks_fd, self.done_fd):
            with contextlib.suppress(OSError):
                os.close(fd)


def _fork_worker(spec: ChildSpec) -> _Worker | None:
    """Fork the resident worker (its first task is ``spec``); ``None`` if the fork failed."""
    tasks_r, tasks_w = os.pipe()
    done_r, done_w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        for fd in (tasks_r, tasks_w, done_r, done_w):
            os.close(fd)
        return None
    if pid == 0:
        code = 1
        try:
            os.close(tasks_w)
            os.close(done_r)
            code = _serve_resident(spec, tasks_r, done_w)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(tasks_r)
    os.close(done_w)
    os.set_blocking(done_r, False)
    worker = _Worker(pid=pid, tasks_fd=tasks_w, done_fd=done_r)
    return worker if worker.send(spec.to_line()) else None


def _fork_one_shot(spec: ChildSpec, inherited: _Worker | None) -> None:
    """Fork a child that runs ``spec`` and exits (the resident worker's pipes closed in it)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            if inherited is not None:
                inherited.close()
            code = _run_child(spec)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)


def zygote(stdin: IO[bytes] | None = None, ready_fd: int | None = None) -> int:
    """Preload, then run each launch request line read from ``stdin``; exit on EOF.

    A request goes to the resident worker (:mod:`client.resident`; forked at the first request,
    again if it died) when it is idle, else to a one-shot fork; with
    ``HETFL_RESIDENT_CLIENTAPP=0`` every request gets a one-shot fork.

    After the preload it writes ``ready`` to ``ready_fd`` (and closes it, so no child inherits it).
    """
    from flwr.common import log

    from client.resident import enabled as resident_on  # (forgotten with the project below)

    resident_enabled = resident_on()
    for module in preload_modules():
        try:
            __import__(module)
        except Exception as exc:
            log(WARNING, "[client.warm] preloading %s failed (%r); children import it themselves", module, exc)
    dropped = forget_project_modules(sys.modules)
    log(INFO, "[client.warm] zygote %d ready: %d modules loaded (%d project modules left to the FAB)",
        os.getpid(), len(sys.modules), len(dropped))  # fmt: skip
    if ready_fd is not None:
        os.write(ready_fd, b"ready\n")
        os.close(ready_fd)
    signal.signal(signal.SIGCHLD, _reap)
    worker: _Worker | None = None
    stream = stdin if stdin is not None else sys.stdin.buffer
    for line in iter(stream.readline, b""):
        try:
            spec = ChildSpec.from_line(line)
        except ValueError as exc:
            log(WARNING, "[client.warm] ignored a malformed launch request: %s", exc)
            continue
        if resident_enabled:
            state = worker.idle() if worker is not None else None
            if state is None:
                if worker is not None:
                    log(WARNING, "[client.warm] the resident worker %d is gone; forking a new one", worker.pid)
                    worker.close()
                worker = _fork_worker(spec)
                if worker is not None:
                    continue
            elif state and worker is not None and worker.send(line):
                continue
        _fork_one_shot(spec, worker)
    if worker is not None:
        worker.close()
    return 0


# --------------------------------------------------------------------------- executor


def launch_route(*, alive: bool, ready: bool, preloading_s: float, patience_s: float = PRELOAD_PATIENCE_S) -> str:
    """Where a ClientApp task goes: ``"fork"``, ``"queue"`` or ``"cold"``.

    ``"fork"``: the zygote is alive and ready.  ``"queue"``: it is alive and has preloaded for
    less than ``patience_s`` seconds -- the task line waits in its pipe, and is forked as soon
    as the preload ends.  ``"cold"``: no live zygote, or one preloading for too long; the task
    is a plain ``flwr-clientapp`` process.
    """
    if not alive:
        return "cold"
    if ready:
        return "fork"
    return "queue" if preloading_s < patience_s else "cold"


class WarmExecutor:
    """Flower ``Executor`` that forks ClientApp tasks from a zygote, the rest as subprocesses.

    The zygote starts at construction when ``eager`` (a SuperNode's SuperExec), else on the
    first ClientApp task.  While it preloads, ClientApp tasks queue for it, for at most
    :data:`PRELOAD_PATIENCE_S` (:func:`launch_route`); a zygote that exits before it is ready
    is started again, up to :data:`ZYGOTE_START_LIMIT` times, after which tasks go cold.
    """

    def __init__(self, *, eager: bool = True) -> None:
        from flwr.supercore.superexec.executor.subprocess_executor import SubprocessExecutor

        self._cold = SubprocessExecutor()
        self._zygote: subprocess.Popen[bytes] | None = None
        self._ready_fd: int | None = None
        self._ready = False
        self._started_at = 0.0
        self._failed_starts = 0
        self._lock = threading.Lock()
        if eager:
            self._start_zygote()

    def get_eligible_capacity(self, supported_task_types: Any, **kwargs: Any) -> Any:
        """As Flower's subprocess executor: every task type, no capacity wait."""
        return self._cold.get_eligible_capacity(supported_task_types, **kwargs)

    def wait_for_capacity(self, task_type: Any = None, **kwargs: Any) -> None:
        """No capacity gate."""
        self._cold.wait_for_capacity(task_type, **kwargs)

    def _start_zygote(self) -> None:
        if self._ready_fd is not None:  # a previous zygote's
            os.close(self._ready_fd)
            self._ready_fd = None
        read_fd, write_fd = os.pipe()
        self._zygote = subprocess.Popen(
            [sys.executable, "-m", "client.warm", "--zygote", str(write_fd)], stdin=subprocess.PIPE,
            pass_fds=(write_fd,),
        )  # fmt: skip
        os.close(write_fd)
        self._ready_fd, self._ready = read_fd, False
        self._started_at = time.monotonic()

    def _zygote_ready(self) -> bool:
        """Whether the zygote is alive and done preloading (never blocks).

        ``self._ready`` keeps whether it ever reported ready, alive or not.
        """
        if not self._ready and self._ready_fd is not None:
            readable, _, _ = select.select([self._ready_fd], [], [], 0)
            if readable:
                self._ready = os.read(self._ready_fd, 16).startswith(b"ready")
                os.close(self._ready_fd)
                self._ready_fd = None
        return self._ready and self._zygote is not None and self._zygote.poll() is None

    def launch(self, spec: Any) -> Any:
        """Fork a ClientApp task from the zygote once it is ready; everything else cold."""
        from flwr.common import log
        from flwr.supercore.constant import TaskType
        from flwr.supercore.superexec.executor.types import LaunchResult

        if spec.task_type != TaskType.CLIENT_APP:
            return self._cold.launch(spec)
        line = ChildSpec(
            runtime_api_address=spec.runtime_api_address, token=spec.token, insecure=spec.insecure,
            root_certificates_path=spec.root_certificates_path,
            runtime_dependency_install=spec.runtime_dependency_install, parent_pid=spec.parent_pid,
            suppress_output=spec.suppress_output,
        ).to_line()  # fmt: skip
        with self._lock:
            self._restart_if_gone()
            alive = self._zygote is not None and self._zygote.poll() is None
            ready = self._zygote_ready()
            preloading_s = time.monotonic() - self._started_at
            route = launch_route(alive=alive, ready=ready, preloading_s=preloading_s)
            if route != "cold":
                try:
                    stdin = self._zygote.stdin if self._zygote is not None else None
                    if stdin is None:
                        raise OSError("the zygote has no open stdin")
                    stdin.write(line)
                    stdin.flush()
                    if route == "queue":
                        log(INFO, "[client.warm] task %d queued for the zygote (preloading for %.1f s)",
                            spec.task_id, preloading_s)  # fmt: skip
                    return LaunchResult.accepted()
                except OSError as exc:
                    log(WARNING, "[client.warm] zygote unreachable (%r)", exc)
                    self._zygote, self._ready = None, False
            reason = "no zygote" if not alive else f"zygote still preloading after {preloading_s:.0f} s"
            log(INFO, "[client.warm] task %d launched cold (%s)", spec.task_id, reason)
        return self._cold.launch(spec)

    def _restart_if_gone(self) -> None:
        """Start a new zygote if the last one exited, unless :data:`ZYGOTE_START_LIMIT` died unready."""
        from flwr.common import log

        z = self._zygote
        if z is not None and z.poll() is None:
            return
        if z is not None and not (self._zygote_ready() or self._ready):
            self._failed_starts += 1
        if self._failed_starts >= ZYGOTE_START_LIMIT:
            if z is not None:
                log(WARNING, "[client.warm] %d zygotes exited before they were ready; ClientApps now start cold",
                    self._failed_starts)  # fmt: skip
                self._zygote = None
            return
        if z is not None:
            log(WARNING, "[client.warm] zygote exited (code %s); starting a new one", z.returncode)
        self._start_zygote()

    def close(self) -> None:
        """Close the zygote's pipe (it exits on EOF) and wait briefly for it."""
        with self._lock:
            z, self._zygote = self._zygote, None
            if self._ready_fd is not None:
                os.close(self._ready_fd)
                self._ready_fd = None
        if z is None:
            return
        try:
            if z.stdin is not None:
                z.stdin.close()
            z.wait(timeout=5)
        except (OSError, subprocess.TimeoutExpired):
            z.kill()

    def reconcile(self) -> None:
        """Nothing to reconcile (no pool)."""


def serves_clientapps(argv: list[str]) -> bool:
    """Whether a SuperExec started with ``argv`` runs a SuperNode's tasks (start the zygote now).

    True without ``--parent-pid`` (a standalone SuperExec next to a ``--isolation process``
    SuperNode, as in the ClientApp image) or when the parent is a ``flower-supernode``; false
    for a SuperLink's SuperExec, which runs ServerApps (cold) and starts a zygote only if it
    ever gets a ClientApp task.
    """
    if "--parent-pid" not in argv[:-1]:
        return True
    parent = argv[argv.index("--parent-pid") + 1]
    try:
        return b"flower-supernode" in Path(f"/proc/{int(parent)}/cmdline").read_bytes()
    except (OSError, ValueError):
        return True


def parent_alive(argv: list[str]) -> bool:
    """Whether the process named by ``--parent-pid`` in ``argv`` still runs (True without one)."""
    if "--parent-pid" not in argv[:-1]:
        return True
    try:
        os.kill(int(argv[argv.index("--parent-pid") + 1]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, ValueError):
        return True
    return True


def run_supervised(
    loop: Callable[[], object],
    alive: Callable[[], bool],
    *,
    pauses: tuple[float, float] = LOOP_RESTART_S,
    sleep: Callable[[float], None] = time.sleep,
) -> None:
    """Run Flower's SuperExec ``loop`` until it returns, again after each failure while ``alive()``.

    Flower's loop ends at the first error of the Runtime API it polls that its HTTP retry does
    not cover (it retries 503 and 504 only, ``flwr.supercore.retry.http_retry``): a single
    transient ``500`` of a SuperLink (a state-database write that waited past SQLite's 5 s busy
    timeout on a loaded machine) ends it, and a SuperLink starts its SuperExec once and never
    again, so no ServerApp is launched after that: every run submitted stays pending. Here the
    loop is run again after a pause (``pauses[0]`` s, doubling up to ``pauses[1]``); once
    ``alive()`` is false (the parent is gone) the failure is raised. ``SystemExit`` (Flower's
    own exits: bad configuration, the parent gone) and ``KeyboardInterrupt`` are not caught.
    """
    from flwr.common import log

    pause = pauses[0]
    while True:
        try:
            loop()
            return
        except Exception as exc:
            if not alive():
                raise
            log(WARNING, "[client.warm] the SuperExec's task loop failed (%r); running it again in %.0f s", exc, pause)
            sleep(pause)
            pause = min(2 * pause, pauses[1])


def shim_dir(home: Path) -> Path:
    """A directory with a ``flower-superexec`` that runs this module (put it first on ``PATH``).

    A SuperNode in ``subprocess`` isolation starts ``flower-superexec`` from ``PATH``; with
    this directory first it starts the warm SuperExec instead, with the same arguments.
    """
    path = home / "warm-bin"
    path.mkdir(parents=True, exist_ok=True)
    shim = path / "flower-superexec"
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m client.warm "$@"\n')
    shim.chmod(0o755)
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m client.warm [flower-superexec args]`` or ``--zygote`` (internal)."""
    args = sys.argv[1:] if argv is None else argv
    if args[:1] == ["--zygote"]:
        return zygote(ready_fd=int(args[1]) if len(args) > 1 else None)
    import flwr.supercore.superexec.run_superexec as run_superexec
    from flwr.supercore.cli import flower_superexec
    from flwr.supercore.constant import ExecutorType

    if enabled():
        flower_get_executor = run_superexec.get_executor

        def get_executor(executor_type: Any, executor_config: Any = None, **kwargs: Any) -> Any:
            if executor_type == ExecutorType.SUBPROCESS:
                return WarmExecutor(eager=serves_clientapps(args))
            return flower_get_executor(executor_type, executor_config, **kwargs)

        run_superexec.get_executor = get_executor  # type: ignore[assignment]
    sys.argv = ["flower-superexec", *args]
    run_supervised(flower_superexec, functools.partial(parent_alive, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
