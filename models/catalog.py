"""Variant catalog: architectures a device tier can train, their layouts and memory.

A *variant* is one trainable architecture cut from a model family (for the
transformer family: the bottom ``k`` encoder layers plus a head).  Its *layout*
lists every parameter tensor with its name, shape, dtype, layer index and role:

* ``shared``   -- embeddings and encoder layers ``1 .. L_j - 1`` (InclusiveFL's
  theta^j), aggregated across every variant that holds them;
* ``isolated`` -- the variant's last encoder layer ``L_j``;
* ``head``     -- pooler and classifier (with ``isolated``, InclusiveFL's f^j).

Layer indices are 1-based as in the paper; embeddings carry layer 0 and head
tensors ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from torch import nn

Role = Literal["shared", "isolated", "head"]

MIB = 1024 * 1024


class CatalogError(ValueError):
    """Raised for an inconsistent catalog (unknown variant, bad tier list)."""


@dataclass(frozen=True)
class ParamSpec:
    """One parameter tensor of a variant.

    Attributes
    ----------
    name : str
        State-dict key inside the variant's model.
    shape : tuple[int, ...]
        Tensor shape.
    dtype : str
        NumPy dtype name (``"float32"``).
    layer : int | None
        1-based encoder layer, 0 for embeddings, ``None`` for head tensors.
    role : {"shared", "isolated", "head"}
        Which InclusiveFL module the tensor belongs to for this variant.
    trainable : bool
        False for tensors frozen during local training (never uploaded).

    """

    name: str
    shape: tuple[int, ...]
    dtype: str
    layer: int | None
    role: Role
    trainable: bool = True

    @property
    def numel(self) -> int:
        """Number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Size in bytes (float32/int64 aware for the dtypes used here)."""
        itemsize = 8 if self.dtype in ("float64", "int64") else 4
        return self.numel * itemsize


@dataclass(frozen=True)
class Layout:
    """Ordered parameter layout of one variant."""

    params: tuple[ParamSpec, ...]

    def __iter__(self) -> Iterator[ParamSpec]:
        return iter(self.params)

    def __len__(self) -> int:
        return len(self.params)

    def by_name(self) -> dict[str, ParamSpec]:
        """Map name -> spec."""
        return {p.name: p for p in self.params}

    def names(self) -> list[str]:
        """All parameter names in order."""
        return [p.name for p in self.params]

    def trainable_names(self) -> list[str]:
        """Names a client uploads after training."""
        return [p.name for p in self.params if p.trainable]

    def num_params(self, *, trainable_only: bool = False) -> int:
        """Total element count."""
        return sum(p.numel for p in self.params if p.trainable or not trainable_only)

    def nbytes(self, *, trainable_only: bool = False) -> int:
        """Total byte size."""
        return sum(p.nbytes for p in self.params if p.trainable or not trainable_only)


def _every_tensor_trains(name: str) -> bool:
    return True


def meta_layout(
    build: Callable[[], nn.Module],
    place: Callable[[str], tuple[int | None, Role]],
    *,
    parameters_only: bool = False,
    trainable: Callable[[str], bool] = _every_tensor_trains,
) -> Layout:
    """The layout of the model ``build`` makes, built on the meta device (no memory, no initialization).

    One float32 :class:`ParamSpec` per tensor of the model's ``state_dict`` in its order
    (``parameters_only``: per parameter, buffers left out), placed by ``place(name) = (layer,
    role)``, trainable where ``trainable(name)``.
    """
    with torch.device("meta"):
        model = build()
    tensors = model.named_parameters() if parameters_only else model.state_dict().items()
    return Layout(
        tuple(
            ParamSpec(name, tuple(t.shape), "float32", *place(name), trainable=trainable(name)) for name, t in tensors
        )
    )


@dataclass(frozen=True)
class MemoryEstimate:
    """Training-memory estimate of one variant, in bytes.

    ``total = parameters + gradients + optimizer + activations``, where
    gradients and optimizer state cover trainable tensors only (AdamW keeps two
    moments, SGD with momentum one, plain SGD none) and activations are what
    autograd saves for one batch at the configured batch size and sequence length.
    """

    parameters: int
    gradients: int
    optimizer: int
    activations: int

    @property
    def total(self) -> int:
        """Sum of the four parts."""
        return self.parameters + self.gradients + self.optimizer + self.activations

    @property
    def total_mb(self) -> float:
        """Total in MiB."""
        return self.total / MIB


@dataclass(frozen=True)
class Variant:
    """One catalog entry.

    Attributes
    ----------
    name : str
        Variant (and group) name; for depth catalogs the tier name.
    depth : int
        Encoder layers kept.
    layout : Layout
        Parameter layout.
    memory : MemoryEstimate
        Estimated training memory.

    """

    name: str
    depth: int
    layout: Layout
    memory: MemoryEstimate
    extra: Mapping[str, int | float | str] = field(default_factory=dict)


@dataclass(frozen=True)
class VariantCatalog:
    """Variants ordered from smallest to largest."""

    family: str
    variants: tuple[Variant, ...]

    def __post_init__(self) -> None:
        names = [v.name for v in self.variants]
        if len(set(names)) != len(names):
            raise CatalogError(f"duplicate variant names in catalog: {names}")
        if not self.variants:
            raise CatalogError("a catalog needs at least one variant")

    def __iter__(self) -> Iterator[Variant]:
        return iter(self.variants)

    def __len__(self) -> int:
        return len(self.variants)

    def names(self) -> list[str]:
        """Variant names, smallest first."""
        return [v.name for v in self.variants]

    def get(self, name: str) -> Variant:
        """Return the variant called ``name`` or raise :class:`CatalogError`."""
        for v in self.variants:
            if v.name == name:
                return v
        raise CatalogError(f"unknown variant {name!r}; catalog has {self.names()}")

    @property
    def smallest(self) -> Variant:
        """First (smallest) variant."""
        return self.variants[0]

    @property
    def largest(self) -> Variant:
        """Last (largest) variant."""
        return self.variants[-1]


def tier_counts(num_nodes: int, proportions: Sequence[float]) -> list[int]:
    """Nodes per tier when ``num_nodes`` are split in ``proportions``, by largest remainder.

    ``q_i = p_i / sum(p) * N``; each tier gets ``floor(q_i)``, and the ``N - sum floor(q)``
    left over go one each to the largest remainders ``q_i - floor(q_i)`` (ties: the earlier
    tier).  E.g. ``N = 10``, ``1:1:1`` gives ``[4, 3, 3]``.
    """
    p = np.asarray(proportions, dtype=float)
    quota = p / p.sum() * num_nodes
    counts = np.floor(quota).astype(int)
    for i in np.argsort(-(quota - counts), kind="stable")[: num_nodes - counts.sum()]:
        counts[i] += 1
    return [int(c) for c in counts]


def choose_variant(estimates_mb: Mapping[str, float], budget_mb: float, overhead_mb: float) -> tuple[str | None, str]:
    """Pick the largest variant whose estimated training memory fits a budget.

    A variant fits when ``overhead_mb + estimate_mb <= budget_mb`` (the overhead
    is the process's runtime: interpreter, torch, Flower).  ``estimates_mb`` must
    be ordered from smallest to largest variant.

    Returns
    -------
    tuple[str | None, str]
        The chosen name (``None`` when nothing fits) and a human-readable reason.

    """
    if not estimates_mb:
        return None, "the server published an empty catalog"
    chosen: str | None = None
    for name, est in estimates_mb.items():
        if overhead_mb + est <= budget_mb:
            chosen = name
    if chosen is None:
        smallest, est = next(iter(estimates_mb.items()))
        return None, (
            f"memory budget {budget_mb:.0f} MiB is below the smallest variant "
            f"{smallest!r}: needs {est:.0f} MiB for training + {overhead_mb:.0f} MiB runtime"
        )
    return chosen, (
        f"{chosen!r} needs {estimates_mb[chosen]:.0f} MiB + {overhead_mb:.0f} MiB runtime <= budget {budget_mb:.0f} MiB"
    )
