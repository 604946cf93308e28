"""A real `flwr run` in Ray simulation: 6 virtual clients, 2 rounds, the tiny model."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from deploy import launch
from deploy.launch import run_simulation
from experiment.config import RunConfig
from tests.flower_runs import TINY, read_rounds, tiny_budgets, tiny_depths, tiny_trainable_bytes


def simulate(tmp_path: Path, name: str, run_config: str) -> Path:
    """Run the app on 6 virtual clients with the tiny model; return the results folder."""
    outcome = run_simulation(
        supernodes=6,
        run_config=f"{TINY} {run_config}",
        results_dir=tmp_path,
        run_name=name,
        flwr_home=tmp_path / "flwr-home",
        echo=False,
    )
    assert outcome.ok, outcome.log[-4000:]
    return outcome.results


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_simulation_every_tier_trains_its_own_variant(tmp_path: Path) -> None:
    folder = simulate(tmp_path, "sim", f"num-server-rounds=2 tier-memory-mb='{tiny_budgets()}'")
    for name in ("rounds.jsonl", "summary.csv", "accuracy.png", "config.json"):
        assert (folder / name).stat().st_size > 0, name
    rows = read_rounds(folder)
    assert [r["round"] for r in rows] == [0, 1, 2]
    sizes = tiny_trainable_bytes()
    depths = tiny_depths()
    for row in rows[1:]:
        assert row["rejected"] == [] and row["failed"] == []
        for tier in ("weak", "medium", "strong"):
            vals = row["tiers"][tier]
            assert vals["clients"] == 2, (tier, vals)  # 1:1:1 over 6 clients
            assert vals["layers"] == depths[tier]  # what the clients actually trained
            per_client_up = vals["bytes-up"] / vals["clients"]
            data_bytes, tensors = sizes[tier]
            # exactly the variant's trainable tensors, plus one .npy header (<= 256 B) each
            assert data_bytes + 64 * tensors <= per_client_up <= data_bytes + 256 * tensors, (tier, per_client_up)
            assert 0.0 <= vals["local-accuracy"] <= 1.0 and math.isfinite(vals["local-loss"])
            assert 0.0 <= vals["fed-accuracy"] <= 1.0
    csv_text = (folder / "summary.csv").read_text()
    assert csv_text.count("\n") == 4  # header + 3 tiers


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_local_baseline_trains_every_tier_on_its_own_variant(tmp_path: Path) -> None:
    """Local end to end; the one-variant baselines' assignments are checked in-process (tests/test_baselines.py)."""
    folder = simulate(tmp_path, "local", f"num-server-rounds=1 method='local' tier-memory-mb='{tiny_budgets()}'")
    last = read_rounds(folder)[-1]
    clients = {t: v["clients"] for t, v in last["tiers"].items() if "clients" in v}
    assert clients == {"weak": 2, "medium": 2, "strong": 2}
    assert last["rejected"] == [] and last["failed"] == []


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("method", ["heterofl", "fedrolex"])
def test_width_methods_train_every_tier_on_its_width(tmp_path: Path, method: str) -> None:
    widths = {"method": method, "tier-widths": "0.25:0.5:1"}
    budgets = tiny_budgets(widths)
    folder = simulate(
        tmp_path, method, f"num-server-rounds=2 method='{method}' tier-widths='0.25:0.5:1' tier-memory-mb='{budgets}'"
    )
    sizes = tiny_trainable_bytes(widths)
    for row in read_rounds(folder)[1:]:
        assert row["rejected"] == [] and row["failed"] == []
        for tier in ("weak", "medium", "strong"):
            vals = row["tiers"][tier]
            assert vals["clients"] == 2, (tier, vals)
            data_bytes, tensors = sizes[tier]
            per_client_up = vals["bytes-up"] / vals["clients"]
            assert data_bytes + 64 * tensors <= per_client_up <= data_bytes + 256 * tensors, (tier, per_client_up)


#: HeteroFL's conv net, 4x narrower than the default, on the embedded Fashion-MNIST.
CNN_TINY = (
    "model='conv' cnn-widths='4:8:16:32' dataset='embedded:fashion_mnist' num-labels=10 "
    "optimizer='sgd' lr=0.05 batch-size=32 tier-memory-mb='auto' tier-widths='auto'"
)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("method", "expected_clients"),
    [("heterofl", {"weak": 2, "medium": 2, "strong": 2})],  # all-small: tests/test_heterofl_strategy.py
)
def test_cnn_width_tiers_on_fashion_mnist(tmp_path: Path, method: str, expected_clients: dict[str, int]) -> None:
    folder = simulate(tmp_path, f"cnn-{method}", f"{CNN_TINY} method='{method}' num-server-rounds=2")
    cfg = RunConfig.model_validate(
        {"model": "conv", "cnn-widths": "4:8:16:32", "num-labels": 10, "method": method, "batch-size": 32}
    )
    rows = read_rounds(folder)
    for row in rows[1:]:
        assert row["rejected"] == [] and row["failed"] == []
        assert {t: v["clients"] for t, v in row["tiers"].items() if "clients" in v} == expected_clients
        for tier, n in expected_clients.items():
            vals = row["tiers"][tier]
            layout = cfg.catalog.get(tier).layout
            per_client_up = vals["bytes-up"] / n
            # exactly the rate's sub-model (every CNN tensor is trained), plus one .npy header each
            assert layout.nbytes() + 64 * len(layout) <= per_client_up <= layout.nbytes() + 256 * len(layout)
            assert 0.0 <= vals["fed-accuracy"] <= 1.0  # evaluated on the client after sBN
    assert rows[-1]["tiers"]["weak"]["local-accuracy"] > 0.1  # the server's sBN evaluation beats chance


