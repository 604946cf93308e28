"""bench.cut_probe: the linear probe's optimum, the width cut's weights, the per-depth features."""

from __future__ import annotations

import pytest
import torch

from bench.cut_probe import fit_linear_probe, layer_features, main, pool, width_cut_model
from models.data import text_inputs
from models.transformer import (
    TransformerSpec,
    bert_width_rules,
    build_model,
    load_tokenizer,
    masked_mean,
)
from strategies.heterofl import WidthRules, extract_submodel

TINY = TransformerSpec(source="tiny", num_labels=2)


def test_probe_is_the_regularized_optimum() -> None:
    """At the returned (W, b): mean_i (p_i - e_{y_i}) z_i^T + l2 W = 0 and mean_i (p_i - e_{y_i}) = 0."""
    torch.manual_seed(0)
    x = torch.randn(40, 3, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * torch.randn(40, dtype=torch.float64) > 0).long()
    probe = fit_linear_probe(x, y, num_classes=2, l2=0.1)
    z = (x - probe.mean) / probe.std
    residual = torch.softmax(z @ probe.weight.T + probe.bias, dim=1) - torch.nn.functional.one_hot(y, 2)
    assert torch.allclose(
        residual.T @ z / len(y) + 0.1 * probe.weight, torch.zeros(2, 3, dtype=torch.float64), atol=1e-6
    )
    assert torch.allclose(residual.mean(dim=0), torch.zeros(2, dtype=torch.float64), atol=1e-6)


def test_probe_separates_separable_points() -> None:
    x = torch.tensor([[-2.0], [-1.0], [1.0], [2.0]])
    y = torch.tensor([0, 0, 1, 1])
    probe = fit_linear_probe(x, y, num_classes=2, l2=1e-3)
    assert probe.predict(x.to(torch.float64)).tolist() == [0, 0, 1, 1]


def test_pool_reads_the_mean_or_the_first_token() -> None:
    hidden = torch.arange(12.0).reshape(1, 3, 4)
    mask = torch.tensor([[1, 1, 0]])
    assert torch.equal(pool(hidden, mask, "mean"), torch.tensor([[2.0, 3.0, 4.0, 5.0]]))
    assert torch.equal(pool(hidden, mask, "cls"), hidden[:, 0])
    with pytest.raises(ValueError, match="pooling"):
        pool(hidden, mask, "max")


def test_width_cut_holds_heterofls_leading_slices() -> None:
    torch.manual_seed(1)
    full = build_model(TINY, 6, pretrained=True)
    cut = width_cut_model(TINY, full, 0.5)
    names = [k for k, _ in full.named_parameters()]
    expected = extract_submodel(dict(full.named_parameters()), WidthRules(axes=bert_width_rules(names)), 0.5)
    got = dict(cut.named_parameters())
    assert set(got) == set(expected)
    for name, t in expected.items():
        assert torch.equal(got[name], t), name


def test_layer_features_end_with_the_models_own_pooled_state() -> None:
    torch.manual_seed(2)
    model = build_model(TINY, 6, pretrained=True)
    inputs = text_inputs(["a fine film", "dull and long , badly acted"], load_tokenizer("tiny"), max_length=16)
    feats = layer_features(model, inputs, pooling="mean", batch_size=1)
    assert len(feats) == 7 and all(f.shape == (2, 32) for f in feats)
    with torch.no_grad():
        last = model.base_model(**inputs).last_hidden_state
    assert torch.allclose(feats[-1], masked_mean(last, inputs["attention_mask"]), atol=1e-6)


def test_main_prints_one_row_per_cut(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--source", "tiny", "--train", "64", "--rates", "0.25"]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| width")]
    assert rows[0].startswith("| width 1 (depth cuts) |")
    assert any(r.startswith("| width 0.250 |") for r in rows)
    assert all(len(r.strip("|").split("|")) == 1 + 7 for r in rows)
