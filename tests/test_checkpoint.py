"""Checkpoints: atomic write, verified read, corruption, incompatibility, keep-last-K, strategy round trips."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from experiment.config import ConfigError, RunConfig
from server.app import build_strategy, checkpoint_folder, restore, resume_point
from server.checkpoint import (
    CheckpointCorrupt,
    CheckpointIncompatible,
    capture_rng,
    checkpoint_path,
    clear_checkpoints,
    fingerprint,
    latest_checkpoint,
    list_checkpoints,
    prune_checkpoints,
    read_checkpoint,
    restore_rng,
    write_checkpoint,
)
from server.results import ResultsWriter
from strategies.base import HeterogeneousStrategy
from strategies.baselines import LocalTraining
from strategies.heterofl import HeteroFL
from strategies.inclusivefl import InclusiveFL
from strategies.profiles import NodeProfile
from tests.flower_runs import read_rounds
from tests.toy import constant_state, reply, sent, toy_catalog, trained

DEPTHS = {"weak": 1, "medium": 2, "strong": 3}
FP = fingerprint("inclusivefl", "toy", toy_catalog(DEPTHS))


def payload(value: float = 1.0) -> dict[str, Any]:
    return {"state": {"weak": {"w": torch.full((3,), value)}}, "rng": random.Random(0).getstate(), "rows": [{"a": 1}]}


# --- file format ------------------------------------------------------------------------------


def test_write_read_round_trip_is_exact(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, 3, payload(2.5), FP)
    assert path == tmp_path / "round-000003.ckpt"
    assert [p.name for p in tmp_path.iterdir()] == ["round-000003.ckpt"]  # no temporary left behind
    ckpt = read_checkpoint(path, FP)
    assert ckpt.server_round == 3 and ckpt.fingerprint == FP
    assert torch.equal(ckpt.payload["state"]["weak"]["w"], torch.full((3,), 2.5))
    assert ckpt.payload["rng"] == random.Random(0).getstate() and ckpt.payload["rows"] == [{"a": 1}]
    header = json.loads(path.read_bytes().split(b"\n", 1)[0])
    assert header["magic"] == "hetfl-checkpoint" and header["round"] == 3 and len(header["sha256"]) == 64


def test_rewrite_replaces_atomically(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 1, payload(1.0), FP)
    write_checkpoint(tmp_path, 1, payload(2.0), FP)
    assert torch.equal(
        read_checkpoint(checkpoint_path(tmp_path, 1)).payload["state"]["weak"]["w"], torch.full((3,), 2.0)
    )


def test_failed_write_leaves_previous_checkpoints_and_no_temporary(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 1, payload(), FP)
    with pytest.raises(Exception):  # noqa: B017 - torch.save of an unpicklable object fails, whatever type
        write_checkpoint(tmp_path, 2, {"bad": lambda: 0}, FP)
    assert [p.name for p in tmp_path.iterdir()] == ["round-000001.ckpt"]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda b: b[: len(b) // 2], "payload is"),  # truncated (crash while copying, full disk)
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum mismatch"),  # one flipped bit in the payload
        (lambda b: b.replace(b'"round": 2', b'"round": 5'), "checksum mismatch"),  # edited header
        (lambda b: b"", "no checkpoint header"),
        (lambda b: b"PK\x03\x04 some zip\n" + b[100:], "unreadable header"),
        (lambda b: b'{"magic": "x"}\n', "not a hetfl checkpoint"),
    ],
)
def test_corrupt_checkpoint_is_refused(tmp_path: Path, damage: Any, message: str) -> None:
    path = write_checkpoint(tmp_path, 2, payload(), FP)
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(CheckpointCorrupt, match=message):
        read_checkpoint(path, FP)


def test_other_format_version_is_incompatible(tmp_path: Path) -> None:
    path = write_checkpoint(tmp_path, 2, payload(), FP)
    path.write_bytes(path.read_bytes().replace(b'"version": 1', b'"version": 9', 1))
    with pytest.raises(CheckpointIncompatible, match="format version 9"):
        read_checkpoint(path, FP)


@pytest.mark.parametrize(
    ("other", "named"),
    [
        (fingerprint("heterofl", "toy", toy_catalog(DEPTHS)), "method 'heterofl'"),
        (fingerprint("inclusivefl", "minilm-l6", toy_catalog(DEPTHS)), "model 'minilm-l6'"),
        (fingerprint("inclusivefl", "toy", toy_catalog({"weak": 1, "strong": 3})), "variants"),
        (fingerprint("inclusivefl", "toy", toy_catalog(DEPTHS, dim=4)), "layouts"),
    ],
)
def test_incompatible_checkpoint_is_refused_naming_the_difference(tmp_path: Path, other: Any, named: str) -> None:
    path = write_checkpoint(tmp_path, 1, payload(), other)
    with pytest.raises(CheckpointIncompatible, match=named):
        read_checkpoint(path, FP)
    with pytest.raises(CheckpointIncompatible):
        latest_checkpoint(tmp_path, FP)


def test_keep_last_k_and_ignore_temporaries(tmp_path: Path) -> None:
    for t in range(1, 6):
        write_checkpoint(tmp_path, t, payload(float(t)), FP)
    (tmp_path / ".round-000006.ckpt.tmp").write_bytes(b"half")  # a crash mid-write
    (tmp_path / "notes.txt").write_text("mine")
    assert [t for t, _ in list_checkpoints(tmp_path)] == [1, 2, 3, 4, 5]
    removed = prune_checkpoints(tmp_path, 2)
    assert sorted(p.name for p in removed) == [".round-000006.ckpt.tmp", *(f"round-00000{t}.ckpt" for t in (1, 2, 3))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "round-000004.ckpt", "round-000005.ckpt"]
    with pytest.raises(ValueError):
        prune_checkpoints(tmp_path, 0)
    assert [p.name for p in clear_checkpoints(tmp_path)] == ["round-000004.ckpt", "round-000005.ckpt"]
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_latest_good_checkpoint_skips_a_corrupt_newest(tmp_path: Path) -> None:
    assert latest_checkpoint(tmp_path / "none", FP) is None
    write_checkpoint(tmp_path, 1, payload(1.0), FP)
    newest = write_checkpoint(tmp_path, 2, payload(2.0), FP)
    newest.write_bytes(newest.read_bytes()[:-10])
    ckpt = latest_checkpoint(tmp_path, FP)
    assert ckpt is not None and ckpt.server_round == 1
    checkpoint_path(tmp_path, 1).write_bytes(b"garbage")
    with pytest.raises(CheckpointCorrupt, match="no usable checkpoint"):
        latest_checkpoint(tmp_path, FP)


def test_rng_states_round_trip(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(5)
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    states = capture_rng({"g": gen})
    write_checkpoint(tmp_path, 1, {"rng": states}, FP)
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)), float(torch.rand(1, generator=gen)))
    loaded = read_checkpoint(checkpoint_path(tmp_path, 1)).payload["rng"]
    random.seed(9)
    np.random.seed(9)
    torch.manual_seed(9)
    gen.manual_seed(9)
    restore_rng(loaded, {"g": gen})
    assert (random.random(), float(np.random.rand()), float(torch.rand(1)), float(torch.rand(1, generator=gen))) == (
        expected
    )
    with pytest.raises(ValueError, match="RNG"):
        restore_rng({"python": "nope"})


# --- strategies -------------------------------------------------------------------------------


def round_replies(s: HeterogeneousStrategy, server_round: int, nodes: dict[int, str], shift: float) -> list:
    return [
        reply(sent(s, node, v), trained(s.variant_payload(node, v), shift * (node % 7 + 1)), server_round=server_round)
        for node, v in nodes.items()
    ]


def through_file(s: HeterogeneousStrategy, tmp_path: Path, server_round: int) -> dict[str, Any]:
    path = write_checkpoint(tmp_path, server_round, {"strategy": s.checkpoint_state()}, FP)
    return read_checkpoint(path, FP).payload["strategy"]


def assert_same_state(a: HeterogeneousStrategy, b: HeterogeneousStrategy) -> None:
    assert a.state.keys() == b.state.keys()
    for v, params in a.state.items():
        for k, t in params.items():
            assert torch.equal(t, b.state[v][k]), (v, k)


NODES = {1: "weak", 2: "medium", 3: "strong", 4: "strong"}


def test_inclusivefl_resumed_equals_uninterrupted(tmp_path: Path) -> None:
    cat = toy_catalog(DEPTHS)

    def make() -> InclusiveFL:
        s = InclusiveFL(catalog=cat, beta=0.3, seed=7)
        s.set_state(constant_state(cat, 0.5))
        return s

    straight, first = make(), make()
    for s in (straight, first):
        s.aggregate_train(1, round_replies(s, 1, NODES, 0.1))
    assert first.momenta and first.adam["strong"].step == 1
    resumed = make()
    resumed.load_checkpoint_state(through_file(first, tmp_path, 1), 1)
    assert resumed.global_round(1) == 2 and resumed.current_round == 1
    assert resumed.rng.getstate() == first.rng.getstate()
    straight.aggregate_train(2, round_replies(straight, 2, NODES, -0.2))
    resumed.aggregate_train(1, round_replies(resumed, 2, NODES, -0.2))  # Flower's round 1 = round 2
    assert resumed.report(2).groups["strong"]["clients"] == 2 and 1 not in resumed.reports
    assert_same_state(straight, resumed)
    for tier in DEPTHS:
        assert resumed.adam[tier].step == straight.adam[tier].step
        for k, m in straight.adam[tier].m.items():
            assert torch.equal(m, resumed.adam[tier].m[k]) and torch.equal(
                straight.adam[tier].v[k], resumed.adam[tier].v[k]
            )
    for tier, mom in straight.momenta.items():
        assert all(torch.equal(t, resumed.momenta[tier][k]) for k, t in mom.items())


def test_heterofl_fedadam_resumed_equals_uninterrupted(tmp_path: Path) -> None:
    cfg = RunConfig(model="tiny", method="fedrolex", tier_widths="0.25:0.5:1", heterofl_server_optimizer="fedadam")  # type: ignore[arg-type]

    def make() -> HeteroFL:
        s = build_strategy(cfg)
        assert isinstance(s, HeteroFL)
        torch.manual_seed(0)
        init = cfg.family().initial_states(cfg.catalog, seed=0)
        s.set_state({HeteroFL.GLOBAL: init["strong"]})
        return s

    def replies(s: HeteroFL, server_round: int) -> list:
        s.current_round = server_round  # configure_train sets it; FedRolex's window depends on it
        out = []
        for node, v in {1: "weak", 2: "medium", 3: "strong"}.items():
            payload = {k: t for k, t in s.variant_payload(node, v).items() if "word_embeddings" not in k}
            out.append(reply(sent(s, node, v), trained(payload, 0.01 * node), server_round=server_round))
        return out

    straight, first = make(), make()
    for s in (straight, first):
        s.aggregate_train(1, replies(s, 1))
    resumed = make()
    resumed.load_checkpoint_state(through_file(first, tmp_path, 1), 1)
    assert resumed.adam.step == 1 and resumed.current_round == 1
    straight.aggregate_train(2, replies(straight, 2))
    resumed.aggregate_train(1, replies(resumed, 2))
    assert_same_state(straight, resumed)
    assert resumed.adam.step == 2


def test_local_models_follow_their_node_to_its_new_id(tmp_path: Path) -> None:
    cat = toy_catalog(DEPTHS)
    s = LocalTraining(catalog=cat)
    s.set_state(constant_state(cat, 0.0))
    s.profiles = {
        n: NodeProfile(n, v, 100.0, 10, True, v, "", key=f"partition-{i}") for i, (n, v) in enumerate(NODES.items())
    }
    s.aggregate_train(1, round_replies(s, 1, NODES, 1.0))
    own = {n: {k: t.clone() for k, t in s.node_states[n].items()} for n in NODES}
    data = through_file(s, tmp_path, 1)
    resumed = LocalTraining(catalog=cat)
    resumed.set_state(constant_state(cat, 0.0))
    resumed.load_checkpoint_state(data, 1)
    # after the restart three of the partitions come back under new node ids; node 4 stays away
    for i, (n, v) in enumerate(list(NODES.items())[:3]):
        resumed.profiles[100 + n] = profile = NodeProfile(100 + n, v, 100.0, 10, True, v, "", key=f"partition-{i}")
        old = resumed._restored_nodes.pop(profile.stable_key)
        resumed.rebind_node(old, 100 + n)
    for n, v in list(NODES.items())[:3]:
        assert all(torch.equal(t, own[n][k]) for k, t in resumed.variant_payload(100 + n, v).items())
    assert set(resumed.node_states) == {101, 102, 103, 4}
    # a second checkpoint still knows who node 4 was
    again = LocalTraining(catalog=cat)
    again.set_state(constant_state(cat, 0.0))
    again.load_checkpoint_state(through_file(resumed, tmp_path, 2), 2)
    assert again._restored_nodes == {"partition-0": 101, "partition-1": 102, "partition-2": 103, "partition-3": 4}


def test_load_refuses_state_of_another_strategy_or_catalog(tmp_path: Path) -> None:
    cat = toy_catalog(DEPTHS)
    s = InclusiveFL(catalog=cat)
    s.set_state(constant_state(cat, 0.0))
    data = through_file(s, tmp_path, 1)
    other = LocalTraining(catalog=cat)
    with pytest.raises(ValueError, match="InclusiveFL"):
        other.load_checkpoint_state(data, 1)
    small = InclusiveFL(catalog=toy_catalog({"weak": 1, "strong": 3}))
    with pytest.raises(ValueError):
        small.load_checkpoint_state(data, 1)
    data["method"]["adam"].pop("weak")
    with pytest.raises(ValueError, match="FedAdam"):
        InclusiveFL(catalog=cat).load_checkpoint_state(data, 1)


# --- the server's resume path -----------------------------------------------------------------


def tiny_cfg(tmp_path: Path, **kw: Any) -> RunConfig:
    return RunConfig.model_validate(
        {"model": "tiny", "results-dir": str(tmp_path), "run-name": "run", "num-server-rounds": 3, **kw}
    )


def test_fresh_run_clears_stale_checkpoints_and_resume_picks_the_newest(tmp_path: Path) -> None:
    cfg = tiny_cfg(tmp_path)
    folder = checkpoint_folder(cfg, tmp_path / "run")
    assert folder == tmp_path / "run" / "checkpoints"
    fp = fingerprint(cfg.method, cfg.model, cfg.catalog)
    for t in (1, 2):
        write_checkpoint(folder, t, payload(), fp)
    resumed = resume_point(tiny_cfg(tmp_path, resume=True), folder, fp)
    assert resumed is not None and resumed.server_round == 2
    with pytest.raises(ConfigError, match="num-server-rounds"):
        resume_point(tiny_cfg(tmp_path, resume=True, **{"num-server-rounds": 1}), folder, fp)
    with pytest.raises(CheckpointIncompatible, match="method"):
        other = tiny_cfg(tmp_path, method="all-large", resume=True)
        resume_point(other, folder, fingerprint(other.method, other.model, other.catalog))
    assert resume_point(cfg, folder, fp) is None  # fresh run
    assert list_checkpoints(folder) == []
    assert resume_point(tiny_cfg(tmp_path, resume=True), folder, fp) is None  # nothing to resume: start over


def test_restore_checks_the_results_rows(tmp_path: Path) -> None:
    cfg = tiny_cfg(tmp_path)
    s = InclusiveFL(catalog=toy_catalog(DEPTHS))
    s.set_state(constant_state(s.catalog, 0.0))
    evaluator = type("E", (), {"generators": lambda self: {}})()
    rows = [{"round": 0}, {"round": 1}]
    good = {"strategy": s.checkpoint_state(), "rng": capture_rng(), "results": rows}
    fp = fingerprint(cfg.method, cfg.model, cfg.catalog)
    ckpt = read_checkpoint(write_checkpoint(tmp_path, 1, good, fp), fp)
    arrays, got = restore(s, evaluator, ckpt)  # type: ignore[arg-type]
    assert got == rows and "weak/classifier.weight" in arrays and s.round_offset == 1
    bad = read_checkpoint(write_checkpoint(tmp_path, 2, good, fp), fp)  # rows 0..1 in a round-2 checkpoint
    with pytest.raises(CheckpointIncompatible, match="results rows"):
        restore(s, evaluator, bad)  # type: ignore[arg-type]
    broken = read_checkpoint(write_checkpoint(tmp_path, 3, {"results": rows}, fp), fp)
    with pytest.raises(CheckpointIncompatible):
        restore(s, evaluator, broken)  # type: ignore[arg-type]


def test_results_writer_resumes_without_duplicating_rounds(tmp_path: Path) -> None:
    central = {"weak": {"accuracy": 0.5, "loss": 0.7}}
    w = ResultsWriter(tmp_path / "run", method="m", tiers=["weak"], config={}, held_out=("test", 10, 0.5))
    for t in range(4):  # the crashed run logged round 3, but its last checkpoint is after round 2
        w.write_round(t, central, None)
    ResultsWriter(
        tmp_path / "run", method="m", tiers=["weak"], config={}, held_out=("test", 10, 0.5), rows=w.rows[:3]
    ).write_round(3, central, None)
    assert [r["round"] for r in read_rounds(tmp_path / "run")] == [0, 1, 2, 3]
    assert not any(p.name.endswith(".tmp") for p in (tmp_path / "run").iterdir())


def test_resume_config_needs_a_place_to_resume_from() -> None:
    with pytest.raises(ConfigError, match="'resume'"):
        RunConfig.from_flower({"resume": True})
    with pytest.raises(ConfigError, match="checkpoint-keep"):
        RunConfig.from_flower({"resume": True, "run-name": "x", "checkpoint-keep": 0})
    cfg = RunConfig.from_flower({"resume": True, "checkpoint-dir": "~/ckpt"})
    assert checkpoint_folder(cfg, Path("/r")) == Path(os.path.expanduser("~/ckpt")).resolve()


def test_group_fedadam_states_round_trip_and_name_the_groups_that_differ() -> None:
    from strategies.fedadam import FedAdamState, group_states_from_dict, group_states_to_dict

    states = {"weak": FedAdamState(m={"w": torch.ones(2)}, v={"w": torch.full((2,), 4.0)}, step=3)}
    back = group_states_from_dict(group_states_to_dict(states), ["weak"], "tiers")
    assert back["weak"].step == 3 and torch.equal(back["weak"].v["w"], torch.full((2,), 4.0))
    with pytest.raises(ValueError, match=r"are for pools \['weak'\], not \['large', 'small'\]"):
        group_states_from_dict(group_states_to_dict(states), ["small", "large"], "pools")
    with pytest.raises(ValueError, match=r"are for tiers \[\], not \['weak'\]"):
        group_states_from_dict(None, ["weak"], "tiers")
