"""The real loaders (Hugging Face ids, local files) exercised on local data, offline."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch

from models.data import (
    DataError,
    DataSpec,
    _partitioner,
    check_partitioning,
    load_partition,
    load_splits,
    server_test_set,
)
from models.transformer import TransformerSpec, build_model, embedded_model_path

HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


def test_hub_id_resolves_through_a_seeded_offline_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``from_pretrained(<hub id>)`` is the path users take; here the cache holds the package's files."""
    snapshot = tmp_path / "hub" / "models--sentence-transformers--all-MiniLM-L6-v2" / "snapshots" / "local"
    snapshot.mkdir(parents=True)
    for f in Path(embedded_model_path()).iterdir():
        if f.is_file():
            (snapshot / f.name).symlink_to(f)
    refs = snapshot.parent.parent / "refs"
    refs.mkdir()
    (refs / "main").write_text("local")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants as hub_constants

    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    from_hub = build_model(TransformerSpec(source=HUB_ID), 2, pretrained=True).state_dict()
    embedded = build_model(TransformerSpec(), 2, pretrained=True).state_dict()
    for name, t in embedded.items():
        if not name.startswith("classifier."):
            assert torch.equal(t, from_hub[name]), name


def _write_csv(path: Path, rows: int) -> None:
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["review", "stars", "extra"])
        for i in range(rows):
            w.writerow([f"review number {i} {'good' if i % 3 else 'bad'}", i % 3, "x"])


def test_local_csv_with_custom_columns_and_dirichlet_partitions(tmp_path: Path) -> None:
    _write_csv(tmp_path / "train.csv", 300)
    _write_csv(tmp_path / "test.csv", 60)
    spec = DataSpec(
        dataset=str(tmp_path), text_column="review", label_column="stars", partitioner="dirichlet", dirichlet_alpha=0.3
    )
    train, test = load_splits(spec)
    assert train.column_names == ["text", "label"] and len(train) == 300 and len(test) == 60
    sizes = []
    for pid in range(4):
        local_train, local_test = load_partition(spec, pid, 4)
        sizes.append(len(local_train) + len(local_test))
        assert set(local_train["label"]) <= {0, 1, 2}
    assert sum(sizes) == 300
    # a single file is the whole dataset: 15 % of it becomes the test split
    single = DataSpec(
        dataset=str(tmp_path / "test.csv"), text_column="review", label_column="stars", server_test_size=5
    )
    single_train, single_test = load_splits(single)
    assert (len(single_train), len(single_test)) == (51, 9)
    assert len(server_test_set(single)) == 5


def test_a_dirichlet_draw_that_gives_up_fails_the_same_way_every_time_naming_dirichlet_alpha(tmp_path: Path) -> None:
    """Issue 23 item 7: a failed draw is never retried from an advanced random state.

    flwr-datasets' Dirichlet partitioner gives up after 10 draws; its generator is then
    advanced, so a second ``load_partition`` on the same object used to draw another
    partitioning (the first node a Ray actor served declined "no local data", the next got
    data).  Every call now fails with the same error, which names the key and the clients.
    """
    _write_csv(tmp_path / "train.csv", 90)
    _write_csv(tmp_path / "test.csv", 30)
    spec = DataSpec(
        dataset=str(tmp_path), text_column="review", label_column="stars", partitioner="dirichlet", dirichlet_alpha=0.05
    )
    messages = []
    for pid in (0, 1, 0):
        expected = r"dirichlet-alpha = 0\.05 cannot split 90 training examples over 30 clients"
        with pytest.raises(DataError, match=expected) as err:
            load_partition(spec, pid, 30)
        messages.append(str(err.value))
    assert len(set(messages)) == 1 and "raise dirichlet-alpha" in messages[0]
    with pytest.raises(DataError, match="dirichlet-alpha"):
        check_partitioning(spec, 30)


def test_partitions_are_a_pure_function_of_the_configuration(tmp_path: Path) -> None:
    """The same partition id gets the same examples in a fresh process (cache cleared) as in a warm one."""
    _write_csv(tmp_path / "train.csv", 300)
    _write_csv(tmp_path / "test.csv", 60)
    spec = DataSpec(
        dataset=str(tmp_path), text_column="review", label_column="stars", partitioner="dirichlet", dirichlet_alpha=0.3
    )
    warm = [load_partition(spec, pid, 5)[0]["text"] for pid in range(5)]
    _partitioner.cache_clear()
    cold = [load_partition(spec, pid, 5)[0]["text"] for pid in (3, 1, 4, 0, 2)]
    assert [cold[i] for i in (3, 1, 4, 0, 2)] == warm


def test_missing_column_and_unreachable_hub_fail_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _write_csv(tmp_path / "train.csv", 20)
    with pytest.raises(DataError, match="no column 'text'"):
        load_splits(DataSpec(dataset=str(tmp_path / "train.csv")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError, match="cannot load dataset"):
        load_splits(DataSpec(dataset="no-such-user/no-such-dataset-" + os.urandom(4).hex()))


def test_embedded_rotten_tomatoes_split() -> None:
    train, test = load_splits(DataSpec())
    assert len(train) + len(test) > 12_000
    majority = max(sum(test["label"]), len(test) - sum(test["label"])) / len(test)
    assert 0.55 < majority < 0.6  # fresh vs rotten, as documented


def test_evaluation_batches_come_shortest_first_and_keep_every_example() -> None:
    from datasets import Dataset

    from models.data import text_loader
    from models.transformer import load_tokenizer

    texts = ["a " * n for n in (9, 1, 5, 30, 2, 14, 7, 3)]
    ds = Dataset.from_dict({"text": texts, "label": [i % 2 for i in range(8)]})
    tok = load_tokenizer("minilm-l6")
    widths, labels = [], []
    for batch in text_loader(ds, tok, batch_size=3, max_length=48, shuffle=False):
        widths.append(batch["input_ids"].shape[1])
        labels += batch["labels"].tolist()
    assert widths == sorted(widths) and widths[0] < widths[-1]
    assert sorted(labels) == sorted(i % 2 for i in range(8))
