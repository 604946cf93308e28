"""FlexiFed: federated learning across clients with different architectures of one family.

Wang et al., "FlexiFed: Personalized Federated Learning for Edge Clients with Heterogeneous
Model Architectures", WWW 2023 (Algorithms 1-3).  A model is a sequence of parameterized
layers, each with a signature (``models.architectures.LayerSignature``: kind, tensor shapes,
the non-parameterized operations since the previous layer).  Two architectures share their
*common base layers*: the longest prefix of equal signatures (:func:`common_prefix_length`).
All prefixes of a set of architectures form a prefix trie (:func:`common_layer_trie`); a trie
node at depth ``l + 1`` is layer ``l`` of every architecture passing through it.

Aggregation
-----------
Let ``U`` be the clients that replied this round, ``n_u`` their example counts (weights
``w_u = n_u``, or ``w_u = 1`` with ``uniform=True`` -- the paper's ``1 / |U|``), ``A(u)`` a
client's architecture and ``P`` the common prefix length of all participating architectures.
Layer ``l`` of client ``u`` becomes the weighted mean over a client set ``S(u, l)``:

``x_{u,l} <- sum_{v in S} w_v x_{v,l'} / sum_{v in S} w_v``

with ``l' = l`` except for shared classifiers (below), and

* ``basic`` (Basic-Common, Alg. 2): ``S = U`` for ``l < P``, else ``{u}`` (personal layers
  stay with each client);
* ``clustered`` (Clustered-Common, Alg. 3): ``S = U`` for ``l < P``, else the clients whose
  architecture is identical to ``A(u)`` (equal signature sequences);
* ``max`` (Max-Common, Alg. 1): ``S`` = every client whose architecture passes through the trie
  node of ``(A(u), l)`` -- the recursion "average the prefix common to the group, split the
  rest into groups that still share a layer, recurse" produces exactly these sets;
* ``clustered-fl`` (baseline): ``S`` = clients with identical architectures (FedAvg per
  architecture);
* ``standalone`` (baseline): ``S = {u}``.

Classifier layers (kind ``"classifier"``) are averaged only among identical architectures
(``S`` intersected with them; the paper measured that sharing heads across architectures lowers
accuracy).  With ``share_classifier=True`` a classifier is averaged over every participating
client whose architecture has a classifier with an equal signature, wherever it sits
(``basic``, ``clustered`` and ``max`` only).

Server state and streaming
--------------------------
Within a round, clients of one architecture always fall into the same sets (except for
personal layers of ``basic`` / ``standalone``), so the per-architecture weighted sums
``S_a = sum_{A(u)=a} w_u x_u`` and weights ``W_a`` are sufficient statistics: every group mean
is ``sum_{a in G} S_a / sum_{a in G} W_a`` (:func:`aggregate_layers`).  Memory is
``O(architectures x model)`` for the sums (:class:`FlexiFedAccumulator`), plus, in ``basic`` and
``standalone``, one model per client, which those methods keep by definition.

The server keeps one model per architecture (the state key is the variant name).  A group
mean is written to every architecture of the catalog whose layer passes through the same
trie node -- also to architectures without clients this round, whose clients download it when
they are next sampled (the paper's global common model ``w_g^comm``); layers that no
participating client covers keep their value.  In ``basic`` / ``standalone`` the strategy also
keeps each client's own model (its last reply, with later group means written into it).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from logging import INFO
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Unpack, get_args

import torch
from flwr.common import log
from torch import Tensor

from experiment.config import ConfigError
from experiment.method_settings import FlexiFedGroup
from models.architectures import ArchLayer, LayerSignature
from models.catalog import VariantCatalog
from models.family import ArchitectureFamily, TransformerFamily
from strategies.base import HeterogeneousStrategy
from strategies.baselines import PerNodeModels
from strategies.options import StrategyOptions
from strategies.replies import Accepted, Sent
from strategies.round_sums import MedianNotSupported
from strategies.streaming import StreamingMean

if TYPE_CHECKING:
    from experiment.config import RunConfig
    from experiment.registry import MethodEntry

Mode = Literal["basic", "clustered", "max", "clustered-fl", "standalone"]
MODES: tuple[str, ...] = get_args(Mode)
#: Modes in which some layers stay with each client (one model per client is kept).
LOCAL_MODES: frozenset[str] = frozenset({"basic", "standalone"})
#: Modes that never average across different architectures.
SAME_ARCH_MODES: frozenset[str] = frozenset({"clustered-fl", "standalone"})

Params = dict[str, Tensor]
#: ``(architecture, 0-based layer index)``.
Position = tuple[str, int]
#: The positions whose clients' weights are averaged into a layer; empty = nothing covers it.
Group = frozenset[Position]
#: A layer whose clients each keep their own weights (personal layers of ``basic``).
LOCAL = None
ArchPlan = dict[str, tuple[Group | None, ...]]

C = TypeVar("C", bound=Hashable)


class FlexiFedError(ValueError):
    """Raised for an unknown mode or architecture, or layers that do not match a layout."""


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise FlexiFedError(f"unknown FlexiFed mode {mode!r}; expected one of {MODES}")


# --- common layers ----------------------------------------------------------------------------


def common_prefix_length(sig_a: Sequence[LayerSignature], sig_b: Sequence[LayerSignature]) -> int:
    """Number of common base layers: the largest ``k`` with ``sig_a[i] == sig_b[i]`` for all ``i < k``."""
    k = 0
    for a, b in zip(sig_a, sig_b, strict=False):
        if a != b:
            break
        k += 1
    return k


def common_prefix_of_all(signatures: Iterable[Sequence[LayerSignature]]) -> int:
    """Common prefix length of several architectures (0 for none, the full length for one)."""
    seqs = list(signatures)
    if not seqs:
        return 0
    first = seqs[0]
    return min((common_prefix_length(first, s) for s in seqs[1:]), default=len(first))


@dataclass
class TrieNode:
    """A node of the layer-signature prefix trie.

    Attributes
    ----------
    signature : LayerSignature | None
        The layer this node stands for (``None`` at the root).
    depth : int
        ``l + 1`` for layer ``l`` (0 at the root).
    architectures : set[str]
        Architectures whose first ``depth`` layers have exactly the signatures on the path.
    children : dict[LayerSignature, TrieNode]
        One child per distinct next-layer signature.

    """

    signature: LayerSignature | None
    depth: int
    architectures: set[str] = field(default_factory=set)
    children: dict[LayerSignature, TrieNode] = field(default_factory=dict)


def common_layer_trie(signatures: Mapping[str, Sequence[LayerSignature]]) -> TrieNode:
    """Prefix trie of the architectures' layer signatures.

    Every architecture is a root-to-node path; two architectures pass through the same node at
    depth ``k`` iff their first ``k`` signatures are equal, i.e. iff ``k <=``
    :func:`common_prefix_length` of the two.
    """
    root = TrieNode(None, 0, set(signatures))
    for arch, sigs in signatures.items():
        node = root
        for sig in sigs:
            node = node.children.setdefault(sig, TrieNode(sig, node.depth + 1))
            node.architectures.add(arch)
    return root


def trie_path(trie: TrieNode, sigs: Sequence[LayerSignature]) -> list[TrieNode]:
    """The nodes of layers ``0 .. len(sigs) - 1`` of an architecture in ``trie``.

    Raises
    ------
    FlexiFedError
        If the architecture is not in the trie.

    """
    path: list[TrieNode] = []
    node = trie
    for index, sig in enumerate(sigs):
        if sig not in node.children:
            raise FlexiFedError(f"layer {index} is not in the trie")
        node = node.children[sig]
        path.append(node)
    return path


def identical_architectures(signatures: Mapping[str, Sequence[LayerSignature]]) -> dict[str, frozenset[str]]:
    """Per architecture, all architectures with an equal signature sequence (itself included)."""
    by_seq: dict[tuple[LayerSignature, ...], set[str]] = {}
    for arch, sigs in signatures.items():
        by_seq.setdefault(tuple(sigs), set()).add(arch)
    return {arch: frozenset(by_seq[tuple(sigs)]) for arch, sigs in signatures.items()}


# --- the plan ---------------------------------------------------------------------------------


def _classifier_group(
    sig: LayerSignature, signatures: Mapping[str, Sequence[LayerSignature]], participating: frozenset[str]
) -> Group:
    """Every participating classifier position with signature ``sig`` (``share_classifier=True``)."""
    return frozenset((a, i) for a in participating for i, s in enumerate(signatures[a]) if s == sig)


def architecture_plan(
    signatures: Mapping[str, Sequence[LayerSignature]],
    participating: Iterable[str],
    *,
    mode: str,
    share_classifier: bool = False,
) -> ArchPlan:
    """Per architecture and layer, the positions whose clients are averaged into it.

    See the module docstring for the sets per mode.  ``plan[a][l]`` is a frozenset of
    ``(architecture, layer)`` positions of participating architectures -- empty when no
    participating client covers the layer (it keeps its value) -- or :data:`LOCAL` (``None``)
    when each client of ``a`` keeps its own weights for that layer.  Architectures without
    clients get the groups their layers would join (never :data:`LOCAL`).

    Parameters
    ----------
    signatures : Mapping[str, Sequence[LayerSignature]]
        Every architecture of the catalog.
    participating : Iterable[str]
        Architectures with at least one client this round.
    mode : {"basic", "clustered", "max", "clustered-fl", "standalone"}
        Which FlexiFed strategy or baseline.
    share_classifier : bool
        Share classifier layers across architectures with equal classifier signatures.

    Raises
    ------
    FlexiFedError
        For an unknown mode or participating architecture.

    """
    _check_mode(mode)
    parts = frozenset(participating)
    unknown = sorted(parts - set(signatures))
    if unknown:
        raise FlexiFedError(f"participating architectures {unknown} have no signatures")
    trie = common_layer_trie(signatures)
    clusters = identical_architectures(signatures)
    prefix = common_prefix_of_all(signatures[a] for a in sorted(parts))
    plan: ArchPlan = {}
    for arch, sigs in signatures.items():
        row: list[Group | None] = []
        for index, (sig, node) in enumerate(zip(sigs, trie_path(trie, sigs), strict=True)):
            node_group = frozenset((a, index) for a in node.architectures & parts)
            cluster_group = frozenset((a, index) for a in clusters[arch] & parts)
            group: Group | None
            if mode == "standalone":
                group = LOCAL
            elif mode == "clustered-fl":
                group = cluster_group
            elif mode == "max" or index < prefix:
                group = node_group
            else:
                group = cluster_group if mode == "clustered" else LOCAL
            if sig.is_classifier and mode not in SAME_ARCH_MODES:
                if share_classifier:
                    group = _classifier_group(sig, signatures, parts)
                elif group is not LOCAL:
                    group = frozenset(p for p in group if p[0] in clusters[arch])
            if group is LOCAL and arch not in parts:
                group = frozenset()
            row.append(group)
        plan[arch] = tuple(row)
    return plan


def client_plan(
    signatures: Mapping[str, Sequence[LayerSignature]],
    clients: Mapping[C, str],
    *,
    mode: str,
    share_classifier: bool = False,
) -> dict[C, tuple[frozenset[C], ...]]:
    """Per client and layer, the clients whose weights are averaged into it (the FlexiFed plan).

    ``plan[u][l] = S(u, l)`` of the module docstring: ``{u}`` for a layer ``u`` keeps to itself.

    Parameters
    ----------
    signatures : Mapping[str, Sequence[LayerSignature]]
        Every architecture.
    clients : Mapping[C, str]
        The participating clients and their architectures.
    mode, share_classifier
        As in :func:`architecture_plan`.

    """
    plan = architecture_plan(signatures, set(clients.values()), mode=mode, share_classifier=share_classifier)
    by_arch: dict[str, set[C]] = {}
    for client, arch in clients.items():
        by_arch.setdefault(arch, set()).add(client)
    out: dict[C, tuple[frozenset[C], ...]] = {}
    for client, arch in clients.items():
        out[client] = tuple(
            frozenset({client}) if group is LOCAL else frozenset(u for a, _ in group for u in by_arch[a])
            for group in plan[arch]
        )
    return out


def shared_layer_count(plan: ArchPlan, arch: str) -> int:
    """Layers of ``arch`` averaged with at least one *other* architecture's clients."""
    return sum(1 for g in plan[arch] if g is not LOCAL and any(a != arch for a, _ in g))


