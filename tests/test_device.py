"""Where training runs: the ``device`` setting, batches following the model, GPU shares in simulation.

The same checks on a CUDA GPU are in ``tests/test_gpu.py`` (``make test-gpu``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import deploy.experiments as ex
import deploy.launch as launch
from deploy.launch import check_gpus_per_client
from experiment.config import ConfigError, RunConfig
from models.training import batch_to, resolve_device
from tests.handlers import IMAGES, TEXT, arrays, call, metric, task_identity  # noqa: F401 (fixture)

CUDA = torch.cuda.device_count() if torch.cuda.is_available() else 0


def test_resolve_device_names_and_fallback() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if CUDA else "cpu")
    for bad in ("gpu", "cuda:", "cuda:x", "CPU", "mps"):
        with pytest.raises(ValueError, match="'cpu', 'auto', 'cuda' or 'cuda:N'"):
            resolve_device(bad)
    with pytest.raises(ValueError, match=rf"'cuda:{CUDA}' asked for, but this machine has {CUDA} CUDA device"):
        resolve_device(f"cuda:{CUDA}")


def test_batch_to_moves_tensors_and_mappings() -> None:
    x = torch.arange(6).reshape(2, 3)
    assert batch_to(x, torch.device("cpu")) is x  # already there: no copy
    moved = batch_to({"input_ids": x, "labels": x[:, 0]}, torch.device("cpu"))
    assert set(moved) == {"input_ids", "labels"} and torch.equal(moved["labels"], x[:, 0])
    with pytest.raises(TypeError, match="tensors or mappings of tensors"):
        batch_to([x], torch.device("cpu"))  # type: ignore[call-overload]


def test_device_setting_fails_fast_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"run config 'device'.*'cuda:N'"):
        RunConfig.from_flower({"device": "gpu0"})
    cfg = RunConfig.from_flower({"device": f"cuda:{CUDA}"})  # valid name: checked where it is used
    with pytest.raises(ConfigError, match=r"run config 'device': .* has \d CUDA device"):
        cfg.torch_device()
    with pytest.raises(ConfigError, match=r"run config 'device': 'pfedknow' .* CPU only"):
        RunConfig.from_flower({"method": "pfedknow", "model": "tiny", "tiers": "iot", "device": "auto"})
    assert RunConfig().torch_device() == torch.device("cpu")  # the default


def test_gpu_share_fails_fast_without_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    check_gpus_per_client(0.0)
    with pytest.raises(ValueError, match=">= 0"):
        check_gpus_per_client(-0.5)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"0\.25 GPU per client asked for, but this machine has no CUDA GPU"):
        check_gpus_per_client(0.25)


@pytest.mark.parametrize(("gpus", "resources"), [(0.0, ""), (0.25, " client-resources-num-gpus=0.25")])
def test_simulation_asks_ray_for_the_gpu_share(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: float, resources: str
) -> None:
    fake = tmp_path / "bin" / "python"  # a stand-in for `python -m deploy.flwr_cli` that prints its federation config
    fake.parent.mkdir()
    fake.write_text(f"#!{sys.executable}\nimport sys\nprint(sys.argv[sys.argv.index('--federation-config') + 1])\n")
    fake.chmod(0o755)
    monkeypatch.setattr(launch, "BIN", fake.parent)
    monkeypatch.setattr(launch, "superlink_pids", lambda home: set())  # stop no real SuperLink from this test
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    outcome = launch.run_simulation(
        supernodes=3, run_config="", results_dir=tmp_path, run_name="probe", flwr_home=tmp_path / "home",
        gpus_per_client=gpus, echo=False, lock=tmp_path / "sim.lock",
    )  # fmt: skip
    assert outcome.log.strip() == f"num-supernodes=3 client-resources-num-cpus=1{resources}"


def test_suites_gpu_share_from_the_preset_or_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = {"presets": {"gpu": {"supernodes": 2, "gpus-per-client": 0.25}}, "runs": [{"label": "a"}]}
    suite = ex.parse_suite("s", doc, base=tmp_path)
    assert [p.gpus_per_client for p in ex.plan_runs(suite, "gpu", 1)] == [0.25]
    assert [p.gpus_per_client for p in ex.plan_runs(suite, "gpu", 1, gpus_per_client=0.0)] == [0.0]
    with pytest.raises(ex.SuiteError, match="gpus-per-client: expected a number >= 0"):
        ex.parse_suite("s", {**doc, "presets": {"gpu": {"supernodes": 2, "gpus-per-client": -1}}}, base=tmp_path)
    # a GPU preset on a machine without one: refused before any run, with the way out
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        ex.main(["heterofl", "--preset", "paper", "--out", str(tmp_path)])
    assert "--gpus-per-client 0 overrides the preset's 0.1" in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()
    assert ex.main(["heterofl", "--preset", "paper", "--dry-run", "--out", str(tmp_path)]) == 0  # planning is fine


@pytest.mark.usefixtures("task_identity")
@pytest.mark.parametrize("run_config", [TEXT, IMAGES], ids=["text", "images"])
def test_handlers_reply_with_host_arrays(run_config: dict[str, object]) -> None:
    """``device='auto'`` trains where it can; the reply is the same kind of arrays either way."""
    sent = arrays(call("train", {**run_config, "local-steps": 0, "device": "auto"}))  # 0 steps: nothing trained
    trained = call("train", {**run_config, "device": "auto"})
    after = arrays(trained)
    assert set(after) == set(sent) and all(isinstance(a, np.ndarray) for a in after.values())
    assert any(not np.array_equal(after[k], sent[k]) for k in sent)  # it trained
    assert np.isfinite(metric(trained, "train-loss"))
    evaluated = call("evaluate", {**run_config, "device": "auto"})
    assert 0.0 <= metric(evaluated, "accuracy") <= 1.0 and metric(evaluated, "num-examples") > 0


@pytest.mark.usefixtures("task_identity")
def test_federated_evaluation_does_not_depend_on_what_the_process_served_before() -> None:
    """The sBN statistics' batches are the round's (seeded), not wherever the cached loader stands."""
    first = call("evaluate", IMAGES)
    call("train", IMAGES)  # iterates this node's cached training loader
    call("evaluate", {**IMAGES, "seed": 5})  # and so does another run seed's evaluation
    again = call("evaluate", IMAGES)
    assert metric(again, "loss") == metric(first, "loss") and metric(again, "accuracy") == metric(first, "accuracy")
