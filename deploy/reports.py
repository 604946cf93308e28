"""A suite's report: its finished runs read back, reduced over seeds, written as tables and a plot.

:func:`read_run` turns a run's ``rounds.jsonl`` into per-tier curves (:class:`RunResult`); the
statistics (final value, best value, rounds to best) are reduced over seeds into mean and
standard error (:func:`mean_se`, :func:`summarize`); :func:`write_report` writes ``table.md``
(with the suite's claims, :mod:`deploy.claims`), ``table.csv`` and ``convergence.png``.  The
functions are pure (inputs in, text or a file out) so they are tested on fixed fake results;
:mod:`deploy.experiments` runs the suites and calls them.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from deploy.claims import best_value, claims_markdown
from deploy.markdown import markdown_rows

if TYPE_CHECKING:
    from deploy.experiments import Suite


@dataclass(frozen=True)
class RunResult:
    """One finished run, reduced to what the tables need.

    Parameters
    ----------
    label : str
    seed : int
    curves : Mapping[str, Mapping[int, float]]
        ``curves[tier][round]`` = the suite's metric for that tier after that round (round 0 =
        the initial models); rounds where the tier was not measured are absent.
    seconds : float
        Wall time of the run (the last round's ``elapsed``).
    tiers : tuple[str, ...]
        Tier order of the run's config (weakest first).
    other_curves : Mapping[str, Mapping[str, Mapping[int, float]]]
        ``other_curves[metric][tier][round]`` for the further metrics a suite's claims compare
        (:attr:`deploy.claims.Claim.metric`, :attr:`~deploy.claims.Claim.metric_b`), e.g. one
        input domain's accuracy or one exit's; the suite's metric too when a claim names it.

    """

    label: str
    seed: int
    curves: Mapping[str, Mapping[int, float]]
    seconds: float = 0.0
    tiers: tuple[str, ...] = ()
    other_curves: Mapping[str, Mapping[str, Mapping[int, float]]] = field(default_factory=dict)

    def tier_curves(self, metric: str = "") -> Mapping[str, Mapping[int, float]]:
        """Per-tier curves of ``metric``.

        :attr:`curves` for ``""`` (the suite's metric), else :attr:`other_curves` ``[metric]``
        (empty when the run did not record it).
        """
        return self.other_curves.get(metric, {}) if metric else self.curves


#: A per-round metric that names no exit number: each tier's deepest exit alone (the highest ``i``
#: of its ``<prefix>exit-<i>-accuracy``), so one claim reads exit 6 of a 6-layer run and exit 12 of
#: a 12-layer one.
DEEPEST_EXIT_SUFFIX = "exit-deepest-accuracy"


def metric_value(values: Mapping[str, float], metric: str) -> float | None:
    r"""One tier's value of ``metric`` in a ``rounds.jsonl`` row; None when the row lacks it.

    ``<prefix>exit-deepest-accuracy`` (:data:`DEEPEST_EXIT_SUFFIX`) is ``<prefix>exit-<k>-accuracy``
    with :math:`k = \max\{i\}` over the exits the tier recorded (a multi-exit model's last
    classifier alone, :func:`models.exits.evaluate_exits`).
    """
    if not metric.endswith(DEEPEST_EXIT_SUFFIX):
        value = values.get(metric)
        return None if value is None else float(value)
    prefix = metric[: -len(DEEPEST_EXIT_SUFFIX)] + "exit-"
    exits = {
        int(key[len(prefix) : -len("-accuracy")]): float(v)
        for key, v in values.items()
        if key.startswith(prefix) and key.endswith("-accuracy") and key[len(prefix) : -len("-accuracy")].isdigit()
    }
    return exits[max(exits)] if exits else None


def read_run(folder: Path, *, label: str, seed: int, metric: str, other_metrics: Sequence[str] = ()) -> RunResult:
    """Read ``folder/rounds.jsonl`` (and ``config.json`` for the tier order) into a :class:`RunResult`.

    ``metric`` gives :attr:`RunResult.curves`; each of ``other_metrics`` (those a suite's claims
    name) its entry of :attr:`RunResult.other_curves`; each value is read by :func:`metric_value`.
    """
    curves: dict[str, dict[int, float]] = {}
    others: dict[str, dict[str, dict[int, float]]] = {m: {} for m in other_metrics}
    seconds = 0.0
    for line in (folder / "rounds.jsonl").read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        seconds = float(row.get("elapsed", seconds))
        for tier, vals in row.get("tiers", {}).items():
            value = metric_value(vals, metric)
            if value is not None:
                curves.setdefault(tier, {})[int(row["round"])] = value
            for other, by_tier in others.items():
                if (other_value := metric_value(vals, other)) is not None:
                    by_tier.setdefault(tier, {})[int(row["round"])] = other_value
    tiers: tuple[str, ...] = ()
    cfg = folder / "config.json"
    if cfg.is_file():
        tiers = tuple(str(json.loads(cfg.read_text()).get("tiers", "")).replace(",", ":").split(":"))
    return RunResult(label=label, seed=seed, curves=curves, seconds=seconds, tiers=tiers, other_curves=others)


RunKey = tuple[str, int]
"""A finished run's row label and seed."""


def run_name(key: RunKey) -> str:
    """``("InclusiveFL", 42)`` -> ``"InclusiveFL (seed 42)"``, a table's row name for one run."""
    label, seed = key
    return f"{label} (seed {seed})"


def finished_curves(
    out: Path, *, tier: str, metric: str, only: Sequence[str] = ()
) -> dict[RunKey, Mapping[int, float]]:
    """Every finished run's ``tier`` curve of ``metric`` in a runner ``--out`` folder, by (label, seed).

    A run is finished when ``out/runs/<run>/experiment.json`` exists.  ``only`` keeps the runs with
    those labels; a run that did not measure ``metric`` on ``tier`` is left out.  Used by
    :mod:`deploy.plateau` and :mod:`deploy.curves`.
    """
    curves: dict[RunKey, Mapping[int, float]] = {}
    for marker_path in sorted((out / "runs").glob("*/experiment.json")):
        marker = json.loads(marker_path.read_text())
        if only and marker["label"] not in only:
            continue
        run = read_run(marker_path.parent, label=marker["label"], seed=int(marker["seed"]), metric=metric)
        if tier in run.curves:
            curves[(run.label, run.seed)] = run.curves[tier]
    return curves


def curves_parser(doc: str | None, *, verb: str) -> argparse.ArgumentParser:
    """A command's parser with the arguments that name the curves it reads from a runner ``--out`` folder.

    ``out`` (the folder), ``--tier``, ``--metric`` and ``--only`` (repeatable), each read by
    :func:`finished_curves`; ``verb`` says what the command does with them ("judged", "read").
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help=f"a runner --out folder or its archive (its runs/ are {verb})")
    parser.add_argument("--tier", required=True, help=f"tier whose curve is {verb} (e.g. small, strong, iot)")
    parser.add_argument("--metric", default="local-accuracy", help="per-tier metric of rounds.jsonl")
    parser.add_argument("--only", action="append", default=[], help="only this row label (repeatable)")
    return parser


def final_value(curve: Mapping[int, float]) -> float:
    """Value at the last measured round: ``curve[max(curve)]``."""
    return curve[max(curve)]


def rounds_to_best(curve: Mapping[int, float]) -> float:
    r"""First round that reaches the curve's best value.

    .. math:: r^\star = \min \{ r : \mathrm{curve}[r] = \max_{r'} \mathrm{curve}[r'] \}

    Round 0 (the initial model) counts, so a tier that never improves has :math:`r^\star = 0`.
    Returned as a float so it averages like the other statistics.
    """
    best = best_value(curve)
    return float(min(r for r, v in curve.items() if v == best)) if not math.isnan(best) else math.nan


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    r"""Mean and standard error of the mean over seeds.

    .. math::
        \bar x = \frac{1}{n}\sum_{i=1}^n x_i, \qquad
        s = \sqrt{\frac{1}{n-1}\sum_{i=1}^n (x_i - \bar x)^2}, \qquad
        \mathrm{SE} = \frac{s}{\sqrt n}

    (``s`` is the sample standard deviation, Bessel-corrected). With one value the standard error
    is undefined and returned as NaN.

    Raises
    ------
    ValueError
        If ``values`` is empty.

    """
    n = len(values)
    if n == 0:
        raise ValueError("mean_se needs at least one value")
    mean = math.fsum(values) / n
    if n == 1:
        return mean, math.nan
    var = math.fsum((x - mean) ** 2 for x in values) / (n - 1)
    return mean, math.sqrt(var) / math.sqrt(n)


#: Per-curve statistics the tables report, by name.
STATISTICS: dict[str, Callable[[Mapping[int, float]], float]] = {
    "final": final_value,
    "best": best_value,
    "rounds-to-best": rounds_to_best,
}


@dataclass(frozen=True)
class Cell:
    """One table cell: a statistic of one label and tier over seeds."""

    label: str
    tier: str
    statistic: str
    values: tuple[float, ...]
    mean: float
    se: float

    @property
    def n(self) -> int:
        """Number of seeds."""
        return len(self.values)


def tier_order(results: Sequence[RunResult]) -> list[str]:
    """Tiers in first-seen order, each run's config order first (weakest first), then the rest."""
    seen: list[str] = []
    for res in results:
        for tier in (*res.tiers, *res.curves):
            if tier in res.curves and tier not in seen:
                seen.append(tier)
    return seen


def label_order(results: Sequence[RunResult]) -> list[str]:
    """Labels in first-seen order."""
    return list(dict.fromkeys(r.label for r in results))


def summarize(results: Sequence[RunResult], statistic: str) -> list[Cell]:
    """Aggregate ``statistic`` of every (label, tier) over seeds with :func:`mean_se`.

    A tier a run never measured (e.g. ExclusiveFL's weak tier) gives no cell for that run.
    """
    fn = STATISTICS[statistic]
    cells = []
    for label in label_order(results):
        for tier in tier_order(results):
            values = tuple(fn(r.curves[tier]) for r in results if r.label == label and r.curves.get(tier))
            if values:
                mean, se = mean_se(values)
                cells.append(Cell(label, tier, statistic, values, mean, se))
    return cells


def wall_times(results: Sequence[RunResult]) -> dict[str, tuple[float, float]]:
    """Mean and standard error of each label's run wall time (seconds)."""
    return {label: mean_se([r.seconds for r in results if r.label == label]) for label in label_order(results)}


def format_mean_se(mean: float, se: float, digits: int = 3) -> str:
    """``0.812 ± 0.004``; ``0.812`` when the standard error is undefined (one seed)."""
    if math.isnan(se):
        return f"{mean:.{digits}f}"
    return f"{mean:.{digits}f} ± {se:.{digits}f}"


def points_table(columns: Sequence[str], rows: Mapping[RunKey, Sequence[float]], *, fmt: str) -> str:
    """One markdown row per run (its ``run_name``), each value times 100 (points) formatted by ``fmt``."""
    return markdown_rows(
        ["run", *columns], ([run_name(key), *(fmt.format(100 * v) for v in values)] for key, values in rows.items())
    )


def markdown_table(
    cells: Sequence[Cell], *, labels: Sequence[str], tiers: Sequence[str], digits: int = 3, first: str = "run"
) -> str:
    """Rows = labels, columns = tiers, each cell ``mean ± SE``; ``—`` where there is no cell."""
    by_key = {(c.label, c.tier): c for c in cells}
    rows = []
    for label in labels:
        row = [label]
        ns = set()
        for tier in tiers:
            cell = by_key.get((label, tier))
            row.append(format_mean_se(cell.mean, cell.se, digits) if cell else "—")
            if cell:
                ns.add(cell.n)
        row.append("/".join(str(n) for n in sorted(ns)) or "0")
        rows.append(row)
    return markdown_rows([first, *tiers, "seeds"], rows) + "\n"


CSV_FIELDS = ("suite", "preset", "label", "tier", "metric", "statistic", "n", "mean", "se", "values")


def csv_table(cells: Sequence[Cell], *, suite: str, preset: str, metric: str) -> str:
    """Long-format CSV: one line per (label, tier, statistic) with ``n``, ``mean``, ``se``, the values."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for c in cells:
        w.writerow(
            {
                "suite": suite,
                "preset": preset,
                "label": c.label,
                "tier": c.tier,
                "metric": metric,
                "statistic": c.statistic,
                "n": c.n,
                "mean": repr(c.mean),
                "se": "" if math.isnan(c.se) else repr(c.se),
                "values": " ".join(repr(v) for v in c.values),
            }
        )
    return buf.getvalue()


def report_markdown(suite: Suite, preset: str, results: Sequence[RunResult], *, command: str = "") -> str:
    """The suite's full markdown report: final, best, rounds-to-best and wall time tables."""
    labels, tiers = label_order(results), tier_order(results)
    p = suite.presets.get(preset)
    out = [f"# {suite.name} ({preset} preset)", ""]
    if suite.description:
        out += [suite.description, ""]
    if suite.paper:
        out += [f"Paper: {suite.paper}", ""]
    if p and p.notes:
        out += [f"Preset: {p.notes}", ""]
    if command:
        out += [f"Command: `{command}`", ""]
    seeds = sorted({r.seed for r in results})
    out += [f"Seeds: {', '.join(map(str, seeds))}. Cells: mean ± standard error (sd / sqrt(n)) over seeds.", ""]
    for stat, title, digits in (
        ("final", f"Final {suite.metric} (last measured round)", 3),
        ("best", f"Best {suite.metric} over rounds", 3),
        ("rounds-to-best", "Rounds to best (first round reaching the best value; 0 = initial model)", 1),
    ):
        out += [f"## {title}", "", markdown_table(summarize(results, stat), labels=labels, tiers=tiers, digits=digits)]
    if suite.claims:
        out += [
            "## Claims (paired per-seed differences)",
            "",
            "Held: >= 3 common seeds and the paired mean difference >= 2 SE in the claimed direction.",
            "",
            claims_markdown(suite.claims, results),
        ]
    seconds = [[label, format_mean_se(m, s, 0)] for label, (m, s) in wall_times(results).items()]
    out += ["## Wall time per run (s)", "", markdown_rows(["run", "seconds"], seconds)]
    return "\n".join(out) + "\n"


def mean_curve(curves: Sequence[Mapping[int, float]]) -> tuple[list[int], list[float], list[float]]:
    """Per round, mean and standard error over the curves that measured that round."""
    rounds = sorted({r for c in curves for r in c})
    means, ses = [], []
    for r in rounds:
        m, s = mean_se([c[r] for c in curves if r in c])
        means.append(m)
        ses.append(0.0 if math.isnan(s) else s)
    return rounds, means, ses


def plot_convergence(results: Sequence[RunResult], path: Path, *, title: str, metric: str) -> Path:
    """Mean curve of every label, one panel per tier, shaded +/- one standard error; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    tiers, labels = tier_order(results), label_order(results)
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    # same style in every panel; past the palette's colors, the next lines are dashed
    color = {label: palette[i % len(palette)] for i, label in enumerate(labels)}
    styles: tuple[Literal["-", "--", ":"], ...] = ("-", "--", ":")
    style = {label: styles[(i // len(palette)) % 3] for i, label in enumerate(labels)}
    cols = min(len(tiers), 3) or 1
    rows = max(1, math.ceil(len(tiers) / cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 3.4 * rows), squeeze=False, sharey=True)
    for ax, tier in zip(axes.flat, tiers, strict=False):
        for label in labels:
            curves = [r.curves[tier] for r in results if r.label == label and r.curves.get(tier)]
            if not curves:
                continue
            x, m, s = mean_curve(curves)
            ax.plot(x, m, marker=".", color=color[label], linestyle=style[label])
            lo, hi = [a - b for a, b in zip(m, s, strict=True)], [a + b for a, b in zip(m, s, strict=True)]
            ax.fill_between(x, lo, hi, color=color[label], alpha=0.2)
        ax.set_title(tier)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(tiers) :]:
        ax.set_visible(False)
    axes[0][0].set_ylabel(metric)
    handles = [Line2D([], [], color=color[label], linestyle=style[label], marker=".") for label in labels]
    widest = max((len(label) for label in labels), default=1)
    ncol = max(1, min(len(labels), int(4.5 * cols * 14 // (widest + 6))))  # ~14 small characters per inch
    fig.suptitle(title)
    fig.tight_layout()
    # below the panels; the saved image grows to hold it (bbox_inches="tight")
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=ncol, fontsize="small")
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def write_report(
    suite: Suite, preset: str, results: Sequence[RunResult], out: Path, *, command: str = ""
) -> list[Path]:
    """Write ``table.md``, ``table.csv`` and ``convergence.png`` into ``out``; return their paths."""
    out.mkdir(parents=True, exist_ok=True)
    md = out / "table.md"
    md.write_text(report_markdown(suite, preset, results, command=command))
    cells = [c for stat in STATISTICS for c in summarize(results, stat)]
    table = out / "table.csv"
    table.write_text(csv_table(cells, suite=suite.name, preset=preset, metric=suite.metric))
    png = plot_convergence(results, out / "convergence.png", title=f"{suite.name} ({preset})", metric=suite.metric)
    return [md, table, png]
