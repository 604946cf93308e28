"""What one round's accepted replies are folded into: the :class:`RoundSums` a method starts each aggregation with.

:meth:`strategies.base.HeterogeneousStrategy.aggregate_train` asks the method for fresh sums
(:meth:`~strategies.base.HeterogeneousStrategy.new_round_sums`) at the start of every
aggregation, folds each accepted reply into them (:meth:`RoundSums.add`; held replies in their
senders' node-key order, :func:`strategies.replies.in_node_order`, a lazy stream as it comes; with
the median, each group's coordinate-wise median once, :meth:`RoundSums.add_group`), and hands
their :meth:`RoundSums.result` to the method's ``apply_round``.  Where the sums are
:attr:`RoundSums.rebuildable` (they are all a fold wrote), finiteness is checked once on them
(:meth:`RoundSums.is_finite`) instead of on every reply, and a failed check starts new sums
from the replies that pass; sums that are not rebuildable (a reply became a node's model as it
was folded) are fed only replies checked one by one.

The sums of the methods: :class:`GroupMeans` (the example-weighted mean per variant, or per one
global group: InclusiveFL and its one-variant baselines, co-distillation, DepthFL),
:class:`NodeModels` (each reply becomes its node's model: the Local baseline), HeteroFL's
coverage sums (:class:`strategies.heterofl.CoverageSums`), FlexiFed's architecture sums
(:class:`strategies.flexifed.FlexiFedSums`) and pFedKnow's kept uploads
(:class:`strategies.pfedknow.KeptUploads`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol, TypeVar

from torch import Tensor

from strategies.replies import Accepted, Sent
from strategies.streaming import StreamingMean

ResultT_co = TypeVar("ResultT_co", covariant=True)

#: ``(examples, replies) -> weight`` of a reply (``replies = 1``) or of a group's median standing for ``replies``.
GroupWeight = Callable[[float, int], float]
#: Per-group mean tensors: ``group -> tensor name -> mean``.
GroupMeansResult = dict[str, dict[str, Tensor]]


class MedianNotSupported(RuntimeError):
    """A group's median was folded into sums of a method without one (its options forbid the median)."""


class RoundSums(Protocol[ResultT_co]):
    """One round's folded replies; fresh ones start every aggregation (and every rebuild)."""

    @property
    def rebuildable(self) -> bool:
        """Whether folding wrote nothing but these sums: then dropping them and folding again is safe."""
        ...

    def add(self, entry: Accepted, tensors: Mapping[str, Tensor]) -> None:
        """Fold one accepted reply; ``tensors`` are its own (payload views) or its clipped update."""
        ...

    def add_group(self, variant: str, tensors: Mapping[str, Tensor], num_examples: float, replies: int) -> None:
        """Fold one group's coordinate-wise median, standing for its ``replies`` replies and their examples."""
        ...

    def is_finite(self) -> bool:
        """Whether the sums so far hold no NaN or Inf."""
        ...

    def result(self) -> ResultT_co:
        """What the method's ``apply_round`` gets, once every reply is folded."""
        ...


def by_examples(num_examples: float, replies: int) -> float:
    """A reply (or a group's median) weighs its examples: ``w = n``."""
    return num_examples


def by_replies(num_examples: float, replies: int) -> float:
    """Every reply weighs one (a group's median: its reply count): ``w = replies``."""
    return float(replies)


class GroupMeans:
    """Example-weighted (or ``weight``-weighted) mean tensors per group; the default group is the reply's variant.

    For group ``g`` and tensor ``k``: ``mean_{g,k} = sum_i w_i x_{i,k} / sum_i w_i`` over the
    replies of ``g`` that carry ``k`` (:class:`strategies.streaming.StreamingMean`).

    Parameters
    ----------
    group_of : Callable[[str], str] or None
        The group of a variant (``None``: the variant itself; DepthFL: one global group).
    weight : GroupWeight
        ``(examples, replies) -> w`` (default :func:`by_examples`).

    """

    rebuildable = True

    def __init__(self, group_of: Callable[[str], str] | None = None, weight: GroupWeight = by_examples) -> None:
        self.group_of = group_of
        self.weight = weight
        self.means: dict[str, StreamingMean] = {}

    def _group(self, variant: str) -> StreamingMean:
        group = variant if self.group_of is None else self.group_of(variant)
        return self.means.setdefault(group, StreamingMean())

    def add(self, entry: Accepted, tensors: Mapping[str, Tensor]) -> None:  # noqa: D102
        self._group(entry.sent.variant).add(tensors, self.weight(float(entry.num_examples), 1))

    def add_group(self, variant: str, tensors: Mapping[str, Tensor], num_examples: float, replies: int) -> None:  # noqa: D102
        self._group(variant).add(tensors, self.weight(float(num_examples), replies))

    def is_finite(self) -> bool:  # noqa: D102
        return all(m.is_finite() for m in self.means.values())

    def result(self) -> GroupMeansResult:
        """Each group's mean tensors: fresh tensors (aliasing no reply), the sums released."""
        return {group: m.take_mean() for group, m in self.means.items()}


class NodeModels:
    """Each reply becomes its node's model as it is folded (``keep(sent, tensors)``); nothing is summed.

    Not rebuildable: what a fold kept outlives the round.  No median (nothing is aggregated).
    """

    rebuildable = False

    def __init__(self, keep: Callable[[Sent, Mapping[str, Tensor]], None]) -> None:
        self.keep = keep

    def add(self, entry: Accepted, tensors: Mapping[str, Tensor]) -> None:  # noqa: D102
        self.keep(entry.sent, tensors)

    def add_group(self, variant: str, tensors: Mapping[str, Tensor], num_examples: float, replies: int) -> None:  # noqa: D102
        raise MedianNotSupported("per-node models have no group median")

    def is_finite(self) -> bool:
        """True: every kept reply was checked finite on its own (the sums are not rebuildable)."""
        return True

    def result(self) -> None:  # noqa: D102
        return None
