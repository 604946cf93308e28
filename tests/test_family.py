"""Model families behind the apps: CNN variants cut from one model, sBN evaluation, shared training loop."""

from __future__ import annotations

import copy

import pytest
import torch

from experiment.config import RunConfig
from models.cnn import ConvNet
from models.data import DataSpec, load_partition
from models.family import CNNFamily, TransformerFamily, with_memory_format
from models.training import TrainSettings, evaluate_classifier, logits_and_loss, train_classifier
from strategies.flexifed import architecture_plan, check_layers
from strategies.heterofl import WidthRules, extract_submodel

CNN = {
    "model": "conv",
    "method": "heterofl",
    "num-labels": 10,
    "cnn-widths": "8:16:32:64",
    "dataset": "embedded:fashion_mnist",
}


@pytest.mark.parametrize("model", ["conv", "preresnet18"])
def test_cnn_variants_are_slices_of_the_initial_full_model(model: str) -> None:
    cfg = RunConfig.from_flower({**CNN, "model": model})
    family = cfg.family()
    assert isinstance(family, CNNFamily) and family.base == (8, 16, 32, 64)
    assert cfg.width_rates == [0.25, 0.5, 1.0]
    init = family.initial_states(cfg.catalog, seed=3)
    assert list(init) == ["strong"]
    full = init["strong"]
    assert list(full) == cfg.catalog.largest.layout.names()
    rules = WidthRules(axes=family.width_rules(cfg.catalog))
    for variant in cfg.catalog:
        sub = extract_submodel(full, rules, float(variant.extra["rate"]))
        model_ = family.build(variant)
        model_.load_state_dict(sub)  # strict: every tensor present with the built shape
        assert {k: tuple(v.shape) for k, v in sub.items()} == {p.name: p.shape for p in variant.layout}


def test_sbn_evaluation_needs_training_batches_and_sets_statistics() -> None:
    cfg = RunConfig.from_flower(CNN)
    family = cfg.family()
    model = family.build(cfg.catalog.get("medium"))
    spec = cfg.data_spec()
    train, _ = load_partition(spec, 0, 50)
    loader = family.loader(train, batch_size=32, shuffle=True)
    with pytest.raises(ValueError, match="static batch norm needs training batches"):
        family.for_evaluation(model, None)
    evaluated = family.for_evaluation(model, loader)
    assert isinstance(evaluated, ConvNet) and isinstance(model, ConvNet)
    norm = evaluated.conv_blocks()[0].norm
    assert not evaluated.training and norm.track_running_stats
    assert norm.running_mean is not None and norm.running_var is not None
    assert norm.running_mean.abs().sum() > 0 and not torch.allclose(norm.running_var, torch.ones_like(norm.running_var))
    assert model.conv_blocks()[0].norm.running_mean is None  # the original is untouched


@pytest.mark.parametrize("model", ["conv", "preresnet18"])
def test_sbn_evaluation_copy_is_channels_last_and_predicts_as_the_default_layout(model: str) -> None:
    cfg = RunConfig.from_flower({**CNN, "model": model})
    family = cfg.family()
    torch.manual_seed(0)
    trained = family.build(cfg.catalog.largest)
    g = torch.Generator().manual_seed(1)
    stats = [{"x": torch.randn(16, 1, 28, 28, generator=g)} for _ in range(3)]
    evaluated = family.for_evaluation(trained, stats)  # type: ignore[arg-type]
    kernels = [p for p in evaluated.parameters() if p.dim() == 4]
    assert kernels and all(k.is_contiguous(memory_format=torch.channels_last) for k in kernels)
    assert all(p.is_contiguous() for p in trained.parameters())  # the trained model keeps its layout
    default = with_memory_format(copy.deepcopy(evaluated), torch.contiguous_format)
    x = torch.randn(64, 1, 28, 28, generator=g)
    with torch.no_grad():
        fast, ref = evaluated(x=x), default(x=x)
    torch.testing.assert_close(fast, ref, rtol=0, atol=1e-4)
    assert torch.equal(fast.argmax(-1), ref.argmax(-1))


