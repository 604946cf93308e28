"""HeteroFL and FedRolex: width-reduced sub-models and coverage-weighted aggregation.

Diao et al., "HeteroFL: Computation and Communication Efficient Federated Learning for
Heterogeneous Clients", ICLR 2021; Alam et al., "FedRolex: Model-Heterogeneous Federated
Learning with Rolling Sub-Model Extraction", NeurIPS 2022.

Every reducible tensor axis belongs to a *width group* ``g`` of full size ``d_g`` (the output
channels of a layer, which are also the input channels of the next one).  A client with width
rate ``r`` in ``(0, 1]`` receives, per group, the index set

* HeteroFL:  ``I_g(r) = {0, 1, ..., k_g - 1}``, the leading slice;
* FedRolex:  ``I_g(r, o) = {(o + i) mod d_g : i = 0, ..., k_g - 1}``, a window that rolls one
  index per round (``o = (t - 1) mod d_g`` in round ``t``, see :func:`rolling_offset`);

with ``k_g = ceil(r * d_g)``.  Axes without a group (the network input, the class count) are
never reduced.  The sub-model of a tensor ``W`` with per-axis index sets ``I_0, I_1, ...`` is
``W[I_0 x I_1 x ...]``, e.g. ``W_l[I_{l,out}, I_{l-1,out}]`` for a linear layer and
``W_l[I_{l,out}, I_{l-1,out}, :, :]`` for a conv weight; position ``j`` of a reduced axis holds
full index ``I[j]``.

Aggregation is per element of the full model: with ``C(e)`` the replies whose index sets cover
element ``e`` and ``w_i`` their weights,

    ``x_e <- sum_{i in C(e)} w_i x_{i,e} / sum_{i in C(e)} w_i``   if ``C(e)`` is not empty,
    ``x_e <- x_e``                                                  otherwise.

:class:`CoverageMean` computes this in one pass over the replies with two full-size
accumulators ``S = sum_i w_i x_i`` and ``W = sum_i w_i`` per tensor (memory ``O(model)``,
independent of the number of replies).  The weights are the caller's choice: both reference
implementations weight by the client's number of local training examples; ``w_i = 1`` gives
the plain per-element mean.

Training-side parts of HeteroFL (static batch norm, the ``1 / r`` scaler) live with the model
families in ``models/``.  The math above is pure functions over ``dict[str, Tensor]``; the
:class:`HeteroFL` strategy at the end only wires it to Flower.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Unpack

import torch
from torch import Tensor

from experiment.method_settings import HeteroFLGroup, ServerAdamGroup
from models.catalog import Variant, VariantCatalog
from strategies.base import HeterogeneousStrategy
from strategies.fedadam import FedAdamConfig, FedAdamState, fedadam_step
from strategies.options import StrategyOptions
from strategies.records import State
from strategies.replies import Accepted
from strategies.round_sums import GroupWeight, by_examples, by_replies
from strategies.validation import non_finite_reason

if TYPE_CHECKING:
    from experiment.config import RunConfig
    from experiment.registry import MethodEntry

Params = dict[str, Tensor]
Groups = tuple[str | None, ...]
IndexSets = Mapping[str, Tensor]
Reply = tuple[Mapping[str, Tensor], float, int, float]

# ``rate * full_dim`` is rounded to this many decimals before ``ceil`` so that float noise
# (``0.07 * 100 == 7.000000000000001``) does not add a unit.
_RATE_DECIMALS = 9


def width_indices(full_dim: int, rate: float, *, offset: int = 0, keep: bool = False) -> Tensor:
    """Index set of one reduced dimension.

    ``k = max(1, ceil(rate * full_dim))`` indices: ``(offset + i) mod full_dim`` for
    ``i = 0 .. k - 1``.  ``offset = 0`` is HeteroFL's leading slice ``0 .. k - 1``; a non-zero
    offset is FedRolex's rolling window, which wraps around the end of the dimension.

    Parameters
    ----------
    full_dim : int
        Size ``d`` of the dimension in the full model.
    rate : float
        Width rate ``r`` in ``(0, 1]``.
    offset : int
        Start of the window (taken mod ``d``).
    keep : bool
        The dimension is never reduced (network input, class count): all ``d`` indices in order.

    Returns
    -------
    Tensor
        1-D ``int64`` tensor of ``k`` distinct indices in window order.

    Notes
    -----
    ``rate * full_dim`` is rounded to 9 decimals before the ceiling, so ``ceil(0.07 * 100) = 7``
    as the formula intends; the reference code's raw ``np.ceil`` gives 8 there.

    """
    if full_dim < 1:
        raise ValueError(f"full_dim must be >= 1, got {full_dim}")
    if not 0.0 < rate <= 1.0:
        raise ValueError(f"rate must be in (0, 1], got {rate}")
    if keep:
        return torch.arange(full_dim, dtype=torch.int64)
    k = min(full_dim, max(1, math.ceil(round(rate * full_dim, _RATE_DECIMALS))))
    return (torch.arange(k, dtype=torch.int64) + offset % full_dim) % full_dim


def rolling_offset(server_round: int, full_dim: int) -> int:
    """FedRolex's window start in (1-based) server round ``t``: ``(t - 1) mod d``.

    The paper's rolling extraction (round index ``j`` from 0, ``j^ = j mod K``) gives the
    sub-model the hidden units ``{j^, j^ + 1, ..., j^ + k - 1}`` when ``j^ + k <= K`` and
    ``{j^, ..., K - 1} u {0, ..., j^ + k - 1 - K}`` otherwise, i.e. the window moves forward by
    one index per round and every unit is trained by every rate over ``K`` rounds.  With
    Flower's rounds ``t = j + 1`` the start is ``(t - 1) mod K``; pass it as ``offset`` to
    :func:`width_indices` (or pass ``t - 1`` to :func:`group_index_sets`, which reduces it
    modulo each group's size).
    """
    if server_round < 1:
        raise ValueError(f"server_round must be >= 1, got {server_round}")
    if full_dim < 1:
        raise ValueError(f"full_dim must be >= 1, got {full_dim}")
    return (server_round - 1) % full_dim


@dataclass(frozen=True)
class WidthRules:
    """Which axes of which tensor are reduced, and with which index set.

    Attributes
    ----------
    axes : Mapping[str, tuple[str | None, ...]]
        Per parameter name, one entry per tensor axis: the name of the axis' width group
        (e.g. ``"conv1.out"``) or ``None`` for an axis that is never reduced.  Axes that share
        a group share the index set, so the input axis of layer ``l + 1`` names the output
        group of layer ``l``.  A conv weight ``(out, in, kh, kw)`` is
        ``("conv2.out", "conv1.out", None, None)``, its bias ``("conv2.out",)``; the first
        layer's input axis and the last layer's output axis are ``None``; a scalar is ``()``.

    """

    axes: Mapping[str, Groups]

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes", MappingProxyType({k: tuple(v) for k, v in self.axes.items()}))

    @property
    def groups(self) -> tuple[str, ...]:
        """Sorted names of all width groups."""
        return tuple(sorted({g for gs in self.axes.values() for g in gs if g is not None}))

    def group_sizes(self, full: Mapping[str, Tensor]) -> dict[str, int]:
        """Full size ``d_g`` of every group, checked against the full model's shapes.

        Raises
        ------
        ValueError
            If the names differ from ``axes``', an entry's length differs from the tensor's
            rank, or one group has two different sizes.

        """
        if set(full) != set(self.axes):
            missing, extra = sorted(set(full) - set(self.axes)), sorted(set(self.axes) - set(full))
            raise ValueError(f"width rules do not match the model: no rule for {missing}, no tensor for {extra}")
        sizes: dict[str, int] = {}
        for name, t in full.items():
            groups = self.axes[name]
            if len(groups) != t.dim():
                raise ValueError(f"{name}: {len(groups)} axis groups for a {t.dim()}-D tensor")
            for axis, g in enumerate(groups):
                if g is None:
                    continue
                d = int(t.shape[axis])
                if sizes.setdefault(g, d) != d:
                    raise ValueError(f"group {g!r} has size {sizes[g]} and {d} (axis {axis} of {name})")
        return sizes

    @classmethod
    def chain(cls, full: Mapping[str, Tensor], layers: Sequence[str]) -> WidthRules:
        """Rules of a plain chain of linear / conv layers ``layers[0] -> layers[1] -> ...``.

        Layer ``l`` owns every tensor named ``"<layers[l]>.<x>"``; its output group is
        ``"<layers[l]>.out"`` (``None`` for the last layer: the class count) and its input
        group the previous layer's output group (``None`` for the first layer: the network
        input).  A tensor of rank >= 2 gets ``(out, in, None, ...)``, rank 1 ``(out,)``, rank 0
        ``()``.  Normalization layers between two layers need explicit :attr:`axes`.
        """
        axes: dict[str, Groups] = {}
        for name, t in full.items():
            owner = [i for i, layer in enumerate(layers) if name.startswith(layer + ".")]
            if len(owner) != 1:
                raise ValueError(f"{name}: belongs to {len(owner)} of the layers {list(layers)}")
            i = owner[0]
            out = None if i == len(layers) - 1 else f"{layers[i]}.out"
            inp = None if i == 0 else f"{layers[i - 1]}.out"
            axes[name] = () if t.dim() == 0 else (out,) if t.dim() == 1 else (out, inp) + (None,) * (t.dim() - 2)
        return cls(axes)


def group_index_sets(rules: WidthRules, full: Mapping[str, Tensor], rate: float, offset: int = 0) -> dict[str, Tensor]:
    """``I_g = width_indices(d_g, rate, offset=offset)`` for every group ``g`` of ``rules``.

    The same ``offset`` is used for every group, reduced modulo its size, so
    ``offset = t - 1`` gives FedRolex's ``rolling_offset(t, d_g)`` in every group.
    """
    sizes = rules.group_sizes(full)
    return {g: width_indices(d, rate, offset=offset) for g, d in sizes.items()}


def submodel_shapes(rules: WidthRules, full: Mapping[str, Tensor], index_sets: IndexSets) -> dict[str, tuple[int, ...]]:
    """Shape of every sub-model tensor: ``|I_g|`` on a reduced axis, the full size elsewhere."""
    return {
        name: tuple(int(d) if g is None else len(index_sets[g]) for g, d in zip(rules.axes[name], t.shape, strict=True))
        for name, t in full.items()
    }


def extract_with_indices(full: Mapping[str, Tensor], rules: WidthRules, index_sets: IndexSets) -> Params:
    """Sub-model ``W[I_0 x I_1 x ...]`` of every tensor for given group index sets.

    Every returned tensor is a fresh contiguous copy (``index_select`` per reduced axis,
    ``clone`` for tensors without one), so the client may modify it freely.
    """
    rules.group_sizes(full)
    out: Params = {}
    for name, t in full.items():
        sub = t
        for axis, g in enumerate(rules.axes[name]):
            if g is not None:
                sub = sub.index_select(axis, index_sets[g].to(device=t.device))
        out[name] = t.clone(memory_format=torch.contiguous_format) if sub is t else sub.contiguous()
    return out


def extract_submodel(full: Mapping[str, Tensor], rules: WidthRules, rate: float, offset: int = 0) -> Params:
    """The sub-model a client of width rate ``rate`` receives.

    ``offset = 0`` is HeteroFL; FedRolex passes ``offset = t - 1`` in round ``t``.  See
    :func:`group_index_sets` and :func:`extract_with_indices`.
    """
    return extract_with_indices(full, rules, group_index_sets(rules, full, rate, offset))


def _check_index_set(group: str, idx: Tensor, size: int) -> None:
    if idx.dim() != 1 or idx.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"index set of {group!r} must be a 1-D integer tensor")
    if idx.numel() == 0 or int(idx.min()) < 0 or int(idx.max()) >= size:
        raise ValueError(f"index set of {group!r} must be non-empty and within [0, {size})")
    if torch.unique(idx).numel() != idx.numel():
        raise ValueError(f"index set of {group!r} has repeated indices")


#: Above this many contiguous blocks per tensor, :class:`CoverageMean` scatters with one
#: ``index_put_`` instead of one slice ``add_`` per block (leading slices have 1 block per
#: tensor and FedRolex windows at most ``2 ** reduced axes``; arbitrary index sets fall back).
MAX_SLICE_BLOCKS = 16


def contiguous_runs(idx: Tensor) -> list[tuple[int, int, int]]:
    """Split an index set into maximal runs of consecutive indices.

    Returns ``(full_start, sub_start, length)`` per run: sub-model positions
    ``sub_start .. sub_start + length - 1`` hold full indices ``full_start .. full_start + length - 1``.
    ``[0, 1, 2]`` is one run ``(0, 0, 3)``; FedRolex's wrapped window ``[6, 7, 0, 1]`` is two,
    ``(6, 0, 2)`` and ``(0, 2, 2)``.
    """
    values = idx.tolist()
    runs: list[tuple[int, int, int]] = []
    start = 0
    for j in range(1, len(values) + 1):
        if j == len(values) or values[j] != values[j - 1] + 1:
            runs.append((values[start], start, j - start))
            start = j
    return runs


class CoverageMean:
    """Streaming per-element weighted mean over the replies that cover each element.

    For every full-model tensor a reply carries it keeps ``S = sum_i w_i x_i`` at full size
    (allocated on first use: tensors no reply carries, such as frozen embeddings, cost
    nothing).  The coverage ``W = sum_i w_i 1[e in I_i]`` is not accumulated per reply: replies
    with equal index sets (one *pattern* per rate, and per window for FedRolex) cover the same
    elements, so only the total weight of each pattern is kept and ``W`` is built once per
    tensor in :meth:`result` from the few patterns of the round.  :meth:`result` returns
    ``S / W`` where ``W > 0`` and the previous value elsewhere.  Memory: one full-size sum per
    carried tensor, plus one coverage tensor at a time in :meth:`result`.

    The scatter is a slice ``add_`` per block of consecutive indices (:func:`contiguous_runs`;
    one block per tensor for HeteroFL, a few for FedRolex's wrapped windows), so adding a reply
    costs one dense ``add_`` over its bytes; index sets with more than
    :data:`MAX_SLICE_BLOCKS` blocks per tensor use one vectorized ``index_put_`` instead.

    Parameters
    ----------
    full : Mapping[str, Tensor]
        The full model (only names, shapes, dtypes and device are used; no reference kept).
        Every tensor must be floating point.
    rules : WidthRules
        Axis groups of every tensor of ``full``.

    """

    def __init__(self, full: Mapping[str, Tensor], rules: WidthRules) -> None:
        self.rules = rules
        self.sizes = rules.group_sizes(full)
        self.shapes = {k: tuple(t.shape) for k, t in full.items()}
        self._like = {k: (t.dtype, t.device) for k, t in full.items()}
        for name, t in full.items():
            if not t.is_floating_point():
                raise ValueError(f"{name}: coverage averaging needs floating-point tensors, got {t.dtype}")
        self.sums: Params = {}
        # pattern key -> (index sets, runs per group, tensor names carried, total weight)
        self._patterns: dict[
            tuple[object, ...], tuple[IndexSets, dict[str, list[tuple[int, int, int]]], frozenset[str], float]
        ] = {}
        self.count = 0

    def is_finite(self) -> bool:
        """Whether no sum holds a NaN or Inf."""
        return non_finite_reason(self.sums) is None

    def add(self, sub_params: Mapping[str, Tensor], index_sets: IndexSets, weight: float) -> None:
        """Fold one reply into the sums: ``S[I] += w x``; its weight joins its pattern's total.

        Parameters
        ----------
        sub_params : Mapping[str, Tensor]
            The client's sub-model (a subset of the full model's names; a missing tensor
            covers nothing).  Shapes must be :func:`submodel_shapes` of ``index_sets``.
        index_sets : Mapping[str, Tensor]
            The index set of every group the reply's tensors use, as sent to the client.
        weight : float
            ``w_i > 0`` (the client's example count in the reference code, or 1).

        Raises
        ------
        ValueError
            For a non-positive weight, an unknown name, a bad index set or a wrong shape;
            nothing has been added when it is raised.

        """
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"weight must be positive and finite, got {weight}")
        unknown = sorted(set(sub_params) - set(self.shapes))
        if unknown:
            raise ValueError(f"reply carries tensors not in the model: {unknown}")
        used = sorted({g for name in sub_params for g in self.rules.axes[name] if g is not None})
        for g in used:
            if g not in index_sets:
                raise ValueError(f"no index set for group {g!r}")
            _check_index_set(g, index_sets[g], self.sizes[g])
        for name, x in sub_params.items():
            expected = self._sub_shape(name, index_sets)
            if tuple(x.shape) != expected:
                raise ValueError(f"{name}: shape {tuple(x.shape)}, expected {expected}")
        runs = {g: contiguous_runs(index_sets[g]) for g in used}
        for name, x in sub_params.items():
            s = self._sum(name)
            _scatter_add(s, x.to(device=s.device, dtype=s.dtype), self.rules.axes[name], runs, index_sets, weight)
        names = frozenset(sub_params)
        key = (names, *((g, tuple(r)) for g, r in runs.items()))
        _, _, _, total = self._patterns.get(key, (index_sets, runs, names, 0.0))
        self._patterns[key] = ({g: index_sets[g] for g in used}, runs, names, total + weight)
        self.count += 1

    def _sum(self, name: str) -> Tensor:
        if name not in self.sums:
            dtype, device = self._like[name]
            self.sums[name] = torch.zeros(self.shapes[name], dtype=dtype, device=device)
        return self.sums[name]

    def coverage(self, name: str) -> Tensor:
        """``W`` of tensor ``name``: ``sum`` over patterns of their total weight on the elements they cover."""
        dtype, device = self._like[name]
        w = torch.zeros(self.shapes[name], dtype=dtype, device=device)
        ones = torch.ones((), dtype=dtype, device=device)
        for index_sets, runs, names, total in self._patterns.values():
            if name in names:
                _scatter_add(
                    w, ones.expand(self._sub_shape(name, index_sets)), self.rules.axes[name], runs, index_sets, total
                )
        return w

    def _covers_all(self, name: str, index_sets: IndexSets) -> bool:
        """Whether a pattern with these index sets covers every element of tensor ``name``."""
        return all(
            g is None or len(index_sets[g]) == d for g, d in zip(self.rules.axes[name], self.shapes[name], strict=True)
        )

    def _sub_shape(self, name: str, index_sets: IndexSets) -> tuple[int, ...]:
        groups = self.rules.axes[name]
        return tuple(d if g is None else len(index_sets[g]) for g, d in zip(groups, self.shapes[name], strict=True))

    def result(self, previous_full: Mapping[str, Tensor]) -> Params:
        """``S / W`` where ``W > 0``, the previous value elsewhere.

        Tensors no reply carried are returned as the previous tensor objects themselves (no
        copy); the others are fresh tensors.  The accumulators are consumed: call once.
        """
        if set(previous_full) != set(self.shapes):
            raise ValueError("previous model has different tensor names than the accumulator")
        out: Params = {}
        for name, prev in previous_full.items():
            if tuple(prev.shape) != self.shapes[name]:
                raise ValueError(f"{name}: previous shape {tuple(prev.shape)}, expected {self.shapes[name]}")
            if name not in self.sums:
                out[name] = prev
                continue
            s = self.sums[name]
            full = [self._covers_all(name, p[0]) for p in self._patterns.values() if name in p[2]]
            if all(full):  # every pattern covers the whole tensor: W is one number
                total = sum(p[3] for p in self._patterns.values() if name in p[2])
                out[name] = s.div_(total).to(prev.dtype)
                continue
            w = self.coverage(name)
            if any(full):  # some pattern covers every element: no element keeps its old value
                out[name] = s.div_(w).to(prev.dtype)
                continue
            uncovered = w == 0
            s.div_(w.masked_fill_(uncovered, 1.0))  # in place: S / W on covered elements
            out[name] = torch.where(uncovered, prev.to(device=s.device, dtype=s.dtype), s).to(prev.dtype)
        self.sums, self._patterns = {}, {}
        return out


def _scatter_add(
    s: Tensor,
    x: Tensor,
    groups: Groups,
    runs: Mapping[str, list[tuple[int, int, int]]],
    index_sets: IndexSets,
    weight: float,
) -> None:
    """``s[I] += weight * x`` over the product ``I`` of the axes' index sets (slices per block)."""
    axis_runs = [[(0, 0, d)] if g is None else runs[g] for g, d in zip(groups, s.shape, strict=True)]
    if math.prod(len(r) for r in axis_runs) <= MAX_SLICE_BLOCKS:
        for block in itertools.product(*axis_runs):
            full = tuple(slice(f, f + n) for f, _, n in block)
            sub = tuple(slice(j, j + n) for _, j, n in block)
            s[full].add_(x[sub], alpha=weight)
        return
    index = []
    for axis, (g, d) in enumerate(zip(groups, s.shape, strict=True)):
        idx = torch.arange(d) if g is None else index_sets[g].to(torch.int64)
        view = [1] * s.dim()
        view[axis] = -1
        index.append(idx.to(s.device).view(view))
    s.index_put_(tuple(index), x * weight, accumulate=True)


def coverage_aggregate(full: Mapping[str, Tensor], rules: WidthRules, replies: Iterable[Reply]) -> Params:
    """HeteroFL / FedRolex aggregation of ``(sub_params, rate, offset, weight)`` replies.

    Each reply's index sets are rebuilt with :func:`group_index_sets` from its ``rate`` and
    ``offset`` (0 for HeteroFL, ``t - 1`` for FedRolex) and folded into a
    :class:`CoverageMean`; the result is the per-element coverage-weighted mean of the
    module docstring, with uncovered elements keeping their value in ``full``.
    """
    acc = CoverageMean(full, rules)
    for sub_params, rate, offset, weight in replies:
        acc.add(sub_params, group_index_sets(rules, full, rate, offset), weight)
    return acc.result(full)


class CoverageSums:
    """HeteroFL's round sums (a :class:`~strategies.round_sums.RoundSums`): replies scattered into coverage sums.

    A reply of variant ``v`` adds ``w x`` at ``index_sets(v)`` (the leading slice, or FedRolex's
    window of the round) with ``w = weight(examples, 1)``; a variant's median stands for its
    replies with ``w = weight(examples, replies)``.  The full-size sums are allocated on the
    first reply, over the global model ``full()`` then; :meth:`result` is ``None`` without one.
    """

    rebuildable = True

    def __init__(
        self,
        full: Callable[[], Mapping[str, Tensor]],
        rules: WidthRules,
        index_sets: Callable[[str], IndexSets],
        weight: GroupWeight,
    ) -> None:
        self.full = full
        self.rules = rules
        self.index_sets = index_sets
        self.weight = weight
        self.coverage: CoverageMean | None = None

    def _scatter(self, variant: str, tensors: Mapping[str, Tensor], weight: float) -> None:
        if self.coverage is None:
            self.coverage = CoverageMean(self.full(), self.rules)
        self.coverage.add(tensors, self.index_sets(variant), weight)

    def add(self, entry: Accepted, tensors: Mapping[str, Tensor]) -> None:  # noqa: D102
        self._scatter(entry.sent.variant, tensors, self.weight(float(entry.num_examples), 1))

    def add_group(self, variant: str, tensors: Mapping[str, Tensor], num_examples: float, replies: int) -> None:  # noqa: D102
        self._scatter(variant, tensors, self.weight(float(num_examples), replies))

    def is_finite(self) -> bool:  # noqa: D102
        return self.coverage is None or self.coverage.is_finite()

    def result(self) -> CoverageMean | None:
        """The coverage sums, or ``None`` where no reply was folded."""
        return self.coverage if self.coverage is not None and self.coverage.count > 0 else None


class HeteroFL(HeterogeneousStrategy[CoverageMean | None]):
    """HeteroFL (and FedRolex with ``rolling=True``) on Flower.

    The server keeps one full model (state group ``"global"``).  A node of variant ``v``
    (catalog ``extra["rate"] = r_v``) receives ``extract_with_indices(global, rules, I_v)``
    with HeteroFL's leading index sets, or FedRolex's window rolled by
    ``offset = server_round - 1``; every validated reply is scattered into a
    :class:`CoverageMean` with weight = its example count (``weighting="examples"``, as both
    reference implementations) or 1 (``"uniform"``); after the round the covered elements are
    replaced by their mean and uncovered ones keep their value (HeteroFL's server rule,
    ``server_optimizer="average"``).  With ``server_optimizer="fedadam"`` the difference
    ``Delta = result - w`` (zero on uncovered elements) is applied by one FedAdam state
    instead, which is how InclusiveFL's paper runs its baselines ("same FedAdam server
    optimizer").

    Parameters
    ----------
    catalog : VariantCatalog
        Width variants published to nodes, each with ``extra["rate"]``, smallest first.
    full : Variant, optional
        The rate-1 variant whose layout the global model has; by default ``catalog.largest``.
        A one-variant catalog of a smaller rate with ``full`` set is FedAvg on that sub-model
        alone (the "smallest model only" baseline): only its slice is ever covered.
    rules : WidthRules
        Width groups of every tensor of the full model.
    rolling : bool
        FedRolex's rolling window instead of HeteroFL's leading slice.
    weighting : {"examples", "uniform"}
    server_optimizer : {"average", "fedadam"}
    adam : FedAdamConfig, optional
        FedAdam hyper-parameters when ``server_optimizer="fedadam"``.
    **options
        :class:`~strategies.base.StrategyOptions`, passed to :class:`~strategies.base.HeterogeneousStrategy`.

    """

    GLOBAL = "global"

    def initial_state(self, init: Mapping[str, Mapping[str, Tensor]]) -> State:
        """One full model (:data:`GLOBAL`), the full variant's initial model: tiers are cut from it each round."""
        return {self.GLOBAL: dict(init[self.full.name])}

    def __init__(
        self,
        *,
        catalog: VariantCatalog,
        rules: WidthRules,
        full: Variant | None = None,
        rolling: bool = False,
        weighting: str = "examples",
        server_optimizer: str = "average",
        adam: FedAdamConfig | None = None,
        **options: Unpack[StrategyOptions],
    ) -> None:
        if weighting not in ("examples", "uniform"):
            raise ValueError(f"weighting must be 'examples' or 'uniform', got {weighting!r}")
        if server_optimizer not in ("average", "fedadam"):
            raise ValueError(f"server_optimizer must be 'average' or 'fedadam', got {server_optimizer!r}")
        self.full = full or catalog.largest
        if float(self.full.extra.get("rate", 0.0)) != 1.0:
            raise ValueError("the full HeteroFL variant must have rate 1.0")
        super().__init__(catalog=catalog, **options)
        self.rules = rules
        self.rolling = rolling
        self.weighting = weighting
        self.server_optimizer = server_optimizer
        self.adam_cfg = adam or FedAdamConfig()
        self.adam = FedAdamState()

    def check_state(self, state: Mapping[str, Mapping[str, Tensor]]) -> None:
        """Require exactly the full model under ``"global"``."""
        if set(state) != {self.GLOBAL}:
            raise ValueError(f"HeteroFL keeps one full model under {self.GLOBAL!r}, got {sorted(state)}")
        if set(state[self.GLOBAL]) != set(self.full.layout.names()):
            raise ValueError("the global model does not match the full variant's layout")
        self.rules.group_sizes(state[self.GLOBAL])

    def index_sets(self, variant: str) -> dict[str, Tensor]:
        """Index sets of ``variant`` this round (leading, or rolled for FedRolex)."""
        rate = float(self.catalog.get(variant).extra["rate"])
        offset = self.current_round - 1 if self.rolling and self.current_round > 0 else 0
        return group_index_sets(self.rules, self.state[self.GLOBAL], rate, offset)

    def variant_payload(self, node_id: int, variant: str) -> dict[str, Tensor]:
        """The sub-model of ``variant`` cut from the global model."""
        return extract_with_indices(self.state[self.GLOBAL], self.rules, self.index_sets(variant))

    def new_round_sums(self) -> CoverageSums:
        """The coverage sums of the global model, each reply scattered at its variant's index sets this round."""
        weight = by_examples if self.weighting == "examples" else by_replies
        return CoverageSums(lambda: self.state[self.GLOBAL], self.rules, self.index_sets, weight)

    def method_state(self) -> dict[str, Any]:
        """The FedAdam state of the global model (unused with ``server_optimizer="average"``)."""
        return {"adam": self.adam.to_dict()}

    def load_method_state(self, data: Mapping[str, Any]) -> None:
        """Restore :meth:`method_state`."""
        self.adam = FedAdamState.from_dict(data.get("adam", {}))

    def apply_round(self, server_round: int, result: CoverageMean | None, counts: Mapping[str, int]) -> None:
        """Replace covered elements by their mean; uncovered ones keep their value."""
        if result is not None:
            old = self.state[self.GLOBAL]
            new = result.result(old)
            if self.server_optimizer == "fedadam":
                trainable = self.full.layout.trainable_names()
                new = fedadam_step(old, {k: new[k] - old[k] for k in trainable}, self.adam, self.adam_cfg)
            self.state[self.GLOBAL] = new

    def models_for_evaluation(self) -> dict[str, list[Mapping[str, Tensor]]]:
        """Every variant's sub-model of the global model: the one its nodes trained this round.

        HeteroFL: the leading slice.  FedRolex: the window of the current round (offset
        ``t - 1``); a leading slice would mix units trained at this width with units only the
        wider models trained.
        """
        full = self.state[self.GLOBAL]
        return {v.name: [extract_with_indices(full, self.rules, self.index_sets(v.name))] for v in self.catalog}


def build(cfg: RunConfig, entry: MethodEntry, options: Mapping[str, Any]) -> HeteroFL:
    """HeteroFL (``entry.mode = "static"``) or FedRolex (``"rolling"`` windows) over the family's width rules.

    Registry factory (:class:`experiment.registry.MethodEntry` ``strategy``).
    """
    return HeteroFL(
        rules=WidthRules(axes=cfg.family().width_rules(cfg.catalog)),
        full=cfg.catalog.largest,
        rolling=entry.mode == "rolling",
        server_optimizer=cfg.settings_of(HeteroFLGroup).heterofl_server_optimizer,
        adam=FedAdamConfig.from_settings(cfg.settings_of(ServerAdamGroup)),
        **options,
    )
