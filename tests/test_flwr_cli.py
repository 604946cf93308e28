"""``python -m deploy.flwr_cli``: Flower's CLI with a FAB walk that skips .gitignore'd directories."""

from __future__ import annotations

import io
import subprocess
import sys
import zipfile
from pathlib import Path

import flwr.cli.utils as flower_utils
from flwr.cli.build import build_fab_from_files
from flwr.common.constant import FAB_MAX_SIZE

from deploy.flower import ROOT, flwr_cli
from deploy.flwr_cli import collect_files, prune_spec


def test_the_project_fab_is_byte_for_byte_the_one_flower_builds() -> None:
    ours, flowers = collect_files(ROOT), flower_utils.collect_files(ROOT)
    assert len(ours) < len(flowers) / 10  # the virtual environment is not walked
    fab, metadata = build_fab_from_files(ours)
    reference, reference_metadata = build_fab_from_files(flowers)
    assert fab == reference and metadata == reference_metadata


def test_the_project_fab_ships_the_code_not_the_archived_runs() -> None:
    """docs/runs/ grows with every archived run; in the FAB it passed Flower's 10 MiB limit (2026-12-06)."""
    fab, _ = build_fab_from_files(collect_files(ROOT))
    names = zipfile.ZipFile(io.BytesIO(fab)).namelist()
    assert "server/app.py" in names and "client/app.py" in names and "strategies/base.py" in names
    assert not [n for n in names if n.startswith("docs/")]
    assert len(fab) < FAB_MAX_SIZE / 4  # room to grow: the code alone is about 1.4 MB


def _tree(root: Path, gitignore: str) -> None:
    for rel in ("app/a.py", "app/cache/b.py", "keep/cache/c.py", "venv/lib/d.py", "venv/lib/e.toml", "f.md"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x = 1\n")
    (root / ".gitignore").write_text(gitignore)


def test_excluded_directories_are_not_entered_and_a_negated_pattern_turns_pruning_off(tmp_path: Path) -> None:
    _tree(tmp_path, "venv/\n/app/cache/\n")
    assert sorted(collect_files(tmp_path)) == [".gitignore", "app/a.py", "f.md", "keep/cache/c.py"]
    negated = tmp_path / "negated"
    _tree(negated, "venv/\n!venv/lib/d.py\n")
    assert prune_spec(negated) is None
    assert collect_files(negated) == flower_utils.collect_files(negated)
    bare = tmp_path / "bare"
    _tree(bare, "")
    assert prune_spec(bare) is None and collect_files(bare) == flower_utils.collect_files(bare)
    linked = tmp_path / "linked"  # Flower skips a symlinked .gitignore, so it prunes nothing either
    _tree(linked, "")
    (linked / ".gitignore").unlink()
    (linked / ".gitignore").symlink_to(tmp_path / ".gitignore")
    assert prune_spec(linked) is None and collect_files(linked) == flower_utils.collect_files(linked)


def test_the_command_is_flowers_cli() -> None:
    out = subprocess.run([*flwr_cli(), "--help"], cwd=ROOT, capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr
    assert "Usage: flwr" in out.stdout and "run" in out.stdout
    assert flwr_cli()[0] == str(Path(sys.executable).parent / "python")