# --- aggregation ------------------------------------------------------------------------------


def aggregate_layers(
    plan: ArchPlan, layers: Mapping[str, Sequence[ArchLayer]], sums: Mapping[str, StreamingMean]
) -> dict[str, Params]:
    """Group means of every covered, non-local layer, per architecture.

    For layer ``l`` of architecture ``a`` with group ``G = plan[a][l]`` and its ``j``-th tensor,

    ``x = sum_{(b, m) in G} S_b[names(b, m)_j] / sum_{(b, m) in G} W_b``

    where ``S_b`` and ``W_b`` are the weighted sum and total weight of architecture ``b``'s
    replies (``sums[b]``).  Layers with an empty or :data:`LOCAL` group are left out (they keep
    their value, or the client's own).  Each distinct ``(G, j)`` is computed once.

    Raises
    ------
    FlexiFedError
        If a group names an architecture without sums or positions whose shapes differ.

    """
    cache: dict[tuple[Group, int], Tensor] = {}
    out: dict[str, Params] = {}
    for arch, row in plan.items():
        updates: Params = {}
        for index, group in enumerate(row):
            if not group:  # LOCAL or uncovered
                continue
            for j, name in enumerate(layers[arch][index].names):
                key = (group, j)
                if key not in cache:
                    cache[key] = _group_mean(group, j, layers, sums)
                updates[name] = cache[key]
        out[arch] = updates
    return out


