"""The validation split: carved from training data, never seen by clients, the test split never read."""

from __future__ import annotations

from pathlib import Path

import pytest

from experiment.config import RunConfig
from models.data import DataError, DataSpec, load_partition, load_splits, server_test_set


def _rows(path: Path, n: int, start: int) -> None:
    path.write_text("text,label\n" + "".join(f"snippet {start + i},{i % 2}\n" for i in range(n)))


@pytest.fixture
def source(tmp_path: Path) -> Path:
    _rows(tmp_path / "train.csv", 200, 0)
    _rows(tmp_path / "test.csv", 50, 10_000)
    return tmp_path


def test_validation_is_carved_from_train_and_clients_never_see_it(source: Path) -> None:
    spec = DataSpec(dataset=str(source), eval_split="validation", validation_fraction=0.2)
    train, held = load_splits(spec)
    assert len(train) == 160 and len(held) == 40
    train_texts, held_texts = set(train["text"]), set(held["text"])
    assert not train_texts & held_texts
    assert all(int(t.split()[1]) < 10_000 for t in held_texts)  # from the training split, not the test split
    assert set(server_test_set(spec)["text"]) == held_texts
    seen: set[str] = set()
    for pid in range(4):
        local_train, local_test = load_partition(spec, pid, 4)
        seen |= set(local_train["text"]) | set(local_test["text"])
    assert seen == train_texts


def test_the_carve_is_the_same_for_every_run_seed(source: Path) -> None:
    held = [set(load_splits(DataSpec(dataset=str(source), eval_split="validation", seed=s))[1]["text"]) for s in (1, 2)]
    assert held[0] == held[1]


def test_test_mode_uses_the_whole_training_and_test_splits(source: Path) -> None:
    train, held = load_splits(DataSpec(dataset=str(source)))
    assert len(train) == 200 and len(held) == 50
    assert len(server_test_set(DataSpec(dataset=str(source)))) == 50  # server-test-size 0 = all of it


def test_bad_split_settings_name_the_key(source: Path) -> None:
    with pytest.raises(DataError, match="eval-split"):
        load_splits(DataSpec(dataset=str(source), eval_split="dev"))
    with pytest.raises(DataError, match="validation-fraction"):
        load_splits(DataSpec(dataset=str(source), eval_split="validation", validation_fraction=1.5))
    with pytest.raises(ValueError, match=r"eval-split|eval_split"):
        RunConfig.from_flower({"eval-split": "dev"})
    cfg = RunConfig.from_flower({"eval-split": "validation", "validation-fraction": 0.25})
    assert cfg.data_spec().eval_split == "validation" and cfg.data_spec().validation_fraction == 0.25


def test_train_size_keeps_a_seeded_subset_of_the_training_data_and_the_held_out_split(source: Path) -> None:
    full = DataSpec(dataset=str(source), eval_split="validation", validation_fraction=0.2)
    scarce = DataSpec(dataset=str(source), eval_split="validation", validation_fraction=0.2, train_size=60)
    full_train, full_held = load_splits(full)
    train, held = load_splits(scarce)
    assert len(train) == 60 and set(train["text"]) < set(full_train["text"])
    assert set(held["text"]) == set(full_held["text"])  # the held-out split does not shrink
    seen: set[str] = set()
    for pid in range(3):
        local_train, local_test = load_partition(scarce, pid, 3)
        seen |= set(local_train["text"]) | set(local_test["text"])
    assert seen == set(train["text"])
    again = load_splits(DataSpec(dataset=str(source), eval_split="validation", validation_fraction=0.2, train_size=60))
    other_seed = load_splits(
        DataSpec(dataset=str(source), eval_split="validation", validation_fraction=0.2, train_size=60, seed=7)
    )
    assert again[0]["text"] == train["text"] and set(other_seed[0]["text"]) != set(train["text"])
    with pytest.raises(DataError, match="train-size"):
        load_splits(DataSpec(dataset=str(source), eval_split="validation", validation_fraction=0.2, train_size=161))
    assert RunConfig.from_flower({"train-size": 60}).data_spec().train_size == 60
    with pytest.raises(ValueError, match=r"train-size|train_size"):
        RunConfig.from_flower({"train-size": -1})
