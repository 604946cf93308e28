"""Results of a run: ``rounds.jsonl``, ``summary.csv``, ``accuracy.png`` and a rich table.

One JSON object per round (round 0 = the initial models)::

    {"round": 3, "seconds": 41.2, "method": "inclusivefl",
     "tiers": {"weak": {"global-accuracy": ..., "local-accuracy": ..., "local-loss": ...,
                         "fed-accuracy": ..., "clients": 2, "bytes-down": ..., "bytes-up": ...}, ...},
     "rejected": [...], "failed": [...]}

``global-*`` is the strongest variant on the server's held-out set (InclusiveFL's
"global inference"), ``local-*`` each tier's own model on that set, ``fed-*`` each
tier's own model on its clients' local test splits (example-weighted).  The held-out set is
the test split, or with ``eval-split = "validation"`` the validation carve of the training
split (:func:`models.data.load_splits`); ``summary.csv`` states which, and each tier's final
accuracy against the majority-class rate of that set (what a model that never leaves the
majority class scores).
"""

from __future__ import annotations

import csv
import json
import math
import os
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from experiment.outputs import WARNINGS_FILE
from strategies.replies import RoundReport

#: A tier "learns" when its final accuracy is at least this far above the majority-class rate.
LEARNS_MARGIN = 0.10


def majority_rate(labels: Sequence[int]) -> float:
    """Share of the most frequent label: the accuracy of always predicting it (0.0 for no labels)."""
    if not labels:
        return 0.0
    return max(Counter(labels).values()) / len(labels)


def verdict(accuracy: float | None, majority: float) -> str:
    """``"learns"`` (>= majority + :data:`LEARNS_MARGIN`), ``"majority class"`` (within 0.01 of it), else ``"weak"``."""
    if accuracy is None or math.isnan(accuracy):
        return "-"
    if accuracy >= majority + LEARNS_MARGIN:
        return "learns"
    if abs(accuracy - majority) <= 0.01:
        return "majority class"
    return "weak"


