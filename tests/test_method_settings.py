"""Settings groups: one model per method's keys, flat on the command line (experiment/method_settings.py)."""

from __future__ import annotations

import pytest

from experiment.config import KEY_METHODS, ConfigError, RunConfig, SettingsGroupError
from experiment.method_settings import GROUPS, CodistGroup, InclusiveFLGroup, PFedKnowGroup, group_of, reads
from experiment.registry import METHODS


def test_a_group_is_read_as_one_object_from_the_flat_keys() -> None:
    pools = {"model": "codist-cnn", "tiers": "small:large", "tier-proportions": "1:1", "tier-memory-mb": "auto"}
    cfg = RunConfig.from_flower({**pools, "method": "codist-merged", "codist-alpha": 0.9, "distill-size": 64})
    own = cfg.settings_of(CodistGroup)
    assert isinstance(own, CodistGroup) and (own.codist_alpha, own.distill_size) == (0.9, 64)
    assert own.model_dump(by_alias=True)["codist-alpha"] == 0.9  # the group keeps the flat keys
    assert cfg.beta == 0.2  # every group's keys are validated, read or not
    with pytest.raises(SettingsGroupError, match=r"method 'codist-merged' reads InclusiveFLGroup but its registry"):
        cfg.settings_of(InclusiveFLGroup)  # a group the entry does not name


def test_a_bad_group_value_fails_before_round_1_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"run config 'codist-alpha': Input should be less than or equal to 1"):
        RunConfig.from_flower({"codist-alpha": 1.5})
    with pytest.raises(ConfigError, match=r"run config 'pfedknow-delta'"):
        RunConfig.from_flower({"pfedknow-delta": 0.0})


def test_every_group_key_belongs_to_one_group_and_some_method_reads_it() -> None:
    keys = [name for group in GROUPS for name in group.model_fields]
    assert len(keys) == len(set(keys))
    assert all(group_of(name) is not None and name in RunConfig.model_fields for name in keys)
    for group in GROUPS:
        assert any(group in e.settings for e in METHODS.values()), f"{group.__name__} is read by no method"
        for name, info in group.model_fields.items():
            assert KEY_METHODS[info.alias or name], f"{name}: no method reads it"


def test_readers_follow_the_entries_and_the_fields_filters() -> None:
    assert reads("merged", {"modes": ["merged"]}) and not reads("periodic", {"modes": ["merged"]})
    assert not reads("fedavg", {"but": ["fedavg"]}) and reads("merged", {"but": ["fedavg"]})
    assert reads("anything", None)
    assert KEY_METHODS["codist-alpha"] == ("codist-merged",)
    assert KEY_METHODS["beta"] == ("inclusivefl",)
    assert KEY_METHODS["distill-steps"] == ("codist-merged", "codist-periodic", "pfedknow", "pfedknow-as1",
                                            "pfedknow-as3", "pfedknow-as4", "semifl")  # fmt: skip
    assert KEY_METHODS["pfedknow-labeled-size"] == tuple(n for n, e in METHODS.items() if PFedKnowGroup in e.settings)
