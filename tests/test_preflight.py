"""Pre-flight (issue 23): a run that cannot do what was asked fails before anything starts."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

from deploy import launch
from deploy.preflight import PreflightError, check_keys, parse_overrides, preflight
from experiment.config import ConfigError, RunConfig
from experiment.preflight import (
    NothingCanTrain,
    TierAssignment,
    changed_keys,
    check_plan,
    no_effect_warnings,
    plan_tiers,
    simulated_tier_nodes,
    start_checks,
)
from models.catalog import tier_counts

TINY = {"model": "tiny", "tier-memory-mb": "auto"}


def test_tier_counts_split_by_largest_remainder() -> None:
    assert tier_counts(10, [1, 1, 1]) == [4, 3, 3]
    assert tier_counts(120, [1, 2, 7]) == [12, 24, 84]
    assert tier_counts(7, [7, 2, 1]) == [5, 1, 1]  # quotas 4.9, 1.4, 0.7: remainders .9, .7 win
    assert tier_counts(2, [1, 1, 1]) == [1, 1, 0]


def test_auto_budgets_give_every_tier_its_own_variant() -> None:
    cfg = RunConfig.from_flower(TINY)
    plan = plan_tiers(cfg, simulated_tier_nodes(cfg, 6))
    assert [(a.tier, a.nodes, a.variant) for a in plan] == [
        ("weak", 2, "weak"),
        ("medium", 2, "medium"),
        ("strong", 2, "strong"),
    ]
    assert check_plan(cfg, plan) == []


def test_budgets_that_fit_only_the_largest_variant_warn_that_the_others_train_nowhere() -> None:
    cfg = RunConfig.from_flower({"model": "tiny"})  # default budgets 700:850:1100 MiB fit every tiny variant
    plan = plan_tiers(cfg, simulated_tier_nodes(cfg, 6))
    assert {a.variant for a in plan} == {"strong"}
    warnings = check_plan(cfg, plan)
    assert len(warnings) == 2
    assert warnings[0].startswith("variant 'weak' trains on no node") and "tier-memory-mb='auto'" in warnings[0]


def test_one_variant_methods_leave_the_nodes_that_do_not_fit_out_without_a_warning() -> None:
    cfg = RunConfig.from_flower({"method": "exclusive"})
    plan = plan_tiers(cfg, {"weak": 2, "medium": 2, "strong": 2})
    assert [a.variant for a in plan] == [None, None, "strong"]
    assert check_plan(cfg, plan) == []


def test_no_node_that_can_train_is_an_error_naming_the_keys() -> None:
    cfg = RunConfig.from_flower({"tier-memory-mb": "100:120:140"})
    with pytest.raises(NothingCanTrain, match="tier-memory-mb") as exc:
        check_plan(cfg, plan_tiers(cfg, {"weak": 1, "medium": 1, "strong": 1}))
    assert "memory budget 100 MiB is below the smallest variant 'weak'" in str(exc.value)


def test_a_tier_without_nodes_and_a_declining_tier_warn() -> None:
    cfg = RunConfig.from_flower(TINY)
    plan = [
        TierAssignment("weak", 0, 1.0, None, "no node"),
        TierAssignment("medium", 1, 1.0, None, "too small"),
        TierAssignment("strong", 1, 1e9, "strong", "fits"),
    ]
    warnings = check_plan(cfg, plan)
    assert warnings[0].startswith("tier 'weak' has no node (2 nodes split 1:1:1)")
    assert "tier 'medium' (1 nodes) trains nothing: too small" in warnings
    assert [w.split(" (")[0] for w in warnings if "trains on no node" in w] == ["variant 'medium' trains on no node"]


def test_a_tier_left_out_on_purpose_is_not_warned_about() -> None:
    """HeteroFL's a-e mixture: proportions 1:0:0:0:1 train only the smallest and the full model."""
    cfg = RunConfig.from_flower(
        {"model": "conv", "method": "heterofl", "num-labels": 10, "dataset": "embedded:fashion_mnist",
         "tiers": "a:b:c:d:e", "tier-proportions": "1:0:0:0:1", "tier-memory-mb": "auto", "tier-widths": "auto"}
    )  # fmt: skip
    plan = plan_tiers(cfg, simulated_tier_nodes(cfg, 10))
    assert [(a.tier, a.nodes, a.variant) for a in plan if a.nodes] == [("a", 5, "a"), ("e", 5, "e")]
    assert check_plan(cfg, plan) == []


def test_keys_without_effect_are_named() -> None:
    cfg = RunConfig.from_flower({"method": "heterofl", "local-epochs": 5, "beta": 0.5, "codist-alpha": 0.3})
    warnings = no_effect_warnings(cfg, ["local-epochs", "beta", "codist-alpha", "dirichlet-alpha", "seed"])
    assert warnings[0].startswith("'local-epochs' has no effect: local-steps = 15")
    assert "'dirichlet-alpha' has no effect with partitioner = 'iid'" in warnings[1]
    assert warnings[2] == "'beta' has no effect with method = 'heterofl': only inclusivefl read it"
    assert warnings[3].startswith("'codist-alpha' has no effect with method = 'heterofl': only codist-")
    assert no_effect_warnings(RunConfig.from_flower({"beta": 0.5}), ["beta"]) == []
    held_out = RunConfig.from_flower({"client-test-split": "held-out", "client-test-fraction": 0.3})
    (warning,) = no_effect_warnings(held_out, ["client-test-split", "client-test-fraction"])
    assert warning.startswith("'client-test-fraction' has no effect with client-test-split = 'held-out'")
    assert no_effect_warnings(RunConfig.from_flower({"client-test-fraction": 0.3}), ["client-test-fraction"]) == []


