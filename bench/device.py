"""Local training on the CPU vs a CUDA GPU: one client's round of the paper presets' models.

For each case (the largest variant of a paper preset's model, at the preset's input size and
batch size) the script times ``models.training.train_classifier`` -- the ClientApp's own
training loop, with the run's optimizer -- for ``--steps`` optimizer steps on each device
(``device = "cpu"`` and ``"cuda"`` in the run config), after ``--warmup`` steps on that
device; the batches are random inputs and labels built once on the host, so every step also
pays the host-to-device copy a real loader's batch does.  ``speed-up = cpu seconds / gpu
seconds``, measured in one run; CPU threads are torch's default (one per core) unless
``--threads``.

Run ``python -m bench.device --help``; ``--smoke`` is the test suite's tiny run (CPU only).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import torch

from bench.common import add_run_options, write_report
from experiment.config import RunConfig
from models.training import TrainSettings, resolve_device, train_classifier, use_threads

#: ``name -> RunConfig keys``: the paper presets' largest client models (deploy/suites/*.toml).
CASES: dict[str, dict[str, Any]] = {
    # heterofl paper preset: PreResNet-18 on CIFAR-10, batch 10, SGD
    "preresnet18": {
        "model": "preresnet18", "method": "heterofl", "cnn-widths": "64:128:256:512", "image-channels": 3,
        "image-size": 32, "num-labels": 10, "batch-size": 10, "optimizer": "sgd", "lr": 0.1,
    },
    # flexifed paper preset: full-width VGG-16 on CIFAR-10
    "vgg16": {
        "model": "vgg", "method": "flexifed-max", "tiers": "vgg11:vgg16", "tier-proportions": "1:1",
        "tier-memory-mb": "auto", "arch-width": 1.0,
        "image-channels": 3, "image-size": 32, "num-labels": 10, "batch-size": 32, "optimizer": "sgd", "lr": 0.01,
    },
    # codist-table1 paper preset: the large CNN on CIFAR-100, batch 20
    "codist-large": {
        "model": "codist-cnn", "method": "codist-fedavg", "tiers": "small:large", "tier-proportions": "1:1",
        "tier-memory-mb": "auto", "image-channels": 3, "image-size": 32, "num-labels": 100, "batch-size": 20,
        "optimizer": "sgd", "lr": 0.05,
    },
    # the CI's tiny transformer (smoke)
    "tiny": {"model": "tiny", "method": "all-large", "batch-size": 8},
}  # fmt: skip


def batches(cfg: RunConfig, n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """``n`` random host batches of the run's shape (images, or token ids of ``max-seq-len``)."""
    g = torch.Generator().manual_seed(seed)
    b = cfg.batch_size
    text = cfg.family().data_kind == "text"
    out = []
    for _ in range(n):
        if text:
            ids = torch.randint(1000, 30000, (b, cfg.max_seq_len), generator=g)
            batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        else:
            batch = {"x": torch.randn(b, cfg.image_channels, cfg.image_size, cfg.image_size, generator=g)}
        batch["labels"] = torch.randint(0, cfg.num_labels, (b,), generator=g)
        out.append(batch)
    return out


def time_training(case: str, device: str, steps: int, warmup: int) -> dict[str, Any]:
    """Seconds of ``steps`` training steps of ``case``'s largest variant on ``device`` (after ``warmup``)."""
    cfg = RunConfig.from_flower({**CASES[case], "device": device})
    dev = cfg.torch_device()
    variant = cfg.catalog.largest
    torch.manual_seed(0)
    model = cfg.family().build(variant).to(dev)
    data = batches(cfg, max(steps, warmup))
    settings = TrainSettings(optimizer=cfg.optimizer, lr=cfg.lr, local_steps=warmup)
    train_classifier(model, data, settings)  # type: ignore[arg-type]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    loss = train_classifier(model, data, TrainSettings(optimizer=cfg.optimizer, lr=cfg.lr, local_steps=steps))  # type: ignore[arg-type]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    seconds = time.perf_counter() - t0
    return {
        "case": case, "device": str(dev), "variant": variant.name, "params": variant.layout.num_params(),
        "batch_size": cfg.batch_size, "steps": steps, "seconds": seconds, "loss": loss,
    }  # fmt: skip


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Command line of :func:`main`."""
    p = argparse.ArgumentParser(prog="python -m bench.device", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--cases", default="preresnet18,vgg16,codist-large", help=f"of {sorted(CASES)}")
    p.add_argument("--devices", default="cpu,cuda", help="devices to compare (the first is the reference)")
    p.add_argument("--steps", type=int, default=50, help="timed optimizer steps (HeteroFL's preset: 50 per round)")
    p.add_argument("--warmup", type=int, default=5)
    add_run_options(p, smoke="the tiny transformer on the CPU, 2 steps")
    a = p.parse_args(argv)
    if a.smoke:
        a.cases, a.devices, a.steps, a.warmup = "tiny", "cpu", 2, 1
    if a.steps < 1 or a.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    return a


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Time every case on every device; print seconds per step and the speed-up over the first device."""
    a = parse_args(argv)
    devices = a.devices.split(",")
    for d in devices:
        resolve_device(d)  # fails fast, naming the device, before any timing
    threads = use_threads(a.threads)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    print(f"# torch {torch.__version__}, {threads} CPU threads, GPU {gpu}; {a.steps} steps after {a.warmup}")
    print(f"{'case':<14}{'variant':<9}{'params M':>9}{'batch':>6}{'device':>8}{'s/step':>10}{'speed-up':>10}")
    rows = []
    for case in a.cases.split(","):
        base = None
        for d in devices:
            r = time_training(case, d, a.steps, a.warmup)
            per_step = r["seconds"] / r["steps"]
            base = per_step if base is None else base
            r["speed_up"] = base / per_step
            rows.append(r)
            print(
                f"{case:<14}{r['variant']:<9}{r['params'] / 1e6:>9.2f}{r['batch_size']:>6}{d:>8}"
                f"{per_step:>10.4f}{r['speed_up']:>10.1f}",
                flush=True,
            )
    report = {"steps": a.steps, "warmup": a.warmup, "threads": threads, "gpu": gpu, "rows": rows}
    write_report(a.json, report)
    return report


if __name__ == "__main__":
    main()
