"""pFedKnow rounds in one process: the real strategy and client round, without the Flower transport.

Usage: ``python -m bench.pfedknow_inprocess CONFIG.toml METHOD [METHOD ...] [--clients N]
[--set KEY=VALUE ...]`` (e.g. ``deploy/configs/pfedknow-iid.toml pfedknow pfedknow-as1 pfedknow-as2
pfedknow-as3 pfedknow-as4``; text: ``deploy/configs/pfedknow-text.toml pfedknow pfedknow-as1
--clients 4``).  ``--clients`` is the number of partitions (default 10), ``--set`` overrides a run
config key (TOML value syntax).  Every client of the partitioning is a node; each round the strategy samples, encodes
its messages, every sampled client runs :func:`client.pfedknow.pfedknow_round` on its unlabeled
partition, and the replies (Flower ``RecordDict`` contents; only the message envelope is a stand-in)
go through the strategy's real validation and aggregation.  After every round each client's
personalized model is evaluated on the client's local test split.  Prints one JSON line per
method and round (mean accuracy over all clients, split as the strategy's federated metric is by
:func:`strategies.pfedknow.personalization_split` into clients evaluated on their own model --
``fed-accuracy-personalized`` -- and clients still on the server's initial model ``w_s'`` --
``fed-accuracy-initial``; upload saving, pseudo-labels kept, ...; round 0 is ``w_s'``, with the
teacher's accuracy on the same test data as ``teacher-accuracy`` where the method has one), then a
``RESULT`` line per method.  Used for the README's pFedKnow table when the Ray simulation was
not available; ``python -m deploy.experiments pfedknow-table3`` runs the same comparison in Flower.
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from typing import Any
from unittest.mock import Mock

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from client.pfedknow import local_unlabeled, pfedknow_round
from experiment.config import RunConfig
from models.batches import batch_size_of
from models.data import load_partition
from models.training import evaluate_classifier
from server.app import build_strategy
from strategies.pfedknow import PFedKnow, personalization_split
from strategies.profiles import NodeProfile

TaskIdentity._run_id = 1  # type: ignore[attr-defined]
TaskIdentity._node_id = 0  # type: ignore[attr-defined]
TaskIdentity._task_id = 1  # type: ignore[attr-defined]


def run(path: str, method: str, num_clients: int = 10, overrides: dict[str, Any] | None = None) -> dict[str, object]:
    """Run ``method`` with the settings of ``path`` (and ``overrides``); return its per-round rows."""
    with open(path, "rb") as f:
        table = tomllib.load(f)
    cfg = RunConfig.from_flower({**table, **(overrides or {}), "method": method})
    family = cfg.family()
    variant = cfg.catalog.largest
    shapes = {p.name: tuple(p.shape) for p in variant.layout}
    spec = cfg.data_spec()
    s = build_strategy(cfg)
    if not isinstance(s, PFedKnow):
        raise SystemExit(f"{method!r} is not a pFedKnow method")
    torch.manual_seed(cfg.seed)
    init = family.initial_states(cfg.catalog, seed=cfg.seed)
    s.set_state({variant.name: init[variant.name]})
    loaders = {}
    for pid in range(num_clients):
        train, test = load_partition(spec, pid, num_clients)
        loaders[pid] = (
            family.loader(train, batch_size=cfg.batch_size, shuffle=True, seed=spec.seed + pid),
            family.loader(test, batch_size=cfg.eval_batch_size, shuffle=False),
        )
        s.profiles[pid + 1] = NodeProfile(
            pid + 1, "iot", 1000.0, len(train), False, variant.name, "", key=f"partition-{pid}"
        )
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for r in range(1, cfg.num_server_rounds + 1):
        if not s.initialized:
            s.initialize(r)
            accs0 = []
            for pid in range(num_clients):
                model = family.build(variant)
                model.load_state_dict(dict(s.client_model(f"partition-{pid}")), strict=False)
                _, acc0, _ = evaluate_classifier(family.for_evaluation(model, loaders[pid][0]), loaders[pid][1])
                accs0.append(acc0)
            rows.append({"round": 0, "acc-mean": float(np.mean(accs0))})
            teacher = s.teacher()
            if teacher is not None:  # what the teacher knows: its accuracy on the same test data
                rows[0]["teacher-accuracy"] = float(
                    np.mean([evaluate_classifier(teacher, loaders[pid][1])[1] for pid in range(num_clients)])
                )
            print(json.dumps({"method": method, **rows[0]}), flush=True)
        s.prepare_round(r)
        nodes = s._sample(sorted(s.profiles), cfg.fraction_train, cfg.min_train_nodes)
        s._sent_train = s._messages(nodes, r, ConfigRecord(), MessageType.TRAIN)
        replies = []
        for i, rec in enumerate(s._sent_train.values()):
            rec.message.metadata.__dict__["_message_id"] = f"r{r}-{i}"
            pid = rec.node_id - 1
            arrays = rec.message.content.array_records["arrays"]
            cfgrec = rec.message.content.config_records["config"]
            payload = {k: np.asarray(a.numpy()) for k, a in arrays.items()}
            seed = (cfg.seed + 1_000_003 * r + pid) % (2**63)
            torch.manual_seed(seed)
            x = local_unlabeled(spec, pid, num_clients, family)
            upload, metrics = pfedknow_round(
                family.build(variant),
                payload,
                shapes,
                x,
                cfgrec,
                settings=cfg.train_settings(),
                batch_size=cfg.batch_size,
                seed=seed,
            )
            m = Mock(spec=Message)
            m.content = RecordDict(
                {
                    "arrays": ArrayRecord({k: Array(v) for k, v in upload.items()}),
                    "metrics": MetricRecord({"num-examples": batch_size_of(x), **metrics}),
                    "config": ConfigRecord({"variant": cfgrec["variant"], "server-round": r}),
                }
            )
            m.metadata = Mock(reply_to_message_id=f"r{r}-{i}", src_node_id=rec.node_id)
            m.has_error.return_value = False
            replies.append(m)
        s.aggregate_train(r, replies)
        accs = []
        for pid in range(num_clients):
            model = family.build(variant)
            model.load_state_dict(dict(s.client_model(f"partition-{pid}")), strict=False)
            train_loader, test_loader = loaders[pid]
            _, acc, _ = evaluate_classifier(family.for_evaluation(model, train_loader), test_loader)
            accs.append(acc)
        g = s.report(r).groups[variant.name]
        rows.append(
            {
                "round": r,
                "acc-mean": float(np.mean(accs)),
                **personalization_split(
                    {f"partition-{pid}": acc for pid, acc in enumerate(accs)}, s.personalized_keys()
                ),
                "upload-saving": g.get("upload-saving"),
                "payload-saving": g.get("payload-saving"),
                "bytes-up": g.get("bytes-up"),
                "bytes-up-dense": g.get("bytes-up-dense"),
                "pseudo-kept": g.get("pseudo-kept"),
                "kept-weights": g.get("kept-weights"),
                "prune-ratio": g.get("prune-ratio"),
                "rejected": len(s.report(r).rejected),
                "server-seconds": g.get("server-seconds"),
                "elapsed": round(time.time() - t0, 1),
            }
        )
        print(json.dumps({"method": method, **rows[-1]}), flush=True)
    return {"method": method, "config": path, "clients": num_clients, "overrides": overrides or {}, "rows": rows}


def parse_override(item: str) -> tuple[str, Any]:
    """``KEY=VALUE`` with a TOML value (``lr=1e-4``, ``tiers='iot'``)."""
    key, sep, value = item.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {item!r}")
    return key.strip(), tomllib.loads(f"v = {value}")["v"]


def main() -> None:
    """Command line: ``CONFIG.toml METHOD [METHOD ...] [--clients N] [--set KEY=VALUE ...]``."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("config")
    p.add_argument("methods", nargs="+")
    p.add_argument("--clients", type=int, default=10, help="number of partitions / nodes")
    p.add_argument("--set", type=parse_override, action="append", default=[], help="KEY=VALUE run-config override")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    for method in args.methods:
        out = run(args.config, method, args.clients, dict(args.set))
        print("RESULT", json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
