"""DepthFL's multi-exit models (conv net, ResNet, transformer): prefix states, exits, ensemble, sBN, catalogs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from models.cnn import ConvNet, PreResNet, recompute_bn_statistics
from models.exit_heads import BottleneckExit, conv_exit
from models.exits import (
    ExitBert,
    ExitConvNet,
    ExitFamily,
    ExitHead,
    ExitPreResNet,
    ExitsError,
    ensemble_logits,
    evaluate_exits,
    exit_bert_catalog,
    exit_bert_initial_state,
    exit_bert_layout,
    exit_conv_catalog,
    exit_conv_layout,
    exit_conv_place,
    exit_preresnet_place,
    exits_logits_and_loss,
)
from models.family import CNNFamily, ModelFamily, TransformerFamily
from models.training import evaluate_classifier
from models.transformer import WORD_EMBEDDINGS, TransformerSpec, build_model, masked_mean

BASE = (2, 4, 8)


def shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def test_a_shallower_model_is_a_prefix_of_the_deepest_and_keeps_the_conv_nets_block_names() -> None:
    deepest = shapes(ExitConvNet(3, in_channels=1, num_classes=5, base=BASE))
    for depth in (1, 2):
        sub = shapes(ExitConvNet(depth, in_channels=1, num_classes=5, base=BASE))
        assert all(deepest[k] == s for k, s in sub.items())
        assert {k.split(".")[1] for k in sub} == {str(i) for i in range(depth)}
    conv = {k: s for k, s in shapes(ConvNet(1.0, in_channels=1, num_classes=5, base=BASE)).items() if "blocks" in k}
    assert conv == {k: s for k, s in deepest.items() if k.startswith("blocks.")}
    assert deepest["exits.1.weight"] == (5, 4)


def test_the_prediction_is_the_mean_of_every_exits_logits() -> None:
    torch.manual_seed(0)
    model = ExitConvNet(3, in_channels=1, num_classes=5, base=BASE).eval()
    x = torch.randn(2, 1, 8, 8)
    exits = model.exit_logits(x)
    assert [tuple(z.shape) for z in exits] == [(2, 5)] * 3
    torch.testing.assert_close(model(x), ensemble_logits(exits))


class _Examples(Dataset[dict[str, torch.Tensor]]):
    """Given examples, one per index."""

    def __init__(self, rows: list[dict[str, torch.Tensor]]) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self.rows[index]


class _FixedExits(ExitConvNet):
    """Two exits whose logits are given per example: exit 1 right on examples 0, 1, 3, exit 2 on 0 and 2."""

    def __init__(self) -> None:
        super().__init__(2, in_channels=1, num_classes=2, base=(2, 2))

    def exit_logits(self, x: torch.Tensor) -> list[torch.Tensor]:
        i = x.flatten(1)[:, 0].long()  # the example's index
        z1 = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [0.0, 1.0]])[i]
        z2 = torch.tensor([[4.0, 0.0], [3.0, 0.0], [0.0, 4.0], [1.0, 0.0]])[i]
        return [z1, z2]


def test_each_exit_is_scored_alone_and_the_ensemble_as_the_model_predicts() -> None:
    """Labels 0, 1, 1, 1; the ensemble (z1 + z2) / 2 = [3,0], [1.5,1], [1,2], [0.5,0.5] is right on 0 and 2."""
    x = torch.arange(4.0).view(4, 1, 1, 1)
    examples = _Examples([{"x": x[i], "labels": torch.tensor(y)} for i, y in enumerate((0, 1, 1, 1))])
    loader: DataLoader[dict[str, torch.Tensor]] = DataLoader(examples, batch_size=3)
    model = _FixedExits()
    result = evaluate_exits(model, loader)
    assert result.examples == 4 and result.exit_accuracies == (0.75, 0.5) and result.accuracy == 0.5
    loss, accuracy, count = evaluate_classifier(model, loader)  # the ensemble is the model's prediction
    assert (accuracy, count) == (result.accuracy, 4) and result.loss == pytest.approx(loss)
    expected = torch.nn.functional.cross_entropy(
        torch.tensor([[3.0, 0.0], [1.5, 1.0], [1.0, 2.0], [0.5, 0.5]]), torch.tensor([0, 1, 1, 1])
    )
    assert result.loss == pytest.approx(float(expected))
    assert result.metrics() == {
        "loss": result.loss, "accuracy": 0.5, "exit-1-accuracy": 0.75, "exit-2-accuracy": 0.5
    }  # fmt: skip


def test_static_batch_norm_statistics_are_recomputed_as_for_the_conv_net() -> None:
    torch.manual_seed(0)
    model = ExitConvNet(2, in_channels=1, num_classes=3, base=BASE)
    batches = [{"x": torch.randn(4, 1, 8, 8)} for _ in range(2)]
    evaluated = recompute_bn_statistics(model, batches, input_key="x")
    assert isinstance(evaluated, ExitConvNet)
    norms = [m for m in evaluated.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert len(norms) == 2 and all(n.track_running_stats and n.running_mean is not None for n in norms)
    assert tuple(evaluated(torch.randn(3, 1, 8, 8)).shape) == (3, 3)


def test_the_layout_places_block_i_as_shared_and_exit_i_as_a_head_both_at_layer_i() -> None:
    layout = exit_conv_layout(2, in_channels=1, num_classes=3, base=BASE)
    placed = {p.name: (p.layer, p.role) for p in layout}
    assert placed["blocks.1.conv.weight"] == (1, "shared")
    assert placed["exits.0.bias"] == (0, "head")
    with pytest.raises(ExitsError, match="not a tensor"):
        exit_conv_place("classifier.weight")


def test_the_catalog_estimates_activations_of_a_variants_own_blocks() -> None:
    # base (2, 4, 8), 8x8 images, batch 1: conv outputs 2x8x8, 4x4x4, 8x2x2 -> 128, 64, 32 elements
    catalog = exit_conv_catalog(
        [("weak", 1), ("strong", 3)], in_channels=1, num_classes=3, image_size=8, batch_size=1, base=BASE
    )
    weak, strong = catalog.variants
    assert (weak.depth, strong.depth, weak.extra["exits"]) == (1, 3, 1)
    assert weak.memory.activations == 4 * 4 * 128  # 4 bytes x 4 floats per conv output element
    assert strong.memory.activations == 4 * 4 * (128 + 64 + 32)
    assert weak.memory.parameters == 4 * weak.layout.num_params()


@pytest.mark.parametrize("depths", [[("a", 2), ("b", 1)], [("a", 0)], [("a", 4)], []])
def test_depths_out_of_order_or_range_are_refused(depths: list[tuple[str, int]]) -> None:
    with pytest.raises(ExitsError, match="strictly increasing"):
        exit_conv_catalog(depths, in_channels=1, num_classes=3, image_size=8, batch_size=1, base=BASE)


def test_a_depth_beyond_the_conv_nets_blocks_is_refused() -> None:
    with pytest.raises(ExitsError, match=r"depth must be in 1 \.\. 3"):
        ExitConvNet(4, in_channels=1, num_classes=3, base=BASE)


# --- the multi-exit pre-activation ResNet-18 ---------------------------------------------------

PBASE = (2, 4, 4, 8)  # one width per stage


def test_a_shallower_resnet_is_a_prefix_of_the_deepest_and_keeps_the_resnets_names() -> None:
    deepest = shapes(ExitPreResNet(4, in_channels=1, num_classes=5, base=PBASE))
    resnet = shapes(PreResNet(1.0, in_channels=1, num_classes=5, base=PBASE))
    assert {k: s for k, s in deepest.items() if not k.startswith("exits.")} == {
        k: s for k, s in resnet.items() if k.startswith(("stem.", "stages."))
    }
    for depth in (1, 2, 3):
        sub = shapes(ExitPreResNet(depth, in_channels=1, num_classes=5, base=PBASE))
        assert all(deepest[k] == s for k, s in sub.items())
        assert {k.split(".")[1] for k in sub if k.startswith(("stages.", "exits."))} == {str(i) for i in range(depth)}
    assert deepest["exits.1.linear.weight"] == (5, 4) and deepest["exits.1.norm.weight"] == (4,)


def test_the_deepest_resnet_exit_is_the_full_resnets_head() -> None:
    torch.manual_seed(0)
    resnet = PreResNet(1.0, in_channels=1, num_classes=5, base=PBASE)
    exits = ExitPreResNet(4, in_channels=1, num_classes=5, base=PBASE)
    state = resnet.state_dict()
    renamed = {"norm.": "exits.3.norm.", "classifier.": "exits.3.linear."}
    mapped = {
        next((new + k[len(old) :] for old, new in renamed.items() if k.startswith(old)), k): v for k, v in state.items()
    }
    missing, unexpected = exits.load_state_dict(mapped, strict=False)
    assert not unexpected and all(k.startswith(("exits.0.", "exits.1.", "exits.2.")) for k in missing)
    x = torch.randn(3, 1, 8, 8)
    logits = exits.exit_logits(x)
    assert [tuple(z.shape) for z in logits] == [(3, 5)] * 4
    torch.testing.assert_close(logits[-1], resnet(x))
    torch.testing.assert_close(exits(x), ensemble_logits(logits))


def test_the_resnet_layout_places_the_stem_at_layer_0_and_stage_and_exit_s_at_layer_s() -> None:
    layout = exit_conv_layout(2, in_channels=1, num_classes=3, base=PBASE, model_name="preresnet18")
    placed = {p.name: (p.layer, p.role) for p in layout}
    assert placed["stem.weight"] == (0, "shared")
    assert placed["stages.1.0.shortcut.weight"] == (1, "shared")
    assert placed["exits.1.linear.bias"] == (1, "head") and placed["exits.0.norm.weight"] == (0, "head")
    with pytest.raises(ExitsError, match="not a tensor"):
        exit_preresnet_place("classifier.weight")


def test_the_resnet_catalog_estimates_activations_of_a_variants_own_stages() -> None:
    # 8x8 images, batch 1, widths (2, 4, 4, 8): the stem and stage 0's four convs at 2x8x8 = 128
    # elements each; stage 1 (five convs with the projection) at 4x4x4 = 64, stage 2 at 4x2x2 = 16,
    # stage 3 at 8x1x1 = 8
    catalog = exit_conv_catalog(
        [("weak", 1), ("strong", 4)], in_channels=1, num_classes=3, image_size=8, batch_size=1, base=PBASE,
        model_name="preresnet18",
    )  # fmt: skip
    weak, strong = catalog.variants
    assert catalog.family == "exits:preresnet18" and (weak.depth, strong.depth) == (1, 4)
    assert weak.memory.activations == 4 * 4 * (5 * 128)
    assert strong.memory.activations == 4 * 4 * (5 * 128 + 5 * 64 + 5 * 16 + 5 * 8)


def test_the_resnet_trains_every_stage_and_exit_on_the_self_distillation_loss() -> None:
    torch.manual_seed(0)
    model = ExitPreResNet(2, in_channels=1, num_classes=3, base=PBASE)
    batch = {"x": torch.randn(4, 1, 8, 8), "labels": torch.tensor([0, 1, 2, 0])}
    logits, loss = exits_logits_and_loss(model, batch, weight=0.5)
    loss.backward()
    assert tuple(logits.shape) == (4, 3)
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in model.parameters())


def test_a_resnet_depth_beyond_its_stages_is_refused() -> None:
    with pytest.raises(ExitsError, match=r"depth must be in 1 \.\. 4"):
        ExitPreResNet(5, in_channels=1, num_classes=3, base=PBASE)
    with pytest.raises(ExitsError, match="4 stages"):
        ExitPreResNet(1, in_channels=1, num_classes=3, base=BASE)


# --- the multi-exit transformer ---------------------------------------------------------------

TINY = TransformerSpec(source="tiny", num_labels=3)


def batch_of(n: int = 2, length: int = 5) -> dict[str, torch.Tensor]:
    ids = torch.randint(5, 100, (n, length))
    mask = torch.ones(n, length, dtype=torch.long)
    mask[0, -2:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def test_a_shallower_transformer_is_a_prefix_with_the_classifiers_encoder_names() -> None:
    deepest = {k: tuple(v.shape) for k, v in ExitBert(TINY, 3).named_parameters()}
    shallow = {k: tuple(v.shape) for k, v in ExitBert(TINY, 2).named_parameters()}
    assert all(deepest[k] == s for k, s in shallow.items())
    encoder = {k for k in dict(build_model(TINY, 2, pretrained=False).named_parameters()) if k.startswith("bert.e")}
    assert encoder == {k for k in shallow if k.startswith("bert.")}
    assert {k for k in shallow if k.startswith("exits.1.")} == {
        "exits.1.pooler.dense.weight",
        "exits.1.pooler.dense.bias",
        "exits.1.classifier.weight",
        "exits.1.classifier.bias",
    }


def test_each_transformer_exit_reads_its_own_layer_and_the_prediction_is_their_mean() -> None:
    torch.manual_seed(0)
    model = ExitBert(TINY, 3).eval()
    batch = batch_of()
    exits = model.exit_logits(**batch)
    assert [tuple(z.shape) for z in exits] == [(2, 3)] * 3
    torch.testing.assert_close(model(**batch), ensemble_logits(exits))
    hidden = model.bert(**batch, output_hidden_states=True).hidden_states
    head = model.exits[1]
    assert isinstance(head, ExitHead)
    torch.testing.assert_close(exits[1], head(masked_mean(hidden[2], batch["attention_mask"])))


def test_the_word_embeddings_stay_frozen_and_out_of_the_trainable_layout() -> None:
    model = ExitBert(TINY, 1)
    assert not model.bert.embeddings.word_embeddings.weight.requires_grad
    layout = exit_bert_layout(TINY, 2)
    placed = {p.name: (p.layer, p.role, p.trainable) for p in layout}
    assert placed[WORD_EMBEDDINGS] == (0, "shared", False)
    assert placed["bert.encoder.layer.1.output.dense.weight"] == (2, "shared", True)
    assert placed["exits.1.classifier.weight"] == (2, "head", True)
    assert list(layout.names()) == [k for k, _ in ExitBert(TINY, 2).named_parameters()]


def test_the_initial_state_takes_the_checkpoints_encoder_and_pooler_for_every_exit() -> None:
    spec = TransformerSpec(num_labels=2)  # the embedded MiniLM-L6
    state = exit_bert_initial_state(spec, 2, seed=0)
    pretrained = dict(build_model(spec, 2, pretrained=True).named_parameters())
    for name in ("bert.embeddings.word_embeddings.weight", "bert.encoder.layer.1.output.dense.weight"):
        torch.testing.assert_close(state[name], pretrained[name].detach())
    for i in (0, 1):
        torch.testing.assert_close(state[f"exits.{i}.pooler.dense.weight"], pretrained["bert.pooler.dense.weight"])
    again = exit_bert_initial_state(spec, 2, seed=0)
    torch.testing.assert_close(state["exits.1.classifier.weight"], again["exits.1.classifier.weight"])
    assert list(state) == exit_bert_layout(spec, 2).names()


def test_the_transformer_catalog_counts_each_variants_exits() -> None:
    catalog = exit_bert_catalog(TINY, [("weak", 1), ("strong", 3)], batch_size=4, seq_len=16, optimizer="adamw")
    weak, strong = catalog.variants
    assert (weak.depth, strong.depth, strong.extra["exits"]) == (1, 3, 3)
    assert strong.memory.total > weak.memory.total
    assert strong.layout.num_params() > weak.layout.num_params()
    with pytest.raises(ExitsError, match="strictly increasing"):
        exit_bert_catalog(TINY, [("a", 2), ("b", 2)], batch_size=4, seq_len=16, optimizer="adamw")


# --- the family -------------------------------------------------------------------------------

CONV_FAMILY = CNNFamily(name="conv", base=BASE, in_channels=1, num_classes=3)


@pytest.mark.parametrize(
    "family",
    [
        ExitFamily(CONV_FAMILY),
        ExitFamily(CNNFamily(name="preresnet18", base=PBASE, in_channels=1, num_classes=3)),
        ExitFamily(TransformerFamily(TINY)),
    ],
    ids=["conv", "preresnet18", "transformer"],
)
def test_every_variant_starts_from_a_prefix_of_one_deepest_model(family: ExitFamily) -> None:
    as_family: ModelFamily = family  # the protocol the apps use
    catalog = family.catalog([("weak", 1), ("strong", 3)], batch_size=2, optimizer="sgd", seq_len=8, image_size=8)
    states = as_family.initial_states(catalog, seed=3)
    weak, strong = states["weak"], states["strong"]
    assert list(weak) == catalog.get("weak").layout.names()
    assert all(torch.equal(t, strong[k]) for k, t in weak.items())
    model = as_family.build(catalog.get("weak"))
    model.load_state_dict(weak, strict=False)
    assert isinstance(model, ExitBert | ExitConvNet | ExitPreResNet) and model.exits is not None
    again = family.initial_states(catalog, seed=3)["strong"]
    assert all(torch.equal(t, again[k]) for k, t in strong.items())


class OneBatch(Dataset[dict[str, torch.Tensor]]):
    """One batch of four 8x8 images, as a loader of training batches yields it."""

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": torch.randn(4, 1, 8, 8), "labels": torch.zeros(4, dtype=torch.long)}


def test_the_conv_family_evaluates_with_static_batch_norm_statistics_and_has_no_widths() -> None:
    family = ExitFamily(CONV_FAMILY)
    assert family.uses_statistics and family.data_kind == "image"
    model = family.at_depth(2)
    stats: DataLoader[dict[str, torch.Tensor]] = DataLoader(OneBatch(), batch_size=None)
    evaluated = family.for_evaluation(model, stats)
    assert evaluated is not model and not evaluated.training
    catalog = family.catalog([("a", 1)], batch_size=2, optimizer="sgd", seq_len=8, image_size=8)
    with pytest.raises(ExitsError, match="no width groups"):
        family.width_rules(catalog)


def test_a_bottleneck_exit_brings_its_block_to_the_last_blocks_channels_with_exact_parameter_counts() -> None:
    # exit 0 of widths (2, 4, 8): step 1 = SepConv(2 -> 4, stride 2): depthwise 2*9, pointwise 2*2, BN 2*2,
    # depthwise 2*9, pointwise 2*4, BN 2*4 = 60; step 2 = SepConv(4 -> 8, stride 1): 36 + 16 + 8 + 36 + 32 + 16
    # = 144; linear 8*3 + 3 = 27.  The last exit is the linear layer alone.
    def count(module: torch.nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    assert [count(BottleneckExit(i, base=BASE, num_classes=3)) for i in range(3)] == [60 + 144 + 27, 144 + 27, 27]
    first = BottleneckExit(0, base=(4, 8, 16, 32), num_classes=10)
    h = torch.randn(2, 4, 14, 14)  # block 0's output of a 28x28 image (pooled once)
    assert tuple(first.steps(h).shape) == (2, 32, 4, 4)  # stride 2 where the conv net pools, 1 at the last block
    assert tuple(first(h).shape) == (2, 10)


def test_bottleneck_exits_keep_a_shallower_model_a_prefix_of_the_deepest() -> None:
    deepest = shapes(ExitConvNet(3, in_channels=1, num_classes=5, base=BASE, exit_head="bottleneck"))
    for depth in (1, 2):
        sub = shapes(ExitConvNet(depth, in_channels=1, num_classes=5, base=BASE, exit_head="bottleneck"))
        assert all(deepest[k] == s for k, s in sub.items())
    assert deepest["exits.0.linear.weight"] == deepest["exits.2.linear.weight"] == (5, 8)
    assert not any(k.startswith("exits.2.steps") for k in deepest)
    model = ExitConvNet(3, in_channels=1, num_classes=5, base=BASE, exit_head="bottleneck")
    logits = model.exit_logits(torch.randn(4, 1, 28, 28))
    assert [tuple(z.shape) for z in logits] == [(4, 5)] * 3
    assert exit_conv_place("exits.0.steps.1.op.3.weight") == (0, "head")


def test_bottleneck_exits_are_the_conv_nets_only() -> None:
    cnn = CNNFamily(name="preresnet18", base=(2, 4, 8, 16), in_channels=1, num_classes=3)
    with pytest.raises(ExitsError, match="'bottleneck' is the 'conv' net's"):
        ExitFamily(cnn, exit_head="bottleneck")
    with pytest.raises(ValueError, match="exit head must be one of"):
        conv_exit("deep", 0, base=BASE, num_classes=3)  # type: ignore[arg-type]


def test_only_heterofls_cnns_or_a_transformer_are_cut_into_exits() -> None:
    with pytest.raises(ExitsError, match="not 'vgg'"):
        ExitFamily(CNNFamily(name="vgg", base=BASE, in_channels=1, num_classes=3))
