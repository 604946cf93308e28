"""Co-distillation CNN pair, its variant catalog and unlabeled distillation images.

The models of federated co-distillation (PeriodicCodist / MergedCodist, seed 003, Appendix E):
a 5-layer CNN,

    ``conv3x3(f_1) -> ReLU -> MaxPool2d(2) -> conv3x3(f_2) -> ReLU -> MaxPool2d(2)
    -> conv3x3(f_3) -> ReLU -> flatten -> dense(d_1) -> ReLU -> dense(d_2) -> ReLU -> dense(classes)``

with SAME padding (3x3, padding 1), so an ``h x h`` input reaches the flatten at
``floor(floor(h / 2) / 2)`` squared spatial positions.  Two sizes (:data:`CODIST_SIZES`):

* ``"small"``: filters ``(16, 32, 32)``, dense ``(64, 128)`` -- 109,348 parameters on 24x24x3 crops
  with 100 classes (the paper's CIFAR-100 setting);
* ``"large"``: filters ``(32, 64, 64)``, dense ``(128, 256)`` -- 410,084 parameters there.

The same architecture takes any input: Fashion-MNIST (1 x 28 x 28, 10 classes), the project's
embedded image default, is ``in_channels=1, image_size=28, num_classes=10``.

Pools are catalog variants (:func:`codist_catalog`): one variant per pool, named after the pool,
with ``extra = {"size": <size name>}``.  No tensor is shared between pools (the paper shares no
parameters): every tensor has role ``"isolated"`` except the output layer (``"head"``).

Unlabeled distillation data (the server's, never a client's):

* :func:`unlabeled_image_crops` -- random crops of scikit-image's bundled photographs
  (out-of-domain, as the paper's CIFAR-10 for CIFAR-100);
* :func:`unlabeled_images` -- a dataset's own images with the labels dropped (in-domain).

Both are normalized like :mod:`models.images`: ``(x / 255 - 0.5) / 0.5``.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from datasets import Dataset
from torch import Tensor, nn
from torch.utils.data import DataLoader

from models.catalog import Layout, MemoryEstimate, Role, Variant, VariantCatalog, meta_layout
from models.family import ImageBatches, seeded_states
from models.images import MEAN, STD, ImageDataError, image_tensors

FAMILY = "codist-cnn"


@dataclass(frozen=True)
class CodistSize:
    """Hidden sizes of one co-distillation CNN.

    Attributes
    ----------
    filters : tuple[int, int, int]
        Output channels of the three 3x3 convolutions.
    dense : tuple[int, int]
        Units of the two hidden dense layers.

    """

    filters: tuple[int, int, int]
    dense: tuple[int, int]

    def __post_init__(self) -> None:
        if len(self.filters) != 3 or len(self.dense) != 2:
            raise ValueError(f"need 3 filter counts and 2 dense sizes, got {self.filters} and {self.dense}")
        if min(*self.filters, *self.dense) < 1:
            raise ValueError(f"sizes must be positive, got {self.filters} and {self.dense}")


#: The paper's pair (Appendix E).
CODIST_SIZES: dict[str, CodistSize] = {
    "small": CodistSize(filters=(16, 32, 32), dense=(64, 128)),
    "large": CodistSize(filters=(32, 64, 64), dense=(128, 256)),
}

#: Default pools: every client trains ``small``; high-capacity clients ``large``.
DEFAULT_POOLS: tuple[tuple[str, str], ...] = (("small", "small"), ("large", "large"))


def resolve_size(size: str | CodistSize) -> CodistSize:
    """A :class:`CodistSize` from its name in :data:`CODIST_SIZES` (or itself)."""
    if isinstance(size, CodistSize):
        return size
    if size not in CODIST_SIZES:
        raise ValueError(f"unknown co-distillation CNN size {size!r}; expected one of {sorted(CODIST_SIZES)}")
    return CODIST_SIZES[size]


def flat_side(image_size: int) -> int:
    """Spatial side at the flatten: two 2x2 max-pools (floor) after SAME convolutions."""
    side = (image_size // 2) // 2
    if side < 1:
        raise ValueError(f"image_size {image_size} is too small for two 2x2 max-pools")
    return side


class CodistCNN(nn.Module):
    """The co-distillation CNN (seed 003, Appendix E).

    State-dict names: ``conv{1,2,3}.{weight,bias}``, ``fc{1,2}.{weight,bias}``,
    ``out.{weight,bias}``.  Parameters for ``(f_1, f_2, f_3)``, ``(d_1, d_2)``, ``C`` input
    channels, side ``h`` and ``K`` classes, with ``s = floor(floor(h / 2) / 2)``:

    ``9 C f_1 + f_1 + 9 f_1 f_2 + f_2 + 9 f_2 f_3 + f_3 + (s^2 f_3 + 1) d_1 + (d_1 + 1) d_2 + (d_2 + 1) K``.

    Parameters
    ----------
    size : str or CodistSize
        ``"small"``, ``"large"`` or explicit sizes.
    in_channels : int
        Image channels (3 for CIFAR, 1 for Fashion-MNIST).
    num_classes : int
        Output classes.
    image_size : int
        Side of the square input (24 for the paper's CIFAR crops, 28 for Fashion-MNIST).

    """

    def __init__(self, size: str | CodistSize, *, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        spec = resolve_size(size)
        f1, f2, f3 = spec.filters
        d1, d2 = spec.dense
        self.size = spec
        self.image_size = int(image_size)
        side = flat_side(image_size)
        self.conv1 = nn.Conv2d(in_channels, f1, kernel_size=3, padding=1)
        self.conv2 = nn.Conv2d(f1, f2, kernel_size=3, padding=1)
        self.conv3 = nn.Conv2d(f2, f3, kernel_size=3, padding=1)
        self.fc1 = nn.Linear(side * side * f3, d1)
        self.fc2 = nn.Linear(d1, d2)
        self.out = nn.Linear(d2, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        """Logits of shape ``(batch, num_classes)``."""
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = F.relu(self.conv3(x)).flatten(1)
        x = F.relu(self.fc1(x))
        x = F.relu(self.fc2(x))
        return self.out(x)


def build_codist_cnn(size: str | CodistSize, *, in_channels: int, num_classes: int, image_size: int) -> CodistCNN:
    """A randomly initialised :class:`CodistCNN`."""
    return CodistCNN(size, in_channels=in_channels, num_classes=num_classes, image_size=image_size)


# --- layouts, memory, catalog -----------------------------------------------------------------

_LAYER_OF = {"conv1": 1, "conv2": 2, "conv3": 3, "fc1": 4, "fc2": 5}
#: Hidden layers (3 conv + 2 dense): the ``depth`` of every variant.
CODIST_DEPTH = 5
#: Floats training keeps per conv output element: the ReLU output (saved by ReLU and by the next
#: layer), the pre-activation (alive during the forward pass) and, after conv 1 and 2, the
#: max-pool's int64 indices and output (0.5 + 0.25 of a float per conv output element),
#: rounded up.  A documented estimate, not a fit.
ACT_FLOATS_PER_CONV_OUTPUT = 3.0
#: Floats per dense output unit: pre-activation and ReLU output.
ACT_FLOATS_PER_DENSE_OUTPUT = 2.0


def codist_layout(size: str | CodistSize, *, in_channels: int, num_classes: int, image_size: int) -> Layout:
    """Parameter layout (built on the meta device).

    Roles: hidden layers ``"isolated"`` (layers 1-5: conv 1-3, dense 1-2), the output layer
    ``"head"`` (layer ``None``).  Pools share nothing.
    """

    def place(name: str) -> tuple[int | None, Role]:
        layer = _LAYER_OF.get(name.split(".")[0])
        return layer, "head" if layer is None else "isolated"

    return meta_layout(
        lambda: build_codist_cnn(size, in_channels=in_channels, num_classes=num_classes, image_size=image_size), place
    )


def estimate_memory(
    size: str | CodistSize, layout: Layout, *, in_channels: int, image_size: int, batch_size: int, optimizer: str
) -> MemoryEstimate:
    """Training-memory estimate of one co-distillation CNN.

    ``parameters = 4 P``, ``gradients = 4 P``, ``optimizer = 4 m P`` (``m = 2`` for AdamW, ``1``
    for SGD with momentum) and ``activations = 4 B (C h^2 + a_c sum_l f_l h_l^2 + a_d (d_1 + d_2 + K))``
    bytes with ``h_1 = h``, ``h_2 = floor(h / 2)``, ``h_3 = floor(h_2 / 2)``,
    ``a_c`` = :data:`ACT_FLOATS_PER_CONV_OUTPUT` and ``a_d`` = :data:`ACT_FLOATS_PER_DENSE_OUTPUT`.
    """
    moments = {"adamw": 2, "sgd": 1}.get(optimizer)
    if moments is None:
        raise ValueError(f"unknown optimizer {optimizer!r} (expected 'adamw' or 'sgd')")
    spec = resolve_size(size)
    sides = (image_size, image_size // 2, (image_size // 2) // 2)
    conv_elements = sum(f * h * h for f, h in zip(spec.filters, sides, strict=True))
    num_classes = layout.by_name()["out.bias"].shape[0]
    dense_elements = sum(spec.dense) + num_classes
    per_example = (
        in_channels * image_size * image_size
        + ACT_FLOATS_PER_CONV_OUTPUT * conv_elements
        + ACT_FLOATS_PER_DENSE_OUTPUT * dense_elements
    )
    p_all = layout.num_params()
    p_train = layout.num_params(trainable_only=True)
    return MemoryEstimate(
        parameters=4 * p_all,
        gradients=4 * p_train,
        optimizer=4 * moments * p_train,
        activations=int(4 * batch_size * per_example),
    )


def codist_catalog(
    pools: Sequence[tuple[str, str | CodistSize]] = DEFAULT_POOLS,
    *,
    in_channels: int,
    num_classes: int,
    image_size: int,
    batch_size: int,
    optimizer: str = "sgd",
) -> VariantCatalog:
    """Catalog with one variant per pool, smallest first.

    Parameters
    ----------
    pools : Sequence[tuple[str, str | CodistSize]]
        ``(pool name, size)`` pairs, smallest model first; default ``small`` and ``large``.
        A size given by name is recorded in ``extra["size"]``; explicit sizes are recorded as
        ``"f1:f2:f3/d1:d2"``.
    in_channels, num_classes, image_size : int
        Input and output of the task (``3, 100, 24`` for the paper; ``1, 10, 28`` for Fashion-MNIST).
    batch_size : int
        Client batch size of the memory estimate.
    optimizer : {"sgd", "adamw"}
        Client optimizer of the memory estimate (the paper's clients use SGD).

    Raises
    ------
    ValueError
        For no pools, or parameter counts that do not strictly increase.

    """
    if not pools:
        raise ValueError("a co-distillation catalog needs at least one pool")
    variants = []
    counts = []
    for name, size in pools:
        spec = resolve_size(size)
        layout = codist_layout(spec, in_channels=in_channels, num_classes=num_classes, image_size=image_size)
        mem = estimate_memory(
            spec, layout, in_channels=in_channels, image_size=image_size, batch_size=batch_size, optimizer=optimizer
        )
        label = size if isinstance(size, str) else size_label(spec)
        variants.append(Variant(name=name, depth=CODIST_DEPTH, layout=layout, memory=mem, extra={"size": label}))
        counts.append(layout.num_params())
    if any(b <= a for a, b in itertools.pairwise(counts)):
        raise ValueError(f"pools must be ordered by strictly increasing model size, got parameter counts {counts}")
    return VariantCatalog(family=FAMILY, variants=tuple(variants))


def size_label(spec: CodistSize) -> str:
    """``"f1:f2:f3/d1:d2"`` (inverse of :func:`parse_size_label`)."""
    return ":".join(map(str, spec.filters)) + "/" + ":".join(map(str, spec.dense))


def parse_size_label(label: str) -> CodistSize:
    """A size name of :data:`CODIST_SIZES` or ``"f1:f2:f3/d1:d2"``."""
    if label in CODIST_SIZES:
        return CODIST_SIZES[label]
    try:
        filters, dense = label.split("/")
        f = tuple(int(x) for x in filters.split(":"))
        d = tuple(int(x) for x in dense.split(":"))
    except ValueError as exc:
        raise ValueError(f"bad co-distillation CNN size {label!r}; expected a name or 'f1:f2:f3/d1:d2'") from exc
    if len(f) != 3 or len(d) != 2:
        raise ValueError(f"bad co-distillation CNN size {label!r}; expected 'f1:f2:f3/d1:d2'")
    return CodistSize(filters=(f[0], f[1], f[2]), dense=(d[0], d[1]))


@dataclass(frozen=True)
class CodistFamily(ImageBatches):
    """The co-distillation CNNs as a :class:`models.family.ModelFamily` (one model per pool).

    Attributes
    ----------
    in_channels, num_classes, image_size : int
        Task input and output.

    """

    in_channels: int
    num_classes: int
    image_size: int
    data_kind: str = "image"

    def build(self, variant: Variant) -> nn.Module:
        """The model of the variant's ``extra["size"]``."""
        return build_codist_cnn(
            parse_size_label(str(variant.extra["size"])),
            in_channels=self.in_channels,
            num_classes=self.num_classes,
            image_size=self.image_size,
        )

    def initial_states(self, catalog: VariantCatalog, *, seed: int) -> dict[str, dict[str, Tensor]]:
        """Every pool's model initialised independently with ``seed``."""
        return seeded_states(self.build, catalog, seed=seed)

    def width_rules(self, catalog: VariantCatalog) -> dict[str, tuple[str | None, ...]]:
        """Pools share no tensors: there are no width groups."""
        raise ValueError("co-distillation pools have no width variants")

    @property
    def uses_statistics(self) -> bool:
        """No: the co-distillation CNNs have no normalization layers."""
        return False

    def for_evaluation(self, model: nn.Module, stats: DataLoader | None) -> nn.Module:
        """The model itself (no normalization layers)."""
        return model


# --- unlabeled distillation data --------------------------------------------------------------

#: scikit-image photographs bundled in its wheel (no download): colour, then grayscale.
SKIMAGE_PHOTOS: tuple[str, ...] = (
    "astronaut",
    "coffee",
    "chelsea",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "camera",
    "brick",
    "grass",
    "gravel",
    "moon",
    "coins",
    "clock",
    "cell",
)
#: ITU-R BT.601 luma weights (RGB -> gray).
_LUMA = (0.299, 0.587, 0.114)


@functools.cache
def _photo(name: str, channels: int) -> np.ndarray:
    """A bundled photograph as ``float32 (channels, H, W)`` in ``[0, 255]``."""
    try:
        import skimage.data
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImageDataError("unlabeled image crops need scikit-image (pip install scikit-image)") from exc
    loader = getattr(skimage.data, name, None)
    if loader is None:
        raise ImageDataError(f"scikit-image has no bundled image {name!r}")
    img = np.asarray(loader())
    if img.dtype == bool:
        img = img.astype(np.float32) * 255.0
    img = img.astype(np.float32)
    if img.ndim == 3:
        img = img[..., :3]  # drop alpha
    if channels == 1:
        gray = img if img.ndim == 2 else img @ np.asarray(_LUMA, dtype=np.float32)
        return np.ascontiguousarray(gray[None])
    if channels == 3:
        rgb = np.repeat(img[..., None], 3, axis=-1) if img.ndim == 2 else img
        return np.ascontiguousarray(rgb.transpose(2, 0, 1))
    raise ValueError(f"channels must be 1 or 3, got {channels}")


def unlabeled_image_crops(
    n: int,
    size: int,
    channels: int,
    seed: int = 0,
    *,
    photos: Sequence[str] = SKIMAGE_PHOTOS,
    max_scale: int = 4,
) -> Tensor:
    """``n`` random square crops of scikit-image's bundled photographs, as an unlabeled set.

    Crop ``i``: a photo drawn uniformly from ``photos``, a scale ``k`` drawn uniformly from
    ``1 .. min(floor(min(H, W) / size), max_scale)``, a uniformly placed ``k size x k size``
    window, averaged over ``k x k`` blocks down to ``size x size``.  Colour photos become gray by BT.601 luma for
    ``channels=1``; gray photos are repeated for ``channels=3``.  Values are normalized as in
    :mod:`models.images`: ``(x / 255 - 0.5) / 0.5``.

    Parameters
    ----------
    n : int
        Number of crops.
    size : int
        Output side (e.g. 24 for the paper's CIFAR crops, 28 for Fashion-MNIST, 32 for CIFAR).
    channels : int
        1 or 3.
    seed : int
        Seed of the crop positions (the result is a deterministic function of the arguments).
    photos : Sequence[str]
        Names of ``skimage.data`` images.
    max_scale : int
        Largest crop side as a multiple of ``size`` (1 = plain crops, no resizing).

    Returns
    -------
    Tensor
        ``float32 (n, channels, size, size)``.

    Raises
    ------
    ImageDataError
        When scikit-image is missing or a photo is unknown or smaller than ``size``.

    """
    if n < 0 or size < 1:
        raise ValueError(f"need n >= 0 and size >= 1, got n={n}, size={size}")
    if max_scale < 1:
        raise ValueError(f"max_scale must be >= 1, got {max_scale}")
    if not photos:
        raise ValueError("need at least one photo")
    images = [torch.from_numpy(_photo(name, channels)) for name in photos]
    for name, img in zip(photos, images, strict=True):
        if min(img.shape[1:]) < size:
            raise ImageDataError(f"photo {name!r} of shape {tuple(img.shape)} is smaller than a {size}x{size} crop")
    rng = np.random.default_rng(seed)
    by_factor: dict[int, list[tuple[int, Tensor]]] = {}
    for i in range(n):
        img = images[int(rng.integers(len(images)))]
        h, w = int(img.shape[1]), int(img.shape[2])
        k = int(rng.integers(1, min(min(h, w) // size, max_scale) + 1))
        side = k * size
        top = int(rng.integers(h - side + 1))
        left = int(rng.integers(w - side + 1))
        by_factor.setdefault(k, []).append((i, img[:, top : top + side, left : left + side]))
    out = torch.empty(n, channels, size, size, dtype=torch.float32)
    for k, crops in by_factor.items():
        index = torch.tensor([i for i, _ in crops])
        out[index] = F.avg_pool2d(torch.stack([c for _, c in crops]), kernel_size=k)
    return (out / 255.0 - MEAN) / STD


def unlabeled_images(ds: Dataset, n: int | None = None, seed: int = 0) -> Tensor:
    """In-domain unlabeled set: the images of ``ds`` (normalized), labels dropped.

    With ``n`` given, a uniformly drawn subset of ``n`` images (without replacement, seeded).
    """
    x, _ = image_tensors(ds)
    if n is None or n >= x.shape[0]:
        return x
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    idx = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))[:n]
    return x[idx.sort().values]