#: FlexiFed's four VGGs at width 1/16 on the embedded Fashion-MNIST.
VGG_TINY = (
    "model='vgg' arch-width=0.0625 tiers='vgg11:vgg13:vgg16:vgg19' tier-proportions='1:1:1:1' "
    "tier-memory-mb='auto' dataset='embedded:fashion_mnist' num-labels=10 optimizer='sgd' lr=0.05 batch-size=32"
)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_flexifed_max_common_with_four_vgg_architectures(tmp_path: Path) -> None:
    folder = simulate(tmp_path, "flexifed", f"{VGG_TINY} method='flexifed-max' num-server-rounds=2")
    cfg = RunConfig.model_validate(
        {
            "model": "vgg",
            "method": "flexifed-max",
            "arch-width": 0.0625,
            "tiers": "vgg11:vgg13:vgg16:vgg19",
            "tier-proportions": "1:1:1:1",
            "tier-memory-mb": "auto",
            "num-labels": 10,
            "batch-size": 32,
        }
    )
    for row in read_rounds(folder)[1:]:
        assert row["rejected"] == [] and row["failed"] == []
        tiers = row["tiers"]
        # 6 clients over 4 architectures 1:1:1:1 (largest remainder): every architecture trains
        assert sum(tiers[a]["clients"] for a in cfg.tier_names) == 6
        # layers averaged with another architecture's clients: the trie of VGG-11/13/16/19
        assert {a: tiers[a]["shared-layers"] for a in cfg.tier_names} == {
            "vgg11": 1,
            "vgg13": 6,
            "vgg16": 7,
            "vgg19": 7,
        }
        for arch in cfg.tier_names:
            vals = tiers[arch]
            layout = cfg.catalog.get(arch).layout  # each client returns exactly its own architecture
            per_client_up = vals["bytes-up"] / vals["clients"]
            assert layout.nbytes() + 64 * len(layout) <= per_client_up <= layout.nbytes() + 256 * len(layout)
            assert vals["layers"] == layout.params[-1].layer
            assert 0.0 <= vals["fed-accuracy"] <= 1.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_codistillation_pools_with_nested_membership(tmp_path: Path) -> None:
    """MergedCodist, 2 pools: every node trains the small CNN, high-capacity nodes also the large one."""
    run = (
        "model='codist-cnn' method='codist-merged' tiers='small:large' tier-proportions='2:1' "
        "tier-memory-mb='auto' codist-membership='also' dataset='embedded:fashion_mnist' num-labels=10 "
        "optimizer='sgd' lr=0.05 batch-size=32 distill-steps=4 distill-size=256 num-server-rounds=2"
    )
    folder = simulate(tmp_path, "codist", run)
    for row in read_rounds(folder)[1:]:
        assert row["rejected"] == [] and row["failed"] == []
        small, large = row["tiers"]["small"], row["tiers"]["large"]
        assert small["clients"] == 6 and large["clients"] == 2  # 2:1 over 6 nodes; the large ones train both
        assert small["distill-seconds"] > 0 and large["distill-seconds"] > 0  # server-side distillation ran
        assert 0.0 <= small["fed-accuracy"] <= 1.0 and 0.0 <= large["fed-accuracy"] <= 1.0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_run_where_every_node_declines_fails_naming_the_memory_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Issue 23 item 2: budgets no variant fits stop round 1; the launcher exits non-zero naming the keys.

    Started as a user would, through the launcher, with its pre-flight skipped (the pre-flight
    refuses these budgets before Ray starts: tests/test_preflight.py).
    """
    code = launch.main(
        ["simulation", "--supernodes", "3", "--skip-preflight", "--results-dir", str(tmp_path),
         "--run-name", "declined", "--run-config", f"{TINY} num-server-rounds=2 tier-memory-mb='100:120:140'"]
    )  # fmt: skip
    err = capsys.readouterr().err
    assert code == 1, err
    assert not (tmp_path / "declined" / "summary.csv").exists()
    assert "because NothingToTrain: nothing to train in round 1: all 3 connected nodes declined" in err, err
    assert "'tier-memory-mb'" in err
