"""The ServerApp: validated config -> catalog -> strategy -> Flower's round loop -> results."""

from __future__ import annotations

import time
from collections.abc import Mapping
from logging import INFO
from pathlib import Path

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from torch import Tensor
from torch.utils.data import DataLoader

from models.data import DataSpec, num_labels, server_stats_set, server_test_set
from models.family import ArchitectureFamily
from models.images import image_shape
from models.training import evaluate_classifier
from server.config import FLEXIFED_MODES, ConfigError, RunConfig
from server.results import ResultsWriter
from strategies.base import HeterogeneousStrategy
from strategies.baselines import LocalTraining
from strategies.flexifed import FlexiFed
from strategies.heterofl import HeteroFL, WidthRules
from strategies.inclusivefl import InclusiveFL

app = ServerApp()


def build_strategy(cfg: RunConfig) -> HeterogeneousStrategy:
    """The strategy for ``cfg.method`` over ``cfg.training_catalog``."""
    common = {
        "catalog": cfg.training_catalog,
        "fraction_train": cfg.fraction_train,
        "fraction_evaluate": cfg.fraction_evaluate,
        "min_train_nodes": cfg.min_train_nodes,
        "min_evaluate_nodes": 1,
        "min_available_nodes": cfg.min_available_nodes,
        "assign": "largest" if cfg.method == "all-large" else "choice",
        "seed": cfg.seed,
    }
    if cfg.method == "local":
        return LocalTraining(**common)  # type: ignore[arg-type]
    family = cfg.family()
    if isinstance(family, ArchitectureFamily):
        return FlexiFed(
            signatures=family.layers(cfg.catalog),
            mode=FLEXIFED_MODES[cfg.method],
            uniform=cfg.flexifed_uniform,
            share_classifier=cfg.flexifed_share_classifier,
            **common,  # type: ignore[arg-type]
        )
    if cfg.uses_width:
        return HeteroFL(
            rules=WidthRules(axes=family.width_rules(cfg.catalog)),
            full=cfg.catalog.largest,
            rolling=cfg.method == "fedrolex",
            server_optimizer=cfg.heterofl_server_optimizer,
            adam=cfg.fedadam(),
            **common,  # type: ignore[arg-type]
        )
    beta = cfg.beta if cfg.method == "inclusivefl" else 0.0
    return InclusiveFL(beta=beta, adam=cfg.fedadam(), **common)  # type: ignore[arg-type]


class CentralEvaluator:
    """Evaluate every variant's model(s) on the server's held-out test set.

    For families with data-dependent normalization (the CNNs' static batch norm) the
    statistics are first recomputed on a sample of the training split, as HeteroFL's server
    does (:func:`models.data.server_stats_set`).
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.family = cfg.family()
        spec = cfg.data_spec()
        self.loader: DataLoader = self.family.loader(
            server_test_set(spec), batch_size=cfg.eval_batch_size, shuffle=False
        )
        self.stats: DataLoader | None = None
        if self.family.data_kind == "image":
            self.stats = self.family.loader(
                server_stats_set(spec), batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed
            )

    def evaluate(self, variant: str, params: Mapping[str, Tensor]) -> tuple[float, float]:
        """``(loss, accuracy)`` of one model."""
        model = self.family.build(self.cfg.catalog.get(variant))
        model.load_state_dict(dict(params), strict=False)
        loss, acc, _ = evaluate_classifier(self.family.for_evaluation(model, self.stats), self.loader)
        return loss, acc

    def __call__(self, models: Mapping[str, list[Mapping[str, Tensor]]]) -> dict[str, dict[str, float]]:
        """Mean loss/accuracy per variant over its models."""
        out = {}
        for variant, params_list in models.items():
            results = [self.evaluate(variant, p) for p in params_list]
            out[variant] = {
                "loss": sum(r[0] for r in results) / len(results),
                "accuracy": sum(r[1] for r in results) / len(results),
            }
        return out


def check_data(cfg: RunConfig, spec: DataSpec) -> None:
    """Fail fast when the data does not fit the configured model (classes, image shape)."""
    classes = num_labels(spec)
    if classes > cfg.num_labels:
        raise ConfigError(
            f"run config 'num-labels': {cfg.num_labels} but dataset {cfg.dataset!r} has {classes} classes"
        )
    if cfg.image_data:
        c, h, w = image_shape(server_test_set(spec))
        if c != cfg.image_channels:
            raise ConfigError(f"run config 'image-channels': {cfg.image_channels} but the images have {c} channels")
        if (h, w) != (cfg.image_size, cfg.image_size):
            raise ConfigError(f"run config 'image-size': {cfg.image_size} but the images are {h}x{w}")


def results_folder(cfg: RunConfig) -> Path:
    """``<results-dir>/<run-name or method-timestamp>``."""
    name = cfg.run_name or f"{cfg.method}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Path(cfg.results_dir).expanduser().resolve() / name


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run ``num-server-rounds`` rounds of the configured method and write results."""
    cfg = RunConfig.from_flower(context.run_config)
    check_data(cfg, cfg.data_spec())
    strategy = build_strategy(cfg)
    torch.manual_seed(cfg.seed)
    init = cfg.family().initial_states(cfg.catalog, seed=cfg.seed)
    if isinstance(strategy, HeteroFL):  # one full model; tiers are cut from it each round
        arrays = strategy.set_state({HeteroFL.GLOBAL: init[cfg.catalog.largest.name]})
    else:
        arrays = strategy.set_state({v.name: init[v.name] for v in cfg.training_catalog})
    evaluator = CentralEvaluator(cfg)
    writer = ResultsWriter(
        results_folder(cfg),
        method=cfg.method,
        tiers=cfg.training_catalog.names(),
        config=cfg.model_dump(by_alias=True),
    )
    log(INFO, "results go to %s", writer.folder)

    def evaluate_fn(server_round: int, _arrays: ArrayRecord) -> MetricRecord:
        central = evaluator(strategy.models_for_evaluation())
        report = strategy.reports.get(server_round)
        writer.write_round(server_round, central, report)
        out = MetricRecord()
        for variant, vals in central.items():
            out[f"{variant}/accuracy"] = vals["accuracy"]
            out[f"{variant}/loss"] = vals["loss"]
        return out

    strategy.start(
        grid=grid,
        initial_arrays=arrays,
        num_rounds=cfg.num_server_rounds,
        timeout=cfg.round_timeout,
        train_config=ConfigRecord(),
        evaluate_config=ConfigRecord(),
        evaluate_fn=evaluate_fn,
    )
    writer.finish()