def _group_mean(
    group: Group, j: int, layers: Mapping[str, Sequence[ArchLayer]], sums: Mapping[str, StreamingMean]
) -> Tensor:
    """``sum_{(b, m) in G} S_b[names(b, m)_j] / sum_{(b, m) in G} W_b`` (see :func:`aggregate_layers`)."""
    parts: list[Tensor] = []
    weight = 0.0
    for arch, index in sorted(group):
        acc = sums.get(arch)
        if acc is None:
            raise FlexiFedError(f"group {sorted(group)} names architecture {arch!r}, which has no replies")
        name = layers[arch][index].names[j]
        s = acc.sums[name]
        if parts and s.shape != parts[0].shape:
            raise FlexiFedError(f"{arch}/{name}: shape {tuple(s.shape)} != {tuple(parts[0].shape)} in its group")
        parts.append(s)
        weight += acc.weights[name]
    if len(parts) == 1:  # one pass, no copy of the sum first
        return parts[0] / weight
    # the same left-to-right sum, into one new tensor, then divided in place
    total = torch.add(parts[0], parts[1])
    for s in parts[2:]:
        total.add_(s)
    return total.div_(weight)


class FlexiFedAccumulator:
    """Streaming per-architecture weighted sums of one round's replies.

    ``add(client, arch, x, n)`` folds ``w x`` into architecture ``arch``'s
    :class:`~strategies.streaming.StreamingMean` with ``w = n`` (or ``1`` with ``uniform``);
    replies are not kept.
    """

    def __init__(self, *, uniform: bool = False) -> None:
        self.uniform = uniform
        self.sums: dict[str, StreamingMean] = {}
        self.clients: dict[Hashable, str] = {}

    def weight(self, num_examples: float) -> float:
        """``1`` with ``uniform``, else ``num_examples``."""
        return 1.0 if self.uniform else float(num_examples)

    def add(self, client: Hashable, arch: str, tensors: Mapping[str, Tensor], num_examples: float) -> None:
        """Fold one client's weights into its architecture's sums."""
        if client in self.clients:
            raise FlexiFedError(f"client {client!r} replied twice in one round")
        self.sums.setdefault(arch, StreamingMean()).add(tensors, self.weight(num_examples))
        self.clients[client] = arch

    @property
    def participating(self) -> set[str]:
        """Architectures with at least one reply."""
        return set(self.sums)


