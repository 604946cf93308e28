"""Co-distillation math on tiny tensors: merged gradient, KL target, decay, distillation, the CNN pair."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from datasets import Array2D, Dataset, Features, Value
from torch import nn

from models.codist import (
    CODIST_SIZES,
    CodistFamily,
    CodistSize,
    build_codist_cnn,
    codist_catalog,
    codist_layout,
    parse_size_label,
    size_label,
    unlabeled_image_crops,
    unlabeled_images,
)
from strategies.codistill import (
    CodistConfigError,
    DistillConfig,
    global_norm,
    linear_decay,
    merged_update,
    parse_mode,
)
from strategies.distillation import (
    DistillationConfigError,
    DistillationError,
    distill,
    distillation_loss,
    distillation_target,
    sample_batches,
)

# --- merged gradient (Algorithm 2, eq. 2) ------------------------------------------------------


def g_and_delta() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    g = {"a": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])}  # ||g|| = 5
    delta = {"a": torch.tensor([0.0, 1.0]), "b": torch.tensor([0.0]), "frozen": torch.tensor([9.0])}  # ||delta|| = 1
    return g, delta


def test_merged_update_rescales_the_distillation_gradient_to_the_fedavg_norm() -> None:
    g, delta = g_and_delta()
    out = merged_update(g, delta, 0.5)
    # 0.5 * g + 0.5 * delta * 5 / 1; keys are g's ("frozen" ignored)
    assert set(out) == {"a", "b"}
    torch.testing.assert_close(out["a"], torch.tensor([1.5, 2.5]))
    torch.testing.assert_close(out["b"], torch.tensor([2.0]))


def test_merged_update_limits() -> None:
    g, delta = g_and_delta()
    fedavg = merged_update(g, delta, 1.0)
    assert all(torch.equal(fedavg[k], g[k]) for k in g)  # alpha = 1: FedAvg, bit for bit
    pure = merged_update(g, delta, 0.0)  # alpha = 0: the distillation direction at the FedAvg norm
    torch.testing.assert_close(pure["a"], torch.tensor([0.0, 5.0]))
    torch.testing.assert_close(pure["b"], torch.tensor([0.0]))
    assert global_norm(pure) == pytest.approx(global_norm(g))


def test_merged_update_zero_norms_and_sign_symmetry() -> None:
    g, delta = g_and_delta()
    zero_delta = {k: torch.zeros_like(v) for k, v in delta.items()}
    out = merged_update(g, zero_delta, 0.25)  # student did not move: Delta = alpha g
    torch.testing.assert_close(out["a"], 0.25 * g["a"])
    zero_g = {k: torch.zeros_like(v) for k, v in g.items()}
    out = merged_update(zero_g, delta, 0.25)  # no client movement: no rescaled distillation either
    assert all(torch.count_nonzero(v) == 0 for v in out.values())
    # odd in (g, delta): the paper's descent convention and ours give opposite Deltas
    neg = merged_update({k: -v for k, v in g.items()}, {k: -v for k, v in delta.items()}, 0.3)
    pos = merged_update(g, delta, 0.3)
    for k in pos:
        torch.testing.assert_close(neg[k], -pos[k])


def test_merged_update_rejects_bad_input() -> None:
    g, delta = g_and_delta()
    with pytest.raises(CodistConfigError, match="alpha"):
        merged_update(g, delta, 1.5)
    with pytest.raises(CodistConfigError, match="lacks"):
        merged_update(g, {"a": delta["a"]}, 0.5)


# --- distillation target and loss --------------------------------------------------------------

LN3 = math.log(3.0)


def test_target_interpolates_teacher_and_student_start() -> None:
    z_teacher = torch.tensor([[0.0, 2 * LN3]])  # at T = 2: softmax([0, ln 3]) = [1/4, 3/4]
    z_start = torch.tensor([[0.0, 0.0]])  # [1/2, 1/2]
    torch.testing.assert_close(distillation_target(z_teacher, z_start, 2.0, 0.0), torch.tensor([[0.25, 0.75]]))
    torch.testing.assert_close(distillation_target(z_teacher, z_start, 2.0, 1.0), torch.tensor([[0.5, 0.5]]))
    # 0.8 * [0.25, 0.75] + 0.2 * [0.5, 0.5]
    torch.testing.assert_close(distillation_target(z_teacher, z_start, 2.0, 0.2), torch.tensor([[0.3, 0.7]]))
    # several teachers: the mean of their tempered softmaxes ([1/4, 3/4] and [3/4, 1/4])
    both = distillation_target([z_teacher, z_teacher.flip(-1)], z_start, 2.0, 0.0)
    torch.testing.assert_close(both, torch.tensor([[0.5, 0.5]]))
    with pytest.raises(DistillationConfigError):
        distillation_target(z_teacher, z_start, 0.0, 0.1)
    with pytest.raises(DistillationConfigError):
        distillation_target(z_teacher, z_start, 1.0, -0.1)


def test_loss_is_kl_of_target_to_tempered_student() -> None:
    target = torch.tensor([[0.5, 0.5], [1.0, 0.0]])
    z_student = torch.tensor([[0.0, LN3], [0.0, LN3]])  # softmax = [1/4, 3/4]
    want = (0.5 * math.log(0.5 / 0.25) + 0.5 * math.log(0.5 / 0.75) + 1.0 * math.log(1.0 / 0.25)) / 2
    assert float(distillation_loss(z_student, target, 1.0)) == pytest.approx(want, rel=1e-6)
    # at T = 2 the student's logits are halved
    same = torch.softmax(z_student / 2.0, dim=-1)
    assert float(distillation_loss(z_student, same, 2.0)) == pytest.approx(0.0, abs=1e-7)


# --- schedules ---------------------------------------------------------------------------------


def test_linear_decay_values() -> None:
    assert [linear_decay(0.4, t, 4) for t in (1, 2, 3, 4, 5, 9)] == pytest.approx([0.4, 0.3, 0.2, 0.1, 0.0, 0.0])
    assert linear_decay(1.0, 1, 1) == 1.0
    with pytest.raises(CodistConfigError):
        linear_decay(1.0, 0, 4)
    with pytest.raises(CodistConfigError):
        linear_decay(1.0, 1, 0)


def test_sample_batches_walks_seeded_epochs() -> None:
    x = torch.arange(10.0).reshape(10, 1)
    batches = list(sample_batches(x, steps=7, batch_size=4, seed=3))
    assert [b.shape[0] for b in batches] == [4] * 7
    # two full batches per pass; each pass draws without replacement
    for lo in range(0, 6, 2):
        seen = torch.cat(batches[lo : lo + 2]).flatten().tolist()
        assert len(set(seen)) == 8
    again = list(sample_batches(x, steps=7, batch_size=4, seed=3))
    assert all(torch.equal(a, b) for a, b in zip(batches, again, strict=True))
    assert len(list(sample_batches(x, steps=2, batch_size=50, seed=0))) == 2  # batch capped at the set


def test_distill_config_validates() -> None:
    for bad in ({"steps": -1}, {"temperature": 0.0}, {"lam": 2.0}, {"lr": -1.0}, {"batch_size": 0}):
        with pytest.raises(CodistConfigError):
            DistillConfig(**bad)  # type: ignore[arg-type]


# --- distillation ------------------------------------------------------------------------------


def kl_to_teacher(student: nn.Module, teacher: nn.Module, x: torch.Tensor, temperature: float) -> float:
    with torch.no_grad():
        return float(distillation_loss(student(x), torch.softmax(teacher(x) / temperature, dim=-1), temperature))


def test_distillation_moves_the_student_toward_the_teacher() -> None:
    torch.manual_seed(0)
    student, teacher = nn.Linear(4, 3), nn.Linear(4, 3)
    before = {k: v.clone() for k, v in student.state_dict().items()}
    x = torch.randn(64, 4)
    kl0 = kl_to_teacher(student, teacher, x, 2.0)
    out = distill(student, teacher, [x] * 50, steps=50, temperature=2.0, lam=0.0, lr=0.05)
    moved = nn.Linear(4, 3)
    moved.load_state_dict(out.state)
    assert kl_to_teacher(moved, teacher, x, 2.0) < 0.2 * kl0
    assert out.losses[-1] < out.losses[0] and len(out.losses) == 50
    assert all(torch.equal(student.state_dict()[k], v) for k, v in before.items())  # input untouched
    assert teacher.training  # mode restored


def test_student_regularization_holds_the_student_back() -> None:
    torch.manual_seed(1)
    student, teacher = nn.Linear(4, 3), nn.Linear(4, 3)
    x = torch.randn(32, 4)
    free = distill(student, teacher, [x] * 20, steps=20, temperature=1.0, lam=0.0, lr=0.05).state
    held = distill(student, teacher, [x] * 20, steps=20, temperature=1.0, lam=1.0, lr=0.05).state
    start = student.state_dict()
    # lam = 1: the target is the student's own start distribution, so it barely moves
    assert global_norm({k: held[k] - start[k] for k in start}) < 0.1 * global_norm(
        {k: free[k] - start[k] for k in start}
    )


def test_distill_edge_cases() -> None:
    student, teacher = nn.Linear(2, 2), nn.Linear(2, 2)
    same = distill(student, teacher, [], steps=0, temperature=1.0, lam=0.0, lr=0.1)
    assert all(torch.equal(student.state_dict()[k], v) for k, v in same.state.items()) and same.losses == []
    with pytest.raises(DistillationError, match="ran out after 1 of 3"):
        distill(student, teacher, [torch.randn(4, 2)], steps=3, temperature=1.0, lam=0.0, lr=0.1)
    no_lr = distill(student, teacher, [torch.randn(4, 2)] * 2, steps=2, temperature=1.0, lam=0.0, lr=0.0)
    assert all(torch.equal(student.state_dict()[k], v) for k, v in no_lr.state.items())


# --- the CNN pair ------------------------------------------------------------------------------


def formula_params(size: CodistSize, channels: int, side: int, classes: int) -> int:
    f1, f2, f3 = size.filters
    d1, d2 = size.dense
    s = (side // 2) // 2
    conv = 9 * channels * f1 + f1 + 9 * f1 * f2 + f2 + 9 * f2 * f3 + f3
    return conv + (s * s * f3 + 1) * d1 + (d1 + 1) * d2 + (d2 + 1) * classes


def test_paper_parameter_counts() -> None:
    small = build_codist_cnn("small", in_channels=3, num_classes=100, image_size=24)
    large = build_codist_cnn("large", in_channels=3, num_classes=100, image_size=24)
    assert sum(p.numel() for p in small.parameters()) == 109_348
    assert sum(p.numel() for p in large.parameters()) == 410_084
    cat = codist_catalog(in_channels=3, num_classes=100, image_size=24, batch_size=20)
    assert [v.layout.num_params() for v in cat] == [109_348, 410_084]
    assert cat.names() == ["small", "large"] and [v.extra["size"] for v in cat] == ["small", "large"]


def test_fashion_mnist_variants() -> None:
    cat = codist_catalog(in_channels=1, num_classes=10, image_size=28, batch_size=32)
    family = CodistFamily(in_channels=1, num_classes=10, image_size=28)
    for v in cat:
        want = formula_params(CODIST_SIZES[v.name], 1, 28, 10)
        assert v.layout.num_params() == want
        model = family.build(v)
        assert {k: tuple(t.shape) for k, t in model.state_dict().items()} == {p.name: p.shape for p in v.layout}
        assert model(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert [v.layout.num_params() for v in cat] == [124_074, 492_874]
    small, large = cat
    assert small.memory.total < large.memory.total
    roles = {p.name: (p.role, p.layer) for p in small.layout}
    assert roles["conv1.weight"] == ("isolated", 1) and roles["fc2.bias"] == ("isolated", 5)
    assert roles["out.weight"] == ("head", None)
    states = family.initial_states(cat, seed=0)
    assert set(states) == {"small", "large"} and set(states["small"]) == set(small.layout.names())


def test_custom_sizes_and_ordering() -> None:
    tiny = CodistSize(filters=(2, 2, 2), dense=(3, 3))
    assert parse_size_label(size_label(tiny)) == tiny
    assert codist_layout(tiny, in_channels=1, num_classes=3, image_size=8).num_params() == formula_params(tiny, 1, 8, 3)
    with pytest.raises(ValueError, match="increasing"):
        codist_catalog([("a", "large"), ("b", "small")], in_channels=1, num_classes=3, image_size=8, batch_size=4)
    with pytest.raises(ValueError):
        parse_size_label("2:2/3")
    with pytest.raises(ValueError):
        build_codist_cnn("medium", in_channels=1, num_classes=3, image_size=8)


# --- unlabeled data ----------------------------------------------------------------------------


def test_unlabeled_image_crops_are_normalized_and_seeded() -> None:
    rgb = unlabeled_image_crops(40, 24, 3, seed=0, photos=("coffee", "camera"))
    assert rgb.shape == (40, 3, 24, 24) and rgb.dtype == torch.float32
    assert float(rgb.min()) >= -1.0 and float(rgb.max()) <= 1.0 and float(rgb.std()) > 0.1
    assert torch.equal(rgb, unlabeled_image_crops(40, 24, 3, seed=0, photos=("coffee", "camera")))
    assert not torch.equal(rgb, unlabeled_image_crops(40, 24, 3, seed=1, photos=("coffee", "camera")))
    gray = unlabeled_image_crops(8, 28, 1, seed=0, photos=("coffee",), max_scale=1)
    assert gray.shape == (8, 1, 28, 28)


def test_unlabeled_images_drop_labels() -> None:
    images = np.arange(5 * 4 * 4, dtype=np.uint8).reshape(5, 4, 4)
    features = Features({"image": Array2D((4, 4), "uint8"), "label": Value("int64")})
    ds = Dataset.from_dict({"image": images, "label": np.zeros(5, dtype=np.int64)}, features=features)
    x = unlabeled_images(ds)
    assert x.shape == (5, 1, 4, 4)
    torch.testing.assert_close(x[0, 0, 0, 1], torch.tensor((1 / 255 - 0.5) / 0.5))
    sub = unlabeled_images(ds, n=3, seed=0)
    assert sub.shape == (3, 1, 4, 4) and all(any(torch.equal(s, r) for r in x) for s in sub)


def test_a_registry_mode_parses_to_the_typed_mode_or_fails_naming_the_choices() -> None:
    assert [parse_mode(m) for m in ("periodic", "merged", "fedavg")] == ["periodic", "merged", "fedavg"]
    with pytest.raises(CodistConfigError, match=r"mode must be one of .*got 'merge'"):
        parse_mode("merge")
