"""``flwr``, Flower's CLI, with a FAB file walk that skips the directories ``.gitignore`` excludes.

``flwr run`` and ``flwr build`` collect the app's files with ``flwr.cli.utils.collect_files``: an
``os.walk`` of the whole project folder that resolves every file it finds, before ``.gitignore``
and the FAB rules filter them.  With the virtual environment inside the project (``.venv/``, as
``make setup`` makes it) that is about 55,000 files: ``flwr build`` took 10.1 s on a 2-core CI
machine (2026-12-02), 8 s of it in the walk, and every simulation and every submitted run pays it.

:func:`collect_files` walks the same tree but does not descend into a directory that the
project's ``.gitignore`` matches.  Without negated (``!``) patterns every file below such a
directory matches the same pattern, so Flower's filter would drop it anyway: the FAB is the one
Flower builds, byte for byte (``tests/test_flwr_cli.py``).  A ``.gitignore`` with a negated
pattern turns the pruning off (Flower's walk, unchanged).

``python -m deploy.flwr_cli ARGS`` is ``flwr ARGS`` with that one function replaced; the
launcher and the clusters start the CLI this way (:func:`deploy.flower.flwr_cli`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def prune_spec(root: Path) -> Any | None:
    """The pathspec of ``root/.gitignore`` used to prune directories; ``None`` (no pruning) if it negates.

    Also ``None`` when the file is missing or a symlink (Flower's walk skips symlinks, so it then
    applies no ``.gitignore`` rule).
    """
    from flwr.cli.utils import build_pathspec, load_gitignore_patterns

    gitignore = root / ".gitignore"
    if gitignore.is_symlink() or not gitignore.is_file():  # Flower skips a symlinked one: no rules at all
        return None
    patterns = load_gitignore_patterns(gitignore.read_bytes())
    if not patterns or any(p.lstrip().startswith("!") for p in patterns):
        return None
    return build_pathspec(patterns)


def collect_files(root: Path) -> dict[str, Path]:
    """Flower's ``collect_files``, without entering the directories ``root/.gitignore`` excludes.

    Relative POSIX path -> path; symlinks and paths that resolve outside ``root`` are skipped,
    as Flower does; :func:`prune_spec` decides the pruning.
    """
    resolved_root = root.resolve()
    spec = prune_spec(root)
    files: dict[str, Path] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        here = Path(dirpath)
        rel_dir = here.relative_to(root).as_posix()
        if spec is not None:
            prefix = "" if rel_dir == "." else f"{rel_dir}/"
            dirnames[:] = [d for d in dirnames if not spec.match_file(f"{prefix}{d}/")]
        for filename in filenames:
            path = here / filename
            if path.is_symlink():
                continue
            if not path.resolve().is_relative_to(resolved_root):
                continue
            files[path.relative_to(root).as_posix()] = path
    return files


def install() -> None:
    """Replace Flower's ``collect_files`` where the CLI looks it up."""
    import flwr.cli.build as build
    import flwr.cli.utils as utils

    for module in (build, utils):
        setattr(module, "collect_files", collect_files)  # noqa: B010 (a module attribute typed as Flower's)


def main() -> Any:
    """Run Flower's CLI (``flwr``) with :func:`collect_files` installed."""
    install()
    from flwr.cli.app import app

    return app(prog_name="flwr")


if __name__ == "__main__":
    raise SystemExit(main())
