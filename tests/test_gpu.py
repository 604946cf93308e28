"""The same work on a CUDA GPU as on the CPU (``make test-gpu``; CI has no GPU, so not in ``make test``).

Each test runs one piece of the product with ``device='cuda'`` and with ``device='cpu'`` from the
same weights and seeds, and checks they agree (GPU kernels sum in another order, convolutions use
TF32, dropout draws other masks): the ClientApp's train and evaluate handlers (text and image models, sBN included), the
ServerApp's central evaluation, and co-distillation's server-side distillation.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from experiment.config import RunConfig
from models.training import resolve_device
from server.app import CentralEvaluator, build_strategy
from strategies.codistill import CoDistillation
from strategies.distillation import distill
from tests.handlers import IMAGES, TEXT, arrays, call, metric, task_identity  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _a_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.fail("these tests need a CUDA GPU: run `make test-gpu` on a machine with one")


def test_device_names_resolve_to_the_gpu() -> None:
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("auto").type == "cuda"
    assert resolve_device("cuda:0") == torch.device("cuda:0")


def update(after: dict[str, np.ndarray], before: dict[str, np.ndarray]) -> np.ndarray:
    return np.concatenate([(after[k] - before[k]).ravel() for k in sorted(before)])


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize(
    ("run_config", "min_cosine", "max_relative"),
    # measured on an H100 (3 steps): images cosine 1.0, relative difference 1.5e-4 (TF32
    # convolutions); text cosine 0.98, relative 0.2 -- dropout draws other masks on the GPU
    [(TEXT, 0.9, 0.5), (IMAGES, 0.999, 0.01)],
    ids=["text", "images"],
)
def test_client_handlers_on_the_gpu_match_the_cpu(
    run_config: dict[str, object], min_cosine: float, max_relative: float
) -> None:
    """The same local update from the same weights and seed: the direction, and the size of the gap."""
    cpu, gpu = ({**run_config, "device": d} for d in ("cpu", "cuda"))
    trained = {d: call("train", c) for d, c in (("cpu", cpu), ("cuda", gpu))}
    a, b = arrays(trained["cpu"]), arrays(trained["cuda"])
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype for k in a)  # host arrays, same layout
    sent = arrays(call("train", {**cpu, "local-steps": 0}))
    ua, ub = update(a, sent), update(b, sent)
    assert np.linalg.norm(ub) > 0  # it trained, on the GPU
    cosine = float(ua @ ub / (np.linalg.norm(ua) * np.linalg.norm(ub)))
    relative = float(np.linalg.norm(ua - ub) / np.linalg.norm(ua))
    assert cosine > min_cosine and relative < max_relative, (cosine, relative)
    loss = {d: metric(r, "train-loss") for d, r in trained.items()}
    assert loss["cuda"] == pytest.approx(loss["cpu"], rel=1e-2)
    ev = {d: call("evaluate", c) for d, c in (("cpu", cpu), ("cuda", gpu))}  # eval mode: no dropout
    assert metric(ev["cuda"], "accuracy") == pytest.approx(metric(ev["cpu"], "accuracy"), abs=0.01)
    assert metric(ev["cuda"], "loss") == pytest.approx(metric(ev["cpu"], "loss"), rel=2e-3)


def test_central_evaluation_on_the_gpu_matches_the_cpu() -> None:
    base = {**IMAGES, "server-test-size": 500}
    results = {}
    for device in ("cpu", "cuda"):
        cfg = RunConfig.from_flower({**base, "device": device})
        evaluator = CentralEvaluator(cfg)
        assert evaluator.device.type == device
        states = cfg.family().initial_states(cfg.catalog, seed=3)
        results[device] = evaluator({v: [states[v]] for v in states})
    for variant, metrics in results["cpu"].items():
        assert results["cuda"][variant]["accuracy"] == pytest.approx(metrics["accuracy"], abs=0.01)
        assert results["cuda"][variant]["loss"] == pytest.approx(metrics["loss"], rel=2e-3)


def test_codistillation_on_the_gpu_matches_the_cpu() -> None:
    torch.manual_seed(0)
    student, teacher = nn.Linear(16, 5), nn.Linear(16, 5)
    batches = [torch.randn(32, 16) for _ in range(20)]
    out = {
        d: distill(student, teacher, batches, steps=20, temperature=2.0, lam=0.1, lr=0.01, device=d)
        for d in ("cpu", "cuda")
    }
    for k, v in out["cpu"].state.items():
        assert out["cuda"].state[k].device.type == "cpu"  # returned where the student lives
        torch.testing.assert_close(out["cuda"].state[k], v, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out["cuda"].losses, out["cpu"].losses, rtol=1e-4)
    cfg = RunConfig.from_flower(
        {"model": "codist-cnn", "method": "codist-periodic", "tiers": "small:large", "tier-proportions": "1:1",
         "tier-memory-mb": "auto", "dataset": "embedded:fashion_mnist", "num-labels": 10, "distill-size": 64,
         "device": "cuda"}
    )  # fmt: skip
    strategy = build_strategy(cfg)
    assert isinstance(strategy, CoDistillation) and strategy.device.type == "cuda"
