"""Shared-trunk evaluation: the same logits and tallies as each model's own forward pass, bit for bit."""

from __future__ import annotations

from typing import cast

import pytest
import torch
from torch import nn
from transformers import BertForSequenceClassification

from experiment.config import RunConfig
from models.shared_trunk import evaluate_shared_trunk, head_logits, shares_trunk, trunk_groups
from models.training import EvaluationTally, evaluate_classifier
from models.transformer import MeanPooledBertForSequenceClassification, TransformerSpec, build_model, depth_prefix
from server.app import CentralEvaluator


def tiers(pooling: str, seed: int = 0) -> dict[str, BertForSequenceClassification]:
    """Tiny 2 / 4 / 6-layer classifiers cut from one 6-layer model, each with its own random head."""
    spec = TransformerSpec(source="tiny", pooling=pooling)
    torch.manual_seed(seed)
    full = build_model(spec, 6, pretrained=False).state_dict()
    out = {}
    for name, depth in (("weak", 2), ("medium", 4), ("strong", 6)):
        model = build_model(spec, depth, pretrained=False)  # a fresh random head
        trunk = {
            k: v for k, v in depth_prefix(full, depth).items() if not k.startswith(("bert.pooler.", "classifier."))
        }
        model.load_state_dict(trunk, strict=False)
        out[name] = cast(BertForSequenceClassification, model.eval())
    return out


def batches(seed: int = 1) -> list[dict[str, torch.Tensor]]:
    """Three padded batches of random token ids (sizes 4, 3, 5; shorter rows masked)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for size, width in ((4, 7), (3, 11), (5, 9)):
        ids = torch.randint(1000, 5000, (size, width), generator=gen)
        mask = torch.ones_like(ids)
        mask[0, width // 2 :] = 0
        ids[0, width // 2 :] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": torch.randint(0, 2, (size,), generator=gen)})
    return out


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_each_tiers_logits_from_the_deepest_pass_equal_its_own_forward_pass(pooling: str) -> None:
    models = tiers(pooling)
    batch = batches()[1]
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    with torch.no_grad():
        hidden = models["strong"].bert(**inputs, output_hidden_states=True).hidden_states
        for name, depth in (("weak", 2), ("medium", 4), ("strong", 6)):
            own = models[name](**inputs).logits
            assert torch.equal(head_logits(models[name], hidden[depth], batch["attention_mask"]), own)


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_one_pass_gives_every_tier_the_loss_and_accuracy_of_its_own_evaluation(pooling: str) -> None:
    models = tiers(pooling)
    loader = batches()
    shared = evaluate_shared_trunk(models, loader)  # type: ignore[arg-type]  # a list of batches is iterable
    for name, model in models.items():
        assert shared[name] == evaluate_classifier(model, loader)  # type: ignore[arg-type]
    assert {n for n, (_, _, count) in shared.items() if count == 12} == {"weak", "medium", "strong"}


def test_a_trunk_is_shared_only_when_every_embedding_and_encoder_tensor_is_equal() -> None:
    models = tiers("mean")
    assert shares_trunk(models["strong"], models["weak"]) and shares_trunk(models["strong"], models["medium"])
    assert not shares_trunk(models["weak"], models["strong"])  # deeper than the root
    with torch.no_grad():
        models["medium"].get_parameter("bert.encoder.layer.1.output.dense.bias")[0] += 1e-6
    assert not shares_trunk(models["strong"], models["medium"])
    assert trunk_groups(models) == [["strong", "weak"], ["medium"]]
    with pytest.raises(ValueError, match="'medium' does not share the trunk of 'strong'"):
        evaluate_shared_trunk(models, batches())  # type: ignore[arg-type]

    class OtherHead(MeanPooledBertForSequenceClassification):
        """A subclass may read its hidden states another way: never grouped."""

    subclassed = OtherHead(models["weak"].config)
    subclassed.load_state_dict(models["weak"].state_dict())
    assert not shares_trunk(models["strong"], subclassed)
    other_pooling = tiers("cls")["weak"]
    assert not shares_trunk(models["strong"], other_pooling)  # another head: never grouped
    assert trunk_groups({"strong": models["strong"], "cls": other_pooling, "lin": nn.Linear(2, 2)}) == [
        ["strong"],
        ["cls"],
        ["lin"],
    ]


def test_the_tally_weights_each_batchs_mean_loss_by_its_examples() -> None:
    tally = EvaluationTally()
    tally.add(torch.tensor([[0.0, 1.0], [2.0, 0.0]]), torch.tensor([1, 1]), torch.tensor(0.5))
    tally.add(torch.tensor([[0.0, 3.0]]), torch.tensor([1]), torch.tensor(2.0))
    assert tally.result() == ((0.5 * 2 + 2.0) / 3, 2 / 3, 3)
    assert EvaluationTally().result()[2] == 0


def test_the_central_evaluator_reports_the_numbers_of_one_evaluation_per_model() -> None:
    cfg = RunConfig.model_validate(
        {"model": "tiny", "method": "inclusivefl", "tier-memory-mb": "auto", "server-test-size": 96}
    )
    states = cfg.family().initial_states(cfg.catalog, seed=0)
    torch.manual_seed(3)
    for variant in ("weak", "medium"):  # own heads, the trunk as cut
        for name in states[variant]:
            if name.startswith("classifier."):
                states[variant][name] = torch.randn_like(states[variant][name])
    states["medium"]["bert.encoder.layer.0.output.dense.bias"] = (
        states["medium"]["bert.encoder.layer.0.output.dense.bias"] + 0.5
    )
    evaluator = CentralEvaluator(cfg)
    assert trunk_groups({v: evaluator.model(v, p) for v, p in states.items()}) == [["strong", "weak"], ["medium"]]
    out = evaluator({v: [p] for v, p in states.items()})
    assert list(out) == list(states)
    assert out == {v: evaluator.evaluate(v, p) for v, p in states.items()}