def test_cnn_local_training_lowers_the_loss_on_fashion_mnist() -> None:
    cfg = RunConfig.from_flower(CNN)
    family = cfg.family()
    train, _ = load_partition(DataSpec(dataset="embedded:fashion_mnist", kind="image"), 0, 200)
    loader = family.loader(train, batch_size=32, shuffle=True, seed=0)
    torch.manual_seed(0)
    model = family.build(cfg.catalog.largest)
    before, _, n = evaluate_classifier(family.for_evaluation(model, loader), loader)
    train_classifier(model, loader, TrainSettings(optimizer="sgd", lr=0.05, local_steps=40))
    after, acc, _ = evaluate_classifier(family.for_evaluation(model, loader), loader)
    assert n == len(train) and after < 0.7 * before and acc > 0.5


def test_transformer_loss_is_the_models_own_cross_entropy() -> None:
    cfg = RunConfig(model="tiny")
    family = cfg.family()
    assert isinstance(family, TransformerFamily)
    train, _ = load_partition(cfg.data_spec(), 0, 100)
    batch = next(iter(family.loader(train, batch_size=8, shuffle=False)))
    model = family.build(cfg.catalog.get("weak")).eval()
    logits, loss = logits_and_loss(model, batch)
    torch.testing.assert_close(loss, model(**batch).loss)
    assert logits.shape == (8, 2)


def test_depth_variants_as_flexifed_layers_give_inclusivefl_sharing() -> None:
    """Max-Common over depth variants averages encoder layer l over every client with >= l layers."""
    cfg = RunConfig(model="tiny")
    family = cfg.family()
    assert isinstance(family, TransformerFamily)
    layers = family.layers(cfg.catalog)
    check_layers(cfg.catalog, layers)  # every trainable tensor in exactly one layer
    assert [layer.signature.kind for layer in layers["weak"]] == ["embeddings", "encoder", "encoder", "classifier"]
    assert all("word_embeddings" not in n for ls in layers.values() for layer in ls for n in layer.names)  # frozen
    signatures = {a: [layer.signature for layer in ls] for a, ls in layers.items()}
    plan = architecture_plan(signatures, set(signatures), mode="max")
    sharing = [sorted({a for a, _ in group}) if group else [] for group in plan["strong"]]
    everyone, deeper = ["medium", "strong", "weak"], ["medium", "strong"]
    assert sharing == [everyone, everyone, everyone, deeper, deeper, ["strong"], ["strong"], ["strong"]]


@pytest.mark.parametrize(
    ("settings", "family_type", "needs"),
    [
        ({"model": "tiny"}, "TransformerFamily", False),
        (CNN, "CNNFamily", True),
        (
            {**CNN, "model": "vgg", "method": "flexifed-max", "tiers": "vgg11:vgg13", "tier-proportions": "1:1",
             "tier-memory-mb": "auto", "arch-width": 0.125},
            "ArchitectureFamily",
            True,
        ),
        (
            {**CNN, "model": "codist-cnn", "method": "codist-merged", "tiers": "small:large",
             "tier-proportions": "1:1", "tier-memory-mb": "auto"},
            "CodistFamily",
            False,
        ),
    ],
)  # fmt: skip
def test_uses_statistics_says_whether_evaluation_needs_training_batches(
    settings: dict[str, object], family_type: str, needs: bool
) -> None:
    """The ClientApp builds a node's training batches for ``evaluate`` only when this says so."""
    cfg = RunConfig.from_flower(settings)
    family = cfg.family()
    assert type(family).__name__ == family_type and family.uses_statistics is needs
    model = family.build(cfg.catalog.largest)
    if needs:
        with pytest.raises(ValueError, match="training batches"):
            family.for_evaluation(model, None)
    else:
        assert family.for_evaluation(model, None) is model