class ResultsWriter:
    """Append-only writer of one run's results folder.

    Parameters
    ----------
    folder : Path
        The run's results folder (created).
    method : str
    tiers : list[str]
        Tier names, weakest first (table and plot order).
    config : dict[str, Any]
        Written to ``config.json``.
    held_out : tuple[str, int, float]
        ``(split name, examples, majority-class rate)`` of the server's held-out set
        (:attr:`server.app.CentralEvaluator.held_out`).
    rows : Sequence[dict[str, Any]], optional
        Rows of a resumed run (from its checkpoint): ``rounds.jsonl`` is rewritten with exactly
        these (atomically), so rounds the crashed run logged after its checkpoint are dropped and
        never duplicated; ``elapsed`` continues from the last row.

    """

    def __init__(
        self,
        folder: Path,
        *,
        method: str,
        tiers: list[str],
        config: dict[str, Any],
        held_out: tuple[str, int, float],
        rows: Sequence[dict[str, Any]] | None = None,
    ) -> None:
        self.folder = folder
        self.held_out = held_out
        self.method = method
        self.tiers = tiers
        self.rows: list[dict[str, Any]] = [dict(r) for r in rows or ()]
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True))
        self._jsonl = folder / "rounds.jsonl"
        tmp = folder / ".rounds.jsonl.tmp"
        tmp.write_text("".join(json.dumps(r) + "\n" for r in self.rows))
        os.replace(tmp, self._jsonl)
        self.console = Console(stderr=False)
        self._t0 = time.time() - (float(self.rows[-1].get("elapsed", 0.0)) if self.rows else 0.0)

    def write_round(
        self, server_round: int, central: dict[str, dict[str, float]], report: RoundReport | None
    ) -> dict[str, Any]:
        """Append one round; ``central[variant]`` holds ``accuracy``/``loss`` on the server test set."""
        largest = self.tiers[-1] if self.tiers[-1] in central else (list(central)[-1] if central else None)
        tiers: dict[str, dict[str, float]] = {}
        for tier in sorted(set(central) | set(report.groups if report else {}), key=self._order):
            row: dict[str, float] = {}
            if tier in central:
                row["local-accuracy"] = central[tier]["accuracy"]
                row["local-loss"] = central[tier]["loss"]
                for key, value in central[tier].items():  # per input domain: local-accuracy-<domain>, ...
                    if key not in ("accuracy", "loss"):
                        row[f"local-{key}"] = value
            if report and tier in report.groups:
                row.update(report.groups[tier])
            tiers[tier] = row
        record: dict[str, Any] = {
            "round": server_round,
            "seconds": round(time.time() - report.started, 3) if report else 0.0,
            "elapsed": round(time.time() - self._t0, 3),
            "method": self.method,
            "global-accuracy": central[largest]["accuracy"] if largest else None,
            "global-loss": central[largest]["loss"] if largest else None,
            "tiers": tiers,
            "rejected": list(report.rejected) if report else [],
            "failed": list(report.failed) if report else [],
        }
        self.rows.append(record)
        with self._jsonl.open("a") as f:
            f.write(json.dumps(record) + "\n")
        acc = ", ".join(f"{t} {r.get('local-accuracy', float('nan')):.3f}" for t, r in tiers.items())
        self.console.print(f"[bold]round {server_round}[/bold] ({record['seconds']:.1f}s) accuracy: {acc}")
        return record

    def _order(self, tier: str) -> int:
        return self.tiers.index(tier) if tier in self.tiers else len(self.tiers)

    def finish(self, warnings: Sequence[str] = ()) -> Path:
        """Write ``summary.csv``, ``accuracy.png`` and the run's ``warnings`` and print the summary table.

        ``warnings``: what the run found it could not do as asked (e.g. a variant no node chose);
        written one per line to ``warnings.txt`` (removed when there are none), which the
        launcher prints again beside its verdict.
        """
        summary = self.folder / "summary.csv"
        warned = self.folder / WARNINGS_FILE
        if warnings:
            warned.write_text("".join(f"{w}\n" for w in warnings))
        else:
            warned.unlink(missing_ok=True)
        final = self.rows[-1] if self.rows else {"tiers": {}}
        best: dict[str, tuple[float, int]] = {}
        for row in self.rows:
            for tier, vals in row["tiers"].items():
                acc = vals.get("local-accuracy")
                if acc is not None and acc > best.get(tier, (-1.0, 0))[0]:
                    best[tier] = (acc, row["round"])
        fields = [
            "method",
            "tier",
            "final-local-accuracy",
            "final-fed-accuracy",
            "best-local-accuracy",
            "best-round",
            "rounds",
            "bytes-down",
            "bytes-up",
            "held-out",
            "held-out-size",
            "majority-rate",
            "verdict",
        ]
        split, size, majority = self.held_out
        lines = []
        for tier, vals in final["tiers"].items():
            down = sum(r["tiers"].get(tier, {}).get("bytes-down", 0) for r in self.rows)
            up = sum(r["tiers"].get(tier, {}).get("bytes-up", 0) for r in self.rows)
            lines.append(
                {
                    "method": self.method,
                    "tier": tier,
                    "final-local-accuracy": vals.get("local-accuracy"),
                    "final-fed-accuracy": vals.get("fed-accuracy"),
                    "best-local-accuracy": best.get(tier, (None, None))[0],
                    "best-round": best.get(tier, (None, None))[1],
                    "rounds": len(self.rows) - 1,
                    "bytes-down": int(down),
                    "bytes-up": int(up),
                    "held-out": split,
                    "held-out-size": size,
                    "majority-rate": round(majority, 4),
                    "verdict": verdict(vals.get("local-accuracy"), majority),
                }
            )
        with summary.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerows(lines)
        self._plot()
        table = Table(
            title=f"{self.method}: accuracy per tier on the {split} split ({size} examples; "
            f"majority class {majority:.3f})"
        )
        for col in ("tier", "final acc", "vs majority", "fed acc", "best acc", "best round", "MB down", "MB up"):
            table.add_column(col)
        for line in lines:
            table.add_row(
                str(line["tier"]),
                _fmt(line["final-local-accuracy"]),
                str(line["verdict"]),
                _fmt(line["final-fed-accuracy"]),
                _fmt(line["best-local-accuracy"]),
                str(line["best-round"]),
                f"{line['bytes-down'] / 1e6:.1f}",
                f"{line['bytes-up'] / 1e6:.1f}",
            )
        self.console.print(table)
        self.console.print(f"results: {self.folder}")
        return summary

    def _plot(self) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        tiers = sorted({t for r in self.rows for t in r["tiers"]}, key=self._order)
        for tier in tiers:
            pts = [
                (r["round"], r["tiers"][tier]["local-accuracy"])
                for r in self.rows
                if "local-accuracy" in r["tiers"].get(tier, {})
            ]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=tier)
        ax.set_xlabel("round")
        split, _, majority = self.held_out
        if majority > 0:
            ax.axhline(majority, color="grey", linestyle=":", label="majority class")
        ax.set_ylabel(f"accuracy ({split} split)")
        ax.set_title(self.method)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(self.folder / "accuracy.png", dpi=100)
        plt.close(fig)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"
