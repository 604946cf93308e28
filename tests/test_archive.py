"""The tracked archive of finished suite runs (deploy.archive) and the runner's --archive."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy import archive
from deploy import experiments as ex
from tests.toy import finished_suite_run


def test_archive_refuses_an_unfinished_run_and_copies_nothing(tmp_path: Path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text("{}")
    with pytest.raises(archive.ArchiveError, match=r"lacks experiment\.json, rounds\.jsonl, summary\.csv"):
        archive.archive_run(tmp_path / "run", tmp_path / "kept")
    assert not (tmp_path / "kept").exists()


def test_the_archive_is_named_after_suite_and_preset_not_the_out_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(archive, "ARCHIVE_DIR", tmp_path / "docs" / "runs")
    assert archive.archive_folder("tiny", "cpu") == tmp_path / "docs" / "runs" / "tiny-cpu"
    (planned,) = ex.plan_runs(ex.load_suite("tiny"), "cpu", seeds=1)
    out = tmp_path / "scratch"  # an --out of the caller's choice
    finished_suite_run(out / "runs" / planned.run_name, planned, final=0.5)
    kept = tmp_path / "docs" / "runs" / "tiny-cpu" / "runs" / planned.run_name
    assert ex.main(["tiny", "--dry-run", "--archive", "--out", str(out)]) == 0
    assert not kept.exists()  # a dry run writes nothing, the archive included
    assert ex.main(["tiny", "--report-only", "--archive", "--out", str(out)]) == 0
    assert sorted(p.name for p in kept.iterdir()) == sorted(archive.RECORD_FILES)


def test_a_run_that_cannot_be_archived_is_reported_and_the_suite_goes_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (planned,) = ex.plan_runs(ex.load_suite("tiny"), "cpu", seeds=1)
    out = tmp_path / "out"
    finished_suite_run(out / "runs" / planned.run_name, planned, final=0.5)
    (out / "runs" / planned.run_name / "config.json").unlink()  # done for the runner, not archivable
    done, _ = ex.run_suite(ex.load_suite("tiny"), "cpu", seeds=1, out=out, dry_run=True, archive=tmp_path / "kept")
    assert len(done) == 1 and "not archived: " in capsys.readouterr().out
    assert not (tmp_path / "kept").exists()
