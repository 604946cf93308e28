"""The ServerApp: validated config -> catalog -> strategy -> Flower's round loop -> results.

After every round (once its results row is written) the complete server state is
checkpointed (:mod:`server.checkpoint`).  With ``resume = true`` the run restores the last
good checkpoint (round ``k``), rewrites ``rounds.jsonl`` with the rows it holds, and lets
Flower's loop run the remaining ``N - k`` rounds, which the strategy numbers ``k + 1 .. N``
(:meth:`~strategies.base.HeterogeneousStrategy.global_round`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, MetricRecord
from flwr.common import log
from flwr.serverapp import Grid, ServerApp
from torch import Tensor, nn
from torch.utils.data import DataLoader

from experiment.config import ConfigError, RunConfig
from experiment.preflight import start_checks
from experiment.registry import FactoryNotFound, MethodEntry, load_factory
from models.data import (
    DataSpec,
    num_labels,
    server_stats_set,
    server_test_set,
)
from models.exits import EXIT_MODELS, evaluate_exits
from models.images import image_shape
from models.shared_trunk import evaluate_shared_trunk, trunk_groups
from models.training import evaluate_classifier, use_threads
from server.checkpoint import (
    Checkpoint,
    CheckpointIncompatible,
    Fingerprint,
    capture_rng,
    clear_checkpoints,
    fingerprint,
    latest_checkpoint,
    prune_checkpoints,
    restore_rng,
    write_checkpoint,
)
from server.results import ResultsWriter, majority_rate
from strategies.base import HeterogeneousStrategy

app = ServerApp()


def strategy_options(cfg: RunConfig, entry: MethodEntry) -> dict[str, Any]:
    """The keyword options of :class:`~strategies.base.HeterogeneousStrategy` every factory passes on."""
    return {
        "catalog": cfg.training_catalog,
        "fraction_train": cfg.fraction_train,
        "fraction_evaluate": cfg.fraction_evaluate,
        "min_train_nodes": cfg.min_train_nodes,
        "min_evaluate_nodes": 1,
        "min_available_nodes": cfg.min_available_nodes,
        "assign": entry.assign,
        "seed": cfg.seed,
        "clip_update_norm": cfg.clip_bounds,
        "robust_aggregation": cfg.robust_aggregation,
    }


def build_strategy(cfg: RunConfig) -> HeterogeneousStrategy:
    """The strategy of ``cfg.method``: its registry entry's factory over ``cfg.training_catalog``.

    The entry (:mod:`experiment.registry`) names the factory, a function of the method's module
    in ``strategies/``; every factory gets the options all strategies share (:func:`strategy_options`).
    """
    entry = cfg.entry
    strategy = load_factory(entry)(cfg, entry, strategy_options(cfg, entry))
    if not isinstance(strategy, HeterogeneousStrategy):
        raise FactoryNotFound(
            f"method {entry.name!r}: factory {entry.strategy!r} returned {type(strategy).__name__}, not a strategy"
        )
    return strategy


class CentralEvaluator:
    """Evaluate every variant's model(s) on the server's held-out test set.

    For families with data-dependent normalization (the CNNs' static batch norm) the
    statistics are first recomputed on a sample of the training split, as HeteroFL's server
    does (:func:`models.data.server_stats_set`).
    """

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg
        self.family = cfg.family()
        self.device = cfg.torch_device()
        spec = cfg.data_spec()
        test = server_test_set(spec)
        #: ``(split, examples, majority-class rate)`` of the evaluation set, for the results
        self.held_out = (spec.eval_split, len(test), majority_rate([int(y) for y in test["label"]]))
        self.loaders: dict[str, DataLoader] = {
            d: self.family.loader(test, batch_size=cfg.eval_batch_size, shuffle=False, domain=d) for d in cfg.domains
        }
        self.stats: dict[str, DataLoader] = {}
        if self.family.data_kind == "image":
            sample = server_stats_set(spec)
            self.stats = {
                d: self.family.loader(sample, batch_size=cfg.batch_size, shuffle=True, seed=cfg.seed, domain=d)
                for d in cfg.domains
            }

    def model(self, variant: str, params: Mapping[str, Tensor]) -> nn.Module:
        """The variant's model with ``params`` loaded, on the evaluation device."""
        model = self.family.build(self.cfg.catalog.get(variant))
        model.load_state_dict(dict(params), strict=False)
        return model.to(self.device)

    def evaluate(self, variant: str, params: Mapping[str, Tensor]) -> dict[str, float]:
        """:meth:`metrics` of the variant's model with ``params``."""
        return self.metrics(self.model(variant, params))

    def metrics(self, model: nn.Module) -> dict[str, float]:
        """``loss`` and ``accuracy`` of one model, and per input domain when the run has several.

        With domains (``tier-domains``) the test set is evaluated once per domain
        (``accuracy-<domain>``, ``loss-<domain>``); ``accuracy`` / ``loss`` are their means, i.e.
        the mixed test set of equal shares.  Static batch-norm statistics come from the same
        domain's training sample.  A multi-exit model (DepthFL's) adds each exit's accuracy
        alone, ``exit-<i>-accuracy`` (:func:`models.exits.evaluate_exits`).
        """
        per_domain: dict[str, dict[str, float]] = {}
        for domain, loader in self.loaders.items():
            evaluated = self.family.for_evaluation(model, self.stats.get(domain))
            if isinstance(evaluated, EXIT_MODELS):  # a multi-exit model: each exit's accuracy too
                per_domain[domain] = evaluate_exits(evaluated, loader).metrics()
            else:
                loss, acc, _ = evaluate_classifier(evaluated, loader)
                per_domain[domain] = {"loss": loss, "accuracy": acc}
        keys = next(iter(per_domain.values()))
        out = {k: sum(m[k] for m in per_domain.values()) / len(per_domain) for k in keys}
        if len(per_domain) > 1:
            out.update({f"{k}-{d}": v for d, m in per_domain.items() for k, v in m.items()})
        return out

    @property
    def can_share_trunks(self) -> bool:
        """Whether :meth:`by_shared_trunk` applies: text, one input domain, no batch statistics."""
        return self.family.data_kind == "text" and not self.family.uses_statistics and len(self.loaders) == 1

    def by_shared_trunk(self, params: Mapping[str, Mapping[str, Tensor]]) -> dict[str, dict[str, float]]:
        """:meth:`metrics` of one model per variant, variants sharing a trunk in one pass.

        Depth variants whose embeddings and encoder layers equal the deepest one's (InclusiveFL
        after every round) are evaluated by :func:`models.shared_trunk.evaluate_shared_trunk`:
        the same logits as their own forward passes, with ``L_max`` instead of ``sum_j L_j``
        layers run per batch.  Every other model is evaluated on its own.

        Raises
        ------
        ValueError
            When :attr:`can_share_trunks` is false.

        """
        if not self.can_share_trunks:
            raise ValueError("shared-trunk evaluation needs text, one input domain and no batch statistics")
        (loader,) = self.loaders.values()
        built = {variant: self.model(variant, p) for variant, p in params.items()}
        out: dict[str, dict[str, float]] = {}
        for group in trunk_groups(built):
            if len(group) == 1:
                out[group[0]] = self.metrics(built[group[0]])
                continue
            for variant, (loss, acc, _) in evaluate_shared_trunk({v: built[v] for v in group}, loader).items():
                out[variant] = {"loss": loss, "accuracy": acc}
        return {variant: out[variant] for variant in params}

    def generators(self) -> dict[str, torch.Generator]:
        """Random generators whose state belongs in a checkpoint (the sBN statistics samplers)."""
        out = {}
        for domain, loader in self.stats.items():
            gen = getattr(loader, "generator", None)
            if isinstance(gen, torch.Generator):
                out["evaluator-stats" if domain == "plain" else f"evaluator-stats-{domain}"] = gen
        return out

    def __call__(self, models: Mapping[str, list[Mapping[str, Tensor]]]) -> dict[str, dict[str, float]]:
        """Mean of every metric of :meth:`evaluate` per variant over its models.

        Text runs with one model per variant go through :meth:`by_shared_trunk` (the same numbers).
        """
        one_each = bool(models) and all(len(p) == 1 for p in models.values())
        if one_each and self.can_share_trunks:
            return self.by_shared_trunk({variant: p[0] for variant, p in models.items()})
        out = {}
        for variant, params_list in models.items():
            results = [self.evaluate(variant, p) for p in params_list]
            out[variant] = {k: sum(r[k] for r in results) / len(results) for k in results[0]}
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


def checkpoint_folder(cfg: RunConfig, results: Path) -> Path:
    """``checkpoint-dir``, or ``<results folder>/checkpoints`` when it is empty."""
    return Path(cfg.checkpoint_dir).expanduser().resolve() if cfg.checkpoint_dir else results / "checkpoints"


def resume_point(cfg: RunConfig, folder: Path, fp: Fingerprint) -> Checkpoint | None:
    """The checkpoint to resume from (``resume = true``), else ``None`` after clearing stale checkpoints.

    A fresh run deletes the ``round-*.ckpt`` files already in ``folder`` (a later resume must
    never pick up an older run's rounds).  ``resume`` without any checkpoint starts from scratch
    with a warning (a restart policy may set ``resume`` on the very first start).

    Raises
    ------
    CheckpointIncompatible
        The newest readable checkpoint belongs to another method / model / catalog.
    CheckpointCorrupt
        Every checkpoint in the folder is corrupt.
    ConfigError
        The checkpoint is after round ``num-server-rounds``.

    """
    if not cfg.resume:
        removed = clear_checkpoints(folder)
        if removed:
            log(WARNING, "fresh run: removed %d old checkpoints from %s", len(removed), folder)
        return None
    ckpt = latest_checkpoint(folder, fp)
    if ckpt is None:
        log(WARNING, "resume: no checkpoint in %s, starting from round 1", folder)
        return None
    if ckpt.server_round > cfg.num_server_rounds:
        raise ConfigError(
            f"run config 'num-server-rounds': {cfg.num_server_rounds}, "
            f"but {ckpt.path} is after round {ckpt.server_round}"
        )
    return ckpt


def restore(
    strategy: HeterogeneousStrategy, evaluator: CentralEvaluator, ckpt: Checkpoint
) -> tuple[ArrayRecord, list[dict[str, Any]]]:
    """Load a verified checkpoint into the strategy and the RNGs; return the model record and results rows.

    Raises
    ------
    CheckpointIncompatible
        The payload does not fit this strategy or catalog (or its rows are not rounds ``0 .. k``).

    """
    payload = ckpt.payload
    try:
        arrays = strategy.load_checkpoint_state(payload["strategy"], ckpt.server_round)
        restore_rng(payload["rng"], evaluator.generators())
        rows = [dict(r) for r in payload["results"]]
        if [r.get("round") for r in rows] != list(range(ckpt.server_round + 1)):
            raise ValueError(f"results rows are rounds {[r.get('round') for r in rows]}")
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointIncompatible(f"{ckpt.path}: {exc}") from exc
    return arrays, rows


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run (or resume) ``num-server-rounds`` rounds of the configured method and write results."""
    cfg = RunConfig.from_flower(context.run_config)
    notes, start_warnings = start_checks(cfg, Path.cwd())
    for message in notes:
        log(INFO, "pre-flight: %s", message)
    for message in start_warnings:
        log(WARNING, "pre-flight: %s", message)
    use_threads(cfg.server_threads)
    check_data(cfg, cfg.data_spec())
    strategy = build_strategy(cfg)
    torch.manual_seed(cfg.seed)
    arrays = strategy.set_state(strategy.initial_state(cfg.family().initial_states(cfg.catalog, seed=cfg.seed)))
    evaluator = CentralEvaluator(cfg)
    folder = results_folder(cfg)
    ckpt_dir = checkpoint_folder(cfg, folder)
    fp = fingerprint(cfg.method, cfg.model, cfg.catalog)
    resumed = resume_point(cfg, ckpt_dir, fp)
    rows = None
    if resumed is not None:
        arrays, rows = restore(strategy, evaluator, resumed)
        log(
            INFO,
            "resumed from %s: Flower's rounds 1..%d are this run's rounds %d..%d",
            resumed.path,
            cfg.num_server_rounds - resumed.server_round,
            resumed.server_round + 1,
            cfg.num_server_rounds,
        )
    writer = ResultsWriter(
        folder,
        method=cfg.method,
        tiers=cfg.training_catalog.names(),
        config=cfg.model_dump(by_alias=True),
        held_out=evaluator.held_out,
        rows=rows,
    )
    log(INFO, "results go to %s", writer.folder)

    def evaluate_fn(flower_round: int, _arrays: ArrayRecord) -> MetricRecord | None:
        if flower_round == 0 and resumed is not None:
            return None  # round k is already in the results
        server_round = strategy.global_round(flower_round)
        central = evaluator(strategy.models_for_evaluation())
        report = strategy.reports.get(server_round)
        writer.write_round(server_round, central, report)
        if server_round > 0 and cfg.checkpoint_keep > 0:
            payload = {
                "strategy": strategy.checkpoint_state(),
                "rng": capture_rng(evaluator.generators()),
                "results": writer.rows,
            }
            path = write_checkpoint(ckpt_dir, server_round, payload, fp)
            prune_checkpoints(ckpt_dir, cfg.checkpoint_keep)
            log(INFO, "checkpoint: %s", path)
        out = MetricRecord()
        for variant, vals in central.items():
            out[f"{variant}/accuracy"] = vals["accuracy"]
            out[f"{variant}/loss"] = vals["loss"]
        return out

    strategy.start(
        grid=grid,
        initial_arrays=arrays,
        num_rounds=cfg.num_server_rounds - strategy.round_offset,
        timeout=cfg.round_timeout,
        train_config=ConfigRecord(),
        evaluate_config=ConfigRecord(),
        evaluate_fn=evaluate_fn,
    )
    writer.finish([*start_warnings, *strategy.plan_warnings])
    for message in strategy.plan_warnings:  # said at the first handshake; repeated beside the verdict
        log(WARNING, "%s", message)
