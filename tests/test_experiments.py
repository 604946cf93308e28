"""The experiment runner: suites as data, aggregation over seeds, tables and plots, one tiny suite run."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import math
import subprocess
from pathlib import Path

import pytest

from deploy import archive as archive_mod
from deploy import console, reports
from deploy import experiments as ex
from deploy.experiments import Preset, Suite, SuiteError, SuiteRun
from deploy.flower import code_version
from deploy.markdown import markdown_rows
from deploy.reports import Cell, RunResult
from experiment.config import RunConfig
from tests.toy import finished_suite_run

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def fake_results() -> list[RunResult]:
    """Two methods x two seeds; ExclusiveFL has no weak tier; fed-style gaps in one curve."""
    return [
        RunResult("InclusiveFL", 42, {"weak": {0: 0.5, 1: 0.6, 2: 0.7}, "strong": {0: 0.5, 1: 0.8, 2: 0.75}}, 30.0,
                  ("weak", "strong")),
        RunResult("InclusiveFL", 43, {"weak": {0: 0.5, 1: 0.7, 2: 0.7}, "strong": {0: 0.5, 1: 0.7, 2: 0.85}}, 34.0,
                  ("weak", "strong")),
        RunResult("ExclusiveFL", 42, {"strong": {0: 0.5, 2: 0.6}}, 20.0, ("weak", "strong")),
        RunResult("ExclusiveFL", 43, {"strong": {0: 0.5, 1: 0.55, 2: 0.65}}, 22.0, ("weak", "strong")),
    ]  # fmt: skip


# ------------------------------------------------------------------------------- statistics
def test_mean_se_is_sample_sd_over_sqrt_n() -> None:
    mean, se = reports.mean_se([0.8, 0.9, 1.0])
    assert mean == pytest.approx(0.9)
    assert se == pytest.approx(0.1 / math.sqrt(3))  # sd = 0.1 (Bessel-corrected)
    mean, se = reports.mean_se([0.7, 0.7])
    assert (mean, se) == (pytest.approx(0.7), 0.0)


def test_mean_se_one_value_has_undefined_se_and_empty_fails() -> None:
    mean, se = reports.mean_se([0.42])
    assert mean == 0.42 and math.isnan(se)
    with pytest.raises(ValueError, match="at least one"):
        reports.mean_se([])


def test_rounds_to_best_is_the_first_round_at_the_maximum() -> None:
    assert reports.rounds_to_best({0: 0.5, 1: 0.7, 2: 0.9, 3: 0.9, 4: 0.8}) == 2.0
    assert reports.rounds_to_best({0: 0.566, 1: 0.566, 2: 0.5}) == 0.0  # never improves: round 0
    assert reports.rounds_to_best({0: 0.1, 3: 0.4, 5: 0.3}) == 3.0  # rounds with gaps (fed-accuracy)


def test_final_and_best_values() -> None:
    curve = {2: 0.6, 0: 0.5, 5: 0.55, 3: 0.7}
    assert reports.final_value(curve) == 0.55
    assert reports.best_value(curve) == 0.7


def test_summarize_final_over_seeds_per_label_and_tier() -> None:
    cells = {(c.label, c.tier): c for c in reports.summarize(fake_results(), "final")}
    assert set(cells) == {("InclusiveFL", "weak"), ("InclusiveFL", "strong"), ("ExclusiveFL", "strong")}
    strong = cells[("InclusiveFL", "strong")]
    assert strong.values == (0.75, 0.85) and strong.n == 2
    assert strong.mean == pytest.approx(0.8)
    assert strong.se == pytest.approx(math.sqrt(((0.05**2) * 2) / 1) / math.sqrt(2))  # = 0.05
    assert cells[("InclusiveFL", "weak")].se == 0.0
    assert cells[("ExclusiveFL", "strong")].mean == pytest.approx(0.625)


def test_summarize_rounds_to_best_and_best() -> None:
    rtb = {(c.label, c.tier): c for c in reports.summarize(fake_results(), "rounds-to-best")}
    assert rtb[("InclusiveFL", "strong")].values == (1.0, 2.0)
    assert rtb[("InclusiveFL", "weak")].values == (2.0, 1.0)
    assert rtb[("ExclusiveFL", "strong")].mean == 2.0
    best = {(c.label, c.tier): c for c in reports.summarize(fake_results(), "best")}
    assert best[("InclusiveFL", "strong")].values == (0.8, 0.85)


def test_orders_follow_config_tiers_then_first_seen() -> None:
    res = fake_results()
    assert reports.tier_order(res) == ["weak", "strong"]
    assert reports.label_order(res) == ["InclusiveFL", "ExclusiveFL"]
    assert reports.tier_order([RunResult("x", 1, {"b": {0: 1.0}, "z": {0: 1.0}}, 0.0, ("a", "b"))]) == ["b", "z"]


def test_wall_times() -> None:
    walls = reports.wall_times(fake_results())
    assert walls["InclusiveFL"] == (pytest.approx(32.0), pytest.approx(2.0 * math.sqrt(2) / math.sqrt(2)))


def test_mean_curve_uses_the_seeds_that_measured_each_round() -> None:
    rounds, means, ses = reports.mean_curve([{0: 0.5, 2: 0.6}, {0: 0.5, 1: 0.55, 2: 0.65}])
    assert rounds == [0, 1, 2]
    assert means == pytest.approx([0.5, 0.55, 0.625])
    assert ses == pytest.approx([0.0, 0.0, 0.025])  # one seed at round 1: no spread drawn


# ------------------------------------------------------------------------------- writers
def test_markdown_table_exact() -> None:
    cells = [
        Cell("A", "weak", "final", (0.5, 0.7), 0.6, 0.1),
        Cell("A", "strong", "final", (0.9,), 0.9, math.nan),
        Cell("B", "strong", "final", (0.8, 0.8), 0.8, 0.0),
    ]
    text = reports.markdown_table(cells, labels=["A", "B"], tiers=["weak", "strong"])
    assert text == (
        "| run | weak | strong | seeds |\n"
        "| --- | --- | --- | --- |\n"
        "| A | 0.600 ± 0.100 | 0.900 | 1/2 |\n"
        "| B | — | 0.800 ± 0.000 | 2 |\n"
    )


def test_markdown_rows_exact_and_rejects_a_ragged_row() -> None:
    assert markdown_rows(["run", "r5"], [["a-s1", "+1.0"], ["b-s1", "-2.5"]]) == (
        "| run | r5 |\n| --- | --- |\n| a-s1 | +1.0 |\n| b-s1 | -2.5 |"
    )
    assert markdown_rows(["run"], []) == "| run |\n| --- |"
    with pytest.raises(ValueError, match="has 1 cells, the header 2"):
        markdown_rows(["run", "r5"], [["a-s1"]])


def test_points_table_names_runs_and_scales_to_points() -> None:
    rows: dict[reports.RunKey, list[float]] = {("A", 42): [0.5, -0.0125], ("B", 7): [1.0, 0.25]}
    assert reports.points_table(["r5", "r9"], rows, fmt="{:+.2f}") == (
        "| run | r5 | r9 |\n| --- | --- | --- |\n| A (seed 42) | +50.00 | -1.25 |\n| B (seed 7) | +100.00 | +25.00 |"
    )


def test_csv_table_round_trips_the_numbers() -> None:
    cells = reports.summarize(fake_results(), "final")
    rows = list(csv.DictReader(io.StringIO(reports.csv_table(cells, suite="s", preset="cpu", metric="local-accuracy"))))
    assert [(r["label"], r["tier"]) for r in rows] == [
        ("InclusiveFL", "weak"),
        ("InclusiveFL", "strong"),
        ("ExclusiveFL", "strong"),
    ]
    strong = rows[1]
    assert strong["statistic"] == "final" and strong["n"] == "2" and strong["metric"] == "local-accuracy"
    assert float(strong["mean"]) == pytest.approx(0.8) and float(strong["se"]) == pytest.approx(0.05)
    assert [float(v) for v in strong["values"].split()] == [0.75, 0.85]
    one = reports.csv_table([Cell("A", "t", "final", (0.3,), 0.3, math.nan)], suite="s", preset="p", metric="m")
    assert next(csv.DictReader(io.StringIO(one)))["se"] == ""


def test_write_report_writes_markdown_csv_and_png(tmp_path: Path) -> None:
    suite = Suite(
        "fake", "a fake suite", "claim", "local-accuracy", (SuiteRun("InclusiveFL"),), {"cpu": Preset("cpu", 6)}
    )
    paths = reports.write_report(suite, "cpu", fake_results(), tmp_path, command="python -m deploy.experiments fake")
    assert [p.name for p in paths] == ["table.md", "table.csv", "convergence.png"]
    md = (tmp_path / "table.md").read_text()
    assert "| InclusiveFL | 0.700 ± 0.000 | 0.800 ± 0.050 | 2 |" in md  # final
    assert "| ExclusiveFL | — | 0.625 ± 0.025 | 2 |" in md
    assert "| InclusiveFL | 1.5 ± 0.5 | 1.5 ± 0.5 | 2 |" in md  # rounds to best
    assert "| InclusiveFL | 32 ± 2 |" in md and "`python -m deploy.experiments fake`" in md
    rows = list(csv.DictReader((tmp_path / "table.csv").open()))
    assert {r["statistic"] for r in rows} == {"final", "best", "rounds-to-best"} and len(rows) == 9
    png = (tmp_path / "convergence.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 5000


def test_read_run_from_a_results_folder(tmp_path: Path) -> None:
    rows = [
        {"round": 0, "elapsed": 5.0, "tiers": {"weak": {"local-accuracy": 0.5}, "strong": {"local-accuracy": 0.4}}},
        {"round": 1, "elapsed": 40.5, "tiers": {"strong": {"local-accuracy": 0.7, "fed-accuracy": 0.72}}},
    ]
    (tmp_path / "rounds.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "config.json").write_text(json.dumps({"tiers": "weak:medium:strong"}))
    res = reports.read_run(tmp_path, label="L", seed=7, metric="local-accuracy")
    assert res.curves == {"weak": {0: 0.5}, "strong": {0: 0.4, 1: 0.7}}
    assert res.seconds == 40.5 and res.tiers == ("weak", "medium", "strong") and res.seed == 7
    assert reports.read_run(tmp_path, label="L", seed=7, metric="fed-accuracy").curves == {"strong": {1: 0.72}}
    both = reports.read_run(tmp_path, label="L", seed=7, metric="local-accuracy", other_metrics=("fed-accuracy",))
    assert both.curves == res.curves and both.tier_curves("fed-accuracy") == {"strong": {1: 0.72}}
    assert both.tier_curves() == res.curves and both.tier_curves("loss") == {}
    named = reports.read_run(tmp_path, label="L", seed=7, metric="local-accuracy", other_metrics=("local-accuracy",))
    assert named.tier_curves("local-accuracy") == res.curves  # a claim may name the suite's metric on one side


def test_the_deepest_exit_metric_reads_each_tiers_last_exit() -> None:
    weak = {"local-accuracy": 0.7, "local-exit-1-accuracy": 0.6, "local-exit-2-accuracy": 0.65}
    strong = {**weak, "local-exit-10-accuracy": 0.81, "local-exit-9-accuracy": 0.8, "fed-exit-3-accuracy": 0.1}
    assert reports.metric_value(weak, "local-exit-deepest-accuracy") == 0.65
    assert reports.metric_value(strong, "local-exit-deepest-accuracy") == 0.81  # 10 > 9 as numbers
    assert reports.metric_value(strong, "fed-exit-deepest-accuracy") == 0.1
    assert reports.metric_value({"local-accuracy": 0.7}, "local-exit-deepest-accuracy") is None
    assert reports.metric_value(weak, "local-accuracy") == 0.7 and reports.metric_value(weak, "loss") is None


def test_format_round_progress_line() -> None:
    row = {"round": 3, "seconds": 41.24, "tiers": {"weak": {"local-accuracy": 0.5}, "strong": {"x": 1}}}
    assert console.format_round(row, "local-accuracy", 10) == "    round 3/10 (41.2 s): weak 0.500"


# ------------------------------------------------------------------------------- suites
def write_config(tmp_path: Path) -> Path:
    cfg = tmp_path / "base.toml"
    cfg.write_text("method = 'heterofl'\nnum-server-rounds = 20\nlr = 0.05\n")
    return cfg


def test_plan_precedence_file_preset_run_seed(tmp_path: Path) -> None:
    write_config(tmp_path)
    suite = ex.parse_suite(
        "s",
        {
            "config": "base.toml",
            "presets": {"cpu": {"supernodes": 4, "seeds": 2, "overrides": {"num-server-rounds": 3, "lr": 0.1}}},
            "runs": [
                {"label": "HeteroFL a-e", "overrides": {"lr": 0.2}},
                {"label": "FedAvg", "overrides": {"method": "all-small", "seed": 1}},
            ],
        },
        base=tmp_path,
    )
    plan = ex.plan_runs(suite, "cpu", 2)
    assert [(p.label, p.seed) for p in plan] == [
        ("HeteroFL a-e", 42),
        ("FedAvg", 42),
        ("HeteroFL a-e", 43),
        ("FedAvg", 43),
    ]
    assert plan[0].run_name == "heterofl-a-e-s42" and plan[0].supernodes == 4
    assert plan[0].run_config == "method='heterofl' num-server-rounds=3 lr=0.2 seed=42"
    assert plan[3].run_config == "method='all-small' num-server-rounds=3 lr=0.1 seed=43"  # the seed wins
    assert [p.label for p in ex.plan_runs(suite, "cpu", 1, only=["fedavg"])] == ["FedAvg"]
    with pytest.raises(SuiteError, match="no preset 'paper'"):
        ex.plan_runs(suite, "paper", 1)
    with pytest.raises(SuiteError, match="matches no run"):
        ex.plan_runs(suite, "cpu", 1, only=["nope"])


def test_control_rows_run_only_when_named_or_asked_for(tmp_path: Path) -> None:
    doc = {
        "presets": {"cpu": {"supernodes": 2}},
        "runs": [{"label": "a"}, {"label": "a control", "control": True}, {"label": "b", "control": False}],
    }
    suite = ex.parse_suite("s", doc, base=tmp_path)
    assert [r.control for r in suite.runs] == [False, True, False]
    assert [p.label for p in ex.plan_runs(suite, "cpu", 1)] == ["a", "b"]  # the preset's own rows
    assert [p.label for p in ex.plan_runs(suite, "cpu", 1, with_controls=True)] == ["a", "a control", "b"]
    assert [p.label for p in ex.plan_runs(suite, "cpu", 1, only=["a-control"])] == ["a control"]
    with pytest.raises(SuiteError, match=r"runs\[0\]\.control: expected true or false"):
        ex.parse_suite("s", {**doc, "runs": [{"label": "a", "control": "yes"}]}, base=tmp_path)


def test_parts_group_rows_and_cover_every_row_that_is_not_a_control(tmp_path: Path) -> None:
    doc = {
        "presets": {"cpu": {"supernodes": 2}},
        "runs": [{"label": "a"}, {"label": "b"}, {"label": "c"}, {"label": "d", "control": True}],
        "parts": {"ab": {"rows": ["b", "a"], "notes": "claim 1"}, "bc": {"rows": ["c", "b"]}},
    }
    suite = ex.parse_suite("s", doc, base=tmp_path)
    assert suite.parts["ab"] == ex.Part("ab", ("b", "a"), "claim 1")
    assert suite.rows_of_parts(["ab"]) == ["a", "b"]  # the suite's row order
    assert suite.rows_of_parts(["bc", "ab"]) == ["a", "b", "c"]  # a shared row once
    assert [p.label for p in ex.plan_runs(suite, "cpu", 1, only=suite.rows_of_parts(["bc"]))] == ["b", "c"]
    with pytest.raises(SuiteError, match="has no part 'x' \\(has ab, bc\\)"):
        suite.rows_of_parts(["x"])
    with pytest.raises(SuiteError, match=r"rows \['c'\] belong to no part"):
        ex.parse_suite("s", {**doc, "parts": {"ab": {"rows": ["a", "b"]}}}, base=tmp_path)
    with pytest.raises(SuiteError, match=r"parts.ab.rows: \['e'\] are not labels"):
        ex.parse_suite("s", {**doc, "parts": {"ab": {"rows": ["a", "b", "c", "e"]}}}, base=tmp_path)
    with pytest.raises(SuiteError, match=r"parts.ab: unknown keys \['seeds'\]"):
        ex.parse_suite("s", {**doc, "parts": {"ab": {"rows": ["a", "b", "c"], "seeds": 3}}}, base=tmp_path)


def test_a_suite_with_parts_runs_one_part_per_call(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "parted.toml"
    path.write_text(
        'description = "d"\n[presets.cpu]\nsupernodes = 3\nnotes = "n"\nin-parts = true\n'
        '[presets.big]\nsupernodes = 3\nnotes = "n"\n'
        '[[runs]]\nlabel = "a"\n[[runs]]\nlabel = "b"\n'
        '[parts.first]\nrows = ["a"]\n[parts.second]\nrows = ["b"]\n'
    )
    out = ["--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit):  # the whole suite is over the cpu budget: the error names the parts
        ex.main([str(path), *out])
    assert "--part first (a); --part second (b)" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ex.main([str(path), "--part", "third", *out])
    assert "has no part 'third'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ex.main([str(path), "--part", "first", "--only", "b", *out])
    assert ex.main([str(path), "--part", "second", "--dry-run", "--seeds", "1", *out]) == 0
    plan = capsys.readouterr().out
    assert "b seed 42" in plan and "a seed 42" not in plan
    assert ex.main([str(path), "--preset", "big", "--dry-run", "--seeds", "1", *out]) == 0  # a preset run whole
    plan = capsys.readouterr().out
    assert "a seed 42" in plan and "b seed 42" in plan
    assert ex.main([str(path), "--dry-run", "--seeds", "1", *out]) == 0  # a plan or a report is never refused
    with pytest.raises(SuiteError, match=r"presets \['cpu'\] set in-parts = true but the suite declares no"):
        ex.parse_suite("s", {"presets": {"cpu": {"supernodes": 2, "in-parts": True}}, "runs": [{"label": "a"}]})


def test_first_seed_from_the_preset_or_the_caller(tmp_path: Path) -> None:
    doc = {"presets": {"tune": {"supernodes": 2, "first-seed": 44}}, "runs": [{"label": "a"}]}
    suite = ex.parse_suite("s", doc, base=tmp_path)
    assert [(p.seed, p.run_name) for p in ex.plan_runs(suite, "tune", 2)] == [(44, "a-s44"), (45, "a-s45")]
    assert [p.seed for p in ex.plan_runs(suite, "tune", 1, first_seed=7)] == [7]
    assert "seed=44" in ex.plan_runs(suite, "tune", 1)[0].run_config


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ({"presets": {"cpu": {"supernodes": 2}}, "runs": [{"label": "a"}, {"label": "a"}]}, "unique"),
        ({"presets": {"cpu": {"supernodes": 2}}, "runs": []}, "at least one"),
        ({"presets": {"cpu": {"supernodes": 0}}, "runs": [{"label": "a"}]}, "supernodes"),
        ({"presets": {"cpu": {"supernodes": 2}}, "runs": [{"label": "a", "config": "missing.toml"}]}, "no such"),
        ({"presets": {"cpu": {"supernodes": 2}}, "runs": [{"label": "a", "overrides": {"k": [1]}}]}, "strings"),
        ({"presets": {"cpu": {"supernodes": 2}}, "runs": [{"label": "a", "seeds": 3}]}, "unknown keys"),
        ({"preset": {}, "runs": [{"label": "a"}]}, "unknown keys"),
        ({"presets": {"cpu": {"supernodes": 2, "first-seed": -1}}, "runs": [{"label": "a"}]}, "first-seed"),
        ({"presets": {"cpu": {"supernodes": 2, "first-seed": "44"}}, "runs": [{"label": "a"}]}, "first-seed"),
    ],
)
def test_parse_suite_rejects_malformed_suites(tmp_path: Path, doc: dict[str, object], match: str) -> None:
    with pytest.raises(SuiteError, match=match):
        ex.parse_suite("bad", doc, base=tmp_path)


def test_is_done_needs_summary_and_the_same_run_config(tmp_path: Path) -> None:
    planned = ex.PlannedRun("L", 42, "l-s42", "method='x' seed=42", 6, 1.0, 60.0)
    folder = tmp_path / "l-s42"
    folder.mkdir()
    (folder / "summary.csv").write_text("method\n")
    (folder / "rounds.jsonl").write_text("{}\n")
    assert not ex.is_done(tmp_path, planned)  # no marker: not ours
    (folder / "experiment.json").write_text(json.dumps({"run-config": "seed=42  method='x'", "supernodes": 6}))
    assert ex.is_done(tmp_path, planned)  # same pairs in another order
    (folder / "rounds.jsonl").unlink()
    assert not ex.is_done(tmp_path, planned)  # no rounds to read: run again
    (folder / "rounds.jsonl").write_text("{}\n")
    (folder / "experiment.json").write_text(json.dumps({"run-config": planned.run_config, "supernodes": 8}))
    assert not ex.is_done(tmp_path, planned)
    (folder / "experiment.json").write_text(json.dumps({"run-config": "method='y' seed=42", "supernodes": 6}))
    assert not ex.is_done(tmp_path, planned)  # the suite changed: run again


REQUIRED_SUITES = {
    "tiny",
    "heterofl",
    "inclusivefl-table2",
    "inclusivefl-proportions",
    "inclusivefl-beta",
    "flexifed",
    "codist-table1",
    "pfedknow-table3",
}


def test_shipped_suites_cover_the_issue_and_every_run_config_validates() -> None:
    names = set(ex.available_suites())
    assert names >= REQUIRED_SUITES, REQUIRED_SUITES - names
    for name in names:
        suite = ex.load_suite(name)
        selects = all(p.overrides.get("eval-split") == "validation" for p in suite.presets.values())
        # a table the papers print has both sizes; a suite that only chooses settings needs the cpu one
        assert ({"cpu"} if selects else {"cpu", "paper"}) <= set(suite.presets), name
        for preset in suite.presets.values():
            assert preset.notes, (name, preset.name)
            for run in suite.runs:
                values = ex.run_config_values(run, preset, ex.BASE_SEED)
                cfg = RunConfig.from_flower(values)  # raises ConfigError naming the key
                assert cfg.seed == ex.BASE_SEED


def test_demo_selection_runs_the_demo_on_validation_data_with_unreported_seeds() -> None:
    suite = ex.load_suite("demo-selection")
    preset = suite.presets["cpu"]
    assert preset.first_seed not in range(ex.BASE_SEED, ex.BASE_SEED + 5)
    # what `make demo` runs (and the defaults); federated evaluation (fraction-evaluate) changes no
    # weight: the demo's server-test accuracies are the same in every round with and without it
    demo = RunConfig.from_flower({"client-threads": 1, "fraction-evaluate": 0.0})
    for run in suite.runs:
        cfg = RunConfig.from_flower(ex.run_config_values(run, preset, preset.first_seed))
        assert cfg.eval_split == "validation" and cfg.data_spec().eval_split == "validation"
        differs = {k for k, v in cfg.model_dump().items() if v != getattr(demo, k)}
        assert differs <= {"eval_split", "seed", "pooling", "results_dir", "run_name", "fraction_evaluate"}, differs
    assert {RunConfig.from_flower(ex.run_config_values(r, preset, 7)).pooling for r in suite.runs} == {"mean", "cls"}


def test_inclusivefl_beta_suite_sweeps_the_papers_values() -> None:
    suite = ex.load_suite("inclusivefl-beta")
    preset = suite.presets["cpu"]
    betas = [RunConfig.from_flower(ex.run_config_values(r, preset, 42)).beta for r in suite.runs]
    assert betas == [0.0, 0.2, 0.5, 0.8, 1.0]
    props = ex.load_suite("inclusivefl-proportions")
    assert {str(r.overrides["tier-proportions"]) for r in props.runs} == {"1:1:1", "1:2:7", "7:2:1"}


def test_dry_run_prints_the_plan_and_runs_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert ex.main(["heterofl", "--dry-run", "--seeds", "2", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert out.count(": to run") == 8 and "[8/8] HeteroFL a-b-c-d-e seed 43" in out
    assert not (tmp_path / "runs").exists() and not (tmp_path / "table.md").exists()


def test_report_only_skips_the_preflight_of_runs_it_will_not_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # every codist-domain-shift row sets keys that only some of its methods read: pre-flight warns
    assert ex.main(["codist-domain-shift", "--dry-run", "--seeds", "1", "--out", str(tmp_path)]) == 0
    assert "pre-flight WARNING" in capsys.readouterr().out
    assert ex.main(["codist-domain-shift", "--report-only", "--seeds", "1", "--out", str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "pre-flight" not in captured.out + captured.err and "no finished runs" in captured.err


def test_every_shipped_cpu_row_gives_each_tier_its_own_variant() -> None:
    """Pre-flight of every row (first seed) of every suite's cpu preset: no tier idle, no variant untrained.

    The inclusivefl-table2 and depthfl-text HeteroFL rows once ran under the depth tiers' memory
    budgets, in which the weak tier fit no width and the medium tier the weak one.
    """
    for name in ex.available_suites():
        ex.check_runs(ex.plan_runs(ex.load_suite(name), "cpu", seeds=1))  # raises SuiteError naming the row


def test_a_row_whose_tier_plan_leaves_a_variant_untrained_stops_the_suite(tmp_path: Path) -> None:
    (good,) = ex.plan_runs(ex.load_suite("tiny"), "cpu", seeds=1)
    squeezed = good.run_config.replace("tier-memory-mb='auto'", "tier-memory-mb='100:900:1100'")
    bad = dataclasses.replace(good, label="squeezed", run_config=squeezed)
    with pytest.raises(ex.SuiteError, match=r"squeezed seed 42: tier .weak. \(1 nodes\) trains nothing"):
        ex.check_runs([bad])


# ------------------------------------------------------------------------------- end to end
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_tiny_suite_end_to_end(tmp_path: Path) -> None:
    assert ex.main(["tiny", "--out", str(tmp_path)]) == 0
    folder = tmp_path / "runs" / "inclusivefl-s42"
    rows = [json.loads(line) for line in (folder / "rounds.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [0, 1, 2]
    final = {t: v["local-accuracy"] for t, v in rows[-1]["tiers"].items()}
    assert set(final) == {"weak", "medium", "strong"}
    md = (tmp_path / "table.md").read_text()
    line = "| InclusiveFL | " + " | ".join(f"{final[t]:.3f}" for t in ("weak", "medium", "strong")) + " | 1 |"
    assert line in md
    table = {(r["tier"], r["statistic"]): r for r in csv.DictReader((tmp_path / "table.csv").open())}
    for tier, acc in final.items():
        assert float(table[(tier, "final")]["mean"]) == acc and table[(tier, "final")]["n"] == "1"
        curve = {r["round"]: r["tiers"][tier]["local-accuracy"] for r in rows}
        assert float(table[(tier, "rounds-to-best")]["mean"]) == reports.rounds_to_best(curve)
    assert (tmp_path / "convergence.png").read_bytes().startswith(PNG_MAGIC)
    # resumable: a second call skips the finished run and rewrites the same table
    before = (folder / "rounds.jsonl").stat().st_mtime
    assert ex.main(["tiny", "--out", str(tmp_path)]) == 0
    assert (folder / "rounds.jsonl").stat().st_mtime == before
    assert line in (tmp_path / "table.md").read_text()
    # another per-tier metric of the same runs, reported beside the suite's tables
    loss = {t: v["local-loss"] for t, v in rows[-1]["tiers"].items()}
    assert ex.main(["tiny", "--out", str(tmp_path), "--report-only", "--metric", "local-loss"]) == 0
    loss_line = "| InclusiveFL | " + " | ".join(f"{loss[t]:.3f}" for t in ("weak", "medium", "strong")) + " | 1 |"
    assert loss_line in (tmp_path / "metric-local-loss" / "table.md").read_text()
    assert line in (tmp_path / "table.md").read_text()
    assert ex.main(["tiny", "--out", str(tmp_path), "--report-only", "--metric", "no-such-metric"]) == 1


def test_every_shipped_claim_compares_tiers_its_rows_train() -> None:
    for name in ex.available_suites():
        suite = ex.load_suite(name)
        preset = suite.presets["cpu"]
        runs = {r.label: r for r in suite.runs}
        for claim in suite.claims:
            for label, tier in ((claim.a, claim.tier), (claim.b, claim.b_tier)):
                cfg = RunConfig.from_flower(ex.run_config_values(runs[label], preset, ex.BASE_SEED))
                assert tier in cfg.tier_names, (name, claim.label, label, tier, cfg.tier_names)
    assert {c.label for c in ex.load_suite("heterofl").claims} >= {"C12"}
    assert {c.label for c in ex.load_suite("inclusivefl-proportions").claims} >= {"C1 (1:1:1)", "C1 (1:2:7)"}


def test_code_version_names_the_commit_and_a_dirty_tree(tmp_path: Path) -> None:
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tmp_path), *args], capture_output=True, text=True, check=True).stdout

    assert code_version(tmp_path) == "unknown"  # not a checkout
    git("init", "-q")
    (tmp_path / "a.txt").write_text("1\n")
    git("add", "a.txt")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = git("rev-parse", "HEAD").strip()
    assert code_version(tmp_path) == head
    (tmp_path / "new.txt").write_text("untracked files do not count\n")
    assert code_version(tmp_path) == head
    (tmp_path / "a.txt").write_text("2\n")
    assert code_version(tmp_path) == f"{head}-dirty"


def test_archive_keeps_the_record_files_and_rebuilds_the_same_table(tmp_path: Path) -> None:
    (planned,) = ex.plan_runs(ex.load_suite("tiny"), "cpu", seeds=1)
    out, archive = tmp_path / "results" / "tiny-cpu", tmp_path / "docs" / "runs" / "tiny-cpu"
    finished_suite_run(out / "runs" / planned.run_name, planned, final=0.75)
    done, failed = ex.run_suite(ex.load_suite("tiny"), "cpu", seeds=1, out=out, dry_run=True, archive=archive)
    assert failed == [] and [r.curves["strong"] for r in done] == [{1: 0.375, 2: 0.75}]
    kept = archive / "runs" / planned.run_name
    assert sorted(p.name for p in kept.iterdir()) == sorted(archive_mod.RECORD_FILES)  # no checkpoint
    assert ex.is_done(archive / "runs", planned)  # the archive is a finished --out: nothing to re-run
    assert ex.main(["tiny", "--report-only", "--out", str(out)]) == 0
    assert ex.main(["tiny", "--report-only", "--out", str(archive)]) == 0
    assert (archive / "table.csv").read_text() == (out / "table.csv").read_text()


def test_a_run_in_the_archive_counts_as_done_on_a_new_checkout(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (planned,) = ex.plan_runs(ex.load_suite("tiny"), "cpu", seeds=1)
    archive = tmp_path / "docs" / "runs" / "tiny-cpu"
    finished_suite_run(archive / "runs" / planned.run_name, planned, final=0.5)
    out = tmp_path / "results" / "tiny-cpu"  # a new checkout: nothing under results/
    done, failed = ex.run_suite(ex.load_suite("tiny"), "cpu", seeds=1, out=out, dry_run=True, archive=archive)
    assert failed == [] and [r.curves["strong"][2] for r in done] == [0.5]
    assert "done, skipped" in capsys.readouterr().out and not out.exists()  # not run, not copied back


def test_machine_fingerprint_reads_the_cpu_and_hashes_its_sorted_flags(tmp_path: Path) -> None:
    import hashlib

    from deploy.flower import machine_fingerprint

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: sse2 avx fpu\n\nprocessor\t: 1\n")
    found = machine_fingerprint(info)
    assert found["cpu"] == "AMD EPYC"
    assert found["cpu-flags"] == hashlib.sha256(b"avx fpu sse2").hexdigest()[:12]
    assert isinstance(found["cores"], int) and found["cores"] >= 1
    missing = machine_fingerprint(tmp_path / "absent")
    assert missing["cpu"] == "unknown" and missing["cpu-flags"] == "unknown"
