"""The message protocol (experiment/protocol.py): round trips, strict parsing, server checks."""

from __future__ import annotations

import pytest
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord, RecordDict

from experiment.protocol import (
    ACCURACY,
    CONFIG,
    LOSS,
    METRICS,
    NUM_EXAMPLES,
    SERVER_ROUND,
    VARIANT,
    CatalogOffer,
    Instruction,
    ProfileReply,
    ProtocolError,
    PruningInstruction,
    ReplyRejected,
    evaluate_reply,
    instruction_config,
    record_of,
    scalar_metrics,
    train_reply,
    validate_echo,
    validate_evaluate_metrics,
    validate_examples_claim,
    validate_num_examples,
)
from strategies import validation

PROFILE = ProfileReply(
    tier="weak",
    memory_mb=512.0,
    memory_source="tier budget",
    num_examples=90,
    labeled=True,
    variant="2-layer",
    reason="fits",
    node_key="partition-3",
)


def test_catalog_offer_round_trips_and_pairs_names_with_memory() -> None:
    offer = CatalogOffer(("a", "b"), (10.0, 20.0), ignore_memory=False)
    back = CatalogOffer.from_record(offer.to_record())
    assert back == offer
    assert back.memory_by_name() == {"a": 10.0, "b": 20.0}


def test_catalog_offer_rejects_mismatched_lists_and_missing_keys() -> None:
    record = CatalogOffer(("a", "b"), (10.0, 20.0), ignore_memory=True).to_record()
    record["variant-memory-mb"] = [10.0]
    with pytest.raises(ProtocolError, match="2 variant names but 1 memory estimates"):
        CatalogOffer.from_record(record)
    record["variant-memory-mb"] = [10.0, 20.0]
    del record["ignore-memory"]
    with pytest.raises(ProtocolError, match="'ignore-memory' missing"):
        CatalogOffer.from_record(record)


def test_profile_round_trips() -> None:
    assert ProfileReply.from_record(PROFILE.to_record()) == PROFILE


@pytest.mark.parametrize(
    "key", ["tier", "memory-mb", "memory-source", "num-examples", "labeled", "variant", "reason", "node-key"]
)
def test_profile_requires_every_field_and_names_the_missing_one(key: str) -> None:
    record = PROFILE.to_record()
    del record[key]
    with pytest.raises(ProtocolError, match=f"'{key}' missing"):
        ProfileReply.from_record(record)


def test_profile_rejects_a_mistyped_field() -> None:
    record = PROFILE.to_record()
    record["num-examples"] = 1.5
    with pytest.raises(ProtocolError, match="'num-examples' must be an integer"):
        ProfileReply.from_record(record)
    record = PROFILE.to_record()
    record["labeled"] = 1
    with pytest.raises(ProtocolError, match="'labeled' must be true or false"):
        ProfileReply.from_record(record)


def test_instruction_config_adds_round_and_variant_after_the_base_keys() -> None:
    cfg = instruction_config(ConfigRecord({"lr": 0.1}), server_round=3, variant="v")
    assert list(cfg.keys()) == ["lr", SERVER_ROUND, VARIANT]
    instruction = Instruction.from_content(RecordDict({CONFIG: cfg}))
    assert instruction == Instruction("v", 3)
    assert dict(instruction.echo()) == {VARIANT: "v", SERVER_ROUND: 3}


def test_instruction_needs_an_integer_round() -> None:
    content = RecordDict({CONFIG: ConfigRecord({VARIANT: "v", SERVER_ROUND: "3"})})
    with pytest.raises(ProtocolError, match="'server-round' must be an integer"):
        Instruction.from_content(content)
    with pytest.raises(ProtocolError, match="no ConfigRecord under 'config'"):
        Instruction.from_content(RecordDict())


def test_pruning_instruction_round_trips_through_a_config_record() -> None:
    p = PruningInstruction(prune_ratio=0.25, delta=0.5, uncertainty="evidential", pruning="slimming", l1=1e-4)
    cfg = instruction_config(ConfigRecord(p.to_config()), server_round=1, variant="v")
    assert PruningInstruction.from_config(cfg) == p


def test_train_reply_echoes_and_needs_the_example_count() -> None:
    instruction = Instruction("v", 2)
    content = train_reply(ArrayRecord(), {NUM_EXAMPLES: 5, "train-loss": 0.5}, instruction)
    assert validate_echo(content, variant="v", server_round=2) is not None
    metrics = record_of(content, METRICS, MetricRecord)
    assert validate_num_examples(metrics, max_examples=5) == 5
    with pytest.raises(ProtocolError, match="need 'num-examples'"):
        train_reply(ArrayRecord(), {"train-loss": 0.5}, instruction)


def test_echo_of_another_round_or_variant_is_rejected() -> None:
    content = evaluate_reply(4, 0.3, 0.75, Instruction("v", 2))
    with pytest.raises(ReplyRejected, match="reply is for round 2, expected 3"):
        validate_echo(content, variant="v", server_round=3)
    with pytest.raises(ReplyRejected, match="reply is for variant 'v', node was sent 'w'"):
        validate_echo(content, variant="w", server_round=2)


def test_evaluate_metrics_are_checked() -> None:
    content = evaluate_reply(4, 0.3, 0.75, Instruction("v", 2))
    metrics = record_of(content, METRICS, MetricRecord)
    assert validate_evaluate_metrics(metrics, max_examples=10) == (4, 0.3, 0.75)
    metrics[ACCURACY] = 1.5
    with pytest.raises(ReplyRejected, match=r"accuracy 1\.5 outside"):
        validate_evaluate_metrics(metrics, max_examples=10)
    del metrics[LOSS]
    with pytest.raises(ReplyRejected, match="loss missing"):
        validate_evaluate_metrics(metrics, max_examples=10)


def test_example_count_and_claim_checks() -> None:
    with pytest.raises(ReplyRejected, match=r"outside 1\.\.10"):
        validate_num_examples(MetricRecord({NUM_EXAMPLES: 11}), max_examples=10)
    with pytest.raises(ReplyRejected, match="whole number"):
        validate_num_examples(MetricRecord({NUM_EXAMPLES: 2.5}), max_examples=10)
    with pytest.raises(ReplyRejected, match="exceeds the 3"):
        validate_examples_claim(4, 3)
    validate_examples_claim(4, 0)  # unknown count: not checked


def test_record_of_raises_the_error_kind_asked_for() -> None:
    content = RecordDict({METRICS: MetricRecord({NUM_EXAMPLES: 1})})
    with pytest.raises(ReplyRejected, match="'metrics' is a MetricRecord, expected ConfigRecord"):
        record_of(content, METRICS, ConfigRecord, error=ReplyRejected)
    assert issubclass(ReplyRejected, ProtocolError)


def test_scalar_metrics_skip_the_example_count_and_non_finite_values() -> None:
    metrics = MetricRecord({NUM_EXAMPLES: 3, "train-loss": 0.5, "bad": float("nan"), "layers": 2})
    assert scalar_metrics(metrics) == {"train-loss": 0.5, "layers": 2.0}


def test_strategies_validation_re_exports_the_protocol_error() -> None:
    assert validation.ReplyRejected is ReplyRejected
