"""Mean pooling for the sentence encoder: exact numbers, same parameters as BERT's pooler, config key."""

from __future__ import annotations

import pytest
import torch
from transformers import BertForSequenceClassification

from experiment.config import RunConfig
from models.transformer import (
    MeanPooledBertForSequenceClassification,
    TransformerSpec,
    build_model,
    classifier_class,
    depth_layout,
    masked_mean,
)

TINY = TransformerSpec(source="tiny")


def test_masked_mean_on_exact_numbers() -> None:
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]], [[2.0, 0.0], [4.0, 2.0], [6.0, 4.0]]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    assert torch.equal(masked_mean(hidden, mask), torch.tensor([[2.0, 3.0], [4.0, 2.0]]))
    assert torch.equal(masked_mean(hidden[1:], None), torch.tensor([[4.0, 2.0]]))
    # an all-padding row divides by 1, not 0
    assert torch.equal(masked_mean(hidden[:1], torch.zeros(1, 3)), torch.zeros(1, 2))


def test_mean_pooled_logits_are_the_pooler_on_the_mean_token_state() -> None:
    torch.manual_seed(0)
    model = build_model(TINY, 2, pretrained=False).eval()
    assert isinstance(model, MeanPooledBertForSequenceClassification)
    ids = torch.tensor([[101, 2307, 3185, 102, 0], [101, 2919, 102, 0, 0]])
    mask = (ids != 0).long()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=torch.tensor([1, 0]))
        hidden = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state
        mean = (hidden * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True)
        pooler = model.bert.pooler
        assert pooler is not None
        expected = model.classifier(torch.tanh(pooler.dense(mean)))
    torch.testing.assert_close(out.logits, expected)
    torch.testing.assert_close(out.loss, torch.nn.functional.cross_entropy(expected, torch.tensor([1, 0])))
    # padding does not change a row's logits
    with torch.no_grad():
        short = model(input_ids=ids[1:, :3], attention_mask=mask[1:, :3]).logits
    torch.testing.assert_close(short, out.logits[1:], atol=1e-5, rtol=1e-5)


def test_both_poolings_have_the_layout_parameters() -> None:
    names = depth_layout(TINY, 3).names()
    for pooling in ("mean", "cls"):
        spec = TransformerSpec(source="tiny", pooling=pooling)
        model = build_model(spec, 3, pretrained=False)
        assert [n for n, _ in model.named_parameters()] == names
    assert classifier_class(TransformerSpec(pooling="cls")) is BertForSequenceClassification


def test_pretrained_mean_pooled_model_loads_every_checkpoint_tensor() -> None:
    model = build_model(TransformerSpec(), 2, pretrained=True)
    cls_model = build_model(TransformerSpec(pooling="cls"), 2, pretrained=True)
    a, b = model.state_dict(), cls_model.state_dict()
    for name, t in a.items():
        if not name.startswith("classifier."):
            assert torch.equal(t, b[name]), name


def test_pooling_config_key() -> None:
    assert RunConfig.from_flower({}).transformer_spec().pooling == "mean"
    assert RunConfig.from_flower({"pooling": "cls"}).transformer_spec().pooling == "cls"
    with pytest.raises(ValueError, match="pooling"):
        RunConfig.from_flower({"pooling": "max"})
    with pytest.raises(ValueError, match="pooling"):
        classifier_class(TransformerSpec(pooling="max"))
