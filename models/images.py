"""Image data: the embedded Fashion-MNIST set and image columns as model-ready tensors.

Fashion-MNIST (Xiao et al. 2017; 60,000 train + 10,000 test 28x28 grayscale images of 10
clothing classes) ships in Debian's ``dataset-fashion-mnist`` package as IDX files under
``/usr/share/datasets/fashion-mnist`` (``$HETFL_FASHION_MNIST_DIR`` overrides the folder);
``make setup`` installs the package where ``apt-get`` is available.  Images from any source
(this set, a Hugging Face id such as ``uoft-cs/cifar10``, a local parquet folder with an image
column) become float tensors the same way (:func:`image_tensors`).
"""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import torch
from datasets import Array2D, Dataset, Features, Value
from torch.utils.data import DataLoader
from torch.utils.data import Dataset as TorchDataset

FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
_FASHION_FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
#: Inputs are mapped to ``(x / 255 - MEAN) / STD`` per channel (HeteroFL normalizes per dataset;
#: a fixed 0.5 / 0.5 keeps every source on the same [-1, 1] scale without a pass over the data).
MEAN, STD = 0.5, 0.5


class ImageDataError(ValueError):
    """An image source is missing or unusable."""


def fashion_mnist_dir() -> Path:
    """Folder of the Fashion-MNIST IDX files."""
    env = os.environ.get("HETFL_FASHION_MNIST_DIR")
    return Path(env) if env else FASHION_MNIST_DIR


def read_idx(path: Path) -> np.ndarray:
    """Read a (gzipped) IDX file of unsigned bytes.

    Layout: two zero bytes, the type code ``0x08`` (uint8), the number of dimensions ``n``, then
    ``n`` big-endian uint32 sizes and the data in C order.
    """
    raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ImageDataError(f"{path} is not an IDX file of unsigned bytes")
    ndim = raw[3]
    dims = [int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim)]
    expected = 4 + 4 * ndim + int(np.prod(dims))
    if len(raw) != expected:
        raise ImageDataError(f"{path}: {len(raw)} bytes, expected {expected} for shape {dims}")
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim).reshape(dims)


def fashion_mnist_splits() -> dict[str, Dataset]:
    """The official train/test splits as datasets with ``image`` (28x28 uint8) and ``label``."""
    folder = fashion_mnist_dir()
    out = {}
    for split, (images_file, labels_file) in _FASHION_FILES.items():
        paths = (folder / images_file, folder / labels_file)
        missing = [str(p) for p in paths if not p.exists()]
        if missing:
            raise ImageDataError(
                f"Fashion-MNIST files missing: {missing}; install Debian's dataset-fashion-mnist "
                "(apt-get install dataset-fashion-mnist) or set HETFL_FASHION_MNIST_DIR"
            )
        images, labels = read_idx(paths[0]), read_idx(paths[1])
        if images.ndim != 3 or labels.shape != (images.shape[0],):
            raise ImageDataError(f"{folder}: images {images.shape} and labels {labels.shape} do not match")
        h, w = images.shape[1:]
        features = Features({"image": Array2D((h, w), "uint8"), "label": Value("int64")})
        out[split] = Dataset.from_dict({"image": images, "label": labels.astype(np.int64)}, features=features)
    return out


def image_tensors(ds: Dataset) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, y)``: images as ``float32 (N, C, H, W)`` normalized to ``(x / 255 - 0.5) / 0.5``, labels ``int64``.

    Accepts 2-D (grayscale) and ``H x W x C`` arrays, decoded PIL images included (the numpy
    format of ``datasets`` decodes ``Image`` columns).

    Raises
    ------
    ImageDataError
        When the images do not all have one shape.

    """
    if len(ds) == 0:
        return torch.zeros(0, 1, 1, 1), torch.zeros(0, dtype=torch.long)
    rows = ds.with_format("numpy")[0 : len(ds)]
    images = rows["image"]
    if not isinstance(images, np.ndarray) or images.dtype == object:
        raise ImageDataError("images of different sizes in one dataset; resize them to one shape first")
    x = torch.from_numpy(np.ascontiguousarray(images)).to(torch.float32)
    if x.ndim == 3:  # N, H, W
        x = x.unsqueeze(1)
    elif x.ndim == 4:  # N, H, W, C
        x = x.permute(0, 3, 1, 2).contiguous()
    else:
        raise ImageDataError(f"expected images of 2 or 3 dimensions, got array of shape {tuple(x.shape)}")
    x = (x / 255.0 - MEAN) / STD
    y = torch.as_tensor(np.asarray(rows["label"]), dtype=torch.long)
    return x, y


#: Input domains of domain-shifted pools: ``plain`` images and ``inverted`` ones (pixel
#: ``p -> 255 - p``); the co-distillation paper's Table 2 splits pools by domain the same way.
IMAGE_DOMAINS = ("plain", "inverted")


def shift_images(x: torch.Tensor, domain: str) -> torch.Tensor:
    """Normalized images ``x`` seen in ``domain``.

    ``inverted`` maps pixel ``p`` to ``255 - p``; with ``MEAN = STD = 0.5`` that is
    ``((255 - p) / 255 - 0.5) / 0.5 = -x`` exactly.  ``plain`` returns ``x`` itself.
    """
    if domain == "plain":
        return x
    if domain == "inverted":
        return -x
    raise ImageDataError(f"unknown image domain {domain!r} (expected one of {IMAGE_DOMAINS})")


def mixed_domains(x: torch.Tensor, domains: list[str] | tuple[str, ...]) -> torch.Tensor:
    """``x`` with example ``i`` seen in ``domains[i % len(domains)]`` (equal shares, interleaved)."""
    if len(domains) <= 1:
        return shift_images(x, domains[0]) if domains else x
    out = x.clone()
    for k, domain in enumerate(domains):
        out[k :: len(domains)] = shift_images(x[k :: len(domains)], domain)
    return out


def image_shape(ds: Dataset) -> tuple[int, int, int]:
    """``(channels, height, width)`` of the first image of ``ds``."""
    x, _ = image_tensors(ds.select(range(min(1, len(ds)))))
    if x.shape[0] == 0:
        raise ImageDataError("empty image dataset")
    c, h, w = x.shape[1:]
    return int(c), int(h), int(w)


class _Pairs(TorchDataset):
    """``{"x": image, "labels": label}`` items over two tensors."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return int(self.y.shape[0])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "labels": self.y[i]}


def image_loader(ds: Dataset, *, batch_size: int, shuffle: bool, seed: int = 0, domain: str = "plain") -> DataLoader:
    """Loader of ``{"x": (B, C, H, W) float32, "labels": (B,) int64}`` batches, seen in ``domain``."""
    x, y = image_tensors(ds)
    x = shift_images(x, domain)
    gen = torch.Generator().manual_seed(seed)
    return DataLoader(_Pairs(x, y), batch_size=batch_size, shuffle=shuffle, generator=gen)
