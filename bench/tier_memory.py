"""Each catalog variant's estimated training memory against its measured peak.

The estimate is the catalog's ``Variant.memory.total_mb`` (parameters + gradients + optimizer
state + activations of one batch), what a client compares with its memory budget.  The
measurement follows ``models.memory_probe``: a fresh subprocess per variant imports torch,
warms up, takes its anonymous resident memory as the baseline, then builds the variant with
the run's model family (``RunConfig.family().build``) and trains ``--steps`` batches of the
run's batch size (random token ids of ``max-seq-len`` / random images of the run's size) with
the run's optimizer, sampling anonymous RSS every millisecond (``PeakSampler``);
``measured = peak - baseline``.

Run ``python -m bench.tier_memory --help``; ``--smoke`` is the test suite's tiny run.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import run_child, write_report

ROOT = Path(__file__).resolve().parent.parent

#: ``name -> RunConfig keys``: MiniLM depth tiers (InclusiveFL), width tiers (HeteroFL), CNN widths, VGGs.
CASES: dict[str, dict[str, Any]] = {
    "minilm-depth": {"model": "minilm-l6", "method": "inclusivefl"},
    "minilm-width": {"model": "minilm-l6", "method": "heterofl"},
    "conv-width": {"model": "conv", "method": "heterofl"},
    "vgg": {"model": "vgg", "method": "flexifed-max", "tiers": "vgg11:vgg13:vgg16", "tier-memory-mb": "auto"},
    "tiny-depth": {"model": "tiny", "method": "inclusivefl"},
}


def child(case: str, variant: str, steps: int) -> dict[str, Any]:
    """Train ``variant`` of ``case`` for ``steps`` batches in this fresh process; return the numbers."""
    import torch

    from experiment.config import RunConfig
    from models.memory_probe import PeakSampler, anon_rss_mb
    from models.training import logits_and_loss, make_optimizer

    cfg = RunConfig.model_validate(CASES[case])
    v = cfg.catalog.get(variant)
    family = cfg.family()
    torch.manual_seed(0)
    torch.ones(8, 8) @ torch.ones(8, 8)  # warm up the allocator and thread pool
    b = cfg.batch_size
    baseline = anon_rss_mb()
    with PeakSampler() as sampler:
        model = family.build(v)
        model.train()
        opt = make_optimizer(model, cfg.optimizer, lr=1e-4)
        for _ in range(steps):
            if family.data_kind == "text":
                ids = torch.randint(1000, 30000, (b, cfg.max_seq_len))
                batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
            else:
                batch = {"x": torch.randn(b, cfg.image_channels, cfg.image_size, cfg.image_size)}
            batch["labels"] = torch.randint(0, cfg.num_labels, (b,))
            _, loss = logits_and_loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {
        "case": case,
        "variant": variant,
        "params": v.layout.num_params(),
        "estimated_mb": v.memory.total_mb,
        "measured_mb": sampler.peak - baseline,
        "batch_size": b,
    }


def measure(case: str, variant: str, steps: int) -> dict[str, Any]:
    """:func:`child` in a fresh interpreter."""
    return run_child("bench.tier_memory", [case, variant, "--steps", str(steps)], f"{case}/{variant}")


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line of :func:`main`."""
    p = argparse.ArgumentParser(prog="python -m bench.tier_memory", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--cases", default="minilm-depth,minilm-width,conv-width,vgg", help=f"of {sorted(CASES)}")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", nargs=2, metavar=("CASE", "VARIANT"), help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="the tiny transformer's tiers, 1 step")
    a = p.parse_args(argv)
    if a.smoke:
        a.cases, a.steps = "tiny-depth", 1
    return a


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Measure every variant of every case; print estimated vs measured."""
    a = parse_args(argv)
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.steps)))
        return {}
    from experiment.config import RunConfig

    rows = []
    print(f"{'case':<14}{'variant':<9}{'params M':>9}{'batch':>6}{'est MB':>8}{'meas MB':>9}{'est/meas':>9}")
    for case in a.cases.split(","):
        for v in RunConfig.model_validate(CASES[case]).catalog:
            r = measure(case, v.name, a.steps)
            r["ratio"] = r["estimated_mb"] / r["measured_mb"] if r["measured_mb"] > 0 else float("nan")
            rows.append(r)
            print(
                f"{case:<14}{v.name:<9}{r['params'] / 1e6:>9.2f}{r['batch_size']:>6}{r['estimated_mb']:>8.1f}"
                f"{r['measured_mb']:>9.1f}{r['ratio']:>9.2f}",
                flush=True,
            )
    report = {"steps": a.steps, "rows": rows}
    write_report(a.json, report)
    return report


if __name__ == "__main__":
    main()
