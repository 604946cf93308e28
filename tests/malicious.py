"""A hostile ClientApp and a checking ServerApp, for the chaos suite only (issue 22, item 4).

Nothing here is part of the product: the apps exist only in a test FAB (:func:`build_test_fab`,
a copy of the project whose ``pyproject.toml`` names the two apps below), which
``tests/test_chaos.py`` submits to its real deployment.

* :data:`client_app` is the project's ClientApp (same handlers, same mods) with one more mod,
  :func:`corrupting_mod`: on the node of partition :data:`HOSTILE_PARTITION` it answers round
  1's ``train`` honestly (and keeps that reply), and from round 2 on replaces each ``train``
  reply with the next kind of bad reply of :data:`SCHEDULE` (one kind per round).  Every other
  node, and every ``query`` and ``evaluate``, is the project's ClientApp unchanged.
* :data:`server_app` is the project's ServerApp whose strategy re-aggregates every round a
  second time, in the same run: a copy of the strategy taken before the round aggregates the
  round's replies *without* the hostile node's, and the two resulting states must be bit for bit
  the same.  Each round's comparison is appended to ``<results>/<run>/reaggregation.jsonl``.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import subprocess
from collections.abc import Callable, Iterable, Mapping
from logging import INFO
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.common import log
from flwr.serverapp import Grid, ServerApp

import client.app as project_client
import server.app as project_server
from client.held import held_arrays_mod
from experiment.config import RunConfig
from experiment.protocol import ARRAYS, CONFIG, METRICS, NUM_EXAMPLES, SERVER_ROUND, VARIANT, Instruction
from strategies.base import HeterogeneousStrategy
from strategies.records import ArrayCache

#: The node that misbehaves (its ``partition-id``); its stable key is ``partition-<id>``.
HOSTILE_PARTITION = 1
#: Bytes of the oversized payload's one tensor (the tiny variants' whole replies are ~0.1-0.3 MB).
OVERSIZED_BYTES = 32 * 2**20
#: Where the hostile node keeps its honest round-1 reply (``Context.state``, kept across messages).
REPLAY_KEY = "hostile-replay"
#: The file the checking ServerApp writes a line per round to.
REAGGREGATION_FILE = "reaggregation.jsonl"

ROOT = Path(__file__).resolve().parent.parent


# --- the hostile ClientApp -----------------------------------------------------------------------
def _arrays(content: RecordDict) -> dict[str, np.ndarray]:
    record = content[ARRAYS]
    if not isinstance(record, ArrayRecord):
        raise TypeError(f"{ARRAYS!r} is not an ArrayRecord")
    return {name: array.numpy() for name, array in record.items()}


def _with(content: RecordDict, *, arrays: Mapping[str, np.ndarray] | None = None,
          metrics: Mapping[str, Any] | None = None, echo: Mapping[str, Any] | None = None) -> RecordDict:  # fmt: skip
    """``content`` with its arrays, metrics or echo replaced (the rest kept)."""
    out = RecordDict(dict(content.items()))
    if arrays is not None:
        out[ARRAYS] = ArrayRecord({name: Array(np.ascontiguousarray(a)) for name, a in arrays.items()})
    if metrics is not None:
        out[METRICS] = MetricRecord(dict(metrics))
    if echo is not None:
        out[CONFIG] = ConfigRecord(dict(echo))
    return out


def _first_float(arrays: Mapping[str, np.ndarray]) -> str:
    return next(name for name, a in arrays.items() if a.dtype == np.float32 and a.size > 1)


def wrong_keys(content: RecordDict, context: Context, instruction: Instruction) -> RecordDict:
    """One tensor left out, one that no layout has added."""
    arrays = _arrays(content)
    arrays.pop(_first_float(arrays))
    arrays["encoder.backdoor.weight"] = np.zeros(4, np.float32)
    return _with(content, arrays=arrays)


def wrong_shape(content: RecordDict, context: Context, instruction: Instruction) -> RecordDict:
    """One tensor with its first dimension one shorter (same dtype, fewer bytes)."""
    arrays = _arrays(content)
    name = _first_float(arrays)
    arrays[name] = arrays[name].reshape(-1)[:-1]
    return _with(content, arrays=arrays)


def wrong_dtype(content: RecordDict, context: Context, instruction: Instruction) -> RecordDict:
    """One tensor as float16 (same shape)."""
    arrays = _arrays(content)
    name = _first_float(arrays)
    arrays[name] = arrays[name].astype(np.float16)
    return _with(content, arrays=arrays)


def non_finite(content: RecordDict, context: Context, instruction: Instruction) -> RecordDict:
    """A NaN in one tensor and an Inf in another."""
    arrays = {name: a.copy() for name, a in _arrays(content).items()}
    floats = [name for name, a in arrays.items() if a.dtype == np.float32]
    arrays[floats[0]].reshape(-1)[0] = np.nan
    arrays[floats[-1]].reshape(-1)[-1] = np.inf
    return _with(content, arrays=arrays)


def oversized(content: RecordDict, context: Context, instruction: Instruction) -> RecordDict:
    """One tensor replaced by :data:`OVERSIZED_BYTES` of float32 (same key, another shape)."""
    arrays = _arrays(content)
    arrays[_first_float(arrays)] = np.ones(OVERSIZED_BYTES // 4, np.float32)
    return _with(content, arrays=arrays)


def variant_not_sent(content: RecordDict, context: Context, instruction: Instruction) -> RecordDict:
    """A consistent reply for another variant: its freshly built trainable weights, its name echoed."""
    cfg = project_client.run_config(context)
    other = next(v for v in reversed(list(cfg.catalog)) if v.name != instruction.variant)
    model = cfg.family().build(other)
    arrays = {k: v.detach().numpy() for k, v in model.named_parameters() if v.requires_grad}
    echo = {VARIANT: other.name, SERVER_ROUND: instruction.server_round}
    return _with(content, arrays=arrays, echo=echo)


def stale_round(content: RecordDict, context: Context, instruction: Instruction) -> RecordDict:
    """The honest weights, but the echo says the previous round."""
    return _with(content, echo={VARIANT: instruction.variant, SERVER_ROUND: instruction.server_round - 1})


def inflated_examples(content: RecordDict, context: Context, instruction: Instruction) -> RecordDict:
    """The honest weights claiming 50 times the node's examples (its weight in every mean)."""
    metrics = content[METRICS]
    if not isinstance(metrics, MetricRecord):
        raise TypeError(f"{METRICS!r} is not a MetricRecord")
    claimed = dict(metrics.items())
    honest = claimed[NUM_EXAMPLES]
    if not isinstance(honest, int | float):
        raise TypeError(f"{NUM_EXAMPLES!r} is not a number")
    claimed[NUM_EXAMPLES] = int(honest) * 50
    return _with(content, metrics=claimed)


