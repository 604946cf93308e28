"""Keep the record of finished suite runs in the repository, so their tables can be rebuilt anywhere.

``results/`` is not tracked: a new checkout starts without the runs behind docs/RESULTS.md, and a
claim's paired difference could then only be re-derived by re-running hours of experiments.
:func:`archive_run` copies the few small files that :func:`deploy.reports.read_run` and the
runner's resume check read (``RECORD_FILES``, a few kB a run; no checkpoints, no logs) from a run's
results folder into ``docs/runs/<suite>-<preset>/runs/<run-name>/``. That folder is a valid
``--out`` of the runner, so ::

    python -m deploy.experiments SUITE --report-only --out docs/runs/SUITE-PRESET [--only ...]

rebuilds the tables and the claims from the archived runs alone, and ``--archive`` on a run call
adds each run to the archive the moment it finishes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from deploy.flower import ROOT

#: Tracked home of archived runs: ``ARCHIVE_DIR / <suite>-<preset> / runs / <run-name>``.
ARCHIVE_DIR = ROOT / "docs" / "runs"
#: What a finished run's folder must hold to be archived, and all that is copied: the runner's
#: marker (label, seed, run config, code commit), the run config as resolved, the per-round
#: metrics and the final summary.
RECORD_FILES = ("experiment.json", "config.json", "rounds.jsonl", "summary.csv")


class ArchiveError(ValueError):
    """A run folder lacks a record file: it is unfinished or not a suite run."""


def archive_run(folder: Path, dest: Path) -> list[Path]:
    """Copy ``folder``'s :data:`RECORD_FILES` into ``dest`` (created; same-named files replaced).

    Returns the copied files' paths under ``dest``.

    Raises
    ------
    ArchiveError
        If ``folder`` lacks one of :data:`RECORD_FILES`; nothing is copied then.

    """
    missing = [name for name in RECORD_FILES if not (folder / name).is_file()]
    if missing:
        raise ArchiveError(f"{folder} is not a finished suite run: it lacks {', '.join(missing)}")
    dest.mkdir(parents=True, exist_ok=True)
    return [Path(shutil.copy2(folder / name, dest / name)) for name in RECORD_FILES]


def archive_folder(suite: str, preset: str, archive_dir: Path | None = None) -> Path:
    """Where the runs of ``suite`` under ``preset`` are archived: ``archive_dir / "<suite>-<preset>"``.

    ``archive_dir`` defaults to :data:`ARCHIVE_DIR`, read at call time. The name does not follow
    the runner's ``--out``: runs made under any output folder land in the suite's one archive.
    """
    return (ARCHIVE_DIR if archive_dir is None else archive_dir) / f"{suite}-{preset}"
