"""The message protocol between the ServerApp and the ClientApp: record names, keys and their parsers.

Every message of a run is a Flower ``RecordDict``; the names of its records and the keys inside
them are defined here once, with typed builders and parsers, so the two apps agree on a message
without importing each other (issue 20).

Messages
--------
``query`` (server -> client)
    record :data:`CATALOG` (:class:`CatalogOffer`): the variants' names and estimated training
    memory, and whether the node must take the largest whatever its memory.
``query`` reply
    record :data:`PROFILE` (:class:`ProfileReply`): the node's tier, memory budget and its
    source, training-example count, whether it holds labels, the variant it chose (``""``:
    declined) and why, and its stable key.  Every field is required.
``train`` / ``evaluate`` (server -> client)
    records :data:`ARRAYS` (the variant's weights) and :data:`CONFIG` (:class:`Instruction`:
    :data:`VARIANT`, :data:`SERVER_ROUND`, plus a method's own keys, e.g. pFedKnow's
    :class:`PruningInstruction`).
``train`` reply
    :data:`ARRAYS` (the trained tensors), :data:`METRICS` (:data:`NUM_EXAMPLES` and scalar
    training metrics) and :data:`CONFIG` echoing the instruction's variant and round.
``evaluate`` reply
    :data:`METRICS` (:data:`NUM_EXAMPLES`, :data:`LOSS`, :data:`ACCURACY`) and the echo.

The server-side checks of a reply's protocol part (echo, example count, evaluation metrics)
live here too and raise :class:`ReplyRejected`; the tensor checks need the layouts the server
sent and stay in :mod:`strategies.validation`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final, TypeVar

from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.app.typing import ConfigRecordValues

# --- record names ------------------------------------------------------------------------------
CATALOG: Final = "catalog"
PROFILE: Final = "profile"
ARRAYS: Final = "arrays"
CONFIG: Final = "config"
METRICS: Final = "metrics"

# --- instruction and echo keys (CONFIG) --------------------------------------------------------
VARIANT: Final = "variant"
SERVER_ROUND: Final = "server-round"

#: DepthFL's distillation weight of the round, ``w_t`` (a train message's ``CONFIG``).
DEPTHFL_ROUND_KD_WEIGHT: Final = "depthfl-round-kd-weight"

# --- reply metric keys (METRICS) ---------------------------------------------------------------
NUM_EXAMPLES: Final = "num-examples"
TRAIN_LOSS: Final = "train-loss"
LAYERS: Final = "layers"
TRAIN_SECONDS: Final = "train-seconds"
STARTUP_SECONDS: Final = "startup-seconds"
LOSS: Final = "loss"
ACCURACY: Final = "accuracy"
#: pFedKnow's client metrics: pseudo-labels kept, share pruned, share of uploaded weights kept.
PSEUDO_KEPT: Final = "pseudo-kept"
PRUNE_RATIO: Final = "prune-ratio"
KEPT_WEIGHTS: Final = "kept-weights"

R = TypeVar("R", ArrayRecord, ConfigRecord, MetricRecord)


class ProtocolError(ValueError):
    """A message does not follow the protocol; ``str(exc)`` names the record or key."""


class ReplyRejected(ProtocolError):
    """A client reply failed the server's validation; ``str(exc)`` is the reason."""


def record_of(content: RecordDict, key: str, kind: type[R], *, error: type[ProtocolError] = ProtocolError) -> R:
    """The record ``key`` of ``content``, which must be a ``kind``; else ``error`` naming it."""
    if key not in content:
        raise error(f"reply has no {kind.__name__} under {key!r}")
    rec = content[key]
    if not isinstance(rec, kind):
        raise error(f"{key!r} is a {type(rec).__name__}, expected {kind.__name__}")
    return rec


def _value(record: ConfigRecord, key: str) -> object:
    if key not in record:
        raise ProtocolError(f"{key!r} missing from the message")
    return record[key]


def get_str(record: ConfigRecord, key: str) -> str:
    """``record[key]``, a string (:class:`ProtocolError` naming the key when missing or not one)."""
    value = _value(record, key)
    if not isinstance(value, str):
        raise ProtocolError(f"{key!r} must be a string, got {value!r}")
    return value


