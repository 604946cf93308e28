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


# ---------------------------------------------------------------- client-test-split = "held-out"
def test_label_matched_shares_on_exact_numbers() -> None:
    from models.label_shares import label_matched_shares

    # class 0: 3 held-out examples, clients train on 2 / 1 of it -> 2 / 1; class 1: 5 held-out,
    # only client 1 trains on it -> 0 / 5; class 2: nobody trains on it -> dealt to no one
    counts = [[2, 0, 0], [1, 3, 0]]
    labels = [0, 1, 0, 1, 1, 2, 0, 1, 1]
    shares = label_matched_shares(counts, labels, seed=0)
    assert [sorted(int(labels[i]) for i in s) for s in shares] == [[0, 0], [0, 1, 1, 1, 1, 1]]
    assert not set(shares[0]) & set(shares[1]) and 5 not in set(shares[0]) | set(shares[1])
    assert all(list(s) == sorted(s) for s in shares)
    # largest remainder, ties to the lower client: 4 examples over 3 equal clients -> 2 / 1 / 1
    assert [len(s) for s in label_matched_shares([[1], [1], [1]], [0, 0, 0, 0], seed=3)] == [2, 1, 1]
    # 7 * 2 / 5 = 2.8 and 7 * 3 / 5 = 4.2: floors 2 / 4, the one left goes to the larger remainder (client 0)
    assert [len(s) for s in label_matched_shares([[2], [3]], [0] * 7, seed=3)] == [3, 4]
    # the deal is a function of the seed
    a = label_matched_shares([[1], [1]], [0] * 10, seed=5)
    b = label_matched_shares([[1], [1]], [0] * 10, seed=5)
    assert all((x == y).all() for x, y in zip(a, b, strict=True))


def test_label_matched_shares_refuse_bad_input() -> None:
    from models.label_shares import LabelShareError, label_matched_shares

    with pytest.raises(LabelShareError, match="non-negative"):
        label_matched_shares([[1, -1]], [0], seed=0)
    with pytest.raises(LabelShareError, match=r"0\.\.1"):
        label_matched_shares([[1, 1]], [0, 2], seed=0)


@pytest.mark.parametrize("eval_split", ["test", "validation"])
def test_held_out_client_tests_partition_the_held_out_split(source: Path, eval_split: str) -> None:
    spec = DataSpec(dataset=str(source), eval_split=eval_split, validation_fraction=0.2, client_test_split="held-out")
    train, held = load_splits(spec)
    local_trains, local_tests = zip(*(load_partition(spec, pid, 4) for pid in range(4)), strict=True)
    tested = [t for lt in local_tests for t in lt["text"]]
    assert sorted(tested) == sorted(held["text"])  # every held-out example, each on one client
    assert sorted(t for lt in local_trains for t in lt["text"]) == sorted(train["text"])  # whole partitions
    if eval_split == "validation":
        assert all(int(t.split()[1]) < 10_000 for t in tested)  # the carve: the test split is never read
    else:
        assert all(int(t.split()[1]) >= 10_000 for t in tested)  # the test split itself


def test_held_out_client_tests_follow_each_clients_labels(tmp_path: Path) -> None:
    (tmp_path / "train.csv").write_text("text,label\n" + "".join(f"a{i},{i % 3}\n" for i in range(300)))
    (tmp_path / "test.csv").write_text("text,label\n" + "".join(f"b{i},{i % 3}\n" for i in range(90)))
    spec = DataSpec(
        dataset=str(tmp_path), partitioner="dirichlet", dirichlet_alpha=0.3, client_test_split="held-out", seed=1
    )
    for pid in range(3):
        local_train, local_test = load_partition(spec, pid, 3)
        train_share = [local_train["label"].count(c) / len(local_train) for c in range(3)]
        test_share = [local_test["label"].count(c) / max(len(local_test), 1) for c in range(3)]
        assert max(abs(a - b) for a, b in zip(train_share, test_share, strict=True)) < 0.1


def test_a_bad_client_test_split_names_the_key(source: Path) -> None:
    with pytest.raises(DataError, match="client-test-split"):
        load_partition(DataSpec(dataset=str(source), client_test_split="server"), 0, 2)
    with pytest.raises(ValueError, match=r"client-test-split|client_test_split"):
        RunConfig.from_flower({"client-test-split": "server"})
    assert RunConfig.from_flower({"client-test-split": "held-out"}).data_spec().client_test_split == "held-out"


def test_label_matched_shares_refuse_non_integer_or_nested_input() -> None:
    from models.label_shares import LabelShareError, label_matched_shares

    with pytest.raises(LabelShareError, match="integers"):
        label_matched_shares([[1.9, 0.0]], [0], seed=0)
    with pytest.raises(LabelShareError, match="integers"):
        label_matched_shares([[1, 1]], [0.7], seed=0)
    with pytest.raises(LabelShareError, match="1-D"):
        label_matched_shares([[1, 1]], [[0, 1]], seed=0)


def test_a_client_left_without_held_out_test_data_is_refused_before_the_run(tmp_path: Path) -> None:
    from models.data import check_held_out_shares

    # 400 training snippets over 8 clients, 8 held-out: a share of about 1 example per client
    (tmp_path / "train.csv").write_text("text,label\n" + "".join(f"a{i},{i % 2}\n" for i in range(400)))
    (tmp_path / "test.csv").write_text("text,label\n" + "".join(f"b{i},{i % 2}\n" for i in range(4)))
    spec = DataSpec(dataset=str(tmp_path), client_test_split="held-out")
    with pytest.raises(DataError, match=r"client-test-split.*no\s+held-out test examples"):
        check_held_out_shares(spec, 8)
    check_held_out_shares(spec, 2)  # 2 clients: 2 held-out examples each
    check_held_out_shares(DataSpec(dataset=str(tmp_path)), 8)  # 'partition': nothing to check
