"""Smoke test of bench.heterofl_aggregation: output structure and correctness (never timing)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from bench.evaluation import main as evaluation_main
from bench.heterofl_aggregation import METHODS, dense_state, dense_weighted_mean, main
from strategies.heterofl import coverage_aggregate

PER_METHOD_KEYS = {
    "best_s",
    "median_s",
    "times_s",
    "reply_bytes",
    "gbps",
    "state_bytes",
    "state_over_model",
    "peak_rss_growth_bytes",
}


def test_conv_report_structure_and_heterofl_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "report.json"
    run = main(["--model", "conv", "--base", "4,8", "--clients", "4", "--repeats", "1", "--json", str(out)])
    report = run.report

    assert "heterofl" in capsys.readouterr().out
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert set(report) >= {"config", "machine", "model", "methods", "heterofl_phases_s", "ratio_heterofl_over_dense"}
    assert report["config"]["clients"] == 4 and report["config"]["rates"] == [0.25, 0.5, 1.0]
    assert tuple(report["methods"]) == METHODS
    for m in report["methods"].values():
        assert set(m) == PER_METHOD_KEYS
        assert len(m["times_s"]) == 1 and m["best_s"] > 0 and m["gbps"] > 0
    assert set(report["heterofl_phases_s"]) == {"init", "index_sets", "add", "result"}
    assert report["ratio_heterofl_over_dense"] > 0

    work = run.workload
    assert [r.rate for r in work.replies] == [0.25, 0.5, 1.0, 0.25]
    model_bytes = report["model"]["bytes"]
    # O(model), whatever the number of replies
    largest = max(t.numel() * t.element_size() for t in work.full.values())
    assert report["methods"]["heterofl"]["state_bytes"] == model_bytes + largest  # S, plus one W at a time
    assert report["methods"]["fedavg-full"]["state_bytes"] == model_bytes
    reply_bytes = sum(t.numel() * t.element_size() for r in work.replies for t in r.params.values())
    assert report["methods"]["heterofl"]["reply_bytes"] == reply_bytes < 4 * model_bytes

    # the benchmarked aggregation is the strategy's: equal to coverage_aggregate
    ref = coverage_aggregate(work.full, work.rules, [(r.params, r.rate, 0, r.weight) for r in work.replies])
    assert set(run.heterofl_result) == set(ref)
    for name, t in ref.items():
        torch.testing.assert_close(run.heterofl_result[name], t, rtol=0, atol=0)

    # elements only the rate-1 client covers equal the dense rate-1 "mean" (its own values)
    dense = dense_weighted_mean(work.replies, dense_state(work.replies))[1.0]
    w = "blocks.1.conv.weight"  # (8, 4, 3, 3); rate 0.5 covers [:4, :2]
    torch.testing.assert_close(run.heterofl_result[w][4:, 2:], dense[w][4:, 2:])
    assert not torch.equal(run.heterofl_result[w], work.full[w])


def test_transformer_replies_skip_frozen_word_embeddings() -> None:
    run = main(["--model", "tiny", "--clients", "3", "--repeats", "1", "--no-memory"])
    work, report = run.workload, run.report
    emb = "bert.embeddings.word_embeddings.weight"
    assert report["model"]["frozen_not_uploaded"] == [emb]
    assert all(emb not in r.params for r in work.replies)
    assert all(m["peak_rss_growth_bytes"] is None for m in report["methods"].values())
    # never uploaded: unchanged, bit for bit
    assert torch.equal(run.heterofl_result[emb], work.full[emb])
    ref = coverage_aggregate(work.full, work.rules, [(r.params, r.rate, 0, r.weight) for r in work.replies])
    for name, t in ref.items():
        torch.testing.assert_close(run.heterofl_result[name], t, rtol=0, atol=0)


# --- bench.aggregation, bench.server_memory, bench.communication, bench.tier_memory, bench.simulation ---


def test_aggregation_smoke_report_and_references_agree(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.aggregation import BARE, FLOWER, methods_for
    from bench.aggregation import main as agg_main

    report = agg_main(["--smoke", "--models", "tiny"])
    out = capsys.readouterr().out
    assert "tiny, R=3, homogeneous" in out and "tiny, R=3, mixed" in out
    cases = {(c["model"], c["scenario"]): c for c in report["cases"]}
    homo, mixed = cases["tiny", "homogeneous"], cases["tiny", "mixed"]
    assert set(homo["methods"]) == {*methods_for("tiny"), BARE, FLOWER}
    assert FLOWER not in mixed["methods"]
    for case in (homo, mixed):
        for name, m in case["methods"].items():
            assert m["best_s"] > 0 and m["reply_bytes"] > 0, name
            assert m["x_bare"] is not None and m["x_bare"] > 0, name
    assert homo["methods"][BARE]["x_bare"] == 1.0 and homo["methods"][FLOWER]["x_flower"] == 1.0


def test_aggregation_bench_replies_are_accepted_and_plain_means_match_flower() -> None:
    import numpy as np

    from bench.aggregation import array_view, bare_weighted_sum, build_round, flower_fedavg

    r = build_round("tiny", "heterofl", 3, scenario="homogeneous")
    for msg in r.replies:  # the zero-copy view reads exactly what Array.numpy() decodes
        for arr in msg.content.array_records["arrays"].values():
            assert np.array_equal(array_view(arr).numpy(), arr.numpy())
    bare = bare_weighted_sum(r.replies, r.variants)["strong"]
    flower = flower_fedavg(r.flower_replies)
    assert flower is not None
    r.reset()
    arrays, _ = r.strategy.aggregate_train(1, r.replies)
    assert arrays is not None and r.strategy.report(1).rejected == []
    for name, t in bare.items():
        # HeteroFL over rate-1 replies is the plain example-weighted mean: = bare sum = Flower's FedAvg
        torch.testing.assert_close(r.strategy.state["global"][name], t, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(torch.from_numpy(flower[name].numpy()), t, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("held", [False, True], ids=["streamed", "held"])
def test_server_memory_child_measures_one_round(held: bool) -> None:
    from bench.server_memory import child

    row = child("tiny", "inclusivefl", 3, "mixed", held)
    assert row["replies"] == 3 and row["held"] is held
    assert row["peak_mb"] >= row["baseline_mb"] and row["server_state_mb"] > 0


def test_communication_bytes_follow_the_variants() -> None:
    from bench.communication import sparse_bytes, tier_bytes

    rows = {r["variant"]: r for r in tier_bytes("tiny", "heterofl")}
    assert rows["weak"]["up_bytes"] < rows["medium"]["up_bytes"] < rows["strong"]["up_bytes"]
    for r in rows.values():  # the payload plus one .npy header (<= 256 B) per tensor
        assert r["up_tensor_bytes"] < r["up_bytes"] <= r["down_bytes"]
    sparse = sparse_bytes("tiny", "inclusivefl", [0.5])
    if sparse:  # models.sparse present
        assert all(s["sparse_bytes"] < s["dense_bytes"] for s in sparse)


def test_tier_memory_child_reports_estimate_and_measurement() -> None:
    from bench.tier_memory import child

    row = child("tiny-depth", "weak", 1)
    assert row["estimated_mb"] > 0 and row["measured_mb"] >= 0 and row["params"] > 0


def test_device_bench_smoke_times_the_training_loop(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.device import main as device_main

    report = device_main(["--smoke"])
    (row,) = report["rows"]
    assert row["device"] == "cpu" and row["steps"] == 2 and row["seconds"] > 0 and row["speed_up"] == 1.0
    assert "tiny" in capsys.readouterr().out
    with pytest.raises(ValueError, match="'cuda:7' asked for"):
        device_main(["--cases", "tiny", "--devices", "cpu,cuda:7", "--steps", "1"])


def test_simulation_bare_loop_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    from bench.simulation import main as sim_main

    rows = sim_main(["overhead", "--smoke"])["bare_rounds"]
    assert [r["round"] for r in rows] == [1, 2]
    assert all(r["train_s"] > 0 and r["total_s"] >= r["train_s"] for r in rows)


def test_process_sampler_kinds_and_cpu_between(tmp_path: Path) -> None:
    import subprocess
    import sys

    from bench.simulation import ProcessSampler, _kind

    assert _kind("/x/bin/flower-superlink --insecure") == "superlink"
    assert _kind("ray::ClientAppActor.run") == "clientapp"
    assert _kind("/x/bin/flwr-simulation --token t") == "serverapp"
    assert _kind("/x/site-packages/ray/core/src/ray/raylet/raylet --node") == "ray"
    assert _kind("python -m bench.simulation overhead") is None and _kind("python -m tray --array") is None
    s = ProcessSampler()
    s.samples = [(0.0, {1: ("superlink", 1.0)}), (1.0, {1: ("superlink", 1.5), 2: ("clientapp", 2.0)})]
    s.samples.append((2.0, {1: ("superlink", 1.75), 2: ("clientapp", 3.0)}))
    cpu = s.cpu_between(0.0, 2.0)  # pid 2 was born after t = 0: counts from 0
    assert cpu["superlink"] == 0.75 and cpu["clientapp"] == 3.0 and cpu["serverapp"] == 0.0
    assert s.cpu_between(1.0, 2.0)["clientapp"] == 1.0
    # a real process that burns CPU under a matching name, and rows appearing in a rounds file
    rounds = tmp_path / "rounds.jsonl"
    burn = "import time\nwhile time.process_time() < 0.5: pass"  # 0.5 s of CPU, whatever the load
    with ProcessSampler(rounds, interval=0.05) as live:
        rounds.write_text("{}\n")
        subprocess.run([sys.executable, "-c", burn, "flower-superlink"], check=True)
        rounds.write_text("{}\n{}\n")
        time.sleep(0.2)
    assert len(live.row_times) == 2 and live.row_times[0] <= live.row_times[1]
    assert 0.4 < live.cpu_between(live.samples[0][0], live.samples[-1][0])["superlink"] < 2.0


def test_scale_server_child_samples_per_round_from_all_nodes() -> None:
    from bench.scale_server import child

    row = child(12, 4, 2, "tiny")
    assert row["per_round"] == [4, 4] and len(row["round_s"]) == 2 and row["peak_growth_mb"] >= 0


def test_superlink_state_smoke_reports_every_cost(tmp_path: Path) -> None:
    from bench.superlink_state import main as state_main

    out = tmp_path / "state.json"
    assert state_main(["--smoke", "--json", str(out)]) == 0
    result = json.loads(out.read_text())["superlink_state"]
    assert result["nodes"] == 20
    for key in ("heartbeat_ms", "idle_pull_ms", "key_lookup_ms", "verify_signature_ms", "list_online_ms"):
        assert result[key] > 0, key
    assert result["db_bytes_per_node"] > 0


def test_evaluation_bench_smoke_compares_the_two_layouts_of_one_model(tmp_path: Path) -> None:
    out = tmp_path / "evaluation.json"
    report = evaluation_main(["--smoke", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    (row,) = report["rows"]
    assert row["case"] == "tiny-vgg" and row["images"] == 64
    assert set(row["best_s"]) == {"default", "channels-last"} and row["speed_up"] > 0
    assert row["max_abs_logit_diff"] < 1e-4 and row["changed_predictions"] == 0