class FlexiFedSums:
    """FlexiFed's round sums (:class:`~strategies.round_sums.RoundSums`): a :class:`FlexiFedAccumulator`.

    With ``keep`` (the modes with personal layers) each reply is also kept as its node's model
    as it is folded, which outlives the round: then the sums are not rebuildable.  No median
    (FlexiFed's options forbid it).
    """

    def __init__(self, acc: FlexiFedAccumulator, keep: Callable[[Sent, Mapping[str, Tensor]], None] | None) -> None:
        self.acc = acc
        self.keep = keep

    @property
    def rebuildable(self) -> bool:
        """True unless replies are also kept as node models."""
        return self.keep is None

    def add(self, entry: Accepted, tensors: Mapping[str, Tensor]) -> None:  # noqa: D102
        if self.keep is not None:
            self.keep(entry.sent, tensors)
        self.acc.add(entry.sent.node_id, entry.sent.variant, tensors, entry.num_examples)

    def add_group(self, variant: str, tensors: Mapping[str, Tensor], num_examples: float, replies: int) -> None:  # noqa: D102
        raise MedianNotSupported("FlexiFed folds each reply into its architecture's sums; it has no group median")

    def is_finite(self) -> bool:  # noqa: D102
        return all(m.is_finite() for m in self.acc.sums.values())

    def result(self) -> FlexiFedAccumulator:  # noqa: D102
        return self.acc