def get_int(record: ConfigRecord, key: str) -> int:
    """``record[key]``, an integer (a bool is not one)."""
    value = _value(record, key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ProtocolError(f"{key!r} must be an integer, got {value!r}")
    return value


def get_float(record: ConfigRecord, key: str) -> float:
    """``record[key]`` as a float (an int or a float; a bool is not one)."""
    value = _value(record, key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ProtocolError(f"{key!r} must be a number, got {value!r}")
    return float(value)


def get_bool(record: ConfigRecord, key: str) -> bool:
    """``record[key]``, a bool."""
    value = _value(record, key)
    if not isinstance(value, bool):
        raise ProtocolError(f"{key!r} must be true or false, got {value!r}")
    return value


def _get_list(record: ConfigRecord, key: str) -> list[object]:
    value = _value(record, key)
    if not isinstance(value, list):
        raise ProtocolError(f"{key!r} must be a list, got {value!r}")
    return list(value)


# --- query -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CatalogOffer:
    """The server's ``query``: the catalog a node chooses its variant from.

    Attributes
    ----------
    variant_names : tuple of str
        Smallest to largest.
    variant_memory_mb : tuple of float
        Each variant's estimated training memory (MiB), same order.
    ignore_memory : bool
        Every node takes the largest variant whatever its budget (AllLarge).

    """

    variant_names: tuple[str, ...]
    variant_memory_mb: tuple[float, ...]
    ignore_memory: bool

    def to_record(self) -> ConfigRecord:
        """The ``CATALOG`` record."""
        return ConfigRecord(
            {
                "variant-names": list(self.variant_names),
                "variant-memory-mb": list(self.variant_memory_mb),
                "ignore-memory": self.ignore_memory,
            }
        )

    @classmethod
    def from_record(cls, record: ConfigRecord) -> CatalogOffer:
        """Parse a ``CATALOG`` record; :class:`ProtocolError` naming a missing or mistyped key."""
        names = tuple(str(x) for x in _get_list(record, "variant-names"))
        memory = []
        for x in _get_list(record, "variant-memory-mb"):
            if isinstance(x, bool) or not isinstance(x, int | float):
                raise ProtocolError(f"'variant-memory-mb' must hold numbers, got {x!r}")
            memory.append(float(x))
        if len(memory) != len(names):
            raise ProtocolError(f"{len(names)} variant names but {len(memory)} memory estimates")
        return cls(names, tuple(memory), get_bool(record, "ignore-memory"))

    def memory_by_name(self) -> dict[str, float]:
        """``{variant name: estimated training MiB}``."""
        return dict(zip(self.variant_names, self.variant_memory_mb, strict=True))


@dataclass(frozen=True)
class ProfileReply:
    """A node's ``query`` reply: its device profile and the variant it can train.

    Attributes
    ----------
    tier : str
        The node's tier (node config ``tier``, or drawn from the run's proportions).
    memory_mb : float
        Its memory budget (MiB).
    memory_source : str
        Where the budget comes from (node config, cgroup, the tier's budget).
    num_examples : int
        Its training examples (0: no local data).
    labeled : bool
        Whether it holds labels (pFedKnow's IoT devices do not).
    variant : str
        The variant it chose; ``""`` when it declines.
    reason : str
        Why it chose or declined.
    node_key : str
        Identity that survives restarts (``partition-<id>``; ``""``: none).

    """

    tier: str
    memory_mb: float
    memory_source: str
    num_examples: int
    labeled: bool
    variant: str
    reason: str
    node_key: str

    def to_record(self) -> ConfigRecord:
        """The ``PROFILE`` record."""
        return ConfigRecord(
            {
                "tier": self.tier,
                "memory-mb": float(self.memory_mb),
                "memory-source": self.memory_source,
                NUM_EXAMPLES: int(self.num_examples),
                "labeled": self.labeled,
                VARIANT: self.variant,
                "reason": self.reason,
                "node-key": self.node_key,
            }
        )

    @classmethod
    def from_record(cls, record: ConfigRecord) -> ProfileReply:
        """Parse a ``PROFILE`` record: every field is required (:class:`ProtocolError` names the missing one)."""
        return cls(
            tier=get_str(record, "tier"),
            memory_mb=get_float(record, "memory-mb"),
            memory_source=get_str(record, "memory-source"),
            num_examples=get_int(record, NUM_EXAMPLES),
            labeled=get_bool(record, "labeled"),
            variant=get_str(record, VARIANT),
            reason=get_str(record, "reason"),
            node_key=get_str(record, "node-key"),
        )


# --- train / evaluate instructions -------------------------------------------------------------
def instruction_config(base: ConfigRecord, *, server_round: int, variant: str) -> ConfigRecord:
    """The ``CONFIG`` record of a train / evaluate message: ``base`` plus the round and the variant."""
    config = ConfigRecord(dict(base))
    config[SERVER_ROUND] = server_round
    config[VARIANT] = variant
    return config


@dataclass(frozen=True)
class Instruction:
    """What a train / evaluate message asks of the node: which variant, which round."""

    variant: str
    server_round: int

    @classmethod
    def from_content(cls, content: RecordDict) -> Instruction:
        """Parse the ``CONFIG`` record of a received message."""
        config = record_of(content, CONFIG, ConfigRecord)
        return cls(get_str(config, VARIANT), get_int(config, SERVER_ROUND))

    def echo(self) -> ConfigRecord:
        """The ``CONFIG`` record of the reply: the variant and round it answers."""
        return ConfigRecord({VARIANT: self.variant, SERVER_ROUND: self.server_round})


@dataclass(frozen=True)
class PruningInstruction:
    """pFedKnow's per-round client settings, sent in the train message's ``CONFIG``.

    Attributes
    ----------
    prune_ratio : float
        This round's pruning ratio (share of channels / prunable weights removed in all).
    delta : float
        Pseudo-label uncertainty threshold (kept when the uncertainty is ``<= delta``).
    uncertainty : str
        ``evidential`` or ``softmax``.
    pruning : str
        ``slimming``, ``magnitude`` or ``none``.
    l1 : float
        Network slimming's ``l1`` weight on the batch-norm scales.

    """

    prune_ratio: float
    delta: float
    uncertainty: str
    pruning: str
    l1: float

    def to_config(self) -> dict[str, ConfigRecordValues]:
        """The keys this instruction adds to a ``CONFIG`` record."""
        return {
            PRUNE_RATIO: self.prune_ratio,
            "delta": self.delta,
            "uncertainty": self.uncertainty,
            "pruning": self.pruning,
            "l1": self.l1,
        }

    @classmethod
    def from_config(cls, config: ConfigRecord) -> PruningInstruction:
        """Parse the five keys from a received ``CONFIG`` record."""
        return cls(
            prune_ratio=get_float(config, PRUNE_RATIO),
            delta=get_float(config, "delta"),
            uncertainty=get_str(config, "uncertainty"),
            pruning=get_str(config, "pruning"),
            l1=get_float(config, "l1"),
        )


# --- replies -----------------------------------------------------------------------------------
def train_reply(arrays: ArrayRecord, metrics: Mapping[str, float], instruction: Instruction) -> RecordDict:
    """The content of a ``train`` reply; ``metrics`` must hold :data:`NUM_EXAMPLES`."""
    if NUM_EXAMPLES not in metrics:
        raise ProtocolError(f"a train reply's metrics need {NUM_EXAMPLES!r}")
    return RecordDict({ARRAYS: arrays, METRICS: MetricRecord(dict(metrics)), CONFIG: instruction.echo()})


def evaluate_reply(num_examples: int, loss: float, accuracy: float, instruction: Instruction) -> RecordDict:
    """The content of an ``evaluate`` reply."""
    metrics = MetricRecord({NUM_EXAMPLES: num_examples, LOSS: loss, ACCURACY: accuracy})
    return RecordDict({METRICS: metrics, CONFIG: instruction.echo()})


def validate_echo(content: RecordDict, *, variant: str, server_round: int) -> ConfigRecord:
    """Check a reply echoes the variant and round the server sent (:class:`ReplyRejected` if not)."""
    cfg = record_of(content, CONFIG, ConfigRecord, error=ReplyRejected)
    if cfg.get(VARIANT) != variant:
        raise ReplyRejected(f"reply is for variant {cfg.get(VARIANT)!r}, node was sent {variant!r}")
    if cfg.get(SERVER_ROUND) != server_round:
        raise ReplyRejected(f"reply is for round {cfg.get(SERVER_ROUND)!r}, expected {server_round}")
    return cfg


def validate_num_examples(metrics: MetricRecord, *, max_examples: int, key: str = NUM_EXAMPLES) -> int:
    """Return the example count: an integer in ``1 .. max_examples``."""
    if key not in metrics:
        raise ReplyRejected(f"metrics lack {key!r}")
    raw = metrics[key]
    if isinstance(raw, bool) or not isinstance(raw, int | float):
        raise ReplyRejected(f"{key} is not a number: {raw!r}")
    value = float(raw)
    if not math.isfinite(value) or value != int(value):
        raise ReplyRejected(f"{key} must be a whole number, got {raw!r}")
    if not 1 <= value <= max_examples:
        raise ReplyRejected(f"{key} = {raw!r} outside 1..{max_examples}")
    return int(value)


def validate_examples_claim(num_examples: int, reported: int) -> None:
    """Reject a reply claiming more training examples than its node reported in the handshake.

    A node's weight in every mean is its example count, so inflating it is the cheapest way
    to dominate an aggregate: ``num_examples <= reported`` is required whenever the node
    reported a positive count (``reported = 0`` means unknown and is not checked).
    """
    if reported > 0 and num_examples > reported:
        raise ReplyRejected(f"num-examples = {num_examples} exceeds the {reported} the node reported in the handshake")


def validate_evaluate_metrics(metrics: MetricRecord, *, max_examples: int) -> tuple[int, float, float]:
    """``(num_examples, loss, accuracy)`` of an evaluation reply's metrics: finite, accuracy in [0, 1]."""
    n = validate_num_examples(metrics, max_examples=max_examples)
    values: list[float] = []
    for key in (LOSS, ACCURACY):
        v = metrics.get(key)
        if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
            raise ReplyRejected(f"{key} missing or not a finite number: {v!r}")
        values.append(float(v))
    if not 0.0 <= values[1] <= 1.0:
        raise ReplyRejected(f"accuracy {values[1]} outside [0, 1]")
    return n, values[0], values[1]


def scalar_metrics(metrics: MetricRecord, *, skip: Sequence[str] = (NUM_EXAMPLES,)) -> dict[str, float]:
    """The finite scalar metrics of a reply, without ``skip`` (the example count: it is the weight)."""
    return {
        k: float(v) for k, v in metrics.items() if k not in skip and isinstance(v, int | float) and math.isfinite(v)
    }
