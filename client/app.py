"""The ClientApp: ``query`` (profile + variant choice), ``train`` and ``evaluate``.

A node answers the server's handshake with its device profile and the largest
catalog variant whose estimated training memory fits its budget (or declines with
the reason), then trains exactly the variant the server sends it.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from logging import INFO, WARNING
from pathlib import Path

import torch
from datasets import Dataset
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from torch import nn
from torch.utils.data import DataLoader

from client.held import held_arrays_mod
from client.pfedknow import pfedknow_train
from client.profile import DeviceProfile, cgroup_memory_limit_mb, device_profile, node_config_int
from client.resident import task_started
from experiment.config import RunConfig
from experiment.protocol import (
    ARRAYS,
    CATALOG,
    CONFIG,
    LAYERS,
    NUM_EXAMPLES,
    PROFILE,
    STARTUP_SECONDS,
    TRAIN_LOSS,
    TRAIN_SECONDS,
    CatalogOffer,
    Instruction,
    ProfileReply,
    evaluate_reply,
    record_of,
    train_reply,
)
from experiment.registry import ClientRole
from models.catalog import Variant, choose_variant
from models.data import DataSpec, load_partition
from models.family import ModelFamily
from models.training import evaluate_classifier, logits_and_loss, model_device, train_classifier, use_threads

#: every message passes :func:`client.held.held_arrays_mod` first (arrays the node holds are not re-sent)
app = ClientApp(mods=[held_arrays_mod])


@lru_cache(maxsize=4)
def _config(items: tuple[tuple[str, object], ...]) -> RunConfig:
    return RunConfig.from_flower(dict(items))


def run_config(context: Context) -> RunConfig:
    """Validated run configuration (cached per process); applies ``client-threads``."""
    cfg = _config(tuple(sorted(context.run_config.items())))
    use_threads(cfg.client_threads)
    return cfg


def profile_of(context: Context, cfg: RunConfig) -> DeviceProfile:
    """This node's device profile (see :mod:`client.profile`)."""
    return device_profile(
        context.node_config,
        tiers=cfg.tier_names,
        proportions=cfg.proportions,
        budgets=cfg.memory_budgets,
        seed=cfg.seed,
        cgroup_limit_mb=cgroup_memory_limit_mb(),
    )


def _partition_ids(context: Context) -> tuple[int, int]:
    nc = context.node_config
    if "partition-id" not in nc or "num-partitions" not in nc:
        raise ValueError("node config needs partition-id and num-partitions to load local data")
    return node_config_int(nc, "partition-id"), node_config_int(nc, "num-partitions")


@lru_cache(maxsize=8)
def _partition(spec: DataSpec, pid: int, num: int) -> tuple[Dataset, Dataset]:
    return load_partition(spec, pid, num)


@lru_cache(maxsize=16)
def _loader(
    spec: DataSpec, family: ModelFamily, pid: int, num: int, train: bool, batch: int, domain: str
) -> DataLoader:
    train_ds, test_ds = _partition(spec, pid, num)
    if train:
        return family.loader(train_ds, batch_size=batch, shuffle=True, seed=spec.seed + pid, domain=domain)
    return family.loader(test_ds, batch_size=batch, shuffle=False, domain=domain)


def _where(context: Context, cfg: RunConfig) -> tuple[int, int, str]:
    """This node's partition id, partition count and input domain (``tier-domains``; else ``plain``)."""
    pid, num = _partition_ids(context)
    domain = cfg.tier_domain(profile_of(context, cfg).tier) if cfg.tier_domains else "plain"
    return pid, num, domain


def num_train_examples(context: Context, cfg: RunConfig) -> int:
    """Size of this node's training split (no tokenizing or decoding)."""
    pid, num = _partition_ids(context)
    return len(_partition(cfg.data_spec(), pid, num)[0])


def train_loader(context: Context, cfg: RunConfig) -> DataLoader:
    """This node's shuffled training batches (built on first use; cached per process)."""
    pid, num, domain = _where(context, cfg)
    return _loader(cfg.data_spec(), cfg.family(), pid, num, True, cfg.batch_size, domain)


def seeded_train_loader(context: Context, cfg: RunConfig, seed: int) -> DataLoader:
    """:func:`train_loader` with its shuffling generator set to ``seed`` (:func:`train_seed`).

    The loader is cached per process; reseeding makes the batches it yields next a function of
    the run seed, the node and the round, not of what this process served before.
    """
    loader = train_loader(context, cfg)
    if loader.generator is not None:
        loader.generator.manual_seed(seed)
    return loader