def flexifed_round(
    states: Mapping[str, Mapping[str, Tensor]],
    layers: Mapping[str, Sequence[ArchLayer]],
    replies: Iterable[tuple[C, str, Mapping[str, Tensor], float]],
    *,
    mode: str,
    uniform: bool = False,
    share_classifier: bool = False,
) -> tuple[dict[str, Params], dict[C, Params]]:
    """One FlexiFed server round as a pure function.

    Parameters
    ----------
    states : Mapping[str, Mapping[str, Tensor]]
        Per-architecture models before the round.
    layers : Mapping[str, Sequence[ArchLayer]]
        Per architecture, its layers (signature and tensor names).
    replies : Iterable[tuple[C, str, Mapping[str, Tensor], float]]
        ``(client, architecture, weights, num_examples)``, folded in one at a time; in the
        ``basic`` / ``standalone`` modes each reply is kept as that client's model.
    mode, uniform, share_classifier
        See the module docstring.

    Returns
    -------
    tuple[dict[str, Params], dict[C, Params]]
        New per-architecture models (every covered layer replaced by its group mean, others
        unchanged) and every replying client's model after the round (its own weights in
        :data:`LOCAL` layers, group means elsewhere).

    """
    _check_mode(mode)
    acc = FlexiFedAccumulator(uniform=uniform)
    own: dict[C, Params] = {}
    order: list[tuple[C, str]] = []
    for client, arch, tensors, n in replies:
        acc.add(client, arch, tensors, n)
        order.append((client, arch))
        if mode in LOCAL_MODES:
            own[client] = {**states[arch], **tensors}
    signatures = {a: [layer.signature for layer in ls] for a, ls in layers.items()}
    plan = architecture_plan(signatures, acc.participating, mode=mode, share_classifier=share_classifier)
    updates = aggregate_layers(plan, layers, acc.sums)
    new_states = {a: {**states[a], **updates.get(a, {})} for a in states}
    clients = {c: {**own[c], **updates[arch]} if c in own else new_states[arch] for c, arch in order}
    return new_states, clients


# --- Flower strategy --------------------------------------------------------------------------


def check_layers(catalog: VariantCatalog, layers: Mapping[str, Sequence[ArchLayer]]) -> None:
    """Require every variant's layers to partition its layout with matching shapes.

    Raises
    ------
    FlexiFedError
        For a variant without layers, or names / shapes that differ from the layout.

    """
    for v in catalog:
        if v.name not in layers:
            raise FlexiFedError(f"no layer signatures for variant {v.name!r}")
        spec = v.layout.by_name()
        seen: list[str] = []
        for layer in layers[v.name]:
            for name, shape in zip(layer.names, layer.signature.shapes, strict=True):
                if name not in spec or spec[name].shape != shape:
                    raise FlexiFedError(f"{v.name}: layer tensor {name} {shape} is not in the layout")
                seen.append(name)
        if sorted(seen) != sorted(v.layout.trainable_names()) or len(seen) != len(set(seen)):
            raise FlexiFedError(f"{v.name}: layers must cover every trainable tensor exactly once")


