"""DepthFL's math on exact numbers: the exits' self-distillation loss and the server's holder means."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from models.exits import ExitsError, ensemble_logits, mutual_distillation, self_distillation_loss
from strategies.depthfl import DepthFLError, holder_mean, prefix, round_kd_weight
from strategies.streaming import StreamingMean

# two exits, two classes, one example of class 0: p1 = (1/2, 1/2), p2 = (3/4, 1/4)
Z1 = torch.tensor([[0.0, 0.0]])
Z2 = torch.tensor([[math.log(3.0), 0.0]])
Y = torch.tensor([0])
KL_P2_P1 = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)  # KL(p2 || p1): exit 1 learns from exit 2
KL_P1_P2 = 0.5 * math.log(0.5 / 0.75) + 0.5 * math.log(2.0)  # KL(p1 || p2): exit 2 learns from exit 1


def test_the_loss_is_both_exits_cross_entropy_plus_w_times_both_kl_terms() -> None:
    loss = self_distillation_loss([Z1, Z2], Y, weight=0.5)
    expected = math.log(2.0) + math.log(4.0 / 3.0) + 0.5 * (KL_P2_P1 + KL_P1_P2)
    assert float(loss) == pytest.approx(expected, abs=1e-6)


def test_without_distillation_weight_or_with_one_exit_the_loss_is_cross_entropy() -> None:
    ce = math.log(2.0) + math.log(4.0 / 3.0)
    assert float(self_distillation_loss([Z1, Z2], Y, weight=0.0)) == pytest.approx(ce, abs=1e-6)
    assert float(self_distillation_loss([Z2], Y, weight=1.0)) == pytest.approx(math.log(4.0 / 3.0), abs=1e-6)
    assert float(mutual_distillation([Z2])) == 0.0


def test_three_exits_average_each_students_kl_over_its_two_teachers() -> None:
    z3 = torch.tensor([[0.0, math.log(3.0)]])  # p3 = (1/4, 3/4)
    p = [torch.tensor([0.5, 0.5]), torch.tensor([0.75, 0.25]), torch.tensor([0.25, 0.75])]

    def kl(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a * (a / b).log()).sum())

    expected = sum(kl(p[j], p[i]) for i in range(3) for j in range(3) if j != i) / 2
    assert float(mutual_distillation([Z1, Z2, z3])) == pytest.approx(expected, abs=1e-6)


def test_teachers_are_detached_each_exit_is_pulled_only_as_student() -> None:
    z1, z2 = Z1.clone().requires_grad_(), Z2.clone().requires_grad_()
    mutual_distillation([z1, z2]).backward()
    # d/dz2 KL(p1 || softmax(z2)) = softmax(z2) - p1; d/dz1 KL(p2 || softmax(z1)) = softmax(z1) - p2
    assert z2.grad is not None and z1.grad is not None
    torch.testing.assert_close(z2.grad, torch.tensor([[0.25, -0.25]]))
    torch.testing.assert_close(z1.grad, torch.tensor([[-0.25, 0.25]]))


def test_the_temperature_scales_the_kl_by_t_squared() -> None:
    at_t2 = mutual_distillation([2 * Z1, 2 * Z2], temperature=2.0)
    assert float(at_t2) == pytest.approx(4 * (KL_P2_P1 + KL_P1_P2), abs=1e-6)


def test_the_prediction_is_the_mean_of_the_exits_logits() -> None:
    torch.testing.assert_close(ensemble_logits([Z1, Z2]), torch.tensor([[math.log(3.0) / 2, 0.0]]))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: ensemble_logits([]), "at least one exit"),
        (lambda: ensemble_logits([Z1, torch.zeros(1, 3)]), "one shape"),
        (lambda: self_distillation_loss([Z1, Z2], Y, weight=-1.0), "must be >= 0"),
        (lambda: mutual_distillation([Z1, Z2], temperature=0.0), "temperature must be > 0"),
    ],
)
def test_unusable_exits_or_settings_raise_naming_the_problem(call: Callable[[], object], message: str) -> None:
    with pytest.raises(ExitsError, match=message):
        call()


def test_the_distillation_weight_ramps_up_over_r_rounds() -> None:
    assert round_kd_weight(3, 1.5, 0) == 1.5
    assert round_kd_weight(0, 2.0, 10) == pytest.approx(2.0 * math.exp(-5.0))
    assert round_kd_weight(5, 2.0, 10) == pytest.approx(2.0 * math.exp(-1.25))
    assert round_kd_weight(10, 2.0, 10) == 2.0
    assert round_kd_weight(25, 2.0, 10) == 2.0
    with pytest.raises(DepthFLError, match="must be >= 0"):
        round_kd_weight(1, 1.0, -1)


def test_each_tensor_is_averaged_over_its_holders_and_kept_where_nobody_held_it() -> None:
    previous = {"blocks.0.w": torch.zeros(2), "blocks.1.w": torch.tensor([1.0]), "exits.1.w": torch.tensor([5.0])}
    sums = StreamingMean()
    sums.add({"blocks.0.w": torch.tensor([2.0, 4.0]), "blocks.1.w": torch.tensor([3.0])}, 1.0)  # depth 2
    sums.add({"blocks.0.w": torch.tensor([6.0, 8.0])}, 3.0)  # depth 1
    out = holder_mean(previous, sums.mean())
    torch.testing.assert_close(out["blocks.0.w"], torch.tensor([5.0, 7.0]))  # (1 x (2, 4) + 3 x (6, 8)) / 4
    torch.testing.assert_close(out["blocks.1.w"], torch.tensor([3.0]))  # its one holder
    assert out["exits.1.w"] is previous["exits.1.w"]  # nobody held it


def test_a_reply_tensor_the_global_model_lacks_is_refused() -> None:
    with pytest.raises(DepthFLError, match=r"blocks\.9\.w"):
        holder_mean({"blocks.0.w": torch.zeros(1)}, {"blocks.9.w": torch.ones(1)})


def test_a_sub_model_is_the_prefix_its_layout_names() -> None:
    state = {"blocks.0.w": torch.zeros(1), "blocks.1.w": torch.ones(1), "exits.0.w": torch.ones(1)}
    assert list(prefix(state, ["blocks.0.w", "exits.0.w"])) == ["blocks.0.w", "exits.0.w"]
    with pytest.raises(DepthFLError, match="lacks"):
        prefix(state, ["blocks.2.w"])
