"""Image data: the IDX reader, the embedded Fashion-MNIST set, image columns from local files."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch
from datasets import Dataset, Features, Image, Value
from PIL import Image as PILImage

from models.data import DataError, DataSpec, load_partition, load_splits, server_stats_set, server_test_set
from models.images import ImageDataError, fashion_mnist_splits, image_loader, image_shape, image_tensors, read_idx


def _write_idx(path: Path, array: np.ndarray) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    path.write_bytes(gzip.compress(header + array.astype(np.uint8).tobytes()))


def _fake_fashion(folder: Path, n_train: int = 12, n_test: int = 4) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8)
    labels = np.arange(n_train, dtype=np.uint8) % 10
    _write_idx(folder / "train-images-idx3-ubyte.gz", images)
    _write_idx(folder / "train-labels-idx1-ubyte.gz", labels)
    _write_idx(folder / "t10k-images-idx3-ubyte.gz", images[:n_test])
    _write_idx(folder / "t10k-labels-idx1-ubyte.gz", labels[:n_test])
    return images, labels


def test_idx_reader_round_trips_and_rejects_truncated_files(tmp_path: Path) -> None:
    arr = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    _write_idx(tmp_path / "a.gz", arr)
    assert np.array_equal(read_idx(tmp_path / "a.gz"), arr)
    raw = gzip.decompress((tmp_path / "a.gz").read_bytes())
    (tmp_path / "b").write_bytes(raw[:-1])
    with pytest.raises(ImageDataError, match="39 bytes, expected 40"):
        read_idx(tmp_path / "b")
    (tmp_path / "c").write_bytes(b"\x00\x00\x0d\x01" + raw[4:])  # float type code
    with pytest.raises(ImageDataError, match="unsigned bytes"):
        read_idx(tmp_path / "c")


def test_fashion_mnist_reader_from_a_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    images, labels = _fake_fashion(tmp_path)
    monkeypatch.setenv("HETFL_FASHION_MNIST_DIR", str(tmp_path))
    splits = fashion_mnist_splits()
    assert (len(splits["train"]), len(splits["test"])) == (12, 4)
    x, y = image_tensors(splits["train"])
    assert x.shape == (12, 1, 28, 28) and y.tolist() == labels.tolist()
    torch.testing.assert_close(x[3, 0], (torch.from_numpy(images[3]).float() / 255 - 0.5) / 0.5)


def test_missing_fashion_mnist_names_the_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HETFL_FASHION_MNIST_DIR", str(tmp_path / "nowhere"))
    with pytest.raises(ImageDataError, match="dataset-fashion-mnist"):
        fashion_mnist_splits()


def test_embedded_fashion_mnist_is_the_official_split() -> None:
    spec = DataSpec(dataset="embedded:fashion_mnist", kind="image", server_test_size=300)
    train, test = load_splits(spec)
    assert (len(train), len(test)) == (60_000, 10_000)
    assert np.bincount(np.asarray(test["label"])).tolist() == [1000] * 10
    assert image_shape(test) == (1, 28, 28)
    stats, held_out = server_stats_set(spec, 64), server_test_set(spec)
    assert len(stats) == 64 and len(held_out) == 300
    local_train, local_test = load_partition(spec, 3, 10)
    assert len(local_train) + len(local_test) == 6000


def test_local_parquet_with_an_image_column_loads_like_a_hub_dataset(tmp_path: Path) -> None:
    """The path CIFAR-10 / SVHN take from the hub: an ``Image`` column (PNG bytes) named ``img``."""
    rng = np.random.default_rng(1)
    arrays = rng.integers(0, 256, (30, 32, 32, 3), dtype=np.uint8)
    features = Features({"img": Image(), "label": Value("int64")})
    for split, rows in (("train", range(24)), ("test", range(24, 30))):
        ds = Dataset.from_dict(
            {"img": [PILImage.fromarray(arrays[i]) for i in rows], "label": [i % 3 for i in rows]}, features=features
        )
        ds.to_parquet(str(tmp_path / f"{split}.parquet"))
    spec = DataSpec(dataset=str(tmp_path), kind="image", image_column="img")
    train, test = load_splits(spec)
    assert train.column_names == ["image", "label"] and (len(train), len(test)) == (24, 6)
    x, y = image_tensors(test)
    assert x.shape == (6, 3, 32, 32) and y.tolist() == [i % 3 for i in range(24, 30)]
    expected = (torch.from_numpy(arrays[24:30]).permute(0, 3, 1, 2).float() / 255 - 0.5) / 0.5
    torch.testing.assert_close(x, expected)
    batch = next(iter(image_loader(train, batch_size=8, shuffle=True, seed=0)))
    assert set(batch) == {"x", "labels"} and batch["x"].shape == (8, 3, 32, 32)
    with pytest.raises(DataError, match="image-column"):
        load_splits(DataSpec(dataset=str(tmp_path), kind="image"))


def test_images_of_different_sizes_are_refused() -> None:
    features = Features({"image": Image(), "label": Value("int64")})
    ds = Dataset.from_dict(
        {"image": [PILImage.new("L", (4, 4)), PILImage.new("L", (5, 5))], "label": [0, 1]}, features=features
    )
    with pytest.raises(ImageDataError, match="different sizes"):
        image_tensors(ds)