def replay(content: RecordDict, context: Context, instruction: Instruction) -> RecordDict:
    """The node's accepted round-1 weights again, echoing this round (a well-formed stale update)."""
    kept = context.state[REPLAY_KEY]
    if not isinstance(kept, ArrayRecord):
        raise TypeError("no round-1 reply kept for the replay")
    return _with(content, arrays={name: a.numpy() for name, a in kept.items()})


Corruption = Callable[[RecordDict, Context, Instruction], RecordDict]

#: Round -> the bad reply the hostile node sends (round 1 is honest; the replay needs it).
SCHEDULE: dict[int, tuple[str, Corruption]] = {
    2: ("wrong keys", wrong_keys),
    3: ("wrong shape", wrong_shape),
    4: ("wrong dtype", wrong_dtype),
    5: ("NaN and Inf", non_finite),
    6: ("oversized payload", oversized),
    7: ("variant not sent", variant_not_sent),
    8: ("stale round", stale_round),
    9: ("inflated example count", inflated_examples),
    10: ("replay of round 1", replay),
}


def corrupting_mod(msg: Message, context: Context, call_next: Callable[[Message, Context], Message]) -> Message:
    """On the hostile node, turn round ``r``'s ``train`` reply into :data:`SCHEDULE`'s kind ``r``."""
    reply = call_next(msg, context)
    hostile = context.node_config.get("partition-id") == HOSTILE_PARTITION
    if not hostile or msg.metadata.message_type != "train" or reply.has_error():
        return reply
    instruction = Instruction.from_content(msg.content)
    kind = SCHEDULE.get(instruction.server_round)
    if kind is None:
        if instruction.server_round == 1:
            arrays = reply.content[ARRAYS]
            if isinstance(arrays, ArrayRecord):
                context.state[REPLAY_KEY] = ArrayRecord({k: Array(a.numpy().copy()) for k, a in arrays.items()})
        return reply
    name, corrupt = kind
    log(INFO, "hostile node: round %d sends a bad reply: %s", instruction.server_round, name)
    return Message(corrupt(reply.content, context, instruction), reply_to=msg)


client_app = ClientApp(mods=[held_arrays_mod, corrupting_mod])
client_app.query()(project_client.query)
client_app.train()(project_client.train)
client_app.evaluate()(project_client.evaluate)


