"""What every Flower process the project starts shares: the executables, the environment, a run's outcome.

``ROOT`` (the project, the app ``flwr run`` submits) and ``BIN`` (this interpreter's Flower
executables); :func:`flower_env` (own ``FLWR_HOME``, no telemetry, no runtime installs, the warm
SuperExec's shim on ``PATH``) and :func:`flower_home` (a temporary home per run); what a run
produced (:class:`RunOutcome`) and why it stopped (:func:`failure_reason`).  Used by the
simulation launcher (:mod:`deploy.launch`) and the deployment cluster (:mod:`deploy.cluster`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from client.warm import enabled as warm_enabled
from client.warm import shim_dir
from deploy.overrides import merge_overrides
from experiment.outputs import SUMMARY_FILE

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def flwr_cli(bin_dir: Path | None = None) -> list[str]:
    """The command that runs Flower's CLI, ``flwr``: :mod:`deploy.flwr_cli` (its FAB walk skips ``.venv/``)."""
    return [str((bin_dir or BIN) / "python"), "-m", "deploy.flwr_cli"]


def flower_env(flwr_home: Path) -> dict[str, str]:
    """Environment for every Flower process: own FLWR_HOME, no telemetry, no installs."""
    env = dict(os.environ)
    env.update(
        {
            "FLWR_HOME": str(flwr_home),
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "PYTHONUNBUFFERED": "1",
            # the SuperExec that starts every ServerApp / ClientApp process polls for new
            # tasks every second by default; 0.1 s cuts up to ~1 s per message and hop
            "FLWR_SUPEREXEC_TASK_POLL_INTERVAL": os.environ.get("FLWR_SUPEREXEC_TASK_POLL_INTERVAL", "0.1"),
        }
    )
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    if warm_enabled():
        # SuperNodes start `flower-superexec` from PATH: the warm one forks each ClientApp
        # from a process that has imported torch & co. once (client/warm.py)
        env["PATH"] = f"{shim_dir(flwr_home)}{os.pathsep}{env['PATH']}"
    return env


@contextmanager
def flower_home(given: Path | None) -> Iterator[Path]:
    """``given``, or a temporary Flower home that is removed when the run ends (issue 23 item 6).

    A run's Flower home holds only what lives as long as the run: the CLI's connection file, the
    SuperLink's state database, SuperNode keys made for it and the warm SuperExec's shim; the
    run's results and logs go to its results folder.
    """
    if given is not None:
        yield given
        return
    home = Path(tempfile.mkdtemp(prefix="flwr-home-"))
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def run_config_arg(run_config: str, results_dir: Path, run_name: str) -> str:
    """``run_config`` with the run's results folder (``results-dir``, ``run-name``) set last."""
    return merge_overrides(run_config, f"results-dir='{results_dir}' run-name='{run_name}'")


@dataclass
class RunOutcome:
    """What a launched run produced."""

    returncode: int
    results: Path
    log: str

    @property
    def ok(self) -> bool:
        """The run finished and wrote its summary."""
        return self.returncode == 0 and (self.results / SUMMARY_FILE).exists()

    @property
    def reason(self) -> str | None:
        """Why the run stopped, when the ServerApp raised one of the project's typed errors."""
        return failure_reason(self.log)


#: The project's errors that say what to change (key, value, fix) when they stop a run.
TYPED_ERRORS = (
    "NothingToTrain",
    "ConfigError",
    "PreflightError",
    "DataError",
    "UnknownMethod",
    "FactoryNotFound",
    "CheckpointIncompatible",
)
_TYPED_ERROR = re.compile(rf"\b({'|'.join(TYPED_ERRORS)}): (.+)$")


def failure_reason(output: str) -> str | None:
    """The last ``<TypedError>: message`` line of a run's output (Flower prints the ServerApp's traceback)."""
    found = None
    for line in output.splitlines():
        match = _TYPED_ERROR.search(line.strip())
        if match:
            found = f"{match.group(1)}: {match.group(2)}"
    return found


def machine_fingerprint(cpuinfo: Path = Path("/proc/cpuinfo")) -> dict[str, str | int]:
    """What a run's numbers depend on beyond the code: the CPU, its instruction set, the core count, torch.

    Runs of one seed and one code are bit-identical on one machine but differ by a few test
    examples across machines (docs/RESULTS.md, "Same-seed runs across machines"), so a paired
    difference is only as good as the machines of its two rows: the suite runner writes this
    into each run's marker.  ``cpu-flags`` is the first 12 hex digits of the SHA-256 of the
    sorted instruction-set flags (what decides the vector kernels a BLAS picks); fields that
    cannot be read are ``"unknown"``.
    """
    import hashlib
    from importlib import metadata

    model, flags = "unknown", "unknown"
    try:
        text = cpuinfo.read_text()
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == "unknown":
            model = value.strip()
        elif key.strip() == "flags" and flags == "unknown":
            joined = " ".join(sorted(value.split()))
            flags = hashlib.sha256(joined.encode()).hexdigest()[:12]
    try:
        torch_version = metadata.version("torch")
    except metadata.PackageNotFoundError:
        torch_version = "unknown"
    return {"cpu": model, "cpu-flags": flags, "cores": os.cpu_count() or 0, "torch": torch_version}


def code_version(root: Path = ROOT) -> str:
    """The commit of the code under ``root``, ``-dirty`` appended when tracked files differ from it.

    ``"unknown"`` where ``root`` is not a git checkout or git is missing (e.g. a copy of the tree
    on another machine).  Recorded beside each suite run, so a result names the code that made it.
    """

    def git(*args: str) -> str:
        run = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True, timeout=30)
        return run.stdout.strip()

    try:
        head = git("rev-parse", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return f"{head}-dirty" if changed else head
