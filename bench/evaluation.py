"""Evaluation on the CPU: the sBN conv nets in the default vs the channels-last memory layout.

The server tests every kept model on the whole held-out split each round (FlexiFed's
Basic-Common and Standalone: every client's own model), so inference, not training, is most of
a round of the image suites' cpu presets.  For each case (a suite's largest model at its cpu
preset's width, input size and ``eval-batch-size``) the script builds the model the way the
server does -- random weights, then :meth:`models.family.StaticBatchNorm.for_evaluation` on
``--stats-batches`` random training batches -- and times forward passes over ``--images``
random test images, the same evaluation copy once in the default ``NCHW`` layout and once
channels-last (:func:`models.family.channels_last_for_inference`), interleaved, best of
``--repeats``.  ``speed-up = default seconds / channels-last seconds``, measured in one run;
``max |d logit|`` and ``changed predictions`` compare the two layouts' outputs on the same images.

Run ``python -m bench.evaluation --help``; ``--smoke`` is the test suite's tiny run.
"""

from __future__ import annotations

import argparse
import copy
import time
import tomllib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from bench.common import add_run_options, write_report
from experiment.config import RunConfig
from models.family import with_memory_format
from models.training import use_threads

#: ``name -> RunConfig keys``: the image suites' cpu presets (deploy/suites/*.toml); ``variant`` is the tier.
CASES: dict[str, dict[str, Any]] = {
    # flexifed cpu preset: CIFAR VGGs at width 1/8 on Fashion-MNIST
    "vgg11": {"config": "vgg-flexifed-max.toml", "arch-width": 0.125, "variant": "vgg11"},
    "vgg19": {"config": "vgg-flexifed-max.toml", "arch-width": 0.125, "variant": "vgg19"},
    # heterofl cpu preset: HeteroFL's conv net at widths 16:32:64:128, the full-width model
    "heterofl-conv": {"config": "cnn-heterofl-a-e.toml", "cnn-widths": "16:32:64:128", "variant": "a"},
    # depthfl-cnn cpu preset: the 4-exit conv net
    "depthfl-conv": {"config": "depthfl-cnn.toml", "cnn-widths": "16:32:64:128", "variant": "a"},
    # the smallest VGG (smoke)
    "tiny-vgg": {"config": "vgg-flexifed-max.toml", "arch-width": 0.0625, "variant": "vgg11"},
}  # fmt: skip

CONFIGS = Path(__file__).resolve().parent.parent / "deploy" / "configs"


def case_config(case: str) -> tuple[RunConfig, str]:
    """The run config of ``case`` (its config file plus overrides) and the variant it evaluates."""
    keys = dict(CASES[case])
    variant = str(keys.pop("variant"))
    with (CONFIGS / str(keys.pop("config"))).open("rb") as f:
        raw = tomllib.load(f)
    return RunConfig.from_flower({**raw, **keys}), variant


def images(cfg: RunConfig, n: int, batch_size: int, seed: int) -> list[dict[str, Tensor]]:
    """``n`` random images of the run's shape in batches of ``batch_size`` (``{"x", "labels"}``)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg.image_channels, cfg.image_size, cfg.image_size, generator=g)
    y = torch.randint(0, cfg.num_labels, (n,), generator=g)
    return [{"x": x[i : i + batch_size], "labels": y[i : i + batch_size]} for i in range(0, n, batch_size)]


@torch.inference_mode()
def forward_all(model: nn.Module, batches: Sequence[dict[str, Tensor]]) -> tuple[float, Tensor]:
    """Seconds of ``model``'s forward passes over ``batches`` and the concatenated logits."""
    t0 = time.perf_counter()
    logits = [model(x=b["x"]) for b in batches]
    return time.perf_counter() - t0, torch.cat(logits)


def time_case(case: str, n_images: int, stats_batches: int, repeats: int) -> dict[str, Any]:
    """Best-of-``repeats`` inference seconds of ``case`` in both layouts, and how their logits differ."""
    cfg, name = case_config(case)
    family = cfg.family()
    torch.manual_seed(0)
    model = family.build(cfg.catalog.get(name))
    stats = images(cfg, stats_batches * cfg.batch_size, cfg.batch_size, seed=1)
    fast = family.for_evaluation(model, stats)  # type: ignore[arg-type]
    default = with_memory_format(copy.deepcopy(fast), torch.contiguous_format)
    test = images(cfg, n_images, cfg.eval_batch_size, seed=2)
    forward_all(default, test[:1])
    forward_all(fast, test[:1])  # warm-up: oneDNN builds its kernels on first use
    times: dict[str, list[float]] = {"default": [], "channels-last": []}
    for _ in range(repeats):
        t, ref = forward_all(default, test)
        times["default"].append(t)
        t, out = forward_all(fast, test)
        times["channels-last"].append(t)
    best = {k: min(v) for k, v in times.items()}
    return {
        "case": case,
        "variant": name,
        "params": sum(p.numel() for p in model.parameters()),
        "images": n_images,
        "eval_batch_size": cfg.eval_batch_size,
        "seconds": times,
        "best_s": best,
        "speed_up": best["default"] / best["channels-last"],
        "max_abs_logit_diff": float((out - ref).abs().max()),
        "changed_predictions": int((out.argmax(-1) != ref.argmax(-1)).sum()),
    }


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line of :func:`main`."""
    p = argparse.ArgumentParser(prog="python -m bench.evaluation", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--cases", default="vgg11,vgg19,heterofl-conv,depthfl-conv", help=f"of {sorted(CASES)}")
    p.add_argument("--images", type=int, default=10000, help="test images per pass (the Fashion-MNIST test split)")
    p.add_argument("--stats-batches", type=int, default=20, help="training batches of the sBN statistics")
    p.add_argument("--repeats", type=int, default=3)
    add_run_options(p, smoke="a width-1/16 VGG-11, 64 images, 1 repeat")
    a = p.parse_args(argv)
    if a.smoke:
        a.cases, a.images, a.stats_batches, a.repeats = "tiny-vgg", 64, 2, 1
    if a.images < 1 or a.stats_batches < 1 or a.repeats < 1:
        p.error("--images, --stats-batches and --repeats must be >= 1")
    unknown = sorted(set(a.cases.split(",")) - set(CASES))
    if unknown:
        p.error(f"unknown cases {unknown}; known: {sorted(CASES)}")
    return a


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Time every case in both layouts; print the best seconds, the speed-up and the logit difference."""
    a = parse_args(argv)
    threads = use_threads(a.threads)
    print(f"# torch {torch.__version__}, {threads} CPU threads; {a.images} images, best of {a.repeats}")
    print(f"{'case':<15}{'params k':>9}{'default s':>11}{'last s':>9}{'speed-up':>10}{'max|dlogit|':>13}{'changed':>9}")
    rows = []
    for case in a.cases.split(","):
        r = time_case(case, a.images, a.stats_batches, a.repeats)
        rows.append(r)
        print(
            f"{case:<15}{r['params'] / 1e3:>9.1f}{r['best_s']['default']:>11.3f}{r['best_s']['channels-last']:>9.3f}"
            f"{r['speed_up']:>10.2f}{r['max_abs_logit_diff']:>13.2e}{r['changed_predictions']:>9d}",
            flush=True,
        )
    report = {"threads": threads, "images": a.images, "repeats": a.repeats, "rows": rows}
    write_report(a.json, report)
    return report


if __name__ == "__main__":
    main()