# --- the checking ServerApp ------------------------------------------------------------------------
def tensors_of(state: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Every tensor and plain value in a nested checkpoint state, keyed by its path."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        path = f"{prefix}/{key}"
        if isinstance(value, Mapping):
            out |= tensors_of(value, path)
        else:
            out[path] = value
    return out


def state_differences(a: Mapping[str, Any], b: Mapping[str, Any]) -> list[str]:
    """Paths where two :meth:`HeterogeneousStrategy.checkpoint_state` results differ (tensors bit for bit)."""
    flat_a, flat_b = tensors_of(a), tensors_of(b)
    if flat_a.keys() != flat_b.keys():
        return sorted(flat_a.keys() ^ flat_b.keys())
    out = []
    for path, x in flat_a.items():
        y = flat_b[path]
        if isinstance(x, torch.Tensor):
            same = isinstance(y, torch.Tensor) and x.dtype == y.dtype and torch.equal(x.view(-1), y.view(-1))
        else:
            same = x == y
        if not same:
            out.append(path)
    return out


def shadow_copy(strategy: HeterogeneousStrategy) -> tuple[HeterogeneousStrategy, list[str]]:
    """A copy of ``strategy`` whose aggregation cannot touch the original; the attributes it shares.

    Every attribute is deep-copied (one memo, so shared references stay shared); one that cannot
    be (Flower messages over ``memoryview`` payloads: the messages sent this round, which
    aggregation only reads) is shared, and the copy gets a cache of serialized arrays of its own.
    """
    shadow = copy.copy(strategy)
    memo: dict[int, Any] = {}
    shared = []
    for name, value in vars(strategy).items():
        try:
            shadow.__dict__[name] = copy.deepcopy(value, memo)
        except TypeError:
            shadow.__dict__[name] = value
            shared.append(name)
    shadow.__dict__["_arrays"] = ArrayCache()
    shadow.__dict__.pop("aggregate_train", None)  # the check's wrapper; the copy aggregates plainly
    return shadow, shared


def check_reaggregation(strategy: HeterogeneousStrategy, out: Path, hostile_key: str) -> None:
    """Make ``strategy`` re-aggregate each round without ``hostile_key``'s replies and log the comparison."""
    live = strategy.aggregate_train

    def aggregate_train(server_round: int, replies: Iterable[Message]) -> Any:
        replies = list(replies)
        shadow, shared = shadow_copy(strategy)  # the state before this round's aggregation
        result = live(server_round, replies)
        hostile = {n for n, p in strategy.profiles.items() if p.stable_key == hostile_key}
        others = [r for r in replies if r.metadata.src_node_id not in hostile]
        flower_log = logging.getLogger("flwr")
        level = flower_log.level
        flower_log.setLevel(logging.ERROR)  # the copy's log (e.g. the left-out reply as missing) is not the run's
        try:
            shadow.aggregate_train(server_round, others)
        finally:
            flower_log.setLevel(level)
        keep = ("state", "method")
        live_state = {k: v for k, v in strategy.checkpoint_state().items() if k in keep}
        shadow_state = {k: v for k, v in shadow.checkpoint_state().items() if k in keep}
        report = strategy.report(strategy.global_round(server_round))
        differences = state_differences(live_state, shadow_state)
        row = {
            "round": strategy.global_round(server_round),
            "replies": len(replies),
            "hostile-replies": len(replies) - len(others),
            "rejected": list(report.rejected),
            "failed": list(report.failed),
            "differences": differences,
            "shared": shared,
            "tensors": sum(isinstance(v, torch.Tensor) for v in tensors_of(live_state).values()),
        }
        with out.open("a") as f:
            f.write(json.dumps(row) + "\n")
        log(INFO, "re-aggregated round %d without %s: %d differences", row["round"], hostile_key,
            len(differences))  # fmt: skip
        return result

    strategy.aggregate_train = aggregate_train  # type: ignore[method-assign]


server_app = ServerApp()


@server_app.main()
def main(grid: Grid, context: Context) -> None:
    """The project's ServerApp, with :func:`check_reaggregation` on its strategy."""
    cfg = RunConfig.from_flower(context.run_config)
    out = project_server.results_folder(cfg) / REAGGREGATION_FILE
    build = project_server.build_strategy

    def build_checked(cfg: RunConfig) -> HeterogeneousStrategy:
        strategy = build(cfg)
        check_reaggregation(strategy, out, f"partition-{HOSTILE_PARTITION}")
        return strategy

    project_server.build_strategy = build_checked
    try:
        project_server.main(grid, context)
    finally:
        project_server.build_strategy = build


# --- the test FAB ------------------------------------------------------------------------------------
def build_test_fab(dest: Path) -> Path:
    """A copy of the project (its tracked files and new ones not ignored) naming the two apps above.

    Its ``pyproject.toml`` names the apps of this module; ``flwr run DEST`` then builds and
    submits a FAB of the same code with them.
    """
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout
    if dest.exists():
        shutil.rmtree(dest)
    for name in filter(None, files.decode().split("\0")):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    pyproject = dest / "pyproject.toml"
    text = pyproject.read_text()
    for app, target in (("serverapp", "tests.malicious:server_app"), ("clientapp", "tests.malicious:client_app")):
        old = f'{app} = "{"server.app:app" if app == "serverapp" else "client.app:app"}"'
        if old not in text:
            raise ValueError(f"pyproject.toml has no {old!r} to replace")
        text = text.replace(old, f'{app} = "{target}"')
    pyproject.write_text(text)
    return dest
