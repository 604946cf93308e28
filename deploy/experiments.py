"""Run a named experiment suite over several seeds and write paper-style tables and plots.

Usage::

    python -m deploy.experiments SUITE [--preset cpu|paper] [--seeds N] [--first-seed S] [--out DIR]
                                       [--part NAME ... | --only LABEL ...] [--with-controls]
                                       [--lock FILE] [--archive]
                                       [--dry-run | --report-only]
    python -m deploy.experiments --list

A *suite* (``deploy/suites/<name>.toml``) is data: a list of runs (one table row each: a label,
an optional run-config file from ``deploy/configs/`` and ``key = value`` overrides; ``control =
true`` marks a diagnosis control that runs only with ``--only`` or ``--with-controls``), presets
(``cpu``: sized for a 2-core machine, at most 2 hours; ``paper``: the papers' models, clients and
rounds) and optional *parts* (``[parts.<name>]``: named groups of rows, each the rows of one or a
few claims).  A suite whose rows together take longer than a cpu preset's 2-hour budget declares
parts that each fit it, and that preset (``in-parts = true``) runs one part per call (``--part
NAME``); a part's rows that another part ran already are skipped (same run folder), so running
every part runs every row once. Every run of every seed goes through :func:`deploy.launch.run_simulation`, one after the
other; a run whose results folder already holds a ``summary.csv`` written for the same run config
is skipped, so an interrupted suite resumes where it stopped.

Run-config precedence (later wins): the run's ``config`` file, the preset's overrides, the run's
overrides, then ``seed`` and the results folder.

Outputs under ``--out`` (default ``results/experiments/<suite>-<preset>``): ``runs/<run-name>/``
(each run's own results folder), ``table.md`` and ``table.csv`` (final and best value of the
suite's metric, mean and standard error over seeds, per run label and tier; rounds-to-best; wall
time), ``convergence.png`` (mean curve per label, one panel per tier, +/- one standard error),
written by :mod:`deploy.reports`. ``--archive`` also copies each finished run's small record files
into the tracked ``docs/runs/<suite>-<preset>/`` (:mod:`deploy.archive`), from which
``--report-only --out docs/runs/<suite>-<preset>`` rebuilds the tables on any checkout.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import shlex
import sys
import time
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from deploy.archive import ArchiveError, archive_folder, archive_run
from deploy.claims import Claim, ClaimError, parse_claims
from deploy.console import RoundTail
from deploy.flower import ROOT, code_version, machine_fingerprint
from deploy.launch import check_gpus_per_client, run_simulation
from deploy.locks import file_lock
from deploy.overrides import merge_overrides, parse_pairs, run_config_pairs
from deploy.reports import RunResult, read_run, write_report
from deploy.suite_parts import Part, SuiteError, parse_parts

SUITES_DIR = ROOT / "deploy" / "suites"
#: ``seed`` of a suite's first seed unless its preset says otherwise; seed ``i`` (0-based) runs
#: with ``first_seed + i``.
BASE_SEED = 42

Scalar = str | int | float | bool


# --------------------------------------------------------------------------------- suite data
@dataclass(frozen=True)
class SuiteRun:
    """One row of a suite's table: a method or variant.

    Parameters
    ----------
    label : str
        Row name in tables and plots (unique within the suite).
    config : Path or None
        Run-config TOML file (flat ``key = value``), e.g. ``deploy/configs/cnn-heterofl-a-e.toml``.
    overrides : Mapping[str, Scalar]
        Run-config keys that define the variant (``method``, ``beta``, ``tier-proportions``, ...).
    control : bool
        A diagnosis control, not a paper row (``control = true``): planned only when named by
        ``--only`` or with ``--with-controls``, so that the preset's own runs keep their time
        budget; ``--report-only`` reads it wherever it finished.

    """

    label: str
    config: Path | None = None
    overrides: Mapping[str, Scalar] = field(default_factory=dict)
    control: bool = False


@dataclass(frozen=True)
class Preset:
    """How large a suite's runs are.

    Parameters
    ----------
    name : str
        ``cpu`` or ``paper`` (any name a suite defines).
    supernodes : int
        Virtual clients (``num-supernodes`` of the simulation).
    seeds : int
        Default number of seeds (``--seeds`` overrides).
    overrides : Mapping[str, Scalar]
        Run-config keys applied to every run (rounds, model size, data sizes).
    notes : str
        What the preset reproduces and where its numbers come from.
    cpus_per_client : float
        Ray CPUs per virtual client.
    gpus_per_client : float
        Ray GPU share per virtual client (``gpus-per-client``; 0 = none; ``--gpus-per-client``
        overrides, e.g. 0 to run a GPU preset on a machine without one).
    timeout_s : float
        Wall-clock limit of one run.
    first_seed : int
        Seed of the first of ``seeds`` (``first-seed``; e.g. tuning runs on seeds disjoint from
        the ones a table reports).
    in_parts : bool
        ``in-parts = true``: the suite's rows together exceed this preset's time budget, so it
        runs one of the suite's parts per call (``--part``) and refuses to start whole.

    """

    name: str
    supernodes: int
    seeds: int = 3
    overrides: Mapping[str, Scalar] = field(default_factory=dict)
    notes: str = ""
    cpus_per_client: float = 1.0
    timeout_s: float = 3600.0
    first_seed: int = BASE_SEED
    gpus_per_client: float = 0.0
    in_parts: bool = False


@dataclass(frozen=True)
class Suite:
    """A named set of runs compared in one table.

    Parameters
    ----------
    name : str
    description : str
    paper : str
        The claim or table the suite reproduces (its direction is what ``docs/RESULTS.md`` checks).
    metric : str
        Per-tier key of ``rounds.jsonl`` the table reports (``local-accuracy``: the tier's model on
        the server's test set; ``fed-accuracy``: on the clients' own test splits).
    runs : tuple[SuiteRun, ...]
    presets : Mapping[str, Preset]
    claims : tuple[Claim, ...]
        The paper's claims the suite tests, each a paired comparison of two runs
        (:mod:`deploy.claims`); the report gives each its paired difference and verdict.
    parts : Mapping[str, Part]
        Named groups of rows, for a suite too long to run in one call; empty when the suite runs
        whole.  Declared parts cover every row that is not a control.

    """

    name: str
    description: str
    paper: str
    metric: str
    runs: tuple[SuiteRun, ...]
    presets: Mapping[str, Preset]
    claims: tuple[Claim, ...] = ()
    parts: Mapping[str, Part] = field(default_factory=dict)

    def rows_of_parts(self, names: Sequence[str]) -> list[str]:
        """The labels of the parts ``names``, in the suite's row order.

        Raises
        ------
        SuiteError
            Naming an unknown part and the suite's parts.

        """
        unknown = [n for n in names if n not in self.parts]
        if unknown:
            raise SuiteError(
                f"suite {self.name!r} has no part {', '.join(map(repr, unknown))} "
                f"(has {', '.join(self.parts) or 'none'})"
            )
        wanted = {label for n in names for label in self.parts[n].rows}
        return [r.label for r in self.runs if r.label in wanted]


def _scalars(table: object, where: str) -> dict[str, Scalar]:
    if not isinstance(table, dict):
        raise SuiteError(f"{where}: expected a table of key = value, got {table!r}")
    out: dict[str, Scalar] = {}
    for key, value in table.items():
        if not isinstance(value, str | int | float | bool):
            raise SuiteError(f"{where}.{key}: run-config values are strings, numbers or booleans, got {value!r}")
        out[key] = value
    return out


def parse_suite(name: str, data: Mapping[str, Any], *, base: Path = ROOT) -> Suite:
    """Build a :class:`Suite` from a parsed suite TOML document.

    Parameters
    ----------
    name : str
        Suite name (the file's stem).
    data : Mapping[str, Any]
        The TOML document: ``description``, ``paper``, ``metric``, optional default ``config``,
        ``[presets.<name>]`` tables, ``[[runs]]`` entries and optional ``[[claims]]`` entries
        (:func:`deploy.claims.parse_claims`).
    base : Path
        Folder that relative ``config`` paths are resolved against (the repository root).

    Raises
    ------
    SuiteError
        On a missing or malformed key, duplicate labels, a config file that does not exist, or a
        malformed claim.

    """
    where = f"suite {name!r}"
    known = {"description", "paper", "metric", "config", "presets", "runs", "claims", "parts"}
    unknown = sorted(set(data) - known)
    if unknown:
        raise SuiteError(f"{where}: unknown keys {unknown} (expected {sorted(known)})")

    def config_path(value: object, at: str) -> Path | None:
        if value is None:
            return None
        if not isinstance(value, str):
            raise SuiteError(f"{at}.config: expected a path string, got {value!r}")
        path = (base / value).resolve()
        if not path.is_file():
            raise SuiteError(f"{at}.config: no such run-config file {value!r}")
        return path

    default_config = config_path(data.get("config"), where)
    raw_runs = data.get("runs")
    if not isinstance(raw_runs, list) or not raw_runs:
        raise SuiteError(f"{where}: needs at least one [[runs]] entry")
    runs: list[SuiteRun] = []
    for i, raw in enumerate(raw_runs):
        at = f"{where} runs[{i}]"
        if not isinstance(raw, dict) or not isinstance(raw.get("label"), str) or not raw["label"]:
            raise SuiteError(f"{at}: needs a non-empty 'label'")
        extra = sorted(set(raw) - {"label", "config", "overrides", "control"})
        if extra:
            raise SuiteError(f"{at}: unknown keys {extra}")
        control = raw.get("control", False)
        if not isinstance(control, bool):
            raise SuiteError(f"{at}.control: expected true or false, got {control!r}")
        cfg = config_path(raw["config"], at) if "config" in raw else default_config
        runs.append(SuiteRun(raw["label"], cfg, _scalars(raw.get("overrides", {}), f"{at}.overrides"), control))
    labels = [r.label for r in runs]
    if len(set(labels)) != len(labels):
        raise SuiteError(f"{where}: run labels must be unique, got {labels}")
    raw_presets = data.get("presets")
    if not isinstance(raw_presets, dict) or not raw_presets:
        raise SuiteError(f"{where}: needs at least one [presets.<name>] table")
    presets: dict[str, Preset] = {}
    for pname, raw in raw_presets.items():
        at = f"{where} presets.{pname}"
        if not isinstance(raw, dict) or not isinstance(raw.get("supernodes"), int) or raw["supernodes"] < 1:
            raise SuiteError(f"{at}: needs 'supernodes' (a positive integer)")
        known = {
            "supernodes", "seeds", "first-seed", "overrides", "notes", "cpus-per-client", "gpus-per-client",
            "timeout-s", "in-parts",
        }  # fmt: skip
        extra = sorted(set(raw) - known)
        if extra:
            raise SuiteError(f"{at}: unknown keys {extra}")
        seeds = raw.get("seeds", 3)
        if not isinstance(seeds, int) or seeds < 1:
            raise SuiteError(f"{at}.seeds: expected a positive integer, got {seeds!r}")
        in_parts = raw.get("in-parts", False)
        if not isinstance(in_parts, bool):
            raise SuiteError(f"{at}.in-parts: expected true or false, got {in_parts!r}")
        first_seed = raw.get("first-seed", BASE_SEED)
        if not isinstance(first_seed, int) or isinstance(first_seed, bool) or first_seed < 0:
            raise SuiteError(f"{at}.first-seed: expected an integer >= 0, got {first_seed!r}")
        presets[pname] = Preset(
            name=pname,
            supernodes=raw["supernodes"],
            seeds=seeds,
            overrides=_scalars(raw.get("overrides", {}), f"{at}.overrides"),
            notes=str(raw.get("notes", "")),
            cpus_per_client=float(raw.get("cpus-per-client", 1.0)),
            timeout_s=float(raw.get("timeout-s", 3600.0)),
            first_seed=first_seed,
            gpus_per_client=_non_negative(raw.get("gpus-per-client", 0.0), f"{at}.gpus-per-client"),
            in_parts=in_parts,
        )
    try:
        claims = parse_claims(data.get("claims"), where, labels)
    except ClaimError as exc:
        raise SuiteError(str(exc)) from exc
    parts = parse_parts(data.get("parts", {}), where, labels, {r.label for r in runs if r.control})
    parted = [p.name for p in presets.values() if p.in_parts]
    if parted and not parts:
        raise SuiteError(f"{where}: presets {parted} set in-parts = true but the suite declares no [parts.<name>]")
    return Suite(
        name=name,
        description=str(data.get("description", "")),
        paper=str(data.get("paper", "")),
        metric=str(data.get("metric", "local-accuracy")),
        runs=tuple(runs),
        presets=presets,
        claims=claims,
        parts=parts,
    )


def _non_negative(value: object, at: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise SuiteError(f"{at}: expected a number >= 0, got {value!r}")
    return float(value)


def available_suites(folder: Path = SUITES_DIR) -> list[str]:
    """Names of the suites in ``folder`` (file stems of ``*.toml``), sorted."""
    return sorted(p.stem for p in folder.glob("*.toml"))


def load_suite(name: str, folder: Path = SUITES_DIR) -> Suite:
    """Read ``folder/<name>.toml`` (or a path to a suite file) into a :class:`Suite`."""
    path = Path(name) if name.endswith(".toml") else folder / f"{name}.toml"
    if not path.is_file():
        raise SuiteError(f"unknown suite {name!r}; available: {', '.join(available_suites(folder))}")
    with path.open("rb") as f:
        return parse_suite(path.stem, tomllib.load(f))


# --------------------------------------------------------------------------------- planning
@dataclass(frozen=True)
class PlannedRun:
    """One simulation to launch: a suite run at one seed."""

    label: str
    seed: int
    run_name: str
    run_config: str
    supernodes: int
    cpus_per_client: float
    timeout_s: float
    gpus_per_client: float = 0.0


def slug(text: str) -> str:
    """Lower-case ``text`` with every run of other characters than ``[a-z0-9.]`` as one ``-``."""
    return re.sub(r"[^a-z0-9.]+", "-", text.lower()).strip("-")


def run_config_values(run: SuiteRun, preset: Preset, seed: int) -> dict[str, Scalar]:
    """Run-config keys of ``run`` at ``seed``: config file < preset < run overrides < ``seed``."""
    values: dict[str, Scalar] = {}
    if run.config is not None:
        with run.config.open("rb") as f:
            values.update(_scalars(tomllib.load(f), str(run.config)))
    values.update(preset.overrides)
    values.update(run.overrides)
    values["seed"] = seed
    return values


def run_config_for(run: SuiteRun, preset: Preset, seed: int) -> str:
    """:func:`run_config_values` as the ``k=v`` string ``flwr run --run-config`` takes."""
    return merge_overrides(run_config_pairs(run_config_values(run, preset, seed)))


def plan_runs(
    suite: Suite,
    preset: str,
    seeds: int,
    only: Sequence[str] = (),
    first_seed: int | None = None,
    gpus_per_client: float | None = None,
    with_controls: bool = False,
) -> list[PlannedRun]:
    """Every (run, seed) of ``suite`` under ``preset``, seed-major (all labels of seed 1 first).

    Seeds are ``first_seed, first_seed + 1, ...`` (default: the preset's ``first-seed``);
    ``gpus_per_client`` replaces the preset's GPU share.  Control rows
    (:attr:`SuiteRun.control`) are planned when ``only`` names them or ``with_controls``.
    Seed-major order makes a suite that is stopped early still give every label the same number
    of seeds.
    """
    if preset not in suite.presets:
        raise SuiteError(f"suite {suite.name!r} has no preset {preset!r} (has {sorted(suite.presets)})")
    p = suite.presets[preset]

    def planned_row(run: SuiteRun) -> bool:
        if only:
            return run.label in only or slug(run.label) in only
        return with_controls or not run.control

    runs = [r for r in suite.runs if planned_row(r)]
    if only and not runs:
        raise SuiteError(f"--only {list(only)} matches no run of {suite.name!r}: {[r.label for r in suite.runs]}")
    planned = []
    start = p.first_seed if first_seed is None else first_seed
    for i in range(seeds):
        seed = start + i
        for run in runs:
            planned.append(
                PlannedRun(
                    label=run.label,
                    seed=seed,
                    run_name=f"{slug(run.label)}-s{seed}",
                    run_config=run_config_for(run, p, seed),
                    supernodes=p.supernodes,
                    cpus_per_client=p.cpus_per_client,
                    timeout_s=p.timeout_s,
                    gpus_per_client=p.gpus_per_client if gpus_per_client is None else gpus_per_client,
                )
            )
    return planned


def is_done(runs_dir: Path, planned: PlannedRun) -> bool:
    """Whether ``planned`` already finished with the same run config and supernodes."""
    folder = runs_dir / planned.run_name
    marker = folder / "experiment.json"
    if not all((folder / name).is_file() for name in ("summary.csv", "rounds.jsonl", "experiment.json")):
        return False
    try:
        saved = json.loads(marker.read_text())
    except json.JSONDecodeError:
        return False
    return (
        same_run_config(str(saved.get("run-config", "")), planned.run_config)
        and saved.get("supernodes") == planned.supernodes
    )


def same_run_config(a: str, b: str) -> bool:
    """Whether two ``k=v`` run-config strings set the same keys to the same values (in any order)."""
    return parse_pairs(a) == parse_pairs(b)


# --------------------------------------------------------------------------------- running
def _rounds_of(run_config: str) -> int | None:
    m = re.search(r"(?:^|\s)num-server-rounds=(\d+)", run_config)
    return int(m.group(1)) if m else None


def check_runs(planned: Sequence[PlannedRun]) -> None:
    """Pre-flight every run before the first starts (:mod:`deploy.preflight`); print each warning once.

    Raises
    ------
    SuiteError
        Naming the run and what its configuration cannot do (an invalid key, or a tier plan in
        which a tier trains nothing or a variant trains on no node: the row would not measure
        what its label says), so a suite with a bad row stops before hours of the good ones,
        not after.

    """
    from deploy.preflight import preflight
    from experiment.config import ConfigError

    shown: set[str] = set()
    for pr in planned:
        try:
            found = preflight(pr.run_config, num_nodes=pr.supernodes)
        except ConfigError as exc:
            raise SuiteError(f"{pr.label} seed {pr.seed}: {exc}") from None
        if found.plan_warnings:  # a table row must train what its label says: each tier its variant
            raise SuiteError(f"{pr.label} seed {pr.seed}: {'; '.join(found.plan_warnings)}")
        for line in found.lines()[1:]:
            if line not in shown:
                shown.add(line)
                print(f"{pr.label}: {line}", flush=True)


def run_suite(
    suite: Suite,
    preset: str,
    *,
    seeds: int,
    out: Path,
    only: Sequence[str] = (),
    lock: Path | None = None,
    echo: bool = False,
    dry_run: bool = False,
    show_config: bool = True,
    first_seed: int | None = None,
    gpus_per_client: float | None = None,
    check: bool = True,
    archive: Path | None = None,
    copy_to_archive: bool = True,
    with_controls: bool = False,
) -> tuple[list[RunResult], list[PlannedRun]]:
    """Launch every planned run that is not done yet; return the finished runs' results and the failures.

    ``check=False`` skips the pre-flight of the runs still to do (:func:`check_runs`): for
    ``--report-only``, which starts none of them, its warnings would only bury the table.
    ``archive``: copy each finished run's record into ``archive / runs / <run-name>``
    (:func:`deploy.archive.archive_run`), the runs found done included; a run not done under
    ``out`` but done in the archive (an earlier checkout's) counts as done and is read from there.
    A run done in both is read from ``out`` and its record replaces the archived one. An
    ``archive`` that is ``out`` itself is ignored. A finished run that cannot be archived (a
    record file missing) is reported and the suite goes on. ``copy_to_archive=False`` (``--dry-run``)
    reads the archive but writes nothing to it.  ``with_controls``: plan the control rows too
    (:func:`plan_runs`).
    """
    runs_dir = out / "runs"
    kept = None if archive is None or archive.resolve() == out.resolve() else archive / "runs"

    def finished(pr: PlannedRun) -> Path | None:
        """The folder holding ``pr`` finished: under ``out`` first, else in the archive."""
        for where in (runs_dir, kept):
            if where is not None and is_done(where, pr):
                return where / pr.run_name
        return None

    planned = plan_runs(suite, preset, seeds, only, first_seed, gpus_per_client, with_controls)
    if check:
        check_runs([pr for pr in planned if finished(pr) is None])
    done: list[RunResult] = []
    failed: list[PlannedRun] = []
    t_suite = time.time()
    for i, pr in enumerate(planned, 1):
        head = f"[{i}/{len(planned)}] {pr.label} seed {pr.seed} ({pr.run_name}, {pr.supernodes} supernodes)"
        if finished(pr) is not None:
            print(f"{head}: done, skipped", flush=True)
        elif dry_run:
            print(f"{head}: to run" + (f'\n    --run-config "{pr.run_config}"' if show_config else ""), flush=True)
            continue
        else:
            print(f"{head}: running", flush=True)
            t0 = time.time()
            code = code_version()  # what `flwr run` packs now: the marker names it
            folder = runs_dir / pr.run_name
            with (
                file_lock(lock),
                RoundTail(folder / "rounds.jsonl", metric=suite.metric, rounds=_rounds_of(pr.run_config)),
            ):
                outcome = run_simulation(
                    supernodes=pr.supernodes, run_config=pr.run_config, results_dir=runs_dir.resolve(),
                    run_name=pr.run_name, cpus_per_client=pr.cpus_per_client, gpus_per_client=pr.gpus_per_client,
                    timeout=pr.timeout_s, echo=echo,
                )  # fmt: skip
            if not outcome.ok:
                failed.append(pr)
                print(f"    FAILED (flwr exit {outcome.returncode}); last output:\n{outcome.log[-3000:]}", flush=True)
                continue
            marker = {
                "label": pr.label, "seed": pr.seed, "run-config": pr.run_config, "supernodes": pr.supernodes,
                "code": code, "machine": machine_fingerprint(),
            }  # fmt: skip
            (folder / "experiment.json").write_text(json.dumps(marker, indent=2))
            print(f"    finished in {time.time() - t0:.0f} s (suite {time.time() - t_suite:.0f} s)", flush=True)
        record = finished(pr)
        if record is not None:
            if copy_to_archive and kept is not None and record.parent != kept:
                try:
                    archive_run(record, kept / pr.run_name)
                except ArchiveError as exc:
                    print(f"    not archived: {exc}", flush=True)
            others = tuple(dict.fromkeys(m for c in suite.claims for m in c.metrics()))
            done.append(read_run(record, label=pr.label, seed=pr.seed, metric=suite.metric, other_metrics=others))
    return done, failed


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("suite", nargs="?", help=f"suite name ({', '.join(available_suites())}) or a .toml path")
    parser.add_argument("--preset", default="cpu", help="preset of the suite (cpu | paper)")
    parser.add_argument("--seeds", type=int, default=None, help="number of seeds (default: the preset's)")
    parser.add_argument(
        "--out", type=Path, default=None, help="output folder (default results/experiments/SUITE-PRESET)"
    )
    parser.add_argument(
        "--first-seed", type=int, default=None, help="seed of the first run of each row (default: the preset's, 42)"
    )
    parser.add_argument(
        "--gpus-per-client", type=float, default=None, help="Ray GPU share per client (default: the preset's)"
    )
    parser.add_argument("--only", action="append", default=[], help="run only this label (repeatable)")
    parser.add_argument(
        "--part",
        action="append",
        default=[],
        help="run only this part's rows (repeatable; a preset with in-parts = true runs one of its suite's "
        "[parts.NAME] per call: --list shows them)",
    )
    parser.add_argument(
        "--with-controls",
        action="store_true",
        help="also run the suite's control rows (control = true: diagnosis controls outside the preset's "
        "budget; --only names them one by one; --report-only always reads them)",
    )
    parser.add_argument(
        "--metric",
        default=None,
        help="report this per-tier metric of rounds.jsonl instead of the suite's (e.g. local-accuracy-inverted: one "
        "input domain's accuracy); the tables go to OUT/metric-<METRIC>/",
    )
    parser.add_argument("--lock", type=Path, default=None, help="extra flock(FILE) per run")
    parser.add_argument("--echo", action="store_true", help="show Flower's own output of each run")
    parser.add_argument(
        "--archive",
        action="store_true",
        help="copy each finished run's record (marker, config, per-round metrics, summary; a few kB) into the "
        "tracked docs/runs/SUITE-PRESET/, a folder --report-only --out can rebuild the tables from",
    )
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--dry-run", action="store_true", help="print the plan (and what is done) without running")
    mode.add_argument("--report-only", action="store_true", help="write the tables from finished runs only")
    parser.add_argument("--list", action="store_true", help="list the suites and their presets")
    args = parser.parse_args(argv)
    if args.list or not args.suite:
        for name in available_suites():
            s = load_suite(name)
            print(f"{name:26s} presets {', '.join(s.presets)}; {len(s.runs)} runs: {s.description}")
            for part in s.parts.values():
                print(f"{'':26s}   --part {part.name}: {'; '.join(part.rows)}")
        return 0
    suite = load_suite(args.suite)
    if args.preset not in suite.presets:
        parser.error(f"suite {suite.name!r} has no preset {args.preset!r} (has {', '.join(suite.presets)})")
    only: list[str] = list(args.only)
    if args.part and args.only:
        parser.error("--part and --only both choose rows: give one of them")
    if args.part:
        try:
            only = suite.rows_of_parts(args.part)
        except SuiteError as exc:
            parser.error(str(exc))
    elif suite.presets[args.preset].in_parts and not only and not (args.dry_run or args.report_only):
        parser.error(
            f"suite {suite.name!r} runs its {args.preset!r} preset one part per call (its rows together exceed the "
            "preset's time budget): "
            + "; ".join(f"--part {p.name} ({', '.join(p.rows)})" for p in suite.parts.values())
            + " (or --only LABEL)"
        )
    seeds = args.seeds or suite.presets[args.preset].seeds
    out = (args.out or ROOT / "results" / "experiments" / f"{suite.name}-{args.preset}").resolve()
    report_dir = out
    if args.metric and args.metric != suite.metric:
        suite, report_dir = dataclasses.replace(suite, metric=args.metric), out / f"metric-{args.metric}"
    command = "python -m deploy.experiments " + shlex.join(argv if argv is not None else sys.argv[1:])
    if not (args.dry_run or args.report_only):
        gpus = suite.presets[args.preset].gpus_per_client if args.gpus_per_client is None else args.gpus_per_client
        try:
            check_gpus_per_client(gpus)
        except ValueError as exc:
            parser.error(f"{exc} (--gpus-per-client 0 overrides the preset's {gpus:g})")
    try:
        results, failed = run_suite(
            suite, args.preset, seeds=seeds, out=out, only=only, lock=args.lock, echo=args.echo,
            dry_run=args.dry_run or args.report_only, show_config=not args.report_only, first_seed=args.first_seed,
            gpus_per_client=args.gpus_per_client, check=not args.report_only,
            archive=archive_folder(suite.name, args.preset) if args.archive else None, copy_to_archive=not args.dry_run,
            with_controls=args.with_controls or args.report_only,
        )  # fmt: skip
    except SuiteError as exc:
        print(f"pre-flight failed, nothing was started: {exc}", file=sys.stderr)
        return 2
    if args.dry_run:
        return 0
    if not results:
        print("no finished runs: nothing to report", file=sys.stderr)
        return 1
    if not any(r.curves for r in results):
        print(f"no finished run recorded the metric {suite.metric!r}: nothing to report", file=sys.stderr)
        return 1
    paths = write_report(suite, args.preset, results, report_dir, command=command)
    print((report_dir / "table.md").read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    if failed:
        print(f"{len(failed)} run(s) failed: {', '.join(f.run_name for f in failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