def test_loader(context: Context, cfg: RunConfig) -> DataLoader:
    """This node's test batches (built on first use; cached per process).

    Each split is prepared only when a handler needs it: Flower runs every message in a new
    ClientApp process in a deployment, so a ``query`` tokenizes nothing, a ``train`` only the
    training split and a text model's ``evaluate`` only the test split.
    """
    pid, num, domain = _where(context, cfg)
    return _loader(cfg.data_spec(), cfg.family(), pid, num, False, cfg.eval_batch_size, domain)


def _model_for(msg: Message, cfg: RunConfig, instruction: Instruction) -> tuple[nn.Module, Variant]:
    """Rebuild the variant the message names, load the sent weights, move it to ``device``."""
    variant = cfg.catalog.get(instruction.variant)
    model = cfg.family().build(variant)
    state = record_of(msg.content, ARRAYS, ArrayRecord).to_torch_state_dict()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k in set(variant.layout.names())]
    if missing or unexpected:
        raise ValueError(
            f"weights for {variant.name!r} do not match: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    return model.to(cfg.torch_device()), variant


def node_key(context: Context) -> str:
    """Identity of this node that survives restarts: ``partition-<id>`` when the node config has one.

    Simulation gives nodes new random ids in every run; the server matches per-node state of a
    resumed run to nodes by this key (empty: the server falls back to the node id).
    """
    pid = context.node_config.get("partition-id")
    return "" if pid is None else f"partition-{pid}"


def train_seed(seed: int, context: Context, server_round: int) -> int:
    """Seed of one local training run: ``seed + 1_000_003 * round + k`` (``k``: partition id, else node id).

    Training is a function of the run seed, the node's stable identity and the round, not of
    how many rounds this process served before -- so a resumed run trains exactly as an
    uninterrupted one (given the same weights).
    """
    pid = context.node_config.get("partition-id")
    k = int(pid) if isinstance(pid, int | float | str) else context.node_id % 100_000
    return (seed + 1_000_003 * server_round + k) % (2**63)


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Report the device profile and the variant this node can train."""
    cfg = run_config(context)
    offer = CatalogOffer.from_record(record_of(msg.content, CATALOG, ConfigRecord))
    profile = profile_of(context, cfg)
    if offer.ignore_memory:
        chosen: str | None = offer.variant_names[-1]
        reason = "server asked every node to train the largest variant (memory ignored)"
    else:
        chosen, reason = choose_variant(offer.memory_by_name(), profile.memory_mb, cfg.runtime_overhead_mb)
    try:
        n_train = num_train_examples(context, cfg)
    except ValueError as exc:
        chosen, reason, n_train = None, f"no local data: {exc}", 0
    log(
        INFO if chosen else WARNING,
        "tier %s (%s, %.0f MiB): %s",
        profile.tier,
        profile.source,
        profile.memory_mb,
        reason,
    )
    reply = ProfileReply(
        tier=profile.tier,
        memory_mb=float(profile.memory_mb),
        memory_source=profile.source,
        num_examples=int(n_train),
        labeled=profile.labeled,
        variant=chosen or "",
        reason=reason,
        node_key=node_key(context),
    )
    return Message(RecordDict({PROFILE: reply.to_record()}), reply_to=msg)


def in_simulation_actor() -> bool:
    """Whether this ClientApp runs inside a Ray simulation actor (issue 23 item 3).

    A Ray actor serves many messages in one long-lived process, so its age says nothing about a
    message's start-up cost (it grows from seconds to minutes over a run): it is not reported
    there. A deployment's ClientApp is a fresh (or forked) process per message.
    """
    ray = sys.modules.get("ray")
    return ray is not None and bool(ray.is_initialized())


def startup_seconds() -> float | None:
    """Seconds from the message's task start to now; ``None`` in a simulation actor.

    In a resident ClientApp worker (:mod:`client.resident`) since it took the task, else
    :func:`process_age` (a one-shot process starts with its task).
    """
    if in_simulation_actor():
        return None
    started = task_started()
    return process_age() if started is None else max(0.0, time.monotonic() - started)


def _age_note(startup: float | None) -> str:
    return "simulation actor" if startup is None else f"process age at start {startup:.2f} s"


def process_age() -> float:
    """Seconds since this process started (for a forked ClientApp: since its fork).

    Linux ``/proc/self/stat`` field 22 (start time in clock ticks after boot) against
    ``/proc/uptime``; resolution one clock tick; ``0.0`` where ``/proc`` is unavailable.
    """
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


@dataclass(frozen=True)
class TrainTask:
    """A train message as the behaviours get it: the run config, the instruction, the seed, the clocks.

    ``started`` (``time.perf_counter()``) and ``startup`` (:func:`startup_seconds`) are read first
    thing in the handler, so ``train-seconds`` covers the whole handler and ``startup-seconds`` the
    process's age when it began.
    """

    cfg: RunConfig
    instruction: Instruction
    seed: int
    started: float
    startup: float | None


def supervised_train(msg: Message, context: Context, task: TrainTask) -> Message:
    """Train the received variant on this node's labeled data; reply with its trainable weights."""
    cfg, instruction, seed, started, startup = task.cfg, task.instruction, task.seed, task.started, task.startup
    model, variant = _model_for(msg, cfg, instruction)
    loader, n_train = seeded_train_loader(context, cfg, seed), num_train_examples(context, cfg)
    local_loss = cfg.entry.local_loss  # a method's own loss (DepthFL's exits), else the cross-entropy
    config = record_of(msg.content, CONFIG, ConfigRecord)
    loss_fn = logits_and_loss if local_loss is None else local_loss(cfg, config)
    loss = train_classifier(model, loader, cfg.train_settings(), loss_fn=loss_fn)
    upload = {k: v.detach() for k, v in model.named_parameters() if v.requires_grad}
    metrics = {
        NUM_EXAMPLES: n_train,
        TRAIN_LOSS: loss,
        LAYERS: variant.depth,
        TRAIN_SECONDS: time.perf_counter() - started,
    }
    if startup is not None:
        metrics[STARTUP_SECONDS] = startup
    content = train_reply(ArrayRecord(upload), metrics, instruction)
    log(INFO, "trained %s on %d examples on %s, loss %.4f (%s, handler %.2f s)", variant.name, n_train,
        model_device(model), loss, _age_note(startup), time.perf_counter() - started)  # fmt: skip
    return Message(content, reply_to=msg)


def unlabeled_pruning_train(msg: Message, context: Context, task: TrainTask) -> Message:
    """The client round of pFedKnow on unlabeled data: pseudo-labels, pruning, sparse upload (client/pfedknow.py)."""
    cfg = task.cfg
    light = cfg.catalog.get(task.instruction.variant)
    shapes = {p.name: tuple(p.shape) for p in light.layout}
    return pfedknow_train(
        msg, cfg.family().build(light), shapes, cfg.data_spec(), _partition_ids(context),
        settings=cfg.train_settings(), batch_size=cfg.batch_size, seed=task.seed, family=cfg.family(),
    )  # fmt: skip


#: What a ClientApp does with a train message, by its method's registry fact ``client``
#: (:data:`experiment.registry.ClientRole`); a method adds a behaviour here, never a branch on its name.
TRAIN_BEHAVIOURS: Mapping[ClientRole, Callable[[Message, Context, TrainTask], Message]] = {
    "supervised": supervised_train,
    "unlabeled-pruning": unlabeled_pruning_train,
}


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Train locally as the method's client behaviour says (:data:`TRAIN_BEHAVIOURS`).

    The reply's ``train-seconds`` (wall time of the handler: rebuild, data, training) and
    ``startup-seconds`` (age of this ClientApp process when the handler began: its start or
    fork, imports, pulling the message, installing the FAB) let a round's time be split into
    training and fixed overhead.
    """
    started = time.perf_counter()
    startup = startup_seconds()
    cfg = run_config(context)
    instruction = Instruction.from_content(msg.content)
    seed = train_seed(cfg.seed, context, instruction.server_round)
    torch.manual_seed(seed)
    return TRAIN_BEHAVIOURS[cfg.entry.client](msg, context, TrainTask(cfg, instruction, seed, started, startup))


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Evaluate the received variant on this node's local test split.

    Families with data-dependent normalization (the CNNs' static batch norm) first
    recompute its statistics on this node's training data (HeteroFL's sBN, per client), on the
    batches that start the round's training order (:func:`train_seed`): the result is a function
    of the run seed, the node and the round, not of which nodes this process served before.
    """
    started, startup = time.perf_counter(), startup_seconds()
    cfg = run_config(context)
    instruction = Instruction.from_content(msg.content)
    model, _ = _model_for(msg, cfg, instruction)
    family = cfg.family()
    seed = train_seed(cfg.seed, context, instruction.server_round)
    stats = seeded_train_loader(context, cfg, seed) if family.uses_statistics else None
    loss, acc, n = evaluate_classifier(family.for_evaluation(model, stats), test_loader(context, cfg))
    if n == 0:
        raise ValueError("this node has no local test examples")
    content = evaluate_reply(n, loss, acc, instruction)
    log(INFO, "evaluated on %d examples on %s (%s, handler %.2f s)",
        n, model_device(model), _age_note(startup), time.perf_counter() - started)  # fmt: skip
    return Message(content, reply_to=msg)
