"""Tiny hand-made catalogs, mock Flower messages and suite-run folders for unit tests."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from unittest.mock import Mock

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from deploy.experiments import PlannedRun
from models.catalog import Layout, MemoryEstimate, ParamSpec, Role, Variant, VariantCatalog
from strategies.base import HeterogeneousStrategy
from strategies.records import to_record
from strategies.replies import Sent

DIM = 2


def toy_layout(depth: int, dim: int = DIM) -> Layout:
    """Embeddings (layer 0), ``depth`` one-tensor encoder layers and a head."""
    params = [ParamSpec("bert.embeddings.e", (dim,), "float32", 0, "shared")]
    for layer in range(1, depth + 1):
        role: Role = "isolated" if layer == depth else "shared"
        params.append(ParamSpec(f"bert.encoder.layer.{layer - 1}.w", (dim,), "float32", layer, role))
    params.append(ParamSpec("classifier.weight", (dim,), "float32", None, "head"))
    return Layout(tuple(params))


def toy_catalog(depths: Mapping[str, int], dim: int = DIM) -> VariantCatalog:
    """Catalog of toy depth variants (memory estimates grow with depth)."""
    variants = tuple(
        Variant(name, d, toy_layout(d, dim), MemoryEstimate(d * 1024 * 1024, 0, 0, 0)) for name, d in depths.items()
    )
    return VariantCatalog("toy", variants)


def constant_state(catalog: VariantCatalog, value: float = 0.0) -> dict[str, dict[str, torch.Tensor]]:
    """Every tensor of every variant filled with ``value``."""
    return {v.name: {p.name: torch.full(p.shape, value) for p in v.layout} for v in catalog}


_counter = iter(range(10**9))


def sent(strategy: HeterogeneousStrategy, node_id: int, variant: str) -> Sent:
    """Register a (mock) message the strategy sent to ``node_id``."""
    msg = Mock(spec=Message)
    msg.metadata = Mock(message_id=f"m{next(_counter)}", dst_node_id=node_id)
    rec = Sent(msg, node_id, variant, 0)
    strategy._sent_train[str(id(msg))] = rec
    return rec


def reply(
    to: Sent,
    arrays: Mapping[str, np.ndarray] | ArrayRecord,
    *,
    num_examples: object = 10,
    server_round: int = 1,
    variant: str | None = None,
    src_node_id: int | None = None,
    extra_metrics: Mapping[str, float] | None = None,
    reply_to: str | None = None,
) -> Message:
    """A mock training reply to ``to``."""
    rec = (
        arrays if isinstance(arrays, ArrayRecord) else ArrayRecord({k: Array(np.asarray(v)) for k, v in arrays.items()})
    )
    metrics = MetricRecord({"num-examples": num_examples, **(extra_metrics or {})})  # type: ignore[dict-item]
    cfg = ConfigRecord({"variant": variant or to.variant, "server-round": server_round})
    content = RecordDict({"arrays": rec, "metrics": metrics, "config": cfg})
    return _mock_reply(to, content, src_node_id=src_node_id, reply_to=reply_to)


def evaluate_reply(to: Sent, *, accuracy: float, loss: float, num_examples: int = 1, server_round: int = 1) -> Message:
    """A mock evaluation reply to ``to``: metrics and config only, as the ClientApp's evaluate sends."""
    metrics = MetricRecord({"num-examples": num_examples, "loss": loss, "accuracy": accuracy})
    cfg = ConfigRecord({"variant": to.variant, "server-round": server_round})
    return _mock_reply(to, RecordDict({"metrics": metrics, "config": cfg}))


def _mock_reply(
    to: Sent, content: RecordDict, *, src_node_id: int | None = None, reply_to: str | None = None
) -> Message:
    """A mock reply carrying ``content``, answering ``to`` (or message ``reply_to``) from its node."""
    m = Mock(spec=Message)
    m.content = content
    answered = reply_to or to.message.metadata.message_id
    m.metadata = Mock(reply_to_message_id=answered, src_node_id=src_node_id or to.node_id)
    m.has_error.return_value = False
    return m


def error_reply(to: Sent, code: int = 5, reason: str = "node gone", src_node_id: int = 1) -> Message:
    """A mock error reply (the SuperLink answers for a dead node with src 1)."""
    m = Mock(spec=Message)
    m.metadata = Mock(reply_to_message_id=to.message.metadata.message_id, src_node_id=src_node_id)
    m.has_error.return_value = True
    m.error = Mock(code=code, reason=reason)
    return m


def trained(state: Mapping[str, torch.Tensor], shift: float) -> dict[str, np.ndarray]:
    """Weights a client would return: every tensor + ``shift``."""
    return {k: (v + shift).numpy() for k, v in state.items()}


__all__ = ["constant_state", "error_reply", "reply", "sent", "to_record", "toy_catalog", "trained"]


def finished_suite_run(folder: Path, planned: PlannedRun, final: float) -> None:
    """A run folder as the suite runner leaves it: marker, resolved config, two rounds, summary, a checkpoint.

    The strong tier reads ``final / 2`` after round 1 and ``final`` after round 2.
    """
    folder.mkdir(parents=True)
    marker = {"label": planned.label, "seed": planned.seed, "run-config": planned.run_config}
    (folder / "experiment.json").write_text(json.dumps(marker | {"supernodes": planned.supernodes}))
    (folder / "config.json").write_text(json.dumps({"tiers": "weak:medium:strong"}))
    rows = [{"round": r, "elapsed": 5.0 * r, "tiers": {"strong": {"local-accuracy": final * r / 2}}} for r in (1, 2)]
    (folder / "rounds.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "summary.csv").write_text("method\nx\n")
    (folder / "model.pt").write_bytes(b"not archived")
