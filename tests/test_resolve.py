"""The experiment a run configuration describes, derived once (experiment/resolve.py, issue 20 stage 3)."""

from __future__ import annotations

import pytest

from experiment.config import ConfigError, RunConfig
from experiment.resolve import Experiment, auto_memory_budgets, halving_width_rates


def test_auto_budgets_sit_between_each_estimate_and_the_next() -> None:
    # o + (e_i + e_{i+1}) / 2, and o + 1.25 e_n for the strongest
    assert auto_memory_budgets([100.0, 200.0, 400.0], 50.0) == [200.0, 350.0, 550.0]
    assert auto_memory_budgets([80.0], 0.0) == [100.0]


def test_cnn_auto_widths_halve_per_tier_below_the_strongest() -> None:
    assert halving_width_rates(5) == [0.0625, 0.125, 0.25, 0.5, 1.0]
    assert halving_width_rates(1) == [1.0]


def test_each_part_is_derived_once_and_kept() -> None:
    cfg = RunConfig.model_validate({"model": "tiny", "tier-memory-mb": "auto"})
    exp = cfg.experiment
    assert isinstance(exp, Experiment) and cfg.experiment is exp
    assert cfg.family() is cfg.family() is exp.family
    assert cfg.data_spec() is exp.data and cfg.train_settings() is exp.train
    assert cfg.catalog is exp.catalog and cfg.training_catalog is exp.catalog  # InclusiveFL trains every variant
    estimates = [v.memory.total_mb for v in cfg.catalog]
    assert list(cfg.memory_budgets.values()) == auto_memory_budgets(estimates, cfg.runtime_overhead_mb)


def test_parts_are_derived_only_when_asked_for() -> None:
    """A hub model outside the local cache builds no catalog until one is needed (pre-flight stops first)."""
    cfg = RunConfig.model_validate({"model": "org/not-cached-anywhere"})
    assert cfg.data_spec().kind == "text" and cfg.train_settings().lr == cfg.lr
    assert "catalog" not in vars(cfg.experiment)


def test_the_method_decides_what_is_trained_and_carved() -> None:
    largest = RunConfig.model_validate({"model": "tiny", "method": "all-large"})
    assert largest.training_catalog.names() == [largest.catalog.largest.name]
    smallest = RunConfig.model_validate({"model": "tiny", "method": "all-small"})
    assert smallest.training_catalog.names() == [smallest.catalog.smallest.name]
    assert largest.data_spec().server_labeled_size == 0


def test_a_width_catalog_that_cannot_be_cut_names_the_key() -> None:
    cfg = RunConfig.model_validate({"model": "tiny", "method": "heterofl", "tier-widths": "0.3:0.5:1"})
    with pytest.raises(ConfigError, match="run config 'tier-widths': tier width rates must be strictly increasing"):
        cfg.catalog  # noqa: B018