class FlexiFed(PerNodeModels[FlexiFedAccumulator]):
    """FlexiFed on Flower: one model per architecture, common-layer aggregation.

    A node of variant ``a`` (an architecture) receives and returns only architecture ``a``'s
    weights.  Every validated reply is folded into a :class:`FlexiFedAccumulator`; after the
    round the plan of :func:`architecture_plan` (over the architectures that replied) decides
    which layers are averaged over which clients, :func:`aggregate_layers` computes the group
    means, and they are written into every architecture's model (and, in ``basic`` /
    ``standalone``, into every kept client model).  The server rule is plain averaging, as in
    the paper.  ``mode="standalone"`` equals :class:`~strategies.baselines.LocalTraining` (each
    node keeps its own model); either can run the Standalone baseline.

    Parameters
    ----------
    catalog : VariantCatalog
        One variant per architecture (``models.architectures.architecture_catalog``).
    signatures : Mapping[str, Sequence[ArchLayer]]
        Per variant, its layers in forward order (signature and state-dict names), e.g.
        ``models.architectures.architecture_layers``.
    mode : {"basic", "clustered", "max", "clustered-fl", "standalone"}
        Basic-Common, Clustered-Common, Max-Common or the baselines.
    uniform : bool
        Weight every client 1 (the paper) instead of by its example count.
    share_classifier : bool
        Share classifier layers across architectures with equal classifier signatures.
    **options
        :class:`~strategies.base.StrategyOptions`, passed to :class:`~strategies.base.HeterogeneousStrategy`.

    """

    #: Personal layers and per-client models need the replies themselves, not a group median.
    supports_median = False

    def __init__(
        self,
        *,
        catalog: VariantCatalog,
        signatures: Mapping[str, Sequence[ArchLayer]],
        mode: str = "max",
        uniform: bool = False,
        share_classifier: bool = False,
        **options: Unpack[StrategyOptions],
    ) -> None:
        _check_mode(mode)
        check_layers(catalog, signatures)
        super().__init__(catalog=catalog, **options)
        self.mode = mode
        self.uniform = uniform
        self.share_classifier = share_classifier
        self.layers: dict[str, tuple[ArchLayer, ...]] = {v.name: tuple(signatures[v.name]) for v in catalog}
        self.signatures = {a: [layer.signature for layer in ls] for a, ls in self.layers.items()}

    @property
    def keeps_client_models(self) -> bool:
        """Whether personal layers stay per client (``basic``, ``standalone``)."""
        return self.mode in LOCAL_MODES

    def new_round_sums(self) -> FlexiFedSums:
        """The round's architecture sums; with personal layers each reply is also kept as its node's model."""
        keep = self.keep_node_model if self.keeps_client_models else None
        return FlexiFedSums(FlexiFedAccumulator(uniform=self.uniform), keep)

    def apply_round(self, server_round: int, acc: FlexiFedAccumulator, counts: Mapping[str, int]) -> None:
        """Plan over the architectures that replied and write each group's mean."""
        if not acc.clients:
            return
        plan = architecture_plan(
            self.signatures, acc.participating, mode=self.mode, share_classifier=self.share_classifier
        )
        with torch.no_grad():
            updates = aggregate_layers(plan, self.layers, acc.sums)
        for arch, upd in updates.items():
            self.state[arch] = {**self.state[arch], **upd}
        for node, arch in self.node_variant.items():
            self.node_states[node] = {**self.node_states[node], **updates[arch]}
        report = self.report(server_round)
        for arch in acc.participating:
            report.group(arch)["shared-layers"] = float(shared_layer_count(plan, arch))
        log(
            INFO,
            "FlexiFed (%s) round %d: clients per architecture %s, layers shared across architectures %s",
            self.mode,
            server_round,
            dict(counts),
            {a: shared_layer_count(plan, a) for a in sorted(acc.participating)},
        )

    def models_for_evaluation(self) -> dict[str, list[Mapping[str, Tensor]]]:
        """Per architecture its model, or every kept client model (``basic`` / ``standalone``)."""
        if not self.keeps_client_models:
            return HeterogeneousStrategy.models_for_evaluation(self)
        return super().models_for_evaluation()


def build(cfg: RunConfig, entry: MethodEntry, options: Mapping[str, Any]) -> FlexiFed:
    """FlexiFed in ``entry.mode`` over the family's layer signatures (VGGs / ResNets, or a transformer's depths).

    Registry factory (:class:`experiment.registry.MethodEntry` ``strategy``).

    Raises
    ------
    ConfigError
        When ``model`` names neither an architecture family nor a transformer.

    """
    family = cfg.family()
    if not isinstance(family, ArchitectureFamily | TransformerFamily):
        raise ConfigError(f"run config 'model': {entry.name!r} needs an architecture family or a transformer")
    own = cfg.settings_of(FlexiFedGroup)
    return FlexiFed(
        signatures=family.layers(cfg.catalog),
        mode=entry.mode,
        uniform=own.flexifed_uniform,
        share_classifier=own.flexifed_share_classifier,
        **options,
    )
