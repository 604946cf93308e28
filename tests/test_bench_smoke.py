"""Smoke test of bench.heterofl_aggregation: output structure and correctness (never timing)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

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
