"""pFedKnow in a real `flwr run` Ray simulation: unlabeled tiny clients, sparse uploads, personal models."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path

import pytest

from deploy.launch import run_simulation
from tests.flower_runs import read_rounds

#: 4 unlabeled clients on the embedded Fashion-MNIST, a 4:8:16:32 conv net, 2 rounds.
PFEDKNOW_TINY = (
    "method='pfedknow' model='conv' cnn-widths='4:8:16:32' tiers='iot' tier-proportions='1' tier-memory-mb='auto' "
    "dataset='embedded:fashion_mnist' num-labels=10 optimizer='sgd' lr=0.05 batch-size=32 local-steps=3 "
    "server-test-size=200 eval-batch-size=64 fraction-evaluate=1.0 distill-steps=4 distill-batch-size=32 "
    "num-server-rounds=2 checkpoint-keep=0"
)
#: Shorter server initialization, passed only where pyproject.toml lists the keys (flwr refuses others).
FAST_INIT = {"pfedknow-teacher-steps": 30, "pfedknow-init-steps": 30, "pfedknow-prune-rounds": 2}


def fast_init_overrides() -> str:
    """``FAST_INIT`` as ``k=v`` pairs, restricted to the keys ``[tool.flwr.app.config]`` declares."""
    with Path("pyproject.toml").open("rb") as f:
        declared = tomllib.load(f)["tool"]["flwr"]["app"]["config"]
    return " ".join(f"{k}={v}" for k, v in FAST_INIT.items() if k in declared)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pfedknow_simulation_with_unlabeled_clients(tmp_path: Path) -> None:
    outcome = run_simulation(
        supernodes=4,
        run_config=f"{PFEDKNOW_TINY} {fast_init_overrides()}",
        results_dir=tmp_path,
        run_name="pfedknow",
        flwr_home=tmp_path / "flwr-home",
        echo=False,
    )
    assert outcome.ok, outcome.log[-4000:]
    rows = read_rounds(outcome.results)
    assert [r["round"] for r in rows] == [0, 1, 2]
    keys = {f"partition-{i}" for i in range(4)}
    for row in rows[1:]:
        assert row["rejected"] == [] and row["failed"] == []
        g = row["tiers"]["iot"]
        assert g["clients"] == 4
        # per-client bytes up and down are in the results, uploads smaller than the dense model
        assert {k.partition(":")[2] for k in g if k.startswith("bytes-up:")} == keys
        assert {k.partition(":")[2] for k in g if k.startswith("bytes-down:")} == keys
        assert g["bytes-up"] < g["bytes-up-dense"]
        assert 0.0 < g["payload-saving"] < 1.0
        # the personalized models' accuracy on every client's local test split
        assert {k.partition(":")[2] for k in g if k.startswith("fed-accuracy:")} == keys
        assert math.isfinite(g["fed-accuracy-mean"]) and 0.0 <= g["fed-accuracy-mean"] <= 1.0
        # every client trained in round 1, so none is still evaluated on the initial w_s'
        assert g["clients-personalized"] == 4.0 and "fed-accuracy-initial" not in g
        assert 0.0 <= g["local-accuracy"] <= 1.0  # mean of the personal models on the server test set
    # progressive pruning: round 2 prunes more and uploads less than round 1
    g1, g2 = rows[1]["tiers"]["iot"], rows[2]["tiers"]["iot"]
    assert g2["prune-ratio"] > g1["prune-ratio"] > 0
    assert g2["payload-bytes-up"] < g1["payload-bytes-up"]
    assert "teacher-loss" in g1 and "init-loss" in g1  # the server initialized w_s' with the teacher


#: The text path: 3 unlabeled clients on the embedded rotten_tomatoes, the tiny transformer (a 2-layer
#: student under its full 6-layer teacher), magnitude pruning, 2 rounds.
PFEDKNOW_TEXT_TINY = (
    "method='pfedknow' model='tiny' tiers='iot' tier-layers='2' tier-proportions='1' tier-memory-mb='auto' "
    "dataset='embedded:rotten_tomatoes' num-labels=2 max-seq-len=16 optimizer='adamw' lr=0.001 batch-size=16 "
    "local-steps=3 server-test-size=100 eval-batch-size=64 fraction-evaluate=1.0 distill-steps=3 "
    "distill-batch-size=16 num-server-rounds=2 checkpoint-keep=0 pfedknow-labeled-size=100 "
    "pfedknow-teacher-steps=5 pfedknow-init-steps=5 pfedknow-prune-ratio=0.75 pfedknow-prune-rounds=2"
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_pfedknow_text_simulation_uploads_sparse_transformer_weights(tmp_path: Path) -> None:
    outcome = run_simulation(
        supernodes=3,
        run_config=PFEDKNOW_TEXT_TINY,
        results_dir=tmp_path,
        run_name="pfedknow-text",
        flwr_home=tmp_path / "flwr-home",
        echo=False,
    )
    assert outcome.ok, outcome.log[-4000:]
    rows = read_rounds(outcome.results)
    assert [r["round"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["rejected"] == [] and row["failed"] == []
        g = row["tiers"]["iot"]
        assert g["clients"] == 3 and g["bytes-up"] < g["bytes-up-dense"]
        assert math.isfinite(g["fed-accuracy-mean"])
    g1, g2 = rows[1]["tiers"]["iot"], rows[2]["tiers"]["iot"]
    assert g1["prune-ratio"] == 0.375 and g2["prune-ratio"] == 0.75  # progressive magnitude pruning
    assert g2["payload-bytes-up"] < g1["payload-bytes-up"]