def test_unknown_keys_get_the_closest_declared_ones() -> None:
    with pytest.raises(PreflightError, match=r"'num-rounds' is not a key of this app \(did you mean"):
        check_keys({"num-rounds": 3}, {"num-server-rounds": 1, "seed": 0})
    assert parse_overrides("a=1 b='x y' c=true") == {"a": 1, "b": "x y", "c": True}
    with pytest.raises(PreflightError, match="invalid format"):
        parse_overrides("num-server-rounds=three")


#: Bad inputs a user meets in the first hour (issue 23), with the error and what its message names.
BAD_INPUTS = [
    ("num-rounds=3", PreflightError, "did you mean 'num-server-rounds'"),
    ("method='inclusivfl'", ConfigError, "did you mean 'inclusivefl'"),
    ("model='minilm-l12'", PreflightError, "did you mean 'minilm-l6'"),
    ("dataset='data/reviews.csv'", PreflightError, "no file or folder 'data/reviews.csv'"),
    ("dataset='embedded:rotten_tomato'", PreflightError, "did you mean 'embedded:rotten_tomatoes'"),
    ("tier-memory-mb='100:120:140'", NothingCanTrain, "no node can train"),
    ("partitioner='dirichlet' dirichlet-alpha=0.1", PreflightError, "raise dirichlet-alpha"),
]


@pytest.mark.parametrize(("run_config", "error", "match"), BAD_INPUTS)
def test_preflight_stops_what_cannot_run(run_config: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        preflight(run_config, num_nodes=30)


def test_preflight_passes_the_demo_and_notes_a_hub_model() -> None:
    found = preflight("", num_nodes=6)
    assert found.warnings == [] and found.notes == []
    assert found.lines()[0].endswith("strong x2 (1100 MiB) -> strong")
    hub = preflight("model='org/some-encoder'", num_nodes=6)
    assert hub.tiers == [] and "fetch it from the hub" in hub.notes[0]


def test_launcher_stops_before_starting_anything(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    started = time.perf_counter()
    code = launch.main(["simulation", "--run-config", "num-rounds=3", "--results-dir", str(tmp_path)])
    assert code == 2 and time.perf_counter() - started < 20
    assert "pre-flight failed, nothing was started: run config 'num-rounds'" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("run_config", "error", "match"), BAD_INPUTS)
@pytest.mark.parametrize("mode", ["simulation", "loopback"])
def test_every_bad_input_stops_the_launcher_naming_the_fix(
    mode: str, run_config: str, error: type[Exception], match: str, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Each bad input as a user meets it: the launcher exits 2 with the key and the fix, nothing started."""
    nodes = ["--supernodes", "30"] if mode == "simulation" else ["--tiers", ",".join(["weak", "medium", "strong"] * 10)]
    code = launch.main([mode, *nodes, "--run-config", run_config, "--results-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert re.search(match, err), err
    assert list(tmp_path.iterdir()) == []


def test_launcher_names_a_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(SystemExit) as exc:
        launch.main(["simulation", "--config", str(tmp_path / "missing.toml")])
    assert exc.value.code == 2


def test_the_serverapp_runs_the_same_checks_for_flwr_run_users(tmp_path: Path) -> None:
    """``flwr run`` skips the launcher: the ServerApp's start names the key and the closest choice too."""
    typo = RunConfig.model_validate({"model": "minilm-l12"})
    with pytest.raises(PreflightError, match=r"run config 'model': 'minilm-l12' .* did you mean 'minilm-l6'"):
        start_checks(typo, tmp_path)
    missing = RunConfig.model_validate({"dataset": "data/reviews.csv"})
    with pytest.raises(PreflightError, match=r"no file or folder 'data/reviews.csv'"):
        start_checks(missing, tmp_path)
    cfg = RunConfig.model_validate({"local-epochs": 5, "beta": 0.5, "method": "heterofl"})
    assert set(changed_keys(cfg)) == {"local-epochs", "beta", "method"}
    notes, warnings = start_checks(cfg, tmp_path)
    assert notes == []
    assert warnings == no_effect_warnings(cfg, ["local-epochs", "beta", "method"])
    assert any("'local-epochs' has no effect" in w for w in warnings)
    assert any("'beta' has no effect with method = 'heterofl'" in w for w in warnings)
    assert start_checks(RunConfig.model_validate({}), tmp_path) == ([], [])


def test_preflight_refuses_a_held_out_split_too_small_to_give_every_client_test_data(tmp_path: Path) -> None:
    """``client-test-split = 'held-out'`` with a client whose share is empty stops before round 1, naming the key."""
    (tmp_path / "train.csv").write_text("text,label\n" + "".join(f"review {i},{i % 2}\n" for i in range(600)))
    (tmp_path / "test.csv").write_text("text,label\n" + "".join(f"held {i},{i % 2}\n" for i in range(6)))
    with pytest.raises(PreflightError, match=r"client-test-split.*no held-out test examples"):
        preflight(f"dataset='{tmp_path}' client-test-split='held-out'", num_nodes=12)
    assert preflight(f"dataset='{tmp_path}' client-test-split='held-out'", num_nodes=3).plan_warnings == []
